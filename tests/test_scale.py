"""Scale-out on CPU with gloo: FSDP2 against one process, a data-parallel async trainer, the cluster recipe's
commands (two torchrun "nodes" on loopback), and checkpoints that a kill -9 cannot lose."""
import csv
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

import tasks
import train
import utils
from algos import ADVANTAGES
from config import Config
from model import HFPolicy, MLPPolicy, shared_prompts
from tasks import GymTask
from test_llm import flat, leave_rank, llm_cfg, shared_batch
from test_serve import ROOT, finish, free_port, output, rows, spawn
from utils import Batch, Logger


def _fsdp_rank(r, port, cfg, batch_file, out_file):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=r, world_size=2)
    torch.manual_seed(0)
    policy = HFPolicy(cfg)  # the same initial weights on both ranks, then sharded
    local = [sum((p.to_local() if hasattr(p, "to_local") else p).nbytes for p in policy.parameters() if p.requires_grad == t)
             for t in (True, False)]
    whole = [sum(p.numel() * p.element_size() for p in policy.parameters() if p.requires_grad == t) for t in (True, False)]
    batch = Batch(**load_file(batch_file))
    mine = batch.rows(torch.nonzero(batch.group % 2 == r)[:, 0])  # this rank's prompt groups
    mine.adv, _ = ADVANTAGES[cfg.algo](mine, cfg)
    stats = train.update(policy, torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=1.0), mine, cfg,
                         cfg.max_new_tokens, old_from=train.old_logp_from(cfg, mine))
    params = flat(policy)  # gathered whole on every rank
    if r == 0:
        save_file({"params": params, "bytes": torch.tensor(local + whole, dtype=torch.float64),
                   "loss": torch.tensor(stats["loss"]), "grad_norm": torch.tensor(stats["grad_norm"])}, out_file)
    leave_rank()


@pytest.mark.parametrize("lora_r", [4, 0])
def test_fsdp_two_ranks_equal_one_process(tiny_llm, tmp_path, lora_r):
    one = llm_cfg(tiny_llm, lora_r=lora_r)
    cfg = dataclasses.replace(one, fsdp=True)  # validate() would want torchrun's WORLD_SIZE: the ranks come from mp.spawn
    policy, batch = shared_batch(one, tmp_path / "batch.safetensors")
    assert shared_prompts(batch, policy.cfg) is not None  # the ranks run each group's prompt once (model.forward_logits) ...
    unshared = dataclasses.replace(one, group_size=1)  # ... the one process runs every row whole
    policy.cfg = unshared
    stats = train.update(policy, torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=1.0), batch,
                         unshared, one.max_new_tokens, old_from=train.old_logp_from(unshared, batch))
    mp.spawn(_fsdp_rank, args=(free_port(), cfg, str(tmp_path / "batch.safetensors"), str(tmp_path / "out.safetensors")),
             nprocs=2)
    out = load_file(tmp_path / "out.safetensors")
    assert torch.allclose(out["params"], flat(policy), atol=1e-6, rtol=0)  # updated weights: the same
    assert out["loss"].item() == pytest.approx(stats["loss"], abs=1e-6)
    assert out["grad_norm"].item() == pytest.approx(stats["grad_norm"], rel=1e-5)  # so the gradient's norm too
    trainable, frozen, trainable_all, frozen_all = out["bytes"].tolist()
    assert 0.45 <= trainable / trainable_all <= 0.55  # each rank holds about half of every parameter
    assert frozen_all == 0 or 0.45 <= frozen / frozen_all <= 0.55
    print(f"FSDP, 2 ranks, lora_r {lora_r}: rank 0 holds {trainable / trainable_all:.3f} of the trainable and "
          f"{frozen / max(frozen_all, 1):.3f} of the frozen parameter bytes")


def torchrun(*args, nproc=2, env=None, script="train.py"):
    return spawn(env=env, cmd=[sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                               "--master-addr", "127.0.0.1", "--master-port", str(free_port()), script, *args])


