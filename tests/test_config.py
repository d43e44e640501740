"""CLI and YAML parsing, unknown keys, validate() rejections."""
import os
import re
import subprocess
import sys

import pytest

import config
from algos import ADVANTAGES
from tasks import TASKS

CHOICES = {"task": list(TASKS), "algo": list(ADVANTAGES)}  # what train.py passes


def test_defaults_yaml_and_flags_layer(tmp_path):
    preset = tmp_path / "p.yaml"
    preset.write_text("algo: grpo\ngroup_size: 4\nlr: 1e-4\nbatch_size: 16\n")
    cfg = config.parse(["--config", str(preset), "--lr", "0.5", "--no-norm-std"])
    assert (cfg.algo, cfg.group_size, cfg.lr, cfg.norm_std, cfg.gamma) == ("grpo", 4, 0.5, False, 0.99)
    assert config.parse(["--config", str(preset)]).lr == 1e-4  # YAML's "1e-4" string cast to float


def test_config_round_trips_through_the_run_dir(tmp_path):
    cfg = config.parse(["--algo", "ppo", "--epochs", "3"])
    config.save(cfg, tmp_path / "config.yaml")
    assert config.parse(["--config", str(tmp_path / "config.yaml")]) == cfg


@pytest.mark.parametrize("argv,needle", [
    (["--lrr", "3"], "did you mean '--lr'"),
    (["--learning-rate", "3"], "did you mean '--lr'"),
    (["--algo", "a2c"], "pick one of reinforce, reinforce_baseline, ppo, grpo, rloo"),
    (["--algo", "grpoo"], "did you mean 'grpo'"),
    (["--task", "arithmetic"], "did you mean 'arith'"),
    (["--eps", "0.3"], "--eps-high >= --eps"),
    (["--dual-clip", "0.5"], "> 1"),
    (["--loss-agg", "mean"], "token_mean"),
    (["--kl-estimator", "k4"], "pick one of k1, k2, k3"),
    (["--tis-clip", "0.5"], "tis_clip 0.5 < 1 would down-weight every token"),
    (["--generator", "vllm", "--vllm-lora", "adapter", "--lora-r", "0"], "needs --vllm-lora merge"),
    (["--old-logp", "mine"], "pick one of trainer, sampler"),
    (["--batch-size", "6", "--group-size", "4", "--algo", "grpo"], "multiple of group_size"),
    # out of range: each of these crashed (or trained on nonsense) at some later point before it was refused here
    (["--n-eval", "0"], "n_eval must be >= 1, not 0 (held-out prompts per LLM evaluation"),
    (["--eval-episodes", "0"], "eval_episodes must be >= 1, not 0"),
    (["--max-new-tokens", "0"], "max_new_tokens must be >= 1, not 0"),
    (["--eval-k", "-1"], "eval_k must be >= 0, not -1"),
    (["--lora-r", "-1"], "lora_r must be >= 0, not -1 (LoRA rank (0 = full fine-tuning))"),
    (["--gamma", "1.5"], "gamma must be >= 0 and <= 1, not 1.5"),
    (["--port", "70000"], "port must be >= 0 and <= 65535, not 70000"),
    (["--lr", "0"], "lr must be > 0, not 0.0"),
    (["--turn-discount", "0"], "turn_discount must be > 0 and <= 1, not 0.0"),
    (["--weight-decay", "-1"], "weight_decay must be >= 0, not -1.0"),
    (["--ops", "+/"], "ops '+/': arith draws from + - and *"),
    (["--ops", ""], "arith draws from + - and *"),
])
def test_rejections_name_the_fix(argv, needle):
    with pytest.raises(SystemExit, match="config error") as e:
        config.parse(argv, CHOICES)
    assert needle in str(e.value)


# The numeric fields without a RANGES entry, each with a value its own check refuses and the message's words.
OWN_CHECKS = {"eps_high": ("0.1", "eps_high 0.1 < eps 0.2"), "dual_clip": ("0.5", "dual_clip must be 0 (off) or > 1"),
              "tis_clip": ("0.5", "tis_clip 0.5 < 1 would down-weight"),
              "ent_coef": ("nan", "ent_coef must be a finite number, not nan")}  # negative: a legitimate penalty


def test_every_numeric_field_has_a_range_or_its_own_check():
    """A new int or float field gets a RANGES entry (or a check of its own, exercised here): a bad value is refused
    by name before anything runs, not met as a traceback at the first step that uses it."""
    numeric = {f.name for f in config.dataclasses.fields(config.Config) if f.type in (int, float)}
    assert numeric - set(config.RANGES) == set(OWN_CHECKS)
    for key, (value, needle) in OWN_CHECKS.items():
        with pytest.raises(SystemExit, match="config error") as e:
            config.parse(["--" + key.replace("_", "-"), value], CHOICES)
        assert needle in str(e.value), key
    assert set(config.POSITIVE) <= set(config.RANGES)
    for key, (low, high) in config.RANGES.items():  # the defaults themselves are in range
        value = getattr(config.Config(), key)
        assert (low < value if key in config.POSITIVE else low <= value) and (high is None or value <= high), key


def test_nan_and_inf_are_refused_in_every_float_field(tmp_path):
    """NaN passes every range comparison (and trained a whole run on skipped steps); inf crashed in sampling."""
    floats = [f.name for f in config.dataclasses.fields(config.Config) if f.type is float]
    assert len(floats) >= 18
    for key in floats:
        for value in ("nan", "inf", "-inf"):
            with pytest.raises(SystemExit, match=f"config error: {key} must be a finite number, not {value}"):
                config.parse([f"--{key.replace('_', '-')}={value}"], CHOICES)
    preset = tmp_path / "p.yaml"
    preset.write_text("gamma: .nan\n")
    with pytest.raises(SystemExit, match="gamma must be a finite number, not nan"):
        config.parse(["--config", str(preset)])


