"""Resource model: memory per device, compute and communication time per stage.

The planner (`h2ir/planner/search.py`), the simulator (`h2ir/planner/simulate.py`) and the validator
(`h2ir/planner/validate.py`) all cost a plan through this module, so a number printed by one agrees with
the others. Every formula cites where it comes from.

Units: bytes, seconds, FLOP, FLOP/s, B/s. "Per device" means one chip: a stage's `chips` are
dp * tp chips, and each holds 1/tp of the stage's dense parameters and activations.

Model-state accounting (bytes per parameter, per device, before dividing by TP):

    dtype     weights  grads  optimizer                     total
    bf16/fp16    2       2    12 (fp32 master, m, v)          16   mixed-precision Adam,
                                                                   ZeRO (Rajbhandari et al. 2020) Sec. 3.1
    fp32         4       4     8 (m, v)                       16   fp32 AdamW (the CPU backends)

The planning issue quotes "12 B/param for fp32 AdamW": that is the persistent state
(weights 4 + m 4 + v 4). We also count the 4 B/param gradient buffer as its own item, because
under 1F1B it is live from the first backward until `opt_step`, i.e. for most of the step, so a
device that only fits 12 B/param would run out of memory in the middle of the step. A ZeRO-1
stage (`zero=1`) keeps 1/dp of the optimizer column on each replica (`stage_memory`).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from h2ir.clusters.cluster import ChipType, Cluster, NodeGroup
from h2ir.costs import LayerCost, ModelCosts, MoEInfo
from h2ir.errors import H2Error
from h2ir.plans.plan import Plan
from h2ir.planner import alltoall
from h2ir.planner.calibration import colocation_key
from h2ir.plans.plan import VIRTUAL_SCHEDULES
from h2ir.schedule.streams import WorkerLayout, chunk_orders, chunk_stages, worker_hosts

DTYPE_BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1}


def dtype_bytes(dtype: str) -> int:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise H2Error(f"unknown training dtype {dtype!r} (expected one of: {', '.join(DTYPE_BYTES)})")


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of model state, split the way MemoryBreakdown reports it."""
    weights: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer


def state_bytes_per_param(dtype: str) -> StateBytes:
    if dtype_bytes(dtype) == 4:
        # fp32 AdamW: weights + two moments = 12 B persistent, + 4 B gradient buffer.
        return StateBytes(weights=4, grads=4, optimizer=8)
    # Mixed-precision Adam, ZeRO Sec. 3.1: 2 (half weights) + 2 (half grads) + K=12
    # (fp32 master weights, momentum, variance).
    return StateBytes(weights=2, grads=2, optimizer=12)


# ----------------------------------------------------------------------------------------------
# costs at the plan's micro-batch and sequence length

def costs_at(costs: ModelCosts, micro_batch: int, seq_len: int) -> ModelCosts:
    """Per-micro-batch costs at another micro-batch size / sequence length.

    Micro-batch scaling is exact (every term is linear in it, `ModelCosts.scaled`). Sequence
    length scaling is linear in tokens, which under-counts attention's s^2 score term; the CLI
    therefore captures the model at the plan's sequence length and this path is a fallback.
    """
    # memoised on the object (the search asks once per stage of every candidate plan); the hit
    # must be the same object, not a reused id
    key = (id(costs), micro_batch, seq_len)
    hit = _COSTS_AT.get(key)
    if hit is not None and hit[0] is costs:
        return hit[1]
    if len(_COSTS_AT) > 256:
        _COSTS_AT.clear()
    c = _COSTS_AT[key] = (costs, _costs_at(costs, micro_batch, seq_len))
    return c[1]


_COSTS_AT: dict = {}


def _costs_at(costs: ModelCosts, micro_batch: int, seq_len: int) -> ModelCosts:
    c = costs.scaled(micro_batch)
    if seq_len and c.seq_len and seq_len != c.seq_len:
        r = seq_len / c.seq_len
        layers = tuple(dataclasses.replace(
            l, fwd_flops=int(l.fwd_flops * r), bwd_flops=int(l.bwd_flops * r),
            act_saved_bytes=int(l.act_saved_bytes * r), out_bytes=int(l.out_bytes * r),
            act_selective_bytes=None if l.act_selective_bytes is None
            else int(l.act_selective_bytes * r))
            for l in c.layers)
        c = dataclasses.replace(c, seq_len=seq_len, layers=layers)
    return c


# ----------------------------------------------------------------------------------------------
# collectives: pure formulas

