"""Async transport: real trainer and worker processes on loopback (CartPole and a tiny LLM), staleness
and snapshots, old_logp under the sampling weights, auth, and a fuzz of malformed requests."""
import contextlib
import csv
import http.client
import json
import os
import random
import re
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request

import pytest
import torch
from safetensors.torch import load as st_load

import train
from config import Config
from model import MLPPolicy
from serve import AsyncSource, pack_batch
from tasks import GymTask
from utils import Logger, cpu_shares

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(*args, env=None, cmd=None, cwd=ROOT):
    """train.py (or cmd) in the background, its output in a file: a pipe that nobody reads while the test waits
    on another process fills up and blocks the child for good. output(proc) reads it."""
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(cmd or [sys.executable, os.path.join(ROOT, "train.py"), *args], cwd=cwd, stdout=log,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})})
    proc.log = log
    return proc


def output(proc, timeout=180, partners=()):
    """Its output once it has exited. A process that writes nothing (no progress bar, no line) for `timeout` s is
    hung: stopped, and its output shown. The limit is on silence, not on the whole run, so a machine that another
    job keeps busy only makes the run slower. A trainer is never silent (it says every 30 s that it waits for
    rollouts): it is stopped as soon as one of its partners (its workers) fails."""
    written, last = -1, time.time()
    while proc.poll() is None:
        if failed := [p for p in partners if p.poll() not in (None, 0)]:
            proc.kill()
            proc.wait()
            raise AssertionError(f"a partner exited {failed[0].returncode}; its output:\n{output(failed[0])[-3000:]}")
        if os.fstat(proc.log.fileno()).st_size != written:
            written, last = os.fstat(proc.log.fileno()).st_size, time.time()
        elif time.time() - last > timeout:  # stop it, and show what it was doing
            proc.kill()
            proc.wait()
            proc.log.seek(0)
            raise AssertionError(f"silent for {timeout} s; its output:\n{proc.log.read()[-3000:]}")
        time.sleep(0.2)
    proc.log.seek(0)
    return proc.log.read()


