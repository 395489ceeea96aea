"""Virtual-stage schedules (interleaved 1F1B, interleaved zero bubble, ZB-V): a worker holds
several layer chunks. Their orders are complete and causal, the simulator times them to the
textbook makespan, plans print and parse back, bad plans are located errors, and real runs on
torch + numpy give 1F1B's losses and resume exactly."""
import json
import shutil
from pathlib import Path

import pytest

from conftest import ROOT
from executor.launcher import run
from frontend.compiler import compile_model
from h2ir.errors import H2Error
from h2ir.plans.dsl import format_plan, parse_plan
from h2ir.planner.simulate import simulate
from h2ir.schedule.streams import (Instr, build_streams, chunk_orders, chunk_stages,
                                   format_stream, parse_stream)
from tests.test_simulate import blocks_only, cluster, even_plan

LLAMA = str(ROOT / "examples/llama_tiny.py")
SMALL = {"n_layers": 6, "dim": 64, "n_heads": 4, "ffn": 128, "vocab": 256, "max_seq": 64}
CASES = [("interleaved", 2), ("interleaved", 3), ("izb", 2), ("izb", 3), ("zbv", 2)]


@pytest.mark.parametrize("schedule,V", CASES)
@pytest.mark.parametrize("S", [2, 3, 4])
def test_orders_are_complete_and_causal(schedule, V, S):
    for m in (S, 2 * S, 4 * S):
        orders = chunk_orders(schedule, S, V, m)
        split = schedule != "interleaved"
        for order in orders:
            assert len(order) == len(set(order)) == V * m * (3 if split else 2)
            pos = {a: i for i, a in enumerate(order)}
            for kind, mb, c in order:
                if kind in ("B", "I"):
                    assert pos[("F", mb, c)] < pos[(kind, mb, c)]
                if kind == "W":
                    assert pos[("I", mb, c)] < pos[("W", mb, c)]
            # gradients accumulate in micro-batch order on every chunk, as in 1F1B
            for c in range(V):
                last = "W" if split else "B"
                assert [mb for k, mb, cc in order if k == last and cc == c] == list(range(m))
        streams = build_streams(schedule, S * V, m, dp=2, virtual=V, ties={0: (S * V - 1,)})
        for instrs in streams.values():
            assert parse_stream(format_stream(instrs)) == instrs


def test_chunk_placement():
    assert chunk_stages("interleaved", 3, 2) == [[0, 3], [1, 4], [2, 5]]
    assert chunk_stages("zbv", 3, 2) == [[0, 5], [1, 4], [2, 3]]
    with pytest.raises(H2Error):
        chunk_stages("zbv", 3, 3)
    assert str(Instr("fwd", 3, chunk=1)) == "fwd 3 c1"
    assert Instr.parse("all_reduce grads [w0 w2] c1") == Instr("all_reduce", group=(0, 2), chunk=1)


@pytest.mark.parametrize("S,m,V", [(4, 8, 2), (4, 16, 2), (2, 8, 4), (3, 6, 2)])
def test_interleaved_makespan_is_the_textbook_one(S, m, V):
    """Equal chunks and free links: Narayanan et al.'s interleaved 1F1B step is
    m (tf + tb) + (S - 1)(tf + tb) / V, the 1F1B bubble over V."""
    c, cl = blocks_only(layers=S * V * 2), cluster()
    r1 = simulate(c, even_plan(c, S, m), cl)
    plan = even_plan(c, S * V, m, schedule="interleaved")
    plan.virtual = V
    r = simulate(c, plan, cl)
    st = r.stage_times[0]
    t = st.fwd_s + st.bwd_s                 # one chunk's forward + backward
    opt = sum(r.stage_times[j].opt_step_s for j in chunk_stages("interleaved", S, V)[0])
    assert r.step_time_s == pytest.approx(m * V * t + (S - 1) * t + opt, rel=1e-9)
    assert r.bubble_fraction < r1.bubble_fraction


