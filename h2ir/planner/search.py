"""HeteroAuto: search a heterogeneous pipeline plan (H2, arXiv 2505.17548, HeteroPP/HeteroAuto).

What it ranks by. Every layer split is scored by `step_lower_bound`, a lower bound of the
simulator's step time built from the same resource model terms the simulator charges (compute,
the p2p link queue of every worker in both directions, DP all-reduce, TP collectives inside the
stage times, optimizer step, memory feasibility). The search is a best-first queue over lower
bounds: configurations, then lines of stages, then layer splits, and candidates are simulated
(h2ir/planner/simulate.py) in bound order; it stops when the next bound is no better than the
best simulated step (then the choice is the simulator's optimum over what was generated), or
when the simulation budget or `time_limit` is spent. `SearchResult.exact` is derived, not set:
true only when the least lower bound of everything left unsimulated (the heap, configurations
whose lines coordinate descent sampled, truncated split searches) is not below the chosen plan.

The plan space (`PlanSpace`, each dimension switchable):
  micro-batch size   1, 2, 4, 8 dividing the global batch (or the one asked for)
  dp                 one data-parallel degree for the whole pipeline (the executor replicates the
                     whole pipeline: a per-stage dp is not expressible in its streams)
  stages of a type   a type's dp-way replicated chips become stages of tp chips each; every stage
                     has its own tp (`mixed_tp`: a type's first stages at one tp, the rest at
                     another, either higher first or lower first); chips, part of a type (any
                     number of its stages: `partial`) or a whole type may stay idle (`idle`)
  tp                 dividing the heads and chips-per-node, or whole nodes (costed over NICs)
  stage order        any order of the types' blocks; one type may form two blocks (`split_types`:
                     A-B-A orders)
  recompute          per stage: none if it fits, else selective if that fits, else full
  zero               per stage with dp > 1 and ep 1 (`zero`): ZeRO-1 where zero=0 does not fit at
                     that recompute, or where the resource model times it faster
  schedule           1f1b and/or gpipe (`schedules`), each with its own memory (in-flight count)
  layer split        contiguous ranges: branch-and-bound DFS on the lower bound

Small spaces (at most `EXACT_WORK` / layers lines per configuration) are enumerated line by line; larger
ones are explored by coordinate descent over each type's stage sequence, block moves in the order
and A-B-A splits (`_LocalLines`), so type orders are never enumerated as k!.
"""
from __future__ import annotations

import bisect
import dataclasses
import heapq
import itertools
import math
import time
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from h2ir.clusters.cluster import Cluster
from h2ir.costs import ModelCosts
from h2ir.errors import MAX_MICROBATCHES, MAX_WORKERS, H2Error
from h2ir.plans.plan import MoEPlan, Plan, StagePlan
from h2ir.planner.resource import (ResourceModel, attention_score_bytes, default_ep_geometry,
                                   device_capacity, dtype_bytes, ep_groups, inflight_microbatches,
                                   moe_a2a_pass_time, p2p_link, stage_memory, zero_optimizer_bytes)
from h2ir.schedule.streams import WorkerLayout, worker_hosts
from h2ir.planner.simulate import SimResult, simulate

BLOCK_KINDS = ("transformer_block", "moe_block")
MICRO_BATCHES = (1, 2, 4, 8)
# safety margin on memory capacity: the search's float sums vs the validator's integer items
_CAP_MARGIN = 1.0 - 1e-9
# the DFS does not chase improvements smaller than this fraction of the bound
REL_TOL = 1e-4
# a configuration with at most EXACT_WORK / layers lines of stages is enumerated line by line,
# while the search has enumerated fewer than EXACT_TOTAL lines in all (best configurations
# first: they are expanded in bound order)
EXACT_WORK = 40_000
EXACT_TOTAL = 20_000
# outside exact mode, a configuration whose starting line is this much behind the best line
# found is not explored
PROBE_SLACK = 0.15
# a layer-split search that runs out of nodes is repeated with 4x the nodes, up to this many
# times the first budget
NODE_BUDGET_GROWTH = 64


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


def _config_of(dp: int, mb: int, m: int, shapes, counts_t: tuple, schedule: str) -> Config:
    first = {}
    for c, t in shapes:
        first.setdefault(c, t)
    order = tuple(dict.fromkeys(c for c, _ in shapes))
    return Config(dp, mb, m, tuple(sorted(first.items())), order, counts_t, tuple(shapes), schedule)


@dataclass
class Candidate:
    plan: Plan
    estimate_s: float              # lower bound of the simulated step (`step_lower_bound`)
    kind: str                      # 'auto' | 'uniform' | 'exhaustive'
    config: Config | None = None
    bounds: tuple = ()
    sim: SimResult | None = None
    sim_work: int = 0              # its simulation's work (worker x micro-batch units)

    @property
    def step_time_s(self) -> float:
        return self.sim.step_time_s if self.sim else self.estimate_s

    @property
    def tokens_per_s(self) -> float:
        return self.plan.global_batch * self.plan.seq_len / self.step_time_s


@dataclass
class SearchResult:
    best: Candidate
    runner_ups: list[Candidate]
    uniform: Candidate | None
    search_time_s: float
    method: str
    configs_total: int = 0
    configs_searched: int = 0
    dfs_nodes: int = 0
    simulations: int = 0
    timed_out: bool = False        # stopped by `time_limit`: the best plan found so far
    lines: int = 0
    # The least lower bound (of the simulated step) of every plan of the search's space it did
    # not simulate: the heap when it stopped, configurations whose lines coordinate descent
    # sampled, truncated layer-split searches; inf when nothing was left.
    unexplored_bound_s: float = math.inf
    lines_by: str = "enumeration"  # how lines were generated: 'enumeration' or 'coordinate-descent'
    stopped_by: str = "bound"      # 'bound', 'simulation budget' or 'time limit'

    @property
    def exact(self) -> bool:
        """Proved optimal over the search's plan space: nothing left unsimulated has a lower
        bound below the chosen plan's simulated step. Derived from the bounds, never set."""
        return bool(self.unexplored_bound_s >= self.best.step_time_s * (1 - 1e-9))

    @property
    def lower_bound_s(self) -> float:
        """No plan of the search's space is predicted faster than this (the chosen plan's step
        when `exact`)."""
        return float(min(self.unexplored_bound_s, self.best.step_time_s))

    def proof(self) -> dict:
        """What the search proved, for reports: `exact`, how lines were generated, what
        stopped it, the lower bound and the chosen plan's distance from it."""
        lb, step = self.lower_bound_s, self.best.step_time_s
        if self.exact:
            proved = "optimal over the search's plan space (docs/planning.md, 'The plan space')"
        elif lb > 0:
            proved = (f"no plan of the search's space is predicted faster than {lb:.4g} s; the "
                      f"chosen one is within {step / lb - 1:.1%} of that bound")
        else:
            proved = "nothing: part of the space was left without a bound"
        return {"exact": self.exact, "search": self.lines_by, "stopped_by": self.stopped_by,
                "lower_bound_s": lb, "gap_to_bound": float(step / lb - 1) if lb > 0 else None,
                "proved": proved}

    @property
    def plan(self) -> Plan:
        return self.best.plan

    @property
    def sim(self) -> SimResult:
        return self.best.sim


# ----------------------------------------------------------------------------------------------
# one stage kind: O(1) range costs

class _KindTable:
    """What one (chip, tp, ep, a2a) stage costs for every layer range [a, b), independent of
    the in-flight count: prefix sums for time, and the memory fits (`_Fits`) of zero=0
    (`plain`) and of zero=1 over dp replicas (`sharded(dp)`, for stages that may shard their
    optimizer state: dp > 1 and ep 1, as the validator has it). Memory numbers are
    h2ir/planner/resource.py's (`memory_items`, the attention scores of
    `attention_score_bytes`, `device_capacity`, `zero_optimizer_bytes`), evaluated for all
    (a, b) at once: bytes = base + inflight * per_mb, so a range fits iff
    inflight <= (cap - base) / per_mb."""

    def __init__(self, rm: ResourceModel, chip: str, tp: int, ep: int, a2a: str):
        lt = rm.layer_times(chip, tp, ep, a2a)
        self.chip, self.tp = chip, tp
        self.F, self.B, self.Bsel, self.Brc = lt.fwd, lt.bwd, lt.bwd_sel, lt.bwd_rc
        self.FB = [f + b for f, b in zip(lt.fwd, lt.bwd)]
        self.FBsel = [f + b for f, b in zip(lt.fwd, lt.bwd_sel)]
        self.FBrc = [f + b for f, b in zip(lt.fwd, lt.bwd_rc)]
        self.tau = np.add(lt.fwd_layer, lt.bwd_layer)
        dev = rm.la.device(tp, ep)
        self.Pp = dev.P_params
        self.out = dev.out.tolist()
        L = rm.L
        Pp = np.array(dev.P_params)
        a = np.arange(L)[:, None]
        b = np.arange(1, L + 1)[None, :]
        P = Pp[b] - Pp[a]
        st = rm.la.state
        # the resource model's own terms of every range [a, b): fixed + inflight * per_mb
        # (`DeviceArrays.memory_terms`, what `memory_items` itemises)
        fixed_n, per_n = dev.memory_terms("none")
        fixed_s, per_s = dev.memory_terms("selective")
        fixed_f, per_f = dev.memory_terms("full")
        ct = rm.cluster.chip(chip)
        cap = device_capacity(ct) * _CAP_MARGIN
        # attention scores of chips without a fused kernel (resource.attention_score_bytes):
        # every in-flight micro-batch keeps them, or, with either recomputation (both re-make
        # the attention core, as resource.stage_memory has it), the re-run block only
        sc = _score_bytes(rm, ct, tp)
        Psc = np.concatenate([[0.0], np.cumsum(sc)])
        sc_rc = np.where(Psc[b] - Psc[a] > 0, sc.max() if L else 0.0, 0.0)
        before = b <= a
        # (base, per micro-batch) of each recompute tier, besides the model state; and the
        # gradient sums, for `_Fits.late`
        tiers = ((fixed_n, per_n + Psc[b] - Psc[a], per_n), (fixed_s + sc_rc, per_s, per_s),
                 (fixed_f + sc_rc, per_f, per_f))
        grads = P * st.grads
        self.plain = _Fits(P * st.total, tiers, grads, cap, before)
        self._fits_args = (tiers, grads, cap, before)
        self._P, self._state = P, st
        self._sharded: dict = {1: self.plain}

    def sharded(self, dp: int) -> "_Fits":
        """The fits of zero=1 over dp replicas (dp 1: zero=0's)."""
        if dp not in self._sharded:
            P, st = self._P, self._state
            state = P * (st.weights + st.grads) + zero_optimizer_bytes(P * st.optimizer, dp)
            self._sharded[dp] = _Fits(state, *self._fits_args)
        return self._sharded[dp]


