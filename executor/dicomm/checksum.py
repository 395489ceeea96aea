"""CRC-32 of frame payloads, fast enough not to be the bottleneck of a shared-memory link.

The value is always the plain CRC-32 of the whole payload (zlib's polynomial, what zlib.crc32
returns), whichever way it is computed:

  * zlib-ng's crc32 (SIMD, ~3x the standard library here) when the `zlib-ng` package is
    installed, else zlib's;
  * payloads of PARALLEL_BYTES or more are cut into chunks whose CRCs are computed on a small
    thread pool (crc32 releases the GIL) and joined with `crc32_combine`, the GF(2) polynomial
    arithmetic of zlib's crc32_combine (zlib 1.2.12 crc32.c: multmodp, x2nmodp), re-derived here
    because Python's zlib does not expose it.

`copy_with_checksum` does the shm sender's copy into its segment and the CRC in the same pass over
each chunk, so the CRC reads bytes the copy has just brought into cache.
"""
from __future__ import annotations

import os
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np

try:  # same CRC-32 values, SIMD (PCLMUL) implementation
    from zlib_ng import zlib_ng as _impl
    CRC_IMPL = "zlib-ng"
except ImportError:  # pragma: no cover - depends on the environment
    _impl = zlib
    CRC_IMPL = "zlib"

crc32 = _impl.crc32

PARALLEL_BYTES = 8 << 20          # below this a thread hand-off costs more than it saves
_CHUNK_BYTES = 4 << 20            # unit of work on the pool
_SLICE_BYTES = 256 << 10          # copy-then-CRC granule that stays in L2
THREADS = max(1, min(4, os.cpu_count() or 1))

_POLY = 0xEDB88320                # CRC-32 polynomial, bit-reflected


def _multmodp(a: int, b: int) -> int:
    """a(x) * b(x) modulo the CRC polynomial (reflected bit order)."""
    if a == 0:
        return 0
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if a & (m - 1) == 0:
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


_X2N = [1 << 30]                  # x^(2^k) mod p(x) for k = 0..31
for _ in range(31):
    _X2N.append(_multmodp(_X2N[-1], _X2N[-1]))


def _x2nmodp(n: int, k: int) -> int:
    """x^(n * 2^k) modulo p(x)."""
    p = 1 << 31                   # x^0
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32 of A+B from crc32(A), crc32(B) and len(B)."""
    return _multmodp(_x2nmodp(len2, 3), crc1) ^ crc2


_pool: ThreadPoolExecutor | None = None


def _threads() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(THREADS, thread_name_prefix="dicomm-crc")
    return _pool


def _combine(parts: list[tuple[int, int]]) -> int:
    crc = 0
    for part_crc, length in parts:
        crc = crc32_combine(crc, part_crc, length)
    return crc


def checksum(buf) -> int:
    """CRC-32 of a contiguous buffer."""
    mv = memoryview(buf).cast("B")
    if mv.nbytes < PARALLEL_BYTES or THREADS == 1:
        return crc32(mv)
    spans = [(i, min(i + _CHUNK_BYTES, mv.nbytes)) for i in range(0, mv.nbytes, _CHUNK_BYTES)]
    return _combine(list(_threads().map(lambda s: (crc32(mv[s[0]:s[1]]), s[1] - s[0]), spans)))


def copy_with_checksum(dst: np.ndarray, src) -> int:
    """Copy the bytes of `src` into the uint8 array `dst` (same length); return their CRC-32."""
    s = np.frombuffer(memoryview(src).cast("B"), dtype=np.uint8)

    def run(span: tuple[int, int]) -> tuple[int, int]:
        crc = 0
        for i in range(span[0], span[1], _SLICE_BYTES):
            j = min(i + _SLICE_BYTES, span[1])
            dst[i:j] = s[i:j]
            crc = crc32(dst[i:j], crc)
        return crc, span[1] - span[0]

    if s.size < PARALLEL_BYTES or THREADS == 1:
        return run((0, s.size))[0]
    spans = [(i, min(i + _CHUNK_BYTES, s.size)) for i in range(0, s.size, _CHUNK_BYTES)]
    return _combine(list(_threads().map(run, spans)))
