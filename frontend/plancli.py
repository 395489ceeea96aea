"""`h2c plan`: plan a model on a cluster and report the predicted step.

    h2c plan MODEL.py [--arg k=v ...] [--cluster C] [--plan auto|uniform|FILE.h2plan]
             [--search heuristic|exhaustive] [--global-batch N] [--micro-batch N] [--seq-len N]
             [--schedule 1f1b|gpipe|zb1|interleaved|izb|zbv|auto] [--time-limit SECONDS]
             [-o plan.h2plan] [--trace FILE]
             [--json] [--no-speedup]

MODEL may also be a layer-cost JSON file (`h2c ir MODEL.py --json`), which skips tracing.
The report: stages, chips, layers, memory per device against capacity, predicted step time
(simulated instruction streams), tokens/s, MFU per chip type, bubble fraction, the uniform
baseline, HeteroSpeedupRatio, search time and runner-ups. Errors print and exit with code 2.
"""
from __future__ import annotations

import argparse
import inspect
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from backends.calibrate import ensure_calibration
from backends.registry import measured_backends
from h2ir.costs import ModelCosts
from h2ir.errors import (MAX_GLOBAL_BATCH, MAX_MICRO_BATCH, MAX_SEQ_LEN, H2Error, int_flag,
                         read_user_file, too_deep)
from h2ir.plans.plan import SCHEDULES

if TYPE_CHECKING:
    from h2ir.clusters.cluster import Cluster
    from h2ir.planner.search import Candidate, SearchResult
    from h2ir.plans.plan import Plan

DEFAULT_CLUSTER = "local"
# build_model keyword arguments that name the model's maximum sequence length
_SEQ_ARGS = ("max_seq", "max_seq_len", "seq_len", "max_position_embeddings", "block_size")




def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="h2c plan", description="Plan a model on a (heterogeneous) "
                                 "cluster with HeteroAuto, a uniform split, or a .h2plan file, "
                                 "and predict its training step.")
    ap.add_argument("model", nargs="?", help="model file (.py with build_model) or layer-cost "
                    "JSON (default: the config's model.file)")
    ap.add_argument("--arg", action="append", default=[], metavar="KEY=VALUE",
                    help="keyword argument for build_model (repeatable)")
    ap.add_argument("--cluster", help="built-in cluster name or cluster TOML file (default: the "
                    "plan file's cluster, else local)")
    ap.add_argument("--plan", default="auto", metavar="auto|uniform|FILE.h2plan")
    ap.add_argument("--search", default="heuristic", choices=("heuristic", "exhaustive"))
    ap.add_argument("--global-batch", type=int_flag(1, MAX_GLOBAL_BATCH),
                    help="batch.global: sequences per step (default 16)")
    ap.add_argument("--micro-batch", type=int_flag(1, MAX_MICRO_BATCH, words=("auto",)),
                    metavar="N|auto", help="sequences per micro-batch (default: auto, searched)")
    ap.add_argument("--seq-len", type=int_flag(1, MAX_SEQ_LEN),
                    help="batch.seq: tokens per sequence (default 128; a layer-cost JSON's own)")
    ap.add_argument("--schedule", default="1f1b", choices=(*SCHEDULES, "auto"),
                    help="pipeline schedule (auto: search 1f1b and gpipe, then keep the fastest "
                    "of that pipeline under every schedule h2x runs); interleaved, izb and zbv "
                    "cut the searched pipeline's workers into 2 chunks each")
    ap.add_argument("--time-limit", type=float, metavar="SECONDS",
                    help="stop the search after SECONDS and take the best plan found so far")
    ap.add_argument("-o", "--output", help="write the plan as .h2plan text to FILE")
    ap.add_argument("--trace", help="write the predicted timeline as Chrome/Perfetto trace JSON")
    ap.add_argument("--json", action="store_true", help="machine-readable report on stdout")
    ap.add_argument("--no-speedup", action="store_true",
                    help="skip HeteroSpeedupRatio (it searches every chip type alone)")
    return ap


