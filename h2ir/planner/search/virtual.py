"""Schedules of a searched pipeline: virtual-stage schedules cut each worker's share into
chunks (`virtualize`); 'auto' times every schedule by simulation (`choose_schedule`)."""
from __future__ import annotations

import dataclasses

import numpy as np

from h2ir.clusters.cluster import Cluster
from h2ir.costs import ModelCosts
from h2ir.errors import H2Error
from h2ir.plans.plan import Plan, StagePlan
from h2ir.planner.limits import SCHEDULE_CHOICES, VIRTUAL_BASE
from h2ir.planner.simulate import simulate
from h2ir.planner.validate import validate_plan
from h2ir.schedule.streams import chunk_stages


def virtualize(plan: Plan, costs: ModelCosts, schedule: str, virtual: int = 2) -> Plan:
    """`plan`'s pipeline under a virtual-stage schedule: every worker keeps its chip and its
    share of the model's FLOPs, cut into `virtual` chunks placed as `chunk_stages` says (chunk
    c of worker s is virtual stage c*S + s interleaved, s or 2S-1-s in a V). The chunks are
    contiguous in model order, so the layers each worker holds change; their FLOPs do not, up
    to one layer per chunk boundary. Needs tp = 1, no EP, and `virtual` layers per worker."""
    if plan.is_virtual:
        raise H2Error(f"the plan already runs {plan.schedule} with virtual={plan.virtual}")
    S = plan.num_stages
    for i, st in enumerate(plan.stages):
        if st.tp != 1 or plan.stage_ep(i) != 1:
            raise H2Error(f"schedule {schedule}: stage {i} has tp={st.tp}, ep={plan.stage_ep(i)}; "
                          "virtual stages run with tp=1 and no expert parallelism")
        if len(st.layers) < virtual:
            raise H2Error(f"schedule {schedule} virtual={virtual}: stage {i} has "
                          f"{len(st.layers)} layer(s), fewer than its {virtual} chunks")
    names = costs.layer_names()
    flops = {l.name: float(l.fwd_flops + l.bwd_flops) for l in costs.layers}
    order = [n for st in plan.stages for n in st.layers]
    if order != names:
        raise H2Error("virtualize: the plan's stages do not hold the model's layers in order")
    share = [sum(flops[n] for n in st.layers) for st in plan.stages]
    vst = chunk_stages(schedule, S, virtual)
    owner = {v: (s, c) for s, cs in enumerate(vst) for c, v in enumerate(cs)}
    VS = S * virtual
    target = np.cumsum([share[owner[v][0]] / virtual for v in range(VS)])
    cum = np.cumsum([flops[n] for n in names])
    cuts, lo = [], 0
    for v in range(VS - 1):
        # the cut nearest the running target, leaving a layer for every chunk still to come
        hi = len(names) - (VS - 1 - v)
        i = int(np.argmin(np.abs(cum[lo:hi] - target[v]))) + lo
        cuts.append(i + 1)
        lo = i + 1
    bounds = [0] + cuts + [len(names)]
    stages = []
    for v in range(VS):
        src = plan.stages[owner[v][0]]
        stages.append(StagePlan(src.chip, src.chips, names[bounds[v]:bounds[v + 1]], tp=1,
                                recompute=src.recompute, zero=src.zero))
    return Plan(plan.model, plan.cluster, plan.global_batch, plan.micro_batch, plan.seq_len,
                stages, dp=plan.dp, schedule=schedule, moe=plan.moe, virtual=virtual)


def choose_schedule(plan: Plan, costs: ModelCosts, cluster: Cluster, calibration=None,
                    schedules=SCHEDULE_CHOICES, log=None) -> tuple[Plan, dict]:
    """The fastest of `plan`'s pipeline under each of `schedules` (virtual-stage ones through
    `virtualize`), each timed by full simulation and kept only if every device's memory fits
    (zero-bubble and interleaved schedules hold more activations) and the validator accepts
    it. Returns the plan and {schedule: predicted step seconds or the reason it was left}."""
    table: dict = {}
    best = None
    for sch in schedules:
        try:
            cand = virtualize(plan, costs, sch) if sch in VIRTUAL_BASE else \
                dataclasses.replace(plan, schedule=sch, virtual=1)
            validate_plan(cand, costs, cluster)
            r = simulate(costs, cand, cluster, calibration, record=False)
        except H2Error as e:
            table[sch] = e.message
            continue
        if not r.fits:
            table[sch] = "does not fit in memory"
            continue
        table[sch] = r.step_time_s
        if best is None or r.step_time_s < best[0]:
            best = (r.step_time_s, cand)
    if best is None:
        raise H2Error("no schedule runs this plan: " + "; ".join(f"{k}: {v}" for k, v in table.items()))
    if log:
        log("schedules (predicted step): " + ", ".join(
            f"{k} {v * 1e3:.1f} ms" if isinstance(v, float) else f"{k} ({v})"
            for k, v in table.items()) + f" -> {best[1].schedule}")
    return best[1], table


def apply_schedule(plan: Plan, costs: ModelCosts, cluster: Cluster, schedule: str,
                   calibration=None, log=None) -> Plan:
    """A searched plan under the schedule the user asked for: 'auto' is the fastest that fits
    of the plan's pipeline under every executed schedule (`choose_schedule`, the plan's own
    first), a virtual-stage schedule cuts it into chunks (`virtualize`), anything else leaves
    it as searched."""
    if schedule == "auto":
        first = plan.schedule
        return choose_schedule(plan, costs, cluster, calibration,
                               (first,) + tuple(x for x in SCHEDULE_CHOICES if x != first),
                               log=log)[0]
    if schedule in VIRTUAL_BASE:
        return virtualize(plan, costs, schedule)
    return plan
