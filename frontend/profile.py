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

from backends.allocator import keep_freed_memory
from backends.threads import limit_torch_threads, pin_to_core, single_thread_env

single_thread_env()

import argparse
import hashlib
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from backends.calibrate import checked, profile, software_versions
from backends.registry import BACKENDS
from frontend.capture import load_model_file, parse_model_args
from h2ir.errors import MAX_MICRO_BATCH, MAX_SEQ_LEN, H2Error, int_flag
from h2ir.planner.calibration import (Calibration, colocation_key, contention_curve, host_info,
                                      layer_key, load_calibration, now_str, record_id,
                                      store_layer_record)


MIN_REPS = 5              # timed repetitions at least (after one warm-up)
MAX_REPS = 40             # at most: sweeps of every layer's forward and backward
WINDOW = 5                # stable: the last WINDOW sweeps' totals spread at most TARGET_SPREAD
TARGET_SPREAD = 0.05
BUDGET_S = 30.0           # stop repeating after this long
# Whole measurements (`measure_concurrently`: fresh processes, fresh allocations, the machine as it
# is then) are repeated too: one process set's layer times moved a prediction by 20 % against the
# next one's on this VM, more than any set's own repetitions spread. Rounds go on until two
# agree (every backend's total within ROUND_AGREE, `agreeing_pair`), at least ROUNDS[0], at most
# ROUNDS[1]; the layer times are those two rounds' (`combine_rounds`). H2_CALIBRATION_ROUNDS="lo,hi"
# overrides.
ROUNDS = (2, 4)
ROUND_AGREE = 0.05


def spread(xs) -> float:
    """(p90 - p10) / median of `xs` (0 for fewer than two samples)."""
    if len(xs) < 2:
        return 0.0
    q = np.percentile(xs, [10, 50, 90])
    return float((q[2] - q[0]) / q[1]) if q[1] > 0 else 0.0


def time_until_stable(sweep, min_reps: int = MIN_REPS, max_reps: int = MAX_REPS,
                      window: int = WINDOW, target: float = TARGET_SPREAD,
                      budget_s: float = BUDGET_S) -> tuple[dict, dict, int]:
    """({name: median seconds}, {name: spread}, repetitions) of `sweep()`, which runs once and
    returns {name: seconds} of its parts: one warm-up, then repeated until the last `window`
    sweeps' totals agree within `target` (or `max_reps` / `budget_s` run out); medians and
    spreads are those of that last window."""
    sweep()
    xs: list[dict] = []
    t_end = time.perf_counter() + budget_s
    while True:
        xs.append(sweep())
        last = [sum(x.values()) for x in xs[-window:]]
        if len(xs) >= max(min_reps, window) and spread(last) <= target:
            break
        if len(xs) >= max_reps or (time.perf_counter() > t_end and len(xs) >= min_reps):
            break
    last = xs[-window:]
    return ({k: float(np.median([x[k] for x in last])) for k in last[0]},
            {k: spread([x[k] for x in last]) for k in last[0]}, len(xs))


def layer_chain(progs, values, kinds: list[str], run, synchronize):
    """A sweep that runs the layer programs as a worker's micro-batch does: every layer's
    forward in order, each layer with its own weights, the outputs held, then every backward in
    reverse order. Returns {(kind, 'fwd'|'bwd'): mean seconds over that kind's layers}.

    A layer timed alone, again and again, finds its weights, inputs and freed memory hot; in a
    stage the layers take turns and the saved activations pile up. On llama_tiny (10 layers,
    torch, micro-batch 1) the whole model's program ran 13 % slower than the sum of its layers
    timed alone, and 3 % slower than this chain (docs/planning.md, "Calibration")."""
    counts = {k: kinds.count(k) for k in set(kinds)}

    def sweep() -> dict:
        out = {(k, d): 0.0 for k in counts for d in ("fwd", "bwd")}
        held = []
        for i, p in enumerate(progs):
            t0 = time.perf_counter()
            held.append(run(p.fwd, values[i]["fwd"]))
            synchronize()
            out[(kinds[i], "fwd")] += time.perf_counter() - t0
        for i in reversed(range(len(progs))):
            t0 = time.perf_counter()
            run(progs[i].bwd, values[i]["bwd"])
            synchronize()
            out[(kinds[i], "bwd")] += time.perf_counter() - t0
        del held
        return {k: v / counts[k[0]] for k, v in out.items()}
    return sweep


