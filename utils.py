"""Shared pieces every file imports: the Batch type (the shape legend), masked reductions,
discounted sums (returns, GAE), seeding, distributed helpers, checkpoints and the metrics logger.
"""
import csv
import dataclasses
import json
import os
import random

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from tqdm import tqdm


@dataclasses.dataclass
class Batch:
    """One step's samples, padded. N = sequences (prompts x group_size, or episodes),
    T = padded steps / completion tokens, P = padded prompt tokens (LLM), D = observation size.

    obs       [N, T, D] float observations (control)  |  [N, P + T] token ids, prompts left-padded (LLM)
    actions   [N, T] long   the action taken / token sampled at each step
    mask      [N, T] float  1 on the steps trained on (actions, sampled tokens); 0 on padding and on
                            environment tokens between the turns of a multi-turn episode
    rewards   [N, T] float  per-step reward; LLM tasks put the scalar reward on the last real token
    group     [N]    long   samples with one id share a prompt (or an env reset seed)
    truncated [N]    bool   cut by the step / token limit instead of ending by itself
    attn      [N, P + T]    LLM attention mask (prompt padding and completion padding are 0)
    The loop fills, all [N, T]: old_logp (policy that sampled, scored by the trainer), sampler_logp
    (as reported by the sampler), ref_logp, values (old critic), adv, returns, weight (loss weights).
    """
    obs: torch.Tensor
    actions: torch.Tensor
    mask: torch.Tensor
    rewards: torch.Tensor
    group: torch.Tensor
    truncated: torch.Tensor
    attn: torch.Tensor = None
    old_logp: torch.Tensor = None
    sampler_logp: torch.Tensor = None
    ref_logp: torch.Tensor = None
    values: torch.Tensor = None
    adv: torch.Tensor = None
    returns: torch.Tensor = None
    weight: torch.Tensor = None
    final_obs: torch.Tensor = None  # [N, D] control: the observation after the last step (bootstraps truncated rows)
    last_value: torch.Tensor = None  # [N] V(final_obs) where a time limit cut the episode, else 0 (ppo)
    version: int = 0  # weights version that sampled this batch (async)
    stats: dict = dataclasses.field(default_factory=dict)  # the task's per-step metrics (accuracy, ...)
    probe: list = None  # async LLM: the worker sampler's logprobs of the fixed sync probe (model.HFPolicy.probe)

    def tensors(self):
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if isinstance(getattr(self, f.name), torch.Tensor)}

    def rows(self, idx):
        """A new Batch holding rows idx of every tensor (never a view the caller could write through)."""
        return dataclasses.replace(self, **{k: v[idx] for k, v in self.tensors().items()})

    def to(self, device):
        return dataclasses.replace(self, **{k: v.to(device) for k, v in self.tensors().items()})

    @property
    def seq_reward(self):  # [N] total reward of each sample
        return (self.rewards * self.mask).sum(1)


# --- masked reductions ------------------------------------------------------------------------

def masked_sum(x, mask, dim=None):
    return (x * mask).sum() if dim is None else (x * mask).sum(dim)


def masked_mean(x, mask, dim=None):
    return masked_sum(x, mask, dim) / (mask.sum() if dim is None else mask.sum(dim)).clamp(min=1)


def whiten(x, mask, eps=1e-8):
    """(x - mean) / std over the real tokens of every rank; padding stays 0."""
    s = all_reduce_sum(torch.stack([masked_sum(x, mask), masked_sum(x * x, mask), mask.sum()]))
    mean = s[0] / s[2]
    var = (s[1] / s[2] - mean**2).clamp(min=0)
    return (x - mean) * torch.rsqrt(var + eps) * mask


def discounted_cumsum(x, mask, factor):
    """y_t = x_t + factor * y_t' over the real steps of a row, t' the next real step after t: steps with
    mask 0 (padding, or environment tokens in the middle of a multi-turn row) are skipped, not counted,
    and get y = 0. x, mask [N, T]. factor .5, x [0, 0, env, env, 1, pad] -> [.25, .5, 0, 0, 1, 0]."""
    y, acc = torch.zeros_like(x), x.new_zeros(x.shape[0])  # [N, T], [N]
    for t in reversed(range(x.shape[1])):  # T steps of [N] work: small next to any forward pass
        acc = torch.where(mask[:, t] > 0, x[:, t] + factor * acc, acc)
        y[:, t] = acc * mask[:, t]
    return y


def gae(rewards, values, mask, gamma, lam, last_value=None):
    """GAE (arXiv 1506.02438): delta_t = r_t + gamma V_t' - V_t, t' the next real step (environment tokens
    are skipped), A_t = delta_t + gamma lam A_t'. After the last real step V = last_value [N]: the
    critic's value of the state where a time limit cut the episode (bootstrapping, Pardo et al. 2018,
    arXiv 1712.00378), 0 where the episode ended by itself (None = all ended). Returns (A, R = A + V)."""
    next_v = torch.zeros_like(values)  # [N, T] V at the next real step
    v = values.new_zeros(values.shape[0]) if last_value is None else last_value  # [N]
    for t in reversed(range(values.shape[1])):
        next_v[:, t] = v
        v = torch.where(mask[:, t] > 0, values[:, t], v)
    A = discounted_cumsum(rewards + gamma * next_v - values, mask, gamma * lam)
    return A, (A + values) * mask


