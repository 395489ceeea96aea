"""`h2x run BUILD/`: one process per worker on this host, supervised.

The launcher hosts the rendezvous store (torch's TCPStore) and a per-run secret, starts the
workers, prints a progress line per step, writes the JSON log and the measured trace, and stops
every worker cleanly when one dies or hangs (naming it and its last instruction).
"""
from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from backends.calibrate import ensure_calibration
from backends.registry import measured_backends
from executor import dicomm
from executor.build import BuildDir
from executor.checkpoint import (build_fingerprint, complete_steps, mark_complete, prune,
                                 resume_point, run_identity)
from executor.data import prepare_mix
from executor.rundir import RunLock, run_temp_dir, writable_dir, writable_file
from executor.worker import STATUS_FIELDS
from h2ir.clusters.clusterfile import load_cluster
from h2ir.errors import H2Error, InternalError
from h2ir.planner.simulate import (SimResult, StreamDeadlock, manifest_b_fractions,
                                   program_comm_volumes, simulate_build)
from h2ir.plans.dsl import load_plan
from h2ir.schedule.devices import run_devices
from h2ir.schedule.trace import TraceEvent, chrome_trace

HANG_AFTER_S = 5.0          # no heartbeat for this long: the worker is hung (stopped, deadlocked)
STARTUP_S = 120.0           # before its first heartbeat a worker imports and loads its stage


class RunFailed(Exception):
    pass


@dataclass
class RunResult:
    losses: list = field(default_factory=list)          # per step (mean over replicas)
    step_s: list = field(default_factory=list)
    tokens_per_s: list = field(default_factory=list)
    predicted_step_s: float | None = None
    sent_bytes: list = field(default_factory=list)      # per step: worker -> {act, grad} bytes
    transport: str = ""
    moe: list = field(default_factory=list)             # per step: MoE layer -> loads (merge_moe)
    eval_losses: list = field(default_factory=list)     # (step, held-out loss)
    grad_norms: list = field(default_factory=list)      # per step: the global gradient norm
    lrs: list = field(default_factory=list)             # per step: the learning rate
    peak_memory: dict = field(default_factory=dict)     # worker -> peak bytes of live tensors


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
    q.put((wid, {"event": "eof", "t": time.time()}))     # when it exited (or closed stdout)


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


def json_line(obj) -> str:
    """One JSON-log line; a NaN or infinite number (a step the NaN guard skipped) is written as
    null, so every line is valid JSON (json.dumps would write a bare NaN)."""
    def clean(v):
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        if isinstance(v, list):
            return [clean(x) for x in v]
        return v
    return json.dumps(clean(obj), allow_nan=False) + "\n"


def open_json_log(path: str, append: bool):
    """The --json-log file, unbuffered: each line reaches the disk whole or fails as it is
    written (nothing is left in a buffer for close to fail on)."""
    return open(path, "ab" if append else "wb", buffering=0)


def tensorboard_writer(log_dir: str | None):
    """torch.utils.tensorboard's SummaryWriter on `log_dir` (logging.tensorboard), or None."""
    if not log_dir:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise H2Error("logging.tensorboard needs the tensorboard package",
                      hint="pip install tensorboard (or the h2[tensorboard] extra), or leave "
                           "logging.tensorboard unset") from None
    return SummaryWriter(log_dir=log_dir)


def run_data(build: BuildDir, cfg, out) -> dict:
    """The run's training data and evaluation settings as the workers take them (JSON): data
    sources checked against the build and text tokenized here, before any worker starts."""
    d = cfg.data
    sources = d.sources or [{"path": d.path, "format": d.format, "max_bytes": d.max_bytes}]
    if d.sources and d.path:
        raise H2Error("data.path and data.sources are both set: give one (a single path, or a "
                      "blend of sources)")
    mix = prepare_mix(build.manifest, build.path / "data", sources, tokenizer=d.tokenizer,
                      eod=d.eod_token, shuffle=d.shuffle, out=out, packing=d.packing)
    settings = {"data": mix.to_json(), "eval": None}
    e = cfg.eval
    if e.data:
        emix = prepare_mix(build.manifest, build.path / "data",
                           [{"path": e.data, "format": e.format, "max_bytes": d.max_bytes}],
                           tokenizer=d.tokenizer, eod=d.eod_token, shuffle=False, out=out,
                           what="eval data", packing=d.packing)
        settings["eval"] = {"data": emix.to_json(), "every": e.every, "steps": e.steps}
    return settings


