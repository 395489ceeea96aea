"""The planner across emulated hosts: predicted against measured step time, and where
`--plan auto` puts its heavy traffic, on 2 hosts x 2 workers, or x 1 with --per-host 1
(examples/testbed, tc tbf).

For each NIC rate (--rates, Mbit/s; default 1000 and 100) a cluster file is written for the run:
examples/clusters/testbed-2host.toml (2 hosts x 2 CPU workers on the torch backend) with
nic_gbps = the test bed's rate. llama_tiny (d=256, 8 layers), global batch 16 x 128, 1F1B, fp32,
one thread per worker, is compiled with

- `--plan uniform` (the anchor of the throughput ratio) and `--plan auto` (HeteroAuto);
- two fixed plans that put one kind of traffic across hosts each: `dp2` (2 stages x dp 2: a
  replica per host, so both stages' gradient all-reduces cross) and `pp4` (4 stages, dp 1: one
  stage boundary crosses);

and run with `h2x run --nnodes 2` (one torchrun agent per emulated host). Per run it prints the
predicted step time (`predicted_step_time(build)`, what `h2x run` prints), the measured median of
steps 2..N and the error, and where the plan's DP all-reduce and stage boundaries run (inside or
across hosts, `LinePlacement`); per rate the measured tokens/s ratio auto / uniform. The
calibration (backend speed, llama_tiny's layer times) is measured in this run, into its own file.

Both emulated hosts share this machine's cores (2 here, so 4 workers share 2 cores: each
worker's compute is slower than alone; the layer times are measured with every core busy).
Skips (exit 0, saying why) where network namespaces are unavailable.

    .venv/bin/python bench/bench_multihost_plan.py [--steps 6] [--rates 1000,100] [--plans ...]
        [--per-host 1|2]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
os.environ.setdefault("OMP_NUM_THREADS", "1")

from bench_multihost import MODEL, cluster_file, load, run_two_hosts  # noqa: E402

GLOBAL, SEQ = 16, 128
# name -> (dp, stages' layers); each stage gets dp chips (tp 1). With 2 workers per host: dp2 puts
# a replica per host (both all-reduces cross), pp4 one stage boundary across. With 1 worker per
# host: dp2 is one stage x dp 2 (its all-reduce crosses), pp2 two stages (the boundary crosses).
FIXED = {
    "dp2": (2, [("embed", "0..3"), ("4..7", "head")]),
    "pp4": (1, [("embed", "0..1"), ("2..3",), ("4..5",), ("6..7", "head")]),
}
FIXED_1 = {
    "dp2": (2, [("embed", "0..7", "head")]),
    "pp2": (1, [("embed", "0..3"), ("4..7", "head")]),
}


def fixed_plan(d: Path, name: str, cluster: Path, per_host: int = 2) -> Path:
    dp, stages = (FIXED if per_host == 2 else FIXED_1)[name]
    text = (f'model    "{MODEL}"\ncluster  "{cluster}"\nbatch    global={GLOBAL} micro=1 seq={SEQ}\n'
            f"schedule 1f1b\ndp       {dp}\n" + "".join(
                f"stage chip=cpu-torch chips={dp} tp=1 layers={', '.join(s)}\n" for s in stages))
    p = d / f"{name}-{cluster.stem}.h2plan"
    p.write_text(text)
    return p


def where(build: str) -> str:
    """Where the build's DP all-reduces and stage boundaries run, by the resource model's
    placement (the manifest's hosts: h2ir.schedule.streams.worker_hosts)."""
    from executor.build import BuildDir
    from h2ir.clusters.clusterfile import load_cluster
    from h2ir.plans.dsl import load_plan
    from h2ir.planner.resource import LinePlacement
    b = BuildDir(build)
    plan = load_plan(str(b.path / "plan.h2plan"))
    cluster = load_cluster(str(b.path / "cluster.toml"))
    pl = LinePlacement(cluster, tuple((s.chip, s.tp) for s in plan.stages), plan.dp)
    assert list(pl.hosts) == [w["host"] for w in b.workers], "placement differs from the manifest"
    c = pl.crossing
    ar = ("none (dp 1)" if plan.dp == 1 else
          f"across hosts (stage {', '.join(map(str, c['allreduce']))})" if c["allreduce"]
          else "inside hosts")
    S = plan.num_stages
    bd = ("none (1 stage)" if S == 1 else
          ", ".join(f"{j}->{j + 1} " + ("across" if j in c["boundaries"] else "inside")
                    for j in range(S - 1)))
    stages = " | ".join(f"{len(s.layers)}" for s in plan.stages)
    return (f"dp {plan.dp} x {S} stage(s) [{stages} layers], micro-batch {plan.micro_batch} x "
            f"{plan.num_microbatches}; DP all-reduce {ar}; boundaries {bd}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rates", default="1000,100")
    ap.add_argument("--plans", default=None,
                    help="default: uniform,auto,dp2,pp4 (2 per host), uniform,auto,dp2,pp2 (1)")
    ap.add_argument("--per-host", type=int, default=2, choices=(1, 2),
                    help="workers per emulated host (1: each worker has a core of its own here)")
    a = ap.parse_args()
    a.plans = a.plans or ("uniform,auto,dp2,pp4" if a.per_host == 2 else "uniform,auto,dp2,pp2")
    from examples.testbed.netns import available
    ok, why = available()
    if not ok:
        print(f"skipped: no network namespaces here ({why}); the emulated hosts need them")
        return
    from executor.build import BuildDir
    from executor.launcher import predicted_step_time
    from frontend.compiler import compile_model
    t0 = time.perf_counter()
    d = Path(tempfile.mkdtemp(prefix="h2-bench-mhp-"))
    os.environ["H2_CALIBRATION"] = str(d / "calibration.json")
    print(f"llama_tiny, global batch {GLOBAL} x {SEQ}, 1F1B, fp32, 1 thread/worker; 2 emulated hosts "
          f"x {a.per_host} worker(s) on this machine's {os.cpu_count()} cores; {a.steps} steps per run (median of "
          f"steps 2..); calibration measured in this run; load average {load()} at start")
    errors = []
    for rate in [float(r) for r in a.rates.split(",")]:
        cl = cluster_file(d, rate, chips_per_node=a.per_host)
        print(f"{rate:g} Mbit/s between hosts (tbf), cluster nic_gbps = {rate / 1000:g}:")
        tput = {}
        for name in a.plans.split(","):
            plan_arg = name if name in ("uniform", "auto") else str(fixed_plan(d, name, cl, a.per_host))
            build = str(d / f"{name}-{rate:g}")
            compile_model(MODEL, cluster_arg=str(cl), plan_arg=plan_arg, global_batch=GLOBAL,
                          seq_len=SEQ, out_dir=build, log=lambda *x: None)
            pred = predicted_step_time(BuildDir(build)).step_time_s
            r = run_two_hosts(build, rate, a.steps)
            meas = statistics.median(r["times"][1:])
            err = (pred - meas) / meas
            errors.append(err)
            tput[name] = GLOBAL * SEQ / meas
            printed = r["printed_predicted"]
            print(f"  {name:8s} {where(build)}")
            print(f"  {'':8s} predicted {pred:.3f} s (h2x run printed {printed:.3f} s), measured "
                  f"{meas:.3f} s/step, error {err:+.1%}; {tput[name]:.0f} tokens/s; steps "
                  f"{[round(x, 2) for x in r['times']]}; load {load()}")
        if "auto" in tput and "uniform" in tput:
            print(f"  ratio auto / uniform tokens/s: {tput['auto'] / tput['uniform']:.2f}")
    if errors:
        worst = max(errors, key=abs)
        print(f"worst prediction error {worst:+.1%} (target within 15%: "
              f"{'met' if abs(worst) <= 0.15 else 'not met'}); load average {load()} at end; "
              f"{time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
