"""The training loop. Every step: evaluate when due, then 1 - rollout, 2 - advantage, 3 - update,
4 - publish / log / save. Control tasks and language models run this same loop. Start reading at main();
the reading path then goes tasks.play -> algos -> model.HFPolicy.score -> serve.

    python train.py --task cartpole --algo reinforce          # solves CartPole-v1 in seconds
    python train.py --config configs/cartpole_ppo.yaml        # a preset; flags override it
    python train.py --config configs/arith_grpo_cpu.yaml      # LoRA GRPO on SmolLM2-135M, CPU
    torchrun --nproc-per-node 2 train.py --config ...         # data parallel (gloo on CPU, nccl on GPU)
    python train.py --resume runs/cartpole-reinforce-<time>   # continue a run exactly where it stopped
"""
import gc
import math
import os
import sys
import threading
import time

import torch
import torch.distributed as dist
from safetensors import safe_open

import config as config_lib
from algos import ADVANTAGES, loss_weights, needs_groups, pg_loss, run_stats, value_loss
from model import HFPolicy, MLPPolicy, check_parity, save_adapter
from serve import WORKER, AsyncSource, SyncSource, hello, run_worker, serve_chat, served
from tasks import TASKS, checks_form, task_class
from utils import (Logger, Timer, all_reduce_sum, backend, broadcast_bytes, ctrl_c_waits, freeze_start_up,
                   fresh_dir, held_mb, keep_freed_memory, load_checkpoint, masked_mean, non_dumpable, peak_flops, rank,
                   reshard, rewind, rng_mark, save_checkpoint, seed_all, share_cores, unshard, world)


def build(cfg):
    """The task and its policy, after the checks that need the algorithm's and the task's own answers."""
    if cfg.group_size < 2 and needs_groups(ADVANTAGES[cfg.algo], cfg):
        raise SystemExit(f"config error: {cfg.algo} compares samples of the same prompt, and a group of one has "
                         f"nothing to compare: set --group-size 2 or more")
    if cfg.rg_config and not cfg.task.startswith("rg:"):
        raise SystemExit(f"config error: --rg-config configures a reasoning-gym task, and {cfg.task} is not one: drop "
                         "it, or use --task rg:NAME")
    if cfg.vf_config and not cfg.task.startswith("vf:"):
        raise SystemExit(f"config error: --vf-config configures a verifiers environment, and {cfg.task} is not one: "
                         "drop it, or use --task vf:NAME")
    task = task_class(cfg.task)(cfg)
    if not task.llm and (cfg.kl_coef or cfg.fsdp or cfg.credit == "turn"):
        raise SystemExit("config error: --kl-coef, --fsdp and --credit turn are for LLM policies; drop them for "
                         "control tasks")
    return task, HFPolicy(cfg) if task.llm else MLPPolicy(task.obs_dim, task.n_actions, cfg.hidden, cfg.algo == "ppo")


def micro_batches(batch, size):
    """The rows in pieces of at most `size` (0 = one piece), groups kept whole (their prompt runs once) and ordered
    by their longest completion, each piece's rows sorted by length (model.runs) and trimmed of all-padding columns:
    a two-token answer is not padded to the batch's longest. Losses add up over pieces, so the gradient does not
    depend on `size`. -> [(row indices, Batch)]"""
    N = len(batch.mask)
    if N == 0 or batch.attn is None:
        return [(idx, batch.rows(idx)) for idx in torch.arange(N).split(size or N)] if N else []
    _, g = torch.unique(batch.group, return_inverse=True)  # [N] groups numbered 0..G-1
    length = batch.tokens.sum(1).float()  # [N]
    longest = torch.zeros(N).scatter_reduce(0, g, length, "amax")[g]  # [N] of the row's group
    order = (longest * N + g).argsort(stable=True)  # by the group's longest completion, a group's rows together
    pieces = [idx[length[idx].argsort(stable=True)] for idx in order.split(size or N)]  # each piece's rows by length
    return [(idx, batch.rows(idx).trimmed()) for idx in pieces]


