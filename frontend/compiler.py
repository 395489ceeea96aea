"""`h2c compile`: model + cluster + plan -> a self-contained build directory.

    build/
      manifest.json            what h2x needs: plan, model hash, cluster, versions, stages, workers
      plan.h2plan              the plan (canonical DSL text)
      cluster.toml             the cluster description the plan was made for
      model.h2ir               the whole model's IR (for reading)
      stages/stageN.fwd.h2ir   forward program of stage N
      stages/stageN.bwd.h2ir   backward program of stage N
      stages/stageN.json       stage signature: boundary names, params, saved values, gradients
      stages/stageN.kernels.json  stage N bound to backend B: the kernel of each op, dtype
                               policy, the capability check's result
      weights/stageN.safetensors         initial parameters of stage N
      weights/stageN.consts.safetensors  non-trained buffers stage N reads (e.g. rotary tables)
      streams/wK.txt           instruction stream of worker K (one instruction per line)
      streams/schedule.csv     the simulated timeline of those streams as a time-aligned grid
                               (a row per worker, a column per time slot, bubbles empty)
      calibration.json         clusters of `measured` chips: the backends' rates and the
                               layer-time records the plan and its prediction were made with

No pickle anywhere: JSON for metadata, h2ir text for programs, safetensors for tensors. h2x needs
only this directory and the backends — not the model file.
"""
from __future__ import annotations

import argparse
import fcntl
import functools
import hashlib
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from backends.base import missing_kernels
from backends.calibrate import ensure_calibration
from backends.registry import get_backend, measured_backends, resolve_stack
from frontend.capture import load_model_file, parse_model_args, trace_model
from frontend.profile import record
from frontend.progress import phase
from frontend.stages import build_stage_programs, split_backward
from frontend.tensor_parallel import shard_weight
from h2ir.clusters.clusterfile import load_cluster
from h2ir.errors import (MAX_GLOBAL_BATCH, MAX_MICRO_BATCH, MAX_SEQ_LEN, SEED_MAX, H2Error,
                         int_flag)
from h2ir.planner import search as heteroauto
from h2ir.planner.collectives import Member, build_groups, stream_notes
from h2ir.planner.simulate import (SimResult, chunk_durations, manifest_b_fractions, plan_chunks,
                                   plan_layout, program_comm_volumes, simulate_build)
from h2ir.planner.validate import validate_plan
from h2ir.plans.dsl import format_plan, load_plan
from h2ir.plans.plan import SCHEDULES
from h2ir.schedule.devices import assign_devices
from h2ir.schedule.grid import format_grid
from h2ir.schedule.streams import (SPLIT_SCHEDULES, build_streams, format_stream,
                                   tied_stage_groups, worker_hosts)
from h2ir.text import print_graph
from h2ir.types import TRAIN_DTYPES

FORMAT = "h2-build/1"


@dataclass
class BuildResult:
    out_dir: Path
    plan: object
    stages: list
    seconds: float
    predicted: SimResult | None = None


def search_plan(plan_arg: str, costs, cluster, *, global_batch: int, micro_batch: int | None,
                seq_len: int, schedule: str, search: str = "heuristic", model_path: str = "",
                executable: bool = True, calibration=None, time_limit: float | None = None, log=None,
                sparse_moe: bool = False):
    """A Plan from 'auto' (HeteroAuto) or 'uniform'. `executable` keeps the search to what h2x
    runs: tp > 1 only where the capture found attention heads and not beside sparse experts,
    and expert parallelism only for a model whose experts h2 runs sparsely
    (`sparse_moe`: it has experts modules, frontend/moe.py); otherwise the plan has no 'moe'
    section and the model's MoE layers run as written."""
    # tp > 1 runs (frontend/tensor_parallel.py) where the capture found heads to split, and not
    # beside sparse experts (`_executable_check`)
    max_tp = 1 if executable and (sparse_moe or not costs.n_heads) else None
    max_ep = None if (sparse_moe or not executable) else 1
    wanted, schedule = schedule, heteroauto.VIRTUAL_BASE.get(
        schedule, "1f1b" if schedule == "auto" else schedule)
    if plan_arg == "auto":
        res = heteroauto.search(costs, cluster, global_batch, seq_len=seq_len, micro_batch=micro_batch,
                                schedule=schedule, method=search, calibration=calibration,
                                max_tp=max_tp, max_ep=max_ep, time_limit=time_limit)
        plan = res.plan
        if res.timed_out and log:
            log(f"the --time-limit of {time_limit:g} s ran out: the plan is the best found so far")
    elif plan_arg == "uniform":
        plan = heteroauto.uniform_plan(costs, cluster, global_batch, seq_len=seq_len,
                                       micro_batch=micro_batch, schedule=schedule,
                                       calibration=calibration, max_tp=max_tp,
                                       max_ep=max_ep).plan
    else:
        raise ValueError(f"search_plan makes 'auto' or 'uniform' plans, not {plan_arg!r}")
    plan.model = model_path or plan.model
    plan.cluster = cluster.name
    if executable and not sparse_moe and plan.moe is not None:
        plan.moe = None                 # a dense-form MoE: every expert inside its stage
        for st in plan.stages:
            st.ep = None
    return heteroauto.apply_schedule(plan, costs, cluster, wanted, calibration, log)


def cluster_calibration(cluster):
    """The calibration the planner needs for the cluster's `measured` chips (measured by the
    backends now if missing), or None for a cluster of catalog chips."""
    measured = measured_backends(cluster)
    if not measured:
        return None
    with phase(f"calibrating {', '.join(measured)}"):
        return ensure_calibration(measured)


