"""Agents written against the OpenAI chat API: the endpoint (schema, streaming, tools, errors, vLLM's token fields),
exact token records, sampling honesty, AgentTask with good and bad agents, --serve, and tools in a template that
ignores them."""
import json
import os
import signal
import subprocess
import sys
import threading
import time
import types
import urllib.error
import urllib.request

import openai
import pytest
import torch

import train
from conftest import SMOL, needs_smol
from model import HFPolicy, parse_tool_calls, render, tool_schema
from serve import serve_chat
from config import Config
from tasks import AgentTask, Calc, CalcAgent, agent_rows, calculator, place_rewards
from utils import Batch
from test_llm import llm_cfg

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def endpoint(tiny_llm):
    cfg = llm_cfg(tiny_llm, max_new_tokens=24, max_turns=3)
    policy = HFPolicy(cfg)
    server = serve_chat(policy, cfg)
    yield policy, server, f"http://127.0.0.1:{server.server_port}/v1"
    server.shutdown()


def strict_client(url, **kw):  # the verifiers library validates responses so
    return openai.OpenAI(base_url=url, api_key="any", max_retries=0, _strict_response_validation=True, **kw)


def scripted(policy, monkeypatch, replies):
    """The sampler answers each prompt with replies[k] + a stop token, k = how many tool results the prompt holds
    after Calc's worked example; records every generate call."""
    calls = []

    def generate(prompts, n, greedy=False, record=False, max_new=None):
        calls.append(len(prompts))
        out = []
        for p in prompts:
            k = policy.tok.decode(p).count("calculator result") - 1
            out += [policy.tok(replies[k], add_special_tokens=False)["input_ids"] + [policy.stop_ids[0]]] * n
        return out, [[-0.5] * len(ids) for ids in out] if record else None
    monkeypatch.setattr(policy.generator, "generate", generate)
    return calls


def post(url, body, headers=None):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


# --- the endpoint ---------------------------------------------------------------------------------------------

def test_the_openai_client_parses_every_response_strictly(endpoint):
    policy, _, url = endpoint
    client = strict_client(url)
    assert [m.id for m in client.models.list().data] == [policy.cfg.model]
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    r = client.chat.completions.create(model="anything", messages=messages, n=2, max_tokens=5, logprobs=True,
                                       extra_body={"unknown_field": 1, "return_token_ids": True})
    prompt, ids = policy.prompt_ids(messages), [c.model_extra["token_ids"] for c in r.choices]
    assert r.object == "chat.completion" and len(r.choices) == 2 and r.usage.prompt_tokens == len(prompt)
    assert r.usage.completion_tokens == sum(map(len, ids)) and all(len(x) <= 5 for x in ids)
    assert [c.finish_reason for c in r.choices] == ["stop" if x[-1] in policy.stop_ids else "length" for x in ids]
    assert all(c.message.content == policy.tok.decode(x, skip_special_tokens=True) for c, x in zip(r.choices, ids))
    extra, choice = r.model_extra, r.choices[0]
    assert extra["prompt_token_ids"] == prompt and len(choice.model_extra["token_ids"]) == len(choice.logprobs.content)
    assert all(t.logprob <= 0 for t in choice.logprobs.content)
    chunks = list(client.chat.completions.create(model="m", messages=messages, stream=True, max_tokens=4))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_tool_calls_are_parsed_into_the_openai_shape(endpoint, monkeypatch):
    policy, _, url = endpoint
    scripted(policy, monkeypatch, ["calculator: 12 * 3"])
    tools = [tool_schema(calculator)]
    for stream in (False, True):
        r = strict_client(url).chat.completions.create(model="m", messages=[{"role": "user", "content": "12 * 3?"}],
                                                       tools=tools, stream=stream)
        if stream:
            r = list(r)
            call, finish = r[0].choices[0].delta.tool_calls[0], r[-1].choices[0].finish_reason
        else:
            call, finish = r.choices[0].message.tool_calls[0], r.choices[0].finish_reason
        assert finish == "tool_calls" and call.type == "function" and call.function.name == "calculator"
        assert json.loads(call.function.arguments) == {"expression": "12 * 3"}  # a JSON string, as OpenAI's
    text = 'Let me see. <tool_call>{"name": "calculator", "arguments": {"expression": "1 + 2"}}</tool_call>'
    call = {"name": "calculator", "arguments": {"expression": "1 + 2"}}
    assert parse_tool_calls(text, tools) == ("Let me see.", [call])
    assert parse_tool_calls("<tool_call>{not json</tool_call>", tools) == ("<tool_call>{not json</tool_call>", [])
    assert parse_tool_calls("Let me see.\n```\ncalculator(12 * 3)\n```", tools) == ("Let me see.", [  # Python-style
        {"name": "calculator", "arguments": {"expression": "12 * 3"}}])


