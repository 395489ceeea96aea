"""Sparse MoE and expert parallelism executed (frontend/moe.py, executor/experts.py): losses
against the dense reference form and eager transformers, dropped tokens against an independent
count, expert migration (balance, identical losses, resume)."""
import json
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import ROOT
from executor.experts import imbalance, rebalance
from executor.launcher import run
from executor.reference import eager_losses
from frontend.compiler import compile_model
from frontend.moe import experts_modules

MOE_TINY = str(ROOT / "examples/moe_tiny.py")
HF = str(ROOT / "examples/hf/decoders.py")
TORCH4 = str(ROOT / "examples/clusters/local4.toml")
MIXED4 = str(ROOT / "examples/clusters/local-mixed4.toml")
SMALL = {"n_layers": 2, "dim": 64, "ffn": 128, "vocab": 512, "max_seq": 64}

# (name, cluster, dp, stages as (chip, layers), moe line)
CONFIGS = {
    "2 stages x ep2 torch": (TORCH4, 2, [("cpu-torch", "embed, 0"), ("cpu-torch", "1, head")]),
    "2 stages x ep2 torch+numpy": (MIXED4, 2, [("cpu-torch", "embed, 0"), ("cpu-numpy", "1, head")]),
    "1 stage x ep4 torch": (TORCH4, 4, [("cpu-torch", "embed, 0..1, head")]),
    # two EP groups of 2: expert gradients also averaged over the replicas holding them
    "1 stage x dp4 ep2 torch": (TORCH4, 4, [("cpu-torch", "embed, 0..1, head")], 2),
}


def _plan(tmp: Path, model: str, cluster: str, dp: int, stages, moe: str, batch="global=8 micro=2 seq=32",
          ep: int | None = None):
    ep = ep or dp
    text = [f'model "{model}"', f'cluster "{cluster}"', f"batch {batch}", f"dp {dp}"]
    text += [f"stage chip={c} chips={dp} ep={ep} layers={l}" for c, l in stages]
    text.append(moe)
    p = tmp / "plan.h2plan"
    p.write_text("\n".join(text) + "\n")
    return str(p)


def _build(tmp: Path, model: str, args: dict, plan: str) -> str:
    out = tmp / "build"
    compile_model(model, model_args=args, plan_arg=plan, out_dir=str(out), log=lambda *a: None)
    return str(out)


def _run(build: str, steps: int, **kw):
    log = Path(build) / f"log{len(list(Path(build).glob('log*')))}.jsonl"
    res = run(build, steps=steps, json_log=str(log), out=lambda *a: None, predict=False, **kw)
    return res, [json.loads(l) for l in log.read_text().splitlines()]


