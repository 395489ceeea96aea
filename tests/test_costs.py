"""Costs the planner can trust (issue 14, item 4): keyed and checked calibration, realistic
inputs for layer timing, per-op-class efficiency per chip type, fused attention memory, memory
headroom, every node group of a type, TP that does not scale ideally."""
from __future__ import annotations

import datetime as dt
import json
import re
import shutil

import numpy as np
import pytest

from h2ir.clusters.cluster import ChipType, Cluster, NodeGroup
from h2ir.clusters.clusterfile import CATALOG_PATH, catalog_chip, catalog_names, parse_cluster
from h2ir.costs import LayerCost
from h2ir.errors import H2Error
from h2ir.planner.calibration import (TIME_FORMAT, Calibration, host_info, layer_key,
                                      load_calibration, problems, record_id, save_calibration)
from h2ir.planner.resource import (ResourceModel, analytic_llama_costs, device_capacity,
                                   stage_memory)
from h2ir.plans.plan import Plan, StagePlan

GiB = 2 ** 30


def _rec(backend="torch", when=None, host=None, software=None, spread=0.01, sha="abc",
         fwd=0.003, params=100, flops=1000, mb=1, seq=128):
    key = layer_key("m", sha, {}, mb, seq, "fp32", backend)
    return {"key": key, "host": host if host is not None else host_info(),
            "software": software or {}, "spread": spread,
            "measured_at": (when or dt.datetime.now()).strftime(TIME_FORMAT),
            "layers": {"transformer_block": {"fwd_s": fwd, "bwd_s": 2 * fwd, "fwd_flops": flops,
                                             "bwd_flops": 2 * flops, "params": params}}}


def _layer(params=100, flops=1000):
    return LayerCost("block.0", "transformer_block", params=params, param_bytes=4 * params,
                     fwd_flops=flops, bwd_flops=2 * flops, act_saved_bytes=0, out_bytes=0)


# ---- calibration: keyed, checked, never reused silently ----------------------------------------

def test_foreign_stale_and_noisy_records_are_named():
    assert problems(_rec()) == []
    other = dict(host_info(), node="elsewhere", boot_id="another-kernel")
    assert any(p.startswith("foreign") for p in problems(_rec(host=other)))
    # an emulated host (examples/testbed: its own hostname, this machine's kernel) is this one
    assert problems(_rec(host=dict(host_info(), node="h2tb-0a1b2c-h1"))) == []
    old = dt.datetime.now() - dt.timedelta(days=40)
    assert any(p.startswith("stale") for p in problems(_rec(when=old)))
    assert any("versions" in p for p in problems(_rec(software={"torch": "1.0"}),
                                                 software={"torch": "2.13.0"}))
    assert any(p.startswith("noisy") for p in problems(_rec(spread=0.5)))


def test_planner_skips_foreign_and_stale_records_and_reports_them():
    cal = Calibration(records={})
    good, foreign = _rec(fwd=0.003), _rec(fwd=0.1, sha="other", host=dict(host_info(), node="x", boot_id="y"))
    foreign["measured_at"] = (dt.datetime.now() + dt.timedelta(seconds=1)).strftime(TIME_FORMAT)
    cal.add_record(good)
    fid = cal.add_record(foreign)
    cal.check()
    assert fid in cal.distrusted and any("foreign" in n for n in cal.notes)
    assert cal.layer_time("torch", _layer(), 1, 128) == pytest.approx((0.003, 0.006))
    # a layer of another shape is never costed from this record (no FLOP-ratio stretching)
    assert cal.layer_time("torch", _layer(params=200), 1, 128) is None
    assert cal.layer_time("torch", _layer(), 1, 64) is None
    # the micro-batch scales linearly
    assert cal.layer_time("torch", _layer(flops=2000), 2, 128) == pytest.approx((0.006, 0.012))


