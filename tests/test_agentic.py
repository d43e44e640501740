"""Agentic episodes: per-reply rewards, per-turn credit (unbiased, by Monte Carlo against the exact policy
gradient of a toy), tools as environment replies, and the resource-limited Python runner."""
import json
import os
import subprocess
import sys
import time

import pytest
import torch

from algos import ADVANTAGES, pg_loss
from config import Config
from model import HFPolicy
from tasks import Calc, Episode, overlong_penalty, run_python
from test_llm import llm_cfg
from test_multiturn import Chatty, episodes
from utils import Batch


def replies_batch(rewards, lengths, env=2):
    """One episode per row: replies of `lengths` tokens with `env` environment tokens between them, each
    reply's reward on its last token."""
    rows = []
    for rs, ls in zip(rewards, lengths):
        mask, r = [], []
        for k, (x, n) in enumerate(zip(rs, ls)):
            mask += [0.0] * (env if k else 0) + [1.0] * n
            r += [0.0] * (env if k else 0) + [0.0] * (n - 1) + [x]
        rows.append((mask, r))
    T = max(len(m) for m, _ in rows)
    mask = torch.tensor([m + [0.0] * (T - len(m)) for m, _ in rows])
    rewards = torch.tensor([r + [0.0] * (T - len(r)) for _, r in rows])
    return Batch(obs=mask, actions=mask.long(), mask=mask, rewards=rewards, group=torch.zeros(len(rows), dtype=torch.long),
                 truncated=torch.zeros(len(rows), dtype=torch.bool))


def test_reply_returns_by_hand():
    b = replies_batch([[0.0, 1.0, 0.5]], [[2, 1, 3]])  # tokens: r r e e r e e r r r
    A, _ = ADVANTAGES["reinforce"](b, Config(credit="turn", turn_discount=0.5, whiten_returns=False))
    # G2 = .5, G1 = 1 + .5 * .5 = 1.25, G0 = 0 + .5 * 1.25 = .625; environment tokens 0
    assert A[0].tolist() == [0.625, 0.625, 0, 0, 1.25, 0, 0, 0.5, 0.5, 0.5]


def test_turn_baseline_leaves_the_episode_out_and_counts_only_who_reached_the_reply():
    b = replies_batch([[0.0, 1.0], [1.0], [0.0, 0.0], [0.0, 0.0, 1.0]], [[1, 1], [1], [1, 1], [1, 1, 1]], env=1)
    A = ADVANTAGES["rloo"](b, Config(credit="turn", group_size=4))
    # returns per reply (discount 1): [1, 1], [1], [0, 0], [1, 1, 1]. Reply 0: baseline = mean of the 3 others' G0; reply 1: of the others among rows 0, 2, 3; reply 2: nobody else -> 0
    expect = [[1 - 2 / 3, 1 - 1 / 2], [1 - 2 / 3], [0 - 1, 0 - 1], [1 - 2 / 3, 1 - 1 / 2, 1 - 0]]
    got = [[round(x, 6) for x in row[m > 0].tolist()] for row, m in zip(A[0], b.mask)]
    assert got == [[round(x, 6) for x in row] for row in expect]


# --- Monte Carlo: the mean of flatrl's estimates is the exact policy gradient ----------------------------------

R = torch.tensor([[0.2, 0.0, 0.5], [1.0, 0.3, 0.0], [0.0, 0.8, 0.4]])  # reward of action a at reply k; a = 2 stops


def exact_gradient(theta):
    """d/dtheta E[sum_k r_k], every episode enumerated: at reply k the policy picks a ~ softmax(theta[k]);
    a = 2 ends the episode, and so does the third reply."""
    theta = theta.clone().requires_grad_()
    p, J = theta.softmax(-1), 0.0

    def walk(k, prob, ret):
        nonlocal J
        for a in range(3):
            if a == 2 or k == 2:
                J = J + prob * p[k, a] * (ret + R[k, a])
            else:
                walk(k + 1, prob * p[k, a], ret + R[k, a])
    walk(0, 1.0, 0.0)
    return torch.autograd.grad(J, theta)[0]


