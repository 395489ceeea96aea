"""h2x run across emulated hosts (examples/testbed: one network namespace per host, torchrun's
agent on each): losses equal the single-host run's, links inside a host are shm and between
hosts tcp, listeners stay on the host's own address, a lost host stops the run naming it, and
with --max-restarts the job resumes from its newest complete checkpoint."""
import json
import os
import re
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, run_cli
from examples.testbed.netns import Testbed, available

OK, WHY = available()
needs_netns = pytest.mark.skipif(not OK, reason=f"no network namespaces here: {WHY}")

CLUSTER = "examples/clusters/testbed-2host.toml"
COMMON = ["--seq-len", "32", "--arg", "n_layers=2", "--arg", "max_seq=64", "--cluster", CLUSTER]
STEPS = 20

PLAN_DP = f"""model    "examples/llama_tiny.py"
cluster  "{CLUSTER}"
batch    global=4 micro=1 seq=32
schedule 1f1b
dp       2
stage chip=cpu-torch chips=2 tp=1 layers=embed, 0
stage chip=cpu-torch chips=2 tp=1 layers=1, head
"""

PLAN_TP = f"""model    "examples/llama_tiny.py"
cluster  "{CLUSTER}"
batch    global=4 micro=2 seq=32
schedule 1f1b
dp       1
stage chip=cpu-torch chips=2 tp=2 layers=embed, 0
stage chip=cpu-torch chips=2 tp=2 layers=1, head
"""


def _compile(d: Path, name: str, plan: str, batch: list[str]) -> Path:
    p = d / f"{name}.h2plan"
    p.write_text(plan)
    out = d / name
    r = run_cli("h2c", "compile", "examples/llama_tiny.py", *COMMON, *batch, "--plan", str(p),
                "-o", str(out))
    assert r.returncode == 0, r.stderr
    return out


class _Builds(dict):
    """builds["dp" | "tp"], compiled when a test first asks for it (tp: the slow tests only)."""
    def __init__(self, d: Path):
        super().__init__()
        self.d = d

    def __missing__(self, kind):
        plan, micro = {"dp": (PLAN_DP, "1"), "tp": (PLAN_TP, "2")}[kind]
        self[kind] = _compile(self.d, kind, plan, ["--global-batch", "4", "--micro-batch", micro])
        return self[kind]


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    return _Builds(tmp_path_factory.mktemp("mh"))


def _losses(log: Path) -> dict[int, float]:
    """step -> loss; a resumed run appends to the log, the last line of a step wins."""
    out = {}
    for line in log.read_text().splitlines():
        rec = json.loads(line)
        out[rec["step"]] = rec["loss"]
    return out


def _single_host(build: Path, log: Path, steps: int = STEPS) -> dict[int, float]:
    r = run_cli("h2x", "run", str(build), "--steps", str(steps), "--json-log", str(log))
    assert r.returncode == 0, r.stderr
    return _losses(log)


def _start(tb, i: int, build: Path, port: int, env: dict, *extra) -> subprocess.Popen:
    return tb.run(i, [sys.executable, "-m", "executor.cli", "run", str(build), "--nnodes",
                      str(tb.n), "--node-rank", str(i), "--master", f"{tb.addr(0)}:{port}",
                      *extra], env=env, cwd=str(ROOT), stdout=subprocess.PIPE,
                  stderr=subprocess.STDOUT, text=True)


def _env() -> dict:
    return dict(os.environ, H2_SECRET=secrets.token_hex(32))


def _listeners(tb, i: int) -> set[str]:
    r = tb.exec(i, ["ss", "-ltnH"], timeout=10)
    return {line.split()[3] for line in r.stdout.splitlines() if line.strip()}


def _run_two_hosts(build: Path, log: Path, *extra) -> tuple[str, str, list[set]]:
    """Both hosts' output and every TCP listener seen in each namespace while it ran."""
    with Testbed(2) as tb:
        env = _env()
        ps = [_start(tb, i, build, 29400, env, "--steps", str(STEPS), *extra,
                     *(["--json-log", str(log)] if i == 0 else [])) for i in range(2)]
        seen = [set(), set()]
        addrs = [tb.addr(0), tb.addr(1)]
        deadline = time.monotonic() + 240
        while any(p.poll() is None for p in ps) and time.monotonic() < deadline:
            if any(p.poll() not in (None, 0) for p in ps):     # a failed host: the rest follow
                deadline = min(deadline, time.monotonic() + 20)
            for i in range(2):
                seen[i] |= _listeners(tb, i)
            time.sleep(0.3)
        for p in ps:
            if p.poll() is None:
                p.kill()
        outs = [p.communicate(timeout=30)[0] for p in ps]
        for i, p in enumerate(ps):
            assert p.returncode == 0, "\n".join(f"host {j} (exit {q.returncode}):\n{outs[j]}"
                                                 for j, q in enumerate(ps))
    seen = [{s for s in listen} for listen in seen]
    for i, listen in enumerate(seen):
        bad = [s for s in listen if not (s.startswith(addrs[i] + ":") or s.startswith("127.")
                                         or s.startswith("[::1]"))]
        assert not bad, f"host {i} listened on {bad} (allowed: {addrs[i]} or loopback)"
    return outs[0], outs[1], seen


