"""The loop on control tasks: invariants (ratio 1, micro-batching, resume), NaN safety, smoke runs, and
what a new user meets: one-line errors, the group-size guard, where the results went."""
import copy
import csv
import gc
import json
import os
import random
import re
import subprocess
import sys

import gymnasium as gym
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import tasks
import train
import utils
from algos import ADVANTAGES
from config import Config
from model import HFPolicy, MLPPolicy
from tasks import GymTask
from conftest import ctrl_c_during, same_run
from utils import Logger


def rollout(cfg, seed=0):
    torch.manual_seed(seed)
    task = GymTask(cfg)
    policy = MLPPolicy(task.obs_dim, task.n_actions, 16, critic=cfg.algo == "ppo")
    return task, policy, task.rollout(policy, step=0)


def test_rollout_shapes_groups_and_determinism():
    cfg = Config(batch_size=6, group_size=3)
    task, policy, _ = rollout(cfg)
    state = torch.get_rng_state()
    b = task.rollout(policy, step=0)
    N, T = b.mask.shape
    assert N == 6 and b.obs.shape == (6, T, 4) and b.actions.shape == (6, T)
    assert torch.equal(b.mask.sum(1), b.rewards.sum(1))  # CartPole pays 1 per real step
    assert torch.all(b.mask[:, :-1] >= b.mask[:, 1:])  # real steps form a prefix
    assert b.group.tolist() == [0, 0, 0, 1, 1, 1]
    assert torch.equal(b.obs[0, 0], b.obs[1, 0]) and not torch.equal(b.obs[0, 0], b.obs[3, 0])  # shared seed
    torch.set_rng_state(state)
    again = task.rollout(policy, step=0)
    assert torch.equal(again.obs, b.obs) and torch.equal(again.actions, b.actions)


@pytest.mark.parametrize("group_size", [1, 2])  # CartPole's own vector env; gymnasium's synchronous wrapper
def test_vector_env_episodes_replay_exactly_on_single_envs(group_size):
    cp = "gymnasium.envs.classic_control.cartpole:"
    gym.register("CartPoleShort-v1", entry_point=cp + "CartPoleEnv", vector_entry_point=cp + "CartPoleVectorEnv",
                 max_episode_steps=20)  # random actions: some episodes fall, some are cut at 20
    task, policy, b = rollout(Config(env="CartPoleShort-v1", batch_size=12, group_size=group_size))
    assert isinstance(task.envs(12), gym.vector.SyncVectorEnv) == (group_size == 2)
    lengths = b.mask.sum(1).long().tolist()
    assert 0 < b.truncated.sum() < 12 and all(n == 20 for n, cut in zip(lengths, b.truncated) if cut)
    for i, n in enumerate(lengths):  # the same start and actions, one env: the same episode, step by step
        env = gym.make("CartPoleShort-v1")
        env.reset(seed=0)
        env.unwrapped.state = b.obs[i, 0].double().numpy()
        for t in range(n):
            o, r, term, trunc, _ = env.step(int(b.actions[i, t]))
            assert r == b.rewards[i, t] and (term or trunc) == (t == n - 1)
            assert torch.allclose(torch.from_numpy(o), b.final_obs[i] if t == n - 1 else b.obs[i, t + 1])
        assert trunc and not term if b.truncated[i] else term  # the flag that bootstraps a cut (ppo)
    if group_size == 2:  # a group shares its start
        assert torch.equal(b.obs[0, 0], b.obs[1, 0]) and not torch.equal(b.obs[0, 0], b.obs[2, 0])


def folder_bytes(run):
    return {f: open(os.path.join(run, f), "rb").read() for f in sorted(os.listdir(run))}


def test_refusals_leave_the_run_folder_byte_identical(tmp_path, tiny_llm):
    run = tmp_path / "r"
    train.main(["--task", "cartpole", "--steps", "2", "--out", str(run)])
    before = folder_bytes(run)
    for argv, needle in [(["--task", "arith", "--model", tiny_llm], "task 'cartpole' there, 'arith' here"),  # --config too
                         (["--ask", "hi"], "--ask answers with a trained LLM run"),
                         (["--algo", "grpo"], "a group of one has nothing to compare")]:
        with pytest.raises(SystemExit) as e:
            train.main(["--resume", str(run), *argv])
        assert needle in str(e.value) and folder_bytes(run) == before