def unsplit(pieces, outs, whole):
    """Per-piece [n, t] outputs of micro_batches written into a copy of `whole` [N, T], in the batch's row order."""
    whole = whole.clone()
    for (idx, _), x in zip(pieces, outs):
        whole[idx, :x.shape[1]] = x.float().cpu()
    return whole


def old_logp_from(cfg, batch):
    """Where old_logp comes from, decided once a step (the update and the logs read this name, nothing else):
      "update"   one optimizer step per batch, nothing else to score first (ppo's critic, a KL's reference) and a batch
                 these very weights sampled: the update's own first forward is the old policy, the ratio is exactly 1
                 and no scoring pass runs
      "sampler"  the sampler's own logprobs (--old-logp sampler, the teaching ablation)
      "scored"   a no-grad pass under the weights that sampled the batch (score_old): a worker's batch always, since
                 the sampler's numbers are not the trainer's"""
    if cfg.old_logp == "sampler" and batch.sampler_logp is not None:
        return "sampler"
    one_update = cfg.epochs * cfg.minibatches == 1 and cfg.algo != "ppo" and not cfg.kl_coef
    return "update" if one_update and batch.sampler_logp is None else "scored"


def rows_to_run(batch, cfg):
    """-> (learns [N] bool: the rows whose passes can move the loss; run [N] bool: the rows score_old and the update
    run). With nothing but the policy loss in it (no KL, entropy or value term), a row whose advantage is 0 on every
    token adds exactly 0 to loss and gradient, so it need not run. Under FSDP every row runs all the same: each
    forward is a collective, and every rank must run as many passes."""
    every = torch.ones(len(batch.mask), dtype=torch.bool)
    learns = every if cfg.kl_coef or cfg.ent_coef or cfg.algo == "ppo" else (batch.adv != 0).any(1)
    return learns, every if cfg.fsdp else learns


def score_old(policy, batch, cfg, old_from, rows=None):
    """No-grad pass over `rows` ([N] bool, None: every row) under the weights that sampled the batch: old_logp, the
    old critic's values (ppo), ref_logp (KL). Rows not scored hold 0: they train nothing."""
    if old_from == "sampler":
        batch.old_logp = batch.sampler_logp
        if cfg.algo != "ppo" and not cfg.kl_coef:  # nothing else to score
            return
    idx = torch.arange(len(batch.mask)) if rows is None else rows.nonzero()[:, 0]
    pieces = [(idx[i], mb) for i, mb in micro_batches(batch.rows(idx), cfg.micro_batch)]
    zeros = torch.zeros(batch.mask.shape)  # [N, T]
    with torch.no_grad():
        outs = [policy.score(mb, entropy=False) for _, mb in pieces]
        if cfg.kl_coef:
            batch.ref_logp = unsplit(pieces, [policy.ref_logp(mb) for _, mb in pieces], zeros)  # [N, T]
        if cfg.algo == "ppo" and batch.final_obs is not None:  # a time-limit cut bootstraps from V(final_obs) (gae)
            batch.last_value = policy.value(batch.final_obs).cpu() * batch.truncated  # [N]
    if old_from == "scored":
        batch.old_logp = unsplit(pieces, [o["logp"] for o in outs], zeros)  # [N, T]
    if cfg.algo == "ppo":
        batch.values = unsplit(pieces, [o["value"] for o in outs], zeros) * batch.mask  # [N, T]


def minibatch(batch, rows, cfg, max_len):
    """Minibatch `rows` as the update runs it: the loss weights' denominators span EVERY row of it, then the rows that
    cannot move the loss are dropped (rows_to_run). Their loss is exactly 0, so the loss is the one over all rows.
    -> the Batch to run, or None when no row on any rank learns (no step anywhere: Adam would move on momentum)."""
    mb = batch.rows(rows)
    mb.weight = loss_weights(mb.mask, cfg, max_len)  # [n, T], global denominators, skipped rows counted
    learns, run = rows_to_run(mb, cfg)
    if all_reduce_sum(learns.sum()) == 0:
        return None
    return mb.rows(run.nonzero()[:, 0])


