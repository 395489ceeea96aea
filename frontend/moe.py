"""Sparse Mixture-of-Experts with a capacity, and expert parallelism (Piper, arXiv 2605.05049;
GShard, Lepikhin et al. 2020, Sec. 2.2 for the capacity and the dispatch/combine form).

The cut point is the *experts module* as transformers 5 defines it (integrations/moe.py,
`use_experts_implementation`): one module holding E experts as weight stacks [E, ...] —
`gate_up_proj` [E, 2F, D] (or `up_proj` without a gate), `down_proj` [E, D, F], optional
`*_bias`, `act_fn`, the flags `has_gate`, `has_bias`, `is_transposed` — called as
`experts(hidden [T, D], top_k_index [T, k], top_k_weights [T, k]) -> [T, D]`. The router (its
scoring, top-k, normalisation, shared experts) stays the model's own code; only what happens
between the routing decision and the weighted sum is h2's. That is the interface of Mixtral,
Qwen2/3-MoE, DeepSeek-V3, OLMoE, ... in transformers, and of examples/moe_tiny.py's sparse form.
A module of that call interface whose weights are in another layout (DBRX's [E * F, D] stacks)
is an experts module too: its experts run through its own forward, one expert at a time
(frontend/routing.py `expert_output`), and expert parallelism shards its stacks by whole experts.

`install(model, ep=..., capacity=...)` replaces each experts module's forward (on this instance)
with `experts_forward`, which has static shapes (traceable on the meta device) and no Python loop
over experts:

    dispatch   each (token, choice) gets its position in its expert's queue (one-hot, cumsum:
               tokens in order); positions >= C are dropped (counted); tokens are scattered
               into a buffer [E, C, D] (one index_add)
    a2a        ep > 1: the buffer's experts in placement order are split into ep chunks, chunk
               j goes to EP rank j (h2moe::all_to_all, the op set's `ep_all_to_all`); rank j
               now holds its E/ep experts' tokens from every rank, [E/ep, ep*C, D]
    experts    two batched matmuls (bmm) over the local experts: one grouped matmul, not a loop
               (another weight layout: each local expert's rows through its own forward)
    a2a        back (the same exchange: it is its own inverse)
    combine    each (token, choice) gathers its expert's output row (a dropped one reads a zero
               row) and the rows are summed with the router's weights

C = ceil(capacity * T * k / E) tokens per expert and micro-batch, at most T; capacity None means
C = T, so no token is ever dropped and the result equals the model's own experts forward.

Per-expert loads (tokens routed to each expert, before dropping) leave the program through
h2moe::stats (the op set's `moe_stats`: identity on the hidden states, the counts recorded by
the runtime), so the worker can log loads and dropped tokens and migrate experts.

Expert parallelism: with ep > 1 each EP rank's module holds only its E/ep experts' stacks, in
placement order (`h2_placement` [E]: the expert in each slot, rank-major; `h2_slot` its inverse).
Both are buffers (program constants), so moving experts between ranks (migration) changes
weights and these two constants, never the program.
"""
from __future__ import annotations

import math
import types

import torch
import torch.nn as nn
import torch.nn.functional as F

from h2ir.errors import H2Error
from frontend.routing import expert_count, expert_output, forward_args, is_routed_experts


# ---- the runtime's points in a program, as torch custom ops -------------------------------------
# Outside an h2 program (eager torch) they act as a group of one.

@torch.library.custom_op("h2moe::all_to_all", mutates_args=())
def all_to_all(x: torch.Tensor, size: int) -> torch.Tensor:
    """Split dim 0 into `size` chunks; chunk j goes to EP rank j; the result's chunk r is what
    rank r sent here. Its own inverse, so it is also its gradient."""
    return x.clone()


@all_to_all.register_fake
def _(x, size):
    return torch.empty_like(x)


def _setup_size(ctx, inputs, output):
    ctx.size = inputs[1]


all_to_all.register_autograd(lambda ctx, g: (all_to_all(g, ctx.size), None),
                             setup_context=_setup_size)


@torch.library.custom_op("h2moe::stats", mutates_args=())
def stats(x: torch.Tensor, counts: torch.Tensor, capacity: int, layer: str) -> torch.Tensor:
    """x unchanged; the runtime records `counts` (tokens routed to each expert of the experts
    module `layer`, i64 [E]) and the capacity C of that MoE layer."""
    return x.clone()