class _Fits:
    """For one model-state table (bytes of every range [a, b)), the largest in-flight count at
    which [a, b') still fits for every b' <= b without recomputation (`inone`), with at most
    selective recomputation (`isel`) and with any (`iany`)."""

    def __init__(self, state: np.ndarray, tiers: tuple, grads: np.ndarray, cap: float,
                 before: np.ndarray):
        (fixed_n, per_n, _), (fixed_s, per_s, _), (fixed_f, per_f, _) = tiers
        with np.errstate(divide="ignore", invalid="ignore"):
            inone = _max_inflight(cap - state - fixed_n, per_n)
            isel = _max_inflight(cap - state - fixed_s, per_s)
            irc = _max_inflight(cap - state - fixed_f, per_f)
        inone[before] = np.inf
        isel[before] = np.inf
        irc[before] = np.inf
        # monotone: what fits without recomputation fits with at most selective, and that
        # with any (each the max of the in-flight limits of the tiers below it); kept as whole
        # counts (x >= n iff floor(x) >= n), exact in float32 below 2^24 micro-batches
        isel = np.maximum(inone, isel)
        whole = lambda x: np.clip(np.floor(np.minimum.accumulate(x, axis=1)), -1, 2 ** 24
                                  ).astype(np.float32)
        self.inone, self.isel, self.iany = whole(inone), whole(isel), whole(np.maximum(isel, irc))
        # for `late`: the same terms, and the gradient sums that do not exist yet while the
        # first backward's micro-batch is still held (`stage_memory`)
        self.state, self.tiers = state, tiers
        self.cap, self.before, self.grads = cap, before, grads

    def limits(self, inflight: int, late: bool, single: bool = False) -> tuple[list, list, list]:
        """For every start layer a, the furthest end b that fits at `inflight` micro-batches
        without recomputation, with at most selective and with any (`StageKind`)."""
        if late or single:
            return tuple(f.sum(axis=1).tolist() for f in self.late(inflight, single))
        return tuple((i >= inflight).sum(axis=1).tolist()
                     for i in (self.inone, self.isel, self.iany))

    def late(self, inflight: int, single: bool = False) -> tuple[np.ndarray, ...]:
        """(fit without recomputation, fit with at most selective, fit with any) at
        `inflight` micro-batches when every
        micro-batch's forward runs before the stage's first backward: the gradient sums then
        first exist once that backward has released its micro-batch's activations, so the peak
        holds min(grads, one micro-batch's activations) less; with `single` (one micro-batch
        per step) there are no sums besides the backward's own gradients, so it holds none of
        them (resource.stage_memory)."""
        less = (lambda per: self.grads) if single else (lambda per: np.minimum(self.grads, per))
        with np.errstate(invalid="ignore"):
            none, sel, full = (self.state + fixed + inflight * per - less(act) <= self.cap
                               for fixed, per, act in self.tiers)
        none = none | self.before
        sel = none | sel | self.before
        full = sel | full | self.before
        return (np.logical_and.accumulate(none, axis=1),
                np.logical_and.accumulate(sel, axis=1),
                np.logical_and.accumulate(full, axis=1))


def first_backward_late(inflight: int, m: int) -> bool:
    """Whether a stage holding `inflight` of m micro-batches runs every forward before its
    first backward (as `stage_memory` tells it for a one-chunk schedule)."""
    return inflight >= m > 1


def _max_inflight(room: np.ndarray, per_mb: np.ndarray) -> np.ndarray:
    """Largest in-flight count with room - inflight * per_mb >= 0 (inf when per_mb is 0 and
    there is room, -inf when there is none)."""
    return np.where(per_mb > 0, room / np.where(per_mb > 0, per_mb, 1.0),
                    np.where(room >= 0, np.inf, -np.inf))


class StageKind:
    """Costing of one stage for a (chip, tp, ep, a2a, dp, in-flight micro-batches) combination:
    the `_KindTable`'s prefix sums for time, and for every start layer a the furthest end b up
    to which the stage still fits in memory without recomputation (`fit_none`), with at most
    selective recomputation (`fit_sel`) and with full recomputation if needed (`fit_any`):
    fit_none <= fit_sel <= fit_any. A range up to fit_none runs without recomputation, one up
    to fit_sel with selective, one up to fit_any with full. Where the stage may take ZeRO-1
    (`zero`) the fits are those of zero=1, its least memory, and `plain_fit` zero=0's (whether
    it fits at the same recomputation: `StageLine.step_end`)."""

    def __init__(self, rm: ResourceModel, chip: str, tp: int, ep: int, a2a: str, inflight: int,
                 table: _KindTable | None = None, late: bool = False, single: bool = False,
                 zero_dp: int = 1):
        """`late`: every micro-batch's forward runs before the stage's first backward (GPipe,
        or 1F1B with m <= S - j; `first_backward_late`); `single`: one micro-batch per step;
        `zero_dp`: the replicas a ZeRO-1 stage shards over (1: zero=0 only)."""
        t = table or _KindTable(rm, chip, tp, ep, a2a)
        self.chip, self.tp = chip, tp
        self.F, self.B, self.Bsel, self.Brc = t.F, t.B, t.Bsel, t.Brc
        self.FB, self.FBsel, self.FBrc = t.FB, t.FBsel, t.FBrc
        self.tau, self.Pp, self.out = t.tau, t.Pp, t.out
        self.zero = zero_dp > 1
        self.fit_none, self.fit_sel, self.fit_any = t.sharded(zero_dp).limits(inflight, late, single)
        self.plain_fit = t.plain.limits(inflight, late, single) if self.zero else \
            (self.fit_none, self.fit_sel, self.fit_any)

    def stage(self, a: int, b: int):
        """(fwd, bwd, recompute) for layers [a, b), or None if they do not fit."""
        if b <= self.fit_none[a]:
            return self.F[b] - self.F[a], self.B[b] - self.B[a], "none"
        if b <= self.fit_sel[a]:
            return self.F[b] - self.F[a], self.Bsel[b] - self.Bsel[a], "selective"
        if b <= self.fit_any[a]:
            return self.F[b] - self.F[a], self.Brc[b] - self.Brc[a], "full"
        return None

    def fits_plain(self, a: int, b: int) -> bool:
        """Layers [a, b) fit with zero=0 at the recomputation `stage` gives them."""
        for fit, plain in zip((self.fit_none, self.fit_sel, self.fit_any), self.plain_fit):
            if b <= fit[a]:
                return b <= plain[a]
        return False

    def time(self, a: int, b: int) -> float:
        if b <= self.fit_none[a]:
            return self.FB[b] - self.FB[a]
        if b <= self.fit_sel[a]:
            return self.FBsel[b] - self.FBsel[a]
        if b <= self.fit_any[a]:
            return self.FBrc[b] - self.FBrc[a]
        return math.inf

    def furthest(self, a: int, T: float) -> int:
        """Largest b with time(a, b) <= T and memory fitting (a if none): feasibility is
        downward closed in b (fewer layers: less time, less memory; each layer's selective
        time lies between its times without and with full recomputation, so time(a, b) grows
        with b across the tiers too), so it is one bisection per tier, the furthest first."""
        if self.fit_any[a] > self.fit_sel[a]:
            b3 = min(self.fit_any[a], bisect.bisect_right(self.FBrc, self.FBrc[a] + T) - 1)
            if b3 > self.fit_sel[a]:
                return b3
        if self.fit_sel[a] > self.fit_none[a]:
            b2 = min(self.fit_sel[a], bisect.bisect_right(self.FBsel, self.FBsel[a] + T) - 1)
            if b2 > self.fit_none[a]:
                return b2
        b = min(self.fit_none[a], bisect.bisect_right(self.FB, self.FB[a] + T) - 1)
        return max(b, a)


_SCORES: dict = {}

# the final ranking's simulation budget (`_Search.sim_budget`), in simulated worker x
# micro-batch units
SIM_WORK_MIN = 12_500


def _score_bytes(rm: ResourceModel, chip, tp: int) -> np.ndarray:
    """Per layer, the attention-score bytes one micro-batch keeps on `chip` at `tp`
    (resource.attention_score_bytes), memoised per layer arrays."""
    # keyed by id() but holding the object: an id is reused once its object is collected, so
    # the hit must be the same object, not only the same id
    key = (id(rm.la), chip.name, chip.fused_attention, tp)
    hit = _SCORES.get(key)
    if hit is None or hit[0] is not rm.la:
        if len(_SCORES) > 4096:
            _SCORES.clear()
        hit = _SCORES[key] = (rm.la, np.array([attention_score_bytes(rm.la, chip, tp, i, i + 1)
                                               for i in range(rm.L)]))
    return hit[1]


@lru_cache(maxsize=16)
def _all_bounds(L: int, S: int) -> np.ndarray:
    """Every split of L layers into S non-empty contiguous ranges, as rows of S+1 bounds."""
    k = S - 1
    n = math.comb(L - 1, k)
    cuts = np.fromiter(itertools.chain.from_iterable(itertools.combinations(range(1, L), k)),
                       dtype=np.int64, count=n * k).reshape(n, k)
    return np.concatenate([np.zeros((n, 1), np.int64), cuts, np.full((n, 1), L, np.int64)], axis=1)


# ----------------------------------------------------------------------------------------------
# one configuration's line of stages and the step-time estimate


# ----------------------------------------------------------------------------------------------
# the lower bound of the simulated step