def predicted_step_time(build: BuildDir) -> SimResult:
    """The simulator's step time for this build: its own stream files (streams/wK.txt), timed
    with the resource model and the calibration the compile used (the build's calibration.json;
    a build without one: this host's calibration file) — the streams the workers will run."""
    plan = load_plan(str(build.path / "plan.h2plan"))
    m = build.manifest                  # the plan the programs were built from, or an error
    if (len(plan.stages) != len(m["stages"]) or plan.dp != m["dp"]
            or plan.num_microbatches != m["num_microbatches"] or plan.schedule != m["schedule"]
            or [list(st.layers) for st in plan.stages] != [list(st["layers"]) for st in m["stages"]]):
        raise H2Error("the build's plan does not match its manifest (stages, layers, dp, "
                      "micro-batches or schedule differ): it was edited after h2c compile",
                      str(build.path / "plan.h2plan"), hint="recompile the build with h2c compile")
    cl = build.path / "cluster.toml"
    cluster = load_cluster(str(cl) if cl.exists() else plan.cluster)
    backends = measured_backends(cluster)
    cal = build.calibration() if backends else None   # the compile's own
    if cal is None and backends:                      # a build of an older h2c: the host's file,
        cal = ensure_calibration(backends)            # restricted to the records it used
        if "calibration_records" in m:
            cal = cal.select(m["calibration_records"])
    streams = {w: build.stream(w) for w in range(len(build.workers))}
    comm = {}                  # TP stages are timed with their programs' own collectives
    for s, st in enumerate(build.manifest["stages"]):
        if any(w["stage"] == s and w.get("tp_group") for w in build.workers):
            art = build.stage(s)
            comm[s] = program_comm_volumes(art.fwd, art.bwd)
    return simulate_build(build.model_costs(), plan, cluster, cal, streams, comm,
                          manifest_b_fractions(build.manifest["stages"]))


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
    fingerprint: str = ""           # of the build, recorded in every checkpoint's COMPLETE
    launched: float = field(default_factory=time.time)
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


def _resume_point(ckpt_dir: Path, resume: bool, fingerprint: str, num_workers: int,
                  out) -> tuple[int, Path | None]:
    if not resume:
        return 0, None
    found = resume_point(ckpt_dir, fingerprint, num_workers, out)   # verified; notes fallbacks
    out(f"resuming from {found[1]} (step {found[0]})")
    return found


def worker_log_path(build_path, w: int) -> Path:
    """Worker w's stderr of the latest run, BUILD/logs/stderr_wN.txt: failure messages point
    users at it, so it is kept after the run (the next run on the build overwrites it)."""
    return Path(build_path) / "logs" / f"stderr_w{w}.txt"


def _check_outputs(build: BuildDir, checkpoint_every: int, json_log, trace,
                   ckpt_dir: Path | None = None) -> None:
    """Every path the run writes, proven writable before any worker starts."""
    writable_dir(worker_log_path(build.path, 0).parent, "the worker log directory")
    if checkpoint_every:
        writable_dir(ckpt_dir or build.path / "ckpt", "the checkpoint directory")
    if json_log:
        writable_file(json_log, "the --json-log file")
    if trace:
        writable_file(trace, "the --trace file")


