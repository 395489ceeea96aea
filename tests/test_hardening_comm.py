"""Hardening of the run's communication and supervision (issue 29): records bound to one run,
no descriptors before authentication, accept errors survived, the worker that failed by itself
named (not the peers that saw it go), bounded secrets, a located error for a device this machine
lacks or a full log disk, SIGTERM (one host and torchrun), streams predicted to deadlock, and
strict JSON logs.

The attackers run as another uid (nobody) in a child forked from this process, which needs root;
elsewhere those tests skip and say so. Everything runs on loopback."""
from __future__ import annotations

import encodings.idna  # noqa: F401 - the attacker (another uid) cannot import it after the fork
import errno
import json
import math
import os
import pickle
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
from torch.distributed import TCPStore

from conftest import ROOT, TINY_2STAGE_PLAN, pid_alive, run_cli
from executor import dicomm
from executor.dicomm.errors import CommError
from executor.dicomm.frame import PREFIX

TINY = ["--global-batch", "4", "--micro-batch", "2", "--seq-len", "32", "--arg", "n_layers=2",
        "--arg", "max_seq=64", "--arg", "vocab=256", "--arg", "dim=64", "--arg", "n_heads=4",
        "--arg", "ffn=128"]
OTHER_DATA = ["--data", "examples/llama_tiny.py", "--data-format", "bytes"]
NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="the attacker runs as another uid "
                             "(nobody), which only root can switch to")


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """A 2-stage torch build of a ~100 k-parameter llama on one host."""
    d = tmp_path_factory.mktemp("comm")
    (d / "p.h2plan").write_text(TINY_2STAGE_PLAN)
    r = run_cli("h2c", "compile", "examples/llama_tiny.py", *TINY, "--plan", str(d / "p.h2plan"),
                "-o", str(d / "b"))
    assert r.returncode == 0, r.stderr
    return d / "b"


def _losses(log: Path) -> dict[int, float]:
    def bad(c):
        raise AssertionError(f"not valid JSON: {c}")
    out = {}
    for line in log.read_text().splitlines():
        rec = json.loads(line, parse_constant=bad)
        if "loss" in rec:
            out[rec["step"]] = rec["loss"]
    return out


def _clean_error(r, rc=2):
    assert r.returncode == rc, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and "internal error" not in r.stderr, r.stderr


# -- an attacker of another uid -------------------------------------------------------------------

class Stranger:
    """fn(*args) in a child forked from this process that first becomes uid/gid nobody (unless
    `nobody` is False) and may map at most `memory` more bytes; its return value comes back
    pickled. Modules it needs are imported here, before the fork."""

    def __init__(self, fn, *args, nobody: bool = True, memory: int | None = None):
        r, w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:           # the child: never returns into pytest
            code = 0
            try:
                os.close(r)
                if memory is not None:
                    import resource
                    mapped = int(next(line.split()[1] for line in open("/proc/self/status")
                                      if line.startswith("VmSize:"))) * 1024
                    resource.setrlimit(resource.RLIMIT_AS, (mapped + memory, mapped + memory))
                if nobody:
                    os.setgroups([])
                    os.setgid(NOBODY)
                    os.setuid(NOBODY)
                data = pickle.dumps(fn(*args))
            except BaseException as e:          # noqa: BLE001 - reported to the parent
                data, code = pickle.dumps(RuntimeError(f"{type(e).__name__}: {e}")), 1
            with os.fdopen(w, "wb") as f:
                f.write(data)
            os._exit(code)
        os.close(w)
        self._r = r

    def result(self, timeout: float = 60.0):
        deadline = time.monotonic() + timeout
        chunks = []
        os.set_blocking(self._r, False)
        while True:
            try:
                chunk = os.read(self._r, 1 << 16)
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.kill(self.pid, signal.SIGKILL)
                    os.waitpid(self.pid, 0)
                    raise TimeoutError("the attacker did not finish") from None
                time.sleep(0.01)
                continue
            if not chunk:
                break
            chunks.append(chunk)
        os.close(self._r)
        os.waitpid(self.pid, 0)
        out = pickle.loads(b"".join(chunks))
        if isinstance(out, RuntimeError):
            raise out
        return out


def _descendants(pid: int) -> list[int]:
    parents = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                parents[int(p.name)] = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    family, grew = {pid}, True
    while grew:
        new = {c for c, parent in parents.items() if parent in family} - family
        family |= new
        grew = bool(new)
    return sorted(family - {pid})


