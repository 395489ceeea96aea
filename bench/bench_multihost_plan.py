"""The planner across emulated hosts, judged by the order it puts plans in: 2 hosts x 2
workers (or x 1 with --per-host 1) on examples/testbed (tc tbf), all on this machine's cores.

For each NIC rate (--rates, Mbit/s; default 1000) a cluster file is written for the run:
examples/clusters/testbed-2host.toml (2 hosts x 2 CPU workers on the torch backend, one
machine's cores: `shared_cores`) with nic_gbps = the test bed's rate. llama_tiny (d=256,
8 layers), global batch 16 x 128, 1F1B, fp32, one thread per worker, is compiled as

- `--plan auto` (HeteroAuto) and `--plan uniform` (the anchor);
- the plans the search ranks nearest the top (bench/plan_ranking.py `top_plans`), --plans in all;
- with --fixed, also the two fixed plans that put one kind of traffic across hosts each:
  `dp2` (2 stages x dp 2: a replica per host, so both stages' all-reduces cross) and `pp4`
  (4 stages, dp 1: one stage boundary crosses); with 1 worker per host `dp2` and `pp2`;

and run with `h2x run --nnodes 2` (one torchrun agent per emulated host) for --rounds rounds,
the order rotated each round. Per plan: where its DP all-reduce and stage boundaries run
(`LinePlacement`); per round each plan's measured step and prediction error; then the ranking
report (bench/plan_ranking.py: errors and their spread per round, the pairwise matrix, auto >=
uniform) and a summary table for docs/performance.md. The calibration (backend speeds,
llama_tiny's layer times under the 4 workers' co-location) is measured in this run, into its
own file; once the plans are chosen, the layer times of all their micro-batches again, their
rounds alternated, and each plan is compiled from its plan file from those. --beside N runs N CPU-heavy jobs (bench_hetero_local.py's) beside it all.
Skips (exit 0, saying why) where network namespaces are unavailable.

    .venv/bin/python bench/bench_multihost_plan.py [--steps 6] [--rounds 5] [--rates 1000]
        [--plans 4] [--fixed] [--per-host 1|2] [--beside 0] [--json FILE]
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

from bench_multihost import MODEL, cluster_file, load, run_one_host, run_two_hosts  # noqa: E402

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


def run_plan(build: str, rate: float, steps: int) -> list:
    """Step times of a build run on the hosts it uses: both emulated hosts (`h2x run --nnodes
    2`), or, for a plan that leaves one host idle, one `h2x run` on this machine (its workers
    talk inside the host, as they would on host 0)."""
    from executor.build import BuildDir
    if sum(1 for h in BuildDir(build).hosts if h) > 1:
        return run_two_hosts(build, rate, steps)["times"]
    return run_one_host(build, steps)["times"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rates", default="1000")
    ap.add_argument("--plans", type=int, default=4, help="auto, uniform and the search's next "
                    "ones, this many in all")
    ap.add_argument("--fixed", action="store_true", help="also the fixed plans dp2 and pp4 "
                    "(pp2 with --per-host 1)")
    ap.add_argument("--per-host", type=int, default=2, choices=(1, 2),
                    help="workers per emulated host (1: each worker has a core of its own here)")
    ap.add_argument("--beside", type=int, default=0, metavar="N",
                    help="N CPU-heavy jobs beside the run (single-thread fp32 matmul loops)")
    ap.add_argument("--json", default=None, help="write every figure to this file")
    a = ap.parse_args()
    from examples.testbed.netns import available
    ok, why = available()
    if not ok:
        print(f"skipped: no network namespaces here ({why}); the emulated hosts need them")
        return
    from executor.build import BuildDir
    from executor.launcher import predicted_step_time
    from frontend.compiler import compile_model
    from h2ir.clusters.clusterfile import load_cluster
    from h2ir.plans.dsl import format_plan
    from h2ir.plans.dsl import load_plan
    from plan_ranking import (describe, finish, measure_together, plan_set, report, start_hogs,
                              stop_hogs)
    t0 = time.perf_counter()
    d = Path(tempfile.mkdtemp(prefix="h2-bench-mhp-"))
    os.environ["H2_CALIBRATION"] = str(d / "calibration.json")
    hogs = start_hogs(a.beside)
    print(f"llama_tiny, global batch {GLOBAL} x {SEQ}, 1F1B, fp32, 1 thread/worker; 2 emulated hosts "
          f"x {a.per_host} worker(s) on this machine's {os.cpu_count()} cores; {a.steps} steps per run "
          f"(median of steps 2..), {a.rounds} rounds, order rotated; calibration measured in this "
          f"run; beside it: " + (f"{a.beside} single-thread numpy 512x512 fp32 matmul loop(s)"
                                 if a.beside else "nothing of this bench's")
          + f"; load average {load()} at start")
    rows, dump = [], {}
    try:
        for rate in [float(r) for r in a.rates.split(",")]:
            cl = cluster_file(d, rate, chips_per_node=a.per_host)
            name = f"testbed {rate:g} Mbit/s"
            print(f"{rate:g} Mbit/s between hosts (tbf), cluster nic_gbps = {rate / 1000:g}:")

            def compiled(tag, plan_arg, measure=False):
                out = str(d / f"{tag}-{rate:g}")
                res = compile_model(MODEL, cluster_arg=str(cl), plan_arg=plan_arg,
                                    global_batch=GLOBAL, seq_len=SEQ, out_dir=out,
                                    log=lambda *x: None, measure=measure)
                return {"out": out, "plan": res.plan}
            auto = compiled("auto0", "auto")
            fixed = {f: load_plan(str(fixed_plan(d, f, cl, a.per_host)))
                     for f in (FIXED if a.per_host == 2 else FIXED_1)} if a.fixed else {}
            plans = plan_set(auto["out"], MODEL, load_cluster(str(cl)), a.plans, GLOBAL, SEQ,
                             fixed)
            measure_together(MODEL, load_cluster(str(cl)), plans, SEQ)
            # every plan compiled last from its file, without measuring: one set of records
            builds = {}
            for tag, plan in plans.items():
                p = d / f"final-{tag}-{rate:g}.h2plan"
                plan.model, plan.cluster = MODEL, str(cl)
                p.write_text(format_plan(plan))
                builds[tag] = compiled(tag, str(p))
            pred = {p: predicted_step_time(BuildDir(b["out"])).step_time_s for p, b in builds.items()}
            for p, b in builds.items():
                print(f"  {p:8s} {where(b['out'])}")
            names = list(builds)
            rounds = []
            for r in range(a.rounds):
                order = names[r % len(names):] + names[:r % len(names)]
                meas = {}
                for p in order:
                    meas[p] = statistics.median(run_plan(builds[p]["out"], rate, a.steps)[1:])
                rounds.append(meas)
                print(f"    round {r + 1} ({' '.join(order)}): " + "  ".join(
                    f"{p} {meas[p]:.3f} s ({(pred[p] - meas[p]) / meas[p]:+.0%})" for p in names)
                    + f"  load {load()}", flush=True)
            rows.append(report(name, pred, rounds, {p: describe(b["plan"]) for p, b in builds.items()}))
            dump[name] = {"predicted": pred, "rounds": rounds}
    finally:
        stop_hogs(hogs)
    finish(rows, f"load average {load()} at end; {time.perf_counter() - t0:.0f} s", a.json,
           {"rates": dump})


if __name__ == "__main__":
    main()
