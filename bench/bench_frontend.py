"""Capture and compile cost of H2's 100B model (96 layers), against an anchor measured in the same run.

- anchor: one forward of the same model on the meta device under torch's FlopCounterMode — the
  least any tool that counts this model's FLOPs must do
- `h2c ir`: capture into h2ir with layer costs (symbolic_trace + make_fx on the meta device)
- `h2c compile --dry-run`: capture, plan for the 1,024-chip cluster (HeteroAuto), per-stage
  forward/backward programs from AOTAutograd, instruction streams, build directory

Prints seconds and the ratio to the anchor, plus peak RSS (the issue's limits: ir < 30 s and
< 4 GiB; dry-run compile < 60 s).

    .venv/bin/python bench/bench_frontend.py
"""
from __future__ import annotations

import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
BIN = Path(sys.executable).parent


def anchor() -> float:
    code = ("import sys,torch,time; sys.path.insert(0,'examples'); import llama_100b as m;"
            "from torch.utils.flop_counter import FlopCounterMode;"
            "t=time.perf_counter();\n"
            "with torch.device('meta'): net=m.build_model()\n"
            "x=torch.zeros(1,4096,dtype=torch.long,device='meta')\n"
            "with FlopCounterMode(display=False) as f: net(x)\n"
            "print(time.perf_counter()-t)")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return float(r.stdout.strip().splitlines()[-1])


def timed(cmd) -> tuple[float, float]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t = time.perf_counter()
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    dt = time.perf_counter() - t
    if r.returncode != 0:
        raise SystemExit(r.stderr)
    peak = max(before, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss) / 2**20
    return dt, peak


def main():
    a = anchor()
    ir_s, ir_mem = timed([str(BIN / "h2c"), "ir", "examples/llama_100b.py", "--seq-len", "4096",
                          "--summary", "--json"])
    out = tempfile.mkdtemp(prefix="h2-b100-") + "/B"
    c_s, c_mem = timed([str(BIN / "h2c"), "compile", "examples/llama_100b.py", "--cluster", "h2-1024",
                        "--plan", "auto", "--dry-run", "--seq-len", "4096", "--global-batch", "1024",
                        "-o", out])
    print("llama_100b (96 layers, 113.27 B params), micro-batch 1 x 4096, meta device")
    print(f"  anchor: meta forward under FlopCounterMode  {a:6.1f} s")
    print(f"  h2c ir --summary --json                     {ir_s:6.1f} s  ratio {ir_s / a:5.2f}  "
          f"peak RSS {ir_mem:.2f} GiB")
    print(f"  h2c compile --dry-run (h2-1024, auto plan)  {c_s:6.1f} s  ratio {c_s / a:5.2f}  "
          f"peak RSS {c_mem:.2f} GiB")


if __name__ == "__main__":
    main()
