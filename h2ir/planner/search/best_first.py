"""HeteroAuto's search: best-first over lower bounds, from configurations to lines of stages
to layer splits to simulated plans (`search`)."""
from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import time

from h2ir.clusters.cluster import Cluster
from h2ir.costs import ModelCosts
from h2ir.errors import MAX_MICROBATCHES, MAX_WORKERS, H2Error
from h2ir.plans.plan import Plan
from h2ir.planner.divisors import divisors
from h2ir.planner.limits import (EXACT_TOTAL, EXACT_WORK, EXHAUSTIVE_LINE_LIMIT,
                                 EXHAUSTIVE_TOTAL_LIMIT, NODE_BUDGET_GROWTH, PROBE_SLACK,
                                 SIM_WORK_MIN)
from h2ir.planner.resource import ResourceModel, device_capacity, stage_memory, zero_optimizer_bytes
from h2ir.planner.search.bound import config_bound
from h2ir.planner.search.experts import (a2a_choice, ep_assignments, ep_degree_options, ep_local,
                                         ep_type_budgets, eps_key, moe_plan)
from h2ir.planner.search.lines import LocalLines, lines_exact, sequences_at_most, type_sequences
from h2ir.planner.search.result import Candidate, SearchResult
from h2ir.planner.search.space import (PlanSpace, chip_counts, config_of, memory_order,
                                       micro_batch_options, too_many_microbatches, tp_options,
                                       tp_reach)
from h2ir.planner.search.split import StageLine
from h2ir.planner.search.uniform import uniform_candidates
from h2ir.planner.simulate import simulate


def fits_memory(costs: ModelCosts, plan: Plan, cluster: Cluster) -> bool:
    """Every stage within its devices' capacity by `stage_memory`, the validator's check (the
    search's vectorised feasibility leaves out tied-parameter copies)."""
    return all(m.total <= m.capacity for m in
               (stage_memory(costs, plan, cluster, j) for j in range(plan.num_stages)))


