"""HeteroAuto on MoE models: a Mixtral-8x22B-class and a DeepSeek-V3-class model on the 1,024-chip,
four-type cluster examples/clusters/moe-1024.toml, against the best homogeneous-EP plan and the
uniform baseline, all found and simulated in the same run.

    .venv/bin/python bench/bench_moe_plan.py [--models mixtral,deepseek] [--global-batch 1024]
                                             [--seq-len 4096] [--json]

Model costs come from the architectures' shapes (`h2ir.planner.resource.analytic_moe_costs`), not
from tracing: a 256-expert, 61-layer model is some 15,000 expert modules, which the meta-device
capture does not trace in seconds. The numbers (published configurations):

  Mixtral-8x22B  56 layers, d 6144, 48 heads (8 KV heads of 128: GQA), 8 experts top-2 of width
                 16384, vocab 32768 (mistralai/Mixtral-8x22B-v0.1 config.json); ~141 B params
  DeepSeek-V3    61 layers, d 7168, 128 heads, MLA (q rank 1536, kv rank 512, head 128 + rope
                 64), first 3 layers dense (FFN 18432), then 256 routed experts top-8 + 1 shared,
                 width 2048, vocab 129280 (DeepSeek-V3 technical report, arXiv 2412.19437,
                 Sec. 4.2); ~671 B params (without the MTP module)

For each model it prints: the search time of HeteroAuto (per-type EP), peak memory of every
stage against its capacity, the chosen plan, its predicted step, tokens/s and MFU, and the same
for the best homogeneous-EP plan (the same search with one EP degree for every stage:
PlanSpace(mixed_ep=False)) and the uniform baseline (one tp, even split, the largest node-local
EP), with the throughput ratios. Every plan is checked by validate_plan.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from h2ir.clusters.clusterfile import load_cluster  # noqa: E402
from h2ir.costs import MoEInfo  # noqa: E402
from h2ir.errors import H2Error  # noqa: E402
from h2ir.plans.dsl import format_plan  # noqa: E402
from h2ir.planner.resource import (ResourceModel, analytic_moe_costs, device_capacity,  # noqa: E402
                                   stage_memory)
from h2ir.planner.divisors import divisors  # noqa: E402
from h2ir.planner.search import PlanSpace, search  # noqa: E402
from h2ir.planner.simulate import simulate  # noqa: E402
from h2ir.planner.validate import validate_plan  # noqa: E402

CLUSTER = ROOT / "examples" / "clusters" / "moe-1024.toml"


def mixtral_8x22b(seq_len: int):
    d, f = 6144, 16384
    attn = 2 * d * d + 2 * d * (8 * 128)            # q, o; k, v of 8 KV heads x 128
    return analytic_moe_costs("mixtral-8x22b", 56, d, 48, 32768, seq_len,
                              MoEInfo(num_experts=8, top_k=2, d_model=d, d_ffn=f, expert_params=0),
                              attn_params=attn)


def deepseek_v3(seq_len: int):
    d = 7168
    # MLA projections: q down (d x 1536), q up (1536 x 128 x 192), kv down (d x (512 + 64)),
    # kv up (512 x 128 x (128 + 128)), out (128 x 128 x d)
    attn = d * 1536 + 1536 * 128 * 192 + d * 576 + 512 * 128 * 256 + 128 * 128 * d
    return analytic_moe_costs("deepseek-v3", 61, d, 128, 129280, seq_len,
                              MoEInfo(num_experts=256, top_k=8, d_model=d, d_ffn=2048, expert_params=0),
                              attn_params=attn, dense_layers=3, dense_ffn=18432, shared_experts=1)


MODELS = {"mixtral": mixtral_8x22b, "deepseek": deepseek_v3}


def describe(plan) -> str:
    parts = []
    for j, s in enumerate(plan.stages):
        parts.append((s.chip, s.tp, plan.stage_ep(j)))
    out = [f"{c}(tp{t},ep{e})x{len(list(g))}" for (c, t, e), g in itertools.groupby(parts)]
    return f"dp={plan.dp} mb={plan.micro_batch} m={plan.num_microbatches} {plan.schedule} " + " > ".join(out)


def mfu(costs, plan, cluster, step: float) -> float:
    """Model FLOPs of the step (no recompute) / (peak of the chips the plan uses x step)."""
    rm = ResourceModel(costs, cluster, plan.micro_batch, plan.seq_len)
    flops = sum(rm.stage_flops(plan, j) for j in range(plan.num_stages)) * plan.num_microbatches * plan.dp
    peak = sum(s.chips * rm.rates(s.chip).peak_flops for s in plan.stages)
    return flops / (peak * step)


def report(name, costs, cluster, plan, sim) -> dict:
    warnings = validate_plan(plan, costs, cluster)
    mems = [stage_memory(costs, plan, cluster, j) for j in range(plan.num_stages)]
    worst = max(mems, key=lambda m: m.total / m.capacity)
    return {"name": name, "plan": describe(plan), "step_s": sim.step_time_s,
            "tokens_per_s": sim.tokens_per_s, "mfu": mfu(costs, plan, cluster, sim.step_time_s),
            "bubble": sim.bubble_fraction, "fits": all(m.total <= m.capacity for m in mems),
            "peak_fill": worst.total / worst.capacity, "peak_gib": worst.total / 2**30,
            "peak_cap_gib": worst.capacity / 2**30, "warnings": warnings,
            "mems": [(s.chip, m.total / 2**30, m.capacity / 2**30) for s, m in zip(plan.stages, mems)],
            "text": format_plan(plan)}


def node_local_bound(costs, cluster, gb: int, seq: int) -> dict:
    """Why node-local EP caps a model on this cluster, from the resource model's own figures.

    The build's placement is replica-major (worker_hosts: replica r takes a type's next chips),
    so a stage's EP group of `ep` replicas shares one node only if the replica uses at most
    cpn/ep chips of that type; and experts divide by EP only (tp replicates them). So one
    replica's chips of a type with `cpn`-chip nodes hold at most max over ep of
    (cpn/ep chips) x floor(capacity / one MoE layer's state at ep) MoE layers, with no room
    left for activations, dense layers or the embedding (an upper bound). The MoE layers the
    small-node types cannot hold fall on the others, whose chips then run at least
    gb x layers / sum(chips / (fwd+bwd of a layer at tp 1, the fastest ep)) per step: a lower
    bound of any node-local plan's step (no bubble, all-reduce or optimizer)."""
    rm = ResourceModel(costs, cluster, 1, seq)
    la = rm.la
    moe = [i for i, l in enumerate(costs.layers) if l.moe is not None]
    E = costs.layers[moe[0]].moe.num_experts
    i = moe[0]
    held, fast = {}, {}
    for c in cluster.chip_types:
        if not cluster.count(c):
            continue
        cpn = min(g.chips_per_node for g in cluster.groups_of(c))
        cap = device_capacity(cluster.chip(c))
        best = (0, 1)
        fits = []                    # the degrees at which one MoE layer's state fits a chip
        for e in divisors(E):
            state = float(la.device(1, e).params[i]) * la.state.total
            if e <= cpn and state <= cap:
                fits.append(e)
                best = max(best, ((cpn // e) * int(cap // state), e))
        held[c] = best
        fast[c] = min((float(np.add(lt.fwd_layer, lt.bwd_layer)[i])
                       for lt in (rm.layer_times(c, 1, e, "flat") for e in fits)), default=math.inf)
    small = {c: h for c, h in held.items() if h[0] < len(moe)}
    rest = len(moe) - sum(h for h, _ in small.values())
    big = [c for c in held if c not in small]
    rate = sum(cluster.count(c) / fast[c] for c in big)
    return {"moe_layers": len(moe), "held_per_replica": {c: {"layers": h, "ep": e} for c, (h, e) in small.items()},
            "rest_on": big, "rest_layers": rest,
            "layer_s": {c: fast[c] for c in big},
            "step_lower_bound_s": gb * max(rest, 0) / rate if rate else float("inf")}


def run_model(key: str, gb: int, seq: int, time_limit: float | None) -> dict:
    cluster = load_cluster(CLUSTER)
    costs = MODELS[key](seq)
    params = sum(l.params for l in costs.layers)
    t0 = time.perf_counter()
    r = search(costs, cluster, gb, seq_len=seq, time_limit=time_limit)
    t_auto = time.perf_counter() - t0
    # the best homogeneous-EP plan (one EP degree for every stage) under the same node-local
    # constraint, and separately with EP groups free to cross nodes (costed over their NICs)
    t0 = time.perf_counter()
    try:
        rh = search(costs, cluster, gb, seq_len=seq, space=PlanSpace(mixed_ep=False), time_limit=time_limit)
    except H2Error:
        rh = None
    t_homo = time.perf_counter() - t0
    rx = search(costs, cluster, gb, seq_len=seq, space=PlanSpace(mixed_ep=False, ep_local=False),
                time_limit=time_limit)
    out = {"model": costs.model, "params": params, "global_batch": gb, "seq_len": seq,
           "search_s": t_auto, "homo_search_s": t_homo, "exact": r.exact, "timed_out": r.timed_out,
           "simulations": r.simulations, "node_local_bound": node_local_bound(costs, cluster, gb, seq)}
    # full simulations (every tp rank) of the plans for the figures
    out["auto"] = report("HeteroAuto (EP per type)", costs, cluster, r.plan,
                         simulate(costs, r.plan, cluster, record=False))
    out["homo_ep"] = None if rh is None else report(
        "homogeneous EP, node-local", costs, cluster, rh.plan, simulate(costs, rh.plan, cluster, record=False))
    out["homo_ep_cross"] = report("homogeneous EP, any node", costs, cluster, rx.plan,
                                  simulate(costs, rx.plan, cluster, record=False))
    out["uniform"] = None if r.uniform is None else report(
        "uniform baseline", costs, cluster, r.uniform.plan,
        simulate(costs, r.uniform.plan, cluster, record=False))
    tok = out["auto"]["tokens_per_s"]
    out["ratio_vs_homo_ep"] = tok / out["homo_ep"]["tokens_per_s"] if out["homo_ep"] else None
    out["ratio_vs_homo_ep_cross"] = tok / out["homo_ep_cross"]["tokens_per_s"]
    out["ratio_vs_uniform"] = tok / out["uniform"]["tokens_per_s"] if out["uniform"] else None
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="mixtral,deepseek")
    ap.add_argument("--global-batch", type=int, default=1024)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--time-limit", type=float, default=None)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    load = open("/proc/loadavg").read().split()[:3] if os.path.exists("/proc/loadavg") else ["?"]
    res = [run_model(k, a.global_batch, a.seq_len, a.time_limit) for k in a.models.split(",")]
    if a.json:
        print(json.dumps({"loadavg": load, "results": res}, indent=1, default=str))
        return
    print(f"cluster moe-1024 (1,024 chips, 4 types); load average {' '.join(load)}")
    for o in res:
        print(f"\n{o['model']} ({o['params'] / 1e9:.1f} B params), global batch {o['global_batch']}, "
              f"seq {o['seq_len']}: search {o['search_s']:.2f} s ({o['simulations']} simulated, "
              f"{'exact' if o['exact'] else 'budget spent' if not o['timed_out'] else 'time limit'}); "
              f"homogeneous-EP search {o['homo_search_s']:.2f} s")
        for k in ("auto", "homo_ep", "homo_ep_cross", "uniform"):
            p = o[k]
            if p is None:
                print(f"  {k:26s} no plan fits")
                continue
            print(f"  {p['name']:26s} step {p['step_s']:7.2f} s  {p['tokens_per_s']:>10,.0f} tok/s  "
                  f"MFU {100 * p['mfu']:5.1f} %  bubble {100 * p['bubble']:4.1f} %  peak stage "
                  f"{p['peak_gib']:.1f} of {p['peak_cap_gib']:.1f} GiB ({'fits' if p['fits'] else 'OVER'})"
                  f"{'  warnings: ' + str(len(p['warnings'])) if p['warnings'] else ''}")
            print(f"    {p['plan']}")
        f = lambda x: "%.3f" % x if x else "n/a (none fits)"
        print(f"  ratio HeteroAuto / homogeneous EP node-local {f(o['ratio_vs_homo_ep'])}, "
              f"/ homogeneous EP any node {f(o['ratio_vs_homo_ep_cross'])}, / uniform {f(o['ratio_vs_uniform'])}")
        nb = o["node_local_bound"]
        held = ", ".join(f"{c} {h['layers']} (ep {h['ep']})" for c, h in nb["held_per_replica"].items())
        if nb["rest_layers"] <= 0:
            print(f"  node-local bound: none (a replica's chips on small nodes could hold all "
                  f"{nb['moe_layers']} MoE layers: {held})")
        else:
            print(f"  node-local bound: of {nb['moe_layers']} MoE layers a replica's chips on small nodes "
                  f"hold at most {held}; the other {nb['rest_layers']} on {', '.join(nb['rest_on'])} "
                  f"(fwd+bwd >= {', '.join('%.1f ms' % (1e3 * v) for v in nb['layer_s'].values())} "
                  f"per layer and micro-batch) take >= {nb['step_lower_bound_s']:.2f} s per step")


if __name__ == "__main__":
    main()
