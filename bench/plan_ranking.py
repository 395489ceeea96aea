"""Judging a planner by the order it puts plans in: the plans the search ranked near the top,
each compiled, run in alternated rounds, and the predicted order set against the measured one.

Shared by bench/bench_hetero_local.py and bench/bench_multihost_plan.py. Once a set of plans is
chosen, the layer times of all their micro-batches are measured again together
(`measure_together`), and every plan is compiled from its plan file without measuring
(`h2c compile --plan FILE`): so all are predicted from the same layer-time records, taken in
the same minutes, and the ranking compares plans, not measurements. The functions that
turn predictions and measurements into the report (`pair_agreement`, `round_errors`,
`error_spread`, `not_slower`, `summary_row`) are pure; tests/test_colocation.py checks them.

Reading the report:
- the pairwise matrix: for two plans A (predicted faster) and B, in how many rounds A measured
  faster too; pairs the planner predicts within `TIE` of each other make no claim and are left
  out (a planner is not wrong about an order it does not state);
- each plan's prediction error per round, and per round the spread of those errors (max - min,
  percentage points): the bias between plans, which noise shared by the round does not excuse;
- per round, whether auto measured no slower than uniform.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

# predicted steps closer than this (relative) are a tie: no claim about their order
TIE = 0.01


# ----------------------------------------------------------------------------------------------
# pure: predictions and measurements -> the report's figures

def pair_agreement(pred: dict, rounds: list[dict], tie: float = TIE) -> dict:
    """{(a, b): (rounds where a measured faster, rounds measured)} for every pair the planner
    orders, a predicted faster than b (by more than `tie`); `pred` {plan: predicted step s},
    `rounds` [{plan: measured step s}] (a plan missing from a round is not counted there)."""
    out = {}
    names = sorted(pred, key=lambda p: pred[p])
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            if pred[b] - pred[a] <= tie * pred[a]:
                continue
            got = [r[a] < r[b] for r in rounds if a in r and b in r]
            out[(a, b)] = (sum(got), len(got))
    return out


def agreement(pairs: dict) -> tuple[int, int]:
    """(pair-rounds measured in the predicted order, pair-rounds) over `pair_agreement`."""
    return sum(a for a, _ in pairs.values()), sum(n for _, n in pairs.values())


def round_errors(pred: dict, measured: dict) -> dict:
    """{plan: (predicted - measured) / measured} of one round."""
    return {p: (pred[p] - m) / m for p, m in measured.items() if p in pred}


def error_spread(errors: dict) -> float:
    """max - min of one round's prediction errors, in percentage points."""
    return 100.0 * (max(errors.values()) - min(errors.values())) if errors else 0.0


def not_slower(rounds: list[dict], a: str = "auto", b: str = "uniform") -> list[bool]:
    """Per round, whether plan `a` measured no slower than plan `b` (its step time at most b's)."""
    return [r[a] <= r[b] for r in rounds if a in r and b in r]


def summary_row(cluster: str, pred: dict, rounds: list[dict]) -> dict:
    """One cluster's verdicts: agreement over pair-rounds, auto >= uniform rounds, the worst
    round's error spread, and the three must-shows of issue 31 (>= 80 % of pair-rounds in the
    predicted order, auto >= uniform in >= 80 % of rounds, every round's spread <= 10 pp)."""
    ok, n = agreement(pair_agreement(pred, rounds))
    au = not_slower(rounds)
    spreads = [error_spread(round_errors(pred, r)) for r in rounds]
    return {"cluster": cluster, "plans": len(pred), "rounds": len(rounds),
            "pair_rounds_agree": ok, "pair_rounds": n,
            "auto_ge_uniform": sum(au), "auto_rounds": len(au),
            "max_spread_pp": max(spreads, default=0.0),
            "ranking_ok": n > 0 and ok >= 0.8 * n,
            "auto_ok": bool(au) and sum(au) >= 0.8 * len(au),
            "spread_ok": all(s <= 10.0 for s in spreads)}


def format_matrix(pred: dict, rounds: list[dict]) -> list[str]:
    """The pairwise matrix as text, plans in predicted order: row A, column B holds 'k/n' when A
    is predicted faster than B (k rounds measured so), '=' for a predicted tie, blank otherwise."""
    names = sorted(pred, key=lambda p: pred[p])
    pairs = pair_agreement(pred, rounds)
    w = max(8, *(len(n) for n in names)) + 1
    lines = [" " * w + "".join(f"{n:>{w}}" for n in names)]
    for a in names:
        cells = []
        for b in names:
            if (a, b) in pairs:
                k, n = pairs[(a, b)]
                cells.append(f"{k}/{n}")
            elif a != b and (b, a) not in pairs:
                cells.append("=")
            else:
                cells.append("")
        lines.append(f"{a:<{w}}" + "".join(f"{c:>{w}}" for c in cells))
    return lines