def ring_allreduce_time(nbytes: float, n: int, bw: float, latency: float) -> float:
    """Ring all-reduce: 2(n-1)/n * bytes / bw (Patarasuk & Yuan 2009, Sec. 3), plus 2(n-1)
    message latencies (reduce-scatter then all-gather, Thakur et al. 2005 Sec. 4)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * latency


def hierarchical_allreduce_time(nbytes: float, per_node: int, nodes: int, intra_bw: float,
                                inter_bw: float, intra_latency: float, inter_latency: float) -> float:
    """Two-level all-reduce: intra-node reduce-scatter, inter-node ring on each 1/per_node shard
    (all shards in parallel, each over its chip's NIC share), intra-node all-gather.
    (Hierarchical/2D all-reduce as in Jia et al. 2018 "Highly scalable DL training system with
    mixed-precision", Sec. 3.3; Thakur et al. 2005 for the reduce-scatter/all-gather halves.)"""
    if per_node * nodes <= 1 or nbytes <= 0:
        return 0.0
    k, N = per_node, nodes
    rs = (k - 1) / k * nbytes / intra_bw + (k - 1) * intra_latency
    inter = ring_allreduce_time(nbytes / k, N, inter_bw, inter_latency)
    return 2 * rs + inter


def all_to_all_flat_time(nbytes: float, n: int, per_node: int, intra_bw: float, inter_bw: float,
                         intra_latency: float, inter_latency: float) -> float:
    """Flat all-to-all: every device sends 1/n of its `nbytes` to each of the n-1 others directly.
    The (n - per_node)/n share that leaves the node goes over the NIC share, the rest over the
    intra-node links, concurrently; one message per peer."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    k = min(per_node, n)
    intra = (k - 1) / n * nbytes / intra_bw
    inter = (n - k) / n * nbytes / inter_bw
    lat = (k - 1) * intra_latency + (n - k) * inter_latency
    return max(intra, inter) + lat


def all_to_all_halo_time(nbytes: float, n: int, per_node: int, intra_bw: float, inter_bw: float,
                         intra_latency: float, inter_latency: float) -> float:
    """Hierarchical (HALO-style) all-to-all: intra-node gather so each chip holds the tokens of
    its node bound for one remote node, one aggregated exchange per node pair, intra-node scatter.
    The inter-node bytes are the same as flat, but N-1 large messages replace n-k small ones, and
    the two intra-node phases are added (Piper arXiv 2605.05049, hierarchical all-to-all)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    k = min(per_node, n)
    N = max(1, math.ceil(n / k))
    if N == 1:
        return all_to_all_flat_time(nbytes, n, per_node, intra_bw, inter_bw, intra_latency, inter_latency)
    local = (k - 1) / k * nbytes / intra_bw + (k - 1) * intra_latency
    inter = (N - 1) / N * nbytes / inter_bw + (N - 1) * inter_latency
    return 2 * local + inter


@dataclass(frozen=True)
class PiperMoEMemory:
    attention_state: float
    expert_state: float
    expert_activations: float


def piper_moe_memory(moe: MoEInfo, micro_batch: int, seq_len: int, ep: int) -> PiperMoEMemory:
    """Piper (arXiv 2605.05049) per-device memory terms of one MoE block, bf16 mixed precision:
    attention state 64*d^2 (4d^2 params x 16 B), expert state 48*E*d*d_ffn/EP (3*d*d_ffn params
    per SwiGLU expert x 16 B), expert activations 2*b*s*k*(3*d_ffn + d)/EP (bf16 elements of
    the routed tokens' expert intermediates)."""
    d, f, E, k = moe.d_model, moe.d_ffn, moe.num_experts, moe.top_k
    return PiperMoEMemory(
        attention_state=64.0 * d * d,
        expert_state=48.0 * E * d * f / ep,
        expert_activations=2.0 * micro_batch * seq_len * k * (3 * f + d) / ep)


# ----------------------------------------------------------------------------------------------
# memory

@dataclass
class MemoryBreakdown:
    capacity: int                      # bytes per device
    items: dict = field(default_factory=dict)   # name -> bytes per device
    inflight: int = 0                  # micro-batches whose activations are held at the peak

    @property
    def total(self) -> int:
        return int(sum(self.items.values()))

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity

    def __str__(self) -> str:
        parts = ", ".join(f"{k} {_gib(v)}" for k, v in self.items.items() if v)
        return f"{_gib(self.total)} of {_gib(self.capacity)} ({parts})"


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def inflight_microbatches(schedule: str, stage: int, num_stages: int, m: int,
                          virtual: int = 1) -> int:
    """Micro-batches whose activations stage `stage` holds at its peak: S - j under 1F1B
    (Narayanan et al. SC'21 Sec. 2.2: stage j does S-j warm-up forwards before its first
    backward), all m under GPipe (Huang et al. 2019 Sec. 2.2). With a virtual-stage schedule
    `stage` is a chunk of `num_stages` (all chunks) and the count is read off the schedule's
    order (`chunk_inflight`)."""
    if schedule == "gpipe":
        return m
    if schedule in VIRTUAL_SCHEDULES:
        return chunk_inflight(schedule, num_stages // virtual, virtual, m)[stage]
    return max(1, min(num_stages - stage, m))


@lru_cache(maxsize=256)
def chunk_inflight(schedule: str, S: int, V: int, m: int) -> tuple[int, ...]:
    """Per virtual stage, the most micro-batches whose activations its chunk holds at once
    under the schedule's order (a forward adds one, its backward or weight-gradient part ends
    it)."""
    vst = chunk_stages(schedule, S, V)
    peak = [1] * (S * V)
    for s, order in enumerate(chunk_orders(schedule, S, V, m)):
        n = [0] * V
        for kind, _, c in order:
            n[c] += 1 if kind == "F" else -1 if kind in ("B", "W") else 0
            peak[vst[s][c]] = max(peak[vst[s][c]], n[c])
    return tuple(peak)


class LayerArrays:
    """Per-layer numbers of a model at one micro-batch/sequence length, as arrays, with prefix
    sums so that any contiguous layer range is costed in O(1) (the search needs this)."""

    def __init__(self, costs: ModelCosts, cluster_dtype: str):
        self.costs = costs
        self.layers = costs.layers
        self.L = len(costs.layers)
        # Saved activations and boundary tensors keep the program's (traced) dtype whatever the
        # cluster's training dtype: the torch backend's bf16 policy casts only the inputs of the
        # matrix ops and returns f32 (backends/torch/runtime.py, `dtype_policy`), and numpy
        # computes in the traced dtype; the cluster dtype sets the matmul rate, not these bytes.
        self.act_scale = 1.0
        self.act_width = max(1, costs.dtype_bytes)          # bytes per activation element
        self.state = state_bytes_per_param(cluster_dtype)
        self.grad_bytes = self.state.grads
        a = lambda f: np.array([f(l) for l in self.layers], dtype=np.float64)
        self.params = a(lambda l: l.params)
        self.expert_params = a(lambda l: (l.moe.num_experts * l.moe.expert_params) if l.moe else 0)
        self.dense_params = self.params - self.expert_params
        self.fwd_flops = a(lambda l: l.fwd_flops)
        self.bwd_flops = a(lambda l: l.bwd_flops)
        self.act = a(lambda l: l.act_saved_bytes) * self.act_scale
        # under selective recomputation (h2ir/recompute.py), as a fraction of `act`
        self.sel_frac = np.divide(a(lambda l: l.selective_bytes()), a(lambda l: l.act_saved_bytes),
                                  out=np.ones(self.L), where=self.act > 0)
        self.out = a(lambda l: l.out_bytes) * self.act_scale
        # Expert activations of the routed tokens at EP=1 (Piper's term, in the cluster dtype):
        # the part of act_saved_bytes that expert parallelism divides.
        b, s = costs.micro_batch, costs.seq_len
        bpe = self.act_width
        self.expert_act = a(lambda l: (bpe * b * s * l.moe.top_k * (3 * l.moe.d_ffn + l.moe.d_model))
                            if l.moe else 0.0)
        self.expert_act = np.minimum(self.expert_act, self.act)
        self.is_block = np.array([l.kind in ("transformer_block", "moe_block") for l in self.layers])
        self.is_embed = np.array([l.kind == "embedding" for l in self.layers])
        self.act_rep = self._tp_replicated()
        self.names = [l.name for l in self.layers]
        self._dev: dict = {}

    def _tp_replicated(self) -> np.ndarray:
        """Per layer, the saved-activation bytes every TP rank keeps whole: tensor parallelism
        without sequence parallelism (frontend/tensor_parallel.py: column/row-parallel linears,
        attention by heads, an all-reduce back to a replicated residual stream) divides the
        attention and MLP internals by t, but not the norms' inputs and outputs (the residual
        stream entering each sub-block and the first linear's input): Korthikanti et al. 2022
        Sec. 4.2.1, Eq. 2, the 10sbh of sbh(10 + 24/t + 5as/ht) — LayerNorm inputs 4sbh, QKV and
        MLP inputs 2sbh each in 16 bit, dropout masks 2sbh. A pre-norm block keeps 4 tensors of
        its b*s*d output's size replicated (no dropout in the traced models); the head its final
        norm's input and output (the logits are vocabulary-parallel); other layers (embedding)
        run replicated."""
        rep = np.array(self.act)
        prev_out = 0.0
        for i, l in enumerate(self.layers):
            if self.is_block[i]:
                rep[i] = min(self.act[i] - self.expert_act[i], 4.0 * self.out[i])
            elif l.kind == "head":
                rep[i] = min(self.act[i], 2.0 * prev_out)
            prev_out = self.out[i]
        return rep

    def device(self, tp: int, ep: int = 1, capacity: float | None = None) -> "DeviceArrays":
        key = (tp, ep, capacity)
        if key not in self._dev:
            self._dev[key] = DeviceArrays(self, tp, ep, capacity)
        return self._dev[key]


def _prefix(x: np.ndarray) -> list:
    return np.concatenate([[0.0], np.cumsum(x)]).tolist()


class DeviceArrays:
    """Per-device memory arrays for TP degree `tp` and expert-parallel degree `ep`."""

    def __init__(self, la: LayerArrays, tp: int, ep: int, capacity: float | None = None):
        self.tp, self.ep = tp, ep
        # Dense parameters split over TP (Megatron-LM, Shoeybi et al. 2019 Sec. 3); experts split
        # over EP (Piper: expert state / EP).
        self.params = la.dense_params / tp + la.expert_params / ep
        # Activations: tensor parallelism without sequence parallelism (what h2 runs) divides
        # the attention / MLP internals by t and keeps the norms' inputs and outputs whole on
        # every rank (`LayerArrays.act_rep`; Korthikanti et al. 2022 Sec. 4.2.1); routed-expert
        # activations divide by EP instead (Piper). With a capacity factor F (`moe capacity=F`)
        # every expert's buffer is padded to F x its even share of the routed tokens (GShard,
        # Lepikhin et al. 2020 Sec. 2.2), so the term scales by F; without one (no token
        # dropped) it is the even share, Piper's k/EP.
        self.act = (la.act_rep + (la.act - la.expert_act - la.act_rep) / tp
                    + la.expert_act * (capacity or 1.0) / ep)
        # A layer's input and output (the residual stream) are whole on every TP rank: the
        # all-reduce ends each block replicated, so full recomputation's kept inputs and the
        # p2p receive buffers are not divided by t (Korthikanti et al. Sec. 4.2.1 / Table 2:
        # full recompute keeps 2sbhL without sequence parallelism, 2sbhL/t with it).
        self.out = la.out
        self.P_params = _prefix(self.params)
        self.P_act = _prefix(self.act)
        self.act_sel = self.act * la.sel_frac
        self.P_act_sel = _prefix(self.act_sel)
        self.L = la.L
        self.P_out = _prefix(self.out)
        # the logits a rank holds for the loss: TP makes the head and the loss vocabulary-
        # parallel (frontend/tensor_parallel.py); that log-softmax's backward is decomposed into
        # three logits-sized tensors where the fused one holds two
        self.logits = (la.out[-1] / tp) if la.L else 0.0
        self.loss_bwd = 3.0 if tp > 1 else 2.0
        self.grad = self.params * la.grad_bytes
        self.P_grad = _prefix(self.grad)
        self._terms: dict = {}

    def transient(self, mode: str) -> np.ndarray:
        """Per layer, what its backward creates beyond the saved activations: the values
        recomputation re-makes (selective: those it dropped; full: all of the layer's) and, for
        the model's last layer, the loss's backward, which holds the gradients of the
        log-probabilities and of the logits at once (full: the log-probabilities re-made too)."""
        t = {"none": np.zeros(self.L), "selective": self.act - self.act_sel,
             "full": self.act.copy()}[mode]
        if self.L:
            t[-1] += (self.loss_bwd + (mode == "full")) * self.logits
        return t

    def memory_terms(self, mode: str) -> tuple[np.ndarray, np.ndarray]:
        """(fixed, per_mb), L x L: a stage of layers [a, b) under recomputation `mode` holds
        fixed[a, b-1] + inflight * per_mb[a, b-1] bytes besides its weights, gradients and
        optimizer state (the search reads these; `memory_items` itemises them)."""
        t = self.terms(mode)
        return t["p2p_buffers"] + t["backward_working_set"], t["activations"] + t["loss"]

    def terms(self, mode: str) -> dict:
        """Each term of `memory_terms`, L x L ([a, b-1] for layers [a, b); 0 where b <= a):
        per micro-batch `activations` and `loss`, fixed `p2p_buffers` and
        `backward_working_set`."""
        if mode not in self._terms:
            L = self.L
            a = np.arange(L)[:, None]
            b = np.arange(1, L + 1)[None, :]
            out, Pout = self.out, np.asarray(self.P_out)
            last = b == L
            into = np.where(a > 0, out[np.maximum(a - 1, 0)], 0.0)   # the stage's input
            if mode == "full":
                # Full recomputation (Chen et al. 2016; Korthikanti et al. 2022 Sec. 4.1): each
                # layer's input is kept — the stage's, then layers a..b-2's outputs; the layer's
                # backward re-makes the rest (`transient`)
                act = into + Pout[np.maximum(b - 1, a)] - Pout[a]
                loss = np.zeros((L, L))
            else:
                P = np.asarray(self.P_act_sel if mode == "selective" else self.P_act)
                act = P[b] - P[a]
                # the loss, a cross-entropy over the logits (h2's default, every causal LM's):
                # it saves log-probabilities the size of the logits per micro-batch
                loss = np.where(last, self.logits, 0.0) + np.zeros((L, L))
            # receive buffers: the incoming boundary activation and the incoming output gradient
            p2p = into + np.where(last, 0.0, out[b - 1])
            # the backward's peak beyond what is held: walking layers b-1 .. a, the parameter
            # gradients made so far (the program returns them together) plus the layer's own
            # transient, or all of the stage's gradients at the end
            Pg = np.asarray(self.P_grad)
            u = self.transient(mode) - Pg[1:]
            umax = np.full((L, L), -np.inf)
            for i in range(L):
                umax[i, i:] = np.maximum.accumulate(u[i:])
            ws = Pg[b] + np.maximum(umax, -Pg[a])
            empty = b <= a
            self._terms[mode] = {k: np.where(empty, 0.0, v) for k, v in (
                ("activations", act), ("loss", loss), ("p2p_buffers", p2p),
                ("backward_working_set", ws))}
        return self._terms[mode]


def memory_items(la: LayerArrays, dev: DeviceArrays, a: int, b: int, inflight: int,
                 recompute: str) -> dict:
    """Per-device bytes of a stage that holds layers [a, b) at the peak of a backward (1F1B's
    steady state: every in-flight micro-batch's saved activations held)."""
    p = dev.P_params[b] - dev.P_params[a]
    st = la.state
    items = {"weights": p * st.weights, "grads": p * st.grads, "optimizer": p * st.optimizer}
    terms = {k: float(v[a, b - 1]) for k, v in dev.terms(recompute).items()}
    items["activations"] = inflight * terms["activations"]
    if terms["loss"]:
        items["loss"] = inflight * terms["loss"]
    items["p2p_buffers"] = terms["p2p_buffers"]
    items["backward_working_set"] = terms["backward_working_set"]
    return {k: int(v) for k, v in items.items()}


def zero_optimizer_bytes(nbytes, dp: int):
    """A ZeRO-1 replica's optimizer state when zero=0's is `nbytes` (an int, or a float array:
    the search's per-range tables): Rajbhandari et al. SC'20, Sec. 5.1, P_os, each replica keeps
    the state of its 1/dp shard of the stage's parameters, rounded up (executor/zero.py: shards
    differ by at most one element)."""
    return -(-nbytes // dp)


def stage_layer_range(plan: Plan, stage_index: int, names: list[str]) -> tuple[int, int]:
    """The stage's layers as a contiguous index range [a, b) into the model's layer list."""
    st = plan.stages[stage_index]
    idx = sorted(names.index(n) for n in st.layers if n in names)
    if not idx or len(idx) != len(st.layers):
        missing = [n for n in st.layers if n not in names]
        raise H2Error(f"stage {stage_index} names layers the model does not have: {missing[:5]}",
                      file=plan.source, line=st.line or None)
    a, b = idx[0], idx[-1] + 1
    if b - a != len(idx):
        raise H2Error(f"stage {stage_index}'s layers are not contiguous ({st.layers[0]}..{st.layers[-1]})",
                      file=plan.source, line=st.line or None)
    return a, b


def _capacity_of(plan: Plan) -> float | None:
    return getattr(plan.moe, "capacity", None) if plan.moe else None


@lru_cache(maxsize=64)
def _layer_arrays_cached(costs: ModelCosts, dtype: str) -> LayerArrays:
    return LayerArrays(costs, dtype)


def layer_arrays(costs: ModelCosts, plan: Plan, cluster: Cluster) -> LayerArrays:
    return _layer_arrays_cached(costs_at(costs, plan.micro_batch, plan.seq_len), cluster.dtype)


def stage_memory(costs: ModelCosts, plan: Plan, cluster: Cluster, stage_index: int,
                 inflight: int | None = None) -> MemoryBreakdown:
    """Peak bytes per device of stage `stage_index` (weights, gradients, optimizer states,
    in-flight activations). `inflight` overrides the schedule's count (the simulator passes
    the count it tracked from the instruction stream)."""
    la = layer_arrays(costs, plan, cluster)
    st = plan.stages[stage_index]
    a, b = stage_layer_range(plan, stage_index, la.names)
    dev = la.device(st.tp, plan.stage_ep(stage_index), _capacity_of(plan))
    if inflight is None:
        inflight = inflight_microbatches(plan.schedule, stage_index, plan.num_stages,
                                         plan.num_microbatches, virtual=plan.virtual)
    chip = cluster.chip(st.chip)
    items = memory_items(la, dev, a, b, inflight, st.recompute)
    if plan.virtual == 1 and plan.num_microbatches == 1:
        # one micro-batch: the gradients its backward returns are the step's sums (in the
        # backward working set), not a second copy
        items["grads"] = 0
    elif plan.virtual == 1 and inflight >= plan.num_microbatches > 1:
        # every micro-batch's forward runs before the first backward (GPipe, or 1F1B with
        # m <= S - j): the step's gradient sums first exist once that backward has released
        # its micro-batch's activations
        per_mb = (items["activations"] + items.get("loss", 0)) / inflight
        items["grads"] = int(max(0.0, items["grads"] - per_mb))
    if st.zero and plan.dp > 1:
        items["optimizer"] = zero_optimizer_bytes(items["optimizer"], plan.dp)
    copies = tied_copy_bytes(costs, plan, stage_index)
    if copies:     # a copy of a tied parameter: weights and a gradient buffer, no optimizer state
        items["tied_copies"] = int(copies * (la.state.weights + la.state.grads) / st.tp)
    scores = attention_score_bytes(la, chip, st.tp, a, b)
    if scores:
        # without recomputation every in-flight micro-batch keeps every block's scores; with
        # either recomputation (both re-make the attention core) only the re-run block has them
        nb = max(1, int(la.is_block[a:b].sum()))
        items["attention_scores"] = int(scores / nb if st.recompute != "none" else scores * inflight)
    return MemoryBreakdown(capacity=device_capacity(chip), items=items, inflight=inflight)


def device_capacity(chip: ChipType) -> int:
    """Bytes a plan may fill on one chip: its memory less the headroom the cluster file states
    (runtime context, communication buffers, fragmentation; `ChipType.usable_mem_bytes`)."""
    return int(chip.usable_mem_bytes)


def attention_score_bytes(la: "LayerArrays", chip: ChipType, tp: int, a: int, b: int) -> float:
    """Per device, one micro-batch: the s x s attention scores that blocks [a, b) keep for
    backward on a chip without a fused attention kernel. Traced costs assume a fused kernel
    (SDPA saves only its output and log-sum-exp); an unfused softmax(QK^T)V saves the softmax
    output, b * heads * s^2 elements per block (Korthikanti et al. 2022, Sec. 4.1: the 2as^2b
    bytes of the softmax output in 16-bit; the dropout mask and its output are absent at p = 0),
    split over TP by heads."""
    if chip.fused_attention or not la.costs.n_heads:
        return 0.0
    c = la.costs
    per_block = c.micro_batch * c.n_heads * c.seq_len ** 2 * la.act_width
    return float(la.is_block[a:b].sum()) * per_block / tp


def tied_copy_bytes(costs: ModelCosts, plan: Plan, stage_index: int) -> int:
    """Bytes (as traced) of tied parameters stage `stage_index` holds a copy of: read by one of
    its layers, owned by a layer of another stage (h2ir/schedule/streams.py)."""
    mine = set(plan.stages[stage_index].layers)
    return sum(t.nbytes for t in costs.ties
               if t.owner not in mine and any(u in mine for u in t.users))


def tied_exchange_bytes(costs: ModelCosts, plan: Plan, stage_index: int) -> int:
    """Bytes of tied parameters stage `stage_index` exchanges per step in each direction: those
    it holds a copy of, or, for the owner, those any other stage holds a copy of."""
    mine = set(plan.stages[stage_index].layers)
    total = 0
    for t in costs.ties:
        users_here = any(u in mine for u in t.users)
        users_elsewhere = any(u not in mine for u in t.users)
        if (t.owner in mine and users_elsewhere) or (t.owner not in mine and users_here):
            total += t.nbytes
    return total


# ----------------------------------------------------------------------------------------------
# links

def nic_share(g: NodeGroup) -> float:
    """Inter-node bandwidth one chip gets when every chip of its node communicates at once."""
    return g.nics_per_node * g.nic_bw / g.chips_per_node


@dataclass(frozen=True)
class GroupGeometry:
    """How a group of `n` chips (one per TP group) spreads over nodes: `per_node` per node."""
    n: int
    per_node: int

    @property
    def nodes(self) -> int:
        return max(1, math.ceil(self.n / self.per_node))


def replica_geometry(g: NodeGroup, n: int, tp: int) -> GroupGeometry:
    """A stage's n replicas are placed on consecutive chips (Megatron rank order tp, dp, pp:
    Narayanan et al. SC'21 Sec. 3), so a node holds chips_per_node // tp of them."""
    return GroupGeometry(n=n, per_node=max(1, min(n, g.chips_per_node // max(1, tp))))


def group_allreduce_time(nbytes: float, g: NodeGroup, geo: GroupGeometry) -> float:
    """All-reduce over a stage's replicas: ring inside one node, else the faster of a flat ring
    (bottlenecked by the NIC share) and the hierarchical scheme — what NCCL-like libraries pick."""
    if geo.n <= 1:
        return 0.0
    if geo.nodes == 1:
        return ring_allreduce_time(nbytes, geo.n, g.intra_bw, g.intra_latency)
    flat = ring_allreduce_time(nbytes, geo.n, min(g.intra_bw, nic_share(g)), g.inter_latency)
    hier = hierarchical_allreduce_time(nbytes, geo.per_node, geo.nodes, g.intra_bw, nic_share(g),
                                       g.intra_latency, g.inter_latency)
    return min(flat, hier)


def tp_allreduce_time(nbytes: float, g: NodeGroup, tp: int, cross: bool = False) -> float:
    """A TP group inside one node rings over the intra-node links; one that spans nodes (tp >
    chips_per_node, or `cross`: a group the build's placement puts on two hosts; the validator
    warns) is paced by the edges that cross a NIC, each chip's share of its node's NICs with
    every chip in a TP ring at once (Patarasuk & Yuan 2009: a ring runs at its slowest edge)."""
    if tp <= g.chips_per_node and not cross:
        return ring_allreduce_time(nbytes, tp, g.intra_bw, g.intra_latency)
    return ring_allreduce_time(nbytes, tp, min(g.intra_bw, nic_share(g)),
                               max(g.intra_latency, g.inter_latency))


def p2p_link(cluster: Cluster, chip_a: str, tp_a: int, chip_b: str, tp_b: int,
             dp: int) -> tuple[float, float]:
    """(latency, bandwidth) of the path from a stage on `chip_a` to the next on `chip_b`.

    With TP, each of the tp ranks sends 1/tp of the tensor (scatter/gather optimisation,
    Narayanan et al. SC'21 Sec. 4.1), so the path's bandwidth is min(tp_a * bw_a, tp_b * bw_b).
    Intra-node when both stages are on the same node group and the two stages' chips of all
    replicas (dp * (tp_a + tp_b)) fit in one node; otherwise over NICs, limited by the slower
    side's per-chip NIC share.
    """
    ga, gb = cluster.group(chip_a), cluster.group(chip_b)
    if ga is gb and dp * (tp_a + tp_b) <= ga.chips_per_node:
        return ga.intra_latency, min(tp_a, tp_b) * ga.intra_bw
    return max(ga.inter_latency, gb.inter_latency), min(tp_a * nic_share(ga), tp_b * nic_share(gb))


def p2p_time(nbytes: float, cluster: Cluster, chip_a: str, tp_a: int, chip_b: str, tp_b: int,
             dp: int) -> float:
    """One micro-batch's boundary tensor between consecutive stages: latency + bytes / bandwidth
    (Hockney's model), over the path `p2p_link` picks."""
    if nbytes <= 0:
        return 0.0
    lat, bw = p2p_link(cluster, chip_a, tp_a, chip_b, tp_b, dp)
    return lat + nbytes / bw


def _hockney(nbytes: float, link: tuple[float, float]) -> float:
    """latency + bytes / bandwidth (Hockney's model) over a (latency, bandwidth) link."""
    return link[0] + nbytes / link[1] if nbytes > 0 else 0.0


@dataclass(frozen=True)
class EPGeometry:
    """How one stage's expert-parallel groups lie on hosts: `per_node` members of a group per
    host (the busiest), `nodes` hosts per group, and `nic_share`, the fraction of a host's NICs
    one group's members get while every EP group of the stage on that host runs its
    all-to-all at once (the dp / ep groups of a stage are in lock step)."""
    ep: int
    per_node: int
    nodes: int = 1
    nic_share: float = 1.0

    @property
    def local(self) -> bool:
        return self.nodes <= 1


def ep_groups(layout: WorkerLayout, stage: int, ep: int, rank: int = 0) -> list[tuple[int, ...]]:
    """The expert-parallel groups of `stage` (TP rank `rank`): group b is replicas
    b*ep .. b*ep+ep-1 of the stage (the compiler's rule: EP is carved out of dp, Plan.stage_ep)."""
    if ep < 1 or layout.dp % ep:
        raise H2Error(f"ep={ep} does not divide dp={layout.dp}")
    return [tuple(layout.wid(q, stage, rank) for q in range(b * ep, (b + 1) * ep))
            for b in range(layout.dp // ep)]


def default_ep_geometry(g: NodeGroup, ep: int, tp: int) -> EPGeometry:
    """Without a placement: consecutive replicas, chips_per_node // tp of them per node."""
    geo = replica_geometry(g, ep, tp)
    return EPGeometry(ep=ep, per_node=geo.per_node, nodes=geo.nodes,
                      nic_share=min(1.0, geo.per_node * tp / g.chips_per_node))


def moe_a2a_pass_time(costs: ModelCosts, moe: MoEInfo, g: NodeGroup, tp: int, ep: int, a2a: str,
                      geo: EPGeometry, capacity: float | None, bpe: int) -> float:
    """One pass (forward or backward) of one MoE layer's expert parallelism: a dispatch and a
    combine all-to-all (GShard, Lepikhin et al. 2020 Sec. 2.2; the backward runs the same two
    on the gradients), each rank sending its routed tokens' hidden states, b*s*k*d elements,
    / tp (each TP rank routes its sequence shard), x the capacity factor when buffers are
    padded to it. Time from `h2ir.planner.alltoall` (DiComm's flat or HALO algorithm) over the
    hosts the group occupies: `geo.per_node` ranks per node sharing `geo.nic_share` of the NICs."""
    if ep <= 1:
        return 0.0
    nbytes = costs.micro_batch * costs.seq_len * moe.top_k * moe.d_model * bpe / tp * (capacity or 1.0)
    topo = alltoall.topology_of(g, ranks_per_node=max(1, geo.per_node),
                                nic_bw=g.nic_bw * max(1e-9, geo.nic_share))
    fn = alltoall.halo_time if a2a == "halo" else alltoall.flat_time
    return 2 * fn(nbytes, ep, topo)


class LinePlacement:
    """Where the workers of one line of stages run, and what that makes each link cost.

    The hosts come from `h2ir.schedule.streams.worker_hosts`, the rule h2c writes into a
    build's manifest (replica-major worker ids, each worker the next chip of its stage's type,
    node by node), so the links costed here are the links h2x opens: shm inside a host, the
    NIC between hosts. A NIC is shared by every flow that crosses it at once; each gets an equal
    share (long-lived TCP flows through one bottleneck queue converge to equal rates: Chiu &
    Jain 1989; the test bed's tbf is one FIFO per port, docs/testbed.md). Flows counted per
    host and direction:

    - p2p: the host's workers with a peer stage (same replica) on another host; activations and
      gradients flow during the same pipeline phase, so they are counted together;
    - DP all-reduce: the ring edges leaving the host, over the rings of every stage and TP rank
      (the stages' all-reduces follow the pipeline flush, so they overlap).

    A ring all-reduce moves in lock step, so its slowest edge paces it: 2(n-1)/n * B / bw_min
    (Patarasuk & Yuan 2009), the ring in the dp group's order as DiComm runs it
    (executor/dicomm/comm.py: reduce-scatter then all-gather, no hierarchical phase)."""

    def __init__(self, cluster: Cluster, shapes: tuple, dp: int):
        self.cluster = cluster
        self.shapes = tuple(shapes)               # (chip, tp) per stage
        self.layout = WorkerLayout(dp, tuple(tp for _, tp in self.shapes))
        lay = self.layout
        self.hosts = worker_hosts(lay, [c for c, _ in self.shapes], cluster)
        S = len(self.shapes)
        self.group_of = {}                        # host -> its NodeGroup (NIC rate)
        for w, h in enumerate(self.hosts):
            self.group_of.setdefault(h, cluster.group(self.shapes[lay.where(w)[1]][0]))
        self.p2p_flows: dict = {}
        for w in range(lay.num_workers):
            r, s, _ = lay.where(w)
            peers = [v for t in (s - 1, s + 1) if 0 <= t < S for v in lay.tp_group(r, t)]
            if any(self.hosts[v] != self.hosts[w] for v in peers):
                self.p2p_flows[self.hosts[w]] = self.p2p_flows.get(self.hosts[w], 0) + 1
        self.ring_flows: dict = {}
        self.rings = [[lay.dp_group(s, k) for k in range(tp)] for s, (_, tp) in enumerate(self.shapes)]
        if dp > 1:
            for rings in self.rings:
                for ring in rings:
                    for a, b in zip(ring, ring[1:] + ring[:1]):
                        if self.hosts[a] != self.hosts[b]:
                            self.ring_flows[self.hosts[a]] = self.ring_flows.get(self.hosts[a], 0) + 1

    def _nic(self, h: int) -> float:
        g = self.group_of[h]
        return g.nics_per_node * g.nic_bw

    def boundary(self, j: int, k: int | None = None) -> tuple[float, float]:
        """(latency, bandwidth) between stage j and stage k (default j + 1), as `p2p_link`:
        each TP rank sends 1/tp (scatter/gather, Narayanan et al. SC'21 Sec. 4.1). Inside a
        host in every replica: the intra-node links; else each crossing sender's NIC share."""
        k = j + 1 if k is None else k
        (ca, ta), (cb, tb) = self.shapes[j], self.shapes[k]
        ga, gb = self.cluster.group(ca), self.cluster.group(cb)
        lay = self.layout
        pairs = [(a, b) for r in range(lay.dp) for a in lay.tp_group(r, j) for b in lay.tp_group(r, k)]
        cross = [(self.hosts[a], self.hosts[b]) for a, b in pairs if self.hosts[a] != self.hosts[b]]
        if not cross:
            return ga.intra_latency, min(ta, tb) * ga.intra_bw
        share = min(min(self._nic(ha) / self.p2p_flows.get(ha, 1),
                        self._nic(hb) / self.p2p_flows.get(hb, 1)) for ha, hb in cross)
        return max(ga.inter_latency, gb.inter_latency), min(ta, tb) * share

    def allreduce_time(self, j: int, nbytes: float) -> float:
        """Stage j's gradient all-reduce (each TP rank's ring of its 1/tp shard, concurrently):
        ring over the dp group in order, paced by its slowest edge."""
        ring = self.rings[j][0]
        n = len(ring)
        if n <= 1 or nbytes <= 0:
            return 0.0
        return ring_allreduce_time(nbytes, n, *self._ring_link(j))

    def _ring_link(self, j: int) -> tuple[float, float]:
        """(bandwidth, latency) of stage j's slowest ring edge (memoised: the search times
        many layer ranges of one stage)."""
        cache = self.__dict__.setdefault("_rings", {})
        if j not in cache:
            ring = self.rings[j][0]
            g = self.cluster.group(self.shapes[j][0])
            bw, lat = g.intra_bw, g.intra_latency
            for a, b in zip(ring, ring[1:] + ring[:1]):
                ha, hb = self.hosts[a], self.hosts[b]
                if ha != hb:
                    bw = min(bw, self._nic(ha) / self.ring_flows[ha],
                             self._nic(hb) / self.ring_flows[hb])
                    lat = max(lat, g.inter_latency)
            cache[j] = (bw, lat)
        return cache[j]

    def ep_geometry(self, j: int, ep: int) -> EPGeometry:
        """Stage j's EP groups (`ep_groups`, every TP rank) on this line's hosts: the most
        hosts one group spans, the most members it has on one host, and its share of that
        host's NICs (its members there over the stage's workers there)."""
        key = (j, ep)
        cache = self.__dict__.setdefault("_ep_geo", {})
        if key in cache:
            return cache[key]
        lay = self.layout
        tp = lay.tps[j]
        stage_on = {}
        for r in range(lay.dp):
            for w in lay.tp_group(r, j):
                stage_on[self.hosts[w]] = stage_on.get(self.hosts[w], 0) + 1
        nodes, per_node, share = 1, 1, 1.0
        for k in range(tp):
            for grp in ep_groups(lay, j, ep, k):
                on: dict = {}
                for w in grp:
                    on[self.hosts[w]] = on.get(self.hosts[w], 0) + 1
                nodes = max(nodes, len(on))
                per_node = max(per_node, max(on.values()))
                if len(on) > 1:
                    share = min(share, min(n / stage_on[h] for h, n in on.items()))
        cache[key] = EPGeometry(ep=ep, per_node=per_node, nodes=nodes, nic_share=share)
        return cache[key]

    def tp_crosses(self, j: int) -> bool:
        """Some TP group of stage j has workers on two hosts (its all-reduces cross a NIC)."""
        lay = self.layout
        return any(len({self.hosts[w] for w in lay.tp_group(r, j)}) > 1 for r in range(lay.dp))

    def ep_local(self, j: int, ep: int) -> bool:
        """Every EP group of stage j (every TP rank) inside one host."""
        return ep <= 1 or self.ep_geometry(j, ep).local

    @property
    def crossing(self) -> dict:
        """What crosses hosts: {'boundaries': [j, ...], 'allreduce': [stage, ...]} (reports)."""
        S = len(self.shapes)
        return {"boundaries": [j for j in range(S - 1) if self._crosses(j)],
                "allreduce": [j for j in range(S) if len({self.hosts[w] for w in self.rings[j][0]}) > 1]}

    def _crosses(self, j: int) -> bool:
        lay = self.layout
        return any(self.hosts[a] != self.hosts[b] for r in range(lay.dp)
                   for a in lay.tp_group(r, j) for b in lay.tp_group(r, j + 1))


# ----------------------------------------------------------------------------------------------
# compute rates

@dataclass(frozen=True)
class ChipRates:
    flops: float                 # achievable FLOP/s on dense matmuls
    mem_bw: float                # B/s, for memory-bound work (optimizer step)
    peak_flops: float            # denominator of MFU
    source: str                  # 'catalog' or 'measured'
    backend: str = ""
    attn_flops: float = 0.0      # achievable FLOP/s on the attention core (0: same as flops)
    act_bw: float = 0.0          # achievable B/s on memory-bound layer work (0: mem_bw)
    opt_bw: float = 0.0          # the optimizer step's state bytes per second (0: mem_bw)


def measured_calibration(backend: str, calibration=None):
    """The calibration for a measured chip on `backend`: the one passed in. The planner never
    measures; the layer that measures (backends/calibrate.py, frontend/profile.py) writes the
    calibration file and the driver passes it in."""
    if calibration is not None and calibration.has_backend(backend):
        return calibration
    where = f" in {calibration.path}" if calibration is not None and calibration.path else ""
    raise H2Error(f"a `measured` chip runs the {backend!r} backend, but no calibration for it was "
                  f"given{where}", hint="run `h2c profile` on the machine that runs it, or plan "
                  "through `h2c plan`/`h2c compile`, which measure what is missing")


def chip_rates(chip: ChipType, cluster: Cluster, calibration=None) -> ChipRates:
    """Achievable FLOP/s of a chip: peak x efficiency from the catalog (chip.flops), or, for
    `measured` chips, what `h2c profile` measured (single-thread matmul FLOP/s and copy
    bandwidth of the chip's backend, `h2ir/planner/calibration.py`), which must be passed in."""
    if chip.measured:
        cal = measured_calibration(chip.backend, calibration)
        f = cal.matmul_flops(chip.backend)
        return ChipRates(flops=f, mem_bw=cal.mem_bw(chip.backend), peak_flops=f,
                         source="measured", backend=chip.backend,
                         opt_bw=cal.opt_bw(chip.backend) or 0.0)
    peak = chip.peak_flops.get(cluster.dtype) or chip.peak_flops.get("fp32")
    if not peak:
        raise H2Error(f"chip {chip.name!r} has no peak FLOP/s for {cluster.dtype} or fp32")
    return ChipRates(flops=chip.flops(cluster.dtype, "matmul"), mem_bw=chip.mem_bw,
                     peak_flops=peak, source="catalog", backend=chip.backend,
                     attn_flops=chip.flops(cluster.dtype, "attention"),
                     act_bw=chip.mem_bw * chip.eff("memory"))


def layer_op_split(la: "LayerArrays", i: int) -> tuple[float, float, float, float, float]:
    """Layer i's work by op class, per micro-batch: (matmul fwd FLOPs, attention fwd FLOPs,
    matmul bwd, attention bwd, memory-bound fwd bytes); memory-bound bwd bytes are twice the
    forward's.

    Attention core of a block: 4*b*s^2*d forward (QK^T and PV, dense count, FlashAttention-2,
    Dao 2023, Sec. 4.1, as h2ir/opset.py counts it), backward 2.5x (ibid.: five matmuls to the
    forward's two). Memory-bound work (norms, rotary, activations, residual adds, softmax,
    loss): each activation the layer saves is written once and read once in the forward, and
    read plus its gradient written and read in the backward (a roofline estimate, Williams et al.
    2009: these ops do O(1) FLOPs per byte)."""
    l = la.layers[i]
    c = la.costs
    attn_f = 4.0 * c.micro_batch * c.seq_len ** 2 * c.d_model if la.is_block[i] else 0.0
    attn_f = min(attn_f, 0.5 * l.fwd_flops)
    attn_b = min(2.5 * attn_f, 0.5 * l.bwd_flops)
    return (l.fwd_flops - attn_f, attn_f, l.bwd_flops - attn_b, attn_b, 2.0 * la.act[i])


def tp_memory_share(la: "LayerArrays", i: int, tp: int) -> float:
    """The fraction of layer i's memory-bound work one of `tp` ranks does. The kernels shard
    it as the activations are sharded (`LayerArrays.act_rep`): the elementwise work inside
    the column/row-parallel matmuls' outputs and the attention heads divides by t; the norms
    and residual adds on the replicated b*s*d stream run whole on every rank (Megatron-LM
    without sequence parallelism: Shoeybi et al. 2019 Sec. 3; Korthikanti et al. 2022
    Sec. 4.2.1)."""
    act = la.act[i]
    if tp <= 1 or act <= 0:
        return 1.0
    rep = la.act_rep[i] / act
    return rep + (1.0 - rep) / tp


# ----------------------------------------------------------------------------------------------
# time

@dataclass(frozen=True)
class LayerTimes:
    """Per-layer per-micro-batch times on one (chip, tp, ep), comm included, with prefix sums."""
    fwd: list            # prefix sums, len L+1
    bwd: list            # no recomputation
    bwd_rc: list         # full recomputation: backward + a re-run forward
    bwd_sel: list        # selective recomputation: backward + the re-made pointwise / attention work
    fwd_layer: list      # per layer (not prefix), for lower bounds
    bwd_layer: list


@dataclass(frozen=True)
class StageTimes:
    fwd_s: float                # one micro-batch's forward on the stage (TP / all-to-all included)
    bwd_s: float                # one micro-batch's backward (recompute included)
    send_act_s: float           # to the next stage (0 on the last)
    send_grad_s: float          # to the previous stage (0 on the first)
    dp_allreduce_s: float       # with ZeRO-1: its two halves below, together
    opt_step_s: float
    tied_s: float = 0.0         # one hand-over of tied gradients / parameters (0 without ties)
    reduce_scatter_s: float = 0.0   # ZeRO-1: the gradients' reduce-scatter ...
    all_gather_s: float = 0.0       # ... and the updated parameters' all-gather


class ResourceModel:
    """Times and memory of stages of one model on one cluster at one micro-batch/seq length."""

    def __init__(self, costs: ModelCosts, cluster: Cluster, micro_batch: int | None = None,
                 seq_len: int | None = None, calibration=None):
        mb = micro_batch or costs.micro_batch
        sl = seq_len or costs.seq_len
        self.costs = costs_at(costs, mb, sl)
        self.cluster = cluster
        self.calibration = calibration
        self.la = _layer_arrays_cached(self.costs, cluster.dtype)
        self._rates: dict = {}
        self._times: dict = {}
        self._cals: dict = {}
        # (chip, layer name) of `measured` chips timed by the FLOP estimate: no measured record
        self.estimated: set = set()
        self._placements: dict = {}

    def placement(self, shapes, dp: int) -> LinePlacement:
        """The hosts of a line of stages ((chip, tp) per stage) with dp replicas, and its links."""
        key = (tuple(shapes), dp)
        if key not in self._placements:
            self._placements[key] = LinePlacement(self.cluster, key[0], dp)
        return self._placements[key]

    def plan_placement(self, plan: Plan) -> LinePlacement:
        return self.placement(tuple((st.chip, st.tp) for st in plan.stages), plan.dp)

    @property
    def L(self) -> int:
        return self.la.L

    def rates(self, chip: str) -> ChipRates:
        if chip not in self._rates:
            self._rates[chip] = chip_rates(self.cluster.chip(chip), self.cluster, self.calibration)
        return self._rates[chip]

    def _measured_layer_time(self, rates: ChipRates, l: LayerCost):
        if rates.source != "measured":
            return None
        cal = self._cals.get(rates.backend)
        if cal is None:
            cal = self._cals[rates.backend] = measured_calibration(rates.backend, self.calibration)
        return cal.layer_time(rates.backend, l, self.costs.micro_batch, self.costs.seq_len,
                              solo=self.cluster.shares_cores, colocation=self.colocation)

    @property
    def colocation(self) -> dict | None:
        """The co-location measured layer times must have been taken under: the cluster's
        busiest set of shared cores (`Cluster.colocation`, `calibration.colocation_key`)."""
        c = self.cluster.colocation()
        return colocation_key(*c) if c else None

    def contention_curve(self, chip: str) -> dict:
        """How much slower a worker of `chip` computes with n of its host's workers computing
        at once ({n: factor}, `h2ir.planner.calibration.contention_curve`): measured with its
        layer times on `measured` chips; otherwise {1: 1.0}, time sharing past the cores only.
        The simulator applies it (`simulate._shared_cores_fixed_point`)."""
        curves = self.__dict__.setdefault("_curves", {})
        if chip not in curves:
            r = self.rates(chip)
            # the curve of the record that times the model's heaviest layer
            top = max(self.costs.layers, key=lambda l: l.fwd_flops, default=None)
            curves[chip] = {1: 1.0} if r.source != "measured" else measured_calibration(
                r.backend, self.calibration).contention_curve(
                    r.backend, self.costs.micro_batch, self.colocation, top, self.costs.seq_len)
        return curves[chip]

    def layer_times(self, chip: str, tp: int, ep: int = 1, a2a: str = "flat",
                    tp_estimate: bool = True, ep_geo: "EPGeometry | None" = None,
                    capacity: float | None = None, tp_cross: bool = False) -> LayerTimes:
        """`tp_estimate=False` leaves out the per-layer TP all-reduce estimate (the caller adds
        the stage programs' own collectives instead: `stage_times(program_comm=...)`). `ep_geo`:
        how the stage's EP groups lie on hosts (`LinePlacement.ep_geometry`); None: node-local
        when ep x tp fits a node, else spread as `replica_geometry` says. `tp_cross`: the
        stage's TP groups span hosts (`LinePlacement.tp_crosses`)."""
        key = (chip, tp, ep, a2a, tp_estimate, ep_geo, capacity, tp_cross)
        if key in self._times:
            return self._times[key]
        r = self.rates(chip)
        g = self.cluster.group(chip)
        la = self.la
        fused = self.cluster.chip(chip).fused_attention
        fwd, bwd, rerun_rc, rerun_sel = [], [], [], []
        for i, l in enumerate(la.layers):
            measured = self._measured_layer_time(r, l)
            share = tp_memory_share(la, i, tp)
            if measured is not None:
                # h2c profile timings of this very layer. Under TP the matmul share (at most
                # FLOPs / the measured matmul rate) splits over the ranks; the rest — norms,
                # elementwise ops, per-op dispatch — splits as the activations it reads and
                # writes do (`tp_memory_share`: the replicated stream's part runs whole).
                mm_f = min(measured[0], l.fwd_flops / r.flops)
                mm_b = min(measured[1], l.bwd_flops / r.flops)
                f_c = mm_f / tp + (measured[0] - mm_f) * share
                b_c = mm_b / tp + (measured[1] - mm_b) * share
                sel = (measured[0] - mm_f) * share
            elif r.source == "measured":
                # a measured chip without a record of this layer: FLOPs / measured matmul rate
                self.estimated.add((chip, l.name))
                f_c = l.fwd_flops / (tp * r.flops)
                b_c = l.bwd_flops / (tp * r.flops)
                sel = 0.0
            else:
                # per op class: matmul and attention FLOPs at their achievable rates, split over
                # TP (Megatron-LM Sec. 3); memory-bound bytes at the achievable bandwidth, split
                # as the kernels split them (`tp_memory_share`)
                mm_f, at_f, mm_b, at_b, mem = layer_op_split(la, i)
                af = r.attn_flops or r.flops
                bw = r.act_bw or r.mem_bw
                f_c = (mm_f / r.flops + at_f / af) / tp + mem * share / bw
                b_c = (mm_b / r.flops + at_b / af) / tp + 2 * mem * share / bw
                # selective recomputation re-makes the pointwise values and, without a fused
                # kernel, the attention core (Korthikanti et al. 2022 Sec. 5;
                # frontend/recompute.py)
                sel = mem * share / bw + (0.0 if fused else at_f / af / tp)
            if r.source == "measured":
                b_c += self.grad_accumulation_time(r, l.params / tp)
            comm = 0.0
            if tp > 1 and tp_estimate:
                # Megatron-LM (Shoeybi et al. 2019) Sec. 3, Fig. 4: two all-reduces of the b*s*d
                # block output per transformer block in the forward and two in the backward; the
                # vocab-parallel embedding needs one per pass.
                n_ar = 2 if la.is_block[i] else (1 if la.is_embed[i] else 0)
                comm += n_ar * tp_allreduce_time(la.out[i], g, tp, tp_cross)
            if l.moe is not None and ep > 1:
                comm += moe_a2a_pass_time(self.costs, l.moe, g, tp, ep, a2a,
                                          ep_geo or default_ep_geometry(g, ep, tp), capacity,
                                          dtype_bytes(self.cluster.dtype))
            fwd.append(f_c + comm)
            bwd.append(b_c + comm)
            # recomputation re-runs compute only: the collectives' results are kept
            # (frontend/recompute.py never re-runs communication)
            rerun_rc.append(f_c)
            rerun_sel.append(sel)
        f = np.array(fwd)
        b = np.array(bwd)
        lt = LayerTimes(fwd=_prefix(f), bwd=_prefix(b), bwd_rc=_prefix(b + np.array(rerun_rc)),
                        bwd_sel=_prefix(b + np.array(rerun_sel)),
                        fwd_layer=f.tolist(), bwd_layer=b.tolist())
        self._times[key] = lt
        return lt

    def grad_accumulation_time(self, r: "ChipRates", params: float) -> float:
        """One micro-batch's parameter gradients added into the step's running sums: an h2x
        worker's backward does this with the backend's own add after the layer programs
        (executor/worker.py `_take_grads`), which the measured layer times do not contain. It is
        memory-bound: read both, write one, 3 x the gradient bytes at the copy bandwidth (llama_tiny,
        10.5 M parameters, torch, one thread: 9.9 ms measured, 12.7 ms from the 9.9 GB/s copy rate;
        a stage's backward ran 12-17 ms over its measured layers in `h2x run`). Charged on every
        micro-batch, the first too (which only keeps its gradients), so up to 1/m high. Catalog chips
        get none: a GPU trainer fuses it into the weight-gradient GEMM (Megatron-LM's
        gradient_accumulation_fusion)."""
        return 3.0 * params * self.la.grad_bytes / r.mem_bw

    # -- one stage ---------------------------------------------------------------------------
    def compute_times(self, chip: str, tp: int, a: int, b: int, recompute: str, ep: int = 1,
                      a2a: str = "flat", tp_estimate: bool = True, ep_geo=None,
                      capacity: float | None = None, tp_cross: bool = False) -> tuple[float, float]:
        lt = self.layer_times(chip, tp, ep, a2a, tp_estimate, ep_geo, capacity, tp_cross)
        f = lt.fwd[b] - lt.fwd[a]
        bw = {"full": lt.bwd_rc, "selective": lt.bwd_sel}.get(recompute, lt.bwd)
        return f, bw[b] - bw[a]

    def boundary_bytes(self, b: int) -> float:
        """Bytes of one micro-batch's activations leaving a stage that ends before layer b."""
        return float(self.la.out[b - 1])

    def dp_allreduce_time(self, chip: str, tp: int, dp: int, a: int, b: int, ep: int = 1,
                          placement: LinePlacement | None = None, stage: int = 0) -> float:
        """Gradient all-reduce over the stage's dp replicas (data parallelism; Patarasuk & Yuan
        ring); gradients in the training dtype's grad width. With `placement` (the line the
        stage is `stage` of) the ring runs over the links the build's hosts give it."""
        if dp <= 1:
            return 0.0
        dev = self.la.device(tp, ep)
        return self.grad_allreduce_time(chip, tp, dp, (dev.P_params[b] - dev.P_params[a]) * self.la.grad_bytes,
                                        placement, stage)

    def grad_allreduce_time(self, chip: str, tp: int, dp: int, nbytes: float,
                            placement: LinePlacement | None = None, stage: int = 0) -> float:
        """Without `placement`: replicas assumed on consecutive chips (`replica_geometry`)."""
        if dp <= 1:
            return 0.0
        if placement is not None:
            return placement.allreduce_time(stage, nbytes)
        g = self.cluster.group(chip)
        return group_allreduce_time(nbytes, g, replica_geometry(g, dp, tp))

    def opt_step_coef(self, chip: str) -> float:
        """Seconds per parameter (per device) of the optimizer step. AdamW is elementwise and
        memory-bound (roofline, Williams et al. 2009): it reads every state byte (weights,
        grads, optimizer) and writes back weights and optimizer state; at the rate the
        backend's own step was measured at (`opt_bw`), else the copy bandwidth."""
        st = self.la.state
        r = self.rates(chip)
        return (st.total + st.weights + st.optimizer) / (r.opt_bw or r.mem_bw)

    def opt_step_time(self, chip: str, tp: int, a: int, b: int, ep: int = 1) -> float:
        dev = self.la.device(tp, ep)
        return (dev.P_params[b] - dev.P_params[a]) * self.opt_step_coef(chip)

    def program_comm_time(self, chip: str, volumes: list, cross: bool = False) -> float:
        """Seconds of a stage program's collectives: `volumes` are the op set's comm_volume
        triples (collective, payload bytes, group size) of its COMM nodes, each all-reduce a
        ring over the TP group's links (`tp_allreduce_time`; `cross`: the group spans hosts)."""
        g = self.cluster.group(chip)
        return sum(tp_allreduce_time(nbytes, g, n, cross) for kind, nbytes, n in volumes
                   if kind == "all_reduce" and n > 1)

    def stage_times(self, plan: Plan, j: int, program_comm: tuple | None = None) -> StageTimes:
        """`program_comm` = (forward volumes, backward volumes) of the stage's compiled
        programs' collectives replaces the per-layer TP estimate (Megatron's two all-reduces
        per block) with the programs' own."""
        S = plan.num_stages
        st = plan.stages[j]
        ep = plan.stage_ep(j)
        a2a = plan.moe.a2a if plan.moe else "flat"
        a, b = stage_layer_range(plan, j, self.la.names)
        # links as the build's hosts give them (LinePlacement: worker_hosts, shared NICs)
        place = self.plan_placement(plan)
        # the all-to-all over the hosts the stage's EP groups really occupy
        geo = place.ep_geometry(j, ep) if ep > 1 and plan.dp % ep == 0 else None
        cross = st.tp > 1 and place.tp_crosses(j)
        f, bw = self.compute_times(st.chip, st.tp, a, b, st.recompute, ep, a2a,
                                   tp_estimate=program_comm is None, ep_geo=geo,
                                   capacity=_capacity_of(plan), tp_cross=cross)
        if program_comm is not None:
            f += self.program_comm_time(st.chip, program_comm[0], cross)
            bw += self.program_comm_time(st.chip, program_comm[1], cross)
        send_act = send_grad = 0.0
        if j + 1 < S:
            send_act = _hockney(self.boundary_bytes(b), place.boundary(j))
        if j > 0:
            send_grad = _hockney(self.boundary_bytes(a), place.boundary(j - 1))
        # (expert gradients ring over all dp replicas here, not the dp / ep that hold the
        # same experts: an over-estimate of their share)
        allreduce, opt, rs, ag = self.step_end_times(st.chip, st.tp, plan.dp, a, b, ep, st.zero,
                                                     place, j)
        return StageTimes(fwd_s=f, bwd_s=bw, send_act_s=send_act, send_grad_s=send_grad,
                          dp_allreduce_s=allreduce, opt_step_s=opt,
                          tied_s=self.tied_time(plan, j), reduce_scatter_s=rs, all_gather_s=ag)

    def step_end_times(self, chip: str, tp: int, dp: int, a: int, b: int, ep: int = 1,
                       zero: int = 0, placement: LinePlacement | None = None,
                       stage: int = 0) -> tuple[float, float, float, float]:
        """(gradient all-reduce, optimizer step, reduce-scatter, all-gather) at the end of a
        step of a stage of layers [a, b); under ZeRO-1 (`zero`, dp > 1) the all-reduce is its
        two halves (`zero_collective_times`) and the optimizer step updates 1/dp of the
        parameters. The search's bound charges the same (`StageLine.tail_of`)."""
        opt = self.opt_step_time(chip, tp, a, b, ep)
        if not (zero and dp > 1):
            return self.dp_allreduce_time(chip, tp, dp, a, b, ep, placement, stage), opt, 0.0, 0.0
        rs, ag = self.zero_collective_times(chip, tp, dp, a, b, ep, placement, stage)
        return rs + ag, opt / dp, rs, ag

    def zero_collective_times(self, chip: str, tp: int, dp: int, a: int, b: int, ep: int = 1,
                              placement: LinePlacement | None = None,
                              stage: int = 0) -> tuple[float, float]:
        """ZeRO-1 (Rajbhandari et al. SC'20, Sec. 7.2.1): (reduce-scatter of the gradients,
        all-gather of the updated weights), each one half of a ring all-reduce (Thakur et al.
        2005 Sec. 4): (n-1)/n of its bytes and n-1 latencies. In fp32 the gradients and weights
        have one width, so the two together move what the all-reduce did."""
        dev = self.la.device(tp, ep)
        p = dev.P_params[b] - dev.P_params[a]
        rs = self.grad_allreduce_time(chip, tp, dp, p * self.la.grad_bytes, placement, stage) / 2
        ag = self.grad_allreduce_time(chip, tp, dp, p * self.la.state.weights, placement,
                                      stage) / 2
        return rs, ag

    def tied_time(self, plan: Plan, j: int) -> float:
        """One hand-over of stage j's tied tensors to or from its counterpart stage (the other
        end of the embedding/head tie: the first or the last stage), over the p2p path."""
        nbytes = tied_exchange_bytes(self.costs, plan, j)
        if not nbytes:
            return 0.0
        other = plan.num_stages - 1 if j == 0 else 0
        return _hockney(nbytes, self.plan_placement(plan).boundary(j, other))

    def stage_flops(self, plan: Plan, j: int) -> float:
        """Model FLOPs (forward + backward, no recompute) of one micro-batch on stage j, all TP."""
        a, b = stage_layer_range(plan, j, self.la.names)
        return float(self.la.fwd_flops[a:b].sum() + self.la.bwd_flops[a:b].sum())


# ----------------------------------------------------------------------------------------------
# analytic costs (when no traced graph is at hand: tests, benchmarks, quick what-ifs)

def analytic_llama_costs(name: str, n_layers: int, d_model: int, n_heads: int, ffn: int,
                         vocab: int, seq_len: int, micro_batch: int = 1, dtype_bytes: int = 4,
                         moe: MoEInfo | None = None) -> ModelCosts:
    """LLaMA-style layer costs from the architecture's numbers alone.

    FLOPs per token (forward): QKVO projections 8d^2, attention scores and values 4*s*d,
    SwiGLU MLP 6*d*ffn (Narayanan et al. SC'21 Sec. 5.1 counts the same terms for GPT); head
    2*d*vocab; backward = 2x forward (ibid.). Parameters per block 4d^2 + 3*d*ffn + 2d.
    Saved activations per token: 14*d + 4*ffn elements, what `h2c ir --summary` reports for
    examples/llama_tiny.py's block with SDPA (no s^2 score matrix is kept).
    With `moe`, every block is a MoE block of `moe.num_experts` SwiGLU experts of width moe.d_ffn
    (router d*E), each token visiting top_k of them.
    """
    b, s, d = micro_batch, seq_len, d_model
    tok = b * s
    layers = [LayerCost("embed", "embedding", params=vocab * d, param_bytes=vocab * d * dtype_bytes,
                        fwd_flops=0, bwd_flops=0, act_saved_bytes=tok * 8,
                        out_bytes=tok * d * dtype_bytes)]
    for i in range(n_layers):
        if moe is None:
            p = 4 * d * d + 3 * d * ffn + 2 * d
            f = tok * (8 * d * d + 4 * s * d + 6 * d * ffn)
            act = tok * (14 * d + 4 * ffn) * dtype_bytes
            kind = "transformer_block"
        else:
            e = 3 * d * moe.d_ffn
            p = 4 * d * d + d * moe.num_experts + moe.num_experts * e + 2 * d
            f = tok * (8 * d * d + 4 * s * d + 2 * d * moe.num_experts + 6 * d * moe.d_ffn * moe.top_k)
            act = tok * (14 * d + moe.top_k * (3 * moe.d_ffn + d)) * dtype_bytes
            kind = "moe_block"
        layers.append(LayerCost(f"block.{i}", kind, params=p, param_bytes=p * dtype_bytes,
                                fwd_flops=f, bwd_flops=2 * f, act_saved_bytes=act,
                                out_bytes=tok * d * dtype_bytes,
                                moe=dataclasses.replace(moe, expert_params=3 * d * moe.d_ffn) if moe else None))
    return _with_head(name, layers, b, s, d, n_heads, vocab, tok, dtype_bytes)


def _with_head(name, layers, b, s, d, n_heads, vocab, tok, dtype_bytes) -> ModelCosts:
    """The analytic models' LM head (final norm + [d, vocab] projection) and the ModelCosts."""
    ph = vocab * d + d
    layers.append(LayerCost("head", "head", params=ph, param_bytes=ph * dtype_bytes,
                            fwd_flops=2 * tok * d * vocab, bwd_flops=4 * tok * d * vocab,
                            act_saved_bytes=tok * (d + vocab) * dtype_bytes,
                            out_bytes=tok * vocab * dtype_bytes))
    return ModelCosts(model=name, micro_batch=b, seq_len=s, layers=tuple(layers), d_model=d,
                      n_heads=n_heads, vocab=vocab, dtype_bytes=dtype_bytes)


def analytic_moe_costs(name: str, n_layers: int, d_model: int, n_heads: int, vocab: int,
                       seq_len: int, moe: MoEInfo, *, attn_params: int, dense_layers: int = 0,
                       dense_ffn: int = 0, shared_experts: int = 0, micro_batch: int = 1,
                       dtype_bytes: int = 2) -> ModelCosts:
    """Layer costs of a MoE decoder from its architecture's shapes, for models too large to trace
    quickly on the meta device (a 256-expert model is 15,000 expert modules).

    Each block: attention with `attn_params` projection parameters (GQA or MLA: whatever the
    architecture's projections hold; forward 2 FLOPs per parameter per token) plus the scores
    and values, 4*s*d per token (as `analytic_llama_costs`); then either a dense SwiGLU FFN of
    width `dense_ffn` (the first `dense_layers` blocks, DeepSeek-V3's first three) or a router
    (d*E) with `moe.num_experts` routed SwiGLU experts of width moe.d_ffn, top moe.top_k per
    token, plus `shared_experts` experts every token visits (DeepSeek-V3 Sec. 2.1.2; they are
    dense parameters: EP does not divide them). Backward = 2x forward (Narayanan et al. SC'21
    Sec. 5.1). Saved activations per token: 14*d for attention and norms (the LLaMA count of
    `analytic_llama_costs`), 4*ffn for a dense FFN, k*(3*f + d) for the routed experts (Piper's
    expert-activation term) and the same per shared expert. Embedding and head are untied."""
    b, s, d = micro_batch, seq_len, d_model
    tok = b * s
    f, E, k = moe.d_ffn, moe.num_experts, moe.top_k
    e_params = 3 * d * f
    info = dataclasses.replace(moe, expert_params=e_params)
    layers = [LayerCost("embed", "embedding", params=vocab * d, param_bytes=vocab * d * dtype_bytes,
                        fwd_flops=0, bwd_flops=0, act_saved_bytes=tok * 8,
                        out_bytes=tok * d * dtype_bytes)]
    attn_f = 2 * attn_params + 4 * s * d
    for i in range(n_layers):
        if i < dense_layers:
            p = attn_params + 3 * d * dense_ffn + 2 * d
            fl = tok * (attn_f + 6 * d * dense_ffn)
            act = tok * (14 * d + 4 * dense_ffn) * dtype_bytes
            kind, mi = "transformer_block", None
        else:
            p = attn_params + d * E + (E + shared_experts) * e_params + 2 * d
            fl = tok * (attn_f + 2 * d * E + 6 * d * f * (k + shared_experts))
            act = tok * (14 * d + (k + shared_experts) * (3 * f + d)) * dtype_bytes
            kind, mi = "moe_block", info
        layers.append(LayerCost(f"block.{i}", kind, params=p, param_bytes=p * dtype_bytes,
                                fwd_flops=fl, bwd_flops=2 * fl, act_saved_bytes=act,
                                out_bytes=tok * d * dtype_bytes, moe=mi))
    return _with_head(name, layers, b, s, d, n_heads, vocab, tok, dtype_bytes)
