"""H2's evaluation model (arXiv 2505.17548, Sec. 6): LLaMA architecture, 96 layers, 64 heads,
hidden 8192, SwiGLU FFN 36864, sequence length 4096, vocab 32000, untied head: ~113.27 B params.

Built on the meta device by `h2c`; never materialised on this machine.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama_tiny import Llama  # noqa: E402  (same architecture, bigger numbers)


def build_model(vocab=32000, dim=8192, n_layers=96, n_heads=64, ffn=36864, max_seq=4096):
    return Llama(vocab=int(vocab), dim=int(dim), n_layers=int(n_layers), n_heads=int(n_heads),
                 ffn=int(ffn), max_seq=int(max_seq))
