"""--task vf:NAME: a verifiers (0.4) environment as it is published (tests/vf_calc.py: a taskset and an agent program
on the OpenAI client with a tool), trained through flatrl's endpoint: runs attributed through verifiers' interception
server, exact tokens, the environment's rewards, every algorithm, a trainer and a rollout worker, bad rollouts
contained, one-line errors."""
import json
import os
import re
import subprocess
import sys
import time

import pytest

pytest.importorskip("verifiers")

import train  # noqa: E402
from model import HFPolicy  # noqa: E402
from tasks import VerifiersTask  # noqa: E402
from test_llm import llm_cfg  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(autouse=True)
def env_importable(monkeypatch):  # the environment's child process imports vf_calc from here, as an installed one
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [HERE, os.environ.get("PYTHONPATH")])))


def vf_cfg(tiny_llm, **kw):
    return llm_cfg(tiny_llm, **{"task": "vf:vf_calc", "max_turns": 3, "max_new_tokens": 24, "batch_size": 8,
                                "group_size": 2, "n_eval": 4, "agent_timeout": 60, **kw})


def calculator_script(policy, monkeypatch):
    """The sampler, scripted: a prompt's first reply calls the calculator on its own question's numbers, the second
    gives the product (one more when the first number is odd). Records every reply's ids."""
    replied = []

    def generate(prompts, n, greedy=False, record=False, max_new=None):
        out = []
        for p in prompts:
            text = policy.tok.decode(p)
            a, b = map(int, re.findall(r"What is (\d+) \* (\d+)\?", text)[-1])
            said = f"calculator: {a} * {b}" if text.count("calculator result") == 1 else str(a * b + a % 2)
            out += [policy.tok(said, add_special_tokens=False)["input_ids"] + [policy.stop_ids[0]]] * n
        replied.extend(out)
        return out, [[-0.5] * len(ids) for ids in out] if record else None
    monkeypatch.setattr(policy.generator, "generate", generate)
    return replied


def product_reward(question):  # the environment's reward for calculator_script's answer
    return float(int(re.findall(r"What is (\d+)", question)[0]) % 2 == 0)


