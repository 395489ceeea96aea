"""moe_tiny tokens/s with expert parallelism against its dense reference form on the same
workers, measured in the same run.

Setup: moe_tiny (d=128, 4 MoE blocks of 4 SwiGLU experts, top-2, vocab 4096), 4 torch workers
on this machine (examples/clusters/local4.toml: on a 2-core VM the four share two cores), 8
micro-batches of 2 x 64 tokens per step, AdamW, fp32.

- anchors: the dense reference form (`--arg routing=dense`: every expert on every token, the
  gate masks all but the top-k) on the same layout — the same workers, split, batch and data;
- h2x EP: the sparse form with `examples/plans/moe_tiny_ep2.h2plan`'s layout (2 stages, each an
  EP group of 2: each worker holds half the experts, dispatch/combine all-to-alls over shm),
  no token dropped (capacity none: every expert's buffer has a row per token, so it computes
  as many rows as the dense form) — and with capacity 1.25 (GShard's usual factor);
- 1 stage x ep4: four EP ranks holding one expert each;
- the same for 8 experts, top-1 routing (the dense form computes 8 experts per token, the
  sparse one 1.25 token rows per token at capacity 1.25).

Runs alternate for --rounds rounds; medians over the steady-state steps (2..N) of each. Losses
of the EP run and of the dense anchor agree to 1e-5 (tests/test_moe.py), so the ratio is the
same training at a different cost.

    .venv/bin/python bench/bench_moe.py [--steps 8] [--rounds 2]
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

MODEL = str(ROOT / "examples/moe_tiny.py")
CLUSTER = str(ROOT / "examples/clusters/local4.toml")
BATCH = "batch global=16 micro=2 seq=64"


def plan_text(stages: list[str], dp: int, moe: str | None) -> str:
    lines = [f'model "{MODEL}"', f'cluster "{CLUSTER}"', BATCH, f"dp {dp}"]
    lines += [f"stage chip=cpu-torch chips={dp} layers={s}" for s in stages]
    if moe:
        lines.append(moe)
    return "\n".join(lines) + "\n"


# name -> (stages, dp, moe section, model args, anchor): every EP run against the dense
# reference form on the same layout (same workers, split, data: its losses match to 1e-5 when
# no token is dropped)
TOP1 = {"num_experts": 8, "top_k": 1}
CONFIGS = {
    "E4 k2: dense reference, 2 stages x dp2": (["embed, 0..1", "2..3, head"], 2, None, {"routing": "dense"}, None),
    "E4 k2: EP 2 stages x ep2": (["embed, 0..1", "2..3, head"], 2, "moe ep=2", {}, "E4 k2: dense reference, 2 stages x dp2"),
    "E4 k2: EP 2 stages x ep2, capacity 1.25": (["embed, 0..1", "2..3, head"], 2, "moe ep=2 capacity=1.25", {}, "E4 k2: dense reference, 2 stages x dp2"),
    "E4 k2: dense reference, 1 stage x dp4": (["embed, 0..3, head"], 4, None, {"routing": "dense"}, None),
    "E4 k2: EP 1 stage x ep4": (["embed, 0..3, head"], 4, "moe ep=4", {}, "E4 k2: dense reference, 1 stage x dp4"),
    "E8 k1: dense reference, 2 stages x dp2": (["embed, 0..1", "2..3, head"], 2, None, {"routing": "dense", **TOP1}, None),
    "E8 k1: EP 2 stages x ep2": (["embed, 0..1", "2..3, head"], 2, "moe ep=2", TOP1, "E8 k1: dense reference, 2 stages x dp2"),
    "E8 k1: EP 2 stages x ep2, capacity 1.25": (["embed, 0..1", "2..3, head"], 2, "moe ep=2 capacity=1.25", TOP1, "E8 k1: dense reference, 2 stages x dp2"),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    from executor.launcher import run
    from frontend.compiler import compile_model
    quiet = lambda *x, **k: None      # noqa: E731
    with tempfile.TemporaryDirectory(prefix="h2-bench-moe-") as tmp:
        builds = {}
        for i, (name, (stages, dp, moe, args, _)) in enumerate(CONFIGS.items()):
            plan = Path(tmp) / f"p{i}.h2plan"
            plan.write_text(plan_text(stages, dp, moe))
            out = Path(tmp) / f"b{i}"
            compile_model(MODEL, model_args=args, plan_arg=str(plan), out_dir=str(out), log=quiet)
            builds[name] = str(out)
        tps = {name: [] for name in CONFIGS}
        losses = {}
        for _ in range(a.rounds):
            for name, b in builds.items():
                r = run(b, steps=a.steps, out=quiet, predict=False)
                tps[name] += r.tokens_per_s[1:]
                losses[name] = r.losses
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    print(f"moe_tiny, {a.steps} steps x {a.rounds} rounds, 4 torch workers (load average {load})")
    for name, cfg in CONFIGS.items():
        anchor = cfg[4] or name
        med, base = statistics.median(tps[name]), statistics.median(tps[anchor])
        drift = max(abs(x - y) / abs(y) for x, y in zip(losses[name], losses[anchor]))
        print(f"  {name:<42} {med:7.0f} tokens/s  x{med / base:5.2f} of its dense anchor  "
              f"losses vs anchor: max rel diff {drift:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
