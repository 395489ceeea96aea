"""A tiny LLaMA-style decoder (RMSNorm, rotary embeddings, causal SDPA, SwiGLU; head untied unless
`tie=true`).

Defaults: d=256, 8 layers, 8 heads, FFN 688, vocab 8192 (~6.4 M parameters) — trains on a CPU in
well under a second per step. Model-file convention: `build_model(**kwargs)`; `example_inputs` and
`loss_fn` are optional (defaults: int64 token ids, next-token cross-entropy).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x, cos, sin):
        b, s, d = x.shape
        q = self.wq(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        cos, sin = cos.narrow(0, 0, s), sin.narrow(0, 0, s)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, s, d))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim: int, n_heads: int, ffn: int):
        super().__init__()
        self.attn_norm = RMSNorm(dim)
        self.attn = Attention(dim, n_heads)
        self.ffn_norm = RMSNorm(dim)
        self.ffn = FeedForward(dim, ffn)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.ffn(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, vocab=8192, dim=256, n_layers=8, n_heads=8, ffn=688, max_seq=4096,
                 rope_theta=10000.0):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, n_heads, ffn) for _ in range(n_layers))
        self.norm = RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        head_dim = dim // n_heads
        inv = 1.0 / (rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        ang = torch.outer(torch.arange(max_seq, dtype=torch.float32), inv)
        ang = torch.cat((ang, ang), dim=-1)
        # Rotary tables are constants, not weights: they are rebuilt, never trained or saved.
        self.register_buffer("rope_cos", ang.cos(), persistent=False)
        self.register_buffer("rope_sin", ang.sin(), persistent=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, self.rope_cos, self.rope_sin)
        return self.head(self.norm(x))


def build_model(vocab=8192, dim=256, n_layers=8, n_heads=8, ffn=688, max_seq=1024, tie=False):
    model = Llama(vocab=int(vocab), dim=int(dim), n_layers=int(n_layers), n_heads=int(n_heads),
                  ffn=int(ffn), max_seq=int(max_seq))
    if tie:      # one parameter for the embedding and the LM head (as GPT-2 and Gemma do)
        model.head.weight = model.embed.weight
    return model
