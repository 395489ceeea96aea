"""Resource model: memory accounting, collective and p2p formulas, compute times, calibration."""
import dataclasses
import json

import pytest

from backends.calibrate import ensure_calibration
from h2ir.planner.calibration import (Calibration, load_calibration,
                              record_layer_times, save_calibration)
from h2ir.clusters.cluster import ChipType, Cluster, NodeGroup
from h2ir.costs import MoEInfo
from h2ir.errors import H2Error
from h2ir.plans.plan import MoEPlan, Plan, StagePlan
from h2ir.planner.resource import (state_bytes_per_param, ResourceModel, all_to_all_flat_time, all_to_all_halo_time,
                           analytic_llama_costs, hierarchical_allreduce_time, p2p_time,
                           piper_moe_memory, ring_allreduce_time, stage_memory,
                           state_bytes_per_param)

GiB = 2 ** 30


def chip(name="X", tflops=100.0, mem_gib=80, backend="cuda", measured=False, eff=0.5):
    return ChipType(name, backend, "v", {"bf16": tflops * 1e12, "fp32": tflops * 1e12 / 4},
                    mem_gib * GiB, 2e12, efficiency=eff, measured=measured)


def cluster(dtype="bf16", chips=None, groups=None):
    chips = chips or {"X": chip("X"), "Y": chip("Y", tflops=50, mem_gib=40)}
    groups = groups or (NodeGroup("X", 2, 8, intra_bw=200e9, nics_per_node=4, nic_bw=25e9),
                        NodeGroup("Y", 2, 8, intra_bw=100e9, nics_per_node=2, nic_bw=25e9))
    return Cluster("t", chips, groups, dtype=dtype)


def costs(layers=8, d=1024, seq=512, mb=1):
    return analytic_llama_costs("m", layers, d, 8, 4 * d, 8000, seq, micro_batch=mb, dtype_bytes=4)


def plan_of(c, stages, dp=1, gb=8, mb=1, schedule="1f1b", moe=None):
    return Plan("m", "t", gb, mb, c.seq_len, stages, dp=dp, schedule=schedule, moe=moe)


def split(c, counts, chips=("X",), tp=1, dp=1, recompute="none"):
    names, out, i = c.layer_names(), [], 0
    for j, n in enumerate(counts):
        out.append(StagePlan(chips[j % len(chips)], dp * tp, names[i:i + n], tp=tp, recompute=recompute))
        i += n
    assert i == len(names)
    return out


# -- memory --------------------------------------------------------------------------------------

def test_state_bytes_follow_zero_and_the_fp32_accounting():
    mixed = state_bytes_per_param("bf16")
    assert (mixed.weights, mixed.grads, mixed.optimizer, mixed.total) == (2, 2, 12, 16)
    fp32 = state_bytes_per_param("fp32")
    assert fp32.weights + fp32.optimizer == 12          # the persistent 12 B/param
    assert fp32.total == 16                             # plus the live gradient buffer