def format_summary(rows: list[dict]) -> list[str]:
    """The summary table (markdown) for docs/performance.md."""
    out = ["| cluster | plans | rounds | pair-rounds in predicted order | auto >= uniform | "
           "worst round's error spread |",
           "|---|---|---|---|---|---|"]
    for r in rows:
        pr = (f"{r['pair_rounds_agree']}/{r['pair_rounds']} "
              f"({r['pair_rounds_agree'] / max(1, r['pair_rounds']):.0%})")
        out.append(f"| {r['cluster']} | {r['plans']} | {r['rounds']} | {pr} "
                   f"{'met' if r['ranking_ok'] else 'NOT met'} | {r['auto_ge_uniform']}/"
                   f"{r['auto_rounds']} {'met' if r['auto_ok'] else 'NOT met'} | "
                   f"{r['max_spread_pp']:.1f} pp {'met' if r['spread_ok'] else 'NOT met'} |")
    return out


def report(cluster: str, pred: dict, rounds: list[dict], describe: dict, out=print) -> dict:
    """Print one cluster's ranking report; returns its `summary_row`."""
    order = sorted(pred, key=lambda p: pred[p])
    out(f"  plans in predicted order:")
    for p in order:
        meas = [r[p] for r in rounds if p in r]
        med = f"{statistics.median(meas):.3f}" if meas else "-"
        out(f"    {p:10s} predicted {pred[p]:.3f} s, measured median {med} s  {describe.get(p, '')}")
    out("  prediction error per round (and its spread across the plans, max - min):")
    for i, r in enumerate(rounds):
        e = round_errors(pred, r)
        out(f"    round {i + 1}: " + "  ".join(f"{p} {e[p]:+.1%}" for p in order if p in e)
            + f"  | spread {error_spread(e):.1f} pp")
    out("  pairwise: row predicted faster than column; cell = rounds measured so")
    for line in format_matrix(pred, rounds):
        out("    " + line)
    au = not_slower(rounds)
    out(f"  auto measured >= uniform (throughput) in {sum(au)} of {len(au)} rounds: "
        + " ".join("yes" if x else "no" for x in au))
    row = summary_row(cluster, pred, rounds)
    out(f"  => pair-rounds in predicted order {row['pair_rounds_agree']}/{row['pair_rounds']}; "
        f"worst spread {row['max_spread_pp']:.1f} pp")
    return row


# ----------------------------------------------------------------------------------------------
# the plans: the search's top ones, from the calibration the auto build was planned with

def plan_key(plan) -> tuple:
    """What makes two plans the same run: stages (chip, chips, tp, layers, recompute), dp,
    micro-batch, schedule."""
    return (tuple((s.chip, s.chips, s.tp, tuple(s.layers), s.recompute, s.zero)
                  for s in plan.stages), plan.dp, plan.micro_batch, plan.schedule, plan.virtual)


def describe(plan) -> str:
    return (" | ".join(f"{s.chip}{'(tp' + str(s.tp) + ')' if s.tp > 1 else ''}:{len(s.layers)}"
                       for s in plan.stages)
            + f"  dp {plan.dp}, micro-batch {plan.micro_batch} x {plan.num_microbatches}")


def plan_set(auto_build: str, model_path: str, cluster, n: int, global_batch: int,
             seq_len: int, fixed: dict | None = None, log=print) -> dict:
    """{name: Plan}: auto (the auto build's), uniform, the `fixed` ones, then the search's
    nearest others (`top_plans`) up to n besides the fixed; uniform is left out where it is the
    auto plan (one plan, one name). All from the calibration the auto build was planned with,
    as `h2c compile` makes them."""
    from executor.build import BuildDir
    from frontend.compiler import search_plan
    b = BuildDir(auto_build)
    cal, costs = b.calibration(), b.model_costs()
    plans = {"auto": _load(b)}
    uni = search_plan("uniform", costs, cluster, global_batch=global_batch, micro_batch=None,
                      seq_len=seq_len, schedule="1f1b", model_path=model_path, calibration=cal)
    if plan_key(uni) != plan_key(plans["auto"]):
        plans["uniform"] = uni
    else:
        log("  uniform is the auto plan: it is run once, as auto")
    plans.update(fixed or {})
    extra = top_plans(auto_build, model_path, cluster, n - len(plans) + len(fixed or {}),
                      global_batch, seq_len, exclude={plan_key(p) for p in plans.values()})
    plans.update({f"next{i}": p for i, p in enumerate(extra, 1)})
    for plan in plans.values():
        plan.model = model_path
    return plans


