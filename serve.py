"""Where batches come from. SyncSource samples in-process; AsyncSource serves weights to rollout workers
and takes their batches over stdlib HTTP (run_worker is the worker). Nothing is pickled: tensors travel
as safetensors, metadata as JSON. Invariant: a batch is trained on only under the exact weights that
sampled it (the trainer keeps the last max_staleness + 1 versions) or it is dropped, and counted.
The last stop of the reading path: SyncSource is the whole story of a one-process run.
"""
import contextlib
import hashlib
import hmac
import http.client
import http.server
import json
import os
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid

import torch
from safetensors.torch import load as st_load, save as st_save

from model import check_keys, check_parity
from utils import Batch, Logger, broadcast_bytes, loopback, rank, sharded, unshard, world

WORKER = uuid.uuid4().hex[:8]  # this process's id as a rollout worker: its prompts and env seeds, its default folder

# A worker whose config differs from the trainer's in one of these would sample the wrong thing.
FINGERPRINT = ("task", "env", "model", "algo", "seed", "group_size", "batch_size", "temperature", "max_new_tokens",
               "max_turns", "turn_discount", "credit", "max_tool_calls", "max_episode_tokens", "digits", "ops", "data",
               "data_prompt", "hidden", "lora_r", "lora_alpha", "lora_targets")


class SyncSource:
    """Samples with the policy's current weights, in this process."""

    def __init__(self, task, policy):
        self.task, self.policy = task, policy

    def next_batch(self, step):
        return self.task.rollout(self.policy, step)

    def weights(self, batch):  # the batch was sampled by the current weights
        return contextlib.nullcontext()

    def publish(self, step):
        self.policy.publish()

    def stats(self):
        return {}

    def close(self):
        pass


# --- the wire: safetensors bytes with JSON metadata ---------------------------------------------

def pack_batch(batch, worker):
    tensors = {k: v.contiguous() for k, v in batch.tensors().items()}
    meta = {"version": str(batch.version), "worker": worker, "stats": json.dumps(batch.stats)}
    return st_save(tensors, metadata=meta)


def unpack_batch(body, cfg, expect):
    """Bytes -> (Batch, worker), or ValueError naming the first problem (a bad token id would crash the forward)."""
    try:
        n = int.from_bytes(body[:8], "little")
        meta = json.loads(body[8:8 + n]).get("__metadata__") or {}
        tensors = st_load(body)
    except Exception as e:  # safetensors raises several types on garbage
        raise ValueError(f"body is not a safetensors file ({type(e).__name__})")
    if set(tensors) != set(expect):
        raise ValueError(f"tensors must be exactly {sorted(expect)}; got {sorted(tensors)}")
    for k, (dtype, dims) in expect.items():
        if tensors[k].dtype != dtype or tensors[k].dim() != dims:
            raise ValueError(f"{k} must be {dtype} with {dims} dims; got {tensors[k].dtype} {tuple(tensors[k].shape)}")
    b = Batch(**tensors)
    N, T = b.mask.shape
    if N == 0 or any(v.shape[0] != N for v in tensors.values()) or b.actions.shape != (N, T):
        raise ValueError("tensors disagree on the number of samples N or steps T")
    llm = not b.obs.is_floating_point()
    for k in ("rewards", "sampler_logp", "attn") if llm else ("obs", "final_obs", "rewards", "sampler_logp"):
        if not torch.isfinite(tensors[k]).all():
            raise ValueError(f"{k} holds NaN or Inf")
    if ((b.mask != 0) & (b.mask != 1)).any():
        raise ValueError("mask must hold only 0 and 1")
    _, counts = torch.unique(b.group, return_counts=True)
    if (counts != cfg.group_size).any():
        raise ValueError(f"every group must have group_size = {cfg.group_size} samples; got sizes {counts.tolist()}")
    if (b.group.view(-1, cfg.group_size) != b.group.view(-1, cfg.group_size)[:, :1]).any():
        raise ValueError("a group's samples must be adjacent rows (rows i G .. i G + G - 1 share a group id)")
    if any(x.min() < 0 or x.max() >= expect.limit for x in ((b.actions, b.obs) if llm else (b.actions,))):
        raise ValueError(f"actions and token ids must lie in [0, {expect.limit})")
    if llm and (b.attn.shape != b.obs.shape or not torch.equal(b.obs[:, -T:], b.actions)):
        raise ValueError("obs must end with the completion tokens (actions) and attn must match obs")
    if not llm and {b.obs.shape[2], b.final_obs.shape[1]} != {expect.obs_dim}:
        raise ValueError(f"observations must have {expect.obs_dim} features; got {b.obs.shape[2]}, "
                         f"{b.final_obs.shape[1]}")
    try:
        b.version, worker = int(meta["version"]), str(meta["worker"])
        b.stats = {str(k): float(v) for k, v in json.loads(meta.get("stats", "{}")).items()}
    except (KeyError, ValueError, TypeError, AttributeError):
        raise ValueError("metadata needs an integer 'version', a 'worker' and optional JSON 'stats' of numbers")
    return b, worker