def ensure_layer_times(cluster, model_path: str, model_args: dict, micro_batch: int, seq_len: int,
                       log=print, keep=frozenset()):
    """Plans for chips marked `measured` (this machine's backends) use measured per-layer times of
    this model, measured under the co-location the cluster's chips run with (its busiest set of
    shared cores: frontend/profile.py `colocation_of`). They are keyed by the model file's
    content and arguments, the shapes, dtype, backend, threads and co-location
    (frontend/profile.py `layer_record_key`); a record that is missing, from
    another host, stale (age, torch/numpy versions) or noisy is measured again, and a fresh one
    that is still noisy is reported. Returns the calibration restricted to this model's records
    at this micro-batch and the record ids in `keep` (the same model measured at other
    micro-batches), or None when the cluster has no measured chip."""
    from backends.calibrate import software_versions
    from frontend.profile import colocation_of, layer_record_key
    from h2ir.planner.calibration import problems, record_id
    backends = measured_backends(cluster)
    if not backends:
        return None
    quiet = lambda m: log(m) if m.startswith("calibration of the") else None  # noqa: E731
    with phase(f"calibrating {', '.join(backends)}"):
        cal = ensure_calibration(backends, log=quiet)
    sw = software_versions()
    name = Path(model_path).stem
    ids, todo = {}, []
    colocation = colocation_of(cluster)
    for b in backends:
        rid = ids[b] = record_id(layer_record_key(model_path, model_args, micro_batch, seq_len, b,
                                                  colocation))
        rec = cal.records.get(rid)
        why = ["not measured yet"] if rec is None else problems(rec, software=sw)
        if why:
            todo.append(b)
            if rec is not None:
                log(f"layer times of {name} on {b} measured again: {'; '.join(why)}")
    if todo:
        log(f"measuring per-layer times of {name} on {', '.join(todo)} (micro-batch {micro_batch} "
            f"x {seq_len}; stored in the calibration file)")
        with phase(f"measuring {name}'s layer times on {', '.join(todo)}"):
            record(model_path, model_args, micro_batch, seq_len, todo, log=log,
                   colocation=colocation)
        cal = ensure_calibration(backends, log=quiet)
        for b in todo:
            why = problems(cal.records[ids[b]], software=sw)
            if why:
                log(f"warning: layer times of {name} on {b}: {'; '.join(why)} (used anyway: "
                    "run on a quieter machine for a better plan)")
    return cal.select(set(ids.values()) | set(keep))


