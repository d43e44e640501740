"""The update's seconds with each group's prompt run once (model.HFPolicy.forward_logits) against every row
run whole (the path before it, which --group-size 1 still takes: micro-batches of 8 rows sorted by length, as the
preset had), on the same informative batch, side by side, alternating: SmolLM2-135M-Instruct + LoRA as
configs/arith_grpo_cpu.yaml sets it (8 prompts x 4 sampled completions, micro_batch 16 = 4 whole groups, bf16
autocast where the CPU has fast bf16), random rewards so that every group
trains, SGD with lr 0 so that every round does the same work. Also the no-grad scoring pass (score_old).

    HF_HUB_OFFLINE=1 python benchmarks/update.py --rounds 5
"""
import argparse
import dataclasses
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import config as config_lib  # noqa: E402
import train  # noqa: E402
from algos import ADVANTAGES  # noqa: E402
from model import HFPolicy  # noqa: E402
from tasks import TASKS  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--whole-micro-batch", type=int, default=8, help="the whole-row side's (the preset's before)")
    a = p.parse_args()
    cfg = config_lib.parse(["--config", "configs/arith_grpo_cpu.yaml", "--seed", str(a.seed)],
                           {"task": list(TASKS), "algo": list(ADVANTAGES)})
    torch.manual_seed(a.seed)
    policy, task = HFPolicy(cfg), TASKS[cfg.task](cfg)
    batch = task.rollout(policy, step=0)
    batch.rewards = torch.rand_like(batch.mask) * batch.mask  # every group varies: every row trains
    batch.adv, batch.returns = ADVANTAGES[cfg.algo](batch, cfg)
    opt = torch.optim.SGD([x for x in policy.parameters() if x.requires_grad], lr=0.0)
    whole = dataclasses.replace(cfg, group_size=1, micro_batch=a.whole_micro_batch)
    today = dataclasses.replace(batch, group=torch.arange(len(batch.mask)))  # micro-batches sorted by length, as before
    prompt, done = batch.obs.shape[1] - batch.mask.shape[1], batch.mask.sum(1)
    print(f"{len(batch.mask)} rows, prompt {prompt} tokens, completions {done.mean():.1f} tokens on average "
          f"({int(done.min())}-{int(done.max())}); FLOPs of the update, shared / whole: ", end="")
    policy.cfg = cfg
    shared_flops = policy.flops(batch, train=True)
    policy.cfg = whole
    print(f"{shared_flops / policy.flops(batch, train=True):.2f}")
    res = {"shared": {"update": [], "score": []}, "whole": {"update": [], "score": []}}
    for r in range(a.rounds):  # alternate
        for name, c, b in (("shared", cfg, batch), ("whole", whole, today)):
            policy.cfg = c
            t = time.perf_counter()
            train.update(policy, opt, b, c, task.max_len)
            res[name]["update"].append(time.perf_counter() - t)
            t = time.perf_counter()
            with torch.no_grad():
                for _, mb in train.micro_batches(b, c.micro_batch):
                    policy.score(mb, entropy=False)
            res[name]["score"].append(time.perf_counter() - t)
        print(f"round {r}: update shared {res['shared']['update'][-1]:.2f} s, whole {res['whole']['update'][-1]:.2f} s; "
              f"scoring shared {res['shared']['score'][-1]:.2f} s, whole {res['whole']['score'][-1]:.2f} s", flush=True)
    print("\n| pass | shared s per round | whole s per round | median shared / whole |\n|---|---|---|---|")
    for k in ("update", "score"):
        s, w = res["shared"][k], res["whole"][k]
        print(f"| {k} | {', '.join(f'{x:.2f}' for x in s)} | {', '.join(f'{x:.2f}' for x in w)} | "
              f"{statistics.median(s):.2f} / {statistics.median(w):.2f} = {statistics.median(s) / statistics.median(w):.2f}x |")


if __name__ == "__main__":
    main()