def test_bad_requests_get_a_400_in_openais_error_shape(endpoint, monkeypatch):
    _, _, url = endpoint
    good = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    bad = [b"{not json", b"[1, 2]", {"messages": "hi"}, {"messages": []}, {"messages": [{"content": "hi"}]},
           {"messages": [{"role": "user", "content": 5}]}, {**good, "max_tokens": -1}, {**good, "n": "2"},
           {**good, "n": 1.5}, {**good, "tools": "calculator"}, {**good, "tools": [{"type": "function"}]},
           {**good, "stream": "yes"}, {"messages": [{"role": "developer", "content": "hi"}]},
           {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
           {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f"}}]}]}]
    for body in bad:
        status, answer = post(f"{url}/chat/completions", body)
        assert status == 400 and set(answer["error"]) == {"message", "type", "param", "code"}, (body, answer)
    assert post(f"{url}/chat/completions", {**good, "whatever": [1]})[0] == 200  # unknown fields are ignored
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}]}
    assert post(f"{url}/chat/completions", {**parts, "max_tokens": 2})[0] == 200
    assert post(f"{url}/nothing", good)[0] == 404
    monkeypatch.setenv("FLATRL_TOKEN", "s3cret")
    server = serve_chat(endpoint[0], endpoint[0].cfg)  # reads the token as it starts
    local = f"http://127.0.0.1:{server.server_port}/v1/chat/completions"
    assert post(local, good)[0] == 401 and post(local, good, {"Authorization": "Bearer s3cret"})[0] == 200
    with pytest.raises(openai.AuthenticationError):
        strict_client(local.rsplit("/", 2)[0]).chat.completions.create(model="m", messages=good["messages"])
    server.cfg = types.SimpleNamespace(**{**vars(server.cfg), "body_limit_mb": 1e-5})
    assert post(local, good, {"Authorization": "Bearer s3cret"})[0] == 413
    server.shutdown()


def test_in_training_the_run_decides_how_to_sample(endpoint):
    """A request's temperature, top_p, seed are counted, not used; max_tokens is capped at --max-new-tokens; an
    evaluation is greedy: the same reply twice."""
    policy, server, url = endpoint
    chat, runs = server.chat, ["a", "b"]
    chat.open(runs, greedy=False)
    client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, default_headers={"X-Flatrl-Episode": "a"})
    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], temperature=0.01,
                                       top_p=0.1, seed=3, max_tokens=1000)
    assert chat.ignored == 1 and r.usage.completion_tokens <= policy.cfg.max_new_tokens
    chat.close(runs)
    chat.open(runs, greedy=True)
    texts = [openai.OpenAI(base_url=url, api_key="x", default_headers={"X-Flatrl-Episode": e}).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], temperature=1.5).choices[0].message.content
        for e in runs]
    chat.close(runs)
    chat.ignored = 0
    assert texts[0] == texts[1]


