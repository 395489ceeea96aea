"""HeteroAuto against a brute force over every plan the validator accepts, judged by the
simulator.

The brute force shares no code with the search and does not assume its plan space: on tiny
clusters it enumerates every plan `validate_plan` accepts for the dense model at the given
micro-batch and schedule — every data-parallel degree, every sequence of stages (any chip type
in any order, A-B-A-B included, each stage any tp dividing the heads, also across nodes), chips
left idle freely (a type used in part or not at all), every contiguous layer split, with dp > 1
every stage at zero=0 and at zero=1 (ZeRO-1), each combination its own plan — and simulates
each with `simulate` (every tp rank). Recomputation is chosen per stage as none when the stage
fits without it, else full: a stage's recompute changes only its own memory and backward time,
and full only adds time, so this choice loses no optimum. (Selective recomputation is outside
this enumeration: the analytic models keep the same bytes under it.)

Instances are "memory-tight small clusters": 2-3 chip types of 1-4 chips each (1-2 per node),
3-5 transformer blocks, a chip's memory 0.8-5 blocks of model state, random speeds and links,
seeded. HeteroAuto's plan must be within 1 % of the brute-force best on >= 95 % of them. The
default suite runs `DEFAULT` seeds; `-m slow` runs `SLOW`.
"""
import itertools
import math
import random

import pytest

from h2ir.clusters.cluster import ChipType, Cluster, NodeGroup
from h2ir.errors import H2Error
from h2ir.planner.resource import ResourceModel, analytic_llama_costs, stage_memory
from h2ir.planner.search import search
from h2ir.planner.simulate import simulate
from h2ir.planner.validate import validate_plan
from h2ir.plans.dsl import format_plan, parse_plan
from h2ir.plans.plan import Plan, StagePlan

# `find_seeds`: seeds of `instance` whose brute force had 1..600 plans (DEFAULT, the first 36)
# and 1..4,000 (SLOW, of seeds 0..399) before zero=1 joined it (it adds up to 2^S plans per
# split at dp > 1); listed because counting takes minutes. Nearly half the
# seeds have no plan at all (memory 0.8 block per chip is too little), which says how tight
# these clusters are.
DEFAULT = [0, 5, 8, 10, 15, 21, 26, 31, 34, 35, 36, 40, 41, 45, 46, 47, 49, 54, 59, 61, 64, 71,
    73, 74, 75, 76, 77, 78, 79, 81, 85, 88, 89, 93, 96, 99]
SLOW = [0, 5, 6, 7, 8, 9, 10, 11, 12, 15, 16, 21, 24, 26, 31, 32, 34, 35, 36, 40, 41, 45, 46, 47,
    49, 50, 54, 58, 59, 61, 64, 71, 73, 74, 75, 76, 77, 78, 79, 81, 83, 84, 85, 88, 89, 93, 96,
    99, 102, 105, 106, 107, 110, 112, 115, 116, 119, 120, 122, 123, 128, 129, 130, 132, 133, 134,
    135, 136, 138, 140, 141, 142, 144, 145, 147, 148, 149, 150, 152, 156, 159, 163, 165, 166, 168,
    170, 172, 173, 174, 175, 181, 182, 184, 186, 193, 195, 196, 199, 206, 208, 211, 214, 215, 217,
    218, 221, 222, 223, 225, 226, 228, 231, 232, 233, 234, 235, 237, 238, 242, 243, 245, 246, 247,
    248, 250, 251, 252, 253, 254, 256, 257, 258, 259, 260, 261, 262, 263, 264, 265, 269, 270, 272,
    273, 275, 277, 279, 280, 281, 285, 286, 287, 288, 289, 291, 292, 293, 294, 295, 297, 299, 300,
    303, 304, 306, 307, 309, 310, 311, 312, 313, 316, 317, 318, 319, 320, 321, 322, 324, 325, 327,
    328, 329, 331, 333, 336, 341, 342, 344, 345, 347, 348, 351, 352, 353, 354, 355, 357, 359, 360,
    362, 364, 365, 367, 369, 370, 371, 373, 374, 375, 376, 377, 379, 382, 383, 385, 386, 387, 388,
    389, 391, 392, 393, 395, 398, 399]


