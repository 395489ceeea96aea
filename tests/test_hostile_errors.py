"""Hostile input, one clean error each: every bad flag, file and build a user (or a tamperer)
can hand h2c/h2x ends in a located message and exit code 2 — never a traceback, never "internal
error" — and what they read stays bounded (memory for a 2 GiB data file, time for 10^9 chips).

Most cases call the CLIs' `main()` in-process (argparse's usage errors are SystemExit(2)); the
cases that need workers run `h2x run` on one tiny two-stage build compiled once for the module.
"""
import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import ROOT, run_cli

LLAMA = str(ROOT / "examples" / "llama_tiny.py")
TINY_ARGS = ["--arg", "n_layers=1", "--arg", "dim=32", "--arg", "n_heads=2", "--arg", "ffn=64",
             "--arg", "vocab=256", "--arg", "max_seq=16"]


def cli(main, argv, capsys) -> tuple[int, str]:
    """(exit code, stderr) of an h2c/h2x main() called in-process."""
    capsys.readouterr()
    try:
        code = main(list(argv))
    except SystemExit as e:            # argparse's usage errors
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    return code, capsys.readouterr().err


def h2c(argv, capsys):
    from frontend.cli import main
    return cli(main, argv, capsys)


def h2x(argv, capsys):
    from executor.cli import main
    return cli(main, argv, capsys)


def assert_clean(code, err, *names, rc=2):
    assert code == rc, (code, err[-3000:])
    assert "Traceback" not in err and "internal error" not in err, err[-3000:]
    for n in names:
        assert str(n) in err, (n, err[-3000:])


@pytest.fixture(autouse=True)
def _crash_reports_here(tmp_path, monkeypatch):
    monkeypatch.setenv("H2_LOG_DIR", str(tmp_path / "crash"))


@pytest.fixture(scope="module")
def costs_json(tmp_path_factory):
    """Layer costs of a tiny model (what `h2c ir --json` writes): plans without tracing."""
    from frontend.capture import model_costs
    p = tmp_path_factory.mktemp("costs") / "tiny.json"
    args = {"n_layers": 2, "dim": 32, "n_heads": 2, "ffn": 64, "vocab": 256, "max_seq": 16}
    p.write_text(json.dumps(model_costs(LLAMA, args, 1, 8).to_json()))
    return p


# the local cluster with its placeholder figures as they are: planning on it measures nothing
LOCAL = (ROOT / "examples" / "clusters" / "local.toml").read_text().replace("measured    = true", "")
assert "measured" not in LOCAL.split("[[nodes]]")[0].replace("# ", "").split("mem_bw_gbs")[1]


def cluster_file(tmp_path, text, name="c.toml"):
    f = tmp_path / name
    f.write_text(text)
    return f


# ---- h2c flags ----------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, flag", [
    (["ir", LLAMA, "--micro-batch", "-3"], "--micro-batch"),
    (["ir", LLAMA, "--micro-batch", "0"], "--micro-batch"),
    (["ir", LLAMA, "--seq-len", "-4"], "--seq-len"),
    (["ir", LLAMA, "--seq-len", "0"], "--seq-len"),
    (["ir", LLAMA, "--seq-len", "2**70"], "--seq-len"),
    (["ir", LLAMA, "--seq-len", str(2 ** 70)], "--seq-len"),
    (["plan", LLAMA, "--micro-batch", "0"], "--micro-batch"),
    (["plan", LLAMA, "--micro-batch", "-3"], "--micro-batch"),
    (["plan", LLAMA, "--global-batch", "0"], "--global-batch"),
    (["plan", LLAMA, "--seq-len", "-1"], "--seq-len"),
    (["compile", LLAMA, "--seed", str(2 ** 70)], "--seed"),
    (["compile", LLAMA, "--seed", "-1"], "--seed"),
    (["compile", LLAMA, "--micro-batch", "0"], "--micro-batch"),
    (["compile", LLAMA, "--micro-batch", "-3"], "--micro-batch"),
    (["compile", LLAMA, "--seq-len", "-4"], "--seq-len"),
    (["compile", LLAMA, "--global-batch", "-2"], "--global-batch"),
    (["profile", "--micro-batch", "-3"], "--micro-batch"),
    (["profile", "--seq-len", "0"], "--seq-len"),
    (["check-ops", "--backend", "numpy", "--seed", str(2 ** 70)], "--seed"),
])
def test_bad_h2c_number_is_a_usage_error_naming_the_flag(argv, flag, capsys):
    code, err = h2c(argv, capsys)
    assert_clean(code, err, f"argument {flag}")
    assert ("must be" in err or "expected an integer" in err)


