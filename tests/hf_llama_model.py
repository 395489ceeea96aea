"""A tiny transformers `LlamaForCausalLM` (random weights, small config) as an h2 model file.

h2ir's attention op is causal-by-flag (no per-token mask tensor yet), so the model is run with
an attention implementation registered under the name "h2_causal": transformers' own SDPA
attention, with a mask function that returns no mask — SDPA then applies `is_causal=True`.
"""
import torch
import torch.nn as nn
from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface

AttentionInterface.register("h2_causal", sdpa_attention_forward)
AttentionMaskInterface.register("h2_causal", lambda *args, **kwargs: None)


class CausalLMLogits(nn.Module):
    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, tokens):
        # An all-ones mask (no padding) also skips transformers' packed-sequence detection.
        mask = torch.ones_like(tokens)
        return self.lm(input_ids=tokens, attention_mask=mask, use_cache=False).logits


def build_model(layers=2, vocab=256, hidden=64, ffn=128, heads=4):
    cfg = LlamaConfig(vocab_size=int(vocab), hidden_size=int(hidden), intermediate_size=int(ffn),
                      num_hidden_layers=int(layers), num_attention_heads=int(heads),
                      num_key_value_heads=int(heads), max_position_embeddings=256,
                      tie_word_embeddings=False)
    cfg._attn_implementation = "h2_causal"
    return CausalLMLogits(LlamaForCausalLM(cfg))
