import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Tests measure into their own calibration file, never the user's (~/.cache/h2).
# Under pytest-xdist (`make test` runs two) each test process has its own file: a calibration file
# is replaced whole, so two writers would drop each other's records.
os.environ.setdefault("H2_CALIBRATION", str(Path(os.environ.get("TMPDIR", "/tmp")) /
                                            f"h2-test-calibration-{os.getuid()}"
                                            f"{os.environ.get('PYTEST_XDIST_WORKER', '')}.json"))
# One measurement round per calibration (frontend/profile.py ROUNDS): no test judges how well the
# layer times agree with a run, and rounds would double every first compile of a test model.
# tests/test_costs.py checks the rounds themselves.
os.environ.setdefault("H2_CALIBRATION_ROUNDS", "1")
BIN = Path(sys.executable).parent


_FORK = None


def run_cli(*args, timeout=300, **kw):
    """Run an h2 console script (h2c/h2x) as a user would; returns CompletedProcess. The process
    is forked from a warm parent that has torch imported (tests/forkserver.py): its own exit
    status, output, cwd and environment, without a fresh interpreter's imports.
    H2_TEST_FRESH_PROCESSES=1, or any subprocess.run argument other than cwd/env, runs the
    installed console script in a fresh interpreter instead."""
    global _FORK
    if os.environ.get("H2_TEST_FRESH_PROCESSES") != "1" and set(kw) <= {"cwd", "env"}:
        if _FORK is None:
            import atexit

            from forkserver import ForkServer
            _FORK = ForkServer()
            atexit.register(_FORK.close)
        return _FORK.run(list(args), cwd=kw.get("cwd", ROOT), env=kw.get("env"),
                         timeout=timeout)
    exe = BIN / args[0]
    cmd = [str(exe), *args[1:]] if exe.exists() else [sys.executable, "-m",
                                                      {"h2c": "frontend.cli", "h2x": "executor.cli"}[args[0]],
                                                      *args[1:]]
    return subprocess.run(cmd, cwd=kw.pop("cwd", ROOT), capture_output=True, text=True,
                          timeout=timeout, **kw)


@pytest.fixture(scope="session")
def tiny_graph():
    from frontend.capture import capture
    return capture(str(ROOT / "examples/llama_tiny.py"), {"n_layers": 2}, 2, 32)


def child_pids(pid: int) -> list[int]:
    """Live (non-zombie) child processes of `pid`, from /proc."""
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


def pid_alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


# llama_tiny on the local cluster, two torch stages: the plan the executor and hostile suites share
TINY_2STAGE_PLAN = """model    "examples/llama_tiny.py"
cluster  "local"
batch    global=4 micro=2 seq=32
schedule 1f1b
dp       1
stage chip=cpu-torch chips=1 tp=1 layers=embed, 0
stage chip=cpu-torch chips=1 tp=1 layers=1, head
"""


def trains_like_eager(tmp_path: Path, model, plan_text: str | None, steps: int, model_args=(),
                      tol: float = 1e-5, compile_args=()) -> Path:
    """Compile `model` with the plan `plan_text` (written to tmp_path/p.h2plan; None: the plan
    `compile_args` ask for), train `steps` steps with h2x, and assert the losses equal eager
    training's (executor/reference.py: same weights, data and AdamW) within `tol`, relative.
    Returns the build directory."""
    import json

    from executor.reference import eager_losses
    args = [a for kv in model_args for a in ("--arg", kv)] + list(compile_args)
    if plan_text is not None:
        (tmp_path / "p.h2plan").write_text(plan_text)
        args += ["--plan", str(tmp_path / "p.h2plan")]
    build = tmp_path / "build"
    r = run_cli("h2c", "compile", str(model), *args, "-o", str(build))
    assert r.returncode == 0, r.stderr
    log = tmp_path / "log.jsonl"
    r = run_cli("h2x", "run", str(build), "--steps", str(steps), "--json-log", str(log))
    assert r.returncode == 0, r.stderr + r.stdout
    got = [json.loads(line)["loss"] for line in log.read_text().splitlines()]
    ref = eager_losses(str(build), steps)
    assert max(abs(a - b) / abs(b) for a, b in zip(got, ref)) <= tol, (got, ref)
    return build