def _start_workers(build: BuildDir, *, run_dir: Path, fingerprint: str, steps, start, resume_from,
                   transport, checkpoint_every, timeout, device, data, out,
                   ckpt_dir: Path, recipe: dict, device_map: str | None = None) -> _Run:
    m = build.manifest
    W = len(build.workers)
    store = dicomm.reserve_store("127.0.0.1")   # its TCPStore starts once the workers have
    secret = dicomm.new_secret()
    status_path = run_dir / "status.bin"
    (run_dir / "recipe.json").write_text(json.dumps(recipe))
    status = np.memmap(status_path, dtype=np.float64, mode="w+", shape=(W, STATUS_FIELDS))
    status[:] = 0               # heartbeat time 0: none yet (STARTUP_S applies)
    status.flush()
    t0 = time.perf_counter()
    env = dict(os.environ, H2_SECRET=secret, H2_T0=repr(t0), PYTHONUNBUFFERED="1")
    # Keep freed activation buffers in the heap instead of returning them to the OS: every
    # micro-batch allocates the same sizes again, and re-faulting fresh pages costs ~10 % of a
    # CPU step (glibc's dynamic mmap threshold would otherwise map large tensors anew each time).
    env.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 30))
    env.setdefault("MALLOC_TRIM_THRESHOLD_", str(1 << 31))
    kinds = ", ".join(f"w{w['id']}: stage{'s' if w.get('chunks') else ''} "
                      f"{'+'.join(map(str, w.get('chunks') or [w['stage']]))} {w['backend']}"
                      for w in build.workers)
    out(f"starting {W} worker(s) [{kinds}] over {transport}; {m['num_microbatches']} micro-batches "
        f"of {m['micro_batch']} x {m['seq_len']} per step ({m['schedule']})")
    run = _Run(build, [], [], store, run_dir, status, ckpt_dir, t0, fingerprint)
    try:
        for w in range(W):
            cmd = [sys.executable, "-m", "executor.worker", "--build", str(build.path),
                   "--worker", str(w), "--store-port", str(store.port), "--steps", str(steps),
                   "--start", str(start), "--transport", transport, "--status", str(status_path),
                   "--run-dir", str(run_dir), "--checkpoint-every", str(checkpoint_every),
                   "--checkpoint-dir", str(ckpt_dir),
                   "--timeout", str(timeout), "--recipe", str(run_dir / "recipe.json")] + \
                (["--device", device] if device else []) + \
                (["--device-map", device_map] if device_map else [])
            if resume_from:
                cmd += ["--resume-from", str(resume_from)]
            err = open(worker_log_path(build.path, w), "w")
            run.errs.append(err)
            run.procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True,
                                              env=env))
        run.store = store.start()       # torch here, while the workers import theirs
    except BaseException:               # no worker outlives a launcher that failed to start them
        _kill_all(run.procs)
        for e in run.errs:
            e.close()
        store.close()
        raise
    for w, p in enumerate(run.procs):
        threading.Thread(target=_reader, args=(p, w, run.events), daemon=True).start()
    return run


