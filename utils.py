"""The leaf every file imports: the Batch type (the shape legend), masked reductions, discounted sums (returns, GAE),
distributed helpers, checkpoints and the metrics logger. Read Batch first; then train.py's step.
"""
import contextlib
import csv
import ctypes
import dataclasses
import functools
import gc
import ipaddress
import itertools
import json
import math
import os
import random
import re
import signal
import sys
import time
import urllib.parse

import numpy as np
import torch
import torch.distributed as dist
from safetensors import safe_open
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
    run       [N]    long   LLM: rows with one id are one episode (an agent run can be several rows)
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
    run: torch.Tensor = None
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
    worker: str = ""  # the rollout worker that pushed it (async: the trainer tells each worker what it trained)
    stats: dict = dataclasses.field(default_factory=dict)  # the task's per-step metrics (accuracy, ...)

    def tensors(self):
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if isinstance(getattr(self, f.name), torch.Tensor)}

    def rows(self, idx):
        """A new Batch holding rows idx of every tensor (never a view the caller could write through)."""
        return dataclasses.replace(self, **{k: v[idx] for k, v in self.tensors().items()})

    def to(self, device):
        return dataclasses.replace(self, **{k: v.to(device) for k, v in self.tensors().items()})

    def trimmed(self):
        """Without the columns that are padding in every row (LLM). Positions count attended tokens and attention
        never looks right, so every logp stays the same."""
        if self.attn is None:
            return self
        used = self.attn.bool().any(0).nonzero()[:, 0]  # columns of [P + T] that some row attends
        P = self.attn.shape[1] - self.mask.shape[1]
        first, t = int(used[0]), max(int(used[-1]) + 1 - P, 1)  # the first prompt column, completion columns kept
        return dataclasses.replace(self, **{k: v[:, first:P + t] if k in ("obs", "attn") else v[:, :t]
                                            for k, v in self.tensors().items() if v.dim() == 2})

    @property
    def seq_reward(self):  # [N] total reward of each sample
        return (self.rewards * self.mask).sum(1)

    @property
    def tokens(self):  # [N, T] bool, LLM: the completion's real tokens (sampled or the environment's), not padding
        return self.attn[:, -self.mask.shape[1]:] > 0


# --- masked reductions, discounted sums ----------------------------------------------------------

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
    """y_t = x_t + factor * y_t', t' the next real step after t: mask-0 steps (padding, environment tokens) are
    skipped and get y = 0. x, mask [N, T]; factor a number or [N, T]. factor .5, x [0, 0, env, env, 1, pad] ->
    [.25, .5, 0, 0, 1, 0]."""
    y, acc = torch.zeros_like(x), x.new_zeros(x.shape[0])  # [N, T], [N]
    for t in reversed(range(x.shape[1])):  # T steps of [N] work: small next to any forward pass
        f = factor[:, t] if torch.is_tensor(factor) else factor
        acc = torch.where(mask[:, t] > 0, x[:, t] + f * acc, acc)
        y[:, t] = acc * mask[:, t]
    return y


def reply_ends(mask):
    """[N, T] bool: the last token of each run of trained tokens, i.e. of each reply of an episode."""
    after = torch.cat([mask[:, 1:], mask.new_zeros(len(mask), 1)], 1)  # [N, T] the mask one step later
    return (mask > 0) & (after == 0)


def gae(rewards, values, mask, gamma, lam, last_value=None):
    """GAE (arXiv 1506.02438): delta_t = r_t + gamma V_t' - V_t, t' the next real step, A_t = delta_t + gamma lam A_t'.
    After the last step V = last_value [N]: the critic's value where a time limit cut the episode (arXiv 1712.00378),
    0 where it ended (None = all ended). -> (A, R = A + V)"""
    next_v = torch.zeros_like(values)  # [N, T] V at the next real step
    v = values.new_zeros(values.shape[0]) if last_value is None else last_value  # [N]
    for t in reversed(range(values.shape[1])):
        next_v[:, t] = v
        v = torch.where(mask[:, t] > 0, values[:, t], v)
    A = discounted_cumsum(rewards + gamma * next_v - values, mask, gamma * lam)
    return A, (A + values) * mask


