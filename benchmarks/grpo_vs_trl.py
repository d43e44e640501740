"""flatrl vs TRL's GRPOTrainer on identical work, side by side in one run, alternating:
SmolLM2-135M-Instruct + LoRA r=16 (alpha 32, q/k/v/o/gate/up/down), arith prompts "What is a + b?
Reply with just the number." (the same 8 prompts per step for both, in order), reward 1 when the
first number of the reply is a + b, 4 completions per prompt, at most 32 new tokens, temperature 1,
no KL, one optimizer step per batch, AdamW (weight decay 0) lr 3e-4 constant, token-mean loss (TRL's "dapo" default).
Both train under bf16 autocast where the CPU has fast bf16 (AVX512-BF16 or AMX; TRL's default is bf16
everywhere, which an AVX2 CPU only emulates, so TRL is given flatrl's rule), fp32 elsewhere. TRL keeps its
other defaults except gradient checkpointing, turned off so that it does not pay for memory it does
not need here (pass --trl-grad-ckpt for its default). flatrl samples with its HF decode loop, or with vLLM
(--generator vllm, the adapter merged into its weights), or both (--generator hf vllm). Per-step times
are printed as well as medians: as groups start to differ (fewer zero-variance rows skipped) flatrl's
steps grow, so a median over the first steps flatters it. For flatrl, a per-step table splits each step
(generation, scoring + update, publishing) and sets it against its compute floor: the step's FLOPs
(train.forward_flops) at the device's measured matmul peak.

    pip install trl && python .ci/cache_smollm2.py
    HF_HUB_OFFLINE=1 python benchmarks/grpo_vs_trl.py --steps 12 --rounds 2 --generator hf vllm
    HF_HUB_OFFLINE=1 python benchmarks/grpo_vs_trl.py --steps 12 --rounds 2 --generator vllm --against REV  # a change
    HF_HUB_OFFLINE=1 python benchmarks/grpo_vs_trl.py --steps 12 --rounds 2 --generator vllm --against REV --no-trl

Time to accuracy: the whole command's seconds (from its first line, imports included) until greedy accuracy on
the preset's 32 held-out prompts first reaches 0.8, both evaluated every 5 steps (TRL through a callback, on
the same prompts, greedy, 32 new tokens), per seed; each run stops there (at most --steps steps):

    HF_HUB_OFFLINE=1 python benchmarks/grpo_vs_trl.py --to-acc 0.8 --eval-every 5 --steps 40 --seeds 0 1 --generator hf vllm

--to-acc 0 stops each run at its step-0 evaluation: start-up's seconds (imports, models, the first greedy evaluation);
with --against REV, revision REV's flatrl runs too, in the same turns (a start-up change):

    HF_HUB_OFFLINE=1 python benchmarks/grpo_vs_trl.py --to-acc 0 --seeds 0 1 2 3 4 --generator vllm hf --against HEAD
"""
import argparse
import atexit
import contextlib
import csv
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"