class _Progress:
    """Turns the workers' events into step lines, the JSON log and complete checkpoints."""

    def __init__(self, run: _Run, result: RunResult, steps: int, start: int, log_f, out,
                 tensorboard=None, keep_last: int = 0):
        self.run, self.result, self.steps, self.start, self.log_f, self.out = \
            run, result, steps, start, log_f, out
        self.tb = tensorboard           # a SummaryWriter (logging.tensorboard), or None
        self.keep_last = keep_last      # checkpoint.keep_last
        self.W = len(run.build.workers)
        m = run.build.manifest
        self.tokens_per_step = m["global_batch"] * m["seq_len"]
        self.skipped = 0                # steps skipped by the NaN guard in this run
        self.flops_per_step, self.peak_flops = model_flops(run.build)
        self.step_reports: dict[int, dict] = {}
        self.ckpt_reports: dict[int, dict] = {}      # step -> {worker: its files' digests}
        self.ckpt_failed: set = set()
        self.eval_reports: dict[int, list] = {}   # steps a worker could not save (non-finite state)
        self.done: set = set()
        self.links: list = []
        self.ready = 0
        self.connected: set = set()     # workers that sent "ready"
        self.errors: dict = {}          # worker -> its "error" event, in arrival order
        self.eof: set = set()           # workers whose stdout has ended
        self.ended: dict = {}           # worker -> when its stdout ended (wall clock)
        self.last_step_t = None

    def on_event(self, w: int, ev: dict):
        kind = ev["event"]
        if kind == "ready":
            self.result.transport = ev.get("transport", self.result.transport)
            self.connected.add(w)
            self.ready += 1
            if self.ready == self.W:
                self.out(f"all workers connected in {time.perf_counter() - self.run.t0:.1f} s "
                         f"(requested transport {self.result.transport})")
        elif kind == "step":
            self.on_step(w, ev)
        elif kind == "checkpoint" and ev.get("nonfinite"):
            self.ckpt_failed.add(ev["step"])
            self.ckpt_reports.pop(ev["step"], None)
            self.out(f"warning: checkpoint of step {ev['step']} not saved: worker w{w}'s "
                     f"{', '.join(ev['nonfinite'][:3])} are not finite; --resume takes an "
                     "earlier one")
        elif kind == "checkpoint":
            if ev["step"] in self.ckpt_failed:
                return
            got = self.ckpt_reports.setdefault(ev["step"], {})
            got[w] = ev.get("files", {})
            if len(got) == self.W:      # every worker's files are durable: the step is complete
                mark_complete(self.run.ckpt_dir, ev["step"], self.run.fingerprint, got)
                prune(self.run.ckpt_dir, self.keep_last, self.run.fingerprint)
                del self.ckpt_reports[ev["step"]]
        elif kind == "done":
            self.done.add(w)
            self.links += ev.get("links", [])
            if len(self.done) == self.W:   # the transports the links really used, fallbacks named
                self.out(dicomm.describe_links(self.links))
                self.result.transport = ",".join(dict.fromkeys(l["transport"] for l in self.links)) \
                    or self.result.transport
        elif kind == "eval":
            got = self.eval_reports.setdefault(ev["step"], [])
            got.append(ev["loss"])
            if len(got) == self.run.build.manifest["dp"]:    # every replica's last stage
                loss = float(np.mean(got))
                self.result.eval_losses.append((ev["step"], loss))
                self.out(f"eval {ev['step']:>4}/{self.steps}  held-out loss {loss:.4f}")
                if self.log_f:
                    self.log({"step": ev["step"], "eval_loss": loss})
                if self.tb is not None:
                    self.tb.add_scalar("eval/loss", loss, ev["step"])
                    self.tb.flush()
                del self.eval_reports[ev["step"]]
        elif kind == "log":
            self.out(f"[w{w}] {ev['text']}")
        elif kind == "error":
            self.errors.setdefault(w, ev)
        elif kind == "eof":
            self.eof.add(w)
            self.ended.setdefault(w, ev.get("t", time.time()))

    def log(self, line: dict) -> None:
        """One line of the JSON log, on disk before the next; a full or failing disk stops the
        run naming the file, and leaves only whole lines."""
        data = json_line(line).encode()
        try:
            start = self.log_f.tell()
        except OSError:                 # a pipe or a terminal
            start = None
        try:
            while data:
                data = data[self.log_f.write(data):]
        except OSError as e:
            if start is not None:
                with contextlib.suppress(OSError):
                    self.log_f.truncate(start)      # no torn last line
            raise H2Error(f"cannot write the JSON log: {e.strerror or e}",
                          getattr(self.log_f, "name", None),
                          hint="free space there, or give --json-log another file") from None

    def drain(self, workers, wait_s: float = 1.0):
        """Take the events still queued, waiting (at most wait_s) until `workers`' stdout has
        ended: a worker that exited has written its error event, but it may not be read yet."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                w, ev = self.run.events.get(timeout=0.05)
                self.on_event(w, ev)
            except queue.Empty:
                if set(workers) <= self.eof or time.monotonic() > deadline:
                    return

    def on_step(self, w: int, ev: dict):
        rep = self.step_reports.setdefault(ev["step"], {"workers": set(), "losses": [],
                                                        "sent": {}, "moe": [], "memory": {}})
        rep["workers"].add(w)
        if "grad_norm" in ev:           # the same on every worker (one global all-reduce)
            rep.update(grad_norm=ev["grad_norm"], lr=ev["lr"], skipped=ev["skipped"])
        if "peak_memory" in ev:
            mem = dict(ev["peak_memory"])
            predicted = self.run.build.manifest["stages"][self.run.build.workers[w]["stage"]] \
                .get("memory", {}).get("predicted_bytes")
            if predicted is not None:
                mem["predicted"] = predicted
            rep["memory"][w] = mem
            self.result.peak_memory[w] = max(self.result.peak_memory.get(w, 0), mem["tensors"])
        if "loss" in ev:
            rep["losses"].append(ev["loss"])
        if "sent_bytes" in ev:          # boundary bytes each worker sent (TP redistribution)
            rep["sent"][w] = ev["sent_bytes"]
        if ev.get("moe"):
            rep["moe"].append(ev["moe"])
        if ev.get("a2a"):               # expert-parallel all-to-alls this worker took part in
            rep.setdefault("a2a", {})[w] = ev["a2a"]
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
        self.result.sent_bytes.append(dict(sorted(rep["sent"].items())))
        moe = merge_moe(rep["moe"])
        if moe:
            self.result.moe.append(moe)
        s = ev["step"]
        skipped = rep.get("skipped", False)
        if "grad_norm" in rep:
            self.result.grad_norms.append(rep["grad_norm"])
            self.result.lrs.append(rep["lr"])
        self.skipped += bool(skipped)
        gn = rep.get("grad_norm")
        extra = (f"  lr {rep['lr']:.3g}  grad norm {gn:.3g}" if gn is not None else "") + \
            (f"  SKIPPED (non-finite; {self.skipped} so far)" if skipped else "")
        self.out(f"step {s + 1:>4}/{self.steps}  loss {loss:.4f}{extra}  tokens/s {tps:9.0f}  "
                 f"step {step_s:.3f} s" + ("  (includes start-up)" if s == self.start else ""))
        if self.log_f:
            line = {"step": s + 1, "loss": loss, "tokens_per_s": tps, "step_s": step_s,
                    "tokens_seen": (s + 1) * self.tokens_per_step,
                    "sent_bytes": {f"w{k}": v for k, v in sorted(rep["sent"].items())}}
            if gn is not None:
                line.update(lr=rep["lr"], grad_norm=gn, skipped=skipped,
                            skipped_steps=self.skipped)
            if rep["memory"]:
                line["peak_memory"] = {f"w{k}": v for k, v in sorted(rep["memory"].items())}
            if self.flops_per_step and self.peak_flops:
                line["mfu"] = self.flops_per_step / step_s / self.peak_flops
            if moe:
                line["moe"] = moe
            if rep.get("a2a"):
                line["a2a"] = {f"w{k}": v for k, v in sorted(rep["a2a"].items())}
            self.log(line)
        if self.tb is not None:
            scalars = {"train/loss": loss, "train/tokens_per_s": tps, "train/step_s": step_s}
            if gn is not None:
                scalars.update({"train/lr": rep["lr"], "train/grad_norm": gn})
            for k, v in scalars.items():
                if math.isfinite(v):
                    self.tb.add_scalar(k, v, s + 1)
            self.tb.flush()
        del self.step_reports[s]


def model_flops(build: BuildDir) -> tuple[float | None, float | None]:
    """(model FLOPs of one step, the peak FLOP/s of the build's chips at the cluster's dtype):
    the MFU estimate's terms; a peak is None when a chip's is not known (a measured CPU)."""
    try:
        costs = build.model_costs()
        m = build.manifest
        per_mb = sum(l.fwd_flops + l.bwd_flops for l in costs.layers)
        flops = per_mb * m["global_batch"] / max(1, costs.micro_batch)
        cl = build.path / "cluster.toml"
        plan = load_plan(str(build.path / "plan.h2plan"))
        cluster = load_cluster(str(cl) if cl.exists() else plan.cluster)
        dtype = cluster.dtype
        peak = 0.0
        for st in plan.stages:
            chip = cluster.chip(st.chip)
            if getattr(chip, "measured", False) or dtype not in chip.peak_flops:
                return flops, None
            peak += chip.peak_flops[dtype] * st.chips * plan.dp
        return flops, peak or None
    except (H2Error, KeyError, AttributeError, TypeError):
        return None, None


def merge_moe(reports: list[dict]) -> dict:
    """One step's MoE layers from the workers' reports (executor/experts.py MoEState.report):
    per layer the loads summed over every worker's tokens (`load`, tokens per expert before
    dropping), dropped tokens, capacity, and on an EP stage the placement and the EP ranks'
    max/mean load (`rank_imbalance`), and what migrated."""
    from executor.experts import imbalance
    out: dict = {}
    for rep in reports:
        for layer, r in rep.items():
            m = out.setdefault(layer, {"load": [0] * len(r["load"]), "dropped": 0,
                                       "capacity": r.get("capacity")})
            m["load"] = [a + b for a, b in zip(m["load"], r["load"])]
            m["dropped"] += r["dropped"]
            for key in ("placement", "ep", "migrated"):
                if key in r:
                    m[key] = r[key]
    for m in out.values():
        loads = np.asarray(m["load"], dtype=np.float64)
        mean = loads.mean() if loads.size else 0.0
        m["expert_imbalance"] = round(float(loads.max() / mean), 4) if mean > 0 else 1.0
        if "placement" in m:
            m["rank_imbalance"] = round(imbalance(loads, m["placement"], m["ep"]), 4)
    return dict(sorted(out.items()))


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
            _check_health(run.build, run.procs, run.status, progress.done, run.run_dir,
                          progress, run.launched)
    except RunFailed as e:
        _kill_all(run.procs)
        raise H2Error(str(e)) from None
    except (H2Error, KeyboardInterrupt):    # e.g. a checkpoint's COMPLETE could not be written
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
    """The simulator's step time for the build's streams (None, with a note, when it cannot
    say); streams it finds waiting on each other are refused before any worker starts."""
    try:
        sim = predicted_step_time(build)
    except StreamDeadlock as e:
        raise H2Error(f"the build's {e.message}: every worker would wait on another until the "
                      "communication timeout; refusing to start them", str(build.path / "streams"),
                      hint="the stream files were edited, or h2c built a wrong schedule: "
                           "compile the build again with h2c compile") from None
    except H2Error as e:
        out(f"note: no prediction ({e})")
        return None
    out(f"predicted step time {sim.step_time_s:.3f} s (simulated from the build's "
        f"{len(build.workers)} stream file(s))")
    note = sim.estimate_note()
    if note:
        out(f"note: {note}")
    return sim


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the launcher's main thread so that it stops as on Ctrl-C."""