def estimated_gradient(theta, cfg, n_groups, seed=0):
    """Sample n_groups x group_size episodes, one token per reply and an environment token between replies;
    flatrl's estimator (algos.ADVANTAGES) and loss (algos.pg_loss, weight 1 / episodes) -> the gradient."""
    gen, G = torch.Generator().manual_seed(seed), cfg.group_size
    N, theta = n_groups * G, theta.clone().requires_grad_()
    logp_all = theta.log_softmax(-1)  # [3, 3]
    mask, rewards, logp = torch.zeros(N, 5), torch.zeros(N, 5), torch.zeros(N, 5)
    alive = torch.ones(N, dtype=torch.bool)
    for k in range(3):
        a = torch.multinomial(logp_all[k].detach().exp(), N, replacement=True, generator=gen)  # [N]
        col = 2 * k
        mask[:, col] = alive.float()
        rewards[:, col] = R[k, a] * alive
        logp = logp + torch.nn.functional.one_hot(torch.tensor(col), 5) * (logp_all[k, a] * alive)[:, None]
        alive = alive & (a != 2)
    if cfg.credit == "episode":  # the episode's return on its last reply's token
        last = 2 * (mask[:, ::2].sum(1).long() - 1)
        total, rewards = rewards.sum(1), torch.zeros(N, 5)
        rewards[torch.arange(N), last] = total
    b = Batch(obs=mask, actions=mask.long(), mask=mask, rewards=rewards, group=torch.arange(N) // G,
              truncated=torch.zeros(N, dtype=torch.bool))
    A, _ = ADVANTAGES[cfg.algo](b, cfg)
    loss, _ = pg_loss(logp, logp.detach(), A, mask, cfg, weight=mask / N)
    return -torch.autograd.grad(loss, theta)[0]


@pytest.mark.parametrize("algo,credit", [("grpo", "turn"), ("rloo", "turn"), ("reinforce_baseline", "turn"),
                                         ("reinforce", "turn"), ("rloo", "episode"), ("reinforce", "episode")])
def test_credit_is_unbiased_by_monte_carlo(algo, credit):
    theta = torch.tensor([[0.3, -0.2, 0.0], [0.1, 0.4, -0.5], [-0.3, 0.2, 0.1]])
    cfg = Config(algo=algo, credit=credit, group_size=4, norm_std=False, gamma=1.0, whiten_returns=False)  # textbook
    exact = exact_gradient(theta)
    est = estimated_gradient(theta, cfg, n_groups=100_000)
    assert (est - exact).norm() / exact.norm() < 0.03, (est, exact)


def test_per_turn_credit_refuses_grpo_std_division():
    with pytest.raises(SystemExit, match="--credit turn with grpo's std division is biased"):
        Config(algo="grpo", credit="turn", group_size=4).validate()
    Config(algo="grpo", credit="turn", group_size=4, norm_std=False).validate()


# --- per-reply rewards in an LLM task ----------------------------------------------------------------------

