"""A model with inputs after the token ids (here position ids, read on both stages): their values
are what the model file's `example_inputs` returns, stored with stage 0's constants and passed on
to later stages like any activation. Before, the compile succeeded and the first worker failed
with an internal KeyError."""
import json
import textwrap

from conftest import trains_like_eager

MODEL = textwrap.dedent('''
    import torch, torch.nn as nn, torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self, d=32, h=4):
            super().__init__()
            self.h = h
            self.n = nn.RMSNorm(d)
            self.qkv = nn.Linear(d, 3 * d, bias=False)
            self.o = nn.Linear(d, d, bias=False)
            self.pe = nn.Embedding(64, d)           # each block reads the position ids

        def forward(self, x, pos):
            b, s, d = x.shape
            h = self.n(x + self.pe(pos))
            q, k, v = self.qkv(h).view(b, s, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return x + self.o(y.transpose(1, 2).reshape(b, s, d))

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(256, 32)
            self.layers = nn.ModuleList([Block() for _ in range(3)])
            self.head = nn.Linear(32, 256, bias=False)

        def forward(self, input_ids, position_ids):
            x = self.emb(input_ids)
            for l in self.layers:
                x = l(x, position_ids)
            return {"logits": self.head(x)}

    def build_model():
        return LM()

    def example_inputs(micro_batch, seq_len):
        return (torch.zeros(micro_batch, seq_len, dtype=torch.long),
                (torch.arange(seq_len) * 3 % 64).expand(micro_batch, seq_len))
''')


def test_inputs_after_the_token_ids_reach_every_stage_and_train_like_eager(tmp_path):
    model = tmp_path / "m.py"
    model.write_text(MODEL)
    build = trains_like_eager(
        tmp_path, model, f'model "{model}"\ncluster "local"\nbatch global=4 micro=2 seq=16\n'
        "schedule 1f1b\ndp 1\n"
        "stage chip=cpu-torch chips=1 tp=1 layers=embed, block.0\n"
        "stage chip=cpu-torch chips=1 tp=1 layers=block.1, block.2, head\n", 4)
    sig0 = json.loads((build / "stages/stage0.json").read_text())
    sig1 = json.loads((build / "stages/stage1.json").read_text())
    assert len(sig0["inputs"]) == 2 and sig0["fixed_inputs"] == sig0["inputs"][1:]
    assert sig0["fixed_inputs"][0] in sig1["inputs"]          # crosses to the second stage
