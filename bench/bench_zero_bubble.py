"""Zero-bubble and interleaved schedules against 1F1B on a heterogeneous 2-stage pipeline,
measured and predicted in the same run.

Setup: llama_tiny (d=256, 8 layers), `local-mixed` (one torch worker, one NumPy worker: two
"vendors" of different speed), the plan `--plan uniform` (4 blocks per stage; the calibration
and this model's layer times are measured by the compile, as for any uniform/auto plan), 8
micro-batches of 2 x 128 tokens, AdamW, fp32.

- anchor: the 1F1B build;
- h2: the same plan with `--schedule zb1` (each backward split into B, the input gradient sent
  upstream at once, and W, the weight gradient, run later: Qi et al., ICLR 2024), and with the
  virtual-stage schedules `interleaved`, `izb` and `zbv` (each worker's share cut into 2 chunks,
  `h2ir.planner.search.virtualize`).

The builds alternate for --runs runs; medians over steps 2..N. Prints each schedule's measured
and predicted step time, the measured gain (1F1B step / its step), the simulator's predicted
gain and their difference, and each schedule's largest relative loss difference to 1F1B.

    .venv/bin/python bench/bench_zero_bubble.py [--steps 8] [--runs 3] [--cluster local-mixed]
        [--schedules zb1 interleaved izb zbv]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_NUM_THREADS", "1")
MODEL = str(ROOT / "examples/llama_tiny.py")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--cluster", default="local-mixed")
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--schedules", nargs="+", default=["zb1", "interleaved", "izb", "zbv"])
    a = ap.parse_args()
    from executor.launcher import run
    from frontend.compiler import compile_model
    quiet = lambda *x, **k: None          # noqa: E731
    with tempfile.TemporaryDirectory(prefix="h2-bench-zb-") as tmp:
        builds, predicted = {}, {}
        for sch in ["1f1b"] + a.schedules:
            out = Path(tmp) / sch
            res = compile_model(MODEL, cluster_arg=a.cluster, plan_arg="uniform", schedule=sch,
                                global_batch=a.global_batch, micro_batch=2, seq_len=128,
                                out_dir=str(out), log=quiet)
            builds[sch], predicted[sch] = str(out), res.predicted.step_time_s
        steps = {s: [] for s in builds}
        losses = {}
        for _ in range(a.runs):
            for sch, b in builds.items():
                r = run(b, steps=a.steps, out=quiet, predict=False)
                steps[sch] += r.step_s[1:]
                losses[sch] = r.losses
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    meas = {s: statistics.median(v) for s, v in steps.items()}
    print(f"llama_tiny, {a.cluster}, uniform plan, {a.global_batch // 2} micro-batches, "
          f"{a.steps} steps x {a.runs} runs (load average {load})")
    for s in builds:
        print(f"  {s:<12} measured {meas[s] * 1e3:7.1f} ms   predicted {predicted[s] * 1e3:7.1f} ms")
    for s in a.schedules:
        gm, gp = meas["1f1b"] / meas[s], predicted["1f1b"] / predicted[s]
        diff = max(abs(x - y) / abs(y) for x, y in zip(losses[s], losses["1f1b"]))
        print(f"  gain of {s:<12} (1F1B step / its step): measured {gm:.3f}, predicted {gp:.3f}, "
              f"predicted - measured {gp - gm:+.3f} ({(gp - gm) / gm:+.1%} of the measured "
              f"gain); max loss difference {diff:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
