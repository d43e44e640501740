"""Where batches come from. SyncSource samples in-process; AsyncSource serves weights to rollout workers
and takes their batches over stdlib HTTP (run_worker is the worker). Nothing is pickled: tensors travel
as safetensors, metadata as JSON. Invariant: a batch is trained on only under the exact weights that
sampled it (the trainer keeps the last max_staleness + 1 versions) or it is dropped, and counted.
The last stop of the reading path: SyncSource is the whole story of a one-process run.
"""
import collections
import contextlib
import hashlib
import hmac
import http.client
import http.server
import itertools
import json
import os
import secrets
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid

import torch
from safetensors.torch import load as st_load, save as st_save
from tqdm import tqdm

from model import check_keys, check_parity, json_args, parse_tool_calls, template_message
from utils import (LOCAL_TOKENS, Batch, Logger, bearer_token, broadcast_bytes, local_token, loopback, rank, sharded,
                   unshard, world)

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
    _, counts = torch.unique_consecutive(b.group, return_counts=True)
    if len(counts) != len(torch.unique(b.group)):
        raise ValueError("a group's samples must be adjacent rows")
    if llm:  # an agent run may be several rows: they must be adjacent, in one group, and a group hold enough runs
        runs = torch.unique_consecutive(torch.stack([b.group, b.run]), dim=1)  # [2, runs]: each run's group, run
        if runs.shape[1] != len(torch.unique(b.run)):
            raise ValueError("an episode's rows (run) must be adjacent and in one group")
        if (torch.unique_consecutive(runs[0], return_counts=True)[1] < cfg.group_size).any():
            raise ValueError(f"every group needs group_size = {cfg.group_size} episodes (run ids)")
    if (counts < cfg.group_size).any():  # more: an agent run that rewrote its history has a row more (tasks.py)
        raise ValueError(f"every group needs group_size = {cfg.group_size} samples; got sizes {counts.tolist()}")
    if any(x.min() < 0 or x.max() >= expect.limit for x in ((b.actions, b.obs) if llm else (b.actions,))):
        raise ValueError(f"actions and token ids must lie in [0, {expect.limit})")
    if llm and (b.attn.shape != b.obs.shape or not torch.equal(b.obs[:, -T:], b.actions)):
        raise ValueError("obs must end with the completion tokens (actions) and attn must match obs")
    if not llm and {b.obs.shape[2], b.final_obs.shape[1]} != {expect.obs_dim}:
        raise ValueError(f"observations must have {expect.obs_dim} features; got {b.obs.shape[2]}, "
                         f"{b.final_obs.shape[1]}")
    try:
        b.version, b.worker = int(meta["version"]), str(meta["worker"])
        b.stats = {str(k): float(v) for k, v in json.loads(meta.get("stats", "{}")).items()}
    except (KeyError, ValueError, TypeError, AttributeError):
        raise ValueError("metadata needs an integer 'version', a 'worker' and optional JSON 'stats' of numbers")
    return b, b.worker


class Expect(dict):
    """Tensor name -> (dtype, number of dims) a rollout must carry, plus the action / vocabulary limit."""

    def __init__(self, task, policy):
        llm = task.llm
        super().__init__(obs=(torch.long if llm else torch.float32, 2 if llm else 3), actions=(torch.long, 2),
                         mask=(torch.float32, 2), rewards=(torch.float32, 2), group=(torch.long, 1),
                         truncated=(torch.bool, 1), sampler_logp=(torch.float32, 2),
                         **({"attn": (torch.float32, 2), "run": (torch.long, 1)} if llm else
                            {"final_obs": (torch.float32, 2)}))
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
        self.trained, self.stale = collections.Counter(), collections.Counter()  # worker id -> its batches trained on,
        # and dropped as older than max_staleness

    def fate(self, worker):  # under cond: what became of a worker's batches, told with the end (its last line)
        return [("X-Flatrl-Trained", str(self.trained[worker])), ("X-Flatrl-Stale", str(self.stale[worker]))]

    def heard(self, worker):  # under cond
        now = time.time()
        self.gap[worker] = max(self.gap.get(worker, 0.0), now - self.seen.get(worker, now))
        self.seen[worker] = now


class Server(http.server.ThreadingHTTPServer):
    """A thread per request. A step's agents connect at once: a listen queue of 5 (the default) refuses some."""
    daemon_threads, request_queue_size = True, 256

    def handle_error(self, request, client_address):  # a client that went away (an agent cut off) is no error
        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            super().handle_error(request, client_address)


