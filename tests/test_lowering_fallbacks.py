"""ATen ops with no lowering of their own go through their decomposition (frontend/lower.py
`_decompose`): a CompositeImplicitAutograd kernel (`Tensor.T` under torch.export, `swapaxes`)
or torch._decomp's entry (`stack`; `softplus`, whose decomposition is written in prims). And an
absent optional input (a layer norm without weight or bias) survives the IR's text form.
Each model here is one nobody wrote for h2: it trains on both backends with eager's losses."""
import textwrap

import pytest

from conftest import run_cli

MODEL = textwrap.dedent('''
    import torch
    import torch.nn as nn
    import torch.nn.functional as F


    class Block(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.w = nn.Parameter(torch.randn(d, d) * d ** -0.5)
            self.u = nn.Parameter(torch.randn(2 * d, d) * (2 * d) ** -0.5)

        def forward(self, x):
            h = F.layer_norm(x, (x.shape[-1],))              # no weight, no bias
            a = h @ self.w.T                                  # Tensor.T
            z = torch.stack([a, F.softplus(a)], dim=-1)       # stack; softplus
            z = z.flatten(-2).swapaxes(1, 2).swapaxes(1, 2)
            return x + z @ self.u


    class Net(nn.Module):
        def __init__(self, vocab=256, d=16, layers=2):
            super().__init__()
            self.emb = nn.Embedding(vocab, d)
            self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
            self.head = nn.Linear(d, vocab, bias=False)

        def forward(self, ids):
            x = self.emb(ids)
            for b in self.blocks:
                x = b(x)
            return self.head(x)


    def build_model(**kw):
        return Net(**{k: int(v) for k, v in kw.items()})
''')


def _trains_like_eager(tmp_path, model_text: str, cluster: str, steps: int) -> None:
    """Compile `model_text` (a uniform plan on `cluster`), run `steps` steps with h2x, and
    compare the losses with eager training of the same weights on the same data."""
    from conftest import trains_like_eager
    f = tmp_path / "m.py"
    f.write_text(model_text)
    trains_like_eager(tmp_path, f, None, steps,
                      compile_args=["--cluster", cluster, "--plan", "uniform", "--global-batch",
                                    "4", "--micro-batch", "2", "--seq-len", "8"])


def test_decomposed_ops_lower_to_the_op_set(tmp_path):
    """The IR holds only op-set ops where the model called stack, softplus and Tensor.T, and
    the weightless layer norm prints and parses back unchanged."""
    from frontend.capture import trace_model
    from h2ir.text import parse_graph, print_graph
    f = tmp_path / "m.py"
    f.write_text(MODEL)
    cap = trace_model(str(f), {}, 2, 8)
    ops = {n.op for n in cap.graph.nodes()}
    assert "cat" in ops and {"log1p", "log"} & ops, ops
    assert not {"stack", "softplus"} & ops
    norms = [n for n in cap.graph.nodes() if n.op == "layer_norm"]
    assert norms and all(n.inputs[1] is None and n.inputs[2] is None for n in norms)
    text = print_graph(cap.graph)
    assert print_graph(parse_graph(text)) == text


@pytest.mark.slow          # ~10 s each; the IR-level test above runs in make test
@pytest.mark.parametrize("backend", ["torch", "numpy"])
def test_decomposed_ops_train_like_eager(tmp_path, backend):
    _trains_like_eager(tmp_path, MODEL, {"torch": "local", "numpy": "local-numpy"}[backend], 4)


def test_an_op_with_no_lowering_nor_decomposition_is_named(tmp_path):
    """What cannot be decomposed still gets the located 'not in the h2ir op set' error."""
    f = tmp_path / "m.py"
    f.write_text(MODEL.replace("h = F.layer_norm(x, (x.shape[-1],))",
                               "h = torch.special.bessel_j0(x)"))
    r = run_cli("h2c", "ir", str(f), "--seq-len", "8")
    assert r.returncode != 0
    assert "bessel_j0" in r.stderr and "is not in the h2ir op set" in r.stderr, r.stderr
    assert f"{f}:" in r.stderr and "Traceback" not in r.stderr, r.stderr


LIFTED = textwrap.dedent('''
    import torch
    import torch.nn as nn


    class Net(nn.Module):
        def __init__(self, vocab=256, d=16):
            super().__init__()
            self.emb = nn.Embedding(vocab, d)
            self.proj = nn.Linear(d, 3 * d, bias=False)
            self.head = nn.Linear(2 * d, vocab, bias=False)

        def forward(self, ids):
            x = self.emb(ids)
            if x.shape[1] > 1:          # shape control flow: torch.fx cannot trace it, export can
                x = x * 2
            qkv = self.proj(x).view(*x.shape[:2], 3, -1)
            picked = qkv[..., [0, 2], :]            # a list index: a tensor export lifts
            return self.head(picked.flatten(-2))


    def build_model():
        return Net()
''')


def test_tensors_lifted_from_the_forward_get_their_values(tmp_path):
    """torch.export lifts `qkv[..., [0, 2], :]`'s index list out of the forward as a constant;
    captured on the meta device it has no value, so the compiler reads it from the real model
    (Falcon's `_split_heads` does this)."""
    from frontend.capture import trace_model
    f = tmp_path / "m.py"
    f.write_text(LIFTED)
    cap = trace_model(str(f), {}, 2, 8)
    lifted = [c.name for c in cap.graph.consts if "lifted" in c.name]
    assert cap.how == "torch.export" and lifted
    got = cap.constants(cap.model_file.build({}), lifted)
    assert [got[k].tolist() for k in lifted] == [[0, 2]]