def main(argv: list[str]) -> int:
    from h2ir import config as jobconfig
    argv, overrides = jobconfig.split_overrides(argv)
    ap = _parser()
    ap.add_argument("--config", metavar="FILE.toml", help="the job configuration (h2c config): "
                    "its model, batch and plan sections are defaults of the flags above")
    a = ap.parse_args(argv)
    if a.config or overrides:
        cfg = jobconfig.build_config(config_file=a.config, overrides=overrides)
        d = jobconfig.Config()
        for dest, (sec, key) in {"global_batch": ("batch", "global_"), "seq_len": ("batch", "seq"),
                                 "micro_batch": ("batch", "micro"), "cluster": ("plan", "cluster"),
                                 "schedule": ("plan", "schedule"), "plan": ("plan", "plan"),
                                 "search": ("plan", "search")}.items():
            v = getattr(getattr(cfg, sec), key)
            if v != getattr(getattr(d, sec), key) and getattr(a, dest) in (None, ap.get_default(dest)):
                setattr(a, dest, v)
        a.config_args = cfg.model.args
        a.model = a.model or cfg.model.file or None
    if not a.model:
        ap.error("the model is required (a positional argument, or model.file in --config)")
    try:
        report = plan_report(a)
    except H2Error as e:
        print(str(e), file=sys.stderr)
        return 2
    if a.json:
        sys.stdout.write(json.dumps(report, indent=1) + "\n")
    else:
        sys.stdout.write(format_report(report))
    return 0


# ----------------------------------------------------------------------------------------------

def _model_args(pairs: list[str]) -> dict:
    try:
        from frontend.capture import parse_model_args
    except ImportError:
        parse_model_args = None
    if parse_model_args is not None:
        return parse_model_args(pairs)
    out = {}
    for p in pairs:
        if "=" not in p:
            raise H2Error(f"--arg {p!r}: expected key=value")
        k, v = p.split("=", 1)
        out[k] = v
    return out


def _model_max_seq(model: str, args: dict) -> int | None:
    """The model's own maximum sequence length: a build_model argument (given, or its default);
    None when it has none."""
    for k in _SEQ_ARGS:
        if k in args:
            v = args[k]
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_SEQ_LEN:
                raise H2Error(f"--arg {k}={v}: expected a sequence length in 1..{MAX_SEQ_LEN}",
                              hint="or say --seq-len N")
            return v
    try:
        from frontend.capture import load_model_file
        sig = inspect.signature(load_model_file(model).module.build_model)
    except (ImportError, ValueError, TypeError):
        return None
    for k in _SEQ_ARGS:
        p = sig.parameters.get(k)
        if p is not None and isinstance(p.default, int):
            return p.default
    return None


def load_costs(model: str, args: dict, micro_batch: int, seq_len: int | None) -> ModelCosts:
    """Layer costs of `model`: a cost JSON as is, or a model file traced by the frontend."""
    p = Path(model)
    if p.suffix == ".json":
        text = read_user_file(p, "layer-cost JSON file")
        try:
            costs = ModelCosts.from_json(json.loads(text))
        except RecursionError:
            raise too_deep(text, model, "layer-cost JSON") from None
        except (ValueError, KeyError, TypeError, AttributeError, IndexError) as e:
            raise H2Error(f"not a layer-cost JSON file ({type(e).__name__}: {_short(e)})",
                          file=model, hint="write one with `h2c ir MODEL.py --json`") from None
        return costs
    try:
        from frontend.capture import model_costs
    except ImportError as e:
        raise H2Error(f"the frontend is not available to trace {model} ({e})",
                      hint="pass a layer-cost JSON file instead") from None
    longest = _model_max_seq(model, args)
    if longest is not None and seq_len > longest:
        raise H2Error(f"batch.seq {seq_len} is longer than the model's maximum sequence length "
                      f"{longest}", model, hint=f"pass --seq-len {longest} (or less)")
    return model_costs(model, args, micro_batch, seq_len)