def realistic_layer_values(cap, progs, be, model_args: dict, seed: int = 0) -> list[dict]:
    """For every layer program, the forward and backward inputs an h2x worker sees at step 1:
    weights and buffers from the model's own initialisation (the model built for real with
    `seed`, as `h2c compile` writes its initial weights), token ids and targets drawn from the
    vocabulary, each layer's input the previous layer's real output, each output gradient the
    real backward of the loss from the layers after it.

    N(0, 1) weights and inputs are far from what training sees: logits then have a standard
    deviation of ~sqrt(d), the softmax underflows into denormals, and the head's backward took
    99 ms instead of 8.3 ms (issue 14)."""
    import torch
    from backends.base import run_program
    from h2ir.opset import DROPOUT_SEED_INPUT
    from h2ir.types import FLOAT_DTYPES, TensorType, dtype_of_host, host_dtype

    torch.manual_seed(seed)
    model = cap.model_file.build(model_args)
    params = {k: v.detach().numpy() for k, v in model.named_parameters(remove_duplicate=False)}
    buffers = {k: v.detach().numpy() for k, v in
               cap.constants(model, {k for p in progs for k in p.consts}).items()}
    dev = {}

    def weight(k, table):
        if k not in dev:
            dev[k] = be.from_numpy(np.ascontiguousarray(table[k]), dtype_of_host(table[k].dtype))
        return dev[k]

    fixed = {k: be.from_numpy(a, dtype_of_host(a.dtype))
             for k, a in ((k, v.numpy()) for k, v in cap.fixed_inputs().items())}
    vocab = max(2, int(cap.graph.attrs.get("vocab", 256) or 256))
    rng = np.random.default_rng(seed)
    acts: dict = {}
    out = []
    for i, p in enumerate(progs):
        types = {k: TensorType.parse(v) for k, v in p.input_types.items()}
        env = {k: weight(k, params) for k in p.params}
        env.update({k: weight(k, buffers) for k in p.consts})
        for k in p.inputs:
            if k in acts:
                env[k] = acts[k]
            elif k in fixed:                   # a model input after the token ids
                env[k] = fixed[k]
            else:                              # a model input: token ids (or a float input)
                t = types[k]
                env[k] = be.from_numpy(rng.integers(0, vocab, size=t.shape).astype(np.int64), "i64") \
                    if t.dtype in ("i64", "i32") else \
                    be.from_numpy(rng.standard_normal(t.shape).astype(host_dtype(t.dtype)), t.dtype)
        if "targets" in types:
            env["targets"] = be.from_numpy(
                rng.integers(0, vocab, size=types["targets"].shape).astype(np.int64), "i64")
        if any(v.name == DROPOUT_SEED_INPUT for v in p.fwd.inputs):
            env[DROPOUT_SEED_INPUT] = be.from_numpy(np.array(seed, dtype=np.int64), "i64")
        outs = run_program(p.fwd, be, env)
        n = len(p.outputs) - len(p.passthrough)
        computed = [k for k in p.outputs if k not in p.passthrough]
        acts.update(zip(computed, outs[:n]))
        saved = {v.name: o for v, o in zip(p.fwd.outputs[n:], outs[n:])}
        out.append({"fwd": env, "saved": saved, "n_out": n, "computed": computed})
    # backward, last layer first: the loss gradient 1, then each layer's real input gradients
    add = be.ops["add"]
    grads: dict = {}
    for i in range(len(progs) - 1, -1, -1):
        p, v = progs[i], out[i]
        benv = {k: v["fwd"][k] for k in list(p.params) + list(p.consts)}
        benv.update(v["saved"])
        for k in p.tangents:
            if k == "loss":
                benv["grad.loss"] = be.from_numpy(np.asarray(1.0, dtype=np.float32), "f32")
            elif k in grads:
                benv[f"grad.{k}"] = grads[k]
            else:                              # nothing flows back into it: zeros, as h2x sends
                t = p.fwd.outputs[v["computed"].index(k)].type
                benv[f"grad.{k}"] = be.from_numpy(np.zeros(t.shape, host_dtype(t.dtype)), t.dtype)
        v["bwd"] = benv
        if i == 0:
            break
        gouts = run_program(p.bwd, be, benv)
        for k, g in zip(p.input_grads, gouts):
            if k in p.inputs and g is not None and \
                    TensorType.parse(p.input_types[k]).dtype in FLOAT_DTYPES:
                grads[k] = g if k not in grads else add(grads[k], g)
        del v["saved"]                         # the timing re-runs only the chosen layers
    return out