@pytest.mark.slow          # ~10 s
def test_a_model_with_lifted_tensors_trains_like_eager(tmp_path):
    _trains_like_eager(tmp_path, LIFTED, "local", 3)


VIEW_WRITES = textwrap.dedent('''
    import torch
    import torch.nn as nn


    class Net(nn.Module):
        def __init__(self, vocab=256, d=16):
            super().__init__()
            self.emb = nn.Embedding(vocab, d)
            self.a = nn.Linear(d, d // 2, bias=False)
            self.b = nn.Linear(d, d // 2, bias=False)
            self.head = nn.Linear(d, vocab, bias=False)

        def forward(self, ids):
            x = self.emb(ids)
            if x.shape[1] > 1:          # shape control flow: torch.fx cannot trace it, export can
                x = x + 1
            h = x.new_empty(*x.shape)
            h[..., : x.shape[-1] // 2].copy_(self.a(x))   # writes through views of h
            h[..., x.shape[-1] // 2 :].copy_(self.b(x))
            h[..., :2].mul_(3.0)
            return self.head(h)


    def build_model():
        return Net()
''')


def test_writes_through_views_update_their_base(tmp_path):
    """In-place writes into slices of a fresh tensor (DeepSeek-V3's key states): the exported
    graph is functionalized, so the base sees the writes and gradients flow through them."""
    _trains_like_eager(tmp_path, VIEW_WRITES, "local-numpy", 3)


# the torch case in make test-slow: test_compiler's stage gradients run op_zoo on torch
@pytest.mark.parametrize("cluster, chip", [
    pytest.param("local", "cpu-torch", marks=pytest.mark.slow), ("local-numpy", "cpu-numpy")])
def test_a_model_of_seventy_torch_functions_trains_like_eager(tmp_path, cluster, chip):
    """tests/op_zoo.py: erf, atan, sign, flip, roll, var/std, argmax, remainder/fmod, hypot,
    log2, logsigmoid, mish, new_full (lerp) and ~55 more in one block, on both backends (a plan
    file: nothing to measure)."""
    from conftest import ROOT, trains_like_eager
    model = ROOT / "tests/op_zoo.py"
    trains_like_eager(tmp_path, model,
                      f'model "{model}"\ncluster "{cluster}"\nbatch global=4 micro=2 seq=8\n'
                      "schedule 1f1b\ndp 1\n"
                      f"stage chip={chip} chips=1 tp=1 layers=embed, block.0\n"
                      f"stage chip={chip} chips=1 tp=1 layers=block.1, head\n", 3,
                      model_args=["layers=2"])


ALIBI = textwrap.dedent('''
    import torch, torch.nn as nn, torch.nn.functional as F

    def alibi(h, s, device):            # slopes built from Python floats in the forward
        slopes = torch.tensor([2 ** (-8 * (i + 1) / h) for i in range(h)], device=device)
        rel = (torch.arange(s, device=device)[None, :] - torch.arange(s, device=device)[:, None])
        bias = slopes[:, None, None] * rel.float()[None]
        return bias.masked_fill(rel[None] > 0, float("-inf"))

    class Block(nn.Module):
        def __init__(self, d=32, h=4):
            super().__init__()
            self.h = h
            self.n = nn.LayerNorm(d, bias=False)
            self.qkv = nn.Linear(d, 3 * d, bias=False)
            self.o = nn.Linear(d, d, bias=False)

        def forward(self, x):
            b, s, d = x.shape
            q, k, v = self.qkv(self.n(x)).view(b, s, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=alibi(self.h, s, x.device)[None])
            return x + self.o(y.transpose(1, 2).reshape(b, s, d))

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(256, 32, padding_idx=0)
            self.layers = nn.ModuleList([Block() for _ in range(2)])

        def forward(self, ids):
            x = self.emb(ids)
            for l in self.layers:
                x = l(x)
            return x @ self.emb.weight.T                # tied head

    def build_model():
        return LM()
''')


def test_a_tensor_built_in_the_forward_trains_like_eager(tmp_path):
    """`torch.tensor([...])` in the forward (ALiBi slopes) is a constant make_fx's graph holds
    with no value on the meta device: the capture takes torch.export's path, which lifts it,
    and the compiler reads its value from the real model (it was "graph input
    '_tensor_constant0' is neither a model input, a parameter nor a buffer")."""
    from conftest import trains_like_eager
    from frontend.capture import trace_model
    model = tmp_path / "m.py"
    model.write_text(ALIBI)
    assert trace_model(str(model), {}, 1, 8).how == "torch.export"
    trains_like_eager(tmp_path, model,
                      f'model "{model}"\ncluster "local-numpy"\nbatch global=4 micro=2 seq=8\n'
                      "schedule 1f1b\ndp 1\n"
                      "stage chip=cpu-numpy chips=1 tp=1 layers=embed, block.0\n"
                      "stage chip=cpu-numpy chips=1 tp=1 layers=block.1, head\n", 3)