def update(policy, opt, batch, cfg, max_len, old_from):
    """epochs x minibatches optimizer steps; micro-batch losses add up to the minibatch's (global denominators), so
    micro_batch never changes the gradient. Every rank takes the same passes and decisions: a non-finite loss on
    any rank skips the step on all (none leaves early: under FSDP the others would wait in backward for it)."""
    sums, losses, norms, skipped = {}, [], [], 0
    params = [p for p in policy.parameters() if p.requires_grad]
    _, g = torch.unique(batch.group, return_inverse=True)  # minibatches shuffle whole groups
    for _ in range(cfg.epochs):
        order = torch.arange(len(g))
        if cfg.minibatches > 1:
            order = torch.randperm(int(g.max()) + 1)[g].argsort(stable=True)
        for rows in order.tensor_split(cfg.minibatches):  # exactly `minibatches` on every rank (chunk can give fewer)
            mb = minibatch(batch, rows, cfg, max_len)
            if mb is None:
                continue
            total = 0.0
            for _, micro in micro_batches(mb, cfg.micro_batch):
                out = policy.score(micro)
                old = out["logp"].detach() if old_from == "update" else micro.old_logp
                micro = micro.to(out["logp"].device)
                loss, stats = pg_loss(out["logp"], old, micro.adv, micro.mask, cfg, micro.weight, out["entropy"],
                                      micro.ref_logp, micro.sampler_logp)
                if out["value"] is not None:
                    loss = loss + cfg.vf_coef * value_loss(out["value"], micro.values, micro.returns, micro.weight, cfg)
                total += loss.item()
                loss.backward()  # even when not finite: the step is skipped below, on every rank alike
                for k, v in stats.items():
                    sums[k] = torch.maximum(sums[k], v) if k.endswith("_max") and k in sums else sums.get(k, 0) + v
            if world() > 1 and not cfg.fsdp:  # loss weights carry global denominators: gradients are SUMMED
                for p in params:  # (FSDP reduce-scatters them itself, summed: model.py)
                    p.grad = all_reduce_sum(torch.zeros_like(p) if p.grad is None else p.grad)
            if world() > 1:  # one rank's NaN skips the step everywhere
                total = all_reduce_sum(torch.tensor(total)).item()
            norm = unshard(torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm or math.inf))
            if math.isfinite(total) and torch.isfinite(norm):
                opt.step()
                losses.append(total)
                norms.append(norm.item())
            else:
                skipped += 1
            opt.zero_grad()
    n = sums.pop("tokens", torch.tensor(1.0)).clamp(min=1)  # the rows trained on: rows with A = 0 may be skipped
    out = {f"trained_{k}": (v if k.endswith("_max") else v / n).item() for k, v in sums.items()}
    if losses:  # a step that took no optimizer step logs no loss and no grad_norm: a gap, not a 0
        out.update(loss=sum(losses) / len(losses), grad_norm=sum(norms) / len(norms))
    return {"nonfinite": skipped, **out}