def bind_token(bind, cfg):
    """The bearer token every request must carry (utils.bearer_token; None: none asked); refused without one for an
    address other than loopback."""
    token = bearer_token(cfg)
    if not loopback(bind) and token is None:
        raise SystemExit(f"refusing to bind {bind} without a token: set FLATRL_TOKEN or --token-file (its clients "
                         "send it too)")
    return token


class Handler(http.server.BaseHTTPRequestHandler):
    """What both APIs' routes share: replies, errors, the token, the body (self.server.cfg, .token)."""
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

    def fail(self, code, msg, param=None):
        """An error in OpenAI's shape (its clients read it; so do flatrl's workers)."""
        kinds = {401: "authentication_error", 404: "not_found_error", 500: "server_error"}
        kind = kinds.get(code, "invalid_request_error")
        self.reply(code, {"error": {"message": msg, "type": kind, "param": param, "code": None}})

    def authorized(self):
        got, token = self.headers.get("Authorization", ""), self.server.token
        return token is None or hmac.compare_digest(got.encode(), f"Bearer {token}".encode())

    def body(self):
        """A POST's body, or None once a 4xx said why not (no token, no length, over body_limit_mb, cut short)."""
        if not self.authorized():
            return self.fail(401, "missing or wrong bearer token")
        size, limit = self.headers.get("Content-Length", ""), int(self.server.cfg.body_limit_mb * 2**20)
        if not size.isdecimal():
            return self.fail(411, "a non-negative integer Content-Length is required")
        if (size := int(size)) > limit:
            return self.fail(413, f"body of {size} bytes is over the {limit}-byte limit (body_limit_mb)")
        body = self.rfile.read(size)
        if len(body) != size:
            return self.fail(400, f"body ended after {len(body)} of {size} bytes")
        return body


class TrainerRoutes(Handler):
    """The trainer's routes, for its rollout workers (self.server.hub, .expect: AsyncSource sets them)."""

    def fail(self, code, msg, param=None):
        if self.command == "POST":  # the trainer's count of refused pushes
            with self.server.hub.cond:
                self.server.hub.counts["rejected"] += 1
        super().fail(code, msg, param)

    def do_GET(self):
        url, hub = urllib.parse.urlparse(self.path), self.server.hub
        if url.path == "/healthz":  # open to all: it says only the version, the queue's length and the counts
            with hub.cond:
                health = {"version": hub.version, "queued": len(hub.queue), "done": hub.done, **hub.counts}
            return self.reply(200, health)
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
                answer = 410, {"error": "training finished"}, hub.fate(worker)
            elif hub.version == have:
                answer = 304, b""
            else:
                answer = 200, hub.blob, [("X-Flatrl-Version", str(hub.version)), ("X-Flatrl-Sha256", hub.sha),
                                         *(hub.fate(worker) if last else [])]
        self.reply(*answer)
        if last:  # told only once it has the answer: the trainer stops serving as soon as every worker is told
            with hub.cond:
                hub.told.add(worker)

    def do_POST(self):
        """POST /rollouts: a batch into the queue (200), or why not (400 malformed, 410 done, 503 queue full)."""
        if self.path != "/rollouts":
            return self.fail(404, f"no endpoint {self.path}")
        body = self.body()
        if body is None:
            return
        hub, cfg = self.server.hub, self.server.cfg
        try:
            batch, worker = unpack_batch(body, cfg, self.server.expect)
        except ValueError as e:
            return self.fail(400, str(e))
        with hub.cond:
            hub.heard(worker)
            if hub.done:
                hub.told.add(worker)
                return self.reply(410, {"error": "training finished"}, hub.fate(worker))
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
        token = bind_token(cfg.bind, cfg)
        made = token is None and task.runs_model_text  # model text on this machine could POST made-up batches
        token = secrets.token_urlsafe(32) if made else token
        self.policy, self.cfg, self.log, self.hub = policy, cfg, log, Hub(version)
        self.snapshots = {}  # version -> the trainable weights that sampled it
        self.staleness, self.expect = [], Expect(task, policy)  # staleness: this step's, for stats()
        self.wire = cfg.wire_dtype if cfg.wire_dtype != "auto" else cfg.gen_dtype if task.llm else "float32"
        self.server = None  # under torchrun only rank 0 serves; the others get every batch from it (next_batch)
        if rank() == 0:
            self.server = Server((cfg.bind, cfg.port), TrainerRoutes, bind_and_activate=False)
            self.server.hub, self.server.cfg, self.server.expect, self.server.token = self.hub, cfg, self.expect, token
            self.server.server_bind()  # the port; a worker that connects before listen() is refused and reads again
            if made:  # written before any connection is taken: local workers read it (utils.local_token)
                local_token(self.server.server_port, token)
            self.server.server_activate()
            threading.Thread(target=self.server.serve_forever, daemon=True).start()
            log.say(f"trainer listening on http://{cfg.bind}:{self.server.server_port} (version {version})" +
                    (f"; this task runs model text, so the routes ask a token on loopback too, one of the run's own "
                     f"in {LOCAL_TOKENS}/{self.server.server_port} (0600), which this machine's workers read"
                     if made else ""))
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
                    self.hub.stale[batch.worker] += 1
                    continue
                self.hub.trained[batch.worker] += 1
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
        if self.server.token and self.server.token == local_token(self.server.server_port):
            local_token(self.server.server_port, "")  # this run's own: nobody needs it now


