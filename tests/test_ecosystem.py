"""Datasets (local files of every format, one-line errors offline), trackers (TensorBoard read back, wandb
offline), the run picture, and --help grouped by section. Offline, seconds each."""
import csv
import os
import re
import subprocess
import sys

import pytest

import config
import train
from tasks import DataTask, numeric_match
from test_llm import llm_cfg

ROWS = [{"question": f"Sam has {i} apples and buys {i % 5} more. How many?", "answer": f"{i} + {i % 5} = ...\n#### {i + i % 5:,}"}
        for i in range(998, 1030)]


def write(path, fmt, rows=ROWS):
    import pandas as pd  # comes with datasets
    frame = pd.DataFrame(rows)
    {"jsonl": lambda: frame.to_json(path, orient="records", lines=True), "json": lambda: frame.to_json(path, orient="records"),
     "parquet": lambda: frame.to_parquet(path), "csv": lambda: frame.to_csv(path, index=False)}[fmt]()
    return str(path)


@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet", "csv"])
def test_local_files_of_every_format(tmp_path, fmt, tiny_llm):
    task = DataTask(llm_cfg(tiny_llm, task="data", data=write(tmp_path / f"rows.{fmt}", fmt), n_eval=4))
    assert [q for q, _ in task.eval_set] == [r["question"] for r in ROWS[-4:]]  # the last n_eval rows, in order
    assert task.eval_set[0][1] == str(1026 + 1026 % 5)  # "#### 1,027" -> "1027"
    drawn = {q for step in range(20) for q, _ in task.train_problems(step)}
    assert drawn and not drawn & {q for q, _ in task.eval_set} and len(task.rows) == len(ROWS) - 4


@pytest.mark.parametrize("kw,needle", [
    ({"data": "missing.jsonl"}, "'missing.jsonl': no such file"),
    ({"data": "ROWS", "question_field": "prompt"}, "has no field 'prompt' (it has question, answer): set --question-field"),
    ({"data": "ROWS", "eval_split": "test"}, "--eval-split names a split of a hub dataset"),
    ({"data": "ROWS", "n_eval": 40}, "too few rows for 40 held out"),
    ({"data": "nobody-here/no-such-dataset"}, "a hub dataset must be cached to load offline"),
])
def test_data_mistakes_are_one_line_errors(tmp_path, tiny_llm, kw, needle):
    rows = write(tmp_path / "rows.jsonl", "jsonl")
    args = [f"--{k.replace('_', '-')}={rows if v == 'ROWS' else v}" for k, v in {"n_eval": 4, **kw}.items()]
    run = subprocess.run([sys.executable, "train.py", "--task", "data", "--model", tiny_llm, *args, "--out", str(tmp_path / "r")],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1",
                                                                           "HF_DATASETS_OFFLINE": "1"})
    assert run.returncode != 0 and "Traceback" not in run.stderr and len(run.stderr.strip().splitlines()) == 1, run.stderr
    assert run.stderr.startswith("config error: --") and needle in run.stderr