def _sha256(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _executable_check(plan):
    # tp > 1 stages run sharded (frontend/tensor_parallel.py); ep > 1 stages share out their
    # experts (frontend/moe.py); both at once in one stage is not built
    for s, st in enumerate(plan.stages):
        if st.tp > 1 and plan.stage_ep(s) > 1:
            raise H2Error(f"stage {s} has tp={st.tp} and ep={plan.stage_ep(s)}: tensor and "
                          "expert parallelism in one stage is not executed yet; use --dry-run",
                          plan.source, st.line or None)
        if st.tp > 1 and plan.moe is not None:
            raise H2Error(f"stage {s} has tp={st.tp} in a plan with a 'moe' section: tensor "
                          "parallelism of sparse MoE layers is not executed yet; use --dry-run",
                          plan.source, st.line or None)


def lowering_record(prog_fwd, prog_bwd, stack: str, stage: int, dtype_policy: str,
                    dry_run: bool) -> dict:
    """Bind a stage's programs to a backend's kernels; an op the backend lacks is an error now,
    not a crash at step 500."""
    resolved = resolve_stack(stack)
    used = sorted(prog_fwd.ops_used() | prog_bwd.ops_used())
    if resolved is None:
        if not dry_run:
            raise H2Error(f"stage {stage} runs on the '{stack}' software stack, which has no op "
                          "library here (available: torch, numpy, cuda, rocm); compile with "
                          "--dry-run to plan it")
        return {"backend": stack, "stage": stage, "dtype_policy": dtype_policy, "ops": used,
                "capability_check": f"skipped: no op library for '{stack}' in this installation"}
    backend_name, device = resolved
    be = get_backend(backend_name)
    missing = sorted(missing_kernels(prog_fwd, be) | missing_kernels(prog_bwd, be))
    if missing:
        raise H2Error(f"stage {stage} is placed on backend '{backend_name}', which has no kernel "
                      f"for op(s): {', '.join(missing)}",
                      hint="place the stage on another chip type, or add the kernels to "
                           f"backends/{backend_name}/")
    kernels = {op: (f"{getattr(be.ops[op], '__module__', '?')}."
                    f"{getattr(be.ops[op], '__qualname__', op)}" if op in be.ops
                    else "comm: the worker's TP group (DiComm)")
               for op in used}
    return {"backend": backend_name, "device": device, "stage": stage, "dtype_policy": dtype_policy,
            "capability_check": "passed", "ops": used, "kernels": kernels}


@dataclass
class _Inputs:
    plan_arg: str                # 'auto' | 'uniform' | a .h2plan file
    cluster: object
    plan: object | None          # a hand-written plan file, else None (search or uniform)
    global_batch: int
    micro_batch: int | None
    seq_len: int


def _read_inputs(cluster_arg: str, plan_arg: str, global_batch, micro_batch, seq_len) -> _Inputs:
    """The cluster and, for a plan file, the plan (whose batch shape and cluster win)."""
    cluster = load_cluster(cluster_arg)
    if plan_arg in ("auto", "uniform"):
        return _Inputs(plan_arg, cluster, None, global_batch, micro_batch, seq_len)
    fplan = load_plan(plan_arg)
    if cluster_arg == "local" and fplan.cluster:
        cluster = load_cluster(fplan.cluster)
    return _Inputs(plan_arg, cluster, fplan, fplan.global_batch, fplan.micro_batch, fplan.seq_len)


MAX_EXTRA_MICRO_BATCHES = 2     # layer-time measurements a search may add at other micro-batches


def _capture_and_plan(model_path, model_args, inp: _Inputs, *, schedule, search, dry_run, log,
                      time_limit=None, measure=False):
    """Trace the model, then plan it (search/uniform) or take the plan file; retrace at the
    plan's micro-batch if the search chose another. Also returns the calibration used."""
    mb_trace = inp.micro_batch or 1
    log(f"capturing {model_path} (meta device) ...")
    load_model_file(model_path)     # a missing or broken model file is told before any measuring
    cal = None
    if inp.plan is None or measure:   # the search ranks plans by this model's measured layer times
        cal = ensure_layer_times(inp.cluster, model_path, model_args, mb_trace, inp.seq_len, log)
    measured_mbs = {mb_trace} if cal is not None else set()
    cal = cal or cluster_calibration(inp.cluster)
    cap = trace_model(model_path, model_args, mb_trace, inp.seq_len)
    costs = cap.graph.layer_costs()
    plan_search = functools.partial(
        search_plan, inp.plan_arg, costs, inp.cluster, global_batch=inp.global_batch,
        micro_batch=inp.micro_batch, seq_len=inp.seq_len, schedule=schedule, search=search,
        model_path=model_path, executable=not dry_run, time_limit=time_limit, log=log,
        sparse_moe=_has_experts_modules(cap.model))
    if inp.plan is None:
        with phase(f"searching plans ({inp.plan_arg})"):
            plan = plan_search(calibration=cal)
    else:
        plan = inp.plan
    # The search priced micro-batches it has no measurement of from the measured ones (linear in
    # the rows: a larger micro-batch runs more efficiently than that says). Measure the one it
    # chose and search again with both, until its choice is measured (a bounded number of times).
    for _ in range(MAX_EXTRA_MICRO_BATCHES):
        if inp.plan is not None or not measured_mbs or plan.micro_batch in measured_mbs:
            break
        log(f"the plan's micro-batch {plan.micro_batch} was priced from micro-batch(es) "
            f"{', '.join(map(str, sorted(measured_mbs)))}: measuring it and searching again")
        cal = ensure_layer_times(inp.cluster, model_path, model_args, plan.micro_batch,
                                 inp.seq_len, log, keep=cal.selected)
        measured_mbs.add(plan.micro_batch)
        with phase(f"searching plans ({inp.plan_arg})"):
            plan = plan_search(calibration=cal)
    if plan.micro_batch != mb_trace:
        cap = trace_model(model_path, model_args, plan.micro_batch, plan.seq_len)
        costs = cap.graph.layer_costs()
    for w in validate_plan(plan, costs, inp.cluster):
        log(f"warning: {w}")
    if not dry_run:
        _executable_check(plan)
    log(f"plan: {len(plan.stages)} stage(s) x dp {plan.dp}, {plan.num_microbatches} micro-batches "
        f"of {plan.micro_batch} x {plan.seq_len} ({plan.schedule})")
    return cap, costs, plan, cal


_RUN_LOCK = ".h2x-run.lock"      # executor/rundir.py LOCK_FILE: flocked while `h2x run` runs


def _check_output_dir(out: Path) -> bool:
    """Whether `out` is an earlier build to replace (False: absent or empty). An H2Error where
    replacing it would lose something: a file, a directory h2c did not write, checkpoints (they
    resume only in the build that wrote them), or the files of a run in progress."""
    if not out.exists():
        if out.is_symlink():
            raise H2Error("-o names a dangling symbolic link", str(out))
        return False
    if not out.is_dir():
        raise H2Error("-o names an existing file, not a directory; give a directory for the build",
                      str(out))
    if not any(out.iterdir()):
        return False
    if not (out / ".h2-build").is_file():
        raise H2Error("output directory is not empty and is not an h2 build directory; refusing "
                      "to overwrite it", str(out), hint="pick another -o, or empty it yourself")
    ckpts = sorted(p.name for p in (out / "ckpt").glob("step_*"))
    if ckpts:
        shown = ", ".join(ckpts[:3]) + (", ..." if len(ckpts) > 3 else "")
        raise H2Error(f"the build directory holds {len(ckpts)} checkpoint(s) in ckpt/ ({shown}); "
                      "recompiling would delete them", str(out),
                      hint="a checkpoint resumes only in the build that wrote it: move or copy the "
                      "whole build elsewhere to keep them, delete ckpt/ if they are not needed, or "
                      "pick another -o")
    if _run_in_progress(out):
        raise H2Error("an h2x run is using this build directory; recompiling would delete its "
                      "files under it", str(out), hint="wait for the run to end, or pick another -o")
    return True


def _run_in_progress(out: Path) -> bool:
    try:
        fd = os.open(out / _RUN_LOCK, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)                # releases the probe's lock, if it got one


def _prepare_build_dir(out_dir: str, dry_run: bool) -> Path:
    out = Path(out_dir)
    if _check_output_dir(out):      # the earlier build's files go; the directory itself stays
        for child in out.iterdir():
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()
    try:
        for sub in ("stages", "streams") + (() if dry_run else ("weights",)):
            (out / sub).mkdir(parents=True, exist_ok=True)
        (out / ".h2-build").write_text("written by h2c compile; safe to delete\n")
    except OSError as e:
        raise H2Error(f"cannot create the build directory here: {e.strerror}", str(out),
                      hint="pass a writable directory with -o") from None
    return out


def _write_stages(out: Path, progs, plan, cluster, dry_run: bool, log) -> list[dict]:
    """Each stage's programs, signature and kernel binding; returns the manifest's stage list."""
    stages_meta = []
    for p, st in zip(progs, plan.stages):
        chip = cluster.chip(st.chip)
        train = TRAIN_DTYPES.get(cluster.dtype)
        policy = cluster.dtype if train and train.policy and chip.backend != "numpy" else "fp32"
        if cluster.dtype in ("bf16", "fp16") and chip.backend == "numpy":
            log(f"warning: stage {p.index} runs on numpy, which computes in fp32 "
                f"(cluster dtype {cluster.dtype})")
        s = p.index
        (out / f"stages/stage{s}.fwd.h2ir").write_text(print_graph(p.fwd))
        (out / f"stages/stage{s}.bwd.h2ir").write_text(print_graph(p.bwd))
        (out / f"stages/stage{s}.json").write_text(json.dumps(p.meta(), indent=1))
        low = lowering_record(p.fwd, p.bwd, chip.backend, s, policy, dry_run)
        (out / f"stages/stage{s}.kernels.json").write_text(json.dumps(low, indent=1))
        zb = None
        if plan.schedule in SPLIT_SCHEDULES:    # zero-bubble: the backward as B (input grads) and W
            sp = split_backward(p)
            for part in ("bwd_input", "bwd_weight"):
                (out / f"stages/stage{s}.{part}.h2ir").write_text(print_graph(sp[part]))
            zb = {"bwd_input": f"stages/stage{s}.bwd_input.h2ir",
                  "bwd_weight": f"stages/stage{s}.bwd_weight.h2ir",
                  **{k: sp[k] for k in ("b_outputs", "w_outputs", "stash", "w_inputs",
                                        "b_flops_fraction")}}
        stages_meta.append({
            "index": s, "chip": st.chip, "backend": low["backend"], "device": low.get("device"),
            "stack": chip.backend, "dtype_policy": policy,
            "layers": p.layers, "fwd": f"stages/stage{s}.fwd.h2ir", "bwd": f"stages/stage{s}.bwd.h2ir",
            "signature": f"stages/stage{s}.json", "kernels": f"stages/stage{s}.kernels.json",
            "weights": None if dry_run else f"weights/stage{s}.safetensors",
            "consts": None if dry_run else f"weights/stage{s}.consts.safetensors",
            "params": len(p.params), "tp": p.tp, "zero_bubble": zb,
            # ZeRO stage: 1 shards the AdamW state over the dp group (executor/zero.py)
            "zero": st.zero if plan.dp > 1 else 0,
        })
    return stages_meta


def _tied_stage_meta(costs, plan, progs) -> list[dict | None]:
    """Per stage, what the workers need of tied parameters: the copies it holds (updated by
    their owner stage) and, on an owner, the parameters it shares with each holder stage."""
    stage_of = {l: s for s, st in enumerate(plan.stages) for l in st.layers}
    meta: list[dict] = [{"copies": [], "shared": {}} for _ in plan.stages]
    for t in costs.ties:
        owner = stage_of[t.owner]
        for s in sorted({stage_of[u] for u in t.users} - {owner}):
            if t.name not in progs[s].params:
                raise H2Error(f"internal: stage {s} reads tied parameter {t.name} but its "
                              "program does not take it")
            meta[s]["copies"].append(t.name)
            meta[s]["owner"] = owner
            meta[owner]["shared"].setdefault(str(s), []).append(t.name)
    return [m if m["copies"] or m["shared"] else None for m in meta]


def _write_streams(out: Path, plan, costs, stages_meta, cluster,
                   cal=None) -> tuple[dict, list[dict]]:
    """One instruction-stream file per worker; returns the streams and the manifest's workers
    (each with its replica, stage and TP rank: h2ir.schedule.streams.WorkerLayout, and the host
    its chip is on: h2ir.schedule.streams.worker_hosts, which `h2x run --nnodes` maps processes
    by)."""
    ties = tied_stage_groups(costs.ties, [list(s.layers) for s in plan.stages])
    lay = plan_layout(plan)
    eps = [plan.stage_ep(s) for s in range(len(plan.stages))]
    streams = build_streams(plan.schedule, len(plan.stages), plan.num_microbatches, plan.dp,
                            ties=ties, tp=None if plan.is_virtual else lay.tps, ep=eps,
                            migrate=plan.moe is not None and plan.moe.migration != "none",
                            virtual=plan.virtual, durations=_durations(plan, costs, cluster, cal,
                                                                       stages_meta),
                            zero=[st.zero for st in plan.stages])
    if plan.is_virtual:
        return streams, _chunked_workers(out, plan, streams, stages_meta, cluster)
    hosts = worker_hosts(lay, [st.chip for st in plan.stages], cluster)
    workers = []
    for w, instrs in streams.items():
        r, s, k = lay.where(w)
        tp = lay.tps[s]
        (out / f"streams/w{w}.txt").write_text(
            f"# worker {w}: replica {r}, stage {s}" + (f", tp rank {k} of {tp}" if tp > 1 else "")
            + f" ({stages_meta[s]['backend']})\n" + format_stream(instrs))
        entry = {"id": w, "replica": r, "stage": s, "chip": plan.stages[s].chip,
                 "backend": stages_meta[s]["backend"], "stream": f"streams/w{w}.txt",
                 "host": hosts[w]}
        if tp > 1:
            entry.update(tp_rank=k, tp_group=list(lay.tp_group(r, s)),
                         weights=stages_meta[s]["weights"] and
                         f"weights/stage{s}.tp{k}.safetensors")
        if eps[s] > 1:
            entry.update(ep_rank=r % eps[s], ep_group=list(lay.ep_group(r, s, eps[s], k)),
                         weights=stages_meta[s]["weights"] and
                         f"weights/stage{s}.ep{r % eps[s]}.safetensors")
        workers.append(entry)
    return streams, workers


def _comm_groups(plan, cluster, costs, progs, stages_meta, workers, streams) -> list:
    """The build's communication groups and the library each runs on (h2ir/planner/
    collectives.py), costed at one message of each: a stage's gradients, its boundary tensor,
    its programs' mean TP all-reduce and EP all-to-all."""
    members = [Member(stack=stages_meta[w["stage"]]["stack"], backend=w["backend"],
                      device=stages_meta[w["stage"]].get("device"), host=w.get("host", 0),
                      chip=w["chip"], stage=w["stage"]) for w in workers]
    layer = {l.name: l for l in costs.layers}
    volumes = {}
    for s, (st, p) in enumerate(zip(plan.stages, progs)):
        ls = [layer[n] for n in st.layers if n in layer]
        volumes[("dp", s)] = sum(l.param_bytes for l in ls) // max(1, st.tp)
        if ls:
            volumes[("p2p", s)] = ls[-1].out_bytes
        fwd, bwd = program_comm_volumes(p.fwd, p.bwd)
        for kind, op in (("tp", "all_reduce"), ("ep", "all_to_all")):
            sizes = [n for o, n, _ in fwd + bwd if o == op]
            if sizes:
                volumes[(kind, s)] = sum(sizes) / len(sizes)
    return build_groups(streams, members, plan.comm, cluster, volumes, plan.is_virtual)


def _note_comm(out: Path, workers: list[dict], groups: list) -> None:
    """Each worker's groups and their libraries as comment lines under its stream's header."""
    for w in workers:
        notes = stream_notes(groups, w["id"])
        if notes:
            path = out / w["stream"]
            head, _, rest = path.read_text().partition("\n")
            path.write_text(f"{head}\n{notes}{rest}")


def _durations(plan, costs, cluster, cal, stages_meta) -> dict | None:
    """The stages' predicted (F, B, W) times, which the zero-bubble virtual-stage schedules
    are ordered by (their split programs' FLOP shares give B and W)."""
    if plan.schedule not in ("izb", "zbv"):
        return None
    from h2ir.planner.resource import ResourceModel
    rm = ResourceModel(costs, cluster, plan.micro_batch, plan.seq_len, cal)
    return chunk_durations([rm.stage_times(plan, j) for j in range(plan.num_stages)],
                           manifest_b_fractions(stages_meta))


def _chunked_workers(out: Path, plan, streams, stages_meta, cluster) -> list[dict]:
    """The manifest's workers of a virtual-stage plan: each runs the stages (chunks) listed
    in its `chunks`, in chunk order; `stage` is its first."""
    lay = plan_layout(plan)
    groups = plan_chunks(plan)
    hosts = worker_hosts(lay, [plan.stages[g[0]].chip for g in groups], cluster)
    workers = []
    for w, instrs in streams.items():
        r, s, _ = lay.where(w)
        cs = groups[s]
        (out / f"streams/w{w}.txt").write_text(
            f"# worker {w}: replica {r}, stages {', '.join(map(str, cs))} as chunks "
            f"{', '.join(f'c{c}' for c in range(len(cs)))} ({stages_meta[cs[0]]['backend']})\n"
            + format_stream(instrs))
        workers.append({"id": w, "replica": r, "stage": cs[0], "chunks": list(cs),
                        "chip": plan.stages[cs[0]].chip, "backend": stages_meta[cs[0]]["backend"],
                        "stream": f"streams/w{w}.txt", "host": hosts[w]})
    return workers


def _manifest(cap, costs, plan, cluster, model_path, model_args, seed, dry_run, out: Path,
              stages_meta, workers, sim: SimResult) -> dict:
    import torch
    return {
        "format": FORMAT,
        "versions": {"h2": _h2_version(), "torch_at_compile": torch.__version__,
                     "python": sys.version.split()[0]},
        "created_unix": int(time.time()),
        "model": {"name": cap.model_file.name, "path": str(Path(model_path).resolve()),
                  "sha256": _sha256(model_path), "args": model_args, "capture": cap.how,
                  "total_params": costs.total_params, "vocab": costs.vocab},
        "cluster": {"name": cluster.name, "file": "cluster.toml" if (out / "cluster.toml").exists()
                    else None, "dtype": cluster.dtype, "shared_cores": cluster.shared_cores},
        "plan": "plan.h2plan",
        "global_batch": plan.global_batch, "micro_batch": plan.micro_batch, "seq_len": plan.seq_len,
        "num_microbatches": plan.num_microbatches, "dp": plan.dp, "schedule": plan.schedule,
        "virtual": plan.virtual,
        "seed": seed, "dry_run": dry_run,
        "config": BUILD_CONFIG,
        "predicted_step_s": sim.step_time_s,
        "moe": None if plan.moe is None else {
            "a2a": plan.moe.a2a, "placement": plan.moe.placement, "capacity": plan.moe.capacity,
            "migration": plan.moe.migration, "migration_every": plan.moe.migration_every,
            "threshold": plan.moe.threshold},
        "stages": stages_meta, "workers": workers,
    }


def compile_model(model_path: str, *, model_args: dict | None = None, cluster_arg: str = "local",
                  plan_arg: str = "auto", global_batch: int = 16, micro_batch: int | None = None,
                  seq_len: int = 128, out_dir: str = "build", dry_run: bool = False, seed: int = 0,
                  schedule: str = "1f1b", search: str = "heuristic", log=print,
                  time_limit: float | None = None, measure: bool = False,
                  config=None) -> BuildResult:
    """`config`: the job configuration (h2ir/config.py) written as the build's train.toml,
    the defaults `h2x run` starts from; None: the defaults with these arguments."""
    t0 = time.perf_counter()
    model_args = model_args or {}
    _check_output_dir(Path(out_dir))    # before capture: a bad -o fails in a second, not a minute
    inp = _read_inputs(cluster_arg, plan_arg, global_batch, micro_batch, seq_len)
    if inp.cluster.dtype == "fp16" and not dry_run:
        # the planner costs fp16 at the chips' fp16 peak; the stages would run fp32 without the
        # dynamic loss scaling fp16 training needs: refuse rather than build that silently
        raise H2Error("the cluster's dtype is fp16, which h2 plans but does not execute: its "
                      "stage programs have no fp16 policy with dynamic loss scaling",
                      inp.cluster.source or cluster_arg,
                      hint="set dtype = \"bf16\" (or \"fp32\") in the cluster file, or compile "
                           "with --dry-run to plan it")
    cap, costs, plan, cal = _capture_and_plan(model_path, model_args, inp, schedule=schedule,
                                              search=search, dry_run=dry_run, log=log,
                                              time_limit=time_limit, measure=measure)
    cluster = inp.cluster
    out = _prepare_build_dir(out_dir, dry_run)
    log(f"building forward/backward programs for {len(plan.stages)} stage(s) "
        f"({time.perf_counter() - t0:.1f} s so far) ...")
    caps = _stage_captures(cap, model_path, model_args, plan)
    progs = _stage_programs(caps, plan, cap.model_file.name)
    if caps.get(1, cap) is not cap:
        # the plan was priced on the model as captured (a dense MoE reference); the build runs
        # the sparse dispatch: simulate it, and predict its memory, from what runs
        costs = caps[1].graph.layer_costs()
    cap = caps.get(1, cap)        # the model as it runs (sparse MoE installed) for model.h2ir

    (out / "plan.h2plan").write_text(format_plan(plan))
    if cluster.source and Path(cluster.source).is_file():
        shutil.copyfile(cluster.source, out / "cluster.toml")
    (out / "model.h2ir").write_text(print_graph(cap.graph))
    stages_meta = _write_stages(out, progs, plan, cluster, dry_run, log)
    for m, tied in zip(stages_meta, _tied_stage_meta(costs, plan, progs)):
        m["tied"] = tied
    for m, p in zip(stages_meta, progs):
        if p.moe:
            m["moe"] = p.moe
    if not dry_run:
        _write_weights(cap, progs, model_path, model_args, seed, out,
                       config.init.from_ if config is not None else None, log)
    streams, workers = _write_streams(out, plan, costs, stages_meta, cluster, cal)
    for w, dev in zip(workers, assign_devices(workers, [m.get("device") for m in stages_meta],
                                              cluster)):
        w.update(dev)
    comm = _comm_groups(plan, cluster, costs, progs, stages_meta, workers, streams)
    _note_comm(out, workers, comm)
    sim = simulate_build(costs, plan, cluster, cal, streams,
                         {p.index: program_comm_volumes(p.fwd, p.bwd) for p in progs},
                         manifest_b_fractions(stages_meta))
    (out / "streams/schedule.csv").write_text(format_grid(sim.grid()))
    for m, mem in zip(stages_meta, sim.stage_memory):
        # the resource model's peak per device, which h2x reports beside the measured one
        m["memory"] = {"predicted_bytes": mem.total, "capacity_bytes": mem.capacity,
                       "inflight": mem.inflight, "items": dict(mem.items)}
    manifest = _manifest(cap, costs, plan, cluster, model_path, model_args, seed, dry_run, out,
                         stages_meta, workers, sim)
    manifest["comm"] = {"setting": plan.comm, "groups": [g.to_json() for g in comm]}
    # the layer-time records this prediction used, so h2x predicts from the same ones (a
    # calibration file holds other models' and shapes' records too)
    selected = getattr(cal, "selected", None) if cal is not None else None
    if selected is not None:
        manifest["calibration_records"] = sorted(selected)
    if cal is not None:
        _write_calibration(cal, out)
        manifest["calibration"] = BUILD_CALIBRATION
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    _write_config(out, config, model_path, model_args, plan, cluster_arg, schedule, search, seed)
    write_digests(out)
    log(f"predicted step time {sim.step_time_s:.4g} s (simulated from the build's {len(streams)} "
        f"stream file(s))")
    note = sim.estimate_note()
    if note:
        log(f"note: {note}; `h2c compile --measure` (or `--plan auto`) measures them")
    return BuildResult(out, plan, progs, time.perf_counter() - t0, sim)


BUILD_CALIBRATION = "calibration.json"
BUILD_CONFIG = "train.toml"      # executor/build.py reads it; not in the build's fingerprint
BUILD_DIGESTS = "digests.json"   # executor/build.py checks every file h2x reads against it
DIGESTS_FORMAT = "h2-digests/1"
# not digested: the job configuration, whose non-program fields a user may edit, and what
# `h2x run` writes into a build (checkpoints, worker logs, token caches, its lock: dot files)
_UNDIGESTED = {BUILD_CONFIG, BUILD_DIGESTS}
_RUN_OUTPUTS = {"ckpt", "logs", "data"}


def write_digests(out: Path) -> None:
    """Every file h2c wrote into the build (train.toml aside) with its sha256 and size, so that
    h2x refuses a file changed, truncated or swapped after the compile, weights included."""
    out = Path(out)
    files = {}
    for p in sorted(out.rglob("*")):
        rel = p.relative_to(out).as_posix()
        top = rel.split("/")[0]
        if top in _RUN_OUTPUTS or top.startswith(".") or rel in _UNDIGESTED:
            continue
        if p.is_file() and not p.is_symlink():
            h, size = hashlib.sha256(), 0
            with open(p, "rb") as f:
                while chunk := f.read(1 << 20):
                    h.update(chunk)
                    size += len(chunk)
            files[rel] = {"sha256": h.hexdigest(), "size": size}
    (out / BUILD_DIGESTS).write_text(json.dumps({"format": DIGESTS_FORMAT, "files": files},
                                                indent=1) + "\n")



def _write_config(out: Path, cfg, model_path, model_args, plan, cluster_arg, schedule, search,
                  seed) -> None:
    """The job configuration as compiled: the program fields as the build has them (a plan
    file's batch shape wins), the rest as given — h2x run's defaults."""
    from h2ir.config import Config
    cfg = cfg or Config()
    cfg.model.file, cfg.model.args = model_path, dict(model_args)
    cfg.batch.global_, cfg.batch.micro, cfg.batch.seq = \
        plan.global_batch, plan.micro_batch, plan.seq_len
    cfg.plan.cluster, cfg.plan.schedule, cfg.plan.search = cluster_arg, schedule, search
    cfg.training.seed = seed
    cfg.plan.output = str(out)
    (out / BUILD_CONFIG).write_text(
        "# the job configuration h2c compile used (h2c config explains every field); h2x run\n"
        "# starts from it. Fields the programs depend on ([program] in h2c config) must not\n"
        "# change; the others may, between runs and across a resume.\n" + cfg.to_toml())


def _write_calibration(cal, out: Path) -> None:
    """The calibration this build was planned and predicted with (the backends' rates and the
    layer-time records the planner was allowed to use), so h2x's prediction of this build is the
    compile's, whatever the host's calibration file holds by the time it runs: another compile
    may have re-measured a backend, or replaced a record of the same key."""
    d = cal.to_json()
    if cal.selected is not None:
        d["layer_records"] = {rid: r for rid, r in cal.records.items() if rid in cal.selected}
    (out / BUILD_CALIBRATION).write_text(json.dumps(d, indent=1))


def _write_weights(cap, progs, model_path, model_args, seed, out: Path, init_from=None,
                   log=print):
    """Initial weights: the model built for real on the CPU with `seed` (the same init an eager
    run with that seed gets), or read from `init_from` (frontend/pretrained.py), split per
    stage."""
    import numpy as np
    import torch
    from safetensors.numpy import save_file

    from frontend import moe
    from frontend.pretrained import lazy_weights, load_pretrained
    torch.manual_seed(seed)
    lazy = lazy_weights(cap.model_file, model_args, init_from) if init_from else None
    if lazy is not None:      # one stage's tensors in memory at a time
        model, source = lazy
        log(f"init.from {init_from}: {len(source.key)} parameters read stage by stage")
        weight = source.array
    else:
        model = cap.model_file.build(model_args)
        if init_from:
            log(load_pretrained(model, init_from))
        params = dict(model.named_parameters(remove_duplicate=False))   # tied: every name

        def weight(k):
            return params[k].detach().numpy().copy()
    names = {k for p in progs for k in p.consts if not k.endswith((".h2_placement", ".h2_slot"))}
    buffers = cap.constants(model, names)
    for k, v in buffers.items():
        if v.device.type == "meta":        # a frozen parameter, still on meta: from the file
            buffers[k] = torch.from_numpy(weight(k))
    for p in progs:
        for path, e in (p.moe or {}).get("experts", {}).items():   # the placement constants
            order = np.array(e["placement"], dtype=np.int64)
            buffers[f"{path}.h2_placement"] = torch.from_numpy(order)
            buffers[f"{path}.h2_slot"] = torch.from_numpy(np.argsort(order).astype(np.int64))
    for p in progs:
        full = {k: weight(k) for k in p.params}
        save_file(full, str(out / f"weights/stage{p.index}.safetensors"))
        ep = (p.moe or {}).get("ep", 1)
        if ep > 1:                                     # each EP rank's experts, in slot order
            placements = {path: e["placement"] for path, e in p.moe["experts"].items()}
            stacks = {k: path for path, e in p.moe["experts"].items() for k in e["params"]}
            for r, shard in enumerate(moe.shards(full, stacks, placements, ep)):
                save_file(shard, str(out / f"weights/stage{p.index}.ep{r}.safetensors"))
        for r in range(p.tp if p.tp > 1 else 0):       # each TP rank's shards
            save_file({k: np.ascontiguousarray(shard_weight(full[k], p.sharding.get(k), p.tp, r))
                       for k in p.params},
                      str(out / f"weights/stage{p.index}.tp{r}.safetensors"))
        consts = {k: buffers[k].detach().numpy().copy() for k in p.consts}
        if p.fixed_inputs:             # the model inputs after the token ids (stage 0)
            consts.update({k: v.numpy().copy() for k, v in cap.fixed_inputs().items()})
        save_file(consts, str(out / f"weights/stage{p.index}.consts.safetensors"))
        del full                           # before the next stage's tensors are read


def _has_experts_modules(model) -> bool:
    from frontend import moe
    return bool(moe.experts_modules(model))


def _stage_captures(cap, model_path: str, model_args: dict, plan) -> dict:
    """EP degree -> the capture stage programs of that degree are built from. Without a 'moe'
    section the model runs as written; with one, its experts modules run h2's sparse forward
    (frontend/moe.py) with the plan's capacity, and each EP degree's capture holds one rank's
    share of the expert stacks."""
    if plan.moe is None:
        return {1: cap}
    import torch
    from frontend import moe
    out = {}
    for ep in sorted({plan.stage_ep(s) for s in range(len(plan.stages))} | {1}):
        with torch.device("meta"):
            model = cap.model_file.build(model_args)
        moe.install(model, ep=ep, capacity=plan.moe.capacity, placement=plan.moe.placement,
                    file=plan.source or model_path)
        out[ep] = trace_model(model_path, model_args, plan.micro_batch, plan.seq_len, model=model)
    return out


def _stage_programs(caps: dict, plan, name: str) -> list:
    """Every stage's programs, each from the capture of its EP degree; an EP stage's programs
    are one EP rank's (the same on every rank: which experts a rank holds is data)."""
    from frontend import moe
    layers = [list(s.layers) for s in plan.stages]
    built = {}
    used = {plan.stage_ep(s) for s in range(len(plan.stages))}
    for ep, c in caps.items():
        if ep in used:      # caps[1] also serves model.h2ir: no programs unless a stage uses it
            try:
                built[ep] = build_stage_programs(c, layers, name=name,
                                                 tp=[s.tp for s in plan.stages],
                                                 recompute=[s.recompute for s in plan.stages])
            except H2Error as e:    # an op met only in a backward program: locate it in the model
                raise c.locate(e) from None
    progs = []
    for s in range(len(plan.stages)):
        ep = plan.stage_ep(s)
        p = built[ep][s]
        p.moe = None
        if plan.moe is not None:
            model = caps[ep].model
            stacks = moe.expert_param_names(model)
            mods = {path: m for path, m in moe.experts_modules(model)}
            mine = sorted({stacks[k] for k in p.params if k in stacks})
            p.moe = {"ep": ep, "capacity_factor": plan.moe.capacity, "experts": {
                path: {"experts": mods[path].h2_experts,
                       "params": sorted(k for k in p.params if stacks.get(k) == path),
                       "placement": moe.placement_order(mods[path].h2_experts, ep,
                                                        plan.moe.placement)}
                for path in mine}}
        progs.append(p)
    return progs


COMPILE_ALIASES = {"cluster": ("plan", "cluster"), "plan": ("plan", "plan"),
                   "search": ("plan", "search"), "schedule": ("plan", "schedule"),
                   "global_batch": ("batch", "global"), "micro_batch": ("batch", "micro"),
                   "seq_len": ("batch", "seq"), "seed": ("training", "seed"),
                   "output": ("plan", "output"), "time_limit": ("plan", "time_limit")}


def job_config(a, overrides, ap, aliases: dict = COMPILE_ALIASES):
    """The job configuration of an h2c command: defaults < --config < --section.field and the
    short flags (`aliases`: argparse dest -> field) < the positional model file."""
    from h2ir import config as jobconfig
    given = {field: getattr(a, dest) for dest, field in aliases.items()
             if getattr(a, dest, None) is not None or (dest == "micro_batch" and
                                                        hasattr(a, dest))}
    cfg = jobconfig.build_config(config_file=a.config, overrides=overrides, aliases=given)
    if a.arg:
        cfg.model.args = {**cfg.model.args, **parse_model_args(a.arg)}
    if a.model:
        cfg.model.file = a.model
    if not cfg.model.file:
        ap.error("the model file is required (a positional argument, or model.file in --config)")
    return cfg


def _h2_version() -> str:
    try:
        from importlib.metadata import version
        return version("h2")
    except Exception:
        return "0+unknown"


def main(argv: list[str]) -> int:
    from h2ir import config as jobconfig
    argv, overrides = jobconfig.split_overrides(argv)
    ap = argparse.ArgumentParser(prog="h2c compile", description="Compile a model for a cluster "
                                 "and plan into a build directory that `h2x run` executes. "
                                 "Every setting is a field of the job configuration (`h2c "
                                 "config` lists them): --config FILE.toml sets them, "
                                 "--section.field VALUE overrides one; the flags below are "
                                 "short names of fields.")
    ap.add_argument("model", nargs="?", help="model file (.py; default: the config's model.file)")
    ap.add_argument("--config", metavar="FILE.toml", help="the job configuration")
    ap.add_argument("--arg", action="append", default=[], metavar="KEY=VALUE",
                    help="model.args: a keyword argument of build_model (repeatable)")
    ap.add_argument("--cluster", help="plan.cluster: cluster TOML or built-in name (default: local)")
    ap.add_argument("--plan", help="plan.plan: auto | uniform | FILE.h2plan (default: auto)")
    ap.add_argument("--search", choices=["heuristic", "exhaustive"], help="plan.search")
    ap.add_argument("--schedule", choices=[*SCHEDULES, "auto"],
                    help="plan.schedule; zb1: ZB-H1 zero-bubble (backward split in B and W); "
                    "interleaved: interleaved 1F1B (2 chunks per worker); izb: interleaved zero "
                    "bubble; zbv: V-shape zero bubble; auto: the fastest of 1f1b, zb1, "
                    "interleaved, izb and zbv by the simulator, among those that fit memory"),
    ap.add_argument("--global-batch", type=int_flag(1, MAX_GLOBAL_BATCH), help="batch.global")
    ap.add_argument("--micro-batch", type=int_flag(1, MAX_MICRO_BATCH, words=("auto",)),
                    default=argparse.SUPPRESS, metavar="N|auto", help="batch.micro: sequences "
                    "per micro-batch (default: auto, searched with --plan auto)")
    ap.add_argument("--seq-len", type=int_flag(1, MAX_SEQ_LEN), help="batch.seq")
    ap.add_argument("--seed", type=int_flag(0, SEED_MAX), help="training.seed")
    ap.add_argument("--dry-run", action="store_true", help="programs and streams only, no weights")
    ap.add_argument("-o", "--output", help="plan.output: the build directory (default: build)")
    ap.add_argument("--time-limit", type=float, metavar="SECONDS",
                    help="plan.time_limit: stop the plan search after SECONDS with the best plan "
                    "found so far")
    ap.add_argument("--measure", action="store_true",
                    help="with a plan file: measure this model's layer times on the cluster's "
                         "measured backends first, as --plan auto does, so the prediction uses "
                         "them (without: stored ones, else a FLOP estimate)")
    a = ap.parse_args(argv)
    cfg = job_config(a, overrides, ap)
    res = compile_model(cfg.model.file, model_args=cfg.model.args, cluster_arg=cfg.plan.cluster,
                        plan_arg=cfg.plan.plan, global_batch=cfg.batch.global_,
                        micro_batch=cfg.batch.micro, seq_len=cfg.batch.seq,
                        out_dir=cfg.plan.output, dry_run=a.dry_run, seed=cfg.training.seed,
                        schedule=cfg.plan.schedule, search=cfg.plan.search,
                        time_limit=cfg.plan.time_limit, measure=a.measure, config=cfg)
    for st, p in zip(res.plan.stages, res.stages):
        print(f"  stage {p.index}: {st.chip} ({st.chips} chip(s), tp={st.tp}) layers "
              f"{p.layers[0]}..{p.layers[-1]}: {sum(1 for _ in p.fwd.nodes())} fwd / "
              f"{sum(1 for _ in p.bwd.nodes())} bwd ops")
        if p.tp > 1:
            n_ar = [sum(1 for n in g.nodes() if n.op == "tp_all_reduce") for g in (p.fwd, p.bwd)]
            print(f"    tensor parallel over {p.tp} ranks: {n_ar[0]} fwd / {n_ar[1]} bwd "
                  "TP all-reduces")
            for kind in ("column", "row", "vocab", "replicated"):
                names = [k for k, v in p.sharding.items() if v.kind == kind]
                if names:
                    print(f"    {kind}{'-parallel' if kind != 'replicated' else ''}: "
                          f"{', '.join(names)}")
    print(f"wrote {res.out_dir}/ in {res.seconds:.1f} s")
    return 0