def step_lower_bound(fs, bs, cs, tails, m: int, dp: int, gpipe: bool, mx=max):
    """A lower bound of the simulator's step time (h2ir/planner/simulate.py) for a line of S
    stages with per-micro-batch forward fs[j] and backward bs[j], boundary p2p time cs[j]
    (stage j to j+1, the same both ways: the simulator times both directions over
    `LinePlacement.boundary(j)`) and tails[j] (gradient
    all-reduce + optimizer step). Entries may be floats or numpy columns (then `mx` is
    np.maximum). Every term is a chain of waits the simulator must respect:

    compute lane of j:  pre_j + m (f_j + b_j) + T_j, where pre_j = sum_{k<j} (f_k + c_k) is the
        earliest first forward (micro-batch 0 must cross stages 0..j-1), and
        T_j = max(tail_j, c_{j-1} + b_{j-1} + T_{j-1}) what must follow j's last backward
        (its own tail, and the last gradient's way back to stage 0 and its tail);
    link of j:          one queue carries j's m activations and m gradients (both directions
        of a worker's sends serialise, as in the simulator); it cannot start before j's
        first forward ends, its last send is the last gradient, which stage j-1 must then
        take through its backward and T_{j-1};
    GPipe, in addition: no backward before the stage's last forward (phases), the last
        forward needs the last activation, the first backward the first gradient.

    Ties (embedding = head) only add sends, so leaving them out keeps it a lower bound."""
    S = len(fs)
    pre, back, lb = 0.0, 0.0, 0.0
    for j in range(S):
        T = mx(tails[j], back)
        lb = mx(lb, pre + m * (fs[j] + bs[j]) + T)
        cin = cs[j - 1] if j > 0 else 0.0
        cout = cs[j] if j < S - 1 else 0.0
        after = mx(back - cin, tails[j]) if dp > 1 else back - cin
        if j == 0:
            if S > 1:
                lb = mx(lb, fs[0] + (m + 1) * cout + bs[0] + T)
        elif j < S - 1:
            lb = mx(lb, pre + fs[j] + m * (cin + cout) + after)
        else:
            lb = mx(lb, pre + fs[j] + bs[j] + m * cin + after)
        pre = pre + fs[j] + cout
        back = cout + bs[j] + T
    if gpipe and S > 1:
        fe = [m * fs[0]]
        pre_j = fs[0] + cs[0]
        for j in range(1, S):
            fe.append(mx(mx(fe[j - 1] + cs[j - 1] + fs[j], pre_j + m * fs[j]),
                         pre_j - cs[j - 1] + m * cs[j - 1] + fs[j]))
            if j < S - 1:
                pre_j = pre_j + fs[j] + cs[j]
        bs_ = fe[S - 1]
        be = fe[S - 1] + m * bs[S - 1]
        lb = mx(lb, be + tails[S - 1])
        for j in range(S - 2, -1, -1):
            first_grad = bs_ + bs[j + 1] + cs[j]
            be = mx(mx(mx(fe[j], first_grad) + m * bs[j], be + cs[j] + bs[j]),
                    bs_ + bs[j + 1] + m * cs[j] + bs[j])
            bs_ = mx(fe[j], first_grad)
            lb = mx(lb, be + tails[j])
    return lb


# ----------------------------------------------------------------------------------------------
# one line of stages: the lower bound of every layer split

class StageLine:
    """The ordered stages of one configuration, with everything needed to bound a layer split."""

    def __init__(self, rm: ResourceModel, config: Config, schedule: str, ep: int, a2a: str,
                 kinds: dict | None = None, placed: bool = True, zero: bool = True):
        """`placed`: links and all-reduces where the build puts the workers
        (`ResourceModel.placement`: the build's hosts and shared NICs, what the simulator
        charges); without it, the cheaper placement-free formulas (`p2p_link`,
        `replica_geometry`), which rank lines while they are being formed but bound nothing.
        `zero`: stages with dp > 1 and ep 1 may take ZeRO-1 (`step_end`)."""
        self.rm, self.config, self.schedule = rm, config, schedule
        self.a2a = a2a
        self.shapes = config.shapes()
        # `ep`: one EP degree for every stage, or {chip: ep} (a degree per chip type)
        self.eps = [ep.get(c, 1) if isinstance(ep, dict) else ep for c, _ in self.shapes]
        self.ep = ep
        S, L = len(self.shapes), rm.L
        self.S, self.L, self.m, self.dp = S, L, config.m, config.dp
        self.gpipe = schedule == "gpipe"
        kinds = kinds if kinds is not None else {}
        self.kinds = []
        for j, (chip, tp) in enumerate(self.shapes):
            infl = inflight_microbatches(schedule, j, S, self.m)
            late = first_backward_late(infl, self.m)
            e = self.eps[j]
            # the dp a ZeRO-1 stage shards over (1: zero=0 only, and tables shared by every dp)
            zdp = self.dp if zero and self.dp > 1 and e == 1 else 1
            single = self.m == 1
            key = (id(rm), chip, tp, e, a2a, zdp, infl, late, single)
            if key not in kinds:
                tkey = ("table", id(rm), chip, tp, e, a2a)
                if tkey not in kinds:
                    kinds[tkey] = _KindTable(rm, chip, tp, e, a2a)
                kinds[key] = StageKind(rm, chip, tp, e, a2a, infl, kinds[tkey], late, single, zdp)
            self.kinds.append(kinds[key])
        # the simulator's p2p: the whole boundary tensor over LinePlacement.boundary's path
        self.bout = rm.la.out.tolist()
        self.placed = placed
        self._place = self._link = None
        self._lb = None
        self._tail_cache: dict = {}
        # without placement a stage's step-end times depend on its shape alone: lines share them
        self._shared_tails = None if placed else kinds.setdefault(("tails", id(rm)), {})

    # the links are built when first needed: `bound` (compute and memory only) does not read
    # them, and most lines of a large space are bounded and never split (placing one line of
    # hundreds of workers costs milliseconds)
    @property
    def place(self):
        if self._place is None and self.placed:
            self._place = self.rm.placement(self.shapes, self.dp)
        return self._place

    @property
    def link(self) -> list:
        if self._link is None:
            S, rm = self.S, self.rm
            if self.placed:
                self._link = [self.place.boundary(j) for j in range(S - 1)]
            else:
                self._link = [p2p_link(rm.cluster, *self.shapes[j], *self.shapes[j + 1], self.dp)
                              for j in range(S - 1)]
        return self._link

    def stage(self, j: int, a: int, b: int):
        return self.kinds[j].stage(a, b)

    def comm(self, j: int, b: int) -> float:
        """p2p time of one micro-batch's boundary tensor between stage j (ending before b) and
        j+1, as the simulator times it (`ResourceModel.stage_times`)."""
        lat, bw = self.link[j]
        nbytes = self.bout[b - 1]
        return lat + nbytes / bw if nbytes > 0 else 0.0

    def tail_of(self, j: int, a: int, b: int) -> float:
        """Stage j's gradient exchange + optimizer step for layers [a, b) (`step_end`)."""
        return self.step_end(j, a, b)[0]

    def step_end(self, j: int, a: int, b: int) -> tuple[float, int]:
        """(gradient exchange + optimizer step, zero) of stage j holding layers [a, b), as the
        resource model times them (`ResourceModel.step_end_times`). ZeRO-1 where the stage may
        take it and zero=0 does not fit at the same recomputation, or the model times it
        faster (its reduce-scatter + all-gather against the all-reduce, 1/dp of the optimizer
        step); a tie keeps zero=0. The recomputation is the least zero=1 allows (`StageKind`),
        so the choice changes only this tail, never the stage's other terms."""
        key = (j, a, b)
        hit = self._tail_cache.get(key)
        if hit is None:
            k = self.kinds[j]
            t0, t1 = self._end_times(j, a, b, k.zero)
            hit = (t1, 1) if k.zero and (t1 < t0 or not k.fits_plain(a, b)) else (t0, 0)
            self._tail_cache[key] = hit
        return hit

    def _end_times(self, j: int, a: int, b: int, zero: bool) -> tuple:
        """(zero=0's step-end seconds, zero=1's or None) of stage j holding layers [a, b)."""
        chip, tp = self.shapes[j]
        e = self.eps[j]
        skey = (chip, tp, self.dp, e, zero, a, b)
        shared = self._shared_tails
        if shared is not None and skey in shared:
            return shared[skey]
        end = lambda z: sum(self.rm.step_end_times(chip, tp, self.dp, a, b, e, z, self.place,
                                                   j)[:2])
        times = (end(0), end(1) if zero else None)
        if shared is not None:
            shared[skey] = times
        return times

    def estimate(self, bounds) -> tuple[float, list] | None:
        """(lower bound of the simulated step, recompute per stage) of a layer split (S+1 layer
        indices), or None if a stage does not fit in memory (`step_lower_bound`)."""
        fs, bs, rcs, cs, tails = [], [], [], [], []
        for j in range(self.S):
            a, b = bounds[j], bounds[j + 1]
            r = self.kinds[j].stage(a, b)
            if r is None:
                return None
            fs.append(r[0]); bs.append(r[1]); rcs.append(r[2])
            tails.append(self.tail_of(j, a, b))
            if j < self.S - 1:
                cs.append(self.comm(j, b))
        return step_lower_bound(fs, bs, cs, tails, self.m, self.dp, self.gpipe), rcs

    lower_bound = estimate

    # -- bounds over all splits ------------------------------------------------------------------
    @property
    def lb_sum(self):
        """lb_sum[j][a]: every layer >= a on its fastest stage among j.. (one micro-batch's pass)."""
        if self._lb is None:
            S, L = self.S, self.L
            mt = np.full(L, np.inf)
            lb = [None] * (S + 1)
            lb[S] = [0.0] * (L + 1)
            for j in range(S - 1, -1, -1):
                mt = np.minimum(mt, self.kinds[j].tau)
                lb[j] = np.concatenate([np.cumsum(mt[::-1])[::-1], [0.0]]).tolist()
            self._lb = lb
        return self._lb

    def pack(self, T: float):
        """Ends of the split that fills each stage as far as bottleneck T and memory allow, or
        None. Since each stage's feasibility is downward closed, this greedy succeeds iff some
        split has every stage time <= T (the classic linear-partition argument)."""
        S, L = self.S, self.L
        ends = [0]
        a = 0
        for j in range(S - 1):
            b = min(self.kinds[j].furthest(a, T), L - (S - 1 - j))
            if b <= a:
                return None
            ends.append(b)
            a = b
        if self.kinds[S - 1].time(a, L) > T:
            return None
        ends.append(L)
        return ends

    def min_bottleneck(self) -> tuple[float, list] | None:
        """(T_lo, split): no split has every stage time below T_lo, and `split` (found by
        bisection on T with `pack`) is within 1e-4 of it."""
        if self.S > self.L:
            return None
        top = max(k.FBrc[self.L] for k in self.kinds)
        if self.pack(top) is None:
            return None
        # no split has every stage under the layers' least total over S, nor under the slowest
        # layer's least time; from there up in steps of a quarter to a feasible bottleneck
        fastest = np.min([k.tau for k in self.kinds], axis=0)
        lo = max(float(fastest.sum()) / self.S, float(fastest.max()))
        hi = lo * 1.25
        while hi < top and self.pack(hi) is None:
            lo, hi = hi, hi * 1.25
        hi = min(hi, top)
        while hi - lo > 1e-4 * hi:
            mid = (lo + hi) / 2
            if self.pack(mid) is None:
                lo = mid
            else:
                hi = mid
        return lo, self.pack(hi)

    def bound(self):
        """(lower bound over every split of this line, a good split) or None if none fits:
        some stage runs at least T_lo per micro-batch, m times (`min_bottleneck`), and one
        micro-batch crosses every layer on its fastest stage."""
        r = self.min_bottleneck()
        if r is None:
            return None
        T_lo, split = r
        return max(self.m * T_lo, self.lb_sum[0][0]), split

    def _earliest_starts(self, T: float) -> list[int]:
        """start[j]: smallest a such that stages j.. can hold layers [a, L) with every stage
        time <= T (packing backwards from the last layer); L + 1 when they cannot."""
        S, L = self.S, self.L
        start = [L + 1] * (S + 1)
        start[S] = L
        b = L
        for j in range(S - 1, -1, -1):
            k = self.kinds[j]
            lo, hi = j, b - 1          # smallest a >= j (stages before need a layer each)
            if hi < lo or k.furthest(hi, T) < b:
                break
            while lo < hi:
                mid = (lo + hi) // 2
                if k.furthest(mid, T) >= b:
                    hi = mid
                else:
                    lo = mid + 1
            b = lo
            start[j] = b
        return start

    # -- branch and bound ----------------------------------------------------------------------
    def best_split(self, bound: float = math.inf, node_budget: int = 30_000, incumbent=None,
                   k: int = 1):
        """Branch-and-bound DFS over stage ends, stage 0 first, minimising `estimate` (the lower
        bound of the simulated step). Returns (splits, nodes): the best `k` splits with bound <
        `bound` as (bound, ends), best first.

        A partial split's terms of `step_lower_bound` are final once its stages are chosen, so
        the running maximum only grows; a completion adds at least the rest of one micro-batch's
        pass; every later stage must run under (limit - pre - back) / m, which with memory caps
        how far a stage may reach (one bisection) and how early the next must start (backward
        packing). With k = 1, a (stage, start) reached again with no smaller (pre, back,
        running maximum) is dominated: the rest of the bound depends on nothing else."""
        bb = _LayerSplitSearch(self, bound, node_budget, k)
        if self.S > self.L:
            return [], 0
        inc = incumbent if incumbent is not None else (self.min_bottleneck() or (None, None))[1]
        if inc is not None:
            e = self.estimate(inc)
            if e is not None:
                bb.offer(e[0], tuple(inc))
        if not bb.best and bound == math.inf:
            return [], 0                       # nothing fits: the bottleneck packing failed
        bb.starts = self._earliest_starts(bb.limit() / self.m * (1 + 1e-9))
        bb.dfs(0, 0, 0.0, 0.0, 0.0)
        return bb.below_bound(), bb.nodes

    # -- exhaustive, vectorised ---------------------------------------------------------------
    def _tail_table(self, j: int) -> np.ndarray:
        L = self.L
        t = np.zeros((L + 1, L + 1))
        for a in range(L):
            for b in range(a + 1, L + 1):
                t[a, b] = self.tail_of(j, a, b)
        return t

    def all_splits(self, keep: int):
        """The bound of every contiguous split at once (numpy over all C(L-1, S-1) of them, the
        same `step_lower_bound`); the best `keep` as (bound, ends)."""
        S, L = self.S, self.L
        if S > L:
            return []
        n = math.comb(L - 1, S - 1)
        if n > EXHAUSTIVE_LINE_LIMIT:
            raise H2Error(f"exhaustive search of {n:,} layer splits for {self.config.describe()} "
                          f"is too large", hint="use --search heuristic")
        Bd = _all_bounds(L, S)
        N = len(Bd)
        ok = np.ones(N, bool)
        fs, bs, cs, tails = [], [], [], []
        bout = np.asarray(self.bout)
        for j, k in enumerate(self.kinds):
            a, b = Bd[:, j], Bd[:, j + 1]
            none = b <= np.asarray(k.fit_none)[a]
            sel = b <= np.asarray(k.fit_sel)[a]
            ok &= b <= np.asarray(k.fit_any)[a]
            F, Bn, Bs, Br = np.asarray(k.F), np.asarray(k.B), np.asarray(k.Bsel), np.asarray(k.Brc)
            fs.append(F[b] - F[a])
            bs.append(np.where(none, Bn[b] - Bn[a], np.where(sel, Bs[b] - Bs[a], Br[b] - Br[a])))
            if j < S - 1:
                lat, bw = self.link[j]
                nb = bout[b - 1]
                cs.append(np.where(nb > 0, lat + nb / bw, 0.0))
            tails.append(self._tail_table(j)[a, b])
        est = step_lower_bound(fs, bs, cs, tails, self.m, self.dp, self.gpipe, mx=np.maximum)
        est = np.where(ok, est, np.inf)
        order = np.argsort(est, kind="stable")[:keep]
        return [(float(est[i]), tuple(Bd[i].tolist())) for i in order if est[i] < np.inf]

    # -- plan ---------------------------------------------------------------------------------
    def plan(self, bounds, costs_model: str, cluster: Cluster, global_batch: int, seq_len: int,
             moe: MoEPlan | None) -> Plan:
        names = self.rm.la.names
        stages = []
        for j, (chip, tp) in enumerate(self.shapes):
            a, b = bounds[j], bounds[j + 1]
            r = self.stage(j, a, b)
            e = self.eps[j]
            stages.append(StagePlan(chip=chip, chips=self.dp * tp, layers=names[a:b], tp=tp,
                                    recompute=r[2] if r else "none",
                                    ep=e if moe is not None and e != moe.ep else None,
                                    zero=self.step_end(j, a, b)[1] if r else 0))
        return Plan(model=costs_model, cluster=cluster.name, global_batch=global_batch,
                    micro_batch=self.config.micro_batch, seq_len=seq_len, stages=stages,
                    dp=self.dp, schedule=self.schedule, moe=moe)


