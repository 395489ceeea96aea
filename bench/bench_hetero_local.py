"""Heterogeneous planning on this machine: HeteroAuto against the uniform split on local-mixed
(one torch worker + one numpy worker), with the planner's predicted step time beside each.

- anchor: `--plan uniform` (even layer split, cluster order) on the same cluster, same run
- h2: `--plan auto` (HeteroAuto with measured per-layer times of both backends)

Prints measured median step times, the speed ratio uniform/auto (> 1 means auto is faster), and
each plan's predicted-vs-measured step-time error.

    .venv/bin/python bench/bench_hetero_local.py [--steps 8]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def measure(plan: str, steps: int) -> dict:
    from executor.launcher import predicted_step_time, run
    from executor.build import BuildDir
    from frontend.compiler import compile_model
    out = tempfile.mkdtemp(prefix=f"h2-{plan}-") + "/B"
    res = compile_model(str(ROOT / "examples/llama_tiny.py"), cluster_arg="local-mixed",
                        plan_arg=plan, out_dir=out, log=lambda *a: None)
    r = run(out, steps=steps, out=lambda *a: None, predict=False)
    pred = predicted_step_time(BuildDir(out)).step_time_s
    layers = [f"{s.chip}:{len(s.layers)}" for s in res.plan.stages]
    return {"measured": statistics.median(r.step_s[1:]), "predicted": pred, "layers": layers,
            "mb": res.plan.micro_batch, "m": res.plan.num_microbatches}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    a = ap.parse_args()
    uni = measure("uniform", a.steps)
    auto = measure("auto", a.steps)
    print("llama_tiny on local-mixed (cpu-torch + cpu-numpy workers), global batch 16 x 128")
    for name, r in (("uniform (anchor)", uni), ("auto (HeteroAuto)", auto)):
        err = (r["predicted"] - r["measured"]) / r["measured"]
        print(f"  {name:18s} stages {' | '.join(r['layers'])}  micro-batch {r['mb']} x {r['m']}: "
              f"measured {r['measured']:.3f} s/step, predicted {r['predicted']:.3f} s ({err:+.1%})")
    print(f"  ratio auto / uniform throughput: {uni['measured'] / auto['measured']:.2f}")


if __name__ == "__main__":
    main()
