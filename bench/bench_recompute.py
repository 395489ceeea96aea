"""Activation recomputation on llama_tiny at seq 512: measured peak memory per stage, losses and
step time of recompute=selective and full against none.

Two torch stages (blocks 0-3 with the embedding, 4-7 with the head), micro-batch 2, 1F1B over
four micro-batches. Per mode: the peak of each worker's live tensors (backends/memory.py) and the
resource model's prediction; the losses of every step against none's (bit-identical expected:
the backward re-runs the same kernels on the same inputs); the median step time (steps 2..N)
as a ratio to none's, rounds alternated.

    .venv/bin/python bench/bench_recompute.py [--steps 10] [--rounds 2] [--seq 512]
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
MODES = ("none", "selective", "full")


def _compile(work: Path, mode: str, seq: int) -> Path:
    plan = work / f"{mode}.h2plan"
    plan.write_text(f'model "examples/llama_tiny.py"\ncluster "local"\nbatch global=8 micro=2 '
                    f"seq={seq}\nschedule 1f1b\ndp 1\n"
                    f"stage chip=cpu-torch chips=1 tp=1 recompute={mode} layers=embed, 0..3\n"
                    f"stage chip=cpu-torch chips=1 tp=1 recompute={mode} layers=4..7, head\n")
    build = work / mode
    subprocess.run([str(BIN / "h2c"), "compile", "examples/llama_tiny.py", "--plan", str(plan),
                    "-o", str(build)], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return build


def _run(build: Path, steps: int) -> list[dict]:
    log = build.parent / f"{build.name}.jsonl"
    data = build.parent / "data"          # a snapshot: docs/ may be edited while this runs
    if not data.exists():
        shutil.copytree(ROOT / "docs", data)
    subprocess.run([str(BIN / "h2x"), "run", str(build), "--steps", str(steps), "--data", str(data),
                    "--json-log", str(log)], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return [json.loads(x) for x in log.read_text().splitlines() if '"loss"' in x]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seq", type=int, default=512)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as td:
        builds = {m: _compile(Path(td), m, a.seq) for m in MODES}
        times: dict[str, list[float]] = {m: [] for m in MODES}
        first: dict[str, list[dict]] = {}
        for r in range(a.rounds):
            for m in (MODES if r % 2 == 0 else MODES[::-1]):
                log = _run(builds[m], a.steps)
                first.setdefault(m, log)
                times[m].append(statistics.median(x["step_s"] for x in log[1:]))
        base = first["none"]
        peak = {m: {w: max(x["peak_memory"][w]["tensors"] for x in first[m])
                    for w in first[m][0]["peak_memory"]} for m in MODES}
        pred = {m: first[m][0]["peak_memory"] for m in MODES}
        print(f"llama_tiny, seq {a.seq}, micro-batch 2, 2 stages, {a.steps} steps, "
              f"{a.rounds} rounds alternated")
        print(f"{'mode':<10} {'worker':>6} {'measured':>10} {'predicted':>10} {'÷ none':>7}")
        for m in MODES:
            for w, got in peak[m].items():
                print(f"{m:<10} {w:>6} {got / 2**20:>6.1f} MiB {pred[m][w]['predicted'] / 2**20:>6.1f} MiB "
                      f"{got / peak['none'][w]:>7.3f}")
        for m in MODES[1:]:
            worst = max(abs(x["loss"] - y["loss"]) / abs(y["loss"]) for x, y in zip(first[m], base))
            same = all(x["loss"] == y["loss"] for x, y in zip(first[m], base))
            ratios = [t / n for t, n in zip(times[m], times["none"])]
            print(f"{m}: losses over {a.steps} steps {'bit-identical to' if same else 'differ from'} "
                  f"none (worst relative {worst:.1e}); step time ÷ none: median "
                  f"{statistics.median(ratios):.3f} (rounds {min(ratios):.3f} .. {max(ratios):.3f})")


if __name__ == "__main__":
    main()