# --- the machine ---------------------------------------------------------------------------------

def fast_bf16(device):
    """bf16 matmuls are fast on a CUDA GPU that has them and on a CPU with AVX512-BF16 or AMX; elsewhere they are
    emulated (an AVX2 CPU) and fp32 is the fast dtype. FLATRL_FAST_BF16=1 / 0 forces the answer (tests, CI)."""
    if os.environ.get("FLATRL_FAST_BF16") in ("0", "1"):
        return os.environ["FLATRL_FAST_BF16"] == "1"
    if torch.device(device).type == "cuda":
        return torch.cuda.is_bf16_supported()
    cpu = torch.cpu  # (older torch builds lack these probes: no fast bf16 then)
    return getattr(cpu, "_is_avx512_bf16_supported", bool)() or getattr(cpu, "_is_amx_tile_supported", bool)()


class Timer:
    """timer(name) records the seconds since the previous call under `name`: a step's phases, in order."""

    def __init__(self):
        self.last, self.split = time.time(), {}

    def __call__(self, name):
        now = time.time()
        self.split[name] = now - self.last
        self.last = now


def peak_flops(device, dtype, cache=os.path.expanduser("~/.cache/flatrl/peak.json")):
    """The device's matmul FLOP/s in dtype, for MFU: the best of square matmuls grown until one takes ~50 ms,
    measured once per device, dtype, thread count and torch version, then read from `cache`."""
    device = torch.device(device)
    cpu = re.findall(r"model name\s*: (.*)", open("/proc/cpuinfo").read()) if os.path.exists("/proc/cpuinfo") else []
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else (cpu + ["cpu"])[0]
    key = f"{name} | {dtype} | {torch.get_num_threads()} threads | torch {torch.__version__}"
    known = json.load(open(cache)) if os.path.exists(cache) else {}
    if key not in known:
        best, n, took = 0.0, 256, 0.0
        while n <= 4096 and took < 0.05:
            a = torch.ones(n, n, device=device, dtype=getattr(torch, dtype))  # not randn: the run's RNG stays untouched
            for _ in range(3):
                t = time.perf_counter()
                (a @ a).sum().item()  # .item() waits for a GPU
                took = time.perf_counter() - t
                best = max(best, 2 * n ** 3 / took)
            n *= 2
        known[key] = best
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        with open(tmp_name(cache), "w") as f:  # torchrun ranks probe at once
            json.dump(known, f, indent=1)
        os.replace(tmp_name(cache), cache)
    return known[key]


def seed_all(seed):
    random.seed(seed)
    torch.manual_seed(seed)


def freeze_start_up():
    """Start-up (imports, the model, vLLM's engine) makes millions of objects that live all run, and each full
    collection walks them all, in every step too. train.py, run as a script, starts with collection off; this moves
    what exists by now out of every later collection (gc.freeze; the vLLM sampler calls it before its engine starts,
    which collects in full itself; what it saves: benchmarks/README.md "Speed tricks"). Library callers keep
    Python's own collection: it does nothing while collection is on."""
    if not gc.isenabled():
        gc.freeze()


def keep_freed_memory():
    """glibc hands every freed block over 32 MB back to the kernel, so each update's [tokens, vocab] logits,
    log-softmax and their gradients come back as fresh pages, each faulted in again. No mmap, no trimming: freed
    memory stays in the process for the next step, and resident memory stays at its peak (what it saves:
    benchmarks/README.md "Speed tricks"). train.py calls it when run as a script; other libcs keep their default."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-4, 0)  # M_MMAP_MAX = 0: no mmap
        libc.mallopt(-1, -1)  # M_TRIM_THRESHOLD = -1: never trim


def non_dumpable():
    """No process of this user may read this one's memory or /proc/<pid>/environ (FLATRL_TOKEN, hub tokens): called
    before model-written code runs (tasks.run_python, agent tasks). What it costs: no debugger or profiler can attach
    (py-spy, gdb) and a crash writes no core dump. Linux only; elsewhere nothing changes."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(4, 0)  # PR_SET_DUMPABLE = 4


