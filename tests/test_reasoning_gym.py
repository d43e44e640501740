"""--task rg:NAME: reasoning-gym's datasets graded by their own score_answer, drawn like every other task's."""
import csv
import json
import os
import subprocess
import sys

import pytest
import torch

import train
from config import Config
from model import HFPolicy
from tasks import ReasoningGym, answer_tag, task_class

pytest.importorskip("reasoning_gym", reason='the tasks extra: pip install -e ".[tasks]"')

SMALL = json.dumps({"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+", "-"]})


def rg_task(name, rg_config="", **kw):
    cfg = Config(**{"task": f"rg:{name}", "rg_config": rg_config, "n_eval": 8, "batch_size": 8, "group_size": 2,
                    **kw}).validate({"task": ["rg:NAME"]})
    return task_class(cfg.task)(cfg)


def wrong_answer(name, entry):
    if name == "countdown":
        return "1 + 1"
    if name == "basic_arithmetic":
        return str(int(entry["answer"]) + 1)
    return entry["answer"][::-1] + "x"  # spell_backward: the word itself, and a letter more


@pytest.mark.parametrize("name", ["countdown", "basic_arithmetic", "spell_backward"])
def test_the_datasets_own_grader_is_the_reward_and_a_score_of_one_is_correct(name):
    task = rg_task(name)
    for question, entry in task.eval_set[:4]:
        prompt = task.build_prompt(question)
        assert question in prompt and prompt.endswith("<answer></answer> tags.")
        right, wrong = f"Done. <answer>{entry['answer']}</answer>", f"<answer>{wrong_answer(name, entry)}</answer>"
        assert (task.reward(prompt, right, entry), task.correct(prompt, right, entry)) == (1.0, 1.0)
        assert task.reward(prompt, wrong, entry) < 1 and task.correct(prompt, wrong, entry) == 0.0
        assert task.reward(prompt, wrong, entry) == task.data.score_answer(answer_tag(wrong), entry)
        assert task.reward(prompt, f" {entry['answer']}\n", entry) == 1.0  # no tags: the whole reply is graded
        assert task.reward(prompt, f"<answer>{entry['answer']}</answer> or <answer>no</answer>", entry) < 1  # last


def test_the_rg_config_reaches_the_dataset():
    task = rg_task("basic_arithmetic", SMALL)
    assert task.data.config.max_terms == 2 and task.data.config.seed == 0 and len(task.data) == 10_000
    for question, entry in task.train_problems(0) + task.eval_set:
        assert entry["metadata"]["num_terms"] == 2 and entry["question"] == question


def problems(seed):
    task = rg_task("countdown", seed=seed)
    return [q for q, _ in task.eval_set], [[q for q, _ in task.train_problems(step)] for step in range(3)]


def test_the_same_seed_draws_the_same_problems_in_another_process():
    """Another interpreter, another hash seed: the same held-out set and the same steps; another run seed draws
    other training problems from the same held-out set."""
    code = "import json, tests.test_reasoning_gym as t; print(json.dumps(t.problems(0)))"
    env = {**os.environ, "PYTHONHASHSEED": "123"}
    there = json.loads(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                      check=True).stdout)
    held, steps = problems(0)
    assert there == [held, steps] and len(set(steps[0])) == 4 and steps[0] != steps[1]
    other_held, other_steps = problems(1)
    assert other_held == held and other_steps[0] != steps[0]


def test_held_out_problems_are_never_trained_on():
    """A dataset of 40 items with 16 held out: 200 steps' draws cover the other 24 and never touch the 16."""
    task = rg_task("basic_arithmetic", json.dumps({**json.loads(SMALL), "size": 40}), n_eval=16)
    trained = {q for step in range(200) for q, _ in task.train_problems(step)}
    everything = {task.data[i]["question"] for i in range(40)}
    assert len(task.eval_set) == 16 and not trained & task.held_keys
    assert trained | task.held_keys == everything