class Expect(dict):
    """Tensor name -> (dtype, number of dims) a rollout must carry, plus the action / vocabulary limit."""

    def __init__(self, task, policy):
        llm = task.llm
        super().__init__(obs=(torch.long if llm else torch.float32, 2 if llm else 3), actions=(torch.long, 2),
                         mask=(torch.float32, 2), rewards=(torch.float32, 2), group=(torch.long, 1),
                         truncated=(torch.bool, 1), sampler_logp=(torch.float32, 2),
                         **({"attn": (torch.float32, 2)} if llm else {"final_obs": (torch.float32, 2)}))
        self.limit = policy.lm.get_input_embeddings().num_embeddings if llm else task.n_actions
        self.obs_dim = None if llm else task.obs_dim


def sent(params):
    """What the trainer sends workers of its trainable weights: all but the value head (workers only sample)."""
    return {k: v for k, v in params.items() if not k.startswith("value_head")}


# --- the trainer's side ----------------------------------------------------------------------------

class Hub:
    """State shared by the HTTP threads and the training loop, guarded by one condition variable."""

    def __init__(self, version):
        self.cond = threading.Condition()
        self.version, self.blob, self.sha, self.queue, self.done = version, b"", "", [], False
        self.counts = {"accepted": 0, "rejected": 0, "dropped_stale": 0, "dropped_busy": 0}
        self.seen, self.told = {}, set()  # worker id -> last time heard from; workers that know training ended
        self.gap = {}  # worker id -> the longest time between two of its requests (how long close() waits for it)

    def heard(self, worker):  # under cond
        now = time.time()
        self.gap[worker] = max(self.gap.get(worker, 0.0), now - self.seen.get(worker, now))
        self.seen[worker] = now