def test_ratio_is_one_on_the_first_epoch():
    cfg = Config(algo="ppo", epochs=3, minibatches=2)
    _, policy, b = rollout(cfg)
    train.score_old(policy, b, cfg, "scored")
    b.adv, b.returns = ADVANTAGES["ppo"](b, cfg)
    opt = torch.optim.SGD(policy.parameters(), lr=0.0)  # no movement: every pass sees the old policy
    stats = train.update(policy, opt, b, cfg, max_len=500, old_from=train.old_logp_from(cfg, b))
    assert stats["trained_ratio"] == pytest.approx(1.0, abs=1e-6)
    assert stats["trained_ratio_max"] == pytest.approx(1.0, abs=1e-6)
    assert stats["trained_approx_kl"] == pytest.approx(0.0, abs=1e-7) and stats["trained_clipfrac"] == 0


@pytest.mark.parametrize("algo,agg", [("reinforce", "token_mean"), ("grpo", "seq_mean_token_mean"),
                                      ("ppo", "seq_mean_token_sum_norm"), ("rloo", "token_mean")])
def test_micro_batching_never_changes_the_gradient(algo, agg):
    cfg = Config(algo=algo, loss_agg=agg, batch_size=8, group_size=2 if algo in ("grpo", "rloo") else 1,
                 ent_coef=0.01)
    _, policy, b = rollout(cfg)
    train.score_old(policy, b, cfg, "scored")
    b.adv, b.returns = ADVANTAGES[algo](b, cfg)
    results = []
    for micro in (0, 3):
        p = copy.deepcopy(policy)
        c = Config(**{**cfg.__dict__, "micro_batch": micro})
        train.update(p, torch.optim.SGD(p.parameters(), lr=1.0), b, c, max_len=500, old_from=train.old_logp_from(c, b))
        results.append(torch.cat([x.flatten() for x in p.parameters()]))
    assert not torch.equal(results[0], torch.cat([x.flatten() for x in policy.parameters()]))
    assert torch.allclose(results[0], results[1], atol=1e-6)


def test_ppo_bootstraps_episodes_cut_by_the_time_limit():
    cfg = Config(env="Acrobot-v1", algo="ppo", batch_size=3)  # a random policy rarely swings up in 500 steps
    _, policy, b = rollout(cfg)
    assert b.truncated.any() and b.final_obs.shape == (3, 6)
    train.score_old(policy, b, cfg, "scored")
    with torch.no_grad():
        expect = policy.value(b.final_obs) * b.truncated  # V(s_T) where cut, 0 where the episode ended
    assert torch.equal(b.last_value, expect) and (b.last_value != 0).any()
    _, R = ADVANTAGES["ppo"](b, cfg)
    last = b.mask.sum(1).long() - 1  # the cut step's return holds gamma * V(s_T): R = r + gamma V(s_T) at lam 1
    b.last_value = None
    _, R_none = ADVANTAGES["ppo"](b, cfg)
    assert torch.allclose((R - R_none)[torch.arange(3), last], cfg.gamma * expect, atol=1e-5)


def test_nonfinite_loss_skips_the_update():
    cfg = Config()
    _, policy, b = rollout(cfg)
    b.adv = torch.full_like(b.mask, float("nan"))
    before = copy.deepcopy(policy.state_dict())
    stats = train.update(policy, torch.optim.AdamW(policy.parameters(), lr=0.1), b, cfg, max_len=500, old_from=train.old_logp_from(cfg, b))
    assert stats["nonfinite"] == 1
    assert all(torch.equal(before[k], v) for k, v in policy.state_dict().items())


class Endless(gym.Env):
    """Never ends by itself, and has no TimeLimit: only flatrl's own episode cap (1000 steps) cuts it."""
    observation_space, action_space = gym.spaces.Box(-1, 1, (2,)), gym.spaces.Discrete(2)

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        return self.np_random.uniform(-1, 1, 2).astype("float32"), {}

    def step(self, action):
        return self.np_random.uniform(-1, 1, 2).astype("float32"), 1.0, False, False, {}


