"""Heterogeneous planning on this machine, judged by the order it puts plans in: on
`local-mixed` (torch + numpy) and `local-mixed4` (two of each on the 2 cores) by default.

For each cluster, a set of valid plans (--plans, at least 4):
- auto: `--plan auto` (HeteroAuto with measured per-layer times of both backends);
- uniform: `--plan uniform` (even layer split, cluster order), the anchor;
- the others the search ranks nearest the top (its runner-ups, then its best at each other
  micro-batch and dp: bench/plan_ranking.py `top_plans`).

The calibration is taken in this run, into a fresh file: the auto compile measures the backends
and llama_tiny's layer times under the cluster's co-location (frontend/profile.py); once the
plans are chosen, the layer times of all their micro-batches are measured again, their rounds
alternated, and each plan is compiled from its plan file from those. Then --rounds rounds, each
running every plan once (--steps steps, the median of steps 2..), the order rotated each
round. The report per cluster (bench/plan_ranking.py): each plan's predicted and measured step, the
prediction errors per round and their spread across the plans (max - min, percentage points),
the pairwise matrix (row predicted faster than column: rounds measured so), auto >= uniform per
round; at the end, a summary table for docs/performance.md.

--beside N runs N CPU-heavy jobs beside the whole run, calibration included: each a
single-thread numpy loop of 512 x 512 fp32 matmuls (a neighbour that competes for the cores and
the caches, as another trainer would).

    .venv/bin/python bench/bench_hetero_local.py [--clusters local-mixed,local-mixed4]
        [--rounds 5] [--steps 8] [--plans 4] [--beside 0] [--json FILE] [--keying-check]
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
MODEL = str(ROOT / "examples/llama_tiny.py")
OTHER_ARGS = {"dim": 128, "n_layers": 4, "ffn": 344}
GLOBAL, SEQ = 16, 128
from plan_ranking import (describe, finish, measure_together, plan_set,  # noqa: E402
                          report, start_hogs, stop_hogs)


def build(cluster: str, plan: str, model_args: dict | None = None, measure: bool = False) -> dict:
    from frontend.compiler import compile_model
    out = tempfile.mkdtemp(prefix=f"h2-{cluster}-{Path(plan).stem}-") + "/B"
    res = compile_model(MODEL, model_args=model_args, cluster_arg=cluster, plan_arg=plan,
                        out_dir=out, log=lambda *a: None, measure=measure, global_batch=GLOBAL,
                        seq_len=SEQ)
    return {"out": out, "plan": res.plan}


def predicted(b: dict) -> float:
    from executor.build import BuildDir
    from executor.launcher import predicted_step_time
    return predicted_step_time(BuildDir(b["out"])).step_time_s


def run_once(b: dict, steps: int) -> float:
    from executor.launcher import run
    r = run(b["out"], steps=steps, out=lambda *a: None, predict=False)
    return statistics.median(r.step_s[1:])


def plan_builds(cluster: str, n: int) -> dict:
    """{name: build} of the plans `plan_set` picks (auto, uniform and the search's nearest
    others, n in all), their micro-batches' layer times measured again together, then each
    compiled from its plan file without measuring (bench/plan_ranking.py)."""
    from h2ir.clusters.clusterfile import load_cluster
    from h2ir.plans.dsl import format_plan
    d = Path(tempfile.mkdtemp(prefix=f"h2-{cluster}-plans-"))
    cl = load_cluster(cluster)
    plans = plan_set(build(cluster, "auto")["out"], MODEL, cl, n, GLOBAL, SEQ)
    measure_together(MODEL, cl, plans, SEQ)
    out = {}
    for name, plan in plans.items():
        f = d / f"{name}.h2plan"
        plan.cluster = cluster
        f.write_text(format_plan(plan))
        out[name] = build(cluster, str(f))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clusters", default="local-mixed,local-mixed4")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--plans", type=int, default=4, help="plans per cluster, auto and uniform "
                    "included (at least 4 for the ranking must-show)")
    ap.add_argument("--beside", type=int, default=0, metavar="N",
                    help="N CPU-heavy jobs beside the run (single-thread fp32 matmul loops)")
    ap.add_argument("--json", default=None, help="write every figure to this file")
    ap.add_argument("--keying-check", action="store_true", help="also compile another model into "
                    "the same calibration file and check that auto's prediction does not move")
    a = ap.parse_args()
    cal_dir = tempfile.mkdtemp(prefix="h2-bench-cal-")
    os.environ["H2_CALIBRATION"] = str(Path(cal_dir) / "calibration.json")
    t0 = time.perf_counter()
    hogs = start_hogs(a.beside)
    print(f"llama_tiny, global batch {GLOBAL} x {SEQ}, {a.steps} steps per run (median of steps "
          f"2..), {a.rounds} rounds, plan order rotated each round; fresh calibration measured in "
          f"this run; {os.cpu_count()} cores; beside it: "
          + (f"{a.beside} single-thread numpy 512x512 fp32 matmul loop(s)" if a.beside else
             "nothing of this bench's") + f"; load average {os.getloadavg()[0]:.2f} at start")
    rows, dump = [], {}
    try:
        for cluster in a.clusters.split(","):
            print(f"{cluster}:")
            builds = plan_builds(cluster, a.plans)
            pred = {p: predicted(b) for p, b in builds.items()}
            desc = {p: describe(b["plan"]) for p, b in builds.items()}
            names = list(builds)
            rounds = []
            for r in range(a.rounds):
                order = names[r % len(names):] + names[:r % len(names)]
                meas = {p: run_once(builds[p], a.steps) for p in order}
                rounds.append(meas)
                print(f"    round {r + 1} ({' '.join(order)}): " + "  ".join(
                    f"{p} {meas[p]:.3f} s" for p in names) + f"  load {os.getloadavg()[0]:.1f}",
                    flush=True)
            rows.append(report(cluster, pred, rounds, desc))
            if a.keying_check:
                build(cluster, "auto", OTHER_ARGS)
                again = predicted(build(cluster, "auto"))
                print(f"  after another model's compile into the same file, auto predicts "
                      f"{again:.3f} s (was {pred['auto']:.3f} s)")
            dump[cluster] = {"predicted": pred, "rounds": rounds, "plans": desc}
    finally:
        stop_hogs(hogs)
    finish(rows, f"load average {os.getloadavg()[0]:.2f} at end; {time.perf_counter() - t0:.0f} s",
           a.json, {"clusters": dump})


if __name__ == "__main__":
    main()