TRL = """
import time
T0 = time.time()  # from the first line, imports included (train.py's clock starts in main())
import json, sys
sys.path.insert(0, {root!r})
import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer
from config import Config
from tasks import Arith, numeric_match
from utils import fast_bf16

steps, seed, ckpt, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4]
eval_every, target = int(sys.argv[5]), float(sys.argv[6])  # 0: no evaluation
cfg = Config(task="arith", digits=1, ops="+", batch_size=32, group_size=4, n_eval=32, seed=seed)
task = Arith(cfg)
rows = [{{"prompt": [{{"role": "user", "content": q}}], "answer": a}}  # flatrl's prompts, in its order
        for step in range(steps) for q, a in task.train_problems(step)]

def reward(completions, answer, **kw):
    return [numeric_match(None, c[0]["content"], a) for c, a in zip(completions, answer)]

times, rewards, evals = [], [], []
class Clock(TrainerCallback):  # greedy accuracy on flatrl's held-out prompts, as flatrl evaluates them
    def evaluate(self, model, tok, step, control):
        model.eval()
        tok.padding_side = "left"
        chats = [[{{"role": "user", "content": task.build_prompt(q)}}] for q, _ in task.eval_set]
        enc = tok.apply_chat_template(chats, add_generation_prompt=True, padding=True, return_tensors="pt", return_dict=True)
        with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled=fast_bf16("cpu")):
            ids = model.generate(**enc, max_new_tokens=32, do_sample=False)
        texts = tok.batch_decode(ids[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        acc = sum(numeric_match(None, t, a) for t, (_, a) in zip(texts, task.eval_set)) / len(texts)
        evals.append((step, time.time() - T0, acc))
        model.train()
        control.should_training_stop = acc >= target
    def on_train_begin(self, args, state, control, model=None, processing_class=None, **kw):
        if eval_every:
            self.evaluate(model, processing_class, 0, control)
    def on_step_end(self, args, state, control, model=None, processing_class=None, **kw):
        times.append(time.time())
        if eval_every and state.global_step % eval_every == 0:
            self.evaluate(model, processing_class, state.global_step, control)
    def on_log(self, args, state, control, logs=None, **kw):
        if logs and "reward" in logs:
            rewards.append(logs["reward"])

args = GRPOConfig(output_dir=out, per_device_train_batch_size=32, num_generations=4, max_completion_length=32,
                  temperature=1.0, beta=0.0, num_iterations=1, learning_rate=3e-4, lr_scheduler_type="constant",
                  warmup_steps=0, max_grad_norm=1.0, max_steps=steps, logging_steps=1, save_strategy="no",
                  report_to=[], shuffle_dataset=False, seed=seed, use_cpu=True, gradient_checkpointing=ckpt,
                  bf16=fast_bf16("cpu"))
peft = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                  target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
trainer = GRPOTrainer(model={model!r}, reward_funcs=reward, args=args, train_dataset=Dataset.from_list(rows),
                      peft_config=peft, callbacks=[Clock()])
t0 = time.time()
trainer.train()
step_s = [b - a for a, b in zip([t0] + times[:-1], times)]
print("RESULT " + json.dumps({{"step_s": step_s, "reward": rewards, "evals": evals}}))
"""


def tree_at(rev, into):
    """Git revision rev's files (git archive), extracted into the folder `into`: its code and its presets, to run
    beside this checkout's (benchmarks/update.py --against too). -> into"""
    os.makedirs(into, exist_ok=True)
    archive = subprocess.run(["git", "-C", ROOT, "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", into], input=archive, check=True)
    return into


def run_flatrl(steps, seed, generator, root=ROOT):
    with tempfile.TemporaryDirectory() as d:
        cmd = [sys.executable, "train.py", "--config", "configs/arith_grpo_cpu.yaml", "--steps", str(steps),
               "--eval-every", "0", "--seed", str(seed), "--generator", generator, "--out", d]
        subprocess.run(cmd, cwd=root, check=True, capture_output=True)
        with open(f"{d}/metrics.csv") as f:
            rows = [r for r in csv.DictReader(f) if r["reward"]]
    t = [float(r["time_s"]) for r in rows]
    col = lambda k: [float(r[k] or 0) for r in rows[1:]]  # noqa: E731  the steps step_s covers (blank: trained nothing)
    return {"step_s": [b - a for a, b in zip(t, t[1:])], "reward": [float(r["reward"]) for r in rows],
            **{k: col(k) for k in ("gen_s", "score_s", "update_s", "publish_s", "gen_mfu", "train_mfu",
                                   "gen_tok_s", "train_tok_s")}}


def flatrl_to(target, every, steps, seed, generator, root=ROOT):
    """Whole-command seconds (train.py's clock, from its first line) until held-out eval_acc first reaches
    `target`, evaluating every `every` steps; the run is stopped there. -> (seconds or None, [(step, s, acc)])
    A step's row is logged after its training, which follows its evaluation: the evaluation ended at the row's
    time_s less that step's phases (TRL's clock, too, is read as its evaluation ends)."""
    with tempfile.TemporaryDirectory() as d:
        cmd = [sys.executable, "train.py", "--config", "configs/arith_grpo_cpu.yaml", "--steps", str(steps), "--eval-every",
               str(every), "--seed", str(seed), "--generator", generator, "--out", d]
        phases = lambda r: sum(float(r.get(k) or 0) for k in ("rollout_s", "score_s", "update_s", "publish_s"))  # noqa: E731
        proc, evals = subprocess.Popen(cmd, cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True), []
        while proc.poll() is None and not (evals and evals[-1][2] >= target):
            time.sleep(0.5)
            if os.path.exists(f"{d}/metrics.csv"):
                with open(f"{d}/metrics.csv") as f:
                    evals = [(int(r["step"]), float(r["time_s"]) - phases(r), float(r["eval_acc"]))
                             for r in csv.DictReader(f) if r.get("eval_acc")]
        with contextlib.suppress(ProcessLookupError):  # (none left: it ran all its steps without reaching target)
            os.killpg(proc.pid, signal.SIGKILL)  # vLLM's engine processes too
        proc.wait()
    return next((t for _, t, acc in evals if acc >= target), None), evals