@stats.register_fake
def _(x, counts, capacity, layer):
    return torch.empty_like(x)


def _no_context(ctx, inputs, output):
    pass


stats.register_autograd(lambda ctx, g: (g, None, None, None), setup_context=_no_context)

# ---- the auxiliary load-balancing loss ----------------------------------------------------------
# The loss the pipeline trains on is the last stage's; a router's auxiliary loss is made in an
# earlier stage. So it is not added to that loss: its gradient is injected where it is made
# (as Megatron-LM's MoEAuxLossAutoScaler does). `attach_aux_loss(x, aux, coef)` is x; its
# backward gives `aux` the gradient coef * s, where s is the scale the training loop gives each
# micro-batch's loss (h2's workers: 1/m, before the data-parallel average; h2's eager
# reference: 1/(dp*m), `set_aux_loss_scale`), so the aux loss is weighted like the loss.

_AUX_SCALE = [1.0]


def set_aux_loss_scale(scale: float) -> None:
    """The gradient scale of one micro-batch's loss in an eager training loop (default 1.0)."""
    _AUX_SCALE[0] = float(scale)


@torch.library.custom_op("h2moe::aux_scale", mutates_args=())
def aux_scale(anchor: torch.Tensor) -> torch.Tensor:
    """The loss-gradient scale of this micro-batch (an f32 scalar); h2 programs get it from the
    runtime (the op set's `moe_aux_scale`)."""
    return torch.tensor(_AUX_SCALE[0], dtype=torch.float32, device=anchor.device)


@aux_scale.register_fake
def _(anchor):
    return torch.empty((), dtype=torch.float32, device=anchor.device)


@torch.library.custom_op("h2moe::attach_aux", mutates_args=())
def _attach_aux(x: torch.Tensor, aux: torch.Tensor, coef: float) -> torch.Tensor:
    return x.clone()


@_attach_aux.register_fake
def _(x, aux, coef):
    return torch.empty_like(x)


def _attach_setup(ctx, inputs, output):
    ctx.coef = inputs[2]
    ctx.save_for_backward(inputs[1])


def _attach_bwd(ctx, g):
    (aux,) = ctx.saved_tensors
    return g, (aux_scale(aux) * ctx.coef).to(aux.dtype).expand_as(aux), None


_attach_aux.register_autograd(_attach_bwd, setup_context=_attach_setup)


def attach_aux_loss(x: torch.Tensor, aux: torch.Tensor, coef: float) -> torch.Tensor:
    """x, with `coef * aux` trained as part of the loss (see above)."""
    if coef == 0:
        return x
    return _attach_aux(x, aux, float(coef))


def load_balancing_loss(probs: torch.Tensor, top_k_index: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Switch Transformer's auxiliary loss (Fedus et al. 2021, eq. 4) for top-k routing, as
    transformers' `load_balancing_loss_func` computes it: E * sum over k and e of (share of the
    tokens whose k-th choice is e) * (mean router probability of e). probs [T, E], top_k_index
    [T, k]; 1.0 when routing is uniform."""
    mask = torch.nn.functional.one_hot(top_k_index, num_experts).to(probs.dtype)   # [T, k, E]
    tokens_per_expert = mask.mean(dim=0)                                            # [k, E]
    prob_per_expert = probs.mean(dim=0)                                             # [E]
    return (tokens_per_expert * prob_per_expert.unsqueeze(0)).sum() * num_experts


# ---- experts modules ---------------------------------------------------------------------------

def has_weight_stacks(m: nn.Module) -> bool:
    """An experts module of transformers 5's form: weight stacks [E, ...] named gate_up_proj (or
    up_proj) and down_proj, and an activation; its experts run as batched matmuls."""
    up = getattr(m, "gate_up_proj", None)
    if up is None:
        up = getattr(m, "up_proj", None)
    down = getattr(m, "down_proj", None)
    return (isinstance(up, nn.Parameter) and isinstance(down, nn.Parameter) and up.dim() == 3
            and down.dim() == 3 and up.shape[0] == down.shape[0] and hasattr(m, "act_fn")
            and len(forward_args(m)) >= 3)        # not Llama 4's experts(hidden) alone


def is_experts_module(m: nn.Module) -> bool:
    """A module h2 runs sparsely: one with weight stacks (`has_weight_stacks`), or any other of
    transformers' experts interface whose parameters are per-expert stacks (DBRX's; its experts
    run through its own forward, frontend/routing.py)."""
    return has_weight_stacks(m) or is_routed_experts(m)


def experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    out = []
    for name, m in model.named_modules():
        if is_experts_module(m) and not any(name.startswith(p + ".") for p, _ in out):
            out.append((name, m))
    return out


def _stacks(m: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of the per-expert stacks of an experts module: its own parameters, or
    every parameter under a module that runs through its own forward."""
    return list(m.named_parameters(recurse=not has_weight_stacks(m)))


