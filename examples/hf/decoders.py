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
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                  "decoder_sparse_step": 1},
    "olmoe": {"num_experts": 4, "num_experts_per_tok": 2},
    "granitemoe": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "phimoe": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "deepseek_v3": {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                    "n_shared_experts": 1, "first_k_dense_replace": 0, "n_group": 1,
                    "topk_group": 1, "kv_lora_rank": 32, "q_lora_rank": 48,
                    "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
                    "head_dim": 8,              # deepseek's rotary size: qk_rope_head_dim
                    "num_key_value_heads": 4},  # multi-head latent attention: every head
    "deepseek_v2": {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                    "n_shared_experts": 1, "first_k_dense_replace": 0, "kv_lora_rank": 32,
                    "q_lora_rank": 48, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
                    "v_head_dim": 16, "head_dim": 8, "num_key_value_heads": 4},
    # dense and MoE layers, RoPE and NoPE (temperature-tuned) layers, chunked attention
    "llama4_text": {"num_local_experts": 4, "num_experts_per_tok": 1, "intermediate_size_mlp": 128,
                    "interleave_moe_layer_step": 2, "no_rope_layer_interval": 2,
                    "attention_chunk_size": 16, "floor_scale": 8},
    # state-space and hybrid families: Mamba-2 heads of 16 and chunks of 16 at hidden 64
    "jamba": {"num_experts": 4, "num_experts_per_tok": 2, "attn_layer_period": 2,
              "attn_layer_offset": 1, "expert_layer_period": 3, "expert_layer_offset": 1},
    "mamba2": {"num_heads": 8, "head_dim": 16, "state_size": 16, "n_groups": 2, "chunk_size": 16},
    "zamba": {"n_mamba_heads": 2, "mamba_d_state": 16},
    "zamba2": {"n_mamba_heads": 8, "mamba_headdim": 16, "mamba_d_state": 16, "chunk_size": 16},
    "bamba": {"mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_state": 16,
              "mamba_chunk_size": 16},
    "granitemoehybrid": {"mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_state": 16,
                         "mamba_chunk_size": 16, "num_local_experts": 4, "num_experts_per_tok": 2},
    "falcon_h1": {"mamba_d_ssm": 128, "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_state": 16,
                  "mamba_chunk_size": 16},
    "nemotron_h": {"mamba_num_heads": 8, "mamba_head_dim": 16, "ssm_state_size": 16,
                   "n_groups": 2, "chunk_size": 16, "head_dim": 16},
    "qwen3_next": {"num_experts": 4, "num_experts_per_tok": 2, "linear_num_value_heads": 4,
                   "linear_num_key_heads": 2, "linear_key_head_dim": 16,
                   "linear_value_head_dim": 16, "head_dim": 16},
}
# Hybrids whose config lists each layer's kind: (field, state-space or convolution layer,
# attention layer); even layers are the first, odd ones the second (Jamba says it by periods)
HYBRID_LAYERS = {"zamba": ("layers_block_type", "mamba", "hybrid"),
                 "zamba2": ("layers_block_type", "mamba", "hybrid"),
                 "granitemoehybrid": ("layer_types", "mamba", "attention"),
                 "nemotron_h": ("layers_block_type", "mamba", "attention"),
                 "lfm2": ("layer_types", "conv", "full_attention"),
                 "qwen3_next": ("layer_types", "linear_attention", "full_attention")}