def prepare(model_path: str, model_args: dict, micro_batch: int, seq_len: int, backend: str,
            seed: int = 0):
    """(time, busy) for this model's layer programs on `backend`: `time()` returns {layer kind:
    {fwd_s, bwd_s, fwd_spread, bwd_spread, reps, fwd_flops, bwd_flops, params, layer, count}}
    for each distinct layer kind, with realistic inputs (`realistic_layer_values`), timed in a
    chain of every layer (`layer_chain`) repeated until stable (`time_until_stable`); `busy()`
    runs the largest layer's forward once (what a measuring process keeps its core busy with
    while the others of its phase finish)."""
    limit_torch_threads()
    keep_freed_memory()       # as a worker runs (backends/allocator.py)
    from backends.base import run_program
    from backends.registry import get_backend
    from frontend.capture import trace_model
    from frontend.stages import build_stage_programs

    cap = trace_model(model_path, model_args, micro_batch, seq_len)
    costs = cap.graph.layer_costs()
    variant = layer_variants(cap.graph, costs)
    kinds: dict[str, str] = {}
    for l in cap.graph.layers:                 # first layer of each variant represents it
        kinds.setdefault(variant[l.name], l.name)
    names = [l.name for l in cap.graph.layers]
    try:
        progs = build_stage_programs(cap, [[n] for n in names])
    except H2Error as e:        # AOTAutograd's graphs know no model lines: say which
        raise cap.locate(e) from None
    be = get_backend(backend)
    values = realistic_layer_values(cap, progs, be, model_args, seed)
    layer_kinds = [variant[l.name] for l in cap.graph.layers]
    sweep = layer_chain(progs, values, layer_kinds, lambda g, env: run_program(g, be, env),
                        be.synchronize)

    def time_layers() -> dict:
        times, spreads, reps = time_until_stable(sweep)
        out = {}
        for kind, lname in kinds.items():
            lc = costs.layer(lname)
            out[kind] = {"fwd_s": times[(kind, "fwd")], "bwd_s": times[(kind, "bwd")],
                         "fwd_spread": spreads[(kind, "fwd")], "bwd_spread": spreads[(kind, "bwd")],
                         "reps": reps, "fwd_flops": lc.fwd_flops, "bwd_flops": lc.bwd_flops,
                         "params": lc.params, "layer": lname, "count": layer_kinds.count(kind),
                         "kind": lc.kind}
        return out
    busiest = max(range(len(progs)), key=lambda i: costs.layers[i].fwd_flops)
    return time_layers, lambda: run_program(progs[busiest].fwd, be, values[busiest]["fwd"])


def _sequence_mixer(layer, seq_len: int) -> str:
    """What mixes a block's sequence positions: attention (a fused op, or a softmax over
    scores with two sequence axes), a selective scan ('ssm'), a convolution alone ('conv'),
    several ('attention+ssm'), or none ('mlp')."""
    from h2ir.recompute import quadratic
    ops = {n.op for n in layer.nodes}
    attention = bool(ops & {"attention", "attention_masked"}) or any(
        n.op == "softmax" and quadratic(n.outputs[0], seq_len) for n in layer.nodes)
    parts = [name for name, has in (("attention", attention),
                                    ("ssm", "selective_scan" in ops),
                                    ("conv", "depthwise_conv1d" in ops and
                                     "selective_scan" not in ops)) if has]
    return "+".join(parts) or "mlp"