def test_flatrl_own_episode_cap_is_a_time_limit_cut():
    gym.register("Endless-v0", entry_point=Endless)
    cfg = Config(env="Endless-v0", algo="ppo", batch_size=2)
    _, policy, b = rollout(cfg)
    assert b.mask.sum(1).tolist() == [1000, 1000] and b.truncated.all()  # cut, not ended
    train.score_old(policy, b, cfg, "scored")
    assert (b.last_value != 0).all()  # so ppo bootstraps from V(s_1000)


def test_ranks_run_distinct_episodes_that_add_up_to_the_batch(monkeypatch):
    cfg = Config(batch_size=8, group_size=2)
    task, policy, whole = rollout(cfg)
    starts = []
    for r in (0, 1):
        monkeypatch.setattr(tasks, "rank", lambda: r)
        monkeypatch.setattr(tasks, "world", lambda: 2)
        starts.append({tuple(o) for o in task.rollout(policy, step=0).obs[:, 0].tolist()})
    assert len(starts[0]) == len(starts[1]) == 2 and not starts[0] & starts[1]  # 2 reset seeds each, none shared
    assert starts[0] | starts[1] == {tuple(o) for o in whole.obs[:, 0].tolist()}  # together: one process's batch


def test_checkpoints_keep_the_gpu_rng_state_too(tmp_path, monkeypatch):
    # No GPU on the build machines: torch.cuda's RNG calls are stood in for; the file round trip is real.
    saved, restored = torch.arange(16, dtype=torch.uint8), []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda: saved.clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state", restored.append)
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.ones(3))], lr=0.1)
    utils.save_checkpoint(str(tmp_path / "c.safetensors"), {"w": torch.ones(3)}, opt, {"step": 1})
    utils.load_checkpoint(str(tmp_path / "c.safetensors"), opt, {"w": torch.ones(3)})
    assert len(restored) == 1 and torch.equal(restored[0], saved)


def test_adamw_is_adam_without_decay_and_resumes_checkpoints_from_before_it(tmp_path):
    torch.manual_seed(0)
    ours = torch.nn.ParameterList([torch.randn(5, 3), torch.randn(4)])
    theirs = [p.detach().clone().requires_grad_() for p in ours]
    opt = train.optimizer(ours, Config(lr=0.01))  # train.py's: AdamW, weight_decay 0
    adam = torch.optim.Adam(theirs, lr=0.01)  # what flatrl's own Adam stepped as (and was tested equal to)
    for step in range(6):
        for ps, o in ((ours, opt), (theirs, adam)):
            loss = (ps[0] ** 3).sum() + (ps[1].sin().sum() if step % 3 else 0)  # ps[1]: no gradient every third step
            loss.backward()
            o.step()
            o.zero_grad()
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    # A checkpoint written before AdamW: the optimizer state as opt.<index>.<name>, torch's names, as saved then.
    old = {f"opt.{i}.{k}": v for i, s in adam.state_dict()["state"].items() for k, v in s.items()}
    save_file({**old, "rng.torch": torch.get_rng_state()[None]}, tmp_path / "old.safetensors",
              metadata={"flatrl": json.dumps({"step": 6, "rng_python": random.getstate()})})
    resumed = torch.nn.ParameterList([p.detach().clone() for p in theirs])
    opt = train.optimizer(resumed, Config(lr=0.01))
    utils.load_checkpoint(str(tmp_path / "old.safetensors"), opt, dict(resumed.named_parameters()))
    assert [s["step"].item() for s in opt.state_dict()["state"].values()] == [6, 4]
    for ps, o in ((resumed, opt), (theirs, adam)):  # one more step each, on the same gradient
        ps[0].grad = torch.ones(5, 3)
        o.step()
    assert torch.equal(resumed[0], theirs[0]) and torch.equal(resumed[1], theirs[1])


def test_weight_decay_shrinks_the_weights_decoupled_from_the_gradient():
    w = torch.nn.Parameter(torch.full((3, 2), 2.0))
    opt = train.optimizer(torch.nn.ParameterList([w]), Config(lr=0.1, weight_decay=0.5))
    w.grad = torch.zeros(3, 2)  # no gradient: Adam's step is 0, only the decay moves w
    opt.step()
    assert torch.allclose(w.detach(), torch.full((3, 2), 2.0 * (1 - 0.1 * 0.5)))  # w <- w (1 - lr wd)
    with pytest.raises(SystemExit, match="weight_decay must be >= 0"):
        Config(weight_decay=-1.0).validate()


