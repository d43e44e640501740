"""Async on one machine against sync: the README's async pair (a trainer and one rollout worker, its two
commands as written, default flags) against the sync preset, configs/arith_grpo_cpu.yaml, the same steps and
seed. Alternating, fresh processes each time. Per step, from the trainer's metrics.csv: the step (time_s
from one row to the next), generation (gen_s: in the worker, for async), the trainer's wait for a batch
(rollout_s), scoring, the update and publishing; the worker's publish (load) from its own metrics.csv.
Medians over steps 2..N (step 0 evaluates first; step 1 is the pair's warm-up: the first batch).
`--contended` adds the pair as it ran before the two shared the cores: `--threads <all cores>` on both,
each a thread per core, unpinned (one round: it is slow).

    HF_HUB_OFFLINE=1 python benchmarks/async_one_machine.py --rounds 2 --steps 10 --contended
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
PHASES = ("gen_s", "rollout_s", "score_s", "update_s", "publish_s")


def metrics(path):
    with open(path) as f:
        return [{k: float(v) for k, v in r.items() if v} for r in csv.DictReader(f) if r.get("reward")]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(contender, generator, steps, seed):
    """One run in fresh processes. -> {"step": [s per step 2..N], phase: [...], "worker_publish_s": [...]}"""
    with tempfile.TemporaryDirectory() as d:
        common = [sys.executable, "train.py", "--config", "configs/arith_grpo_cpu.yaml", "--eval-every", "0",
                  "--steps", str(steps), "--seed", str(seed), "--plot", "off"]
        log = open(f"{d}/log", "w+")  # a file, not a pipe: an unread pipe fills and blocks the process writing it
        quiet = dict(cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log,
                     preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        if contender == "sync":
            procs = [subprocess.Popen(common + ["--generator", generator, "--out", f"{d}/t"], **quiet)]
        else:
            port = free_port()
            threads = ["--threads", str(len(os.sched_getaffinity(0)))] if contender == "contended" else []
            trainer = ["--role", "trainer", "--port", str(port), "--out", f"{d}/t"]
            worker = ["--role", "rollout", "--generator", generator, "--trainer-url", f"http://127.0.0.1:{port}",
                      "--out", f"{d}/w"]
            procs = [subprocess.Popen(common + threads + args, **quiet) for args in (trainer, worker)]
        if any([p.wait() for p in procs]):  # every one waited for
            log.seek(0)
            raise SystemExit(f"{contender} failed:\n{log.read()[-3000:]}")
        rows = metrics(f"{d}/t/metrics.csv")
        out = {"step": [b["time_s"] - a["time_s"] for a, b in zip(rows[1:], rows[2:])]}  # step k: row k - row k-1
        out.update({k: [r.get(k, 0.0) for r in rows[2:]] for k in PHASES})
        if contender != "sync":
            out["worker_publish_s"] = [r["publish_s"] for r in metrics(f"{d}/w/metrics.csv")[2:]]
    return out


def med(values):
    return statistics.median(values) if values else float("nan")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--generator", default="hf", choices=("hf", "vllm"))
    p.add_argument("--contended", action="store_true")
    a = p.parse_args()
    if a.steps < 10:  # checked before minutes of work
        p.error("--steps must be >= 10: medians over >= 8 steps, after step 0's evaluation and the warm-up step")
    res = {"sync": [], "async": [], "contended": []}
    order = [c for _ in range(a.rounds) for c in ("sync", "async")] + ["contended"] * a.contended
    for i, c in enumerate(order):
        res[c].append(run(c, a.generator, a.steps, a.seed))
        r = res[c][-1]
        print(f"run {i} {c}: step {med(r['step']):.2f} s (per step: {' '.join(f'{s:.1f}' for s in r['step'])})",
              flush=True)
    sync = med([s for r in res["sync"] for s in r["step"]])
    print(f"\ngenerator {a.generator}, {a.steps} steps, seed {a.seed}, {len(os.sched_getaffinity(0))} cores; "
          "medians over all runs' steps 2..N\n")
    print("| run | step s | / sync | mean step s | generation (gen_s) | trainer waits (rollout_s) | score_s | update_s "
          "| publish_s | worker publish |\n|---|---|---|---|---|---|---|---|---|---|")
    for c, runs in res.items():
        if runs:
            pool = {k: [x for r in runs for x in r.get(k, [])] for k in ("step", *PHASES, "worker_publish_s")}
            step = med(pool["step"])
            mean = statistics.mean(pool["step"])  # throughput: a pipeline's steps alternate long and short
            print(f"| {c} ({len(runs)} run(s)) | {step:.2f} | {step / sync:.2f}x | {mean:.2f} | " +
                  " | ".join(f"{med(pool[k]):.2f}" for k in (*PHASES, "worker_publish_s")) + " |")


if __name__ == "__main__":
    main()
