"""CartPole-v1: wall seconds and steps to solve, per algorithm and seed, side by side with
stable-baselines3 PPO (default hyper-parameters) in the same run, alternating. Every timing is a whole
command in a fresh process, imports included; for flatrl also when `solved` was printed (read from its
unbuffered stdout as it happens) and what the command spent after it.

    pip install -e ".[bench]" && python benchmarks/cartpole.py --seeds 3
    python benchmarks/cartpole.py --seeds 5 --default-only   # the default command against SB3 and the import floor
    python benchmarks/cartpole.py --seeds 5 --stay [--workers 1]  # does it stay solved (sync, or async with a worker)
"""
import argparse
import csv
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALGOS = ["reinforce", "reinforce_baseline", "ppo", "grpo", "rloo"]

# SB3 PPO with its defaults, stopped by flatrl's rule: a greedy evaluation of 10 episodes reaching a mean
# return of 475, evaluated every rollout (2048 env steps, SB3's default n_steps).
SB3 = """
import sys
import gymnasium as gym
from stable_baselines3 import PPO
from stable_baselines3.common.callbacks import EvalCallback, StopTrainingOnRewardThreshold
model = PPO("MlpPolicy", "CartPole-v1", seed=int(sys.argv[1]), device="cpu")
stop = StopTrainingOnRewardThreshold(reward_threshold=475, verbose=0)
evaluate = EvalCallback(gym.make("CartPole-v1"), callback_on_new_best=stop, n_eval_episodes=10, eval_freq=2048,
                        deterministic=True, verbose=0)
model.learn(200_000, callback=evaluate)
print("env_steps", model.num_timesteps)
"""


def timed(cmd):
    """-> (wall s, stdout, seconds from the start until a line with 'solved at step' was printed, or None)."""
    t, seen, lines = time.time(), None, []
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    for line in proc.stdout:
        lines.append(line)
        if seen is None and "solved at step" in line:
            seen = time.time() - t
    if proc.wait():
        raise SystemExit(f"{cmd} failed (rerun it by hand to see why)")
    return time.time() - t, "".join(lines), seen


def flatrl(args, seed):
    """-> (wall s, env steps sampled for training or None if it did not solve, s until 'solved' was printed)."""
    with tempfile.TemporaryDirectory() as d:
        wall, out, seen = timed([sys.executable, "train.py", *args, "--seed", str(seed), "--out", d])
        batch = yaml.safe_load(open(f"{d}/config.yaml"))["batch_size"]
        with open(f"{d}/metrics.csv") as f:
            env_steps = sum(float(r["length"]) * batch for r in csv.DictReader(f) if r.get("length"))
    return wall, int(env_steps) if seen else None, seen


def stays_solved(seeds, steps, flags, workers=0):
    """--stay: the default command run on past solving (--no-stop-when-solved), greedy evaluation every 5 steps;
    per seed, the step and second of the first solve and the share of evaluations >= 475 in the 100 steps after.
    workers > 0: as a trainer (--role trainer) fed by that many rollout workers on loopback."""
    out, base = [], ["--task", "cartpole", "--algo", "reinforce", "--no-stop-when-solved", "--eval-every", "5", *flags]
    for seed in seeds:
        with tempfile.TemporaryDirectory() as d:
            cmd = [sys.executable, "train.py", *base, "--steps", str(steps), "--seed", str(seed), "--out", d]
            if workers:
                port = free_port()
                pool = [subprocess.Popen([sys.executable, "train.py", *base, "--seed", str(seed), "--role", "rollout",
                                          "--trainer-url", f"http://127.0.0.1:{port}", "--out", f"{d}/w{i}"], cwd=ROOT,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for i in range(workers)]
                cmd += ["--role", "trainer", "--port", str(port)]
            timed(cmd)
            for w in pool if workers else []:
                w.wait(120)
            with open(f"{d}/metrics.csv") as f:
                evals = [(int(r["step"]), float(r["time_s"]), float(r["eval_return"])) for r in csv.DictReader(f) if r.get("eval_return")]
        first = next(((s, t) for s, t, ret in evals if ret >= 475), None)
        after = [ret for s, _, ret in evals if first and first[0] < s <= first[0] + 100]
        share = sum(ret >= 475 for ret in after) / len(after) if after else None
        out.append((first, share))
        print(f"seed {seed} {' '.join(flags) or 'defaults'}{f' (async, {workers} worker)' if workers else ''}: first solved "
              f"{first}, share >= 475 after it {share} ({[round(r) for _, _, r in evals]})", flush=True)
    return out


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--no-sb3", action="store_true")
    p.add_argument("--default-only", action="store_true", help="only the default command (and SB3)")
    p.add_argument("--stay", action="store_true", help="instead: does the default command (plus any train.py flags "
                   "given after these) stay solved?")
    p.add_argument("--workers", type=int, default=0, help="with --stay: run it async, a trainer and this many workers")
    a, flags = p.parse_known_args()
    if a.stay:
        return stays_solved(range(a.seeds), 300, flags, a.workers)
    if flags:
        p.error(f"unrecognized arguments: {' '.join(flags)}")
    jobs = {"reinforce (default command)": ["--task", "cartpole", "--algo", "reinforce"]}
    jobs.update({algo: ["--config", f"configs/cartpole_{algo}.yaml"] for algo in ALGOS[1:] if not a.default_only})
    res = {name: [] for name in list(jobs) + ([] if a.no_sb3 else ["sb3 PPO"])}
    for seed in range(a.seeds):  # alternate: every contender once per seed, in turn
        for name, args in jobs.items():
            res[name].append(flatrl(args, seed))
            wall, steps, seen = res[name][-1]
            print(f"seed {seed} {name}: {wall:.2f} s, {steps} env steps" +
                  (f", solved printed at {seen:.2f} s, {wall - seen:.2f} s after it" if seen else ""), flush=True)
        if not a.no_sb3:
            wall, out, _ = timed([sys.executable, "-c", SB3, str(seed)])
            res["sb3 PPO"].append((wall, int(out.split()[-1]), None))
            print(f"seed {seed} sb3 PPO: {wall:.2f} s, {res['sb3 PPO'][-1][1]} env steps", flush=True)
    floor = statistics.median(timed([sys.executable, "-c", "import torch, gymnasium"])[0] for _ in range(3))
    print(f"import floor (python -c 'import torch, gymnasium', median of 3): {floor:.2f} s")
    sb3 = statistics.median(w for w, _, _ in res["sb3 PPO"]) if not a.no_sb3 else None
    print("\n| run | solved | wall s per seed | median wall s | solved printed at (median) | after it (median) | "
          "median env steps | wall vs SB3 PPO |\n|---|---|---|---|---|---|---|---|")
    for name, rows in res.items():
        walls, steps = [w for w, _, _ in rows], [s for _, s, _ in rows if s is not None]
        seen = [(s, w - s) for w, _, s in rows if s is not None]
        med = lambda xs, fmt=".2f": format(statistics.median(xs), fmt) if xs else "-"  # noqa: E731
        ratio = f"{statistics.median(walls) / sb3:.2f}x" if sb3 else "-"
        print(f"| {name} | {len(steps)}/{len(rows)} | {', '.join(f'{w:.1f}' for w in walls)} | {med(walls)} | "
              f"{med([s for s, _ in seen])} | {med([t for _, t in seen])} | {med(steps, '.0f')} | {ratio} |")


if __name__ == "__main__":
    main()