def instance(seed):
    rng = random.Random(seed)
    d = rng.choice([256, 512])
    ffn = d * rng.choice([2, 4])
    blocks = rng.randint(3, 5)
    heads = rng.choice([4, 8])
    costs = analytic_llama_costs("bf", blocks, d, heads, ffn, rng.choice([2048, 8192]),
                                 rng.choice([256, 512, 1024]), dtype_bytes=rng.choice([2, 4]))
    per_block = (4 * d * d + 3 * d * ffn) * 16
    k = rng.choice([2, 2, 3])
    chips, groups = {}, []
    for t in range(k):
        name = f"T{t}"
        n = rng.choice([1, 2, 2, 3, 4])
        chips[name] = ChipType(name, "cuda", "v", {"bf16": rng.uniform(10e12, 300e12)},
                               int(per_block * rng.uniform(0.8, 5)), rng.uniform(0.3e12, 3e12),
                               efficiency=rng.uniform(0.3, 0.7), mem_reserved_bytes=0,
                               mem_fragmentation=0.0)
        cpn = rng.choice([c for c in (1, 2) if n % c == 0])
        groups.append(NodeGroup(name, n // cpn, cpn, intra_bw=rng.uniform(20e9, 300e9),
                                nic_bw=rng.uniform(1e9, 25e9), nics_per_node=rng.choice([1, 2])))
    cluster = Cluster("bf", chips, tuple(groups), dtype="bf16")
    gb = rng.choice([4, 8])
    mb = rng.choice([1, 2])
    schedule = rng.choice(["1f1b", "1f1b", "gpipe"])
    return costs, cluster, gb, mb, schedule


# -- the brute force -------------------------------------------------------------------------

def lines(budget: dict, dp: int, heads: int, L: int):
    """Every sequence of (chip, tp) stages, 1..L long, whose chips (dp x tp each) fit `budget`."""
    tps = [t for t in range(1, heads + 1) if heads % t == 0]

    def rec(left, prefix):
        if prefix:
            yield tuple(prefix)
        if len(prefix) == L:
            return
        for c in sorted(left):
            for t in tps:
                if dp * t <= left[c]:
                    left[c] -= dp * t
                    prefix.append((c, t))
                    yield from rec(left, prefix)
                    prefix.pop()
                    left[c] += dp * t
    yield from rec(dict(budget), [])


def splits(L: int, S: int):
    """Every split of L layers into S non-empty contiguous ranges, as S+1 bounds."""
    def rec(a, j):
        if j == S - 1:
            yield (L,)
            return
        for b in range(a + 1, L - (S - 1 - j) + 1):
            for rest in rec(b, j + 1):
                yield (b,) + rest
    for ends in rec(0, 0):
        yield (0,) + ends


