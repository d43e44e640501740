"""Multi-turn episodes on a tiny in-process Llama: one token sequence per episode, environment tokens
masked out of everything, prefixes never re-tokenized, caps and early ends, the single-turn path intact."""
import csv
import dataclasses

import pytest
import torch

import train
from algos import pg_loss
from model import HFPolicy
from tasks import TASKS, Arith
from test_llm import Digits, llm_cfg


class Chatty(Arith):
    """Answers every reply (odd questions get no answer: their episodes end after one reply)."""

    def env_response(self, question, answer, turns):
        return None if int(question.split()[2]) % 2 else f"Turn {len(turns)} was wrong. Again."


class Silent(Digits):
    env_response = TASKS["arith"].__mro__[1].env_response  # LLMTask's: never answers


def episodes(tiny_llm, task=Chatty, seed=0, **kw):
    """A batch of episodes from the random tiny model: 1 in ~12 of its tokens is a stop token, so at 24 tokens
    per reply most replies end by themselves and the environment answers them."""
    cfg = llm_cfg(tiny_llm, **{"max_turns": 3, "max_new_tokens": 24, "batch_size": 16, **kw})
    policy, task = HFPolicy(cfg), task(cfg)
    torch.manual_seed(seed)
    batch, played = task.play(policy, task.train_problems(0), cfg.group_size)
    return policy, task, batch, [ep.chat for ep in played]


def test_an_episode_is_one_sequence_of_replies_and_environment_tokens(tiny_llm):
    import itertools
    policy, task, batch, chats = episodes(tiny_llm)
    P = batch.obs.shape[1] - batch.mask.shape[1]
    for i, chat in enumerate(chats):
        real = batch.attn[i, P:] > 0
        tail, mask = batch.obs[i, P:][real].tolist(), batch.mask[i][real].tolist()
        assert batch.mask[i][~real].sum() == 0
        runs = [(m, [t for t, _ in g]) for m, g in itertools.groupby(zip(tail, mask), key=lambda x: x[1])]
        assert len(runs) == len(chat)  # reply, message, reply, ...: one run of the mask each
        for (trained, ids), m in zip(runs, chat):
            if m["role"] == "assistant":  # the reply's ids as sampled
                assert trained == 1 and policy.tok.decode(ids, skip_special_tokens=True) == m["content"]
                last = ids[-1]
            else:  # the message as the chat template's ids, never trained on
                assert trained == 0 and ids == policy.env_ids(m["content"], last)
    turns = [sum(m["role"] == "assistant" for m in c) for c in chats]
    assert 1 in turns and 3 in turns  # odd questions end after one reply, the rest run to max_turns
    assert [m["content"] for m in chats[turns.index(3)] if m["role"] == "user"] == ["Turn 1 was wrong. Again.",
                                                                                  "Turn 2 was wrong. Again."]