# --- seeding, distributed -----------------------------------------------------------------------

def fast_bf16(device):
    """bf16 matmuls are fast on a CUDA GPU that supports them and on a CPU with AVX512-BF16 or AMX; on
    other CPUs they are emulated (measured on an AVX2 CPU: 1.3 GFLOP/s against 175 in fp32)."""
    if torch.device(device).type == "cuda":
        return torch.cuda.is_bf16_supported()
    return getattr(torch.cpu, "_is_avx512_bf16_supported", bool)() or getattr(torch.cpu, "_is_amx_tile_supported", bool)()


def seed_all(seed):
    random.seed(seed)
    torch.manual_seed(seed)


def dist_on():
    return dist.is_available() and dist.is_initialized()


def rank():
    return dist.get_rank() if dist_on() else 0


def world():
    return dist.get_world_size() if dist_on() else 1


def all_reduce_sum(t):
    """Sum a tensor over ranks in place (identity in a single process)."""
    if dist_on():
        dist.all_reduce(t)
    return t


# --- checkpoints: safetensors + JSON, no pickle -------------------------------------------------

def save_checkpoint(path, params, opt, meta):
    """params: name -> tensor; opt: a torch optimizer; meta: JSON-able. RNG states included."""
    state = opt.state_dict()
    tensors = {f"model.{k}": v.detach().contiguous().cpu() for k, v in params.items()}
    tensors["rng.torch"] = torch.get_rng_state()
    for i, s in state["state"].items():
        tensors.update({f"opt.{i}.{k}": v.cpu().contiguous() for k, v in s.items()})
    meta = {**meta, "opt_groups": state["param_groups"], "rng_python": random.getstate()}
    tmp = path + ".tmp"
    save_file(tensors, tmp, metadata={"flatrl": json.dumps(meta)})
    os.replace(tmp, path)  # a crash mid-write never leaves a half checkpoint behind


def load_checkpoint(path, opt):
    """-> (params name -> tensor, meta). Restores the optimizer and the RNG states."""
    from safetensors import safe_open
    with safe_open(path, "pt") as f:
        meta = json.loads(f.metadata()["flatrl"])
    tensors = load_file(path)
    state = {}
    for k, v in tensors.items():
        if k.startswith("opt."):
            _, i, name = k.split(".", 2)
            state.setdefault(int(i), {})[name] = v
    opt.load_state_dict({"state": state, "param_groups": meta["opt_groups"]})
    torch.set_rng_state(tensors["rng.torch"])
    version, internal, gauss = meta["rng_python"]
    random.setstate((version, tuple(internal), gauss))
    return {k[6:]: v for k, v in tensors.items() if k.startswith("model.")}, meta


# --- logging ------------------------------------------------------------------------------------

class Logger:
    """One call per step: a tqdm progress line and a metrics.csv row; curves.png at the end.
    Everything is a no-op on ranks other than 0."""

    def __init__(self, run_dir, start, steps):
        self.on = rank() == 0
        self.path, self.rows = os.path.join(run_dir, "metrics.csv"), []
        self.bar = tqdm(total=steps, initial=start, dynamic_ncols=True, disable=not self.on)
        self.fields, self.last_eval = None, {}
        if self.on and os.path.exists(self.path):  # resumed: keep the curve up to the checkpoint's step
            with open(self.path) as f:
                reader = csv.DictReader(f)
                self.rows = [{k: float(v) for k, v in r.items() if v not in ("", None)} for r in reader]
                self.fields = reader.fieldnames
            self.rows = [r for r in self.rows if r["step"] < start]  # later rows are redone from the checkpoint
            self.write()

    def write(self, rows=None):
        """Append rows to metrics.csv; with none, rewrite it whole (a new column, or a resume)."""
        with open(self.path, "a" if rows else "w", newline="") as f:
            w = csv.DictWriter(f, self.fields, restval="")
            if not rows:
                w.writeheader()
            w.writerows({k: f"{v:.6g}" if isinstance(v, float) else v for k, v in r.items()} for r in rows or self.rows)

    def say(self, msg):
        if self.on:
            tqdm.write(msg)

    def log(self, row, done, show=("reward",)):
        """Append a metrics row; the progress bar shows `done` of the run's steps."""
        if not self.on:
            return
        self.rows.append(row)
        new_column = self.fields is None or not row.keys() <= set(self.fields)
        self.fields = list(dict.fromkeys([*(self.fields or []), *row]))
        self.write(None if new_column else [row])
        self.last_eval = {k: v for k, v in row.items() if k.startswith("eval_")} or self.last_eval
        post = {k: f"{row[k]:.3g}" for k in show if k in row}
        post.update({k[5:]: f"{v:.3g}" for k, v in self.last_eval.items()})
        self.bar.set_postfix(post, refresh=False)
        self.bar.update(done - self.bar.n)

    def close(self, run_dir):
        if not self.on:
            return
        self.bar.close()
        import matplotlib  # only for the final plot: keeps it off the import path of every step
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for ax, x in zip(axes, ("step", "time_s")):
            for key in ("reward",) + tuple(k for k in self.fields or () if k.startswith("eval_")):
                pts = [(r[x], r[key]) for r in self.rows if r.get(key) not in (None, "")]
                if pts:
                    ax.plot(*zip(*pts), label=key)
            ax.set_xlabel(x)
            ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(run_dir, "curves.png"))
        plt.close(fig)