def test_micro_batch_auto_is_the_explicit_search(costs_json, capsys, tmp_path):
    code, err = h2c(["plan", str(costs_json), "--micro-batch", "auto", "--json", "--no-speedup",
                     "--cluster", str(cluster_file(tmp_path, LOCAL))], capsys)
    assert code == 0, err


@pytest.mark.parametrize("arg", ["n_heads=0", "=3", "1x=2"])
def test_bad_model_arg_is_the_model_files_error(arg, capsys):
    code, err = h2c(["ir", LLAMA, "--arg", arg, "--seq-len", "8"], capsys)
    assert_clean(code, err, "--arg" if not arg.startswith("n_heads") else "llama_tiny.py:")
    assert "a bug in h2" not in err
    if arg == "n_heads=0":
        assert "error: build_model() raised ZeroDivisionError" in err


def test_model_arg_for_the_sequence_length_is_checked(costs_json, capsys, tmp_path):
    code, err = h2c(["plan", LLAMA, "--arg", "max_seq=-5", "--no-speedup",
                     "--cluster", str(cluster_file(tmp_path, LOCAL))], capsys)
    assert_clean(code, err, "--arg max_seq=-5")


# ---- model files ---------------------------------------------------------------------------------

@pytest.mark.parametrize("cmd", ["ir", "plan", "compile"])
def test_missing_model_file(cmd, capsys, tmp_path):
    code, err = h2c([cmd, str(tmp_path / "nosuch.py"), "-o", str(tmp_path / "out")], capsys)
    assert_clean(code, err, "nosuch.py: error: model file not found")


MODEL_HEAD = f"""\
import sys
sys.path.insert(0, {str(ROOT / 'examples')!r})
from llama_tiny import build_model as _tiny
"""


@pytest.mark.parametrize("body, expect", [
    ("def build_model(**kw):\n    return 1 // 0\n", "build_model() raised ZeroDivisionError"),
    ("def build_model(**kw):\n    sys.exit(7)\n", "build_model() called sys.exit(7)"),
    ("sys.exit(7)\n\ndef build_model(**kw):\n    return _tiny()\n",
     "importing the model file called sys.exit(7)"),
    ("def build_model(**kw):\n    raise KeyError('no such layer')\n", "build_model() raised KeyError"),
])
def test_model_file_exceptions_are_located_in_the_model_file(body, expect, tmp_path, capsys):
    f = tmp_path / "user_model.py"
    f.write_text(MODEL_HEAD + body)
    line = next(i for i, ln in enumerate(f.read_text().splitlines(), 1)
                if "sys.exit" in ln or "raise" in ln or "1 // 0" in ln)
    for cmd in ("ir", "plan"):
        code, err = h2c([cmd, str(f), "--seq-len", "8"], capsys)
        assert_clean(code, err, f"{f}:{line}: error: {expect}")
        assert "a bug in h2" not in err


# ---- cluster files -------------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["1e308", "-1", "nan", "inf", "0", '"lots"'])
def test_cluster_numbers_out_of_range_are_located(value, tmp_path, costs_json, capsys):
    f = cluster_file(tmp_path, LOCAL.replace("mem_gib     = 8", f"mem_gib     = {value}"))
    line = next(i for i, ln in enumerate(f.read_text().splitlines(), 1) if "mem_gib" in ln)
    code, err = h2c(["plan", str(costs_json), "--cluster", str(f), "--no-speedup"], capsys)
    assert_clean(code, err, f"{f}:{line}: error: chips.cpu-torch.mem_gib")