def test_default_rewards_are_the_episode_reward_on_the_last_token(tiny_llm):
    """--credit episode without turn_rewards: the reward tensor is exactly what flatrl put there before per-reply
    rewards: the last reply's reward times turn_discount per reply beyond the first, plus the overlong
    penalty, on the episode's last sampled token, and nothing elsewhere."""
    policy, task, _, _ = episodes(tiny_llm, turn_discount=0.5, overlong_buffer=60)
    played = []
    play = task.play
    task.play = lambda *a, **k: played.append(play(*a, **k)) or played[-1]
    torch.manual_seed(1)
    batch = task.rollout(policy, 0)
    chats, problems = [ep.chat for ep in played[0][1]], task.train_problems(0)
    expect = torch.zeros_like(batch.rewards)
    last = batch.mask.shape[1] - 1 - batch.mask.flip(1).argmax(1)
    for i, chat in enumerate(chats):
        said = [m["content"] for m in chat if m["role"] == "assistant"]
        q, a = problems[i // task.cfg.group_size]
        expect[i, last[i]] = task.reward(task.build_prompt(q), said[-1], a) * 0.5 ** (len(said) - 1) + overlong_penalty(
            batch.mask[i].sum().item(), task.max_len, 60)
    assert torch.equal(batch.rewards, expect) and (batch.mask.sum(1) > task.max_len - 60).any()  # penalties too


def test_turn_rewards_sit_on_each_reply(tiny_llm):
    class Scored(Chatty):  # every reply scored: 1 for the first, 2 for the second, ...
        def turn_rewards(self, question, answer, turns):
            return [float(k + 1) for k in range(len(turns))]
    policy, task, batch, chats = episodes(tiny_llm, task=Scored, credit="turn", algo="rloo")
    torch.manual_seed(0)
    batch = task.rollout(policy, 0)
    for row, m in zip(batch.rewards, batch.mask):
        n = int((torch.diff(torch.cat([torch.zeros(1), m])) == 1).sum())  # replies in this episode
        assert row[row != 0].tolist() == [float(k + 1) for k in range(n)]


# --- tools ---------------------------------------------------------------------------------------------------

def boom(x: int) -> int:
    """Always fails.

    Args:
        x: anything
    """
    raise RuntimeError("kaput")


class Tools(Calc):
    from tasks import calculator
    tools = [calculator, boom]


@pytest.mark.parametrize("reply,expect", [
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "347 * 28"}}</tool_call>', "calculator result: 9716"),
    ("calculator: 347 * 28", "calculator result: 9716"),  # the plain format, for templates without tools
    ("<tool_call>{name: calculator}</tool_call>", "error: write a call as <tool_call>"),
    ("<tool_call></tool_call>", "error: write a call as <tool_call>"),  # empty: a malformed call
    ('<tool_call>{"name": "search", "arguments": {}}</tool_call>', "error: no tool 'search'; the tools are calculator, boom"),
    ('<tool_call>{"name": "calculator", "arguments": {"expr": "1"}}</tool_call>', "error: bad arguments for calculator:"),
    ('<tool_call>{"name": "boom", "arguments": {"x": 1}}</tool_call>', "error: boom raised RuntimeError: kaput"),
    ("calculator: 2 ** 8", "error: calculator raised ValueError: use numbers, + - * / and parentheses"),
    ("```\ncalculator(347 * 28)\n```", "calculator result: 9716"),  # Python, as small models write unprompted:
    ('`calculator("347 * 28")`', "calculator result: 9716"),  # an argument as its text, or as the literal
    ("calculator(expression='(1 + 2) * 3')", "calculator result: 9"),
    ("boom(x=1)", "error: boom raised RuntimeError: kaput"),
    ('Use calculator("347 * 28").', None), ("print(boom(x=1))", None),  # a call inside a sentence is text
    ("calculator(1, 2)", None),  # more arguments than it takes: no call
    ("f(347 * 28) is 9716 (as I said)", None),  # no tool of the task's: no call
    ("calculator(347 * 28) = 9716, so 9716.", None),  # an answer that restates a call is an answer
    ("def calculator(x):", None), ("obj.calculator(2)", None),
    ('calculator(b"1")', "error: calculator raised ValueError"),  # a literal JSON cannot hold: its text
    ("calculator(" + "-" * 390 + "1)", None),  # nesting deeper than the parser's stack: no call, no crash
    ("calculator( " * 2000 + ") " * 2000, None),  # a long degenerate reply: no call, in linear time
    ("The answer is 9716.", None),  # no call: the episode ends
])
def test_tool_calls_and_their_errors(reply, expect):
    task = Tools(Config(task="calc", max_turns=3, max_tool_calls=2, n_eval=4).validate())
    said = task.env_response("What is 347 * 28?", 9716, [reply])
    assert (said is None) if expect is None else (said["role"] == "tool" and said["content"].startswith(expect))


def test_a_call_past_the_cap_is_refused_and_counted():
    task = Tools(Config(task="calc", max_turns=4, max_tool_calls=1, n_eval=4).validate())
    turns = ["calculator: 1 + 1", "calculator: 2 + 2"]
    said = task.env_response("q", 4, turns)
    assert said == {"role": "tool", "content": "error: no tool calls left (at most 1); reply with the answer"}
    chats = [[{"role": "assistant", "content": turns[0]}, {"role": "tool", "content": "calculator result: 2"},
              {"role": "assistant", "content": turns[1]}, said, {"role": "assistant", "content": "4"}],
             [{"role": "assistant", "content": "5"}]]
    assert task.episode_stats([Episode(c, c[-1]["content"]) for c in chats]) == {
        "tool_calls": 1.0, "tool_use": 0.5, "tool_errors": 0.5}
    assert task.correct("q", "4", 4) == 1.0 and task.correct("q", "calculator: 4", 4) == 0.0  # a call is no answer
    empty = "<tool_call></tool_call> 4"  # an empty call is a malformed call, for the budget and for correct alike
    assert task.env_response("q", 4, [empty])["content"].startswith("error:") and task.correct("q", empty, 4) == 0.0