def decayed(policy, cfg):
    """The names of the parameters train.optimizer decays, and of those it does not."""
    opt, names = train.optimizer(policy, cfg), {id(p): k for k, p in policy.named_parameters()}
    groups = {g["weight_decay"] > 0: {names[id(p)] for p in g["params"]} for g in opt.param_groups}
    return groups.get(True, set()), groups.get(False, set())


def test_weight_decay_falls_on_weight_matrices_only(tiny_llm):
    """The usual convention: biases, norms, embeddings and the value head's bias are not decayed."""
    mlp = MLPPolicy(4, 2, 8, critic=True)
    yes, no = decayed(mlp, Config(weight_decay=0.1))
    assert yes == {f"{net}.{i}.weight" for net in ("actor", "critic") for i in (0, 2, 4)}
    assert no == {f"{net}.{i}.bias" for net in ("actor", "critic") for i in (0, 2, 4)}
    full_ft = HFPolicy(Config(task="arith", model=tiny_llm, lora_r=0, algo="ppo", weight_decay=0.1))
    yes, no = decayed(full_ft, Config(weight_decay=0.1))
    assert "lm.model.embed_tokens.weight" in no and "lm.model.norm.weight" in no
    assert "lm.model.layers.0.input_layernorm.weight" in no and "value_head.bias" in no
    assert "lm.model.layers.0.self_attn.q_proj.weight" in yes and "value_head.weight" in yes
    assert "lm.lm_head.weight" in yes  # an untied output projection is a weight matrix
    assert all(k.endswith("norm.weight") or k.endswith("bias") or "embed" in k for k in no)
    lora = HFPolicy(Config(task="arith", model=tiny_llm, algo="ppo", weight_decay=0.1))
    yes, no = decayed(lora, Config(weight_decay=0.1))
    assert yes and all("lora_" in k for k in yes - {"value_head.weight"}) and no == {"value_head.bias"}


def test_a_resume_with_weight_decay_equals_a_run_never_stopped(tmp_path):
    """Two AdamW groups number their states otherwise than one did; checkpoints keep the policy's order (opt_index)."""
    flags = ["--task", "cartpole", "--algo", "ppo", "--batch-size", "4", "--weight-decay", "0.1", "--eval-every", "0",
             "--no-stop-when-solved"]
    train.main(flags + ["--steps", "4", "--out", str(tmp_path / "whole")])
    train.main(flags + ["--steps", "2", "--out", str(tmp_path / "half")])
    train.main(["--resume", str(tmp_path / "half"), "--steps", "4"])
    whole, half = (load_file(tmp_path / d / "checkpoint.safetensors") for d in ("whole", "half"))
    assert whole.keys() == half.keys() and all(torch.equal(whole[k], half[k]) for k in whole)


def test_the_updates_token_metrics_cover_the_rows_it_trained_on():
    """Rows with A = 0 on every token are skipped (nothing else in the loss): the update's entropy, ratio, clipfrac
    and approx_kl are over the other rows' tokens, and named so (trained_*); README "Health metrics"."""
    cfg = Config(algo="grpo", group_size=2, batch_size=4)
    _, policy, b = rollout(cfg)
    b.adv = torch.zeros_like(b.mask)
    b.adv[:2] = b.mask[:2]  # the first group trains, the second tied
    with torch.no_grad():
        out = policy.score(b.rows(torch.arange(2)))
    trained = (out["entropy"] * b.mask[:2]).sum() / b.mask[:2].sum()
    stats = train.update(policy, torch.optim.SGD(policy.parameters(), lr=0.0), b, cfg, max_len=500, old_from=train.old_logp_from(cfg, b))
    assert "entropy" not in stats and stats["trained_entropy"] == pytest.approx(trained.item(), rel=1e-5)
    everyone = (policy.score(b)["entropy"] * b.mask).sum() / b.mask.sum()
    assert abs(everyone.item() - trained.item()) > 1e-4  # the rows skipped would have moved it


