"""Peak resident memory of `h2c compile --init.from` on a model of about 1 B parameters.

The model is examples/llama_tiny.py at d=2048, 18 layers, FFN 5504, vocab 32000 (1.04 B
parameters, 4.2 GB in fp32); its checkpoint (random bf16 tensors under the model's own names,
2.1 GB) is written to a temporary directory. The plan has 4 stages. Prints the compile's peak
RSS beside one stage's fp32 weights (the largest stage's weight file) and the whole model's.

    .venv/bin/python bench/bench_init_from.py [--h2c PATH]

`--h2c`: another h2c to measure (an older checkout's, for the figure before the lazy read).
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
BIN = Path(sys.executable).parent
ARGS = {"dim": 2048, "n_layers": 18, "n_heads": 16, "ffn": 5504, "vocab": 32000}


def write_checkpoint(directory: Path) -> int:
    """Random bf16 tensors for every parameter of the model (by its own names); returns the
    parameter count."""
    import torch
    from safetensors.torch import save_file

    from frontend.capture import load_model_file
    from frontend.pretrained import parameters_on_meta
    with parameters_on_meta():
        model = load_model_file("examples/llama_tiny.py").build(ARGS)
    g = torch.Generator().manual_seed(0)
    tensors = {k: (torch.randn(p.shape, generator=g) * 0.02).to(torch.bfloat16)
               for k, p in model.named_parameters()}
    save_file(tensors, str(directory / "model.safetensors"))
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--h2c", default=str(BIN / "h2c"))
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as td:
        td = Path(td)
        ckpt = td / "ckpt"
        ckpt.mkdir()
        n = write_checkpoint(ckpt)
        plan = td / "p.h2plan"
        L = ARGS["n_layers"]
        cuts = [(0, 4), (5, 9), (10, 13), (14, L - 1)]
        stages = [f"stage chip=cpu-torch chips=1 tp=1 layers={'embed, ' if i == 0 else ''}"
                  f"{lo}..{hi}{', head' if i == 3 else ''}\n" for i, (lo, hi) in enumerate(cuts)]
        cluster = td / "big.toml"      # room for a 1 B model's training state per worker
        cluster.write_text((ROOT / "examples/clusters/local4.toml").read_text().replace(
            "mem_gib     = 4", "mem_gib     = 64"))
        plan.write_text(f'model "examples/llama_tiny.py"\ncluster "{cluster}"\n'
                        "batch global=4 micro=1 seq=64\nschedule 1f1b\ndp 1\n" + "".join(stages))
        build = td / "build"
        cmd = ["/usr/bin/time", "-f", "%M", a.h2c, "compile", "examples/llama_tiny.py",
               *[x for k, v in ARGS.items() for x in ("--arg", f"{k}={v}")], "--plan", str(plan),
               "--init.from", str(ckpt), "-o", str(build)]
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if r.returncode:
            sys.exit(f"h2c compile failed:\n{r.stderr[-2000:]}")
        rss = int(r.stderr.strip().splitlines()[-1]) * 1024
        stage = max(f.stat().st_size for f in (build / "weights").glob("stage?.safetensors"))
        read = next((x for x in r.stdout.splitlines() if x.startswith("init.from")), "")
        print(f"model: {n / 1e9:.2f} B parameters, {4 * n / 2**30:.2f} GiB in fp32; checkpoint "
              f"bf16 {2 * n / 2**30:.2f} GiB; 4 stages")
        print(f"h2c compile --init.from: peak RSS {rss / 2**30:.2f} GiB; largest stage's fp32 "
              f"weights {stage / 2**30:.2f} GiB; RSS - stage = {(rss - stage) / 2**30:.2f} GiB "
              f"(bound: 1 GiB)")
        print(f"  ({read})")


if __name__ == "__main__":
    main()
