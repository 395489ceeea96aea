"""HeteroAuto against an independent brute force over a part of its plan space, judged by the
simulator, on mid-sized instances.

The brute force below shares no code with the search: it enumerates every plan of the space
HeteroAuto searched before it learned to use a chip type in part (docs/planning.md, "The plan
space", less partial use, lower-tp-first sequences and TP across nodes) directly — dp, each chip
type's stage sequence (one tp, or a higher tp on its first stages and a lower one on the rest;
chips beyond a whole stage, or a whole type, idle), every order of the types' blocks with at
most one type cut into two blocks (A-B-A), every contiguous layer split, recomputation only
where a stage does not fit otherwise, zero=0 — checks each stage's memory with `stage_memory` and
simulates every plan that fits with `simulate` (every tp rank). HeteroAuto's chosen plan must be
within 1 % of (or better than: its space is larger, ZeRO-1 included) the best on >= 95 % of the
instances and
never more than 5 % slower. The whole space — every plan the validator accepts — is checked on
tiny clusters in tests/test_planner_bruteforce.py (it is too large to enumerate here).

Instances: 2-3 chip types, 8-32 chips, 8-16 layers, random speeds, memory, node shapes and
links, seeded. Seeds whose space holds more than MAX_PLANS plans are skipped (the brute force
must simulate each); the first N under the cap are used. The default suite runs a few; the
full set (>= 40) runs under `-m slow`.
"""
import itertools
import math
import random

import pytest

from h2ir.clusters.cluster import ChipType, Cluster, NodeGroup
from h2ir.errors import H2Error
from h2ir.planner.resource import analytic_llama_costs, stage_memory
from h2ir.planner.search import search
from h2ir.planner.simulate import simulate
from h2ir.planner.validate import validate_plan
from h2ir.plans.dsl import format_plan, parse_plan
from h2ir.plans.plan import Plan, StagePlan

MAX_PLANS = 2500


def instance(seed):
    rng = random.Random(seed)
    d = rng.choice([256, 512])
    ffn = d * rng.choice([2, 4])
    L = rng.randint(8, 16)
    seq = rng.choice([128, 256, 512])
    costs = analytic_llama_costs("bf", L - 2, d, 8, ffn, 4096, seq, dtype_bytes=2)
    per_block = (4 * d * d + 3 * d * ffn) * 16
    k = rng.randint(2, 3)
    while True:
        n = [rng.choice([2, 4, 4, 8, 8, 16]) for _ in range(k)]
        if 8 <= sum(n) <= 32:
            break
    chips, groups = {}, []
    for t in range(k):
        name = f"T{t}"
        chips[name] = ChipType(name, "cuda", "v", {"bf16": rng.uniform(10e12, 200e12)},
                               int(per_block * rng.uniform(1.5, 8)), rng.uniform(0.5e12, 3e12),
                               efficiency=rng.uniform(0.3, 0.6), mem_reserved_bytes=0,
                               mem_fragmentation=0.0)
        cpn = rng.choice([c for c in (2, 4, 8) if n[t] % c == 0])
        groups.append(NodeGroup(name, n[t] // cpn, cpn, intra_bw=rng.uniform(20e9, 300e9),
                                nic_bw=rng.uniform(1e9, 25e9), nics_per_node=rng.choice([1, 2])))
    cluster = Cluster("bf", chips, tuple(groups), dtype="bf16")
    gb = rng.choice([8, 16])
    mb = rng.choice([1, 2])
    schedule = rng.choice(["1f1b", "1f1b", "gpipe", "auto"])
    return costs, cluster, gb, mb, schedule


# -- the brute force -------------------------------------------------------------------------

