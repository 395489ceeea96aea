"""The schedule as data: stream text round trip, one interpreter base for worker and simulator,
schedule.csv as a time-aligned grid, and predictions made from a build's own stream files."""
import json
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from h2ir.errors import H2Error
from h2ir.planner.simulate import SimulatedWorker, simulate
from h2ir.schedule.grid import format_grid, parse_grid
from h2ir.schedule.interpret import StreamInterpreter
from h2ir.schedule.streams import OPS, Instr, build_streams, format_stream, parse_stream
from tests.test_simulate import blocks_only, cluster, even_plan

workers = st.integers(0, 4095)
instrs = st.one_of(
    st.builds(Instr, st.sampled_from(["fwd", "bwd"]), st.integers(0, 10**6)),
    st.builds(lambda op, mb, p: Instr(op, mb, p),
              st.sampled_from(["send_act", "send_grad", "recv_act", "recv_grad"]),
              st.integers(0, 10**6), workers),
    st.builds(lambda g: Instr("all_reduce", group=tuple(g)), st.lists(workers, min_size=1, max_size=8)),
    st.builds(lambda mb, g: Instr("all_to_all", mb, group=tuple(g)), st.integers(0, 999),
              st.lists(workers, min_size=1, max_size=8)),
    st.just(Instr("opt_step")),
    st.builds(lambda op, p: Instr(op, peer=p),
              st.sampled_from(["send_tied_grads", "recv_tied_grads", "send_tied_params",
                               "recv_tied_params"]), workers),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(instrs, max_size=40))
def test_stream_text_round_trips(stream):
    text = format_stream(stream)
    assert parse_stream(text) == stream
    assert format_stream(parse_stream(text)) == text


def test_every_built_stream_round_trips():
    for sched in ("1f1b", "gpipe"):
        for w, s in build_streams(sched, 4, 6, 3, ties={0: (3,)}).items():
            assert parse_stream(format_stream(s)) == s


def test_tied_parameters_are_handed_over_around_the_optimizer_step():
    s = build_streams("1f1b", 3, 4, 2, ties={0: (2,)})
    tail = lambda w: [str(i) for i in s[w] if i.op not in ("fwd", "bwd") and i.mb is None]
    assert tail(0) == ["recv_tied_grads <- w2", "all_reduce grads [w0 w3]", "opt_step",
                       "send_tied_params -> w2"]
    assert tail(2) == ["send_tied_grads -> w0", "all_reduce grads [w2 w5]", "opt_step",
                       "recv_tied_params <- w0"]
    assert tail(5) == ["send_tied_grads -> w3", "all_reduce grads [w2 w5]", "opt_step",
                       "recv_tied_params <- w3"]            # each replica ties within itself
    assert tail(1) == ["all_reduce grads [w1 w4]", "opt_step"]


def test_simulated_tie_exchange_costs_time_and_never_deadlocks():
    import dataclasses
    from h2ir.costs import TiedParam
    c = blocks_only(layers=8)
    plan = even_plan(c, 4, 4)
    free = simulate(c, plan, cluster(latency=1e-3, nic_bw=1e9, intra_bw=1e9)).step_time_s
    tied = dataclasses.replace(c, ties=(TiedParam("w", 64 << 20, "block.0", ("block.7",)),))
    r = simulate(tied, plan, cluster(latency=1e-3, nic_bw=1e9, intra_bw=1e9))
    assert r.step_time_s > free + 2 * (64 << 20) / 1e9 * 0.9     # grads there, params back
    names = {e.name for e in r.events if e.lane == "comm"}
    assert {"send_tied_grads", "send_tied_params"} <= names
    assert r.stage_memory[3].items["tied_copies"] > 0 and "tied_copies" not in r.stage_memory[0].items


def test_bad_stream_line_is_located():
    with pytest.raises(H2Error) as e:
        parse_stream("# worker 0\nfwd 0\nfwd zero\n", file="w0.txt")
    assert (e.value.file, e.value.line) == ("w0.txt", 3)
    assert "expected one of" in e.value.message