def _short(e: Exception) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= 200 else text[:197] + "..."


@dataclass
class _PlanInputs:
    """What `h2c plan` plans: a model's layer costs on a cluster at a batch shape."""
    given: Plan | None              # the --plan FILE, if one was given
    cluster: Cluster
    calibration: object             # measured rates of the cluster's local backends, or None
    costs: ModelCosts
    seq_len: int
    global_batch: int
    model_name: str


@dataclass
class _PlanChoice:
    """The plan to report and what was weighed to choose it."""
    cand: Candidate
    uniform: Candidate | None       # the uniform baseline, when it was costed
    warnings: list
    result: SearchResult | None     # the HeteroAuto search, when --plan auto
    search_time_s: float


def plan_report(a) -> dict:
    """The `h2c plan` report for command line `a` (see the module docstring), as JSON data."""
    from frontend.progress import phase, set_quiet
    set_quiet(a.json)
    with phase("calibrating and capturing"):
        inp = _plan_inputs(a)
    with phase(f"planning ({a.plan if a.plan in ('auto', 'uniform') else 'plan file'})"):
        choice = _choose_plan(a, inp)
    plan, sim = choice.cand.plan, choice.cand.sim
    if inp.given is None:
        plan.model = inp.model_name
        plan.cluster = a.cluster if not Path(a.cluster).suffix else inp.cluster.name
    with phase("HeteroSpeedupRatio: each chip type alone"):
        speedup = _hetero_speedup(a, inp, choice.cand)
    text = _write_plan_outputs(a, plan, sim, inp.cluster)
    rates = _chip_rates(inp, plan)
    return _report_json(a, inp, choice, text, _stage_rows(plan, sim), rates, speedup)


def _plan_inputs(a) -> _PlanInputs:
    """Resolve the plan file, cluster (a.cluster is set to the one used), calibration, layer
    costs and batch shape from the command line, in that order."""
    from h2ir.clusters.clusterfile import load_cluster
    args = {**getattr(a, "config_args", {}), **_model_args(a.arg)}
    given: Plan | None = None
    if a.plan not in ("auto", "uniform"):
        from h2ir.plans.dsl import load_plan
        given = load_plan(a.plan)
    a.cluster = a.cluster or (given.cluster if given else DEFAULT_CLUSTER)
    cluster = load_cluster(a.cluster)
    measured = measured_backends(cluster)
    cal = ensure_calibration(measured) if measured else None
    # defaults: the job configuration's (h2ir/config.py), as h2c compile and h2c ir take them;
    # a layer-cost JSON keeps the sequence length it was computed at
    from h2ir.config import Config
    defaults = Config().batch
    seq_len = a.seq_len or (given.seq_len if given else None)
    if seq_len is None and Path(a.model).suffix == ".py":
        seq_len = defaults.seq
    mb_trace = given.micro_batch if given else (a.micro_batch or 1)
    costs = load_costs(a.model, args, mb_trace, seq_len)
    seq_len = seq_len or costs.seq_len
    gb = a.global_batch or (given.global_batch if given else defaults.global_)
    model_name = a.model if Path(a.model).suffix == ".py" else costs.model
    return _PlanInputs(given, cluster, cal, costs, seq_len, gb, model_name)


