"""Memory per device: model-state bytes per parameter, the layer arrays every memory and time
formula reads, a stage's memory items (`stage_memory`) and a chip's capacity."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from h2ir.clusters.cluster import ChipType, Cluster
from h2ir.costs import ModelCosts, MoEInfo
from h2ir.errors import H2Error
from h2ir.plans.plan import VIRTUAL_SCHEDULES, Plan
from h2ir.planner.limits import BLOCK_KINDS
from h2ir.schedule.streams import chunk_orders, chunk_stages
from h2ir.types import TRAIN_DTYPES


def dtype_bytes(dtype: str) -> int:
    try:
        return TRAIN_DTYPES[dtype].itemsize
    except KeyError:
        raise H2Error(f"unknown training dtype {dtype!r} (expected one of: {', '.join(TRAIN_DTYPES)})")


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
        layers = tuple(l.per_token_scaled(r) for l in c.layers)
        c = dataclasses.replace(c, seq_len=seq_len, layers=layers)
    return c


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
        self.is_block = np.array([l.kind in BLOCK_KINDS for l in self.layers])
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


def prefix_sums(x: np.ndarray) -> list:
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
        self.P_params = prefix_sums(self.params)
        self.P_act = prefix_sums(self.act)
        self.act_sel = self.act * la.sel_frac
        self.P_act_sel = prefix_sums(self.act_sel)
        self.L = la.L
        self.P_out = prefix_sums(self.out)
        # the logits a rank holds for the loss: TP makes the head and the loss vocabulary-
        # parallel (frontend/tensor_parallel.py); that log-softmax's backward is decomposed into
        # three logits-sized tensors where the fused one holds two
        self.logits = (la.out[-1] / tp) if la.L else 0.0
        self.loss_bwd = 3.0 if tp > 1 else 2.0
        self.grad = self.params * la.grad_bytes
        self.P_grad = prefix_sums(self.grad)
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


def capacity_of(plan: Plan) -> float | None:
    return getattr(plan.moe, "capacity", None) if plan.moe else None


@lru_cache(maxsize=64)
def layer_arrays_cached(costs: ModelCosts, dtype: str) -> LayerArrays:
    return LayerArrays(costs, dtype)


def layer_arrays(costs: ModelCosts, plan: Plan, cluster: Cluster) -> LayerArrays:
    return layer_arrays_cached(costs_at(costs, plan.micro_batch, plan.seq_len), cluster.dtype)


def stage_memory(costs: ModelCosts, plan: Plan, cluster: Cluster, stage_index: int,
                 inflight: int | None = None) -> MemoryBreakdown:
    """Peak bytes per device of stage `stage_index` (weights, gradients, optimizer states,
    in-flight activations). `inflight` overrides the schedule's count (the simulator passes
    the count it tracked from the instruction stream)."""
    la = layer_arrays(costs, plan, cluster)
    st = plan.stages[stage_index]
    a, b = stage_layer_range(plan, stage_index, la.names)
    dev = la.device(st.tp, plan.stage_ep(stage_index), capacity_of(plan))
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
