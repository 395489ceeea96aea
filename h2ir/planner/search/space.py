"""The plan space and its configurations: which dimensions the search explores (`PlanSpace`),
a configuration (`Config`: everything but the layer split) and the degrees each chip type may
take (TP options, stage orders, micro-batch sizes)."""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from h2ir.clusters.cluster import Cluster
from h2ir.costs import ModelCosts
from h2ir.errors import MAX_MICROBATCHES, H2Error
from h2ir.planner.divisors import divisors
from h2ir.planner.limits import MICRO_BATCHES
from h2ir.planner.resource import ResourceModel, device_capacity


@dataclass(frozen=True)
class PlanSpace:
    """Which dimensions of the plan space the search explores (all on by default)."""
    idle: bool = True            # leave chips, or a whole chip type, unused when that is faster
    partial: bool = True         # with `idle`: a type in part, fewer stages than its chips allow
    lower_first: bool = True     # with `mixed_tp`: a type's lower tp on its first stages too
    mixed_tp: bool = True        # stages of one chip type with different tp degrees
    split_types: bool = True     # a chip type in two contiguous blocks of stages (A-B-A)
    schedules: tuple | None = None   # schedules to search; None: the one passed to `search`
    mixed_ep: bool = True        # MoE: an EP degree per chip type (False: one for every stage)
    ep_local: bool = True        # MoE: EP groups inside one node (False: they may cross NICs)
    zero: bool = True            # ZeRO-1 on stages with dp > 1 and ep 1 (`StageLine.step_end`)


