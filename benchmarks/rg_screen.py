"""Which reasoning-gym datasets can SmolLM2-135M-Instruct learn from? Before any training, per dataset (--task rg:NAME
with the config below): greedy held-out accuracy (a score of 1), and over 4 samples per prompt at the preset's
temperature: the share scoring 1, the mean score, and the share of groups whose scores differ (GRPO's signal: a
group that ties teaches nothing). 16 held-out prompts each, 32 new tokens.

    HF_HUB_OFFLINE=1 python benchmarks/rg_screen.py
    HF_HUB_OFFLINE=1 python benchmarks/rg_screen.py syllogism chain_sum
"""
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from config import Config  # noqa: E402
from model import HFPolicy  # noqa: E402
from tasks import task_class  # noqa: E402

DATASETS = {"chain_sum": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
            "basic_arithmetic": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
            "products": {"min_digits": 1, "max_digits": 1}, "gcd": {"max_value": 20},
            "leg_counting": {"min_animals": 1, "max_animals": 1, "max_instances": 2},
            "spell_backward": {"min_word_len": 3, "max_word_len": 3},
            "letter_counting": {"min_words": 3, "max_words": 4},
            "needle_haystack": {"min_num_statements": 2, "max_num_statements": 2},
            "syllogism": {}, "ransom_note": {}, "aiw": {}, "coin_flip": {}}


def main(names):
    policy = None
    for name in names or DATASETS:
        cfg = Config(task=f"rg:{name}", rg_config=json.dumps(DATASETS.get(name, {})), n_eval=16, batch_size=32,
                     group_size=4, max_new_tokens=32, temperature=0.7)
        task = task_class(cfg.task)(cfg)
        policy = policy or HFPolicy(cfg)
        t, held = time.time(), task.eval_set
        greedy = [ep.answer for ep in task.play(policy, held, 1, greedy=True)[1]]
        sampled = [ep.answer for ep in task.play(policy, held, 4)[1]]
        scores = [task.score(reply, held[i // 4][1]) for i, reply in enumerate(sampled)]
        groups = [scores[i:i + 4] for i in range(0, len(scores), 4)]
        right = sum(task.score(reply, entry) == 1 for reply, (_, entry) in zip(greedy, held)) / len(held)
        ones, mean = sum(s == 1 for s in scores) / len(scores), sum(scores) / len(scores)
        signal = sum(len(set(g)) > 1 for g in groups) / len(groups)
        print(f"{name:20s} greedy {right:.2f}  sampled: scoring 1 {ones:.3f}, mean {mean:.3f}, groups with signal "
              f"{signal:.2f}  e.g. {greedy[0][:50]!r} ({time.time() - t:.0f} s)", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
