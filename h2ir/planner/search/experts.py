"""Expert parallelism in the search: the EP degrees a chip type may take, whether a line's EP
groups stay inside a host, the chips a node-local group can use, and flat vs HALO all-to-all."""
from __future__ import annotations

import math

from h2ir.clusters.cluster import Cluster
from h2ir.costs import ModelCosts
from h2ir.plans.plan import MoEPlan
from h2ir.planner.divisors import divisors
from h2ir.planner.resource import (ResourceModel, default_ep_geometry, dtype_bytes, ep_groups,
                                   moe_a2a_pass_time)
from h2ir.planner.search.bound import config_bound
from h2ir.planner.search.space import PlanSpace
from h2ir.schedule.streams import WorkerLayout, worker_hosts


def moe_layers(costs: ModelCosts):
    return [l for l in costs.layers if l.moe is not None]


def _expert_gcd(costs: ModelCosts) -> int:
    """The gcd of the MoE layers' expert counts (0 without MoE layers): an EP degree divides it."""
    g = 0
    for l in moe_layers(costs):
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
    ok = _ep_fits_node(cluster, shapes, dp, per)
    if ok and not _ep_aligned(cluster, shapes, dp, per):
        ok = _ep_on_one_host(cluster, shapes, dp, per)
    _EP_LOCAL[key] = (cluster, ok)
    return ok


def _chips_used(shapes) -> dict:
    """A replica's chips of each type on the line."""
    used: dict = {}
    for c, t in shapes:
        used[c] = used.get(c, 0) + t
    return used


def _ep_fits_node(cluster: Cluster, shapes, dp: int, per: list) -> bool:
    """Necessary for node-local EP groups: a group's members are a replica's chips of the type
    apart, so ep of them must span at most one node."""
    used = _chips_used(shapes)
    return all(dp % e == 0 and (e - 1) * used[c] + t <= _chips_per_node(cluster, c)
               for (c, t), e in zip(shapes, per) if e > 1)


def _ep_aligned(cluster: Cluster, shapes, dp: int, per: list) -> bool:
    """Sufficient: replica r's chips of a type are the type's chips r*used .. (worker_hosts
    numbers them from the first of its nodes), so when ep * used divides every chips-per-node
    of the type, a group's ep replicas fill one aligned block of a node."""
    used = _chips_used(shapes)
    return all(dp * used[c] <= cluster.count(c)
               and all(g.chips_per_node % (e * used[c]) == 0 for g in cluster.groups_of(c))
               for (c, _), e in zip(shapes, per) if e > 1)


def _ep_on_one_host(cluster: Cluster, shapes, dp: int, per: list) -> bool:
    """Every EP group's workers on one host, on the hosts the build gives them."""
    lay = WorkerLayout(dp, tuple(t for _, t in shapes))
    hosts = worker_hosts(lay, [c for c, _ in shapes], cluster)
    return all(len({hosts[w] for w in grp}) == 1
               for j, e in enumerate(per) if e > 1
               for k in range(lay.tps[j]) for grp in ep_groups(lay, j, e, k))


def _chips_per_node(cluster: Cluster, chip: str) -> int:
    return max(g.chips_per_node for g in cluster.groups_of(chip))


def node_aligned_eps(cluster: Cluster, chip: str, per_replica: int, opts: list[int]) -> list[int]:
    """The EP degrees whose groups are node-local when a type's `per_replica` chips are all used:
    ep consecutive replicas fill whole chips of a node and never straddle two (ep * per_replica
    divides every node group's chips per node; worker_hosts numbers a type's chips from 0)."""
    return [e for e in opts if e == 1 or ep_budget(cluster, chip, per_replica, e) == per_replica] or [1]


def ep_budget(cluster: Cluster, chip: str, per_replica: int, ep: int) -> int:
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


def a2a_choice(rm: ResourceModel, cluster: Cluster, eps: dict, tps: dict) -> str:
    """flat or HALO, whichever `moe_a2a_pass_time` says is faster summed over the chip types (at
    the geometry of consecutive replicas; on one node both are the flat all-to-all)."""
    moes = moe_layers(rm.costs)
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


def moe_plan(costs: ModelCosts, eps: dict, a2a: str = "flat") -> MoEPlan | None:
    """The moe section for EP degrees per chip type: its ep is the most common degree (the
    stages of other degrees say their own `ep=`)."""
    if not moe_layers(costs):
        return None
    vals = list(eps.values()) or [1]
    ep = max(set(vals), key=lambda e: (vals.count(e), e))
    return MoEPlan(ep=ep, a2a=a2a if ep > 1 or any(v > 1 for v in vals) else "flat")