def test_training_dtypes_are_sized_by_the_ir_dtype_table():
    from h2ir.planner.resource import dtype_bytes
    from h2ir.types import DTYPE_POLICIES, DTYPE_TABLE, TRAIN_DTYPES
    assert {n: dtype_bytes(n) for n in TRAIN_DTYPES} == \
        {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
    assert all(t.itemsize == DTYPE_TABLE[t.storage].itemsize
               for t in TRAIN_DTYPES.values() if t.storage)
    assert DTYPE_POLICIES == ("fp32", "bf16")          # the dtypes a stage trains in
    with pytest.raises(H2Error, match="unknown training dtype 'f32'.*fp32, tf32, bf16"):
        dtype_bytes("f32")


def test_analytic_100b_has_the_h2_parameter_count():
    c = analytic_llama_costs("llama_100b", 96, 8192, 64, 36864, 32000, 4096)
    assert len(c.layers) == 98
    assert c.total_params == pytest.approx(113.27e9, rel=1e-3)


def test_weights_grads_optimizer_are_divided_by_tp():
    c, cl = costs(), cluster()
    p = c.total_params
    for tp in (1, 2, 4):
        plan = plan_of(c, split(c, [len(c.layers)], tp=tp))
        m = stage_memory(c, plan, cl, 0)
        assert m.items["weights"] == pytest.approx(2 * p / tp, rel=1e-6)
        assert m.items["grads"] == pytest.approx(2 * p / tp, rel=1e-6)
        assert m.items["optimizer"] == pytest.approx(12 * p / tp, rel=1e-6)
        assert m.capacity == cl.chip("X").usable_mem_bytes    # 80 GiB less the headroom


def test_1f1b_stage_j_holds_s_minus_j_microbatches_and_gpipe_holds_m():
    c, cl = costs(layers=6), cluster()
    S, m = 4, 8
    for schedule, expect in (("1f1b", [4, 3, 2, 1]), ("gpipe", [m] * S)):
        plan = plan_of(c, split(c, [2, 2, 2, 2]), gb=m, schedule=schedule)
        for j in range(S):
            mem = stage_memory(c, plan, cl, j)
            assert mem.inflight == expect[j]
            # at the traced width: the bf16 policy keeps activations in f32
            # (backends/torch/runtime.py), so a bf16 cluster does not halve them
            a = sum(c.layer(n).act_saved_bytes for n in plan.stages[j].layers)
            assert mem.items["activations"] == pytest.approx(expect[j] * a, rel=1e-6)


def test_full_recompute_keeps_layer_inputs_and_one_working_set():
    c, cl = costs(layers=6), cluster()
    plan = plan_of(c, split(c, [8], recompute="full"), gb=4)
    mem = stage_memory(c, plan, cl, 0)
    inflight = 1
    L = c.layers
    # kept: every layer's input (the first one's is the token ids, not an activation)
    ins = sum(l.out_bytes for l in L[:-1])
    assert mem.items["activations"] == pytest.approx(inflight * ins, rel=1e-6)
    # the backward's peak: walking the layers backwards, the gradients made so far plus the
    # layer's re-made activations (the last layer: also the loss's log-probabilities and the
    # two gradients its backward holds), or every gradient at the end
    grad = [l.params * state_bytes_per_param(cl.dtype).grads for l in L]
    walk = [sum(grad[i + 1:]) + L[i].act_saved_bytes + (3 * L[i].out_bytes if i == len(L) - 1 else 0)
            for i in range(len(L))]
    assert mem.items["backward_working_set"] == pytest.approx(max(walk + [sum(grad)]), rel=1e-6)
    assert "loss" not in mem.items
    none = stage_memory(c, plan_of(c, split(c, [8]), gb=4), cl, 0)
    assert none.items["loss"] == L[-1].out_bytes
    assert mem.total < none.total


def test_selective_recompute_keeps_what_the_rule_keeps():
    c, cl = costs(layers=6), cluster()
    c = dataclasses.replace(c, layers=tuple(dataclasses.replace(
        l, act_selective_bytes=l.act_saved_bytes // 2) for l in c.layers))
    sel = stage_memory(c, plan_of(c, split(c, [8], recompute="selective"), gb=4), cl, 0)
    none = stage_memory(c, plan_of(c, split(c, [8]), gb=4), cl, 0)
    assert sel.items["activations"] == pytest.approx(
        sum(l.act_saved_bytes // 2 for l in c.layers), rel=1e-6)
    assert none.items["activations"] == sum(l.act_saved_bytes for l in c.layers)
    assert sel.total < none.total


def test_piper_moe_terms():
    moe = MoEInfo(num_experts=8, top_k=2, d_model=1024, d_ffn=2048, expert_params=3 * 1024 * 2048)
    t = piper_moe_memory(moe, micro_batch=2, seq_len=512, ep=4)
    assert t.attention_state == 64 * 1024 ** 2
    assert t.expert_state == 48 * 8 * 1024 * 2048 / 4
    assert t.expert_activations == 2 * 2 * 512 * 2 * (3 * 2048 + 1024) / 4


def test_moe_expert_state_divides_by_ep():
    moe = MoEInfo(num_experts=8, top_k=2, d_model=512, d_ffn=1024, expert_params=0)
    c = analytic_llama_costs("moe", 4, 512, 8, 2048, 4000, 256, moe=moe, dtype_bytes=2)
    cl = cluster()
    names = c.layer_names()
    mems = []
    for ep in (1, 2, 4):
        plan = plan_of(c, [StagePlan("X", 4, names, tp=1)], dp=4, gb=8, moe=MoEPlan(ep=ep))
        mems.append(stage_memory(c, plan, cl, 0).items["weights"])
    expert = sum(l.moe.num_experts * l.moe.expert_params for l in c.layers if l.moe)
    assert mems[0] - mems[1] == pytest.approx(2 * expert / 2, rel=1e-6)
    assert mems[0] - mems[2] == pytest.approx(2 * expert * 3 / 4, rel=1e-6)


# -- collectives and links -----------------------------------------------------------------------

def test_ring_allreduce_is_patarasuk_yuan():
    assert ring_allreduce_time(1e9, 4, 1e9, 0.0) == pytest.approx(2 * 3 / 4)
    assert ring_allreduce_time(1e9, 1, 1e9, 1.0) == 0.0
    assert ring_allreduce_time(0, 8, 1e9, 1e-5) == 0.0
    assert ring_allreduce_time(1e6, 4, 1e9, 1e-3) == pytest.approx(1.5e-3 + 6e-3)


def test_hierarchical_allreduce_beats_flat_ring_over_slow_nics():
    nbytes, k, N = 1e9, 8, 4
    hier = hierarchical_allreduce_time(nbytes, k, N, intra_bw=200e9, inter_bw=10e9,
                                       intra_latency=0, inter_latency=0)
    flat = ring_allreduce_time(nbytes, k * N, 10e9, 0)
    assert hier < flat
    # intra RS + AG: 2 * 7/8 * 1e9 / 200e9; inter ring on 1/8 shards over 4 nodes
    assert hier == pytest.approx(2 * 7 / 8 * 1e9 / 200e9 + 2 * 3 / 4 * (1e9 / 8) / 10e9)


def test_halo_all_to_all_saves_latency_across_nodes_and_equals_flat_in_one_node():
    args = (1e6, 64, 8, 200e9, 10e9, 2e-6, 20e-6)
    assert all_to_all_halo_time(*args) < all_to_all_flat_time(*args)
    one = (1e6, 8, 8, 200e9, 10e9, 2e-6, 20e-6)
    assert all_to_all_halo_time(*one) == all_to_all_flat_time(*one)


def test_p2p_intra_node_vs_nic_and_cross_type():
    cl = cluster()
    intra = p2p_time(1e8, cl, "X", 1, "X", 1, 1)
    assert intra == pytest.approx(cl.group("X").intra_latency + 1e8 / 200e9)
    # 8 replicas x 2 stages do not fit a node of 8 -> NIC share 4 x 25e9 / 8 per chip
    nic = p2p_time(1e8, cl, "X", 1, "X", 1, 8)
    assert nic == pytest.approx(cl.group("X").inter_latency + 1e8 / (4 * 25e9 / 8))
    # X -> Y: the slower side's NIC share (Y: 2 NICs for 8 chips), times TP (scatter/gather)
    cross = p2p_time(1e8, cl, "X", 2, "Y", 2, 1)
    assert cross == pytest.approx(10e-6 + 1e8 / (2 * 2 * 25e9 / 8))


# -- compute time ----------------------------------------------------------------------------------

def test_tp_divides_compute_and_adds_two_allreduces_per_block_per_pass():
    from h2ir.planner.resource import layer_op_split
    c, cl = costs(), cluster()
    rm = ResourceModel(c, cl)
    i = c.layer_names().index("block.0")
    t1 = rm.layer_times("X", 1)
    t4 = rm.layer_times("X", 4)
    x = cl.chip("X")
    mm_f, at_f, mm_b, at_b, mem = layer_op_split(rm.la, i)
    rate, arate, bw = x.flops("bf16"), x.flops("bf16", "attention"), x.mem_bw * x.eff("memory")
    # matmul and attention FLOPs split over TP; of the memory-bound work only the replicated
    # residual stream's part (4 b*s*d tensors of the block's 14d + 4ffn per token) runs whole
    assert t1.fwd_layer[i] == pytest.approx(mm_f / rate + at_f / arate + mem / bw)
    d, ffn = c.d_model, 4 * c.d_model
    rep = 4 * d / (14 * d + 4 * ffn)
    share = rep + (1 - rep) / 4
    ar = ring_allreduce_time(c.layers[i].out_bytes, 4, 200e9, cl.group("X").intra_latency)
    assert t4.fwd_layer[i] == pytest.approx((mm_f / rate + at_f / arate) / 4 + share * mem / bw + 2 * ar)
    assert t4.bwd_layer[i] == pytest.approx((mm_b / rate + at_b / arate) / 4 + 2 * share * mem / bw + 2 * ar)


def test_tp_without_sequence_parallelism_keeps_the_residual_stream_whole():
    """Korthikanti et al. 2022 Sec. 4.2.1: with TP and no SP a block keeps 4 b*s*d tensors
    (the norms' inputs and outputs) on every rank, the rest divides by t; layer inputs and
    outputs (full recompute's kept inputs, the p2p buffers) are whole."""
    c, cl = costs(layers=4), cluster()
    tok, d = c.micro_batch * c.seq_len, c.d_model
    block = c.layer("block.0")
    rep = 4 * tok * d * 4
    for tp in (1, 2, 8):
        plan = plan_of(c, split(c, [1, 4, 1], tp=tp), gb=1)
        mem = stage_memory(c, plan, cl, 1)
        assert mem.items["activations"] == pytest.approx(
            4 * (rep + (block.act_saved_bytes - rep) / tp), rel=1e-6)
        rc = stage_memory(c, plan_of(c, split(c, [1, 4, 1], tp=tp, recompute="full"), gb=1), cl, 1)
        assert rc.items["activations"] == pytest.approx(4 * block.out_bytes, rel=1e-6)
        assert mem.items["p2p_buffers"] == pytest.approx(2 * block.out_bytes, rel=1e-6)


def test_the_full_recompute_rerun_leaves_out_the_collectives():
    c, cl = costs(), cluster()
    rm = ResourceModel(c, cl)
    for tp in (1, 4):
        lt = rm.layer_times("X", tp)
        no_comm = rm.layer_times("X", tp, tp_estimate=False)
        i = 3
        rerun = (lt.bwd_rc[i + 1] - lt.bwd_rc[i]) - lt.bwd_layer[i]
        assert rerun == pytest.approx(no_comm.fwd_layer[i])


def test_recompute_adds_a_forward_to_the_backward():
    c, cl = costs(), cluster()
    rm = ResourceModel(c, cl)
    f, b = rm.compute_times("X", 1, 1, 5, "none")
    f2, b2 = rm.compute_times("X", 1, 1, 5, "full")
    assert f2 == f and b2 == pytest.approx(b + f)


def test_micro_batch_scales_compute_linearly():
    c, cl = costs(), cluster()
    f1, _ = ResourceModel(c, cl, micro_batch=1).compute_times("X", 1, 0, len(c.layers), "none")
    f4, _ = ResourceModel(c, cl, micro_batch=4).compute_times("X", 1, 0, len(c.layers), "none")
    assert f4 == pytest.approx(4 * f1, rel=1e-6)


def fake_calibration(flops=50e9, bw=10e9, layer_times=None):
    return Calibration(backends={b: {"threads": 1, "dtype": "fp32", "matmul": {"512": flops},
                                     "matmul_flops": flops, "mem_bw": bw, "quick": False}
                                 for b in ("torch", "numpy")},
                       layer_times=layer_times or {})


def local_cluster():
    cpu = ChipType("cpu", "torch", "cpu", {"fp32": 1e11}, 8 * GiB, 1e10, measured=True)
    return Cluster("local", {"cpu": cpu}, (NodeGroup("cpu", 1, 2, intra_bw=2e9),), dtype="fp32")


def test_measured_chips_use_calibration_not_catalog_peaks():
    c, cl = costs(), local_cluster()
    rm = ResourceModel(c, cl, calibration=fake_calibration(flops=50e9))
    r = rm.rates("cpu")
    assert r.source == "measured" and r.flops == 50e9 and r.mem_bw == 10e9
    i = c.layer_names().index("block.0")
    assert rm.layer_times("cpu", 1).fwd_layer[i] == pytest.approx(c.layers[i].fwd_flops / 50e9)


def test_optimizer_step_is_timed_at_the_backends_measured_adamw_rate():
    """The step runs a dozen elementwise passes, so a copy's bandwidth makes it look 2-4x
    faster than it is (measured 47 ms against 12 predicted for llama_tiny); a calibration that
    measured the backend's own adamw_step is used, an older one falls back to mem_bw."""
    c, cl = costs(), local_cluster()
    old = ResourceModel(c, cl, calibration=fake_calibration(bw=10e9))
    cal = fake_calibration(bw=10e9)
    cal.backends["torch"]["opt_bw"] = 2.5e9
    new = ResourceModel(c, cl, calibration=cal)
    n = len(c.layers)
    assert new.opt_step_time("cpu", 1, 0, n) == pytest.approx(4 * old.opt_step_time("cpu", 1, 0, n))
    assert cal.opt_bw("torch") == 2.5e9 and cal.opt_bw("numpy") is None


def test_recorded_layer_times_are_preferred_and_scaled_by_tokens():
    c, cl = costs(seq=512), local_cluster()
    rec = {"torch": {"transformer_block": {"fwd_s": 0.01, "bwd_s": 0.03, "micro_batch": 1, "seq_len": 256}}}
    rm = ResourceModel(c, cl, micro_batch=2, calibration=fake_calibration(layer_times=rec))
    i = c.layer_names().index("block.3")
    lt = rm.layer_times("cpu", 1)
    assert lt.fwd_layer[i] == pytest.approx(0.01 * 4)        # 2 x 512 tokens vs 1 x 256
    # the backward also adds the layer's gradients into the step's sums: 3 x 4 bytes per
    # parameter at the measured copy bandwidth (the layer records do not contain it)
    acc = 3 * 4 * c.layers[i].params / rm.rates("cpu").mem_bw
    assert rm.grad_accumulation_time(rm.rates("cpu"), c.layers[i].params) == pytest.approx(acc)
    assert lt.bwd_layer[i] == pytest.approx(0.03 * 4 + acc)
    # the head has no recorded kind: FLOPs / measured matmul rate
    h = c.layer_names().index("head")
    assert lt.fwd_layer[h] == pytest.approx(2 * c.layers[h].fwd_flops / 50e9)


def test_calibration_file_round_trip_and_record_layer_times(tmp_path, monkeypatch):
    path = tmp_path / "cal.json"
    monkeypatch.setenv("H2_CALIBRATION", str(path))
    assert load_calibration() is None
    save_calibration(fake_calibration())
    record_layer_times("numpy", "transformer_block", 0.5, 1.0, 2, 64, fwd_flops=100, bwd_flops=200)
    cal = load_calibration()
    assert cal.matmul_flops("torch") == 50e9
    (rec,) = cal.records.values()      # a keyed record (tests/test_costs.py checks the keys)
    assert rec["layers"]["transformer_block"]["fwd_flops"] == 100
    d = json.loads(path.read_text())
    assert d["version"] == 2 and "torch" in d["backends"]
    with pytest.raises(H2Error):
        record_layer_times("numpy", "transformer_block", -1.0, 1.0, 2, 64)
    path.write_text("{not json")
    with pytest.raises(H2Error) as e:
        load_calibration()
    assert str(path) in str(e.value)


def test_missing_backend_is_measured_quickly_and_cached(tmp_path, monkeypatch):
    path = tmp_path / "cal.json"
    monkeypatch.setenv("H2_CALIBRATION", str(path))
    cal = ensure_calibration(["numpy"])
    rec = cal.backends["numpy"]
    assert rec["threads"] == 1 and rec["quick"] is True
    assert 1e8 < rec["matmul_flops"] < 1e13 and 1e8 < rec["mem_bw"] < 1e13
    assert 1e7 < rec["opt_bw"] < rec["mem_bw"] * 2     # state bytes/s of the backend's AdamW
    assert json.loads(path.read_text())["backends"]["numpy"]["matmul_flops"] == rec["matmul_flops"]
    # cached: a second call does not re-measure
    again = ensure_calibration(["numpy"])
    assert again.backends["numpy"]["measured_at"] == rec["measured_at"]


def test_unknown_backend_cannot_be_measured_here(tmp_path, monkeypatch):
    monkeypatch.setenv("H2_CALIBRATION", str(tmp_path / "c.json"))
    with pytest.raises(H2Error, match="unknown backend"):
        ensure_calibration(["cann"])


# -- links by where the build puts each worker (LinePlacement) -------------------------------------

def _testbed_cluster(nic_bw=12.5e6, intra_bw=2e9):
    return Cluster("tb", {"X": chip("X")}, (NodeGroup("X", 2, 2, intra_bw=intra_bw, nics_per_node=1,
                                                     nic_bw=nic_bw),), dtype="fp32")


def test_placement_follows_worker_hosts_and_shares_each_nic():
    from h2ir.planner.resource import LinePlacement
    from h2ir.schedule.streams import WorkerLayout, worker_hosts
    cl = _testbed_cluster()
    # 2 stages x dp 2 on 2 hosts of 2 chips: a replica per host (replica-major ids), so each
    # stage's all-reduce crosses and the stage boundary does not
    dp2 = LinePlacement(cl, (("X", 1), ("X", 1)), 2)
    assert list(dp2.hosts) == worker_hosts(WorkerLayout(2, (1, 1)), ["X", "X"], cl) == [0, 0, 1, 1]
    assert dp2.crossing == {"boundaries": [], "allreduce": [0, 1]}
    assert dp2.boundary(0) == (cl.groups[0].intra_latency, 2e9)
    # both stages' rings leave each host: the NIC is split between the two
    B = 20e6
    assert dp2.allreduce_time(0, B) == pytest.approx(ring_allreduce_time(B, 2, 12.5e6 / 2, 10e-6))
    # 4 stages, dp 1: only the boundary 1 -> 2 crosses; its sender has the NIC to itself
    pp4 = LinePlacement(cl, (("X", 1),) * 4, 1)
    assert pp4.crossing == {"boundaries": [1], "allreduce": []}
    assert pp4.boundary(1) == (10e-6, 12.5e6) and pp4.boundary(0)[1] == 2e9
    # 1 stage x dp 4: one ring w0 w1 w2 w3, one edge leaving each host, paced by it
    dp4 = LinePlacement(cl, (("X", 1),), 4)
    assert dp4.allreduce_time(0, B) == pytest.approx(ring_allreduce_time(B, 4, 12.5e6, 10e-6))
    # dp 2 of 1 stage: both replicas on host 0, the ring stays inside
    dp2one = LinePlacement(cl, (("X", 1),), 2)
    assert dp2one.crossing["allreduce"] == []
    assert dp2one.allreduce_time(0, B) == pytest.approx(ring_allreduce_time(B, 2, 2e9, 5e-6))


def test_stage_times_cost_the_links_the_build_opens():
    """The simulator's all-reduce and p2p times come from the placement, so a plan whose
    all-reduce crosses a slow NIC is costed by it and one that keeps it inside is not."""
    from h2ir.planner.simulate import simulate
    c, cl = costs(layers=4, d=256, seq=128), _testbed_cluster()
    names = c.layer_names()
    dp2 = plan_of(c, [StagePlan("X", 2, names[:3]), StagePlan("X", 2, names[3:])], dp=2, gb=8)
    pp4 = plan_of(c, [StagePlan("X", 1, names[a:b]) for a, b in ((0, 2), (2, 3), (3, 4), (4, 6))],
                  dp=1, gb=8)
    rm = ResourceModel(c, cl, 1, c.seq_len)
    t = rm.stage_times(dp2, 0)
    grads = sum(l.params for l in c.layers[:3]) * 4
    assert t.dp_allreduce_s == pytest.approx(ring_allreduce_time(grads, 2, 12.5e6 / 2, 10e-6))
    assert t.send_act_s == pytest.approx(cl.groups[0].intra_latency + c.layers[2].out_bytes / 2e9)
    crossing = rm.stage_times(pp4, 1).send_act_s
    assert crossing == pytest.approx(10e-6 + c.layers[2].out_bytes / 12.5e6)
    assert simulate(c, pp4, cl).step_time_s < simulate(c, dp2, cl).step_time_s


def test_a_tp_group_the_placement_puts_on_two_hosts_pays_the_nic():
    """Nodes of 2 chips: a tp 1 stage then a tp 2 stage puts the tp 2 group on chips 1 and 2,
    two hosts (worker_hosts), so its all-reduces cross the NIC; the same stage first is inside
    a node. A TP group wider than a node always crosses."""
    from h2ir.planner.resource import tp_allreduce_time
    c = costs(layers=4)
    x = chip("X")
    g = NodeGroup("X", 2, 2, intra_bw=200e9, nics_per_node=1, nic_bw=5e9)
    cl = Cluster("t", {"X": x}, (g,), dtype="bf16")
    names = c.layer_names()
    rm = ResourceModel(c, cl)
    straddle = plan_of(c, [StagePlan("X", 1, names[:2], tp=1), StagePlan("X", 2, names[2:], tp=2)])
    aligned = plan_of(c, [StagePlan("X", 2, names[:4], tp=2), StagePlan("X", 1, names[4:], tp=1)])
    assert rm.plan_placement(straddle).tp_crosses(1) and not rm.plan_placement(aligned).tp_crosses(0)
    slow = rm.stage_times(straddle, 1).fwd_s
    fast = rm.compute_times("X", 2, 2, len(names), "none")[0]
    assert slow > fast
    assert tp_allreduce_time(1e8, g, 4) == tp_allreduce_time(1e8, g, 4, cross=True) > \
        tp_allreduce_time(1e8, g, 2)
