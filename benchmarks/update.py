"""The update's seconds with each group's prompt run once (model.HFPolicy.forward_logits) against every row
run whole (the path before it, which --group-size 1 still takes: micro-batches of 8 rows sorted by length, as the
preset had), on the same informative batch, side by side, alternating: SmolLM2-135M-Instruct + LoRA as
configs/arith_grpo_cpu.yaml sets it (8 prompts x 4 sampled completions, bf16 autocast where the CPU has fast bf16),
random rewards so that every group trains, SGD with lr 0 so that every round does the same work. Also the no-grad
scoring pass (score_old).

    HF_HUB_OFFLINE=1 python benchmarks/update.py --rounds 5

--against REV: this checkout's update against git revision REV's (its own code and its own preset), each in a fresh
process per round, alternating, on the same saved batch: three updates each, the first a warm-up (not counted).
cb9de4b^ is the code before a group's prompt ran once (the update issue #19 started from).

    HF_HUB_OFFLINE=1 python benchmarks/update.py --rounds 5 --against cb9de4b^

--lengths cuts the sampled completions to given lengths: a later step's batch, where most replies are short and a
few still run to max_new_tokens (what forward_logits' runs are for).

    HF_HUB_OFFLINE=1 python benchmarks/update.py --rounds 5 --against 7f14517 --lengths 12,10,11,9,13,32,12,10
"""
import argparse
import dataclasses
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import config as config_lib  # noqa: E402
import train  # noqa: E402
from grpo_vs_trl import tree_at  # noqa: E402  (benchmarks/, this script's folder, is on sys.path)
from algos import ADVANTAGES  # noqa: E402
from model import HFPolicy  # noqa: E402
from tasks import TASKS  # noqa: E402


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = """
import sys, time, torch
sys.path.insert(0, ".")
import config, train
from algos import ADVANTAGES
from model import HFPolicy
from safetensors.torch import load_file
from tasks import TASKS
from utils import Batch
cfg = config.parse(["--config", "configs/arith_grpo_cpu.yaml"], {"task": list(TASKS), "algo": list(ADVANTAGES)})
getattr(train, "keep_freed_memory", lambda: None)()  # as train.py run as a script does (a revision before it: not)
policy, batch = HFPolicy(cfg), Batch(**load_file(sys.argv[1]))
opt = torch.optim.SGD([x for x in policy.parameters() if x.requires_grad], lr=0.0)
for i in range(3):
    t = time.perf_counter()
    train.update(policy, opt, batch, cfg, cfg.max_new_tokens, old_from=train.old_logp_from(cfg, batch))
    print(f"update {time.perf_counter() - t:.3f}", flush=True)
"""


def against(rev, batch, rounds):
    """This checkout's update against revision rev's, a fresh process each, alternating. -> {side: [s per round]}"""
    with tempfile.TemporaryDirectory() as tmp:
        then = tree_at(rev, os.path.join(tmp, "then"))
        path = os.path.join(tmp, "batch.safetensors")
        save_file({k: v.contiguous() for k, v in batch.tensors().items()}, path)
        res = {"now": [], rev: []}
        for r in range(rounds):
            for side, cwd in (("now", ROOT), (rev, then)):
                out = subprocess.run([sys.executable, "-c", WORKER, path], cwd=cwd, capture_output=True, text=True,
                                     check=True).stdout
                res[side].append(statistics.mean(float(x) for x in out.split()[3::2]))  # updates 2-3: 1 warms up
            print(f"round {r}: update now {res['now'][-1]:.2f} s, {rev} {res[rev][-1]:.2f} s", flush=True)
    return res


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--whole-micro-batch", type=int, default=8, help="the whole-row side's (the preset's before)")
    p.add_argument("--against", metavar="REV", help="compare with git revision REV's code and preset instead")
    p.add_argument("--lengths", help="cut the rows' completions to these lengths, cycled: 12,10,11,9,13,32,12,10 is "
                   "a later step's shape (most replies short, a few at max_new_tokens)")
    a = p.parse_args()
    cfg = config_lib.parse(["--config", "configs/arith_grpo_cpu.yaml", "--seed", str(a.seed)],
                           {"task": list(TASKS), "algo": list(ADVANTAGES)})
    torch.manual_seed(a.seed)
    policy, task = HFPolicy(cfg), TASKS[cfg.task](cfg)
    batch = task.rollout(policy, step=0)
    if a.lengths:  # each row's completion cut to these lengths, cycled (a later step's shape)
        P, cut = batch.obs.shape[1] - batch.mask.shape[1], [int(x) for x in a.lengths.split(",")]
        prompts = [o[:P][m[:P] > 0].tolist() for o, m in zip(batch.obs, batch.attn)]
        tails = [o[P:P + cut[i % len(cut)]].tolist() for i, o in enumerate(batch.obs)]
        batch = policy.to_batch(prompts, tails, n=cfg.group_size)
    batch.rewards = torch.rand_like(batch.mask) * batch.mask  # every group varies: every row trains
    batch.adv, batch.returns = ADVANTAGES[cfg.algo](batch, cfg)
    if a.against:
        res = against(a.against, batch, a.rounds)
        now, then = res["now"], res[a.against]
        print(f"\n| update | now (s per round) | {a.against} (s per round) | median now / {a.against} |\n|---|---|---|---|")
        print(f"| {len(batch.mask)} rows | {', '.join(f'{x:.2f}' for x in now)} | {', '.join(f'{x:.2f}' for x in then)} | "
              f"{statistics.median(now):.2f} / {statistics.median(then):.2f} = "
              f"{statistics.median(now) / statistics.median(then):.2f}x |")
        return
    opt = torch.optim.SGD([x for x in policy.parameters() if x.requires_grad], lr=0.0)
    whole = dataclasses.replace(cfg, group_size=1, micro_batch=a.whole_micro_batch)
    today = dataclasses.replace(batch, group=torch.arange(len(batch.mask)))  # micro-batches sorted by length, as before
    prompt, done = batch.obs.shape[1] - batch.mask.shape[1], batch.mask.sum(1)
    print(f"{len(batch.mask)} rows, prompt {prompt} tokens, completions {done.mean():.1f} tokens on average "
          f"({int(done.min())}-{int(done.max())})")
    res = {"shared": {"update": [], "score": []}, "whole": {"update": [], "score": []}}
    for r in range(a.rounds):  # alternate
        for name, c, b in (("shared", cfg, batch), ("whole", whole, today)):
            policy.cfg = c
            t = time.perf_counter()
            train.update(policy, opt, b, c, task.max_len, old_from=train.old_logp_from(c, b))
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