class _LayerSplitSearch:
    """The state of one `StageLine.best_split`: the best k layer splits so far (sorted, as
    (bound, ends)), the nodes visited, the dominance memo and the stage ends of the DFS path."""

    def __init__(self, line: StageLine, bound: float, node_budget: int, k: int):
        self.line, self.bound, self.node_budget, self.k = line, bound, node_budget, k
        self.memo = k == 1
        self.lb_sum = line.lb_sum
        self.best: list = []               # sorted (bound, ends), at most k
        self.nodes = 0
        self.seen: dict = {}               # (stage, start) -> undominated (pre, back, running max)
        self.ends = [0] * (line.S + 1)
        self.ends[line.S] = line.L
        self.starts: list = []             # earliest start of each stage under the first cap

    def limit(self) -> float:
        best = self.best
        return (best[-1][0] if len(best) >= self.k else self.bound) * (1 - REL_TOL)

    def offer(self, est, bnds):
        best = self.best
        worst = best[-1][0] if len(best) >= self.k else self.bound
        if est < worst and all(b != bnds for _, b in best):
            bisect.insort(best, (est, bnds))
            del best[self.k:]

    def below_bound(self) -> list:
        return [x for x in self.best if x[0] < self.bound]

    def dominated(self, j, a, state) -> bool:
        lst = self.seen.get((j, a))
        if lst is None:
            self.seen[(j, a)] = [state]
            return False
        for s2 in lst:
            if s2[0] <= state[0] and s2[1] <= state[1] and s2[2] <= state[2]:
                return True
        lst[:] = [s2 for s2 in lst
                  if not (state[0] <= s2[0] and state[1] <= s2[1] and state[2] <= s2[2])]
        lst.append(state)
        return False

    def dfs(self, j, a, pre, back, run):
        """Stage j starts at layer a; pre: the first micro-batch's forward way to it, back:
        what follows the last backward of stage j-1 (c + b + T of `step_lower_bound`), run:
        the bound's terms of stages < j."""
        self.nodes += 1
        if self.nodes > self.node_budget:
            return
        line, ends = self.line, self.ends
        S, L, m = line.S, line.L, line.m
        kd = line.kinds[j]
        lim = self.limit()
        if run >= lim:
            return
        cap = (lim - pre - back) / m
        ends[j] = a
        if j == S - 1:
            if kd.time(a, L) <= cap * (1 + 1e-12):
                e = line.estimate(ends)
                if e is not None:
                    self.offer(e[0], tuple(ends))
            return
        hi = min(kd.furthest(a, cap * (1 + 1e-12)), L - (S - 1 - j))
        lo = max(a + 1, self.starts[j + 1])
        cin = line.comm(j - 1, a) if j > 0 else 0.0
        dp1 = line.dp > 1
        lb_next = self.lb_sum[j + 1]
        for b in range(hi, lo - 1, -1):
            r = kd.stage(a, b)
            if r is None:
                continue
            f, bw, _ = r
            c = line.comm(j, b)
            tail = line.tail_of(j, a, b)
            T = tail if tail > back else back
            run2 = max(run, pre + m * (f + bw) + T)
            if j == 0:
                run2 = max(run2, f + (m + 1) * c + bw + T)
            else:
                after = max(back - cin, tail) if dp1 else back - cin
                run2 = max(run2, pre + f + m * (cin + c) + after)
            pre2 = pre + f + c
            back2 = c + bw + T
            if max(run2, pre2 + back2 + lb_next[b]) >= self.limit():
                continue
            if self.memo and self.dominated(j + 1, b, (pre2, back2, run2)):
                continue
            self.dfs(j + 1, b, pre2, back2, run2)
            ends[j] = a


# configurations

def divisors(n: int) -> list[int]:
    """The divisors of n, ascending, from its prime factors: O(sqrt n) trial division at worst
    (a 10^12-chip count: 10^6 steps), not a scan of 1..n."""
    divs = [1]
    for p, k in _prime_factors(n).items():
        divs = [d * p ** e for d in divs for e in range(k + 1)]
    return sorted(divs)


def _prime_factors(n: int) -> dict[int, int]:
    out: dict[int, int] = {}
    p = 2
    while p * p <= n:
        while n % p == 0:
            out[p] = out.get(p, 0) + 1
            n //= p
        p += 1 if p == 2 else 2
    if n > 1:
        out[n] = out.get(n, 0) + 1
    return out


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


def _moe_layers(costs: ModelCosts):
    return [l for l in costs.layers if l.moe is not None]


def _expert_gcd(costs: ModelCosts) -> int:
    """The gcd of the MoE layers' expert counts (0 without MoE layers): an EP degree divides it."""
    g = 0
    for l in _moe_layers(costs):
        g = math.gcd(g, l.moe.num_experts)
    return g


def ep_options(cluster: Cluster, costs: ModelCosts, dp: int, chip: str, tps,
               max_ep: int | None = None, local: bool = True) -> list[int]:
    """EP degrees a stage of `chip` may take: divisors of dp and of every MoE layer's expert
    count (an EP group is `ep` data-parallel replicas of the stage: Plan.stage_ep), at most
    `max_ep`, and with `local` small enough that ep replicas at the type's smallest tp fit one
    node (necessary for node-local groups; the line's hosts decide, `ep_local`)."""
    E = _expert_gcd(costs)
    if not E:
        return [1]
    cpn = max(g.chips_per_node for g in cluster.groups_of(chip))
    return [e for e in divisors(math.gcd(dp, E))
            if (max_ep is None or e <= max_ep) and (not local or e * min(tps) <= cpn)]


_EP_LOCAL: dict = {}


