"""How much of a language-model preset's held-out gain is format: each run in a fresh process for --budget seconds
(then Ctrl-C: the run saves and stops), greedy held-out evaluation every --eval-every steps and at step 0 (before
any update). Prints, per evaluation: eval_acc, the share of replies well-formed (the task found an answer in them,
right or wrong) and the accuracy among those, and the best constant answer's accuracy where the answers take few
values; per step, the same pair for the sampled replies. Then a table of step 0 against the last evaluation.

    HF_HUB_OFFLINE=1 python benchmarks/format_split.py --budget 300 --runs arith arith-ppo arith-rloo
    HF_HUB_OFFLINE=1 python benchmarks/format_split.py --budget 1200 --runs spell-backward --seeds 0 1 2
"""
import argparse
import json
import tempfile
import time

from multiturn import RUNS as PRESETS, run

RG = ["--config", "configs/rg_syllogism_cpu.yaml"]  # the rg preset's settings, another dataset
RUNS = {"arith": PRESETS["single-turn"], "arith-ppo": ["--config", "configs/arith_ppo_cpu.yaml"],
        "arith-rloo": ["--config", "configs/arith_rloo_cpu.yaml"], "multi-turn": PRESETS["turn-credit"],
        "calc": PRESETS["calc"], "calc-agent": PRESETS["calc-agent"], "syllogism": RG,
        "spell-backward": [*RG, "--task", "rg:spell_backward", "--rg-config", '{"min_word_len": 3, "max_word_len": 4}',
                           "--no-norm-std", "--max-new-tokens", "16"],
        "family": [*RG, "--task", "rg:family_relationships", "--rg-config",
                   '{"min_family_size": 3, "max_family_size": 4}', "--max-new-tokens", "16"],
        **{f"basic-arithmetic-{d}d": [*RG, "--task", "rg:basic_arithmetic", "--rg-config", json.dumps(
            {"min_terms": 2, "max_terms": 2, "min_digits": d, "max_digits": d, "operators": ops})]
           for d, ops in ((1, ["+", "-"]), (2, ["+"]))}}
KEYS = ("eval_acc", "eval_well_formed", "eval_acc_well_formed", "eval_best_constant")


def cell(row, key):
    return f"{row[key]:.2f}" if key in row else "-"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--budget", type=float, default=300, help="wall seconds per run")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--runs", nargs="+", default=["arith"], choices=list(RUNS))
    a = p.parse_args()
    table = []
    with tempfile.TemporaryDirectory() as d:
        for seed in a.seeds:
            for name in a.runs:
                t = time.time()
                rows = run(RUNS[name], seed, a.budget, a.eval_every, f"{d}/{name}-{seed}")
                evals = [r for r in rows if "eval_acc" in r]
                print(f"seed {seed} {name}: {sum('reward' in r for r in rows)} steps in {time.time() - t:.0f} s",
                      flush=True)
                for r in evals:
                    print(f"  step {r['step']:.0f} at {r['time_s']:.0f} s: "
                          + ", ".join(f"{k} {cell(r, k)}" for k in KEYS + ("eval_acc_turn1",) if k in r), flush=True)
                trained = [r for r in rows if "reward" in r]
                print("  per step, reward / well_formed / acc_well_formed: " + " ".join(
                    f"{r['reward']:.2f}/{cell(r, 'well_formed')}/{cell(r, 'acc_well_formed')}" for r in trained))
                table.append((name, seed, evals[0], evals[-1]))
    print("\n| run | seed | step 0: eval_acc / well-formed / acc among well-formed | last evaluation (step, s) | "
          "best constant |\n|---|---|---|---|---|")
    for name, seed, first, last in table:
        print(f"| {name} | {seed} | " + " / ".join(cell(first, k) for k in KEYS[:3])
              + f" | {' / '.join(cell(last, k) for k in KEYS[:3])} (step {last['step']:.0f}, {last['time_s']:.0f} s) | "
              + f"{cell(first, KEYS[3])} |")


if __name__ == "__main__":
    main()