def forward_flops(lm, batch):
    """Model FLOPs of one forward over a batch's real tokens, by the standard count (Kaplan et al. 2020, arXiv
    2001.08361; PaLM's MFU): 2 N per token for the N weights of its matrix products (LoRA's and the LM head's
    included, the embedding lookup not), plus attention's 4 L d_attn per pair of a token and one it attends: a row
    of S tokens has S (S + 1) / 2. A backward costs two forwards. The sampler and the trainer's tricks (a group's
    prompt run once, rows skipped) do not change it: it counts the model's work, not the device's."""
    c, embed = lm.config, lm.get_input_embeddings().weight
    mats = {id(p): p.numel() for p in lm.parameters() if p.dim() >= 2 and p is not embed}  # (DTensors: whole sizes)
    head = lm.get_output_embeddings().weight  # tied to the embedding (SmolLM2) or not: it multiplies either way
    mats[id(head)] = head.numel()
    S = batch.attn.double().sum(1)  # [N] real tokens per row
    d_attn = c.num_attention_heads * (getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
    return float(2 * sum(mats.values()) * S.sum() + 4 * c.num_hidden_layers * d_attn * (S * (S + 1) / 2).sum())


def speed(policy, batch, cfg, split, peaks, trained, old_from):
    """Tokens/s of scoring + update (none without a step) and, for an LLM, the model FLOP utilization (MFU) of
    sampling and of training: the step's forward_flops over seconds over the device's peak (`peaks`). Training runs
    a forward and a backward per epoch over the rows that train, plus score_old's pass and the reference's."""
    out = {}
    if peaks and "gen_s" in batch.stats:
        out["gen_mfu"] = forward_flops(policy.lm, batch) / batch.stats["gen_s"] / peaks["gen"]
    if not trained:
        return out
    seconds = split["score_s"] + split["update_s"]
    out["train_tok_s"] = batch.mask.sum().item() / seconds
    if peaks:
        scored = old_from == "scored" or cfg.algo == "ppo" or bool(cfg.kl_coef)  # score_old's pass ran
        passes = 3 * cfg.epochs + scored + bool(cfg.kl_coef)
        flops = passes * forward_flops(policy.lm, batch.rows(rows_to_run(batch, cfg)[0].nonzero()[:, 0]))
        out["train_mfu"] = flops / seconds / peaks["train"]
    return out


def mfu_peaks(cfg, policy):
    """The device's measured matmul peak for the sampler's dtype and the trainer's (--peak-tflops overrides)."""
    dtypes = {"gen": cfg.gen_dtype, "train": "bfloat16" if policy.autocast else "float32"}
    return {k: cfg.peak_tflops * 1e12 or peak_flops(policy.device, dtype) for k, dtype in dtypes.items()}


def batch_metrics(batch, cfg, say):
    """What the batch itself says: reward and its spread, lengths, truncation, zero-variance groups, the sampler's
    logprobs against the trainer's."""
    R = batch.seq_reward  # [N]
    out = {"reward": R.mean().item(), "reward_std": R.std().item() if len(R) > 1 else 0.0,
           "length": batch.mask.sum(1).mean().item(), "truncated": batch.truncated.float().mean().item()}
    if cfg.group_size > 1:  # groups that teach nothing under grpo / rloo: every sample got the same reward
        out["zero_var_groups"] = (run_stats(batch)[1] == 0).float().mean().item()
    return {**out, **sampler_gap(batch, cfg, say), **batch.stats}


# an LLM run's progress bar: the reward, and why a step may teach nothing (cut replies, tied groups: step_notes)
BAR = ("reward", "truncated", "zero_var_groups")


def step_notes(metrics, step, cfg, task, say_once):
    """Why a step trained nothing, or that most replies were cut: each kind said once a run, in one line (else only a
    blank loss in metrics.csv and flat curves would show it)."""
    cut = task.llm and metrics["truncated"] > 0.5
    if "loss" not in metrics and not metrics["nonfinite"]:  # no optimizer step: no row had an advantage
        what = ("every group's replies got the same reward (zero_var_groups 1), and GRPO and RLOO learn from the "
                "differences between one prompt's replies" if metrics.get("zero_var_groups") == 1 else
                "no row had an advantage to learn from")
        if cut:
            cause = f"most replies were cut at {task.cut_by}"
        elif metrics.get("accuracy") == 1:
            cause = "every reply is right already: a harder setting teaches more"
        else:
            cause = ("the task is out of the model's reach as it samples now: an easier setting, a worked example in "
                     "the prompt, or a bigger --group-size")
        say_once("idle", f"step {step}: nothing learned: {what} (reward {metrics['reward']:.3g}); likely: {cause}")
    if cut:
        say_once("cut", f"step {step}: {metrics['truncated']:.0%} of replies were cut before they ended, at "
                        f"{task.cut_by} ({cfg.max_new_tokens} tokens): a cut reply seldom holds an answer or a whole "
                        "tool call; raise the limit")


def sampler_gap(batch, cfg, say):
    """A batch with the sampler's logprobs (a worker's): their mean |gap| to the trainer's over the tokens scored (none
    when every group tied), and the TIS weights. A gap above gap_tol is said: a worker whose weights did not load
    samples from another policy than the one the trainer scores."""
    if batch.sampler_logp is None:
        return {}
    seen = batch.mask * rows_to_run(batch, cfg)[1][:, None]  # [N, T] the tokens score_old scored
    if not seen.any():
        return {}
    log_w = (batch.old_logp - batch.sampler_logp) * seen  # [N, T]
    out = {"logp_gap": masked_mean(log_w.abs(), seen).item()}
    if out["logp_gap"] > cfg.gap_tol:
        say(f"warning: logp_gap {out['logp_gap']:.3f} > gap_tol {cfg.gap_tol}: the sampler of version {batch.version} "
            "does not sample what the trainer scores (a worker's weights out of sync?)")
    if cfg.tis_clip:
        out["tis_weight"] = masked_mean(log_w.exp().clamp(max=cfg.tis_clip), seen).item()
        out["tis_clipped"] = masked_mean((log_w.exp() > cfg.tis_clip).float(), seen).item()
    return out


def setup(cfg):
    """The process's cores, data parallelism (under torchrun, one rank or many: utils.backend), seeds."""
    cuda = cfg.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        raise SystemExit(f"config error: --device {cfg.device}, but this torch ({torch.__version__}) sees no CUDA "
                         "GPU: use --device cpu, or install a CUDA build of torch")
    threads = share_cores(cfg)  # first: threads started from here on inherit this process's cores
    launched = int(os.environ.get("WORLD_SIZE", 1)) > 1 or {"RANK", "WORLD_SIZE"} <= os.environ.keys()
    if launched and not dist.is_initialized():  # a launcher (torchrun) set up a world; a LOCAL_RANK alone is none
        dist.init_process_group(backend(cfg.device))
        if cuda:  # one GPU per rank; nccl collectives run on the current device
            cfg.device = f"cuda:{os.environ.get('LOCAL_RANK', 0)}"
            torch.cuda.set_device(cfg.device)
    cfg.out = cfg.resume or cfg.out  # a new run's folder is made once the command is accepted (run_folder)
    if rank() == 0 and not cfg.ask:  # an answer alone for --ask
        print(threads, flush=True)
    seed_all(cfg.seed)  # one seed for every rank until the policy is built: one initial model (main reseeds)


def run_folder(cfg):
    """Make the run's folder: --out, or one of its own (runs/TASK-ALGO-TIME), even beside runs started in the same
    second."""
    if not cfg.out:
        name = cfg.env.lower() if cfg.task == "cartpole" else cfg.task.replace(":", "-")  # rg:NAME -> rg-NAME
        worker = f"-worker-{WORKER}" if cfg.role == "rollout" else ""  # next to the trainer's folder
        base = f"runs/{name}-{cfg.algo}-{time.strftime('%Y%m%d-%H%M%S')}{worker}"
        cfg.out = broadcast_bytes(fresh_dir(base).encode() if rank() == 0 else None).decode()  # one for all ranks
    os.makedirs(cfg.out, exist_ok=True)


def optimizer(policy, cfg):
    """AdamW on the trainable weights; on a GPU its fused kernel, one launch for all of them (FSDP's shards take
    torch's default path). --weight-decay decays weight matrices only, as is usual: not biases, norms (1-D) or
    embeddings (a decayed embedding shrinks the rows of rare tokens, which get no gradient to hold them)."""
    embeddings = {id(m.weight) for m in policy.modules() if isinstance(m, torch.nn.Embedding)}
    params = [p for p in policy.parameters() if p.requires_grad]
    decayed = {True: [], False: []}
    for p in params:
        decayed[p.dim() >= 2 and id(p) not in embeddings].append(p)
    groups = [{"params": decayed[True], "weight_decay": cfg.weight_decay},
              {"params": decayed[False], "weight_decay": 0.0}]
    fused = params[0].is_cuda and not cfg.fsdp
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.lr, fused=fused)