def test_an_unknown_dataset_is_one_line_naming_close_ones(tmp_path):
    with pytest.raises(SystemExit) as e:
        train.main(["--task", "rg:countdwn", "--out", str(tmp_path)])
    assert "no dataset 'countdwn'" in str(e.value) and "close names: countdown" in str(e.value)
    assert "\n" not in str(e.value)
    with pytest.raises(SystemExit, match="rg:chain_sum has no field 'min_term'; its fields: min_terms"):
        rg_task("chain_sum", '{"min_term": 2}')
    with pytest.raises(SystemExit, match=r"rg:chain_sum refuses it \(min_terms must be positive\); its fields: "
                                         r"min_terms \(default 2\)"):
        rg_task("chain_sum", '{"min_terms": 0}')
    with pytest.raises(SystemExit, match="--rg-config is not JSON"):
        rg_task("chain_sum", "{min_terms: 2}")
    with pytest.raises(SystemExit, match=r"task 'arith:x' is unknown \(did you mean 'arith'\?\); pick one of arith, rg:NAME$"):
        Config(task="arith:x").validate({"task": ["arith", "rg:NAME"]})


@pytest.mark.parametrize("config, said", [
    ('{"max_terms": "three"}', 'rg:basic_arithmetic\'s max_terms takes an integer \\(default 6\\), not "three"'),
    ('{"max_terms": true}', 'max_terms takes an integer \\(default 6\\), not true'),
    ('{"allow_negation": 1}', 'allow_negation takes true or false \\(default True\\), not 1'),
    ('{"format_style": "fancy"}', 'format_style takes one of "simple", "natural" \\(default \'simple\'\\), not "fancy"')])
def test_an_rg_config_value_of_the_wrong_type_is_one_line_naming_the_type(config, said):
    with pytest.raises(SystemExit, match=said) as e:
        rg_task("basic_arithmetic", config)
    assert "\n" not in str(e.value) and "supported" not in str(e.value)  # not Python's own words


def test_an_rg_config_value_is_checked_against_the_fields_type_not_its_defaults():
    from tasks import rg_dataset
    assert rg_dataset("manipulate_matrix", '{"w_rotate": 0.5}')[1]["w_rotate"] == 0.5  # float, default 1
    assert rg_dataset("calendar_arithmetic", '{"seed": null}')[1]["seed"] is None  # Optional[int]
    with pytest.raises(SystemExit, match="seed takes an integer or null \\(default 42\\), not \"x\""):
        rg_dataset("calendar_arithmetic", '{"seed": "x"}')
    with pytest.raises(SystemExit, match="its fields: .*, task_types$"):  # a field whose default is a factory
        rg_dataset("advanced_geometry", '{"task_type": 1}')


def test_rg_config_on_another_task_is_refused_before_any_work(tmp_path):
    with pytest.raises(SystemExit, match="--rg-config configures a reasoning-gym task, and arith is not one: drop it"):
        train.main(["--task", "arith", "--rg-config", '{"min_terms": 2}', "--model", "no/such-model", "--out",
                    str(tmp_path / "run")])  # refused before the model (which does not exist) is loaded
    assert not (tmp_path / "run").exists()


def test_a_missing_package_is_one_line_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import reasoning_gym now raises ImportError
    with pytest.raises(SystemExit) as e:
        rg_task("countdown")
    assert str(e.value) == 'config error: --task rg:NAME needs the reasoning-gym package: pip install -e ".[tasks]"'


