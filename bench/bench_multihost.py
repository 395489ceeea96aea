"""h2x across two emulated hosts (examples/testbed: one network namespace per host, the link
between them rate-limited by tc tbf), against the same workers on one host and against
torch.distributed.pipelining over gloo on the same test bed, measured in the same run.

Setup: llama_tiny (d=256, 8 layers), 2 stages of 4 layers (examples/plans/llama_tiny_2stage.h2plan),
8 micro-batches of 2 x 128 tokens, 1F1B, AdamW, fp32, one thread per worker, on a cluster of two
hosts with one chip each (so stage 0 runs on host 0 and stage 1 on host 1; the stage boundary
crosses the emulated network), NIC rate --rate-mbit (default 1000).

- anchor 1: the same build run by `h2x run` on one host (shm between the two workers);
- anchor 2: Schedule1F1B over gloo (bench/bench_pipeline.py's workers), rank i in host i,
  `init_process_group` over the test bed addresses; same model, split, batch, data, weights;
- h2x: `h2x run --nnodes 2`, one torchrun agent per emulated host (tcp between hosts).

The three alternate for --rounds rounds; medians over all steady-state steps (2..N) of each.
Both emulated hosts share this machine's cores: the figure is the cost of crossing the emulated
network (tbf, veth, the TCP stack, DiComm's framing), not of two machines' compute.
Skips (exit 0, saying why) where network namespaces are unavailable.

    .venv/bin/python bench/bench_multihost.py [--steps 8] [--rounds 2] [--rate-mbit 1000]

bench/bench_multihost_plan.py has the planner's predictions and --plan auto vs uniform on
2 hosts x 2 workers.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_NUM_THREADS", "1")

PLAN = ROOT / "examples/plans/llama_tiny_2stage.h2plan"
MODEL = str(ROOT / "examples/llama_tiny.py")
BASE_CLUSTER = ROOT / "examples/clusters/testbed-2host.toml"
TOKENS = 8 * 2 * 128


def cluster_file(d: Path, rate_mbit: float, chips_per_node: int = 2) -> Path:
    """examples/clusters/testbed-2host.toml with nic_gbps = the test bed's rate (and another
    chips_per_node), written for this run."""
    text = BASE_CLUSTER.read_text()
    name = f"testbed-2host-{rate_mbit:g}m" + (f"-{chips_per_node}c" if chips_per_node != 2 else "")
    text = re.sub(r'^name\s*=.*$', f'name  = "{name}"', text, flags=re.M)
    text = re.sub(r'^nic_gbps\s*=\s*[0-9.]+', f"nic_gbps       = {rate_mbit / 1000:g}", text, flags=re.M)
    text = re.sub(r'^chips_per_node\s*=\s*\d+', f"chips_per_node = {chips_per_node}", text, flags=re.M)
    p = d / f"{name}.toml"
    p.write_text(text)
    return p


def load() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def _losses_and_times(log: Path) -> tuple[list, list]:
    recs = [json.loads(line) for line in log.read_text().splitlines()]
    return [r["loss"] for r in recs], [r["step_s"] for r in recs]


def run_two_hosts(build: str, rate_mbit: float, steps: int, port: int = 29450) -> dict:
    """`h2x run --nnodes 2` with one agent per emulated host; step times from --json-log, and
    the step-time line host 0 prints (predicted vs measured)."""
    from examples.testbed.netns import Testbed
    log = Path(tempfile.mkdtemp(prefix="h2-mh-log-")) / "log.jsonl"
    env = dict(os.environ, H2_SECRET=secrets.token_hex(32))
    with Testbed(2, rate_mbit=rate_mbit) as tb:
        ps = [tb.run(i, [sys.executable, "-m", "executor.cli", "run", build, "--nnodes", "2",
                         "--node-rank", str(i), "--master", f"{tb.addr(0)}:{port}",
                         "--steps", str(steps), *(["--json-log", str(log)] if i == 0 else [])],
                     env=env, cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                     text=True) for i in range(2)]
        outs = [p.communicate(timeout=1200)[0] for p in ps]
    for i, p in enumerate(ps):
        if p.returncode != 0:
            raise SystemExit(f"h2x on host {i} failed:\n{outs[i][-3000:]}")
    losses, times = _losses_and_times(log)
    m = re.search(r"step time: predicted ([0-9.]+) s", outs[0])
    links = re.search(r"links within hosts: .*", outs[0])
    return {"losses": losses, "times": times, "printed_predicted": float(m.group(1)) if m else None,
            "links": links.group(0) if links else "", "out": outs[0]}


def run_one_host(build: str, steps: int) -> dict:
    from executor.launcher import run
    res = run(build, steps=steps, out=lambda *a: None, predict=False)
    return {"losses": res.losses, "times": res.step_s}


def run_pipelining_two_hosts(rate_mbit: float, steps: int, port: int = 29460) -> dict:
    """bench_pipeline's Schedule1F1B workers, rank i on emulated host i, gloo over the test bed."""
    from examples.testbed.netns import Testbed
    out = tempfile.mktemp(suffix=".json")
    with Testbed(2, rate_mbit=rate_mbit) as tb:
        ps = [tb.run(r, [sys.executable, str(Path(__file__).resolve()), "--pp-worker", str(r),
                         "--master", f"{tb.addr(0)}:{port}", "--steps", str(steps), "--out", out],
                     cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
              for r in range(2)]
        outs = [p.communicate(timeout=1200)[0] for p in ps]
    for r, p in enumerate(ps):
        if p.returncode != 0:
            raise SystemExit(f"torch.distributed.pipelining rank {r} failed:\n{outs[r][-3000:]}")
    return json.loads(Path(out).read_text())


def pp_worker(rank: int, master: str, steps: int, out: str) -> None:
    """One bench_pipeline worker, its gloo group initialised over the test bed's addresses."""
    import torch.distributed as dist

    import bench_pipeline
    init_process_group = dist.init_process_group
    os.environ["GLOO_SOCKET_IFNAME"] = "eth0"      # the emulated host's link to the others

    def over_testbed(backend, init_method=None, **kw):
        return init_process_group(backend, init_method=f"tcp://{master}", **kw)
    dist.init_process_group = over_testbed
    bench_pipeline.pipelining_worker(rank, 0, steps, out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--rate-mbit", type=float, default=1000)
    ap.add_argument("--pp-worker", type=int, default=None)
    ap.add_argument("--master")
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.pp_worker is not None:
        sys.path.insert(0, str(ROOT / "bench"))
        pp_worker(a.pp_worker, a.master, a.steps, a.out)
        return
    from examples.testbed.netns import available
    ok, why = available()
    if not ok:
        print(f"skipped: no network namespaces here ({why}); the emulated hosts need them")
        return
    from frontend.compiler import compile_model
    t0 = time.perf_counter()
    d = Path(tempfile.mkdtemp(prefix="h2-bench-mh-"))
    os.environ["H2_CALIBRATION"] = str(d / "calibration.json")   # this run's own measurements
    cl = cluster_file(d, a.rate_mbit, chips_per_node=1)
    build = str(d / "B")
    compile_model(MODEL, cluster_arg=str(cl), plan_arg=str(PLAN), global_batch=16, micro_batch=2,
                  out_dir=build, log=lambda *x: None)
    hosts = [w["host"] for w in json.loads((Path(build) / "manifest.json").read_text())["workers"]]
    print(f"llama_tiny, 2 stages x 4 layers, 8 micro-batches of 2x128, 1F1B, 1 thread/worker; "
          f"2 emulated hosts (network namespaces) at {a.rate_mbit:g} Mbit/s (tc tbf), stage i on "
          f"host {hosts}; this machine's {os.cpu_count()} cores shared by both hosts; "
          f"{a.rounds} rounds x {a.steps - 1} steady steps; load average {load()} at start")
    one, two, pp = [], [], []
    last = {}
    rounds = {"one": [], "two": [], "pp": []}
    for _ in range(a.rounds):
        r1 = run_one_host(build, a.steps)
        r2 = run_two_hosts(build, a.rate_mbit, a.steps)
        r3 = run_pipelining_two_hosts(a.rate_mbit, a.steps)
        one += r1["times"][1:]
        two += r2["times"][1:]
        pp += r3["times"][1:]
        last = {"one": r1, "two": r2, "pp": r3}
        for k, r in last.items():
            rounds[k].append(round(statistics.median(r["times"][1:]), 3))
    t1, t2, t3 = (statistics.median(x) for x in (one, two, pp))
    print(f"  h2x on 1 host (anchor 1, shm):              {t1:.3f} s/step  {TOKENS / t1:7.0f} tokens/s")
    print(f"  pipelining over gloo, 2 hosts (anchor 2):   {t3:.3f} s/step  {TOKENS / t3:7.0f} tokens/s")
    print(f"  h2x on 2 hosts (tcp between hosts):         {t2:.3f} s/step  {TOKENS / t2:7.0f} tokens/s"
          f"   [{last['two']['links']}]")
    print(f"  ratio h2x 2 hosts / h2x 1 host tokens/s:    {t1 / t2:.2f}")
    print(f"  ratio h2x 2 hosts / pipelining 2 hosts:     {t3 / t2:.2f}")
    print(f"  per round, median s/step: 1 host {rounds['one']}; 2 hosts {rounds['two']}; "
          f"pipelining {rounds['pp']}")
    n = min(len(last["pp"]["losses"]), len(last["two"]["losses"]))
    diff = max(abs(x - y) / abs(y) for x, y in zip(last["pp"]["losses"][:n], last["two"]["losses"][:n]))
    print(f"  max relative loss difference h2x 2 hosts vs pipelining over {n} steps: {diff:.1e}")
    print(f"  load average {load()} at end; {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