def checkpoint_path(cfg):
    return os.path.join(cfg.out, "checkpoint.safetensors")


def restore(ckpt_path, policy, opt, cfg):
    """--resume: weights, optimizer and RNG states. -> (the step to continue from, seconds already run)"""
    mine = policy.params()
    with safe_open(ckpt_path, "pt") as f:  # first: does the checkpoint fit this policy at all?
        theirs = {k[6:]: tuple(f.get_slice(k).get_shape()) for k in f.keys() if k.startswith("model.")}
    if theirs != {k: tuple(v.shape) for k, v in mine.items()}:
        diff = sorted(set(theirs) ^ set(mine)) or [k for k in theirs if theirs[k] != tuple(mine[k].shape)]
        run = os.path.dirname(ckpt_path)
        was = config_lib.load_yaml(os.path.join(run, "config.yaml"))
        keys = ("task", "env", "model", "algo", "hidden", "lora_r", "lora_targets")
        changed = [f"{k} {was.get(k)!r} there, {getattr(cfg, k)!r} here" for k in keys
                   if was.get(k, getattr(cfg, k)) != getattr(cfg, k)]
        raise SystemExit(f"config error: --resume {run}: its checkpoint does not fit this policy ({len(diff)} tensors "
                         f"differ, e.g. {diff[0]}; {', '.join(changed) or 'the same settings'}): drop the flags or "
                         f"--config that change the model; {run}/config.yaml is unchanged")
    params, meta = load_checkpoint(ckpt_path, opt, mine)
    with torch.no_grad():
        for k, p in mine.items():
            p.copy_(reshard(params[k].to(p.device), p))
    policy.publish()  # the sampler must start from the restored weights too
    return meta["step"], meta["time_s"]


