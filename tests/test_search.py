"""HeteroAuto search, uniform baseline, HeteroSpeedupRatio and `h2c plan`."""
import itertools
import json
import math
import random

import pytest

from h2ir.clusters.cluster import ChipType, Cluster, NodeGroup
from h2ir.costs import MoEInfo
from h2ir.errors import H2Error
from h2ir.planner.resource import ResourceModel, analytic_llama_costs, stage_memory
from h2ir.planner.limits import REL_TOL
from h2ir.planner.search import (Config, PlanSpace, StageLine, chip_counts, hetero_speedup,
                                 memory_orders, search, share_batch, uniform_plan)
from h2ir.planner.search.space import tp_configurations
from h2ir.planner.validate import validate_plan

GiB = 2 ** 30
# small random chips: no runtime reserve or fragmentation, so memory is what the instance says
NO_HEADROOM = {"mem_reserved_bytes": 0, "mem_fragmentation": 0.0}


def costs_100b():
    # H2's evaluation model: 96 blocks, d 8192, 64 heads, SwiGLU 36864, seq 4096, vocab 32000
    return analytic_llama_costs("llama_100b", 96, 8192, 64, 36864, 32000, 4096)


def check_plan_is_sound(plan, costs, cluster):
    names = costs.layer_names()
    assigned = [n for s in plan.stages for n in s.layers]
    assert assigned == names                                  # every layer once, in order
    used = {}
    for s in plan.stages:
        assert s.chips == plan.dp * s.tp
        used[s.chip] = used.get(s.chip, 0) + s.chips
    have = chip_counts(cluster)
    assert all(n <= have[c] for c, n in used.items())         # chips may stay idle
    validate_plan(plan, costs, cluster)
    for j in range(plan.num_stages):
        m = stage_memory(costs, plan, cluster, j)
        assert m.total <= m.capacity, (j, str(m))


def test_100b_on_h2_1024_fits_and_assigns_every_layer_once():
    from h2ir.clusters.clusterfile import load_cluster
    from h2ir.plans.dsl import format_plan, parse_plan
    from h2ir.planner.validate import validate_plan
    cluster = load_cluster("h2-1024")
    costs = costs_100b()
    r = search(costs, cluster, 1024)
    check_plan_is_sound(r.plan, costs, cluster)
    validate_plan(r.plan, costs, cluster)
    assert parse_plan(format_plan(r.plan)) == r.plan
    assert r.sim.fits and r.sim.step_time_s > 0
    # auto beats the uniform split and is never predicted slower than anything it ranked
    assert r.uniform is not None and r.best.step_time_s < r.uniform.step_time_s
    assert all(r.best.step_time_s <= c.step_time_s for c in r.runner_ups)
    # coordinate descent over lines proves nothing: exact is false, and the bound it reports
    # is below the chosen plan
    proof = r.proof()
    assert r.lines > 1 and proof["search"] == "coordinate-descent" and not r.exact
    assert proof["lower_bound_s"] < r.best.step_time_s and proof["gap_to_bound"] > 0


# -- heuristic vs exhaustive on small random instances ------------------------------------------

def random_instance(seed):
    rng = random.Random(seed)
    d = rng.choice([256, 512, 1024])
    ffn = d * rng.choice([2, 3, 4])
    costs = analytic_llama_costs("rand", rng.randint(4, 16), d, 8, ffn, 4096,
                                 rng.choice([128, 256, 512]), dtype_bytes=2)
    per_block = (4 * d * d + 3 * d * ffn) * 16
    chips, groups = {}, []
    for t in range(rng.randint(1, 3)):
        name = f"T{t}"
        chips[name] = ChipType(name, "cuda", "v", {"bf16": rng.uniform(10e12, 100e12)},
                               int(per_block * rng.uniform(4, 16)), rng.uniform(0.5e12, 3e12),
                               efficiency=rng.uniform(0.3, 0.6), **NO_HEADROOM)
        n = rng.choice([1, 2, 2, 4])
        cpn = rng.choice([1, 2, 4])
        cpn = min(cpn, n) if n % min(cpn, n) == 0 else 1
        groups.append(NodeGroup(name, n // cpn, cpn, intra_bw=rng.uniform(20e9, 200e9),
                                nic_bw=rng.uniform(5e9, 25e9)))
    return costs, Cluster("rand", chips, tuple(groups), dtype="bf16"), rng.choice([4, 8, 16])