class Handler(http.server.BaseHTTPRequestHandler):
    """The trainer's HTTP routes, one method each. What they share (the Hub, the config, the expected tensors, the
    token) hangs on the server: self.server.hub and so on (AsyncSource sets them)."""
    timeout = 30  # seconds a client may take to send its request: a stalled client cannot pin a thread

    def log_message(self, *args):  # the trainer's progress bar owns the terminal
        pass

    def reply(self, code, body=None, headers=()):
        raw = isinstance(body, bytes)
        data = body if raw else json.dumps(body or {}).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/octet-stream" if raw else "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in headers:
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def fail(self, code, msg):
        if self.command == "POST":
            with self.server.hub.cond:
                self.server.hub.counts["rejected"] += 1
        self.reply(code, {"error": msg})

    def authorized(self):
        got, token = self.headers.get("Authorization", ""), self.server.token
        return token is None or hmac.compare_digest(got.encode(), f"Bearer {token}".encode())

    def do_GET(self):
        url, hub = urllib.parse.urlparse(self.path), self.server.hub
        if url.path == "/healthz":
            return self.healthz()
        if not self.authorized():
            return self.fail(401, "missing or wrong bearer token")
        if worker := self.headers.get("X-Flatrl-Worker"):  # a flatrl worker, waited for at the end (a curl is not)
            with hub.cond:
                hub.heard(worker)
        if url.path == "/config":
            cfg = self.server.cfg
            return self.reply(200, {"fingerprint": {k: getattr(cfg, k) for k in FINGERPRINT}, "steps": cfg.steps})
        if url.path == "/weights":
            return self.weights(url.query, worker)
        return self.fail(404, f"no endpoint {url.path}")

    def healthz(self):
        hub = self.server.hub
        with hub.cond:
            health = {"version": hub.version, "queued": len(hub.queue), "done": hub.done, **hub.counts}
        self.reply(200, health)

    def weights(self, query, worker):
        """GET /weights?have=V&wait=S: long-poll for a version other than V; 304 after S seconds, 410 once done."""
        hub = self.server.hub
        try:
            q = {k: int(v) for k, (v,) in urllib.parse.parse_qs(query, strict_parsing=bool(query)).items()}
        except ValueError:
            return self.fail(400, "query parameters have and wait must be integers")
        have, wait = q.get("have", -1), min(max(q.get("wait", 0), 0), 60)
        with hub.cond:
            hub.cond.wait_for(lambda: hub.version != have or hub.done, timeout=wait)
            last = hub.done or hub.version >= self.server.cfg.steps  # a worker stops at the final weights too
            if hub.done:
                answer = 410, {"error": "training finished"}
            elif hub.version == have:
                answer = 304, b""
            else:
                answer = 200, hub.blob, [("X-Flatrl-Version", str(hub.version)), ("X-Flatrl-Sha256", hub.sha)]
        self.reply(*answer)
        if last:  # told only once it has the answer: the trainer stops serving as soon as every worker is told
            with hub.cond:
                hub.told.add(worker)

    def do_POST(self):
        if self.path != "/rollouts":
            return self.fail(404, f"no endpoint {self.path}")
        if not self.authorized():
            return self.fail(401, "missing or wrong bearer token")
        body = self.body()
        if body is not None:
            self.rollouts(body)

    def body(self):
        """The request's body, or None once a 4xx said why not (no length, over body_limit_mb, cut short)."""
        size, limit = self.headers.get("Content-Length", ""), int(self.server.cfg.body_limit_mb * 2**20)
        if not size.isdecimal():
            return self.fail(411, "a non-negative integer Content-Length is required")
        if (size := int(size)) > limit:
            return self.fail(413, f"body of {size} bytes is over the {limit}-byte limit (body_limit_mb)")
        body = self.rfile.read(size)
        if len(body) != size:
            return self.fail(400, f"body ended after {len(body)} of {size} bytes")
        return body

    def rollouts(self, body):
        """POST /rollouts: a batch into the queue (200), or why not (400 malformed, 410 done, 503 queue full)."""
        hub, cfg = self.server.hub, self.server.cfg
        try:
            batch, worker = unpack_batch(body, cfg, self.server.expect)
        except ValueError as e:
            return self.fail(400, str(e))
        with hub.cond:
            hub.heard(worker)
            if hub.done:
                hub.told.add(worker)
                return self.reply(410, {"error": "training finished"})
            if batch.version > hub.version:
                return self.fail(400, f"version {batch.version} is from the future (trainer is at {hub.version})")
            if len(hub.queue) >= cfg.max_queue:
                hub.counts["dropped_busy"] += 1
                return self.reply(503, {"error": "queue full; fetch newer weights and try again"})
            hub.queue.append(batch)
            hub.counts["accepted"] += 1
            hub.cond.notify_all()
        self.reply(200, {"queued": len(hub.queue)})