def measure_together(model_path: str, cluster, plans: dict, seq_len: int, log=print) -> None:
    """The layer times of every plan's micro-batch, measured again with their rounds taken in
    turn (frontend/profile.py `record_micro_batches`), so that no plan is priced from minutes
    the others were not: on a VM a backend's speed drifts by tens of per cent in minutes, and
    micro-batches measured at different times bias the plans that use them."""
    from backends.registry import measured_backends
    from frontend.profile import colocation_of, record_micro_batches
    mbs = sorted({p.micro_batch for p in plans.values()})
    log(f"  layer times measured again at micro-batches {', '.join(map(str, mbs))}, "
        "in alternated rounds")
    record_micro_batches(model_path, {}, mbs, seq_len, measured_backends(cluster),
                         log=lambda *a: None, colocation=colocation_of(cluster))


def top_plans(auto_build: str, model_path: str, cluster, n: int, global_batch: int,
              seq_len: int, exclude=()) -> list:
    """Up to `n` plans, none of the auto build's nor those in `exclude` (`plan_key`s), that the
    search ranks nearest the top, from the calibration the auto build was planned with: the
    search's runner-ups, then the best plan at each other micro-batch and dp (searches
    restricted to it), in predicted order; each with model and cluster set."""
    from executor.build import BuildDir
    from frontend.compiler import _executable_check
    from h2ir.errors import H2Error
    from h2ir.planner import search as heteroauto
    b = BuildDir(auto_build)
    cal, costs = b.calibration(), b.model_costs()
    seen = {plan_key(_load(b)), *exclude}
    pool = []

    def offer(c):
        if c is None or plan_key(c.plan) in seen:
            return
        try:
            _executable_check(c.plan)
        except H2Error:
            return
        seen.add(plan_key(c.plan))
        pool.append(c)
    # as `h2c compile` searches an executable dense plan (frontend/compiler.py search_plan)
    kw = dict(seq_len=seq_len, calibration=cal, max_tp=None if costs.n_heads else 1, max_ep=1)
    res = heteroauto.search(costs, cluster, global_batch, top_k=4 * n, **kw)
    for c in [res.best] + res.runner_ups:
        offer(c)
    for mb in heteroauto.micro_batch_options(global_batch, None):
        offer(_best(heteroauto, costs, cluster, global_batch, dict(kw, micro_batch=mb)))
    for dp in range(1, cluster.total_chips + 1):
        offer(_best(heteroauto, costs, cluster, global_batch, dict(kw, dp_options=[dp])))
    pool.sort(key=lambda c: c.step_time_s)
    out = []
    for c in pool[:n]:
        c.plan.model, c.plan.cluster = model_path, cluster.name
        out.append(c.plan)
    return out


def _best(heteroauto, costs, cluster, global_batch, kw):
    from h2ir.errors import H2Error
    try:
        return heteroauto.search(costs, cluster, global_batch, **kw).best
    except H2Error:          # nothing fits there
        return None


def _load(build):
    from h2ir.plans.dsl import load_plan
    return load_plan(str(Path(build.path) / "plan.h2plan"))


# a CPU-heavy neighbour (--beside): one thread of fp32 matmuls, forever
HOG = ("import numpy as np\na = np.random.default_rng(0).random((512, 512), dtype=np.float32)\n"
       "while True:\n    a = (a @ a) * (1.0 / 512)\n")


def start_hogs(n: int) -> list:
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return [subprocess.Popen([sys.executable, "-c", HOG], env=env) for _ in range(n)]


def stop_hogs(hogs: list) -> None:
    for h in hogs:
        h.kill()
        h.wait()


def finish(rows: list[dict], end: str, json_path: str | None, dump: dict) -> None:
    """The benches' closing lines: the summary table, `end`, and every figure as JSON."""
    print("summary (docs/performance.md):")
    for line in format_summary(rows):
        print("  " + line)
    print(end)
    if json_path:
        Path(json_path).write_text(json.dumps(dict(dump, summary=rows), indent=1))
