"""One compute thread per process: the one place that says how.

Every h2x worker, every layer-time measurement and every backend micro-benchmark runs with one
compute thread, so their numbers describe the same thing. BLAS libraries read their thread count
when they load, so `single_thread_env` must run before numpy or torch is imported (or be given
to a child process's environment); `limit_torch_threads` covers a torch already loaded.
"""
from __future__ import annotations

import os

THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS",
               "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS")


def single_thread_env(env: dict | None = None, *, force: bool = False) -> dict:
    """Set every BLAS/OpenMP thread variable to 1 in `env` (default: this process's environment).
    Without `force`, a value the user set is kept."""
    target = os.environ if env is None else env
    for v in THREAD_VARS:
        if force:
            target[v] = "1"
        else:
            target.setdefault(v, "1")
    return target


def limit_torch_threads() -> None:
    """One intra-op thread for torch, if torch is installed."""
    try:
        import torch
    except ImportError:
        return
    torch.set_num_threads(1)


def pin_to_core(index: int, sharing: int | None = None) -> None:
    """Pin this process to core `index` (mod the cores it may use), when there is more than one:
    no migrations, warm private caches. `sharing`: how many processes of this job run on this
    host; with more of them than cores, none is pinned: fixed pairs of processes on one core
    would split the work by index rather than by load (a pipeline's stages differ, and the
    last holds the LM head), where the kernel's scheduler balances it."""
    try:
        cores = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return
    if sharing is not None and sharing > len(cores):
        return
    if len(cores) > 1:
        try:
            os.sched_setaffinity(0, {cores[index % len(cores)]})
        except OSError:
            pass
