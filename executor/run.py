"""`h2x run` across hosts, on torchrun (torch.distributed.elastic): one agent per host, one
process per worker.

    torchrun --nnodes N --nproc-per-node K --rdzv-backend c10d --rdzv-endpoint H:P \\
             -m executor.run BUILD [h2x run flags]
    h2x run BUILD --nnodes N --node-rank I --master H:P [h2x run flags]   (`launch` below)

Membership and restarts are torchrun's. What the single-host launcher does happens here:

- **Which worker a process is.** The manifest records each worker's host (h2c's chip
  assignment, `workers[i].host`); host h's local rank k runs `BuildDir.hosts[h][k]`. The host
  index is `H2_NODE_RANK` (set by `h2x run --node-rank`) or torchrun's GROUP_RANK. WORLD_SIZE and
  LOCAL_WORLD_SIZE are checked against the build.
- **Store.** Every process is a client of one TCPStore: the agent's (TORCHELASTIC_USE_AGENT_STORE)
  or, when torchrun does not share one (`h2x run --nnodes` sets TORCH_DISABLE_SHARE_RDZV_TCP_STORE
  so nothing listens on every interface), one that global rank 0 hosts on MASTER_PORT, bound to
  its listen address only; that store is new in every rendezvous round. Keys live under
  `h2x/<run id>/<restart count>` (agent store) or `h2x/<run id>` (a fresh store per round), and
  every record carries the run secret's MAC (dicomm.Rendezvous) and, once the processes have
  agreed on it (`open_run`/`join_run`), the run's id: a record of another run is skipped.
- **Coordinator** (a thread in worker 0's process): decides the start step (resume), checks the
  data, prints the progress lines, writes --json-log, marks checkpoints COMPLETE, watches every
  worker's heartbeat record and names the root cause of a failure: a worker's own error, a hung
  worker, or a lost host (every worker of it silent), then publishes `stop`, which every
  process obeys within a heartbeat.
- **Workers** send their events (ready, step, checkpoint, error, done) as authenticated store
  records `ev/<w>/<n>` and a heartbeat record `hb/<w>` every HEARTBEAT_S (step, instruction,
  host); they listen only on one address (--iface, the cluster file's node `iface`, else the one
  that routes to MASTER_ADDR).
- **Signals.** SIGTERM or SIGINT to `h2x run --nnodes` (torchrun's agent) stops this host's
  workers as on a single host: the agent passes the signal on, each worker leaves at once and
  silently, and the agent says so in one line (exit status 128 + the signal; SIGINT: 130).
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import ipaddress
import json
import os
import secrets
import signal
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import msgpack
import numpy as np

from executor.dicomm.rendezvous import RUN_BYTES
from h2ir.errors import H2Error

HEARTBEAT_S = 0.5
HANG_AFTER_S = 5.0          # no new heartbeat record for this long: hung, dead or cut off
STORE_LOST_S = 10.0         # a worker that cannot reach the store this long stops by itself
STARTUP_S = 120.0           # a worker's first heartbeat may take this long (imports, loading)
STOP_GRACE_S = 2.0          # the store's host stays up this long after `stop`, so all read it
SECRET_HINT = ("make one with `python -c 'import secrets; print(secrets.token_hex(32))' > "
               "secret && chmod 600 secret`, copy it to every host, and pass --secret-file "
               "secret (or export H2_SECRET=$(cat secret))")
MIN_SECRET_CHARS = 32
MAX_SECRET_BYTES = 4096     # a secret is a line of hex; anything longer is the wrong file


# ---- what torchrun tells a process ------------------------------------------------------------

@dataclass(frozen=True)
class ElasticEnv:
    rank: int
    local_rank: int
    group_rank: int
    world_size: int
    local_world_size: int
    master_addr: str
    master_port: int
    restart_count: int
    run_id: str
    agent_store: bool
    node_rank: int | None           # H2_NODE_RANK, set by `h2x run --node-rank`

    @classmethod
    def from_environ(cls, env=os.environ) -> "ElasticEnv":
        need = ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                "MASTER_ADDR", "MASTER_PORT")
        missing = [k for k in need if k not in env]
        if missing:
            raise H2Error(f"executor.run runs under torchrun; {', '.join(missing)} not set",
                          hint="start it as `torchrun ... -m executor.run BUILD` or with "
                               "`h2x run BUILD --nnodes N --node-rank I --master H:P`; "
                               "a single host needs neither: `h2x run BUILD`")
        try:
            ints = {k: int(env[k]) for k in need if k != "MASTER_ADDR"}
            node = int(env["H2_NODE_RANK"]) if env.get("H2_NODE_RANK") else None
            restarts = int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))
        except ValueError as e:
            raise H2Error(f"torchrun environment: {e}") from None
        return cls(ints["RANK"], ints["LOCAL_RANK"], ints["GROUP_RANK"], ints["WORLD_SIZE"],
                   ints["LOCAL_WORLD_SIZE"], env["MASTER_ADDR"], ints["MASTER_PORT"], restarts,
                   env.get("TORCHELASTIC_RUN_ID", "none"),
                   env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true", node)

    @property
    def host(self) -> int:
        return self.group_rank if self.node_rank is None else self.node_rank

    @property
    def namespace(self) -> str:
        # the agent's store outlives rounds: a round's keys carry its restart count; a store
        # rank 0 hosts is new in every round
        return f"h2x/{self.run_id}/{self.restart_count}" if self.agent_store else f"h2x/{self.run_id}"


def worker_of(build, env: ElasticEnv) -> int:
    """The build's worker this process runs; the sizes torchrun gave, checked against the build."""
    hosts = build.hosts
    want = ", ".join(f"host {h}: {len(ws)} (" + " ".join(f"w{w}" for w in ws) + ")"
                     for h, ws in enumerate(hosts))
    expects = f"the build expects {len(hosts)} host(s) with {want} worker process(es)"
    if env.world_size != len(build.workers):
        raise H2Error(f"torchrun started {env.world_size} process(es) in all; {expects}",
                      str(build.path), hint="pass --nnodes and --nproc-per-node to match")
    if not 0 <= env.host < len(hosts):
        raise H2Error(f"this is host {env.host} (node rank); {expects}", str(build.path))
    if env.local_world_size != len(hosts[env.host]) or not 0 <= env.local_rank < len(hosts[env.host]):
        raise H2Error(f"torchrun started {env.local_world_size} process(es) on host {env.host}; "
                      f"{expects}", str(build.path),
                      hint=f"on this host: --nproc-per-node {len(hosts[env.host])}")
    return hosts[env.host][env.local_rank]