def _rel(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


# the mixed pipeline runs the other router: sigmoid scores, a shared expert, the aux loss
ROUTER = {"2 stages x ep2 torch+numpy": {"scoring": "sigmoid", "shared": 1, "aux_loss": 0.01}}


def _ep_matches_dense(tmp, name, steps):
    cluster, dp, stages, *ep = CONFIGS[name]
    ep = ep[0] if ep else dp
    plan = _plan(tmp, MOE_TINY, cluster, dp, stages, f"moe ep={ep}", ep=ep)
    build = _build(tmp, MOE_TINY, {**SMALL, **ROUTER.get(name, {})}, plan)
    manifest = json.loads((Path(build) / "manifest.json").read_text())
    assert all(len(w["ep_group"]) == ep for w in manifest["workers"])
    res, log = _run(build, steps)
    dense = eager_losses(build, steps, model_args={"routing": "dense"})
    assert len(res.losses) == steps
    assert _rel(res.losses, dense) <= 1e-5, (res.losses, dense)
    # per-expert loads are logged every step; no token is dropped (capacity none)
    for entry in log:
        assert entry["moe"] and all(m["dropped"] == 0 for m in entry["moe"].values())
        for m in entry["moe"].values():
            assert sum(m["load"]) == 8 * 32 * 2            # tokens x top-2 per step


# the mixed pipeline by default (both backends, EP inside a pipeline); the others in test-slow
FAST = "2 stages x ep2 torch+numpy"


@pytest.mark.parametrize("name", [FAST] + [pytest.param(n, marks=pytest.mark.slow)
                                          for n in CONFIGS if n != FAST])
def test_moe_tiny_expert_parallel_equals_dense_reference(tmp_path, name):
    _ep_matches_dense(tmp_path, name, 3)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_moe_tiny_expert_parallel_equals_dense_reference_20_steps(tmp_path, name):
    _ep_matches_dense(tmp_path, name, 20)


# ---- capacity: dropped tokens against an independent count -------------------------------------

def _loop_experts_forward(counter: dict):
    """An independent capacity MoE: a Python loop over experts and over tokens in order; the
    first C (token, choice) pairs an expert gets are kept, the rest dropped and counted."""
    def forward(self, x, top_k_index, top_k_weights):
        T, k = top_k_index.shape
        E = self.gate_up_proj.shape[0]
        C = max(1, min(T, -(-int(counter["factor"] * T * k) // E)))
        out = torch.zeros_like(x)
        for e in range(E):
            pairs = [(t, j) for t in range(T) for j in range(k) if int(top_k_index[t, j]) == e]
            counter["dropped"] += max(0, len(pairs) - C)
            for t, j in pairs[:C]:
                gate, up = (self.gate_up_proj[e] @ x[t]).chunk(2)
                out[t] = out[t] + top_k_weights[t, j] * (self.down_proj[e] @ (self.act_fn(gate) * up))
        return out
    return forward


def test_capacity_drops_equal_an_independent_count(tmp_path):
    plan = _plan(tmp_path, MOE_TINY, TORCH4, 2, [("cpu-torch", "embed, 0..1, head")],
                 "moe ep=2 capacity=1.0", batch="global=4 micro=2 seq=16")
    args = {**SMALL, "skew": 1.5, "hot": 1}          # a router leaning on expert 0: it overflows
    build = _build(tmp_path, MOE_TINY, args, plan)
    steps = 3
    trace = Path(build) / "trace.json"
    _, log = _run(build, steps, trace=str(trace))
    # the loads are in the trace too, as counter tracks (one per MoE layer and worker)
    counters = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "C"]
    assert len(counters) == steps * 2 * 2           # steps x workers x MoE layers
    last = {e["pid"]: e for e in counters if e["name"].endswith("layers.1.moe.experts")}
    assert [sum(x) for x in zip(*[list(e["args"].values()) for e in last.values()])] == \
        log[-1]["moe"]["layers.1.moe.experts"]["load"]
    counter = {"factor": 1.0, "dropped": 0}

    def prepare(model):
        for _, m in experts_modules(model):
            m.forward = types.MethodType(_loop_experts_forward(counter), m)
    losses = eager_losses(build, steps, prepare=prepare)
    # eager counts accumulate over steps: take the totals, and h2's per-step sums
    h2_dropped = [sum(m["dropped"] for m in e["moe"].values()) for e in log]
    assert counter["dropped"] == sum(h2_dropped) > 0
    assert all(d > 0 for d in h2_dropped)
    assert _rel([e["loss"] for e in log], losses) <= 1e-5
    assert all(m["capacity"] == 16 for e in log for m in e["moe"].values())  # ceil(1.0*32*2/4)


# ---- migration ---------------------------------------------------------------------------------

def test_rebalance_spreads_hot_experts():
    loads = np.array([100, 100, 100, 100] + [1] * 12, dtype=float)     # a rank per hot expert
    start = list(range(16))
    assert imbalance(loads, start, 4) > 3.5
    new = rebalance(loads, start, 4)
    assert sorted(new) == start and imbalance(loads, new, 4) < 1.05


# 64 experts, the first 16 made hot: contiguous placement puts all 16 on EP rank 0 of 4; a good
# placement gives every rank four of them. (Their loads differ — the router's own logits order
# them — so each rank needs several for the sums to even out.)
SKEWED = {**SMALL, "num_experts": 64, "skew": 4.0, "hot": 16, "n_layers": 1}


def _migration_build(tmp: Path, migration: str) -> str:
    plan = _plan(tmp, MOE_TINY, TORCH4, 4, [("cpu-torch", "embed, 0, head")],
                 f"moe ep=4 migration={migration}", batch="global=16 micro=2 seq=32")
    return _build(tmp, MOE_TINY, SKEWED, plan)


def test_migration_balances_a_skewed_router_and_keeps_losses(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    steps = 6
    plain = _migration_build(tmp_path / "a", "none")
    # check every step, move when a layer's max/mean passes 1.1 (the router keeps learning:
    # loads drift from step to step)
    moved = _migration_build(tmp_path / "b", "periodic(1) threshold=1.1")
    _, log_a = _run(plain, steps)
    res_b, log_b = _run(moved, steps, checkpoint_every=3)
    ra = [next(iter(e["moe"].values()))["rank_imbalance"] for e in log_a]
    rb = [next(iter(e["moe"].values()))["rank_imbalance"] for e in log_b]
    assert min(ra) >= 2.5, ra
    assert "migrated" in next(iter(log_b[0]["moe"].values()))    # at the end of step 1
    assert max(rb[1:]) <= 1.3, rb
    assert [e["loss"] for e in log_a] == [e["loss"] for e in log_b]     # placement only
    # resume from step 3 (after the migration): the same losses as the uninterrupted run
    import shutil
    ckpts = sorted((Path(moved) / "ckpt").glob("step_*"))
    assert len(ckpts) == 2
    shutil.rmtree(ckpts[-1])                 # keep the checkpoint of step 3 only
    res_c, log_c = _run(moved, steps, resume=True)
    assert [e["loss"] for e in log_c] == [e["loss"] for e in log_b[3:]]
    assert next(iter(log_c[0]["moe"].values()))["placement"] == \
        next(iter(log_b[3]["moe"].values()))["placement"]


# ---- transformers MoE families -----------------------------------------------------------------

@pytest.mark.slow          # ~12 s each: the transformers MoE families in make test-slow
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe",
                                    "deepseek_v3"])
def test_transformers_moe_with_ep2_matches_eager(tmp_path, family):
    pytest.importorskip("transformers")
    plan = _plan(tmp_path, HF, TORCH4, 2, [("cpu-torch", "embed, 0"), ("cpu-torch", "1, head")],
                 "moe ep=2")
    build = _build(tmp_path, HF, {"family": family}, plan)
    res, _ = _run(build, 3)
    assert _rel(res.losses, eager_losses(build, 3)) <= 1e-5


def test_halo_all_to_all_and_round_robin_placement_are_honoured(tmp_path):
    """a2a=halo over the hosts of a 2-node cluster file (the run is on this machine; HALO
    aggregates by the manifest's hosts) and round-robin placement: the same losses."""
    cluster = str(ROOT / "examples/clusters/testbed-2host.toml")
    plan = _plan(tmp_path, MOE_TINY, cluster, 4, [("cpu-torch", "embed, 0..1, head")],
                 "moe ep=4 a2a=halo placement=round_robin")
    args = {**SMALL, "num_experts": 8}
    build = _build(tmp_path, MOE_TINY, args, plan)
    manifest = json.loads((Path(build) / "manifest.json").read_text())
    assert [w["host"] for w in manifest["workers"]] == [0, 0, 1, 1]
    assert manifest["stages"][0]["moe"]["experts"]["layers.0.moe.experts"]["placement"] == \
        [0, 4, 1, 5, 2, 6, 3, 7]
    res, log = _run(build, 3)
    assert log[0]["moe"]["layers.0.moe.experts"]["placement"] == [0, 4, 1, 5, 2, 6, 3, 7]
    # every worker ran its 2 layers x (2 forward + 2 backward) exchanges per micro-batch as HALO
    assert all(a["algo"] == "halo" and a["calls"] == 2 * 4 * 1 and a["bytes"] > 0
               for a in log[-1]["a2a"].values()) and len(log[-1]["a2a"]) == 4
    assert _rel(res.losses, eager_losses(build, 3, model_args={"routing": "dense"})) <= 1e-5


@pytest.mark.slow          # ~40 s: --plan auto measures both forms' layer times
def test_plan_auto_uses_expert_parallelism_only_for_sparse_experts(tmp_path):
    """--plan auto may choose ep > 1 for a model whose experts h2 runs sparsely; a dense-form
    MoE (routing=dense: no experts module) gets a plan without a 'moe' section."""
    from h2ir.plans.dsl import load_plan
    got = {}
    for routing in ("sparse", "dense"):
        out = tmp_path / routing
        compile_model(MOE_TINY, model_args={**SMALL, "routing": routing}, cluster_arg=TORCH4,
                      plan_arg="auto", global_batch=8, seq_len=32, out_dir=str(out),
                      log=lambda *a: None)
        got[routing] = load_plan(out / "plan.h2plan")
    assert got["dense"].moe is None
    assert got["sparse"].moe is not None
    assert all(got["sparse"].dp % got["sparse"].stage_ep(j) == 0
               for j in range(got["sparse"].num_stages))