def test_worker_and_simulator_share_one_interpreter_base():
    from executor.worker import Worker
    assert issubclass(Worker, StreamInterpreter) and issubclass(SimulatedWorker, StreamInterpreter)
    for cls in (Worker, SimulatedWorker):
        for op in OPS:        # every instruction kind is interpreted by both
            assert getattr(cls, op) is not getattr(StreamInterpreter, op), (cls, op)


def test_an_interpreter_missing_a_kind_is_refused():
    class Half(StreamInterpreter):
        def fwd(self, ins):
            pass
    with pytest.raises(TypeError, match="does not interpret: bwd"):
        Half(0, [])


def four_stage_grid(m=8):
    c = blocks_only(layers=8)
    r = simulate(c, even_plan(c, 4, m), cluster())
    return r, r.grid()


def test_schedule_csv_shows_1f1b_warm_up_and_cool_down_bubbles():
    r, g = four_stage_grid()
    f = r.stage_times[0].fwd_s
    assert g.slot_s == pytest.approx(f)         # the shortest compute action
    rows = {w: g.row(w) for w in range(4)}
    for s in range(4):
        row = rows[s]
        # warm-up: stage s waits s forward slots for micro-batch 0 to arrive
        lead = next(i for i, c in enumerate(row) if c)
        assert lead == s and all(c == "" for c in row[:s])
        assert row[s] == f"{s}F0"
        # cool-down: stage s finishes its last backward s backward-lengths (2 slots each)
        # before stage 0 does; those cells stay empty apart from the optimizer step
        last_b = max(i for i, c in enumerate(row) if c.startswith(f"{s}B"))
        assert row[last_b] == f"{s}B7"
        assert len(row) - 1 - last_b == 2 * s + 1          # + the optimizer step's slot
        assert row[last_b + 1] == "OPT" and all(c == "" for c in row[last_b + 2:])
    # stage 0 warms up with 4 forwards, then idles until the first backward comes back
    assert list(rows[0][:4]) == ["0F0", "0F1", "0F2", "0F3"]
    assert rows[0][4] == ""
    # a backward lasts two forward slots here, so it fills two cells
    b0 = rows[3].index("3B0")
    assert rows[3][b0 + 1] == "3B0"
    assert sum(g.bubble_slots(w) for w in range(4)) > 0
    assert parse_grid(format_grid(g)) == g


def test_schedule_csv_parse_errors_are_located():
    with pytest.raises(H2Error) as e:
        parse_grid("w0,0F0\n", file="schedule.csv")
    assert e.value.line == 1 and "slot_s" in e.value.message


@pytest.fixture(scope="module")
def tiny_build(tmp_path_factory):
    from tests.conftest import run_cli
    out = tmp_path_factory.mktemp("b") / "build"
    plan = tmp_path_factory.mktemp("p") / "p.h2plan"
    plan.write_text('model "examples/llama_tiny.py"\ncluster "local"\nbatch global=8 micro=2 seq=32\n'
                    "schedule 1f1b\ndp 1\n"
                    "stage chip=cpu-torch chips=1 tp=1 layers=embed, 0..3\n"
                    "stage chip=cpu-torch chips=1 tp=1 layers=4..7, head\n")
    r = run_cli("h2c", "compile", "examples/llama_tiny.py", "--plan", str(plan), "-o", str(out))
    assert r.returncode == 0, r.stderr
    return out, plan