def test_layer_time_between_measured_micro_batches_is_linear_between_the_nearest_pair():
    cal = Calibration(records={})
    for mb, fwd in ((1, 0.003), (4, 0.008), (8, 0.014)):
        cal.add_record(_rec(fwd=fwd, flops=1000 * mb, mb=mb, sha=f"s{mb}"))
    at = lambda mb: cal.layer_time("torch", _layer(flops=1000 * mb), mb, 128)  # noqa: E731
    assert at(4) == pytest.approx((0.008, 0.016))                   # measured: as measured
    assert at(2) == pytest.approx((0.003 + 0.005 / 3, 0.006 + 0.010 / 3))  # between 1 and 4
    assert at(6) == pytest.approx((0.011, 0.022))                   # between 4 and 8, not 1 and 8
    # beyond the measured ones: linear from the nearest (mb 8), not from the first found (mb 1)
    assert at(16) == pytest.approx((0.028, 0.056))


def test_compile_measures_the_micro_batch_the_search_chose_and_searches_again(tmp_path,
                                                                              monkeypatch):
    import frontend.compiler as fc
    from h2ir.clusters.clusterfile import load_cluster
    monkeypatch.setenv("H2_CALIBRATION", str(tmp_path / "cal.json"))
    calls, searched = [], []
    monkeypatch.setattr(fc, "record", _fake_record(calls))
    real = fc.search_plan

    def search_plan(*a, **kw):      # a search that prefers micro-batches of 4
        searched.append(sorted(kw["calibration"].selected))
        return real(*a, **dict(kw, micro_batch=4))
    monkeypatch.setattr(fc, "search_plan", search_plan)
    args = {"dim": 64, "n_layers": 2, "n_heads": 4, "ffn": 128, "vocab": 512}
    inp = fc._Inputs("uniform", load_cluster("local-mixed"), None, 8, None, 32)
    _, _, plan, cal = fc._capture_and_plan("examples/llama_tiny.py", args, inp, schedule="1f1b",
                                           search="heuristic", dry_run=False, log=lambda m: None)
    assert plan.micro_batch == 4
    # measured at micro-batch 1 first, then at 4; the second search saw both records
    assert calls == [["numpy", "torch"], ["numpy", "torch"]]
    assert len(searched) == 2 and len(searched[0]) == 2 and len(searched[1]) == 4
    assert {cal.records[r]["key"]["micro_batch"] for r in cal.selected} == {1, 4}


def test_version_1_file_keeps_speeds_drops_name_keyed_layer_times(tmp_path):
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"version": 1, "created": "2026-01-01T00:00:00", "host": host_info(),
                             "backends": {"torch": {"matmul_flops": 1e11, "mem_bw": 1e10}},
                             "layer_times": {"torch": {"head": {"fwd_s": 1, "bwd_s": 1,
                                                                "model": "llama_tiny"}}}}))
    cal = load_calibration(p)
    assert cal.matmul_flops("torch") == 1e11 and not cal.records
    assert any("version-1" in n for n in cal.notes)


def _fake_record(calls):
    """Stand-in for frontend.profile.record: stores a record with the real key, no timing."""
    from backends.calibrate import software_versions
    from frontend.profile import layer_record_key
    from h2ir.planner.calibration import store_layer_record

    def record(model_path, model_args, mb, seq, backends, log=print, colocation=None):
        calls.append(list(backends))
        ids = []
        for b in backends:
            key = layer_record_key(model_path, model_args, mb, seq, b, colocation)
            store_layer_record(dict(_rec(backend=b, software=software_versions()), key=key))
            ids.append(record_id(key))
        return ids
    return record


