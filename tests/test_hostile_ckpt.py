"""Checkpoints and run-directory hygiene under hostile conditions: a crash while a step directory is
rewritten, two runs on one build, corrupt and truncated checkpoint files, recompiling over
checkpoints, unwritable output paths, and the temp files every exit path must remove."""
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from conftest import ROOT, run_cli

TINY = ["--global-batch", "4", "--micro-batch", "2", "--seq-len", "32", "--arg", "n_layers=2",
        "--arg", "max_seq=64", "--arg", "vocab=256", "--arg", "dim=64", "--arg", "n_heads=4",
        "--arg", "ffn=128"]
PLAN = """model    "examples/llama_tiny.py"
cluster  "local"
batch    global=4 micro=2 seq=32
schedule 1f1b
dp       1
stage chip=cpu-torch chips=1 tp=1 layers=embed, 0
stage chip=cpu-torch chips=1 tp=1 layers=1, head
"""
OTHER_DATA = ["--data", "examples/llama_tiny.py", "--data-format", "bytes"]


def step(n: int) -> str:
    return f"step_{n:08d}"


@pytest.fixture(scope="module")
def tiny_build(tmp_path_factory):
    """A 2-stage torch build of a ~100 k-parameter llama (checkpoints of ~0.7 MB per worker)."""
    d = tmp_path_factory.mktemp("ckpt")
    (d / "p.h2plan").write_text(PLAN)
    r = run_cli("h2c", "compile", "examples/llama_tiny.py", *TINY, "--plan", str(d / "p.h2plan"),
                "-o", str(d / "b"))
    assert r.returncode == 0, r.stderr
    return d / "b"


@pytest.fixture(scope="module")
def trained(tiny_build, tmp_path_factory):
    """The build after run A: 6 steps, checkpoints at 2, 4 and 6, and its per-step losses."""
    b = tmp_path_factory.mktemp("trained") / "b"
    shutil.copytree(tiny_build, b)
    log = b.parent / "a.jsonl"
    r = run_cli("h2x", "run", str(b), "--steps", "6", "--checkpoint-every", "2", "--json-log", str(log))
    assert r.returncode == 0, r.stderr + r.stdout
    return b, _losses(log)


def _losses(log: Path) -> dict[int, float]:
    return {json.loads(l)["step"]: json.loads(l)["loss"] for l in log.read_text().splitlines()}


def _copy(src: Path, tmp_path: Path) -> Path:
    b = tmp_path / "b"
    shutil.copytree(src, b)
    return b


def _private_tmp(tmp_path: Path) -> tuple[Path, dict]:
    """A TMPDIR of the test's own, so the run's temp directory can be seen to go away (other runs
    on this machine use /tmp)."""
    t = tmp_path / "tmp"
    t.mkdir()
    return t, dict(os.environ, TMPDIR=str(t))


def _clean_error(r, rc=2):
    assert r.returncode == rc, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and "internal error" not in r.stderr, r.stderr


def _fingerprint(b: Path) -> str:
    from executor.checkpoint import build_fingerprint
    return build_fingerprint(b)


def _same(got: dict, want: dict, steps):
    for s in steps:
        assert abs(got[s] - want[s]) <= 1e-6 * abs(want[s]), (s, got, want)


def test_interrupted_rewrite_of_a_step_is_not_loaded_as_a_mix(trained, tmp_path):
    """Run B (other data, so its weights differ from A's) rewrites step 6 and crashes there: w1
    cannot write its file. Resume must not load B's w0 beside A's w1."""
    from executor.checkpoint import resume_point
    a_build, _ = trained
    b = _copy(a_build, tmp_path)
    a_record = (b / "ckpt" / step(6) / "COMPLETE").read_text()
    (b / "ckpt" / step(6) / "w1.safetensors.tmp").mkdir()     # w1's write fails at step 6
    tmp, env = _private_tmp(tmp_path)
    log_b = tmp_path / "b.jsonl"
    r = run_cli("h2x", "run", str(b), "--steps", "6", "--checkpoint-every", "2", *OTHER_DATA,
                "--json-log", str(log_b), env=env)
    _clean_error(r)
    # the failing file is named: in the relayed worker error, or in w1's log the message points at
    named = f"{b / 'ckpt' / step(6) / 'w1.safetensors'}: error: cannot write checkpoint"
    assert "all workers stopped" in r.stderr.lower(), r.stderr
    w1_log = (b / "logs" / "stderr_w1.txt").read_text()                # kept after the run
    assert named in r.stderr or (named in w1_log and "full log: " in r.stderr), r.stderr
    assert not any(tmp.iterdir()), list(tmp.iterdir())                 # temp dir gone after a failure
    assert not (b / "ckpt" / step(6) / "COMPLETE").exists()          # invalidated before rewriting
    (b / "ckpt" / step(6) / "w1.safetensors.tmp").rmdir()

    # Had A's COMPLETE survived (the old bug), the digests still refuse a mix of the two runs.
    (b / "ckpt" / step(6) / "COMPLETE").write_text(a_record)
    notes = []
    s, _ = resume_point(b / "ckpt", _fingerprint(b), 2, notes.append)
    mixed = json.loads(a_record)["files"]["w0.safetensors"]["sha256"] != \
        _sha256(b / "ckpt" / step(6) / "w0.safetensors")
    if mixed:                                 # B's w0 landed before the launcher stopped B
        assert s == 4 and "w0.safetensors: corrupt" in notes[0], notes
    (b / "ckpt" / step(6) / "COMPLETE").unlink()

    log_r = tmp_path / "r.jsonl"
    r = run_cli("h2x", "run", str(b), "--steps", "6", "--resume", *OTHER_DATA, "--json-log",
                str(log_r), env=env)
    assert r.returncode == 0, r.stderr + r.stdout
    assert f"{step(6)} has no COMPLETE marker" in r.stdout
    assert f"resuming from {b / 'ckpt' / step(4)}" in r.stdout        # B's own, complete
    got, want = _losses(log_r), _losses(log_b)
    assert sorted(got) == [5, 6] and 5 in want
    _same(got, want, [s for s in got if s in want])
    assert not any(tmp.iterdir())


