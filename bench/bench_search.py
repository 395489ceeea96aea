"""HeteroAuto search time and peak memory at 1,024 x 4, 2,048 x 6 and 8,192 x 6 chips x types,
and HeteroSpeedupRatio with its homogeneous baselines' plans.

    .venv/bin/python bench/bench_search.py [--clusters h2-1024,syn-2048x6,syn-8192x6] [--json]
    .venv/bin/python bench/bench_search.py --speedup [--clusters h2-768,h2-1024]

The model is the 100B LLaMA of examples/llama_100b.py (96 blocks, d 8192, 64 heads, SwiGLU 36864,
vocab 32000, seq 4096) by its analytic costs (`analytic_llama_costs`, the same architecture
numbers; --traced uses the frontend's costs of the model file, ~20 s of tracing first), global
batch 1,024. Each cluster is searched in a fresh subprocess, which reports the wall time of
`h2ir.planner.search.search`, its peak resident memory (ru_maxrss, and the process's resident
memory before the search began), and the anchor measured in the same process: one simulation of
the chosen plan's full instruction streams (`simulate`, every tp rank), the unit the final
ranking repeats. Search time is reported as a multiple of it and against the targets (10 s and
2 GiB at 8,192 x 6, 2 s at 1,024 x 4).

h2-1024 is examples/clusters/h2-1024.toml. syn-2048x6 and syn-8192x6 are synthetic (written
here, no cluster file has six types): the four H2 stand-ins of h2-1024 plus an MI300X and a
Gaudi2 type, catalog figures, invented node shapes and counts, stated in `SYNTHETIC`.

--speedup: for each cluster, the HeteroAuto plan at global batch = chips, and at 1,024, then
HeteroSpeedupRatio at the same work per chip and at constant global batch, each homogeneous
baseline's plan printed (H2 reports 109.03 % / 104.29 % for its 3-type / 4-type clusters and
89.56 % / 77.45 % at constant global batch).
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from h2ir.clusters.clusterfile import load_cluster, parse_cluster  # noqa: E402
from h2ir.planner.resource import analytic_llama_costs  # noqa: E402
from h2ir.planner.search import hetero_speedup, search  # noqa: E402
from h2ir.planner.simulate import simulate  # noqa: E402

GLOBAL_BATCH = 1024
TARGETS = {"h2-1024": (2.0, None), "syn-2048x6": (None, None), "syn-8192x6": (10.0, 2.0)}

# six chip types: (name, catalog base, chips per node, intra GB/s, NICs per node, extra fields)
_TYPES = [
    ("Chip-A", "H800", 8, 200, 4, ""),
    ("Chip-B", "H20", 8, 450, 4, ""),
    ("Chip-C", "Ascend-910B", 16, 56, 8, "peak_tflops = { bf16 = 280 }\nmem_bw_gbs = 1600\n"),
    ("Chip-D", "A100-40", 8, 300, 2, ""),
    ("Chip-E", "MI300X", 8, 448, 8, ""),
    ("Chip-F", "Gaudi2", 8, 300, 3, ""),
]
SYNTHETIC = {   # cluster -> chips of each type (invented counts)
    "syn-2048x6": (512, 384, 384, 256, 256, 256),
    "syn-8192x6": (2048, 1536, 1536, 1024, 1024, 1024),
}


def synthetic_cluster(name: str):
    text = [f'name = "{name}"', 'dtype = "bf16"', ""]
    for chip, base, _, _, _, extra in _TYPES:
        text += [f"[chips.{chip}]", f'base = "{base}"', extra]
    for (chip, _, cpn, intra, nics, _), n in zip(_TYPES, SYNTHETIC[name]):
        text += ["[[nodes]]", f'chip = "{chip}"', f"count = {n // cpn}", f"chips_per_node = {cpn}",
                 f"intra_bw_gbs = {intra}", f"nics_per_node = {nics}", "nic_gbps = 200", ""]
    return parse_cluster("\n".join(text), file=f"<{name}>")


def get_cluster(name: str):
    return synthetic_cluster(name) if name in SYNTHETIC else load_cluster(name)


def model_costs(traced: bool):
    if traced:
        from frontend.capture import model_costs as capture_costs
        return capture_costs(str(ROOT / "examples/llama_100b.py"), {}, 1, 4096)
    return analytic_llama_costs("llama_100b", 96, 8192, 64, 36864, 32000, 4096)


def _rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20     # KiB -> GiB


def one(cluster_name: str, traced: bool, gb: int) -> dict:
    """Runs in the subprocess: one search, its anchor, its memory."""
    costs = model_costs(traced)
    cluster = get_cluster(cluster_name)
    rss0 = _rss_gib()
    t0 = time.perf_counter()
    r = search(costs, cluster, gb)
    search_s = time.perf_counter() - t0
    rss = _rss_gib()
    t0 = time.perf_counter()
    simulate(costs, r.plan, cluster, record=False)
    anchor_s = time.perf_counter() - t0
    return {
        "cluster": cluster_name, "chips": cluster.total_chips,
        "types": len([c for c in cluster.chip_types if cluster.count(c)]), "global_batch": gb,
        "search_s": search_s, "anchor_simulate_s": anchor_s, "search_over_anchor": search_s / anchor_s,
        "peak_rss_gib": rss, "rss_before_search_gib": rss0,
        "configs_searched": r.configs_searched, "configs_total": r.configs_total,
        "lines": r.lines, "simulations": r.simulations, "exact": r.exact,
        "stopped_by": r.stopped_by, "search": r.lines_by, "proved_lower_bound_s": r.lower_bound_s,
        "plan": r.best.config.describe() if r.best.config else r.best.kind,
        "step_time_s": r.best.step_time_s, "lower_bound_s": r.best.estimate_s,
        "tokens_per_s": r.best.tokens_per_s, "bubble": r.sim.bubble_fraction,
        "uniform_step_time_s": r.uniform.step_time_s if r.uniform else None,
    }


def run_subprocess(name: str, traced: bool, gb: int) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--one", name, "--global-batch", str(gb)]
    if traced:
        cmd.append("--traced")
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(out.stdout)


def print_row(r: dict) -> None:
    t_s, t_mem = TARGETS.get(r["cluster"], (None, None))
    verdict = []
    if t_s:
        verdict.append(f"target {t_s:g} s: {'met' if r['search_s'] <= t_s else 'MISSED'}")
    if t_mem:
        verdict.append(f"{t_mem:g} GiB: {'met' if r['peak_rss_gib'] <= t_mem else 'MISSED'}")
    print(f"{r['cluster']} ({r['chips']:,} chips, {r['types']} types, global batch {r['global_batch']}): "
          f"search {r['search_s']:.2f} s = {r['search_over_anchor']:.1f}x one simulation "
          f"({r['anchor_simulate_s'] * 1e3:.0f} ms); peak RSS {r['peak_rss_gib']:.2f} GiB "
          f"({r['rss_before_search_gib']:.2f} before the search)" + ("; " + ", ".join(verdict) if verdict else ""))
    unif = f"; uniform {r['uniform_step_time_s']:.2f} s" if r["uniform_step_time_s"] else ""
    print(f"  {r['configs_searched']} of {r['configs_total']} configurations expanded, {r['lines']} lines, "
          f"{r['simulations']} simulated (stopped by {r['stopped_by']}; {r['search']}: "
          f"{'proved optimal' if r['exact'] else 'not proved'}, no plan below "
          f"{r['proved_lower_bound_s']:.2f} s); "
          f"plan {r['plan']}: step {r['step_time_s']:.2f} s (its own bound {r['lower_bound_s']:.2f} s), "
          f"bubble {r['bubble'] * 100:.1f}%{unif}")


def speedup(cluster_name: str, costs, gb: int) -> dict:
    cluster = get_cluster(cluster_name)
    r = search(costs, cluster, gb)
    t0 = time.perf_counter()
    sp = hetero_speedup(costs, cluster, r.best)
    out = {"cluster": cluster_name, "global_batch": gb, "plan": r.best.config.describe(),
           "step_time_s": r.best.step_time_s, "tokens_per_s": r.best.tokens_per_s,
           "ratio": sp.ratio, "ratio_const_batch": sp.ratio_const_batch,
           "homogeneous": {}, "homogeneous_const_batch": {}, "seconds": time.perf_counter() - t0}
    for key, d in (("homogeneous", sp.homo), ("homogeneous_const_batch", sp.homo_const)):
        for c, h in d.items():
            out[key][c] = None if h is None else {
                "global_batch": h["global_batch"], "tokens_per_s": h["tokens_per_s"],
                "step_time_s": h["step_time_s"], "plan": h["config"]}
    return out


def print_speedup(r: dict) -> None:
    h2 = {"h2-768": "109.03% / 89.56%", "h2-1024": "104.29% / 77.45%"}.get(r["cluster"], "n/a")
    print(f"{r['cluster']} at global batch {r['global_batch']}: HeteroAuto {r['plan']}: "
          f"{r['step_time_s']:.2f} s, {r['tokens_per_s']:,.0f} tokens/s")
    ratio = lambda v: f"{v * 100:.2f}%" if v else "n/a"
    print(f"  HeteroSpeedupRatio {ratio(r['ratio'])} (same work per chip), "
          f"{ratio(r['ratio_const_batch'])} (constant global batch); H2 reports {h2}")
    for key, what in (("homogeneous", "same work per chip"), ("homogeneous_const_batch", "constant global batch")):
        for c, h in r[key].items():
            if h is None:
                print(f"    {what:<22} {c}: cannot train the model alone")
            else:
                print(f"    {what:<22} {c}: batch {h['global_batch']}, {h['step_time_s']:.2f} s, "
                      f"{h['tokens_per_s']:,.0f} tokens/s, plan {h['plan']}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--traced", action="store_true")
    ap.add_argument("--clusters")
    ap.add_argument("--global-batch", type=int, default=GLOBAL_BATCH)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--speedup", action="store_true")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(a.one, a.traced, a.global_batch)))
        return 0
    if a.speedup:
        costs = model_costs(a.traced)
        rows = []
        for name in (a.clusters or "h2-768,h2-1024").split(","):
            chips = get_cluster(name).total_chips
            for gb in dict.fromkeys((chips, GLOBAL_BATCH)):
                rows.append(speedup(name, costs, gb))
                if not a.json:
                    print_speedup(rows[-1])
        if a.json:
            print(json.dumps(rows, indent=1))
        return 0
    rows = [run_subprocess(n, a.traced, a.global_batch)
            for n in (a.clusters or "h2-1024,syn-2048x6,syn-8192x6").split(",")]
    if a.json:
        print(json.dumps(rows, indent=1))
    else:
        for r in rows:
            print_row(r)
    ok = all(r["search_s"] <= (TARGETS.get(r["cluster"], (None,))[0] or 1e9) for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
