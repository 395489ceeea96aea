"""The cost of checkpointing every step: h2x step time with `--checkpoint-every 1` against the
same run without checkpoints, measured in the same run, alternated.

llama_tiny (6.3 M parameters: 76 MB of weights and AdamW moments per checkpoint) on the 2-stage
plan of examples/plans/llama_tiny_2stage.h2plan. A checkpoint is a copy of the worker's tables
(synchronous) and a background write of the files (fsynced) while the next steps run.

Prints each round's median step time (steps 2..N) of both runs (their order alternated round
by round) and the ratio with / without (1.0: free), with the spread over rounds; and how many
step directories `keep_last = 2` left.

    .venv/bin/python bench/bench_checkpoint.py [--steps 12] [--rounds 3]
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
PLAN = ROOT / "examples/plans/llama_tiny_2stage.h2plan"
BIN = Path(sys.executable).parent


def _median_step(build: Path, steps: int, log: Path, *extra: str) -> float:
    subprocess.run([str(BIN / "h2x"), "run", str(build), "--steps", str(steps), "--json-log",
                    str(log), *extra], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    times = [json.loads(x)["step_s"] for x in log.read_text().splitlines()]
    return statistics.median(times[1:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as td:
        build = Path(td) / "build"
        subprocess.run([str(BIN / "h2c"), "compile", "examples/llama_tiny.py", "--plan", str(PLAN),
                        "-o", str(build)], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        ratios, kept = [], set()
        for r in range(a.rounds):
            ck = Path(td) / "ck"

            def plain_run():
                return _median_step(build, a.steps, Path(td) / "plain.jsonl")

            def ckpt_run():
                t = _median_step(build, a.steps, Path(td) / "ck.jsonl", "--checkpoint-every", "1",
                                 "--checkpoint-dir", str(ck), "--checkpoint.keep_last", "2")
                kept.add(len([d for d in ck.iterdir() if d.name.startswith("step_")]))
                shutil.rmtree(ck, ignore_errors=True)
                return t
            # alternated: the first run of a round is the other one each round
            if r % 2 == 0:
                plain, saved = plain_run(), ckpt_run()
            else:
                saved, plain = ckpt_run(), plain_run()
            ratios.append(saved / plain)
            print(f"round {r + 1}: without {plain * 1e3:7.1f} ms  with a checkpoint every step "
                  f"{saved * 1e3:7.1f} ms  ratio {saved / plain:.3f}")
        print(f"keep_last = 2: step directories left after each checkpointed run: "
              f"{', '.join(map(str, sorted(kept)))}")
        print(f"with / without: median {statistics.median(ratios):.3f} "
              f"(rounds {min(ratios):.3f} .. {max(ratios):.3f}; 1.0 = free)")


if __name__ == "__main__":
    main()
