"""Why the trainer recomputes old logprobs: configs/arith_grpo_cpu.yaml with a bf16 sampler (the fp32 trainer
differs from it by rounding alone), trained twice from the same seed: --old-logp trainer (flatrl's way:
old_logp recomputed by the trainer under the weights that sampled) and --old-logp sampler (the ablation:
the sampler's own logprobs stand in). With one update per batch the first run's ratio is exactly 1; the
second's is exp(trainer - sampler), which clipping then acts on. Per step: mean and max ratio, clipfrac,
train reward, and held-out eval_acc every --eval-every steps.

    HF_HUB_OFFLINE=1 python benchmarks/logprob_mismatch.py --steps 30
"""
import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(mode, steps, seed, eval_every):
    with tempfile.TemporaryDirectory() as d:
        subprocess.run([sys.executable, "train.py", "--config", "configs/arith_grpo_cpu.yaml", "--gen-dtype", "bfloat16",
                        "--old-logp", mode, "--steps", str(steps), "--seed", str(seed), "--eval-every", str(eval_every),
                        "--no-stop-when-solved", "--out", d], cwd=ROOT, check=True, capture_output=True)
        with open(f"{d}/metrics.csv") as f:
            return {int(r["step"]): r for r in csv.DictReader(f)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=5)
    a = p.parse_args()
    if a.steps < 1:
        p.error("--steps must be >= 1")
    report({m: run(m, a.steps, a.seed, a.eval_every) for m in ("trainer", "sampler")}, a.steps)


def report(res, steps):
    """res: mode -> {step: metrics.csv row}. A table per step, then one summary line per mode."""
    cols = ("trained_ratio", "trained_ratio_max", "trained_clipfrac", "reward", "eval_acc")
    print("| step | " + " | ".join(f"{c} ({m})" for c in cols for m in res) + " |")
    print("|---" * (1 + 2 * len(cols)) + "|")
    for step in range(steps + 1):
        cell = lambda m, c: res[m].get(step, {}).get(c) or "-"  # noqa: E731
        print(f"| {step} | " + " | ".join(f"{float(cell(m, c)):.3g}" if cell(m, c) != "-" else "-"
                                          for c in cols for m in res) + " |")
    for m, rows in res.items():  # a step whose groups all tied trained on nothing: it has no ratio
        trained = [r for r in rows.values() if r.get("trained_ratio")]
        rewards = [float(r["reward"]) for r in rows.values() if r.get("reward")]
        evals = [float(r["eval_acc"]) for r in rows.values() if r.get("eval_acc")]
        ratio = statistics.mean(float(r["trained_ratio"]) for r in trained)
        print(f"{m}: {len(trained)} steps trained, mean ratio {ratio:.4f}, "
              f"max ratio {max(float(r['trained_ratio_max']) for r in trained):.3f}, mean clipfrac "
              f"{statistics.mean(float(r['trained_clipfrac']) for r in trained):.4f}, final eval_acc {evals[-1]:.3f}, "
              f"mean train reward over the last 10 steps {statistics.mean(rewards[-10:]):.3f}")


if __name__ == "__main__":
    main()
