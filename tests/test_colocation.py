"""Workers that share a host's cores (issue 31): the cluster file says which chips share which
cores; layer times are measured under that co-location, alone and with companions, and the
record keeps each level; the simulator slows each compute by the measured curve at the number
of the host's workers computing meanwhile; the hetero benchmarks judge the planner by the order
of its plans (bench/plan_ranking.py)."""
from __future__ import annotations

import dataclasses
import datetime as dt
import json
import sys
from pathlib import Path

import pytest

from h2ir.clusters.cluster import ChipType, Cluster, NodeGroup
from h2ir.clusters.clusterfile import load_cluster, parse_cluster
from h2ir.errors import H2Error
from h2ir.planner.calibration import (TIME_FORMAT, Calibration, contention, contention_curve,
                                      host_info, layer_key, record_levels)
from h2ir.planner.resource import analytic_llama_costs
from h2ir.planner.simulate import simulate
from h2ir.plans.plan import Plan, StagePlan

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import plan_ranking  # noqa: E402

GiB = 2 ** 30


# ---- the cluster file: which chips share which cores --------------------------------------------

def _toml(top="", first="", second=""):
    return (f'name = "x"\ndtype = "fp32"\n{top}\n'
            '[chips.t]\nvendor = "cpu"\nbackend = "torch"\npeak_tflops = { fp32 = 0.1 }\n'
            'mem_gib = 4\nmem_bw_gbs = 10\nmeasured = true\n'
            '[chips.n]\nvendor = "cpu"\nbackend = "numpy"\npeak_tflops = { fp32 = 0.1 }\n'
            'mem_gib = 4\nmem_bw_gbs = 10\nmeasured = true\n'
            f'[[nodes]]\nchip = "t"\ncount = 2\nchips_per_node = 2\nintra_bw_gbs = 2\n'
            f'nic_gbps = 1\n{first}\n'
            f'[[nodes]]\nchip = "n"\ncount = 1\nchips_per_node = 1\nintra_bw_gbs = 2\n'
            f'nic_gbps = 1\n{second}\n')


def test_cluster_file_says_which_chips_share_which_cores():
    # nothing said: chips are chips
    c = parse_cluster(_toml())
    assert not c.shares_cores and c.node_domain(0) is None and c.colocation() is None
    # shared_cores: one machine holds every node (this machine's clusters, the test bed)
    c = parse_cluster(_toml("shared_cores = 2"))
    assert {c.node_domain(i) for i in range(3)} == {"machine"}
    assert c.colocation() == (2, {"torch": 4, "numpy": 1})
    # a named machine for some groups, a host of its own for each node of another
    c = parse_cluster(_toml("[machines.box]\ncores = 4", 'host_cores = 8', 'machine = "box"'))
    assert c.node_domain(0) == ("node", 0) and c.node_domain(1) == ("node", 1)
    assert c.node_domain(2) == ("machine", "box") and c.domain_cores(("machine", "box")) == 4
    assert c.domain_cores(("node", 1)) == 8
    assert c.colocation() == (8, {"torch": 2})      # the set that holds the most chips
    # two emulated hosts on one machine
    c = parse_cluster(_toml("[machines.m]\ncores = \"auto\"", 'machine = "m"', 'machine = "m"'))
    assert c.node_domain(0) == c.node_domain(2) and c.machines["m"] >= 1
    for name in ("local-mixed", "local-mixed4", "testbed-2host"):
        cl = load_cluster(name)
        assert cl.shares_cores and cl.node_domain(0) == "machine"
    assert load_cluster("local-mixed4").colocation()[1] == {"torch": 2, "numpy": 2}


