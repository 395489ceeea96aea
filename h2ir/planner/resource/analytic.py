"""Analytic model costs, for when no traced graph is at hand (tests, benchmarks, what-ifs)."""
from __future__ import annotations

import dataclasses

from h2ir.costs import LayerCost, ModelCosts, MoEInfo


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
