"""The search's lower bound (`step_lower_bound`) never exceeds the simulated step, on random
plans and clusters; the simulator's one-rank fast path equals the full simulation."""
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from h2ir.clusters.cluster import ChipType, Cluster, NodeGroup
from h2ir.planner.resource import analytic_llama_costs
from h2ir.planner.search import Config, StageLine
from h2ir.planner.simulate import simulate

GiB = 2 ** 30


def chip(name, rng):
    return ChipType(name, "cuda", "v", {"bf16": rng.uniform(5e12, 200e12)}, 1000 * GiB,
                    rng.uniform(0.3e12, 3e12), mem_reserved_bytes=0, mem_fragmentation=0.0)


def random_case(seed):
    """A random line of stages over 1-3 chip types, a random split, dp, tp, m and schedule."""
    rng = random.Random(seed)
    d = rng.choice([256, 512, 1024])
    costs = analytic_llama_costs("r", rng.randint(3, 12), d, 8, d * rng.choice([2, 4]), 4096,
                                 rng.choice([64, 256, 1024]), dtype_bytes=2)
    L = len(costs.layers)
    types = [f"T{i}" for i in range(rng.randint(1, 3))]
    chips = {t: chip(t, rng) for t in types}
    groups = tuple(NodeGroup(t, rng.choice([1, 2, 4]), rng.choice([1, 2, 4, 8]),
                             intra_bw=rng.uniform(1e9, 300e9), nic_bw=rng.uniform(0.5e9, 50e9),
                             nics_per_node=rng.choice([1, 2]),
                             intra_latency=rng.uniform(0, 2e-5), inter_latency=rng.uniform(0, 5e-5))
                   for t in types)
    cluster = Cluster("r", chips, groups, dtype="bf16")
    S = rng.randint(1, min(L, 6))
    dp = rng.choice([1, 1, 2, 4])
    shapes = []
    for _ in range(S):
        t = rng.choice(types)
        cpn = next(g.chips_per_node for g in groups if g.chip == t)
        shapes.append((t, rng.choice([x for x in (1, 2, 4, 8) if x <= cpn])))
    cuts = sorted(rng.sample(range(1, L), S - 1))
    ends = [0] + cuts + [L]
    m = rng.choice([1, 2, 3, 4, 8, 16])
    mb = rng.choice([1, 2])
    schedule = rng.choice(["1f1b", "gpipe"])
    return costs, cluster, shapes, ends, dp, m, mb, schedule


def line_and_plan(costs, cluster, shapes, ends, dp, m, mb, schedule, zero=True):
    from h2ir.planner.resource import ResourceModel
    rm = ResourceModel(costs, cluster, mb, costs.seq_len)
    counts = tuple(sorted({c: cluster.count(c) for c in cluster.chip_types}.items()))
    cfg = Config(dp, mb, m, (), (), counts, tuple(shapes), schedule)
    line = StageLine(rm, cfg, schedule, 1, "flat", zero=zero)
    plan = line.plan(ends, "r", cluster, m * dp * mb, costs.seq_len, None)
    return rm, line, plan


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.integers(0, 10 ** 9))
def test_lower_bound_never_exceeds_the_simulated_step(seed):
    costs, cluster, shapes, ends, dp, m, mb, schedule = random_case(seed)
    rm, line, plan = line_and_plan(costs, cluster, shapes, ends, dp, m, mb, schedule)
    e = line.estimate(ends)
    assert e is not None                     # 1000 GiB chips: every split fits
    sim = simulate(costs, plan, cluster, resource=rm)
    assert e[0] <= sim.step_time_s * (1 + 1e-9), (e[0], sim.step_time_s, shapes, ends, dp, m, schedule)


@pytest.mark.parametrize("seed", range(40))
def test_lower_bound_holds_with_and_without_zero(seed):
    """At dp > 1 the line's plans take ZeRO-1 (its reduce-scatter + all-gather move what the
    all-reduce did, and the optimizer step is 1/dp): the bound, whose tails are the
    resource model's for the zero each stage takes, stays under the simulated step, at zero=1
    and with the dimension switched off, and the sharded plan simulates no slower."""
    costs, cluster, shapes, ends, _, m, mb, schedule = random_case(seed)
    steps = {}
    for zero in (True, False):
        rm, line, plan = line_and_plan(costs, cluster, shapes, ends, 2, m, mb, schedule, zero)
        assert [s.zero for s in plan.stages] == [int(zero)] * len(shapes)
        e = line.estimate(ends)
        steps[zero] = simulate(costs, plan, cluster, resource=rm).step_time_s
        assert e[0] <= steps[zero] * (1 + 1e-9), (e[0], steps[zero], shapes, ends, m, schedule)
    assert steps[True] <= steps[False] * (1 + 1e-9)


def test_lower_bound_is_tight_for_equal_stages():
    """Equal stages, free links: the bound is the textbook (m + S - 1)(f + b) + tail."""
    x = ChipType("X", "cuda", "v", {"bf16": 1e14}, 1000 * GiB, 1e18, mem_reserved_bytes=0,
                 mem_fragmentation=0.0)
    cl = Cluster("t", {"X": x}, (NodeGroup("X", 1, 8, intra_bw=1e18, nic_bw=1e18, intra_latency=0,
                                           inter_latency=0),), dtype="bf16")
    import dataclasses
    c = analytic_llama_costs("m", 8, 512, 8, 2048, 4000, 256, dtype_bytes=2)
    c = dataclasses.replace(c, layers=tuple(l for l in c.layers if l.kind == "transformer_block"))
    for schedule in ("1f1b", "gpipe"):
        rm, line, plan = line_and_plan(c, cl, [("X", 1)] * 4, [0, 2, 4, 6, 8], 1, 8, 1, schedule)
        sim = simulate(c, plan, cl, resource=rm)
        assert line.estimate([0, 2, 4, 6, 8])[0] == pytest.approx(sim.step_time_s, rel=1e-6)


@pytest.mark.parametrize("seed", range(25))
def test_one_rank_simulation_equals_every_rank(seed):
    costs, cluster, shapes, ends, dp, m, mb, schedule = random_case(seed)
    rm, line, plan = line_and_plan(costs, cluster, shapes, ends, dp, m, mb, schedule)
    full = simulate(costs, plan, cluster, resource=rm)
    one = simulate(costs, plan, cluster, resource=rm, one_rank=True)
    assert one.step_time_s == pytest.approx(full.step_time_s, rel=1e-12)
    assert [x.total for x in one.stage_memory] == [x.total for x in full.stage_memory]