@pytest.mark.parametrize("top,first,second,at,message", [
    ("[machines.box]\ncores = 4", 'machine = "bx"', "", 'machine = "bx"', "unknown machine 'bx'"),
    ("[machines.box]\ncores = 4", "", "", "[machines.box]", "no node group runs on machine 'box'"),
    ("[machines.box]\ncores = 4", 'machine = "box"\nhost_cores = 2', "", "host_cores", "not both"),
    ("shared_cores = 2\n[machines.box]\ncores = 4", 'machine = "box"', "", "[machines.box]",
     "shared_cores or \\[machines\\], not both"),
    ("shared_cores = 2", "host_cores = 3", "", "host_cores", "shared_cores already puts every chip"),
    ("", "host_cores = 0", "", "host_cores", "host_cores: expected a positive number of cores, got 0"),
    ("", 'host_cores = "auto"', "", "host_cores", 'expected a positive number of cores, got "auto"'),
    ("[machines.box]\ncores = \"lots\"", 'machine = "box"', "", "cores =", "machines.box.cores"),
    ("[machines.box]\ncorse = 4", 'machine = "box"', "", "corse", "unknown machine field 'corse'"),
    ("", "host_cores = 10000000", "", "host_cores", "larger than any real one"),
])
def test_cluster_file_errors_name_the_line(top, first, second, at, message):
    text = _toml(top, first, second)
    line = next(i for i, ln in enumerate(text.split("\n"), 1) if ln.startswith(at))
    with pytest.raises(H2Error, match=message) as e:
        parse_cluster(text, file="c.toml")
    assert e.value.file == "c.toml" and e.value.line == line, str(e.value)


# ---- the calibration: levels recorded and read --------------------------------------------------

def _record(f1=0.010, levels=((1, 1.0), (2, 1.5)), count=4, layer=None, mb=1, seq=256):
    """A torch record of `layer` (a transformer block) measured at these co-location levels
    ((processes at once, slow-down)); its fwd_s/bwd_s are the last level's."""
    key = layer_key("m", "sha", {}, mb, seq, "fp32", "torch")
    lv = {str(n): [f1 * g, 2 * f1 * g] for n, g in levels}
    last = lv[str(levels[-1][0])]
    return {"key": key, "host": host_info(), "software": {}, "spread": 0.01,
            "measured_at": dt.datetime.now().strftime(TIME_FORMAT),
            "colocation": {"cores": 2, "backends": {"torch": 2}, "levels": [n for n, _ in levels]},
            "layers": {"transformer_block": {
                "fwd_s": last[0], "bwd_s": last[1], "count": count, "levels": lv,
                "fwd_flops": layer.fwd_flops if layer else 1000,
                "bwd_flops": layer.bwd_flops if layer else 2000,
                "params": layer.params if layer else 100}}}


def test_a_record_keeps_each_level_and_its_curve_rises_from_one():
    rec = _record(levels=((1, 1.0), (2, 1.3), (4, 2.9)))
    assert record_levels(rec) == pytest.approx({1: 0.12, 2: 0.156, 4: 0.348})
    assert contention_curve(rec) == pytest.approx({1: 1.0, 2: 1.3, 4: 2.9})
    # a faster figure beside more neighbours is noise: the curve never falls, nor below 1
    assert contention_curve(_record(levels=((1, 1.0), (2, 0.9), (4, 1.2)))) == \
        pytest.approx({1: 1.0, 2: 1.0, 4: 1.2})
    assert contention_curve({"layers": {"k": {"fwd_s": 1, "bwd_s": 1}}}) == {1: 1.0}


def test_contention_interpolates_then_time_shares_past_the_measured_points():
    curve = {1: 1.0, 2: 1.2}
    assert contention(curve, 1.0, 2) == 1.0 and contention(curve, 0.5, 2) == 1.0
    assert contention(curve, 1.5, 2) == pytest.approx(1.1)
    assert contention(curve, 4.0, 2) == pytest.approx(1.2 * 2)     # 4 on 2 cores: half each
    assert contention({1: 1.0}, 3.0, 2) == pytest.approx(1.5)       # pure time sharing
    assert contention({1: 1.0, 2: 1.1}, 3.0, 8) == pytest.approx(1.1)   # cores to spare
    assert contention({1: 1.0, 2: 1.2, 4: 2.6}, 8.0, 2) == pytest.approx(5.2)