def test_fsdp_checkpoint_resume_is_exact_and_the_adapter_loads_with_peft(tiny_llm, tmp_path):
    from peft import AutoPeftModelForCausalLM
    common = ["--task", "arith", "--model", tiny_llm, "--algo", "grpo", "--batch-size", "8", "--group-size", "2",
              "--max-new-tokens", "8", "--n-eval", "4", "--lora-r", "4", "--lr", "0.05", "--eval-every", "0",
              "--gen-dtype", "float32", "--fsdp"]
    finish(torchrun(*common, "--steps", "4", "--out", str(tmp_path / "full")))
    finish(torchrun(*common, "--steps", "2", "--out", str(tmp_path / "half")))
    finish(torchrun("--resume", str(tmp_path / "half"), "--steps", "4"))
    a, b = (load_file(tmp_path / d / "checkpoint.safetensors") for d in ("full", "half"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # resumed == never stopped, bit for bit
    assert a["rng.torch"].shape[0] == 2  # each rank's RNG state is kept
    lm = AutoPeftModelForCausalLM.from_pretrained(str(tmp_path / "full" / "adapter"))  # gathered whole: PEFT loads it
    ours = {k: v for k, v in lm.named_parameters() if "lora_" in k}
    assert len(ours) == 2 * 2 * 7  # A and B of 7 projections in 2 layers
    for k, v in ours.items():
        assert torch.equal(v, a["model.lm." + k]), k


def _async_rank(r, port, http_port, out_file):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=r, world_size=2)
    from serve import AsyncSource
    cfg = Config(role="trainer", port=http_port, batch_size=8, group_size=2, algo="grpo").validate()
    torch.manual_seed(0)
    task = GymTask(Config(**{**cfg.__dict__, "role": "rollout"}))
    policy = MLPPolicy(task.obs_dim, task.n_actions, 16)
    source = AsyncSource(task, policy, cfg, Logger(os.path.dirname(out_file), 0, 1), version=0)
    if r == 0:  # what a worker's POST leaves in the queue
        source.hub.queue.append(Batch(**load_file(os.path.join(os.path.dirname(out_file), "batch.safetensors"))))
    batch = source.next_batch(0)  # rank 0 broadcasts it; each rank keeps its share
    with source.weights(batch):
        train.score_old(policy, batch, cfg, "scored")
    batch.adv, _ = ADVANTAGES["grpo"](batch, cfg)
    train.update(policy, torch.optim.SGD(policy.parameters(), lr=1.0), batch, cfg, 500, old_from=train.old_logp_from(cfg, batch))
    if r == 0:
        save_file({"params": flat(policy), "rows": torch.tensor(len(batch.mask))}, out_file)
    source.close()
    leave_rank()


def test_a_pushed_batch_trains_two_ranks_like_one_process(tmp_path):
    cfg = Config(role="rollout", trainer_url="http://127.0.0.1:1", batch_size=8, group_size=2, algo="grpo").validate()
    torch.manual_seed(0)
    task = GymTask(cfg)
    policy = MLPPolicy(task.obs_dim, task.n_actions, 16)
    batch = task.rollout(policy, 0)
    save_file({k: v.contiguous() for k, v in batch.tensors().items()}, tmp_path / "batch.safetensors")
    train.score_old(policy, batch, cfg, "scored")
    batch.adv, _ = ADVANTAGES["grpo"](batch, cfg)
    train.update(policy, torch.optim.SGD(policy.parameters(), lr=1.0), batch, cfg, 500, old_from=train.old_logp_from(cfg, batch))
    mp.spawn(_async_rank, args=(free_port(), free_port(), str(tmp_path / "out.safetensors")), nprocs=2)
    out = load_file(tmp_path / "out.safetensors")
    assert out["rows"].item() == 4  # rank 0 trained on half of the rows ...
    assert torch.allclose(out["params"], flat(policy), atol=1e-6, rtol=0)  # ... and the update is the whole batch's


def test_the_cluster_recipe_runs_two_trainer_nodes_and_a_worker(tmp_path):
    launch = os.path.join(ROOT, "configs", "cluster", "launch.sh")
    env = {**os.environ, "HEAD": "127.0.0.1", "BIND": "127.0.0.1", "PORT": str(free_port()), "NNODES": "2",
           "RDZV_PORT": str(free_port()), "CONFIG": "configs/cartpole_grpo.yaml",
           "TOKEN_FILE": str(tmp_path / "token")}
    env.pop("FLATRL_TOKEN", None)  # the token from a file: neither torchrun nor the shell holds it
    (tmp_path / "token").write_text("s3cret\n")
    flags = ["--steps", "6", "--no-stop-when-solved", "--eval-every", "0", "--connect-timeout", "60"]
    nodes = [spawn(cmd=["bash", launch, *flags, "--out", str(tmp_path / "t")], env={**env, "ROLE": "trainer", "NODE_RANK": str(i)})
             for i in range(2)]
    worker = spawn(cmd=["bash", launch, *flags, "--out", str(tmp_path / "w")], env={**env, "ROLE": "rollout"})
    outs = [finish(p, partners=[worker]) for p in nodes]
    assert "training finished" in finish(worker)
    assert len(rows(tmp_path / "t")) == 6 and "trainer listening on http://127.0.0.1" in outs[0]


def test_an_fsdp_async_trainer_and_a_worker(tiny_llm, tmp_path):
    port = free_port()
    common = ["--task", "arith", "--model", tiny_llm, "--algo", "grpo", "--batch-size", "8", "--group-size", "2",
              "--max-new-tokens", "8", "--n-eval", "4", "--lora-r", "4", "--eval-every", "0", "--gen-dtype", "float32",
              "--no-bf16", "--connect-timeout", "60"]  # fp32 on both sides, whatever the CPU
    trainer = torchrun(*common, "--fsdp", "--role", "trainer", "--port", str(port), "--steps", "3",
                       "--out", str(tmp_path / "t"))
    worker = spawn(*common, "--role", "rollout", "--trainer-url", f"http://127.0.0.1:{port}", "--out", str(tmp_path / "w"))
    out = finish(trainer, partners=[worker])
    assert "training finished" in finish(worker)
    trained = rows(tmp_path / "t")
    assert len(trained) == 3 and all(float(r["logp_gap"]) < 1e-4 for r in trained)  # fp32 worker vs gathered weights
    assert "parameters on each of 2 rank(s)" in out


# --- checkpoints a kill cannot lose ------------------------------------------------------------------

def wait_rows(run, n, proc, timeout=120):
    end = time.time() + timeout
    while time.time() < end:
        assert proc.poll() is None, output(proc)[-2000:]
        if os.path.exists(f"{run}/metrics.csv") and len(list(csv.DictReader(open(f"{run}/metrics.csv")))) >= n:
            return
        time.sleep(0.1)
    raise TimeoutError


def test_kill_9_with_default_flags_then_resume_reaches_the_end(tmp_path):
    run = str(tmp_path / "run")
    proc = spawn("--task", "cartpole", "--no-stop-when-solved", "--steps", "30", "--out", run)  # save_every: the default
    wait_rows(run, 12, proc)  # the checkpoint of step 10 is written
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert load_file(f"{run}/checkpoint.safetensors")  # a checkpoint exists without any flag asking for one
    out = finish(spawn("--resume", run))
    steps = [int(r["step"]) for r in csv.DictReader(open(f"{run}/metrics.csv"))]
    assert steps == list(range(31)) and "results in" in out  # each step once, to the end


KILLED_MID_SAVE = """
import os, sys, time, torch
import utils
path = sys.argv[1]
opt = torch.optim.AdamW([torch.nn.Parameter(torch.ones(3))], lr=0.1)
utils.save_checkpoint(path, {"w": torch.ones(3)}, opt, {"step": 1})
def slow_save(tensors, file, metadata):  # writes part of the file, then hangs: killed mid-save
    with open(file, "wb") as f:
        f.write(b"partial")
    print("saving", flush=True)
    time.sleep(60)
utils.save_file = slow_save
utils.save_checkpoint(path, {"w": torch.zeros(3)}, opt, {"step": 2})
"""


def test_a_kill_during_a_save_keeps_the_previous_checkpoint(tmp_path):
    path = str(tmp_path / "checkpoint.safetensors")
    proc = subprocess.Popen([sys.executable, "-c", KILLED_MID_SAVE, path], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "saving"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.ones(3))], lr=0.1)
    from utils import load_checkpoint
    params, meta = load_checkpoint(path, opt, {"w": torch.ones(3)})
    assert meta["step"] == 1 and torch.equal(params["w"], torch.ones(3))