@pytest.mark.parametrize("key, value", [("count", "10000000000"), ("chips_per_node", "10000000"),
                                        ("nic_gbps", "1e30"), ("count", "-1")])
def test_cluster_node_numbers_out_of_range(key, value, tmp_path):
    from h2ir.clusters.clusterfile import load_cluster
    from h2ir.errors import H2Error
    import re
    f = cluster_file(tmp_path, re.sub(rf"(?m)^{key}\s*=.*$", f"{key} = {value}", LOCAL))
    with pytest.raises(H2Error) as e:
        load_cluster(f)
    assert e.value.file == str(f) and e.value.line and key in e.value.message


@pytest.mark.parametrize("nest", ["[" * 5000 + "]" * 5000, "{a=" * 3000 + "1" + "}" * 3000])
def test_deeply_nested_toml_is_a_located_error(nest, tmp_path, costs_json, capsys):
    f = cluster_file(tmp_path, LOCAL + f"\nextra = {nest}\n")
    code, err = h2c(["plan", str(costs_json), "--cluster", str(f), "--no-speedup"], capsys)
    assert_clean(code, err, f"{f}:", "nested too deeply")


def test_huge_or_endless_input_files_are_refused_before_parsing(tmp_path):
    from h2ir.clusters.clusterfile import load_cluster
    from h2ir.errors import H2Error
    from h2ir.plans.dsl import load_plan
    from h2ir.text import load_graph
    big = tmp_path / "big.toml"
    with open(big, "wb") as fh:
        fh.truncate(17 << 20)            # sparse: 17 MiB of zeros
    for load, what in ((load_cluster, "cluster file"), (load_plan, "plan file")):
        with pytest.raises(H2Error, match="larger than 16 MiB") as e:
            load(big)
        assert e.value.file == str(big), what
    with pytest.raises(H2Error, match="larger than 16 MiB"):
        load_plan("/dev/zero")           # endless: refused after 16 MiB, not read forever
    huge_ir = tmp_path / "big.h2ir"
    with open(huge_ir, "wb") as fh:
        fh.truncate(65 << 20)
    with pytest.raises(H2Error, match="larger than 64 MiB"):
        load_graph(str(huge_ir))


def test_nested_h2ir_literal_is_a_located_error(tmp_path):
    from h2ir.errors import H2Error
    from h2ir.text import parse_graph
    text = ("h2ir m\ninput %x: f32[2,3]\n\nlayer embed kind=embed\n"
            "  %y: f32[2] = sum(%x, dims=" + "[" * 3000 + "]" * 3000 + ")\nend\n\noutput %y\n")
    with pytest.raises(H2Error, match="nested too deeply") as e:
        parse_graph(text, "m.h2ir")
    assert (e.value.file, e.value.line) == ("m.h2ir", 5)


# ---- plan files ----------------------------------------------------------------------------------

@pytest.mark.parametrize("batch, what", [
    ("global=1000000000000 micro=1 seq=8", "batch global=1000000000000"),
    ("global=4000000 micro=1 seq=8", "micro-batches per step"),
    ("global=2 micro=2000000 seq=8", "batch micro=2000000"),
    ("global=2 micro=1 seq=100000000", "batch seq=100000000"),
])
def test_plan_batch_past_the_bounds(batch, what, tmp_path, costs_json, capsys):
    f = tmp_path / "p.h2plan"
    f.write_text(f'model "x"\ncluster "local"\nbatch {batch}\n'
                 "stage chip=cpu-torch chips=1 layers=embed, 0..1, head\n")
    code, err = h2c(["plan", str(costs_json), "--plan", str(f), "--no-speedup",
                     "--cluster", str(cluster_file(tmp_path, LOCAL))], capsys)
    assert_clean(code, err, f"{f}:3:", what)


def test_global_batch_past_the_micro_batch_bound_is_refused_fast(costs_json, tmp_path, capsys):
    t0 = time.perf_counter()
    code, err = h2c(["plan", str(costs_json), "--global-batch", str(1 << 24), "--no-speedup",
                     "--cluster", str(cluster_file(tmp_path, LOCAL))], capsys)
    assert_clean(code, err, "micro-batches per step")
    assert time.perf_counter() - t0 < 10