LOCAL_TOKENS = os.path.expanduser("~/.cache/flatrl/tokens")  # a loopback trainer's own token, a file per port


@functools.cache
def file_token(path):
    try:
        with open(path) as f:
            token = f.read().strip()
    except OSError as e:
        raise SystemExit(f"config error: --token-file {path}: {e.strerror}")
    if not token:
        raise SystemExit(f"config error: --token-file {path} is empty: write the token in it")
    return token


def bearer_token(cfg):
    """The token flatrl's servers ask and its clients send: read once from --token-file, else FLATRL_TOKEN; None:
    none. An environment variable can be read from /proc/PID/environ by the user's other processes (a launcher
    such as torchrun is not non-dumpable) and passes to every child; a file is read once, by flatrl alone."""
    return file_token(cfg.token_file) if cfg.token_file else os.environ.get("FLATRL_TOKEN") or None


def local_token(port, token=None):
    """A loopback trainer's own token for `port`: written (mode 0600) when given, removed when "" (its run ended),
    else read (None: there is none). Workers on this machine read it; model text cannot (its children may read no
    file outside Python's own)."""
    path = os.path.join(LOCAL_TOKENS, str(port))
    if token == "":
        with contextlib.suppress(OSError):
            os.remove(path)
        return None
    if token is None:
        with contextlib.suppress(OSError), open(path) as f:
            return f.read().strip() or None
        return None
    os.makedirs(LOCAL_TOKENS, mode=0o700, exist_ok=True)
    fd = os.open(path + ".new", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # an older file keeps its mode otherwise
    with os.fdopen(fd, "w") as f:
        f.write(token)
    os.replace(path + ".new", path)  # whole, at once: a worker never reads half a token
    return token


def loopback(host):
    """Is `host` this machine's loopback address (127.x, ::1, localhost)?"""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def cpu_shares(cfg, cores):
    """-> {role: the cores it computes on} for the flatrl processes on this machine. A trainer serving on loopback has
    all its workers beside it, as has a worker whose trainer is on loopback: the trainer takes the first half of the
    cores, its workers the rest (all local workers share that half). Each would otherwise start a thread per core and
    they fight for them: an async step took ~10x the sync one. Otherwise the process has the machine."""
    host = cfg.bind if cfg.role == "trainer" else urllib.parse.urlsplit(cfg.trainer_url).hostname
    if cfg.role == "sync" or cfg.device != "cpu" or not loopback(host):
        return {cfg.role: cores}
    half = max(1, len(cores) // 2)
    return {"trainer": cores[:half], "rollout": cores[half:] or cores}  # one core: shared, one thread each


def share_cores(cfg):
    """This process's threads (and cores, and vLLM's OpenMP binding): --threads N, else its cpu_shares share (all
    of it split over the ranks torchrun started here). Before any torch work: the threads inherit the cores.
    -> a line saying what it took"""
    linux = os.path.isdir("/proc/self/task")  # elsewhere the thread counts alone, unpinned
    cores = sorted(os.sched_getaffinity(0)) if linux else list(range(os.cpu_count()))
    shares = cpu_shares(cfg, cores)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # vLLM's worker processes: the same count
        return f"threads: {cfg.threads} (--threads)"
    if len(shares) == 1:
        return f"threads: {torch.get_num_threads()}"
    mine = shares[cfg.role]
    for thread in os.listdir("/proc/self/task") if linux else []:  # every thread: import torch has started one
        os.sched_setaffinity(int(thread), mine)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, mine)))
    torch.set_num_threads(max(1, len(mine) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
    me, them, other = (("trainer", "its rollout workers", "rollout") if cfg.role == "trainer"
                       else ("rollout worker", "its trainer", "trainer"))
    return (f"threads: {torch.get_num_threads()} on cores {mine} for this {me}, cores {shares[other]} for {them} "
            "(one machine, shared; --threads N to choose)")


# --- distributed ---------------------------------------------------------------------------------

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


def backend(device):
    """The process group's backends: gloo for CPU tensors (the sums, broadcasts and gathers of every step are CPU
    tensors) and, on GPUs, NCCL for GPU ones (gradients, FSDP's shards). NCCL alone cannot reduce a CPU tensor."""
    return "cpu:gloo,cuda:nccl" if torch.device(device).type == "cuda" else "gloo"


def broadcast_bytes(data):
    """Rank 0's bytes on every rank: a length, then a uint8 tensor (no pickle). Other ranks pass None."""
    if not dist_on():
        return data
    n = torch.tensor([len(data) if rank() == 0 else 0])
    dist.broadcast(n, 0)
    if rank() == 0:
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    else:
        buf = torch.empty(int(n), dtype=torch.uint8)
    dist.broadcast(buf, 0)
    return bytes(buf.numpy())


def all_gather(t):  # a CPU tensor -> [every rank's t]
    out = [torch.empty_like(t) for _ in range(world())]
    dist.all_gather(out, t)
    return out


def sharded(t):
    """Is t an FSDP shard (a DTensor)? Asked without importing torch.distributed.tensor in runs that never shard."""
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(t, mod.DTensor)


def unshard(t):
    """An FSDP shard -> the whole tensor (a collective: every rank calls it, in order); any other tensor as it is."""
    return t.full_tensor() if sharded(t) else t


def reshard(t, ref):
    """A whole tensor -> laid out like ref: this rank's shard where ref is an FSDP shard (a collective)."""
    if not sharded(ref):
        return t
    from torch.distributed.tensor import distribute_tensor
    return distribute_tensor(t.to(ref.dtype), ref.device_mesh, ref.placements)


def held_mb(module):
    """(trainable, frozen) MB of parameters this rank holds: its shards under FSDP, all of them otherwise."""
    sizes = {True: 0, False: 0}
    for p in module.parameters():
        sizes[p.requires_grad] += (p.to_local() if sharded(p) else p).nbytes
    return sizes[True] / 2**20, sizes[False] / 2**20


# --- files: safetensors + JSON, no pickle --------------------------------------------------------

def tmp_name(path):
    """Where to write `path` before renaming it into place: this process's own name, so processes writing it at
    once (torchrun ranks, workers) never rename each other's half-written file."""
    return f"{path}.{os.getpid()}.tmp"


def fresh_dir(base):
    """Make and return the first of base, base-2, ... not yet made (by any process: makedirs fails if it exists)."""
    for path in itertools.chain([base], (f"{base}-{i}" for i in itertools.count(2))):
        with contextlib.suppress(FileExistsError):
            os.makedirs(path)
            return path


def rng_states():
    """This rank's random generators: the CPU's, and its GPU's when the run uses one (sampling runs there)."""
    states = {"torch": torch.get_rng_state()}
    if torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def rng_mark():
    """This rank's generators as they are now, to go back to with rewind (a step that Ctrl-C cut short)."""
    return rng_states(), random.getstate()


def set_rng(name, state):
    """Set one of rng_states' generators (looked up now, not at import, so tests can stand in for a GPU)."""
    (torch.cuda if name == "cuda" else torch).set_rng_state(state)


def rewind(mark):
    states, python = mark
    for name, state in states.items():
        set_rng(name, state)
    random.setstate(python)


@contextlib.contextmanager
def ctrl_c_waits():
    """A Ctrl-C inside the block is held until the block ends, then raised: what changes in it changes entirely or
    not at all. Outside the main thread signals are not ours to catch, and the block runs as it is."""
    held = []

    def hold(signum, frame):
        if held:  # a second Ctrl-C: out now, and nothing saved (the block is half done)
            raise SystemExit("stopped by a second Ctrl-C: nothing saved since the last checkpoint")
        held.append(signum)
        print("Ctrl-C: the step finishes first (Ctrl-C again stops without saving)", file=sys.stderr)

    try:
        previous = signal.signal(signal.SIGINT, hold)
    except ValueError:
        previous = None
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    if held and callable(previous):  # Python's own handler raises KeyboardInterrupt; an ignored SIGINT stays ignored
        previous(signal.SIGINT, None)


def opt_index(opt, params):
    """The checkpoint index of each of the optimizer's weights, in torch's numbering (group after group): its place
    among `params`, the policy's trainable weights in order. Checkpoints number states as one group did, so those
    written before AdamW had groups resume, and no regrouping moves a state onto another weight."""
    place = {id(p): i for i, p in enumerate(params.values())}
    return [place[id(p)] for g in opt.param_groups for p in g["params"]]


def save_checkpoint(path, params, opt, meta):
    """Every rank calls it: FSDP shards are gathered, each rank's RNG state kept ([world, S]); rank 0 writes a
    temporary file that replaces the checkpoint once complete (a kill mid-save leaves the old one). The optimizer's
    state is torch's state_dict, flattened: opt.<param index>.<name>, the index the weight's place in `params`
    (opt_index). -> the whole params"""
    states = opt.state_dict()["state"]
    place = opt_index(opt, params) if states else []
    params = {k: unshard(v).detach().contiguous().cpu() for k, v in params.items()}
    tensors = {f"model.{k}": v for k, v in params.items()}
    for j, state in states.items():  # AdamW's step and moments
        tensors.update({f"opt.{place[j]}.{k}": unshard(v).cpu().contiguous() for k, v in state.items()})
    for name, rng in rng_states().items():  # [world, S] each
        tensors[f"rng.{name}"] = torch.stack(all_gather(rng)) if dist_on() else rng[None]
    if rank() == 0:
        meta = {**meta, "rng_python": random.getstate()}
        save_file(tensors, tmp_name(path), metadata={"flatrl": json.dumps(meta)})
        os.replace(tmp_name(path), path)
    return params


def load_checkpoint(path, opt, params):
    """-> (params name -> whole tensor, meta). Every rank reads it and restores the optimizer (sharded like its
    parameters; `params` as given to save_checkpoint) and its own RNG states (on another number of ranks, each keeps
    the seed it was given)."""
    with safe_open(path, "pt") as f:
        meta = json.loads(f.metadata()["flatrl"])
    tensors = load_file(path)
    saved = {k: v for k, v in tensors.items() if k.startswith("opt.")}
    held, state = [p for g in opt.param_groups for p in g["params"]], {}
    torch_index = {i: j for j, i in enumerate(opt_index(opt, params))} if saved else {}
    for k, v in saved.items():
        _, i, name = k.split(".", 2)
        j = torch_index[int(i)]
        state.setdefault(j, {})[name] = reshard(v, held[j]) if v.dim() else v
    opt.load_state_dict({"state": state, "param_groups": opt.state_dict()["param_groups"]})
    for name in rng_states():  # the generators this run uses (a GPU's is in the file if the saving run used one)
        rng = tensors.get(f"rng.{name}", torch.empty(0, 0)).flatten(0, -2)  # [world, S]
        if len(rng) == world():  # resumed on as many ranks: each continues its own stream (else: seeded afresh)
            set_rng(name, rng[rank()].clone())  # a copy: set_rng_state reads from the storage start
    version, internal, gauss = meta["rng_python"]
    random.setstate((version, tuple(internal), gauss))
    return {k[6:]: v for k, v in tensors.items() if k.startswith("model.")}, meta


# --- logging ---------------------------------------------------------------------------------------

# curves.png, one panel per group that the run logged: the first key on the left axis (with every eval_ metric), the
# rest on a right-hand axis. How to read each: README "Health metrics".
PANELS = (("reward", "eval_"), ("well_formed", "acc_well_formed"), ("trained_entropy",),
          ("trained_approx_kl", "trained_clipfrac"), ("length", "truncated"), ("grad_norm",),
          ("staleness", "logp_gap"), ("gen_mfu", "train_mfu"))


# metrics.csv columns renamed since: a run resumed from before keeps one column for each
RENAMED = {k: f"trained_{k}" for k in ("entropy", "ratio", "ratio_max", "clipfrac", "approx_kl", "kl")}


class Logger:
    """One call per step: a progress line, a metrics.csv row, the --log-to trackers; curves.png at the end. Rank 0
    writes; the other ranks' calls do nothing."""

    def __init__(self, run_dir, start, steps, cfg=None, show=("reward",)):
        self.on, self.show, self.said = rank() == 0, show, set()  # show: the metrics on the bar; said: say_once's
        self.path, self.rows, self.fields, self.last_eval = os.path.join(run_dir, "metrics.csv"), [], None, {}
        self.bar = tqdm(total=steps, initial=start, dynamic_ncols=True, disable=not self.on)
        self.trackers = []
        if self.on and cfg:
            self.trackers = [tracker(name, run_dir, dataclasses.asdict(cfg)) for name in cfg.log_to.split(",") if name]
        if self.on and os.path.exists(self.path):  # resumed: keep the curve up to the checkpoint's step
            with open(self.path) as f:
                reader = csv.DictReader(f)
                rows = [{RENAMED.get(k, k): float(v) for k, v in r.items() if v not in ("", None)} for r in reader]
                self.fields = [RENAMED.get(k, k) for k in reader.fieldnames]
            self.rows = [r for r in rows if r["step"] < start]  # later rows are redone from the checkpoint
            self.write()

    def write(self, rows=None):
        """Append rows to metrics.csv; with none, rewrite it whole (a new column, or a resume), atomically."""
        with open(self.path if rows else tmp_name(self.path), "a" if rows else "w", newline="") as f:
            w = csv.DictWriter(f, self.fields, restval="")
            if not rows:
                w.writeheader()
            w.writerows({k: f"{v:.6g}" if isinstance(v, float) else v for k, v in r.items()} for r in rows or self.rows)
        if not rows:
            os.replace(tmp_name(self.path), self.path)

    def say(self, msg):
        if self.on and msg:  # (an empty message says nothing)
            tqdm.write(msg)

    def say_once(self, kind, msg):
        if kind not in self.said:
            self.said.add(kind)
            self.say(msg)

    def log(self, row, done):
        """Append a metrics row; the progress bar shows `done` of the run's steps and the row's `show` metrics."""
        if not self.on:
            return
        self.rows.append(row)
        new_column = self.fields is None or not row.keys() <= set(self.fields)
        self.fields = list(dict.fromkeys([*(self.fields or []), *row]))
        self.write(None if new_column else [row])
        for log, _ in self.trackers:
            log(row)
        self.last_eval = {k: v for k, v in row.items() if k.startswith("eval_")} or self.last_eval
        post = {k: f"{row[k]:.3g}" for k in self.show if k in row}
        post.update({k: f"{v:.3g}" for k, v in self.last_eval.items()})  # eval_acc: held-out, not training
        self.bar.set_postfix(post, refresh=False)
        self.bar.update(done - self.bar.n)

    def close(self, run_dir, plot=True):
        if not self.on:
            return
        self.bar.close()
        for _, close in self.trackers:
            close()
        if plot and self.rows:
            draw_curves(self.rows, self.fields, os.path.join(run_dir, "curves.png"))


def draw_curves(rows, fields, path):
    """A panel per PANELS group the run logged, against step, with the wall time reached along the top. A second
    quantity gets a right-hand axis, dashed with hollow squares (neither hides the other); a constant one is drawn
    from 0 to its value. A step that logged nothing for a key (it trained nothing) is a gap."""
    from matplotlib.figure import Figure  # here, and without pyplot: a CartPole run that draws nothing ends sooner

    def wanted(key, name):  # "eval_" stands for every eval metric
        return key == name or name.endswith("_") and key.startswith(name)
    panels = [[k for name in group for k in fields if wanted(k, name)] for group in PANELS]
    panels = [keys for keys in panels if keys]
    steps, times = [r["step"] for r in rows], [r["time_s"] for r in rows]
    n_rows, n_cols = math.ceil(len(panels) / 3), min(len(panels), 3)
    width, height = 4.2 * n_cols, 3.1 * n_rows  # inches; fixed margins (a layout engine would draw it twice)
    fig = Figure(figsize=(width, height))
    fig.subplots_adjust(left=0.7 / width, right=1 - 0.8 / width, bottom=0.5 / height, top=1 - 0.6 / height,
                        wspace=0.6, hspace=0.6)
    for n, keys in enumerate(panels, 1):
        ax = fig.add_subplot(n_rows, n_cols, n)
        right = ax.twinx() if any(not k.startswith("eval_") for k in keys[1:]) else None
        for i, key in enumerate(keys):
            on = ax if i == 0 or key.startswith("eval_") else right
            points = [(r["step"], r.get(key, math.nan)) for r in rows  # eval rows come every few steps
                      if key in r or not key.startswith("eval_") and "reward" in r]
            on.plot(*zip(*points), label=key, color=f"C{i}", linestyle="-" if on is ax else "--",
                    marker=("o" if on is ax else "s") if len(points) < 30 else None, markersize=4,
                    fillstyle="full" if on is ax else "none")
        for axis in filter(None, (ax, right)):
            axis.set_ylabel(" / ".join(line.get_label() for line in axis.get_lines()))
            low = axis.dataLim.y0
            if axis.dataLim.height == 0 and math.isfinite(low):  # one value: from 0 to it, not +-4% around it
                axis.set_ylim(min(0, 1.1 * low), max(0, 1.1 * low) or 1)
        ax.set_xlabel("step")
        ax.xaxis.get_major_locator().set_params(integer=True)
        if len(keys) > 1:
            ax.legend(handles=[line for axis in filter(None, (ax, right)) for line in axis.get_lines()], fontsize=7)
        ticks = [s for s in ax.get_xticks() if steps[0] <= s <= steps[-1]]
        top = ax.secondary_xaxis("top")
        top.set_xticks(ticks, [f"{np.interp(s, steps, times):.3g}" for s in ticks])
        top.set_xlabel("wall time (s)")
    fig.savefig(path, dpi=90)


def tracker(name, run_dir, config):
    """--log-to: -> (log(row), close()). Each package is optional and imported only when asked for."""
    try:
        if name == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package
            writer = SummaryWriter(os.path.join(run_dir, "tensorboard"))
            writer.add_text("config", json.dumps(config, indent=1))

            def log(row):
                for k, v in row.items():
                    if k != "step":
                        writer.add_scalar(k, v, int(row["step"]))
            return log, writer.close
        import wandb  # WANDB_MODE=offline writes the run under run_dir/wandb without an account
        run = wandb.init(project="flatrl", name=os.path.basename(os.path.abspath(run_dir)), dir=run_dir, config=config)
        return (lambda row: run.log(row, step=int(row["step"]))), run.finish
    except ImportError:
        raise SystemExit(f"config error: --log-to {name} needs its package: pip install {name}")