# --- the worker's side --------------------------------------------------------------------------------

def call(cfg, path, body=None, timeout=120):
    """HTTP to the trainer -> (status, headers, body bytes). HTTP errors are answers; while the trainer is
    unreachable, retry every 0.5-2 s (a trainer that comes up is found within 2 s) for up to connect_timeout s. A 401
    from a loopback trainer, to a worker with no token of its own, is tried again for 10 s: its own token, read from
    its file (utils.local_token), may be an older trainer's on the same port."""
    url, start, delay = cfg.trainer_url.rstrip("/") + path, time.time(), 0.5
    while True:
        own = trainers_own_token(cfg.trainer_url)
        token = bearer_token(cfg) or own  # read again: the trainer may be starting
        headers = {"X-Flatrl-Worker": WORKER, **({"Authorization": f"Bearer {token}"} if token else {})}
        try:
            with urllib.request.urlopen(urllib.request.Request(url, data=body, headers=headers), timeout=timeout) as r:
                return r.status, r.headers, r.read()
        except urllib.error.HTTPError as e:
            if e.code != 401 or token != own or time.time() - start > 10:
                return e.code, e.headers, e.read()
        except (urllib.error.URLError, http.client.HTTPException, ConnectionError, TimeoutError) as e:
            if time.time() - start > cfg.connect_timeout:
                raise SystemExit(f"trainer at {cfg.trainer_url} unreachable for {cfg.connect_timeout} s ({e}); "
                                 "giving up")
            if delay == 0.5:  # said once a call: a worker waiting on its trainer is not hung
                tqdm.write(f"worker {WORKER}: trainer at {cfg.trainer_url} unreachable ({e}); retrying for up to "
                           f"{cfg.connect_timeout:g} s (--connect-timeout)", file=sys.stderr)  # now, not at exit
        time.sleep(delay)
        delay = min(delay * 2, 2.0)


def trainers_own_token(url):
    """The token a trainer on this machine made for itself (AsyncSource), if it made one."""
    parts = urllib.parse.urlsplit(url)
    return local_token(parts.port) if loopback(parts.hostname or "") and parts.port else None


def hello(cfg):
    """The trainer's /config, once its settings match this worker's -> {"fingerprint", "steps"}; else SystemExit."""
    status, _, body = call(cfg, "/config")
    if status == 401:
        raise SystemExit(f"trainer refused /config (401: no token, or another): give this worker the trainer's, "
                         f"--token-file or FLATRL_TOKEN (a loopback trainer's own is read from {LOCAL_TOKENS}/PORT)")
    if status != 200:
        raise SystemExit(f"trainer refused /config ({status}): {body[:200].decode(errors='replace')}")
    remote = json.loads(body)
    for k, theirs in remote["fingerprint"].items():
        if getattr(cfg, k) != theirs:
            raise SystemExit(f"config mismatch on {k!r}: trainer has {theirs!r}, this worker {getattr(cfg, k)!r}")
    return remote


