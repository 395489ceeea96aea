"""Simulator: interprets build_streams' instruction streams with the resource model's durations."""
import json

import pytest

from h2ir.clusters.cluster import ChipType, Cluster, NodeGroup
from h2ir.errors import H2Error
from h2ir.plans.plan import Plan, StagePlan
from h2ir.planner.resource import ResourceModel, analytic_llama_costs, stage_memory
from h2ir.schedule.streams import Instr, build_streams
from h2ir.planner.simulate import SimulatedWorker, Timeline, run_streams, simulate
from h2ir.schedule.trace import TraceEvent, chrome_trace

GiB = 2 ** 30


def cluster(latency=0.0, nic_bw=1e18, intra_bw=1e18, mem_bw=1e18, cpn=8, nodes=2, tflops=100.0):
    x = ChipType("X", "cuda", "v", {"bf16": tflops * 1e12}, 80 * GiB, mem_bw)
    y = ChipType("Y", "cuda", "v", {"bf16": tflops * 0.5e12}, 40 * GiB, mem_bw)
    g = lambda c: NodeGroup(c, nodes, cpn, intra_bw=intra_bw, nic_bw=nic_bw,
                            intra_latency=latency, inter_latency=latency)
    return Cluster("t", {"X": x, "Y": y}, (g("X"), g("Y")), dtype="bf16")


def even_plan(costs, S, m, dp=1, schedule="1f1b", chips=("X",), tp=1):
    """Blocks split evenly; embed/head are zero-FLOP-ish so stage times stay equal enough."""
    names = costs.layer_names()
    blocks = [n for n in names if n.startswith("block.")]
    per = len(blocks) // S
    stages = []
    for j in range(S):
        ls = blocks[j * per:(j + 1) * per]
        stages.append(StagePlan(chips[j % len(chips)], dp * tp, ls, tp=tp))
    return Plan("m", "t", m * dp, 1, costs.seq_len, stages, dp=dp, schedule=schedule)


def blocks_only(layers=8, d=512, seq=256):
    """Costs with only transformer blocks (equal stage times under an even split)."""
    c = analytic_llama_costs("m", layers, d, 8, 4 * d, 4000, seq, dtype_bytes=2)
    import dataclasses
    return dataclasses.replace(c, layers=tuple(l for l in c.layers if l.kind == "transformer_block"))


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("S,m", [(4, 8), (3, 3), (4, 2)])
def test_equal_stages_give_the_textbook_makespan_and_bubble(schedule, S, m):
    c, cl = blocks_only(layers=12), cluster()
    plan = even_plan(c, S, m, schedule=schedule)
    r = simulate(c, plan, cl)
    st = r.stage_times[0]
    t = st.fwd_s + st.bwd_s
    # (m + S - 1)(f + b) for a pipeline of equal stages (GPipe, Huang et al. 2019; 1F1B,
    # Narayanan et al. SC'21 Sec. 2.2), bubble (S - 1)/(m + S - 1)
    assert r.flush_time_s == pytest.approx((m + S - 1) * t, rel=1e-9)
    assert r.bubble_fraction == pytest.approx((S - 1) / (m + S - 1), rel=1e-7)
    assert r.step_time_s >= r.flush_time_s


def test_inflight_activations_tracked_from_the_stream():
    c, cl = blocks_only(layers=12), cluster()
    S, m = 4, 8
    r = simulate(c, even_plan(c, S, m, schedule="1f1b"), cl)
    assert [r.inflight_peak[w] for w in range(S)] == [S - j for j in range(S)]
    g = simulate(c, even_plan(c, S, m, schedule="gpipe"), cl)
    assert [g.inflight_peak[w] for w in range(S)] == [m] * S
    # the tracked count reproduces the resource model's schedule-derived memory
    plan = even_plan(c, S, m, schedule="1f1b")
    for j in range(S):
        assert r.stage_memory[j].total == stage_memory(c, plan, cl, j).total


def test_symmetric_replicas_match_the_full_simulation():
    c, cl = blocks_only(layers=6), cluster(latency=5e-6, nic_bw=10e9, intra_bw=100e9, mem_bw=2e12)
    plan = even_plan(c, 3, 6, dp=3)
    full = simulate(c, plan, cl, symmetric=False)
    sym = simulate(c, plan, cl, symmetric=True)
    assert len(full.inflight_peak) == 9 and len(sym.inflight_peak) == 3
    assert sym.step_time_s == pytest.approx(full.step_time_s, rel=1e-12)
    assert sym.bubble_fraction == pytest.approx(full.bubble_fraction, rel=1e-12)


def test_recv_waits_for_the_matching_send_plus_transfer():
    c = blocks_only(layers=8)
    plan = even_plan(c, 4, 4)
    fast = simulate(c, plan, cluster())
    lat = 1e-3
    slow = simulate(c, plan, cluster(latency=lat))
    # the first micro-batch crosses 3 boundaries forward and 3 back on the critical path
    assert slow.flush_time_s - fast.flush_time_s >= 2 * 3 * lat * (1 - 1e-9)
    assert slow.stage_times[0].send_act_s == pytest.approx(lat)