def _sha256(p: Path) -> str:
    import hashlib
    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_corrupt_and_truncated_checkpoints_are_named_and_skipped(trained, tmp_path):
    a_build, full = trained
    b = _copy(a_build, tmp_path)
    w1 = b / "ckpt" / step(6) / "w1.safetensors"
    data = bytearray(w1.read_bytes())
    data[len(data) // 2] ^= 0x01                                       # one flipped bit
    w1.write_bytes(bytes(data))
    w0 = b / "ckpt" / step(4) / "w0.safetensors"
    with open(w0, "r+b") as f:
        f.truncate(1000)
    log = tmp_path / "r.jsonl"
    r = run_cli("h2x", "run", str(b), "--steps", "6", "--resume", "--json-log", str(log))
    assert r.returncode == 0, r.stderr + r.stdout
    assert f"{w1}: corrupt" in r.stdout and f"{w0}: truncated" in r.stdout, r.stdout
    assert f"resuming from {b / 'ckpt' / step(2)}" in r.stdout
    got = _losses(log)
    assert sorted(got) == [3, 4, 5, 6]
    _same(got, full, got)                     # equal to the uninterrupted run from step 2 on

    m2 = b / "ckpt" / step(2) / "w1.msgpack"
    m2.write_bytes(m2.read_bytes()[:-3])
    r = run_cli("h2x", "run", str(b), "--steps", "6", "--resume")
    _clean_error(r)
    assert "no usable checkpoint" in r.stderr and str(m2) in r.stderr and "starting" not in r.stdout


def test_checkpoint_of_another_build_is_refused(trained, tmp_path):
    a_build, _ = trained
    b = _copy(a_build, tmp_path)
    mf = b / "manifest.json"
    m = json.loads(mf.read_text())
    m["seed"] = m["seed"] + 1                 # as if recompiled with another seed
    mf.write_text(json.dumps(m, indent=1))
    r = run_cli("h2x", "run", str(b), "--steps", "8", "--resume")
    _clean_error(r)
    assert "belongs to a different build" in r.stderr and step(6) in r.stderr


def _children(pid: int) -> list[int]:
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                fields = (p / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                out.append(int(p.name))
    return out


def _alive(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_second_run_on_a_build_refuses(trained, tmp_path):
    from executor.checkpoint import resume_point
    from executor.rundir import RunLock
    a_build, _ = trained
    b = _copy(a_build, tmp_path)
    shutil.rmtree(b / "ckpt")
    tmp, env = _private_tmp(tmp_path)
    exe = Path(sys.executable).parent / "h2x"
    first = subprocess.Popen([str(exe), "run", str(b), "--steps", "100000", "--checkpoint-every",
                              "10"], cwd=ROOT, text=True, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, env=env)
    try:
        for line in first.stdout:
            if line.startswith("step") and int(line.split()[1].split("/")[0]) >= 25:
                break
        else:
            raise AssertionError("first run ended early: " + first.stderr.read())
        threading.Thread(target=first.stdout.read, daemon=True).start()   # keep its pipe drained
        workers = _children(first.pid)
        r = run_cli("h2x", "run", str(b), "--steps", "4", "--checkpoint-every", "2")
        _clean_error(r)
        assert "another h2x run is using this build directory" in r.stderr
        assert f"pid {first.pid}" in r.stderr, r.stderr
        assert "starting" not in r.stdout
        first.send_signal(signal.SIGINT)     # the first run is stopped with Ctrl-C
        assert first.wait(timeout=30) == 130
    finally:
        if first.poll() is None:
            first.kill()
    notes = []
    s, _ = resume_point(b / "ckpt", _fingerprint(b), 2, notes.append)   # the first run's, sound
    assert s >= 20
    assert not any(tmp.iterdir()), list(tmp.iterdir())       # removed after KeyboardInterrupt too
    assert workers and not any(_alive(p) for p in workers), "orphan workers"
    with RunLock(b):                          # released when its holder ended
        pass


def test_compile_never_deletes_checkpoints_or_foreign_paths(trained, tmp_path):
    from frontend.compiler import compile_model
    from executor.rundir import RunLock
    from h2ir.errors import H2Error
    a_build, _ = trained
    b = _copy(a_build, tmp_path)
    before = sorted(str(p.relative_to(b)) for p in (b / "ckpt").rglob("*"))
    r = run_cli("h2c", "compile", "examples/llama_tiny.py", *TINY, "-o", str(b))
    _clean_error(r)
    assert "holds 3 checkpoint(s)" in r.stderr and str(b) in r.stderr
    assert sorted(str(p.relative_to(b)) for p in (b / "ckpt").rglob("*")) == before
    assert (b / "manifest.json").is_file()

    def refused(out) -> str:
        with pytest.raises(H2Error) as e:
            compile_model("examples/llama_tiny.py", out_dir=str(out), log=lambda *a: None)
        return str(e.value)

    f = tmp_path / "notes.txt"
    f.write_text("mine")
    assert "existing file" in refused(f) and f.read_text() == "mine"
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("x")
    assert "not an h2 build directory" in refused(mine) and (mine / "thesis.tex").exists()
    shutil.rmtree(b / "ckpt")
    with RunLock(b):                          # a run in progress on the build
        assert "an h2x run is using this build directory" in refused(b)
    assert (b / "manifest.json").is_file()


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory on a read-only bind mount (EROFS even for root); None where mounting is not
    allowed."""
    src, mnt = tmp_path / "ro_src", tmp_path / "ro"
    src.mkdir()
    mnt.mkdir()
    ok = subprocess.run(["mount", "--bind", str(src), str(mnt)], capture_output=True).returncode == 0
    if ok:
        ok = subprocess.run(["mount", "-o", "remount,ro,bind", str(mnt)],
                            capture_output=True).returncode == 0
        probe = mnt / "probe"
        try:
            probe.write_text("")
            probe.unlink()
            ok = False                        # mounted, but writable: no use
        except OSError:
            pass
    try:
        yield mnt if ok else None
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


def test_unwritable_outputs_are_refused_before_any_step(tiny_build, tmp_path, read_only_dir):
    b = _copy(tiny_build, tmp_path)
    a_file = tmp_path / "a_file"
    a_file.write_text("")

    def refused(*args) -> str:
        r = run_cli("h2x", "run", str(b), "--steps", "2", *args)
        _clean_error(r)
        assert "starting" not in r.stdout and "step " not in r.stdout, r.stdout
        return r.stderr

    assert "cannot write the --trace file: Not a directory" in refused("--trace", str(a_file / "t.json"))
    assert "the --json-log file is a directory" in refused("--json-log", str(tmp_path))
    assert "cannot write the --json-log file" in refused("--json-log", str(a_file / "x" / "l.jsonl"))
    (b / "ckpt").write_text("")               # the checkpoint directory's path is a regular file
    assert "checkpoint directory exists and is not a directory" in refused("--checkpoint-every", "1")
    (b / "ckpt").unlink()
    shutil.rmtree(b / "logs")
    (b / "logs").write_text("")
    assert "worker log directory" in refused()
    (b / "logs").unlink()
    if read_only_dir is None:
        pytest.skip("no read-only bind mount here (mount not permitted); the path-under-a-file "
                    "cases above ran")
    assert "Read-only file system" in refused("--json-log", str(read_only_dir / "l.jsonl"))
    assert "Read-only file system" in refused("--trace", str(read_only_dir / "t.json"))
    (b / "ckpt").mkdir()
    subprocess.run(["mount", "--bind", str(read_only_dir), str(b / "ckpt")], check=True)
    try:
        err = refused("--checkpoint-every", "1")
    finally:
        subprocess.run(["umount", str(b / "ckpt")], capture_output=True)
    assert "checkpoint directory is not writable: Read-only file system" in err


def test_partial_files_of_a_killed_writer_are_removed(trained, tmp_path):
    """What a SIGKILL in the middle of rewriting step 6 leaves: COMPLETE already removed, a
    half-written w0.safetensors.tmp. The next run removes it, says so, and resumes from step 4."""
    a_build, full = trained
    b = _copy(a_build, tmp_path)
    d6 = b / "ckpt" / step(6)
    (d6 / "COMPLETE").unlink()
    (d6 / "w0.safetensors.tmp").write_bytes((d6 / "w0.safetensors").read_bytes()[:5000])
    tmp, env = _private_tmp(tmp_path)
    log = tmp_path / "r.jsonl"
    r = run_cli("h2x", "run", str(b), "--steps", "6", "--resume", "--checkpoint-every", "2",
                "--json-log", str(log), env=env)
    assert r.returncode == 0, r.stderr + r.stdout
    assert "removed 1 partial checkpoint file(s)" in r.stdout and "w0.safetensors.tmp" in r.stdout
    assert f"resuming from {b / 'ckpt' / step(4)}" in r.stdout
    _same(_losses(log), full, [5, 6])
    assert not list((b / "ckpt").rglob("*.tmp"))
    assert (d6 / "COMPLETE").is_file()        # rewritten by this run, complete again
    assert not any(tmp.iterdir()), list(tmp.iterdir())       # and a normal end removes its temp dir