def test_h2x_prediction_simulates_the_builds_stream_files(tiny_build, capsys):
    from executor.build import BuildDir
    from executor.launcher import predicted_step_time
    from frontend.plancli import main as plan_main
    build, plan = tiny_build
    assert plan_main(["examples/llama_tiny.py", "--plan", str(plan), "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)["step_time_s"]
    predicted = predicted_step_time(BuildDir(str(build))).step_time_s
    assert predicted == pytest.approx(planned, rel=1e-12)
    manifest = json.loads((build / "manifest.json").read_text())
    assert manifest["predicted_step_s"] == pytest.approx(planned, rel=1e-12)
    g = parse_grid((build / "streams/schedule.csv").read_text())
    assert g.workers == (0, 1) and g.row(0)[0] == "0F0" and g.row(1)[0] == ""

    # editing stream files changes the prediction: drop the last micro-batch from both workers
    from frontend.compiler import write_digests
    files = [build / "streams/w0.txt", build / "streams/w1.txt"]
    originals = [f.read_text() for f in files]
    try:
        for f, text in zip(files, originals):
            f.write_text("".join(l + "\n" for l in text.splitlines()
                                 if not (l.split()[1:2] == ["3"] and not l.startswith("#"))))
        assert "fwd 3" not in files[1].read_text() and "fwd 2" in files[1].read_text()
        write_digests(build)            # the edit is the test's: else the build is refused
        edited = predicted_step_time(BuildDir(str(build))).step_time_s
        assert edited < predicted * 0.95
    finally:
        for f, text in zip(files, originals):
            f.write_text(text)
        write_digests(build)


def test_h2x_predicts_with_the_records_the_compile_used(tmp_path):
    """h2x's prediction for a build is the compile's, whatever the host's calibration file holds
    by then: here another compile has re-measured the backends (rates doubled), replaced the
    build's own layer-time records (times tripled) and added a newer record of the model
    measured with more workers. The build carries the calibration it was planned with
    (calibration.json), and that copy is what h2x reads: edited, it moves the prediction."""
    from executor.build import BuildDir
    from executor.launcher import predicted_step_time
    from frontend.compiler import compile_model
    from h2ir.planner.calibration import calibration_path
    args = {"n_layers": 2, "dim": 64, "n_heads": 4, "ffn": 128, "vocab": 256, "max_seq": 64}
    out = tmp_path / "b"
    res = compile_model("examples/llama_tiny.py", model_args=args, cluster_arg="local",
                        plan_arg="uniform", global_batch=4, micro_batch=1, seq_len=16,
                        out_dir=str(out), log=lambda *a: None)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["calibration_records"] and manifest["calibration"] == "calibration.json"

    def slower(rec, k):
        for layer in rec["layers"].values():
            layer["fwd_s"] *= k
            layer["bwd_s"] *= k

    host_file = Path(calibration_path())
    saved = host_file.read_text()
    try:
        d = json.loads(saved)
        for b in d["backends"].values():
            b["matmul"] = {k: v * 2 for k, v in b["matmul"].items()}
            b["mem_bw"] *= 2
            if b.get("opt_bw"):
                b["opt_bw"] *= 2
        for rid in manifest["calibration_records"]:
            slower(d["layer_records"][rid], 3)
            newer = json.loads(json.dumps(d["layer_records"][rid]))
            newer["key"]["workers"] += 2
            newer["measured_at"] = "2999-01-01T00:00:00+00:00"
            d["layer_records"][rid + "-newer"] = newer
        host_file.write_text(json.dumps(d))
        assert predicted_step_time(BuildDir(str(out))).step_time_s == \
            pytest.approx(res.predicted.step_time_s, rel=1e-9)
        bc = json.loads((out / "calibration.json").read_text())
        for rec in bc["layer_records"].values():
            slower(rec, 3)
        (out / "calibration.json").write_text(json.dumps(bc))
        from frontend.compiler import write_digests
        write_digests(out)          # the edit is the test's: else the build is refused
        assert predicted_step_time(BuildDir(str(out))).step_time_s > \
            1.5 * res.predicted.step_time_s
        (out / "calibration.json").write_text('{"backends": ')      # damaged: named, not a crash
        write_digests(out)
        from h2ir.errors import H2Error
        with pytest.raises(H2Error, match="calibration is not valid JSON") as e:
            predicted_step_time(BuildDir(str(out)))
        assert str(out / "calibration.json") in str(e.value)
    finally:
        host_file.write_text(saved)
