"""Backend calibration: each backend measures what it achieves here, and the result is written
to the calibration file (`h2ir/planner/calibration.py`) that the planner reads.

Per backend: single-thread fp32 matmul FLOP/s at a few sizes and copy bandwidth. Single thread,
because every executor worker runs with one thread (`backends/threads.py`).
"""
from __future__ import annotations

import time
from importlib import import_module
from pathlib import Path

from backends.registry import BACKENDS, entry
from h2ir.planner.calibration import Calibration, host_info, load_calibration, save_calibration

FULL_SIZES = (512, 1024, 2048)
QUICK_SIZES = (256, 512)


def measure_backend(backend: str, quick: bool = False) -> dict:
    """Measure one backend; returns its `backends[backend]` record."""
    sizes = QUICK_SIZES if quick else FULL_SIZES
    mem_mib = 32 if quick else 128
    min_time = 0.05 if quick else 0.3
    r = import_module(entry(backend).calibrate).measure(sizes, mem_mib, min_time)
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
    """The stored calibration, measuring (quickly) and storing any backend it lacks."""
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
            pass        # a read-only home still gets measured numbers, just not stored
    return cal