def time_to_accuracy(a, then=None):
    """Per seed, in turn: flatrl (each generator; and at revision a.against, its tree `then`), then TRL, each until
    held-out accuracy first reaches a.to_acc (--to-acc 0: the seconds to the step-0 evaluation, start-up's)."""
    res = {}
    for seed in a.seeds:
        for g in a.generator:
            res.setdefault(f"flatrl ({g})", []).append(flatrl_to(a.to_acc, a.eval_every, a.steps, seed, g))
            if then:
                res.setdefault(f"flatrl ({g}) at {a.against}", []).append(
                    flatrl_to(a.to_acc, a.eval_every, a.steps, seed, g, then))
        trl = run_trl(a.steps, seed, a.trl_grad_ckpt, a.eval_every, a.to_acc)["evals"]
        res.setdefault("TRL GRPOTrainer", []).append((next((t for _, t, acc in trl if acc >= a.to_acc), None), trl))
        for k, v in res.items():
            print(f"seed {seed} {k}: {v[-1][0]} s; evaluations (step, s, acc): "
                  f"{[(s, round(t), round(acc, 2)) for s, t, acc in v[-1][1]]}", flush=True)
    ours = [k for k in res if k.startswith("flatrl")]
    print(f"\n| seed | " + " | ".join(res) + " | " + " | ".join(f"{k} vs TRL" for k in ours) + " |")
    print("|---" * (1 + len(res) + len(ours)) + "|")
    fmt = lambda t: f"{t:.0f} s" if t is not None else f"not within {a.steps} steps"  # noqa: E731
    ratio = lambda t, trl: t / trl if t and trl else None  # noqa: E731
    for i, seed in enumerate(a.seeds):
        trl = res["TRL GRPOTrainer"][i][0]
        ratios = [ratio(res[k][i][0], trl) for k in ours]
        print(f"| {seed} | " + " | ".join(fmt(v[i][0]) for v in res.values()) + " | "
              + " | ".join(f"{x:.2f}x" if x else "-" for x in ratios) + " |")
    if len(a.seeds) > 2:  # medians over the seeds that got there (a run that did not is left out: it flatters)
        med = lambda xs, unit: f"{statistics.median(xs):.2f}{unit}" if xs else "-"  # noqa: E731
        print("| median | " + " | ".join(med([t for t, _ in v if t is not None], " s") for v in res.values()) + " | "
              + " | ".join(med([x for i in range(len(a.seeds)) if (x := ratio(res[k][i][0], res["TRL GRPOTrainer"][i][0]))], "x")
                           for k in ours) + " |")


def floor_table(name, runs):
    """Per step (mean over rounds): where the seconds went, MFU, and the compute floor: the step's FLOPs at
    the device's peak (gen_mfu x gen_s + train_mfu x (score_s + update_s); publishing computes ~nothing)."""
    mean = lambda k: [statistics.mean(x) for x in zip(*(r[k] for r in runs))]  # noqa: E731
    step, gen, score, upd, pub = mean("step_s"), mean("gen_s"), mean("score_s"), mean("update_s"), mean("publish_s")
    gmfu, tmfu = mean("gen_mfu"), mean("train_mfu")
    floor = [g * gm + (s + u) * tm for g, gm, s, u, tm in zip(gen, gmfu, score, upd, tmfu)]
    print(f"\n{name}: | step | s | gen s | score + update s | publish s | gen_mfu | train_mfu | floor s | s / floor |")
    print("|---" * 9 + "|")
    for i in range(len(step)):
        print(f"| {i + 2} | {step[i]:.2f} | {gen[i]:.2f} | {score[i] + upd[i]:.2f} | {pub[i]:.2f} | {gmfu[i]:.1%} | "
              f"{tmfu[i]:.1%} | {floor[i]:.2f} | {step[i] / floor[i]:.1f}x |")
    print(f"median: {statistics.median(step):.2f} s/step, floor {statistics.median(floor):.2f} s, gen_mfu "
          f"{statistics.median(gmfu):.1%}, train_mfu {statistics.median(tmfu):.1%}")


