"""HeteroAuto: search a heterogeneous pipeline plan (H2, arXiv 2505.17548, HeteroPP/HeteroAuto).

Search space, outermost first:
  micro-batch size   -> m = global_batch / (dp * micro_batch) micro-batches per replica
  dp                 one data-parallel degree for the whole pipeline; it divides every chip
                     type's count, so every replica has the same chips
  tp per chip type   a divisor of the head count, at most chips-per-node (TP never leaves a node)
  sub-groups         a chip type's n/dp chips per replica become n/(dp*tp) stages: a large
                     homogeneous group is split into several stages
  stage order        permutations of the chip types. H2 puts larger-memory chips first (they hold
                     the most in-flight micro-batches under 1F1B); we try every order instead of
                     assuming it, the memory-descending one first so it seeds the bound
  layer split        contiguous layer ranges per stage: branch-and-bound DFS over the stages
                     (bound: the best step time found so far; memory feasibility prunes ranges),
                     with O(1) range costs from prefix sums (h2ir/planner/resource.py)

The inner DFS ranks partitions with a closed-form 1F1B estimate (`estimate`); the final ranking
simulates the best candidates' instruction streams (h2ir/planner/simulate.py). The uniform plan (even
layer split, Megatron-style one TP degree) is the baseline and always takes part in the final
ranking, so the chosen plan is never predicted slower than it.

`method="exhaustive"` enumerates every contiguous split of every configuration (vectorised) for
small instances; the tests compare the two.
"""
from __future__ import annotations

import bisect
import heapq
import itertools
import math
import time
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from h2ir.clusters.cluster import Cluster
from h2ir.costs import ModelCosts
from h2ir.errors import MAX_MICROBATCHES, H2Error
from h2ir.plans.plan import MoEPlan, Plan, StagePlan
from h2ir.planner.resource import (ResourceModel, all_to_all_flat_time, all_to_all_halo_time, dtype_bytes,
                       inflight_microbatches, nic_share, p2p_link, replica_geometry)
from h2ir.planner.simulate import SimResult, simulate

BLOCK_KINDS = ("transformer_block", "moe_block")
MICRO_BATCHES = (1, 2, 4, 8)
# safety margin on memory capacity: the search's float sums vs the validator's integer items
_CAP_MARGIN = 1.0 - 1e-9
# the DFS does not chase improvements smaller than this fraction of the estimate
REL_TOL = 1e-4