# ---- h2x flags -----------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, flag", [
    (["--steps", "0"], "--steps"), (["--steps", "-1"], "--steps"),
    (["--steps", "ten"], "--steps"),
    (["--checkpoint-every", "-1"], "--checkpoint-every"),
    (["--timeout", "0"], "--timeout"), (["--timeout", "-1"], "--timeout"),
    (["--timeout", "nan"], "--timeout"), (["--timeout", "inf"], "--timeout"),
    (["--data-max-bytes", "0"], "--data-max-bytes"),
    (["--data-max-bytes", "-5"], "--data-max-bytes"),
])
def test_bad_h2x_number_is_a_usage_error_naming_the_flag(argv, flag, tmp_path, capsys):
    code, err = h2x(["run", str(tmp_path), *argv], capsys)
    assert_clean(code, err, f"h2x run: error: argument {flag}: ")


# ---- tampered build directories (the manifest alone) ---------------------------------------------

@pytest.fixture(scope="module")
def build2(tmp_path_factory):
    """A two-stage tiny build (w0: embed + block 0, w1: head), compiled once."""
    d = tmp_path_factory.mktemp("hostile")
    plan = d / "two.h2plan"
    plan.write_text('model "examples/llama_tiny.py"\ncluster "local"\nbatch global=2 micro=1 seq=8\n'
                    "stage chip=cpu-torch chips=1 layers=embed, 0\n"
                    "stage chip=cpu-torch chips=1 layers=head\n")
    r = run_cli("h2c", "compile", LLAMA, *TINY_ARGS, "--plan", str(plan), "-o", str(d / "build"))
    assert r.returncode == 0, r.stderr
    return d / "build"


def tampered(build2, tmp_path, edit=None) -> Path:
    b = tmp_path / "b"
    shutil.copytree(build2, b)
    if edit:
        m = json.loads((b / "manifest.json").read_text())
        edit(m)
        (b / "manifest.json").write_text(json.dumps(m, indent=1))
    return b


def _set(path, value):
    def edit(m):
        d = m
        for k in path[:-1]:
            d = d[k]
        d[path[-1]] = value
    return edit


@pytest.mark.parametrize("path, value, field", [
    (("workers",), [], "workers"),
    (("stages",), [], "stages"),
    (("num_microbatches",), 10 ** 12, "num_microbatches"),
    (("num_microbatches",), 3, "global_batch"),
    (("micro_batch",), "1", "micro_batch"),
    (("micro_batch",), 1.5, "micro_batch"),
    (("seq_len",), -8, "seq_len"),
    (("seed",), -1, "seed"),
    (("seed",), 2 ** 70, "seed"),
    (("dp",), True, "dp"),
    (("schedule",), "zigzag", "schedule"),
    (("optimizer", "lr"), "fast", "optimizer.lr"),
    (("optimizer", "betas"), [0.9], "optimizer.betas"),
    (("stages", 1, "weights"), "../../etc/passwd", "stages[1].weights"),
    (("stages", 1, "weights"), "weights/nosuch.safetensors", "stages[1].weights"),
    (("stages", 0, "fwd"), 7, "stages[0].fwd"),
    (("workers", 1, "stage"), 7, "workers[1].stage"),
    (("workers", 1, "id"), 0, "workers[1].id"),
    (("workers", 1, "stream"), None, "workers[1].stream"),
])
def test_tampered_manifest_field_is_named(build2, tmp_path, path, value, field):
    from executor.build import BuildDir
    from h2ir.errors import H2Error
    b = tampered(build2, tmp_path, _set(path, value))
    with pytest.raises(H2Error) as e:
        BuildDir(str(b))
    assert e.value.file == str(b / "manifest.json") and e.value.line
    assert e.value.message.startswith(f"{field}:"), e.value.message


