"""Calibration: the artifact that carries measured speeds to the planner (data only).

Nothing here measures. Backends measure themselves (`backends/calibrate.py`: single-thread fp32
matmul FLOP/s at a few sizes and copy bandwidth, per backend), the frontend measures a model's
layer programs (`frontend/profile.py`), and both write this file. The resource model
(`h2ir/planner/resource.py`) reads a `Calibration` value passed in for chips marked `measured`
(the local CPU clusters) instead of catalog peaks; a measured chip without one is an error, so a
plan for a local cluster never rests on made-up figures.

Measured per-layer forward/backward times (`layer_times[backend][kind]`) are stored through
`record_layer_times`; the resource model prefers them when present.

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
from dataclasses import dataclass, field
from pathlib import Path

from h2ir.errors import H2Error

VERSION = 1


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