def health(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r:
        return json.loads(r.read())


def wait_for(cond, timeout=120):
    end = time.time() + timeout
    while time.time() < end:
        try:
            if cond():
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError


def finish(proc, timeout=180, partners=()):
    out = output(proc, timeout, partners)
    assert proc.returncode == 0, out[-3000:]
    return out


def rows(run_dir):
    with open(os.path.join(run_dir, "metrics.csv")) as f:
        return [r for r in csv.DictReader(f) if r.get("reward")]


def trainer_and_worker(tmp_path, common, steps, worker_flags=(), timeout=180):
    """A trainer on a free port (steps, its run in tmp_path/t) and one rollout worker (tmp_path/w), both run to their
    end -> (the trainer's metrics rows, the worker's output)."""
    port = free_port()
    trainer = spawn(*common, "--role", "trainer", "--port", str(port), "--steps", str(steps), "--out", str(tmp_path / "t"))
    worker = spawn(*common, *worker_flags, "--role", "rollout", "--trainer-url", f"http://127.0.0.1:{port}",
                   "--out", str(tmp_path / "w"))
    finish(trainer, timeout, [worker])
    out = finish(worker, timeout)
    assert "training finished" in out  # the worker heard the end and exited 0
    m = re.search(r"finished after (\d+) batches; the trainer trained on (\d+)(.*)", out)
    assert int(m[2]) == steps  # one worker: each step trained one of its batches, and the trainer told it so
    assert (int(m[1]) > steps) == ("not trained: still queued" in m[3] or "dropped" in m[3])  # and why not the rest
    return rows(tmp_path / "t"), out


CARTPOLE = ["--task", "cartpole", "--algo", "reinforce", "--batch-size", "4", "--no-stop-when-solved",
            "--eval-every", "0", "--connect-timeout", "60"]
# For several workers that must all join: a worker retries an unreachable trainer every 0.5-2 s, and at 4 rows a batch
# 7 workers fed a trainer 20 steps in under 2 s, so the 8th, asleep between retries, found it gone and retried until
# --connect-timeout. 16 rows a batch keep the trainer at it for 5-8 s.
CARTPOLE16 = [*CARTPOLE, "--batch-size", "16"]


def test_trainer_and_two_workers_end_to_end(tmp_path):
    port = free_port()  # the workers start first (they retry until the trainer is up): both join
    workers = [spawn(*CARTPOLE16, "--role", "rollout", "--trainer-url", f"http://127.0.0.1:{port}",
                     "--out", str(tmp_path / f"w{i}")) for i in range(2)]
    trainer = spawn(*CARTPOLE16, "--role", "trainer", "--port", str(port), "--steps", "20", "--out", str(tmp_path / "t"))
    finish(trainer, partners=workers)
    outs = [finish(w) for w in workers]
    assert all("training finished" in o for o in outs)  # workers notice the end and exit 0
    trained = rows(tmp_path / "t")
    assert len(trained) == 20
    for r in trained:
        assert 0 <= float(r["staleness"]) <= 1 and float(r["logp_gap"]) < 1e-5  # same MLP math on both sides
        if float(r["staleness"]) == 0:  # sampled by the current weights: on-policy
            assert float(r["trained_ratio"]) == pytest.approx(1.0, abs=1e-5)



def test_eight_workers_started_at_once_in_one_folder_keep_apart(tmp_path):
    port = free_port()
    workers = [spawn(*CARTPOLE16, "--role", "rollout", "--trainer-url", f"http://127.0.0.1:{port}", "--threads", "1",
                     "--connect-timeout", "600", cwd=tmp_path) for _ in range(8)]  # one command, default folders, one folder
    # the trainer starts once every worker is up (it said the trainer is unreachable), so each is retrying
    # (CARTPOLE16): for as long as 8 start-ups on 2 cores and the trainer's own take, which came within a 300 s
    # --connect-timeout once. 40 steps: once in CI a worker retrying every 2 s never reached a 20-step trainer
    # (unexplained; if again, both sides show). pread: the workers write at the file's shared offset
    wait_for(lambda: all(b"unreachable" in os.pread(w.log.fileno(), 1 << 20, 0) for w in workers), 240)
    assert not os.path.exists(tmp_path / "runs")  # a worker makes its folder once its trainer answers
    trainer = spawn(*CARTPOLE16, "--role", "trainer", "--port", str(port), "--steps", "40", "--out", str(tmp_path / "t"))
    said = finish(trainer, 300, workers)  # limits on silence (output): a loaded machine makes each step slower
    try:
        outs = [finish(w, timeout=300) for w in workers]
    except AssertionError as e:  # a worker that missed the trainer: show both sides
        raise AssertionError(f"{e}\nthe trainer's output:\n{said[-3000:]}") from None
    assert all("training finished" in o for o in outs)  # none crashed, each exited by itself
    said = [re.search(r"worker (\w+): training finished after (\d+) batches; the trainer trained on (\d+)", o) for o in outs]
    pushed = {m[1]: int(m[2]) for m in said}
    assert sum(int(m[3]) for m in said) == 40  # each of the 40 steps trained one worker's batch: each knows its own
    folders = os.listdir(tmp_path / "runs")
    assert len(folders) == 8 and sorted(f.rsplit("-worker-", 1)[1] for f in folders) == sorted(pushed)  # ...-worker-ID
    for f in folders:  # a worker logs a row per batch it sent, with the answer (a full queue answers 503)
        files = set(os.listdir(tmp_path / "runs" / f))
        sent = rows(tmp_path / "runs" / f) if "metrics.csv" in files else []  # on a loaded machine one may send none
        assert "config.yaml" in files and sum(r["status"] == "200" for r in sent) == pushed[f.rsplit("-worker-", 1)[1]]
        assert not [x for x in files if x.endswith(".tmp")]
    assert len(rows(tmp_path / "t")) == 40


def test_a_worker_that_never_reaches_its_trainer_leaves_no_folder(tmp_path):
    worker = spawn(*CARTPOLE, "--role", "rollout", "--trainer-url", f"http://127.0.0.1:{free_port()}",
                   "--connect-timeout", "1", cwd=tmp_path)
    assert "unreachable for 1.0 s" in output(worker).splitlines()[-1] and worker.returncode == 1
    assert os.listdir(tmp_path) == []  # no runs/...-worker-ID left behind


def test_two_runs_started_in_the_same_second_get_folders_of_their_own(tmp_path):
    from utils import fresh_dir
    assert [fresh_dir(str(tmp_path / "run")) for _ in range(3)] == [str(tmp_path / f"run{s}") for s in ("", "-2", "-3")]
    runs = [spawn("--task", "cartpole", "--steps", "3", "--no-stop-when-solved", "--eval-every", "0", cwd=tmp_path / "run")
            for _ in range(2)]  # default flags, one folder, started together
    for r in runs:
        finish(r)
    folders = sorted(os.listdir(tmp_path / "run" / "runs"))
    assert len(folders) == 2
    for f in folders:
        assert [r["step"] for r in rows(tmp_path / "run" / "runs" / f)] == ["0", "1", "2"]


def test_a_worker_without_a_trainer_says_so_then_gives_up(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    worker = spawn(*CARTPOLE, "--role", "rollout", "--trainer-url", url, "--connect-timeout", "3", "--out", str(tmp_path))
    out = output(worker)
    assert worker.returncode == 1
    said = [line for line in out.splitlines() if url in line]
    assert len(said) == 2 and "retrying for up to 3 s (--connect-timeout)" in said[0]  # once, as it starts retrying
    assert said[1].startswith(f"trainer at {url} unreachable for 3.0 s") and said[1].endswith("giving up")


def test_worker_killed_mid_run_costs_only_its_batch(tmp_path):
    port = free_port()
    trainer = spawn(*CARTPOLE, "--role", "trainer", "--port", str(port), "--steps", "10", "--out", str(tmp_path / "t"))
    url = ["--role", "rollout", "--trainer-url", f"http://127.0.0.1:{port}"]
    doomed, survivor = (spawn(*CARTPOLE, *url, "--out", str(tmp_path / n)) for n in ("a", "b"))
    wait_for(lambda: health(port)["version"] >= 2)
    doomed.send_signal(signal.SIGKILL)
    doomed.wait()
    finish(trainer, partners=[survivor])
    assert "training finished" in finish(survivor)
    assert len(rows(tmp_path / "t")) == 10


def test_trainer_killed_and_resumed_workers_rejoin(tmp_path):
    port, run = free_port(), str(tmp_path / "t")
    trainer = spawn(*CARTPOLE, "--role", "trainer", "--port", str(port), "--steps", "30", "--out", run)  # default saves
    worker = spawn(*CARTPOLE, "--role", "rollout", "--trainer-url", f"http://127.0.0.1:{port}", "--out", str(tmp_path / "w"))
    wait_for(lambda: health(port)["version"] >= 12)  # past the first default checkpoint (10), well before the end
    trainer.send_signal(signal.SIGKILL)
    trainer.wait()
    time.sleep(1.0)  # the worker is now retrying against a dead port
    resumed = spawn("--resume", run, "--port", str(port))
    finish(resumed)
    assert "training finished" in finish(worker)
    steps = [int(r["step"]) for r in rows(run)]
    assert steps[-1] == 29 and load_ckpt_meta(run)["step"] == 30 and steps == sorted(set(steps))  # no repeated rows


def load_ckpt_meta(run):
    from safetensors import safe_open
    with safe_open(os.path.join(run, "checkpoint.safetensors"), "pt") as f:
        return json.loads(f.metadata()["flatrl"])


def test_worker_with_a_different_config_exits_naming_the_field(tmp_path):
    port = free_port()
    trainer = spawn(*CARTPOLE, "--role", "trainer", "--port", str(port), "--steps", "100000", "--out", str(tmp_path / "t"))
    wait_for(lambda: health(port))
    bad = spawn(*CARTPOLE, "--role", "rollout", "--trainer-url", f"http://127.0.0.1:{port}", "--batch-size", "8",
                "--out", str(tmp_path / "w"))
    out = output(bad, 60)
    assert bad.returncode != 0 and "config mismatch on 'batch_size'" in out
    good = spawn(*CARTPOLE, "--role", "rollout", "--trainer-url", f"http://127.0.0.1:{port}", "--out", str(tmp_path / "g"))
    wait_for(lambda: health(port)["accepted"] >= 1)
    good.send_signal(signal.SIGINT)  # Ctrl-C on a worker: a clean exit
    out = output(good, 60)
    assert good.returncode == 130 and "stopped" in out and "Traceback" not in out  # as a shell reports Ctrl-C
    trainer.send_signal(signal.SIGINT)  # Ctrl-C: a clean stop with a final checkpoint
    out = output(trainer, 60)
    assert trainer.returncode == 130 and "interrupted after" in out  # checkpoint saved, then 130
    assert load_ckpt_meta(tmp_path / "t")["step"] == int(out.split("interrupted after ")[1].split()[0])


def test_cpu_shares_split_one_machine_between_a_trainer_and_its_workers():
    sixteen = list(range(16))
    halves = {"trainer": sixteen[:8], "rollout": sixteen[8:]}
    assert cpu_shares(Config(role="trainer"), sixteen) == halves  # the default --bind: loopback, its workers beside it
    for url in ("http://127.0.0.1:8000", "http://localhost:8000", "http://[::1]:8000"):
        assert cpu_shares(Config(role="rollout", trainer_url=url), sixteen) == halves
    assert cpu_shares(Config(role="trainer"), [0, 1, 2]) == {"trainer": [0], "rollout": [1, 2]}
    assert cpu_shares(Config(role="trainer"), [5]) == {"trainer": [5], "rollout": [5]}  # one core: both on it
    alone = [Config(), Config(role="trainer", bind="0.0.0.0"), Config(role="trainer", device="cuda"),
             Config(role="rollout", trainer_url="http://10.0.0.1:8000")]
    for cfg in alone:  # sync, or workers that may be elsewhere, or a trainer on a GPU: the whole machine
        assert cpu_shares(cfg, sixteen) == {cfg.role: sixteen}


def test_a_trainer_and_a_worker_on_one_machine_compute_on_disjoint_cores_by_default(tmp_path):
    port = free_port()
    trainer = spawn(*CARTPOLE, "--role", "trainer", "--port", str(port), "--steps", "100000", "--out", str(tmp_path / "t"))
    worker = spawn(*CARTPOLE, "--role", "rollout", "--trainer-url", f"http://127.0.0.1:{port}", "--out", str(tmp_path / "w"))
    shares = cpu_shares(Config(role="trainer"), sorted(os.sched_getaffinity(0)))
    try:
        wait_for(lambda: health(port)["version"] >= 3)  # both running, and every thread each will use started
        for proc, role in ((trainer, "trainer"), (worker, "rollout")):
            threads = os.listdir(f"/proc/{proc.pid}/task")  # main, torch's pool, HTTP: all on the role's cores
            assert {t: os.sched_getaffinity(int(t)) for t in threads} == {t: set(shares[role]) for t in threads}
    finally:  # a failed check leaves no run behind
        for proc in (worker, trainer):
            proc.send_signal(signal.SIGINT)
    (t, w) = (output(p, 60).splitlines()[0] for p in (trainer, worker))
    assert t == (f"threads: {len(shares['trainer'])} on cores {shares['trainer']} for this trainer, cores "
                 f"{shares['rollout']} for its rollout workers (one machine, shared; --threads N to choose)")
    assert w.startswith(f"threads: {len(shares['rollout'])} on cores {shares['rollout']} for this rollout worker,")


# --- in-process: one AsyncSource, requests by hand -------------------------------------------------------

@pytest.fixture
def source(tmp_path, request):
    cfg = Config(role="trainer", port=0, batch_size=4, group_size=2, max_staleness=1, out=str(tmp_path),
                 **getattr(request, "param", {}))
    torch.manual_seed(0)
    task = GymTask(Config(**{**cfg.__dict__, "role": "rollout"}))  # records sampler logprobs, as a worker does
    policy = MLPPolicy(task.obs_dim, task.n_actions, 16)
    src = AsyncSource(task, policy, cfg, Logger(str(tmp_path), 0, 1), version=0)
    src.task, src.port = task, src.server.server_port
    yield src
    src.hub.done = True
    src.server.shutdown()
    src.server.server_close()


def post(port, body, headers=None, length=None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.putrequest("POST", "/rollouts")
    conn.putheader("Content-Length", str(len(body)) if length is None else length)
    for k, v in (headers or {}).items():
        conn.putheader(k, v)
    conn.endheaders()
    try:
        conn.send(body)
        if length is not None and length.isdigit() and int(length) > len(body):
            with contextlib.suppress(OSError):  # the server may have answered (413) and closed already
                conn.sock.shutdown(socket.SHUT_WR)  # a truncated body: the client stops sending
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def get(port, path, token=None, headers=None):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}",
                                 headers={**({"Authorization": f"Bearer {token}"} if token else {}), **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read(), r.headers
    except urllib.error.HTTPError as e:
        return e.code, e.read(), e.headers


def valid_batch(src, version=0):
    batch = src.task.rollout(src.policy, step=version)
    batch.version = version
    return batch


def test_stale_and_missing_snapshot_batches_are_dropped(source):
    for v in (1, 2, 3):
        source.publish(v)
    assert sorted(source.snapshots) == [2, 3]  # max_staleness + 1 versions kept
    for v in (1, 3):
        assert post(source.port, pack_batch(valid_batch(source, v), "w"))[0] == 200
    batch = source.next_batch(step=3)
    assert batch.version == 3 and source.hub.counts["dropped_stale"] == 1
    stats = source.stats()
    assert stats["dropped_stale"] == 1 and stats["staleness"] == 0 and stats["queue"] == 0


def test_old_logp_is_recomputed_under_the_sampling_weights(source):
    sampled_by = {k: v.clone() for k, v in source.policy.params().items()}
    batch = valid_batch(source, 0)
    with torch.no_grad():
        for p in source.policy.parameters():
            p.add_(0.1 * torch.randn_like(p))
    source.publish(1)
    now = {k: v.clone() for k, v in source.policy.params().items()}
    cfg = Config(batch_size=4, group_size=2)
    with source.weights(batch):
        train.score_old(source.policy, batch, cfg, "scored")
    fresh = MLPPolicy(source.task.obs_dim, source.task.n_actions, 16)
    fresh.load_state_dict(sampled_by)
    with torch.no_grad():
        assert torch.equal(batch.old_logp, fresh.score(batch)["logp"])
    assert torch.allclose(batch.old_logp * batch.mask, batch.sampler_logp, atol=1e-6)  # the sampler agrees
    assert all(torch.equal(now[k], v) for k, v in source.policy.params().items())  # and the weights are back


def test_weights_endpoint(source):
    status, body, headers = get(source.port, "/weights?have=-1")
    assert status == 200 and headers["X-Flatrl-Version"] == "0"
    import hashlib
    assert hashlib.sha256(body).hexdigest() == headers["X-Flatrl-Sha256"]
    wire = st_load(body)
    assert wire.keys() == source.policy.params().keys() and all(v.dtype == torch.float32 for v in wire.values())  # auto: fp32 for control
    assert get(source.port, "/weights?have=0")[0] == 304
    t = time.time()
    assert get(source.port, "/weights?have=0&wait=1")[0] == 304 and time.time() - t >= 0.9  # long poll, bounded
    assert get(source.port, "/weights?have=zero")[0] == 400
    assert get(source.port, "/nope")[0] == 404


def test_a_worker_is_told_training_ended_only_once_the_answer_reached_it(source):
    gone = socket.create_connection(("127.0.0.1", source.port))  # a long poll whose worker vanishes before the end
    gone.sendall(b"GET /weights?have=0&wait=30 HTTP/1.1\r\nHost: x\r\nX-Flatrl-Worker: gone\r\n\r\n")
    wait_for(lambda: "gone" in source.hub.seen, 10)
    gone.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    gone.close()  # a reset: the trainer's 410 cannot be delivered
    time.sleep(0.5)
    with source.hub.cond:
        source.hub.done = True
        source.hub.cond.notify_all()
    time.sleep(1.0)
    assert "gone" not in source.hub.told  # still waited for in close(): it has not heard
    status, _, _ = get(source.port, "/weights?have=0", headers={"X-Flatrl-Worker": "back"})
    assert status == 410
    wait_for(lambda: source.hub.told == {"back"}, 10)  # (marked by the handler just after its answer went out)


def test_one_serialization_per_publish(source, monkeypatch):
    import serve
    calls = []
    monkeypatch.setattr(serve, "st_save", lambda *a, **k: calls.append(1) or b"weights-v7")
    source.publish(7)
    bodies = [get(source.port, "/weights?have=0")[1] for _ in range(3)]  # three workers
    assert len(calls) == 1 and bodies == [b"weights-v7"] * 3


def test_auth(tmp_path, monkeypatch):
    monkeypatch.setenv("FLATRL_TOKEN", "s3cret")
    cfg = Config(role="trainer", port=0, batch_size=4)
    task = GymTask(cfg)
    src = AsyncSource(task, MLPPolicy(4, 2, 8), cfg, Logger(str(tmp_path), 0, 1), version=0)
    port = src.server.server_port
    try:
        assert get(port, "/healthz")[0] == 200  # no auth on health
        assert get(port, "/config")[0] == 401 and get(port, "/config", token="wrong")[0] == 401
        assert get(port, "/weights", token="s3cret")[0] == 200
        assert post(port, b"x")[0] == 401
        assert json.loads(get(port, "/config", token="s3cret")[1])["fingerprint"]["task"] == "cartpole"
    finally:
        src.server.shutdown()
        src.server.server_close()
    monkeypatch.delenv("FLATRL_TOKEN")
    with pytest.raises(SystemExit, match="FLATRL_TOKEN"):
        AsyncSource(task, MLPPolicy(4, 2, 8), Config(role="trainer", bind="0.0.0.0", port=0), None, version=0)


def test_fuzz_malformed_requests_are_all_rejected(source):
    rng = random.Random(0)
    good = pack_batch(valid_batch(source, 0), "w")
    header_end = 8 + int.from_bytes(good[:8], "little")

    def mutate(fn):
        b = valid_batch(source, 0)
        fn(b)
        return pack_batch(b, "w")

    def corrupt_header():
        i = rng.randrange(8, header_end)
        return good[:i] + bytes([rng.randrange(0, 32)]) + good[i + 1:]  # a control byte: invalid JSON

    bad = [
        lambda: rng.randbytes(rng.randrange(0, 2000)),
        lambda: good[:rng.randrange(0, len(good))],  # truncated file
        corrupt_header,
        lambda: rng.randbytes(8) + good[8:],  # wrong header length
        lambda: mutate(lambda b: b.rewards.__setitem__((0, 0), float("nan"))),
        lambda: mutate(lambda b: b.rewards.__setitem__((1, 0), float("inf"))),
        lambda: mutate(lambda b: setattr(b, "group", torch.tensor([0, 0, 0, 1]))),  # groups of 3 and 1
        lambda: mutate(lambda b: setattr(b, "actions", b.actions + 7)),  # actions out of range
        lambda: mutate(lambda b: setattr(b, "mask", b.mask * 0.5)),
        lambda: mutate(lambda b: setattr(b, "obs", b.obs.double())),  # wrong dtype
        lambda: mutate(lambda b: setattr(b, "obs", b.obs[..., :3].contiguous())),  # wrong observation size
        lambda: mutate(lambda b: setattr(b, "rewards", b.rewards[:3])),  # wrong shape
        lambda: mutate(lambda b: setattr(b, "sampler_logp", None)),  # a tensor missing
        lambda: mutate(lambda b: setattr(b, "values", b.mask.clone())),  # an unknown tensor
        lambda: mutate(lambda b: setattr(b, "version", 5)),  # from the future
    ]
    n, statuses = 0, []
    for i in range(210):
        body = bad[i % len(bad)]()
        statuses.append(post(source.port, body)[0])
        n += 1
    for length in ("-5", "abc", "", "99999999999999"):  # bad or huge Content-Length
        statuses.append(post(source.port, b"xyz", length=length)[0])
        n += 1
    statuses.append(post(source.port, good[:100], length=str(len(good)))[0])  # the body stops short
    n += 1
    assert all(400 <= s < 500 for s in statuses), sorted(set(statuses))
    assert 413 in statuses and 411 in statuses
    h = health(source.port)
    assert h["queued"] == 0 and h["accepted"] == 0 and h["rejected"] == n
    assert post(source.port, good)[0] == 200 and health(source.port)["queued"] == 1  # still serving


# --- a tiny LLM, LoRA and full fine-tuning --------------------------------------------------------------

@pytest.mark.parametrize("lora_r", ["4", "0"])
def test_llm_trainer_and_worker(tiny_llm, tmp_path, lora_r):
    common = ["--task", "arith", "--model", tiny_llm, "--algo", "grpo", "--batch-size", "8", "--group-size", "2",
              "--max-new-tokens", "8", "--n-eval", "4", "--lora-r", lora_r, "--lr", "0.01", "--eval-every", "0",
              "--tis-clip", "2.0", "--ent-coef", "0.001", "--connect-timeout", "60"]  # ent-coef: every row scored
    trained, _ = trainer_and_worker(tmp_path, common, 3)
    assert len(trained) == 3
    for r in trained:  # bf16 sampler vs the fp32 / autocast trainer: close, not equal
        assert 0 <= float(r["logp_gap"]) < 0.5 and 0 < float(r["tis_weight"]) <= 2.0
        assert r["accuracy"] != "" and float(r["gen_tok_s"]) > 0  # the worker's stats travel with the batch


def test_llm_worker_runs_multi_turn_episodes(tiny_llm, tmp_path):
    common = ["--task", "arith", "--model", tiny_llm, "--algo", "rloo", "--batch-size", "8", "--group-size", "2",
              "--max-new-tokens", "24", "--max-turns", "3", "--n-eval", "4", "--lora-r", "4", "--lr", "0.01",
              "--eval-every", "0", "--gen-dtype", "float32", "--no-bf16", "--ent-coef", "0.001",
              "--connect-timeout", "60"]  # fp32 on both sides; ent-coef: every row is scored (logp_gap on all rows)
    trained, _ = trainer_and_worker(tmp_path, common, 3)
    assert len(trained) == 3 and max(float(r["turns"]) for r in trained) > 1  # arith answers wrong replies
    assert all(float(r["logp_gap"]) < 1e-4 for r in trained)  # fp32 sampler: what it saw is what the trainer scores


def test_a_worker_refuses_weights_whose_names_drifted(tmp_path, monkeypatch):
    """A worker loads the trainer's weights with strict=False; a renamed key would have left its policy as it was."""
    import hashlib
    import serve
    from safetensors.torch import save as st_save
    cfg = Config(role="rollout", trainer_url="http://127.0.0.1:1", out=str(tmp_path)).validate()
    task = GymTask(cfg)
    policy = MLPPolicy(task.obs_dim, task.n_actions, cfg.hidden)
    sent = {k.replace("actor.0", "actor.first"): v.detach() for k, v in policy.params().items()}
    blob = st_save(sent)
    answers = {"/config": (200, {}, json.dumps({"fingerprint": {k: getattr(cfg, k) for k in serve.FINGERPRINT},
                                                 "steps": 3}).encode()),
               "/weights": (200, {"X-Flatrl-Sha256": hashlib.sha256(blob).hexdigest(), "X-Flatrl-Version": "1"}, blob)}
    monkeypatch.setattr(serve, "call", lambda cfg, path, body=None: answers[path.split("?")[0]])
    with pytest.raises(SystemExit, match=r"2 missing \(first: actor\.0\.bias\), 2 unexpected \(first: "
                                         r"actor\.first\.bias\)"):  # (sorted)
        serve.run_worker(cfg, task, policy, serve.hello(cfg))


def test_the_end_waits_for_a_worker_as_long_as_its_longest_gap_between_requests(monkeypatch):
    import serve
    clock = [100.0]
    monkeypatch.setattr(serve.time, "time", lambda: clock[0])
    hub = serve.Hub(0)
    for gap in (0, 5, 40, 3):  # a worker on a busy machine: one batch took 40 s
        clock[0] += gap
        hub.heard("w")
    assert hub.gap == {"w": 40} and hub.seen == {"w": 148.0}  # close() waits up to 80 s for it, not 30


def test_a_trainer_whose_task_runs_model_text_asks_a_token_on_loopback(tmp_path, monkeypatch):
    import utils
    from serve import trainers_own_token
    from tasks import run_python
    monkeypatch.delenv("FLATRL_TOKEN", raising=False)
    monkeypatch.setattr(utils, "LOCAL_TOKENS", str(tmp_path / "tokens"))
    cfg = Config(role="trainer", port=0, batch_size=4, group_size=2, out=str(tmp_path))
    task = GymTask(Config(**{**cfg.__dict__, "role": "rollout"}))
    task.runs_model_text = True  # as an agent task, a reasoning-gym task or a tool task that runs code declare
    src = AsyncSource(task, MLPPolicy(4, 2, 8), cfg, Logger(str(tmp_path), 0, 1), version=0)
    try:
        port, url = src.server.server_port, f"http://127.0.0.1:{src.server.server_port}"
        assert post(port, b"made-up batch")[0] == 401  # a local process without the token
        token = trainers_own_token(url)
        assert token and oct(os.stat(tmp_path / "tokens" / str(port)).st_mode & 0o777) == "0o600"
        assert post(port, b"made-up batch", {"Authorization": f"Bearer {token}"})[0] == 400  # heard: a bad body
        steal = f"print(open({str(tmp_path / 'tokens' / str(port))!r}).read())"
        assert run_python(steal).startswith("error: exit code 1") and token not in run_python(steal)
        import threading

        import serve
        utils.local_token(port, "an-older-trainers")  # read before this trainer wrote its own: 401, then read again
        threading.Timer(1.0, utils.local_token, (port, token)).start()
        assert serve.call(Config(role="rollout", trainer_url=url, connect_timeout=30), "/config")[0] == 200
    finally:
        src.close()
    assert not (tmp_path / "tokens" / str(port)).exists()  # the run's token ends with it
    task.runs_model_text = False  # a task that runs none: loopback stays open, as before
    src = AsyncSource(task, MLPPolicy(4, 2, 8), cfg, Logger(str(tmp_path), 0, 1), version=0)
    assert post(src.server.server_port, b"made-up batch")[0] == 400
    src.hub.done = True
    src.server.shutdown()
    src.server.server_close()


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/usr/bin/python3"),
                    reason="drops to the unprivileged user nobody: needs root, and a Python nobody may run")
def test_a_non_dumpable_process_hides_its_token_from_the_users_other_processes():
    # As nobody (the project's Python, under /root, is closed to it: the system's runs utils.non_dumpable's own code).
    import inspect

    import utils
    holder = ("import contextlib, ctypes, sys\n" + inspect.getsource(utils.non_dumpable) +
              "if sys.argv[1] == '1':\n    non_dumpable()\nprint('ready', flush=True)\nsys.stdin.read()\n")
    reader = "import sys\ntry:\n    print(open(f'/proc/{sys.argv[1]}/environ').read())\nexcept OSError as e:\n    print(e)"

    def as_nobody():
        os.setgid(65534)
        os.setuid(65534)
    seen = {}
    for hidden in ("0", "1"):
        p = subprocess.Popen(["/usr/bin/python3", "-c", holder, hidden], env={"FLATRL_TOKEN": "s3cret"}, cwd="/",
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, preexec_fn=as_nobody)
        assert p.stdout.readline() == "ready\n"
        seen[hidden] = subprocess.run(["/usr/bin/python3", "-c", reader, str(p.pid)], capture_output=True, text=True,
                                      cwd="/", env={}, preexec_fn=as_nobody).stdout
        p.communicate("")
    assert "s3cret" in seen["0"] and "s3cret" not in seen["1"] and "Permission denied" in seen["1"]


def test_a_run_whose_task_runs_model_text_is_non_dumpable_from_its_start(tiny_llm, monkeypatch):
    import ctypes
    import train
    libc = ctypes.CDLL(None)
    libc.prctl(4, 1)  # PR_SET_DUMPABLE: as a process starts (an earlier test's run_python made this one not)
    assert libc.prctl(3) == 1  # PR_GET_DUMPABLE
    with pytest.raises(SystemExit):  # the shortest run: score fixed prompts and exit
        train.main(["--task", "rg:basic_arithmetic", "--model", tiny_llm, "--check-parity", "--n-eval", "4",
                    "--batch-size", "8", "--group-size", "2", "--lora-r", "4"])
    try:
        assert libc.prctl(3) == 0
    finally:
        libc.prctl(4, 1)  # dumpable again, for the tests after this one


def test_the_token_file_is_read_once_and_a_bad_one_is_one_line(tmp_path, monkeypatch):
    from utils import bearer_token, file_token
    monkeypatch.setenv("FLATRL_TOKEN", "from-the-environment")
    (tmp_path / "token").write_text("from-the-file\n")
    assert bearer_token(Config(token_file=str(tmp_path / "token"))) == "from-the-file"
    (tmp_path / "token").write_text("changed")
    assert bearer_token(Config(token_file=str(tmp_path / "token"))) == "from-the-file"  # read once
    assert bearer_token(Config()) == "from-the-environment"
    file_token.cache_clear()
    with pytest.raises(SystemExit, match=r"--token-file .*missing: No such file"):
        bearer_token(Config(token_file=str(tmp_path / "missing")))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(SystemExit, match="is empty: write the token in it"):
        bearer_token(Config(token_file=str(tmp_path / "empty")))