def sequences(B, cpn, heads, L):
    """A type's stage tp sequences with B chips per replica."""
    tps = [t for t in range(1, cpn + 1) if cpn % t == 0 and heads % t == 0 and t <= B]
    out = {(t,) * min(B // t, L) for t in tps if B // t >= 1}
    for t1 in tps:
        for t2 in tps:
            if t2 >= t1:
                continue
            h = 1
            while B - h * t1 >= t2:
                seq = (t1,) * h + (t2,) * ((B - h * t1) // t2)
                if len(seq) <= L:
                    out.add(seq)
                h += 1
    return out


def lines(per_type, L):
    """Every line of stages: a sequence (or nothing) per type, blocks in any order, at most one
    type cut into two blocks, its first part first."""
    out = set()
    types = sorted(per_type)
    for pick in itertools.product(*[sorted(per_type[t]) + [None] for t in types]):
        used = [(t, s) for t, s in zip(types, pick) if s is not None]
        if not used or sum(len(s) for _, s in used) > L:
            continue
        options = [[(t, s, 0) for t, s in used]]
        for i, (t, s) in enumerate(used):
            for cut in range(1, len(s)):
                options.append([(u, q, 0) for j, (u, q) in enumerate(used) if j != i]
                               + [(t, s[:cut], 1), (t, s[cut:], 2)])
        for blocks in options:
            for perm in itertools.permutations(blocks):
                pos = {(t, part): i for i, (t, _, part) in enumerate(perm)}
                if any(part == 2 and pos[(t, 1)] > i for (t, part), i in pos.items()):
                    continue
                out.add(tuple((t, tp) for t, s, _ in perm for tp in s))
    return out


class _TooMany(Exception):
    pass


def brute_force(costs, cluster, gb, mb, schedules, count_only=False, cap=None):
    """(best simulated step, plans that fit); with `count_only`, no simulation; past `cap`
    plans, (inf, cap + 1)."""
    try:
        return _brute_force(costs, cluster, gb, mb, schedules, count_only, cap)
    except _TooMany:
        return math.inf, cap + 1


def _brute_force(costs, cluster, gb, mb, schedules, count_only, cap):
    names = costs.layer_names()
    L = len(names)
    counts = {c: cluster.count(c) for c in cluster.chip_types if cluster.count(c)}
    best, n = math.inf, 0
    for schedule in schedules:
        for dp in range(1, gb // mb + 1):
            if gb % (dp * mb):
                continue
            per_type = {}
            for c, have in counts.items():
                cpn = max(g.chips_per_node for g in cluster.groups if g.chip == c)
                seqs = sequences(have // dp, cpn, costs.n_heads, L)
                if seqs:
                    per_type[c] = seqs
            if not per_type:
                continue
            for shapes in lines(per_type, L):
                S = len(shapes)
                stages = [StagePlan(c, dp * t, [names[0]], tp=t) for c, t in shapes]
                plan = Plan("bf", "bf", gb, mb, costs.seq_len, stages, dp=dp, schedule=schedule)

                def fits(j):
                    for rc in ("none", "full"):
                        plan.stages[j].recompute = rc
                        mem = stage_memory(costs, plan, cluster, j)
                        if mem.total <= mem.capacity:
                            return True
                    return False

                def split(j, a):
                    nonlocal best, n
                    ends = [L] if j == S - 1 else range(a + 1, L - (S - 1 - j) + 1)
                    for b in ends:
                        plan.stages[j].layers = names[a:b]
                        if not fits(j):
                            continue
                        if j < S - 1:
                            split(j + 1, b)
                            continue
                        n += 1
                        if cap is not None and n > cap:
                            raise _TooMany
                        if not count_only:
                            t = simulate(costs, plan, cluster, record=False).step_time_s
                            best = min(best, t)
                split(0, 0)
    return best, n


# -- the comparison --------------------------------------------------------------------------

# `find_seeds(45)`: the first seeds whose space has 1..MAX_PLANS plans (finding them takes ~10
# minutes, so they are listed; the space of the other seeds is too large to brute-force)
SEEDS = [20, 22, 31, 32, 74, 95, 149, 163, 170, 188, 189, 190, 206, 207, 212, 252, 255, 277, 279,
         290, 309, 312, 341, 353, 357, 358, 367, 373, 381, 387, 399, 404, 422, 441, 455, 465, 468,
         472, 504, 538, 562, 609, 615, 619, 633]


def seeds(how_many):
    return SEEDS[:how_many]


def find_seeds(how_many):
    out, seed = [], 0
    while len(out) < how_many:
        costs, cluster, gb, mb, schedule = instance(seed)
        _, n = brute_force(costs, cluster, gb, mb, _schedules(schedule), count_only=True,
                           cap=MAX_PLANS)
        if 0 < n <= MAX_PLANS:
            out.append(seed)
        seed += 1
    return out


def _schedules(schedule):
    return ("1f1b", "gpipe") if schedule == "auto" else (schedule,)


def compare(seed):
    """(gap, plans simulated), or None for an instance where nothing fits (the seeds were
    listed under an earlier memory model: TP without sequence parallelism keeps more)."""
    costs, cluster, gb, mb, schedule = instance(seed)
    best, n = brute_force(costs, cluster, gb, mb, _schedules(schedule))
    if n == 0:
        try:
            search(costs, cluster, gb, micro_batch=mb, schedule=schedule)
        except H2Error:
            return None
    r = search(costs, cluster, gb, micro_batch=mb, schedule=schedule)
    validate_plan(r.plan, costs, cluster)     # the validator accepts what the search emits
    assert parse_plan(format_plan(r.plan)) == r.plan
    full = simulate(costs, r.plan, cluster, record=False).step_time_s   # the judge: every rank
    assert full == pytest.approx(r.best.step_time_s, rel=1e-9)
    # (below 0: a plan outside the brute force's part of the space, e.g. a type used in part)
    return full / best - 1, n


def check(gaps):
    within = sum(g <= 0.01 for g in gaps)
    assert within >= 0.95 * len(gaps), f"{within}/{len(gaps)} within 1% (gaps {sorted(gaps)[-5:]})"
    assert max(gaps) <= 0.05, f"worst gap {max(gaps):.1%}"


def test_heteroauto_is_the_brute_force_optimum_on_small_instances():
    gaps = [c[0] for c in map(compare, seeds(4)) if c is not None]
    check(gaps)


@pytest.mark.slow
def test_heteroauto_is_the_brute_force_optimum_on_45_instances():
    rows = [(s, *c) for s, c in ((s, compare(s)) for s in seeds(45)) if c is not None]
    gaps = [g for _, g, _ in rows]
    print(f"\n{len(rows)} instances, {sum(n for *_, n in rows):,} plans simulated; within 1%: "
          f"{sum(g <= 0.01 for g in gaps)}, exact: {sum(abs(g) <= 1e-9 for g in gaps)}, "
          f"better: {sum(g < -1e-9 for g in gaps)}, mean gap {sum(gaps) / len(gaps):.3%}, "
          f"worst {max(gaps):.3%}")
    check(gaps)


def test_brute_force_counts_what_it_enumerates():
    """A hand-countable case: one type of 2 chips (2 per node), 8 layers, dp 1 or 2."""
    costs = analytic_llama_costs("bf", 6, 256, 8, 512, 4096, 128, dtype_bytes=2)
    chip = ChipType("A", "cuda", "v", {"bf16": 1e14}, 2 ** 40, 1e12, mem_reserved_bytes=0,
                    mem_fragmentation=0.0)
    cl = Cluster("one", {"A": chip}, (NodeGroup("A", 1, 2, intra_bw=1e11),))
    # dp 1: (1, 1) -> 7 splits, (2,) -> 1; dp 2: (1,) -> 1; mixed (2, 1) needs 3 chips
    assert brute_force(costs, cl, 2, 1, ("1f1b",), count_only=True)[1] == 9
    with pytest.raises(H2Error):
        search(costs, Cluster("none", {"A": chip}, ()), 2)