def run_worker(cfg, task, policy, remote):
    """Pull the newest weights, sample a batch, push it; until the trainer says it is done (the bar shows its steps).
    `remote`: hello's answer."""
    log = Logger(cfg.out, 0, remote["steps"])
    if task.llm:  # once at start-up: does this generator sample what the trainer scores?
        check_parity(policy, [task.build_prompt(q) for q, _ in task.eval_set[:4]], cfg, log.say)
    version, n, publish_s, fate = -1, 0, 0.0, None  # the weights sampled with, batches accepted, the trainer's count
    wait = 30  # seconds to long-poll /weights for a newer version
    while True:
        status, headers, body = call(cfg, f"/weights?have={version}&wait={wait}")
        if status == 410:
            fate = headers
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
                fate = headers
                break
        elif status != 304:
            raise SystemExit(f"trainer refused /weights ({status}): {body[:200].decode(errors='replace')}")
        if version < 0:
            continue
        wait = 0
        batch = task.rollout(policy, step=int(WORKER, 16) * 1000 + n)  # prompts / env seeds of this worker
        batch.version = version
        status, headers, body = call(cfg, "/rollouts", pack_batch(batch, WORKER))
        if status == 410:
            fate = headers
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
    log.say(last_words(n, fate, cfg))


def last_words(n, fate, cfg):
    """The worker's last line: its n accepted batches, and how many the trainer trained on (its X-Flatrl-Trained,
    -Stale headers) and why not the rest."""
    line = f"worker {WORKER}: training finished after {n} batches"
    if "X-Flatrl-Trained" not in fate:  # a trainer from before it counted
        return line
    trained, stale = int(fate["X-Flatrl-Trained"]), int(fate["X-Flatrl-Stale"])
    line += f"; the trainer trained on {trained}"
    if stale:
        line += f"; {stale} dropped, sampled by weights more than --max-staleness {cfg.max_staleness} versions old"
    if rest := n - trained - stale:  # (a trainer that restarted counts from 0 again, and lost its queue)
        line += f"; {rest} not trained: still queued when it trained its last step, or lost when it restarted"
    return line


# --- the OpenAI-compatible endpoint: agents written against the chat API ---------------------------------

SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "frequency_penalty", "presence_penalty",
            "repetition_penalty", "logit_bias")  # the run decides these in training: a request's are counted, unused
ENDED = "this agent run has ended (finished, or cut off at --agent-timeout)"
WAIT_S = 2.0  # a call waits up to this (a quarter of the last generate's time, 0.2 s at least) for other agents' calls


class BadRequest(ValueError):
    def __init__(self, message, param=None, code=400):
        super().__init__(message)
        self.param, self.code = param, code


def chat_request(body):
    """A /v1/chat/completions body -> the request (a dict), or BadRequest naming the first problem. Fields it does
    not know are ignored."""
    try:
        req = json.loads(body)
    except ValueError:
        raise BadRequest("the body is not JSON")
    if not isinstance(req, dict):
        raise BadRequest("the body must be a JSON object")
    if not isinstance(req.get("messages"), list) or not req["messages"]:
        raise BadRequest("messages must be a non-empty list of messages", "messages")
    for i, m in enumerate(req["messages"]):
        check_message(m, f"messages[{i}]")
    for key in ("n", "max_tokens", "max_completion_tokens"):
        if req.get(key) is not None and (type(req[key]) is not int or req[key] < 1):
            raise BadRequest(f"{key} must be a positive integer, not {req[key]!r}", key)
    tools = req.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(
            isinstance(t, dict) and isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str)
            for t in tools)):
        raise BadRequest('tools must be a list of {"type": "function", "function": {"name": ..., ...}}', "tools")
    for key in ("stream", "logprobs", "return_token_ids"):
        if not isinstance(req.get(key, False), bool):
            raise BadRequest(f"{key} must be true or false", key)
    return req


def check_message(m, where):
    roles = ("system", "user", "assistant", "tool")
    if not isinstance(m, dict) or m.get("role") not in roles:
        raise BadRequest(f"{where} must be a message with a role: one of {', '.join(roles)}", f"{where}.role")
    content = m.get("content")
    parts = isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and
                                              isinstance(p.get("text"), str) for p in content)
    if not (isinstance(content, str) or parts or content is None and m["role"] == "assistant"):
        raise BadRequest(f"{where}.content must be text or a list of text parts (no images or audio)",
                         f"{where}.content")
    calls = m.get("tool_calls") or []
    if not (isinstance(calls, list) and all(map(well_formed_call, calls))):
        raise BadRequest(f"{where}.tool_calls must be a list of calls, each a function with a name and JSON "
                         "arguments", f"{where}.tool_calls")