# ---- the run secret and the listen address ------------------------------------------------------

def run_secret(secret_file: str | None, env=os.environ) -> str:
    """The secret every host shares: --secret-file's first line, else H2_SECRET. torchrun hands
    none out, and without one any host that reaches the store could join the run."""
    if secret_file:
        try:
            with open(secret_file, "rb") as f:
                raw = f.read(MAX_SECRET_BYTES + 1)      # /dev/zero is not a secret
            if len(raw) > MAX_SECRET_BYTES:
                raise H2Error(f"the run secret file is longer than {MAX_SECRET_BYTES} bytes: "
                              "not a secret file", secret_file, hint=SECRET_HINT)
            text = raw.decode().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise H2Error(f"cannot read the run secret: {getattr(e, 'strerror', None) or e}",
                          secret_file) from None
        where = secret_file
    else:
        text, where = env.get("H2_SECRET", "").strip(), "H2_SECRET"
    if not text:
        raise H2Error("a multi-host run needs a run secret shared by every host (torchrun "
                      "cannot hand one out): set H2_SECRET or pass --secret-file PATH",
                      hint=SECRET_HINT)
    if len(text) < MIN_SECRET_CHARS:
        raise H2Error(f"{where}: the run secret is {len(text)} characters; at least "
                      f"{MIN_SECRET_CHARS} are needed", hint=SECRET_HINT)
    return text


