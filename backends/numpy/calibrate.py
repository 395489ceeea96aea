"""The numpy backend's micro-benchmarks for calibration: single-thread fp32 matmul and copy.

BLAS reads its thread count when it loads, so the measurement runs in a fresh process with every
thread variable set to 1 (`python -m backends.numpy.calibrate SIZES MEM_MIB MIN_TIME`)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from backends.threads import single_thread_env
from h2ir.errors import H2Error


def measure(sizes, mem_mib: int, min_time: float) -> dict:
    env = single_thread_env(dict(os.environ), force=True)
    r = subprocess.run([sys.executable, "-m", "backends.numpy.calibrate",
                        json.dumps([list(sizes), mem_mib, min_time])],
                       capture_output=True, text=True, env=env, timeout=300)
    if r.returncode != 0:
        raise H2Error(f"numpy calibration failed: {r.stderr.strip()[-500:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _measure_here(sizes, mem_mib: int, min_time: float) -> dict:
    import numpy as np
    from backends.timing import best_time
    out = {}
    for n in sizes:
        a = np.random.rand(n, n).astype(np.float32)
        b = np.random.rand(n, n).astype(np.float32)
        c = np.empty((n, n), np.float32)
        out[str(n)] = 2.0 * n ** 3 / best_time(lambda: np.matmul(a, b, out=c), min_time, 50)
    numel = mem_mib * 2**20 // 4
    src = np.ones(numel, np.float32)
    dst = np.empty_like(src)
    bw = 2.0 * numel * 4 / best_time(lambda: np.copyto(dst, src), min_time, 50)
    return {"matmul": out, "mem_bw": bw}


if __name__ == "__main__":
    print(json.dumps(_measure_here(*json.loads(sys.argv[1]))))