def _cmdline(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _environ(pid: int) -> dict:
    try:
        raw = (Path("/proc") / str(pid) / "environ").read_bytes()
    except OSError:
        return {}
    return dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)


def _fd_count(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


# ================================================================================================
# Records of one run: a replay of an earlier run's records (plan, events, agreement, endpoints)
# into the store of a later run of the same build, under the same secret file
# ================================================================================================

def _workers_store(launcher: subprocess.Popen, timeout: float) -> tuple[int, str]:
    """(port, namespace) of the store the workers of a `--nnodes` run share: what an attacker
    reads from torchrun's own (unauthenticated) store; here from global rank 0's environment."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and launcher.poll() is None:
        for pid in _descendants(launcher.pid):
            if "executor.run" in _cmdline(pid):
                env = _environ(pid)
                if env.get("RANK") == "0" and env.get("MASTER_PORT"):
                    return int(env["MASTER_PORT"]), f"h2x/{env['TORCHELASTIC_RUN_ID']}"
        time.sleep(0.01)
    raise AssertionError("the run's worker store never appeared")


def _store_client(port: int, timeout: float) -> TCPStore:
    """A client of the store on `port` once it listens (torch's own retry does not survive the
    fork)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)
    return TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10),
                    wait_for_workers=False)


RECORD_KEYS = ["agree/challenge", "agree/0", "agree/1", "agree/run", "plan", "hb/0", "hb/1",
               "finished", "dicomm/rank/0", "dicomm/rank/1"]


def _capture(port: int, ns: str, workers: int, seconds: float) -> dict:
    """Every record of a run an attacker can read while it runs (the store goes with the run)."""
    store = _store_client(port, 30)
    got: dict = {}
    nxt = [0] * workers
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            for k in RECORD_KEYS:
                if k not in got and store.check([f"{ns}/{k}"]):
                    got[k] = store.get(f"{ns}/{k}")
            for w in range(workers):
                while store.check([f"{ns}/ev/{w}/{nxt[w]}"]):
                    got[f"ev/{w}/{nxt[w]}"] = store.get(f"{ns}/ev/{w}/{nxt[w]}")
                    nxt[w] += 1
            time.sleep(0.005)
    except Exception:   # noqa: BLE001 - the run ended and its store with it
        pass
    return got


def _replay(port: int, ns: str, records: dict, seconds: float) -> list:
    """Put every captured record into the new run's store wherever the run has not written its
    own yet, for as long as the run lasts; the keys whose replay was in the store."""
    store = _store_client(port, 30)
    landed = set()
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            for k, v in records.items():
                if store.compare_set(f"{ns}/{k}", b"", v) == v:
                    landed.add(k)
            time.sleep(0.002)
    except Exception:   # noqa: BLE001 - the run ended and its store with it
        pass
    return sorted(landed)