# the space of the earlier HeteroAuto (one tp per type, every chip used, one block per type); the
# wider space is checked against an independent brute force in tests/test_search_optimality.py
NARROW = PlanSpace(idle=False, mixed_tp=False, split_types=False)


@pytest.mark.slow          # ~11 s; tests/test_search_optimality.py covers the same by default
def test_heteroauto_matches_exhaustive_on_random_small_instances():
    """The DFS on the lower bound and the exhaustive evaluation of every split end at the same
    simulated step (both rank their candidates by simulation)."""
    within = total = 0
    for seed in range(64):
        costs, cluster, gb = random_instance(seed)
        assert len(costs.layers) <= 24 and len(cluster.chip_types) <= 3
        try:
            h = search(costs, cluster, gb, space=NARROW)
        except H2Error:
            continue                                  # nothing fits: both searches agree below
        x = search(costs, cluster, gb, method="exhaustive", space=NARROW)
        total += 1
        within += h.best.step_time_s <= 1.01 * x.best.step_time_s
        assert h.uniform is None or h.best.step_time_s <= h.uniform.step_time_s
        check_plan_is_sound(h.plan, costs, cluster)
    assert total >= 50
    assert within >= 0.95 * total, f"{within}/{total} within 1% of exhaustive"


def test_dfs_finds_the_estimate_optimum_of_each_line():
    """Branch and bound is exact for the closed-form estimate (up to REL_TOL)."""
    checked = 0
    for seed in range(40):
        costs, cluster, gb = random_instance(seed)
        cfgs, counts = tp_configurations(costs, cluster, gb, [1], "1f1b")
        for mb, dp, m, tps in cfgs[:2]:
            rm = ResourceModel(costs, cluster, mb, costs.seq_len)
            for order in memory_orders(cluster, list(counts))[:2]:
                line = StageLine(rm, Config(dp, mb, m, tps, order, tuple(sorted(counts.items()))),
                                 "1f1b", 1, "flat")
                every = line.all_splits(1)
                found, _ = line.best_split()
                assert bool(every) == bool(found)
                if every:
                    assert found[0][0] <= every[0][0] * (1 + 2 * REL_TOL)
                    checked += 1
    assert checked >= 20


def test_exhaustive_refuses_huge_instances():
    cluster = Cluster("c", {"A": ChipType("A", "cuda", "v", {"bf16": 1e14}, 80 * GiB, 2e12)},
                      (NodeGroup("A", 4, 8, intra_bw=1e11),), dtype="bf16")
    costs = analytic_llama_costs("m", 60, 512, 8, 2048, 4000, 128, dtype_bytes=2)
    with pytest.raises(H2Error, match="heuristic"):
        search(costs, cluster, 32, method="exhaustive", dp_options=[1])


def test_orders_put_larger_memory_first_then_every_permutation():
    costs, cluster, _ = random_instance(3)
    cl = Cluster("c", {"s": ChipType("s", "cuda", "v", {"bf16": 1e14}, 10 * GiB, 1e12),
                       "b": ChipType("b", "cuda", "v", {"bf16": 1e14}, 90 * GiB, 1e12),
                       "m": ChipType("m", "cuda", "v", {"bf16": 1e14}, 40 * GiB, 1e12)},
                 tuple(NodeGroup(c, 1, 1, intra_bw=1e11) for c in "sbm"))
    orders = memory_orders(cl, ["s", "b", "m"])
    assert orders[0] == ("b", "m", "s")
    assert sorted(orders) == sorted(itertools.permutations("bms"))