def test_concurrent_calls_share_one_generate(endpoint, monkeypatch):
    policy, server, url = endpoint
    generates, runs = scripted(policy, monkeypatch, ["12"]), [f"r{i}" for i in range(4)]
    server.chat.open(runs, greedy=False)
    ready = threading.Barrier(4)

    def agent(run):
        client = openai.OpenAI(base_url=url, api_key="x", default_headers={"X-Flatrl-Episode": run})
        ready.wait()
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": f"hi {run[1]}"}])
        server.chat.returned(run)
    threads = [threading.Thread(target=agent, args=(r,)) for r in runs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    records = server.chat.close(runs)
    assert generates == [4] and all(len(r["calls"]) == 1 for r in records)


# --- exact tokens: an agent's episode is the ToolTask's ------------------------------------------------------------

def test_an_agents_episode_is_tasks_play_token_for_token(tiny_llm, monkeypatch):
    """The same conversation played by Calc (a ToolTask) and by CalcAgent through the endpoint: the same rows."""
    cfg = llm_cfg(tiny_llm, task="calc", max_turns=3, max_new_tokens=24, batch_size=4, group_size=2, n_eval=2,
                  old_logp="sampler")
    policy = HFPolicy(cfg)
    scripted(policy, monkeypatch, ["calculator: 12 * 3", "36"])
    tool, agent = Calc(cfg), CalcAgent(cfg)
    problems = [("What is 12 * 3?", 36), ("What is 4 * 5?", 20)]
    expected, played = tool.play(policy, problems, 2)
    got, runs = agent.play(policy, problems, 2)
    assert got.run.tolist() == [0, 1, 2, 3] and [r.error for r in runs] == [None] * 4 and len(runs[0].calls) == 2
    for k in ("obs", "mask", "attn", "actions", "sampler_logp", "group", "truncated"):
        assert torch.equal(getattr(got, k), getattr(expected, k)), k
    assert played[0].chat[1] == {"role": "tool", "content": "calculator result: 36"}


def test_a_run_in_two_rows_gets_its_reward_and_penalty_on_both():
    """Run 0: two rows of one reply each (reward 1, overlong penalty -.25); run 1: one row (reward .5). Discount .5.
    Turn credit: run 0's replies earn [0, 1 - .25]: row 0's reply carries the later row's .75 x .5 = .375, row 1's
    .75. Episode credit: the return 0 + .5 x 1 = .5, plus the penalty, .25, on both rows' last replies."""
    mask = torch.tensor([[1.0, 1, 0], [1, 0, 0], [1, 1, 1]])
    for credit, expect in (("turn", [[0, .375, 0], [.75, 0, 0], [0, 0, .5]]),
                           ("episode", [[0, .25, 0], [.25, 0, 0], [0, 0, .5]])):
        batch = Batch(obs=torch.zeros(3, 6, dtype=torch.long), actions=torch.zeros(3, 3, dtype=torch.long), mask=mask,
                      rewards=torch.zeros(3, 3), group=torch.zeros(3, dtype=torch.long),
                      truncated=torch.zeros(3, dtype=torch.bool), run=torch.tensor([0, 0, 1]))
        place_rewards(batch, [[1.0], [0.5]], [-0.25, 0.0], Config(credit=credit, turn_discount=0.5))
        assert batch.rewards.tolist() == expect, credit


def test_a_call_that_rewrites_history_starts_a_row_of_its_own():
    calls = [{"prompt": [1, 2], "ids": [3, 4], "logps": [-1.0, -2.0]},
             {"prompt": [1, 2, 3, 4, 9], "ids": [5], "logps": [-3.0]},  # extends: 9 is the agent's message
             {"prompt": [1, 7], "ids": [6], "logps": [-4.0]}]  # does not: a row of its own
    assert agent_rows(calls) == [([1, 2], [3, 4, 9, 5], [1, 1, 0, 1], [-1.0, -2.0, 0.0, -3.0]),
                                 ([1, 7], [6], [1], [-4.0])]


# --- AgentTask: bad agents, training ---------------------------------------------------------------------------

class Unruly(AgentTask, Calc):
    """Episode e of each group: 0 answers, 1 raises, 2 hangs past the timeout (then calls: refused), 3 calls too
    often, 4 never calls, 5 answers a list."""
    late = []

    def agent(self, client, question):
        kind = int(threading.current_thread().name.split("-")[-1]) % 6  # not the thread's own business, but a test's

        def ask():
            return client.chat.completions.create(model="m", messages=[{"role": "user", "content": question}])
        if kind == 4:
            return "36"
        ask()
        if kind == 1:
            raise ValueError("a bug in the agent")
        if kind == 2:
            time.sleep(2.5)
            try:
                ask()
            except openai.APIStatusError as e:
                self.late.append(e.status_code)
            return "36"
        if kind == 3:
            for _ in range(5):
                ask()
        return [36] if kind == 5 else "36"


def test_bad_agents_get_reward_0_and_are_counted_by_cause(tiny_llm, monkeypatch):
    cfg = llm_cfg(tiny_llm, task="calc", max_turns=3, batch_size=6, group_size=6, n_eval=2, agent_timeout=1.5)
    policy, task = HFPolicy(cfg), Unruly(cfg)
    counter = iter(range(10**6))
    monkeypatch.setattr(threading.Thread, "__init__", wrap_names(threading.Thread.__init__, counter))
    batch = task.rollout(policy, 0)
    stats = batch.stats
    assert {k: v for k, v in stats.items() if k.startswith("agent_errors")} == {
        "agent_errors": 5, "agent_errors_raised": 1, "agent_errors_timeout": 1, "agent_errors_turns": 1,
        "agent_errors_no_call": 1, "agent_errors_answer": 1}
    assert stats["well_formed"] == 1 / 6 and stats["acc_well_formed"] == 0.0  # a run in error is never well-formed
    assert batch.rewards.sum(1).tolist()[1:] == [0.0] * (len(batch.rewards) - 1)
    time.sleep(1.5)  # the hung agent wakes up and calls after its run was closed
    assert task.late == [410] and task.server.chat.runs == {} and not task.server.chat.running
    assert task.rollout(policy, 1).stats["agent_errors"] == 5  # the next step is not disturbed



class Stalled(AgentTask, Calc):
    """Each agent calls once; the sampler takes longer than --agent-timeout."""

    def agent(self, client, question):
        return client.chat.completions.create(model="m", messages=[{"role": "user", "content": question}]).choices[
            0].message.content


def test_a_cut_off_agents_generate_ends_before_the_rollout_returns(tiny_llm, monkeypatch, capfd):
    cfg = llm_cfg(tiny_llm, task="calc", max_turns=2, batch_size=2, group_size=2, n_eval=2, agent_timeout=0.5)
    policy, task = HFPolicy(cfg), Stalled(cfg)
    ended, sample = [], policy.sample

    def slow(*args, **kwargs):
        time.sleep(1.5)
        out = sample(*args, **kwargs)
        ended.append(time.time())
        return out
    monkeypatch.setattr(policy, "sample", slow)
    batch = task.rollout(policy, 0)
    returned = time.time()
    assert len(ended) == 1 and ended[0] <= returned  # nothing of the step's agents runs into the publish
    assert batch.stats["agent_errors"] == 2 and batch.mask.sum() == 0, batch.stats  # the late replies: not recorded
    time.sleep(0.5)
    assert len(ended) == 1 and task.server.chat.runs == {} and not task.server.chat.waiting
    err = capfd.readouterr().err
    assert "Traceback" not in err and "BrokenPipe" not in err  # a client that went away is no error

def wrap_names(init, counter):
    def named(self, *args, **kwargs):  # agent threads numbered in start order
        init(self, *args, **kwargs)
        if kwargs.get("daemon") and kwargs.get("args"):
            self.name = f"agent-{kwargs['args'][0]}"
    return named


@pytest.mark.parametrize("algo,credit", [("grpo", "episode"), ("rloo", "turn"), ("ppo", "episode")])
def test_an_agent_task_trains(tiny_llm, tmp_path, algo, credit):
    args = ["--task", "calc_agent", "--model", tiny_llm, "--algo", algo, "--credit", credit, "--batch-size", "4",
            "--group-size", "2", "--max-turns", "3", "--max-new-tokens", "8", "--n-eval", "2", "--steps", "2",
            "--gen-dtype", "float32", "--no-bf16", "--lora-r", "4", "--out", str(tmp_path / "run")]
    train.main(args)
    with open(tmp_path / "run" / "metrics.csv") as f:
        header = f.readline().strip().split(",")
    assert {"turns", "agent_errors", "agent_sampling_ignored", "eval_acc", "eval_turns"} <= set(header)


# --- serving a trained run, and tools in a template that ignores them ---------------------------------------

def test_serve_answers_openai_clients_until_ctrl_c(tiny_llm, tmp_path):
    run = str(tmp_path / "run")
    train.main(["--task", "arith", "--model", tiny_llm, "--algo", "grpo", "--batch-size", "4", "--group-size", "2",
                "--n-eval", "2", "--steps", "1", "--max-new-tokens", "4", "--lora-r", "4", "--out", run])
    proc = subprocess.Popen([sys.executable, "train.py", "--resume", run, "--serve", "--port", "0",
                             "--max-new-tokens", "6"], cwd=ROOT,  # the run's 4, raised as the line says
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "FLATRL_TOKEN": ""})
    try:
        line = next(line for line in proc.stdout if line.startswith("serving"))
        url = line.split(" at ")[1].split()[0]
        assert "as model 'run'" in line and "Replies stop at 6 tokens" in line and "--max-new-tokens N" in line
        client = strict_client(url)
        r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "1 + 1?"}], max_tokens=200,
                                           temperature=0)
        assert r.choices[0].message.role == "assistant" and r.usage.completion_tokens <= 6
        [model] = client.models.list().data
        assert model.id == "run" and model.model_dump()["root"] == tiny_llm  # the run, on its base model
        with urllib.request.urlopen(url.removesuffix("/v1") + "/healthz", timeout=10) as h:
            assert json.loads(h.read()) == {"serving": "run", "max_tokens": 6}
    finally:
        proc.send_signal(signal.SIGINT)
    assert proc.wait(30) == 130


