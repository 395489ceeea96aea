"""`h2x run BUILD/`: one process per worker on this host, supervised.

The launcher hosts the rendezvous store (torch's TCPStore) and a per-run secret, starts the
workers, prints a progress line per step, writes the JSON log and the measured trace, and stops
every worker cleanly when one dies or hangs (naming it and its last instruction).
"""
from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from backends.calibrate import ensure_calibration
from backends.registry import measured_backends
from executor import dicomm
from executor.build import BuildDir
from executor.checkpoint import latest_complete, mark_complete
from executor.data import prepare_data
from executor.worker import STATUS_FIELDS
from h2ir.clusters.clusterfile import load_cluster
from h2ir.errors import H2Error
from h2ir.planner.simulate import SimResult, simulate_build
from h2ir.plans.dsl import load_plan
from h2ir.schedule.trace import TraceEvent, chrome_trace

HANG_AFTER_S = 5.0          # no heartbeat for this long: the worker is hung (stopped, deadlocked)


class RunFailed(Exception):
    pass


@dataclass
class RunResult:
    losses: list = field(default_factory=list)          # per step (mean over replicas)
    step_s: list = field(default_factory=list)
    tokens_per_s: list = field(default_factory=list)
    predicted_step_s: float | None = None
    transport: str = ""


def _reader(proc, wid, q):
    for line in proc.stdout:
        line = line.strip()
        if line.startswith("{"):
            try:
                q.put((wid, json.loads(line)))
                continue
            except json.JSONDecodeError:
                pass
        if line:
            q.put((wid, {"event": "log", "text": line}))
    q.put((wid, {"event": "eof"}))


def _kill_all(procs):
    for p in procs:
        if p.poll() is None:
            try:
                p.kill()
            except ProcessLookupError:
                pass
    for p in procs:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


def predicted_step_time(build: BuildDir) -> SimResult:
    """The simulator's step time for this build: its own stream files (streams/wK.txt), timed
    with the resource model and this host's calibration — the streams the workers will run."""
    plan = load_plan(str(build.path / "plan.h2plan"))
    cl = build.path / "cluster.toml"
    cluster = load_cluster(str(cl) if cl.exists() else plan.cluster)
    backends = measured_backends(cluster)
    cal = ensure_calibration(backends) if backends else None
    streams = {w: build.stream(w) for w in range(len(build.workers))}
    return simulate_build(build.model_costs(), plan, cluster, cal, streams)


@dataclass
class _Run:
    """A started run: the store, the worker processes and where they report."""
    build: BuildDir
    procs: list
    errs: list
    store: object
    run_dir: Path
    status: np.ndarray
    ckpt_dir: Path
    t0: float
    events: queue.Queue = field(default_factory=queue.Queue)


def _pick_transport(transport: str, strict: bool, out) -> str:
    if transport != "rdma":
        return transport
    usable, why = dicomm.rdma_probe()
    if usable:
        return transport
    if strict:
        raise H2Error(f"--transport rdma: {why}; refusing to fall back "
                      "(drop --strict-transport to run over shm)")
    out(f"note: {why}; falling back to shm")
    return "shm"


def _resume_point(ckpt_dir: Path, resume: bool, out) -> tuple[int, Path | None]:
    if not resume:
        return 0, None
    found = latest_complete(ckpt_dir)
    if found is None:
        raise H2Error("--resume: no complete checkpoint to resume from", str(ckpt_dir))
    out(f"resuming from {found[1]} (step {found[0]})")
    return found