def test_rows_without_a_usable_answer_are_refused_at_load(tmp_path, tiny_llm):
    rows = [{k: v for k, v in r.items() if k != "answer" or i % 5 != 4} for i, r in enumerate(ROWS)]  # every fifth
    path = write(tmp_path / "rows.jsonl", "jsonl", rows)
    run = subprocess.run([sys.executable, "train.py", "--task", "data", "--model", tiny_llm, "--data", path, "--n-eval", "4",
                          "--out", str(tmp_path / "r")], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    assert run.returncode == 1 and len(run.stderr.strip().splitlines()) == 1, run.stderr
    assert run.stderr.startswith(f"config error: --data {path}: row 5 has no usable 'answer' (None;")
    assert not os.path.exists(tmp_path / "r")  # refused before anything was written, the folder too


def test_the_data_cpu_preset_asks_for_a_short_answer():
    cfg = config.parse(["--config", "configs/data_grpo_cpu.yaml"])
    task = DataTask(cfg)  # the shipped file, as shipped
    assert len(task.rows) == 240 - 32 and len(task.eval_set) == 32
    q, a = task.eval_set[0]
    assert task.build_prompt(q) == q + " Reply with just the number." and a.isdigit()
    default = DataTask(config.parse(["--config", "configs/data_grpo_cpu.yaml", "--data-prompt", config.Config.data_prompt]))
    assert "<answer>" in default.build_prompt(q)  # the GSM8K-style default stays for the hub presets


def test_data_replies_are_scored_by_their_final_number():
    """SmolLM2 answers a word problem in a sentence that restates the numbers first: the first number (arith's
    rule) is an operand, so the shipped preset got reward 0 on every sample and learned nothing."""
    task = DataTask(config.parse(["--config", "configs/data_grpo_cpu.yaml"]))
    reply = "Chloe has 7 shells and 5 more, so she has 7 + 5 = 12 shells now."
    assert task.correct("q", reply, "12") == 1.0 and task.reward("q", reply, "12") == 1.0
    assert numeric_match("q", reply, "12") == 0.0  # the first number: 7
    assert task.reward("q", "12 - 5 = 7 <answer>12</answer> so 7", "12") == pytest.approx(1.1)  # the tag wins, +0.1
    assert task.correct("q", "She has 1,234.5 left.", "1234.5") == 1.0 and task.correct("q", "none", "3") == 0.0


def test_the_gsm8k_preset_names_the_hub_dataset():
    cfg = config.parse(["--config", "configs/gsm8k_grpo_gpu.yaml"])
    assert (cfg.task, cfg.data, cfg.data_config, cfg.eval_split) == ("data", "openai/gsm8k", "main", "test")


def cartpole(tmp_path, *flags):
    train.main(["--task", "cartpole", "--steps", "3", "--no-stop-when-solved", "--eval-every", "2", "--out", str(tmp_path), *flags])
    return list(csv.DictReader(open(tmp_path / "metrics.csv")))


def test_tensorboard_events_are_written_and_read_back(tmp_path):
    pytest.importorskip("tensorboard", reason="pip install tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    rows = cartpole(tmp_path, "--log-to", "tensorboard")
    events = EventAccumulator(str(tmp_path / "tensorboard")).Reload()
    assert [e.value for e in events.Scalars("reward")] == pytest.approx([float(r["reward"]) for r in rows if r["reward"]], rel=1e-5)
    assert [e.step for e in events.Scalars("eval_return")] == [0, 2, 3]
    assert '"algo": "reinforce"' in events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()


def test_wandb_offline_writes_its_run(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb", reason="pip install wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cartpole(tmp_path, "--log-to", "wandb")
    assert wandb.run is None  # flatrl finished its run
    wandb.teardown()  # as at a process's exit: waits until wandb's service has written the run out (once in CI, the
    # file still held only its 7-byte header when read right after finish() returned)
    (run,) = [d for d in os.listdir(tmp_path / "wandb") if d.startswith("offline-run-")]
    (log,) = (tmp_path / "wandb" / run).glob("*.wandb")  # protobuf records: wandb 0.31 has no Python reader
    data = log.read_bytes()
    assert b'algo\x82\x01\x0b"reinforce"' in data  # the config, key and JSON value
    assert data.count(b"reward") >= 3  # one record per logged step


def test_a_missing_tracker_package_is_a_one_line_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    with pytest.raises(SystemExit, match="--log-to wandb needs its package: pip install wandb"):
        cartpole(tmp_path, "--log-to", "wandb")
    with pytest.raises(SystemExit, match="log_to 'mlflow': use tensorboard, wandb or both"):
        config.parse(["--log-to", "mlflow"])


def test_the_run_picture_has_a_panel_per_metric_group(tmp_path):
    from matplotlib.image import imread
    cartpole(tmp_path, "--plot", "on")
    img = imread(tmp_path / "curves.png")
    height, width, _ = img.shape
    # reward + eval, entropy, approx_kl + clipfrac, length + truncated, grad_norm: 5 panels on a 2 x 3 grid of
    # 4.2 x 3.1 in at 90 dpi; the sixth cell (staleness, async runs only) is left blank
    assert (width, height) == (round(3 * 4.2 * 90), round(2 * 3.1 * 90))
    assert (img[height // 2 + 5:, 2 * width // 3 + 5:, :3] == 1).all() and not (img[height // 2 + 5:, :width // 3, :3] == 1).all()


def test_the_picture_shows_format_apart_from_correctness(tmp_path, monkeypatch):
    """Held out: eval_acc beside the well-formed share, the accuracy among those and the best constant's; training:
    the same pair for the sampled replies, in a panel of its own."""
    from matplotlib.figure import Figure
    from utils import Logger
    figs = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **kw: figs.append(fig))
    log = Logger(str(tmp_path), 0, 2, config.Config(steps=2))
    held = {"eval_acc": 0.1, "eval_well_formed": 0.2, "eval_acc_well_formed": 0.5, "eval_best_constant": 0.6}
    for step in (0, 1):
        log.log({"step": step, "time_s": step, **(held if step == 0 else {}), "reward": 0.3, "well_formed": 0.25 * step,
                 "acc_well_formed": 0.75}, step)
    log.close(str(tmp_path))
    panels = {}  # a panel's lines, on its axis and its right-hand one (the same cell of the grid)
    for ax in figs[0].axes:
        lines = {line.get_label(): list(line.get_ydata()) for line in ax.get_lines()}
        panels.setdefault(ax.get_subplotspec().num1, {}).update(lines)
    panels = [panels[cell] for cell in sorted(panels)]
    assert panels[0] == {"reward": [0.3, 0.3], **{k: [v] for k, v in held.items()}}
    assert panels[1] == {"well_formed": [0.0, 0.25], "acc_well_formed": [0.75, 0.75]}


def test_twin_axis_series_stay_apart_and_a_constant_one_gets_a_range(tmp_path, monkeypatch):
    from matplotlib.figure import Figure
    from utils import Logger
    figs = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **kw: figs.append(fig))
    log = Logger(str(tmp_path), 0, 2, config.Config(steps=2))
    for step in (1, 2):  # few points; length on the left, truncated on its own right-hand axis; reward constant
        log.log({"step": step, "time_s": step, "reward": 1.0, "length": 20.0 + step, "truncated": 0.5}, step)
    log.close(str(tmp_path))
    axes = {line.get_label(): line for ax in figs[0].axes for line in ax.get_lines()}
    left, right = axes["length"], axes["truncated"]
    assert left.axes is not right.axes  # two scales ...
    assert (left.get_linestyle(), left.get_marker()) != (right.get_linestyle(), right.get_marker())  # ... told apart
    assert right.get_fillstyle() == "none"  # hollow: a marker under the other's still shows
    assert axes["reward"].axes.get_ylim() == pytest.approx((0, 1.1))  # not 0.96-1.04 around the one value
    assert axes["truncated"].axes.get_ylim() == pytest.approx((0, 0.55))


def test_help_is_grouped_by_the_sections_of_config_py(capsys):
    with pytest.raises(SystemExit):
        config.parse(["--help"])
    out = capsys.readouterr().out
    for section, flag in (("run:", "--seed"), ("async (serve.py): a trainer and any number of rollout workers:", "--port"),
                          ("LLM tasks:", "--max-turns"), ("update:", "--eps-high")):
        assert out.index(section) < out.index("\n  " + flag + " ")  # the flag's own line, not the usage
    assert out.index("update:") > out.index("LLM tasks:") > out.index("run:")


def documented_columns():
    """The README's metrics table: each row's first cell, names split at commas; `*` and `@k` stand for any ending."""
    readme = open(os.path.join(os.path.dirname(__file__), "..", "README.md")).read()
    table = readme[readme.index("| column | how to read it |"):].split("\n\n")[0].splitlines()[2:]
    names = [n.strip() for row in table for n in row.split("|")[1].split(",")]
    return [re.escape(n).replace(r"\*", ".*").replace("@k", r"@\d+") for n in names]


def undocumented(columns):
    return sorted(c for c in columns if not any(re.fullmatch(p, c) for p in documented_columns()))


def test_every_column_a_run_writes_is_in_the_readmes_table(tiny_llm, tmp_path):
    """Collected from a sync LLM run (multi-turn, pass@k), a tool run, an agent run, and an async trainer with a
    worker (TIS)."""
    from test_serve import CARTPOLE, finish, free_port, spawn
    tiny = ["--model", tiny_llm, "--algo", "grpo", "--group-size", "2", "--batch-size", "4", "--steps", "1",
            "--max-new-tokens", "6", "--n-eval", "2", "--lora-r", "2"]
    train.main(["--task", "arith", *tiny, "--max-turns", "2", "--eval-k", "2", "--out", str(tmp_path / "sync")])
    train.main(["--task", "calc", *tiny, "--max-turns", "2", "--out", str(tmp_path / "tool")])
    train.main(["--task", "calc_agent", *tiny, "--max-turns", "2", "--out", str(tmp_path / "agent")])
    port = free_port()
    trainer = spawn(*CARTPOLE, "--role", "trainer", "--port", str(port), "--steps", "3", "--tis-clip", "2",
                    "--out", str(tmp_path / "trainer"))
    worker = spawn(*CARTPOLE, "--role", "rollout", "--trainer-url", f"http://127.0.0.1:{port}", "--tis-clip", "2",
                   "--out", str(tmp_path / "worker"))
    finish(trainer, partners=[worker]), finish(worker)
    columns = {}
    for run in ("sync", "tool", "agent", "trainer", "worker"):
        columns[run] = set(csv.DictReader(open(tmp_path / run / "metrics.csv")).fieldnames)
    assert {"eval_acc_turn1", "eval_pass@2", "turns"} <= columns["sync"]
    assert {"tool_calls", "eval_tool_errors"} <= columns["tool"]
    assert {"agent_errors", "agent_sampling_ignored", "eval_turns", "eval_agent_errors"} <= columns["agent"]
    assert {"tis_weight", "staleness_max", "rejected"} <= columns["trainer"] and "status" in columns["worker"]
    assert undocumented(set.union(*columns.values())) == []
    assert undocumented({"eval_pass@16", "dropped_late", "new_metric"}) == ["dropped_late", "new_metric"]


def test_a_metrics_file_from_before_the_trained_rename_resumes_into_one_set_of_columns(tmp_path):
    from utils import Logger
    (tmp_path / "metrics.csv").write_text("step,time_s,reward,entropy,approx_kl\n0,1,0.5,2.5,0.01\n1,2,0.6,2.4,0.02\n")
    log = Logger(str(tmp_path), 2, 3)
    log.log({"step": 2, "time_s": 3.0, "reward": 0.7, "trained_entropy": 2.3, "trained_approx_kl": 0.03}, 3)
    log.close(str(tmp_path), plot=False)
    rows = list(csv.DictReader(open(tmp_path / "metrics.csv")))
    assert list(rows[0]) == ["step", "time_s", "reward", "trained_entropy", "trained_approx_kl"]
    assert [r["trained_entropy"] for r in rows] == ["2.5", "2.4", "2.3"]


def test_settings_that_change_a_documented_behaviour_are_said_at_the_start(tmp_path, capsys):
    cartpole(tmp_path / "a", "--gamma", "1")
    cartpole(tmp_path / "b", "--old-logp", "sampler")
    cartpole(tmp_path / "c", "--gamma", "1", "--algo", "ppo")  # the critic bootstraps: nothing to say
    out = capsys.readouterr()
    said = out.out + out.err
    assert said.count("at --gamma 1 an episode cut by the time limit is not bootstrapped") == 1
    assert said.count("--old-logp sampler: old_logp is the sampler's own, so logp_gap is 0") == 1