def _stops_on_sigterm(fn):
    """`fn` with SIGTERM handled like SIGINT: every worker stopped, the run's files tidied, a
    message, and exit status 143 (128 + SIGTERM)."""
    @functools.wraps(fn)
    def wrapper(*args, **kw):
        if threading.current_thread() is not threading.main_thread():
            return fn(*args, **kw)

        def terminate(signum, frame):
            signal.signal(signal.SIGTERM, signal.SIG_IGN)   # a second one must not cut cleanup
            raise Terminated()
        previous = signal.signal(signal.SIGTERM, terminate)
        try:
            return fn(*args, **kw)
        except Terminated:
            print("h2x run: stopped by SIGTERM; no worker is left running", file=sys.stderr,
                  flush=True)
            raise SystemExit(128 + signal.SIGTERM) from None
        finally:
            signal.signal(signal.SIGTERM, previous)
    return wrapper


@_stops_on_sigterm
def run(build_path: str, *, steps: int = 20, data: str | None = None, json_log: str | None = None,
        trace: str | None = None, checkpoint_every: int = 0, resume: bool = False,
        transport: str = "shm", strict_transport: bool = False, timeout: float = 10.0,
        device: str | None = None, out=print, predict: bool = True, data_format: str = "auto",
        tokenizer: str | None = None, data_max_bytes: int | None = None,
        checkpoint_dir: str | None = None, config=None,
        device_map: str | None = None) -> RunResult:
    """`config`: the job configuration (h2ir/config.py) for the recipe, evaluation and data;
    None: the build's own (train.toml) with these arguments. `device`, `device_map`: where the
    workers run (h2ir/schedule/devices.py `run_devices`)."""
    build = BuildDir(build_path)
    run_devices(build.workers, device, device_map)      # a bad map is refused before any start
    cfg = config or build.config()
    cfg.training.steps = steps
    recipe = cfg.recipe()
    ckpt_dir = Path(checkpoint_dir) if checkpoint_dir else build.path / "ckpt"
    # a second h2x run on this build or on its checkpoint directory refuses here (RunLock also
    # removes what killed writers left there)
    with RunLock(build.path, ckpt_dir if checkpoint_every or resume else None,
                 writes=bool(checkpoint_every), out=out):
        _check_outputs(build, checkpoint_every, json_log, trace, ckpt_dir)
        transport = _pick_transport(transport, strict_transport, out)
        fingerprint = build_fingerprint(build.path)
        start, resume_from = _resume_point(ckpt_dir, resume, fingerprint, len(build.workers), out)
        recipe["run"] = run_identity(fingerprint, resume_from)   # what binds its checkpoints
        if start >= steps:
            out(f"nothing to do: checkpoint is at step {start}, --steps is {steps}")
            return RunResult()
        earlier = complete_steps(ckpt_dir) if checkpoint_every and not resume else []
        if earlier:
            out(f"note: {ckpt_dir} holds checkpoints of an earlier run (steps "
                f"{', '.join(map(str, sorted(earlier)))}); this run rewrites those at the steps "
                "it checkpoints")
        # checked (and text tokenized) here, so bad data is a located error before any worker starts
        cfg.data.path, cfg.data.format, cfg.data.tokenizer = data, data_format, tokenizer
        if data_max_bytes is not None:
            cfg.data.max_bytes = data_max_bytes
        recipe.update(run_data(build, cfg, out))
        data_spec = None
        sim = _predict(build, out) if predict else None
        tb = tensorboard_writer(cfg.logging.tensorboard)
        result = RunResult(transport=transport)
        with run_temp_dir() as run_dir, \
                (open_json_log(json_log, append=False) if json_log
                 else contextlib.nullcontext()) as log_f:
            run_ = _start_workers(build, run_dir=run_dir, fingerprint=fingerprint, steps=steps,
                                  start=start, resume_from=resume_from, transport=transport,
                                  checkpoint_every=checkpoint_every, timeout=timeout,
                                  device=device, data=data_spec, out=out, ckpt_dir=ckpt_dir,
                                  recipe=recipe, device_map=device_map)
            _supervise(run_, _Progress(run_, result, steps, start, log_f, out, tb,
                                       cfg.checkpoint.keep_last))
            if trace:
                _write_trace(build, run_dir, trace)
    if sim is not None and len(result.step_s) > 1:
        result.predicted_step_s = sim.step_time_s
        measured = float(np.median(result.step_s[1:]))
        err = (sim.step_time_s - measured) / measured
        out(f"step time: predicted {sim.step_time_s:.3f} s, measured {measured:.3f} s "
            f"(median of steps 2..{len(result.step_s)}), error {err:+.1%}")
    for line in memory_summary(build, result.peak_memory):
        out(line)
    return result


