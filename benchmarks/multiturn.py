"""Multi-turn, per-turn credit and tool use on SmolLM2-135M-Instruct, 2-core CPU, at equal wall time.
configs/arith_grpo_cpu.yaml (one reply), configs/arith_multiturn_cpu.yaml (a wrong reply is told so, up to
3 replies), configs/arith_multiturn_turn_cpu.yaml (the same with --credit turn), configs/calc_grpo_cpu.yaml
(a calculator tool), the same without the tool, and configs/calc_agent_cpu.yaml (the calculator task played by an
agent written against the OpenAI API, through flatrl's endpoint), configs/vf_calc_cpu.yaml (the same problems as a
verifiers environment: its taskset and its harness, tests/vf_calc.py) (--runs picks), each in a fresh process for --budget seconds (then Ctrl-C: the run saves and stops), held-out
greedy evaluation every --eval-every steps and at step 0 (before any update). Prints, per run: seconds per
step, generated tokens per step, and eval_acc / eval_acc_turn1 at equal wall times.

    HF_HUB_OFFLINE=1 python benchmarks/multiturn.py --budget 600 --seeds 0
    HF_HUB_OFFLINE=1 python benchmarks/multiturn.py --budget 600 --seeds 0 1 --runs multi-turn turn-credit
    HF_HUB_OFFLINE=1 python benchmarks/multiturn.py --budget 900 --seeds 0 1 --runs calc calc-no-tools
    HF_HUB_OFFLINE=1 python benchmarks/multiturn.py --budget 600 --seeds 0 1 --runs calc calc-agent
    HF_HUB_OFFLINE=1 python benchmarks/multiturn.py --budget 900 --seeds 0 --eval-every 5 --runs vf-calc
"""
import argparse
import csv
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = {"single-turn": ["--config", "configs/arith_grpo_cpu.yaml"],
        "multi-turn": ["--config", "configs/arith_multiturn_cpu.yaml"],
        "turn-credit": ["--config", "configs/arith_multiturn_turn_cpu.yaml"],
        "calc": ["--config", "configs/calc_grpo_cpu.yaml"],
        "calc-no-tools": ["--config", "configs/calc_grpo_cpu.yaml", "--max-tool-calls", "0"],
        "calc-agent": ["--config", "configs/calc_agent_cpu.yaml"],
        "vf-calc": ["--config", "configs/vf_calc_cpu.yaml"]}


def run(flags, seed, budget, eval_every, out):
    proc = subprocess.Popen([sys.executable, "train.py", *flags, "--seed", str(seed), "--steps", "1000",
                             "--eval-every", str(eval_every), "--out", out], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": "tests"},  # vf-calc's environment: tests/vf_calc.py
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,  # a job started with & ignores
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # Ctrl-C: undo that
    try:
        proc.wait(timeout=budget)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)  # Ctrl-C: the step in flight is dropped, a checkpoint saved
        proc.wait(timeout=600)
    with open(os.path.join(out, "metrics.csv")) as f:
        return [{k: float(v) for k, v in r.items() if v != ""} for r in csv.DictReader(f)]


def summary(rows, marks):
    trained = [r for r in rows if "reward" in r]
    times = [r["time_s"] for r in trained]
    evals = [r for r in rows if "eval_acc" in r]
    at = {}
    for m in marks:  # the last evaluation finished by wall time m
        done = [r for r in evals if r["time_s"] <= m]
        at[m] = done[-1] if done else None
    return {"steps": len(trained), "s_per_step": statistics.median(b - a for a, b in zip(times, times[1:])),
            "tokens_per_step": statistics.median(r["length"] * 32 for r in trained),  # 32 episodes a step
            "turns": statistics.mean(r.get("turns", 1.0) for r in trained), "evals": evals, "at": at, "trained": trained}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--budget", type=float, default=600, help="wall seconds per run")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--runs", nargs="+", default=["single-turn", "multi-turn"], choices=list(RUNS))
    a = p.parse_args()
    if a.budget < 120:
        p.error("--budget must be >= 120 s: loading the model and the step-0 evaluation take about a minute")
    marks = [a.budget * f for f in (0.25, 0.5, 0.75, 1.0)]
    for seed in a.seeds:
        res = {}
        with tempfile.TemporaryDirectory() as d:
            for name in a.runs:
                t = time.time()
                res[name] = summary(run(RUNS[name], seed, a.budget, a.eval_every, f"{d}/{name}"), marks)
                print(f"seed {seed} {name}: {res[name]['steps']} steps in {time.time() - t:.0f} s", flush=True)
                for r in res[name]["evals"]:
                    print(f"  step {r['step']:.0f} at {r['time_s']:.0f} s: eval_acc {r['eval_acc']:.3f}"
                          + "".join(f", {k} {r[k]:.3f}" for k in ("eval_acc_turn1", "eval_tool_use") if k in r))
                for r in res[name]["trained"]:
                    print(f"  step {r['step']:.0f}: reward {r['reward']:.3f}, turns {r.get('turns', 1):.2f}"
                          + "".join(f", {k} {r[k]:.2f}" for k in ("tool_calls", "tool_errors", "agent_errors", "rows_per_run") if k in r))
        print(f"\nseed {seed} | s/step (median) | generated tokens/step | replies/episode | "
              + " | ".join(f"eval_acc (turn 1) by {m:.0f} s" for m in marks))
        print("|---" * (4 + len(marks)) + "|")
        for name, s in res.items():
            cells = [f"{r['eval_acc']:.2f} ({r.get('eval_acc_turn1', r['eval_acc']):.2f})" if r else "-"
                     for r in s["at"].values()]
            print(f"| {name} | {s['s_per_step']:.1f} | {s['tokens_per_step']:.0f} | {s['turns']:.2f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