# The families h2's tests train against eager transformers (tests/test_hf_families.py,
# tools/family_matrix.py): the first eight with both attentions on both backends; the rest with
# the attention named (sdpa where transformers offers it for the family) on both backends.
CORE_FAMILIES = ["llama", "mistral", "qwen2", "gemma", "phi3", "gpt2", "mixtral", "qwen2_moe"]
MORE_FAMILIES = {
    "qwen3": "sdpa", "gemma2": "eager", "gemma3_text": "sdpa", "phi": "sdpa", "falcon": "sdpa",
    "gpt_neox": "sdpa", "olmo": "sdpa", "olmo2": "sdpa", "olmo3": "sdpa", "stablelm": "sdpa",
    "starcoder2": "sdpa", "cohere": "sdpa", "cohere2": "sdpa", "granite": "sdpa",
    "gpt_bigcode": "sdpa", "opt": "sdpa", "bloom": "eager", "gptj": "sdpa", "codegen": "sdpa",
    "glm": "sdpa", "glm4": "sdpa", "helium": "sdpa", "smollm3": "sdpa", "exaone4": "sdpa",
    "ernie4_5": "sdpa", "hunyuan_v1_dense": "sdpa", "arcee": "sdpa", "apertus": "sdpa",
    "seed_oss": "sdpa", "ministral": "sdpa", "nemotron": "sdpa", "persimmon": "sdpa",
    "biogpt": "sdpa", "xglm": "eager", "internlm3": "sdpa", "bitnet": "sdpa", "mpt": "eager",
    "vaultgemma": "eager", "qwen3_moe": "sdpa", "olmoe": "sdpa", "granitemoe": "sdpa",
    "deepseek_v3": "sdpa", "gpt_neo": "eager",
}


def _is_dropout_field(name: str) -> bool:
    """A config field that holds a dropout probability, whatever the family calls it
    (attention_dropout, resid_pdrop, hidden_dropout_prob, ...)."""
    return "dropout" in name or name.endswith("_pdrop")


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
    if family == "gpt_neo":      # global and local (windowed) attention alternate, per layer
        n = int(layers)
        extra.setdefault("attention_types", [[["global", "local"], n // 2]] +
                         ([[["global"], 1]] if n % 2 else []))
        extra.setdefault("window_size", 16)
    if family == "dbrx":         # its attention and FFN sizes live in sub-configs
        extra.setdefault("attn_config", {"kv_n_heads": int(kv_heads), "rope_theta": 10000.0,
                                         "clip_qkv": 8.0})   # its forward needs a clip
        extra.setdefault("ffn_config", {"ffn_hidden_size": int(ffn) // 2, "moe_num_experts": 4,
                                        "moe_top_k": 2})
    if family in HYBRID_LAYERS:
        key, ssm, attention = HYBRID_LAYERS[family]
        extra.setdefault(key, [attention if i % 2 else ssm for i in range(int(layers))])
    if family == "bamba":
        extra.setdefault("attn_layer_indices", [i for i in range(int(layers)) if i % 2])
    sizes = dict(vocab_size=int(vocab), hidden_size=int(hidden), intermediate_size=int(ffn),
                 num_hidden_layers=int(layers), num_attention_heads=int(heads),
                 num_key_value_heads=int(kv_heads), max_position_embeddings=int(max_seq),
                 bos_token_id=0, eos_token_id=1, pad_token_id=None)
    cfg = AutoConfig.for_model(family, **{**sizes, **extra})   # a family's own entry wins
    if family == "gpt2":
        cfg.n_inner = int(ffn)
    if family == "dbrx":         # the FFN config copied d_model before hidden_size set it
        cfg.ffn_config.hidden_size = cfg.d_model
    head = int(hidden) // int(heads)
    if "head_dim" not in extra and hasattr(cfg, "head_dim") and \
            not isinstance(getattr(type(cfg), "head_dim", None), property):
        cfg.head_dim = head                  # families whose default head size is fixed (128)
    if (getattr(cfg, "rotary_dim", None) or 0) > head:
        cfg.rotary_dim = head                # GPT-J and CodeGen rotate the first 64 dims by default
    for f, v in list(vars(cfg).items()):
        if _is_dropout_field(f) and isinstance(v, (int, float)) and not isinstance(v, bool):
            setattr(cfg, f, float(dropout))
    cfg._attn_implementation = attn
    if experts:          # MoE experts kernel: transformers' default grouped_mm, or batched_mm
        cfg._experts_implementation = experts
    return CausalLMLogits(AutoModelForCausalLM.from_config(cfg))