def _assert_equal(multi: dict, single: dict):
    assert sorted(multi) == sorted(single) == list(range(1, STEPS + 1))
    for s in single:
        assert abs(multi[s] - single[s]) <= 1e-6 * abs(single[s]), (s, multi[s], single[s])


def _assert_links(out: str):
    m = re.search(r"links within hosts: (.*); between hosts: (.*)", out)
    assert m, out
    within, between = m.group(1), m.group(2)
    assert re.fullmatch(r"\d+ shm", within), within
    assert re.fullmatch(r"\d+ tcp", between), between


@needs_netns
# dp (the all-reduce between hosts) in make test; tp (the stage boundary between hosts) slow
@pytest.mark.parametrize("kind", ["dp", pytest.param("tp", marks=pytest.mark.slow)])
def test_two_hosts_equal_single_host(builds, kind, tmp_path):
    """(a) 2 stages x dp 2: a replica per host, the all-reduce between hosts; (b) 2 stages x
    tp 2: a stage's TP ranks on one host, the stage boundary between hosts."""
    b = builds[kind]
    hosts = [w["host"] for w in json.loads((b / "manifest.json").read_text())["workers"]]
    assert hosts == [0, 0, 1, 1]
    single = _single_host(b, tmp_path / "single.jsonl")
    trace = tmp_path / "trace.json"
    out0, out1, seen = _run_two_hosts(b, tmp_path / "multi.jsonl", "--trace", str(trace))
    _assert_equal(_losses(tmp_path / "multi.jsonl"), single)
    # one timeline from both hosts: every worker's forwards and backwards, on one clock
    ev = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    for w in range(4):
        names = {e["name"][0] for e in ev if e["pid"] == w and e.get("cat") == "compute"}
        assert {"F", "B"} <= names, (w, names)
    starts = [e["ts"] for e in ev]
    assert 0 <= min(starts) and max(starts) < 600e6, (min(starts), max(starts))
    _assert_links(out0)
    assert all(seen), "no listener seen during the run"
    assert "Traceback" not in out0 + out1


def test_multihost_without_secret_refuses(builds):
    env = {k: v for k, v in os.environ.items() if k != "H2_SECRET"}
    r = subprocess.run([sys.executable, "-m", "executor.cli", "run", str(builds["dp"]),
                        "--nnodes", "2", "--node-rank", "0", "--master", "127.0.0.1:29399"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert "needs a run secret" in r.stderr and "--secret-file" in r.stderr
    assert "secrets.token_hex(32)" in r.stderr and "Traceback" not in r.stderr


def _wait_for(p_out_lines: list, pattern: str, p, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        if not line:
            break
        p_out_lines.append(line)
        if re.search(pattern, line):
            return True
    return False


@needs_netns
@pytest.mark.slow           # 16 s; the default suite keeps the two runs above
def test_killed_host_stops_run_naming_it(builds, tmp_path):
    b = builds["dp"]
    with Testbed(2) as tb:
        env = _env()
        ps = [_start(tb, i, b, 29410, env, "--steps", "100000") for i in range(2)]
        lines: list[str] = []
        assert _wait_for(lines, r"step\s+3/", ps[0], 120), "".join(lines)
        tb.kill_host(1)
        t0 = time.monotonic()
        out = ps[0].communicate(timeout=60)[0]
        stopped = time.monotonic() - t0
        text = "".join(lines) + out
    assert ps[0].returncode == 2, text
    assert stopped < 30, f"stopped after {stopped:.1f} s"
    assert re.search(r"error: host 1 \(h2tb-[0-9a-f]+-h1, [0-9.]+\) lost", text), text
    assert "Traceback" not in text
    print(f"stopped {stopped:.1f} s after host 1 was killed")


@needs_netns
@pytest.mark.slow
def test_killed_host_restarts_and_resumes(builds, tmp_path):
    """--max-restarts 1: host 1 is killed (its agent too) and started again with the same
    command; host 0's agent restarts its workers, the new round resumes from the newest
    complete checkpoint, and the losses equal an uninterrupted run's."""
    b = builds["dp"]
    single = _single_host(b, tmp_path / "single.jsonl")
    log = tmp_path / "multi.jsonl"
    ckpt = tmp_path / "ckpt"
    flags = ["--steps", str(STEPS), "--checkpoint-every", "2", "--checkpoint-dir", str(ckpt),
             "--max-restarts", "1"]
    with Testbed(2) as tb:
        env = _env()
        p0 = _start(tb, 0, b, 29420, env, *flags, "--json-log", str(log))
        p1 = _start(tb, 1, b, 29420, env, *flags)
        lines: list[str] = []
        assert _wait_for(lines, r"step\s+7/", p0, 120), "".join(lines)
        tb.kill_host(1)
        p1 = _start(tb, 1, b, 29420, env, *flags)          # the host comes back
        out = p0.communicate(timeout=240)[0]
        out1 = p1.communicate(timeout=60)[0]
        text = "".join(lines) + out
    assert p0.returncode == 0, text + "\n--- host 1:\n" + out1
    assert re.search(r"host 1 \(.*\) lost", text), text
    assert "resuming from" in text and "restart 1" in text, text
    _assert_equal(_losses(log), single)