def test_a_reply_that_stops_on_another_stop_id_still_follows_the_template(tiny_llm):
    # The tiny model's generation config stops on x, y, z, X, Y, Z besides the template's <eos> (conftest.STOPS),
    # as Qwen2.5 and Llama-3 instruct models have several stop ids.
    policy, task, batch, chats = episodes(tiny_llm, batch_size=32)
    eos, specials = policy.tok.eos_token_id, set(policy.tok.all_special_ids)
    P, checked, other_stop = batch.obs.shape[1] - batch.mask.shape[1], 0, 0
    for i, chat in enumerate(chats):
        q = task.train_problems(0)[i // task.cfg.group_size][0]
        ids = batch.obs[i][batch.attn[i] > 0].tolist()
        sampled = [t for t, m in zip(batch.obs[i, P:].tolist(), batch.mask[i].tolist()) if m]
        if len(chat) < 3 or specials & set(sampled) - {eos}:  # one reply, or a special token that decode() drops
            continue
        text = policy.tok.apply_chat_template([{"role": "user", "content": task.build_prompt(q)}] + chat[:-1],
                                              tokenize=False, add_generation_prompt=True)
        expected = policy.tok(text, add_special_tokens=False)["input_ids"]
        assert ids[:len(expected)] == expected  # every turn before the last: the template's own rendering
        checked += 1
        other_stop += any(m["role"] == "assistant" and m["content"][-1:] in "xyzXYZ" for m in chat[:-1])
    assert checked >= 3 and other_stop >= 1  # some earlier reply ended on x, y or z: the case this is about


def test_every_turn_extends_the_previous_ids_exactly(tiny_llm, monkeypatch):
    seen = []
    real = HFPolicy.sample
    monkeypatch.setattr(HFPolicy, "sample", lambda self, seqs, n, *a, **k: (seen.append([list(s) for s in seqs]),
                                                                             real(self, seqs, n, *a, **k))[1])
    policy, task, batch, chats = episodes(tiny_llm)
    rows = [r[a > 0].tolist() for r, a in zip(batch.obs, batch.attn)]
    assert len(seen) == 3 and len(seen[0]) == len(rows) // 2 and seen[2]  # turn 1 samples group_size per prompt
    for i, r in enumerate(rows):
        assert r[:len(seen[0][i // 2])] == seen[0][i // 2]
    for turn in seen[1:]:  # every later prompt is the start of some final sequence, ids unchanged
        assert all(any(r[:len(s)] == s and len(r) > len(s) for r in rows) for s in turn)


def test_environment_tokens_change_nothing(tiny_llm, monkeypatch):
    policy, task, batch, _ = episodes(tiny_llm, ent_coef=0.01, kl_coef=0.1)
    env = (batch.mask == 0) & batch.tokens  # [N, T] environment tokens
    assert env.any()
    batch.adv = torch.randn_like(batch.mask) * batch.mask
    batch.old_logp = batch.ref_logp = torch.zeros_like(batch.mask)

    def loss_and_grad():
        policy.lm.zero_grad()
        out = policy.score(batch)
        loss, stats = pg_loss(out["logp"], batch.old_logp, batch.adv, batch.mask, policy.cfg, None, out["entropy"],
                              batch.ref_logp)
        loss.backward()
        return loss.item(), stats, [p.grad.clone() for p in policy.params().values()]

    base = loss_and_grad()
    real = policy.forward_logits
    real_tokens = batch.tokens  # forward_logits' [M, V]: one row per real token
    noise = 50 * torch.randn(int(real_tokens.sum()), len(policy.tok)) * env[real_tokens][:, None]  # at env tokens only
    monkeypatch.setattr(policy, "forward_logits", lambda lm, b, hidden=False: (real(lm, b, hidden)[0] + noise, None))
    loss, stats, grads = loss_and_grad()
    assert loss == base[0] and all(torch.equal(stats[k], base[1][k]) for k in stats)
    assert all(torch.equal(g, h) for g, h in zip(grads, base[2]))


def test_old_logp_equals_the_samplers_fp32_logprobs_on_assistant_tokens(tiny_llm):
    policy, task, batch, _ = episodes(tiny_llm, role="rollout", trainer_url="http://x")  # a worker records them
    assert batch.sampler_logp is not None and (batch.sampler_logp[batch.mask == 0] == 0).all()
    with torch.no_grad():
        ours = policy.score(batch)["logp"]
    m = batch.mask > 0
    assert torch.allclose(ours[m], batch.sampler_logp[m], atol=1e-5)


def test_episode_cap_truncates_and_early_ends_mix_with_long_episodes(tiny_llm):
    # a message costs ~31 tokens here (character-level tokenizer): reply (<= 12) + message + at most 7 more
    policy, task, batch, chats = episodes(tiny_llm, max_new_tokens=12, max_episode_tokens=50)
    lengths = batch.attn[:, -batch.mask.shape[1]:].sum(1)  # tokens after the prompt
    turns = torch.tensor([sum(m["role"] == "assistant" for m in c) for c in chats])
    assert (lengths <= 50).all() and (lengths == 50).any()  # the cap binds, and cuts a later reply at it
    assert ((turns == 1) & ~batch.truncated).any()  # episodes that ended by themselves after one reply ...
    assert (batch.truncated & (turns > 1)).any()  # ... in the same batch as longer ones the cap cut


def test_rewards_sit_on_the_last_assistant_token_with_the_turn_discount(tiny_llm, monkeypatch):
    cfg = llm_cfg(tiny_llm, max_turns=3, max_new_tokens=24, batch_size=16, turn_discount=0.5)
    task, policy = Chatty(cfg), HFPolicy(cfg)
    monkeypatch.setattr(Chatty, "reward", lambda self, p, c, a: 1.0)
    torch.manual_seed(0)
    batch = task.rollout(policy, 0)
    T = batch.mask.shape[1]
    last = T - 1 - batch.mask.flip(1).argmax(1)
    turns = [int(t) for t in (batch.mask.diff(dim=1, prepend=torch.zeros(len(last), 1)) > 0).sum(1)]  # mask runs
    assert batch.rewards[torch.arange(len(last)), last].tolist() == [0.5 ** (t - 1) for t in turns]
    assert batch.rewards.sum().item() == pytest.approx(sum(0.5 ** (t - 1) for t in turns))


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_max_turns_1_is_the_single_turn_path(tiny_llm, tmp_path, monkeypatch, algo):
    """A task whose environment never answers, at --max-turns 3, trains exactly like --max-turns 1; and one
    turn of play is exactly one call of the single-turn generate."""
    monkeypatch.setitem(TASKS, "digits", Silent)
    common = ["--task", "digits", "--model", tiny_llm, "--algo", algo, "--steps", "3", "--group-size", "2",
              "--max-new-tokens", "8", "--n-eval", "4", "--lora-r", "4", "--lr", "0.05", "--eval-every", "2"]
    for turns in (1, 3):
        train.main(common + ["--max-turns", str(turns), "--out", str(tmp_path / str(turns))])
    one, three = (list(csv.DictReader(open(tmp_path / d / "metrics.csv"))) for d in ("1", "3"))
    timing = ("_s", "_mfu")  # seconds, tokens per second, FLOP utilization: the clock's, not the run's
    assert [{k: v for k, v in r.items() if not k.endswith(timing)} for r in one] == \
           [{k: v for k, v in r.items() if k in r1 and not k.endswith(timing)} for r, r1 in zip(three, one)]
    cfg = llm_cfg(tiny_llm)
    policy, task = HFPolicy(cfg), Silent(cfg)
    problems = task.train_problems(0)
    torch.manual_seed(1)
    played, _ = task.play(policy, problems, 2)
    torch.manual_seed(1)
    generated, _ = policy.generate([task.build_prompt(q) for q, _ in problems], 2)
    assert all(torch.equal(getattr(played, k), getattr(generated, k)) for k in ("obs", "attn", "mask", "truncated"))


def test_multi_turn_evaluation_and_samples(tiny_llm, tmp_path):
    cfg = dataclasses.replace(llm_cfg(tiny_llm, max_turns=3, max_new_tokens=24), out=str(tmp_path))
    policy, task = HFPolicy(cfg), Arith(cfg)
    out = task.evaluate(policy, 0)
    held = {"eval_acc", "eval_acc_turn1", "eval_well_formed"}  # and the accuracy among well-formed, if any
    assert held <= set(out) <= held | {"eval_acc_well_formed"} and out["eval_acc"] >= out["eval_acc_turn1"]
    assert ("eval_acc_well_formed" in out) == (out["eval_well_formed"] > 0)
    first = (tmp_path / "samples.jsonl").read_text().splitlines()[0]
    assert '"turns": [{"role": "assistant"' in first and '"role": "user", "content": "That is not right.' in first


def test_a_template_that_rewrites_history_is_refused(tiny_llm):
    policy = HFPolicy(llm_cfg(tiny_llm))
    policy.tok.chat_template = ("{% for m in messages %}{% if loop.last %}LAST {% endif %}{{ m['content'] }}<eos>"
                                "{% endfor %}{% if add_generation_prompt %}A:{% endif %}")  # re-renders the last turn
    with pytest.raises(SystemExit, match=r"multi-turn needs a chat template .*\(--max-turns 1 works with it\)"):
        policy.env_ids("again", policy.tok.eos_token_id)


def test_readme_multi_turn_example(tiny_llm, monkeypatch):
    import re

    import tasks
    code = next(b for b in re.findall(r"```python\n(.*?)```", open("README.md").read(), re.S) if "env_response" in b)
    namespace = dict(vars(tasks))
    monkeypatch.setattr(tasks, "TASKS", dict(tasks.TASKS))
    exec(code, namespace)  # the README's example, verbatim
    Guess = namespace["TASKS"]["guess"]
    task = Guess(llm_cfg(tiny_llm, task="guess", max_turns=5, max_new_tokens=24))
    q, secret = task.train_problems(0)[0]
    assert task.env_response(q, secret, [str(secret - 1)]) == "Higher." and task.env_response(q, secret, ["hm"]) == \
        "Reply with just a number." and task.env_response(q, secret, [str(secret)]) is None
    assert task.episode_reward(q, secret, ["1", "2", str(secret)]) == pytest.approx(1 / 3)
    torch.manual_seed(0)
    batch, played = task.play(HFPolicy(task.cfg), task.train_problems(0), 2)  # the tiny model rarely guesses a number
    assert any(m["content"] == "Reply with just a number." for ep in played for m in ep.chat)
