"""The host allocator policy of a compute process: freed memory is kept for reuse.

glibc's malloc serves a request above its mmap threshold (128 KiB at start, raised only as such
blocks are freed) with fresh pages from the kernel and gives them back on free, and trims the
heap's top whenever 128 KiB lie free there. A worker allocates and frees the same large tensors
every micro-batch (activations, gradients, an embedding's 8 MiB gradient buffer), so each of
them is paid again as page faults and zeroing: on llama_tiny at micro-batch 1 the embedding's
backward took 3.9-4.3 ms in a chain of layers against 1.3 ms with freed memory kept, the LM
head's backward 15.1-15.6 ms against 11.8-12.3 ms (torch, one thread, this 2-core VM).
PyTorch's own CUDA caching allocator keeps freed blocks for the same reason; on the CPU the
usual advice is a caching malloc (jemalloc, tcmalloc) preloaded. glibc's own knobs do it here
without a preload: every request below 32 MiB (glibc's largest mmap threshold on 64-bit) comes
from the heap, and the heap is never trimmed below 1 GiB of free top.

Every h2x worker and every layer-time measurement applies it, so calibrations time what workers
run. `H2_KEEP_FREED_MEMORY=0` leaves glibc's defaults (lower resident memory after a peak).
"""
from __future__ import annotations

import ctypes
import os

M_TRIM_THRESHOLD = -1        # glibc malloc.h mallopt parameters
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 * 2 ** 20      # DEFAULT_MMAP_THRESHOLD_MAX on 64-bit glibc
TRIM_THRESHOLD = 2 ** 30
TOP_PAD = 64 * 2 ** 20


def keep_freed_memory() -> bool:
    """Apply the policy to this process (glibc only); whether it was applied."""
    if os.environ.get("H2_KEEP_FREED_MEMORY", "1") == "0":
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):          # not glibc (musl, macOS): nothing to set
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return all(mallopt(p, v) == 1 for p, v in ((M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX),
                                                (M_TRIM_THRESHOLD, TRIM_THRESHOLD),
                                                (M_TOP_PAD, TOP_PAD)))
