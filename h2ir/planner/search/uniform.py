"""The uniform baseline: one TP degree for every stage, larger-memory chips first, an even
split of the transformer blocks (heterogeneity-unaware, what HeteroAuto must beat)."""
from __future__ import annotations

import itertools

from h2ir.clusters.cluster import Cluster
from h2ir.costs import ModelCosts
from h2ir.errors import H2Error
from h2ir.planner.limits import BLOCK_KINDS
from h2ir.planner.resource import ResourceModel
from h2ir.planner.search.experts import a2a_choice, ep_local, ep_options, moe_plan
from h2ir.planner.search.result import Candidate
from h2ir.planner.search.space import Config, memory_order, micro_batch_options, tp_configurations
from h2ir.planner.search.split import StageLine
from h2ir.planner.simulate import simulate


def uniform_bounds(costs: ModelCosts, S: int) -> list[int] | None:
    """Even split of the transformer blocks over S stages; the layers before the first block
    (embedding) go to stage 0 and those after the last (head) to the last stage. Remainders go
    to the later stages, which hold fewer in-flight micro-batches under 1F1B."""
    kinds = [l.kind for l in costs.layers]
    blocks = [i for i, k in enumerate(kinds) if k in BLOCK_KINDS]
    L = len(kinds)
    if not blocks:
        base, extra = divmod(L, S)
        if base == 0:
            return None
        counts = [base + (1 if j >= S - extra else 0) for j in range(S)]
        return [0] + list(itertools.accumulate(counts))
    first, last = blocks[0], blocks[-1]
    N = last - first + 1
    base, extra = divmod(N, S)
    if base == 0:
        return None
    counts = [base + (1 if j >= S - extra else 0) for j in range(S)]
    bounds = [0]
    pos = first
    for c in counts[:-1]:
        pos += c
        bounds.append(pos)
    bounds.append(L)
    return bounds


def uniform_candidates(costs: ModelCosts, cluster: Cluster, global_batch: int, seq_len: int,
                       micro_batches, schedule: str, calibration=None, rms=None, dp_options=None,
                       kinds: dict | None = None, max_tp: int | None = None,
                       max_ep: int | None = None, zero: bool = True):
    """Uniform plans (one TP degree for all stages, larger-memory chips first, even layer
    split) for every dp / micro-batch / TP; each with its estimate. Sorted, best first."""
    rms = rms if rms is not None else {}
    cfgs, counts = tp_configurations(costs, cluster, global_batch, micro_batches, schedule, dp_options,
                            max_tp, uniform_only=True)
    first = memory_order(cluster, list(counts))
    out = []
    for mb, dp, m, tps in cfgs:
        if len({t for _, t in tps}) != 1:
            continue
        if mb not in rms:
            rms[mb] = ResourceModel(costs, cluster, mb, seq_len, calibration)
        rm = rms[mb]
        cfg = Config(dp, mb, m, tps, first, tuple(sorted(counts.items())), schedule=schedule)
        # one EP degree for every stage (heterogeneity-unaware): the largest whose groups are
        # node-local on this line's hosts
        t0 = tps[0][1]
        shapes = cfg.shapes()
        opts = set.intersection(*(set(ep_options(cluster, costs, dp, c, [t0], max_ep)) for c, _ in tps))
        ep = max((e for e in opts if ep_local(cluster, shapes, dp, e)), default=1)
        eps = {c: ep for c, _ in tps}
        moe = moe_plan(costs, eps, a2a_choice(rm, cluster, eps, dict(tps)))
        line = StageLine(rm, cfg, schedule, eps, moe.a2a if moe else "flat", kinds,
                         placed=False, zero=zero)   # ranks uniform plans; the best is simulated
        bounds = uniform_bounds(costs, line.S)
        if bounds is None:
            continue
        e = line.estimate(bounds)
        if e is None:
            continue
        out.append(Candidate(line.plan(bounds, costs.model, cluster, global_batch, seq_len, moe),
                             e[0], "uniform", cfg, tuple(bounds)))
    out.sort(key=lambda c: c.estimate_s)
    return out


def uniform_plan(costs: ModelCosts, cluster: Cluster, global_batch: int, seq_len: int | None = None,
                 micro_batch: int | None = None, schedule: str = "1f1b", calibration=None,
                 max_tp: int | None = None, max_ep: int | None = None) -> Candidate:
    """The baseline: best uniform plan by simulated step time among the top few by estimate.
    `max_tp`/`max_ep` bound the tensor- and expert-parallel degrees (1 for plans h2x runs)."""
    seq_len = seq_len or costs.seq_len
    mbs = micro_batch_options(global_batch, micro_batch)
    cands = uniform_candidates(costs, cluster, global_batch, seq_len, mbs, schedule, calibration,
                               max_tp=max_tp, max_ep=max_ep)
    if not cands:
        raise H2Error(f"no uniform plan of {costs.model} fits {cluster.name} "
                      f"(global batch {global_batch})")
    for c in cands[:3]:
        c.sim = simulate(costs, c.plan, cluster, calibration, record=False)
    return min(cands[:3], key=lambda c: c.step_time_s)
