"""HeteroSpeedupRatio (H2): heterogeneous throughput against the best homogeneous throughput
of each chip type alone, each found by the same search."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from h2ir.clusters.cluster import Cluster
from h2ir.costs import ModelCosts
from h2ir.errors import H2Error
from h2ir.planner.search.best_first import search
from h2ir.planner.search.result import Candidate
from h2ir.planner.search.space import PlanSpace, chip_counts


@dataclass
class SpeedupReport:
    """H2's HeteroSpeedupRatio: heterogeneous throughput / sum over chip types of the best
    homogeneous throughput of that type's chips alone (each found by the same search)."""
    hetero_tokens_per_s: float
    homo: dict                       # chip -> {'tokens_per_s', 'global_batch', 'step_time_s', 'plan'} or None
    ratio: float | None              # homogeneous runs at the same work per chip
    homo_const: dict = field(default_factory=dict)   # same, each at the hetero global batch
    ratio_const_batch: float | None = None

    def to_json(self) -> dict:
        def strip(d):
            return {c: ({k: v for k, v in r.items() if k != "plan"} | {"config": r["config"]}
                        if r else None) for c, r in d.items()}
        return {"hetero_tokens_per_s": self.hetero_tokens_per_s, "ratio": self.ratio,
                "ratio_const_batch": self.ratio_const_batch, "homogeneous": strip(self.homo),
                "homogeneous_const_batch": strip(self.homo_const)}


def sub_cluster(cluster: Cluster, chip: str) -> Cluster:
    return Cluster(name=f"{cluster.name}[{chip}]", chip_types={chip: cluster.chip(chip)},
                   groups=tuple(g for g in cluster.groups if g.chip == chip), dtype=cluster.dtype)


def share_batch(global_batch: int, chips: int, total: int) -> int:
    """A homogeneous baseline's global batch at the same work per chip as the heterogeneous run:
    gb * chips / total, moved to the multiple of 8 within 2 % of it that has the most factors
    of two, so that the baseline's dp and micro-batch are not forced to 1 by a prime batch
    (round(1024 * 256 / 768) = 341 = 11 x 31 would be). Below 8 sequences: the exact share."""
    exact = global_batch * chips / total
    if exact < 8:
        return max(1, round(exact))
    near = [k for k in range(8 * math.floor(exact * 0.98 / 8), math.ceil(exact * 1.02) + 1, 8)
            if k >= 8 and abs(k - exact) <= 0.02 * exact] or [max(8, 8 * round(exact / 8))]
    twos = lambda k: (k & -k)
    return max(near, key=lambda k: (twos(k), -abs(k - exact)))


def _homo_best(costs, cluster, chip, global_batch, seq_len, micro_batch, schedule, calibration,
               space=None):
    try:
        r = search(costs, sub_cluster(cluster, chip), global_batch, seq_len=seq_len,
                   micro_batch=micro_batch, schedule=schedule, calibration=calibration, top_k=1,
                   space=space)
    except H2Error:
        return None                  # this chip type alone cannot train the model
    return {"tokens_per_s": r.best.tokens_per_s, "global_batch": global_batch,
            "step_time_s": r.best.step_time_s, "plan": r.best.plan,
            "config": r.best.config.describe() if r.best.config else None}


def hetero_speedup(costs: ModelCosts, cluster: Cluster, hetero: Candidate, *,
                   schedule: str = "1f1b", calibration=None, space: PlanSpace | None = None) -> SpeedupReport:
    """Each chip type alone gets its own best plan (the same search, the same plan space) at
    the same work per chip (`share_batch`), and, separately, at the heterogeneous run's whole
    global batch (constant global batch)."""
    counts = chip_counts(cluster)
    N = sum(counts.values())
    gb, seq, mb = hetero.plan.global_batch, hetero.plan.seq_len, None
    homo, const = {}, {}
    for c, n in counts.items():
        gb_c = share_batch(gb, n, N)
        homo[c] = _homo_best(costs, cluster, c, gb_c, seq, mb, schedule, calibration, space)
        const[c] = homo[c] if gb_c == gb else _homo_best(costs, cluster, c, gb, seq, mb, schedule,
                                                          calibration, space)

    def ratio(d):
        tot = sum(r["tokens_per_s"] for r in d.values() if r)
        return hetero.tokens_per_s / tot if tot > 0 else None

    return SpeedupReport(hetero_tokens_per_s=hetero.tokens_per_s, homo=homo, ratio=ratio(homo),
                         homo_const=const, ratio_const_batch=ratio(const))