def test_compile_remeasures_changed_model_foreign_host_and_stale_records(tmp_path, monkeypatch):
    import frontend.compiler as fc
    from h2ir.clusters.clusterfile import load_cluster
    monkeypatch.setenv("H2_CALIBRATION", str(tmp_path / "cal.json"))
    calls, logs = [], []
    monkeypatch.setattr(fc, "record", _fake_record(calls))
    model = tmp_path / "m.py"
    shutil.copy("examples/llama_tiny.py", model)
    cl = load_cluster("local")
    ensure = lambda: fc.ensure_layer_times(cl, str(model), {}, 1, 128, log=logs.append)  # noqa
    cal = ensure()
    assert calls == [["torch"]] and cal.selected
    ensure()
    assert len(calls) == 1                     # the same model, host and day: reused
    model.write_text(model.read_text() + "\n# changed\n")      # same name, other content
    ensure()
    assert len(calls) == 2
    # a record from another host, then a stale one: measured again, and said why
    for tamper, word in (({"host": dict(host_info(), node="other-host", boot_id="b")}, "foreign"),
                         ({"measured_at": "2020-01-01T00:00:00"}, "stale")):
        c = load_calibration()
        for r in c.records.values():
            r.update(tamper)
        save_calibration(c)
        ensure()
        assert any(word in m and "measured again" in m for m in logs), logs
    assert len(calls) == 4
    # other arguments are another key
    fc.ensure_layer_times(cl, str(model), {"dim": 128}, 1, 128, log=logs.append)
    assert len(calls) == 5


def test_foreign_backend_speeds_are_measured_again(tmp_path):
    from backends.calibrate import ensure_calibration
    p = tmp_path / "c.json"
    cal = Calibration(backends={"numpy": {"matmul_flops": 1.0, "mem_bw": 1.0, "threads": 1,
                                          "measured_at": "2026-01-01T00:00:00",
                                          "host": dict(host_info(), node="other", boot_id="b")}})
    save_calibration(cal, p)
    logs = []
    got = ensure_calibration(["numpy"], path=p, log=logs.append)
    assert got.matmul_flops("numpy") > 1e6 and any("foreign" in m for m in logs)


# ---- realistic inputs for layer timing ----------------------------------------------------------

def test_layer_timing_uses_the_models_own_init_and_real_activations():
    import torch
    from backends.registry import get_backend
    from frontend.capture import trace_model
    from frontend.profile import realistic_layer_values
    from frontend.stages import build_stage_programs
    args = {"dim": 64, "n_layers": 2, "n_heads": 4, "ffn": 128, "vocab": 512}
    cap = trace_model("examples/llama_tiny.py", args, 1, 32)
    names = [l.name for l in cap.graph.layers]
    progs = build_stage_programs(cap, [[n] for n in names])
    be = get_backend("torch")
    vals = realistic_layer_values(cap, progs, be, args, seed=0)
    head = vals[names.index("head")]
    torch.manual_seed(0)
    model = cap.model_file.build(args)
    w = be.to_numpy(head["fwd"]["head.weight"])
    assert np.array_equal(w, model.head.weight.detach().numpy())       # the model's init
    assert w.std() < 0.2                       # nn.Linear's U(-1/sqrt(d), 1/sqrt(d)), not N(0,1)
    # the head's input is the last block's real output on the very token ids fed to the embedding
    (hk,) = progs[names.index("head")].inputs
    x = be.to_numpy(head["fwd"][hk])
    tokens = torch.from_numpy(be.to_numpy(vals[0]["fwd"][progs[0].inputs[0]]))
    seen = {}
    model.layers[-1].register_forward_hook(lambda m, i, o: seen.setdefault("h", o))
    model(tokens)
    assert np.allclose(x, seen["h"].detach().numpy(), rtol=1e-4, atol=1e-5)
    assert 0.1 < x.std() < 10
    # the output gradient a block's backward gets is the real one, not N(0,1)
    g = [v for k, v in vals[names.index("block.0")]["bwd"].items() if k.startswith("grad.")]
    assert g and all(be.to_numpy(t).std() < 0.1 for t in g)


# ---- efficiency per op class, per chip type, cited ----------------------------------------------

