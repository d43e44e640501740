"""Does reading the Python-style calls small models write (`to_minutes(259)`, model.python_call) make a new tool
task train? A tool task written as the README describes one, without a worked example in its prompt (SmolLM2-135M
sees the tool only in flatrl's system note, model.TOOL_NOTE), trained with GRPO on configs/calc_grpo_cpu.yaml's
settings, in two arms alternating by seed, each in a fresh process:

    reads-python   flatrl as it is: <tool_call> JSON, a first line `name: argument`, or `name(argument)`
    json-or-plain  python_call switched off: the first two forms only (flatrl before it)

Prints per step the training tool use and reward, and the held-out eval_acc / eval_tool_use every --eval-every.

    HF_HUB_OFFLINE=1 python benchmarks/tool_forms.py --steps 8 --seeds 0 --max-new-tokens 128
"""
import argparse
import csv
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARMS = ("reads-python", "json-or-plain")


def to_minutes(hours: int) -> int:
    """Convert hours to minutes.

    Args:
        hours: a whole number of hours
    """
    return int(hours) * 60


def run_arm(arm, argv):
    """In this process: register the task, switch the reader off for json-or-plain, train."""
    sys.path.insert(0, ROOT)
    import tasks
    import train

    class Minutes(tasks.ToolTask):  # the tool named in words alone: no worked example
        tools = [to_minutes]

        def problem(self, rng):
            hours = rng.randint(100, 999)
            return f"How many minutes are in {hours} hours? You can use the to_minutes tool.", hours * 60

    tasks.TASKS["minutes"] = Minutes
    if arm == "json-or-plain":
        tasks.python_call = lambda text, tools: None
    train.main(argv)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--eval-every", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)  # at 48, 81-94% of replies were cut: no call at all
    a = p.parse_args()
    for seed in a.seeds:
        for arm in ARMS if seed % 2 == 0 else ARMS[::-1]:
            with tempfile.TemporaryDirectory() as d:
                flags = ["--config", "configs/calc_grpo_cpu.yaml", "--task", "minutes", "--steps", str(a.steps),
                         "--max-new-tokens", str(a.max_new_tokens), "--max-episode-tokens", "0",
                         "--eval-every", str(a.eval_every), "--seed", str(seed), "--out", d]
                subprocess.run([sys.executable, __file__, "--arm", arm, *flags], cwd=ROOT, check=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                with open(os.path.join(d, "metrics.csv")) as f:
                    rows = list(csv.DictReader(f))
            print(f"seed {seed} {arm}, --max-new-tokens {a.max_new_tokens}:")
            for r in rows:
                if r.get("eval_acc"):
                    print(f"  step {r['step']} held out: eval_acc {float(r['eval_acc']):.3f}, eval_tool_use "
                          f"{float(r['eval_tool_use']):.3f}")
            trained = [r for r in rows if r.get("reward")]
            print("  training tool_use by step: " + " ".join(f"{float(r['tool_use']):.2f}" for r in trained))
            print("  training reward by step:   " + " ".join(f"{float(r['reward']):.2f}" for r in trained))
            cut = " ".join(f"{float(r['truncated']):.2f}" for r in trained)
            print(f"  replies cut, by step:      {cut}", flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--arm"]:  # the child: train.py's flags follow the arm
        run_arm(sys.argv[2], sys.argv[3:])
    else:
        main()