def two_type_cluster(same=False):
    a = ChipType("A", "cuda", "v", {"bf16": 300e12}, 80 * GiB, 2e12)
    b = ChipType("B", "cuda", "v", {"bf16": (300e12 if same else 120e12)}, (80 if same else 96) * GiB, 2e12)
    g = lambda c: NodeGroup(c, 2, 4, intra_bw=200e9, nics_per_node=2, nic_bw=25e9)
    return Cluster("two", {"A": a, "B": b}, (g("A"), g("B")), dtype="bf16")


def test_uniform_plan_splits_blocks_evenly():
    costs = analytic_llama_costs("m", 10, 1024, 8, 4096, 8000, 512, dtype_bytes=2)
    cand = uniform_plan(costs, two_type_cluster(), 16)
    counts = [sum(n.startswith("block.") for n in s.layers) for s in cand.plan.stages]
    assert max(counts) - min(counts) <= 1
    assert cand.plan.stages[0].layers[0] == "embed" and cand.plan.stages[-1].layers[-1] == "head"
    assert len({s.tp for s in cand.plan.stages}) == 1


def test_hetero_speedup_ratio_is_throughput_over_sum_of_homogeneous():
    costs = analytic_llama_costs("m", 8, 1024, 8, 4096, 8000, 512, dtype_bytes=2)
    cl = two_type_cluster()
    r = search(costs, cl, 16)
    sp = hetero_speedup(costs, cl, r.best)
    homo = sum(h["tokens_per_s"] for h in sp.homo.values())
    assert sp.ratio == pytest.approx(r.best.tokens_per_s / homo)
    assert {h["global_batch"] for h in sp.homo.values()} == {8}          # proportional to chips
    assert {h["global_batch"] for h in sp.homo_const.values()} == {16}
    # two identical chip types: the mixed cluster is a bigger homogeneous one, except that the
    # two node groups talk over NICs (each homogeneous run keeps its links inside its nodes)
    same = two_type_cluster(same=True)
    sp2 = hetero_speedup(costs, same, search(costs, same, 16).best)
    assert 0.75 < sp2.ratio < 1.1
    assert share_batch(1024, 256, 768) == 336        # not round(341.3) = 341 = 11 x 31
    assert share_batch(1024, 256, 1024) == 256 and share_batch(16, 8, 16) == 8


def test_gpipe_and_moe_plans_are_costed():
    moe = MoEInfo(num_experts=8, top_k=2, d_model=512, d_ffn=1024, expert_params=0)
    costs = analytic_llama_costs("moe", 6, 512, 8, 2048, 4000, 256, moe=moe, dtype_bytes=2)
    cl = two_type_cluster()
    r = search(costs, cl, 16, schedule="gpipe")
    assert r.plan.schedule == "gpipe"
    check_plan_is_sound(r.plan, costs, cl)
    r2 = search(costs, cl, 16, dp_options=[4])
    # the EP degree of each stage is chosen by cost (it divides dp), not always the largest
    assert r2.plan.dp == 4 and r2.plan.moe is not None and r2.plan.moe.a2a in ("flat", "halo")
    assert all(4 % r2.plan.stage_ep(j) == 0 for j in range(r2.plan.num_stages))