def iface_address(name: str) -> str:
    """IPv4 address of network interface `name` (SIOCGIFADDR)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
        return socket.inet_ntoa(raw[20:24])
    except OSError as e:
        raise H2Error(f"--iface {name}: no such interface, or it has no IPv4 address "
                      f"({e.strerror})", hint="`ip -br addr` lists this host's interfaces") from None
    finally:
        s.close()


def route_address(peer: str) -> str:
    """The local address this host's traffic to `peer` leaves from (no packet is sent)."""
    try:
        ip = socket.getaddrinfo(peer, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    except socket.gaierror as e:
        raise H2Error(f"cannot resolve the rendezvous host {peer!r}: {e.strerror}") from None
    if ipaddress.ip_address(ip).is_loopback:
        return "127.0.0.1"
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect((ip, 9))
        return s.getsockname()[0]
    except OSError as e:
        raise H2Error(f"no route from this host to the rendezvous host {peer} ({ip}): "
                      f"{e.strerror}", hint="pass --iface NAME") from None
    finally:
        s.close()


def cluster_iface(build, host: int) -> str | None:
    """The cluster file's `iface` of host `host`'s node group (hosts count over the groups)."""
    from h2ir.clusters.clusterfile import load_cluster
    cl = build.path / "cluster.toml"
    if not cl.is_file():
        return None
    first = 0
    for g in load_cluster(str(cl)).groups:
        if host < first + g.nodes:
            return g.iface
        first += g.nodes
    return None


def listen_address(iface: str | None, build, host: int, master_addr: str) -> str:
    name = iface or cluster_iface(build, host)
    return iface_address(name) if name else route_address(master_addr)


# ---- the store and its records -----------------------------------------------------------------

def open_store(env: ElasticEnv, addr: str, timeout: float):
    """This process's TCPStore: the agent's, or the one global rank 0 hosts on MASTER_PORT bound
    to `addr` only."""
    from torch.distributed import TCPStore

    from executor import dicomm
    if not env.agent_store and env.rank == 0:
        return dicomm.host_store(addr, env.master_port)
    try:
        return TCPStore(env.master_addr, env.master_port, is_master=False,
                        timeout=timedelta(seconds=timeout), wait_for_workers=False)
    except Exception as e:          # DistNetworkError / RuntimeError
        raise H2Error(f"cannot reach the run's store at {env.master_addr}:{env.master_port} "
                      f"within {timeout:g} s: {str(e).splitlines()[0] if str(e) else e}") from None


class Records:
    """Authenticated records in the run's store, under its namespace (dicomm.Rendezvous), bound
    to the run once its id is agreed (`bind`)."""

    def __init__(self, store, namespace: str, secret: str, timeout: float, where: str,
                 on_foreign=None):
        from executor.dicomm.rendezvous import Rendezvous
        self.store, self.ns = store, namespace
        self.rdv = Rendezvous("", 0, timeout, namespace, store, secret=secret.encode(),
                              on_foreign=on_foreign)
        self.rdv.where = where
        self._lock = threading.Lock()

    @property
    def run(self) -> bytes:
        """The run's id (b"" until `bind`)."""
        return self.rdv.run

    def bind(self, run: bytes) -> None:
        self.rdv.run = run

    def put(self, key: str, record: dict) -> None:
        self.rdv.publish(key, record)

    def has(self, key: str) -> bool:
        return bool(self.store.check([f"{self.ns}/{key}"]))

    def get(self, key: str, what: str, timeout: float | None = None) -> dict:
        return self.rdv.lookup(key, what, timeout)

    def poll(self, key: str, what: str) -> dict | None:
        """The record if one of this run is there now, else None (one of another run is noted)."""
        return self.rdv.try_lookup(key, what)

    def add(self, key: str, n: int) -> int:
        return int(self.store.add(f"{self.ns}/{key}", n))


# ---- the run's id: agreed through the store, fresh for every process ----------------------------
#
# A long-lived secret (--secret-file) authenticates every record of every run of a build, so a
# record must also say which run it belongs to, or an earlier run's `plan` or `ev/*` replayed
# into the store would verify. The run id is agreed before any other record is read:
#
#   coordinator  agree/challenge  {c: fresh 32 bytes}
#   worker w     agree/<w>        {c: the challenge it read, n: fresh 32 bytes}  (again if c changes)
#   coordinator  agree/run        {c, n: [every worker's n]}  once each agree/<w> echoes its c
#   run id = SHA-256(c, n_0..n_W-1)[:16]
#
# The coordinator takes only joins that echo its own fresh challenge, and a worker only the run
# record that lists its own fresh nonce, so neither accepts a replay of another run's; every
# later record's MAC and every DiComm handshake key covers the run id.

NONCE_BYTES = 32


def run_id(challenge: bytes, nonces: list) -> bytes:
    return hashlib.sha256(msgpack.packb(["h2x-run", challenge, list(nonces)],
                                        use_bin_type=True)).digest()[:RUN_BYTES]


def _nonce(v) -> bool:
    return type(v) is bytes and len(v) == NONCE_BYTES


def open_run(records: Records, num_workers: int, timeout: float) -> bytes:
    """The coordinator's half of agreeing on the run id (above); binds `records` to it."""
    c = secrets.token_bytes(NONCE_BYTES)
    records.put("agree/challenge", {"c": c})
    nonces: dict[int, bytes] = {}
    deadline = time.monotonic() + timeout
    while len(nonces) < num_workers:
        for w in range(num_workers):
            if w not in nonces:
                j = records.poll(f"agree/{w}", f"worker w{w}'s join record")
                if j is not None and j.get("c") == c and _nonce(j.get("n")):
                    nonces[w] = j["n"]
        if len(nonces) < num_workers and time.monotonic() > deadline:
            missing = " ".join(f"w{w}" for w in range(num_workers) if w not in nonces)
            raise H2Error(f"worker(s) {missing} did not join the run within {timeout:g} s",
                          hint="are all hosts started with the same build, store and secret?")
        time.sleep(0.02)
    listed = [nonces[w] for w in range(num_workers)]
    records.put("agree/run", {"c": c, "n": listed})
    run = run_id(c, listed)
    records.bind(run)
    return run


def join_run(records: Records, wid: int, num_workers: int, timeout: float) -> bytes:
    """Worker `wid`'s half of agreeing on the run id (above); binds `records` to it."""
    n = secrets.token_bytes(NONCE_BYTES)
    echoed = None
    ignored: set = set()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ch = records.poll("agree/challenge", "the coordinator's challenge")
        if ch is not None and _nonce(ch.get("c")) and ch["c"] != echoed:
            records.put(f"agree/{wid}", {"c": ch["c"], "n": n})
            echoed = ch["c"]
        r = records.poll("agree/run", "the run record")
        if r is not None:
            listed = r.get("n")
            if echoed is not None and r.get("c") == echoed and isinstance(listed, list) \
                    and len(listed) == num_workers and listed[wid] == n \
                    and all(_nonce(x) for x in listed):
                run = run_id(echoed, listed)
                records.bind(run)
                return run
            if echoed is not None and r.get("c") != echoed and repr(r.get("c")) not in ignored:
                ignored.add(repr(r.get("c")))   # no answer to this run's challenge: another run's
                records.rdv.on_foreign(f"ignored rendezvous record '{records.ns}/agree/run': it "
                                       f"answers another run's challenge, not this run's")
        time.sleep(0.02)
    raise H2Error(f"worker w{wid} could not agree on a run with the coordinator (worker w0) "
                  f"within {timeout:g} s", hint="is worker w0's host started, with the same "
                                                "secret? Its own error says why it is not")


TRACE_PART_BYTES = 48 * 1024        # a trace goes through the store in records under its limit


def publish_trace(records: Records, wid: int, trace: list) -> None:
    """Worker `wid`'s measured trace as records `trace/<w>/<i>` and their count `trace/<w>`,
    each part under the store's record size."""
    parts, cur, size = [], [], 0
    for ev in trace:
        n = len(json.dumps(ev)) + 2
        if cur and size + n > TRACE_PART_BYTES:
            parts.append(cur)
            cur, size = [], 0
        cur.append(ev)
        size += n
    if cur:
        parts.append(cur)
    for i, part in enumerate(parts):
        records.put(f"trace/{wid}/{i}", {"events": part})
    records.put(f"trace/{wid}", {"parts": len(parts)})


def collect_trace(records: Records, wid: int, timeout: float) -> list:
    n = records.get(f"trace/{wid}", f"worker w{wid}'s trace", timeout)["parts"]
    out: list = []
    for i in range(int(n)):
        out += records.get(f"trace/{wid}/{i}", f"worker w{wid}'s trace", timeout)["events"]
    return out


class EventSender:
    """emit(event) for a worker under torchrun: event n of worker w is record `ev/<w>/<n>`; its
    heartbeat says how many were sent, so a missing one is noticed."""

    def __init__(self, records: Records, wid: int):
        self.records, self.wid, self.n = records, wid, 0
        self.lock = threading.Lock()

    def __call__(self, ev: dict) -> None:
        with self.lock:
            self.records.put(f"ev/{self.wid}/{self.n}", ev)
            self.n += 1


# ---- error reporting ------------------------------------------------------------------------------

def write_error_file(message: str) -> None:
    """torchrun's error file (TORCHELASTIC_ERROR_FILE): its failure summary shows the message."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        Path(path).write_text(json.dumps({"message": {"message": message, "extraInfo": {
            "py_callstack": "", "timestamp": str(int(time.time()))}}}))
    except OSError:
        pass


class Stop:
    """Stops this process the same way from any thread: the message to torchrun's error file and
    the console, then exit 2 (after STOP_GRACE_S when this process hosts the store)."""

    def __init__(self, console, hosts_store: bool):
        self.console, self.hosts_store = console, hosts_store
        self.lock = threading.Lock()

    def __call__(self, message: str, code: int = 2, show: bool = True):
        with self.lock:
            write_error_file(message)
            if show:
                try:
                    print(message, file=self.console, flush=True)
                except (OSError, ValueError):
                    pass
            with contextlib.suppress(Exception):
                sys.stdout.flush()
            if self.hosts_store:
                time.sleep(STOP_GRACE_S)
            os._exit(code)


# ---- the worker's side -------------------------------------------------------------------------

def _heartbeat(records: Records, wid: int, host: int, addr: str, status: np.ndarray, stop: Stop,
               parent: int, where: str, emit: EventSender):
    """Every HEARTBEAT_S once the run id is agreed: publish hb/<w> (with the count of events
    sent); obey `stop`; give up when the store is unreachable or the agent is gone."""
    n, last_ok = 0, time.monotonic()
    hostname = socket.gethostname()
    while True:
        if os.getppid() != parent:          # torchrun's agent is gone: no worker outlives it
            stop("worker stopped: its torchrun agent exited", show=False)
        if not records.run:
            last_ok = time.monotonic()
            time.sleep(HEARTBEAT_S)
            continue
        try:
            n += 1
            records.put(f"hb/{wid}", {"n": n, "step": int(status[1]), "pc": int(status[2]),
                                      "state": int(status[3]), "host": host, "events": emit.n,
                                      "hostname": hostname, "addr": addr, "pid": os.getpid()})
            r = records.poll("stop", "the stop record")
            if r is not None:
                stop(str(r.get("message", "stopped")), show=False)
            last_ok = time.monotonic()
        except Exception as e:              # noqa: BLE001 - the store is down or cut off
            if time.monotonic() - last_ok > STORE_LOST_S:
                stop(f"error: worker w{wid} on host {host} ({hostname}) lost the run's store at "
                     f"{where} for {STORE_LOST_S:g} s ({str(e).splitlines()[0] if str(e) else e});"
                     " its host or the network to it is down. This worker stopped.")
        time.sleep(HEARTBEAT_S)


def serve(a, console, cfg) -> int:
    """One worker process under torchrun."""
    from backends.allocator import keep_freed_memory
    from backends.threads import limit_torch_threads, pin_to_core
    from executor import dicomm
    from executor.build import BuildDir
    from executor.checkpoint import load_worker_checkpoint
    from executor.ccl import open_ccl
    from executor.worker import (ChunkedWorker, Worker, _report_failure, _token_batches,
                                 take_device, worker_devices)

    env = ElasticEnv.from_environ()
    build = BuildDir(a.build)
    wid = worker_of(build, env)
    signal.signal(signal.SIGTERM, _stopped_by_signal)   # how torchrun's agent stops its workers
    secret = run_secret(a.secret_file)
    addr = listen_address(a.iface, build, env.host, env.master_addr)
    store = open_store(env, addr, max(a.timeout, 30.0))
    where = f"{env.master_addr}:{env.master_port}"

    def note(text: str) -> None:
        with contextlib.suppress(OSError, ValueError):
            print(f"note: worker w{wid}: {text}", file=console, flush=True)
    records = Records(store, env.namespace, secret, a.timeout, where, note)
    stop = Stop(console, hosts_store=not env.agent_store and env.rank == 0)
    W = len(build.workers)
    status = np.zeros(4)
    # emulated hosts of one machine (a cluster with shared_cores) share its cores: all workers
    shared = (build.manifest.get("cluster") or {}).get("shared_cores")
    pin_to_core(wid, sharing=W if shared else len(build.hosts[build.workers[wid].get("host", 0)]))
    emit = EventSender(records, wid)
    threading.Thread(target=_heartbeat, args=(records, wid, env.host, addr, status, stop,
                                              os.getppid(), where, emit), daemon=True).start()
    coordinator = None
    if wid == 0:
        from dataclasses import replace

        from executor.coordinator import Coordinator
        # its own client connection: its polling never queues behind this worker's store calls
        coord_records = Records(open_store(replace(env, rank=-1), addr, 30.0), env.namespace,
                                secret, a.timeout, where)
        coordinator = Coordinator(build, a, env, coord_records, stop, console)
        coord_records.rdv.on_foreign = lambda text: coordinator.out(f"note: {text}")
        coordinator.start()
    try:
        run = join_run(records, wid, W, STARTUP_S)
    except H2Error as e:
        stop(str(e))
    try:
        plan = records.get("plan", "the coordinator's start record", timeout=STARTUP_S)
        limit_torch_threads()
        keep_freed_memory()
        recipe = {**cfg.recipe(), **plan["settings"]}
        kind = ChunkedWorker if build.workers[wid].get("chunks") else Worker
        devices = worker_devices(build, a.device, a.device_map,
                                 [w.get("host", 0) for w in build.workers])
        take_device(devices[wid], wid, build)
        worker = kind(build, wid, None, _token_batches(build, wid, recipe["data"]),
                      recipe, emit, status, devices[wid])
        comm = dicomm.connect(wid, W, secret=secret, transport=plan["transport"], fallback=True,
                              timeout=a.timeout, host=addr, namespace=env.namespace + "/dicomm",
                              store=store, run=run, on_foreign=note)
        worker.comm = comm
        ccl = open_ccl(build.manifest, wid, devices, lambda: store, timeout=a.timeout, host=addr,
                       namespace=env.namespace + "/ccl")
        if ccl is not None:
            worker.use_ccl(ccl)
        emit({"event": "ready", "worker": wid, "transport": comm.transport})
        if plan["resume_from"]:
            load_worker_checkpoint(Path(plan["resume_from"]), worker)
        ckpt = Path(plan["checkpoint_dir"]) if a.checkpoint_every else None
        # the trace's clock: the coordinator's start, by wall clock (one machine, or hosts
        # whose clocks are synchronised), on this process's monotonic clock
        t0 = time.perf_counter() - (time.time() - plan.get("t0_wall", time.time()))
        worker.run(plan["start"], a.steps, a.checkpoint_every, ckpt, t0)
        if plan.get("trace"):
            publish_trace(records, wid, worker.trace)
        comm.barrier(list(range(W)))
        links = [dict(link, src=wid) for link in comm.links()
                 + (ccl.links() if ccl is not None else [])]
        if ccl is not None:
            ccl.close()
        comm.close()
        emit({"event": "done", "worker": wid, "links": links})
    except Stopped as e:                    # the agent stops us: it says so, not each worker
        stop(f"worker w{wid} stopped by {e.signal.name}", code=128 + e.signal, show=False)
    except BaseException as e:              # noqa: BLE001 - reported to the coordinator
        code = _report_failure(wid, emit, e)
        # the coordinator names the root cause and publishes `stop` (the heartbeat obeys it);
        # without a verdict in time, stop with this worker's own message
        time.sleep(HANG_AFTER_S * 3 + 5)
        stop(str(e) if isinstance(e, H2Error) else f"error: worker w{wid}: {type(e).__name__}: {e}",
             code=code)
    # the end: wait for the coordinator's verdict, then leave together (the store's host last)
    records.get("finished", "the coordinator's end record", timeout=STARTUP_S)
    records.add("left", 1)
    if coordinator is not None:
        coordinator.join()
    if stop.hosts_store:
        deadline = time.monotonic() + 10
        while records.add("left", 0) < W and time.monotonic() < deadline:
            time.sleep(0.05)
    return 0




class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGINT in a worker under torchrun: its agent is stopping the run."""

    def __init__(self, sig: int):
        super().__init__()
        self.signal = signal.Signals(sig)


def _stopped_by_signal(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)       # a second one must not cut the exit
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise Stopped(signum)


def main(argv=None) -> int:
    """`python -m executor.run BUILD ...`: the process torchrun starts per worker."""
    from executor.cli import parse_run_args
    console = os.fdopen(os.dup(2), "w")
    try:
        a, cfg = parse_run_args(sys.argv[1:] if argv is None else argv, "python -m executor.run")
        from executor.build import BuildDir
        from executor.launcher import worker_log_path
        build = BuildDir(a.build)
        log = worker_log_path(build.path, worker_of(build, ElasticEnv.from_environ()))
        with contextlib.suppress(OSError):  # dicomm warnings and tracebacks: the worker's log
            log.parent.mkdir(parents=True, exist_ok=True)
            with open(log, "w") as f:
                os.dup2(f.fileno(), 2)
        signal.signal(signal.SIGINT, _stopped_by_signal)
        rc = serve(a, console, cfg)
    except H2Error as e:
        write_error_file(str(e))
        print(str(e), file=console, flush=True)
        return 2
    except KeyboardInterrupt as e:      # stopped before (or after) the run: leave silently
        os._exit(128 + e.signal if isinstance(e, Stopped) else 130)
    # Done: every worker has passed `finished`, so nothing is left to say. Leave without the
    # interpreter's teardown: it ran C++ destructors while the heartbeat thread sat in a store
    # call, and some runs (1 in 4 to 6 on the 2-host test bed) aborted there ("terminate called without an active
    # exception", SIGABRT) -- torchrun then called the host failed and the other hosts' agents
    # waited out their 300 s exit barrier.
    for f in (sys.stdout, sys.stderr, console):
        with contextlib.suppress(Exception):
            f.flush()
    os._exit(rc)


# ---- `h2x run --nnodes`: torchrun's launcher, started with the right arguments -------------------

LAUNCH_FLAGS = {"--nnodes": 1, "--node-rank": 1, "--master": 1, "--max-restarts": 1,
                "--rdzv-id": 1}


def worker_argv(argv: list[str]) -> list[str]:
    """h2x run's arguments without the ones only the launcher reads."""
    out, skip = [], 0
    for tok in argv:
        if skip:
            skip -= 1
            continue
        name = tok.split("=", 1)[0]
        if name in LAUNCH_FLAGS:
            skip = 0 if "=" in tok else LAUNCH_FLAGS[name]
            continue
        out.append(tok)
    return out


def parse_master(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise H2Error(f"--master {text!r}: expected HOST:PORT (the rendezvous host, node rank "
                      "0's address, and a free port)")
    return host.strip("[]"), int(port)


def launch(a, argv: list[str], out=print) -> int:
    """`h2x run BUILD --nnodes N --node-rank I --master H:P`: this host's torchrun agent. Node
    rank 0 hosts the rendezvous store itself, bound to H only (torchrun's own binds every
    interface), and the workers' store is hosted by global rank 0 the same way."""
    from executor.build import BuildDir
    from executor.checkpoint import build_fingerprint
    run_secret(a.secret_file)                       # refuse before anything starts
    build = BuildDir(a.build)
    hosts = build.hosts
    if a.nnodes != len(hosts):
        raise H2Error(f"--nnodes {a.nnodes}: the build's workers are on {len(hosts)} host(s) "
                      f"({', '.join(f'host {h}: ' + ' '.join(f'w{w}' for w in ws) for h, ws in enumerate(hosts))})",
                      str(build.path))
    if a.node_rank is None or not 0 <= a.node_rank < a.nnodes:
        raise H2Error(f"--node-rank: expected 0..{a.nnodes - 1} with --nnodes {a.nnodes}, got "
                      f"{a.node_rank}")
    if not a.master:
        raise H2Error("--nnodes needs --master HOST:PORT (node rank 0's address and a port)")
    mhost, mport = parse_master(a.master)
    addr = iface_address(a.iface) if a.iface else \
        (cluster_iface(build, a.node_rank) and iface_address(cluster_iface(build, a.node_rank))) \
        or route_address(mhost)
    rdzv_store = None
    if a.node_rank == 0:
        from executor import dicomm
        try:
            master_ip = socket.getaddrinfo(mhost, None, socket.AF_INET)[0][4][0]
        except socket.gaierror as e:
            raise H2Error(f"--master {a.master}: cannot resolve {mhost!r}: {e.strerror}") from None
        rdzv_store = dicomm.host_store(master_ip, mport, timeout=60.0)   # noqa: F841 - kept alive
    run_id = a.rdzv_id or "h2x-" + build_fingerprint(build.path)[:12]
    # (no --node-rank: c10d ignores it; H2_NODE_RANK maps this host's processes instead)
    targs = ["--nnodes", str(a.nnodes), "--nproc-per-node", str(len(hosts[a.node_rank])),
             "--rdzv-backend", "c10d",
             "--rdzv-endpoint", f"{mhost}:{mport}", "--rdzv-id", run_id,
             "--rdzv-conf", "is_host=false,join_timeout=600", "--local-addr", addr,
             "--max-restarts", str(a.max_restarts), "--monitor-interval", "0.5",
             "-m", "executor.run"] + worker_argv(argv)
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"   # no agent store on every interface
    os.environ["H2_NODE_RANK"] = str(a.node_rank)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")   # c10d's socket chatter
    out(f"h2x: host {a.node_rank} of {a.nnodes} ({socket.gethostname()}, {addr}): "
        f"{len(hosts[a.node_rank])} worker(s) " + " ".join(f"w{w}" for w in hosts[a.node_rank])
        + f"; rendezvous {mhost}:{mport} ({run_id}), up to {a.max_restarts} restart(s)")
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    quiet = _QuietShutdown()
    try:
        torchrun.run(torchrun.parse_args(targs))
    except SignalException as e:    # SIGTERM/SIGINT: torchrun stopped every worker of this host
        sig = signal.Signals(e.sigval)
        if sig == signal.SIGINT:
            raise KeyboardInterrupt from None
        print(f"h2x run: stopped by {sig.name} on host {a.node_rank}; its workers ("
              + " ".join(f"w{w}" for w in hosts[a.node_rank]) + ") are stopped",
              file=sys.stderr, flush=True)
        raise SystemExit(128 + sig) from None
    except ChildFailedError as e:
        if any(w == 0 for w in hosts[a.node_rank]):
            # the coordinator (worker 0) runs here and has printed the verdict above
            raise _Reported(f"h2x run: stopped on host {a.node_rank} (the error above); "
                            f"torchrun restarts allowed: {a.max_restarts}") from None
        _, failure = e.get_first_failure()
        msg = failure.message if isinstance(failure.message, str) else \
            json.dumps(failure.message)
        if "error" not in msg:
            msg = f"error: {msg}"
        raise _Reported(msg) from None
    except Exception as e:          # rendezvous errors: torchrun's own exception types
        raise H2Error(f"torchrun stopped: {type(e).__name__}: "
                      f"{str(e).splitlines()[0] if str(e) else ''}",
                      hint=f"is node rank 0 up with --master {a.master}?") from None
    finally:
        quiet.close()
    return 0


class _QuietShutdown:
    """Drops torchrun's own log lines about a signal it received ("Received 15 death signal,
    shutting down workers", "Sending process N closing signal SIGTERM") while it is installed:
    h2x says what happened in one line of its own."""

    NAMES = ("torch.distributed.elastic.agent.server.api",
             "torch.distributed.elastic.multiprocessing.api")

    def __init__(self):
        import logging
        self.loggers = [logging.getLogger(n) for n in self.NAMES]
        for lg in self.loggers:
            lg.addFilter(self.filter)

    @staticmethod
    def filter(record) -> bool:
        return not str(record.msg).startswith(("Received %s death signal",
                                                "Sending process %s closing signal"))

    def close(self) -> None:
        for lg in self.loggers:
            lg.removeFilter(self.filter)


class _Reported(H2Error):
    """A message that already has its own `file: error:` form (a worker's verdict)."""

    def __str__(self) -> str:
        return self.message


if __name__ == "__main__":
    sys.exit(main())