def _multihost(b: Path, secret: Path, log: Path, steps: int, attack, *extra):
    """`h2x run --nnodes 1` (torchrun, the coordinator, store records) with `attack(port, ns)`
    started as soon as the workers' store is known; (output, the attack's result)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "H2_SECRET"}
    p = subprocess.Popen([sys.executable, "-m", "executor.cli", "run", str(b), "--nnodes", "1",
                          "--node-rank", "0", "--master", f"127.0.0.1:{port}", "--secret-file",
                          str(secret), "--steps", str(steps), "--json-log", str(log), *extra],
                         cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
    try:
        store_port, ns = _workers_store(p, 60)
        attacker = attack(store_port, ns)
        out = p.communicate(timeout=120)[0]
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, out
    return out, attacker.result(60)


@as_root
def test_records_of_an_earlier_run_are_refused_and_the_run_trains_right(build, tmp_path):
    """Run A (other data) is recorded by an attacker of another uid; run B of the same build with
    the same secret file gets every record of A (its plan, events, heartbeats, agreement and
    endpoint records) put into its store wherever it has not written its own yet. B names and
    skips them, and its losses equal a clean run's (on B's data)."""
    secret = tmp_path / "secret"
    secret.write_text(secrets.token_hex(32) + "\n")
    steps = 6
    _, recorded = _multihost(build, secret, tmp_path / "a.jsonl", steps,
                             lambda port, ns: Stranger(_capture, port, ns, 2, 60.0), *OTHER_DATA)
    assert "plan" in recorded and "ev/0/0" in recorded, sorted(recorded)
    out, landed = _multihost(build, secret, tmp_path / "b.jsonl", steps,
                             lambda port, ns: Stranger(_replay, port, ns, recorded, 60.0))
    assert "plan" in landed and any(k.startswith("ev/") for k in landed), landed
    r = run_cli("h2x", "run", str(build), "--steps", str(steps), "--json-log",
                str(tmp_path / "clean.jsonl"))
    assert r.returncode == 0, r.stderr
    got, clean, earlier = (_losses(tmp_path / f"{n}.jsonl") for n in ("b", "clean", "a"))
    assert sorted(got) == list(range(1, steps + 1)), got
    assert any(abs(earlier[s] - clean[s]) > 1e-3 for s in clean)   # the replay would show
    for s in clean:
        assert abs(got[s] - clean[s]) <= 1e-6 * abs(clean[s]), (s, got, clean, earlier)
    assert "belongs to another run" in out and "/plan'" in out, out
    assert "Traceback" not in out


def test_a_record_of_another_run_is_named_and_skipped():
    """The store record layer on its own: a record of run A read by run B is skipped with a
    note naming both runs, B's own record is taken once it replaces it, and a lookup that only
    ever sees A's record fails naming it."""
    from executor.dicomm.rendezvous import Rendezvous
    store = dicomm.host_store()
    key = b"k" * 32
    ns = f"replay-{secrets.token_hex(4)}"
    a = Rendezvous("", 0, 1.0, ns, store, secret=key, run=b"A" * 16)
    notes: list[str] = []
    b = Rendezvous("", 0, 1.0, ns, store, secret=key, run=b"B" * 16, on_foreign=notes.append)
    a.publish("plan", {"data": "A"})
    with pytest.raises(CommError, match=r"'replay-\w+/plan' belongs to another run \(run "
                                        r"4141.*this run is run 4242.*did not replace it"):
        b.lookup("plan", "the plan", timeout=0.3)
    assert b.try_lookup("plan", "the plan") is None
    assert len(notes) == 1 and "belongs to another run" in notes[0], notes
    threading.Timer(0.2, b.publish, ("plan", {"data": "B"})).start()
    assert b.lookup("plan", "the plan", timeout=5) == {"data": "B"}
    # a record without any run (written before a run was agreed) is another run's too
    Rendezvous("", 0, 1.0, ns, store, secret=key).publish("ev/0/0", {"loss": 1.0})
    assert b.try_lookup("ev/0/0", "an event") is None
    assert "no run" in notes[-1]


# ================================================================================================
# Descriptors before authentication: a flood on a worker's unix socket, and accept() failures
# ================================================================================================

def _flood(pids: list[int], seconds: float) -> dict:
    """Until `pids` have exited (or `seconds`): connect to every DiComm unix socket of theirs
    (listed in /proc/net/unix, which any user can read) and pass descriptors with every byte of
    a handshake that never ends."""
    import array
    fd = os.open("/dev/null", os.O_RDONLY)
    stats = {"connections": 0, "fds_sent": 0, "sockets": 0}
    lock = threading.Lock()
    end = time.monotonic() + seconds

    def running() -> bool:
        return time.monotonic() < end and any(os.path.exists(f"/proc/{p}") for p in pids)
    message = PREFIX.pack(b"h2", 2, b"C", 4096) + b"\x80" * 4096

    def names() -> set[str]:
        found = set()
        with open("/proc/net/unix") as f:
            for line in f:
                p = line.split()
                if len(p) >= 8 and p[7].startswith("@h2-dicomm-") \
                        and int(p[7].split("-")[2]) in pids:
                    found.add(p[7][1:])
        return found

    def one(name: str) -> None:
        fds = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd] * 4))]
        while running():
            s = socket.socket(socket.AF_UNIX)
            try:
                s.connect("\0" + name)
                with lock:
                    stats["connections"] += 1
                for i in range(len(message)):
                    s.sendmsg([message[i:i + 1]], fds)
                    with lock:
                        stats["fds_sent"] += 4
                    if i % 64 == 0 and not running():
                        break
            except OSError:
                time.sleep(0.005)
            finally:
                s.close()

    seen: set = set()
    while running():
        for name in names() - seen:
            seen.add(name)
            for _ in range(4):
                threading.Thread(target=one, args=(name,), daemon=True).start()
        time.sleep(0.005)
    stats["sockets"] = len(seen)
    return stats


