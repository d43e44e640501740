"""The training loop. Every step: 1 - rollout, 2 - advantage, 3 - update, 4 - log / evaluate / save.

    python train.py --task cartpole --algo reinforce          # solves CartPole-v1 in seconds
    python train.py --config configs/cartpole_ppo.yaml        # a preset; flags override it
    python train.py --resume runs/cartpole-reinforce-<time>   # continue a run exactly where it stopped
"""
import time

T0 = time.time()  # "solved after T s" counts the imports too

import math
import os

import torch

import config as config_lib
from algos import ADVANTAGES, loss_weights, pg_loss, value_loss
from model import MLPPolicy
from tasks import TASKS
from utils import Logger, load_checkpoint, save_checkpoint, seed_all


def build(cfg):
    if cfg.task not in TASKS:
        raise SystemExit(f"config error: task {cfg.task!r} is unknown; pick one of {', '.join(TASKS)}")
    task = TASKS[cfg.task](cfg)
    policy = MLPPolicy(task.obs_dim, task.n_actions, cfg.hidden, critic=cfg.algo == "ppo")
    return task, policy


def chunks(n, size):
    """Row indices 0..n-1 in pieces of at most `size` (0 = one piece)."""
    return torch.arange(n).split(size or n)


def score_old(policy, batch, cfg):
    """No-grad pass that fixes what the update compares against: old_logp before the first of several
    updates, and the old critic's values (ppo). With one update per batch and no critic it is skipped:
    the update's own forward pass provides old_logp (the ratio is then exactly 1)."""
    if cfg.epochs * cfg.minibatches == 1 and cfg.algo != "ppo":
        return
    with torch.no_grad():
        outs = [policy.score(batch.rows(i)) for i in chunks(len(batch.mask), cfg.micro_batch)]
    batch.old_logp = torch.cat([o["logp"] for o in outs])  # [N, T]
    if outs[0]["value"] is not None:
        batch.values = torch.cat([o["value"] for o in outs]) * batch.mask  # [N, T]


def update(policy, opt, batch, cfg, max_len):
    """epochs x minibatches optimizer steps. Each minibatch is split into micro-batches whose losses add
    up to the minibatch loss (loss_weights uses the minibatch's global denominators), so micro_batch
    never changes the gradient. A non-finite loss or gradient skips that optimizer step untouched."""
    sums, losses, skipped, norms = {}, [], 0, []
    params = [p for p in policy.parameters() if p.requires_grad]
    for _ in range(cfg.epochs):
        order = torch.randperm(len(batch.mask)) if cfg.minibatches > 1 else torch.arange(len(batch.mask))
        for rows in order.chunk(cfg.minibatches):
            mb = batch.rows(rows)
            mb.weight = loss_weights(mb.mask, cfg, max_len)  # [n, T]
            total = 0.0
            for idx in chunks(len(rows), cfg.micro_batch):
                micro = mb.rows(idx)
                out = policy.score(micro)
                old = micro.old_logp if micro.old_logp is not None else out["logp"].detach()
                loss, stats = pg_loss(out["logp"], old, micro.adv, micro.mask, cfg, micro.weight,
                                      out["entropy"], micro.ref_logp, micro.sampler_logp)
                if out["value"] is not None:
                    loss = loss + cfg.vf_coef * value_loss(out["value"], micro.values, micro.returns,
                                                           micro.weight, cfg)
                total += loss.item()
                if not math.isfinite(total):
                    break
                loss.backward()
                for k, v in stats.items():
                    sums[k] = torch.maximum(sums[k], v) if k.endswith("_max") and k in sums else sums.get(k, 0) + v
            norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm or math.inf)
            if math.isfinite(total) and torch.isfinite(norm):
                opt.step()
                losses.append(total)
                norms.append(norm.item())
            else:
                skipped += 1
            opt.zero_grad(set_to_none=True)
    n = sums.pop("tokens", torch.tensor(1.0)).clamp(min=1)
    out = {k: (v if k.endswith("_max") else v / n).item() for k, v in sums.items()}
    return {"loss": sum(losses) / max(len(losses), 1), "grad_norm": sum(norms) / max(len(norms), 1),
            "nonfinite": skipped, **out}


def main(argv=None):
    cfg = config_lib.parse(argv)
    cfg.out = cfg.resume or cfg.out or f"runs/{cfg.task}-{cfg.algo}-{time.strftime('%Y%m%d-%H%M%S')}"
    os.makedirs(cfg.out, exist_ok=True)
    config_lib.save(cfg, os.path.join(cfg.out, "config.yaml"))
    ckpt_path = os.path.join(cfg.out, "checkpoint.safetensors")
    seed_all(cfg.seed)
    task, policy = build(cfg)
    opt = torch.optim.Adam([p for p in policy.parameters() if p.requires_grad], lr=cfg.lr)
    start, t_offset = 0, 0.0
    if cfg.resume:
        params, meta = load_checkpoint(ckpt_path, opt)
        policy.load_state_dict(params, strict=False)
        start, t_offset = meta["step"], meta["time_s"] - (time.time() - T0)
    log = Logger(cfg.out, start, cfg.steps)

    def save(step):
        save_checkpoint(ckpt_path, policy.params(), opt, {"step": step, "time_s": time.time() - T0 + t_offset})

    for step in range(start, cfg.steps + 1):
        row = {"step": step}
        if step in (start, cfg.steps) or (cfg.eval_every and step % cfg.eval_every == 0):
            row.update(task.evaluate(policy))  # greedy on held-out seeds; step 0 is before any update
        solved = cfg.stop_when_solved and task.solved(row)
        if solved or step == cfg.steps:
            log.log({**row, "time_s": time.time() - T0 + t_offset})
            if solved:
                log.say(f"solved at step {step} after {time.time() - T0 + t_offset:.1f} s")
            break
        # 1 - rollout
        batch = task.rollout(policy, step)
        # 2 - advantage (under the weights that sampled the batch)
        score_old(policy, batch, cfg)
        batch.adv, batch.returns = ADVANTAGES[cfg.algo](batch, cfg)
        # 3 - update
        stats = update(policy, opt, batch, cfg, task.max_len)
        # 4 - log, save
        log.log({**row, "time_s": time.time() - T0 + t_offset, "reward": batch.seq_reward.mean().item(),
                 "length": batch.mask.sum(1).mean().item(), **stats})
        if cfg.save_every and (step + 1) % cfg.save_every == 0:
            save(step + 1)
    save(step)
    log.close(cfg.out)
    return policy


if __name__ == "__main__":
    main()