class AsyncSource:
    """Batches pushed by rollout workers. Keeps the weights of the last max_staleness + 1 versions;
    a batch sampled by any older version is dropped (counted), never trained on."""

    def __init__(self, task, policy, cfg, log, version):
        token = os.environ.get("FLATRL_TOKEN") or None
        if not loopback(cfg.bind) and token is None:
            raise SystemExit(f"refusing to bind {cfg.bind} without a token: set FLATRL_TOKEN (workers need it too)")
        self.policy, self.cfg, self.log, self.hub = policy, cfg, log, Hub(version)
        self.snapshots = {}  # version -> the trainable weights that sampled it
        self.staleness, self.expect = [], Expect(task, policy)  # staleness: this step's, for stats()
        self.wire = cfg.wire_dtype if cfg.wire_dtype != "auto" else cfg.gen_dtype if task.llm else "float32"
        self.server = None  # under torchrun only rank 0 serves; the others get every batch from it (next_batch)
        if rank() == 0:
            self.server = http.server.ThreadingHTTPServer((cfg.bind, cfg.port), Handler)
            self.server.hub, self.server.cfg, self.server.expect, self.server.token = self.hub, cfg, self.expect, token
            self.server.daemon_threads = True
            threading.Thread(target=self.server.serve_forever, daemon=True).start()
            log.say(f"trainer listening on http://{cfg.bind}:{self.server.server_port} (version {version})")
        self.publish(version)

    def publish(self, version):
        """One serialization per version for every worker (whole: gathered onto rank 0); a snapshot on each rank."""
        self.policy.publish()  # the trainer's own sampler serves its evaluations
        params = self.policy.params()
        self.snapshots[version] = {k: v.detach().clone() if sharded(v) else v.detach().cpu().clone()
                                   for k, v in params.items()}
        for old in [v for v in self.snapshots if v < version - self.cfg.max_staleness]:
            del self.snapshots[old]
        wire = getattr(torch, self.wire)  # old_logp still comes from the fp32 snapshots above
        whole = {k: unshard(v).detach().cpu().to(wire) for k, v in sent(params).items()}
        blob = st_save(whole, metadata={"version": str(version)}) if rank() == 0 else b""  # only rank 0 serves it
        with self.hub.cond:
            self.hub.version, self.hub.blob, self.hub.sha = version, blob, hashlib.sha256(blob).hexdigest()
            self.hub.cond.notify_all()

    def next_batch(self, step):
        """Rank 0 takes the next batch it holds the weights of; under torchrun it is broadcast and each rank keeps its
        share of the groups (the loss weights' global sums span the whole batch)."""
        batch = self.take(step) if rank() == 0 else None
        if world() > 1:
            body = broadcast_bytes(pack_batch(batch, "rank0") if batch else None)
            batch = unpack_batch(body, self.cfg, self.expect)[0]
            batch = batch.rows(torch.nonzero(batch.group % world() == rank())[:, 0])
        return batch

    def take(self, step):
        waited = time.time()
        while True:
            with self.hub.cond:
                if not self.hub.cond.wait_for(lambda: self.hub.queue, timeout=30):
                    self.log.say(f"step {step}: no rollouts for {time.time() - waited:.0f} s; waiting for workers "
                                 "(python train.py --config ... --role rollout --trainer-url "
                                 f"http://HOST:{self.server.server_port})")
                    continue
                batch = self.hub.queue.pop(0)
                if batch.version not in self.snapshots:  # older than max_staleness, or from before a restart
                    self.hub.counts["dropped_stale"] += 1
                    continue
            self.staleness.append(self.hub.version - batch.version)
            return batch

    @contextlib.contextmanager
    def weights(self, batch):
        """Swap in the snapshot that sampled the batch, then back."""
        self.policy.load_state_dict(self.snapshots[batch.version], strict=False)
        try:
            yield
        finally:
            self.policy.load_state_dict(self.snapshots[self.hub.version], strict=False)

    def stats(self):
        """The step's transport metrics: queue, staleness (mean, max), drop counters."""
        s = self.staleness
        out = {"staleness": sum(s) / max(len(s), 1), "staleness_max": max(s, default=0)}
        self.staleness = []
        with self.hub.cond:
            counts = {k: v for k, v in self.hub.counts.items() if k != "accepted"}
            return {"queue": len(self.hub.queue), **out, **counts}

    def close(self):
        """Tell the workers training is over (410), wait until every worker heard from in the last two minutes has
        heard it, then stop serving: a worker finding no trainer would retry, then exit 1. The wait is at most twice
        the longest a worker went between requests (a slow batch, a busy machine), from 30 s to 120 s."""
        if self.server is None:  # not rank 0
            return
        with self.hub.cond:
            self.hub.done = True
            t = time.time()
            self.hub.cond.notify_all()

        def live():
            with self.hub.cond:  # handler threads add workers to seen
                return [w for w, seen in self.hub.seen.items() if seen > t - 120 and w not in self.hub.told]
        wait = min(120.0, max([30.0] + [2 * self.hub.gap[w] for w in live()]))
        if live():
            self.log.say(f"training ended: waiting up to {wait:.0f} s for {len(live())} worker(s) to hear it")
        while live() and time.time() < t + wait:
            time.sleep(0.1)
        self.server.shutdown()
        self.server.server_close()