def well_formed_call(call):
    try:
        return isinstance(call["function"]["name"], str) and isinstance(json_args(call["function"]["arguments"]), dict)
    except (ValueError, TypeError, KeyError):
        return False


def chat_response(policy, model, req, prompt, replies):
    """The completion's body: replies [(ids, logps)] as OpenAI's choices (tool calls parsed where tools were
    offered), plus vLLM's token fields when logprobs or return_token_ids was asked."""
    choices, tokens = [], req.get("logprobs") or req.get("return_token_ids")
    for i, (ids, logps) in enumerate(replies):
        text = policy.tok.decode(ids, skip_special_tokens=True)
        ended = policy.ended(ids)  # a reply cut at max_tokens calls nothing, as in tasks.play
        content, calls = parse_tool_calls(text, req["tools"]) if req.get("tools") and ended else (text, [])
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                                      "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}}
                                     for c in calls]
        finish = "tool_calls" if calls else "stop" if ended else "length"
        choices.append({"index": i, "message": message, "finish_reason": finish, "logprobs": None})
        if tokens:
            pieces = [policy.tok.decode([t]) for t in ids]
            choices[-1]["token_ids"] = ids
            choices[-1]["logprobs"] = {"content": [{"token": p, "bytes": list(p.encode()), "logprob": lp,
                                                    "top_logprobs": []} for p, lp in zip(pieces, logps)]}
    n_out = sum(len(ids) for ids, _ in replies)
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": choices, **({"prompt_token_ids": prompt} if tokens else {}),
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": n_out, "total_tokens": len(prompt) + n_out}}


def stream_chunks(answer):
    """A completion as server-sent chunks: each choice whole in one delta, then its finish_reason."""
    head = {"id": answer["id"], "object": "chat.completion.chunk", "created": answer["created"],
            "model": answer["model"]}
    for c in answer["choices"]:
        delta = {"role": "assistant", "content": c["message"]["content"]}
        if "tool_calls" in c["message"]:
            delta["tool_calls"] = [{"index": j, **call} for j, call in enumerate(c["message"]["tool_calls"])]
        yield {**head, "choices": [{"index": c["index"], "delta": delta, "finish_reason": None,
                                    "logprobs": c["logprobs"]}]}
        yield {**head, "choices": [{"index": c["index"], "delta": {}, "finish_reason": c["finish_reason"]}]}


def same_chat(a, b):
    """Do two lists of OpenAI messages say the same (roles, text, calls; call ids and other fields aside)?"""
    return [template_message(m, True, True) for m in a] == [template_message(m, True, True) for m in b]