def expert_param_names(model: nn.Module) -> dict[str, str]:
    """FQN -> its experts module's path, for every per-expert stack of every experts module."""
    out = {}
    for path, m in experts_modules(model):
        for pname, _ in _stacks(m):
            out[f"{path}.{pname}" if path else pname] = path
    return out


def capacity_of(tokens: int, top_k: int, experts: int, factor: float | None) -> int:
    """Tokens one expert takes per micro-batch (GShard's expert capacity), 1 .. tokens."""
    if factor is None:
        return tokens
    return max(1, min(tokens, math.ceil(factor * tokens * top_k / experts)))


def placement_order(experts: int, ep: int, kind: str = "contiguous") -> list[int]:
    """The expert in each slot, rank-major (rank r holds slots r*E/ep .. (r+1)*E/ep - 1):
    `contiguous` puts experts 0..E/ep-1 on rank 0, `round_robin` puts e on rank e % ep;
    `balanced` starts contiguous and is rebalanced from measured loads (migration)."""
    per = experts // ep
    if kind == "round_robin":
        return [r + ep * i for r in range(ep) for i in range(per)]
    return list(range(experts))


def _weights(m: nn.Module):
    up = m.gate_up_proj if getattr(m, "has_gate", True) and hasattr(m, "gate_up_proj") else m.up_proj
    up_bias = getattr(m, "gate_up_proj_bias", None) if up is getattr(m, "gate_up_proj", None) \
        else getattr(m, "up_proj_bias", None)
    has_bias = getattr(m, "has_bias", False)
    return up, (up_bias if has_bias else None), m.down_proj, \
        (getattr(m, "down_proj_bias", None) if has_bias else None)


def _linear(x, w, b, transposed: bool):
    """x [e, n, a] through e stacked weights: w [e, out, a] (or [e, a, out] transposed)."""
    y = torch.bmm(x, w if transposed else w.transpose(1, 2))
    return y if b is None else y + b.unsqueeze(1)


def experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """h2's dispatch / experts / combine (see the module docstring). Installed per instance."""
    E, ep = self.h2_experts, self.h2_ep
    local = E // ep
    x = hidden_states.reshape(-1, hidden_states.shape[-1])      # DBRX passes [B, S, D]
    T, D = x.shape
    k = top_k_index.shape[-1]
    C = capacity_of(T, k, E, self.h2_capacity)
    flat = top_k_index.reshape(-1)                           # [T*k], token-major
    onehot = F.one_hot(flat, E)                              # [T*k, E]
    counts = onehot.sum(0)                                   # tokens routed to each expert
    x = stats(x, counts, C, self.h2_path)
    pos = (onehot.cumsum(0) * onehot).sum(-1) - 1            # place in its expert's queue
    slot = torch.where(pos < C, flat * C + pos, torch.full_like(flat, E * C))   # E*C: dropped
    src = x.unsqueeze(1).expand(T, k, D).reshape(T * k, D)
    buf = x.new_zeros(E * C + 1, D).index_add(0, slot, src)
    buf = buf[:E * C].reshape(E, C, D)
    if ep > 1:
        buf = buf[self.h2_placement]                         # experts in slot (rank) order
        buf = all_to_all(buf, ep)                            # chunk r: rank r's tokens
        buf = buf.reshape(ep, local, C, D).transpose(0, 1).reshape(local, ep * C, D)
    if has_weight_stacks(self):
        transposed = bool(getattr(self, "is_transposed", False))
        up, up_b, down, down_b = _weights(self)
        h = _linear(buf, up, up_b, transposed)
        h = self._apply_gate(h) if getattr(self, "has_gate", True) else self.act_fn(h)
        y = _linear(h, down, down_b, transposed)
    else:                   # each local expert through the module's own forward
        y = torch.stack([expert_output(self, buf[s], s, self.h2_path) for s in range(local)])
    if ep > 1:
        y = y.reshape(local, ep, C, D).transpose(0, 1).reshape(E, C, D)
        y = all_to_all(y, ep)
        y = y[self.h2_slot]                                  # back to expert order
    y = torch.cat([y.reshape(E * C, D), y.new_zeros(1, D)])
    out = y[slot].reshape(T, k, D) * top_k_weights.to(y.dtype).unsqueeze(-1)
    return out.sum(1).to(hidden_states.dtype).reshape(hidden_states.shape)


