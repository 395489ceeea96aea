"""Measured per-layer forward/backward times of a model's layer programs on a backend.

This is what an h2x worker really spends per layer: the same h2ir programs, the same
interpreter (`backends.base.run_program`), one thread. The planner's resource model prefers these
records (h2ir/calibration.py `layer_times`) over FLOP-rate estimates, which is what makes the
predicted step time of a local plan land near the measured one.

Run in a subprocess (`measure_in_subprocess`) so thread-pool settings match a worker's exactly.
"""
from __future__ import annotations

import os

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

import argparse
import json
import statistics
import subprocess
import sys
import time

import numpy as np


def _random_inputs(types: dict, vocab: int, rng) -> dict:
    out = {}
    for k, t in types.items():
        if t.dtype in ("i64", "i32"):
            out[k] = rng.integers(0, max(vocab, 2), size=t.shape).astype(np.int64)
        else:
            out[k] = rng.standard_normal(t.shape).astype(np.float32)
    return out


def measure(model_path: str, model_args: dict, micro_batch: int, seq_len: int, backend: str,
            reps: int = 5) -> dict:
    """{layer kind: {fwd_s, bwd_s, fwd_flops, bwd_flops}} for each distinct layer kind."""
    import torch
    torch.set_num_threads(1)
    from backends.base import get_backend, run_program
    from frontend.capture import trace_model
    from frontend.stages import build_stage_programs

    cap = trace_model(model_path, model_args, micro_batch, seq_len)
    costs = cap.graph.layer_costs()
    kinds: dict[str, str] = {}
    for l in cap.graph.layers:                 # first layer of each kind represents it
        kinds.setdefault(l.kind, l.name)
    names = [l.name for l in cap.graph.layers]
    progs = build_stage_programs(cap, [[n] for n in names])
    be = get_backend(backend)
    rng = np.random.default_rng(0)
    vocab = cap.graph.attrs.get("vocab", 256)
    out = {}
    for kind, lname in kinds.items():
        p = progs[names.index(lname)]
        types = {v.name: v.type for v in p.fwd.inputs + p.fwd.consts + p.fwd.all_params()}
        host = _random_inputs(types, vocab, rng)
        env = {k: be.from_numpy(v, types[k].dtype) for k, v in host.items()}
        fwd_t, bwd_t = [], []
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            outs = run_program(p.fwd, be, env)
            be.synchronize()
            t1 = time.perf_counter()
            n = len(p.outputs) - len(p.passthrough)
            benv = dict(env)
            benv.update({v.name: o for v, o in zip(p.fwd.outputs[n:], outs[n:])})
            for k in p.tangents:
                t = p.fwd.outputs[[x for x in p.outputs if x not in p.passthrough].index(k)].type
                benv[f"grad.{k}"] = be.from_numpy(rng.standard_normal(t.shape).astype(np.float32), "f32")
            t2 = time.perf_counter()
            run_program(p.bwd, be, benv)
            be.synchronize()
            t3 = time.perf_counter()
            fwd_t.append(t1 - t0)
            bwd_t.append(t3 - t2)
        lc = costs.layer(lname)
        out[kind] = {"fwd_s": statistics.median(fwd_t[1:]), "bwd_s": statistics.median(bwd_t[1:]),
                     "fwd_flops": lc.fwd_flops, "bwd_flops": lc.bwd_flops, "layer": lname}
    return out


def measure_concurrently(model_path: str, model_args: dict, micro_batch: int, seq_len: int,
                         backends) -> dict:
    """{backend: layer times}, measured with every core busy as in a real run.

    A worker never runs alone: its neighbours share the memory bus and the last-level cache, which
    slows a CPU worker by 10-25 % here. So one measuring process per core (pinned, one thread
    each) runs at once, each backend at least once; copies of a backend are averaged."""
    try:
        cores = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = [None]
    jobs = list(backends)
    while len(jobs) < len(cores):
        jobs.append(jobs[len(jobs) % len(backends)])
    procs = []
    for i, b in enumerate(jobs):
        cmd = [sys.executable, "-m", "executor.profile", model_path, "--backend", b,
               "--micro-batch", str(micro_batch), "--seq-len", str(seq_len),
               "--args", json.dumps(model_args)]
        if cores[0] is not None:
            cmd += ["--core", str(cores[i % len(cores)])]
        procs.append((b, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True)))
    got: dict[str, list] = {}
    for b, p in procs:
        out, err = p.communicate()
        if p.returncode != 0:
            from h2ir.errors import H2Error
            raise H2Error(f"measuring layer times on {b} failed: {err.strip()[-500:]}")
        got.setdefault(b, []).append(json.loads(out.strip().splitlines()[-1]))
    res = {}
    for b, runs in got.items():
        res[b] = {}
        for kind in runs[0]:
            r = dict(runs[0][kind])
            for key in ("fwd_s", "bwd_s"):
                r[key] = statistics.mean(x[kind][key] for x in runs)
            res[b][kind] = r
    return res


def record(model_path: str, model_args: dict, micro_batch: int, seq_len: int, backends,
           log=print) -> None:
    """Measure each backend's layer times and store them in the calibration file."""
    from pathlib import Path
    from h2ir.calibration import record_layer_times
    measured = measure_concurrently(model_path, model_args, micro_batch, seq_len, list(backends))
    for b in backends:
        res = measured[b]
        for kind, r in res.items():
            record_layer_times(b, kind, r["fwd_s"], r["bwd_s"], micro_batch, seq_len,
                               fwd_flops=r["fwd_flops"], bwd_flops=r["bwd_flops"],
                               model=Path(model_path).stem)
            log(f"  {b:6s} {kind:18s} fwd {r['fwd_s'] * 1e3:8.2f} ms  bwd {r['bwd_s'] * 1e3:8.2f} ms"
                f"  (micro-batch {micro_batch} x {seq_len})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m executor.profile")
    ap.add_argument("model")
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--args", default="{}")
    ap.add_argument("--core", type=int, default=None, help="pin to this CPU core")
    a = ap.parse_args(argv)
    if a.core is not None:
        try:
            os.sched_setaffinity(0, {a.core})
        except OSError:
            pass
    print(json.dumps(measure(a.model, json.loads(a.args), a.micro_batch, a.seq_len, a.backend)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