def _start_workers(build: BuildDir, *, steps, start, resume_from, transport, checkpoint_every,
                   timeout, device, data, out) -> _Run:
    m = build.manifest
    W = len(build.workers)
    store = dicomm.host_store("127.0.0.1")
    secret = dicomm.new_secret()
    run_dir = Path(tempfile.mkdtemp(prefix="h2x-run-"))
    status_path = run_dir / "status.bin"
    status = np.memmap(status_path, dtype=np.float64, mode="w+", shape=(W, STATUS_FIELDS))
    status[:] = 0
    status[:, 0] = time.time()
    status.flush()
    t0 = time.perf_counter()
    env = dict(os.environ, H2_SECRET=secret, H2_T0=repr(t0), PYTHONUNBUFFERED="1")
    # Keep freed activation buffers in the heap instead of returning them to the OS: every
    # micro-batch allocates the same sizes again, and re-faulting fresh pages costs ~10 % of a
    # CPU step (glibc's dynamic mmap threshold would otherwise map large tensors anew each time).
    env.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 30))
    env.setdefault("MALLOC_TRIM_THRESHOLD_", str(1 << 31))
    kinds = ", ".join(f"w{w['id']}: stage {w['stage']} {w['backend']}" for w in build.workers)
    out(f"starting {W} worker(s) [{kinds}] over {transport}; {m['num_microbatches']} micro-batches "
        f"of {m['micro_batch']} x {m['seq_len']} per step ({m['schedule']})")
    ckpt_dir = build.path / "ckpt"
    run = _Run(build, [], [], store, run_dir, status, ckpt_dir, t0)
    for w in range(W):
        cmd = [sys.executable, "-m", "executor.worker", "--build", str(build.path), "--worker", str(w),
               "--store-port", str(store.port), "--steps", str(steps), "--start", str(start),
               "--transport", transport, "--status", str(status_path), "--run-dir", str(run_dir),
               "--checkpoint-every", str(checkpoint_every), "--checkpoint-dir", str(ckpt_dir),
               "--timeout", str(timeout)] + (["--device", device] if device else [])
        cmd += data.worker_args()
        if resume_from:
            cmd += ["--resume-from", str(resume_from)]
        err = open(run_dir / f"stderr_w{w}.txt", "w")
        run.errs.append(err)
        run.procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env))
    for w, p in enumerate(run.procs):
        threading.Thread(target=_reader, args=(p, w, run.events), daemon=True).start()
    return run


class _Progress:
    """Turns the workers' events into step lines, the JSON log and complete checkpoints."""

    def __init__(self, run: _Run, result: RunResult, steps: int, start: int, log_f, out):
        self.run, self.result, self.steps, self.start, self.log_f, self.out = \
            run, result, steps, start, log_f, out
        self.W = len(run.build.workers)
        m = run.build.manifest
        self.tokens_per_step = m["global_batch"] * m["seq_len"]
        self.step_reports: dict[int, dict] = {}
        self.ckpt_reports: dict[int, set] = {}
        self.done: set = set()
        self.ready = 0
        self.last_step_t = None

    def on_event(self, w: int, ev: dict):
        kind = ev["event"]
        if kind == "ready":
            self.result.transport = ev.get("transport", self.result.transport)
            self.ready += 1
            if self.ready == self.W:
                self.out(f"all workers connected in {time.perf_counter() - self.run.t0:.1f} s "
                         f"(transport {self.result.transport})")
        elif kind == "step":
            self.on_step(w, ev)
        elif kind == "checkpoint":
            got = self.ckpt_reports.setdefault(ev["step"], set())
            got.add(w)
            if len(got) == self.W:
                mark_complete(self.run.ckpt_dir, ev["step"])
        elif kind == "done":
            self.done.add(w)
        elif kind == "log":
            self.out(f"[w{w}] {ev['text']}")

    def on_step(self, w: int, ev: dict):
        rep = self.step_reports.setdefault(ev["step"], {"workers": set(), "losses": []})
        rep["workers"].add(w)
        if "loss" in ev:
            rep["losses"].append(ev["loss"])
        if len(rep["workers"]) < self.W:
            return
        now = time.perf_counter()
        step_s = now - (self.last_step_t if self.last_step_t is not None else self.run.t0)
        self.last_step_t = now
        loss = float(np.mean(rep["losses"]))
        tps = self.tokens_per_step / step_s
        self.result.losses.append(loss)
        self.result.step_s.append(step_s)
        self.result.tokens_per_s.append(tps)
        s = ev["step"]
        self.out(f"step {s + 1:>4}/{self.steps}  loss {loss:.4f}  tokens/s {tps:9.0f}  "
                 f"step {step_s:.3f} s" + ("  (includes start-up)" if s == self.start else ""))
        if self.log_f:
            self.log_f.write(json.dumps({"step": s + 1, "loss": loss, "tokens_per_s": tps,
                                         "step_s": step_s}) + "\n")
            self.log_f.flush()
        del self.step_reports[s]


def _supervise(run: _Run, progress: _Progress):
    """Pump worker events until every worker is done; stop them all when one fails or hangs."""
    try:
        while len(progress.done) < len(run.procs):
            try:
                w, ev = run.events.get(timeout=0.2)
            except queue.Empty:
                w, ev = None, None
            if ev is not None:
                progress.on_event(w, ev)
            _check_health(run.build, run.procs, run.status, progress.done, run.run_dir)
    except RunFailed as e:
        _kill_all(run.procs)
        raise H2Error(str(e)) from None
    except KeyboardInterrupt:
        _kill_all(run.procs)
        raise
    finally:
        for p in run.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        for e in run.errs:
            e.close()


def _predict(build: BuildDir, out) -> SimResult | None:
    try:
        sim = predicted_step_time(build)
    except H2Error as e:
        out(f"note: no prediction ({e})")
        return None
    out(f"predicted step time {sim.step_time_s:.3f} s (simulated from the build's "
        f"{len(build.workers)} stream file(s))")
    return sim