def ep_local(cluster: Cluster, shapes, dp: int, eps) -> bool:
    """Whether every EP group of every stage of the line (shapes: (chip, tp) per stage; eps:
    {chip: ep} or one ep) lies inside one host, on the hosts the build gives the workers
    (`worker_hosts` over `WorkerLayout`: the compiler's placement, not an assumption)."""
    shapes = tuple(shapes)
    per = [eps.get(c, 1) if isinstance(eps, dict) else eps for c, _ in shapes]
    if all(e <= 1 for e in per):
        return True
    key = (id(cluster), shapes, dp, tuple(per))
    hit = _EP_LOCAL.get(key)
    if hit is not None and hit[0] is cluster:      # the same object, not a reused id
        return hit[1]
    if len(_EP_LOCAL) > 65536:
        _EP_LOCAL.clear()
    # necessary: a group's members are a replica's chips of the type apart
    used: dict = {}
    for c, t in shapes:
        used[c] = used.get(c, 0) + t
    ok = all(dp % e == 0 and (e - 1) * used[c] + t <= max(g.chips_per_node for g in cluster.groups_of(c))
             for (c, t), e in zip(shapes, per) if e > 1)
    # sufficient: replica r's chips of a type are the type's chips r*used .. (worker_hosts
    # numbers them from the first of its nodes), so when ep * used divides every chips-per-node
    # of the type, a group's ep replicas fill one aligned block of a node
    aligned = ok and all(dp * used[c] <= cluster.count(c)
                         and all(g.chips_per_node % (e * used[c]) == 0 for g in cluster.groups_of(c))
                         for (c, _), e in zip(shapes, per) if e > 1)
    if ok and not aligned:
        lay = WorkerLayout(dp, tuple(t for _, t in shapes))
        hosts = worker_hosts(lay, [c for c, _ in shapes], cluster)
        ok = all(len({hosts[w] for w in grp}) == 1
                 for j, e in enumerate(per) if e > 1
                 for k in range(lay.tps[j]) for grp in ep_groups(lay, j, e, k))
    _EP_LOCAL[key] = (cluster, ok)
    return ok


def _aligned(cluster: Cluster, chip: str, per_replica: int, opts: list[int]) -> list[int]:
    """The EP degrees whose groups are node-local when a type's `per_replica` chips are all used:
    ep consecutive replicas fill whole chips of a node and never straddle two (ep * per_replica
    divides every node group's chips per node; worker_hosts numbers a type's chips from 0)."""
    return [e for e in opts if e == 1 or _ep_budget(cluster, chip, per_replica, e) == per_replica] or [1]


