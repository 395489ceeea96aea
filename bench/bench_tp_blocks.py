"""Tensor-parallel stage times, measured against the planner's prediction (issue 14).

Setup: llama_tiny (d=256, 8 blocks, 8 heads, vocab 8192) as one stage of tp = 1, 2 and 4 torch
workers (`local4`: its 4 workers share this machine's cores, `shared_cores`), micro-batches of
2 x 128, 4 per step, fp32. Per TP degree, one `h2c compile` and one `h2x run --trace`:

- measured: rank 0's forward and backward of one micro-batch (its trace's F and B events,
  median over steps 2..N; the Megatron all-reduces run inside them);
- predicted: the same events in the simulator's timeline of the build's streams (the resource
  model's stage times with the programs' own collectives, stretched where workers share cores).

Prints both per degree, their ratio, and the speedup over tp 1 measured and predicted.

    .venv/bin/python bench/bench_tp_blocks.py [--steps 5] [--tp 1 2 4]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_NUM_THREADS", "1")
MODEL = ROOT / "examples/llama_tiny.py"
CLUSTER = ROOT / "examples/clusters/local4.toml"


def plan_text(tp: int) -> str:
    return (f'model "{MODEL}"\ncluster "{CLUSTER}"\nbatch global=8 micro=2 seq=128\n'
            f"schedule 1f1b\ndp 1\nstage chip=cpu-torch chips={tp} tp={tp} "
            "layers=embed, 0..7, head\n")


def measure(tp: int, steps: int) -> dict:
    from executor.launcher import run
    from frontend.compiler import compile_model
    d = Path(tempfile.mkdtemp(prefix=f"h2-bench-tp{tp}-"))
    (d / "p.h2plan").write_text(plan_text(tp))
    res = compile_model(str(MODEL), plan_arg=str(d / "p.h2plan"), out_dir=str(d / "b"),
                        log=lambda *a: None)
    trace = d / "trace.json"
    run(str(d / "b"), steps=steps, out=lambda *a: None, predict=False, trace=str(trace))
    ev = [e for e in json.loads(trace.read_text())["traceEvents"]
          if e.get("ph") == "X" and e.get("cat") == "compute" and e["pid"] == 0
          and e["args"]["step"] >= 2]
    meas = {k: statistics.median(e["dur"] / 1e6 for e in ev if e["name"].startswith(k))
            for k in "FB"}
    pred_ev = [e for e in res.predicted.events if e.worker == 0 and e.lane == "compute"]
    pred = {k: statistics.median(e.dur_s for e in pred_ev if e.name.startswith(k)) for k in "FB"}
    return {"measured": meas, "predicted": pred}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    a = ap.parse_args()
    print(f"llama_tiny as one stage, micro-batch 2 x 128, local4 ({os.cpu_count()} cores shared "
          f"by the workers); load average {os.getloadavg()[0]:.2f} at start")
    print(f"  {'tp':>2}  {'measured F+B':>12}  {'predicted F+B':>13}  {'predicted/measured':>18}  "
          f"{'speedup measured':>16}  {'speedup predicted':>17}")
    base = None
    for tp in a.tp:
        r = measure(tp, a.steps)
        m = r["measured"]["F"] + r["measured"]["B"]
        p = r["predicted"]["F"] + r["predicted"]["B"]
        base = base or (m, p)
        print(f"  {tp:2}  {m * 1e3:10.1f} ms  {p * 1e3:11.1f} ms  {p / m:18.2f}  "
              f"{base[0] / m:16.2f}  {base[1] / p:17.2f}", flush=True)
    print(f"  load average at end {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
