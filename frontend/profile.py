"""Measured per-layer forward/backward times of a model's layer programs on a backend.

This is what an h2x worker really spends per layer: the same h2ir programs, the same
interpreter (`backends.base.run_program`), one thread. The planner's resource model prefers these
records (h2ir/planner/calibration.py `layer_times`) over FLOP-rate estimates, which is what makes the
predicted step time of a local plan land near the measured one. The measurement belongs to the
frontend because it runs the frontend's own stage programs on the backends; the planner only
reads the calibration file it writes.

Each measurement runs in a subprocess (`python -m frontend.profile`) so thread-pool settings
match a worker's exactly. `h2c profile` (`profile_main`) is the command line.
"""
from __future__ import annotations

import os

from backends.threads import limit_torch_threads, pin_to_core, single_thread_env

single_thread_env()

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from backends.calibrate import profile
from backends.registry import BACKENDS
from frontend.capture import load_model_file, parse_model_args
from h2ir.errors import MAX_MICRO_BATCH, MAX_SEQ_LEN, H2Error, int_flag
from h2ir.planner.calibration import Calibration, load_calibration, record_layer_times


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
    limit_torch_threads()
    from backends.base import run_program
    from backends.registry import get_backend
    from frontend.capture import trace_model
    from frontend.stages import build_stage_programs

    cap = trace_model(model_path, model_args, micro_batch, seq_len)
    costs = cap.graph.layer_costs()
    kinds: dict[str, str] = {}
    for l in cap.graph.layers:                 # first layer of each kind represents it
        kinds.setdefault(l.kind, l.name)
    names = [l.name for l in cap.graph.layers]
    try:
        progs = build_stage_programs(cap, [[n] for n in names])
    except H2Error as e:        # AOTAutograd's graphs know no model lines: say which
        raise cap.locate(e) from None
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
        cmd = [sys.executable, "-m", "frontend.profile", model_path, "--backend", b,
               "--micro-batch", str(micro_batch), "--seq-len", str(seq_len),
               "--args", json.dumps(model_args)]
        if cores[0] is not None:
            cmd += ["--core", str(cores[i % len(cores)])]
        procs.append((b, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True)))
    results = [(b, p.communicate(), p.returncode) for b, p in procs]   # every process ends
    got: dict[str, list] = {}
    for b, (out, err), rc in results:
        got.setdefault(b, []).append(_child_result(b, out, err, rc))
    res = {}
    for b, runs in got.items():
        res[b] = {}
        for kind in runs[0]:
            r = dict(runs[0][kind])
            for key in ("fwd_s", "bwd_s"):
                r[key] = statistics.mean(x[kind][key] for x in runs)
            res[b][kind] = r
    return res


def _child_result(backend: str, out: str, err: str, rc: int) -> dict:
    """The layer times a measuring process printed (its last stdout line, JSON). What it
    reported instead, an error in the user's input, is raised here as that same error; a crash
    is an internal error, told in one line (its stderr is never shown)."""
    lines = out.strip().splitlines()
    try:
        res = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        res = None
    if rc == 0 and isinstance(res, dict) and "error" not in res:
        return res
    if isinstance(res, dict) and isinstance(res.get("error"), dict):
        raise H2Error(**res["error"])
    if isinstance(res, dict) and isinstance(res.get("internal"), str):
        raise RuntimeError(f"measuring layer times on {backend}: {res['internal']}")
    last = next((ln.strip() for ln in reversed(err.splitlines()) if ln.strip()), "")
    raise RuntimeError(f"measuring layer times on {backend}: the process exited with code {rc}"
                       + (f" ({last[:300]})" if last else ""))


def record(model_path: str, model_args: dict, micro_batch: int, seq_len: int, backends,
           log=print) -> None:
    """Measure each backend's layer times and store them in the calibration file."""
    load_model_file(model_path)     # a missing or broken model file is told once, here
    measured = measure_concurrently(model_path, model_args, micro_batch, seq_len, list(backends))
    for b in backends:
        res = measured[b]
        for kind, r in res.items():
            record_layer_times(b, kind, r["fwd_s"], r["bwd_s"], micro_batch, seq_len,
                               fwd_flops=r["fwd_flops"], bwd_flops=r["bwd_flops"],
                               model=Path(model_path).stem)
            log(f"  {b:6s} {kind:18s} fwd {r['fwd_s'] * 1e3:8.2f} ms  bwd {r['bwd_s'] * 1e3:8.2f} ms"
                f"  (micro-batch {micro_batch} x {seq_len})")


# ----------------------------------------------------------------------------------------------
# h2c profile

