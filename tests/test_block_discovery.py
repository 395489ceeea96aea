"""Which modules are a model's pipeline blocks (frontend/capture.py `find_blocks`): a ModuleList,
a run of one class in an nn.Sequential, or a run of same-shaped child modules held as attributes
(`self.b0, self.b1`). A model whose blocks are not in a ModuleList is split into layers as well,
and trains like eager on two stages."""
import json
import os
import textwrap

import pytest
import torch.nn as nn

from conftest import run_cli, trains_like_eager
from frontend.capture import capture, find_blocks

# One model file, three ways of holding the blocks (`--arg hold=list|seq|attrs`); einsum
# attention under a torch.where mask, bias-carrying linears, a custom loss.
MODEL = textwrap.dedent('''
    import torch, torch.nn as nn, torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self, d, h):
            super().__init__()
            self.h = h
            self.ln1 = nn.LayerNorm(d); self.ln2 = nn.LayerNorm(d)
            self.qkv = nn.Linear(d, 3 * d); self.o = nn.Linear(d, d)
            self.fc1 = nn.Linear(d, 2 * d); self.fc2 = nn.Linear(2 * d, d)

        def forward(self, x):
            b, s, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
            q, k, v = (t.reshape(b, s, self.h, d // self.h) for t in (q, k, v))
            att = torch.einsum("bqhd,bkhd->bhqk", q, k) / (d // self.h) ** 0.5
            causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
            att = torch.where(causal, att, torch.finfo(att.dtype).min).softmax(-1)
            y = torch.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, s, d)
            x = x + self.o(y)
            return x + self.fc2(F.silu(self.fc1(self.ln2(x))))

    class LM(nn.Module):
        def __init__(self, hold, vocab=256, d=32, layers=3, h=4):
            super().__init__()
            self.hold = hold
            self.emb = nn.Embedding(vocab, d)
            blocks = [Block(d, h) for _ in range(layers)]
            if hold == "list":
                self.blocks = nn.ModuleList(blocks)
            elif hold == "seq":
                self.blocks = nn.Sequential(*blocks)
            else:
                for i, b in enumerate(blocks):
                    setattr(self, f"b{i}", b)
            self.out = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, vocab))

        def forward(self, ids):
            x = self.emb(ids)
            if self.hold == "attrs":
                x = self.b2(self.b1(self.b0(x)))
            elif self.hold == "seq":
                x = self.blocks(x)
            else:
                for b in self.blocks:
                    x = b(x)
            return self.out(x)

    def build_model(hold="list"):
        return LM(hold)

    def loss_fn(logits, targets):
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), label_smoothing=0.1)
''')


class _Leafy(nn.Module):
    """Three same-shaped Linears side by side and one composite module: none is a block."""
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64)
        self.block = nn.Sequential(nn.Linear(8, 8), nn.ReLU())


class _Mixed(nn.Module):
    """Attribute runs break at a change of class or of parameter shapes."""
    def __init__(self):
        super().__init__()
        mk = lambda d: nn.Sequential(nn.Linear(d, d), nn.LayerNorm(d))  # noqa: E731
        self.x0, self.x1, self.y0, self.x2 = mk(16), mk(16), mk(24), mk(16)


def test_blocks_are_found_in_a_list_a_sequential_and_attributes(tmp_path):
    path = tmp_path / "m.py"
    path.write_text(MODEL)
    want = {"list": [f"blocks.{i}" for i in range(3)], "seq": [f"blocks.{i}" for i in range(3)],
            "attrs": ["b0", "b1", "b2"]}
    for hold, paths in want.items():
        names = [l.name for l in capture(str(path), {"hold": hold}, 1, 16).layers]
        assert names == ["embed", "block.0", "block.1", "block.2", "head"], (hold, names)
        kinds = [l.kind for l in capture(str(path), {"hold": hold}, 1, 16).layers]
        assert kinds[1:4] == ["transformer_block"] * 3
    # the head's Sequential (LayerNorm, Linear) is no block run: its elements differ in class
    assert find_blocks(nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 4096))) == []
    assert find_blocks(_Leafy()) == []
    assert find_blocks(_Mixed()) == ["x0", "x1"]


