"""Files bound to their run, their step and their content (issue 29): the checkpoint directory
locked by the run that writes it, checkpoints bound to their step, build and lineage, every build
file and the token cache checked against the digest recorded when it was written, bad build
files and inputs as located errors, the temporary files of killed writers removed, and a
property test: a random byte changed in a build, a checkpoint or a token cache is refused with a
clear message or leaves the losses as they were — never another loss with exit 0, never an
internal error.

One tiny two-stage build (vocab 320, for a 300-id BPE tokenizer trained here) is compiled once
and trained once on tokenized text (5 steps, checkpoints at 2 and 4); each test works on a copy.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings, strategies as st

from conftest import ROOT, TINY_2STAGE_PLAN, run_cli
from h2ir.errors import H2Error

TINY = ["--global-batch", "4", "--micro-batch", "2", "--seq-len", "32", "--arg", "n_layers=2",
        "--arg", "max_seq=64", "--arg", "vocab=320", "--arg", "dim=32", "--arg", "n_heads=2",
        "--arg", "ffn=64"]
STEPS = 5
WORDS = "the quick brown fox jumps over lazy dog pipeline stage micro batch replica".split()


def step(n: int) -> str:
    return f"step_{n:08d}"


# ---- fixtures --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """(text file, tokenizer.json): a byte-level BPE of 300 ids trained on the text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    d = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    text = "".join(" ".join(WORDS[j] for j in rng.integers(0, len(WORDS), 10)) + "\n"
                   for _ in range(400))
    (d / "corpus.txt").write_text(text)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(text.splitlines(), trainers.BpeTrainer(
        vocab_size=300, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(d / "tokenizer.json"))
    return d / "corpus.txt", d / "tokenizer.json"


@pytest.fixture(scope="module")
def data_flags(corpus):
    return ["--data", str(corpus[0]), "--tokenizer", str(corpus[1])]


@pytest.fixture(scope="module")
def tiny_build(tmp_path_factory):
    d = tmp_path_factory.mktemp("hardening")
    (d / "p.h2plan").write_text(TINY_2STAGE_PLAN)
    r = run_cli("h2c", "compile", "examples/llama_tiny.py", *TINY, "--plan", str(d / "p.h2plan"),
                "-o", str(d / "b"))
    assert r.returncode == 0, r.stderr
    return d / "b"


@pytest.fixture(scope="module")
def trained(tiny_build, tmp_path_factory, data_flags):
    """The build after 5 steps on the text (checkpoints at 2 and 4), and its per-step losses."""
    b = tmp_path_factory.mktemp("trained") / "b"
    shutil.copytree(tiny_build, b)
    log = b.parent / "full.jsonl"
    r = run_cli("h2x", "run", str(b), "--steps", str(STEPS), "--checkpoint-every", "2",
                *data_flags, "--json-log", str(log))
    assert r.returncode == 0, r.stderr + r.stdout
    assert sorted(p.name for p in (b / "ckpt").glob("step_*")) == [step(2), step(4)]
    return b, _losses(log)


def _losses(log: Path) -> dict[int, float]:
    if not log.exists():
        return {}
    return {json.loads(l)["step"]: json.loads(l)["loss"] for l in log.read_text().splitlines()
            if "loss" in json.loads(l)}


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _same(got: dict, want: dict):
    assert got, "no step ran"
    for s, v in got.items():
        assert abs(v - want[s]) <= 1e-6 * abs(want[s]), (s, got, want)


def _clean(r, rc=2):
    assert r.returncode == rc, (r.returncode, r.stdout[-3000:], r.stderr[-3000:])
    assert "Traceback" not in r.stderr and "internal error" not in r.stderr, r.stderr[-3000:]


def _redigest(b: Path) -> None:
    """Record the build's files as they are now (an edit whose digests were brought along):
    the structural checks alone must then catch what is wrong."""
    f = b / "digests.json"
    d = json.loads(f.read_text())
    for rel in d["files"]:
        data = (b / rel).read_bytes()
        d["files"][rel] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    f.write_text(json.dumps(d, indent=1))


def _edit_manifest(b: Path, **fields) -> None:
    mf = b / "manifest.json"
    m = json.loads(mf.read_text())
    for path, v in fields.items():
        d = m
        keys = path.split("__")
        for k in keys[:-1]:
            d = d[int(k)] if k.isdigit() else d[k]
        d[int(keys[-1]) if keys[-1].isdigit() else keys[-1]] = v
    mf.write_text(json.dumps(m, indent=1))


def _other_build(src: Path, dst: Path) -> Path:
    """A build of another fingerprint (another seed), its digests recorded: a second build."""
    b = _copy(src, dst)
    shutil.rmtree(b / "ckpt", ignore_errors=True)
    _edit_manifest(b, seed=7)
    _redigest(b)
    return b


# ---- item 2: the checkpoint directory is locked by the run that writes it ---------------------

def test_second_build_on_a_running_checkpoint_dir_is_refused(tiny_build, tmp_path, data_flags):
    """A run of another build pointed at the checkpoint directory of a running one is refused,
    naming the owner; the owner's checkpoints and its files in flight are untouched."""
    a = _copy(tiny_build, tmp_path / "a")
    b = _other_build(tiny_build, tmp_path / "other")
    shared = tmp_path / "shared"
    exe = Path(sys.executable).parent / "h2x"
    first = subprocess.Popen([str(exe), "run", str(a), "--steps", "100000", "--checkpoint-every",
                              "2", "--checkpoint-dir", str(shared), *data_flags], cwd=ROOT,
                             text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        for line in first.stdout:
            if line.startswith("step") and int(line.split()[1].split("/")[0]) >= 5:
                break
        else:
            raise AssertionError("first run ended early: " + first.stderr.read())
        threading.Thread(target=first.stdout.read, daemon=True).start()
        threading.Thread(target=first.stderr.read, daemon=True).start()
        in_flight = shared / step(2) / "w0.safetensors.tmp"      # as if being written now
        in_flight.write_bytes(b"x" * 100)
        before = {p.name: p.stat().st_mtime_ns for p in (shared / step(2)).iterdir()}
        r = run_cli("h2x", "run", str(b), "--steps", "2", "--checkpoint-every", "1",
                    "--checkpoint-dir", str(shared), *data_flags)
        _clean(r)
        assert f"{shared}: error: another h2x run is using this checkpoint directory" in r.stderr
        assert f"pid {first.pid}" in r.stderr and f"build {a}" in r.stderr, r.stderr
        assert "starting" not in r.stdout
        assert in_flight.exists()                  # the owner's file in flight was left alone
        assert {p.name: p.stat().st_mtime_ns for p in (shared / step(2)).iterdir()} == before
        r = run_cli("h2x", "run", str(b), "--steps", "2", "--resume", "--checkpoint-dir",
                    str(shared), *data_flags)      # a reader is refused too
        _clean(r)
        assert "another h2x run is using this checkpoint directory" in r.stderr
        first.send_signal(signal.SIGINT)
        assert first.wait(timeout=60) == 130
    finally:
        if first.poll() is None:
            first.kill()


def test_stale_checkpoint_lock_is_taken_over_with_a_note(tiny_build, tmp_path):
    from executor.rundir import CKPT_LOCK_FILE, RunLock
    b = _copy(tiny_build, tmp_path / "b")
    d = tmp_path / "ckpt"
    d.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (d / CKPT_LOCK_FILE).write_text(json.dumps({"pid": dead.pid, "host": "elsewhere",
                                                "build": "/old/build", "started": 0}))
    notes = []
    with RunLock(b, d, writes=True, out=notes.append):
        held = json.loads((d / CKPT_LOCK_FILE).read_text())
        assert held["pid"] == os.getpid() and held["build"] == str(b)
    assert len(notes) == 1 and "took over the lock" in notes[0], notes
    assert f"pid {dead.pid} on elsewhere, build /old/build" in notes[0]
    assert (d / CKPT_LOCK_FILE).read_text() == ""          # a clean end leaves no owner
    notes.clear()
    (d / CKPT_LOCK_FILE).write_bytes(b"\xff garbage")
    with RunLock(b, d, writes=True, out=notes.append):
        pass
    assert "no owner recorded" in notes[0]


def test_resume_falls_back_past_another_builds_newest_step(trained, tiny_build, tmp_path,
                                                           data_flags):
    """Another build wrote the newest step of a shared directory: this build's --resume notes
    it and resumes from its own newest sound checkpoint, exactly."""
    src, full = trained
    a = _copy(src, tmp_path / "a")
    shared = a / "ckpt"
    other = _other_build(tiny_build, tmp_path / "other")
    r = run_cli("h2x", "run", str(other), "--steps", "6", "--checkpoint-every", "6",
                "--checkpoint-dir", str(shared), *data_flags)
    assert r.returncode == 0, r.stderr + r.stdout
    assert (shared / step(6) / "COMPLETE").is_file()
    log = tmp_path / "r.jsonl"
    r = run_cli("h2x", "run", str(a), "--steps", str(STEPS), "--resume", *data_flags,
                "--json-log", str(log))
    assert r.returncode == 0, r.stderr + r.stdout
    assert f"checkpoint {step(6)} is not usable" in r.stdout and "different build" in r.stdout
    assert f"resuming from {shared / step(4)}" in r.stdout
    _same(_losses(log), full)


def test_prune_keeps_another_builds_checkpoints(tmp_path):
    from executor.checkpoint import MARKER, prune, step_dir
    for s, build in ((2, "mine"), (4, "theirs"), (6, "mine"), (8, "mine")):
        d = step_dir(tmp_path, s)
        d.mkdir()
        (d / MARKER).write_text(json.dumps({"build": build}))
    gone = prune(tmp_path, 1, "mine")
    assert sorted(p.name for p in gone) == [step(2), step(6)]
    assert (step_dir(tmp_path, 4) / MARKER).is_file()


# ---- item 3: a checkpoint is bound to its step, its build and its run --------------------------

def test_renamed_step_and_a_file_named_step_are_skipped(trained, tmp_path, data_flags):
    """step_4 renamed to step_8 resumed "from step 8" with step 4's state; a regular file named
    like a step made --resume fail. Both are skipped with a note now."""
    src, full = trained
    b = _copy(src, tmp_path / "b")
    (b / "ckpt" / step(4)).rename(b / "ckpt" / step(8))
    (b / "ckpt" / step(9)).write_text("not a checkpoint")
    log = tmp_path / "r.jsonl"
    r = run_cli("h2x", "run", str(b), "--steps", str(STEPS), "--resume", *data_flags,
                "--json-log", str(log))
    assert r.returncode == 0, r.stderr + r.stdout
    assert f"{b / 'ckpt' / step(9)} is not a directory; skipped" in r.stdout
    assert "COMPLETE records step 4, but the directory is named for step 8" in r.stdout
    assert f"resuming from {b / 'ckpt' / step(2)}" in r.stdout
    assert sorted(_losses(log)) == [3, 4, 5]
    _same(_losses(log), full)


def test_worker_files_of_another_step_or_run_are_refused(trained, tmp_path):
    """Worker files moved between checkpoints, with COMPLETE's digests brought along: each
    worker's metadata still names its step and run."""
    from executor.checkpoint import MARKER, Unusable, build_fingerprint, file_digest, verify
    src, _ = trained
    b = _copy(src, tmp_path / "b")
    fp = build_fingerprint(b)
    d2, d4 = b / "ckpt" / step(2), b / "ckpt" / step(4)
    record = json.loads((d4 / MARKER).read_text())
    for name in ("w1.safetensors", "w1.msgpack"):
        shutil.copyfile(d2 / name, d4 / name)
        record["files"][name] = file_digest(d4 / name)
    (d4 / MARKER).write_text(json.dumps(record))
    with pytest.raises(Unusable, match="records step 2 where COMPLETE has 4"):
        verify(d4, fp, 2)
    record["lineage"] = "another-run"          # a COMPLETE of another run over these files
    (d2 / MARKER).write_text(json.dumps({**json.loads((d2 / MARKER).read_text()),
                                         "lineage": "another-run"}))
    with pytest.raises(Unusable, match="records lineage .* where COMPLETE has 'another-run'"):
        verify(d2, fp, 2)


def test_lineage_is_kept_across_a_resume(trained, tmp_path, data_flags):
    from executor.checkpoint import MARKER
    src, _ = trained
    b = _copy(src, tmp_path / "b")
    first = json.loads((b / "ckpt" / step(4) / MARKER).read_text())["lineage"]
    assert json.loads((b / "ckpt" / step(2) / MARKER).read_text())["lineage"] == first
    r = run_cli("h2x", "run", str(b), "--steps", "6", "--resume", "--checkpoint-every", "2",
                *data_flags)
    assert r.returncode == 0, r.stderr + r.stdout
    assert json.loads((b / "ckpt" / step(6) / MARKER).read_text())["lineage"] == first


# ---- a checkpoint that cannot be written: a run error naming its step and the cause -------------

@pytest.mark.parametrize("err", ["EMFILE", "ENOSPC", "EACCES", "EIO"])
@pytest.mark.parametrize("where", ["directory", "file"])
def test_checkpoint_write_error_names_the_step_and_the_cause(tmp_path, monkeypatch, err, where):
    """An OSError while a worker writes its checkpoint (its step directory, or a file in it) is
    a run error naming the step directory and the cause, and leaves no temporary file."""
    import errno
    from executor import checkpoint
    code = getattr(errno, err)

    def fail(*a):
        raise OSError(code, os.strerror(code))
    d = tmp_path / step(4)
    if where == "directory":
        monkeypatch.setattr(checkpoint, "_fsync_dir", fail)
    else:
        d.mkdir()
        monkeypatch.setattr(checkpoint.os, "fsync", fail)
    with pytest.raises(H2Error) as e:
        checkpoint.write_snapshot(tmp_path, 4, 0, {"param.w": np.ones(4, np.float32)}, {"step": 4})
    said = str(e.value)
    what = "its directory" if where == "directory" else "w0.safetensors"
    assert f"error: cannot write checkpoint {step(4)} ({what}): {os.strerror(code)} ({err}" \
        in said and said.startswith(str(d)), said
    if err == "EMFILE":
        assert "file descriptors are exhausted, limit" in said and "ulimit -n" in said, said
    assert not list(tmp_path.rglob("*.tmp")), list(tmp_path.rglob("*"))


def test_checkpoint_failing_mid_run_stops_it_and_resume_takes_the_previous(tiny_build, tmp_path):
    """w1 runs out of descriptors after the checkpoint of step 10 is complete: its next checkpoint
    fails in its background writer, and the run stops at once, naming w1, the step directory and
    the cause; that step has no COMPLETE, and --resume takes step 10."""
    import re

    from test_hardening_comm import _starve
    b = _copy(tiny_build, tmp_path / "b")
    ck = tmp_path / "ck"
    r, _ = _starve(b, 1, ["--steps", "200", "--checkpoint-every", "10", "--checkpoint-dir",
                          str(ck)], lambda line: (ck / step(10) / "COMPLETE").exists())
    _clean(r)
    said = re.search(r"error: cannot write checkpoint (step_\d+) \((w1\.safetensors|w1\.msgpack|"
                     r"its directory)\): Too many open files \(EMFILE", r.stderr)
    assert said and "reported by worker w1 (stage 1" in r.stderr, r.stderr
    bad = int(said.group(1)[len("step_"):])
    assert bad > 10 and f"step{bad + 3}/" not in r.stdout.replace(" ", ""), r.stdout[-2000:]
    assert not (ck / said.group(1) / "COMPLETE").exists()
    newest = max(int(m.parent.name[len("step_"):]) for m in ck.glob("step_*/COMPLETE"))
    assert newest == bad - 10, (newest, bad)
    r = run_cli("h2x", "run", str(b), "--steps", str(newest + 2), "--resume", "--checkpoint-dir",
                str(ck))
    assert r.returncode == 0, r.stderr
    assert f"resuming from {ck / step(newest)} (step {newest})" in r.stdout, r.stdout


# ---- item 5: content digests of the build and of the token cache -------------------------------

def test_changed_weight_is_refused(tiny_build, tmp_path):
    b = _copy(tiny_build, tmp_path / "b")
    w = b / "weights" / "stage1.safetensors"
    data = bytearray(w.read_bytes())
    data[-8] ^= 0x10                                  # one bit of the last tensor's data
    w.write_bytes(bytes(data))
    r = run_cli("h2x", "run", str(b), "--steps", "1")
    _clean(r)
    assert f"{w}: error: changed since h2c compile wrote it" in r.stderr, r.stderr
    assert "worker w1" in r.stderr and "during start-up" in r.stderr   # w1 hashes what it loads


def test_stream_without_its_optimizer_step_is_refused(tiny_build, tmp_path, capsys):
    from executor.cli import main
    b = _copy(tiny_build, tmp_path / "b")
    s = b / "streams" / "w1.txt"
    s.write_text(s.read_text().replace("opt_step\n", ""))
    assert main(["run", str(b), "--steps", "1"]) == 2
    assert f"{s}: error: " in capsys.readouterr().err
    _redigest(b)                                      # digests brought along: the stream check
    assert main(["run", str(b), "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert f"{s}: error: the stream has 0 optimizer step(s)" in err, err


def test_build_without_digests_is_refused(tiny_build, tmp_path):
    from executor.build import BuildDir
    b = _copy(tiny_build, tmp_path / "b")
    (b / "digests.json").unlink()
    with pytest.raises(H2Error, match="has no digests.json") as e:
        BuildDir(b)
    assert e.value.file == str(b)
    (b / "digests.json").write_text('{"format": "h2-digests/1", "files": {"x": {"sha256": 1}}}')
    with pytest.raises(H2Error, match="digest of 'x'"):
        BuildDir(b)


def _cache(tmp_path, corpus, vocab=320):
    from executor.data import prepare_data
    man = {"model": {"vocab": vocab}, "micro_batch": 2, "seq_len": 16, "num_microbatches": 2,
           "dp": 1, "seed": 0}
    notes = []
    spec = prepare_data(man, tmp_path / "data", str(corpus[0]), tokenizer=str(corpus[1]),
                        out=notes.append)
    return man, Path(spec.path), notes


def test_truncated_or_changed_token_cache_is_refused(tmp_path, corpus):
    from executor.data import prepare_data
    man, cache, _ = _cache(tmp_path, corpus)
    again = lambda: prepare_data(man, tmp_path / "data", str(corpus[0]),  # noqa: E731
                                 tokenizer=str(corpus[1]), out=lambda s: None)
    again()                                           # sound: reused
    whole = cache.read_bytes()
    cache.write_bytes(whole[:400])                    # 200 ids of ~2000
    with pytest.raises(H2Error, match="token cache is 400 bytes, .* truncated") as e:
        again()
    assert e.value.file == str(cache) and "to tokenize the text again" in e.value.hint
    data = bytearray(whole)
    data[100] ^= 1
    cache.write_bytes(bytes(data))
    with pytest.raises(H2Error, match="token cache changed since the text was tokenized"):
        again()
    # ids past the vocabulary, digest brought along: the one pass over the cache names them
    ids = np.frombuffer(whole, "<u2").copy()
    ids[7] = 400
    cache.write_bytes(ids.tobytes())
    record = cache.with_name(cache.name + ".json")
    rec = json.loads(record.read_text())
    rec["sha256"] = hashlib.sha256(ids.tobytes()).hexdigest()
    record.write_text(json.dumps(rec))
    with pytest.raises(H2Error, match=r"token id 400 at element 7 .* outside the model's vocab"):
        again()


def test_token_cache_without_its_record_is_tokenized_again(tmp_path, corpus):
    man, cache, _ = _cache(tmp_path, corpus)
    whole = cache.read_bytes()
    cache.with_name(cache.name + ".json").unlink()
    cache.write_bytes(whole[:400])
    _, cache2, notes = _cache(tmp_path, corpus)
    assert cache2 == cache and cache.read_bytes() == whole
    assert any("no record of its digest" in n for n in notes), notes


def test_vocabulary_scan_of_a_big_token_file_shows_progress(tmp_path, monkeypatch, capsys):
    from executor import data
    from frontend import progress
    f = tmp_path / "t.u16"
    np.arange(3 * data.SCAN_ELEMS, dtype="<u2").__mod__(300).astype("<u2").tofile(f)
    monkeypatch.setattr(data, "PROGRESS_BYTES", 1)
    monkeypatch.setattr(progress, "enabled", lambda stream=None: True)
    data.check_token_file(str(f), "tokens-u16", 320)
    err = capsys.readouterr().err
    assert "t.u16: checking token ids against the vocabulary" in err, err


# ---- item 6: bad build files and inputs are located errors ------------------------------------

def _run_refused(b: Path, *names: str):
    r = run_cli("h2x", "run", str(b), "--steps", "1")
    _clean(r)
    for n in names:
        assert n in r.stderr, (n, r.stderr)
    return r


def test_swapped_weight_files_are_refused(tiny_build, tmp_path):
    b = _copy(tiny_build, tmp_path / "b")
    w0, w1 = b / "weights" / "stage0.safetensors", b / "weights" / "stage1.safetensors"
    tmp = b / "weights" / "t"
    w0.rename(tmp)
    w1.rename(w0)
    tmp.rename(w1)
    _redigest(b)
    _run_refused(b, "error: weights file lacks", "a file of another stage or build?",
                 "during start-up")


@pytest.mark.parametrize("how", ["reshape", pytest.param("retype", marks=pytest.mark.slow)])
def test_reshaped_or_retyped_weight_file_is_refused(tiny_build, tmp_path, how):
    from safetensors.numpy import load_file, save_file
    b = _copy(tiny_build, tmp_path / "b")
    w = b / "weights" / "stage1.safetensors"
    t = load_file(str(w))
    k = "head.weight"
    t[k] = t[k].reshape(-1)[: t[k].size // 2].reshape(t[k].shape[0] // 2, -1).copy() \
        if how == "reshape" else t[k].astype(np.float64)
    save_file(t, str(w))
    _redigest(b)
    want = "f32[160,32]" if how == "reshape" else "f64[320,32]"
    _run_refused(b, f"{w}: error: weights file: tensor {k} is {want}, the stage's program "
                 "takes f32[320,32]")


@pytest.mark.parametrize("edit, field", [
    ({"micro_batch": 1, "num_microbatches": 4}, "micro_batch"),
    ({"seq_len": 16}, "seq_len"),
])
def test_manifest_batch_shape_edits_name_the_field(tiny_build, tmp_path, edit, field):
    from executor.build import BuildDir
    b = _copy(tiny_build, tmp_path / "b")
    _edit_manifest(b, **edit)
    _redigest(b)
    build = BuildDir(b)
    with pytest.raises(H2Error) as e:
        build.stage(0)
    assert e.value.file == str(b / "manifest.json") and e.value.line
    assert e.value.message.startswith(f"{field}: micro_batch x seq_len is"), e.value.message
    assert "stage 0's program takes %" in e.value.message


def test_manifest_batch_shape_edit_through_h2x(tiny_build, tmp_path):
    b = _copy(tiny_build, tmp_path / "b")
    _edit_manifest(b, seq_len=16)
    _redigest(b)
    _run_refused(b, f"{b / 'manifest.json'}:", "error: seq_len: micro_batch x seq_len is 2 x 16")


@pytest.mark.parametrize("field, value, message", [
    ("stages__0__device", "junk", "stages[0].device: expected cpu, cuda or cuda:N"),
    ("stages__0__device", "meta", "stages[0].device: expected cpu, cuda or cuda:N"),
    ("stages__1__dtype_policy", "fp8", "stages[1].dtype_policy: expected one of fp32, bf16"),
    ("stages__1__backend", "tpu", "stages[1].backend: expected one of"),
    ("workers__0__backend", 7, "workers[0].backend: expected a non-empty string"),
])
def test_manifest_device_dtype_and_backend_edits_are_located(tiny_build, tmp_path, field, value,
                                                             message):
    from executor.build import BuildDir
    b = _copy(tiny_build, tmp_path / "b")
    _edit_manifest(b, **{field: value})
    with pytest.raises(H2Error) as e:
        BuildDir(b)
    assert e.value.file == str(b / "manifest.json") and e.value.line
    assert e.value.message.startswith(message), e.value.message


@pytest.mark.parametrize("old, new, message", [
    ("fwd 1\n", "fwd 7\n", "'fwd 7': micro-batch 7 out of range (the build runs micro-batches 0..1"),
    ("send_act 0 -> w1\n", "send_act 0 -> w9\n", "worker w9 out of range"),
    ("send_act 0 -> w1\n", "send_act 0 -> w0\n", "does not send to or receive from itself"),
    ("fwd 0\n", "fwd 0 c1\n", "chunk c1 out of range (worker w0 runs one stage)"),
])
def test_stream_instruction_out_of_range_is_located(tiny_build, tmp_path, old, new, message):
    from executor.build import BuildDir
    b = _copy(tiny_build, tmp_path / "b")
    s = b / "streams" / "w0.txt"
    text = s.read_text()
    assert old in text
    s.write_text(text.replace(old, new, 1))
    _redigest(b)
    line = next(i for i, l in enumerate(s.read_text().splitlines(), 1) if l == new.strip())
    with pytest.raises(H2Error) as e:
        BuildDir(b).stream(0)
    assert (e.value.file, e.value.line) == (str(s), line)
    assert message in e.value.message, e.value.message


def test_calibration_with_backends_7_is_located(tiny_build, tmp_path):
    from executor.build import BuildDir
    from h2ir.planner.calibration import load_calibration
    b = _copy(tiny_build, tmp_path / "b")
    cal = b / "calibration.json"
    d = json.loads(cal.read_text())
    d["backends"] = 7
    cal.write_text(json.dumps(d))
    with pytest.raises(H2Error, match="h2c compile wrote"):
        BuildDir(b)
    _redigest(b)
    with pytest.raises(H2Error, match="'backends' is not a JSON object") as e:
        BuildDir(b).calibration()
    assert e.value.file == str(cal)
    with pytest.raises(H2Error, match="'backends' is not a JSON object"):
        load_calibration(cal)                     # the host's calibration file, the same check


@pytest.mark.parametrize("section, key", [("optimizer", "lr"), ("lr_schedule", "min_lr"),
                                          ("training", "clip_grad_norm")])
def test_4000_digit_toml_integer_is_located(tmp_path, section, key):
    from h2ir.config import Config, Where, apply_toml, parse_cli_value
    f = tmp_path / "c.toml"
    f.write_text(f"[{section}]\n{key} = {'9' * 4000}\n")
    with pytest.raises(H2Error, match=f"{section}.{key}: expected a finite number") as e:
        apply_toml(Config(), str(f))
    assert (e.value.file, e.value.line) == (str(f), 2)
    with pytest.raises(H2Error, match="expected a finite number"):
        flag = f"--{section}.{key}"
        Config().set(section, key, parse_cli_value(section, key, "9" * 4000, flag), Where(flag=flag))


@pytest.mark.parametrize("dim, message", [("1" * 100_000, "is 100,000 digits long"),
                                          ("-512", "dimension -512 is negative")])
def test_h2ir_dimension_too_long_or_negative_is_located(dim, message):
    from h2ir.text import parse_graph
    text = ("h2ir m\ninput %x: f32[2,64]\n\nlayer embed kind=embed\n"
            f"  param %w: f32[{dim},64]\n  %y: f32[2,64] = add(%x, %x)\nend\n\noutput %y\n")
    with pytest.raises(H2Error, match=message) as e:
        parse_graph(text, "m.h2ir")
    assert (e.value.file, e.value.line) == ("m.h2ir", 5)


def test_negative_dimension_is_not_a_type():
    from h2ir.types import TensorType
    with pytest.raises(ValueError, match="negative dimension"):
        TensorType.parse("f32[-512,64]")
    with pytest.raises(ValueError, match="dimensions have at most"):
        TensorType.parse("f32[" + "9" * 100_000 + "]")


# ---- item 8 and the minor ones ---------------------------------------------------------------

def test_safetensors_own_temporary_file_is_removed(trained, tmp_path):
    """A worker killed inside safetensors' own write leaves `.tmpXXXXXX` (full size) beside
    NAME.tmp; the next run that locks the directory removes both."""
    from executor.rundir import RunLock
    src, _ = trained
    b = _copy(src, tmp_path / "b")
    d4 = b / "ckpt" / step(4)
    (d4 / "COMPLETE").unlink()
    left = d4 / ".tmpAb3XyZ"
    left.write_bytes((d4 / "w0.safetensors").read_bytes())
    (d4 / "w1.safetensors.tmp").write_bytes(b"x")
    keep = d4 / ".tmpnotsafetensors"           # not safetensors' name: not ours to remove
    keep.write_bytes(b"x")
    notes = []
    with RunLock(b, b / "ckpt", writes=True, out=notes.append):
        pass
    assert not left.exists() and not (d4 / "w1.safetensors.tmp").exists() and keep.exists()
    assert "removed 2 partial checkpoint file(s)" in notes[0] and ".tmpAb3XyZ" in notes[0]


def test_resume_with_other_data_notes_it(trained, tmp_path):
    src, _ = trained
    b = _copy(src, tmp_path / "b")
    other = ["--data", "examples/llama_tiny.py", "--data-format", "bytes"]
    r = run_cli("h2x", "run", str(b), "--steps", str(STEPS), "--resume", *other)
    assert r.returncode == 0, r.stderr + r.stdout
    assert f"[w0] note: resuming {step(4)} with other data than it was written with" in r.stdout
    assert "corpus" in r.stdout.split("with other data")[1] and "llama_tiny.py" in r.stdout


# ---- the property: a changed byte is refused or harmless ---------------------------------------

def _files(b: Path) -> dict[str, list[str]]:
    """The files a mutation may hit, by kind (relative paths): the build's own files (train.toml,
    the user's to edit, aside), the checkpoints' and the token cache's."""
    build = sorted(json.loads((b / "digests.json").read_text())["files"]) + ["digests.json"]
    ckpt = sorted(str(p.relative_to(b)) for p in (b / "ckpt").rglob("*")
                  if p.is_file() and "step_" in str(p))
    cache = sorted(str(p.relative_to(b)) for p in (b / "data").iterdir() if p.is_file())
    return {"build": build, "checkpoint": ckpt, "token cache": cache}


MUTATION = st.tuples(st.sampled_from(["flip", "set", "truncate", "append"]),
                     st.floats(0.0, 1.0, exclude_max=True), st.integers(0, 255))


def _mutate(p: Path, how: str, at: float, byte: int) -> None:
    data = bytearray(p.read_bytes())
    i = int(at * len(data)) if data else 0
    if how == "truncate":
        del data[i:]
    elif how == "append":
        data += bytes([byte]) * (1 + byte % 7)
    elif data:
        data[i] = data[i] ^ (byte or 1) if how == "flip" else byte
    p.write_bytes(bytes(data))


def _check_mutation(trained, data_flags, draw, tmp_root: Path):
    src, full = trained
    b = tmp_root / "b"
    if b.exists():
        shutil.rmtree(b)
    _copy(src, b)
    files = _files(b)
    kind = draw(st.sampled_from(sorted(files)))
    rel = draw(st.sampled_from(files[kind]))
    how, at, byte = draw(MUTATION)
    _mutate(b / rel, how, at, byte)
    log = tmp_root / "r.jsonl"
    log.unlink(missing_ok=True)
    r = run_cli("h2x", "run", str(b), "--steps", str(STEPS), "--resume", *data_flags,
                "--json-log", str(log))
    what = f"{how} at {at:.3f} ({byte}) of {rel}"
    event(f"{kind}: {'trained as before' if r.returncode == 0 else 'refused'}")
    assert "Traceback" not in r.stderr and "internal error" not in r.stderr, (what, r.stderr)
    if r.returncode == 0:                  # accepted: then it trained exactly as before
        got = _losses(log)
        assert got, (what, r.stdout)
        for s, v in got.items():
            assert abs(v - full[s]) <= 1e-6 * abs(full[s]), (what, s, got, full)
    else:
        assert r.returncode == 2 and "error:" in r.stderr, (what, r.returncode, r.stderr)


@settings(max_examples=15, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(draw=st.data())
def test_mutated_build_checkpoint_or_cache_is_refused_or_harmless(trained, data_flags, draw,
                                                                  tmp_path_factory):
    _check_mutation(trained, data_flags, draw.draw, tmp_path_factory.mktemp("mut"))


@pytest.mark.slow
@settings(max_examples=120, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(draw=st.data())
def test_mutated_files_many_more(trained, data_flags, draw, tmp_path_factory):
    _check_mutation(trained, data_flags, draw.draw, tmp_path_factory.mktemp("mut"))