@pytest.mark.parametrize("S,m", [(4, 8), (4, 16), (3, 9)])
def test_zero_bubble_schedules_shrink_the_bubble(S, m):
    c, cl = blocks_only(layers=S * 4), cluster()
    got = {}
    for sch in ("1f1b", "interleaved", "izb", "zbv"):
        plan = even_plan(c, S * (1 if sch == "1f1b" else 2), m, schedule=sch)
        plan.virtual = 1 if sch == "1f1b" else 2
        got[sch] = simulate(c, plan, cl)
    assert got["izb"].bubble_fraction < got["interleaved"].bubble_fraction \
        < got["1f1b"].bubble_fraction
    # ZB-V with F = B = W: under a third of the 1F1B bubble (what is left is the last
    # micro-batch's input gradients walking back through every worker)
    assert got["zbv"].bubble_fraction < got["1f1b"].bubble_fraction / 3
    assert all(r.fits for r in got.values())


def _plan_text(schedule: str, stages, virtual: str = "", global_batch: int = 8) -> str:
    out = [f'model "{LLAMA}"', f'cluster "{ROOT / "examples/clusters/local-mixed.toml"}"',
           f"batch global={global_batch} micro=1 seq=32", f"schedule {schedule}{virtual}"]
    out += [f"stage chip={c} chips=1 layers={l}" for c, l in stages]
    return "\n".join(out) + "\n"


FOUR = ["embed, 0", "1..2", "3..4", "5, head"]
MIXED = {  # chip of each chunk: chunks of one worker share its chip
    "interleaved": ["cpu-torch", "cpu-numpy", "cpu-torch", "cpu-numpy"],
    "izb": ["cpu-torch", "cpu-numpy", "cpu-torch", "cpu-numpy"],
    "zbv": ["cpu-torch", "cpu-numpy", "cpu-numpy", "cpu-torch"],
}


def test_plans_round_trip_and_bad_ones_are_located():
    text = _plan_text("zbv", zip(MIXED["zbv"], FOUR))
    p = parse_plan(text)
    assert (p.virtual, p.num_physical, p.num_workers) == (2, 2, 2)
    assert "schedule zbv virtual=2" in format_plan(p)
    assert parse_plan(format_plan(p)) == p
    with pytest.raises(H2Error, match="virtual= applies"):
        parse_plan(_plan_text("1f1b", zip(MIXED["zbv"], FOUR), " virtual=2"))
    from frontend.capture import model_costs
    from h2ir.clusters.clusterfile import load_cluster
    from h2ir.planner.validate import validate_plan
    costs = model_costs(LLAMA, SMALL, 1, 32)
    cl = load_cluster(str(ROOT / "examples/clusters/local-mixed.toml"))
    validate_plan(p, costs, cl)
    bad = parse_plan(_plan_text("interleaved", zip(MIXED["zbv"], FOUR)), file="x.h2plan")
    with pytest.raises(H2Error, match="stage 2 runs on the worker of stage 0") as e:
        validate_plan(bad, costs, cl)
    assert e.value.file == "x.h2plan" and e.value.line == 7
    odd = parse_plan(_plan_text("izb", zip(MIXED["izb"], FOUR), global_batch=3))
    with pytest.raises(H2Error, match="multiple of the 2 workers"):
        validate_plan(odd, costs, cl)


def _build(tmp: Path, schedule: str, stages) -> Path:
    plan = tmp / f"{schedule}.h2plan"
    plan.write_text(_plan_text(schedule, stages))
    out = tmp / schedule
    compile_model(LLAMA, model_args=SMALL, plan_arg=str(plan), out_dir=str(out),
                  log=lambda *a: None)
    return out


def _losses(build: Path, steps: int, **kw) -> list[float]:
    log = build / f"log{len(list(build.glob('log*')))}.jsonl"
    run(str(build), steps=steps, json_log=str(log), out=lambda *a: None, predict=False, **kw)
    return [json.loads(l)["loss"] for l in log.read_text().splitlines()]