@as_root
def test_descriptor_flood_before_authentication_is_refused(build, tmp_path):
    """Another uid floods both workers' unix sockets with descriptors for the whole run, under a
    1024-descriptor limit: each worker's descriptor count stays bounded and the run completes,
    checkpoints included."""
    import resource

    def limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))
    p = subprocess.Popen([sys.executable, "-m", "executor.cli", "run", str(build), "--steps",
                          "300", "--checkpoint-every", "100", "--checkpoint-dir",
                          str(tmp_path / "ck")], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, preexec_fn=limit)
    workers: list[int] = []
    deadline = time.monotonic() + 60
    while len(workers) < 2 and time.monotonic() < deadline and p.poll() is None:
        workers = [q for q in _descendants(p.pid) if "executor.worker" in _cmdline(q)]
        time.sleep(0.01)
    assert len(workers) == 2, workers
    attacker = Stranger(_flood, workers, 120.0)
    peak = {w: 0 for w in workers}
    while p.poll() is None:
        for w in workers:
            peak[w] = max(peak[w], _fd_count(w))
        time.sleep(0.02)
    out, err = p.communicate()
    stats = attacker.result(30)
    assert p.returncode == 0, err + out
    assert stats["sockets"] == 2 and stats["connections"] >= 2 and stats["fds_sent"] > 1000, stats
    assert max(peak.values()) < 200, (peak, stats)
    assert "step  300/300" in out


def test_accept_errors_are_survived_and_logged(caplog):
    """accept() failing (out of descriptors) is logged and retried: the link still opens."""
    from executor.dicomm.tcp import listen_tcp
    store = dicomm.host_store()
    ns = f"accept-{secrets.token_hex(4)}"
    c0, c1 = (dicomm.connect(r, 2, "127.0.0.1", store.port, "s" * 32, transport="tcp",
                             namespace=ns, timeout=5.0) for r in range(2))
    try:
        real = listen_tcp("127.0.0.1")

        class Exhausted:
            failures = 3

            def accept(self):
                if self.failures:
                    self.failures -= 1
                    raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
                return real.accept()
        threading.Thread(target=c1._accept_loop, args=(Exhausted(),), daemon=True).start()
        record = c1._rdv.lookup("rank/1", "rank 1's record")
        c1._rdv.publish("rank/1", dict(record, port=real.getsockname()[1]))
        with caplog.at_level("WARNING", logger="h2.dicomm"):
            c0.send(1, np.arange(3, dtype=np.float32))
            assert np.array_equal(c1.recv(0), np.arange(3, dtype=np.float32))
        assert "accept failed: Too many open files; retrying" in caplog.text
    finally:
        c0.close()
        c1.close()
        real.close()


def test_handshake_reads_share_one_deadline():
    """A stranger dripping a handshake one byte at a time is dropped once the comm timeout has
    passed in all, not after a timeout per byte."""
    store = dicomm.host_store()
    c = dicomm.connect(0, 2, "127.0.0.1", store.port, "s" * 32, transport="tcp",
                       namespace=f"drip-{secrets.token_hex(4)}", timeout=1.0)
    try:
        s = socket.create_connection(("127.0.0.1", c._rdv.lookup("rank/0", "record")["port"]))
        s.settimeout(0.1)
        s.recv(4096)                                    # hello
        s.sendall(PREFIX.pack(b"h2", 2, b"C", 4096))
        t0 = time.monotonic()
        closed = None
        while closed is None and time.monotonic() - t0 < 6:
            try:
                s.send(b"\x80")
                if s.recv(4096) == b"":
                    closed = time.monotonic() - t0
            except socket.timeout:
                pass
            except OSError:
                closed = time.monotonic() - t0
        s.close()
        assert closed is not None and closed < 3, closed
    finally:
        c.close()


# ================================================================================================
# Whose failure it was: the worker that failed by itself is named, not a peer that saw it go
# ================================================================================================

class _Exited:
    """A worker process as the launcher's health check sees it: its exit status."""

    def __init__(self, rc: int | None):
        self.returncode = rc

    def poll(self):
        return self.returncode


