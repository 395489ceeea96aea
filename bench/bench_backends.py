"""Forward pass of llama_tiny on the numpy and torch backends, single-threaded.

    .venv/bin/python bench/bench_backends.py [--layers 2] [--micro-batch 4] [--seq-len 128]

Both backends run the same h2ir program (captured from examples/llama_tiny.py at its default
width) through `run_program` on the same inputs; torch, measured in the same run, is the anchor.
Prints the median time of each, the numpy/torch ratio, and where each backend spends its time by
op (summed over the program's nodes, from a separate instrumented pass).
"""
from __future__ import annotations

import os

# one thread for every BLAS/OpenMP pool; must be set before numpy and torch load them
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from backends.base import run_program                            # noqa: E402
from backends.registry import get_backend                         # noqa: E402
from backends.numpy.runtime import NumpyBackend                   # noqa: E402
from frontend.capture import capture                              # noqa: E402
from h2ir.graph import Value, full_attrs                          # noqa: E402


def make_inputs(g, seed=0) -> dict:
    rng = np.random.default_rng(seed)
    host = {}
    vocab = g.attrs.get("vocab", 2)
    for v in g.inputs:
        host[v.name] = rng.integers(0, vocab, v.type.shape).astype(np.int64)
    for v in g.consts + g.all_params():
        host[v.name] = (rng.standard_normal(v.type.shape) * 0.05).astype(np.float32)
    return host


def time_forwards(g, backends: dict, host, repeats: int) -> dict:
    """Forward times per backend; the backends alternate run by run, so a change in machine load
    during the benchmark hits both alike."""
    ins = {name: {k: be.from_numpy(a, "i64" if a.dtype == np.int64 else "f32")
                  for k, a in host.items()} for name, be in backends.items()}
    times = {name: [] for name in backends}
    for i in range(repeats + 1):
        for name, be in backends.items():
            t0 = time.perf_counter()
            run_program(g, be, ins[name])
            be.synchronize()
            if i:                               # the first round is a warm-up
                times[name].append(time.perf_counter() - t0)
    return times


def time_by_op(g, backend, host, repeats: int) -> dict:
    """Seconds per op name over one forward (run_program's loop with a clock around each node),
    the median over `repeats` forwards."""
    env = {k: backend.from_numpy(a, "i64" if a.dtype == np.int64 else "f32")
           for k, a in host.items()}
    runs = []
    for _ in range(repeats):
        spent = defaultdict(float)
        for n in g.nodes():
            args = [env[v.name] if isinstance(v, Value) else v for v in n.inputs]
            t0 = time.perf_counter()
            out = backend.ops[n.op](*args, **full_attrs(n))
            spent[n.op] += time.perf_counter() - t0
            outs = [out] if len(n.outputs) == 1 else list(out)
            for v, o in zip(n.outputs, outs):
                env[v.name] = o
        runs.append(spent)
    return {op: statistics.median(r[op] for r in runs) for op in runs[0]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=20)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)

    g = capture(str(ROOT / "examples/llama_tiny.py"), {"n_layers": a.layers}, a.micro_batch,
                a.seq_len)
    host = make_inputs(g)
    backends = {"torch": get_backend("torch"), "numpy": NumpyBackend()}
    med = {name: statistics.median(t) for name, t in time_forwards(g, backends, host,
                                                                   a.repeats).items()}
    print(f"llama_tiny forward: {a.layers} layers, d={g.attrs.get('d_model')}, "
          f"micro-batch {a.micro_batch}, seq {a.seq_len}; 1 thread; median of {a.repeats}")
    for name, t in med.items():
        print(f"  {name:<6} {t * 1e3:9.2f} ms")
    print(f"  numpy/torch time ratio: {med['numpy'] / med['torch']:.2f}")

    spent = {name: time_by_op(g, be, host, a.repeats) for name, be in backends.items()}
    ops = sorted(spent["numpy"], key=lambda o: -spent["numpy"][o])
    print(f"  {'op':<12}{'torch ms':>10}{'numpy ms':>10}{'ratio':>8}")
    for op in ops:
        t, n = spent["torch"][op], spent["numpy"][op]
        print(f"  {op:<12}{t * 1e3:>10.2f}{n * 1e3:>10.2f}{n / t if t else float('nan'):>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
