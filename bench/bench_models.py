"""Real transformers decoders through h2x against eager transformers training, in the same run.

Per family of examples/hf/decoders.py (tiny random configs): a 2-stage 1F1B build on the torch
backend (layers split in halves, 1 thread per worker) trained by `h2x run`, against the anchor:
the same model, weights, data and AdamW trained eagerly in one process with one thread
(`executor.reference.eager_losses`). Prints tokens/s of both, their ratio, and the ratio to the
bubble-bound expectation (a perfect 2-stage pipeline runs S·m/(m+S−1) times the single process).

    .venv/bin/python bench/bench_models.py [--families llama,gpt2] [--steps 6] [--attn sdpa]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODEL = str(ROOT / "examples/hf/decoders.py")
FAMILIES = ["llama", "mistral", "qwen2", "gemma", "phi3", "gpt2", "mixtral", "qwen2_moe"]
S, MB, SEQ, M = 2, 4, 128, 8         # 2 stages, 8 micro-batches of 4 x 128 tokens


def plan_text(family: str, attn: str) -> str:
    from frontend.capture import capture
    names = [l.name for l in capture(MODEL, {"family": family, "attn": attn}, MB, SEQ).layers]
    half = len(names) // 2
    stages = "".join(f"stage chip=cpu-torch chips=1 tp=1 layers={', '.join(p)}\n"
                     for p in (names[:half], names[half:]))
    return (f'model "{MODEL}"\ncluster "local"\nbatch global={M * MB} micro={MB} seq={SEQ}\n'
            f"schedule 1f1b\ndp 1\n{stages}")


def bench_family(family: str, attn: str, steps: int) -> dict:
    from executor.launcher import run
    from executor.reference import eager_losses
    from frontend.compiler import compile_model
    d = Path(tempfile.mkdtemp(prefix=f"h2-bench-{family}-"))
    (d / "p.h2plan").write_text(plan_text(family, attn))
    compile_model(MODEL, model_args={"family": family, "attn": attn}, plan_arg=str(d / "p.h2plan"),
                  out_dir=str(d / "build"), log=lambda *a: None)
    res = run(str(d / "build"), steps=steps, out=lambda *a: None, predict=False)
    eager_t: list = []
    ref = eager_losses(str(d / "build"), steps, threads=1, timings=eager_t)
    h2 = statistics.median(res.step_s[2:])          # steady state: steps 3..N
    eager = statistics.median(eager_t[2:])
    diff = max(abs(a - b) / abs(b) for a, b in zip(res.losses, ref))
    return {"h2x_s": h2, "eager_s": eager, "loss_diff": diff}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--attn", default="sdpa")
    ap.add_argument("--steps", type=int, default=12)
    a = ap.parse_args()
    tokens = M * MB * SEQ
    expect = S * M / (M + S - 1)
    print(f"{S}-stage 1F1B on the torch backend, {M} micro-batches of {MB}x{SEQ}, 1 thread/worker, "
          f"attention '{a.attn}'; anchor: eager transformers, one process, one thread; "
          f"bubble-bound expectation {expect:.2f}x the anchor")
    print(f"{'family':<10} {'eager tok/s':>11} {'h2x tok/s':>10} {'h2x/eager':>9} "
          f"{'/ expected':>10} {'loss diff':>9}")
    for fam in a.families.split(","):
        try:
            r = bench_family(fam, a.attn, a.steps)
        except Exception as e:          # report and go on: one family must not hide the others
            print(f"{fam:<10} failed: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
            continue
        ratio = r["eager_s"] / r["h2x_s"]
        print(f"{fam:<10} {tokens / r['eager_s']:>11.0f} {tokens / r['h2x_s']:>10.0f} "
              f"{ratio:>9.2f} {ratio / expect:>10.2f} {r['loss_diff']:>9.1e}")


if __name__ == "__main__":
    main()