def test_layer_time_reads_the_co_located_times_or_alone():
    cal = Calibration()
    cal.add_record(_record())
    from h2ir.costs import LayerCost
    layer = LayerCost("block.0", "transformer_block", params=100, param_bytes=400,
                      fwd_flops=1000, bwd_flops=2000, act_saved_bytes=0, out_bytes=0)
    assert cal.layer_time("torch", layer, 1, 256) == pytest.approx((0.015, 0.030))
    assert cal.layer_time("torch", layer, 1, 256, solo=True) == pytest.approx((0.010, 0.020))
    assert cal.contention_curve("torch", 1) == pytest.approx({1: 1.0, 2: 1.5})
    assert cal.contention_curve("numpy", 1) == {1: 1.0}
    # a record from before levels, 4 processes on 2 cores: one process per core, no curve
    old = _record()
    old["key"]["workers"], old["cores"] = 4, 2
    del old["layers"]["transformer_block"]["levels"]
    cal = Calibration()
    cal.add_record(old)
    assert cal.layer_time("torch", layer, 1, 256, solo=True) == pytest.approx((0.0075, 0.015))
    assert cal.contention_curve("torch", 1) == {1: 1.0}


# ---- the simulator: co-located workers slow each other as measured ------------------------------

def _measured_cluster(nodes=1, per_node=2, **kw):
    chip = ChipType("cpu", "torch", "cpu", {"fp32": 1e11}, 8 * GiB, 1e10, measured=True)
    g = NodeGroup("cpu", nodes, per_node, intra_bw=1e18, nic_bw=1e18, intra_latency=0.0,
                  inter_latency=0.0, **{k: v for k, v in kw.items() if k in ("host_cores", "machine")})
    return Cluster("c", {"cpu": chip}, (g,), dtype="fp32",
                   **{k: v for k, v in kw.items() if k in ("shared_cores", "machines")})


def _costs():
    c = analytic_llama_costs("m", 8, 256, 4, 1024, 256, 256, dtype_bytes=4)
    return dataclasses.replace(c, layers=tuple(l for l in c.layers if l.kind == "transformer_block"))


def _cal(costs, g2):
    """Layer times of `costs`' blocks, 2 processes at once measured g2 times slower than one
    (g2 None: measured alone only)."""
    blk = costs.layers[0]
    cal = Calibration(backends={"torch": {"matmul_flops": 1e11, "mem_bw": 1e18, "opt_bw": 1e18}})
    levels = ((1, 1.0),) if g2 is None else ((1, 1.0), (2, g2))
    cal.add_record(_record(levels=levels, layer=blk, count=len(costs.layers)))
    return cal


def _plan(costs, split, m=8):
    names = costs.layer_names()
    return Plan("m", "c", m, 1, costs.seq_len,
                [StagePlan("cpu", 1, names[:split]), StagePlan("cpu", 1, names[split:])])


def _step(costs, plan, cluster, g2):
    return simulate(costs, plan, cluster, _cal(costs, g2)).step_time_s


def test_a_balanced_pipeline_pays_the_measured_slow_down_an_unbalanced_one_less():
    """Two workers on two shared cores, measured 1.5x slower together than alone: the balanced
    split computes side by side nearly all the step; the unbalanced one's heavy stage runs
    alone while the light one waits, so its step grows less."""
    c, cl = _costs(), _measured_cluster(shared_cores=2)
    balanced = _step(c, _plan(c, 4), cl, 1.5) / _step(c, _plan(c, 4), cl, 1.0)
    skewed = _step(c, _plan(c, 1), cl, 1.5) / _step(c, _plan(c, 1), cl, 1.0)
    assert 1.3 < balanced <= 1.5 + 1e-6
    assert 1.0 <= skewed < balanced - 0.15
    # the search ranks by the same simulation: it sees the difference too
    assert _step(c, _plan(c, 4), cl, 1.0) < _step(c, _plan(c, 3), cl, 1.0)


