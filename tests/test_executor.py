"""h2x: real multi-process training equals eager PyTorch; failures stop cleanly; resume is exact."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, TINY_2STAGE_PLAN, child_pids, pid_alive, run_cli

STEPS = 20
COMMON = ["--global-batch", "4", "--micro-batch", "2", "--seq-len", "32", "--arg", "n_layers=2",
          "--arg", "max_seq=64"]

PLAN_TT = TINY_2STAGE_PLAN


PLAN_DP = """model    "examples/llama_tiny.py"
cluster  "local"
batch    global=4 micro=1 seq=32
schedule gpipe
dp       2
stage chip=cpu-torch chips=2 tp=1 layers=embed, 0..1, head
"""

PLAN_NUMPY = """model    "examples/llama_tiny.py"
cluster  "local-mixed"
batch    global=4 micro=2 seq=32
schedule 1f1b
dp       1
stage chip=cpu-numpy chips=1 tp=1 layers=embed, 0..1, head
"""


def _compile(out: Path, *extra):
    r = run_cli("h2c", "compile", "examples/llama_tiny.py", *COMMON, *extra, "-o", str(out))
    assert r.returncode == 0, r.stderr
    return out


class _Builds(dict):
    """builds[kind], compiled when a test first asks for it (some kinds only slow tests use)."""
    def __init__(self, d: Path):
        super().__init__()
        self.d = d

    def _plan(self, name: str, text: str) -> str:
        (self.d / f"{name}.h2plan").write_text(text)
        return str(self.d / f"{name}.h2plan")

    def __missing__(self, kind):
        d = self.d
        self[kind] = {
            "torch+torch": lambda: _compile(d / "tt", "--plan", self._plan("tt", PLAN_TT)),
            "torch+numpy": lambda: _compile(d / "tn", "--cluster", "local-mixed", "--plan",
                                            "uniform"),
            "numpy": lambda: _compile(d / "np", "--plan", self._plan("np", PLAN_NUMPY)),
            # 2 data-parallel replicas
            "torch|torch": lambda: _compile(d / "dp", "--plan", self._plan("dp", PLAN_DP)),
        }[kind]()
        return self[kind]


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    return _Builds(tmp_path_factory.mktemp("x"))


def _losses(log: Path) -> list[float]:
    return [json.loads(l)["loss"] for l in log.read_text().splitlines()]


# torch+numpy (both backends in one pipeline) by default; the rest in make test-slow (a dp 2
# run against a reference also runs by default in test_multihost's dp case)
@pytest.mark.parametrize("kind", [pytest.param("torch+torch", marks=pytest.mark.slow), "torch+numpy",
                                  pytest.param("numpy", marks=pytest.mark.slow),
                                  pytest.param("torch|torch", marks=pytest.mark.slow)])
def test_losses_equal_eager_pytorch(builds, kind, tmp_path):
    """'+' separates pipeline stages, '|' data-parallel replicas of one stage."""
    from executor.reference import eager_losses
    b = builds[kind]
    m = json.loads((b / "manifest.json").read_text())
    assert [s["backend"] for s in m["stages"]] == kind.split("|")[0].split("+")
    assert m["dp"] == len(kind.split("|"))
    log = tmp_path / "log.jsonl"
    transport = "tcp" if kind == "torch|torch" else "shm"    # both DiComm transports carry a run
    r = run_cli("h2x", "run", str(b), "--steps", str(STEPS), "--json-log", str(log),
                "--transport", transport)
    assert r.returncode == 0, r.stderr + r.stdout
    got = _losses(log)
    ref = eager_losses(str(b), STEPS)
    assert len(got) == STEPS
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, ref))
    assert worst <= 1e-4, (worst, got, ref)
    assert got[-1] < got[0]          # it learns
    first = json.loads(log.read_text().splitlines()[0])
    assert {"step", "loss", "tokens_per_s", "step_s"} <= set(first)


def _launch(build, *args):
    exe = Path(sys.executable).parent / "h2x"
    return subprocess.Popen([str(exe), "run", str(build), *args], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _wait_for_step(proc, n):
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("step") and int(line.split()[1].split("/")[0]) >= n:
            return lines
    raise AssertionError("run ended early:\n" + "".join(lines) + proc.stderr.read())


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP])
def test_dead_or_hung_worker_stops_the_run(builds, how):
    b = builds["torch+torch"]
    proc = _launch(b, "--steps", "400")
    try:
        _wait_for_step(proc, 2)
        workers = child_pids(proc.pid)
        assert len(workers) == 2
        victim = max(workers)            # started second: worker w1
        t0 = time.monotonic()
        os.kill(victim, how)
        rc = proc.wait(timeout=30)
        elapsed = time.monotonic() - t0
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc != 0
    assert elapsed < 10, elapsed
    assert "worker w1" in err and "last instruction" in err and "Traceback" not in err
    time.sleep(0.5)
    if how == signal.SIGSTOP:
        os.kill(victim, signal.SIGCONT) if pid_alive(victim) else None
    assert not any(pid_alive(p) for p in workers), "orphan worker processes left behind"


def test_resume_reproduces_uninterrupted_run(builds, tmp_path):
    import shutil
    b = tmp_path / "b"
    shutil.copytree(builds["torch+numpy"], b)
    full = tmp_path / "full.jsonl"
    r = run_cli("h2x", "run", str(b), "--steps", "10", "--json-log", str(full))
    assert r.returncode == 0, r.stderr
    shutil.rmtree(b / "ckpt", ignore_errors=True)
    # interrupted run: checkpoints every 3 steps, killed after step 7
    proc = _launch(b, "--steps", "400", "--checkpoint-every", "3")
    try:
        _wait_for_step(proc, 7)
        # step 6's files are written in the background during step 7: its COMPLETE may come
        # after the step-7 line
        done = b / "ckpt" / "step_00000006" / "COMPLETE"
        deadline = time.monotonic() + 60
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        for p in child_pids(proc.pid):
            os.kill(p, signal.SIGKILL)
            break
        assert proc.wait(timeout=30) != 0
    finally:
        if proc.poll() is None:
            proc.kill()
    resumed = tmp_path / "resumed.jsonl"
    r = run_cli("h2x", "run", str(b), "--steps", "10", "--resume", "--json-log", str(resumed))
    assert r.returncode == 0, r.stderr
    assert "resuming from" in r.stdout and "step_00000006" in r.stdout
    got = [json.loads(l) for l in resumed.read_text().splitlines()]
    want = {json.loads(l)["step"]: json.loads(l)["loss"] for l in full.read_text().splitlines()}
    assert [g["step"] for g in got] == [7, 8, 9, 10]
    for g in got:
        assert abs(g["loss"] - want[g["step"]]) <= 1e-6 * abs(want[g["step"]]), (g, want)


def test_a_worker_killed_while_its_checkpoint_is_written_loses_nothing(builds, tmp_path):
    """Checkpoints every step are written in the background while the next steps run: kill a
    worker then, and every COMPLETE checkpoint still verifies and --resume takes the newest."""
    import shutil

    from executor.checkpoint import build_fingerprint, complete_steps, verify
    b = tmp_path / "b"
    shutil.copytree(builds["torch+torch"], b)
    shutil.rmtree(b / "ckpt", ignore_errors=True)
    proc = _launch(b, "--steps", "400", "--checkpoint-every", "1")
    try:
        _wait_for_step(proc, 4)
        time.sleep(0.1)                  # inside step 5: step 4's files are being written
        os.kill(max(child_pids(proc.pid)), signal.SIGKILL)
        assert proc.wait(timeout=30) != 0
    finally:
        if proc.poll() is None:
            proc.kill()
    done = complete_steps(b / "ckpt")
    assert done, "no complete checkpoint"
    fp = build_fingerprint(b)
    for s in done:
        verify(b / "ckpt" / f"step_{s:08d}", fp, 2)
    r = run_cli("h2x", "run", str(b), "--steps", str(max(done) + 1), "--resume")
    assert r.returncode == 0 and f"(step {max(done)})" in r.stdout, r.stderr


def test_checkpoint_safetensors_writer_round_trips(tmp_path):
    """The checkpoint writer's safetensors files: safetensors reads back every array, for any
    dtype mix (bf16 as its uint16 bits), and the digest it returns is the file's own."""
    import numpy as np
    from safetensors import safe_open
    from safetensors.numpy import load_file

    from executor.checkpoint import _durable_write, file_digest, write_safetensors
    t = {"b.w": np.random.rand(3, 5).astype(np.float32), "a": np.arange(7, dtype=np.int64),
         "c": np.ones(1, np.float16), "empty": np.zeros((0,), np.float32),
         "bits": np.arange(5, dtype=np.uint16), "flag": np.array([True, False, True]),
         "scalar": np.array(2.5, np.float64), "t": np.arange(12, dtype=np.float32).reshape(3, 4).T}
    got = _durable_write(tmp_path / "x.safetensors", lambda p: write_safetensors(p, t),
                         hashed=True)
    assert got == file_digest(tmp_path / "x.safetensors")
    back = load_file(str(tmp_path / "x.safetensors"))
    assert set(back) == set(t)
    for k, v in t.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape and (back[k] == v).all(), k
    with safe_open(str(tmp_path / "x.safetensors"), "pt") as f:     # torch's reader too
        assert f.get_tensor("b.w").numpy().tolist() == t["b.w"].tolist()
    # a writer that returns nothing: the file is read back
    got = _durable_write(tmp_path / "y.bin", lambda p: p.write_bytes(b"abc"))
    assert got == file_digest(tmp_path / "y.bin")


