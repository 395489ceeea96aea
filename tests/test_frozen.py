"""Frozen parameters (requires_grad=False, as in a fine-tune) are constants of the stage programs:
never updated, no gradient, no optimizer state. Training matches eager torch, which skips them
too; before, h2 trained them (0.07 % off eager from the second step)."""
import textwrap

import pytest

from conftest import run_cli, trains_like_eager

MODEL = textwrap.dedent('''
    import torch, torch.nn as nn, torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.ln = nn.LayerNorm(d)
            self.fc1 = nn.Linear(d, 2 * d)
            self.fc2 = nn.Linear(2 * d, d)

        def forward(self, x):
            return x + self.fc2(F.gelu(self.fc1(self.ln(x))))

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(256, 32)
            self.layers = nn.ModuleList([Block(32) for _ in range(3)])
            self.head = nn.Linear(32, 256)

        def forward(self, ids):
            x = self.emb(ids)
            for l in self.layers:
                x = l(x)
            return self.head(x)

    def build_model():
        m = LM()
        m.emb.weight.requires_grad_(False)           # a frozen embedding on the first stage
        m.layers[2].fc1.requires_grad_(False)        # and a frozen linear on the second
        return m
''')


@pytest.mark.parametrize("cluster,chip,dp", [("local4", "cpu-torch", 2),      # all-reduced too
                                             pytest.param("local-numpy", "cpu-numpy", 1,
                                                          marks=pytest.mark.slow)])
def test_frozen_parameters_stay_frozen_and_training_matches_eager(tmp_path, cluster, chip, dp):
    model = tmp_path / "m.py"
    model.write_text(MODEL)
    r = run_cli("h2c", "ir", str(model), "--seq-len", "16")
    assert r.returncode == 0, r.stderr
    assert "const %emb.weight" in r.stdout and "const %layers.2.fc1.weight" in r.stdout
    assert "param %layers.2.fc2.weight" in r.stdout
    trains_like_eager(tmp_path, model,
                      f'model "{model}"\ncluster "{cluster}"\nbatch global=8 micro=2 seq=16\n'
                      f"schedule 1f1b\ndp {dp}\n"
                      f"stage chip={chip} chips={dp} tp=1 layers=embed, block.0, block.1\n"
                      f"stage chip={chip} chips={dp} tp=1 layers=block.2, head\n", 4)