@needs_smol
def test_a_template_that_ignores_tools_gets_them_in_the_system_message():
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(SMOL)
    chat = [{"role": "user", "content": "What is 347 * 28?"}]
    assert tok.apply_chat_template(chat, tools=[calculator], tokenize=False) == tok.apply_chat_template(
        chat, tokenize=False)  # SmolLM2's template shows no tools
    text = tok.decode(render(tok, chat, True, [calculator]))
    assert "calculator" in text and '"expression"' in text and "<tool_call>" in text
    call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "1 + 2"}'}}]}
    text = tok.decode(render(tok, chat + [call, {"role": "tool", "content": "3"}], True, [calculator]))
    assert '<tool_call>{"name": "calculator", "arguments": {"expression": "1 + 2"}}</tool_call>' in text


TINY_AGENT = ["--task", "calc_agent", "--algo", "rloo", "--batch-size", "4", "--group-size", "2", "--max-turns", "2",
              "--max-new-tokens", "12", "--n-eval", "2", "--lora-r", "4", "--eval-every", "0", "--gen-dtype", "float32",
              "--no-bf16", "--ent-coef", "0.001"]  # fp32 both sides; ent-coef: every row is scored


def test_a_rollout_worker_serves_its_own_agents(tiny_llm, tmp_path):
    from test_serve import trainer_and_worker
    trained, _ = trainer_and_worker(tmp_path, [*TINY_AGENT, "--model", tiny_llm, "--connect-timeout", "60"], 2)
    assert len(trained) == 2 and all(r["agent_errors"] == "0" for r in trained)
    assert all(float(r["logp_gap"]) < 1e-4 for r in trained)  # the endpoint recorded exactly what was sampled