@pytest.mark.parametrize("argv,needle", [
    (["--seed", "18446744073709551616"], "seed must be >= 0 and <= 4294967295"),  # a torch overflow traceback
    (["--seed", "-1"], "seed must be >= 0"),
    (["--temperature", "1e-40"], "temperature must be >= 0.001, not 1e-40"),  # logits / T overflowed in the sampler
])
def test_seed_and_temperature_out_of_range(argv, needle):
    with pytest.raises(SystemExit, match="config error") as e:
        config.parse(argv, CHOICES)
    assert needle in str(e.value)


@pytest.mark.parametrize("line,needle", [
    ('stop_when_solved: "false"', "stop_when_solved must be true or false, not 'false'"),
    ("stop_when_solved: no_thanks", "stop_when_solved must be true or false, not 'no_thanks'"),
    ("norm_std: 0", "norm_std must be true or false, not 0"),
    ("steps: abc", "steps must be an integer such as 8, not 'abc'"),
    ("steps: 8.5", "steps must be an integer such as 8, not 8.5"),
    ("lr: fast", "lr must be a number such as 3e-4, not 'fast'"),
    ("lr: true", "lr must be a number such as 3e-4, not True"),
    ("model: 7", "model must be a string, not 7"),
    ("learning_rate: 0.1", "unknown key 'learning_rate' in .* \\(did you mean 'lr'\\?\\)"),
    ("- a list", "p.yaml must hold 'key: value' lines"),
])
def test_yaml_values_are_type_checked(tmp_path, line, needle):
    preset = tmp_path / "p.yaml"
    preset.write_text(line + "\n")
    with pytest.raises(SystemExit, match="^config error: .*" + needle):
        config.parse(["--config", str(preset)])


def test_yaml_booleans_and_numbers_that_are_fine(tmp_path):
    preset = tmp_path / "p.yaml"
    preset.write_text("stop_when_solved: false\nlr: 1e-4\ngamma: 1\nsteps: 12\n")  # YAML 1.1: 1e-4 is a string
    cfg = config.parse(["--config", str(preset)])
    assert (cfg.stop_when_solved, cfg.lr, cfg.gamma, cfg.steps) == (False, 1e-4, 1.0, 12)
    assert type(cfg.gamma) is float


def test_help_lists_the_registered_tasks_and_algorithms(capsys):
    with pytest.raises(SystemExit):
        config.parse(["--help"], CHOICES)
    out = " ".join(capsys.readouterr().out.split())
    tasks, algos = (re.search(rf"--{k} {k.upper()} .*?\[(.*?)\]", out)[1].split(", ") for k in ("task", "algo"))
    assert {"cartpole", "gym", "arith", "calc", "data", "jsonl"} <= set(tasks) and tasks == list(TASKS)
    assert {"reinforce", "reinforce_baseline", "ppo", "grpo", "rloo"} <= set(algos) and algos == list(ADVANTAGES)
    assert not os.environ.get("FLATRL_TEST_FORK") or ("fork" in tasks and "fork_rloo" in algos)


@pytest.mark.skipif(bool(os.environ.get("FLATRL_TEST_FORK")), reason="this test runs the others as the fork")
def test_a_fork_that_adds_a_task_a_reward_and_an_algorithm_keeps_the_tests_green():
    """README's way of adding a task (and an algorithm): the suite checks the built-ins are there, not that nothing
    else is. conftest.py registers the additions when FLATRL_TEST_FORK is set."""
    files = ["tests/test_config.py", "tests/test_algos.py"]
    run = subprocess.run([sys.executable, "-m", "pytest", *files, "-p", "no:cacheprovider"], capture_output=True,
                         text=True, env={**os.environ, "FLATRL_TEST_FORK": "1"}, cwd=os.path.dirname(__file__) + "/..")
    assert run.returncode == 0, run.stdout[-3000:]
    assert re.search(r"\d+ passed", run.stdout) and " failed" not in run.stdout


def test_one_shot_fields_are_not_saved_with_the_run(tmp_path):
    cfg = config.parse(["--ask", "What is 2 + 2?", "--check-parity"])
    config.save(cfg, tmp_path / "config.yaml")
    again = config.parse(["--config", str(tmp_path / "config.yaml")])
    assert (again.ask, again.check_parity) == ("", False)


def test_unknown_yaml_key_names_the_closest(tmp_path):
    preset = tmp_path / "p.yaml"
    preset.write_text("gama: 0.9\n")
    with pytest.raises(SystemExit, match="unknown key 'gama'.*did you mean 'gamma'"):
        config.parse(["--config", str(preset)])


def test_every_field_has_a_help_comment():
    helps = config._field_help()
    assert set(helps) == {f.name for f in config.dataclasses.fields(config.Config)}


def test_every_preset_parses():
    import glob
    presets = glob.glob("configs/*.yaml")
    assert len(presets) >= 10
    for path in presets:
        assert config.parse(["--config", path], CHOICES).algo in ADVANTAGES


def test_a_config_from_before_the_probe_went_still_loads_with_a_note(tmp_path, capsys):
    """probe_tol (the worker sync probe, replaced by gap_tol on logp_gap) is ignored, not refused: old runs resume."""
    old = tmp_path / "config.yaml"
    old.write_text("algo: ppo\nprobe_tol: 0.25\n")
    assert config.parse(["--config", str(old)]).algo == "ppo"
    assert "note: " + str(old) + ": probe_tol ignored (the worker sync probe is gone" in capsys.readouterr().err