def layer_variants(graph, costs) -> dict[str, str]:
    """{layer name: the key its measured times are recorded under}: its kind; where layers of
    one kind differ (a hybrid's attention, state-space and convolution blocks, Jamba's MoE
    after either), the kind and its sequence mixer ('transformer_block:ssm'), and its
    parameter count where they still differ. Each variant is measured on its own."""
    shape = {l.name: (l.kind, l.params, l.fwd_flops) for l in costs.layers}
    structures: dict[str, set] = {}
    for sig in shape.values():
        structures.setdefault(sig[0], set()).add(sig)
    seq = int(graph.attrs.get("seq_len", 0) or 0)
    out = {l.name: l.kind if len(structures[l.kind]) == 1 else
           f"{l.kind}:{_sequence_mixer(l, seq)}" for l in graph.layers}
    taken: dict[str, set] = {}
    for name, key in out.items():
        taken.setdefault(key, set()).add(shape[name])
    return {name: key if len(taken[key]) == 1 else f"{key}:{shape[name][1]}"
            for name, key in out.items()}


def measure(model_path: str, model_args: dict, micro_batch: int, seq_len: int, backend: str,
            seed: int = 0) -> dict:
    """This model's layer times on `backend`, measured once in this process (`prepare`)."""
    return prepare(model_path, model_args, micro_batch, seq_len, backend, seed)[0]()


def _serve_phases(time_layers, busy) -> None:
    """A measuring process under `measure_concurrently`: say "ready", then follow the parent's
    lines on stdin: "time" measures (the result on one stdout line, then "done") and keeps the
    core busy until the next line ("stop"), so no process of a phase times its last layers
    beside idle companions; "exit" ends. Between phases it blocks on stdin: idle, as a worker
    waiting in a bubble."""
    import select
    print("ready", flush=True)
    while True:
        cmd = sys.stdin.readline().strip()
        if cmd != "time":
            return
        print(json.dumps(time_layers()), flush=True)
        print("done", flush=True)
        while not select.select([sys.stdin], [], [], 0)[0]:
            busy()
        sys.stdin.readline()


def default_colocation(backends) -> tuple[int, dict]:
    """(cores, {backend: processes}) when no cluster says how chips share cores (`h2c
    profile`): this machine's cores, each busy, the backends taking turns (each at least once)."""
    cores = _cores()
    n = {b: 0 for b in backends}
    for i in range(max(cores, len(n))):
        n[list(n)[i % len(n)]] += 1
    return cores, n


def colocation_of(cluster) -> tuple[int, dict]:
    """The co-location a cluster's measured chips run under (`Cluster.colocation`); where the
    cluster says nothing of shared cores, all its measured chips on this machine's cores."""
    got = cluster.colocation()
    if got is not None:
        return got
    n: dict[str, int] = {}
    for g in cluster.groups:
        chip = cluster.chip(g.chip)
        if chip.measured:
            n[chip.backend] = n.get(chip.backend, 0) + g.chips
    return _cores(), n


def _processes(backends, colocation) -> tuple[int, list[str]]:
    """(cores, each measuring process's backend): one per co-located chip, and one for each
    backend to measure that the co-location lacks."""
    cores, counts = colocation or default_colocation(backends)
    workers = [b for b, n in counts.items() for _ in range(n)]
    return cores, workers + [b for b in dict.fromkeys(backends) if b not in workers]


def _usable_cores() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return []


def colocation_levels(k: int, cores: int) -> list[int]:
    """How many processes compute at once in the measurement's phases: alone, as many as the
    cores (where fewer than k), and all k (the co-location a plan runs with)."""
    return sorted({1, min(k, cores), k})


def phase_groups(workers: list[str], level: int, want) -> list[list[int]]:
    """The groups of process indices (`workers`: each process's backend) that compute together
    at `level` processes at once, so that every backend in `want` is timed at that level once:
    a process of a backend not yet timed, and as companions first the processes of other such
    backends, then the others in order."""
    if level >= len(workers):
        return [list(range(len(workers)))]
    todo = [b for b in dict.fromkeys(workers) if b in set(want)]
    groups = []
    for i, b in enumerate(workers):
        if b not in todo:
            continue
        rest = sorted((j for j in range(len(workers)) if j != i),
                      key=lambda j: (workers[j] not in todo or workers[j] == b, j))
        g = [i] + rest[:level - 1]
        groups.append(g)
        todo = [x for x in todo if x not in {workers[j] for j in g}]
    return groups