def test_resume_with_flags_that_change_the_model_is_a_one_line_error(tmp_path):
    finish(spawn("--task", "cartpole", "--steps", "2", "--out", str(tmp_path / "r")))
    run = subprocess.run([sys.executable, "train.py", "--resume", str(tmp_path / "r"), "--hidden", "32"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "Traceback" not in run.stderr
    assert run.stderr.strip().startswith("config error: --resume") and "does not fit this policy" in run.stderr
    assert "hidden 128 there, 32 here" in run.stderr


# --- data parallelism trains one model: same start, same decisions, same steps ------------------------------

RANKS_SCRIPT = """
import os, sys
sys.path.insert(0, os.getcwd())  # run from the repository, as train.py is
import json, torch
import tasks, train
from utils import all_gather, unshard, rank

class Digits(tasks.Arith):  # a reward a random tiny model earns sometimes: groups vary, so there is a gradient
    rewards = [(1.0, lambda p, c, a: sum(ch.isdigit() for ch in c) / 8)]
tasks.TASKS["digits"] = Digits
diffs = {}

def record(name, policy):  # the largest difference between the two ranks' whole trainable weights
    mine = torch.cat([unshard(p).detach().flatten() for p in policy.params().values()])
    a, b = all_gather(mine)
    diffs[name] = (a - b).abs().max().item()

build = train.build
def recording_build(cfg):
    task, policy = build(cfg)
    record("built", policy)
    return task, policy
train.build = recording_build
if os.environ.get("NAN_AT") and int(os.environ["RANK"]) == 1:  # rank 1 alone sees NaN losses in this step's update
    loss_fn, update, steps = train.pg_loss, train.update, []
    def counting_update(*args, **kw):
        steps.append(1)
        return update(*args, **kw)
    def poisoned(*args, **kw):
        loss, stats = loss_fn(*args, **kw)
        return (loss * float("nan") if len(steps) - 1 == int(os.environ["NAN_AT"]) else loss), stats
    train.pg_loss, train.update = poisoned, counting_update
if os.environ.get("SOLVED_ON_RANK0_AT"):  # the ranks' evaluations disagree: only rank 0's says solved, at that step
    def disagreeing(self, policy, step):
        solved = step == int(os.environ["SOLVED_ON_RANK0_AT"]) and int(os.environ["RANK"]) == 0
        return {"eval_return": 500.0 if solved else 10.0}
    tasks.GymTask.evaluate = disagreeing
policy = train.main(sys.argv[1:])
record("trained", policy)
if rank() == 0:
    with open(os.path.join(sys.argv[sys.argv.index("--out") + 1], "diffs.json"), "w") as f:
        json.dump(diffs, f)
sys.stdout.flush(), sys.stderr.flush()
os._exit(0)  # as train.py ends: no teardown, whose C++ destructors can abort a rank ("terminate called ...")
"""


def ranks_run(tmp_path, name, *args, env=None, timeout=240):
    """train.main under torchrun, 2 ranks, with no seeding by the test. -> (metrics rows, rank differences)"""
    script = tmp_path / "ranks.py"
    script.write_text(RANKS_SCRIPT)
    out = tmp_path / name
    finish(torchrun(*args, "--out", str(out), script=str(script), env=env), timeout=timeout)
    with open(out / "metrics.csv") as f:
        return list(csv.DictReader(f)), json.load(open(out / "diffs.json"))


def test_ranks_stop_together_on_rank_0s_decision(tmp_path):
    rows, _ = ranks_run(tmp_path, "solved", "--task", "cartpole", "--steps", "8", "--eval-every", "2",
                        env={"SOLVED_ON_RANK0_AT": "4"})  # rank 1 alone would go on and wait for rank 0 forever
    assert [r["step"] for r in rows][-1] == "4" and float(rows[-1]["eval_return"]) == 500


def test_launch_sh_checks_its_preconditions_in_one_line_each(tmp_path):
    launch = os.path.join(ROOT, "configs", "cluster", "launch.sh")
    base = {k: v for k, v in os.environ.items() if k != "FLATRL_TOKEN"}
    cases = [({"ROLE": "trainer", "HEAD": "127.0.0.1", "CONFIG": "configs/cartpole_grpo.yaml"},
              "set TOKEN_FILE or FLATRL_TOKEN"),
             ({"ROLE": "trainer", "HEAD": "127.0.0.1", "CONFIG": "configs/cartpole_grpo.yaml",
               "TOKEN_FILE": str(tmp_path / "none")}, "is not a readable file"),
             ({"ROLE": "trainer", "HEAD": "no-such-host.invalid", "CONFIG": "configs/cartpole_grpo.yaml", "BIND": "127.0.0.1"},
              "does not resolve"),
             ({"ROLE": "rollout", "HEAD": "127.0.0.1", "CONFIG": "configs/nope.yaml"}, "is not a file"),
             ({"ROLE": "worker", "HEAD": "127.0.0.1", "CONFIG": "configs/cartpole_grpo.yaml"}, "ROLE=trainer or ROLE=rollout")]
    for env, needle in cases:
        run = subprocess.run(["bash", launch], env={**base, **env}, capture_output=True, text=True, timeout=60)
        assert run.returncode == 2 and len(run.stderr.strip().splitlines()) == 1 and needle in run.stderr, run.stderr
        assert run.stdout == ""  # torchrun never started


def test_data_parallel_cartpole_ranks_hold_one_model(tmp_path):
    _, diffs = ranks_run(tmp_path, "dp", "--task", "cartpole", "--steps", "3", "--batch-size", "8",
                         "--no-stop-when-solved")
    assert diffs == {"built": 0.0, "trained": 0.0}  # bitwise: one initial model, one update applied to it


@pytest.mark.parametrize("lora_r", ["4", "0"])
def test_dp_and_fsdp_take_the_same_steps_and_skip_a_nan_together(tmp_path, tiny_llm, lora_r):
    common = ["--task", "digits", "--model", tiny_llm, "--algo", "grpo", "--steps", "3", "--batch-size", "8",
              "--group-size", "2", "--max-new-tokens", "8", "--n-eval", "4", "--lora-r", lora_r, "--lr", "0.01",
              "--eval-every", "0", "--gen-dtype", "float32", "--no-bf16", "--save-every", "0"]  # fp32 everywhere
    nan = {"NAN_AT": "2"}  # rank 1's losses at step 2 are NaN; rank 0 never sees one
    t = time.time()
    dp, dp_diffs = ranks_run(tmp_path, "dp", *common, env=nan)
    fsdp, _ = ranks_run(tmp_path, "fsdp", *common, "--fsdp", env=nan)
    assert time.time() - t < 200  # neither hung in a collective that one rank skipped
    assert dp_diffs == {"built": 0.0, "trained": 0.0}  # LoRA's A starts random: the same on both ranks
    skipped = [r["step"] for r in dp if r.get("nonfinite") == "1"]
    assert skipped == ["2"] == [r["step"] for r in fsdp if r.get("nonfinite") == "1"]  # both ranks skipped it
    compared = 0
    for a, b in zip(dp, fsdp):
        if a.get("reward") and (a["reward"], a["length"]) == (b["reward"], b["length"]):  # the same rollouts
            assert (a.get("loss", ""), b.get("loss", "")) == ("", "") or float(a["loss"]) == pytest.approx(float(b["loss"]), rel=1e-5)
            if a.get("grad_norm"):
                assert float(a["grad_norm"]) == pytest.approx(float(b["grad_norm"]), rel=1e-5)
                compared += 1
    assert compared >= 1


def _layout_rank(r, port, cfg, batch_file, out_file):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=r, world_size=2)
    torch.manual_seed(0)
    policy = HFPolicy(cfg)
    batch = Batch(**load_file(batch_file))
    params = two_updates(policy, batch.rows(torch.nonzero(batch.group % 2 == r)[:, 0]), cfg)
    if r == 0:
        save_file({"params": params}, out_file)
    leave_rank()


def two_updates(policy, batch, cfg):
    """AdamW: a step on the batch, then one on the same rows with every advantage 0. -> the whole weights"""
    opt = train.optimizer(policy, cfg)  # train.py's
    for scale in (1.0, 0.0):
        batch.adv = ADVANTAGES["grpo"](batch, cfg)[0] * scale
        train.update(policy, opt, batch, cfg, cfg.max_new_tokens, old_from=train.old_logp_from(cfg, batch))
    return flat(policy)


@pytest.mark.parametrize("fsdp", [False, True])
def test_a_minibatch_with_nothing_to_learn_steps_alike_in_every_layout(tiny_llm, tmp_path, fsdp):
    cfg = llm_cfg(tiny_llm)
    policy, batch = shared_batch(cfg, tmp_path / "batch.safetensors")
    one = two_updates(policy, batch, cfg)
    mp.spawn(_layout_rank, args=(free_port(), dataclasses.replace(cfg, fsdp=fsdp), str(tmp_path / "batch.safetensors"),
                                 str(tmp_path / "out.safetensors")), nprocs=2)
    assert torch.allclose(load_file(tmp_path / "out.safetensors")["params"], one, atol=1e-6, rtol=0)  # no momentum step


def _count_rank(r, port, cfg, batch_file, out_file):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=r, world_size=2)
    batch = Batch(**load_file(batch_file))
    n = optimizer_steps(batch.rows(torch.arange(r * 6, r * 6 + 6)), cfg)
    if r == 0:
        save_file({"steps": torch.tensor(n)}, out_file)
    leave_rank()


