"""HeteroAuto search time on the H2-like clusters, and what it finds.

    .venv/bin/python bench/bench_search.py [--traced] [--clusters h2-1024,h2-768] [--json]

For each cluster: wall time of `h2ir.planner.search.search` for the 100B model (the part of
`h2c plan examples/llama_100b.py --cluster C --plan auto` after tracing), the predicted step of
the chosen plan and of the uniform baseline, and HeteroSpeedupRatio. The anchor, measured in the
same run, is one simulation of the chosen plan's instruction streams (`h2ir.planner.simulate.simulate`),
the unit of work the final ranking repeats; the search is reported as a multiple of it and
against the 10 s target.

--traced uses the frontend's costs of examples/llama_100b.py (about 20 s of tracing first);
by default the analytic LLaMA costs with the same architecture numbers (they agree with the
traced ones to 0.01% in FLOPs and saved activations).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from h2ir.clusters.clusterfile import load_cluster  # noqa: E402
from h2ir.planner.resource import analytic_llama_costs  # noqa: E402
from h2ir.planner.search import hetero_speedup, search  # noqa: E402
from h2ir.planner.simulate import simulate  # noqa: E402

TARGET_S = 10.0


def model_costs(traced: bool):
    if traced:
        from frontend.capture import model_costs as capture_costs
        return capture_costs(str(ROOT / "examples/llama_100b.py"), {}, 1, 4096)
    return analytic_llama_costs("llama_100b", 96, 8192, 64, 36864, 32000, 4096)


def bench(cluster_name: str, costs) -> dict:
    cluster = load_cluster(cluster_name)
    gb = cluster.total_chips                     # h2c plan's default: one sequence per chip
    t0 = time.perf_counter()
    r = search(costs, cluster, gb)
    search_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    simulate(costs, r.plan, cluster, record=False)
    anchor_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    sp = hetero_speedup(costs, cluster, r.best)
    speedup_s = time.perf_counter() - t0
    return {
        "cluster": cluster_name, "chips": cluster.total_chips, "global_batch": gb,
        "search_s": search_s, "anchor_simulate_s": anchor_s,
        "search_over_anchor": search_s / anchor_s, "under_target": search_s < TARGET_S,
        "configs_searched": r.configs_searched, "configs_total": r.configs_total,
        "plan": r.best.config.describe(), "step_time_s": r.best.step_time_s,
        "tokens_per_s": r.best.tokens_per_s, "bubble": r.sim.bubble_fraction,
        "uniform_step_time_s": r.uniform.step_time_s if r.uniform else None,
        "auto_over_uniform": (r.uniform.step_time_s / r.best.step_time_s) if r.uniform else None,
        "hetero_speedup_ratio": sp.ratio, "hetero_speedup_ratio_const_batch": sp.ratio_const_batch,
        "homogeneous_tokens_per_s": {c: (h["tokens_per_s"] if h else None) for c, h in sp.homo.items()},
        "speedup_s": speedup_s,
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--traced", action="store_true")
    ap.add_argument("--clusters", default="h2-1024,h2-768")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    costs = model_costs(a.traced)
    rows = [bench(c, costs) for c in a.clusters.split(",")]
    if a.json:
        print(json.dumps(rows, indent=1))
        return 0
    for r in rows:
        print(f"{r['cluster']} ({r['chips']} chips, global batch {r['global_batch']}): "
              f"search {r['search_s']:.2f} s = {r['search_over_anchor']:.1f}x one simulation "
              f"({r['anchor_simulate_s'] * 1e3:.0f} ms); target {TARGET_S:.0f} s: "
              f"{'met' if r['under_target'] else 'MISSED'}; "
              f"{r['configs_searched']} of {r['configs_total']} configurations x orders searched")
        print(f"  plan {r['plan']}: step {r['step_time_s']:.2f} s, {r['tokens_per_s']:,.0f} tokens/s, "
              f"bubble {r['bubble'] * 100:.1f}%; uniform {r['uniform_step_time_s']:.2f} s "
              f"(auto {r['auto_over_uniform']:.2f}x faster)")
        homo = ", ".join(f"{c} {v:,.0f}" for c, v in r["homogeneous_tokens_per_s"].items() if v)
        print(f"  HeteroSpeedupRatio {r['hetero_speedup_ratio'] * 100:.2f}% "
              f"(constant global batch: {r['hetero_speedup_ratio_const_batch'] * 100:.2f}%); "
              f"homogeneous tokens/s: {homo}; ratio computed in {r['speedup_s']:.1f} s")
    return 0 if all(r["under_target"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