class Chat:
    """/v1/chat/completions on the run's sampler. The calls of an agent run (AgentTask's client sends its id in
    X-Flatrl-Episode) are recorded apart: the prompt ids, the sampled ids and their logprobs. Where a call's messages
    are the previous call's and its reply, unchanged, plus new ones, its prompt is that call's prompt and reply as
    sampled plus the new messages' ids: nothing sampled is tokenized again. In training the run's temperature
    samples (the loss models exactly it) and max_tokens is capped at max_new_tokens; evaluation is greedy. A call
    waits while a generate is under way, and briefly (wait_s) while fewer calls wait than agents still run: one
    generate then samples them all, and an agent busy elsewhere costs the others little (sample)."""

    def __init__(self, policy, cfg):
        self.policy, self.cfg, self.cond = policy, cfg, threading.Condition()
        self.waiting, self.busy = [], False  # calls for the next generate; a generate under way
        self.runs, self.running = {}, set()  # agent run id -> {"calls": [...], "error": cause}; agents not returned
        self.order = {}  # the open runs' ids -> their place (calls are sampled in that order)
        self.greedy, self.ignored = False, 0  # evaluation; training calls that set sampling fields
        self.wait_s = WAIT_S  # the longest a call waits for the other running agents' calls (sample)

    def open(self, runs, greedy):
        with self.cond:
            self.runs.update({r: {"calls": [], "error": None} for r in runs})
            self.order = {r: i for i, r in enumerate(runs)}
            self.running.update(runs)
            self.greedy = greedy

    def returned(self, run):
        with self.cond:
            self.running.discard(run)
            self.cond.notify_all()

    def close(self, runs):
        """-> each run's record; its agent, if still running, is cut off: its waiting and later calls are refused
        (410), and a generate under way finishes first, so nothing of these runs samples, draws from the RNG or
        records once the step goes on (to publish new weights under the sampler)."""
        with self.cond:
            self.running.difference_update(runs)
            records = [self.runs.pop(r) for r in runs]
            for call in [c for c in self.waiting if c["run"] in set(runs)]:
                self.waiting.remove(call)
                call["out"] = BadRequest(ENDED, code=410)
            self.cond.notify_all()
            while self.busy:
                self.cond.wait()
            return records

    def complete(self, req, run=None):
        """A checked request -> the completion's body; the call recorded in its agent run."""
        n, cap = req.get("n", 1), min(req.get("max_completion_tokens") or req.get("max_tokens") or 2**31,
                                      self.cfg.max_new_tokens)
        with self.cond:
            record = self.runs.get(run)
            if run is not None and record is None:
                raise BadRequest(ENDED, code=410)
            if record is not None and len(record["calls"]) >= self.cfg.max_turns:
                record["error"] = "turns"
                raise BadRequest(f"an agent run makes at most --max-turns {self.cfg.max_turns} calls")
            if record is not None and n != 1:
                raise BadRequest("an agent run's calls sample one reply each (n = 1)", "n")
            greedy = self.greedy if record is not None else req.get("temperature") == 0
            self.ignored += record is not None and not greedy and any(k in req for k in SAMPLING)
        last = record["calls"][-1] if record and record["calls"] else None
        prompt = self.prompt(req, last)
        replies = self.sample(prompt, n, cap, greedy, run)
        answer = chat_response(self.policy, self.cfg.model, req, prompt, replies)
        if record is not None:
            (ids, logps), = replies
            with self.cond:
                if self.runs.get(run) is not record:  # closed while this call sampled: its record is returned
                    raise BadRequest(ENDED, code=410)
                record["calls"].append({"messages": req["messages"], "tools": req.get("tools"), "prompt": prompt,
                                        "ids": ids, "logps": logps, "reply": answer["choices"][0]["message"]})
        return answer

    def prompt(self, req, last):
        """The prompt's ids: the last call's prompt and reply as sampled plus the new messages where the request
        extends that call unchanged (its messages, its tools, its reply); else the whole chat rendered."""
        m, tools = req["messages"], req.get("tools")
        k = len(last["messages"]) + 1 if last else 0  # the last call's messages and its reply
        if last and len(m) > k and tools == last["tools"] and same_chat(m[:k], [*last["messages"], last["reply"]]):
            return last["prompt"] + last["ids"] + self.policy.env_ids(m[k:], last["ids"][-1])
        return self.policy.prompt_ids(m, tools)

    def sample(self, prompt, n, cap, greedy, run=None):
        """n replies [(ids, logps)] to one prompt. The call waits while a generate is under way (its own call may be
        in it), and, for at most wait_s (a quarter of the last generate's seconds, between 0.2 s and WAIT_S), while
        fewer calls wait than agents are still running: an agent that has not called yet will likely call soon, and
        one generate then samples them all. Then the first call still waiting samples every waiting one."""
        mine, until = {"prompt": prompt, "n": n, "cap": cap, "greedy": greedy, "run": run}, time.time() + self.wait_s
        with self.cond:
            if run is not None and run not in self.runs:  # closed while this call built its prompt
                raise BadRequest(ENDED, code=410)
            self.waiting.append(mine)
            self.cond.notify_all()
            while self.must_wait(mine, until):
                self.cond.wait(max(until - time.time(), 0.01))
            if "out" not in mine:
                todo, self.waiting, self.busy = self.waiting, [], True
        if "out" not in mine:
            start = time.time()
            try:
                self.generate(todo)
            finally:
                self.wait_s = min(WAIT_S, max(0.2, (time.time() - start) / 4))
                with self.cond:
                    self.busy = False
                    self.cond.notify_all()
        if isinstance(mine["out"], Exception):
            raise mine["out"]
        return mine["out"]

    def must_wait(self, mine, until):
        """Under cond: does the call `mine` wait on? Not once answered; yes while a generate is under way; else only
        till `until`, and only while fewer calls wait than agents are still running (one of them may yet call)."""
        if "out" in mine:
            return False
        if self.busy:
            return True
        return len(self.waiting) < len(self.running) and time.time() < until

    def generate(self, calls):
        """The calls' replies, in the order their agent runs were opened (so a seed gives the same samples): calls
        with the same prompt share one prefill, as a group's agents do at their first call, and each distinct count of
        replies per prompt is one generate. Each reply is cut to its call's max_tokens."""
        asks = {}  # (prompt, greedy, a call that wants n > 1 on its own) -> the calls asking it
        for c in sorted(calls, key=lambda c: self.order.get(c["run"], len(self.order))):
            asks.setdefault((tuple(c["prompt"]), c["greedy"], id(c) if c["n"] > 1 else 0), []).append(c)
        batches = {}  # (replies per prompt, greedy) -> [(prompt, its calls)]
        for (prompt, greedy, _), alike in asks.items():
            batches.setdefault((sum(c["n"] for c in alike), greedy), []).append((prompt, alike))
        for (n, greedy), work in batches.items():
            try:
                ids, logps = self.policy.sample([list(p) for p, _ in work], n, greedy, record=True,
                                                max_new=max(c["cap"] for _, alike in work for c in alike))
            except Exception as e:  # every call waiting on this generate hears of it
                ids, logps = [e] * len(work) * n, [None] * len(work) * n
            replies = iter(zip(ids, logps))
            for _, alike in work:
                for c in alike:
                    out = list(itertools.islice(replies, c["n"]))
                    c["out"] = out[0][0] if isinstance(out[0][0], Exception) else [
                        (x[:c["cap"]], lp[:c["cap"]]) for x, lp in out]


