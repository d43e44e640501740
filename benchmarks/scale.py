"""One process vs 2 data-parallel gloo ranks vs 2 ranks with --fsdp, configs/arith_grpo_cpu.yaml on
SmolLM2-135M-Instruct: seconds per step and the parameter memory each rank holds (train.py's own line).
Each run in a fresh process (torchrun for the ranks), alternating, median over rounds.

What a 2-core CPU can and cannot show: correctness and memory, yes (the tests pin FSDP's gradients to one
process's, and each rank holds half the weights); speed-up, no: two ranks share the same two cores (one
thread each), so data parallelism here only adds communication. On GPUs, benchmarks/gpu_check.sh.

    HF_HUB_OFFLINE=1 python benchmarks/scale.py --steps 6 --rounds 2
"""
import argparse
import csv
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(ranks, fsdp, steps):
    launch = [sys.executable] if ranks == 1 else [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                                                   str(ranks), "--master-port", str(free_port())]
    with tempfile.TemporaryDirectory() as d:
        out = subprocess.run(launch + ["train.py", "--config", "configs/arith_grpo_cpu.yaml", "--steps", str(steps),
                                       "--eval-every", "0", "--threads", str(2 // ranks), "--out", d]
                             + ["--fsdp"] * fsdp, cwd=ROOT, capture_output=True, text=True)
        if out.returncode:
            raise SystemExit(out.stdout[-3000:] + out.stderr[-3000:])
        with open(f"{d}/metrics.csv") as f:
            t = [float(r["time_s"]) for r in csv.DictReader(f) if r.get("reward")]
    mb = re.search(r"parameters on each of \d+ rank\(s\): ([\d.]+) MB trainable, ([\d.]+) MB frozen", out.stdout + out.stderr)
    return statistics.median(b - a for a, b in zip(t, t[1:])), float(mb[1]), float(mb[2])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args()
    if a.steps < 3 or a.rounds < 1:
        p.error("--steps must be >= 3 and --rounds >= 1")
    runs = {"1 process": (1, False), "2 gloo ranks (data parallel)": (2, False), "2 ranks, --fsdp": (2, True)}
    res = {k: [] for k in runs}
    for r in range(a.rounds):
        for k, (ranks, fsdp) in runs.items():
            res[k].append(run(ranks, fsdp, a.steps))
            print(f"round {r} {k}: {res[k][-1][0]:.2f} s/step, {res[k][-1][1]:.1f} + {res[k][-1][2]:.1f} MB", flush=True)
    print("\n| run | s/step (median) | trainable MB per rank | frozen MB per rank | weights per rank vs 1 process |")
    print("|---|---|---|---|---|")
    base = sum(res["1 process"][0][1:])
    for k, v in res.items():
        print(f"| {k} | {statistics.median(x[0] for x in v):.2f} | {v[0][1]:.1f} | {v[0][2]:.1f} | {sum(v[0][1:]) / base:.2f}x |")


if __name__ == "__main__":
    main()