def answering(answers):
    """HFPolicy.sample, scripted: row 0 of every two is the right answer in tags, row 1 a wrong one ("no"), each
    ended: groups whose rewards differ, which the tiny model alone never earns. answers: {question: answer}."""
    real = HFPolicy.sample

    def sample(self, seqs, n, greedy=False, max_new=None):
        ids, logps = real(self, seqs, n, greedy, max_new=max_new)
        for i in range(len(ids)):
            said = self.tok.decode(seqs[i // n])
            answer = next(a for q, a in answers.items() if q in said) if i % 2 == 0 else "no"
            ids[i] = self.tok.encode(f"<answer>{answer}</answer>", add_special_tokens=False) + [self.tok.eos_token_id]
            if logps:
                logps[i] = [0.0] * len(ids[i])
        return ids, logps
    return sample


def known_answers(rg_config, seed=0):
    task = rg_task("basic_arithmetic", rg_config, seed=seed)
    return {q: e["answer"] for q, e in task.eval_set + [p for step in range(4) for p in task.train_problems(step)]}


def test_rollout_rewards_are_the_graders_scores_and_a_wrong_reply_is_asked_again(tiny_llm, monkeypatch):
    monkeypatch.setattr(HFPolicy, "sample", answering(known_answers(SMALL)))
    task = rg_task("basic_arithmetic", SMALL, model=tiny_llm, max_turns=2, max_new_tokens=8, gen_dtype="float32",
                   lora_r=4)
    policy = HFPolicy(task.cfg)
    problems = task.train_problems(0)
    chats = [ep.chat for ep in task.play(policy, problems, 2)[1]]
    for i, chat in enumerate(chats):
        if i % 2 == 0:  # answered right: the episode ends there
            assert len(chat) == 1 and task.score(chat[0]["content"], problems[i // 2][1]) == 1
        else:  # told so and asked again; the second reply (right in episodes 1 and 5) is the outcome
            assert len(chat) == 3 and chat[1] == {"role": "user", "content": ReasoningGym.retry}
    batch = task.rollout(policy, step=0)
    assert batch.rewards.sum(1).tolist() == [1, 1, 1, 0, 1, 1, 1, 0] and batch.stats["accuracy"] == 0.75


@pytest.mark.parametrize("algo", ["reinforce", "reinforce_baseline", "ppo", "grpo", "rloo"])
def test_every_algorithm_trains_on_an_rg_task(tiny_llm, tmp_path, monkeypatch, capsys, algo):
    monkeypatch.setattr(HFPolicy, "sample", answering(known_answers(SMALL)))
    train.main(["--task", "rg:basic_arithmetic", "--rg-config", SMALL, "--model", tiny_llm, "--algo", algo,
                "--steps", "2", "--batch-size", "8", "--group-size", "2", "--max-new-tokens", "8", "--n-eval", "4",
                "--lora-r", "4", "--lr", "0.01", "--gen-dtype", "float32", "--out", str(tmp_path)])
    with open(tmp_path / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["step"] for r in rows] == ["0", "1", "2"]
    assert [float(r["reward"]) for r in rows[:2]] == [0.5, 0.5] and float(rows[1]["accuracy"]) == 0.5
    assert float(rows[0]["eval_acc"]) == 0.5  # greedy, one row a prompt: held-out prompts 0 and 2 answered right
    assert float(rows[1]["grad_norm"]) > 0 and rows[2]["reward"] == ""  # the last row: the final evaluation
    assert float(rows[1]["well_formed"]) == 1.0 and float(rows[1]["acc_well_formed"]) == 0.5  # every reply is tagged
    assert float(rows[0]["eval_well_formed"]) == 1.0 and float(rows[0]["eval_acc_well_formed"]) == 0.5
    said = capsys.readouterr().out  # its opening line
    assert "grading: rg:basic_arithmetic gave no partial credit (near misses of 8 held-out answers scored 0)" in said


def test_syllogisms_best_constant_answer_is_its_majority_answer_and_the_opening_line_says_it():
    """Yes / No: always the majority answer scores its share (the dataset's own grader); a short untagged reply is
    an answer (graded whole), a sentence is not."""
    task = rg_task("syllogism", n_eval=64, batch_size=32, group_size=4)
    answers = [entry["answer"] for _, entry in task.eval_set]
    majority = max(set(answers), key=answers.count)
    assert set(answers) == {"Yes", "No"} and task.constant == (majority, answers.count(majority) / 64)
    assert train.opening_lines(task.cfg, task, torch.nn.Linear(1, 1)).endswith(
        f"best constant answer: {majority!r} for every held-out problem scores {answers.count(majority) / 64:.3g} "
        "(eval_best_constant): an eval_acc at that level needs no more than that")
    question, entry = task.eval_set[0]
    replies = ("No", "<answer>It follows</answer>", "Yes, it follows from the premises", " ", "<answer></answer>")
    assert [task.well_formed(question, reply, entry) for reply in replies] == [1, 1, 0, 0, 0]


def test_the_opening_line_says_which_graders_give_partial_credit():
    # countdown: 0.01 for a reply that is no expression, 0.05 for a wrong one (near_misses: "", cut, changed, "0")
    assert rg_task("countdown", algo="grpo").grading_rule() == (
        "grading: rg:countdown gives partial credit (near misses of 8 held-out answers scored 0.01 to 0.05): reward can "
        "rise while accuracy stays 0; GRPO's std division makes a 0.01 difference a full-size advantage (--no-norm-std: "
        "to scale)")
    assert rg_task("countdown", algo="rloo").grading_rule().endswith("accuracy stays 0")  # the GRPO part: GRPO's


def test_a_trainer_and_a_rollout_worker_train_an_rg_task(tiny_llm, tmp_path):
    """The worker builds the same dataset from the same flags, samples, grades, and pushes; the trainer trains."""
    from test_serve import trainer_and_worker
    common = ["--task", "rg:basic_arithmetic", "--rg-config", SMALL, "--model", tiny_llm, "--algo", "grpo",
              "--batch-size", "8", "--group-size", "2", "--max-new-tokens", "8", "--n-eval", "4", "--lora-r", "4",
              "--gen-dtype", "float32", "--no-bf16", "--connect-timeout", "60",
              "--ent-coef", "0.001"]  # fp32 on both sides, whatever the CPU; ent-coef: every row scored (logp_gap)
    trained, _ = trainer_and_worker(tmp_path, common, 2)
    assert len(trained) == 2 and all(float(r["logp_gap"]) < 1e-4 for r in trained)
    assert json.loads((tmp_path / "t" / "samples.jsonl").read_text().splitlines()[0])["answer"] == \
        rg_task("basic_arithmetic", SMALL).eval_set[0][1]["answer"]  # samples.jsonl shows the answer alone


def test_a_graders_reply_reaches_neither_the_trainers_environment_nor_later_replies(tmp_path, monkeypatch):
    # rg:string_insertion's grader eval()s a reply that is not the answer (its "list of characters" form)
    monkeypatch.setenv("FLATRL_TOKEN", "secret")
    task = rg_task("string_insertion")
    question, entry = task.eval_set[0]
    leak = tmp_path / "leak"
    steal = f"open({str(leak)!r}, 'w').write(__import__('os').environ.get('FLATRL_TOKEN', 'none'))"
    assert task.reward(question, f"<answer>{steal}</answer>", entry) == 0.0
    assert not leak.exists()  # no file written (and the child's environment is empty)
    rewrite = "setattr(type(__import__('gc').get_referrers(type)[0]), 'x', 1) or list('ab')"
    cheat = ("[setattr(c, 'score_answer', lambda self, a, e: 1.0) for c in "
             "object.__subclasses__.__self__.__subclasses__() if c.__name__ == 'StringInsertionDataset'] and 'x'")
    task.reward(question, f"<answer>{cheat}</answer>", entry)
    task.reward(question, f"<answer>{rewrite}</answer>", entry)
    assert task.reward(question, "<answer>wrong</answer>", entry) == 0.0  # the grader is the dataset's own again
    assert task.reward(question, f"<answer>{entry['answer']}</answer>", entry) == 1.0


def test_a_reply_that_hangs_its_grader_scores_0_within_the_limit():
    import time
    task = rg_task("string_insertion")
    question, entry = task.eval_set[0]
    start = time.time()
    assert task.reward(question, "<answer>len(str(9**9**8))</answer>", entry) == 0.0
    assert time.time() - start < task.graders.wall_s + 2
    assert task.reward(question, f"<answer>{entry['answer']}</answer>", entry) == 1.0  # and the next is graded


def test_a_dataset_whose_items_follow_the_hash_seed_needs_pythonhashseed_for_its_graders():
    # isomorphic_strings iterates Python sets: the graders' child builds other items unless both share a hash seed
    code = "from test_reasoning_gym import rg_task; rg_task('isomorphic_strings'); print('built')"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # flatrl, installed or not
    outs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=os.path.dirname(__file__),
                           env={**env, **seed}) for seed in ({}, {"PYTHONHASHSEED": "0"})]
    assert outs[0].returncode == 1 and "set PYTHONHASHSEED=0" in outs[0].stderr.strip().splitlines()[-1]
    assert outs[1].stdout.endswith("built\n")  # one seed for both: graded as built


def test_a_graders_child_that_cannot_start_stops_the_run_not_scores_0():
    from tasks import Graders
    with pytest.raises(SystemExit, match="the graders' child did not start: .*no_such_dataset"):
        Graders("no_such_dataset", {}).score("1", 0, "What is 1?")
