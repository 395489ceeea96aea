"""Calibration: the artifact that carries measured speeds to the planner (data only).

Nothing here measures. Backends measure themselves (`backends/calibrate.py`: single-thread fp32
matmul FLOP/s at a few sizes and copy bandwidth, per backend), the frontend measures a model's
layer programs (`frontend/profile.py`), and both write this file. The resource model
(`h2ir/planner/resource/`) reads a `Calibration` value passed in for chips marked `measured`
(the local CPU clusters) instead of catalog peaks; a measured chip without one is an error, so a
plan for a local cluster never rests on made-up figures.

Trust. A measurement is only as good as the conditions it was taken in, so every record says
where, when and with what it was taken, and a record is used only while those still hold:

* backend speeds (`backends[b]`) carry the host, the date and the software versions;
* measured layer times are *records* keyed by what was measured — the model file's content
  (SHA-256) and `build_model` arguments, micro-batch, sequence length, dtype, backend, threads,
  and the co-location they were measured under — and carry host, date, software versions and
  the spread of their repetitions.

Co-location. Workers that share a host's cores slow each other (shared caches, memory
bandwidth, time slicing past the cores; on accelerator hosts the dispatch cores and PCIe), so a
record is measured with as many processes at once as the cluster puts on one set of shared
cores (`Cluster.colocation`), and at fewer: each kind's times at n processes at once
(`levels`). `contention(curve, n, cores)` reads a record's slow-down at n computing workers
(`contention_curve`); the simulator applies it to each compute by how many of its host's
workers compute meanwhile (h2ir/planner/simulate.py), so a pipeline's bubbles let the others
run faster, as they do.

`problems(record)` says why a record cannot be trusted here: another host (`foreign`), older than
`MAX_AGE_DAYS` or measured under other torch/numpy versions (`stale`), repetitions that did not
settle (`noisy`). The planner never uses such a record (`layer_time` skips it); the drivers
re-measure it or report it (`backends/calibrate.py`, `frontend/compiler.py ensure_layer_times`).
A layer-time record costs a layer only when the layer is the one measured — same kind,
parameters, sequence length and FLOPs per sample — at the micro-batch measured, between two
measured micro-batches linearly, or scaled linearly from the nearest one; one
model's timings are never stretched by a FLOP ratio over another model's layers (a 6 M-parameter
block measured at 8 tokens says nothing about the same kind at 128 tokens).

File: $H2_CALIBRATION, else ~/.cache/h2/calibration.json. Format (JSON, version 2):

    {"version": 2, "created": "...", "host": {...},
     "backends": {"torch": {"threads": 1, "dtype": "fp32", "matmul": {"512": FLOP/s, ...},
                            "matmul_flops": FLOP/s, "mem_bw": B/s, "opt_bw": B/s, "quick": false,
                            "measured_at": "...", "host": {...}, "software": {...}}, ...},
     "layer_records": {"<id>": {"key": {"model", "model_sha256", "args", "micro_batch",
                                        "seq_len", "dtype", "backend", "threads", "workers",
                                        "colocation": {"cores", "backends": {b: n}}},
                                "host": {...}, "software": {...}, "measured_at": "...",
                                "reps": n, "rounds": r, "spread": max relative spread,
                                "colocation": {"cores", "backends", "levels": [1, ..., k],
                                               "pinned"},
                                "layers": {kind: {"fwd_s", "bwd_s", "fwd_flops", "bwd_flops",
                                                  "params", "fwd_spread", "bwd_spread",
                                                  "layer", "count",
                                                  "levels": {"n": [fwd_s, bwd_s]}}}}}}

`fwd_s` / `bwd_s` are a kind's times with all k processes at once; `levels` its times with n
at once (n = 1: alone), `count` how many layers of the kind the model has. A kind's time alone
is read as `fwd_s` / `bwd_s` over the whole chain's slow-down at k (`contention_curve`): one
small layer's own ratio is mostly noise.

A version-1 file (layer times keyed only by layer kind, with the model's *name*) is read with its
backend speeds; its layer times are dropped, and `notes` says so.
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import platform
from dataclasses import dataclass, field
from pathlib import Path

from h2ir.errors import H2Error

VERSION = 2
MAX_AGE_DAYS = 30          # a chosen bound: OS, BIOS and library updates land on that scale
MAX_SPREAD = 0.15          # repetitions whose (p90 - p10) / median exceeds this did not settle
TIME_FORMAT = "%Y-%m-%dT%H:%M:%S"


def calibration_path() -> Path:
    env = os.environ.get("H2_CALIBRATION")
    if env:
        return Path(env)
    return Path.home() / ".cache" / "h2" / "calibration.json"


def record_sharing(rec: dict) -> float:
    """cores / measuring processes of a layer-time record measured before co-location levels,
    at most 1: its processes ran at once, so with more of them than cores each got that share
    of one."""
    cores = rec.get("cores") or (rec.get("host") or {}).get("cpu_count") or 1
    procs = (rec.get("key") or {}).get("workers") or cores
    return min(1.0, cores / procs)


def micro_batch_time(by_mb: dict, micro_batch: int):
    """A layer's times at `micro_batch` from its measurements at several micro-batches
    ({mb: (seconds, ...)}: each entry's times are read alike), or None: the exact one; between
    two measured micro-batches, linear between the nearest pair (a layer's time is affine in its
    rows: a fixed per-call part — dispatch, small reductions — plus a per-row part, and a larger
    micro-batch runs the matmuls at a better rate); outside them, scaled linearly from the
    nearest (all a single measurement can say)."""
    if not by_mb:
        return None
    if micro_batch in by_mb:
        return tuple(by_mb[micro_batch])
    lo = max((b for b in by_mb if b < micro_batch), default=None)
    hi = min((b for b in by_mb if b > micro_batch), default=None)
    if lo is not None and hi is not None:
        w = (micro_batch - lo) / (hi - lo)
        return tuple(x + w * (y - x) for x, y in zip(by_mb[lo], by_mb[hi]))
    near = lo if hi is None else hi
    return tuple(x * micro_batch / near for x in by_mb[near])


def colocation_key(cores: int, backends: dict) -> dict:
    """How a layer-time record's key states its co-location: `cores` shared by measuring
    processes of these backends ({backend: processes}, `Cluster.colocation`)."""
    return {"cores": int(cores), "backends": {b: int(backends[b]) for b in sorted(backends)}}


def record_levels(rec: dict) -> dict[int, float]:
    """{n: seconds of one micro-batch through every layer of the model, forward and backward,
    with n measuring processes at once} of a layer-time record ({} for one measured without
    co-location levels)."""
    out: dict[int, float] = {}
    layers = rec.get("layers") or {}
    levels = {int(n) for m in layers.values() for n in (m.get("levels") or {})}
    for n in levels:
        if all(str(n) in (m.get("levels") or {}) for m in layers.values()):
            out[n] = sum(m.get("count", 1) * sum(m["levels"][str(n)]) for m in layers.values())
    return out


def contention_curve(rec: dict) -> dict[int, float]:
    """{n: how much slower a worker computes with n of its host's workers computing at once
    than alone} from a record's levels; non-decreasing and at least 1 (a faster figure beside
    more neighbours is noise). {1: 1.0} for a record without levels."""
    lv = record_levels(rec)
    if 1 not in lv or lv[1] <= 0:
        return {1: 1.0}
    out, top = {}, 1.0
    for n in sorted(lv):
        top = max(top, lv[n] / lv[1])
        out[n] = top
    return out


def contention(curve: dict, n: float, cores: int) -> float:
    """The slow-down of a compute overlapped on average by `n` computing workers of its host
    (itself included) on `cores` shared cores: the measured curve, linear between its points;
    past the last measured point (m workers), time sharing of the cores on top:
    curve[m] x max(1, n / max(m, cores)). The curve {1: 1.0} is pure time sharing."""
    pts = sorted(curve.items())
    if n <= pts[0][0]:
        return pts[0][1]
    for (a, fa), (b, fb) in zip(pts, pts[1:]):
        if n <= b:
            return fa + (fb - fa) * (n - a) / (b - a)
    m, fm = pts[-1]
    return fm * max(1.0, n / max(m, cores))


def host_info() -> dict:
    """What identifies the machine a measurement belongs to. `boot_id` names the running
    kernel: processes in other network/UTS namespaces of the same machine (the emulated hosts
    of examples/testbed, each with its own hostname) share it, and so share the hardware."""
    return {"node": platform.node(), "machine": platform.machine(),
            "processor": platform.processor() or platform.machine(), "cpu_model": _cpu_model(),
            "system": platform.system(), "cpu_count": os.cpu_count(),
            "python": platform.python_version(), "boot_id": _boot_id()}


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or ""


_HOST_KEYS = ("node", "machine", "cpu_model", "cpu_count")


def now_str() -> str:
    return _dt.datetime.now().strftime(TIME_FORMAT)


def layer_key(model: str, model_sha256: str, args: dict, micro_batch: int, seq_len: int,
              dtype: str, backend: str, threads: int = 1) -> dict:
    """What a layer-time record was measured for; `record_id` hashes it."""
    return {"model": model, "model_sha256": model_sha256, "args": dict(sorted(args.items())),
            "micro_batch": int(micro_batch), "seq_len": int(seq_len), "dtype": dtype,
            "backend": backend, "threads": int(threads)}


def record_id(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]


def problems(rec: dict, *, host: dict | None = None, software: dict | None = None,
             now: _dt.datetime | None = None, max_age_days: float = MAX_AGE_DAYS) -> list[str]:
    """Why `rec` (a backend-speed or layer-time record) cannot be trusted on this host now; []
    when it can. `software` is the running torch/numpy versions (the backends layer knows them);
    None skips that check."""
    out = _foreign(rec, host if host is not None else host_info())
    out += _stale(rec, now, max_age_days)
    if software is not None:
        sw = rec.get("software") or {}
        changed = [k for k in software if sw.get(k) != software[k]]
        if changed:
            out.append("stale: measured under other versions (" + ", ".join(
                f"{k} {sw.get(k)} here {software[k]}" for k in changed) + ")")
    if rec.get("spread") is not None and rec["spread"] > MAX_SPREAD:
        out.append(f"noisy: repetitions spread {rec['spread']:.0%} (bound {MAX_SPREAD:.0%})")
    return out


def _foreign(rec: dict, host: dict) -> list[str]:
    """`problems` of a record measured on another host (or on none it names)."""
    theirs = rec.get("host") or {}
    diff = [k for k in _HOST_KEYS if k in theirs and theirs.get(k) != host.get(k)]
    if theirs.get("boot_id") and theirs.get("boot_id") == host.get("boot_id"):
        diff = [k for k in diff if k != "node"]     # same kernel: another namespace's hostname
    if not theirs:
        return ["foreign: it records no host"]
    if diff:
        return ["foreign: measured on another host (" + ", ".join(
            f"{k} {theirs.get(k)!r} here {host.get(k)!r}" for k in diff) + ")"]
    return []


def _stale(rec: dict, now: _dt.datetime | None, max_age_days: float) -> list[str]:
    """`problems` of a record without a date, older than `max_age_days`, or from the future."""
    at = rec.get("measured_at")
    try:
        when = _dt.datetime.strptime(at, TIME_FORMAT) if at else None
    except (TypeError, ValueError):
        when = None
    if when is None:
        return ["stale: it records no date"]
    age = ((now or _dt.datetime.now()) - when).total_seconds() / 86400
    if age > max_age_days:
        return [f"stale: measured {age:.0f} days ago (bound {max_age_days:g})"]
    if age < -1:
        return [f"stale: dated {at}, in the future"]
    return []


@dataclass
class Calibration:
    backends: dict = field(default_factory=dict)
    # hand-given layer times {backend: {kind: {fwd_s, bwd_s, micro_batch, seq_len, fwd_flops?}}}:
    # used as given (tests, what-ifs); files carry keyed `records` instead
    layer_times: dict = field(default_factory=dict)
    records: dict = field(default_factory=dict)          # id -> keyed layer-time record
    created: str = ""
    host: dict = field(default_factory=dict)
    path: str | None = None
    notes: list = field(default_factory=list)            # what was dropped, re-measured, distrusted
    selected: frozenset | None = None                    # record ids the planner may use (None: any)
    distrusted: dict = field(default_factory=dict)       # id -> problems (set by `check`)

    def has_backend(self, backend: str) -> bool:
        return backend in self.backends

    def _backend(self, backend: str) -> dict:
        try:
            return self.backends[backend]
        except KeyError:
            raise H2Error(f"no calibration for backend {backend!r} in {self.path or 'memory'}",
                          hint="run `h2c profile --backend all` on the machine that runs it")

    def matmul_flops(self, backend: str) -> float:
        """Achievable single-thread fp32 FLOP/s: the best over the measured matmul sizes."""
        return float(self._backend(backend)["matmul_flops"])

    def mem_bw(self, backend: str) -> float:
        return float(self._backend(backend)["mem_bw"])

    def opt_bw(self, backend: str) -> float | None:
        """The backend's AdamW step in state bytes per second (None: a record from before it
        was measured; the copy bandwidth stands in)."""
        v = self._backend(backend).get("opt_bw")
        return float(v) if v else None

    # -- trust ---------------------------------------------------------------------------------
    def check(self, *, host: dict | None = None, software: dict | None = None,
              now: _dt.datetime | None = None) -> "Calibration":
        """Mark every layer-time record that cannot be trusted here (`distrusted`: foreign or
        stale; the planner skips those) and report every problem, noisy ones included, in
        `notes` (a noisy record is still the best measurement there is; the compiler measures
        it again). Returns self."""
        self.distrusted = {}
        for rid, rec in self.records.items():
            p = problems(rec, host=host, software=software, now=now)
            if any(not x.startswith("noisy") for x in p):
                self.distrusted[rid] = p
            if p:
                k = rec.get("key", {})
                used = "used, but" if rid not in self.distrusted else "not used:"
                self.notes.append(f"layer times of {k.get('model')} on {k.get('backend')} "
                                  f"(micro-batch {k.get('micro_batch')} x {k.get('seq_len')}) "
                                  f"{used} {'; '.join(p)}")
        return self

    def select(self, ids) -> "Calibration":
        """Restrict the planner to these layer-time records (the driver's exact model key)."""
        self.selected = frozenset(ids)
        return self

    def usable_records(self, backend: str, colocation: dict | None = None) -> list[dict]:
        """Trusted records of `backend` the planner may use, newest first; with `colocation`
        (`colocation_key`), only those measured under it (or before records said)."""
        out = [r for rid, r in self.records.items()
               if r.get("key", {}).get("backend") == backend and rid not in self.distrusted
               and (self.selected is None or rid in self.selected)
               and (colocation is None or r["key"].get("colocation", colocation) == colocation)]
        return sorted(out, key=lambda r: r.get("measured_at", ""), reverse=True)

    # -- layer times ---------------------------------------------------------------------------
    def layer_time(self, backend: str, layer, micro_batch: int, seq_len: int,
                   solo: bool = False, colocation: dict | None = None):
        """(fwd_s, bwd_s) for `layer` (a LayerCost at `micro_batch` x `seq_len`), or None.

        From a trusted record of the same layer (kind, parameters, sequence length and FLOPs per
        sample all equal): at a measured micro-batch exactly, else as `micro_batch_time` says
        from the measured ones; hand-given `layer_times` are
        scaled by their FLOP ratio, else by tokens. Without `solo`, the times with every
        co-located process computing (the record's co-location). `solo`: the times alone
        (over the record's slow-down at its co-location), for a simulator that applies the
        co-location itself (`contention_curve`); a record measured before levels, with more
        processes at once than cores, is taken at one process per core (x cores / processes:
        `record_sharing`). `colocation`: only records measured under it (`usable_records`)."""
        got = self._layer_time(backend, layer, micro_batch, seq_len, colocation)
        if got is None:
            return None
        return got[2:] if solo else got[:2]

    def contention_curve(self, backend: str, micro_batch: int, colocation: dict | None = None,
                         layer=None, seq_len: int | None = None) -> dict[int, float]:
        """The co-location slow-down curve (`contention_curve`) of the newest trusted record of
        `backend` measured with levels (under `colocation`, and holding `layer` at `seq_len`,
        if given: the model's own), at the micro-batch nearest `micro_batch`; {1: 1.0} without
        one (pure time sharing)."""
        recs = [r for r in self.usable_records(backend, colocation) if record_levels(r)
                and (layer is None or (r["key"]["seq_len"] == seq_len and any(
                    m.get("kind", k) == layer.kind and m.get("params") == layer.params
                    for k, m in r["layers"].items())))]
        if not recs:
            return {1: 1.0}
        best = min(recs, key=lambda r: abs(r["key"]["micro_batch"] - micro_batch))
        return contention_curve(best)

    def _layer_time(self, backend: str, layer, micro_batch: int, seq_len: int,
                    colocation: dict | None = None):
        rec = self.layer_times.get(backend, {}).get(layer.kind)
        if rec:
            if rec.get("fwd_flops") and layer.fwd_flops:
                rf = layer.fwd_flops / rec["fwd_flops"]
                rb = layer.bwd_flops / rec["bwd_flops"] if rec.get("bwd_flops") else rf
            else:
                rf = rb = (micro_batch * seq_len) / (rec["micro_batch"] * rec["seq_len"])
            return rec["fwd_s"] * rf, rec["bwd_s"] * rb, rec["fwd_s"] * rf, rec["bwd_s"] * rb
        # micro-batch -> (all at once, alone) times of the newest matching record
        by_mb: dict[int, tuple] = {}
        for r, m in self._entries(backend, layer.kind, colocation):
            k = r["key"]
            if k["seq_len"] != seq_len or m.get("params") != layer.params:
                continue
            if abs(m["fwd_flops"] * micro_batch / k["micro_batch"] - layer.fwd_flops) > \
                    1e-6 * max(1, layer.fwd_flops):
                continue
            curve = contention_curve(r)
            # alone: the co-located times over the record's slow-down at its co-location
            # (the whole chain's, steadier than one small layer's); a record from before
            # levels, at one process per core
            share = 1.0 / curve[max(curve)] if len(curve) > 1 else record_sharing(r)
            by_mb.setdefault(k["micro_batch"], (m["fwd_s"], m["bwd_s"], m["fwd_s"] * share,
                                                m["bwd_s"] * share))
        return micro_batch_time(by_mb, micro_batch)

    def _entries(self, backend: str, kind: str, colocation: dict | None = None):
        """(record, entry) of every trusted record's layer entries of `kind`: one per distinct
        layer structure of that kind (frontend/profile.py `layer_variants`), keyed by the kind
        itself where the model has one."""
        for r in self.usable_records(backend, colocation):
            for key, m in r["layers"].items():
                if m.get("kind", key) == kind:
                    yield r, m

    def add_record(self, rec: dict) -> str:
        rid = record_id(rec["key"])
        self.records[rid] = rec
        self.distrusted.pop(rid, None)
        return rid

    # -- file ----------------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {"version": VERSION, "created": self.created, "host": self.host,
                "backends": self.backends, "layer_records": self.records}

    @classmethod
    def from_json(cls, d: dict, path: str | None = None) -> "Calibration":
        v = d.get("version")
        if v not in (1, VERSION):
            raise H2Error(f"calibration file has version {v!r}, expected {VERSION}",
                          file=path, hint="delete it and run `h2c profile`")
        for key in ("backends", "layer_records", "host"):
            part = d.get(key, {})
            inner = part.values() if key != "host" and isinstance(part, dict) else ()
            if not isinstance(part, dict) or not all(isinstance(r, dict) for r in inner):
                raise H2Error(f"calibration file: '{key}' is not a JSON object"
                              + (" of objects" if key != "host" else "")
                              + f" (got {json.dumps(part)[:40]})", file=path,
                              hint="delete it and run `h2c profile`")
        cal = cls(backends=dict(d.get("backends", {})), records=dict(d.get("layer_records", {})),
                  created=d.get("created", ""), host=dict(d.get("host", {})), path=path)
        if v == 1:
            # version 1 stored no host per backend: the file's host stands for it
            for rec in cal.backends.values():
                rec.setdefault("host", cal.host)
            if d.get("layer_times"):
                cal.notes.append("layer times of a version-1 calibration dropped: they were keyed "
                                 "by the model's name only (they are re-measured when needed)")
        return cal