def _ep_budget(cluster: Cluster, chip: str, per_replica: int, ep: int) -> int:
    """The most of a type's `per_replica` chips one replica can use at EP `ep` with node-local
    groups (0: none). The build's placement is replica-major (`worker_hosts`: replica r takes
    the type's next chips), so the members of a stage's EP group are a replica's used chips of
    the type apart, and ep replicas' chips must share a node: b chips per replica with ep * b
    dividing every chips-per-node of the type (aligned, never straddling two nodes). Using
    fewer chips than the replica's share (the rest idle) is what makes a large EP node-local
    on small nodes: 8-chip nodes at ep 8 take one chip per replica."""
    if ep <= 1:
        return per_replica
    cpns = {g.chips_per_node for g in cluster.groups_of(chip)}
    return max((b for b in range(min(per_replica, min(cpns) // ep), 0, -1)
                if all(n % (ep * b) == 0 for n in cpns)), default=0)


def _a2a_choice(rm: ResourceModel, cluster: Cluster, eps: dict, tps: dict) -> str:
    """flat or HALO, whichever `moe_a2a_pass_time` says is faster summed over the chip types (at
    the geometry of consecutive replicas; on one node both are the flat all-to-all)."""
    moes = _moe_layers(rm.costs)
    if not moes:
        return "flat"
    mi = moes[0].moe
    tot = {"flat": 0.0, "halo": 0.0}
    bpe = dtype_bytes(cluster.dtype)
    for c, e in eps.items():
        if e <= 1:
            continue
        g, t = cluster.group(c), tps[c]
        for algo in tot:
            tot[algo] += moe_a2a_pass_time(rm.costs, mi, g, t, e, algo, default_ep_geometry(g, e, t),
                                           None, bpe)
    return "halo" if tot["halo"] < tot["flat"] else "flat"


def _moe_plan(costs: ModelCosts, eps: dict, a2a: str = "flat") -> MoEPlan | None:
    """The moe section for EP degrees per chip type: its ep is the most common degree (the
    stages of other degrees say their own `ep=`)."""
    if not _moe_layers(costs):
        return None
    vals = list(eps.values()) or [1]
    ep = max(set(vals), key=lambda e: (vals.count(e), e))
    return MoEPlan(ep=ep, a2a=a2a if ep > 1 or any(v > 1 for v in vals) else "flat")


def _eps_key(eps: dict) -> tuple:
    return tuple(sorted(eps.items()))


def _configs(costs: ModelCosts, cluster: Cluster, global_batch: int, micro_batches, schedule: str,
             dp_options=None, max_tp: int | None = None, uniform_only: bool = False):
    """All (dp, micro-batch, tp per type) choices with 1 <= stages <= layers; orders added later."""
    counts = chip_counts(cluster)
    if not counts:
        raise H2Error(f"cluster {cluster.name!r} has no chips")
    L = len(costs.layers)
    g = 0
    for n in counts.values():
        g = math.gcd(g, n)
    chips = sorted(counts)
    out = []
    too_many = 0
    for mb in micro_batches:
        for dp in divisors(g):
            if dp_options and dp not in dp_options:
                continue
            if global_batch % (dp * mb):
                continue
            m = global_batch // (dp * mb)
            if m > MAX_MICROBATCHES:      # the stream (and its simulation) grows with m
                too_many += 1
                continue
            opts = [[t for t in tp_options(cluster, c, counts[c] // dp, costs.n_heads)
                     if max_tp is None or t <= max_tp] for c in chips]
            if uniform_only:
                common = sorted(set.intersection(*map(set, opts))) if opts else []
                products = [(t,) * len(chips) for t in common]
            else:
                products = itertools.product(*opts)
            for tps in products:
                S = sum(counts[c] // (dp * t) for c, t in zip(chips, tps))
                if 1 <= S <= L:
                    out.append((mb, dp, m, tuple(zip(chips, tps))))
    if not out and too_many:
        raise H2Error(f"global batch {global_batch} needs more than {MAX_MICROBATCHES:,} "
                      f"micro-batches per step at every micro-batch size and dp tried "
                      f"({', '.join(map(str, micro_batches))})",
                      hint="lower --global-batch, or raise --micro-batch")
    return out, counts


# ----------------------------------------------------------------------------------------------
# uniform baseline

def _uniform_bounds(costs: ModelCosts, S: int) -> list[int] | None:
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
    cfgs, counts = _configs(costs, cluster, global_batch, micro_batches, schedule, dp_options,
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
        moe = _moe_plan(costs, eps, _a2a_choice(rm, cluster, eps, dict(tps)))
        line = StageLine(rm, cfg, schedule, eps, moe.a2a if moe else "flat", kinds,
                         placed=False, zero=zero)   # ranks uniform plans; the best is simulated
        bounds = _uniform_bounds(costs, line.S)
        if bounds is None:
            continue
        e = line.estimate(bounds)
        if e is None:
            continue
        out.append(Candidate(line.plan(bounds, costs.model, cluster, global_batch, seq_len, moe),
                             e[0], "uniform", cfg, tuple(bounds)))
    out.sort(key=lambda c: c.estimate_s)
    return out


# virtual-stage schedules are searched as their one-chunk counterpart (same memory class), then
# each worker's share of the model is cut into chunks (`virtualize`)
VIRTUAL_BASE = {"interleaved": "1f1b", "izb": "zb1", "zbv": "zb1"}
SCHEDULE_CHOICES = ("1f1b", "zb1", "interleaved", "izb", "zbv")


def virtualize(plan: Plan, costs: ModelCosts, schedule: str, virtual: int = 2) -> Plan:
    """`plan`'s pipeline under a virtual-stage schedule: every worker keeps its chip and its
    share of the model's FLOPs, cut into `virtual` chunks placed as `chunk_stages` says (chunk
    c of worker s is virtual stage c*S + s interleaved, s or 2S-1-s in a V). The chunks are
    contiguous in model order, so the layers each worker holds change; their FLOPs do not, up
    to one layer per chunk boundary. Needs tp = 1, no EP, and `virtual` layers per worker."""
    from h2ir.schedule.streams import chunk_stages
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
    from h2ir.planner.validate import validate_plan
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


# ----------------------------------------------------------------------------------------------
# HeteroAuto

EXHAUSTIVE_LINE_LIMIT = 3_000_000
EXHAUSTIVE_TOTAL_LIMIT = 50_000_000


EXHAUSTIVE_LINE_LIMIT = 3_000_000
EXHAUSTIVE_TOTAL_LIMIT = 50_000_000


def micro_batch_options(global_batch: int, micro_batch: int | None) -> list[int]:
    """The micro-batch sizes to try: the one asked for, else those of MICRO_BATCHES that divide
    the global batch."""
    return [micro_batch] if micro_batch else [b for b in MICRO_BATCHES if global_batch % b == 0]


# ----------------------------------------------------------------------------------------------
# the lines of stages of one configuration

def type_sequences(B: int, tps: list[int], L: int, space: PlanSpace, exact: bool) -> list[tuple]:
    """The tp sequences of one chip type's stages with B chips per replica: one tp for all its
    stages (B // tp of them), or, with `mixed_tp`, h stages at one tp t1 followed by the rest at
    another t2: a higher one first (earlier stages hold more micro-batches in flight) or a
    lower one first (a first stage that holds only the embedding needs no TP; `lower_first`).
    With `idle` and `partial`, a type may also be used in part: fewer stages than its chips
    allow, the rest idle (a slow chip with room for the embedding is worth one stage, not
    one stage per chip, each of which must then hold a layer); without it every chip is used.
    At most L stages (each needs a layer). In `exact` mode every count of stages is offered;
    outside it, h takes a quarter, a half and three quarters of the range, and a uniform
    sequence its full length, 1, 2 and a quarter, a half and three quarters of it."""
    out = []
    for t in tps:
        s = B // t
        if s == 0 or (not space.idle and B % t):
            continue
        if s > L:
            if not space.idle:
                continue
            s = L
        out.append((t,) * s)
        if space.idle and space.partial:     # the type in part: k < s stages, the rest idle
            ks = range(1, s) if exact else {1, 2, s // 4, s // 2, 3 * s // 4}
            out += [(t,) * k for k in sorted(ks) if 1 <= k < s]
    if space.mixed_tp:
        for i, t1 in enumerate(tps):
            others = tps[:i] + (tps[i + 1:] if space.lower_first else []) if exact else \
                tps[max(0, i - 1):i] + (tps[i + 1:i + 2] if space.lower_first else [])
            for t2 in others:
                hmax = (B - t2) // t1
                # at most L stages: h beyond L can never give a line (and B may be 10^9 chips)
                hs = range(1, min(hmax, L) + 1) if exact else \
                    sorted({max(1, hmax * q // 4) for q in (1, 2, 3)})
                for h in hs:
                    if h > hmax or h > L:
                        continue
                    rest = B - h * t1
                    if not space.idle and rest % t2:
                        continue
                    partial = space.idle and space.partial
                    if h + rest // t2 > L and not partial:
                        continue
                    r = min(rest // t2, L - h)
                    # in exact mode with `partial`, every shorter tail too (the rest idle)
                    for k in (range(1, r + 1) if exact and partial else (r,)):
                        if k >= 1:
                            out.append((t1,) * h + (t2,) * k)
    return list(dict.fromkeys(out))


def _sequences_at_most(B: int, tps: list[int], L: int) -> int:
    """An upper bound of len(type_sequences(B, tps, L, space, exact=True)) for any space,
    without building them: k stages of one tp, or h of one and k of another (h + k <= L)."""
    n = sum(min(B // t, L) for t in tps)
    for t1 in tps:
        for t2 in tps:
            if t1 != t2:
                h = min((B - t2) // t1, L) if B >= t1 + t2 else 0
                n += h * min(B // t2, L)
    return n


def _lines_exact(seqs: dict, space: PlanSpace, L: int, limit: int):
    """Every line of the space for one configuration, or None if there are more than `limit`:
    each used type one of its sequences (`type_sequences`; with `idle`, a type may be absent),
    in any order of the types' blocks; with `split_types`, one type's sequence may be cut into
    two blocks anywhere in the order (its first part first)."""
    chips = sorted(seqs)
    choices = [seqs[c] + ([None] if space.idle else []) for c in chips]
    if math.prod(len(c) for c in choices) > 20 * limit:
        return None
    out: dict = {}
    for pick in itertools.product(*choices):
        used = [(c, s) for c, s in zip(chips, pick) if s is not None]
        if not used or sum(len(s) for _, s in used) > L:
            continue
        blocksets = [[(c, s) for c, s in used]]
        if space.split_types:
            for i, (c, s) in enumerate(used):
                for cut in range(1, len(s)):
                    blocksets.append([x for k, x in enumerate(used) if k != i]
                                     + [(c, s[:cut]), (c + "\0", s[cut:])])
        for blocks in blocksets:
            for perm in itertools.permutations(blocks):
                names = [c for c, _ in perm]
                if any(c.endswith("\0") and names.index(c) < names.index(c[:-1]) for c in names):
                    continue
                shapes = tuple((c.rstrip("\0"), t) for c, s in perm for t in s)
                out[shapes] = None
                if len(out) > limit:
                    return None
    return list(out)


class _LocalLines:
    """Lines for a configuration too large to enumerate: coordinate descent over each type's
    stage sequence (one of `type_sequences`, or idle), moves of one block to another place in
    the order, and cutting one type into two blocks (A-B-A); each line scored by the bound of
    its bottleneck-packed split. O(types x sequences + blocks^2) lines per round, not k!."""

    ROUNDS = 3

    def __init__(self, score, seqs: dict, first_order: list, space: PlanSpace, L: int):
        self.score, self.seqs, self.space, self.L = score, seqs, space, L
        self.first_order = first_order
        self.seen: dict = {}
        self.rounds = self.ROUNDS

    def shapes(self, pick: dict, order: list, cut) -> tuple:
        out = []
        for c, part in order:
            s = pick[c]
            if cut is not None and cut[0] == c:
                s = s[:cut[1]] if part == 0 else s[cut[1]:]
            out += [(c, t) for t in s]
        return tuple(out)

    def value(self, pick, order, cut) -> float:
        sh = self.shapes(pick, order, cut)
        if not sh or len(sh) > self.L:
            return math.inf
        if sh not in self.seen:
            self.seen[sh] = self.score(sh)
        return self.seen[sh]

    def start_value(self, start=None) -> float:
        """The score of the line the descent would start from."""
        pick = {c: max(self.seqs[c], key=lambda s: (s[0], -len(s))) for c in self.seqs}
        v = self.value(pick, [(c, 0) for c in self.first_order], None)
        if start is not None and all(c in self.seqs and s in self.seqs[c] for c, s in start[0].items()):
            v = min(v, self.value(*start))
        return v

    def run(self, keep: int = 3, start=None) -> list:
        """The `keep` best lines as (score, shapes); `start` (pick, order, cut) from a related
        configuration (the same dp) seeds the descent, which then needs fewer rounds."""
        pick = {c: max(self.seqs[c], key=lambda s: (s[0], -len(s))) for c in self.seqs}
        order = [(c, 0) for c in self.first_order]
        cut = None
        best = self.value(pick, order, cut)
        if start is not None and all(c in self.seqs and s in self.seqs[c] for c, s in start[0].items()):
            v = self.value(*start)
            if v < best:
                best, (pick, order, cut) = v, start
        for _ in range(self.rounds):
            moves = []
            for c in self.seqs:                            # each type's stage sequence, or idle
                opts = list(self.seqs[c]) + ([None] if self.space.idle else [])
                for s in opts:
                    if s == pick.get(c):
                        continue
                    p2 = dict(pick)
                    o2 = list(order)
                    c2 = cut
                    if s is None:
                        p2.pop(c, None)
                        o2 = [b for b in o2 if b[0] != c]
                        c2 = None if cut and cut[0] == c else cut
                    else:
                        p2[c] = s
                        if c not in pick:
                            o2 = o2 + [(c, 0)]
                        if cut and cut[0] == c:
                            c2 = (c, min(cut[1], len(s) - 1)) if len(s) > 1 else None
                            if c2 is None:
                                o2 = [b for b in o2 if b != (c, 1)]
                    moves.append((p2, o2, c2))
            for i, blk in enumerate(order):                # one block elsewhere in the order
                rest = order[:i] + order[i + 1:]
                for k in range(len(rest) + 1):
                    o2 = rest[:k] + [blk] + rest[k:]
                    if o2 != order and _cut_order_ok(o2):
                        moves.append((pick, o2, cut))
            if self.space.split_types and cut is None:    # A-B-A: cut one type in two
                for c in pick:
                    s = pick[c]
                    if len(s) < 2:
                        continue
                    for at in sorted({1, len(s) // 2}):
                        for k in range(len(order) + 1):
                            o2 = order[:k] + [(c, 1)] + order[k:]
                            if _cut_order_ok(o2):
                                moves.append((pick, o2, (c, at)))
            scored = [(self.value(p, o, c), i) for i, (p, o, c) in enumerate(moves)]
            if not scored:
                break
            v, i = min(scored)
            if v >= best:
                break
            best = v
            pick, order, cut = moves[i]
        self.state = (pick, order, cut)
        ranked = sorted((v, sh) for sh, v in self.seen.items() if v < math.inf)
        return ranked[:keep]


def _cut_order_ok(order: list) -> bool:
    pos = {b: i for i, b in enumerate(order)}
    return all(pos[(c, 0)] < i for (c, part), i in pos.items() if part == 1 and (c, 0) in pos)


def _config_bound(rm: ResourceModel, cluster: Cluster, budgets: dict, tps: dict, m: int,
                  schedule: str, ep, a2a: str, inflight: int | None = None, dp: int = 1) -> float:
    """A lower bound of every line of a configuration: some stage runs at least T per
    micro-batch, m times, where T is the smallest bottleneck at which the types' chips could
    hold every transformer block (a stage of (chip, tp) holds at most the blocks that fit
    under T by time and by memory at its least in-flight count: GPipe m, 1F1B 1), with each
    type's chips at the tp that holds the most blocks per chip; and one micro-batch crosses
    every layer on its fastest (chip, tp). A stage that may take ZeRO-1 (dp > 1, ep 1) is
    bounded with its optimizer state sharded."""
    la = rm.la
    block = la.is_block if la.is_block.any() else np.ones(la.L, bool)
    N = int(block.sum())
    infl = inflight or (m if schedule == "gpipe" else 1)
    kinds, pass_t = [], np.full(la.L, np.inf)
    for c, B in budgets.items():
        cap_mem = device_capacity(cluster.chip(c))
        e = ep.get(c, 1) if isinstance(ep, dict) else ep
        for t in tps[c]:
            lt = rm.layer_times(c, t, e, a2a)
            tau = np.add(lt.fwd_layer, lt.bwd_layer)
            pass_t = np.minimum(pass_t, tau)
            dev = la.device(t, e)
            tb = float(tau[block].min())
            rb = float((tau + np.array(lt.fwd_layer))[block].min())
            # (a stage whose forwards all run first, or that runs one micro-batch, has no
            # gradient sums at its peak)
            st, p = la.state, dev.params[block]
            opt = p * st.optimizer
            opt = zero_optimizer_bytes(opt, dp) if dp > 1 and e == 1 else opt
            grads = 0 if first_backward_late(infl, m) or m == 1 else st.grads
            state = float((p * (st.weights + grads) + opt).min())
            act = float(dev.act[block].min())
            out = float(dev.out[block].min())
            # (optimistic, as a bound must be: receive buffers, the loss and the backward's
            # working set beyond one layer's re-made activations are left out)
            M = max(0, math.floor(cap_mem / (state + infl * act)))
            R = max(0, math.floor((cap_mem - act) / (state + infl * out)))
            # selective recomputation: less kept (`act_sel`), the backward re-making what it
            # dropped (`bwd_sel`); where it keeps no less than none, none's term dominates it
            Ms, sb = 0, tb
            act_sel = float(dev.act_sel[block].min())
            if act_sel < act:
                Ms = max(0, math.floor(cap_mem / (state + infl * act_sel)))
                sb = float((tau + np.diff(lt.bwd_sel) - lt.bwd_layer)[block].min())
            kinds.append((c, B / t, tb, sb, rb, min(M, N), min(Ms, N), min(R, N)))
    if not kinds:
        return math.inf

    def blocks(T):
        per = {}
        for c, n, tb, sb, rb, M, Ms, R in kinds:
            held = n * max(min(int(T / tb * (1 + 1e-12)), M), min(int(T / sb * (1 + 1e-12)), Ms),
                           min(int(T / rb * (1 + 1e-12)), R))
            per[c] = max(per.get(c, 0.0), held)
        return sum(per.values())

    cands = np.unique(np.concatenate([np.arange(1, N + 1) * x for _, _, tb, sb, rb, *_ in kinds
                                      for x in {tb, sb, rb}]))
    if blocks(cands[-1]) < N:
        return math.inf
    lo, hi = 0, len(cands) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if blocks(cands[mid]) >= N:
            hi = mid
        else:
            lo = mid + 1
    return max(m * float(cands[lo]), float(pass_t.sum())) * (1 - 1e-9)


# ----------------------------------------------------------------------------------------------
# HeteroAuto

def fits_memory(costs: ModelCosts, plan: Plan, cluster: Cluster) -> bool:
    """Every stage within its devices' capacity by `stage_memory`, the validator's check (the
    search's vectorised feasibility leaves out tied-parameter copies)."""
    return all(m.total <= m.capacity for m in
               (stage_memory(costs, plan, cluster, j) for j in range(plan.num_stages)))


class _Search:
    """Best-first over lower bounds. Heap entries (bound, seq, kind, item):

      config  (micro-batch, dp, schedule) under `_config_bound` -> its lines
      line    a StageLine under its own bound (`StageLine.bound`) -> its best splits (DFS), the
              line re-queued under the bound of its last split for more
      cand    a complete plan under its lower bound -> simulated

    It stops when the bound at the top is no better than the best simulated step (`exact`), or
    when the simulation budget or the time limit runs out."""

    def __init__(self, costs, cluster, global_batch, seq_len, space, schedules, exhaustive,
                 calibration, node_budget, max_tp, max_ep, dp_options, mbs, max_sims, deadline):
        self.costs, self.cluster, self.gb, self.seq_len = costs, cluster, global_batch, seq_len
        self.space, self.schedules, self.exhaustive = space, schedules, exhaustive
        self.calibration, self.node_budget = calibration, node_budget
        self.max_tp, self.max_ep, self.dp_options, self.mbs = max_tp, max_ep, dp_options, mbs
        self.max_sims, self.deadline = max_sims, deadline
        self.counts = chip_counts(cluster)
        if not self.counts:
            raise H2Error(f"cluster {cluster.name!r} has no chips")
        self.counts_t = tuple(sorted(self.counts.items()))
        self.rms: dict = {}
        self.reach: dict = {}               # (micro-batch, chip) -> `tp_reach`
        self.kinds: dict = {}
        self.heap: list = []
        self.seq = itertools.count()
        self.sims: list[Candidate] = []
        self.best_sim = math.inf
        self.nodes = self.lines = self.configs = self.configs_total = 0
        self.timed_out = False
        # the least lower bound of what was left without simulation (`left`)
        self.unproved = math.inf
        self.lines_by = "enumeration"
        self.stopped_by = "bound"
        self.emitted: set = set()
        self.exact_left = EXACT_WORK if exhaustive else EXACT_TOTAL   # lines left to enumerate
        self.best_line = math.inf           # best split bound of the lines found by local search
        self.warm: dict = {}                # (schedule, dp) -> the local search's last state
        self.sim_work = 0

    def rm(self, mb):
        if mb not in self.rms:
            self.rms[mb] = ResourceModel(self.costs, self.cluster, mb, self.seq_len, self.calibration)
        return self.rms[mb]

    def push(self, lb, kind, item):
        heapq.heappush(self.heap, (lb, next(self.seq), kind, item))

    # -- configurations
    def configurations(self):
        L = len(self.costs.layers)
        too_many = 0
        mx_ = max(self.counts.values())
        g = 0
        for n in self.counts.values():
            g = math.gcd(g, n)
        for sched in self.schedules:
            for mb in self.mbs:
                if self.gb % mb:
                    continue
                for dp in divisors(self.gb // mb):
                    if self.dp_options and dp not in self.dp_options:
                        continue
                    if dp > (mx_ if self.space.idle else g):
                        continue
                    if dp > MAX_WORKERS:          # a build holds at most MAX_WORKERS workers
                        continue
                    m = self.gb // (dp * mb)
                    if m > MAX_MICROBATCHES:
                        too_many += 1
                        continue
                    self.configs_total += 1
                    self._queue_config(sched, mb, dp, m, L)
        if not self.heap and too_many:
            raise H2Error(f"global batch {self.gb} needs more than {MAX_MICROBATCHES:,} "
                          f"micro-batches per step at every micro-batch size and dp tried "
                          f"({', '.join(map(str, self.mbs))})",
                          hint="lower --global-batch, or raise --micro-batch")

    def _queue_config(self, sched, mb, dp, m, L):
        rm = self.rm(mb)
        budgets, tps = {}, {}
        for c, n in self.counts.items():
            if not self.space.idle and n % dp:
                return
            B = n // dp
            # every TP degree of the space, across nodes too; coordinate descent (large
            # spaces) offers those past a node only up to `tp_reach`
            opts = [t for t in tp_options(self.cluster, c, B, self.costs.n_heads,
                                          divide=not self.space.idle, reach=self.costs.n_heads)
                    if self.max_tp is None or t <= self.max_tp]
            if B and opts:
                budgets[c], tps[c] = B, opts
            elif not self.space.idle:
                return
        if not budgets:
            return
        loc = self.space.ep_local
        opts = {c: ep_options(self.cluster, self.costs, dp, c, tps[c], self.max_ep, loc)
                for c in budgets}
        full = opts
        if loc:
            # degrees whose groups are node-local with all of the replica's chips of the type
            full = {c: _aligned(self.cluster, c, B, opts[c]) for c, B in budgets.items()}
        if loc and self.space.idle:
            # and those where only some of them can be (`_ep_budget`): the configuration then
            # uses only those chips of the type, the rest idle
            opts = {c: [e for e in opts[c] if any(t <= _ep_budget(self.cluster, c, B, e) for t in tps[c])]
                    or [1] for c, B in budgets.items()}
        else:
            opts = full
        la = rm.la
        for eps in self._ep_assignments(rm, budgets, tps, dp, m, sched, opts, full):
            bud, tpe = self._ep_budgets(budgets, tps, eps)
            # model states a replica must hold: experts divide by EP (at most the largest
            # degree), the optimizer's by dp where a stage may take ZeRO-1 (an ep 1 type), no
            # gradient sums with one micro-batch (`stage_memory`)
            st = la.state
            p = float(la.dense_params.sum()) + \
                float(la.expert_params.sum()) / max(list(eps.values()) or [1])
            zero = self.space.zero and dp > 1 and (not eps or min(eps.values()) == 1)
            need = p * (st.weights + (st.grads if m > 1 else 0)) + (
                zero_optimizer_bytes(p * st.optimizer, dp) if zero else p * st.optimizer)
            if sum(device_capacity(self.cluster.chip(c)) * B for c, B in bud.items()) < need:
                continue
            moe = _moe_plan(self.costs, eps, _a2a_choice(rm, self.cluster, eps,
                                                         {c: t[0] for c, t in tpe.items()}))
            a2a = moe.a2a if moe else "flat"
            lb = _config_bound(rm, self.cluster, bud, tpe, m, sched, eps, a2a,
                               dp=dp if self.space.zero else 1)
            if lb < math.inf:
                self.push(lb, "config", (sched, mb, dp, m, bud, tpe, moe, eps))

    def _ep_budgets(self, budgets: dict, tps: dict, eps: dict) -> tuple[dict, dict]:
        """Each type's chips per replica and tp options under EP degrees `eps`: with node-local
        groups, only the chips `_ep_budget` allows (the rest idle), and tp at most those."""
        if not (self.space.ep_local and self.space.idle) or not eps:
            return budgets, tps
        bud, tpe = {}, {}
        for c, B in budgets.items():
            b = _ep_budget(self.cluster, c, B, eps.get(c, 1))
            ts = [t for t in tps[c] if t <= b]
            if ts:
                bud[c], tpe[c] = b, ts
        return bud, tpe

    def _ep_assignments(self, rm, budgets, tps, dp, m, sched, opts, full) -> list[dict]:
        """EP degrees per chip type to search, each its own configuration (a lower bound each):
        every degree common to all types (homogeneous EP), each type's largest (of `opts`, and
        of `full`: those that keep all of the type's chips), and with `mixed_ep` the assignment
        a coordinate descent picks on the configuration bound taken at a typical 1F1B in-flight
        count (half the stages), where memory speaks as well as the all-to-all: a type with
        room for its experts keeps a small EP, a tight one a large."""
        if not _moe_layers(self.costs):
            return [{}]
        out = [{c: e for c in budgets} for e in sorted(set.intersection(*map(set, opts.values())))]
        if self.space.mixed_ep and len(budgets) > 1:
            out.append({c: max(o) for c, o in full.items()})
            out.append({c: max(o) for c, o in opts.items()})
            S = sum(B // min(tps[c]) for c, B in budgets.items())
            infl = m if sched == "gpipe" else max(1, min(m, S // 2))
            memo: dict = {}

            def score(eps):
                k = _eps_key(eps)
                if k not in memo:
                    memo[k] = _config_bound(rm, self.cluster, *self._ep_budgets(budgets, tps, eps),
                                            m, sched, eps, "flat", infl,
                                            dp if self.space.zero else 1)
                return memo[k]
            cur = {c: max(o) for c, o in opts.items()}
            for _ in range(2):
                for c in sorted(opts):
                    cur[c] = min(opts[c], key=lambda e: (score({**cur, c: e}), -e))
            out.append(dict(cur))
            if math.prod(len(o) for o in opts.values()) > len({_eps_key(e) for e in out}):
                # EP assignments per type are sampled, not enumerated: the others have no bound
                self.left(0.0)
        seen, uniq = set(), []
        for eps in out:
            if _eps_key(eps) not in seen:
                seen.add(_eps_key(eps))
                uniq.append(eps)
        return uniq

    def _line(self, sched, mb, dp, m, shapes, moe, eps, placed=True):
        a2a = moe.a2a if moe else "flat"
        cfg = _config_of(dp, mb, m, shapes, self.counts_t, sched)
        return StageLine(self.rm(mb), cfg, sched, eps or 1, a2a, self.kinds, placed,
                         self.space.zero)

    def _near(self, chip: str, mb: int, tps: list) -> list:
        """`tps` less the TP degrees past a node beyond `tp_reach` (for coordinate descent:
        a TP group across nodes pays the NIC on every all-reduce, so past the degree at which
        every layer fits it is rarely worth a place among the few lines descent keeps)."""
        if (mb, chip) not in self.reach:
            self.reach[(mb, chip)] = tp_reach(self.rm(mb), self.cluster, chip, self.costs.n_heads)
        return [t for t in tps if t <= self._cpn(chip) or t <= self.reach[(mb, chip)]]

    def _cpn(self, chip: str) -> int:
        return max(g.chips_per_node for g in self.cluster.groups_of(chip))

    def left(self, lb: float):
        """Part of the space, all of it no faster than `lb`, is left without simulation."""
        self.unproved = min(self.unproved, lb)

    def expand_config(self, lb, sched, mb, dp, m, budgets, tps, moe, eps):
        self.configs += 1
        L = len(self.costs.layers)
        limit = max(1, min(EXACT_WORK // L, self.exact_left))
        if not self.exhaustive and \
                math.prod(_sequences_at_most(B, tps[c], L) + 1 for c, B in budgets.items()) > 20 * limit:
            lines = None                     # too many to enumerate: not even their sequences
        else:
            exact_seqs = {c: type_sequences(B, tps[c], L, self.space, True) for c, B in budgets.items()}
            exact_seqs = {c: s for c, s in exact_seqs.items() if s}
            lines = _lines_exact(exact_seqs, self.space, L, limit) if exact_seqs else []
        if lines is None:
            if self.exhaustive:
                raise H2Error(f"exhaustive search: dp={dp} micro-batch={mb} has more than "
                              f"{limit:,} lines of stages", hint="use --search heuristic")
            # every line of the narrower space (each type's chips all used, its higher tp
            # first) when that one is small enough, besides what the descent finds
            # (TP across nodes up to `tp_reach`, as the descent)
            narrow = dataclasses.replace(self.space, partial=False, lower_first=False)
            nseqs = {c: type_sequences(B, self._near(c, mb, tps[c]), L, narrow, True)
                     for c, B in budgets.items()}
            nlines = _lines_exact({c: q for c, q in nseqs.items() if q}, narrow, L, limit) or []
            self.exact_left -= len(nlines)
            seqs = {c: type_sequences(B, self._near(c, mb, tps[c]), L, self.space, False)
                    for c, B in budgets.items()}
            seqs = {c: s for c, s in seqs.items() if s}
            order = list(memory_order(self.cluster, list(seqs)))

            def score(shapes):
                if self.space.ep_local and not ep_local(self.cluster, shapes, dp, eps):
                    return math.inf
                line = self._line(sched, mb, dp, m, shapes, moe, eps, placed=False)
                r = line.min_bottleneck()
                if r is None:
                    return math.inf
                e = line.estimate(r[1])
                return e[0] if e else math.inf

            # coordinate descent generates a few of this configuration's lines: the others
            # are bounded only by the configuration's bound
            self.left(lb)
            self.lines_by = "coordinate-descent"
            found = []
            # no descent where a line already found is at least as good as the bound
            if lb < self.best_line:
                ll = _LocalLines(score, seqs, order, self.space, L)
                start = self.warm.get((sched, dp, _eps_key(eps)))
                far = False
                if start is not None:
                    # the same dp at another micro-batch: start from its best line, one
                    # round, unless that is far behind the best line found
                    far = ll.start_value(start) > self.best_line * (1 + PROBE_SLACK)
                    ll.rounds = 1
                else:
                    # first down the narrower space (every chip of a type used, its higher tp
                    # first: fewer, larger moves), then on in the whole one from where that
                    # ended: partial-use moves from the start lead elsewhere, often worse
                    nar = {c: type_sequences(B, self._near(c, mb, tps[c]), L, narrow, False)
                           for c, B in budgets.items()}
                    ln = _LocalLines(score, {c: q for c, q in nar.items() if q}, order, narrow, L)
                    ln.seen = ll.seen
                    ln.run()
                    start, ll.rounds = ln.state, 2
                if not far:
                    found = ll.run(start=start)
                    self.warm[(sched, dp, _eps_key(eps))] = ll.state
                    if found:
                        self.best_line = min(self.best_line, found[0][0])
            lines = list(dict.fromkeys(nlines + [sh for _, sh in found]))
        elif not self.exhaustive:
            self.exact_left -= len(lines)
        else:
            total = sum(math.comb(L - 1, len(sh) - 1) for sh in lines if len(sh) <= L)
            worst = max((math.comb(L - 1, len(sh) - 1) for sh in lines if len(sh) <= L), default=0)
            if worst > EXHAUSTIVE_LINE_LIMIT or total > EXHAUSTIVE_TOTAL_LIMIT:
                raise H2Error(f"exhaustive search would enumerate {total:,} layer splits (up to "
                              f"{worst:,} in one line, dp={dp} micro-batch={mb}); the limit is "
                              f"{EXHAUSTIVE_LINE_LIMIT:,} per line and {EXHAUSTIVE_TOTAL_LIMIT:,} "
                              f"in all", hint="use --search heuristic")
        for shapes in lines:
            if len(shapes) > L or (self.space.ep_local and not ep_local(self.cluster, shapes, dp, eps)):
                continue
            line = self._line(sched, mb, dp, m, shapes, moe, eps)
            self.lines += 1
            if self.exhaustive:
                self.push(lb, "line", (line, moe, 0))
                continue
            r = line.bound()
            if r is not None and r[0] < self.best_sim:
                self.push(max(lb, r[0]), "line", (line, moe, 0))

    def expand_line(self, lb, line, moe, done, budget=None):
        k = done + (4 if line.S * line.L <= 256 else 1)
        budget = budget or self.node_budget
        regrown = False
        if self.exhaustive:
            res = line.all_splits(k)
        else:
            res, n = line.best_split(self.best_sim, budget, k=k)
            self.nodes += n
            if n > budget:
                # the DFS ran out of nodes, so better splits may be missing: the line again,
                # at the same bound, with a larger budget while the search can still prove
                # its choice (nothing left unproved yet); past the largest, or once something
                # is, left unproved (its splits found so far still go on)
                regrown = budget < NODE_BUDGET_GROWTH * self.node_budget and \
                    self.unproved == math.inf
                if regrown:
                    self.push(lb, "line", (line, moe, done, 4 * budget))
                else:
                    self.left(lb)
        new = 0
        for est, ends in res:
            key = (id(line), ends)
            if key in self.emitted:
                continue
            self.emitted.add(key)
            new += 1
            plan = line.plan(ends, self.costs.model, self.cluster, self.gb, self.seq_len, moe)
            kind = "exhaustive" if self.exhaustive else "auto"
            self.push(est, "cand", Candidate(plan, est, kind, line.config, ends))
        if len(res) >= k and res and not regrown:
            self.push(max(lb, res[-1][0]), "line", (line, moe, k))

    def simulate(self, cand: Candidate):
        cand.sim = simulate(self.costs, cand.plan, self.cluster, self.calibration,
                            resource=self.rm(cand.plan.micro_batch), one_rank=True)
        # the simulation's work in (simulated worker x micro-batch) units: the budget below is
        # counted in them, not in seconds, so a plan does not depend on the machine's load
        cand.sim_work = len(cand.sim.busy_s) * max(1, cand.plan.num_microbatches)
        self.sim_work += cand.sim_work
        self.sims.append(cand)
        self.best_sim = min(self.best_sim, cand.sim.step_time_s)

    def sim_budget(self) -> float:
        """Simulation work the final ranking may spend: SIM_WORK_MIN units (about half a second
        here: a unit simulates in 30-50 us), or three times the first simulation's when that is
        more (large plans). Deterministic: the same inputs give the same plan on any machine."""
        first = self.sims[0].sim_work if self.sims else 0
        return max(SIM_WORK_MIN, 3 * first)

    def lower_bound(self) -> float:
        """A lower bound of every plan of the space not simulated: what was left along the way
        and the heap's least bound (it is a min-heap)."""
        return float(min(self.unproved, self.heap[0][0] if self.heap else math.inf))

    def run(self):
        steps = {"config": self.expand_config, "line": self.expand_line}
        while self.heap:
            if self.deadline is not None and time.perf_counter() > self.deadline:
                self.timed_out, self.stopped_by = True, "time limit"
                break
            lb, _, kind, item = self.heap[0]
            if lb >= self.best_sim * (1 - 1e-9):
                break                       # nothing left can beat the best simulated step
            heapq.heappop(self.heap)
            if kind == "cand":
                if not fits_memory(self.costs, item.plan, self.cluster):
                    # the validator's memory check, when it comes up (the split search leaves
                    # out tied copies: it might fit with recomputation)
                    self.left(lb)
                    continue
                if self.sims and (len(self.sims) >= self.max_sims or self.sim_work > self.sim_budget()):
                    self.stopped_by = "simulation budget"
                    break
                self.simulate(item)
            else:
                steps[kind](lb, *item)
        if not self.sims:                   # out of time before any simulation: the best bound
            cands = sorted((e for e in self.heap if e[2] == "cand"), key=lambda e: e[0])
            first = next((e for e in cands if fits_memory(self.costs, e[3].plan, self.cluster)), None)
            if first is not None:
                self.simulate(first[3])


def search(costs: ModelCosts, cluster: Cluster, global_batch: int, *, seq_len: int | None = None,
           micro_batch: int | None = None, schedule: str = "1f1b", method: str = "heuristic",
           calibration=None, top_k: int = 5, dp_options=None, node_budget: int = 2_000,
           max_tp: int | None = None, max_ep: int | None = None, space: PlanSpace | None = None,
           time_limit: float | None = None, max_sims: int = 400) -> SearchResult:
    """HeteroAuto: the plan with the lowest simulated step time (`_Search`).

    `schedule` may be 'auto' (1f1b and gpipe); `space` switches the plan space's dimensions;
    `time_limit` (seconds) returns the best plan found so far when it runs out
    (`SearchResult.timed_out`); `max_sims` caps the simulations of the final ranking. The best
    uniform plan is simulated too and competes, so the choice is never predicted slower."""
    if method not in ("heuristic", "exhaustive"):
        raise H2Error(f"unknown search method {method!r} (expected heuristic or exhaustive)")
    if global_batch < 1:
        raise H2Error(f"global batch must be positive, got {global_batch}")
    t0 = time.perf_counter()
    space = space or PlanSpace()
    schedules = tuple(space.schedules or (("1f1b", "gpipe") if schedule == "auto" else (schedule,)))
    seq_len = seq_len or costs.seq_len
    mbs = micro_batch_options(global_batch, micro_batch)
    deadline = t0 + time_limit if time_limit else None
    s = _Search(costs, cluster, global_batch, seq_len, space, schedules, method == "exhaustive",
                calibration, node_budget, max_tp, max_ep, dp_options, mbs, max_sims, deadline)
    s.configurations()
    s.run()
    uniforms = []
    for sched in schedules:
        uniforms += uniform_candidates(costs, cluster, global_batch, seq_len, mbs, sched,
                                       calibration, s.rms, dp_options, s.kinds, max_tp, max_ep,
                                       space.zero)
    uniforms.sort(key=lambda c: c.estimate_s)
    if not s.sims and not uniforms:
        raise H2Error(f"no plan of {costs.model} fits in {cluster.name}'s memory "
                      f"(global batch {global_batch}, micro-batches {mbs})",
                      hint="add chips, lower the micro-batch or sequence length")
    uniform = uniforms[0] if uniforms else None
    if uniform is not None:
        uniform.sim = simulate(costs, uniform.plan, cluster, calibration,
                               resource=s.rm(uniform.plan.micro_batch), one_rank=True)
    pool = sorted(s.sims + ([uniform] if uniform else []), key=lambda c: c.step_time_s)
    best = pool[0]
    return SearchResult(best=best, runner_ups=pool[1:top_k + 1], uniform=uniform,
                        search_time_s=time.perf_counter() - t0, method=method,
                        configs_total=s.configs_total, configs_searched=s.configs,
                        dfs_nodes=s.nodes, simulations=len(s.sims), timed_out=s.timed_out,
                        lines=s.lines, unexplored_bound_s=s.lower_bound(), lines_by=s.lines_by,
                        stopped_by=s.stopped_by)


# ----------------------------------------------------------------------------------------------
# HeteroSpeedupRatio

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