def brute_force(costs, cluster, gb, mb, schedule, count_only=False):
    """(best simulated step, its plan, plans the validator accepted)."""
    rm = ResourceModel(costs, cluster, mb, costs.seq_len)   # the simulator's costs, built once
    names = costs.layer_names()
    L = len(names)
    counts = {c: cluster.count(c) for c in cluster.chip_types if cluster.count(c)}
    best, best_plan, n = math.inf, None, 0
    for dp in range(1, gb // mb + 1):
        if gb % (dp * mb):
            continue
        for line in lines(counts, dp, costs.n_heads, L):
            S = len(line)
            for ends, zeros in itertools.product(splits(L, S),
                                                 itertools.product((0, 1) if dp > 1 else (0,),
                                                                   repeat=S)):
                stages = [StagePlan(c, dp * t, names[ends[j]:ends[j + 1]], tp=t, zero=z)
                          for j, ((c, t), z) in enumerate(zip(line, zeros))]
                plan = Plan("bf", "bf", gb, mb, costs.seq_len, stages, dp=dp, schedule=schedule)
                if not _recompute_where_needed(costs, plan, cluster):
                    continue
                try:
                    validate_plan(plan, costs, cluster)
                except H2Error:
                    continue
                n += 1
                if count_only:
                    continue
                t = simulate(costs, plan, cluster, record=False, resource=rm).step_time_s
                if t < best:
                    best, best_plan = t, plan
    return best, best_plan, n


def _recompute_where_needed(costs, plan, cluster) -> bool:
    for j, st in enumerate(plan.stages):
        for rc in ("none", "full"):
            st.recompute = rc
            mem = stage_memory(costs, plan, cluster, j)
            if mem.total <= mem.capacity:
                break
        else:
            return False
    return True


# -- the comparison --------------------------------------------------------------------------

def compare(seed):
    costs, cluster, gb, mb, schedule = instance(seed)
    best, best_plan, n = brute_force(costs, cluster, gb, mb, schedule)
    try:
        r = search(costs, cluster, gb, micro_batch=mb, schedule=schedule)
    except H2Error:
        assert n == 0, f"seed {seed}: the search found no plan, the brute force {n}"
        return None
    assert n > 0, f"seed {seed}: the search found a plan the brute force did not"
    validate_plan(r.plan, costs, cluster)     # the validator accepts what the search emits
    assert parse_plan(format_plan(r.plan)) == r.plan
    got = simulate(costs, r.plan, cluster, record=False).step_time_s   # the judge: every rank
    assert got == pytest.approx(r.best.step_time_s, rel=1e-9)
    assert got >= best * (1 - 1e-9), f"seed {seed}: the search beat the brute force"
    return got / best - 1, n, r, best_plan


def sweep(seeds):
    rows = []
    for s in seeds:
        res = compare(s)
        if res is not None:
            rows.append((s,) + res)
    return rows


def find_seeds(lo, hi, cap):
    """Seeds in [lo, hi) whose brute force accepts 1..cap plans."""
    out = []
    for s in range(lo, hi):
        costs, cluster, gb, mb, schedule = instance(s)
        if 0 < brute_force(costs, cluster, gb, mb, schedule, count_only=True)[2] <= cap:
            out.append(s)
    return out


def _tight(plan, cluster) -> bool:
    """The plan leaves chips idle or recomputes: memory shaped it."""
    used: dict = {}
    for st in plan.stages:
        used[st.chip] = used.get(st.chip, 0) + st.chips
    idle = any(used.get(c, 0) < cluster.count(c) for c in cluster.chip_types if cluster.count(c))
    return idle or any(st.recompute != "none" for st in plan.stages)


def _zero(plan) -> bool:
    return any(st.zero for st in plan.stages)


def report(rows) -> str:
    gaps = [g for _, g, *_ in rows]
    within = sum(g <= 0.01 for g in gaps)
    worst = max(rows, key=lambda r: r[1])
    tight = [r for r in rows if _tight(r[4], instance(r[0])[1])]
    return (f"{len(rows)} instances, {sum(r[2] for r in rows):,} validator-accepted plans "
            f"simulated; within 1 %: {within}/{len(rows)} ({within / len(rows):.1%}), exact: "
            f"{sum(g <= 1e-9 for g in gaps)}; {len(tight)} whose best plan leaves chips idle or "
            f"recomputes, {sum(r[1] <= 0.01 for r in tight)} of them within 1 %; "
            f"{sum(_zero(r[4]) for r in rows)} whose best plan uses ZeRO-1, the search's on "
            f"{sum(_zero(r[3].plan) for r in rows)}; the search "
            f"claimed `exact` on {sum(r[3].exact for r in rows)}; worst gap {worst[1]:.2%} "
            f"(seed {worst[0]})")


def check(rows):
    gaps = [g for _, g, *_ in rows]
    assert sum(g <= 0.01 for g in gaps) >= 0.95 * len(gaps), report(rows)


@pytest.mark.parametrize("part", range(2))
def test_heteroauto_is_within_1pct_of_every_validator_accepted_plan(part):
    rows = sweep(DEFAULT[part::2])      # two halves, one per xdist worker
    print("\n" + report(rows))
    check(rows)
    assert any(_zero(r[4]) for r in rows)       # ZeRO-1 is among the best plans


@pytest.mark.slow
def test_heteroauto_is_within_1pct_of_every_validator_accepted_plan_slow():
    rows = sweep(SLOW)
    print("\n" + report(rows))
    check(rows)


def test_the_brute_force_counts_what_it_enumerates():
    """By hand: one type of 2 chips (1 per node), 4 layers, 2 heads, dp 1 or 2, global 2.
    dp 1: lines (tp1), (tp2), (tp1, tp1) -> 1 + 1 + 3 splits; dp 2: (tp1) -> 1 split at zero=0
    and at zero=1; all fit."""
    costs = analytic_llama_costs("bf", 2, 64, 2, 128, 256, 16, dtype_bytes=2)
    chip = ChipType("A", "cuda", "v", {"bf16": 1e14}, 2 ** 40, 1e12, mem_reserved_bytes=0,
                    mem_fragmentation=0.0)
    cl = Cluster("one", {"A": chip}, (NodeGroup("A", 2, 1, intra_bw=1e11),))
    assert brute_force(costs, cl, 2, 1, "1f1b", count_only=True)[2] == 7
    assert len(list(splits(5, 3))) == math.comb(4, 2)
