"""Which of reasoning-gym's graders evaluate the reply as code, found by trying, not from a list: each dataset's
score_answer gets replies that, if evaluated by Python (eval, exec, sympy's parser), set a flag; a dataset whose
grader set it evaluates model text. flatrl grades every dataset in a child (tasks.Graders) all the same; this says
which datasets need it. Also which graders give partial credit (a score between 0 and 1 for a near miss of the
answer: tasks.near_misses), and the cost of one reply's grading in-process and in the child.

    python benchmarks/rg_graders.py            # every dataset: which evaluate text, which give partial credit
    python benchmarks/rg_graders.py --cost     # seconds per reply: in-process vs tasks.Graders, on rg:syllogism
    HF_HUB_OFFLINE=1 python benchmarks/rg_graders.py --steps 10 --rounds 2 --against REV  # the rg preset's step,
                                               # this checkout and revision REV (graded in-process) alternating
"""
import argparse
import builtins
import csv
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

PROBE = "__import__('builtins').__setattr__('flatrl_probe', 1)"
FORMS = [PROBE, f"[{PROBE}]", f"{PROBE} or 1", f"({PROBE}) + 1", f"{{{PROBE}}}", f"x = {PROBE}", f"[{PROBE}, 1]",
         f"{PROBE}, {PROBE}", f"[[{PROBE}]]", f"{PROBE} = 0", f"x**2 + {PROBE}", f"{PROBE}\n{PROBE}", f"({PROBE},)"]


def evaluates_text(data, entry):
    """-> the first reply form the grader evaluated, or None."""
    for form in FORMS:
        builtins.flatrl_probe = 0
        signal.alarm(10)
        try:
            data.score_answer(form, entry)
        except BaseException:  # a grader that trips over the reply (or the alarm) did not score it
            pass
        finally:
            signal.alarm(0)
        if builtins.flatrl_probe:
            return form
    return None


def partial_credit(data, n):
    """-> the scores between 0 and 1 the grader gave near misses of items 0..n-1's answers (tasks.near_misses, as a
    run's opening line checks), sorted."""
    from tasks import near_misses
    seen = set()
    for entry in (data[i] for i in range(n)):
        for reply in near_misses(entry["answer"]):
            signal.alarm(10)
            try:
                score = data.score_answer(reply, entry)
            except BaseException:
                score = 0.0
            finally:
                signal.alarm(0)
            if 0 < score < 1:
                seen.add(round(score, 3))
    return sorted(seen)


def which():
    import reasoning_gym
    signal.signal(signal.SIGALRM, lambda *_: (_ for _ in ()).throw(TimeoutError()))
    evaluated, clean, skipped, partial = [], [], [], []
    for name in sorted(reasoning_gym.factory.DATASETS):
        try:
            data = reasoning_gym.create_dataset(name, seed=0, size=8)
            entry = data[0]
        except Exception as e:  # composite datasets need a config of their own
            skipped.append(f"{name} ({type(e).__name__})")
            continue
        form, scores = evaluates_text(data, entry), partial_credit(data, 8)
        (evaluated if form else clean).append(name)
        if scores:
            partial.append(name)
        print(f"{name:32s} {'EVALUATES TEXT: ' + form if form else 'no':40s} partial credit: "
              f"{' '.join(map(str, scores)) or 'none seen'}", flush=True)
    print(f"\n{len(evaluated)} of {len(evaluated) + len(clean)} datasets evaluate the reply: {', '.join(evaluated)}")
    print(f"{len(partial)} give near misses partial credit: {', '.join(partial)}")
    print(f"not built without a config of their own: {', '.join(skipped) or 'none'}")


def cost(n=128):
    import reasoning_gym

    from tasks import Graders
    data = reasoning_gym.create_dataset("syllogism", seed=0, size=n)
    replies = [("Yes" if i % 2 else "No", i, data[i]["question"]) for i in range(n)]
    graders = Graders("syllogism", {"seed": 0, "size": n})
    graders.score(*replies[0])  # the child's start-up (imports, the dataset) once, outside the timing
    rows = []
    for r in range(3):  # alternating, per-reply seconds
        t = time.perf_counter()
        inside = [data.score_answer(a, data[i]) for a, i, _ in replies]
        t_in = (time.perf_counter() - t) / n
        t = time.perf_counter()
        child = [graders.score(*reply) for reply in replies]
        t_child = (time.perf_counter() - t) / n
        assert inside == child, "the child must grade exactly as the dataset does"
        rows.append((t_in, t_child))
        print(f"round {r}: in-process {t_in * 1e3:.3f} ms/reply, child {t_child * 1e3:.2f} ms/reply", flush=True)
    print(f"median: in-process {statistics.median(x for x, _ in rows) * 1e3:.3f} ms, child "
          f"{statistics.median(y for _, y in rows) * 1e3:.2f} ms per reply; a step of 32 replies: "
          f"{32 * statistics.median(y for _, y in rows):.2f} s")


def preset_steps(root, steps):
    """configs/rg_syllogism_cpu.yaml for `steps` steps, no evaluation, in the tree `root` -> its per-step seconds
    (time_s differences, so the step's whole cost) and rollout_s (sampling and grading)."""
    with tempfile.TemporaryDirectory() as d:
        cmd = [sys.executable, "train.py", "--config", "configs/rg_syllogism_cpu.yaml", "--steps", str(steps),
               "--eval-every", "0", "--out", d]
        subprocess.run(cmd, cwd=root, check=True, capture_output=True)
        with open(f"{d}/metrics.csv") as f:
            rows = [r for r in csv.DictReader(f) if r["reward"]]
    t = [float(r["time_s"]) for r in rows]
    return [b - a for a, b in zip(t, t[1:])], [float(r["rollout_s"]) for r in rows[1:]]


def steps_against(rev, steps, rounds):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from grpo_vs_trl import tree_at
    trees = {"this checkout": ROOT, rev: tree_at(rev, tempfile.mkdtemp(prefix="flatrl-then-"))}
    res = {name: ([], []) for name in trees}
    for r in range(rounds):
        for name, root in (trees.items() if r % 2 == 0 else reversed(trees.items())):  # alternating who goes first
            step_s, rollout_s = preset_steps(root, steps)
            res[name][0].extend(step_s)
            res[name][1].extend(rollout_s)
            print(f"round {r} {name}: step_s {' '.join(f'{x:.2f}' for x in step_s)}; rollout_s "
                  f"{' '.join(f'{x:.2f}' for x in rollout_s)}", flush=True)
    med = {name: (statistics.median(a), statistics.median(b)) for name, (a, b) in res.items()}
    for name, (a, b) in med.items():
        print(f"{name}: median step {a:.2f} s, median rollout_s {b:.2f} s")
    print(f"ratio (this checkout / {rev}): step {med['this checkout'][0] / med[rev][0]:.3f}, "
          f"rollout {med['this checkout'][1] / med[rev][1]:.3f}")


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    ap = argparse.ArgumentParser()
    ap.add_argument("--cost", action="store_true")
    ap.add_argument("--against", metavar="REV", help="the rg preset's step here and at git revision REV")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    steps_against(a.against, a.steps, a.rounds) if a.against else cost() if a.cost else which()