def test_a_step_that_trains_nothing_leaves_blanks(tmp_path):
    cfg = Config(algo="grpo", group_size=2)
    _, policy, b = rollout(cfg)
    b.adv = torch.zeros_like(b.mask)  # every group tied
    before = copy.deepcopy(policy.state_dict())
    stats = train.update(policy, torch.optim.AdamW(policy.parameters(), lr=0.1), b, cfg, max_len=500, old_from=train.old_logp_from(cfg, b))
    assert "loss" not in stats and "grad_norm" not in stats and stats["nonfinite"] == 0
    assert all(torch.equal(before[k], v) for k, v in policy.state_dict().items())
    log = Logger(str(tmp_path), 0, 2)
    log.log({"step": 0, "time_s": 0.1, "reward": 1.0, "loss": 0.5, "grad_norm": 2.0}, 1)
    log.log({"step": 1, "time_s": 0.2, "reward": 1.0, **stats}, 2)
    log.close(str(tmp_path))
    with open(tmp_path / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert (rows[1]["loss"], rows[1]["grad_norm"]) == ("", "")


def params_of(run_dir):
    with safe_open(f"{run_dir}/checkpoint.safetensors", "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, json.loads(f.metadata()["flatrl"])


@pytest.mark.parametrize("algo", ["reinforce", "ppo"])
def test_resume_equals_never_stopped(tmp_path, algo):
    common = ["--config", f"configs/cartpole_{algo}.yaml", "--no-stop-when-solved", "--eval-every", "0"]
    train.main(common + ["--steps", "4", "--out", str(tmp_path / "full")])
    train.main(common + ["--steps", "2", "--out", str(tmp_path / "half")])
    train.main(["--resume", str(tmp_path / "half"), "--steps", "4"])
    full, meta_full = params_of(tmp_path / "full")
    half, meta_half = params_of(tmp_path / "half")
    assert meta_full["step"] == meta_half["step"] == 4
    assert full.keys() == half.keys() and all(torch.equal(full[k], half[k]) for k in full)
    with open(tmp_path / "half" / "metrics.csv") as f:
        assert [r["step"] for r in csv.DictReader(f)] == ["0", "1", "2", "3", "4"]  # step 2 once: redone on resume


@pytest.mark.parametrize("algo", ["reinforce", "reinforce_baseline", "ppo", "grpo", "rloo"])
def test_two_step_smoke_per_algo(tmp_path, algo):
    train.main(["--config", f"configs/cartpole_{algo}.yaml", "--steps", "2", "--out", str(tmp_path)])
    with open(tmp_path / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    cols = {"step", "time_s", "reward", "loss", "trained_entropy", "trained_approx_kl", "trained_ratio", "trained_clipfrac",
            "grad_norm", "eval_return"}
    assert cols <= set(rows[0]) and [r["step"] for r in rows] == ["0", "1", "2"]
    assert rows[0]["eval_return"] != "" and rows[1]["eval_return"] == ""  # eval at step 0, eval_every 5
    assert not (tmp_path / "curves.png").exists() and (tmp_path / "config.yaml").exists()  # --plot auto: LLM runs only


def test_a_script_starts_without_collections_then_freezes_what_it_built(tmp_path):
    gc.disable()  # as train.py does when run as a script (collection stays on for library callers)
    try:
        train.main(["--task", "cartpole", "--steps", "1", "--out", str(tmp_path)])
        assert gc.isenabled() and gc.get_freeze_count() > 0  # on again after build, start-up's objects frozen
    finally:
        gc.enable(), gc.unfreeze()
    before = gc.get_freeze_count()
    train.main(["--task", "cartpole", "--steps", "1", "--out", str(tmp_path / "lib")])
    assert gc.get_freeze_count() == before == 0  # called as a library: nothing frozen


FAULTS = """import resource, sys, torch, utils
if sys.argv[1] == "keep":
    utils.keep_freed_memory()
for step in range(6):  # a step's big tensors, 4 x 64 MB (each over glibc's mmap threshold, 32 MB at most), freed together
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    xs = [torch.ones(2**24) for _ in range(4)]
    del xs
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)  # the last step's page faults
"""


def test_a_script_keeps_freed_memory_for_the_next_step():
    """keep_freed_memory (train.py calls it as a script), a fresh process each way: the setting lasts the process."""
    faults = {how: int(subprocess.run([sys.executable, "-c", FAULTS, how], capture_output=True, text=True, check=True,
                                      cwd=os.path.dirname(os.path.dirname(__file__))).stdout) for how in ("default", "keep")}
    assert faults["default"] >= 2**28 // 2**21  # glibc's default: fresh pages every step (one per 2 MB page at least)
    assert faults["keep"] < 64  # the last step's 256 MB reused in place: no page touched for the first time


def test_a_refused_command_leaves_no_run_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # default folders: runs/NAME under the working directory
    for flags in (["--algo", "grpo"], ["--check-parity"]):  # refused before the policy is built, and after it
        with pytest.raises(SystemExit, match="^config error: "):
            train.main(["--task", "cartpole", *flags])
    assert not os.path.exists("runs")


def test_acrobot_runs_and_is_named_after_its_env(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    train.main(["--task", "cartpole", "--env", "Acrobot-v1", "--steps", "1", "--batch-size", "2", "--eval-episodes", "2"])
    (run,) = os.listdir("runs")
    assert run.startswith("acrobot-v1-reinforce-")
    with open(f"runs/{run}/metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert -500 <= float(rows[0]["eval_return"]) <= 0  # -1 per step, at most 500 steps


def test_solves_cartpole_and_stops(tmp_path, capsys):
    train.main(["--task", "cartpole", "--algo", "reinforce", "--out", str(tmp_path)])
    with open(tmp_path / "metrics.csv") as f:
        last = list(csv.DictReader(f))[-1]
    assert float(last["eval_return"]) >= 475 and int(last["step"]) < 300
    out = capsys.readouterr().out
    assert f"solved at step {last['step']}" in out
    assert (f"results in {tmp_path}/: checkpoint.safetensors, config.yaml, metrics.csv "
            f"(last eval: return {float(last['eval_return']):.3g})") in out


README_ALGO = re.search(r"```python\n(def reinforce_max.*?)```", open("README.md").read(), re.S).group(1)


@pytest.mark.parametrize("algo", ["grpo", "rloo", "reinforce_max"])
def test_group_estimators_refuse_groups_of_one(tmp_path, monkeypatch, algo):
    namespace = {"torch": torch}
    exec(README_ALGO, namespace)  # the README's example, verbatim, added as a user would
    monkeypatch.setitem(train.ADVANTAGES, "reinforce_max", namespace["reinforce_max"])
    with pytest.raises(SystemExit, match="set --group-size 2 or more"):
        train.main(["--algo", algo, "--steps", "1", "--out", str(tmp_path)])
    train.main(["--algo", algo, "--group-size", "2", "--steps", "1", "--out", str(tmp_path)])  # fine with groups


def test_progress_bar_counts_done_steps(tmp_path):
    log = Logger(str(tmp_path), 0, 3)
    log.log({"step": 0, "time_s": 0.1, "reward": 1.0}, 1)
    log.log({"step": 3, "time_s": 0.2, "eval_return": 9.0}, 3)
    assert (log.bar.n, log.bar.total) == (3, 3)
    assert log.bar.postfix == "eval_return=9"  # held-out figures are named so (a training accuracy is not shown)
    log.log({"step": 4, "time_s": 0.3, "reward": 2.0}, 4)
    assert log.bar.postfix == "reward=2, eval_return=9"  # the last evaluation stays until the next
    log.close(str(tmp_path))


@pytest.mark.parametrize("argv,needle", [
    (["--config", "configs/nope.yaml"], "no config file 'configs/nope.yaml' ("),
    (["--config", "configs/arith_grpo.yaml"], "(did you mean configs/arith_grpo_cpu.yaml?)"),
    (["--config", "BROKEN"], "broken.yaml:3: not valid YAML (while parsing a flow sequence from line 2: "),
    (["--lr=fast"], "argument --lr: invalid float value: 'fast'"),
    (["--resume", "configs/cartpole_ppo.yaml"], "to start from a preset use --config configs/cartpole_ppo.yaml"),
    (["--resume", "EMPTY"], "no checkpoint.safetensors there"),
    (["--resume", "EMPTY/missing"], "no such run directory"),
    (["--env", "CartPole-v9", "--steps", "1"], "It provides versioned environments: [ `v0`, `v1` ]"),
    (["--task", "arith", "--model", "nobody/no-such-model", "--steps", "1"], "cannot load --model nobody/no-such-model"),
    (["--config", "TYPO"], "unknown key 'learning_rate'"),
    (["--task", "arith", "--ask", "hi"], "--ask answers with a trained LLM run"),
    (["--task", "arith", "--serve"], "--serve serves with a trained LLM run"),
] + ([] if torch.cuda.is_available() else [(["--device", "cuda"], "sees no CUDA GPU: use --device cpu")]))
def test_user_mistakes_are_one_line_errors(tmp_path, argv, needle):
    (tmp_path / "EMPTY").mkdir()
    (tmp_path / "typo.yaml").write_text("learning_rate: 0.1\n")
    (tmp_path / "broken.yaml").write_text("steps: 3\nlr: [0.1\nalgo: ppo\n")  # the list never closes: line 2
    for name, file in {"EMPTY": "EMPTY", "TYPO": "typo.yaml", "BROKEN": "broken.yaml"}.items():
        argv = [a.replace(name, str(tmp_path / file)) for a in argv]
    run = subprocess.run([sys.executable, "train.py", *argv, "--out", str(tmp_path / "run")], capture_output=True,
                         text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=120)
    assert run.returncode != 0 and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert run.stderr.strip().startswith("config error: ") and len(run.stderr.strip().splitlines()) == 1, run.stderr
    assert needle in run.stderr


@pytest.mark.parametrize("flags", [["--steps", "1"], ["--steps", "2"], ["--rounds", "0"]])
def test_generation_benchmark_checks_its_arguments_first(flags):
    run = subprocess.run([sys.executable, "benchmarks/generation.py", *flags], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "--steps >= 3" in run.stderr and run.stdout == ""  # refused before any round ran


@pytest.mark.parametrize("env", [{"LOCAL_RANK": "0"}, {"LOCAL_RANK": "0", "RANK": "0"}])
def test_a_local_rank_without_a_world_runs_as_one_process(tmp_path, env):
    """Only a launcher's world (WORLD_SIZE > 1, or RANK and WORLD_SIZE) starts a process group: a LOCAL_RANK left in
    the environment (a notebook, a job script) once ended in torch's "environment variable RANK expected"."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")} | env
    run = subprocess.run([sys.executable, "train.py", "--task", "cartpole", "--steps", "1", "--out", str(tmp_path)],
                         capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert [r["step"] for r in csv.DictReader(open(tmp_path / "metrics.csv"))] == ["0", "1"]


@pytest.mark.parametrize("moment,step", [("evaluate", 2), ("rollout", 3), ("update", 2)])
def test_ctrl_c_then_resume_equals_a_run_never_stopped(tmp_path, monkeypatch, moment, step):
    """Ctrl-C in an evaluation or a rollout drops the step (its draws undone); in the update it waits for the step's
    end. Either way the checkpoint is a step boundary's, and the resume evaluates only on the schedule."""
    flags = ["--config", "configs/cartpole_ppo.yaml", "--steps", "4", "--eval-every", "2", "--no-stop-when-solved"]
    train.main(flags + ["--out", str(tmp_path / "whole")])
    ctrl_c_during(monkeypatch, moment, step)
    with pytest.raises(SystemExit) as stop:
        train.main(flags + ["--out", str(tmp_path / "cut")])
    assert stop.value.code == 130 and params_of(tmp_path / "cut")[1]["step"] == step + (moment == "update")
    train.main(["--resume", str(tmp_path / "cut")])
    same_run(tmp_path / "whole", tmp_path / "cut")


def test_a_second_ctrl_c_in_the_update_stops_at_once_and_saves_nothing_of_the_step(tmp_path, monkeypatch):
    flags = ["--config", "configs/cartpole_ppo.yaml", "--steps", "4", "--eval-every", "2", "--no-stop-when-solved",
             "--save-every", "1"]
    train.main(flags + ["--out", str(tmp_path / "whole")])
    ctrl_c_during(monkeypatch, "update", 2, presses=2)
    with pytest.raises(SystemExit, match="stopped by a second Ctrl-C: nothing saved since the last checkpoint"):
        train.main(flags + ["--out", str(tmp_path / "cut")])
    assert params_of(tmp_path / "cut")[1]["step"] == 2  # step 2's update was cut short: the checkpoint is before it
    train.main(["--resume", str(tmp_path / "cut")])
    same_run(tmp_path / "whole", tmp_path / "cut")