def measure_concurrently(model_path: str, model_args: dict, micro_batch: int, seq_len: int,
                         backends, colocation: tuple[int, dict] | None = None,
                         turn: int = 0) -> dict:
    """{backend: layer times} measured under the co-location a plan runs with.

    A worker never runs alone: its neighbours on the host share the memory bus, the last-level
    cache and, past the cores, the cores themselves. So one measuring process per chip of the
    busiest set of shared cores (`colocation`: (cores, {backend: chips}), `Cluster.colocation`;
    by default `default_colocation`) is started, one thread each, pinned where there is a core
    for each (as h2x pins its workers; round `turn` shifts them `turn` cores on). They load the model once, then measure in phases
    (`colocation_levels`, `phase_groups`): each backend of `backends` alone, with as many
    processes as cores, and with all of them at once; a phase's processes start timing
    together and keep their cores busy until the last is done, the others idle. Each kind's
    record has its times with all at once (`fwd_s`, `bwd_s`) and at each level (`levels`:
    {"n": [fwd_s, bwd_s]}); copies of a backend in one phase are averaged."""
    cores, workers = _processes(backends, colocation)
    usable = _usable_cores()
    pinned = bool(usable) and len(workers) <= len(usable)      # h2x pins only so
    env = dict(os.environ, H2_PROFILE_PHASES="1")
    procs = []
    try:
        for i, b in enumerate(workers):
            cmd = [sys.executable, "-m", "frontend.profile", model_path, "--backend", b,
                   "--micro-batch", str(micro_batch), "--seq-len", str(seq_len),
                   "--args", json.dumps(model_args)]
            if pinned:
                # `turn` moves each process to the next core: a plan may put any backend on
                # any core, and one vCPU of a VM can be slower than another
                cmd += ["--core", str(usable[(i + turn) % len(usable)])]
            err = tempfile.TemporaryFile(mode="w+")
            procs.append((b, subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                              stderr=err, text=True, env=env), err))
        for i in range(len(procs)):
            _expect(procs, i, "ready")
        got: dict = {}               # (backend, level) -> [result per timed process]
        for level in colocation_levels(len(workers), cores):
            for group in phase_groups(workers, level, backends):
                for i in group:
                    _tell(procs, i, "time")
                for i in group:
                    lines = _expect(procs, i, "done")
                    got.setdefault((workers[i], level), []).append(
                        _child_result(workers[i], lines[-1] if lines else "", "", 0))
                for i in group:
                    _tell(procs, i, "stop")
        for i in range(len(procs)):
            _tell(procs, i, "exit")
        for _, p, _ in procs:
            p.wait()
    finally:
        for _, p, err in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            err.close()
    k = len(workers)
    res = {}
    for b in backends:
        res[b] = {}
        for kind in got[(b, k)][0]:
            runs = got[(b, k)]
            r = dict(runs[0][kind])
            for key in ("fwd_s", "bwd_s"):
                r[key] = statistics.mean(x[kind][key] for x in runs)
            for key in ("fwd_spread", "bwd_spread"):
                r[key] = max(x[kind][key] for (bb, _), xs in got.items() if bb == b for x in xs)
            r["levels"] = {str(n): [statistics.mean(x[kind][d] for x in xs)
                                    for d in ("fwd_s", "bwd_s")]
                           for (bb, n), xs in sorted(got.items()) if bb == b}
            res[b][kind] = r
    return res


def _tell(procs, i: int, word: str) -> None:
    try:
        procs[i][1].stdin.write(word + "\n")
        procs[i][1].stdin.flush()
    except (BrokenPipeError, OSError, ValueError):
        pass           # it exited: `_expect` reports why


def _expect(procs, i: int, word: str) -> list[str]:
    """Read measuring process i's stdout up to the line `word`; the lines before it. A process
    that ends first reported an error (or crashed): raised here as `_child_result` says."""
    b, p, err = procs[i]
    lines = []
    while True:
        ln = p.stdout.readline()
        if not ln:
            rc = p.wait()
            err.seek(0)
            _child_result(b, "".join(lines), err.read(), rc if rc != 0 else 1)
            raise RuntimeError(f"measuring layer times on {b}: the process stopped early")
        if ln.strip() == word:
            return lines
        lines.append(ln)


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