def test_all_reduce_synchronises_and_costs_the_dp_time():
    c = blocks_only(layers=8)
    cl = cluster(latency=1e-5, intra_bw=50e9, nic_bw=5e9, mem_bw=2e12)
    one = simulate(c, even_plan(c, 2, 4, dp=1), cl)
    two = simulate(c, even_plan(c, 2, 4, dp=2), cl)
    ar = two.stage_times[0].dp_allreduce_s
    assert ar > 0 and one.stage_times[0].dp_allreduce_s == 0
    # stage 0 finishes last; its all-reduce sits on the critical path
    assert two.step_time_s - one.step_time_s == pytest.approx(ar, rel=1e-6)
    names = [e.name for e in two.events if e.worker == 0]
    assert names[-2:] == ["all_reduce grads", "opt_step"]


def test_heterogeneous_stages_slow_stage_paces_the_pipeline():
    c = blocks_only(layers=8)
    cl = cluster()
    fast = simulate(c, even_plan(c, 2, 16, chips=("X", "X")), cl)
    mixed = simulate(c, even_plan(c, 2, 16, chips=("X", "Y")), cl)   # Y is 2x slower
    t_x = mixed.stage_times[0].fwd_s + mixed.stage_times[0].bwd_s
    t_y = mixed.stage_times[1].fwd_s + mixed.stage_times[1].bwd_s
    assert t_y == pytest.approx(2 * t_x)
    # the slow stage is busy for all 16 micro-batches after the first forward reaches it
    assert mixed.flush_time_s == pytest.approx(mixed.stage_times[0].fwd_s + 16 * t_y + mixed.stage_times[0].bwd_s, rel=1e-6)
    assert mixed.step_time_s > fast.step_time_s
    assert mixed.mfu["Y"] > mixed.mfu["X"]      # the slow chip is the busy one


def test_trace_has_chrome_shape():
    c = blocks_only(layers=4)
    r = simulate(c, even_plan(c, 2, 3), cluster(latency=1e-6, nic_bw=1e10, intra_bw=1e11))
    tr = json.loads(json.dumps(r.trace()))
    xs = [e for e in tr["traceEvents"] if e["ph"] == "X"]
    names = {e["name"] for e in xs}
    assert {"F0", "B0", "F2", "B2", "send_act 0", "send_grad 0", "opt_step"} <= names
    assert {e["pid"] for e in xs} == {0, 1}
    threads = {(e["pid"], e["args"]["name"]) for e in tr["traceEvents"] if e["name"] == "thread_name"}
    assert (0, "compute") in threads and (0, "comm") in threads
    f0 = next(e for e in xs if e["name"] == "F0" and e["pid"] == 1)
    send = next(e for e in xs if e["name"] == "send_act 0" and e["pid"] == 0)
    assert f0["ts"] >= send["ts"] + send["dur"] - 1e-3      # stage 1 starts after the data arrives


def test_measured_events_use_the_same_writer():
    events = [TraceEvent(0, "compute", "F0", 0.0, 0.5), TraceEvent(1, "comm", "recv_act 0", 0.5, 0.1)]
    tr = chrome_trace(events, {0: "w0", 1: "w1"}, {"kind": "measured"})
    xs = [e for e in tr["traceEvents"] if e["ph"] == "X"]
    assert xs[0] == {"ph": "X", "name": "F0", "pid": 0, "tid": 0, "ts": 0.0, "dur": 500000.0, "cat": "compute"}
    assert tr["otherData"]["kind"] == "measured"


def test_stream_deadlock_is_an_error():
    c = blocks_only(layers=4)
    plan = even_plan(c, 2, 1)
    rm = ResourceModel(c, cluster())
    times = [rm.stage_times(plan, j) for j in range(2)]
    streams = {0: [Instr("recv_grad", 0, 1), Instr("fwd", 0)], 1: [Instr("recv_act", 0, 0)]}
    with pytest.raises(H2Error, match="deadlock"):
        tl = Timeline()
        run_streams([SimulatedWorker(w, streams[w], times[w], tl, {0, 1}) for w in (0, 1)])


def test_simulator_consumes_build_streams():
    """The simulated compute order per worker is exactly build_streams' fwd/bwd order."""
    c = blocks_only(layers=6)
    plan = even_plan(c, 3, 5)
    r = simulate(c, plan, cluster())
    streams = build_streams("1f1b", 3, 5, 1)
    for w in range(3):
        want = [f"{i.op[0].upper()}{i.mb}" for i in streams[w] if i.op in ("fwd", "bwd")]
        got = [e.name for e in sorted(r.events, key=lambda e: e.start_s)
               if e.worker == w and e.lane == "compute" and e.name != "opt_step"]
        assert got == want


def test_bad_batch_is_an_error():
    c = blocks_only(layers=4)
    plan = even_plan(c, 2, 3)
    plan.micro_batch = 2          # 3 sequences do not split into micro-batches of 2
    with pytest.raises(H2Error, match="not a multiple"):
        simulate(c, plan, cluster())


def test_a_grid_has_at_most_max_slots_columns_whatever_its_shortest_action():
    """An embedding-only stage's forward of a 100 B model takes microseconds in a 20 s step: a
    grid with a column per shortest action needed millions of columns (h2c compile of
    llama_100b on h2-1024 grew to 24 GB and was killed)."""
    from h2ir.schedule.grid import MAX_SLOTS, grid_from_events
    from h2ir.schedule.trace import TraceEvent
    events = [TraceEvent(0, "compute", "F0", 0.0, 1e-6), TraceEvent(1, "compute", "B0", 0.0, 20.0)]
    g = grid_from_events(events, {0: 0, 1: 1})
    assert len(g.rows[0]) <= MAX_SLOTS and g.slot_s == 20.0 / MAX_SLOTS
    assert g.rows[0][0] == "0F0" and g.rows[1][-1] == "1B0"
