"""The planner's predicted MFU on homogeneous A100 and H100 clusters for 7B, 13B and 70B-class
dense models, beside Megatron-LM's published figures.

    .venv/bin/python bench/bench_planner_mfu.py [--chips 64] [--global-batch 512] [--json]

Models are LLaMA-2 shapes by their analytic costs (`analytic_llama_costs`: multi-head
attention, SwiGLU, vocabulary 32,000, sequence 4,096): 7B (32 layers, d 4,096, 32 heads, FFN
11,008), 13B (40, 5,120, 40, 13,824), 70B-class (80, 8,192, 64, 28,672; multi-head attention
where LLaMA-2-70B has grouped-query attention, so 78 B parameters, not 69 B). Clusters: 64 chips
(8 per node) of the catalog's A100-80 (NVLink 300 GB/s, 8 x 200 Gb/s NICs per node) or H100-SXM
(450 GB/s, 8 x 400 Gb/s), bf16. The search is HeteroAuto as `h2c plan --plan auto` runs it.

Two activation widths: "bf16 act." is a program in bf16 (2-byte activations, as Megatron keeps
them); "f32 act." is what h2 runs for a model traced in f32 under its bf16 dtype policy, which
keeps every program value in f32 and casts only the matrix operations' inputs
(backends/torch/runtime.py), so activations and boundary tensors are 4 bytes wide.

MFU = model FLOPs (forward + backward, no recomputation; attention scores counted in full) per
step / (all 64 chips x bf16 peak x predicted step).

Published references (measured, end to end):
  * Megatron-LM repository README (NVIDIA/Megatron-LM, "Performance Benchmarking"): GPT models of
    2B to 462B parameters on H100, sequence 4,096, vocabulary 131,072, with TP/DP/PP
    communication overlap: MFU rises from 41 % for the smallest to 47-48 % for the largest.
  * Korthikanti et al. 2022 ("Reducing activation recomputation", as tabled in the Megatron-LM
    README of that time): A100, sequence 2,048, selective recomputation + sequence parallelism:
    MFU 41.5 % (22B), 51.4 % (175B), 56.0 % (530B), 56.3 % (1T).
  * Narayanan et al. SC'21 (Table 1 and the Megatron-LM README of that time): GPT 1B-1T on A100
    "more than 43 %" of peak, 52 % for the largest; their FLOP count includes the full
    recomputation's extra forward (Sec. 5.1, Eq. 3), so the MFU is about 3/4 of that.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from h2ir.clusters.clusterfile import parse_cluster  # noqa: E402
from h2ir.planner.resource import ResourceModel, analytic_llama_costs  # noqa: E402
from h2ir.planner.search import search  # noqa: E402

MODELS = {   # name: (layers, d, heads, ffn)
    "7B": (32, 4096, 32, 11008),
    "13B": (40, 5120, 40, 13824),
    "70B": (80, 8192, 64, 28672),
}
CHIPS = {    # catalog chip: (intra-node GB/s, NIC Gb/s; 8 NICs per 8-chip node)
    "A100-80": (300, 200),
    "H100-SXM": (450, 400),
}
REFERENCE = {"H100-SXM": "Megatron-LM README: 41-47 % (GPT 2B-462B)",
             "A100-80": "Korthikanti et al. 2022: 41.5 % (22B); SC'21: >43 % HFU"}
VOCAB, SEQ = 32000, 4096


def cluster(chip: str, n: int):
    intra, nic = CHIPS[chip]
    return parse_cluster(f'name = "{chip}x{n}"\ndtype = "bf16"\n[[nodes]]\nchip = "{chip}"\n'
                         f"count = {n // 8}\nchips_per_node = 8\nintra_bw_gbs = {intra}\n"
                         f"nics_per_node = 8\nnic_gbps = {nic}\n", file=f"<{chip}x{n}>")


def one(model: str, chip: str, n: int, gb: int, act_bytes: int) -> dict:
    L, d, h, f = MODELS[model]
    costs = analytic_llama_costs(model, L, d, h, f, VOCAB, SEQ, dtype_bytes=act_bytes)
    cl = cluster(chip, n)
    t0 = time.perf_counter()
    r = search(costs, cl, gb)
    secs = time.perf_counter() - t0
    plan, step = r.plan, r.best.step_time_s
    rm = ResourceModel(costs, cl, plan.micro_batch, plan.seq_len)
    flops = sum(rm.stage_flops(plan, j) for j in range(plan.num_stages)) * plan.num_microbatches * plan.dp
    peak = rm.rates(chip).peak_flops
    tps = sorted({s.tp for s in plan.stages})
    used = sum(s.chips for s in plan.stages)
    return {"model": model, "params_b": costs.total_params / 1e9, "chip": chip, "chips": n,
            "act_bytes": act_bytes, "global_batch": gb, "mfu": flops / (n * peak * step),
            "step_time_s": step, "tp": tps, "pp": plan.num_stages, "dp": plan.dp,
            "micro_batch": plan.micro_batch, "chips_used": used,
            "recompute": sorted({s.recompute for s in plan.stages}),
            "bubble": r.sim.bubble_fraction, "plan": r.best.config.describe() if r.best.config
            else r.best.kind, "exact": r.exact, "search_s": secs}


def megatron_layout(model: str, chip: str, n: int, gb: int, tp: int, pp: int) -> dict:
    """The planner's prediction for a fixed Megatron-style layout: tp x pp x dp = n, the blocks
    split evenly (embedding first, head last), full recomputation where a stage does not fit."""
    from h2ir.planner.resource import stage_memory
    from h2ir.planner.search.uniform import uniform_bounds as _uniform_bounds
    from h2ir.planner.simulate import simulate
    from h2ir.plans.plan import Plan, StagePlan
    L, d, h, f = MODELS[model]
    costs = analytic_llama_costs(model, L, d, h, f, VOCAB, SEQ, dtype_bytes=2)
    cl = cluster(chip, n)
    dp = n // (tp * pp)
    b = _uniform_bounds(costs, pp)
    names = costs.layer_names()
    plan = Plan(model, cl.name, gb, 1, SEQ, [StagePlan(chip, dp * tp, names[b[j]:b[j + 1]], tp=tp)
                                            for j in range(pp)], dp=dp)
    for j, st in enumerate(plan.stages):
        m = stage_memory(costs, plan, cl, j)
        if m.total > m.capacity:
            st.recompute = "full"
    fits = all((lambda m: m.total <= m.capacity)(stage_memory(costs, plan, cl, j))
               for j in range(pp))
    r = simulate(costs, plan, cl, record=False)
    rm = ResourceModel(costs, cl, 1, SEQ)
    flops = sum(rm.stage_flops(plan, j) for j in range(pp)) * plan.num_microbatches * dp
    return {"mfu": flops / (n * rm.rates(chip).peak_flops * r.step_time_s), "fits": fits,
            "recompute": sorted({s.recompute for s in plan.stages}), "step_time_s": r.step_time_s}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chips", type=int, default=64)
    ap.add_argument("--global-batch", type=int, default=512)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    rows = [one(m, c, a.chips, a.global_batch, w) for m in MODELS for c in CHIPS for w in (2, 4)]
    if a.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{a.chips} chips, global batch {a.global_batch} x {SEQ} tokens, bf16; "
          "MFU over all chips (model FLOPs, no recomputation)")
    print(f"{'model':<5} {'params':>7} {'chip':<9} {'act.':<5} {'MFU':>6}  {'tp':<5} {'pp':>3} "
          f"{'dp':>3} {'mb':>3} {'recompute':<10} {'bubble':>6}  {'step':>8}  reference")
    for r in rows:
        print(f"{r['model']:<5} {r['params_b']:>6.1f}B {r['chip']:<9} "
              f"{'bf16' if r['act_bytes'] == 2 else 'f32':<5} {r['mfu'] * 100:>5.1f}%  "
              f"{','.join(map(str, r['tp'])):<5} {r['pp']:>3} {r['dp']:>3} {r['micro_batch']:>3} "
              f"{','.join(r['recompute']):<10} {r['bubble'] * 100:>5.1f}%  {r['step_time_s']:>7.2f}s  "
              f"{REFERENCE[r['chip']]}")
    for chip in CHIPS:
        meg = megatron_layout("70B", chip, a.chips, a.global_batch, 8, a.chips // 8)
        print(f"70B {chip} bf16 act., Megatron's layout tp 8 x pp {a.chips // 8} x dp 1 (even "
              f"split, recompute {','.join(meg['recompute'])}{'' if meg['fits'] else ', DOES NOT FIT'}): "
              f"predicted MFU {meg['mfu'] * 100:.1f}%, step {meg['step_time_s']:.2f} s")
    for r in rows:
        print(f"  {r['model']} {r['chip']} {'bf16' if r['act_bytes'] == 2 else 'f32'} act.: "
              f"{r['plan']} ({r['chips_used']} chips used; search {r['search_s']:.1f} s, "
              f"{'proved optimal' if r['exact'] else 'not proved'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