def record_spread(layers: dict) -> float:
    """A record's spread: its layers' spreads weighted by their time, so a 10 us embedding
    timed at the clock's resolution does not call a record noisy that a block's 3 ms settle."""
    tot = sum(r["fwd_s"] + r["bwd_s"] for r in layers.values())
    return sum(r["fwd_s"] * r["fwd_spread"] + r["bwd_s"] * r["bwd_spread"]
               for r in layers.values()) / tot if tot > 0 else 0.0


def _cores() -> int:
    """The cores the measuring processes shared."""
    return len(_usable_cores()) or os.cpu_count() or 1


def model_digest(model_path: str) -> str:
    """SHA-256 of the model file's bytes: a record is keyed by what the model is, not its name."""
    return hashlib.sha256(Path(model_path).read_bytes()).hexdigest()


def layer_record_key(model_path: str, model_args: dict, micro_batch: int, seq_len: int,
                     backend: str, colocation: tuple[int, dict] | None = None) -> dict:
    """What a layer-time measurement of this model on `backend` is keyed by (one thread, fp32:
    how every h2x worker on this machine runs), and the co-location it is measured under
    (`measure_concurrently`: `workers` processes, by backend, on `cores` shared cores)."""
    key = layer_key(Path(model_path).stem, model_digest(model_path), model_args, micro_batch,
                    seq_len, "fp32", backend, threads=1)
    cores, workers = _processes([backend], colocation)
    key["workers"] = len(workers)
    key["colocation"] = colocation_key(cores, {b: workers.count(b) for b in set(workers)})
    return key


def rounds_setting() -> tuple[int, int]:
    """(fewest, most) measurement rounds: ROUNDS, or H2_CALIBRATION_ROUNDS="lo,hi" (or "n")."""
    v = os.environ.get("H2_CALIBRATION_ROUNDS", "").strip()
    if not v:
        return ROUNDS
    try:
        parts = [int(x) for x in v.split(",")]
        lo, hi = (parts[0], parts[0]) if len(parts) == 1 else (parts[0], parts[1])
        if len(parts) > 2 or not 1 <= lo <= hi <= 20:
            raise ValueError
    except ValueError:
        raise H2Error(f"H2_CALIBRATION_ROUNDS={v!r}: expected N or LO,HI with 1 <= LO <= HI <= 20")
    return lo, hi


def _totals(res: dict) -> dict:
    """{backend: forward + backward seconds over its layer kinds} of one round."""
    return {b: sum(r["fwd_s"] + r["bwd_s"] for r in layers.values()) for b, layers in res.items()}


def _level_totals(res: dict) -> dict:
    """{(backend, processes at once): forward + backward seconds over its layer kinds}."""
    out = {}
    for b, layers in res.items():
        for r in layers.values():
            for n, (f, bw) in (r.get("levels") or {}).items():
                out[(b, n)] = out.get((b, n), 0.0) + f + bw
    return out


def round_difference(a: dict, b: dict) -> float:
    """The largest relative difference between two rounds' backend totals, at every
    co-location level measured (a slow-down curve is only as good as its points)."""
    ta, tb = _totals(a), _totals(b)
    la, lb = _level_totals(a), _level_totals(b)
    return max([abs(ta[k] - tb[k]) / min(ta[k], tb[k]) for k in ta] +
               [abs(la[k] - lb[k]) / min(la[k], lb[k]) for k in la if k in lb])


def agreeing_pair(rounds: list[dict], tol: float = ROUND_AGREE) -> tuple[int, int] | None:
    """The two rounds that agree most closely, every backend's total within `tol` of the
    other's, or None when no two agree."""
    pairs = [(round_difference(rounds[i], rounds[j]), (i, j))
             for i in range(len(rounds)) for j in range(i + 1, len(rounds))]
    best = min(pairs, default=None)
    return best[1] if best is not None and best[0] <= tol else None