def checkpoint(cfg, llm, policy, opt, meta):
    """Every rank calls it: FSDP shards are gathered; rank 0 writes the checkpoint, and for an LLM the adapter in
    PEFT format too, loadable without flatrl. -> the step saved"""
    params = save_checkpoint(checkpoint_path(cfg), policy.params(), opt, meta)
    if llm and rank() == 0:
        save_adapter(policy, os.path.join(cfg.out, "adapter"), params)
    return meta["step"]


def opening_lines(cfg, task, policy):
    """What a run says as it starts, one string: an LLM's parameter sizes, and the settings under which a documented
    behaviour does not apply (README says so too)."""
    out = []
    if task.llm:
        out.append("parameters on each of %d rank(s): %.1f MB trainable, %.1f MB frozen" % (world(), *held_mb(policy)))
        if rule := task.grading_rule():
            out.append(rule)
        if task.constant:
            reply, acc = task.constant
            acc_name = "eval_acc_turn1" if cfg.max_turns > 1 else "eval_acc"  # later replies may try other answers
            out.append(f"best constant answer: {reply!r} for every held-out problem scores {acc:.3g} "
                       f"(eval_best_constant): an {acc_name} at that level needs no more than that")
        if not checks_form(task):
            out.append(f"note: {type(task).__name__} has a correct() of its own and the default well_formed(), which "
                       "reads numbers: no well_formed share is logged until it defines well_formed (README, Tasks)")
    if not task.llm and cfg.algo != "ppo" and cfg.gamma >= 1:
        out.append("note: at --gamma 1 an episode cut by the time limit is not bootstrapped (its tail r_mean / "
                   "(1 - gamma) is infinite): it counts only the rewards it saw")
    if cfg.old_logp == "sampler":
        out.append("note: --old-logp sampler: old_logp is the sampler's own, so logp_gap is 0 and tis_weight 1 by "
                   "construction")
    return "\n".join(out)