@pytest.mark.parametrize("text", ["[]", "[" * 100_000 + "]" * 100_000, '{"format": "h2-build/1"}'])
def test_manifest_that_is_not_one(build2, tmp_path, capsys, text):
    b = tampered(build2, tmp_path)
    (b / "manifest.json").write_text(text)
    code, err = h2x(["run", str(b), "--steps", "1"], capsys)
    assert_clean(code, err, f"{b / 'manifest.json'}")


def test_empty_worker_list_and_10e12_micro_batches_through_h2x(build2, tmp_path, capsys):
    for edit, field in ((_set(("workers",), []), "workers"),
                        (_set(("num_microbatches",), 10 ** 12), "num_microbatches")):
        b = tampered(build2, tmp_path / field, edit)
        code, err = h2x(["run", str(b), "--steps", "1"], capsys)
        assert_clean(code, err, f"{b / 'manifest.json'}:", f"error: {field}:")


def test_tampered_stage_files_name_the_file(build2, tmp_path):
    from executor.build import BuildDir
    from h2ir.errors import H2Error
    b = tampered(build2, tmp_path)
    w = b / "weights" / "stage1.safetensors"
    w.write_bytes(w.read_bytes()[:1000])
    sig = b / "stages" / "stage0.json"
    s = json.loads(sig.read_text())
    s["input_types"][s["inputs"][0]] = "zz[1"
    sig.write_text(json.dumps(s))
    build = BuildDir(str(b))
    for stage, name in ((1, "stage1.safetensors"), (0, "stage0.json")):
        with pytest.raises(H2Error) as e:
            build.stage(stage)
        assert e.value.file.endswith(name), (e.value.file, e.value.message)
    (b / "weights" / "stage1.consts.safetensors").write_bytes(b"\xff" * 8)
    with pytest.raises(H2Error, match="truncated or not a safetensors"):
        from executor.build import check_safetensors
        check_safetensors(b / "weights" / "stage1.consts.safetensors")


# ---- tampered builds through workers -------------------------------------------------------------

def test_truncated_weights_on_w1_is_w1s_start_up_error_naming_the_file(build2, tmp_path):
    b = tampered(build2, tmp_path)
    w = b / "weights" / "stage1.safetensors"
    w.write_bytes(w.read_bytes()[:1000])
    r = run_cli("h2x", "run", str(b), "--steps", "1", timeout=120)
    assert_clean(r.returncode, r.stderr, f"{w}: error: weights file is truncated",
                 "worker w1", "during start-up")
    assert "w0" not in r.stderr.replace(f"{w}", "")


def test_garbage_in_w1s_stream_is_w1s_located_error(build2, tmp_path):
    b = tampered(build2, tmp_path)
    s = b / "streams" / "w1.txt"
    n = len(s.read_text().splitlines())
    with open(s, "a") as fh:
        fh.write("garbage !!\n")
    r = run_cli("h2x", "run", str(b), "--steps", "1", timeout=120)
    assert_clean(r.returncode, r.stderr, f"{s}:{n + 1}: error: not an instruction", "worker w1")


def test_missing_data_path(build2, capsys):
    code, err = h2x(["run", str(build2), "--steps", "1", "--data", "/nonexistent"], capsys)
    assert_clean(code, err, "/nonexistent: error: data path not found")


def test_a_worker_bug_is_one_event_with_a_crash_report(tmp_path, capsys):
    from executor.worker import _report_failure
    events = []
    try:
        raise RuntimeError("kaboom")
    except RuntimeError as e:
        assert _report_failure(3, events.append, e) == 1
    ev, = events
    assert ev["event"] == "error" and ev["kind"] == "internal" and "kaboom" in ev["message"]
    assert "Traceback" in Path(ev["report"]).read_text()
    from h2ir.errors import H2Error
    events.clear()
    assert _report_failure(1, events.append, H2Error("bad", "f.txt", 3)) == 2
    assert events[0]["kind"] == "user" and (events[0]["file"], events[0]["line"]) == ("f.txt", 3)


def _boom(argv):
    raise RuntimeError("an h2 bug")