def test_agents_under_torchrun_train_one_model(tiny_llm, tmp_path):
    from test_scale import ranks_run
    _, diffs = ranks_run(tmp_path, "agents", *TINY_AGENT, "--model", tiny_llm, "--steps", "2")
    assert diffs == {"built": 0.0, "trained": 0.0}  # each rank's agents on its own endpoint; one update for both


def test_an_agent_task_without_the_openai_package_is_a_one_line_error(tiny_llm, monkeypatch):
    import importlib.util
    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "openai" else find(name, *a))
    with pytest.raises(SystemExit, match=r'agent tasks need the openai package: pip install -e "\.\[agents\]"'):
        CalcAgent(llm_cfg(tiny_llm, task="calc_agent"))


def test_the_agent_endpoint_answers_only_its_agents_key(tiny_llm, monkeypatch):
    from tasks import run_python
    monkeypatch.setenv("FLATRL_TOKEN", "the-clusters-secret")
    cfg = llm_cfg(tiny_llm, task="calc", max_turns=2, batch_size=2, group_size=2, n_eval=2, max_new_tokens=4)
    policy, task = HFPolicy(cfg), CalcAgent(cfg)
    task.rollout(policy, 0)  # starts the endpoint; its agents called it with their key
    url = f"http://127.0.0.1:{task.server.server_port}/v1/chat/completions"
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert task.key != "the-clusters-secret"
    for key in (None, "the-clusters-secret", "flatrl"):
        assert post(url, body, {"Authorization": f"Bearer {key}"} if key else {})[0] == 401
    assert post(url, body, {"Authorization": f"Bearer {task.key}"})[0] == 200
    health = url.replace("/v1/chat/completions", "/healthz")
    with pytest.raises(urllib.error.HTTPError, match="401"):  # not even what it serves, to a caller without the key
        urllib.request.urlopen(health, timeout=10)
    code = f"import urllib.request\nurllib.request.urlopen({url!r}, data=b'{{}}', timeout=5)"
    assert run_python(code).startswith("error: exit code 1")  # model code: no key, and no TCP connection at all