def run_trl(steps, seed, ckpt, eval_every=0, target=1.0):
    with tempfile.TemporaryDirectory() as d:
        code = TRL.format(root=ROOT, model=MODEL)
        out = subprocess.run([sys.executable, "-c", code, str(steps), str(seed), str(int(ckpt)), d, str(eval_every),
                              str(target)], cwd=ROOT, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    res = json.loads(out.stdout.split("RESULT ")[-1])
    res["step_s"] = res["step_s"][1:]  # the first step also pays for TRL's lazy set-up
    return res


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--generator", nargs="+", default=["hf"], choices=["hf", "vllm"])
    p.add_argument("--trl-grad-ckpt", action="store_true")
    p.add_argument("--no-trl", action="store_true", help="flatrl alone: with --against, two revisions side by side")
    p.add_argument("--against", metavar="REV", help="also run flatrl at git revision REV, in the same rounds")
    p.add_argument("--to-acc", type=float, help="instead: seconds until held-out accuracy first reaches this, per seed")
    p.add_argument("--eval-every", type=int, default=5, help="with --to-acc: evaluate every N steps, both alike")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="with --to-acc")
    a = p.parse_args()
    if a.steps < 3 or a.rounds < 1 or a.eval_every < 1:
        p.error("--steps must be >= 3, --rounds and --eval-every >= 1")
    then = a.against and tree_at(a.against, tempfile.mkdtemp(prefix="flatrl-then-"))  # REV's code and preset
    if then:
        atexit.register(shutil.rmtree, then, True)
    if a.to_acc is not None:
        return time_to_accuracy(a, then)
    runs = {f"flatrl ({g})": lambda g=g: run_flatrl(a.steps, a.seed, g) for g in a.generator}
    if a.against:  # the same runs with revision REV's code (and preset), in the same rounds
        runs.update({f"flatrl ({g}) at {a.against}": lambda g=g: run_flatrl(a.steps, a.seed, g, then) for g in a.generator})
    if not a.no_trl:
        runs["TRL GRPOTrainer"] = lambda: run_trl(a.steps, a.seed, a.trl_grad_ckpt)
    res = {k: [] for k in runs}
    for r in range(a.rounds):  # alternate: each contender once per round
        for k, run in runs.items():
            res[k].append(run())
            print(f"round {r} {k}: s/step {[round(x, 1) for x in res[k][-1]['step_s']]}", flush=True)
    med = {k: statistics.median(s for run in v for s in run["step_s"]) for k, v in res.items()}
    last = {k: statistics.mean(x for run in v for x in run["reward"][-3:]) for k, v in res.items()}
    first = {k: statistics.mean(x for run in v for x in run["reward"][:3]) for k, v in res.items()}
    base = next(iter(res)) if a.no_trl else "TRL GRPOTrainer"  # what the ratios are against
    print(f"\n| | s/step (median) | vs {base} | train reward, first 3 steps | train reward, last 3 of {a.steps} |")
    print("|---|---|---|---|---|")
    for k in res:
        print(f"| {k} | {med[k]:.2f} | {med[k] / med[base]:.2f}x | {first[k]:.3f} | {last[k]:.3f} |")
    for k in res:  # per step, the mean over rounds
        print(f"{k} s/step by step:", [round(statistics.mean(s), 1) for s in zip(*(run["step_s"] for run in res[k]))])
        print(f"{k} reward by step:", [round(statistics.mean(s), 3) for s in zip(*(run["reward"] for run in res[k]))])
        if "gen_tok_s" in res[k][0]:
            print(f"{k}: generation {statistics.median(x for run in res[k] for x in run['gen_tok_s']):.0f} tok/s, "
                  f"training {statistics.median(x for run in res[k] for x in run['train_tok_s'] if x):.0f} tok/s")
    for k in res:
        if "gen_mfu" in res[k][0]:
            floor_table(k, res[k])


if __name__ == "__main__":
    main()
