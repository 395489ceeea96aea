"""How far each transformers decoder family gets through h2, and how close its losses are.

For every family x attention implementation x backend of examples/hf/decoders.py (its
CORE_FAMILIES with both attentions, MORE_FAMILIES with the one named): `h2c ir`
(capture), `h2c compile` of a 2-stage plan (stage programs, kernels), `h2x run` for a few steps,
and the comparison with eager transformers training (same weights, data and AdamW). Prints a
markdown table, or JSON with --json; tools/gen_docs.py renders it into docs/backends.md.

    .venv/bin/python tools/family_matrix.py [--families llama,gpt2] [--more all|f1,f2] [--steps 5] [--json]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODEL = str(ROOT / "examples/hf/decoders.py")
sys.path.insert(0, str(ROOT / "examples/hf"))
from decoders import CORE_FAMILIES, MORE_FAMILIES  # noqa: E402
CLUSTER = {"torch": ("local", "cpu-torch"), "numpy": ("local-numpy", "cpu-numpy")}
MB, SEQ, GB = 2, 32, 4


def one_case(family: str, attn: str, backend: str, steps: int) -> dict:
    from executor.launcher import run
    from executor.reference import eager_losses
    from frontend.capture import capture
    from frontend.compiler import compile_model
    from h2ir.errors import H2Error
    args = {"family": family, "attn": attn}
    row = {"family": family, "attn": attn, "backend": backend, "reached": "nothing"}
    try:
        names = [l.name for l in capture(MODEL, args, MB, SEQ).layers]
        row["reached"] = "capture"
        d = Path(tempfile.mkdtemp(prefix=f"h2-fam-{family}-"))
        cluster, chip = CLUSTER[backend]
        half = len(names) // 2
        stages = "".join(f"stage chip={chip} chips=1 tp=1 layers={', '.join(p)}\n"
                         for p in (names[:half], names[half:]))
        (d / "p.h2plan").write_text(f'model "{MODEL}"\ncluster "{cluster}"\nbatch global={GB} '
                                    f"micro={MB} seq={SEQ}\nschedule 1f1b\ndp 1\n{stages}")
        compile_model(MODEL, model_args=args, plan_arg=str(d / "p.h2plan"),
                      out_dir=str(d / "build"), log=lambda *a: None)
        row["reached"] = "compile"
        res = run(str(d / "build"), steps=steps, out=lambda *a: None, predict=False)
        row["reached"] = "run"
        ref = eager_losses(str(d / "build"), steps)
        row["loss_rel_diff"] = max(abs(a - b) / abs(b) for a, b in zip(res.losses, ref))
        row["reached"] = "matches eager" if row["loss_rel_diff"] <= 1e-5 else "run (losses differ)"
    except (H2Error, Exception) as e:     # record where it stopped, keep going
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--families", default=",".join(CORE_FAMILIES),
                    help="families run with both attentions")
    ap.add_argument("--more", default="",
                    help="families run with the attention MORE_FAMILIES names ('all': every one)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    rows = [one_case(f, attn, be, a.steps) for f in a.families.split(",") if f
            for attn in ("sdpa", "eager") for be in ("torch", "numpy")]
    rows += [one_case(f, MORE_FAMILIES.get(f, "sdpa"), be, a.steps)
             for f in (list(MORE_FAMILIES) if a.more == "all" else a.more.split(",")) if f
             for be in ("torch", "numpy")]
    if a.json:
        print(json.dumps(rows, indent=1))
        return
    print("| family | attention | backend | furthest stage | max rel. loss diff vs eager |")
    print("|---|---|---|---|---|")
    for r in rows:
        diff = f"{r['loss_rel_diff']:.1e}" if "loss_rel_diff" in r else r.get("error", "")
        print(f"| {r['family']} | {r['attn']} | {r['backend']} | {r['reached']} | {diff} |")


if __name__ == "__main__":
    main()
