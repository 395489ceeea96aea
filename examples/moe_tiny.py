"""A tiny Mixture-of-Experts decoder: LLaMA blocks whose FFN is `num_experts` SwiGLU experts with
top-2 routing.

Routing here is the dense reference form: every expert runs on every token and a gate masked to
each token's top-k experts combines them. It has static shapes (traceable on the meta device)
and the same gradients for the selected experts as a sparse dispatch; expert-parallel dispatch
with all-to-all (Piper) replaces it on the roadmap. The IR marks these blocks `moe_block` with
their expert shape, so the planner can cost them with Piper's expert terms.
"""
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama_tiny import Attention, FeedForward, Llama, RMSNorm  # noqa: E402


class MoE(nn.Module):
    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.experts = nn.ModuleList(FeedForward(dim, hidden) for _ in range(num_experts))

    def forward(self, x):
        probs = F.softmax(self.router(x), dim=-1)
        # k-th largest probability per token; detached: selection is not differentiated
        kth = probs.topk(self.top_k, dim=-1)[0].detach()[..., -1:]
        gates = torch.where(probs >= kth, probs, torch.zeros_like(probs))
        gates = gates / gates.sum(dim=-1, keepdim=True)
        out = gates[..., 0:1] * self.experts[0](x)
        for e in range(1, len(self.experts)):
            out = out + gates[..., e:e + 1] * self.experts[e](x)
        return out


class MoEBlock(nn.Module):
    def __init__(self, dim, n_heads, hidden, num_experts, top_k):
        super().__init__()
        self.attn_norm = RMSNorm(dim)
        self.attn = Attention(dim, n_heads)
        self.ffn_norm = RMSNorm(dim)
        self.moe = MoE(dim, hidden, num_experts, top_k)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.moe(self.ffn_norm(x))


def build_model(vocab=4096, dim=128, n_layers=4, n_heads=4, ffn=256, num_experts=4, top_k=2,
                max_seq=1024):
    model = Llama(vocab=int(vocab), dim=int(dim), n_layers=int(n_layers), n_heads=int(n_heads),
                  ffn=int(ffn), max_seq=int(max_seq))
    model.layers = nn.ModuleList(MoEBlock(int(dim), int(n_heads), int(ffn), int(num_experts), int(top_k))
                                 for _ in range(int(n_layers)))
    return model