def _default_apply_gate(self, h):
    gate, up = h.chunk(2, dim=-1)
    return self.act_fn(gate) * up


def install(model: nn.Module, *, ep: int = 1, capacity: float | None = None,
            placement: str = "contiguous", file: str | None = None) -> list[str]:
    """Give every experts module of `model` h2's sparse forward (capacity `capacity`) and, with
    ep > 1, only the first EP rank's share of its stacks (on the meta device the shapes are
    all that matters; the compiler slices the real weights per rank). Returns the modules'
    paths; an H2Error when the model has no experts module or ep does not divide E."""
    mods = experts_modules(model)
    if not mods:
        raise H2Error("the plan has a 'moe' section, but the model has no experts module of the "
                      "form h2 runs sparsely (weight stacks gate_up_proj/up_proj and down_proj "
                      "[experts, ...] and an act_fn, called as experts(hidden, top_k_index, "
                      "top_k_weights): transformers 5's experts interface)", file,
                      hint="examples/moe_tiny.py shows one (--arg routing=sparse); a dense MoE "
                           "(every expert on every token) runs without a 'moe' section")
    for path, m in mods:
        if getattr(m, "has_post_expert_norm", False):
            raise H2Error(f"experts module '{path}' has a post-expert norm, which h2's sparse "
                          "experts forward does not apply", file)
        E = int(m.down_proj.shape[0]) if has_weight_stacks(m) else expert_count(m)
        if E % ep:
            raise H2Error(f"moe: ep={ep} does not divide the {E} experts of '{path}'", file)
        m.h2_experts, m.h2_ep, m.h2_capacity, m.h2_path = E, int(ep), capacity, path
        if has_weight_stacks(m) and not hasattr(m, "_apply_gate"):
            m._apply_gate = types.MethodType(_default_apply_gate, m)
        if ep > 1:
            order = placement_order(E, ep, placement)
            inv = [0] * E
            for s, e in enumerate(order):
                inv[e] = s
            dev = next(m.parameters()).device
            m.register_buffer("h2_placement", torch.tensor(order, dtype=torch.long, device=dev))
            m.register_buffer("h2_slot", torch.tensor(inv, dtype=torch.long, device=dev))
            for pname, p in _stacks(m):
                if p.dim() >= 1 and p.shape[0] % E == 0:      # E slices: keep E/ep of them
                    owner, _, leaf = pname.rpartition(".")
                    setattr(m.get_submodule(owner), leaf,
                            nn.Parameter(p.new_empty((p.shape[0] // ep, *p.shape[1:])),
                                         requires_grad=p.requires_grad))
        m.forward = types.MethodType(experts_forward, m)
    return [p for p, _ in mods]


def shards(full: dict, stacks: dict, placements: dict, ep: int) -> list[dict]:
    """Per EP rank, its weights: each expert stack (FQN -> its experts module's path in
    `stacks`) sliced to the rank's slots of that module's placement (slot order), every other
    tensor whole. `full` maps FQN -> numpy array."""
    import numpy as np
    out = []
    for r in range(ep):
        shard = {}
        for k, v in full.items():
            path = stacks.get(k)
            if path is None:
                shard[k] = v
                continue
            order = placements[path]
            per = len(order) // ep
            slices = v.reshape(len(order), -1, *v.shape[1:])     # [E, rows of one expert, ...]
            shard[k] = np.ascontiguousarray(
                slices[order[r * per:(r + 1) * per]].reshape(-1, *v.shape[1:]))
        out.append(shard)
    return out
