"""Timing a kernel call: one warm-up, then repetitions until a minimum time has passed."""
from __future__ import annotations

import time


def best_time(fn, min_time: float, max_reps: int) -> float:
    """Seconds per call: one warm-up, then repeat until `min_time` has passed; the best call."""
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
