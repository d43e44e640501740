"""Does flatrl's update learn what TRL's does? One batch, sampled by flatrl with the arith preset (the work of
benchmarks/grpo_vs_trl.py: SmolLM2-135M-Instruct, LoRA r=16 on every linear layer, 8 prompts x 4, no KL, token-mean
loss), goes through flatrl's update (train.update) and through TRL's GRPOTrainer.compute_loss with the same LoRA
weights; the gradients of every LoRA tensor are compared, before clipping. In fp32 both should agree to rounding;
under bf16 autocast (where the CPU has fast bf16) each differs from its own fp32 gradient, and the two bf16 gradients
should be as far apart as that, not further. The first batch with at least --informative groups that vary is used.

    pip install trl && python .ci/cache_smollm2.py
    HF_HUB_OFFLINE=1 python benchmarks/gradient_vs_trl.py --seeds 0 1
"""
import argparse
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import config as config_lib  # noqa: E402
import train  # noqa: E402
from algos import ADVANTAGES  # noqa: E402
from tasks import TASKS  # noqa: E402
from utils import fast_bf16  # noqa: E402


def flatrl_gradient(policy, batch, cfg, max_len, autocast):
    """LoRA gradients of one update on `batch` (no clipping), read where the optimizer would step. -> {name: grad}"""
    grads = {}

    class Capture:  # an optimizer that keeps the gradients instead of stepping
        def step(self):
            grads.update({k: p.grad.detach().clone() for k, p in policy.params().items()})

        def zero_grad(self):
            for p in policy.parameters():
                p.grad = None

    policy.autocast = autocast
    train.update(policy, Capture(), batch, cfg, max_len, old_from=train.old_logp_from(cfg, batch))
    return grads


def trl_gradient(policy, batch, cfg, bf16):
    """The same LoRA weights in TRL's GRPOTrainer, configured from flatrl's cfg as benchmarks/grpo_vs_trl.py runs it;
    its loss on the batch, backward. -> {flatrl's name: grad}"""
    from datasets import Dataset
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer
    G = cfg.group_size
    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(output_dir=out, per_device_train_batch_size=cfg.batch_size, num_generations=G,
                          max_completion_length=cfg.max_new_tokens, temperature=cfg.temperature, beta=0.0, num_iterations=1,
                          learning_rate=cfg.lr, max_grad_norm=1.0, max_steps=1, report_to=[], seed=cfg.seed, use_cpu=True,
                          bf16=bf16, gradient_checkpointing=False)
        peft = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=0.0, target_modules=cfg.lora_targets.split(","))
        rows = Dataset.from_list([{"prompt": [{"role": "user", "content": "1 + 1?"}]}] * cfg.batch_size)  # unused: the batch is given
        trainer = GRPOTrainer(model=cfg.model, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
                              train_dataset=rows, peft_config=peft)
    theirs = dict(trainer.model.named_parameters())
    mine = policy.params()
    with torch.no_grad():
        for k, p in mine.items():
            theirs[k.removeprefix("lm.")].copy_(p)
    R = batch.seq_reward.view(-1, G)  # TRL's advantage: (R - group mean) / (group std + 1e-4)
    adv = ((R - R.mean(1, keepdim=True)) / (R.std(1, keepdim=True) + 1e-4)).view(-1)
    P = batch.obs.shape[1] - batch.mask.shape[1]
    inputs = {"prompt_ids": batch.obs[:, :P], "prompt_mask": batch.attn[:, :P].long(), "completion_ids": batch.actions,
              "completion_mask": batch.mask.long(), "advantages": adv, "num_items_in_batch": batch.mask.sum()}
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by its training loop, which this skips
    trainer.compute_loss(trainer.model, inputs).backward()
    return {k: theirs[k.removeprefix("lm.")].grad for k in mine}


def distance(a, b):
    """-> (|a - b| / |b|, cosine(a, b)), all tensors as one vector"""
    x, y = (torch.cat([g[k].flatten() for k in b]).double() for g in (a, b))  # float64: a 4.9M-long dot product
    return ((x - y).norm() / y.norm()).item(), (x @ y / (x.norm() * y.norm())).item()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--informative", type=int, default=2, help="groups whose rewards vary in the batch used")
    a = p.parse_args()
    bf16 = fast_bf16("cpu")
    print("| seed | batch (step, groups that vary, tokens) | fp32: flatrl vs TRL | "
          + ("bf16: flatrl vs TRL | bf16 vs fp32: flatrl, TRL |" if bf16 else "(no fast bf16 here) |"))
    print("|---" * (5 if bf16 else 4) + "|")
    for seed in a.seeds:
        cfg = config_lib.parse(["--config", "configs/arith_grpo_cpu.yaml", "--generator", "hf", "--seed", str(seed)],
                               {"task": list(TASKS), "algo": list(ADVANTAGES)})
        cfg.max_grad_norm = 0  # raw gradients
        task, policy = train.build(cfg)
        torch.manual_seed(seed)
        for step in range(100):
            batch = task.rollout(policy, step)
            varied = int((batch.seq_reward.view(-1, cfg.group_size).std(1) > 0).sum())
            if varied >= a.informative:
                break
        else:
            raise SystemExit(f"seed {seed}: no batch in 100 steps had {a.informative} groups that vary; lower --informative")
        batch.adv, batch.returns = ADVANTAGES[cfg.algo](batch, cfg)
        f32, t32 = flatrl_gradient(policy, batch, cfg, task.max_len, False), trl_gradient(policy, batch, cfg, False)
        cells = [f"{step}, {varied}, {int(batch.mask.sum())}", "%.1e, cosine %.6f" % distance(f32, t32)]
        if bf16:
            f16, t16 = flatrl_gradient(policy, batch, cfg, task.max_len, True), trl_gradient(policy, batch, cfg, True)
            cells += ["%.1e, cosine %.4f" % distance(f16, t16),
                      f"{distance(f16, f32)[0]:.1e}, {distance(t16, t32)[0]:.1e}"]
        print(f"| {seed} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