def combine_rounds(rounds: list[dict]) -> dict:
    """One result from several rounds. Where two rounds agree (`agreeing_pair`), from those two
    (a round that agreed with none was the machine's moment, not the layer's cost); otherwise from
    all of them. Each layer time is the median over the rounds used; its spreads the largest
    within those rounds or between their backend totals, whichever is larger (so rounds that
    never agreed make a noisy record); `rounds` how many were measured."""
    pair = agreeing_pair(rounds)
    used = [rounds[i] for i in pair] if pair else rounds
    out = {}
    for b in rounds[0]:
        tots = [_totals(r)[b] for r in used]
        between = (max(tots) - min(tots)) / statistics.median(tots) if len(tots) > 1 else 0.0
        out[b] = {}
        for kind in rounds[0][b]:
            rec = dict(rounds[0][b][kind])
            for key in ("fwd_s", "bwd_s"):
                rec[key] = float(statistics.median(r[b][kind][key] for r in used))
            for key in ("fwd_spread", "bwd_spread"):
                rec[key] = max(max(r[b][kind][key] for r in used), between)
            if rec.get("levels"):
                rec["levels"] = {n: [float(statistics.median(r[b][kind]["levels"][n][d]
                                                             for r in used)) for d in (0, 1)]
                                 for n in rec["levels"]}
            rec["reps"] = max(r[b][kind]["reps"] for r in used)
            rec["rounds"] = len(rounds)
            out[b][kind] = rec
    return out


def measure_rounds(measure_once, rounds: tuple[int, int] | None = None, log=None) -> dict:
    """`measure_once()` ({backend: layer times}) repeated until two rounds agree, at least
    rounds[0] times (two, to compare, unless rounds[1] is 1) and at most rounds[1] times; their
    combination (`combine_rounds`)."""
    return measure_interleaved({None: measure_once}, rounds, log)[None]


def measure_interleaved(measures: dict, rounds: tuple[int, int] | None = None,
                        log=None) -> dict:
    """{name: combined rounds} of several measurements ({name: measure_once}), their rounds
    taken in turn (round 1 of each, then round 2 of each not yet settled, ...), each repeated
    as `measure_rounds` says: what a machine's slow drift does to one, it does to all, rather
    than to the one measured last."""
    lo, hi = rounds or rounds_setting()
    got: dict = {k: [] for k in measures}

    def settled(xs):
        return len(xs) >= hi or (len(xs) >= max(lo, 2) and agreeing_pair(xs) is not None)
    while not all(settled(xs) for xs in got.values()):
        for k, measure_once in measures.items():
            if not settled(got[k]):
                got[k].append(measure_once())
    for k, xs in got.items():
        if log is not None and len(xs) > 1:
            tots = [_totals(r) for r in xs]
            pair = agreeing_pair(xs)
            log("  rounds" + (f" ({k})" if k is not None else "") + ": " + "; ".join(
                f"{b} " + " / ".join(f"{t[b] * 1e3:.1f}" for t in tots) + " ms" for b in tots[0])
                + (f" (rounds {pair[0] + 1} and {pair[1] + 1} agree within {ROUND_AGREE:.0%}: "
                   "used)" if pair else f" (no two agree within {ROUND_AGREE:.0%}: the median of "
                   "all, reported noisy)"))
    return {k: combine_rounds(xs) for k, xs in got.items()}


def record(model_path: str, model_args: dict, micro_batch: int, seq_len: int, backends,
           log=print, colocation: tuple[int, dict] | None = None,
           rounds: tuple[int, int] | None = None) -> list[str]:
    """Measure each backend's layer times under `colocation` ((cores, {backend: chips}) of the
    cluster's busiest set of shared cores, `measure_concurrently`; in rounds until two agree,
    `measure_rounds`) and store them in the calibration file as records keyed by the model's
    content, shapes and co-location; returns the records' ids."""
    return record_micro_batches(model_path, model_args, [micro_batch], seq_len, backends, log,
                                colocation, rounds)[micro_batch]