def results_line(cfg, log, llm):
    """The last thing a run prints: where its files are, its last evaluation, and how to try an LLM."""
    evals = ", ".join(f"{k[5:]} {v:.3g}" for k, v in log.last_eval.items())
    line = f"results in {cfg.out}/: {', '.join(sorted(os.listdir(cfg.out)))} (last eval: {evals})"
    if llm:
        line += f"; try it: python train.py --resume {cfg.out} --ask \"your prompt\""
    return line


def main(argv=None):
    began = time.time()  # the run's clock (time_s, "solved after"): from here, the model's loading included
    cfg = config_lib.parse(argv, {"task": list(TASKS), "algo": list(ADVANTAGES)})
    if task_class(cfg.task).runs_model_text:  # from the start: no process of this user reads the token from memory
        non_dumpable()
    if (cfg.ask or cfg.serve) and not (task_class(cfg.task).llm and cfg.resume):
        flag = "--ask answers" if cfg.ask else "--serve serves"
        raise SystemExit(f"config error: {flag} with a trained LLM run: python train.py --resume RUN_DIR "
                         f"{'--ask ...' if cfg.ask else '--serve'}")
    setup(cfg)
    task, policy = build(cfg)
    freeze_start_up()
    gc.enable()
    if rank() > 0:  # from here on ranks sample differently; rank 0 goes on exactly as one process would
        seed_all(cfg.seed + rank())
    if cfg.check_parity:
        if not task.llm:
            raise SystemExit("config error: --check-parity compares LLM samplers; pick an LLM task")
        ok = check_parity(policy, [task.build_prompt(q) for q, _ in task.eval_set[:8]], cfg, print)
        raise SystemExit(0 if ok else 1)
    opt = optimizer(policy, cfg)
    start, seconds_before = restore(checkpoint_path(cfg), policy, opt, cfg) if cfg.resume else (0, 0.0)
    if cfg.ask:
        print(policy.generate([cfg.ask], 1, greedy=True)[1][0])
        return None
    if cfg.serve:
        return serve_forever(cfg, policy)
    remote = hello(cfg) if cfg.role == "rollout" else None  # a worker whose trainer never answers makes nothing
    run_folder(cfg)  # only now: a refused command (above) leaves no new folder, and a resumed one as it was
    if rank() == 0:
        config_lib.save(cfg, os.path.join(cfg.out, "config.yaml"))
    if cfg.role == "rollout":
        return run_worker(cfg, task, policy, remote)
    return run(cfg, task, policy, opt, start, began - seconds_before)


