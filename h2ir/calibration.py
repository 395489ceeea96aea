"""Calibration: what the local chips really achieve, measured, stored as JSON.

`h2c profile` measures, per backend (torch, numpy), single-thread fp32 matmul FLOP/s at a few
sizes and copy bandwidth. Single thread, because every executor worker runs with one thread.
The resource model (`h2ir/resource.py`) uses these numbers for chips marked `measured` (the
local CPU clusters) instead of catalog peaks; when none is stored it runs a quick (< 2 s)
measurement and caches it, so plans for local clusters never rest on made-up figures.

Measured per-layer forward/backward times (`layer_times[backend][kind]`) are recorded by the
compiler/executor through `record_layer_times`; the resource model prefers them when present.

File: $H2_CALIBRATION, else ~/.cache/h2/calibration.json. Format (JSON):

    {"version": 1, "created": "...", "host": {...},
     "backends": {"torch": {"threads": 1, "dtype": "fp32", "matmul": {"512": FLOP/s, ...},
                            "matmul_flops": FLOP/s, "mem_bw": B/s, "quick": false}, ...},
     "layer_times": {"torch": {"transformer_block": {"fwd_s": .., "bwd_s": .., "micro_batch": ..,
                                                     "seq_len": .., "fwd_flops": ..?}}}}
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .errors import H2Error

VERSION = 1
BACKENDS = ("torch", "numpy")
FULL_SIZES = (512, 1024, 2048)
QUICK_SIZES = (256, 512)


def calibration_path() -> Path:
    env = os.environ.get("H2_CALIBRATION")
    if env:
        return Path(env)
    return Path.home() / ".cache" / "h2" / "calibration.json"


@dataclass
class Calibration:
    backends: dict = field(default_factory=dict)
    layer_times: dict = field(default_factory=dict)
    created: str = ""
    host: dict = field(default_factory=dict)
    path: str | None = None

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

    def layer_time(self, backend: str, layer, micro_batch: int, seq_len: int):
        """(fwd_s, bwd_s) for `layer` (a LayerCost) from recorded layer times of its kind, or None.

        Scaled by the FLOP ratio when the record carries FLOPs (so one model's block timing can
        cost another's), else linearly by tokens."""
        rec = self.layer_times.get(backend, {}).get(layer.kind)
        if not rec:
            return None
        if rec.get("fwd_flops") and layer.fwd_flops:
            rf = layer.fwd_flops / rec["fwd_flops"]
            rb = layer.bwd_flops / rec["bwd_flops"] if rec.get("bwd_flops") else rf
        else:
            rf = rb = (micro_batch * seq_len) / (rec["micro_batch"] * rec["seq_len"])
        return rec["fwd_s"] * rf, rec["bwd_s"] * rb

    def to_json(self) -> dict:
        return {"version": VERSION, "created": self.created, "host": self.host,
                "backends": self.backends, "layer_times": self.layer_times}

    @classmethod
    def from_json(cls, d: dict, path: str | None = None) -> "Calibration":
        if d.get("version") != VERSION:
            raise H2Error(f"calibration file has version {d.get('version')!r}, expected {VERSION}",
                          file=path, hint="delete it and run `h2c profile`")
        return cls(backends=dict(d.get("backends", {})), layer_times=dict(d.get("layer_times", {})),
                   created=d.get("created", ""), host=dict(d.get("host", {})), path=path)


def load_calibration(path: str | Path | None = None) -> Calibration | None:
    p = Path(path) if path else calibration_path()
    if not p.exists():
        return None
    try:
        d = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise H2Error(f"cannot read calibration: {e}", file=str(p),
                      hint="delete it and run `h2c profile`")
    return Calibration.from_json(d, str(p))


def save_calibration(cal: Calibration, path: str | Path | None = None) -> Path:
    p = Path(path) if path else (Path(cal.path) if cal.path else calibration_path())
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(p.suffix + ".tmp")
    tmp.write_text(json.dumps(cal.to_json(), indent=1, sort_keys=True) + "\n")
    tmp.replace(p)    # atomic: concurrent planners never read half a file
    cal.path = str(p)
    return p


def host_info() -> dict:
    return {"machine": platform.machine(), "processor": platform.processor() or platform.machine(),
            "system": platform.system(), "cpu_count": os.cpu_count(), "python": platform.python_version()}


# ----------------------------------------------------------------------------------------------
# measurement

def _time_reps(fn, min_time: float, max_reps: int) -> float:
    """Seconds per call: one warm-up, then repeat until min_time has passed (best of batches)."""
    fn()
    best = float("inf")
    total, reps = 0.0, 0
    while reps < max_reps and (total < min_time or reps < 2):
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        best = min(best, dt)
        total += dt
        reps += 1
    return best


def _measure_torch(sizes, mem_mib: int, min_time: float) -> dict:
    import torch
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = {}
        for n in sizes:
            a = torch.randn(n, n, dtype=torch.float32)
            b = torch.randn(n, n, dtype=torch.float32)
            c = torch.empty(n, n, dtype=torch.float32)
            dt = _time_reps(lambda: torch.mm(a, b, out=c), min_time, 50)
            out[str(n)] = 2.0 * n ** 3 / dt
        numel = mem_mib * 2**20 // 4
        src = torch.ones(numel, dtype=torch.float32)
        dst = torch.empty_like(src)
        dt = _time_reps(lambda: dst.copy_(src), min_time, 50)
        bw = 2.0 * numel * 4 / dt      # a copy reads and writes every byte
    finally:
        torch.set_num_threads(prev)
    return {"matmul": out, "mem_bw": bw}


_NUMPY_SCRIPT = r"""
import json, sys, time
import numpy as np
sizes, mem_mib, min_time = json.loads(sys.argv[1])
def reps(fn):
    fn(); best = float("inf"); total = 0.0; n = 0
    while n < 50 and (total < min_time or n < 2):
        t0 = time.perf_counter(); fn(); dt = time.perf_counter() - t0
        best = min(best, dt); total += dt; n += 1
    return best
out = {}
for n in sizes:
    a = np.random.rand(n, n).astype(np.float32); b = np.random.rand(n, n).astype(np.float32)
    c = np.empty((n, n), np.float32)
    out[str(n)] = 2.0 * n ** 3 / reps(lambda: np.matmul(a, b, out=c))
numel = mem_mib * 2**20 // 4
src = np.ones(numel, np.float32); dst = np.empty_like(src)
bw = 2.0 * numel * 4 / reps(lambda: np.copyto(dst, src))
print(json.dumps({"matmul": out, "mem_bw": bw}))
"""


def _measure_numpy(sizes, mem_mib: int, min_time: float) -> dict:
    # BLAS reads its thread count at load time, so a one-thread measurement needs a fresh
    # process (threadpoolctl is not a dependency).
    env = dict(os.environ)
    for v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS",
              "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS"):
        env[v] = "1"
    r = subprocess.run([sys.executable, "-c", _NUMPY_SCRIPT, json.dumps([list(sizes), mem_mib, min_time])],
                       capture_output=True, text=True, env=env, timeout=300)
    if r.returncode != 0:
        raise H2Error(f"numpy calibration failed: {r.stderr.strip()[-500:]}")
    return json.loads(r.stdout)