class _Reports:
    """The launcher's progress as its health check reads it: the workers' error events (in
    arrival order) and when each one's output ended."""

    def __init__(self, errors: dict, ended: dict):
        self.errors, self.ended, self.eof, self.connected = errors, ended, set(ended), {0, 1}

    def drain(self, workers, wait_s: float = 1.0):
        pass


def _verdict(build, rcs: list, errors: dict, ended: dict) -> str:
    from executor.build import BuildDir
    from executor.launcher import _check_health
    status = np.zeros((2, 4))
    status[:, 0] = time.time()          # both heartbeats fresh: nobody is hung
    with pytest.raises(Exception) as e:
        _check_health(BuildDir(build), [_Exited(rc) for rc in rcs], status, set(), None,
                      _Reports(errors, ended))
    return str(e.value)


def _comm(w: int, peer: int, t: float) -> dict:
    return {"event": "error", "worker": w, "kind": "comm", "t": t, "message":
            f"rank {w}: waiting for 'grad:x' mb 0 from rank {peer}: rank {peer} closed its link "
            f"to rank {w} (process exited or died)"}


def test_the_worker_that_failed_by_itself_is_named_before_its_peers(build):
    """w1 dies without a word (exit 1) and w0's broken link is reported first: w1 is named, and
    w0's broken link is shown as what followed. Of two workers that report their own failure,
    the earlier one (by its event's time, not by arrival) is named."""
    t = time.time()
    said = _verdict(build, [2, 1], {0: _comm(0, 1, t + 0.5)}, {1: t, 0: t + 0.6})
    assert said.startswith("worker w1 (stage 1") and "exited with exit code 1" in said, said
    assert "then w0: rank 0: waiting for 'grad:x'" in said, said
    own = {1: {"event": "error", "worker": 1, "kind": "user", "t": t + 1, "message": "late"},
           0: {"event": "error", "worker": 0, "kind": "os", "t": t, "message": "first"}}
    said = _verdict(build, [2, 2], own, {0: t + 1, 1: t + 1})
    assert said.startswith("error: first") and "reported by worker w0" in said, said
    # only broken links (a network fault): the first one reported is what is named
    said = _verdict(build, [2, 2], {1: _comm(1, 0, t), 0: _comm(0, 1, t)}, {0: t, 1: t})
    assert said.startswith("error: rank 1: waiting") and "reported by worker w1" in said, said


def test_a_workers_own_os_error_is_its_failure_not_a_broken_link():
    """What a worker reports: its own OSError is kind "os" (exit 2, the cause and the limit,
    never "internal"), and so is a comm error raised by its own exhausted descriptors; a comm
    error from a peer's reset connection stays "comm" (a consequence)."""
    from executor.worker import _report_failure

    def report(e: BaseException) -> tuple[int, dict]:
        got = []
        try:
            raise e
        except BaseException as raised:     # noqa: BLE001 - with its traceback, as in main()
            return _report_failure(1, got.append, raised), got[0]
    code, ev = report(OSError(errno.EMFILE, os.strerror(errno.EMFILE), "/x/trace_w1.json"))
    assert code == 2 and ev["kind"] == "os", ev
    assert ev["message"].startswith("worker w1: Too many open files (EMFILE: this process's file "
                                    "descriptors are exhausted, limit "), ev
    assert "/x/trace_w1.json" in ev["message"] and "ulimit -n" in ev["hint"], ev

    def comm_error(cause: OSError) -> CommError:
        try:
            raise cause
        except OSError:
            try:
                raise CommError("rank 1: no shm link to rank 0") from None
            except CommError as e:
                return e
    code, ev = report(comm_error(OSError(errno.EMFILE, os.strerror(errno.EMFILE))))
    assert code == 2 and ev["kind"] == "os" and "the cause is this worker's own: Too many " \
        "open files (EMFILE" in ev["hint"], ev
    code, ev = report(comm_error(ConnectionResetError(errno.ECONNRESET, "reset")))
    assert ev["kind"] == "comm", ev