def test_concurrent_rollouts_are_recorded_apart_token_for_token_and_rewarded_by_the_environment(
        tiny_llm, monkeypatch):
    cfg = vf_cfg(tiny_llm)
    task, policy = VerifiersTask(cfg), HFPolicy(cfg)
    replied = calculator_script(policy, monkeypatch)
    problems = task.rows[:4]
    batch, runs = task.play(policy, problems, 2)  # 8 rollouts at once, each through the interception server
    assert [r.error for r in runs] == [None] * 8 and [len(r.calls) for r in runs] == [2] * 8
    for e, run in enumerate(runs):
        question = problems[e // 2][0]
        assert all(question in policy.tok.decode(c["prompt"]) for c in run.calls)  # its own calls, no other run's
        assert run.answer == product_reward(question)  # the environment's reward: its own product, right or not
        ids = [i for c in run.calls for i in c["ids"]]
        rows = (batch.run == e).nonzero().flatten().tolist()
        sampled = [batch.actions[r][batch.mask[r] == 1].tolist() for r in rows]
        assert sum(sampled, []) == ids  # trained on exactly the sampled tokens: nothing tokenized again
        assert all(c["ids"] in replied for c in run.calls)
    second = task.play(policy, problems, 2)[1]  # the same child, the next step
    assert [r.answer for r in second] == [r.answer for r in runs]


def test_held_out_tasks_are_the_environments_last_never_trained_on(tiny_llm):
    task = VerifiersTask(vf_cfg(tiny_llm, n_eval=8))
    assert [i for _, i in task.eval_set] == list(range(192, 200)) and len(task.rows) == 192
    drawn = {i for step in range(50) for _, i in task.train_problems(step)}
    assert drawn and max(drawn) < 192


@pytest.mark.parametrize("algo", ["reinforce", "reinforce_baseline", "ppo", "grpo", "rloo"])
def test_every_algorithm_trains_a_verifiers_environment(tiny_llm, tmp_path, algo):
    train.main(["--task", "vf:vf_calc", "--model", tiny_llm, "--algo", algo, "--batch-size", "4", "--group-size",
                "2", "--max-turns", "3", "--max-new-tokens", "8", "--n-eval", "2", "--steps", "2", "--gen-dtype",
                "float32", "--no-bf16", "--lora-r", "4", "--out", str(tmp_path / "run")])
    with open(tmp_path / "run" / "metrics.csv") as f:
        header, *rows = [line.strip().split(",") for line in f]
    steps = [r for r in (dict(zip(header, r)) for r in rows) if r["agent_errors"]]  # (the last row: an evaluation)
    assert len(steps) == 2 and {"eval_acc", "agent_errors", "turns", "eval_well_formed"} <= set(header)
    assert all(r["agent_errors"] == "0" and float(r["turns"]) >= 1 for r in steps)  # every rollout reached us


def test_a_rollout_worker_plays_a_verifiers_environment(tiny_llm, tmp_path):
    from test_serve import trainer_and_worker
    args = ["--task", "vf:vf_calc", "--model", tiny_llm, "--algo", "rloo", "--batch-size", "4", "--group-size", "2",
            "--max-turns", "2", "--max-new-tokens", "12", "--n-eval", "2", "--lora-r", "4", "--eval-every", "0",
            "--gen-dtype", "float32", "--no-bf16", "--ent-coef", "0.001", "--connect-timeout", "60"]
    trained, _ = trainer_and_worker(tmp_path, args, 2)
    assert len(trained) == 2 and all(r["agent_errors"] == "0" for r in trained)
    assert all(float(r["logp_gap"]) < 1e-4 for r in trained)  # the endpoint recorded exactly what was sampled


@pytest.mark.parametrize("trouble", ["raise", "hang", "block", "stdin"])
def test_a_rollout_that_raises_or_hangs_is_contained(tiny_llm, tmp_path, monkeypatch, capfd, trouble):
    """Every other task's rollout misbehaves (odd task index): it gets reward 0, counted by cause; the others are
    scored. One that blocks the child's whole process (its event loop) stops every run of the step: they time out,
    the child and the programs under it (in sessions of their own) are ended, and the next step goes on. A program
    a harness starts reads nothing of the trainer's commands."""
    harness = {"id": "vf_calc", "trouble": trouble, "pidfile": str(tmp_path / "pids")}
    cfg = vf_cfg(tiny_llm, agent_timeout=8, vf_config=json.dumps({"agent": {"harness": harness}}))
    task, policy = VerifiersTask(cfg), HFPolicy(cfg)
    calculator_script(policy, monkeypatch)
    problems = [task.rows[i] for i in (0, 1, 2, 3)]  # task indices 0-3: two misbehave
    started = time.time()
    runs = task.play(policy, problems, 2)[1]
    bad = {"raise": "raised", "hang": "timeout", "stdin": None}.get(trouble, "all")
    expected = ["timeout"] * 8 if bad == "all" else [None, None, bad, bad] * 2
    assert [r.error for r in runs] == expected
    assert time.time() - started < 8 + 10 + 5  # the timeout, and the 10 s the child has to say so
    if bad != "all":
        assert [r.answer for r in runs][::4] == [product_reward(q) for q, _ in problems[::2]]  # the environment's
    else:
        pids = [int(p) for p in (tmp_path / "pids").read_text().split()]
        assert pids and not [p for p in pids if alive(p)]
        assert "the environment's process stopped answering" in capfd.readouterr().err
    assert task.server.chat.runs == {} and not task.server.chat.running
    again = task.play(policy, problems[:1], 2)[1]
    assert [r.error for r in again] == [None, None] and [r.answer for r in again] == [product_reward(problems[0][0])] * 2
    if trouble == "raise":  # why, once
        assert "vf:vf_calc: a rollout failed: harness 'vf_calc': RuntimeError: the agent program failed" in capfd.readouterr().err


def alive(pid, within=5.0):
    """Is the process still running `within` seconds from now (a killed one may stay a zombie a moment)?"""
    end = time.time() + within
    while time.time() < end:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return False
        except FileNotFoundError:
            return False
        time.sleep(0.1)
    return True


def test_the_environments_process_ends_with_the_trainer_however_it_ends(tmp_path):
    script = ("import os, sys; sys.path.insert(0, sys.argv[1]); import tasks; c = tasks.VfChild('vf_calc', '', 5); "
              "c.start(); print(c.proc.pid, flush=True); os._exit(0)")  # os._exit: no atexit, as train.py ends
    out = subprocess.run([sys.executable, "-c", script, os.path.dirname(HERE)], capture_output=True, text=True,
                         timeout=300)
    assert not alive(int(out.stdout.split()[-1]))


def test_the_model_name_comes_before_a_header_a_harness_passed_on(tiny_llm):
    from serve import RUN_MODEL, serve_chat
    from test_agents import post
    cfg = vf_cfg(tiny_llm, max_new_tokens=4)
    server = serve_chat(HFPolicy(cfg), cfg, token="k")
    try:
        server.chat.open(["mine", "other"], True)
        status, _ = post(f"http://127.0.0.1:{server.server_port}/v1/chat/completions",
             {"model": RUN_MODEL + "mine", "messages": [{"role": "user", "content": "1 + 1?"}]},
                         {"X-Flatrl-Episode": "other", "Authorization": "Bearer k"})
        mine, other = server.chat.close(["mine", "other"])
        assert status == 200 and len(mine["calls"]) == 1 and other["calls"] == []
    finally:
        server.shutdown()


@pytest.mark.parametrize("flags,says", [
    (["--task", "vf:vf_calk"], r"no verifiers environment 'vf_calk' is installed .*did you mean vf_calc"),
    (["--vf-config", '{"agent": {"harness": {"colour": 1}}}'], r"--vf-config: agent\.harness\.colour: Extra inputs"),
    (["--vf-config", '{"agent": {"harness": {"id": "codex"}}}'], r"harness 'codex' needs a container"),
    (["--vf-config", '{"agent": {"runtime": {"type": "docker"}}}'], r"the agent runs in verifiers' docker runtime"),
    (["--vf-config", '{"taskset": {"id": "other"}}'], r"--vf-config names the taskset 'other'"),
    (["--vf-config", "[1]"], r"--vf-config must be a JSON object"),
    (["--task", "vf:"], r"give the environment's name: --task vf:NAME"),
    (["--vf-config", '{"agent": {"model": "gpt-5"}}'], r"the agent names a model or endpoint of its own"),
    (["--vf-config", '{"retries": {"max_retries": 1}}'], r"retries are on"),
    (["--vf-config", '{"id": "best-of-n"}'], r"the environment is a BestOfNEnv: flatrl trains one agent's"),
    (["--task", "arith", "--vf-config", "{}"], r"--vf-config configures a verifiers environment, and arith"),
])
def test_what_flatrl_cannot_train_is_a_one_line_error(tiny_llm, tmp_path, flags, says):
    args = ["--task", "vf:vf_calc", "--model", tiny_llm, "--steps", "1", "--out", str(tmp_path / "r"), *flags]
    with pytest.raises(SystemExit, match=r"^config error: .*" + says) as e:
        train.main(args)
    assert "\n" not in str(e.value)


def test_without_the_verifiers_package_it_is_a_one_line_error(tiny_llm, monkeypatch):
    import importlib.util
    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "verifiers" else find(name, *a))
    with pytest.raises(SystemExit, match=r'needs the verifiers package: pip install -e "\.\[verifiers\]"'):
        VerifiersTask(vf_cfg(tiny_llm))


def test_a_model_name_names_the_run_its_calls_are_recorded_in():
    from serve import RUN_MODEL, run_named
    assert run_named({"model": RUN_MODEL + "abc"}) == "abc"
    assert run_named({"model": "gpt-4o"}) is None and run_named({}) is None and run_named({"model": 3}) is None