def memory_summary(build, peaks: dict) -> list[str]:
    """Each worker's measured peak (live tensors: backends/memory.py) beside the resource
    model's prediction for its stage."""
    lines = []
    for w, got in sorted(peaks.items()):
        st = build.workers[w]["stage"]
        pred = build.manifest["stages"][st].get("memory", {}).get("predicted_bytes")
        vs = f", predicted {pred / 2**20:.1f} MiB ({got / pred - 1:+.1%})" if pred else ""
        lines.append(f"memory: w{w} (stage {st}) peak {got / 2**20:.1f} MiB of live tensors{vs}")
    return lines


def _check_health(build, procs, status, done, run_dir, progress=None, launched: float = 0.0):
    now = time.time()
    failed = [w for w, p in enumerate(procs) if p.poll() not in (None, 0)]

    def silent(w) -> float:             # since its last heartbeat, or its start
        return now - (status[w, 0] or launched or now)
    hung = [w for w, p in enumerate(procs) if p.poll() is None and w not in done
            and status[w, 3] == 0
            and silent(w) > (HANG_AFTER_S if status[w, 0] else STARTUP_S)]
    if not failed and not hung:
        return
    if failed and not hung:
        # When one worker dies its peers fail too (their receives break): give them a moment,
        # then blame the root cause before the collateral ones.
        time.sleep(0.3)
        failed = [w for w, p in enumerate(procs) if p.poll() not in (None, 0)]
    errors, connected, ended = {}, None, {}
    if progress is not None:
        progress.drain(failed)
        errors, connected, ended = progress.errors, progress.connected, progress.ended
    w = _root_cause(procs, failed, errors, ended, hung)
    after = _consequences(errors, w)
    if w in errors and (errors[w].get("kind") != "comm" or not hung):
        _raise_worker_error(build, w, errors, connected, status, after)
    what = f"exited with {_describe_rc(procs[w].returncode)}" if w in failed else \
        f"stopped responding (no heartbeat for {silent(w):.1f} s)"
    raise RunFailed(_failure(build, w, status, run_dir, what, connected) + after)