@dataclass(frozen=True)
class Config:
    """Everything about a plan except the layer split."""
    dp: int
    micro_batch: int
    m: int
    tp: tuple              # ((chip, tp), ...) in chip-name order
    order: tuple           # chip types in stage order
    counts: tuple          # ((chip, chips), ...)

    def shapes(self) -> list[tuple[str, int]]:
        tp, n = dict(self.tp), dict(self.counts)
        out = []
        for c in self.order:
            out += [(c, tp[c])] * (n[c] // (self.dp * tp[c]))
        return out

    def describe(self) -> str:
        tp = dict(self.tp)
        parts = [f"{c}(tp{tp[c]})x{dict(self.counts)[c] // (self.dp * tp[c])}" for c in self.order]
        return f"dp={self.dp} mb={self.micro_batch} m={self.m} " + " > ".join(parts)


@dataclass
class Candidate:
    plan: Plan
    estimate_s: float
    kind: str                      # 'auto' | 'uniform' | 'exhaustive'
    config: Config | None = None
    bounds: tuple = ()
    sim: SimResult | None = None

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

    @property
    def plan(self) -> Plan:
        return self.best.plan

    @property
    def sim(self) -> SimResult:
        return self.best.sim


# ----------------------------------------------------------------------------------------------
# one stage kind: O(1) range costs

class StageKind:
    """Costing of one stage for a (chip, tp, ep, a2a, in-flight micro-batches) combination:
    prefix sums for time, and for every start layer a the furthest end b up to which the stage
    still fits in memory without recomputation (`fit_none`) and with it if needed (`fit_any`).
    Memory numbers are h2ir/planner/resource.py's (`memory_items`), evaluated for all (a, b) at once."""

    def __init__(self, rm: ResourceModel, chip: str, tp: int, ep: int, a2a: str, inflight: int):
        lt = rm.layer_times(chip, tp, ep, a2a)
        self.chip, self.tp = chip, tp
        self.F, self.B, self.Brc = lt.fwd, lt.bwd, lt.bwd_rc
        self.FB = [f + b for f, b in zip(lt.fwd, lt.bwd)]
        self.FBrc = [f + b for f, b in zip(lt.fwd, lt.bwd_rc)]
        self.tau = np.add(lt.fwd_layer, lt.bwd_layer)
        dev = rm.la.device(tp, ep)
        self.Pp = dev.P_params
        self.out = dev.out.tolist()
        L = rm.L
        Pp, Pact, Pout = np.array(dev.P_params), np.array(dev.P_act), np.array(dev.P_out)
        a = np.arange(L)[:, None]
        b = np.arange(1, L + 1)[None, :]
        out = dev.out
        base = (Pp[b] - Pp[a]) * rm.la.state.total + np.where(a > 0, out[np.maximum(a - 1, 0)], 0.0) + out[b - 1]
        cap = rm.cluster.chip(chip).mem_bytes * _CAP_MARGIN
        none = base + inflight * (Pact[b] - Pact[a]) <= cap
        rc = base + inflight * (Pout[b] - Pout[a]) + dev.act_range_max[a, b - 1] <= cap
        before = b <= a
        self.fit_none = np.logical_and.accumulate(none | before, axis=1).sum(axis=1).tolist()
        self.fit_any = np.logical_and.accumulate(none | rc | before, axis=1).sum(axis=1).tolist()
        self.fit_any = [max(x, y) for x, y in zip(self.fit_any, self.fit_none)]

    def stage(self, a: int, b: int):
        """(fwd, bwd, recompute) for layers [a, b), or None if they do not fit."""
        if b <= self.fit_none[a]:
            return self.F[b] - self.F[a], self.B[b] - self.B[a], "none"
        if b <= self.fit_any[a]:
            return self.F[b] - self.F[a], self.Brc[b] - self.Brc[a], "full"
        return None

    def time(self, a: int, b: int) -> float:
        if b <= self.fit_none[a]:
            return self.FB[b] - self.FB[a]
        if b <= self.fit_any[a]:
            return self.FBrc[b] - self.FBrc[a]
        return math.inf

    def furthest(self, a: int, T: float) -> int:
        """Largest b with time(a, b) <= T and memory fitting (a if none): feasibility is
        downward closed in b (fewer layers: less time, less memory), so it is one bisection."""
        b = min(self.fit_none[a], bisect.bisect_right(self.FB, self.FB[a] + T) - 1)
        if self.fit_any[a] > self.fit_none[a]:
            b2 = min(self.fit_any[a], bisect.bisect_right(self.FBrc, self.FBrc[a] + T) - 1)
            if b2 > self.fit_none[a]:
                return b2
        return max(b, a)


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

class StageLine:
    """The ordered stages of one configuration, with everything needed to cost a layer split."""

    def __init__(self, rm: ResourceModel, config: Config, schedule: str, ep: int, a2a: str,
                 kinds: dict | None = None):
        self.rm, self.config, self.schedule = rm, config, schedule
        self.ep, self.a2a = ep, a2a
        self.shapes = config.shapes()
        S, L = len(self.shapes), rm.L
        self.S, self.L, self.m, self.dp = S, L, config.m, config.dp
        kinds = kinds if kinds is not None else {}
        self.kinds = []
        for j, (chip, tp) in enumerate(self.shapes):
            infl = inflight_microbatches(schedule, j, S, self.m)
            key = (id(rm), chip, tp, ep, a2a, infl)
            if key not in kinds:
                kinds[key] = StageKind(rm, chip, tp, ep, a2a, infl)
            self.kinds.append(kinds[key])
        self.optc = [rm.opt_step_coef(chip) for chip, _ in self.shapes]
        self.grad_bytes = rm.la.grad_bytes
        # p2p path of each boundary j -> j+1: latency and bandwidth (Hockney)
        self.link = [p2p_link(rm.cluster, *self.shapes[j], *self.shapes[j + 1], self.dp)
                     for j in range(S - 1)]
        self._lb = None
        self._tail_cache: dict = {}

    def stage(self, j: int, a: int, b: int):
        return self.kinds[j].stage(a, b)

    def comm(self, j: int, b: int) -> float:
        """p2p time of one micro-batch's boundary tensor from stage j (ending before b) to j+1."""
        lat, bw = self.link[j]
        return lat + self.kinds[j].out[b - 1] / bw

    def tail(self, bounds, bwds, comms) -> float:
        """Time after stage 0's last backward: stage j's last backward ends sum_{k<j}(b_k + c_k)
        earlier, then it sends its last gradient, all-reduces and steps the optimizer."""
        worst, slack = 0.0, 0.0
        for j in range(self.S):
            a, b = bounds[j], bounds[j + 1]
            chip, tp = self.shapes[j]
            key = (j, a, b)
            t = self._tail_cache.get(key)
            if t is None:
                p = self.kinds[j].Pp[b] - self.kinds[j].Pp[a]
                t = self.rm.grad_allreduce_time(chip, tp, self.dp, p * self.grad_bytes) + p * self.optc[j]
                self._tail_cache[key] = t
            if j > 0:
                t += comms[j - 1] - slack
            worst = max(worst, t)
            if j < self.S - 1:
                slack += bwds[j] + comms[j]
        return worst

    def estimate(self, bounds) -> tuple[float, list] | None:
        """Closed-form step time of a layer split (bounds: S+1 layer indices), or None.

        1F1B (Narayanan et al. SC'21 Sec. 2.2, generalised to unequal stages): one micro-batch
        crosses the pipeline forward and back (sum of stage times and 2x each boundary's p2p
        time), the other m-1 are paced by the slowest stage; then the tail (`tail`).
        GPipe: forwards and backwards are paced separately: (m-1)(max f + max b)."""
        fs, bs, rcs, comms = [], [], [], []
        for j in range(self.S):
            r = self.kinds[j].stage(bounds[j], bounds[j + 1])
            if r is None:
                return None
            fs.append(r[0]); bs.append(r[1]); rcs.append(r[2])
            if j < self.S - 1:
                comms.append(self.comm(j, bounds[j + 1]))
        total = sum(fs) + sum(bs) + 2 * sum(comms)
        if self.schedule == "gpipe":
            paced = max(fs) + max(bs)
        else:
            paced = max(f + b for f, b in zip(fs, bs))
        return total + (self.m - 1) * paced + self.tail(bounds, bs, comms), rcs

    # -- bounds ---------------------------------------------------------------------------------
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
        hi = max(k.FBrc[self.L] for k in self.kinds)
        if self.pack(hi) is None:
            return None
        lo = 0.0
        while hi - lo > 1e-4 * hi:
            mid = (lo + hi) / 2
            if self.pack(mid) is None:
                lo = mid
            else:
                hi = mid
        return lo, self.pack(hi)

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
        """Branch-and-bound DFS over stage ends, stage 0 first. Returns (splits, nodes): the
        best `k` splits with estimate < bound as (estimate, bounds), best first.

        Pruning: (1) a partial split's estimate is at least what it has spent plus every
        remaining layer on its fastest remaining stage plus (m-1) x its slowest stage so far;
        (2) so any stage's time is capped at (bound - spent - remaining)/(m-1), which with memory
        caps how far the stage may reach (one bisection); (3) the remaining stages must still be
        able to hold the remaining layers under that cap; (4) with k = 1, a (stage, start)
        reached again with no less spent and no faster slowest stage is dominated (this ignores
        the small optimizer/all-reduce tail, so it is used only on long lines)."""
        bb = _LayerSplitSearch(self, bound, node_budget, k)
        inc = incumbent if incumbent is not None else (self.min_bottleneck() or (None, None))[1]
        if inc is not None:
            e = self.estimate(inc)
            if e is not None:
                bb.offer(e[0], tuple(inc))
        if self.m == 1:
            self._small_m(bb.offer)
            return bb.below_bound(), 1
        if not bb.best and bound == math.inf:
            return [], 0                       # nothing fits: the bottleneck packing failed
        cap0 = (bb.limit() - bb.lb_sum[0][0]) / (self.m - 1)
        bb.starts = self._earliest_starts(cap0 * (1 + 1e-9))
        bb.dfs(0, 0, 0.0, (0.0, 0.0) if bb.gpipe else (0.0,))
        return bb.below_bound(), bb.nodes

    def _small_m(self, offer):
        """m = 1: no pacing term, the estimate is a sum; a plain DP over (stage, start) is exact
        (up to the tail) and cheap."""
        S, L = self.S, self.L
        INF = math.inf
        g = [[INF] * (L + 1) for _ in range(S + 1)]
        nxt = [[None] * (L + 1) for _ in range(S + 1)]
        g[S][L] = 0.0
        for j in range(S - 1, -1, -1):
            for a in range(L):
                for b in range(a + 1, L - (S - 1 - j) + 1):
                    if g[j + 1][b] == INF:
                        continue
                    r = self.kinds[j].stage(a, b)
                    if r is None:
                        break
                    v = r[0] + r[1] + (2 * self.comm(j, b) if j < S - 1 else 0.0) + g[j + 1][b]
                    if v < g[j][a]:
                        g[j][a], nxt[j][a] = v, b
        if g[0][0] < INF:
            ends, a = [0], 0
            for j in range(S):
                a = nxt[j][a]
                ends.append(a)
            e = self.estimate(ends)
            if e is not None:
                offer(e[0], tuple(ends))

    # -- exhaustive, vectorised ---------------------------------------------------------------
    def _allreduce_table(self, j: int) -> np.ndarray:
        """[a, b] -> gradient all-reduce + optimizer seconds of stage j holding layers [a, b)."""
        chip, tp = self.shapes[j]
        Pp = self.kinds[j].Pp
        L = self.L
        P = np.asarray(Pp)
        t = np.maximum(P[None, :] - P[:, None], 0.0) * self.optc[j]
        if self.dp <= 1:
            return t
        for a in range(L):
            for b in range(a + 1, L + 1):
                t[a, b] += self.rm.grad_allreduce_time(chip, tp, self.dp, (Pp[b] - Pp[a]) * self.grad_bytes)
        return t

    def all_splits(self, keep: int):
        """Estimate every contiguous split at once (numpy over all C(L-1, S-1) of them, the same
        formula as `estimate`); the best `keep` as (estimate, bounds)."""
        S, L = self.S, self.L
        n = math.comb(L - 1, S - 1)
        if n > EXHAUSTIVE_LINE_LIMIT:
            raise H2Error(f"exhaustive search of {n:,} layer splits for {self.config.describe()} "
                          f"is too large", hint="use --search heuristic")
        Bd = _all_bounds(L, S)
        N = len(Bd)
        fs = np.zeros((N, S)); bs = np.zeros((N, S)); ok = np.ones(N, bool)
        comms = np.zeros((N, S))
        tails = np.zeros((N, S))
        for j, k in enumerate(self.kinds):
            a, b = Bd[:, j], Bd[:, j + 1]
            none = b <= np.asarray(k.fit_none)[a]
            ok &= b <= np.asarray(k.fit_any)[a]
            F, Bn, Br = np.asarray(k.F), np.asarray(k.B), np.asarray(k.Brc)
            fs[:, j] = F[b] - F[a]
            bs[:, j] = np.where(none, Bn[b] - Bn[a], Br[b] - Br[a])
            if j < S - 1:
                lat, bw = self.link[j]
                comms[:, j] = lat + np.asarray(k.out)[b - 1] / bw
            tails[:, j] = self._allreduce_table(j)[a, b]
        total = fs.sum(1) + bs.sum(1) + 2 * comms.sum(1)
        paced = (fs.max(1) + bs.max(1)) if self.schedule == "gpipe" else (fs + bs).max(1)
        # tail (see `tail`): stage j ends its last backward sum_{k<j}(b_k + c_k) before stage 0
        slack = np.concatenate([np.zeros((N, 1)), np.cumsum(bs + comms, axis=1)[:, :-1]], axis=1)
        prev_comm = np.concatenate([np.zeros((N, 1)), comms[:, :-1]], axis=1)
        tail = np.maximum((tails + prev_comm - slack).max(1), 0.0)
        est = np.where(ok, total + (self.m - 1) * paced + tail, np.inf)
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
            stages.append(StagePlan(chip=chip, chips=self.dp * tp, layers=names[a:b], tp=tp,
                                    recompute=r[2] if r else "none"))
        return Plan(model=costs_model, cluster=cluster.name, global_batch=global_batch,
                    micro_batch=self.config.micro_batch, seq_len=seq_len, stages=stages,
                    dp=self.dp, schedule=self.schedule, moe=moe)


class _LayerSplitSearch:
    """The state of one `StageLine.best_split`: the best k layer splits so far (sorted, as
    (estimate, bounds)), the nodes visited, the dominance memo and the stage ends of the
    current DFS path."""

    def __init__(self, line: StageLine, bound: float, node_budget: int, k: int):
        self.line, self.bound, self.node_budget, self.k = line, bound, node_budget, k
        self.gpipe = line.schedule == "gpipe"
        self.memo = k == 1 and line.S > 8
        self.lb_sum = line.lb_sum
        self.best: list = []               # sorted (estimate, bounds), at most k
        self.nodes = 0
        self.seen: dict = {}               # (stage, start) -> undominated (spent, slowest stage)
        self.ends = [0] * (line.S + 1)
        self.ends[line.S] = line.L
        self.starts: list = []             # earliest start of each stage under the first cap

    def limit(self) -> float:
        # splits within REL_TOL of the k-th best are not worth the nodes: equal stages
        # give many splits that differ only in the optimizer tail
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

    def dominated(self, j, a, acc, mx) -> bool:
        lst = self.seen.get((j, a))
        if lst is None:
            self.seen[(j, a)] = [(acc, mx)]
            return False
        for acc2, mx2 in lst:
            if acc2 <= acc and all(x2 <= x for x2, x in zip(mx2, mx)):
                return True
        lst[:] = [(acc2, mx2) for acc2, mx2 in lst
                  if not (acc <= acc2 and all(x <= x2 for x, x2 in zip(mx, mx2)))]
        lst.append((acc, mx))
        return False

    def dfs(self, j, a, acc, mx):
        """Stage j starts at layer a, having spent acc; mx: its slowest stage so far ((fwd,
        bwd) maxima under GPipe, fwd + bwd under 1F1B)."""
        self.nodes += 1
        if self.nodes > self.node_budget:
            return
        line, lb_sum, gpipe, ends = self.line, self.lb_sum, self.gpipe, self.ends
        S, L, m = line.S, line.L, line.m
        kd = line.kinds[j]
        lim = self.limit()
        cap = (lim - acc - lb_sum[j][a]) / (m - 1)
        if (mx[0] + mx[1] if gpipe else mx[0]) > cap:
            return
        if j == S - 1:
            if kd.time(a, L) <= cap * (1 + 1e-12):
                ends[j] = a
                e = line.estimate(ends)
                if e is not None:
                    self.offer(e[0], tuple(ends))
            return
        ends[j] = a
        hi = min(kd.furthest(a, cap * (1 + 1e-12)), L - (S - 1 - j))
        lo = max(a + 1, self.starts[j + 1])
        for b in range(hi, lo - 1, -1):
            r = kd.stage(a, b)
            if r is None:
                continue
            f, bw, _ = r
            acc2 = acc + f + bw + 2 * line.comm(j, b)
            mx2 = (max(mx[0], f), max(mx[1], bw)) if gpipe else (max(mx[0], f + bw),)
            paced = mx2[0] + mx2[1] if gpipe else mx2[0]
            if acc2 + lb_sum[j + 1][b] + (m - 1) * paced >= self.limit():
                continue
            if self.memo and self.dominated(j + 1, b, acc2, mx2):
                continue
            self.dfs(j + 1, b, acc2, mx2)
            ends[j] = a


# ----------------------------------------------------------------------------------------------
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


def tp_options(cluster: Cluster, chip: str, per_replica: int, n_heads: int) -> list[int]:
    """TP degrees for a chip type: divisors of the heads, at most chips-per-node (Megatron keeps
    TP inside a node, Narayanan et al. SC'21 Sec. 3.3), dividing the chips per replica."""
    g = cluster.group(chip)
    return [t for t in divisors(per_replica)
            if t <= g.chips_per_node and (n_heads <= 0 or n_heads % t == 0)]


def memory_orders(cluster: Cluster, chips: list[str]) -> list[tuple]:
    """Every order of the chip types, larger-memory first (H2's rule) leading."""
    declared = list(cluster.chip_types)
    # ties keep the cluster file's order (so a uniform plan is what the user wrote down)
    key = lambda c: (-cluster.chip(c).mem_bytes, declared.index(c) if c in declared else len(declared), c)
    first = tuple(sorted(chips, key=key))
    rest = [p for p in itertools.permutations(sorted(chips)) if p != first]
    return [first] + rest


def _moe_layers(costs: ModelCosts):
    return [l for l in costs.layers if l.moe is not None]


def _moe_plan(rm: ResourceModel, cluster: Cluster, costs: ModelCosts, dp: int, tps: dict,
              max_ep: int | None = None) -> MoEPlan | None:
    """Expert parallelism across the data-parallel replicas: the largest EP dividing both dp
    and the expert count (at most `max_ep`); all-to-all algorithm: whichever the resource model
    says is faster summed over the chip types."""
    moes = _moe_layers(costs)
    if not moes:
        return None
    E = moes[0].moe.num_experts
    ep = max(d for d in divisors(dp) if E % d == 0 and (max_ep is None or d <= max_ep))
    if ep <= 1:
        return MoEPlan(ep=1)
    mi = moes[0].moe
    nbytes = rm.costs.micro_batch * rm.costs.seq_len * mi.top_k * mi.d_model * dtype_bytes(cluster.dtype)
    tot = {"flat": 0.0, "halo": 0.0}
    for c, t in tps.items():
        g = cluster.group(c)
        geo = replica_geometry(g, ep, t)
        args = (nbytes / t, ep, geo.per_node, g.intra_bw, nic_share(g), g.intra_latency, g.inter_latency)
        tot["flat"] += all_to_all_flat_time(*args)
        tot["halo"] += all_to_all_halo_time(*args)
    return MoEPlan(ep=ep, a2a="halo" if tot["halo"] < tot["flat"] else "flat")


def _configs(costs: ModelCosts, cluster: Cluster, global_batch: int, micro_batches, schedule: str,
             dp_options=None, max_tp: int | None = None):
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
            for tps in itertools.product(*opts):
                S = sum(counts[c] // (dp * t) for c, t in zip(chips, tps))
                if 1 <= S <= L:
                    out.append((mb, dp, m, tuple(zip(chips, tps))))
    if not out and too_many:
        raise H2Error(f"global batch {global_batch} needs more than {MAX_MICROBATCHES:,} "
                      f"micro-batches per step at every micro-batch size and dp tried "
                      f"({', '.join(map(str, micro_batches))})",
                      hint="lower --global-batch, or raise --micro-batch")
    return out, counts


def _fits_at_all(rm: ResourceModel, cluster: Cluster, counts: dict, dp: int) -> bool:
    """Cheap necessary condition: one replica's chips can hold the model states at all."""
    need = float(rm.la.params.sum()) * rm.la.state.total
    have = sum(cluster.chip(c).mem_bytes * n / dp for c, n in counts.items())
    return have >= need


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
                       max_ep: int | None = None):
    """Uniform plans (one TP degree for all stages, larger-memory chips first, even layer
    split) for every dp / micro-batch / TP; each with its estimate. Sorted, best first."""
    rms = rms if rms is not None else {}
    cfgs, counts = _configs(costs, cluster, global_batch, micro_batches, schedule, dp_options, max_tp)
    out = []
    for mb, dp, m, tps in cfgs:
        if len({t for _, t in tps}) != 1:
            continue
        if mb not in rms:
            rms[mb] = ResourceModel(costs, cluster, mb, seq_len, calibration)
        rm = rms[mb]
        cfg = Config(dp, mb, m, tps, memory_orders(cluster, list(counts))[0], tuple(sorted(counts.items())))
        moe = _moe_plan(rm, cluster, rm.costs, dp, dict(tps), max_ep)
        line = StageLine(rm, cfg, schedule, moe.ep if moe else 1, moe.a2a if moe else "flat", kinds)
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
        c.sim = simulate(costs, c.plan, cluster, calibration)
    return min(cands[:3], key=lambda c: c.step_time_s)


# ----------------------------------------------------------------------------------------------
# HeteroAuto

EXHAUSTIVE_LINE_LIMIT = 3_000_000
EXHAUSTIVE_TOTAL_LIMIT = 50_000_000


def _check_exhaustive_size(costs: ModelCosts, cfgs, counts: dict, n_orders: int):
    """Refuse an exhaustive search up front when some line, or all of them together, has more
    layer splits than numpy can enumerate in reasonable time and memory."""
    L = len(costs.layers)
    total, worst = 0, (0, None)
    for mb, dp, m, tps in cfgs:
        S = sum(counts[c] // (dp * t) for c, t in tps)
        n = math.comb(L - 1, S - 1)
        total += n * n_orders
        if n > worst[0]:
            worst = (n, (mb, dp, tps))
    if worst[0] > EXHAUSTIVE_LINE_LIMIT or total > EXHAUSTIVE_TOTAL_LIMIT:
        mb, dp, tps = worst[1]
        raise H2Error(f"exhaustive search would enumerate {total:,} layer splits (up to {worst[0]:,} "
                      f"for dp={dp} micro-batch={mb} tp={dict(tps)}); the limit is "
                      f"{EXHAUSTIVE_LINE_LIMIT:,} per configuration and {EXHAUSTIVE_TOTAL_LIMIT:,} "
                      f"in all", hint="use --search heuristic")


class _ConfigBound:
    """Order-independent lower bounds on a configuration's estimate, from per-(chip, tp)
    numbers only, so thousands of configurations are ranked before any stage line is built.

    `quick`: the paced part alone, with blocks spread over the stages by speed (continuous).
    `full`: for a bottleneck T, a stage of type k holds at most
        max(min(floor(T / t_k), M_k(i)), min(floor(T / r_k), R_k(i)))
    transformer blocks: t_k / r_k are its fastest block time without / with recomputation and
    M_k(i) / R_k(i) the blocks that fit its memory without / with it, with i micro-batches in
    flight (at best its stages sit at the last positions, holding 1, 2, ... in flight). T is
    feasible only if the stages can hold every block; one micro-batch's pass costs at least the
    blocks placed fastest-type-first within those capacities (exchange argument) plus every
    other layer on its fastest type. The bound is the minimum over T of (m-1) T + that pass,
    taken where the pass cost steps (whole numbers of blocks); T values past the first few are
    bounded by the cheapest possible pass."""

    STEPS = 12

    def __init__(self, costs: ModelCosts):
        kinds = [l.kind for l in costs.layers]
        self.block = np.array([k in BLOCK_KINDS for k in kinds]) if any(k in BLOCK_KINDS for k in kinds) \
            else np.ones(len(kinds), bool)
        self.n_blocks = int(self.block.sum())
        self._keys: dict = {}

    def key(self, rm: ResourceModel, chip: str, tp: int, ep: int, a2a: str, count: int):
        k = (id(rm), chip, tp, ep, a2a, count)
        if k not in self._keys:
            lt = rm.layer_times(chip, tp, ep, a2a)
            tau = np.add(lt.fwd_layer, lt.bwd_layer)
            tb = float(tau[self.block].min())
            rb = float((tau + np.array(lt.fwd_layer))[self.block].min())
            dev = rm.la.device(tp, ep)
            state = float((dev.params[self.block] * rm.la.state.total).min())
            act = float(dev.act[self.block].min())
            out = float(dev.out[self.block].min())
            cap = rm.cluster.chip(chip).mem_bytes
            i = np.arange(1, count + 1)
            M = np.maximum(np.floor((cap - 2 * out) / (state + i * act)), 0).astype(int)
            room = cap - act - 2 * out       # one block's working set while it recomputes
            R = np.maximum(np.floor(room / (state + i * out)), 0).astype(int)
            N = self.n_blocks
            self._keys[k] = (tau, tb, rb, np.minimum(M, N).tolist(), np.minimum(R, N).tolist(), count)
        return self._keys[k]

    def stats(self, rm, shapes_count, ep, a2a):
        return sorted((self.key(rm, c, t, ep, a2a, n) for (c, t), n in shapes_count.items()),
                      key=lambda s: s[1])

    def quick(self, stats, m: int) -> float:
        N = self.n_blocks
        mt = np.min([s[0] for s in stats], axis=0)
        speed = sum(cnt / tb for _, tb, _, _, _, cnt in stats)
        return (m - 1) * max(N / speed, float(mt.max())) + N * stats[0][1] + float(mt[~self.block].sum())

    def full(self, stats, m: int) -> float:
        N = self.n_blocks
        mt = np.min([s[0] for s in stats], axis=0)
        other = float(mt[~self.block].sum())
        arrs = [(tb, rb, np.array(M), np.array(R)) for _, tb, rb, M, R, _ in stats]

        def capacity(T):
            return [int(np.maximum(np.minimum(int(T / tb * (1 + 1e-12)), M),
                                   np.minimum(int(T / rb * (1 + 1e-12)), R)).sum())
                    for tb, rb, M, R in arrs]

        def pass_cost(caps):
            left, cost = N, 0.0
            for s, c in zip(stats, caps):
                take = min(left, c)
                cost += take * s[1]
                left -= take
            return cost if left == 0 else math.inf

        # the bottleneck is always a whole number of blocks on some stage type: search those
        n = np.arange(1, N + 1)
        cands = np.unique(np.concatenate([n * t for _, tb, rb, _, _, _ in stats for t in (tb, rb)]))
        if sum(capacity(cands[-1])) < N:
            return math.inf                       # the blocks cannot fit at any speed
        lo, hi = 0, len(cands) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if sum(capacity(cands[mid])) >= N:
                hi = mid
            else:
                lo = mid + 1
        T0 = max(float(cands[lo]), float(mt.max()))
        best = (m - 1) * T0 + pass_cost(capacity(T0))
        if m > 1:
            later = cands[lo + 1:lo + 1 + self.STEPS + 1]
            for T in later[:self.STEPS]:
                if (m - 1) * T >= best:
                    break
                best = min(best, (m - 1) * float(T) + pass_cost(capacity(T)))
            else:
                if len(later) > self.STEPS:
                    best = min(best, (m - 1) * float(later[self.STEPS]) + N * stats[0][1])
        return (best + other) * (1 - 1e-9)


def micro_batch_options(global_batch: int, micro_batch: int | None) -> list[int]:
    """The micro-batch sizes to try: the one asked for, else those of MICRO_BATCHES that divide
    the global batch."""
    return [micro_batch] if micro_batch else [b for b in MICRO_BATCHES if global_batch % b == 0]


class _BestFirstSearch:
    """HeteroAuto's best-first queue over lazily refined lower bounds. An entry is
    (bound, seq, step, item); each step refines its item and re-queues it one level down:

      config  quick `_ConfigBound` bound  -> full bound, then its stage orders
      order   the order's own bound (`StageLine.min_bottleneck`) -> its layer split
      split   DFS over the line's stage groups (`StageLine.best_split`) -> candidates

    The search stops when the smallest bound left cannot beat the `keep`-th best estimate."""

    def __init__(self, costs: ModelCosts, cluster: Cluster, global_batch: int, seq_len: int,
                 schedule: str, exhaustive: bool, keep: int, node_budget: int, orders: list,
                 rms: dict, kinds: dict, max_ep: int | None = None):
        self.max_ep = max_ep
        self.costs, self.cluster, self.global_batch, self.seq_len = costs, cluster, global_batch, seq_len
        self.schedule, self.exhaustive, self.keep, self.node_budget = schedule, exhaustive, keep, node_budget
        self.orders, self.rms, self.kinds = orders, rms, kinds
        self.bound = _ConfigBound(costs)
        self.found: list[Candidate] = []
        self.nodes = self.searched = 0
        self.heap: list = []
        self.seq = itertools.count()

    def threshold(self) -> float:
        """The `keep`-th best estimate found so far: a bound at or above it is not worth pursuing."""
        if len(self.found) < self.keep:
            return math.inf
        return sorted(c.estimate_s for c in self.found)[self.keep - 1]

    def push(self, lb: float, step: str, item: tuple):
        heapq.heappush(self.heap, (lb, next(self.seq), step, item))

    def offer(self, line: StageLine, moe, scored, kind: str):
        """Keep the candidates of (estimate, bounds) pairs from `line`; the best keep*4 survive."""
        for est, bounds in scored:
            plan = line.plan(bounds, self.costs.model, self.cluster, self.global_batch, self.seq_len, moe)
            self.found.append(Candidate(plan, est, kind, line.config, bounds))
        self.found.sort(key=lambda c: c.estimate_s)
        del self.found[self.keep * 4:]

    def add_configurations(self, cfgs, counts: dict, calibration):
        """Queue every candidate configuration (dp, micro-batch, tp per chip type) that can hold
        the model states at all, in the memory-descending order, under its quick bound."""
        counts_t = tuple(sorted(counts.items()))
        for mb, dp, m, tps in cfgs:
            if mb not in self.rms:
                self.rms[mb] = ResourceModel(self.costs, self.cluster, mb, self.seq_len, calibration)
            rm = self.rms[mb]
            if not _fits_at_all(rm, self.cluster, counts, dp):
                continue
            moe = _moe_plan(rm, self.cluster, rm.costs, dp, dict(tps), self.max_ep)
            ep, a2a = (moe.ep, moe.a2a) if moe else (1, "flat")
            stats = self.bound.stats(rm, {(c, t): counts[c] // (dp * t) for c, t in tps}, ep, a2a)
            cfg = Config(dp, mb, m, tps, self.orders[0], counts_t)
            lb = 0.0 if self.exhaustive else self.bound.quick(stats, m)
            self.push(lb, "config", (cfg, moe, stats))

    def run(self):
        steps = {"config": self._bound_config, "orders": self._stage_orders,
                 "order": self._bound_order, "split": self._layer_split}
        while self.heap:
            lb, _, step, item = heapq.heappop(self.heap)
            if lb >= self.threshold():
                break                 # every choice left is bounded below by the keep-th best
            steps[step](lb, *item)

    def _bound_config(self, lb, cfg, moe, stats):
        lb = 0.0 if self.exhaustive else max(lb, self.bound.full(stats, cfg.m))
        if lb < math.inf:
            self.push(lb, "orders", (cfg, moe))

    def _stage_orders(self, lb, cfg, moe):
        for order in self.orders:
            c = Config(cfg.dp, cfg.micro_batch, cfg.m, cfg.tp, order, cfg.counts)
            self.push(lb, "order", (c, moe))

    def _bound_order(self, lb, cfg, moe):
        ep, a2a = (moe.ep, moe.a2a) if moe else (1, "flat")
        line = StageLine(self.rms[cfg.micro_batch], cfg, self.schedule, ep, a2a, self.kinds)
        self.searched += 1
        if self.exhaustive:
            self.offer(line, moe, line.all_splits(self.keep), "exhaustive")
            return
        r = line.min_bottleneck()
        if r is None:
            return                                # this order cannot fit in memory
        T_lo, inc = r
        olb = max(lb, line.lb_sum[0][0] + (line.m - 1) * T_lo)
        self.push(olb, "split", (line, inc, moe))

    def _layer_split(self, lb, line, inc, moe):
        # small lines keep their `keep` best splits (the final ranking simulates the best
        # few overall, as the exhaustive search does); large ones keep one
        res, n = line.best_split(self.threshold(), self.node_budget, incumbent=inc,
                                 k=self.keep if line.S * line.L <= 256 else 1)
        self.nodes += n
        self.offer(line, moe, res, "auto")


def _rank_by_simulation(costs: ModelCosts, cluster: Cluster, found: list, uniforms: list, keep: int,
                        calibration, rms: dict) -> tuple[list, Candidate | None]:
    """Simulate the `keep` best candidates by estimate and the best uniform plan; (all of them
    by simulated step time, the uniform candidate)."""
    found.sort(key=lambda c: c.estimate_s)
    finalists = found[:keep]
    for c in finalists + uniforms[:1]:
        c.sim = simulate(costs, c.plan, cluster, calibration, resource=rms[c.plan.micro_batch])
    uniform = uniforms[0] if uniforms else None
    pool = sorted(finalists + ([uniform] if uniform else []), key=lambda c: c.step_time_s)
    return pool, uniform


def search(costs: ModelCosts, cluster: Cluster, global_batch: int, *, seq_len: int | None = None,
           micro_batch: int | None = None, schedule: str = "1f1b", method: str = "heuristic",
           calibration=None, top_k: int = 5, dp_options=None, node_budget: int = 30_000,
           max_tp: int | None = None, max_ep: int | None = None) -> SearchResult:
    """HeteroAuto: the plan with the lowest simulated step time among the best candidates.

    Heuristic: best-first over lazily refined lower bounds (`_BestFirstSearch`). A configuration
    enters with a quick bound, is re-queued with the full `_ConfigBound`, then expands into its
    stage orders; an order is re-queued with its own bound (fewest-layers bottleneck of that
    exact line, `StageLine.min_bottleneck`), and only when it is popped again is its layer split
    searched (`StageLine.best_split`). The search stops when the smallest bound left cannot
    beat the `top_k`-th best estimate found, so every skipped choice is provably worse by the
    estimate (up to the DFS node budget)."""
    if method not in ("heuristic", "exhaustive"):
        raise H2Error(f"unknown search method {method!r} (expected heuristic or exhaustive)")
    if global_batch < 1:
        raise H2Error(f"global batch must be positive, got {global_batch}")
    t0 = time.perf_counter()
    seq_len = seq_len or costs.seq_len
    mbs = micro_batch_options(global_batch, micro_batch)
    cfgs, counts = _configs(costs, cluster, global_batch, mbs, schedule, dp_options, max_tp)
    orders = memory_orders(cluster, list(counts))
    exhaustive = method == "exhaustive"
    if exhaustive:
        _check_exhaustive_size(costs, cfgs, counts, len(orders))
    keep = max(top_k, 3)
    rms: dict[int, ResourceModel] = {}
    kinds: dict = {}
    bfs = _BestFirstSearch(costs, cluster, global_batch, seq_len, schedule, exhaustive, keep,
                           node_budget, orders, rms, kinds, max_ep)
    bfs.add_configurations(cfgs, counts, calibration)
    bfs.run()

    uniforms = uniform_candidates(costs, cluster, global_batch, seq_len, mbs, schedule,
                                  calibration, rms, dp_options, kinds, max_tp, max_ep)
    if not bfs.found and not uniforms:
        raise H2Error(f"no plan of {costs.model} fits in {cluster.name}'s memory "
                      f"(global batch {global_batch}, micro-batches {mbs})",
                      hint="add chips, lower the micro-batch or sequence length")
    pool, uniform = _rank_by_simulation(costs, cluster, bfs.found, uniforms, keep, calibration, rms)
    return SearchResult(best=pool[0], runner_ups=pool[1:top_k + 1], uniform=uniform,
                        search_time_s=time.perf_counter() - t0, method=method,
                        configs_total=len(cfgs) * len(orders), configs_searched=bfs.searched,
                        dfs_nodes=bfs.nodes)


# ----------------------------------------------------------------------------------------------
# HeteroSpeedupRatio

@dataclass
class SpeedupReport:
    """H2's HeteroSpeedupRatio: heterogeneous throughput / sum over chip types of the best
    homogeneous throughput of that type's chips alone (each found by the same search)."""
    hetero_tokens_per_s: float
    homo: dict                       # chip -> {'tokens_per_s', 'global_batch', 'step_time_s', 'plan'} or None
    ratio: float | None              # homogeneous runs at global batch proportional to their chips
    homo_const: dict = field(default_factory=dict)   # same, each at the hetero global batch
    ratio_const_batch: float | None = None

    def to_json(self) -> dict:
        strip = lambda d: {c: ({k: v for k, v in r.items() if k != "plan"} if r else None) for c, r in d.items()}
        return {"hetero_tokens_per_s": self.hetero_tokens_per_s, "ratio": self.ratio,
                "ratio_const_batch": self.ratio_const_batch, "homogeneous": strip(self.homo),
                "homogeneous_const_batch": strip(self.homo_const)}


def sub_cluster(cluster: Cluster, chip: str) -> Cluster:
    return Cluster(name=f"{cluster.name}[{chip}]", chip_types={chip: cluster.chip(chip)},
                   groups=tuple(g for g in cluster.groups if g.chip == chip), dtype=cluster.dtype)


def _homo_best(costs, cluster, chip, global_batch, seq_len, micro_batch, schedule, calibration):
    try:
        r = search(costs, sub_cluster(cluster, chip), global_batch, seq_len=seq_len,
                   micro_batch=micro_batch, schedule=schedule, calibration=calibration, top_k=1)
    except H2Error:
        return None                  # this chip type alone cannot train the model
    return {"tokens_per_s": r.best.tokens_per_s, "global_batch": global_batch,
            "step_time_s": r.best.step_time_s, "plan": r.best.plan}


def hetero_speedup(costs: ModelCosts, cluster: Cluster, hetero: Candidate, *,
                   schedule: str = "1f1b", calibration=None) -> SpeedupReport:
    counts = chip_counts(cluster)
    N = sum(counts.values())
    gb, seq, mb = hetero.plan.global_batch, hetero.plan.seq_len, None
    homo, const = {}, {}
    for c, n in counts.items():
        gb_c = max(1, round(gb * n / N))
        homo[c] = _homo_best(costs, cluster, c, gb_c, seq, mb, schedule, calibration)
        const[c] = homo[c] if gb_c == gb else _homo_best(costs, cluster, c, gb, seq, mb, schedule, calibration)

    def ratio(d):
        tot = sum(r["tokens_per_s"] for r in d.values() if r)
        return hetero.tokens_per_s / tot if tot > 0 else None

    return SpeedupReport(hetero_tokens_per_s=hetero.tokens_per_s, homo=homo, ratio=ratio(homo),
                         homo_const=const, ratio_const_batch=ratio(const))