def run(build_path: str, *, steps: int = 20, data: str | None = None, json_log: str | None = None,
        trace: str | None = None, checkpoint_every: int = 0, resume: bool = False,
        transport: str = "shm", strict_transport: bool = False, timeout: float = 10.0,
        device: str | None = None, out=print, predict: bool = True, data_format: str = "auto",
        tokenizer: str | None = None, data_max_bytes: int | None = None) -> RunResult:
    build = BuildDir(build_path)
    transport = _pick_transport(transport, strict_transport, out)
    start, resume_from = _resume_point(build.path / "ckpt", resume, out)
    if start >= steps:
        out(f"nothing to do: checkpoint is at step {start}, --steps is {steps}")
        return RunResult()
    # checked (and text tokenized) here, so bad data is a located error before any worker starts
    data_spec = prepare_data(build.manifest, build.path / "data", data, data_format, tokenizer,
                             data_max_bytes, out)
    sim = _predict(build, out) if predict else None
    run_ = _start_workers(build, steps=steps, start=start, resume_from=resume_from,
                          transport=transport, checkpoint_every=checkpoint_every, timeout=timeout,
                          device=device, data=data_spec, out=out)
    result = RunResult(transport=transport)
    log_f = open(json_log, "w") if json_log else None
    try:
        _supervise(run_, _Progress(run_, result, steps, start, log_f, out))
    finally:
        if log_f:
            log_f.close()
    if trace:
        _write_trace(build, run_.run_dir, trace)
    if sim is not None and len(result.step_s) > 1:
        result.predicted_step_s = sim.step_time_s
        measured = float(np.median(result.step_s[1:]))
        err = (sim.step_time_s - measured) / measured
        out(f"step time: predicted {sim.step_time_s:.3f} s, measured {measured:.3f} s "
            f"(median of steps 2..{len(result.step_s)}), error {err:+.1%}")
    return result


def _check_health(build, procs, status, done, run_dir):
    now = time.time()
    failed = [w for w, p in enumerate(procs) if p.poll() not in (None, 0)]
    hung = [w for w, p in enumerate(procs) if p.poll() is None and w not in done
            and status[w, 3] == 0 and now - status[w, 0] > HANG_AFTER_S]
    if not failed and not hung:
        return
    if failed and not hung:
        # When one worker dies its peers fail too (their receives break): give them a moment,
        # then blame the root cause, a worker killed by a signal, before the collateral ones.
        time.sleep(0.3)
        failed = [w for w, p in enumerate(procs) if p.poll() not in (None, 0)]
    killed = [w for w in failed if procs[w].returncode < 0]
    if killed or (failed and not hung):
        w = (killed or failed)[0]
        raise RunFailed(_failure(build, w, status, run_dir,
                                 f"exited with {_describe_rc(procs[w].returncode)}"))
    w = hung[0]
    raise RunFailed(_failure(build, w, status, run_dir,
                             f"stopped responding (no heartbeat for {now - status[w, 0]:.1f} s)"))


def _describe_rc(rc: int) -> str:
    if rc < 0:
        try:
            return f"signal {signal.Signals(-rc).name}"
        except ValueError:
            return f"signal {-rc}"
    return f"exit code {rc}"


def _failure(build, w, status, run_dir, what: str) -> str:
    info = build.workers[w]
    step, pc = int(status[w, 1]), int(status[w, 2])
    try:
        instr = str(build.stream(w)[pc])
    except (IndexError, H2Error):
        instr = "?"
    msg = (f"worker w{w} (stage {info['stage']}, replica {info['replica']}, {info['backend']}) {what}; "
           f"last instruction: '{instr}' of step {step + 1}. All workers stopped.")
    tail = (run_dir / f"stderr_w{w}.txt")
    if tail.exists():
        lines = [l for l in tail.read_text().splitlines() if l.strip()][-6:]
        if lines:
            msg += "\n  worker stderr (last lines):\n    " + "\n    ".join(lines)
    return msg


def _write_trace(build, run_dir: Path, path: str):
    events = []
    names = {}
    for w in range(len(build.workers)):
        f = run_dir / f"trace_w{w}.json"
        info = build.workers[w]
        names[w] = f"w{w} stage {info['stage']} ({info['backend']})"
        if not f.exists():
            continue
        for lane, name, start, dur, step in json.loads(f.read_text()):
            events.append(TraceEvent(w, lane, name, start, dur, {"step": step + 1}))
    Path(path).write_text(json.dumps(chrome_trace(events, names, {"kind": "measured"})))
