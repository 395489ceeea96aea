"""Heterogeneous planning on this machine: HeteroAuto against the uniform split, with the
planner's predicted step time beside each measured one, on `local` (two torch workers),
`local-mixed` (torch + numpy) and `local-mixed4` (two of each on the 2 cores).

- anchor: `--plan uniform` (even layer split, cluster order) on the same cluster, same run
- h2: `--plan auto` (HeteroAuto with measured per-layer times of both backends)

The calibration is taken in this run: a fresh calibration file, so the first compile measures
the backends and llama_tiny's layer times (`h2c compile` does that for `measured` chips). Each
plan is compiled once and run `--runs` times, the two plans alternating. Then another model
(llama_tiny at d=128, 4 layers) is compiled on every cluster, which records its own layer times
into the same file, and each llama_tiny plan is compiled and run once more: its prediction must
not move (the records are keyed by model content and shapes, never mixed up by name).

Prints per run measured median step time and the predicted-vs-measured error, and per cluster
the throughput ratio auto / uniform (> 1: auto faster).

    .venv/bin/python bench/bench_hetero_local.py [--steps 8] [--runs 3] [--clusters a,b]
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
MODEL = str(ROOT / "examples/llama_tiny.py")
OTHER_ARGS = {"dim": 128, "n_layers": 4, "ffn": 344}


def build(cluster: str, plan: str, model_args: dict | None = None) -> dict:
    from frontend.compiler import compile_model
    out = tempfile.mkdtemp(prefix=f"h2-{cluster}-{plan}-") + "/B"
    log: list = []
    res = compile_model(MODEL, model_args=model_args, cluster_arg=cluster, plan_arg=plan,
                        out_dir=out, log=log.append)
    return {"out": out, "plan": res.plan, "measured_layers": any("measuring" in m for m in log),
            "layers": [f"{s.chip}" + (f"(tp{s.tp})" if s.tp > 1 else "") + f":{len(s.layers)}"
                       for s in res.plan.stages]}


def run_once(b: dict, steps: int) -> tuple[float, float]:
    from executor.build import BuildDir
    from executor.launcher import predicted_step_time, run
    r = run(b["out"], steps=steps, out=lambda *a: None, predict=False)
    pred = predicted_step_time(BuildDir(b["out"])).step_time_s
    return statistics.median(r.step_s[1:]), pred


def balance_bound(b: dict, uniform_step_s: float, uniform_pred_s: float) -> str | None:
    """The most any plan can gain over `uniform` here, from the layer times the auto build was
    compiled with (A(w) = every layer of one micro-batch, forward and backward, on worker w's
    backend; m micro-batches per step; communication, optimizer step and divisibility left out,
    so each figure is a lower bound on a step):
    - one stage, dp over the k fastest workers: the replicas keep step, so the slowest of them
      bounds: (m / k) * A(k-th fastest);
    - two or more stages: 1F1B's fill and drain cost at least one stage slot, and a slot is at
      least T* = 1 / sum_w 1 / A(w) (the whole cluster perfectly balanced): (m + 1) * T*.
    The ratio is printed twice: the model's (predicted uniform step / that floor: both from the
    same layer times) and against the measured uniform step (which overstates the bound when
    the layer times are optimistic). Returns the lines to print, or None without the records."""
    from executor.build import BuildDir
    from h2ir.clusters.clusterfile import load_cluster
    from h2ir.planner.calibration import load_calibration
    out = Path(b["out"])
    ids = BuildDir(out).manifest.get("calibration_records")
    cal = load_calibration()
    if not ids or cal is None:
        return None
    recs = cal.records
    plan = b["plan"]
    n_layers = sum(len(st.layers) for st in plan.stages)
    per_backend = {}
    for i in ids:
        r = recs.get(i)
        if r is None or r["key"]["micro_batch"] != plan.micro_batch:
            continue
        t = {kind: v["fwd_s"] + v["bwd_s"] for kind, v in r["layers"].items()}
        blocks = n_layers - sum(1 for k in t if k != "transformer_block")
        per_backend[r["key"]["backend"]] = sum(v for k, v in t.items()
                                               if k != "transformer_block") + \
            blocks * t.get("transformer_block", 0.0)
    cluster = load_cluster(str(out / "cluster.toml"))
    workers = [cluster.chip_types[g.chip].backend for g in cluster.groups for _ in range(g.chips)]
    if not per_backend or any(w not in per_backend for w in workers):
        return None
    m = plan.global_batch // plan.micro_batch
    a = sorted(per_backend[w] for w in workers)
    one_stage = min(m / k * a[k - 1] for k in range(1, len(a) + 1))
    t_star = 1.0 / sum(1.0 / x for x in a)
    pipeline = (m + 1) * t_star if len(a) > 1 else float("inf")
    floor = min(one_stage, pipeline)
    speeds = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in sorted(per_backend.items()))
    return (f"  bound: all layers of one micro-batch (fwd+bwd) take {speeds}; no plan on "
            f"{len(workers)} workers steps under min(one stage x dp {one_stage:.3f} s, a "
            f"pipeline {pipeline:.3f} s) = {floor:.3f} s\n"
            f"  so auto / uniform <= {uniform_pred_s / floor:.2f} in the model (uniform predicted "
            f"{uniform_pred_s:.3f} s), {uniform_step_s / floor:.2f} against the measured uniform "
            f"{uniform_step_s:.3f} s")


def err(pred: float, meas: float) -> float:
    return (pred - meas) / meas


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--clusters", default="local,local-mixed,local-mixed4")
    a = ap.parse_args()
    cal_dir = tempfile.mkdtemp(prefix="h2-bench-cal-")
    os.environ["H2_CALIBRATION"] = str(Path(cal_dir) / "calibration.json")
    t0 = time.perf_counter()
    print(f"llama_tiny, global batch 16 x 128, {a.steps} steps per run (median of steps 2..), "
          f"fresh calibration measured in this run; load average {os.getloadavg()[0]:.2f} at start")
    errors = []
    for cluster in a.clusters.split(","):
        builds = {p: build(cluster, p) for p in ("uniform", "auto")}
        meas = {p: [] for p in builds}
        preds = {}
        print(f"{cluster}:")
        for p, b in builds.items():
            print(f"  {p:8s} stages {' | '.join(b['layers'])}  micro-batch {b['plan'].micro_batch}"
                  f" x {b['plan'].num_microbatches}")
        for i in range(a.runs):
            for p, b in builds.items():
                m, pred = run_once(b, a.steps)
                meas[p].append(m)
                preds[p] = pred
                errors.append(err(pred, m))
                print(f"    run {i + 1} {p:8s} measured {m:.3f} s/step, predicted {pred:.3f} s "
                      f"({err(pred, m):+.1%})")
        # another model's layer times land in the same calibration file; ours must not move
        build(cluster, "auto", OTHER_ARGS)
        for p in builds:
            again = build(cluster, p)
            m, pred = run_once(again, a.steps)
            errors.append(err(pred, m))
            print(f"    after another model's compile {p:8s} stages {' | '.join(again['layers'])}"
                  f" (re-measured: {'yes' if again['measured_layers'] else 'no'}): measured "
                  f"{m:.3f} s/step, predicted {pred:.3f} s ({err(pred, m):+.1%})")
        ratio = statistics.median(meas["uniform"]) / statistics.median(meas["auto"])
        print(f"  ratio auto / uniform throughput (medians of {a.runs} runs): {ratio:.2f}")
        line = balance_bound(builds["auto"], statistics.median(meas["uniform"]),
                             preds["uniform"])
        if line:
            print(line)
    print(f"predicted vs measured over all {len(errors)} runs: worst {max(errors, key=abs):+.1%}, "
          f"mean |error| {statistics.mean(abs(e) for e in errors):.1%}; "
          f"load average {os.getloadavg()[0]:.2f} at end; {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