def test_bad_build_dir_is_a_clean_error(tmp_path):
    r = run_cli("h2x", "run", str(tmp_path))
    assert r.returncode == 2 and "Traceback" not in r.stderr and "manifest.json" in r.stderr
    (tmp_path / "manifest.json").write_text("{not json")
    r = run_cli("h2x", "run", str(tmp_path))
    assert r.returncode == 2 and "manifest.json:1:2" in r.stderr


def test_measured_trace_has_the_predicted_traces_shape(builds, tmp_path):
    """h2x run --trace and h2c plan --trace: same processes (workers), lanes and event names."""
    b = builds["torch+torch"]
    measured, predicted = tmp_path / "m.json", tmp_path / "p.json"
    r = run_cli("h2x", "run", str(b), "--steps", "2", "--trace", str(measured))
    assert r.returncode == 0, r.stderr
    r = run_cli("h2c", "plan", "examples/llama_tiny.py", "--arg", "n_layers=2", "--arg", "max_seq=64",
                "--plan", str(b / "plan.h2plan"), "--trace", str(predicted), "--no-speedup")
    assert r.returncode == 0, r.stderr

    def shape(path):
        ev = json.loads(path.read_text())["traceEvents"]
        xs = [e for e in ev if e["ph"] == "X"]
        lanes = {(e["pid"], e["args"]["name"]) for e in ev if e.get("name") == "thread_name"}
        kinds = {e["name"].split()[0].rstrip("0123456789") for e in xs}
        return {e["pid"] for e in xs}, lanes, kinds

    m_pids, m_lanes, m_kinds = shape(measured)
    p_pids, p_lanes, p_kinds = shape(predicted)
    assert m_pids == p_pids == {0, 1}
    assert m_lanes == p_lanes
    assert {"F", "B", "send_act", "recv_grad", "opt_step"} <= m_kinds
    assert {"F", "B", "opt_step"} <= p_kinds