def optimizer_steps(batch, cfg):
    policy = MLPPolicy(4, 2, 16)
    opt, calls = torch.optim.SGD(policy.parameters(), lr=0.1), []
    step = opt.step
    opt.step = lambda: calls.append(1) or step()
    train.score_old(policy, batch, cfg, "scored")  # as the loop does: two epochs need the old logprobs
    train.update(policy, opt, batch, cfg, 500, old_from=train.old_logp_from(cfg, batch))
    return len(calls)


def test_minibatches_are_counted_over_the_whole_batch(tmp_path):
    cfg = Config(batch_size=12, minibatches=4, epochs=2).validate()
    torch.manual_seed(0)
    task = GymTask(cfg)
    batch = task.rollout(MLPPolicy(task.obs_dim, task.n_actions, 16), 0)
    batch.adv = batch.rewards.clone()
    save_file({k: v.contiguous() for k, v in batch.tensors().items()}, tmp_path / "batch.safetensors")
    mp.spawn(_count_rank, args=(free_port(), cfg, str(tmp_path / "batch.safetensors"), str(tmp_path / "out.safetensors")),
             nprocs=2)
    assert optimizer_steps(batch, cfg) == load_file(tmp_path / "out.safetensors")["steps"].item() == 2 * 4


def _gpu_group_rank(r, port, backend, out_file):
    """Every collective a step makes on CPU tensors (the update's row count and loss, the loss weights' sums,
    whitening, the baseline, the solved fraction, broadcasts and gathers), in a group built from `backend`."""
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=r, world_size=2)
    try:
        cfg = Config(algo="reinforce_baseline", batch_size=4)
        torch.manual_seed(0)
        policy = MLPPolicy(4, 2, 8)
        batch = GymTask(cfg).rollout(policy, step=0)  # this rank's 2 episodes
        batch.adv = ADVANTAGES["reinforce"](batch, cfg)[0]  # whitened over both ranks
        ADVANTAGES["reinforce_baseline"](batch, cfg)
        train.update(policy, train.optimizer(policy, cfg), batch, cfg, max_len=500, old_from=train.old_logp_from(cfg, batch))
        task = tasks.Arith(Config(task="arith", n_eval=4))
        tasks.solved_fraction(task, task.eval_set[:2], ["1", "2"], 1)
        utils.broadcast_bytes(b"rank 0's" if r == 0 else None)
        utils.all_gather(torch.ones(3))
        result = "ok"
    except RuntimeError as e:  # on every rank alike: no CPU backend, so nothing was sent
        result = str(e)
    if r == 0:
        with open(out_file, "w") as f:
            f.write(result)
    dist.destroy_process_group()
    os._exit(0)


def test_a_gpu_runs_process_group_carries_the_cpu_tensors_too(tmp_path):
    """The group train.setup builds for --device cuda, with gloo standing in for NCCL (no GPU here), runs a step's CPU
    collectives. Its stand-in from before the fix, NCCL alone ("nccl" serves cuda tensors only: "cuda:gloo"), fails on
    the first of them, as every GPU data-parallel run did at its step-0 evaluation."""
    gpu_run = utils.backend("cuda")
    assert gpu_run == "cpu:gloo,cuda:nccl" and utils.backend("cpu") == "gloo"
    for group, expect in ((gpu_run.replace("nccl", "gloo"), "ok"),
                          ("cuda:gloo", "No backend type associated with device type cpu")):
        out = tmp_path / "result.txt"
        mp.spawn(_gpu_group_rank, args=(free_port(), group, str(out)), nprocs=2)
        assert expect in out.read_text()
