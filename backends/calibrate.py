"""Backend calibration: each backend measures what it achieves here, and the result is written
to the calibration file (`h2ir/planner/calibration.py`) that the planner reads.

Per backend: single-thread fp32 matmul FLOP/s at a few sizes and copy bandwidth. Single thread,
because every executor worker runs with one thread (`backends/threads.py`).

Each record carries the host, date and software versions it was measured with; a stored record
from another host, older than the bound, or from other torch/numpy versions is measured again
(and said so), never reused silently. Layer-time records are checked the same way here
(`Calibration.check`); the compiler re-measures the ones its model needs.
"""
from __future__ import annotations

import sys
import time
from importlib import import_module
from pathlib import Path

from backends.registry import BACKENDS, entry
from h2ir.planner.calibration import (TIME_FORMAT, Calibration, host_info, load_calibration,
                                      problems, save_calibration)

FULL_SIZES = (512, 1024, 2048)
QUICK_SIZES = (256, 512)


def software_versions() -> dict:
    """The op libraries' versions: a measurement under other versions is stale."""
    import numpy
    import torch
    return {"torch": torch.__version__, "numpy": numpy.__version__}


def measure_backend(backend: str, quick: bool = False) -> dict:
    """Measure one backend; returns its `backends[backend]` record."""
    sizes = QUICK_SIZES if quick else FULL_SIZES
    mem_mib = 32 if quick else 128
    min_time = 0.05 if quick else 0.3
    r = import_module(entry(backend).calibrate).measure(sizes, mem_mib, min_time)
    return {"threads": 1, "dtype": "fp32", "matmul": r["matmul"],
            "matmul_flops": max(r["matmul"].values()), "mem_bw": r["mem_bw"],
            "opt_bw": measure_adamw(backend, mem_mib // 4, min_time), "quick": quick,
            "measured_at": time.strftime(TIME_FORMAT), "host": host_info(),
            "software": software_versions()}


OPT_STATE_BYTES = 28       # fp32 AdamW per parameter: reads weight, grad, 2 states (16 B) and
                           # writes weight and 2 states (12 B): what resource.opt_step_coef counts


def measure_adamw(backend: str, mib: int, min_time: float) -> float:
    """The backend's own `adamw_step`, single thread, over 32 fp32 tensors of `mib` MiB of
    parameters in all: state bytes (OPT_STATE_BYTES per parameter) per second. A copy's
    bandwidth overstates it: the step runs a dozen elementwise passes, not one."""
    import numpy as np

    import torch

    from backends.registry import get_backend
    from backends.timing import best_time
    be = get_backend(backend)
    n = max(1024, mib * 2**20 // 4 // 32)
    rng = np.random.default_rng(0)

    def tensors(scale):
        return [be.from_numpy((rng.standard_normal(n) * scale).astype(np.float32), "f32")
                for _ in range(32)]
    params, grads, m = tensors(0.02), tensors(1e-3), tensors(1e-4)
    v = [be.from_numpy(np.full(n, 1e-8, np.float32), "f32") for _ in range(32)]
    step = [0]

    def run():
        step[0] += 1
        be.adamw_step(params, grads, m, v, step[0], 1e-3, 0.9, 0.999, 1e-8, 0.01)
    prev = torch.get_num_threads()
    torch.set_num_threads(1)        # every worker runs one thread (backends/threads.py)
    try:
        dt = best_time(run, min_time, 20)
    finally:
        torch.set_num_threads(prev)
    return OPT_STATE_BYTES * 32 * n / dt


def profile(backends=BACKENDS, quick: bool = False, path: str | Path | None = None) -> Calibration:
    """Measure `backends` and merge them into the stored calibration (layer times are kept)."""
    cal = load_calibration(path) or Calibration()
    for b in backends:
        cal.backends[b] = measure_backend(b, quick=quick)
    cal.created = time.strftime(TIME_FORMAT)
    cal.host = host_info()
    save_calibration(cal, path)
    return checked(cal)


def checked(cal: Calibration) -> Calibration:
    """`cal` with its layer-time records checked against this host and these versions."""
    cal.notes = [n for n in cal.notes if not n.startswith("layer times of ")]
    return cal.check(software=software_versions())


def _stderr(msg: str) -> None:
    print(f"h2: {msg}", file=sys.stderr)


def ensure_calibration(backends, path: str | Path | None = None, log=_stderr) -> Calibration:
    """The stored calibration, measuring (quickly) and storing any backend it lacks or whose
    record cannot be trusted here (another host, stale, other versions); `log` is told why."""
    cal = load_calibration(path) or Calibration()
    sw = software_versions()
    todo = []
    for b in dict.fromkeys(backends):
        if not cal.has_backend(b):
            todo.append(b)
            continue
        why = problems(cal.backends[b], software=sw)
        if why:
            log(f"calibration of the {b} backend measured again: {'; '.join(why)}")
            todo.append(b)
    for b in todo:
        cal.backends[b] = measure_backend(b, quick=True)
    converted = [n for n in cal.notes if n.startswith("layer times of a version-1")]
    if todo or converted:
        cal.created = cal.created or time.strftime(TIME_FORMAT)
        cal.host = host_info()
        try:
            save_calibration(cal, path)     # a version-1 file is rewritten as version 2
        except OSError:
            pass        # a read-only home still gets measured numbers, just not stored
    cal = checked(cal)
    # a layer-time record is reported where a compile uses it (the model it was measured for),
    # not on every compile of any model that reads the file
    for n in converted + [n for n in cal.notes if not n.startswith("layer times of ")]:
        log(n)
    cal.notes = converted + cal.notes
    return cal