def serve_forever(cfg, policy):
    """--serve: the trained run on OpenAI's chat API (/v1/chat/completions, /v1/models) until Ctrl-C."""
    server = serve_chat(policy, cfg, cfg.bind, cfg.port)
    print(f"serving {cfg.out} at http://{cfg.bind}:{server.server_port}/v1 as model {served(cfg)!r} (OpenAI chat "
          f"completions; Ctrl-C stops). Replies stop at {cfg.max_new_tokens} tokens, the run's --max-new-tokens, "
          "whatever a request's max_tokens: add --max-new-tokens N to serve longer ones", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        server.shutdown()
        raise SystemExit(130)


def evaluation(cfg, task, policy, step):
    """-> ({"step": step} and, when due, the greedy held-out evaluation's metrics; solved?), one decision for every
    rank: rank 0's. Step 0's evaluation is before any update."""
    row = {"step": step}
    if step in (0, cfg.steps) or (cfg.eval_every and step % cfg.eval_every == 0):  # a resume keeps the schedule
        row.update(task.evaluate(policy, step))
    solved = cfg.stop_when_solved and task.solved(row)
    if world() > 1 and len(row) > 1:
        solved = broadcast_bytes(bytes([solved]) if rank() == 0 else None) == b"\x01"
    return row, solved


def run(cfg, task, policy, opt, start, began):
    """The loop, from step `start` to cfg.steps (or until solved), then the last checkpoint and the plot."""
    def clock():  # seconds since the run began, resumes included (`began` is that much earlier)
        return time.time() - began

    def save(step):
        return checkpoint(cfg, task.llm, policy, opt, {"step": step, "time_s": clock()})

    log = Logger(cfg.out, start, cfg.steps, cfg, BAR if task.llm else BAR[:1])
    log.say(opening_lines(cfg, task, policy))
    source = AsyncSource(task, policy, cfg, log, version=start) if cfg.role == "trainer" else SyncSource(task, policy)
    peaks = mfu_peaks(cfg, policy) if task.llm else None
    done, saved, interrupted, mark = start, start if cfg.resume else None, False, rng_mark()
    try:  # Ctrl-C: the checkpoint is the last step boundary's, so a resume goes on as if never stopped
        for step in range(start, cfg.steps + 1):
            row, solved = evaluation(cfg, task, policy, step)
            if solved or step == cfg.steps:
                log.log({**row, "time_s": clock()}, done)
                if solved:
                    log.say(f"solved at step {step} after {clock():.1f} s")
                break
            # 1 - rollout (in-process, or pushed by a worker)
            timer = Timer()
            batch = source.next_batch(step)
            timer("rollout_s")
            # 2 - advantage, and the old policy's numbers under the exact weights that sampled the batch
            old_from = old_logp_from(cfg, batch)
            with source.weights(batch):
                if cfg.algo == "ppo":  # GAE runs on the old critic's values: every row is scored first
                    score_old(policy, batch, cfg, old_from)
                batch.adv, batch.returns = ADVANTAGES[cfg.algo](batch, cfg)
                if cfg.algo != "ppo" and old_from != "update":  # only the rows that can move the loss
                    score_old(policy, batch, cfg, old_from, rows_to_run(batch, cfg)[1])
            timer("score_s")
            with ctrl_c_waits():  # from here the step changes weights, optimizer, log: all of it, or (above) none
                # 3 - update
                stats = update(policy, opt, batch, cfg, task.max_len, old_from)
                timer("update_s")
                # 4 - publish, log, save
                source.publish(step + 1)
                timer("publish_s")
                done, mark = step + 1, rng_mark()
                speeds = speed(policy, batch, cfg, timer.split, peaks, "loss" in stats, old_from)
                metrics = {**batch_metrics(batch, cfg, log.say), **stats}
                log.log({**row, "time_s": clock(), **metrics, **timer.split, **speeds, **source.stats()}, done)
                step_notes(metrics, step, cfg, task, log.say_once)
                if cfg.save_every and done % cfg.save_every == 0:
                    saved = save(done)
    except KeyboardInterrupt:  # in an evaluation, a rollout or scoring: the step is dropped, its draws undone
        rewind(mark)
        log.say(f"interrupted after {done} steps: saving a checkpoint (resume with --resume {cfg.out})")
        interrupted = True
    if done != saved:
        save(done)
    source.close()
    log.close(cfg.out, plot=cfg.plot == "on" or cfg.plot == "auto" and task.llm)
    log.say(results_line(cfg, log, task.llm))
    if interrupted:
        raise SystemExit(130)  # checkpoint saved; 130 as a shell reports Ctrl-C: a script tells it from a finished run
    return policy


def as_script():
    """`python train.py ...`: main() with the process tuning that a library caller does not get, and the exit status.
    Start-up (imports, the model, vLLM's engine) makes millions of objects that live all run: no collection walks
    them until main() has built the policy and moved them out of every later one (utils.freeze_start_up). Freed
    memory stays in the process for the next step's big tensors (utils.keep_freed_memory)."""
    gc.disable()
    keep_freed_memory()
    try:
        main()
        status = 0
    except SystemExit as e:  # a config error's one line (exit 1), or 130 after Ctrl-C
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        status = 1 if isinstance(e.code, str) else e.code or 0
    except KeyboardInterrupt:  # Ctrl-C outside the training loop (a rollout worker loses only its batch in flight)
        print("stopped", file=sys.stderr)
        status = 130
    # No interpreter teardown: its C++ destructors can abort a torchrun rank at exit, which leaves the other nodes'
    # torchrun waiting minutes in its exit barrier. Files and trackers are closed by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    as_script()
