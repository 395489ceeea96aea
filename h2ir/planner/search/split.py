"""The layer split of one line of stages: `StageLine` bounds every split, packs the bottleneck,
searches splits by branch and bound (`_LayerSplitSearch`) or, exhaustively, all at once."""
from __future__ import annotations

import bisect
import itertools
import math
from functools import lru_cache

import numpy as np

from h2ir.clusters.cluster import Cluster
from h2ir.errors import H2Error
from h2ir.plans.plan import MoEPlan, Plan, StagePlan
from h2ir.planner.limits import EXHAUSTIVE_LINE_LIMIT, REL_TOL
from h2ir.planner.resource import ResourceModel, inflight_microbatches, p2p_link
from h2ir.planner.search.bound import step_lower_bound
from h2ir.planner.search.space import Config
from h2ir.planner.search.stage_kind import StageKind, KindTable, first_backward_late


@lru_cache(maxsize=16)
def _all_bounds(L: int, S: int) -> np.ndarray:
    """Every split of L layers into S non-empty contiguous ranges, as rows of S+1 bounds."""
    k = S - 1
    n = math.comb(L - 1, k)
    cuts = np.fromiter(itertools.chain.from_iterable(itertools.combinations(range(1, L), k)),
                       dtype=np.int64, count=n * k).reshape(n, k)
    return np.concatenate([np.zeros((n, 1), np.int64), cuts, np.full((n, 1), L, np.int64)], axis=1)


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
                    kinds[tkey] = KindTable(rm, chip, tp, e, a2a)
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