def _choose_plan(a, inp: _PlanInputs) -> _PlanChoice:
    """The plan file as given (validated), the uniform split, or the HeteroAuto search; timed."""
    from h2ir.planner.search import (VIRTUAL_BASE, Candidate, apply_schedule, search,
                                     uniform_plan)
    from h2ir.planner.simulate import simulate
    costs, cluster, cal = inp.costs, inp.cluster, inp.calibration
    schedule = VIRTUAL_BASE.get(a.schedule, a.schedule)   # virtual ones: searched as their base
    t0 = time.perf_counter()
    result = None
    if inp.given is not None:
        from h2ir.planner.validate import validate_plan
        plan = inp.given
        warnings = validate_plan(plan, costs, cluster)
        cand = Candidate(plan, float("nan"), "file", sim=simulate(costs, plan, cluster, cal))
        uniform = None
    elif a.plan == "uniform":
        cand = uniform_plan(costs, cluster, inp.global_batch, inp.seq_len, a.micro_batch,
                            "1f1b" if schedule == "auto" else schedule, calibration=cal)
        uniform, warnings = cand, []
    else:
        if a.time_limit is not None and not a.time_limit > 0:
            raise H2Error(f"--time-limit must be a positive number of seconds, got {a.time_limit}")
        result = search(costs, cluster, inp.global_batch, seq_len=inp.seq_len,
                        micro_batch=a.micro_batch, schedule=schedule, method=a.search,
                        calibration=cal, time_limit=a.time_limit)
        cand, uniform = result.best, result.uniform
        warnings = ([f"the --time-limit of {a.time_limit:g} s ran out: this is the best plan "
                     f"found so far, not the search's optimum"] if result.timed_out else [])
        if a.trace:        # the search times one tp rank per stage; the trace shows every rank
            cand.sim = simulate(costs, cand.plan, cluster, cal)
    if inp.given is None:       # auto, virtual stages: as h2c compile --schedule applies them
        plan = apply_schedule(cand.plan, costs, cluster, a.schedule, cal)
        if plan is not cand.plan:
            from h2ir.planner.validate import validate_plan
            warnings += validate_plan(plan, costs, cluster)
            cand = Candidate(plan, float("nan"), cand.kind,
                             sim=simulate(costs, plan, cluster, cal))
    return _PlanChoice(cand, uniform, warnings, result, time.perf_counter() - t0)


def _hetero_speedup(a, inp: _PlanInputs, cand: Candidate):
    """HeteroSpeedupRatio of `cand`, unless --no-speedup or the cluster has one chip type."""
    from h2ir.planner.search import hetero_speedup
    cluster = inp.cluster
    if a.no_speedup or len([c for c in cluster.chip_types if cluster.count(c)]) <= 1:
        return None
    from h2ir.planner.search import VIRTUAL_BASE
    return hetero_speedup(inp.costs, cluster, cand, schedule=VIRTUAL_BASE.get(a.schedule, a.schedule),
                          calibration=inp.calibration)


def _write_plan_outputs(a, plan: Plan, sim, cluster: Cluster) -> str:
    """The plan's .h2plan text; written with a header to -o, the predicted timeline to --trace."""
    from h2ir.plans.dsl import format_plan
    from h2ir.schedule.trace import write_chrome_trace
    text = format_plan(plan)
    header = (f"# {plan.model} on {cluster.name}: predicted step {sim.step_time_s:.4g} s, "
              f"{sim.tokens_per_s:,.0f} tokens/s (h2c plan --plan {a.plan})\n")
    if a.output:
        Path(a.output).write_text(header + text)
    if a.trace:
        write_chrome_trace(a.trace, sim.events, sim.worker_names,
                           {"kind": "predicted", "plan": text, "step_time_s": sim.step_time_s})
    return text


def _chip_rates(inp: _PlanInputs, plan: Plan) -> dict:
    """Compute rates of every chip type the plan uses, at its micro-batch shape."""
    from h2ir.planner.resource import ResourceModel
    rm = ResourceModel(inp.costs, inp.cluster, plan.micro_batch, plan.seq_len, inp.calibration)
    return {c: rm.rates(c) for c in {s.chip for s in plan.stages}}