def _starve(build, w: int, flags: list, ready) -> tuple[subprocess.CompletedProcess, list]:
    """`h2x run BUILD *flags`; once `ready(line)` holds for a progress line, worker w's open-file
    limit is cut to the descriptors it holds, so its next open() fails with EMFILE. (the run's
    outcome, the worker processes)"""
    import resource
    p = subprocess.Popen([sys.executable, "-m", "executor.cli", "run", str(build), *flags],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out = []
        for line in p.stdout:
            out.append(line)
            if ready(line):
                break
        workers = sorted(q for q in _descendants(p.pid) if "executor.worker" in _cmdline(q))
        assert len(workers) == 2, (workers, out)
        target = next(q for q in workers if f"--worker {w} " in _cmdline(q))
        n = _fd_count(target)
        resource.prlimit(target, resource.RLIMIT_NOFILE, (n, n))
        rest, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    return subprocess.CompletedProcess(p.args, p.returncode, "".join(out) + rest, err), workers


def test_a_worker_out_of_descriptors_is_named_not_the_peer_that_saw_it_go(build):
    """w1 (not w0) runs out of descriptors: its own OSError (writing its trace at the end) is a
    run error that names it, the cause and the limit; w0's broken link follows it."""
    r, workers = _starve(build, 1, ["--steps", "60"], lambda line: line.startswith("step    3/"))
    _clean_error(r)
    assert "error: worker w1: Too many open files (EMFILE: this process's file descriptors are " \
        "exhausted, limit" in r.stderr, r.stderr
    assert "reported by worker w1 (stage 1" in r.stderr and "then w0: " in r.stderr, r.stderr
    time.sleep(0.2)
    assert not any(pid_alive(q) for q in workers), "workers outlived the run"


# ================================================================================================
# Bad flags and full disks: located errors, never an internal one
# ================================================================================================

@pytest.mark.parametrize("device, says", [
    ("meta", "meta tensors have shapes but no data"), ("junk", "not a device"),
    ("cuda:x", "not a device"), ("cuda", "CUDA device")])
def test_a_device_this_machine_cannot_train_on_is_a_located_error(build, device, says):
    import torch
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    r = run_cli("h2x", "run", str(build), "--steps", "1", "--device", device)
    _clean_error(r)
    assert says in r.stderr and device.split(":")[0] in r.stderr, r.stderr
    if device != "cuda":        # refused before a worker starts
        assert "starting" not in r.stdout, r.stdout


def test_a_device_map_entry_of_no_device_is_refused(build):
    r = run_cli("h2x", "run", str(build), "--steps", "1", "--device-map", "w0=meta")
    _clean_error(r)
    assert "--device-map" in r.stderr and "'meta'" in r.stderr, r.stderr


@pytest.fixture
def tiny_disk(tmp_path):
    """A 16 KiB tmpfs: a JSON log fills it within a few dozen steps."""
    d = tmp_path / "disk"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(d)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {r.stderr.strip()}")
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], capture_output=True)


def test_json_log_on_a_full_disk_stops_the_run_naming_the_file(build, tiny_disk):
    log = tiny_disk / "log.jsonl"
    r = run_cli("h2x", "run", str(build), "--steps", "200", "--json-log", str(log))
    _clean_error(r)
    assert f"{log}: error: cannot write the JSON log: No space left on device" in r.stderr, \
        r.stderr
    _losses(log)                    # every line it holds is whole, valid JSON
    r = run_cli("h2x", "run", str(build), "--steps", "1", "--json-log", "/dev/full")
    _clean_error(r)
    assert "/dev/full: error: cannot write the JSON log" in r.stderr, r.stderr


def test_trace_on_a_full_disk_is_a_run_error_naming_the_file(build):
    r = run_cli("h2x", "run", str(build), "--steps", "2", "--trace", "/dev/full")
    _clean_error(r)
    assert "/dev/full: error: cannot write the trace: No space left on device" in r.stderr, \
        r.stderr


def _read_secret(path: str) -> str:
    from executor.run import run_secret
    t0 = time.monotonic()
    try:
        run_secret(path)
        return "read"
    except Exception as e:      # noqa: BLE001 - what it said, and how soon
        return f"{type(e).__name__}: {e} ({time.monotonic() - t0:.2f} s)"


def test_secret_file_read_is_bounded(build):
    said = Stranger(_read_secret, "/dev/zero", nobody=False, memory=256 << 20).result(60)
    assert said.startswith("H2Error: /dev/zero: error: the run secret file is longer than 4096 "
                           "bytes: not a secret file"), said
    assert float(said.rsplit("(", 1)[1].split()[0]) < 1, said
    r = run_cli("h2x", "run", str(build), "--nnodes", "1", "--node-rank", "0", "--master",
                "127.0.0.1:9", "--secret-file", "/dev/zero")
    _clean_error(r)
    assert "/dev/zero: error: the run secret file is longer than" in r.stderr, r.stderr