def _root_cause(procs, failed: list, errors: dict, ended: dict, hung: list) -> int:
    """The worker whose own failure stopped the run. A worker that reported its own error (not a
    broken link), or that died without a word (killed, crashed), failed by itself; its peers'
    broken links are what followed. Among several, the earliest: the time its error event says,
    or when its output ended. Without one, a hung worker (its peers' receives time out on it),
    else the first broken link reported."""
    def t(w) -> float:
        ev = errors.get(w)
        if ev is not None and isinstance(ev.get("t"), (int, float)):
            return float(ev["t"])
        return ended.get(w, math.inf)
    roots = [w for w in errors if errors[w].get("kind") != "comm"] + \
        [w for w in failed if w not in errors]
    if roots:
        return min(roots, key=lambda w: (t(w), roots.index(w)))
    if hung:
        return hung[0]
    return next((w for w in errors if w in failed), failed[0])


def _consequences(errors: dict, root: int) -> str:
    """The broken links other workers reported after `root` failed, one line each."""
    lines = [f"then w{w}: {str(ev.get('message', '')).splitlines()[0][:200]}"
             for w, ev in errors.items() if w != root and ev.get("kind") == "comm"][:4]
    return "".join(f"\n  {line}" for line in lines)


def _raise_worker_error(build, w, errors, connected, status, after: str = ""):
    """Worker w's own error event as the run's error: its located message, then which worker
    said it and when (start-up, or the instruction it was at); `after`: what followed in its
    peers (`_consequences`)."""
    ev = errors[w]
    info = build.workers[w]
    who = f"worker w{w} (stage {info['stage']}, replica {info['replica']}, {info['backend']})"
    when = "during start-up" if connected is not None and w not in connected else \
        f"at '{_instruction(build, w, status)}' of step {int(status[w, 1]) + 1}"
    context = f"reported by {who} {when}; all workers stopped"
    if ev.get("kind") == "internal":
        raise InternalError(f"h2x run: {who}", str(ev.get("message", "")), ev.get("report"),
                            f"{when}; all workers stopped; its log: "
                            f"{worker_log_path(build.path, w)}" + after)
    if ev.get("kind") == "os":
        context += f"; its log: {worker_log_path(build.path, w)}"
    hint = "\n  ".join(h for h in (ev.get("hint"), context) if h) + after
    raise H2Error(str(ev.get("message", "failed")), ev.get("file"), ev.get("line"),
                  ev.get("col"), hint=hint)