# --- the worker's side --------------------------------------------------------------------------------

def call(cfg, path, body=None, timeout=120):
    """HTTP to the trainer -> (status, headers, body bytes). HTTP errors are answers; while the trainer is
    unreachable, retry every 0.5-2 s (a trainer that comes up is found within 2 s) for up to connect_timeout s."""
    url, token = cfg.trainer_url.rstrip("/") + path, os.environ.get("FLATRL_TOKEN")
    headers = {"X-Flatrl-Worker": WORKER, **({"Authorization": f"Bearer {token}"} if token else {})}
    start, delay = time.time(), 0.5
    while True:
        try:
            with urllib.request.urlopen(urllib.request.Request(url, data=body, headers=headers), timeout=timeout) as r:
                return r.status, r.headers, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.headers, e.read()
        except (urllib.error.URLError, http.client.HTTPException, ConnectionError, TimeoutError) as e:
            if time.time() - start > cfg.connect_timeout:
                raise SystemExit(f"trainer at {cfg.trainer_url} unreachable for {cfg.connect_timeout} s ({e}); "
                                 "giving up")
            time.sleep(delay)
            delay = min(delay * 2, 2.0)


def run_worker(cfg, task, policy):
    """Pull the newest weights, sample a batch, push it; until the trainer says it is done (the bar shows its steps)."""
    status, _, body = call(cfg, "/config")
    if status != 200:
        raise SystemExit(f"trainer refused /config ({status}): {body[:200].decode(errors='replace')}")
    remote = json.loads(body)
    log = Logger(cfg.out, 0, remote["steps"])
    for k, theirs in remote["fingerprint"].items():
        if getattr(cfg, k) != theirs:
            raise SystemExit(f"config mismatch on {k!r}: trainer has {theirs!r}, this worker {getattr(cfg, k)!r}")
    if task.llm:  # once at start-up: does this generator sample what the trainer scores?
        check_parity(policy, [task.build_prompt(q) for q, _ in task.eval_set[:4]], cfg, log.say)
    version, n, publish_s = -1, 0, 0.0  # the weights sampled with, batches accepted
    wait = 30  # seconds to long-poll /weights for a newer version
    while True:
        status, headers, body = call(cfg, f"/weights?have={version}&wait={wait}")
        if status == 410:
            break
        if status == 200:
            if hashlib.sha256(body).hexdigest() != headers["X-Flatrl-Sha256"]:
                continue  # corrupted in transit: fetch again
            t = time.time()
            weights, mine = st_load(body), policy.params()
            check_keys(weights, mine, sent(mine))
            policy.load_state_dict(weights, strict=False)
            policy.publish()  # into the sampler: an HF copy, or the vLLM engine (merge + reload + cache reset)
            version, publish_s = int(headers["X-Flatrl-Version"]), time.time() - t
            if version >= remote["steps"]:  # the final weights: the trainer is evaluating and closing
                break
        elif status != 304:
            raise SystemExit(f"trainer refused /weights ({status}): {body[:200].decode(errors='replace')}")
        if version < 0:
            continue
        wait = 0
        batch = task.rollout(policy, step=int(WORKER, 16) * 1000 + n)  # prompts / env seeds of this worker
        batch.version = version
        status, _, body = call(cfg, "/rollouts", pack_batch(batch, WORKER))
        if status == 410:
            break
        if status == 200:
            n += 1
        wait = 30 if status == 503 else 0  # a full queue: wait for the next version instead of running ahead
        log.log({"step": n, "version": version, "status": status, "reward": batch.seq_reward.mean().item(),
                 "publish_s": publish_s}, version)
        if status not in (200, 503):
            log.say(f"worker {WORKER}: batch refused ({status}): {body[:300].decode(errors='replace')}")
    log.bar.update(log.bar.total - log.bar.n)
    log.bar.close()
    log.say(f"worker {WORKER}: training finished after {n} batches")