# ================================================================================================
# The launcher: SIGTERM, streams predicted to deadlock, strict JSON
# ================================================================================================

def test_sigterm_stops_the_run_like_ctrl_c(build, tmp_path):
    p = subprocess.Popen([sys.executable, "-m", "executor.cli", "run", str(build), "--steps",
                          "100000"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    try:
        for line in p.stdout:
            if line.startswith("step    2/"):
                break
        workers = _descendants(p.pid)
        assert len(workers) >= 2, workers
        p.send_signal(signal.SIGTERM)
        rc = p.wait(timeout=30)
        err = p.stderr.read()
    finally:
        if p.poll() is None:
            p.kill()
    assert rc == 128 + signal.SIGTERM, (rc, err)
    assert "stopped by SIGTERM" in err and "Traceback" not in err, err
    time.sleep(0.5)
    assert not any(pid_alive(w) for w in workers), "workers outlived the launcher"


@pytest.mark.parametrize("sig, says", [
    (signal.SIGTERM, "h2x run: stopped by SIGTERM on host 0; its workers (w0 w1) are stopped"),
    (signal.SIGINT, "h2x: interrupted")], ids=["SIGTERM", "SIGINT"])
def test_sigterm_stops_a_multihost_run_like_ctrl_c(build, tmp_path, sig, says):
    """`h2x run --nnodes` (torchrun's agent) stopped by SIGTERM or SIGINT: every worker stops,
    and the agent says so in one line (no torchrun log lines, no internal error)."""
    secret = tmp_path / "secret"
    secret.write_text(secrets.token_hex(32) + "\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "H2_SECRET"}
    p = subprocess.Popen([sys.executable, "-m", "executor.cli", "run", str(build), "--nnodes", "1",
                          "--node-rank", "0", "--master", f"127.0.0.1:{port}", "--secret-file",
                          str(secret), "--steps", "100000"], cwd=ROOT, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in p.stdout:
            if line.startswith("step    2/"):
                break
        workers = [q for q in _descendants(p.pid) if "executor.run" in _cmdline(q)]
        assert len(workers) == 2, workers
        p.send_signal(sig)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == (130 if sig == signal.SIGINT else 128 + sig), (p.returncode, err)
    assert err.strip().splitlines() == [says], err
    time.sleep(0.5)
    assert not any(pid_alive(w) for w in workers), "workers outlived the agent"


def _rewrite(b: Path, rel: str, text: str) -> None:
    """Change one build file as a wrong h2c would have written it (its digest to match)."""
    import hashlib
    (b / rel).write_text(text)
    d = b / "digests.json"
    if d.exists():
        digests = json.loads(d.read_text())
        raw = (b / rel).read_bytes()
        digests["files"][rel] = {"sha256": hashlib.sha256(raw).hexdigest(), "size": len(raw)}
        d.write_text(json.dumps(digests))


def test_streams_predicted_to_deadlock_are_refused_before_starting(build, tmp_path):
    import shutil
    b = tmp_path / "b"
    shutil.copytree(build, b)
    lines = (b / "streams" / "w0.txt").read_text().splitlines(keepends=True)
    wait = lines.pop(lines.index("recv_grad 0 <- w1\n"))     # w0 waits before it sends
    lines.insert(lines.index("fwd 0\n"), wait)
    _rewrite(b, "streams/w0.txt", "".join(lines))
    t0 = time.monotonic()
    r = run_cli("h2x", "run", str(b), "--steps", "2", "--timeout", "3")
    _clean_error(r)
    assert f"{b / 'streams'}: error: the build's instruction streams deadlock (w0: recv_grad 0 " \
        "<- w1, w1: recv_act 0 <- w0)" in r.stderr, r.stderr
    assert "starting" not in r.stdout and time.monotonic() - t0 < 60, r.stdout


def test_json_log_lines_are_strict_json():
    """A non-finite number (a step the NaN guard skipped) is written as null."""
    from executor.launcher import json_line

    def bad(c):
        raise AssertionError(f"not valid JSON: {c}")
    line = json_line({"loss": float("nan"), "grad_norm": float("inf"), "lr": [1.0, -math.inf],
                      "moe": {"x": np.float64("nan")}})
    assert json.loads(line, parse_constant=bad) == {"loss": None, "grad_norm": None,
                                                     "lr": [1.0, None], "moe": {"x": None}}