def test_no_fit_is_an_error():
    tiny = Cluster("tiny", {"A": ChipType("A", "cuda", "v", {"bf16": 1e14}, GiB // 4, 1e12)},
                   (NodeGroup("A", 1, 2, intra_bw=1e11),))
    with pytest.raises(H2Error, match="fits"):
        search(analytic_llama_costs("m", 4, 2048, 8, 8192, 32000, 2048, dtype_bytes=2), tiny, 8)


def test_selective_recompute_where_none_does_not_fit_and_selective_does():
    """One chip, one stage: a capacity between what the stage holds under selective
    recomputation (half of each layer's saved activations) and without any. The search
    picks selective (cheaper than full), and the plan fits."""
    import dataclasses
    from h2ir.plans.plan import Plan, StagePlan
    c = analytic_llama_costs("m", 4, 1024, 8, 4096, 4000, 512, dtype_bytes=2)
    c = dataclasses.replace(c, layers=tuple(dataclasses.replace(
        l, act_selective_bytes=l.act_saved_bytes // 2) for l in c.layers))
    gb, big = 8, 64 * GiB
    chip = lambda mem: ChipType("A", "cuda", "v", {"bf16": 1e14}, mem, 1e12, efficiency=0.5,
                                fused_attention=True, **NO_HEADROOM)
    cl = lambda mem: Cluster("one", {"A": chip(mem)}, (NodeGroup("A", 1, 1, intra_bw=1e11),),
                             dtype="bf16")
    mem = {}
    for rc in ("none", "selective", "full"):
        plan = Plan("m", "one", gb, 1, c.seq_len,
                    [StagePlan("A", 1, c.layer_names(), tp=1, recompute=rc)], schedule="1f1b")
        mem[rc] = stage_memory(c, plan, cl(big), 0).total
    assert mem["full"] < mem["selective"] < mem["none"]
    cluster = cl((mem["selective"] + mem["none"]) // 2)
    r = search(c, cluster, gb, micro_batch=1)
    assert [s.recompute for s in r.plan.stages] == ["selective"]
    check_plan_is_sound(r.plan, c, cluster)
    # with room for none, none; with room only for full, full
    assert [s.recompute for s in search(c, cl(mem["none"] + GiB), gb, micro_batch=1).plan.stages] \
        == ["none"]
    tight = cl((mem["full"] + mem["selective"]) // 2)
    assert [s.recompute for s in search(c, tight, gb, micro_batch=1).plan.stages] == ["full"]


# -- h2c plan -----------------------------------------------------------------------------------

CLUSTER_TOML = """
name  = "two"
dtype = "bf16"

[chips.A]
vendor = "v"
backend = "cuda"
peak_tflops = { bf16 = 300 }
mem_gib = 80
mem_bw_gbs = 2000

[chips.B]
vendor = "v"
backend = "cuda"
peak_tflops = { bf16 = 120 }
mem_gib = 96
mem_bw_gbs = 2000

[[nodes]]
chip = "A"
count = 2
chips_per_node = 4
intra_bw_gbs = 200
nic_gbps = 200

[[nodes]]
chip = "B"
count = 2
chips_per_node = 4
intra_bw_gbs = 200
nic_gbps = 200
"""


@pytest.fixture
def plan_inputs(tmp_path):
    costs = analytic_llama_costs("m", 8, 1024, 8, 4096, 8000, 512, dtype_bytes=4)
    cj = tmp_path / "costs.json"
    cj.write_text(json.dumps(costs.to_json()))
    ct = tmp_path / "two.toml"
    ct.write_text(CLUSTER_TOML)
    return str(cj), str(ct)


def test_cli_json_report_and_plan_file_round_trip(plan_inputs, tmp_path, capsys):
    from frontend.plancli import main
    cj, ct = plan_inputs
    out = tmp_path / "p.h2plan"
    trace = tmp_path / "t.json"
    assert main([cj, "--cluster", ct, "--global-batch", "16", "--json", "-o", str(out),
                 "--trace", str(trace)]) == 0
    r = json.loads(capsys.readouterr().out)
    for k in ("stages", "step_time_s", "tokens_per_s", "hetero_speedup_ratio", "search_time_s"):
        assert k in r
    for s in r["stages"]:
        assert {"chip", "chips", "layers", "peak_mem_bytes", "mem_capacity_bytes"} <= set(s)
        assert s["peak_mem_bytes"] <= s["mem_capacity_bytes"]
    assert r["hetero_speedup_ratio"] > 0
    assert r["step_time_s"] <= r["uniform"]["step_time_s"]
    # what the search proved, derived from its bounds (exact only when the bound reaches it)
    proof = r["search"]
    assert {"exact", "search", "stopped_by", "lower_bound_s", "gap_to_bound", "proved"} <= set(proof)
    assert proof["exact"] == (proof["lower_bound_s"] >= r["step_time_s"] * (1 - 1e-9))
    assert any(e.get("ph") == "X" for e in json.loads(trace.read_text())["traceEvents"])
    # the written plan is accepted back, and predicts the same step
    assert main([cj, "--cluster", ct, "--plan", str(out), "--json", "--no-speedup"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["step_time_s"] == pytest.approx(r["step_time_s"])
    assert [s["layers"] for s in again["stages"]] == [s["layers"] for s in r["stages"]]


def test_cli_human_report_and_uniform(plan_inputs, capsys):
    from frontend.plancli import main
    cj, ct = plan_inputs
    assert main([cj, "--cluster", ct, "--global-batch", "16", "--plan", "uniform", "--no-speedup"]) == 0
    text = capsys.readouterr().out
    assert "predicted step time" in text and "tokens/s" in text and "stage chip=" in text


def test_cli_errors_exit_2(plan_inputs, tmp_path, capsys):
    from frontend.plancli import main
    cj, ct = plan_inputs
    assert main([cj, "--cluster", "no-such-cluster"]) == 2
    assert "error" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert main([str(bad), "--cluster", ct]) == 2
    assert "layer-cost JSON" in capsys.readouterr().err


# -- the plan space's switches, the time limit --------------------------------------------------

def _runs(plan):
    """The line of stages as runs of one chip type: [(chip, (tp, ...)), ...]."""
    return [(c, tuple(s.tp for s in g)) for c, g in itertools.groupby(plan.stages, key=lambda s: s.chip)]


def test_plan_space_dimensions_switch_off():
    costs, cluster, gb = random_instance(5)          # three types, 4 + 1 + 1 chips
    for space in (NARROW, PlanSpace(idle=False), PlanSpace(mixed_tp=False), PlanSpace(split_types=False)):
        r = search(costs, cluster, gb, space=space)
        check_plan_is_sound(r.plan, costs, cluster)
        runs = _runs(r.plan)
        if not space.idle:
            used = {}
            for s in r.plan.stages:
                used[s.chip] = used.get(s.chip, 0) + s.chips
            assert used == chip_counts(cluster)
        if not space.mixed_tp:
            assert all(len({s.tp for s in r.plan.stages if s.chip == c}) == 1 for c, _ in runs)
        if not space.split_types:
            assert len({c for c, _ in runs}) == len(runs)     # each type one contiguous block
    wide = search(costs, cluster, gb)
    assert wide.best.step_time_s <= search(costs, cluster, gb, space=NARROW).best.step_time_s + 1e-12


def test_a_type_in_part_one_slow_big_chip_for_the_embedding():
    """Two slow chips with room for a 64k-vocabulary embedding, two fast ones without: using
    one slow chip for the embedding alone and leaving the other idle beats every plan that
    uses both (each slow stage must then hold a layer, or the pair runs tp 2 over a slow NIC):
    the space has partial use of a type (issue 25 item 4)."""
    import dataclasses
    big_vocab = analytic_llama_costs("emb", 6, 512, 8, 2048, 64000, 256, dtype_bytes=2)
    small_head = analytic_llama_costs("emb", 6, 512, 8, 2048, 4000, 256, dtype_bytes=2)
    costs = dataclasses.replace(big_vocab, layers=big_vocab.layers[:-1] + small_head.layers[-1:])
    block, vocab = (4 * 512 * 512 + 3 * 512 * 2048) * 16, 64000 * 512 * 16
    chips = {"Big": ChipType("Big", "cuda", "v", {"bf16": 10e12}, int(vocab * 1.6), 1e12,
                             efficiency=0.5, **NO_HEADROOM),
             "Fast": ChipType("Fast", "cuda", "v", {"bf16": 200e12}, int(block * 5), 2e12,
                              efficiency=0.5, **NO_HEADROOM)}
    cl = Cluster("part", chips, (NodeGroup("Big", 2, 1, intra_bw=100e9, nic_bw=0.2e9),
                                 NodeGroup("Fast", 1, 2, intra_bw=100e9, nic_bw=25e9)),
                 dtype="bf16")
    r = search(costs, cl, 8)
    check_plan_is_sound(r.plan, costs, cl)
    assert [(s.chip, len(s.layers)) for s in r.plan.stages][0] == ("Big", 1)
    assert sum(s.chips for s in r.plan.stages if s.chip == "Big") == 1 and r.exact
    full = search(costs, cl, 8, space=PlanSpace(partial=False))
    assert r.best.step_time_s < 0.9 * full.best.step_time_s


def test_an_a_b_a_order_wins_where_only_one_type_holds_the_vocabulary():
    """A slow type with room for the embedding or the head (a 64k vocabulary), a fast one with
    room for blocks only: the embedding and the head go to the slow chips, one each, at both
    ends of the line (A-B-A), and the fast pair runs every block at tp 2."""
    costs = analytic_llama_costs("aba", 6, 512, 8, 2048, 64000, 256, dtype_bytes=2)
    block, vocab = (4 * 512 * 512 + 3 * 512 * 2048) * 16, 64000 * 512 * 16
    chips = {"Big": ChipType("Big", "cuda", "v", {"bf16": 20e12}, int(vocab * 1.6), 1e12,
                             efficiency=0.5, **NO_HEADROOM),
             "Fast": ChipType("Fast", "cuda", "v", {"bf16": 200e12}, int(block * 4), 2e12,
                              efficiency=0.5, **NO_HEADROOM)}
    cl = Cluster("aba", chips, (NodeGroup("Big", 2, 1, intra_bw=100e9, nic_bw=25e9),
                                NodeGroup("Fast", 1, 2, intra_bw=100e9, nic_bw=25e9)), dtype="bf16")
    r = search(costs, cl, 8)
    check_plan_is_sound(r.plan, costs, cl)
    assert [(s.chip, s.tp, len(s.layers)) for s in r.plan.stages] == \
        [("Big", 1, 1), ("Fast", 2, 6), ("Big", 1, 1)]
    assert r.exact


def test_time_limit_returns_the_best_plan_so_far():
    costs = costs_100b()
    from h2ir.clusters.clusterfile import load_cluster
    r = search(costs, load_cluster("h2-1024"), 1024, time_limit=1e-3)
    assert r.timed_out and not r.exact
    check_plan_is_sound(r.plan, costs, load_cluster("h2-1024"))
    assert r.best.sim is not None and r.best.sim.fits


def test_exact_is_derived_from_the_bounds_and_cannot_claim_more(monkeypatch):
    """`exact` is true only when nothing left unsimulated has a bound below the chosen plan;
    a search cut short by its simulation budget says what it proved instead."""
    import h2ir.planner.search.best_first as heteroauto
    costs, cluster, gb = random_instance(5)
    with monkeypatch.context() as mp:
        mp.setattr(heteroauto, "SIM_WORK_MIN", 10 ** 12)     # no budget: run to the bound
        full = search(costs, cluster, gb, max_sims=10 ** 6)
    p = full.proof()
    assert full.exact and p["exact"] and p["stopped_by"] == "bound"
    assert p["lower_bound_s"] == full.best.step_time_s and p["gap_to_bound"] == 0
    cut = search(costs, cluster, gb, max_sims=1)
    q = cut.proof()
    assert q["stopped_by"] == "simulation budget"
    assert q["lower_bound_s"] <= full.best.step_time_s * (1 + 1e-9)   # a true lower bound
    assert cut.exact == (cut.unexplored_bound_s >= cut.best.step_time_s * (1 - 1e-9))
    if not cut.exact:
        assert q["gap_to_bound"] > 0 and "no plan" in q["proved"]


def test_searching_both_schedules():
    costs, cl, gb = random_instance(1)
    both = search(costs, cl, gb, schedule="auto", micro_batch=1)
    one = min(search(costs, cl, gb, schedule=s, micro_batch=1).best.step_time_s
              for s in ("1f1b", "gpipe"))
    assert both.best.step_time_s <= one * (1 + 1e-9)


def test_cli_time_limit_says_the_plan_is_the_best_so_far(plan_inputs, capsys):
    from frontend.plancli import main
    cj, ct = plan_inputs
    assert main([cj, "--cluster", ct, "--global-batch", "16", "--time-limit", "0.000001",
                 "--no-speedup"]) == 0
    text = capsys.readouterr().out
    assert "TIME LIMIT reached: the best plan so far" in text and "not the search's optimum" in text
    assert main([cj, "--cluster", ct, "--time-limit", "0", "--no-speedup"]) == 2


# -- ZeRO-1 ---------------------------------------------------------------------------------------

def _one_block_model():
    """One transformer block and nothing else, one head: no pipeline can split it and no TP
    degree divides it, so ZeRO-1 is the only way to hold less of its state per chip."""
    import dataclasses
    c = analytic_llama_costs("z", 1, 1024, 1, 4096, 4000, 256, dtype_bytes=2)
    blocks = tuple(l for l in c.layers if l.kind == "transformer_block")
    return dataclasses.replace(c, layers=blocks)


def _pair(mem):
    chip = ChipType("A", "cuda", "v", {"bf16": 1e14}, mem, 1e12, efficiency=0.5,
                    fused_attention=True, **NO_HEADROOM)
    return Cluster("pair", {"A": chip}, (NodeGroup("A", 1, 2, intra_bw=1e11),), dtype="bf16")


def _zero_memory(costs, gb=2):
    """Per device, the least (over recomputation) each plan of the pair needs: dp 1, and dp 2
    at zero=0 and zero=1."""
    from h2ir.plans.plan import Plan, StagePlan
    names, big = costs.layer_names(), _pair(64 * GiB)
    need = {}
    for dp, zero in ((1, 0), (2, 0), (2, 1)):
        need[dp, zero] = min(stage_memory(costs, Plan("z", "pair", gb, 1, costs.seq_len, [
            StagePlan("A", dp, names, recompute=rc, zero=zero)], dp=dp), big, 0).total
            for rc in ("none", "selective", "full"))
    return need


def test_zero_where_only_a_sharded_optimizer_fits():
    """A capacity between the one-block model's state at zero=1 over two replicas and at
    zero=0: the search picks dp 2 with ZeRO-1, the plan validates, and proves it optimal."""
    costs = _one_block_model()
    need = _zero_memory(costs)
    assert need[2, 1] < min(need[1, 0], need[2, 0])
    cluster = _pair((need[2, 1] + min(need[1, 0], need[2, 0])) // 2)
    r = search(costs, cluster, 2, micro_batch=1)
    assert (r.plan.dp, [s.zero for s in r.plan.stages]) == (2, [1])
    check_plan_is_sound(r.plan, costs, cluster)
    assert r.exact and r.sim.fits
    with pytest.raises(H2Error, match="fits"):          # the switch: nothing fits without it
        search(costs, cluster, 2, micro_batch=1, space=PlanSpace(zero=False))
    # the same plan at zero=0 is over the capacity: the validator says so
    r.plan.stages[0].zero = 0
    with pytest.raises(H2Error, match="does not fit in memory"):
        validate_plan(r.plan, costs, cluster)


def test_zero_follows_the_resource_models_times(monkeypatch):
    """With room for zero=0, ZeRO-1 is chosen where the resource model times it faster: as
    costed, its reduce-scatter + all-gather move what the all-reduce did and the optimizer
    step updates half the parameters, so at dp 2 it wins. Under a model whose two halves cost
    1 ms more each, zero=0 is faster and kept where it fits, ZeRO-1 taken only where it must."""
    from h2ir.planner.resource import ResourceModel
    from h2ir.planner.simulate import simulate
    costs = _one_block_model()
    need = _zero_memory(costs)
    roomy, tight = _pair(64 * GiB), _pair((need[2, 1] + min(need[1, 0], need[2, 0])) // 2)
    r = search(costs, roomy, 2, micro_batch=1, dp_options=[2])
    assert [s.zero for s in r.plan.stages] == [1] and r.exact
    r.plan.stages[0].zero = 0
    assert simulate(costs, r.plan, roomy).step_time_s > r.best.step_time_s
    halves = ResourceModel.zero_collective_times
    monkeypatch.setattr(ResourceModel, "zero_collective_times",
                        lambda *a, **k: tuple(t + 1e-3 for t in halves(*a, **k)))
    r = search(costs, roomy, 2, micro_batch=1, dp_options=[2])
    assert [s.zero for s in r.plan.stages] == [0] and r.exact
    r.plan.stages[0].zero = 1
    assert simulate(costs, r.plan, roomy).step_time_s > r.best.step_time_s
    r = search(costs, tight, 2, micro_batch=1)
    assert (r.plan.dp, [s.zero for s in r.plan.stages]) == (2, [1]) and r.exact


def test_no_zero_with_expert_parallelism():
    """The validator refuses zero=1 on a stage with ep > 1: a line whose types run EP 2 and 1
    shards only the ep 1 stages, and the searched MoE plan validates."""
    moe = MoEInfo(num_experts=8, top_k=2, d_model=512, d_ffn=1024, expert_params=0)
    costs = analytic_llama_costs("moe", 6, 512, 8, 2048, 4000, 256, moe=moe, dtype_bytes=2)
    cl = two_type_cluster()
    rm = ResourceModel(costs, cl, 1, costs.seq_len)
    counts = tuple(sorted(chip_counts(cl).items()))
    line = StageLine(rm, Config(4, 1, 4, (), (), counts, (("A", 1), ("B", 1)), "1f1b"), "1f1b",
                     {"A": 2, "B": 1}, "flat")
    from h2ir.plans.plan import MoEPlan
    plan = line.plan([0, 4, len(costs.layers)], "moe", cl, 16, costs.seq_len, MoEPlan(ep=2))
    assert [(plan.stage_ep(j), s.zero) for j, s in enumerate(plan.stages)] == [(2, 0), (1, 1)]
    validate_plan(plan, costs, cl)
    r = search(costs, cl, 16, dp_options=[4])
    check_plan_is_sound(r.plan, costs, cl)
    assert all(not s.zero for j, s in enumerate(r.plan.stages) if r.plan.stage_ep(j) > 1)


# llama_tiny as one transformer block of 7.3 M parameters between a 256-word embedding and head,
# one attention head (no TP degree > 1): the block cannot be split, so only ZeRO-1 holds less of it
ONE_BLOCK = ["--arg", "vocab=256", "--arg", "dim=512", "--arg", "n_layers=1", "--arg", "n_heads=1",
             "--arg", "ffn=4096", "--arg", "max_seq=64"]


def test_plan_auto_picks_zero_where_only_it_fits_and_the_run_stays_under_the_cap(tmp_path):
    """0.13 GiB per worker on the local pair: every zero=0 plan of the one-block model needs
    more (the whole block's AdamW state on a chip), two replicas with ZeRO-1 need less.
    `h2c compile --plan auto` picks zero=1, the same plan at zero=0 is refused, and `h2x run`
    trains with each worker's measured peak under the cap."""
    from conftest import run_cli
    from test_recompute import _capped_cluster, _run
    cl = _capped_cluster(tmp_path, 0.13)
    shape = ["--global-batch", "4", "--micro-batch", "1", "--seq-len", "64"]
    b = tmp_path / "auto"
    r = run_cli("h2c", "compile", "examples/llama_tiny.py", *ONE_BLOCK, "--cluster", str(cl),
                "--plan", "auto", *shape, "-o", str(b), timeout=900)
    assert r.returncode == 0, r.stderr
    plan = (b / "plan.h2plan").read_text()
    assert "dp       2" in plan and " zero=1 " in plan, plan
    plain = tmp_path / "plain.h2plan"
    plain.write_text(plan.replace(" zero=1 ", " "))
    r = run_cli("h2c", "compile", "examples/llama_tiny.py", *ONE_BLOCK, "--cluster", str(cl),
                "--plan", str(plain), "-o", str(tmp_path / "plain"))
    assert r.returncode == 2 and "does not fit in memory" in r.stderr, r.stderr
    log = _run(b, 2)
    assert all(math.isfinite(x["loss"]) for x in log)
    cap = 0.13 * 2**30
    for w, mem in log[-1]["peak_memory"].items():
        assert mem["tensors"] <= cap, (w, mem)