def load_calibration(path: str | Path | None = None) -> Calibration | None:
    p = Path(path) if path else calibration_path()
    if not p.exists():
        return None
    try:
        d = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise H2Error(f"cannot read calibration: {e}", file=str(p),
                      hint="delete it and run `h2c profile`")
    if not isinstance(d, dict):
        raise H2Error("calibration file is not a JSON object", file=str(p),
                      hint="delete it and run `h2c profile`")
    return Calibration.from_json(d, str(p)).check()


def save_calibration(cal: Calibration, path: str | Path | None = None) -> Path:
    p = Path(path) if path else (Path(cal.path) if cal.path else calibration_path())
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(p.suffix + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(cal.to_json(), indent=1, sort_keys=True) + "\n")
    tmp.replace(p)    # atomic: concurrent planners never read half a file
    cal.path = str(p)
    return p


def record_layer_times(backend: str, kind: str, fwd_s: float, bwd_s: float, micro_batch: int,
                       seq_len: int, *, fwd_flops: int | None = None, bwd_flops: int | None = None,
                       params: int | None = None, model: str | None = None,
                       path: str | Path | None = None, software: dict | None = None) -> Calibration:
    """Store one layer kind's measured forward/backward seconds as a keyed record (model by
    name only: prefer `store_layer_record` with the model file's digest)."""
    if fwd_s <= 0 or bwd_s <= 0 or micro_batch <= 0 or seq_len <= 0:
        raise H2Error(f"layer times must be positive (got fwd {fwd_s}, bwd {bwd_s}, "
                      f"micro-batch {micro_batch}, seq {seq_len})")
    key = layer_key(model or "?", "", {"kind": kind}, micro_batch, seq_len, "fp32", backend)
    rec = {"key": key, "host": host_info(), "software": software or {}, "measured_at": now_str(),
           "reps": 1, "spread": None,
           "layers": {kind: {"fwd_s": float(fwd_s), "bwd_s": float(bwd_s),
                             "fwd_flops": int(fwd_flops or 0), "bwd_flops": int(bwd_flops or 0),
                             "params": params}}}
    return store_layer_record(rec, path)


def store_layer_record(rec: dict, path: str | Path | None = None) -> Calibration:
    """Add (or replace: same key) a layer-time record in the calibration file."""
    cal = load_calibration(path) or Calibration()
    cal.add_record(rec)
    save_calibration(cal, path)
    return cal