class _Search:
    """Best-first over lower bounds. Heap entries (bound, seq, kind, item):

      config  (micro-batch, dp, schedule) under `config_bound` -> its lines
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
                    self._queue_config(sched, mb, dp, m)
        if not self.heap and too_many:
            raise too_many_microbatches(self.gb, self.mbs)

    def _queue_config(self, sched, mb, dp, m):
        """Queue (sched, mb, dp) under each EP assignment worth searching, at its bound."""
        rm = self.rm(mb)
        r = self._type_budgets(dp)
        if r is None:
            return
        budgets, tps = r
        opts, full = ep_degree_options(self.cluster, self.costs, self.space, dp, budgets, tps,
                                       self.max_ep)
        zdp = dp if self.space.zero else 1
        assignments, sampled = ep_assignments(rm, self.costs, self.space, budgets, tps, dp, m,
                                              sched, opts, full, zdp)
        if sampled:
            # EP assignments per type are sampled, not enumerated: the others have no bound
            self.left(0.0)
        for eps in assignments:
            bud, tpe = ep_type_budgets(self.cluster, self.space, budgets, tps, eps)
            if not self._holds_model_state(rm, bud, eps, dp, m):
                continue
            moe = moe_plan(self.costs, eps, a2a_choice(rm, self.cluster, eps,
                                                       {c: t[0] for c, t in tpe.items()}))
            a2a = moe.a2a if moe else "flat"
            lb = config_bound(rm, self.cluster, bud, tpe, m, sched, eps, a2a, dp=zdp)
            if lb < math.inf:
                self.push(lb, "config", (sched, mb, dp, m, bud, tpe, moe, eps))

    def _type_budgets(self, dp: int) -> tuple[dict, dict] | None:
        """Each type's chips per replica and its TP degrees at `dp` (types without either left
        out, or None where the space must use every chip and cannot)."""
        budgets, tps = {}, {}
        for c, n in self.counts.items():
            if not self.space.idle and n % dp:
                return None
            B = n // dp
            # every TP degree of the space, across nodes too; coordinate descent (large
            # spaces) offers those past a node only up to `tp_reach`
            opts = [t for t in tp_options(self.cluster, c, B, self.costs.n_heads,
                                          divide=not self.space.idle, reach=self.costs.n_heads)
                    if self.max_tp is None or t <= self.max_tp]
            if B and opts:
                budgets[c], tps[c] = B, opts
            elif not self.space.idle:
                return None
        return (budgets, tps) if budgets else None

    def _holds_model_state(self, rm, bud: dict, eps: dict, dp: int, m: int) -> bool:
        """Whether the chips of a replica can hold its model states at all: experts divide by
        EP (at most the largest degree), the optimizer's by dp where a stage may take ZeRO-1
        (an ep 1 type), no gradient sums with one micro-batch (`stage_memory`)."""
        la = rm.la
        st = la.state
        p = float(la.dense_params.sum()) + \
            float(la.expert_params.sum()) / max(list(eps.values()) or [1])
        zero = self.space.zero and dp > 1 and (not eps or min(eps.values()) == 1)
        need = p * (st.weights + (st.grads if m > 1 else 0)) + (
            zero_optimizer_bytes(p * st.optimizer, dp) if zero else p * st.optimizer)
        return sum(device_capacity(self.cluster.chip(c)) * B for c, B in bud.items()) >= need

    def _line(self, sched, mb, dp, m, shapes, moe, eps, placed=True):
        a2a = moe.a2a if moe else "flat"
        cfg = config_of(dp, mb, m, shapes, self.counts_t, sched)
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
        """Queue a configuration's lines of stages, each under its own bound: every line when
        there are few enough, else those coordinate descent finds (`_descent_lines`)."""
        self.configs += 1
        L = len(self.costs.layers)
        limit = max(1, min(EXACT_WORK // L, self.exact_left))
        lines = self._enumerated_lines(budgets, tps, L, limit)
        if lines is None:
            if self.exhaustive:
                raise H2Error(f"exhaustive search: dp={dp} micro-batch={mb} has more than "
                              f"{limit:,} lines of stages", hint="use --search heuristic")
            lines = self._descent_lines(lb, sched, mb, dp, m, budgets, tps, moe, eps, L, limit)
        elif not self.exhaustive:
            self.exact_left -= len(lines)
        else:
            _check_exhaustive_size(lines, L, dp, mb)
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

    def _enumerated_lines(self, budgets: dict, tps: dict, L: int, limit: int) -> list | None:
        """Every line of the configuration, or None when there are more than `limit` (outside
        exhaustive mode, without building the sequences when even those are too many)."""
        if not self.exhaustive and \
                math.prod(sequences_at_most(B, tps[c], L) + 1 for c, B in budgets.items()) > 20 * limit:
            return None
        exact_seqs = {c: type_sequences(B, tps[c], L, self.space, True) for c, B in budgets.items()}
        exact_seqs = {c: s for c, s in exact_seqs.items() if s}
        return lines_exact(exact_seqs, self.space, L, limit) if exact_seqs else []

    def _sequences(self, mb: int, budgets: dict, tps: dict, L: int, space: PlanSpace,
                   exact: bool) -> dict:
        """Each type's stage sequences (`type_sequences`) with TP across nodes up to `tp_reach`;
        types without any left out."""
        seqs = {c: type_sequences(B, self._near(c, mb, tps[c]), L, space, exact)
                for c, B in budgets.items()}
        return {c: q for c, q in seqs.items() if q}

    def _descent_lines(self, lb, sched, mb, dp, m, budgets, tps, moe, eps, L, limit) -> list:
        """Lines of a configuration too large to enumerate: every line of the narrower space
        (each type's chips all used, its higher tp first) when that one is small enough, and
        the few coordinate descent finds; the others are bounded only by `lb`."""
        narrow = dataclasses.replace(self.space, partial=False, lower_first=False)
        nlines = lines_exact(self._sequences(mb, budgets, tps, L, narrow, True), narrow, L,
                             limit) or []
        self.exact_left -= len(nlines)
        seqs = self._sequences(mb, budgets, tps, L, self.space, False)
        self.left(lb)
        self.lines_by = "coordinate-descent"
        found = []
        # no descent where a line already found is at least as good as the bound
        if lb < self.best_line:
            found = self._descend(sched, mb, dp, m, budgets, tps, moe, eps, L, seqs, narrow)
        return list(dict.fromkeys(nlines + [sh for _, sh in found]))

    def _descend(self, sched, mb, dp, m, budgets, tps, moe, eps, L, seqs, narrow) -> list:
        """Coordinate descent over the configuration's lines (`LocalLines`), each scored by
        the bound of its bottleneck-packed split; warm-started from the same dp at another
        micro-batch."""
        def score(shapes):
            if self.space.ep_local and not ep_local(self.cluster, shapes, dp, eps):
                return math.inf
            line = self._line(sched, mb, dp, m, shapes, moe, eps, placed=False)
            r = line.min_bottleneck()
            if r is None:
                return math.inf
            e = line.estimate(r[1])
            return e[0] if e else math.inf

        order = list(memory_order(self.cluster, list(seqs)))
        ll = LocalLines(score, seqs, order, self.space, L)
        key = (sched, dp, eps_key(eps))
        start = self.warm.get(key)
        if start is not None:
            # the same dp at another micro-batch: start from its best line, one round, unless
            # that is far behind the best line found
            ll.rounds = 1
            if ll.start_value(start) > self.best_line * (1 + PROBE_SLACK):
                return []
        else:
            # first down the narrower space (every chip of a type used, its higher tp first:
            # fewer, larger moves), then on in the whole one from where that ended:
            # partial-use moves from the start lead elsewhere, often worse
            ln = LocalLines(score, self._sequences(mb, budgets, tps, L, narrow, False), order,
                            narrow, L)
            ln.seen = ll.seen
            ln.run()
            start, ll.rounds = ln.state, 2
        found = ll.run(start=start)
        self.warm[key] = ll.state
        if found:
            self.best_line = min(self.best_line, found[0][0])
        return found

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


def _check_exhaustive_size(lines: list, L: int, dp: int, mb: int):
    """Refuse an exhaustive search past EXHAUSTIVE_LINE_LIMIT / EXHAUSTIVE_TOTAL_LIMIT splits."""
    total = sum(math.comb(L - 1, len(sh) - 1) for sh in lines if len(sh) <= L)
    worst = max((math.comb(L - 1, len(sh) - 1) for sh in lines if len(sh) <= L), default=0)
    if worst > EXHAUSTIVE_LINE_LIMIT or total > EXHAUSTIVE_TOTAL_LIMIT:
        raise H2Error(f"exhaustive search would enumerate {total:,} layer splits (up to "
                      f"{worst:,} in one line, dp={dp} micro-batch={mb}); the limit is "
                      f"{EXHAUSTIVE_LINE_LIMIT:,} per line and {EXHAUSTIVE_TOTAL_LIMIT:,} "
                      f"in all", hint="use --search heuristic")


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
