"""The async transport's cost, in-process over loopback: bytes on the wire per publish against the
full model, publish latency (serialize on the trainer + transfer + load on the worker, LoRA merged
into its sampler), the rollout POST (serialize + transfer + validate), and their sum as a fraction of
a measured training step. SmolLM2-135M-Instruct + LoRA r=16 (all projections) and a tiny Llama.

    python .ci/cache_smollm2.py
    HF_HUB_OFFLINE=1 python benchmarks/async_transport.py --repeats 5
"""
import argparse
import os
import statistics
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

import torch  # noqa: E402
from safetensors.torch import load as st_load  # noqa: E402

from config import Config  # noqa: E402
from model import HFPolicy  # noqa: E402
from serve import AsyncSource, pack_batch  # noqa: E402
from tasks import Arith  # noqa: E402
from utils import Logger  # noqa: E402


def timed(fn, repeats):
    out, times = None, []
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return out, statistics.median(times)


def measure(name, model, repeats, step_s=None, wire="bfloat16"):
    d = tempfile.mkdtemp()
    cfg = Config(task="arith", model=model, algo="grpo", batch_size=32, group_size=4, max_new_tokens=32,
                 n_eval=32, lora_r=16, lora_alpha=32, role="trainer", port=0, out=d, wire_dtype=wire)
    trainer = HFPolicy(cfg)
    source = AsyncSource(Arith(cfg), trainer, cfg, Logger(d, 0, 1), version=0)
    worker_cfg = Config(**{**cfg.__dict__, "role": "rollout"})
    worker, task = HFPolicy(worker_cfg), Arith(worker_cfg)
    url = f"http://127.0.0.1:{source.server.server_port}/weights?have=-1"
    full = sum(p.numel() * p.element_size() for p in trainer.lm.base_model.model.parameters() if not p.requires_grad)

    _, serialize = timed(lambda: source.publish(1), repeats)
    blob, transfer = timed(lambda: urllib.request.urlopen(url).read(), repeats)
    _, load = timed(lambda: (worker.load_state_dict(st_load(blob), strict=False), worker.publish()), repeats)
    batch = task.rollout(worker, step=0)  # a real rollout batch, with the worker's sampler logprobs
    batch.version = 1
    body = pack_batch(batch, "bench")

    def post():
        req = urllib.request.Request(f"http://127.0.0.1:{source.server.server_port}/rollouts", data=body)
        urllib.request.urlopen(req).read()
        source.hub.queue.clear()
    _, push = timed(post, repeats)
    publish = serialize + transfer + load
    same = full * getattr(torch, wire).itemsize / 4  # the full model in the wire's dtype
    print(f"| {name} | {wire} | {len(blob) / 2**20:.2f} MiB | {full / 2**20:.0f} MiB | {100 * len(blob) / full:.2f}% | "
          f"{100 * len(blob) / same:.2f}% | "
          f"{1000 * serialize:.0f} + {1000 * transfer:.0f} + {1000 * load:.0f} = {1000 * publish:.0f} ms | "
          f"{len(body) / 2**10:.0f} KiB, {1000 * push:.0f} ms | "
          + (f"{100 * (publish + push) / step_s:.1f}% of {step_s:.1f} s |" if step_s else "- |"), flush=True)
    source.hub.done = True
    source.server.shutdown()
    return trainer, task, cfg


def step_seconds(policy, task, cfg, n):
    """Median seconds of a sync training step (rollout + update) on the same setup."""
    import train
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=3e-4)
    times = []
    for step in range(n):
        t = time.perf_counter()
        batch = task.rollout(policy, step)
        train.score_old(policy, batch, cfg, "scored")
        batch.adv, _ = train.ADVANTAGES["grpo"](batch, cfg)
        train.update(policy, opt, batch, cfg, cfg.max_new_tokens, old_from=train.old_logp_from(cfg, batch))
        policy.publish()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=3)
    a = p.parse_args()
    from conftest import make_tiny_llm
    tiny = make_tiny_llm(tempfile.mkdtemp())
    print("| model | wire dtype | adapter on the wire | full model, fp32 | share of the fp32 model | share of the model in the wire dtype "
          "| publish: serialize + transfer + load | rollout POST | transport / step |\n|---|---|---|---|---|---|---|---|---|")
    measure("tiny Llama (r=16)", tiny, a.repeats)
    smol = "HuggingFaceTB/SmolLM2-135M-Instruct"
    policy, task, cfg = measure("SmolLM2-135M (r=16)", smol, a.repeats, wire="float32")
    sync_cfg = Config(**{**cfg.__dict__, "role": "sync"})
    step_s = step_seconds(HFPolicy(sync_cfg), Arith(sync_cfg), sync_cfg, a.steps)
    measure("SmolLM2-135M (r=16)", smol, a.repeats, step_s)
    print("\nOne serialization per publish: every worker is served the same bytes (hub.blob).")


if __name__ == "__main__":
    main()