def test_internal_error_prints_where_the_traceback_is_not_the_traceback(tmp_path, capsys):
    from h2ir.errors import run_subcommand
    code = run_subcommand({"boom": "test_hostile_errors:_boom"}, "h2c", ["boom"], "doc")
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert "h2c boom: internal error: RuntimeError: an h2 bug" in err
    report = err.split("the traceback is in ")[1].split(";")[0]
    assert report.startswith(str(tmp_path / "crash"))
    assert "Traceback" in Path(report).read_text() and "_boom" in Path(report).read_text()


# ---- bounds --------------------------------------------------------------------------------------

RSS_PROBE = """
import resource, sys
from executor.data import load_corpus, prepare_data, TokenBatches
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
manifest = {"micro_batch": 1, "seq_len": 8, "num_microbatches": 2, "dp": 1, "seed": 0,
            "model": {"vocab": 256}}
spec = prepare_data(manifest, sys.argv[2], sys.argv[1], "bytes", None, int(sys.argv[3]),
                    out=lambda s: None)
tokens = load_corpus(sys.argv[1], int(sys.argv[3]), 256)
TokenBatches(tokens, 1, 8, 2, 1).micro_batch(0, 0, 0)
print(len(tokens), (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""


@pytest.mark.parametrize("max_bytes", [4 << 20, 1 << 40])
def test_2gib_data_file_reads_a_bounded_prefix(tmp_path, max_bytes):
    big = tmp_path / "big.txt"
    with open(big, "wb") as fh:
        fh.truncate(2 << 30)             # sparse: no disk, 2 GiB of zero bytes
    r = subprocess.run([sys.executable, "-c", RSS_PROBE, str(big), str(tmp_path / "cache"),
                        str(max_bytes)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    n, grew = map(int, r.stdout.split())
    assert n == min(max_bytes, 2 << 30)
    assert grew < 64 << 20, f"reading grew the peak RSS by {grew / 2**20:.0f} MiB"


def test_divisors_by_factoring():
    from h2ir.planner.search import divisors
    for n in (1, 2, 12, 97, 360, 1024, 9973 * 2):
        assert divisors(n) == [d for d in range(1, n + 1) if n % d == 0]
    t0 = time.perf_counter()
    assert len(divisors(10 ** 12)) == 169 and divisors(999_999_999_989) == [1, 999_999_999_989]
    assert time.perf_counter() - t0 < 2


@pytest.mark.parametrize("count, per_node", [(10 ** 9, 1), (1000, 10 ** 6)])
def test_a_billion_chips_plans_in_seconds(count, per_node, tmp_path, costs_json, capsys):
    import re
    text = re.sub(r"(?m)^count\s*=.*$", f"count = {count}", LOCAL)
    text = re.sub(r"(?m)^chips_per_node\s*=.*$", f"chips_per_node = {per_node}", text)
    f = cluster_file(tmp_path, text)
    t0 = time.perf_counter()
    code, err = h2c(["plan", str(costs_json), "--cluster", str(f), "--no-speedup", "--json"],
                    capsys)
    took = time.perf_counter() - t0
    assert code == 0, err
    assert took < 10, f"planning 10^9 chips took {took:.1f} s"


# ---- a scan over every entry point ---------------------------------------------------------------

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

NUMBERS = st.one_of(st.integers(-2 ** 70, 2 ** 70).map(str), st.sampled_from(
    ["0", "-1", "1", "nan", "inf", "-inf", "1e308", "2**63", "", " ", "0x10", "1_000", "auto",
     "9" * 5000]), st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.text(max_size=12))
JUNK = st.one_of(st.binary(max_size=200), st.text(max_size=200).map(str.encode), st.sampled_from([
    b"", b"\xff\xfe", b"[" * 3000, b"{" * 3000, b"sys.exit(7)", b"import sys\nsys.exit(7)\n",
    b"def build_model(**k):\n    return 1/0\n", b"def build_model(**k):\n    return 3\n",
    LOCAL.encode(), LOCAL.replace("8", "1e308").encode(),
    b'model "x"\ncluster "local"\nbatch global=99999999999 micro=1 seq=8\n',
    json.dumps({"format": "h2-build/1", "workers": [], "stages": []}).encode()]))

# command -> (positional kinds, numeric flags, other flags)
SCAN = {
    ("h2c", "ir"): (["file"], ["--seq-len", "--micro-batch"], ["--summary", "--json"]),
    ("h2c", "plan"): (["file"], ["--global-batch", "--micro-batch", "--seq-len"],
                      ["--cluster", "--plan", "--json", "--no-speedup"]),
    ("h2c", "compile"): (["file"], ["--global-batch", "--micro-batch", "--seq-len", "--seed"],
                         ["--cluster", "--plan", "--dry-run"]),
    ("h2c", "ops"): ([], [], ["--json"]),
    ("h2c", "check-ops"): ([], ["--seed"], ["--backend", "--dtype", "--op"]),
    ("h2c", "profile"): ([], ["--micro-batch", "--seq-len"], ["--model", "--backend"]),
    ("h2x", "run"): (["build"], ["--steps", "--checkpoint-every", "--timeout", "--data-max-bytes"],
                     ["--data", "--data-format", "--transport", "--resume"]),
    ("h2x", "bench-comm"): ([], ["--max-size"], ["--transport", "--json"]),
}
SUFFIXES = [".py", ".toml", ".h2plan", ".h2ir", ".json", ".txt", ""]
# flags that would make a command do real work (measure, train, benchmark) on valid values
_NEEDS_BAD = {("h2c", "check-ops"), ("h2c", "profile"), ("h2x", "bench-comm")}


@st.composite
def invocations(draw):
    prog, cmd = draw(st.sampled_from(sorted(SCAN)))
    positional, numeric, other = SCAN[(prog, cmd)]
    files = {}
    argv = [cmd]
    for kind in positional:
        name = f"in{draw(st.sampled_from(SUFFIXES))}"
        if kind == "build":
            files["b/manifest.json"] = draw(JUNK)
            argv.append("{tmp}/b")
        else:
            files[name] = draw(JUNK)
            argv.append("{tmp}/" + name)
    for flag in draw(st.lists(st.sampled_from(numeric), max_size=3, unique=True)) if numeric else []:
        argv += [flag, draw(NUMBERS)]
    for flag in draw(st.lists(st.sampled_from(other), max_size=2, unique=True)) if other else []:
        if flag in ("--json", "--summary", "--no-speedup", "--dry-run", "--resume"):
            argv.append(flag)
        elif flag in ("--cluster", "--plan", "--model", "--data"):
            name = f"f{len(files)}{draw(st.sampled_from(SUFFIXES))}"
            files[name] = draw(JUNK)
            argv += [flag, "{tmp}/" + name]
        else:
            argv += [flag, draw(st.text(max_size=8))]
    if (prog, cmd) in _NEEDS_BAD and len(argv) < 3:
        argv += [numeric[0] if numeric else "--backend", "-1"]
    return prog, argv, files


@settings(max_examples=int(os.environ.get("H2_SCAN_EXAMPLES", 60)), deadline=None,
          derandomize="H2_SCAN_EXAMPLES" not in os.environ,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(inv=invocations())
def test_no_entry_point_shows_a_traceback(inv, tmp_path_factory, capsys):
    prog, argv, files = inv
    tmp = tmp_path_factory.mktemp("scan")
    for name, data in files.items():
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp / name).write_bytes(data)
    argv = [a.replace("{tmp}", str(tmp)) for a in argv]
    if (prog, argv[0]) in _NEEDS_BAD and not _has_bad_value(argv):
        return                            # valid values would measure or benchmark: not here
    if prog == "h2c" and argv[0] == "compile":
        argv += ["-o", str(tmp / "out")]
    code, err = (h2c if prog == "h2c" else h2x)(argv, capsys)
    assert code in (0, 2), (prog, argv, code, err[-2000:])
    assert "Traceback" not in err, (prog, argv, err[-2000:])


def _has_bad_value(argv) -> bool:
    """Some flag value is not a plain positive integer (so the command stops at its arguments)."""
    vals = [v for f, v in zip(argv, argv[1:]) if f.startswith("--")]
    return any(not v.isdigit() or len(v) > 18 or int(v) < 1 for v in vals)