def test_catalog_efficiency_is_per_op_class_per_chip_and_every_figure_says_its_source():
    text = CATALOG_PATH.read_text()
    a100, h100 = catalog_chip("A100-80"), catalog_chip("H100-SXM")
    assert (a100.eff("matmul"), a100.eff("attention")) != (h100.eff("matmul"), h100.eff("attention"))
    for name in catalog_names():
        block = text.split(f"[{name}]")[1].split("\n[")[0]
        assert "# efficiency:" in block, name           # each entry states where its figures are from
        if "efficiency =" in block:
            note = block.split("# efficiency:")[1].split("efficiency =")[0]
            assert re.search(r"\[(FA2|FA3|STREAM-HBM)|chosen", note), name
    cl = parse_cluster('dtype = "bf16"\n[[nodes]]\nchip = "A100-80"\ncount = 1\n'
                       'chips_per_node = 8\nintra_bw_gbs = 300\nnic_gbps = 200\n'
                       '[[nodes]]\nchip = "H100-SXM"\ncount = 1\nchips_per_node = 8\n'
                       'intra_bw_gbs = 450\nnic_gbps = 400\n')
    c = analytic_llama_costs("m", 2, 1024, 16, 4096, 32000, 2048, dtype_bytes=2)
    rm = ResourceModel(c, cl)
    ta, th = rm.layer_times("A100-80", 1).fwd_layer[1], rm.layer_times("H100-SXM", 1).fwd_layer[1]
    # not a ratio of peaks (989.4 / 312 = 3.17): each type's own efficiencies and bandwidth
    assert ta / th != pytest.approx(989.4 / 312, rel=0.01)


def test_tp_does_not_scale_ideally_and_matches_the_cited_a100_profile():
    """Issue 14 cites A100 block times of a 350M model: 8.22 / 5.31 / 4.41 ms at TP 1 / 2 / 4.
    The model shards the memory-bound work as the kernels do (the norms on the replicated
    stream stay whole: Korthikanti et al. 2022 Sec. 4.2.1), so it follows TP 1 -> 2 and stays
    below the profile everywhere; from TP 2 to 4 the profile gains only 0.9 ms, less than a
    roofline of a d = 1,024 block can explain (its ~2 ms that does not shrink with t is
    per-kernel overhead of small GEMMs, which no term models: issue 25 item 4)."""
    cl = parse_cluster('dtype = "fp16"\n[[nodes]]\nchip = "A100-80"\ncount = 1\n'
                       'chips_per_node = 8\nintra_bw_gbs = 300\nnic_gbps = 200\n')
    c = analytic_llama_costs("350m", 24, 1024, 16, 4096, 50272, 2048, micro_batch=4,
                             dtype_bytes=2)
    rm = ResourceModel(c, cl)
    t = {tp: rm.layer_times("A100-80", tp).fwd_layer[1] + rm.layer_times("A100-80", tp).bwd_layer[1]
         for tp in (1, 2, 4)}
    assert t[2] / t[1] == pytest.approx(5.31 / 8.22, rel=0.15)
    for tp, ms in ((1, 8.22), (2, 5.31), (4, 4.41)):
        assert t[tp] < ms * 1e-3                  # a roofline: below the measured time
    assert t[4] > t[1] / 4 * 1.3               # not ideal: replicated norms, all-reduces


# ---- memory: fused attention, headroom ----------------------------------------------------------

def _one_stage(c, chip):
    return Plan(model="m", cluster="c", global_batch=1, micro_batch=1, seq_len=c.seq_len,
                stages=[StagePlan(chip=chip, chips=1, layers=list(c.layer_names()))])


