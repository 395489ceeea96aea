"""The torch backend's micro-benchmarks for calibration: single-thread fp32 matmul and copy."""
from __future__ import annotations

import torch

from backends.timing import best_time


def measure(sizes, mem_mib: int, min_time: float) -> dict:
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = {}
        for n in sizes:
            a = torch.randn(n, n, dtype=torch.float32)
            b = torch.randn(n, n, dtype=torch.float32)
            c = torch.empty(n, n, dtype=torch.float32)
            dt = best_time(lambda: torch.mm(a, b, out=c), min_time, 50)
            out[str(n)] = 2.0 * n ** 3 / dt
        numel = mem_mib * 2**20 // 4
        src = torch.ones(numel, dtype=torch.float32)
        dst = torch.empty_like(src)
        dt = best_time(lambda: dst.copy_(src), min_time, 50)
        bw = 2.0 * numel * 4 / dt      # a copy reads and writes every byte
    finally:
        torch.set_num_threads(prev)
    return {"matmul": out, "mem_bw": bw}
