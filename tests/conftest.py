"""Shared fixtures: a tiny Llama and a character-level tokenizer, built in-process (no network)."""
import os
import signal
import string

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the suite never needs the hub; unreachable, each load would retry it
# A suite started in the background (`pytest &` in a script) inherits SIGINT ignored, and so would every process it
# starts: the Ctrl-C tests' workers would never stop. Handled here, it is reset to the default in each child.
signal.signal(signal.SIGINT, signal.default_int_handler)
SMOL = "HuggingFaceTB/SmolLM2-135M-Instruct"

if os.environ.get("FLATRL_TEST_FORK"):  # test_config's fork test: the tests again, as a fork with its own additions
    import algos
    import tasks

    class Fork(tasks.Arith):
        rewards = [*tasks.Arith.rewards, (0.1, tasks.format_reward)]

    tasks.TASKS["fork"] = Fork
    algos.ADVANTAGES["fork_rloo"] = algos.rloo


def pytest_collection_modifyitems(items):
    """A test that builds a language model is marked llm: bf16 autocast and the sampler's dtype follow what flatrl
    decides from the CPU (utils.fast_bf16), so .ci/run runs these again with the other answer forced."""
    for item in items:
        if "tiny_llm" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.llm)


def smol_cached():
    """Is SmolLM2 in the Hugging Face cache (wherever HF_HOME / HF_HUB_CACHE put it)?"""
    from huggingface_hub import try_to_load_from_cache
    return isinstance(try_to_load_from_cache(SMOL, "config.json"), str)


needs_smol = pytest.mark.skipif(not smol_cached(), reason='SmolLM2 not cached: python .ci/cache_smollm2.py')

SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>"]
CHARS = list(string.ascii_letters + string.digits + " +-*/()<>=?.,:\n")
STOPS = list("xyzXYZ")  # extra stop tokens the "hub" generation config declares


def make_tiny_llm(path, seed=0):
    import torch
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL + CHARS)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                                  unk_token="<unk>")
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'user' %}Q: {{ m['content'] }}\n"
                         "{% else %}A:{{ m['content'] }}<eos>\n{% endif %}{% endfor %}{% if add_generation_prompt %}A:{% endif %}")
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      pad_token_id=0, eos_token_id=1, bos_token_id=2, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    # A hub config with sampling knobs that would bias the sampler if they leaked into generate().
    model.generation_config = GenerationConfig(eos_token_id=[1] + [vocab[c] for c in STOPS], pad_token_id=0,
                                               bos_token_id=2, do_sample=True, top_k=3, top_p=0.5,
                                               repetition_penalty=1.8, temperature=0.3)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_llm(tmp_path_factory):
    return make_tiny_llm(tmp_path_factory.mktemp("tiny_llm"))


# --- Ctrl-C at a chosen moment of a step, in-process ---------------------------------------------

def ctrl_c_during(monkeypatch, moment, step, presses=1):
    """Make train.main receive real SIGINTs during step `step` (once: a resume runs on undisturbed): after its
    evaluation, after its rollout's draws, or before the first optimizer step of its update."""
    import time

    import torch
    import train
    state, build, adamw_step = {"armed": False, "fired": False}, train.build, torch.optim.AdamW.step

    def ctrl_c():
        if not state["fired"]:
            state["fired"] = True
            for _ in range(presses):
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)  # the handler runs before the next press (two pending SIGINTs would be one)

    def after(fn, phase):
        def wrapped(policy, at):
            out = fn(policy, at)
            state["armed"] = at == step and moment == "update"
            if at == step and phase == moment:
                ctrl_c()
            return out
        return wrapped

    def patched_build(cfg):
        task, policy = build(cfg)
        task.rollout, task.evaluate = after(task.rollout, "rollout"), after(task.evaluate, "evaluate")
        return task, policy

    def stepping(self, *args, **kwargs):
        if state["armed"]:
            ctrl_c()
        return adamw_step(self, *args, **kwargs)

    monkeypatch.setattr(train, "build", patched_build)
    monkeypatch.setattr(torch.optim.AdamW, "step", stepping)


def same_run(a, b):
    """The two run folders hold the same weights, optimizer and RNG states, and the same metrics but for clocks."""
    import csv
    import torch
    from safetensors.torch import load_file
    ta, tb = load_file(os.path.join(a, "checkpoint.safetensors")), load_file(os.path.join(b, "checkpoint.safetensors"))
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)

    def rows(run):
        with open(os.path.join(run, "metrics.csv")) as f:
            return [{k: v for k, v in r.items() if not (k.endswith("_s") or "mfu" in k)} for r in csv.DictReader(f)]
    assert rows(a) == rows(b)