class Noisy(Tools):
    def find_call(self, reply):  # the tiny model writes noise: read a reply with a digit as a call on its text
        return super().find_call(reply) or (json.dumps({"name": "calculator", "arguments": {"expression": reply}})
                                            if any(c.isdigit() for c in reply) else None)


def test_tool_episodes_run_end_to_end(tiny_llm):
    """Every call, good or bad, is answered and nothing crashes; for a template without a tool role the
    tool's message is rendered as a user turn."""
    cfg = llm_cfg(tiny_llm, task="calc", max_turns=3, max_tool_calls=2, max_new_tokens=12, batch_size=16)
    policy, task = HFPolicy(cfg), Noisy(cfg)
    torch.manual_seed(0)
    batch, played = task.play(policy, task.train_problems(0), 2)
    chats = [ep.chat for ep in played]
    tool = [m["content"] for c in chats for m in c if m["role"] == "tool"]
    assert tool and all(m.startswith(("calculator result:", "error:")) for m in tool)
    assert policy.env_ids("x", policy.tok.eos_token_id, "tool") == policy.env_ids("x", policy.tok.eos_token_id, "user")
    stats = task.episode_stats(played)
    assert stats["tool_calls"] == len(tool) / len(chats) and 0 < stats["tool_use"] <= 1


# --- the Python runner ------------------------------------------------------------------------------------------

def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("code,expect", [
    ("print(6 * 7)", "42\n"),
    ("while True: pass", "error: used more than 1 s of CPU; stopped"),
    ("import time; time.sleep(60)", "error: still running after 3 s; stopped"),
    ("x = bytearray(10 * 2**30)", "error: exit code 1"),  # 10 GB: refused by the memory limit
    ("import sys\nwhile True: sys.stdout.write('x' * 2**20)", "error: wrote more than 64 KB; stopped"),
])
def test_the_runner_stops_runaway_code(code, expect):
    t = time.time()
    out = run_python(code, wall_s=3, cpu_s=1)
    assert out.startswith(expect) and time.time() - t < 10
    assert "MemoryError" in out if "bytearray" in code else len(out) < 70 * 1024


def test_the_runner_leaves_no_process_and_no_secrets(monkeypatch):
    monkeypatch.setenv("FLATRL_TOKEN", "s3cret")
    monkeypatch.setenv("HF_TOKEN", "hf_s3cret")
    assert "s3cret" not in run_python("import os; print(dict(os.environ))")
    out = run_python("import subprocess; print(subprocess.Popen(['sleep', '60']).pid)")  # outlives its parent
    end = time.time() + 5  # SIGKILL is sent to the group before run_python returns; it lands within moments
    while alive(int(out)) and time.time() < end:
        time.sleep(0.05)
    assert not alive(int(out))
    assert run_python("import os; print(os.listdir('.'))") == "['main.py', 'out']\n"  # a fresh folder of its own


TRAINER = """import sys
from tasks import run_python
print(run_python("import os; print(sorted(os.environ)); print(open(f'/proc/{os.getppid()}/environ').read())"))
"""


def test_model_written_code_cannot_read_the_trainers_secrets():
    """The code's own environment is empty, and the trainer's (/proc/<trainer>/environ, FLATRL_TOKEN) is closed to
    it: run_python makes the trainer non-dumpable, and the code runs without capabilities (this suite may run as
    root, which reads any process's /proc otherwise). Before: the parent's environment, token and all."""
    env = {**os.environ, "FLATRL_TOKEN": "s3cret"}
    out = subprocess.run([sys.executable, "-c", TRAINER], capture_output=True, text=True, env=env, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))).stdout
    own, parents = out.split("\n", 1)
    assert "FLATRL_TOKEN" not in own and "s3cret" not in parents
    assert "PermissionError" in parents  # refused, not merely empty


def test_the_monte_carlo_check_catches_a_biased_estimator():
    """Dr.GRPO's A = R - mean_g R keeps the episode itself in its baseline: its gradient is (G - 1) / G of the
    true one, here 3/4. The check above sees that."""
    theta = torch.tensor([[0.3, -0.2, 0.0], [0.1, 0.4, -0.5], [-0.3, 0.2, 0.1]])
    exact = exact_gradient(theta)
    est = estimated_gradient(theta, Config(algo="grpo", credit="episode", group_size=4, norm_std=False), n_groups=100_000)
    assert (est - 0.75 * exact).norm() / exact.norm() < 0.03 and (est - exact).norm() / exact.norm() > 0.2
