"""A tiny Mixture-of-Experts decoder: LLaMA blocks whose FFN is `num_experts` SwiGLU experts with
top-k routing (softmax scores, the k best renormalised).

Two forms of the same model, with the same initial weights for the same seed:

- `routing="dense"`, the numerical oracle: every expert runs on every token and a
  gate masked to each token's top-k experts combines them.
- `routing="sparse"` (default): the experts are one experts module in transformers 5's form (weight
  stacks `gate_up_proj` [E, 2F, D] and `down_proj` [E, D, F], called with the routing
  decision), which h2 runs sparsely with a capacity and expert parallelism
  (frontend/moe.py, a plan's `moe` section). Its own eager forward gathers each token's
  experts' weights (no data-dependent shapes).

Router options (both forms): `scoring` softmax (Mixtral) or sigmoid (DeepSeek-V3; the top-k
scores renormalised), `shared` experts every token passes (one FFN `shared` times as wide),
`aux_loss` the weight of Switch Transformer's load-balancing loss (frontend/moe.py
`attach_aux_loss`: its gradient is injected in the block, weighted like the loss). `skew` > 0
adds `skew` to the router logits of the first `hot` experts: a router made skewed on purpose, to
exercise expert migration.

The IR marks these blocks `moe_block` with their expert shape, so the planner can cost them with
Piper's expert terms.
"""
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama_tiny import Attention, FeedForward, Llama, RMSNorm  # noqa: E402


def _skew(num_experts: int, skew: float, hot: int) -> torch.Tensor:
    return torch.tensor([float(skew) if e < hot else 0.0 for e in range(num_experts)])


def _scores(logits, scoring: str):
    """Router scores: softmax (Mixtral) or sigmoid (DeepSeek-V3) of the logits."""
    return torch.sigmoid(logits) if scoring == "sigmoid" else F.softmax(logits, dim=-1)


class MoE(nn.Module):
    """The dense reference form: every expert on every token, gated to the top-k."""

    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int, skew: float = 0.0,
                 hot: int = 0, scoring: str = "softmax", shared: int = 0, aux_loss: float = 0.0):
        super().__init__()
        self.top_k, self.scoring, self.aux_loss = top_k, scoring, aux_loss
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.experts = nn.ModuleList(FeedForward(dim, hidden) for _ in range(num_experts))
        # experts every token goes through (DeepSeek-V3, Qwen2-MoE), as one wider FFN
        self.shared = FeedForward(dim, hidden * shared) if shared else None
        self.register_buffer("router_skew", _skew(num_experts, skew, hot), persistent=False)

    def forward(self, x):
        scores = _scores(self.router(x) + self.router_skew, self.scoring)
        # k-th largest score per token; detached: selection is not differentiated
        top = scores.topk(self.top_k, dim=-1)
        kth = top[0].detach()[..., -1:]
        gates = torch.where(scores >= kth, scores, torch.zeros_like(scores))
        gates = gates / gates.sum(dim=-1, keepdim=True)
        out = gates[..., 0:1] * self.experts[0](x)
        for e in range(1, len(self.experts)):
            out = out + gates[..., e:e + 1] * self.experts[e](x)
        if self.shared is not None:
            out = out + self.shared(x)
        return _with_aux(out, scores, top[1], self.aux_loss)


def _with_aux(out, scores, ids, coef: float):
    """out with the router's load-balancing loss (weight `coef`) attached (frontend/moe.py)."""
    if not coef:
        return out
    from frontend.moe import attach_aux_loss, load_balancing_loss
    E = scores.shape[-1]
    probs = scores / scores.sum(dim=-1, keepdim=True)
    aux = load_balancing_loss(probs.reshape(-1, E), ids.reshape(-1, ids.shape[-1]), E)
    return attach_aux_loss(out, aux, coef)


class Experts(nn.Module):
    """E SwiGLU experts as weight stacks (transformers 5's experts form): gate_up_proj holds
    [w1; w3] of each expert, down_proj its w2."""

    def __init__(self, dim: int, hidden: int, num_experts: int):
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * hidden, dim))
        self.down_proj = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.act_fn = F.silu
        self.has_gate, self.has_bias, self.is_transposed = True, False, False

    def forward(self, x, top_k_index, top_k_weights):
        T, k = top_k_index.shape
        ids = top_k_index.reshape(-1)
        xs = x.repeat_interleave(k, dim=0).unsqueeze(-1)                 # [T*k, D, 1]
        gate, up = torch.bmm(self.gate_up_proj[ids], xs).squeeze(-1).chunk(2, dim=-1)
        y = torch.bmm(self.down_proj[ids], (self.act_fn(gate) * up).unsqueeze(-1)).squeeze(-1)
        return (y * top_k_weights.reshape(-1, 1)).reshape(T, k, -1).sum(1)


class SparseMoE(nn.Module):
    """The same router as MoE; the experts are one `Experts` module called with the routing."""

    def __init__(self, dense: MoE):
        super().__init__()
        self.top_k, self.scoring, self.aux_loss = dense.top_k, dense.scoring, dense.aux_loss
        self.router = dense.router
        self.shared = dense.shared
        self.register_buffer("router_skew", dense.router_skew, persistent=False)
        E = len(dense.experts)
        hidden, dim = dense.experts[0].w1.weight.shape
        self.experts = Experts(dim, hidden, E)
        with torch.no_grad():
            self.experts.gate_up_proj.copy_(torch.stack(
                [torch.cat([e.w1.weight, e.w3.weight]) for e in dense.experts]))
            self.experts.down_proj.copy_(torch.stack([e.w2.weight for e in dense.experts]))

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        scores = _scores(self.router(x) + self.router_skew, self.scoring)
        weights, ids = scores.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        out = self.experts(x, ids, weights)
        if self.shared is not None:
            out = out + self.shared(x)
        return _with_aux(out, scores, ids, self.aux_loss).reshape(shape)


class MoEBlock(nn.Module):
    def __init__(self, dim, n_heads, hidden, num_experts, top_k, skew=0.0, hot=0, **router):
        super().__init__()
        self.attn_norm = RMSNorm(dim)
        self.attn = Attention(dim, n_heads)
        self.ffn_norm = RMSNorm(dim)
        self.moe = MoE(dim, hidden, num_experts, top_k, skew, hot, **router)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.moe(self.ffn_norm(x))


def build_model(vocab=4096, dim=128, n_layers=4, n_heads=4, ffn=256, num_experts=4, top_k=2,
                max_seq=1024, routing="sparse", skew=0.0, hot=0, scoring="softmax", shared=0,
                aux_loss=0.0):
    if routing not in ("dense", "sparse"):
        raise ValueError(f"routing must be 'dense' or 'sparse', got {routing!r}")
    if scoring not in ("softmax", "sigmoid"):
        raise ValueError(f"scoring must be 'softmax' or 'sigmoid', got {scoring!r}")
    router = {"scoring": scoring, "shared": int(shared), "aux_loss": float(aux_loss)}
    model = Llama(vocab=int(vocab), dim=int(dim), n_layers=int(n_layers), n_heads=int(n_heads),
                  ffn=int(ffn), max_seq=int(max_seq))
    model.layers = nn.ModuleList(MoEBlock(int(dim), int(n_heads), int(ffn), int(num_experts),
                                          int(top_k), float(skew), int(hot), **router)
                                 for _ in range(int(n_layers)))
    if routing == "sparse":          # the same weights, the experts as one stacked module
        for block in model.layers:
            block.moe = SparseMoE(block.moe)
    return model