def _stage_rows(plan: Plan, sim) -> list[dict]:
    """One report row per stage: its devices, layers, simulated times and memory."""
    stages = []
    for j, s in enumerate(plan.stages):
        st, mem = sim.stage_times[j], sim.stage_memory[j]
        stages.append({"chip": s.chip, "chips": s.chips, "tp": s.tp, "recompute": s.recompute,
                       "layers": s.layers, "num_layers": len(s.layers),
                       "fwd_s": st.fwd_s, "bwd_s": st.bwd_s,
                       "peak_mem_bytes": mem.total, "mem_capacity_bytes": mem.capacity,
                       "mem_items": mem.items, "inflight": mem.inflight})
    return stages


def _candidate_json(c: Candidate) -> dict:
    return {"kind": c.kind, "config": c.config.describe() if c.config else None,
            "estimate_s": c.estimate_s, "step_time_s": c.step_time_s,
            "tokens_per_s": c.tokens_per_s}


def _report_json(a, inp: _PlanInputs, choice: _PlanChoice, text: str, stages: list, rates: dict,
                 speedup) -> dict:
    cluster, cand, result, uniform = inp.cluster, choice.cand, choice.result, choice.uniform
    plan, sim = cand.plan, cand.sim
    return {
        "model": plan.model, "cluster": cluster.name, "dtype": cluster.dtype,
        "chips": {c: cluster.count(c) for c in cluster.chip_types if cluster.count(c)},
        "plan_mode": a.plan, "plan_text": text, "warnings": choice.warnings,
        "global_batch": plan.global_batch, "micro_batch": plan.micro_batch, "seq_len": plan.seq_len,
        "dp": plan.dp, "schedule": plan.schedule, "num_microbatches": plan.num_microbatches,
        "stages": stages,
        "step_time_s": sim.step_time_s,
        "estimate_s": cand.estimate_s if cand.estimate_s == cand.estimate_s else None,
        "tokens_per_s": sim.tokens_per_s, "bubble_fraction": sim.bubble_fraction,
        "mfu": sim.mfu,
        "rates": {c: {"flops": r.flops, "peak_flops": r.peak_flops, "mem_bw": r.mem_bw,
                      "source": r.source} for c, r in rates.items()},
        "fits": sim.fits,
        "hetero_speedup_ratio": speedup.ratio if speedup else None,
        "hetero_speedup_ratio_const_batch": speedup.ratio_const_batch if speedup else None,
        "speedup": speedup.to_json() if speedup else None,
        "uniform": _candidate_json(uniform) if uniform is not None else None,
        "search_time_s": choice.search_time_s,
        "search": ({"method": result.method, "configs_total": result.configs_total,
                    "configs_searched": result.configs_searched, "dfs_nodes": result.dfs_nodes,
                    "lines": result.lines, "simulations": result.simulations,
                    "timed_out": result.timed_out,
                    # exact, search, stopped_by, lower_bound_s, gap_to_bound, proved: derived
                    # from the search's bounds (SearchResult.proof)
                    **result.proof()}
                   if result else None),
        "runner_ups": [_candidate_json(c) for c in result.runner_ups] if result else [],
    }


# ----------------------------------------------------------------------------------------------
# human report

def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def _secs(t: float) -> str:
    return f"{t:.3g} s" if t >= 0.1 else f"{t * 1e3:.3g} ms"