def test_workers_on_hosts_of_their_own_do_not_slow_each_other():
    c = _costs()
    apart = _measured_cluster(nodes=2, per_node=1, host_cores=2)
    together = _measured_cluster(nodes=2, per_node=1, machine="box", machines={"box": 2})
    plan = _plan(c, 4)
    alone = _step(c, plan, apart, 1.0)
    assert _step(c, plan, apart, 1.5) == pytest.approx(alone, rel=1e-9)
    assert _step(c, plan, together, 1.5) > 1.3 * alone
    # past the measured points and the cores, time sharing: two workers on one core take turns
    one_core = _measured_cluster(nodes=2, per_node=1, machine="box", machines={"box": 1})
    work = 8 * 3 * 0.010 * len(c.layers)      # every micro-batch's fwd + bwd on both stages
    assert _step(c, plan, one_core, None) == pytest.approx(work, rel=0.05)


def test_records_of_another_co_location_are_not_used():
    """A plan for two workers is not priced from a record measured beside three others."""
    from h2ir.planner.calibration import colocation_key
    from h2ir.planner.resource import ResourceModel
    c, cl = _costs(), _measured_cluster(shared_cores=2)
    for backends, used in (({"torch": 2}, True), ({"torch": 4}, False)):
        cal = _cal(c, 1.5)
        for r in cal.records.values():
            r["key"]["colocation"] = colocation_key(2, backends)
        # another model's record, newer, slower together: not this model's curve
        other = _record(levels=((1, 1.0), (2, 3.0)))
        other["key"]["colocation"] = colocation_key(2, backends)
        other["key"]["model_sha256"] = "another"
        cal.add_record(other)
        rm = ResourceModel(c, cl, calibration=cal)
        rm.layer_times("cpu", 1)
        assert (not rm.estimated) == used
        assert rm.contention_curve("cpu") == ({1: 1.0, 2: 1.5} if used else {1: 1.0})


# ---- measuring: a record of every level ---------------------------------------------------------

def test_phase_groups_time_each_backend_at_each_level_with_companions():
    from frontend.profile import colocation_levels, phase_groups
    w = ["torch", "torch", "numpy", "numpy"]
    assert colocation_levels(4, 2) == [1, 2, 4] and colocation_levels(2, 8) == [1, 2]
    assert phase_groups(w, 1, ["torch", "numpy"]) == [[0], [2]]
    assert phase_groups(w, 2, ["torch", "numpy"]) == [[0, 2]]        # one phase covers both
    assert phase_groups(w, 2, ["numpy"]) == [[2, 0]]
    assert phase_groups(w, 4, ["torch"]) == [[0, 1, 2, 3]]


def test_layer_times_are_recorded_under_the_clusters_co_location(tmp_path, monkeypatch):
    from frontend.profile import colocation_of, layer_record_key, record
    from h2ir.planner.calibration import load_calibration
    monkeypatch.setenv("H2_CALIBRATION", str(tmp_path / "cal.json"))
    args = {"dim": 32, "n_layers": 1, "n_heads": 2, "ffn": 64, "vocab": 128}
    colo = colocation_of(load_cluster("local-mixed"))
    assert colo[1] == {"torch": 1, "numpy": 1}
    ids = record(str(ROOT / "examples/llama_tiny.py"), args, 1, 16, ["torch", "numpy"],
                 log=lambda *a: None, colocation=colo, rounds=(1, 1))
    cal = load_calibration()
    for b, rid in zip(("torch", "numpy"), ids):
        rec = cal.records[rid]
        assert rec["key"] == layer_record_key(str(ROOT / "examples/llama_tiny.py"), args, 1, 16,
                                              b, colo)
        assert rec["key"]["colocation"]["backends"] == {"numpy": 1, "torch": 1}
        assert rec["colocation"]["levels"] == [1, 2]
        for kind in ("embedding", "transformer_block", "head"):
            m = rec["layers"][kind]
            assert set(m["levels"]) == {"1", "2"} and m["count"] >= 1
            assert m["levels"]["2"] == pytest.approx([m["fwd_s"], m["bwd_s"]])
        assert min(contention_curve(rec).values()) >= 1.0
    # another cluster's co-location is another key: `local` (two torch workers)
    other = layer_record_key(str(ROOT / "examples/llama_tiny.py"), args, 1, 16, "torch",
                             colocation_of(load_cluster("local")))
    assert other != cal.records[ids[0]]["key"]