def eps_key(eps: dict) -> tuple:
    return tuple(sorted(eps.items()))


def ep_degree_options(cluster: Cluster, costs: ModelCosts, space: PlanSpace, dp: int,
                      budgets: dict, tps: dict, max_ep: int | None) -> tuple[dict, dict]:
    """({chip: EP degrees to search}, {chip: those that keep all of the type's chips}): with
    node-local groups, `full` holds the degrees whose groups are node-local with every chip of
    the replica's share, and (with `idle`) `opts` also those where only some chips can be
    (`ep_budget`: the configuration then uses only those, the rest idle)."""
    loc = space.ep_local
    opts = {c: ep_options(cluster, costs, dp, c, tps[c], max_ep, loc) for c in budgets}
    full = opts
    if loc:
        full = {c: node_aligned_eps(cluster, c, B, opts[c]) for c, B in budgets.items()}
    if loc and space.idle:
        opts = {c: [e for e in opts[c] if any(t <= ep_budget(cluster, c, B, e) for t in tps[c])]
                or [1] for c, B in budgets.items()}
    else:
        opts = full
    return opts, full


def ep_type_budgets(cluster: Cluster, space: PlanSpace, budgets: dict, tps: dict,
                    eps: dict) -> tuple[dict, dict]:
    """Each type's chips per replica and tp options under EP degrees `eps`: with node-local
    groups, only the chips `ep_budget` allows (the rest idle), and tp at most those."""
    if not (space.ep_local and space.idle) or not eps:
        return budgets, tps
    bud, tpe = {}, {}
    for c, B in budgets.items():
        b = ep_budget(cluster, c, B, eps.get(c, 1))
        ts = [t for t in tps[c] if t <= b]
        if ts:
            bud[c], tpe[c] = b, ts
    return bud, tpe


def ep_assignments(rm: ResourceModel, costs: ModelCosts, space: PlanSpace, budgets: dict,
                   tps: dict, dp: int, m: int, sched: str, opts: dict, full: dict,
                   zero_dp: int) -> tuple[list, bool]:
    """(EP degrees per chip type to search, whether they are sampled rather than every
    assignment), each its own configuration with its own bound: every degree common to all
    types (homogeneous EP), each type's largest (of `opts`, and of `full`), and with
    `mixed_ep` the assignment a coordinate descent picks on the configuration bound taken at a
    typical 1F1B in-flight count (half the stages), where memory speaks as well as the
    all-to-all: a type with room for its experts keeps a small EP, a tight one a large."""
    if not moe_layers(costs):
        return [{}], False
    out = [{c: e for c in budgets} for e in sorted(set.intersection(*map(set, opts.values())))]
    sampled = False
    if space.mixed_ep and len(budgets) > 1:
        out.append({c: max(o) for c, o in full.items()})
        out.append({c: max(o) for c, o in opts.items()})
        out.append(_descend_eps(rm, space, budgets, tps, m, sched, opts, zero_dp))
        sampled = math.prod(len(o) for o in opts.values()) > len({eps_key(e) for e in out})
    seen, uniq = set(), []
    for eps in out:
        if eps_key(eps) not in seen:
            seen.add(eps_key(eps))
            uniq.append(eps)
    return uniq, sampled


def _descend_eps(rm: ResourceModel, space: PlanSpace, budgets: dict, tps: dict, m: int,
                 sched: str, opts: dict, zero_dp: int) -> dict:
    """Two rounds of coordinate descent over each type's EP degree on `config_bound` (ties:
    the larger degree)."""
    S = sum(B // min(tps[c]) for c, B in budgets.items())
    infl = m if sched == "gpipe" else max(1, min(m, S // 2))
    memo: dict = {}

    def score(eps):
        k = eps_key(eps)
        if k not in memo:
            memo[k] = config_bound(rm, rm.cluster, *ep_type_budgets(rm.cluster, space, budgets,
                                                                     tps, eps),
                                   m, sched, eps, "flat", infl, zero_dp)
        return memo[k]
    cur = {c: max(o) for c, o in opts.items()}
    for _ in range(2):
        for c in sorted(opts):
            cur[c] = min(opts[c], key=lambda e: (score({**cur, c: e}), -e))
    return dict(cur)