def test_attention_scores_are_kept_only_without_a_fused_kernel_and_headroom_is_applied():
    cl = parse_cluster('dtype = "fp16"\n[[nodes]]\nchip = "A100-40"\ncount = 1\n'
                       'chips_per_node = 8\nintra_bw_gbs = 300\nnic_gbps = 200\n'
                       '[[nodes]]\nchip = "V100-32"\ncount = 1\nchips_per_node = 8\n'
                       'intra_bw_gbs = 150\nnic_gbps = 100\n')
    c = analytic_llama_costs("m", 2, 1024, 16, 4096, 32000, 2048, dtype_bytes=2)
    a = stage_memory(c, _one_stage(c, "A100-40"), cl, 0)
    v = stage_memory(c, _one_stage(c, "V100-32"), cl, 0)
    assert "attention_scores" not in a.items
    assert v.items["attention_scores"] == 2 * 16 * 2048 ** 2 * 2        # 2 blocks, fp16
    # headroom: 1 GiB reserved + 5 % fragmentation by default
    assert a.capacity == int(40 * GiB * 0.95 - 1 * GiB)
    assert device_capacity(cl.chip("A100-40")) == a.capacity


def test_headroom_is_stated_in_the_cluster_file():
    cl = parse_cluster('[chips.g]\nbase = "A100-80"\nmem_reserved_gib = 4\nmem_fragmentation = 0.1\n'
                       '[[nodes]]\nchip = "g"\ncount = 1\nchips_per_node = 8\n'
                       'intra_bw_gbs = 300\nnic_gbps = 200\n')
    assert cl.chip("g").usable_mem_bytes == int(80 * GiB * 0.9 - 4 * GiB)


# ---- every node group of a type --------------------------------------------------------------------

def test_every_node_group_of_a_chip_type_is_used():
    x = ChipType("X", "cuda", "v", {"bf16": 1e14}, 80 * GiB, 2e12)
    fast = NodeGroup("X", 4, 8, intra_bw=300e9, nics_per_node=8, nic_bw=50e9)
    slow = NodeGroup("X", 2, 4, intra_bw=100e9, nics_per_node=1, nic_bw=25e9,
                     inter_latency=20e-6)
    one = Cluster("c", {"X": x}, (fast,))
    both = Cluster("c", {"X": x}, (fast, slow))
    g = both.group("X")
    assert both.count("X") == 40 and g.chips >= 40
    assert g.chips_per_node == 4 and g.intra_bw == 100e9 and g.inter_latency == 20e-6
    assert g.nics_per_node * g.nic_bw / g.chips_per_node == pytest.approx(25e9 / 4)
    assert both.group("X") is g                 # one object: p2p's same-group test holds
    c = analytic_llama_costs("m", 4, 1024, 8, 4096, 8000, 512, dtype_bytes=2)
    assert ResourceModel(c, both).grad_allreduce_time("X", 1, 8, 1e9) > \
        ResourceModel(c, one).grad_allreduce_time("X", 1, 8, 1e9)


# ---- measurement rounds ------------------------------------------------------------------------

def _round(torch_ms, numpy_ms=None, spread=0.01):
    out = {"torch": {"block": {"fwd_s": torch_ms / 3e3, "bwd_s": 2 * torch_ms / 3e3,
                               "fwd_spread": spread, "bwd_spread": spread, "reps": 5}}}
    if numpy_ms is not None:
        out["numpy"] = {"block": {"fwd_s": numpy_ms / 3e3, "bwd_s": 2 * numpy_ms / 3e3,
                                  "fwd_spread": spread, "bwd_spread": spread, "reps": 7}}
    return out


def _rounds_of(*results):
    seq = list(results)
    calls = []

    def once():
        calls.append(1)
        return seq[len(calls) - 1]
    return once, calls


