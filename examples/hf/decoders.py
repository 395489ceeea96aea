"""Unmodified `transformers` decoders as h2 model files: a tiny random-weight config of any
causal-LM family transformers knows, wrapped only as `model(input_ids=ids, use_cache=False).logits`.

    h2c compile examples/hf/decoders.py --arg family=llama --arg attn=eager --plan uniform -o build

`family` is a transformers `model_type` (llama, mistral, qwen2, gemma, phi3, gpt2, mixtral,
qwen2_moe, ...); `attn` the attention implementation (`sdpa`, transformers' default, or
`eager`); `experts` a MoE experts kernel (`batched_mm`; default transformers' `grouped_mm`). Sizes are set through the generic config names (hidden_size, num_hidden_layers, ...),
which every family maps to its own; dropout is off (`dropout=0.0`) so runs are comparable with
eager training — with `dropout=p` h2 draws its own counter-based masks, the same on every backend.
"""
import torch.nn as nn
from transformers import AutoConfig, AutoModelForCausalLM

# Extra config per family: only what the generic names do not cover (MoE shape, head size).
FAMILY_CONFIG = {
    "gemma": {"head_dim": 16},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                  "shared_expert_intermediate_size": 64, "decoder_sparse_step": 1},
}
DROPOUT_FIELDS = ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop",
                  "summary_first_dropout", "dropout", "activation_dropout")


class CausalLMLogits(nn.Module):
    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids):
        return self.lm(input_ids=input_ids, use_cache=False).logits


def build_model(family="llama", attn="sdpa", layers=2, hidden=64, ffn=128, heads=4, kv_heads=2,
                vocab=512, max_seq=256, tie=None, experts="", dropout=0.0):
    extra = dict(FAMILY_CONFIG.get(family, {}))
    if tie is not None:
        extra["tie_word_embeddings"] = bool(tie)
    cfg = AutoConfig.for_model(
        family, vocab_size=int(vocab), hidden_size=int(hidden), intermediate_size=int(ffn),
        num_hidden_layers=int(layers), num_attention_heads=int(heads),
        num_key_value_heads=int(kv_heads), max_position_embeddings=int(max_seq),
        bos_token_id=0, eos_token_id=1, pad_token_id=None, **extra)
    if family == "gpt2":
        cfg.n_inner = int(ffn)
    for f in DROPOUT_FIELDS:
        if isinstance(getattr(cfg, f, None), float):
            setattr(cfg, f, float(dropout))
    cfg._attn_implementation = attn
    if experts:          # MoE experts kernel: transformers' default grouped_mm, or batched_mm
        cfg._experts_implementation = experts
    return CausalLMLogits(AutoModelForCausalLM.from_config(cfg))