def record_micro_batches(model_path: str, model_args: dict, micro_batches, seq_len: int,
                         backends, log=print, colocation: tuple[int, dict] | None = None,
                         rounds: tuple[int, int] | None = None) -> dict[int, list[str]]:
    """`record` at several micro-batches, their rounds taken in turn (`measure_interleaved`),
    so plans at different micro-batches are priced from measurements of the same minutes;
    {micro-batch: record ids}."""
    load_model_file(model_path)     # a missing or broken model file is told once, here
    colocation = colocation or default_colocation(backends)
    turns = {mb: itertools.count() for mb in micro_batches}

    def measure_at(mb):
        return lambda: measure_concurrently(model_path, model_args, mb, seq_len, list(backends),
                                            colocation, next(turns[mb]))
    measured = measure_interleaved({mb: measure_at(mb) for mb in micro_batches}, rounds, log)
    sw = software_versions()
    cores, workers = _processes(backends, colocation)
    out = {}
    for mb, res_mb in measured.items():
        out[mb] = []
        for b in backends:
            res = res_mb[b]
            key = layer_record_key(model_path, model_args, mb, seq_len, b, colocation)
            rec = {"key": key, "host": host_info(), "cores": _cores(), "software": sw,
                   "measured_at": now_str(),
                   "reps": max(r["reps"] for r in res.values()),
                   "rounds": max(r.get("rounds", 1) for r in res.values()),
                   "spread": record_spread(res),
                   "colocation": {**key["colocation"],
                                  "levels": colocation_levels(len(workers), cores),
                                  "pinned": 0 < len(workers) <= len(_usable_cores())},
                   "layers": res}
            store_layer_record(rec)
            out[mb].append(record_id(key))
            for kind, r in res.items():
                log(f"  {b:6s} {kind:18s} fwd {r['fwd_s'] * 1e3:8.2f} ms (spread "
                    f"{r['fwd_spread']:.1%})  bwd {r['bwd_s'] * 1e3:8.2f} ms (spread "
                    f"{r['bwd_spread']:.1%})  (micro-batch {mb} x {seq_len}, {r['reps']} reps, "
                    f"{r.get('rounds', 1)} round(s))")
            curve = contention_curve(rec)
            log(f"  {b:6s} with {len(workers)} processes on {cores} cores, slower than alone by "
                + ", ".join(f"x{v:.2f} at {n}" for n, v in curve.items()))
    return out


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
            ids = record(a.model, parse_model_args(a.arg), a.micro_batch, a.seq_len, backends,
                         log=(lambda *x: None) if a.json else print)
            cal = checked(load_calibration(cal.path)).select(ids)
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
          + f"  {'copy bw':>10}  {'adamw':>10}")
    for b in backends:
        r = cal.backends[b]
        opt = f"{r['opt_bw'] / 1e9:>6.1f} GB/s" if r.get("opt_bw") else f"{'-':>11}"
        print(f"{b:<8} {r['threads']:>7}  " + "  ".join(f"{v / 1e9:>8.1f} GF/s" for v in r["matmul"].values())
              + f"  {r['mem_bw'] / 1e9:>6.1f} GB/s  {opt}")
    for rid, rec in cal.records.items():
        k = rec["key"]
        why = cal.distrusted.get(rid)
        print(f"recorded {k['backend']} layer times of {k['model']} {k['args'] or ''} "
              f"(micro-batch {k['micro_batch']} x {k['seq_len']}, {rec.get('measured_at')}, "
              f"spread {rec.get('spread') or 0:.1%})" + (f": NOT USED, {'; '.join(why)}" if why else ""))
    if layers:
        print(f"per-layer times the planner uses for {a.model} (micro-batch {a.micro_batch}):")
        for row in layers:
            print(f"  {row['backend']:<6} {row['layer']:<10} {row['kind']:<18} fwd {row['fwd_s'] * 1e3:9.3f} ms  "
                  f"bwd {row['bwd_s'] * 1e3:9.3f} ms  ({row['source']})")
    return 0


def _model_layer_times(a, cal: Calibration, backends) -> list[dict]:
    """One row per (backend, distinct layer: kind, parameters and FLOPs) of the model: the
    forward/backward seconds the resource model will use on a single-thread worker of that
    backend."""
    from frontend.plancli import load_costs
    costs = load_costs(a.model, parse_model_args(a.arg), a.micro_batch, a.seq_len)
    rows, seen = [], set()
    for b in backends:
        flops = cal.matmul_flops(b)
        for l in costs.layers:
            if (b, l.kind, l.params, l.fwd_flops) in seen:
                continue
            seen.add((b, l.kind, l.params, l.fwd_flops))
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
        time_layers, busy = prepare(a.model, json.loads(a.args), a.micro_batch, a.seq_len,
                                    a.backend)
        if os.environ.get("H2_PROFILE_PHASES") == "1":
            _serve_phases(time_layers, busy)
            return 0
        res = time_layers()
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