@dataclass(frozen=True)
class Config:
    """Everything about a plan except the layer split. `stages` is the line of (chip, tp)
    stages; without it, each type in `order` contributes counts/(dp*tp) stages of its tp."""
    dp: int
    micro_batch: int
    m: int
    tp: tuple              # ((chip, tp), ...) in chip-name order (the type's first tp)
    order: tuple           # chip types in stage order (first appearance)
    counts: tuple          # ((chip, chips), ...)
    stages: tuple = ()
    schedule: str = "1f1b"

    def shapes(self) -> list[tuple[str, int]]:
        if self.stages:
            return list(self.stages)
        tp, n = dict(self.tp), dict(self.counts)
        out = []
        for c in self.order:
            out += [(c, tp[c])] * (n[c] // (self.dp * tp[c]))
        return out

    def describe(self) -> str:
        parts = [f"{c}(tp{t})x{len(list(g))}" for (c, t), g in itertools.groupby(self.shapes())]
        return f"dp={self.dp} mb={self.micro_batch} m={self.m} " + " > ".join(parts)


def config_of(dp: int, mb: int, m: int, shapes, counts_t: tuple, schedule: str) -> Config:
    first = {}
    for c, t in shapes:
        first.setdefault(c, t)
    order = tuple(dict.fromkeys(c for c, _ in shapes))
    return Config(dp, mb, m, tuple(sorted(first.items())), order, counts_t, tuple(shapes), schedule)


def chip_counts(cluster: Cluster) -> dict[str, int]:
    return {c: cluster.count(c) for c in cluster.chip_types if cluster.count(c) > 0}


def tp_options(cluster: Cluster, chip: str, per_replica: int, n_heads: int,
               divide: bool = True, reach: int = 0) -> list[int]:
    """TP degrees for a chip type: divisors of the heads that divide chips-per-node (Megatron
    keeps TP inside a node, Narayanan et al. SC'21 Sec. 3.3), and whole nodes of it up to
    `reach` (a TP group across nodes: legal, and costed over the NICs by `tp_allreduce_time`;
    on small nodes it lets a stage hold what a node's TP cannot), at most the chips per replica
    and, with `divide`, dividing them."""
    cpn = max(g.chips_per_node for g in cluster.groups if g.chip == chip)
    cands = divisors(cpn) if n_heads <= 0 else \
        [t for t in divisors(n_heads) if cpn % t == 0 or (t % cpn == 0 and t <= reach)]
    return [t for t in cands
            if t <= per_replica and (not divide or per_replica % t == 0)]


def tp_reach(rm: ResourceModel, cluster: Cluster, chip: str, n_heads: int) -> int:
    """The largest TP degree past a node worth offering on `chip`: the smallest multiple of
    its chips-per-node (dividing the heads) at which every layer alone fits a chip, with
    (selective or full) recomputation if need be, at one micro-batch in flight; its chips-per-node when that
    already does. A TP group across nodes pays the NIC on every all-reduce, so a larger one
    only adds comm to what a smaller one can already place."""
    cpn = max(g.chips_per_node for g in cluster.groups if g.chip == chip)
    if n_heads <= 0 or n_heads % cpn:
        return cpn
    cap = device_capacity(cluster.chip(chip))
    for t in [t for t in divisors(n_heads) if t % cpn == 0]:
        dev = rm.la.device(t)
        # zero=0's state: with ZeRO-1 a smaller degree may do, so this reach offers no fewer
        state = np.asarray(dev.params) * rm.la.state.total
        need = np.minimum.reduce([np.diag(f) + np.diag(p) for f, p in
                                  (dev.memory_terms(r) for r in ("none", "selective", "full"))])
        if np.all(state + need <= cap):
            return t
    return n_heads


def memory_order(cluster: Cluster, chips: list[str]) -> tuple:
    """The chip types larger-memory first (H2's rule); ties keep the cluster file's order."""
    declared = list(cluster.chip_types)
    key = lambda c: (-cluster.chip(c).mem_bytes, declared.index(c) if c in declared else len(declared), c)
    return tuple(sorted(chips, key=key))


def memory_orders(cluster: Cluster, chips: list[str]) -> list[tuple]:
    """Every order of the chip types, larger-memory first (H2's rule) leading."""
    first = memory_order(cluster, chips)
    rest = [p for p in itertools.permutations(sorted(chips)) if p != first]
    return [first] + rest


def tp_configurations(costs: ModelCosts, cluster: Cluster, global_batch: int, micro_batches,
                      schedule: str, dp_options=None, max_tp: int | None = None,
                      uniform_only: bool = False):
    """All (dp, micro-batch, tp per type) choices with 1 <= stages <= layers; orders added later."""
    counts = chip_counts(cluster)
    if not counts:
        raise H2Error(f"cluster {cluster.name!r} has no chips")
    g = 0
    for n in counts.values():
        g = math.gcd(g, n)
    out = []
    too_many = 0
    for mb in micro_batches:
        for dp in divisors(g):
            if (dp_options and dp not in dp_options) or global_batch % (dp * mb):
                continue
            m = global_batch // (dp * mb)
            if m > MAX_MICROBATCHES:      # the stream (and its simulation) grows with m
                too_many += 1
                continue
            out += [(mb, dp, m, tps) for tps in
                    _tp_choices(costs, cluster, counts, dp, max_tp, uniform_only)]
    if not out and too_many:
        raise too_many_microbatches(global_batch, micro_batches)
    return out, counts


def _tp_choices(costs: ModelCosts, cluster: Cluster, counts: dict, dp: int, max_tp: int | None,
                uniform_only: bool) -> list[tuple]:
    """((chip, tp), ...) per choice of a tp per type (with `uniform_only` one tp for all) that
    gives 1 <= stages <= layers."""
    chips = sorted(counts)
    opts = [[t for t in tp_options(cluster, c, counts[c] // dp, costs.n_heads)
             if max_tp is None or t <= max_tp] for c in chips]
    if uniform_only:
        common = sorted(set.intersection(*map(set, opts))) if opts else []
        products = [(t,) * len(chips) for t in common]
    else:
        products = itertools.product(*opts)
    return [tuple(zip(chips, tps)) for tps in products
            if 1 <= sum(counts[c] // (dp * t) for c, t in zip(chips, tps)) <= len(costs.layers)]


def too_many_microbatches(global_batch: int, micro_batches) -> H2Error:
    """The error of a global batch that needs more than MAX_MICROBATCHES everywhere."""
    return H2Error(f"global batch {global_batch} needs more than {MAX_MICROBATCHES:,} "
                   f"micro-batches per step at every micro-batch size and dp tried "
                   f"({', '.join(map(str, micro_batches))})",
                   hint="lower --global-batch, or raise --micro-batch")


def micro_batch_options(global_batch: int, micro_batch: int | None) -> list[int]:
    """The micro-batch sizes to try: the one asked for, else those of MICRO_BATCHES that divide
    the global batch."""
    return [micro_batch] if micro_batch else [b for b in MICRO_BATCHES if global_batch % b == 0]