def measure_backend(backend: str, quick: bool = False) -> dict:
    """Measure one backend; returns its `backends[backend]` record."""
    sizes = QUICK_SIZES if quick else FULL_SIZES
    mem_mib = 32 if quick else 128
    min_time = 0.05 if quick else 0.3
    if backend == "torch":
        r = _measure_torch(sizes, mem_mib, min_time)
    elif backend == "numpy":
        r = _measure_numpy(sizes, mem_mib, min_time)
    else:
        raise H2Error(f"cannot measure backend {backend!r} here (expected one of: {', '.join(BACKENDS)})",
                      hint="run `h2c profile` on a machine with that backend and copy its calibration file")
    return {"threads": 1, "dtype": "fp32", "matmul": r["matmul"],
            "matmul_flops": max(r["matmul"].values()), "mem_bw": r["mem_bw"], "quick": quick,
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")}


def profile(backends=BACKENDS, quick: bool = False, path: str | Path | None = None) -> Calibration:
    """Measure `backends` and merge them into the stored calibration (layer times are kept)."""
    cal = load_calibration(path) or Calibration()
    for b in backends:
        cal.backends[b] = measure_backend(b, quick=quick)
    cal.created = time.strftime("%Y-%m-%dT%H:%M:%S")
    cal.host = host_info()
    save_calibration(cal, path)
    return cal


def ensure_calibration(backends, path: str | Path | None = None) -> Calibration:
    """The stored calibration, measuring (quickly) and caching any backend it lacks."""
    cal = load_calibration(path) or Calibration()
    missing = [b for b in dict.fromkeys(backends) if not cal.has_backend(b)]
    if missing:
        for b in missing:
            cal.backends[b] = measure_backend(b, quick=True)
        cal.created = cal.created or time.strftime("%Y-%m-%dT%H:%M:%S")
        cal.host = cal.host or host_info()
        try:
            save_calibration(cal, path)
        except OSError:
            pass        # a read-only home still gets measured numbers, just not cached
    return cal


def record_layer_times(backend: str, kind: str, fwd_s: float, bwd_s: float, micro_batch: int,
                       seq_len: int, *, fwd_flops: int | None = None, bwd_flops: int | None = None,
                       model: str | None = None, path: str | Path | None = None) -> Calibration:
    """Store measured per-layer forward/backward seconds of a layer kind on a backend.

    Pass the layer's FLOPs when known: then the timing is scaled by FLOPs to other layers of the
    same kind (other models, sizes); otherwise it is scaled linearly by tokens."""
    if fwd_s <= 0 or bwd_s <= 0 or micro_batch <= 0 or seq_len <= 0:
        raise H2Error(f"layer times must be positive (got fwd {fwd_s}, bwd {bwd_s}, "
                      f"micro-batch {micro_batch}, seq {seq_len})")
    cal = load_calibration(path) or Calibration()
    rec = {"fwd_s": float(fwd_s), "bwd_s": float(bwd_s), "micro_batch": int(micro_batch),
           "seq_len": int(seq_len)}
    if fwd_flops:
        rec["fwd_flops"] = int(fwd_flops)
    if bwd_flops:
        rec["bwd_flops"] = int(bwd_flops)
    if model:
        rec["model"] = model
    cal.layer_times.setdefault(backend, {})[kind] = rec
    save_calibration(cal, path)
    return cal


# ----------------------------------------------------------------------------------------------
# h2c profile

def main(argv: list[str]) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="h2c profile", description="Measure what this machine's "
                                 "backends achieve (single-thread fp32 matmul FLOP/s, copy "
                                 "bandwidth) and store it for the planner.")
    ap.add_argument("--backend", default="all", choices=("torch", "numpy", "all"))
    ap.add_argument("--quick", action="store_true", help="small sizes, about a second")
    ap.add_argument("--model", help="also measure this model file's per-layer forward/backward "
                    "times on each backend (its own compiled programs, one thread) and show the "
                    "per-layer times the planner will use")
    ap.add_argument("--arg", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    try:
        backends = BACKENDS if a.backend == "all" else (a.backend,)
        cal = profile(backends, quick=a.quick)
        if a.model and a.model.endswith(".py"):
            from executor.profile import record
            from frontend.capture import parse_model_args
            record(a.model, parse_model_args(a.arg), a.micro_batch, a.seq_len, backends,
                   log=(lambda *x: None) if a.json else print)
            cal = load_calibration(cal.path)
        layers = _model_layer_times(a, cal, backends) if a.model else None
    except H2Error as e:
        print(str(e), file=sys.stderr)
        return 2
    if a.json:
        d = cal.to_json()
        d["path"] = cal.path
        if layers is not None:
            d["model_layers"] = layers
        print(json.dumps(d, indent=1))
        return 0
    print(f"calibration written to {cal.path}")
    print(f"{'backend':<8} {'threads':>7}  " + "  ".join(f"{'matmul ' + n:>12}" for n in
                                                        next(iter(cal.backends.values()))["matmul"])
          + f"  {'copy bw':>10}")
    for b in backends:
        r = cal.backends[b]
        print(f"{b:<8} {r['threads']:>7}  " + "  ".join(f"{v / 1e9:>8.1f} GF/s" for v in r["matmul"].values())
              + f"  {r['mem_bw'] / 1e9:>6.1f} GB/s")
    for b, kinds in cal.layer_times.items():
        for k, rec in kinds.items():
            print(f"recorded {b} {k}: fwd {rec['fwd_s'] * 1e3:.3g} ms, bwd {rec['bwd_s'] * 1e3:.3g} ms "
                  f"(micro-batch {rec['micro_batch']}, seq {rec['seq_len']})")
    if layers:
        print(f"per-layer times the planner uses for {a.model} (micro-batch {a.micro_batch}):")
        for row in layers:
            print(f"  {row['backend']:<6} {row['layer']:<10} {row['kind']:<18} fwd {row['fwd_s'] * 1e3:9.3f} ms  "
                  f"bwd {row['bwd_s'] * 1e3:9.3f} ms  ({row['source']})")
    return 0


def _model_layer_times(a, cal: Calibration, backends) -> list[dict]:
    """One row per (backend, distinct layer kind) of the model: the forward/backward seconds the
    resource model will use on a single-thread worker of that backend."""
    from .plancli import _model_args, load_costs
    costs = load_costs(a.model, _model_args(a.arg), a.micro_batch, a.seq_len)
    rows, seen = [], set()
    for b in backends:
        flops = cal.matmul_flops(b)
        for l in costs.layers:
            if (b, l.kind) in seen:
                continue
            seen.add((b, l.kind))
            rec = cal.layer_time(b, l, costs.micro_batch, costs.seq_len)
            if rec is not None:
                f, bw, src = rec[0], rec[1], "recorded layer time"
            else:
                f, bw, src = l.fwd_flops / flops, l.bwd_flops / flops, "FLOPs / measured matmul FLOP/s"
            rows.append({"backend": b, "layer": l.name, "kind": l.kind, "fwd_s": f, "bwd_s": bw,
                         "source": src})
    return rows