def profile_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="h2c profile", description="Measure what this machine's "
                                 "backends achieve (single-thread fp32 matmul FLOP/s, copy "
                                 "bandwidth) and store it for the planner.")
    ap.add_argument("--backend", default="all", choices=("torch", "numpy", "all"))
    ap.add_argument("--quick", action="store_true", help="small sizes, about a second")
    ap.add_argument("--model", help="also measure this model file's per-layer forward/backward "
                    "times on each backend (its own compiled programs, one thread) and show the "
                    "per-layer times the planner will use")
    ap.add_argument("--arg", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--micro-batch", type=int_flag(1, MAX_MICRO_BATCH), default=1)
    ap.add_argument("--seq-len", type=int_flag(1, MAX_SEQ_LEN), default=128)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    try:
        backends = BACKENDS if a.backend == "all" else (a.backend,)
        cal = profile(backends, quick=a.quick)
        if a.model and a.model.endswith(".py"):
            record(a.model, parse_model_args(a.arg), a.micro_batch, a.seq_len, backends,
                   log=(lambda *x: None) if a.json else print)
            cal = load_calibration(cal.path)
        layers = _model_layer_times(a, cal, backends) if a.model else None
    except H2Error as e:
        print(str(e), file=sys.stderr)
        return 2
    if a.json:
        d = cal.to_json()
        d["path"] = cal.path
        if layers is not None:
            d["model_layers"] = layers
        print(json.dumps(d, indent=1))
        return 0
    print(f"calibration written to {cal.path}")
    print(f"{'backend':<8} {'threads':>7}  " + "  ".join(f"{'matmul ' + n:>12}" for n in
                                                        next(iter(cal.backends.values()))["matmul"])
          + f"  {'copy bw':>10}")
    for b in backends:
        r = cal.backends[b]
        print(f"{b:<8} {r['threads']:>7}  " + "  ".join(f"{v / 1e9:>8.1f} GF/s" for v in r["matmul"].values())
              + f"  {r['mem_bw'] / 1e9:>6.1f} GB/s")
    for b, kinds in cal.layer_times.items():
        for k, rec in kinds.items():
            print(f"recorded {b} {k}: fwd {rec['fwd_s'] * 1e3:.3g} ms, bwd {rec['bwd_s'] * 1e3:.3g} ms "
                  f"(micro-batch {rec['micro_batch']}, seq {rec['seq_len']})")
    if layers:
        print(f"per-layer times the planner uses for {a.model} (micro-batch {a.micro_batch}):")
        for row in layers:
            print(f"  {row['backend']:<6} {row['layer']:<10} {row['kind']:<18} fwd {row['fwd_s'] * 1e3:9.3f} ms  "
                  f"bwd {row['bwd_s'] * 1e3:9.3f} ms  ({row['source']})")
    return 0


def _model_layer_times(a, cal: Calibration, backends) -> list[dict]:
    """One row per (backend, distinct layer kind) of the model: the forward/backward seconds the
    resource model will use on a single-thread worker of that backend."""
    from frontend.plancli import load_costs
    costs = load_costs(a.model, parse_model_args(a.arg), a.micro_batch, a.seq_len)
    rows, seen = [], set()
    for b in backends:
        flops = cal.matmul_flops(b)
        for l in costs.layers:
            if (b, l.kind) in seen:
                continue
            seen.add((b, l.kind))
            rec = cal.layer_time(b, l, costs.micro_batch, costs.seq_len)
            if rec is not None:
                f, bw, src = rec[0], rec[1], "recorded layer time"
            else:
                f, bw, src = l.fwd_flops / flops, l.bwd_flops / flops, "FLOPs / measured matmul FLOP/s"
            rows.append({"backend": b, "layer": l.name, "kind": l.kind, "fwd_s": f, "bwd_s": bw,
                         "source": src})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m frontend.profile")
    ap.add_argument("model")
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--args", default="{}")
    ap.add_argument("--core", type=int, default=None, help="pin to this CPU core")
    a = ap.parse_args(argv)
    if a.core is not None:
        pin_to_core(a.core)
    # One JSON line on stdout either way: the parent raises the same error (_child_result).
    try:
        res = measure(a.model, json.loads(a.args), a.micro_batch, a.seq_len, a.backend)
    except H2Error as e:
        print(json.dumps({"error": {"message": e.message, "file": e.file, "line": e.line,
                                    "col": e.col, "hint": e.hint}}))
        return 2
    except Exception as e:      # a bug of ours: one line for the parent to report
        print(json.dumps({"internal": f"{type(e).__name__}: {e}".splitlines()[0][:500]}))
        return 1
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