def _level_round(ms, n2):
    """One round of a torch record whose chain takes `ms` alone and `n2` ms two at once."""
    return {"torch": {"block": {"fwd_s": n2 / 3e3, "bwd_s": 2 * n2 / 3e3, "reps": 5,
                                "fwd_spread": 0.01, "bwd_spread": 0.01, "count": 1,
                                "levels": {"1": [ms / 3e3, 2 * ms / 3e3],
                                           "2": [n2 / 3e3, 2 * n2 / 3e3]}}}}


def test_rounds_agree_at_every_level_and_micro_batches_take_turns():
    """Two rounds agree only where every level agrees (a curve is only as good as its points);
    measurements at several micro-batches take their rounds in turn, each settling on its own."""
    from frontend.profile import measure_interleaved, round_difference
    assert round_difference(_level_round(10, 12), _level_round(10, 15)) == pytest.approx(0.25)
    order = []

    def seq(name, *rounds):
        it = iter(rounds)
        return lambda: (order.append(name), next(it))[1]
    got = measure_interleaved({1: seq(1, _level_round(10, 12), _level_round(10, 12.1)),
                               4: seq(4, _level_round(30, 40), _level_round(30, 50),
                                      _level_round(30, 40.5))}, (2, 4))
    assert order == [1, 4, 1, 4, 4]
    b = got[4]["torch"]["block"]
    assert b["levels"]["2"][0] * 3e3 == pytest.approx(40.25) and b["rounds"] == 3
    assert contention_curve({"layers": got[1]["torch"]}) == pytest.approx({1: 1.0, 2: 1.205})


# ---- the benchmarks' verdicts ------------------------------------------------------------------

def test_pairwise_agreement_counts_each_pair_the_planner_orders():
    pred = {"auto": 1.0, "uniform": 1.3, "b": 1.1, "c": 1.105}      # b and c: a tie
    rounds = [{"auto": 1.0, "uniform": 1.2, "b": 1.3, "c": 1.1},
              {"auto": 1.4, "uniform": 1.2, "b": 1.1, "c": 1.2},
              {"auto": 1.0, "uniform": 1.5, "b": 1.1}]               # c did not run
    pairs = plan_ranking.pair_agreement(pred, rounds)
    assert ("b", "c") not in pairs and ("c", "b") not in pairs
    assert pairs[("auto", "uniform")] == (2, 3)
    assert pairs[("auto", "b")] == (2, 3)
    assert pairs[("auto", "c")] == (1, 2)
    assert pairs[("b", "uniform")] == (2, 3)
    assert pairs[("c", "uniform")] == (1, 2)
    assert plan_ranking.agreement(pairs) == (8, 13)
    assert plan_ranking.not_slower(rounds) == [True, False, True]
    text = "\n".join(plan_ranking.format_matrix(pred, rounds))
    assert "2/3" in text and "=" in text


def test_error_spread_and_the_summary_row():
    pred = {"auto": 1.0, "uniform": 1.2}
    r = {"auto": 1.25, "uniform": 1.2}
    e = plan_ranking.round_errors(pred, r)
    assert e == pytest.approx({"auto": -0.2, "uniform": 0.0})
    assert plan_ranking.error_spread(e) == pytest.approx(20.0)
    row = plan_ranking.summary_row("x", pred, [r, {"auto": 1.0, "uniform": 1.2}])
    assert row["pair_rounds_agree"] == 1 and row["pair_rounds"] == 2 and not row["ranking_ok"]
    assert row["auto_ge_uniform"] == 1 and not row["auto_ok"] and not row["spread_ok"]
    assert row["max_spread_pp"] == pytest.approx(20.0)
    table = plan_ranking.format_summary([row])
    assert table[0].startswith("| cluster") and "NOT met" in table[2]
    json.dumps(row)
