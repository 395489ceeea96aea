"""Predicted against measured peak memory per worker.

For each build: `h2c compile` with a hand-written plan, `h2x run` for a few steps, then each
worker's measured peak (the high-water mark of its live tensors: backends/memory.py) beside the
resource model's peak for its stage (h2ir/planner/resource/memory.py `stage_memory`, written in the
manifest as stages[i].memory). Memory is not noisy the way time is: one run per build.

    .venv/bin/python bench/bench_memory.py [--steps 3] [--only NAME ...]

Prints one row per worker and, per build, the worst |measured / predicted - 1|.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
LLAMA = "examples/llama_tiny.py"
MOE = "examples/moe_tiny.py"
L4 = "examples/clusters/local4.toml"
MIXED = "examples/clusters/local-mixed.toml"
TWO = """stage chip=cpu-torch chips={c} tp={t} recompute={r} {z}layers=embed, 0..3
stage chip={chip1} chips={c} tp={t} recompute={r} {z}layers=4..7, head
"""


def two(chip1="cpu-torch", c=1, t=1, r="none", zero=0) -> str:
    return TWO.format(chip1=chip1, c=c, t=t, r=r, z=f"zero={zero} " if zero else "")


# name -> (model, cluster, batch, dp, stages[, extra plan lines])
BUILDS = {
    "dense 2-stage": (LLAMA, "local", "global=8 micro=2 seq=256", 1, two()),
    "torch + NumPy": (LLAMA, MIXED, "global=8 micro=2 seq=256", 1, two("cpu-numpy")),
    "dp 2": (LLAMA, L4, "global=8 micro=2 seq=256", 2, two(c=2)),
    "tp 2": (LLAMA, L4, "global=8 micro=2 seq=256", 1, two(c=2, t=2)),
    "moe ep 2": (MOE, L4, "global=16 micro=2 seq=64", 2, """\
stage chip=cpu-torch chips=2 tp=1 ep=2 recompute=none layers=embed, 0..1
stage chip=cpu-torch chips=2 tp=1 ep=2 recompute=none layers=2..3, head
moe ep=2 placement=contiguous a2a=flat migration=none capacity=none
"""),
    "recompute full": (LLAMA, "local", "global=8 micro=2 seq=256", 1, two(r="full")),
    "recompute selective": (LLAMA, "local", "global=8 micro=2 seq=256", 1, two(r="selective")),
    "zero 1": (LLAMA, L4, "global=8 micro=2 seq=256", 2, two(c=2, zero=1)),
}


def measure(name: str, spec, steps: int, work: Path) -> list[tuple]:
    model, cluster, batch, dp, stages = spec
    plan = work / "plan.h2plan"
    plan.write_text(f'model "{model}"\ncluster "{cluster}"\nbatch {batch}\nschedule 1f1b\n'
                    f"dp {dp}\n{stages}")
    build, log = work / "build", work / "run.jsonl"
    r = subprocess.run([str(BIN / "h2c"), "compile", model, "--plan", str(plan), "-o",
                        str(build)], cwd=ROOT, capture_output=True, text=True)
    if r.returncode:
        print(f"{name}: h2c compile failed: {r.stderr.strip().splitlines()[-1:]}")
        return []
    r = subprocess.run([str(BIN / "h2x"), "run", str(build), "--steps", str(steps), "--data",
                        "docs", "--json-log", str(log)], cwd=ROOT, capture_output=True, text=True)
    if r.returncode:
        print(f"{name}: h2x run failed: {r.stderr.strip().splitlines()[-1:]}")
        return []
    manifest = json.loads((build / "manifest.json").read_text())
    peaks: dict[str, int] = {}
    for line in log.read_text().splitlines():
        for w, m in (json.loads(line).get("peak_memory") or {}).items():
            peaks[w] = max(peaks.get(w, 0), m["tensors"])
    rows = []
    for w in manifest["workers"]:
        st = manifest["stages"][w["stage"]]
        rows.append((name, f"w{w['id']}", w["stage"], st["backend"],
                     st["memory"]["predicted_bytes"], peaks[f"w{w['id']}"]))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--only", nargs="*", default=None)
    a = ap.parse_args()
    print(f"{'build':<20} {'worker':>6} {'stage':>5} {'backend':>7} {'predicted':>10} "
          f"{'measured':>10} {'meas/pred':>9}")
    worst_all = 0.0
    for name, spec in BUILDS.items():
        if a.only and name not in a.only:
            continue
        with tempfile.TemporaryDirectory() as td:
            rows = measure(name, spec, a.steps, Path(td))
        worst = 0.0
        for b, w, s, be, pred, got in rows:
            ratio = got / pred
            worst = max(worst, abs(ratio - 1))
            print(f"{b:<20} {w:>6} {s:>5} {be:>7} {pred / 2**20:>7.1f} MiB {got / 2**20:>6.1f} MiB "
                  f"{ratio:>9.3f}")
        if rows:
            print(f"{name}: worst |measured / predicted - 1| = {worst:.3f}")
            worst_all = max(worst_all, worst)
    print(f"all builds: worst |measured / predicted - 1| = {worst_all:.3f} (bound 0.15)")


if __name__ == "__main__":
    main()