RUN_MODEL = "flatrl-run:"  # a model name that names an agent run: flatrl-run:<run id> (tasks.VerifiersTask's calls)


def run_named(req):
    """The agent run a request's model names, if any: a harness that sets no header of ours (verifiers' interception
    server names every call's model as its rollout's) still has its calls recorded in its run. It comes before the
    header, which that server passes on from whatever its harness sent."""
    model = req.get("model")
    return model.removeprefix(RUN_MODEL) if isinstance(model, str) and model.startswith(RUN_MODEL) else None


def served(cfg):
    """The name /v1/models gives what is served: the run's folder (its weights), else the base model."""
    return os.path.basename(os.path.normpath(cfg.out)) if cfg.out else cfg.model


class ChatRoutes(Handler):
    """The OpenAI-compatible routes, all behind the token (self.server.chat: serve_chat sets it)."""

    def do_GET(self):
        path, cfg = urllib.parse.urlparse(self.path).path, self.server.cfg
        if not self.authorized():  # /healthz too: an agent endpoint tells what it serves to its callers only
            return self.fail(401, "missing or wrong bearer token")
        if path == "/healthz":
            return self.reply(200, {"serving": served(cfg), "max_tokens": cfg.max_new_tokens})
        if path == "/v1/models":  # the run (its weights), on its base model (root)
            return self.reply(200, {"object": "list", "data": [{"id": served(cfg), "object": "model", "created": 0,
                                                                "owned_by": "flatrl", "root": cfg.model}]})
        return self.fail(404, f"no endpoint {path}")

    def do_POST(self):
        """POST /v1/chat/completions: OpenAI's chat completion (its server-sent events, with stream), by Chat."""
        if self.path != "/v1/chat/completions":
            return self.fail(404, f"no endpoint {self.path}")
        body = self.body()
        if body is None:
            return
        try:
            req = chat_request(body)
            answer = self.server.chat.complete(req, run_named(req) or self.headers.get("X-Flatrl-Episode"))
        except BadRequest as e:
            return self.fail(e.code, str(e), e.param)
        except Exception as e:  # the sampler failed: the agent hears why (a 500), the server goes on
            return self.fail(500, f"sampling failed: {type(e).__name__}: {e}")
        if not req.get("stream"):
            return self.reply(200, answer)
        self.send_response(200)  # HTTP/1.0: the events end when the connection closes
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for event in [*stream_chunks(answer), "[DONE]"]:
            self.wfile.write(f"data: {event if event == '[DONE]' else json.dumps(event)}\n\n".encode())


def serve_chat(policy, cfg, bind="127.0.0.1", port=0, token=None):
    """The endpoint alone -> its server. AgentTask's, in every process that plays agents, takes a key of its own
    (`token`, random, given only to the agents' clients: model code run by a tool has none); train.py --serve's,
    the run's token (bind_token)."""
    token = token or bind_token(bind, cfg)
    server = Server((bind, port), ChatRoutes)
    server.cfg, server.chat, server.token = cfg, Chat(policy, cfg), token
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server