def test_rounds_repeat_until_two_agree_and_use_those_two():
    """A whole measurement is repeated (fresh processes) until two rounds agree within 5 % on
    every backend; the layer times are then those two rounds'. An outlier round (here 40 % slow,
    as one process set was on this VM) does not set the plan's costs, nor make the record noisy."""
    from frontend.profile import combine_rounds, measure_rounds
    once, calls = _rounds_of(_round(14.0, 10.0), _round(10.0, 10.2), _round(10.2, 10.1),
                             _round(99.0, 99.0))
    res = measure_rounds(once, (2, 4))
    assert len(calls) == 3                               # rounds 2 and 3 agree: stop there
    t = res["torch"]["block"]
    assert t["fwd_s"] + t["bwd_s"] == pytest.approx(10.1e-3)      # 10 and 10.2 ms, not 14
    assert t["rounds"] == 3 and res["numpy"]["block"]["reps"] == 7
    assert max(t["fwd_spread"], t["bwd_spread"]) == pytest.approx(0.2 / 10.1)
    assert not problems(dict(_rec(), spread=t["fwd_spread"]))
    # an early round may be the one that agrees: 1 and 3 here
    once, calls = _rounds_of(_round(10.0), _round(13.0), _round(10.1), _round(50.0))
    res = measure_rounds(once, (2, 4))
    assert len(calls) == 3
    assert res["torch"]["block"]["fwd_s"] * 3e3 == pytest.approx(10.05)
    # two agreeing rounds at once: the fewest allowed
    once, calls = _rounds_of(_round(10.0), _round(10.2), _round(50.0))
    measure_rounds(once, (2, 4))
    assert len(calls) == 2
    # rounds that never agree stop at the most allowed: the median of all, a noisy record
    once, calls = _rounds_of(_round(10.0), _round(13.0), _round(16.0), _round(1.0))
    res = measure_rounds(once, (1, 3))
    assert len(calls) == 3
    t = res["torch"]["block"]
    assert t["fwd_s"] * 3e3 == pytest.approx(13.0)
    assert any(p.startswith("noisy") for p in problems(dict(_rec(), spread=t["fwd_spread"])))
    # one round: the measurement as it came
    assert combine_rounds([_round(10.0)])["torch"]["block"]["fwd_spread"] == 0.01


def test_rounds_setting_is_checked(monkeypatch):
    from frontend.profile import ROUNDS, rounds_setting
    monkeypatch.delenv("H2_CALIBRATION_ROUNDS", raising=False)
    assert rounds_setting() == ROUNDS
    monkeypatch.setenv("H2_CALIBRATION_ROUNDS", "3")
    assert rounds_setting() == (3, 3)
    monkeypatch.setenv("H2_CALIBRATION_ROUNDS", "1,5")
    assert rounds_setting() == (1, 5)
    for bad in ("0", "5,2", "x", "1,2,3"):
        monkeypatch.setenv("H2_CALIBRATION_ROUNDS", bad)
        with pytest.raises(H2Error, match="H2_CALIBRATION_ROUNDS"):
            rounds_setting()


def test_layer_times_are_taken_in_a_chain_of_every_layer_as_a_micro_batch_runs():
    """Each layer's forward in order, outputs held, then each backward in reverse; a kind's
    time is the mean over its layers; repeated until the sweeps' totals settle."""
    import weakref
    from types import SimpleNamespace
    from frontend.profile import layer_chain, time_until_stable
    calls, live = [], weakref.WeakSet()
    progs = [SimpleNamespace(fwd=("f", i), bwd=("b", i)) for i in range(4)]
    kinds = ["embedding", "block", "block", "head"]

    class Out:                      # a forward's output: alive until the chain lets it go
        pass

    def run(g, env):
        calls.append((g, len(live)))
        if g[0] == "f":
            out = Out()
            live.add(out)
            return out
    sweep = layer_chain(progs, [{"fwd": {}, "bwd": {}}] * 4, kinds, run, lambda: None)
    got = sweep()
    assert [g for g, _ in calls] == [("f", 0), ("f", 1), ("f", 2), ("f", 3),
                                     ("b", 3), ("b", 2), ("b", 1), ("b", 0)]
    assert [n for g, n in calls if g[0] == "b"] == [4, 4, 4, 4] and not live
    assert set(got) == {(k, d) for k in kinds for d in ("fwd", "bwd")}
    times, spreads, reps = time_until_stable(lambda: {"a": 0.01, "b": 0.02}, min_reps=3,
                                             window=3)
    assert times == {"a": 0.01, "b": 0.02} and spreads == {"a": 0.0, "b": 0.0} and reps == 3