def _instruction(build, w, status) -> str:
    try:
        return str(build.stream(w)[int(status[w, 2])])
    except (IndexError, H2Error):
        return "?"


def _describe_rc(rc: int) -> str:
    if rc < 0:
        try:
            return f"signal {signal.Signals(-rc).name}"
        except ValueError:
            return f"signal {-rc}"
    return f"exit code {rc}"


def _failure(build, w, status, run_dir, what: str, connected=None) -> str:
    info = build.workers[w]
    step = int(status[w, 1])
    if connected is not None and w not in connected:      # it never reached its first instruction
        where = "during start-up (before it connected to its peers)"
    else:
        where = f"last instruction: '{_instruction(build, w, status)}' of step {step + 1}"
    msg = (f"worker w{w} (stage {info['stage']}, replica {info['replica']}, {info['backend']}) {what}; "
           f"{where}. All workers stopped.")
    tail = worker_log_path(build.path, w)
    if tail.exists():
        # its last words, without traceback frames (the full log has them)
        lines = [l for l in tail.read_text(errors="replace").splitlines() if l.strip()
                 and not l.startswith((" ", "\t", "Traceback"))][-6:]
        if lines:
            msg += "\n  worker stderr (last lines):\n    " + "\n    ".join(lines)
        msg += f"\n  full log: {tail}"
    return msg


def _write_trace(build, run_dir: Path, path: str):
    traces = {}
    for w in range(len(build.workers)):
        f = run_dir / f"trace_w{w}.json"
        if f.exists():
            traces[w] = json.loads(f.read_text())
    write_trace(build, traces, path)


def write_trace(build, traces: dict, path: str):
    """The measured Chrome/Perfetto trace from each worker's trace list (Worker.trace: lane,
    name, start, duration, step[, counters]); a worker missing from `traces` has no events."""
    events = []
    names = {}
    for w in range(len(build.workers)):
        info = build.workers[w]
        names[w] = f"w{w} stage {info['stage']} ({info['backend']})"
        for lane, name, start, dur, step, *counters in traces.get(w, ()):
            events.append(TraceEvent(w, lane, name, start, dur,
                                     counters[0] if counters else {"step": step + 1}))
    try:
        Path(path).write_text(json.dumps(chrome_trace(events, names, {"kind": "measured"})))
    except OSError as e:
        raise H2Error(f"cannot write the trace: {e.strerror or e}", str(path),
                      hint="free space there, or give --trace another file") from None