@pytest.mark.slow          # the capture is checked above; two_depths below trains in make test
def test_attribute_blocks_train_like_eager_on_two_stages(tmp_path):
    model = tmp_path / "m.py"
    model.write_text(MODEL)
    trains_like_eager(tmp_path, model,
                      f'model "{model}"\ncluster "local-numpy"\nbatch global=4 micro=2 seq=16\n'
                      "schedule 1f1b\ndp 1\n"
                      "stage chip=cpu-numpy chips=1 tp=1 layers=embed, block.0, block.1\n"
                      "stage chip=cpu-numpy chips=1 tp=1 layers=block.2, head\n", 4,
                      model_args=["hold=attrs"])


def test_hand_plan_prediction_says_when_layer_times_are_a_flop_estimate(tmp_path):
    """A plan file on a measured cluster predicts from stored layer times, else from FLOPs; the
    compile says which, and `--measure` measures them as `--plan auto` does."""
    model = tmp_path / "m.py"
    model.write_text(MODEL)
    # stored records serve any layer of the same kind, shape and FLOPs: start from a calibration
    # file with the backends' rates only (measured once, not again here)
    from backends.calibrate import ensure_calibration
    from h2ir.planner.calibration import Calibration, save_calibration
    cal = ensure_calibration(["torch"])
    own = Calibration.from_json({**cal.to_json(), "layer_records": {}})
    save_calibration(own, tmp_path / "cal.json")
    env = {**os.environ, "H2_CALIBRATION": str(tmp_path / "cal.json")}
    plan = tmp_path / "p.h2plan"
    plan.write_text(f'model "{model}"\ncluster "local"\nbatch global=2 micro=1 seq=16\n'
                    "schedule 1f1b\ndp 1\n"
                    "stage chip=cpu-torch chips=1 tp=1 layers=embed, block.0, block.1\n"
                    "stage chip=cpu-torch chips=1 tp=1 layers=block.2, head\n")
    r = run_cli("h2c", "compile", str(model), "--plan", str(plan), "-o", str(tmp_path / "b1"),
                env=env)
    assert r.returncode == 0, r.stderr
    out = r.stdout + r.stderr
    assert "all 5 layers' times are a FLOP estimate" in out and "--measure" in out
    r = run_cli("h2c", "compile", str(model), "--plan", str(plan), "--measure",
                "-o", str(tmp_path / "b2"), env=env)
    assert r.returncode == 0, r.stderr
    assert "FLOP estimate" not in r.stdout + r.stderr
    m = json.loads((tmp_path / "b2/manifest.json").read_text())
    assert m["calibration_records"]          # the prediction's measured layer records


SHARED = textwrap.dedent('''
    import torch.nn as nn, torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.n = nn.LayerNorm(d)
            self.f1 = nn.Linear(d, 2 * d)
            self.f2 = nn.Linear(2 * d, d)

        def forward(self, x):
            return x + self.f2(F.gelu(self.f1(self.n(x))))

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(256, 32)
            shared = Block(32)                  # one module at two depths (ALBERT-style)
            self.layers = nn.ModuleList([shared, shared, Block(32)])
            self.head = nn.Linear(32, 256)

        def forward(self, ids):
            x = self.emb(ids)
            for l in self.layers:
                x = l(x)
            return self.head(x)

    def build_model():
        return LM()
''')


def test_a_block_called_at_two_depths_is_two_tied_layers_on_two_stages(tmp_path):
    """Each call of a block module is a layer (the module stack numbers repeated calls): the
    shared block's two calls land on different stages, its weights tied across them. Before,
    both calls were one layer, which no plan could split."""
    model = tmp_path / "m.py"
    model.write_text(SHARED)
    layers = capture(str(model), {}, 1, 16).layers
    assert [l.name for l in layers] == ["embed", "block.0", "block.1", "block.2", "head"]
    # the first call owns the shared weights; the second reads them as tied parameters
    assert {v.name for v in layers[1].params} >= {"layers.0.f1.weight", "layers.0.f2.weight"}
    assert not layers[2].params and "layers.0.f1.weight" in layers[2].attrs["tied"]
    trains_like_eager(tmp_path, model,
                      f'model "{model}"\ncluster "local-numpy"\nbatch global=4 micro=2 seq=16\n'
                      "schedule 1f1b\ndp 1\n"
                      "stage chip=cpu-numpy chips=1 tp=1 layers=embed, block.0\n"
                      "stage chip=cpu-numpy chips=1 tp=1 layers=block.1, block.2, head\n", 4)