@pytest.fixture(scope="module")
def one_f_one_b(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vs")
    b = _build(tmp, "1f1b", [("cpu-torch", "embed, 0..2"), ("cpu-numpy", "3..5, head")])
    return _losses(b, 20)


# ZB-V in make test (chunks, the split backward and the V placement); the others in test-slow
@pytest.mark.parametrize("schedule", [pytest.param("interleaved", marks=pytest.mark.slow),
                                      pytest.param("izb", marks=pytest.mark.slow), "zbv"])
def test_losses_equal_1f1b_over_20_steps_on_torch_and_numpy(schedule, one_f_one_b, tmp_path):
    b = _build(tmp_path, schedule, zip(MIXED[schedule], FOUR))
    m = json.loads((b / "manifest.json").read_text())
    assert m["virtual"] == 2 and len(m["workers"]) == 2
    assert [w["chunks"] for w in m["workers"]] == chunk_stages(schedule, 2, 2)
    text = (b / "streams/w0.txt").read_text()
    assert "fwd 0 c1" in text and "opt_step c1" in text
    if schedule != "interleaved":
        assert all(st["zero_bubble"] for st in m["stages"]) and "bwd_weight 0 c0" in text
    got = _losses(b, 20)
    rel = max(abs(a - w) / abs(w) for a, w in zip(got, one_f_one_b))
    assert len(got) == 20 and rel <= 1e-6, rel


@pytest.mark.slow          # resuming runs by default in test_executor, test_zero and test_moe
def test_resume_of_a_chunked_run_reproduces_it(tmp_path):
    b = _build(tmp_path, "zbv", zip(MIXED["zbv"], FOUR))
    full = _losses(b, 6, checkpoint_every=3)
    ckpts = sorted((b / "ckpt").glob("step_*"))
    assert len(ckpts) == 2
    shutil.rmtree(ckpts[-1])                # keep step 3's checkpoint only
    assert _losses(b, 6, resume=True) == full[3:]


def test_virtualize_keeps_each_workers_share_and_auto_picks_the_fastest():
    from h2ir.planner.search import choose_schedule, virtualize
    c, cl = blocks_only(layers=16), cluster()
    base = even_plan(c, 4, 8)
    flops = {l.name: l.fwd_flops + l.bwd_flops for l in c.layers}
    for sch in ("interleaved", "izb", "zbv"):
        v = virtualize(base, c, sch)
        assert (v.schedule, v.virtual, v.num_physical, v.num_stages) == (sch, 2, 4, 8)
        assert [n for st in v.stages for n in st.layers] == c.layer_names()
        for s, chunks in enumerate(chunk_stages(sch, 4, 2)):
            got = sum(flops[n] for j in chunks for n in v.stages[j].layers)
            assert got == sum(flops[n] for n in base.stages[s].layers)
    plan, table = choose_schedule(base, c, cl)
    times = {k: t for k, t in table.items() if isinstance(t, float)}
    assert set(times) == {"1f1b", "zb1", "interleaved", "izb", "zbv"}
    assert plan.schedule == min(times, key=times.get) and plan.schedule != "1f1b"
    short = even_plan(c, 16, 16)            # one layer per stage: nothing to cut into chunks
    with pytest.raises(H2Error, match="fewer than its 2 chunks"):
        virtualize(short, c, "zbv")


def test_compile_with_schedule_auto_and_zbv_from_a_uniform_plan(tmp_path):
    cl = str(ROOT / "examples/clusters/local-mixed.toml")
    for sch in ("zbv", "auto"):
        logs = []
        res = compile_model(LLAMA, model_args=SMALL, cluster_arg=cl, plan_arg="uniform",
                            global_batch=8, micro_batch=1, seq_len=32, schedule=sch,
                            out_dir=str(tmp_path / sch), log=logs.append)
        if sch == "zbv":
            assert res.plan.schedule == "zbv" and res.plan.num_workers == 2
        else:
            assert any(l.startswith("schedules (predicted step): ") for l in logs), logs
        assert res.predicted.step_time_s > 0


def test_the_two_lists_of_virtual_schedules_agree():
    # h2ir.plans and h2ir.schedule are sibling rooms (neither imports the other): each keeps one
    from h2ir.plans import plan
    from h2ir.schedule import streams
    assert plan.VIRTUAL_SCHEDULES == streams.VIRTUAL_SCHEDULES
    assert set(streams.SPLIT_SCHEDULES) <= set(plan.SCHEDULES)


def test_h2c_plan_writes_a_virtual_stage_plan(tmp_path):
    from conftest import run_cli
    cl = tmp_path / "two.toml"
    cl.write_text('name = "two"\ndtype = "bf16"\n[[nodes]]\nchip = "A100-80"\ncount = 1\n'
                  'chips_per_node = 2\nintra_bw_gbs = 300\nnic_gbps = 200\n')
    out = tmp_path / "p.h2plan"
    r = run_cli("h2c", "plan", LLAMA, "--cluster", str(cl), "--plan", "uniform", "--schedule",
                "zbv", "--no-speedup", "--global-batch", "16", "-o", str(out))
    assert r.returncode == 0, r.stderr
    p = parse_plan(out.read_text())
    assert p.schedule == "zbv" and p.virtual == 2 and p.num_stages == 2 * p.num_physical


# ZB-V (first and last chunk on w0) in make test; interleaved (on another worker) in test-slow
@pytest.mark.parametrize("schedule", [pytest.param("interleaved", marks=pytest.mark.slow), "zbv"])
def test_tied_embedding_and_head_across_chunks(tmp_path, schedule):
    """tie=true: the head's copy of the embedding is exchanged between chunks: on another
    worker (interleaved) or on the same one (ZB-V, which puts the first and last chunk on w0)."""
    tied = {**SMALL, "tie": True}
    losses = {}
    for sch, stages in (("1f1b", [("cpu-torch", "embed, 0..2"), ("cpu-numpy", "3..5, head")]),
                        (schedule, zip(MIXED[schedule], FOUR))):
        plan = tmp_path / f"{sch}.h2plan"
        plan.write_text(_plan_text(sch, stages))
        out = tmp_path / sch
        compile_model(LLAMA, model_args=tied, plan_arg=str(plan), out_dir=str(out),
                      log=lambda *a: None)
        if sch == "zbv":
            text = (out / "streams/w0.txt").read_text()
            assert "send_tied_grads -> w0 c1" in text and "recv_tied_grads <- w0 c0" in text
        losses[sch] = _losses(out, 6)
    rel = max(abs(a - w) / abs(w) for a, w in zip(losses[schedule], losses["1f1b"]))
    assert rel <= 1e-6, (schedule, rel)


def test_h2c_plan_schedule_auto_keeps_the_fastest_schedule(tmp_path):
    from conftest import run_cli
    from h2ir.planner.search import SCHEDULE_CHOICES
    cl = tmp_path / "mix.toml"
    cl.write_text('name = "mix"\ndtype = "fp16"\n'
                  '[[nodes]]\nchip = "A100-80"\ncount = 1\nchips_per_node = 2\n'
                  'intra_bw_gbs = 300\nnic_gbps = 25\n'
                  '[[nodes]]\nchip = "V100-32"\ncount = 1\nchips_per_node = 2\n'
                  'intra_bw_gbs = 150\nnic_gbps = 25\n')
    out = tmp_path / "p.h2plan"
    r = run_cli("h2c", "plan", LLAMA, "--cluster", str(cl), "--schedule", "auto",
                "--no-speedup", "--global-batch", "32", "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert parse_plan(out.read_text()).schedule in SCHEDULE_CHOICES + ("gpipe",)