def format_report(r: dict) -> str:
    from h2ir.plans.dsl import format_layers
    chips = ", ".join(f"{c} {n}" for c, n in r["chips"].items())
    out = [f"{r['model']} on {r['cluster']} ({sum(r['chips'].values())} chips: {chips}; {r['dtype']})"]
    how = {"auto": f"HeteroAuto ({r['search']['method'] if r['search'] else ''})",
           "uniform": "uniform split"}.get(r["plan_mode"], f"from {r['plan_mode']}")
    s = r["search"]
    out.append(f"plan: {how}" + (f", {s['configs_searched']:,} of {s['configs_total']:,} "
                                 f"configurations expanded, {s['lines']:,} lines, {s['simulations']} "
                                 f"simulated in {r['search_time_s']:.2f} s"
                                 + ("; TIME LIMIT reached: the best plan so far" if s["timed_out"]
                                    else "; proved optimal over its plan space" if s["exact"]
                                    else f"; not proved optimal ({s['search']}, stopped by "
                                         f"{s['stopped_by']}): {s['proved']}")
                                 if s else ""))
    out.append(f"batch: global {r['global_batch']}, micro {r['micro_batch']}, seq {r['seq_len']}; "
               f"dp {r['dp']}, {r['num_microbatches']} micro-batches per replica, {r['schedule']}")
    out.append("")
    head = f"{'stage':>5}  {'chip':<12} {'chips':>5} {'tp':>3}  {'layers':<22} {'recomp':<6} " \
           f"{'fwd+bwd/mb':>11}  {'memory/device':>22}"
    out += [head, "-" * len(head)]
    for j, st in enumerate(r["stages"]):
        mem = f"{_gib(st['peak_mem_bytes'])} / {_gib(st['mem_capacity_bytes'])}"
        pct = st["peak_mem_bytes"] / st["mem_capacity_bytes"] * 100
        layers = format_layers(st["layers"])
        if len(layers) > 22:
            layers = layers[:19] + "..."
        out.append(f"{j:>5}  {st['chip']:<12} {st['chips']:>5} {st['tp']:>3}  {layers:<22} "
                   f"{st['recompute']:<6} {_secs(st['fwd_s'] + st['bwd_s']):>11}  "
                   f"{mem:>17} {pct:3.0f}%")
    out.append("")
    est = f" (search's lower bound {_secs(r['estimate_s'])})" if r["estimate_s"] else ""
    out.append(f"predicted step time {_secs(r['step_time_s'])}{est}: {r['tokens_per_s']:,.0f} tokens/s, "
               f"bubble {r['bubble_fraction'] * 100:.1f}%")
    mfu = "  ".join(f"{c} {v * 100:.1f}%" + (" (of measured matmul)" if r["rates"][c]["source"] == "measured" else "")
                    for c, v in r["mfu"].items())
    out.append(f"MFU per chip type (model FLOPs / peak): {mfu}")
    if not r["fits"]:
        out.append("WARNING: some stage exceeds its devices' memory")
    for w in r["warnings"]:
        out.append(f"warning: {w}")
    u = r["uniform"]
    if u and r["plan_mode"] == "auto":
        out.append(f"uniform baseline ({u['config']}): {_secs(u['step_time_s'])}, "
                   f"{u['tokens_per_s']:,.0f} tokens/s -> HeteroAuto is "
                   f"{u['step_time_s'] / r['step_time_s']:.2f}x faster")
    sp = r["speedup"]
    if sp:
        parts = ", ".join(f"{c} {h['tokens_per_s']:,.0f} tok/s (batch {h['global_batch']}: "
                          f"{h['config']})" if h else f"{c} cannot train it alone"
                          for c, h in sp["homogeneous"].items())
        ratio = f"{sp['ratio'] * 100:.2f}%" if sp["ratio"] else "n/a"
        out.append(f"HeteroSpeedupRatio {ratio}: throughput / sum of each chip type's best "
                   f"homogeneous throughput ({parts})")
        if sp["ratio_const_batch"]:
            out.append(f"  at constant global batch {r['global_batch']}: "
                       f"{sp['ratio_const_batch'] * 100:.2f}%")
    if r["runner_ups"]:
        out.append("runner-ups:")
        for i, c in enumerate(r["runner_ups"], 1):
            out.append(f"  {i}. {_secs(c['step_time_s'])}  {c['kind']:<8} {c['config']}")
    out.append("")
    out.append(r["plan_text"].rstrip())
    return "\n".join(out) + "\n"
