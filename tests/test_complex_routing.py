"""Complex rotary embeddings (frontend/complex_pairs.py) and experts modules routed by Python
loops (frontend/routing.py): Llama 4 text, DBRX and the other transformers families written
that way compile unmodified and train with losses equal to eager transformers (same initial
weights, data and AdamW), on torch and on a 2-stage build with one stage per backend (NumPy
first, so it runs the rotary layer); DBRX also with expert parallelism. `make test` trains
Llama 4 end to end and checks DBRX's routing on its own (the static form against the loop,
the expert stacks' sharding); every family x attention x backend, and DBRX with EP, train in
`make test-slow`."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import ROOT
from executor.launcher import run
from executor.reference import eager_losses
from frontend.capture import capture, trace_model
from frontend.compiler import compile_model
from h2ir.errors import H2Error

HF = str(ROOT / "examples/hf/decoders.py")
CLUSTERS = ROOT / "examples/clusters"
# backends -> (cluster file, chip of stage 0, chip of stage 1), for dp 1 and for ep 2
BACKENDS = {
    "torch": (("local.toml", "local4.toml"), "cpu-torch", "cpu-torch"),
    "numpy+torch": (("local-mixed.toml", "local-mixed4.toml"), "cpu-numpy", "cpu-torch"),
}
MB, SEQ, STEPS = 2, 32, 3


def train_and_compare(tmp: Path, model: str, args: dict, backends: str, ep: int = 1) -> list:
    """A 2-stage build (layers split in halves) trained STEPS steps; its losses must equal an
    eager PyTorch run's from the same initial weights to 1e-5 (relative)."""
    tmp.mkdir(parents=True, exist_ok=True)
    (one, four), first, second = BACKENDS[backends]
    names = [l.name for l in capture(model, args, MB, SEQ).layers]
    half = len(names) // 2
    lines = [f'model "{model}"', f'cluster "{CLUSTERS / (four if ep > 1 else one)}"',
             f"batch global={2 * MB * ep} micro={MB} seq={SEQ}", "schedule 1f1b", f"dp {ep}"]
    lines += [f"stage chip={chip} chips={ep}{f' ep={ep}' if ep > 1 else ''} "
              f"layers={', '.join(part)}" for chip, part in ((first, names[:half]),
                                                             (second, names[half:]))]
    if ep > 1:
        lines.append(f"moe ep={ep}")
    plan = tmp / "p.h2plan"
    plan.write_text("\n".join(lines) + "\n")
    build = tmp / "build"
    compile_model(model, model_args=args, plan_arg=str(plan), out_dir=str(build),
                  log=lambda *a: None)
    manifest = json.loads((build / "manifest.json").read_text())
    assert [s["backend"] for s in manifest["stages"]] == \
        [{"cpu-torch": "torch", "cpu-numpy": "numpy"}[c] for c in (first, second)]
    res = run(str(build), steps=STEPS, json_log=str(tmp / "log.jsonl"), out=lambda *a: None,
              predict=False)
    ref = eager_losses(str(build), STEPS)
    worst = max(abs(a - b) / abs(b) for a, b in zip(res.losses, ref))
    assert len(res.losses) == STEPS and worst <= 1e-5, (res.losses, ref)
    return [json.loads(l) for l in (tmp / "log.jsonl").read_text().splitlines()]


# ---- end to end: Llama 4 in make test, DBRX with EP in make test-slow -------------------------

def test_llama4_text_trains_like_eager_transformers_on_numpy_and_torch(tmp_path):
    """Dense and MoE layers (a shared expert), RoPE (complex) and NoPE layers with temperature
    tuning, chunked attention; the rotary layer on the NumPy stage."""
    pytest.importorskip("transformers")
    ir = capture(HF, {"family": "llama4_text"}, MB, SEQ)
    assert not any("complex" in str(v.type) for n in ir.nodes() for v in n.outputs)
    assert {"sin", "cos"} <= {n.op for n in ir.nodes()}
    train_and_compare(tmp_path, HF, {"family": "llama4_text", "attn": "sdpa"}, "numpy+torch")


@pytest.mark.slow          # four workers of a transformers model; EP runs by default in test_moe
def test_dbrx_trains_like_eager_transformers_with_expert_parallelism(tmp_path):
    """DBRX's experts loop over nonzero/where results: captured static, run sparsely with 2 EP
    ranks per stage, a NumPy stage and a torch stage."""
    pytest.importorskip("transformers")
    ir = capture(HF, {"family": "dbrx"}, MB, SEQ)
    assert [l.kind for l in ir.layers][1:-1] == ["moe_block", "moe_block"]
    log = train_and_compare(tmp_path, HF, {"family": "dbrx", "attn": "eager"}, "numpy+torch",
                            ep=2)
    for entry in log:       # every (token, choice) reached an expert; none was dropped
        for m in entry["moe"].values():
            assert m["dropped"] == 0 and sum(m["load"]) == 4 * MB * SEQ * 2   # batch x top-2


# ---- complex values as real pairs --------------------------------------------------------------

def _complex_ops(x, y, w):
    z = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))
    u = torch.polar(torch.ones_like(y), y)
    v = (z * u.unsqueeze(0)).transpose(0, 1) / (u.unsqueeze(1) + 2.0)
    v = torch.cat([v, v.conj() * 0.5], dim=-1).exp() - torch.complex(w, -w)
    s = v.sum(dim=1, keepdim=True).permute(2, 1, 0).reshape(-1)
    return torch.view_as_real(v).flatten(2), s.abs(), torch.view_as_real(v[:, 1:3].squeeze(-2))


def test_real_pairs_compute_what_the_complex_ops_compute():
    from torch.fx.experimental.proxy_tensor import make_fx
    from frontend.complex_pairs import has_complex, to_real_pairs
    g = torch.Generator().manual_seed(0)
    args = (torch.randn(3, 4, 8, generator=g), torch.randn(4, 4, generator=g),
            torch.randn(4, 3, 8, generator=g))
    gm = make_fx(_complex_ops, tracing_mode="fake")(*args)
    want = _complex_ops(*args)
    to_real_pairs(gm)
    assert not has_complex(gm)
    for got, ref in zip(gm(*args), want):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


META_LLAMA = '''
import torch, torch.nn as nn, torch.nn.functional as F


def precompute_freqs_cis(dim, end, theta=10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    freqs = torch.outer(torch.arange(end).float(), freqs)
    return torch.polar(torch.ones_like(freqs), freqs)


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    f = freqs_cis[: xq.shape[1]].view(1, xq.shape[1], 1, xq_.shape[-1])
    return (torch.view_as_real(xq_ * f).flatten(3).type_as(xq),
            torch.view_as_real(xk_ * f).flatten(3).type_as(xk))


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.w1, self.w2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x, freqs_cis):
        B, S, D = x.shape
        h = self.norm1(x)
        q, k, v = (w(h).view(B, S, self.heads, -1) for w in (self.wq, self.wk, self.wv))
        q, k = apply_rotary_emb(q, k, freqs_cis)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        x = x + self.wo(o.transpose(1, 2).reshape(B, S, D))
        return x + self.w2(F.silu(self.w1(self.norm2(x))))


class Model(nn.Module):
    def __init__(self, vocab, dim, heads, n_layers, max_seq):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads) for _ in range(n_layers))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)
        self.register_buffer("freqs_cis", precompute_freqs_cis(dim // heads, max_seq),
                             persistent=False)

    def forward(self, ids):
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x, self.freqs_cis)
        return self.head(self.norm(x))


def build_model(vocab=512, dim=64, heads=4, n_layers=2, max_seq=64):
    return Model(vocab, dim, heads, n_layers, max_seq)
'''


def test_a_complex_buffer_is_a_constant_of_real_pairs(tmp_path):
    """Meta's reference Llama keeps its rotary table as a complex buffer: the programs take its
    real pairs, a constant [..., 2], and the compiler stores `view_as_real` of its value."""
    model = tmp_path / "meta_llama.py"
    model.write_text(META_LLAMA)
    cap = trace_model(str(model), {}, MB, SEQ)
    (buf,) = [v for v in cap.graph.consts if v.name == "freqs_cis"]
    assert list(buf.type.shape) == [64, 8, 2] and buf.type.dtype == "f32"
    real = cap.model_file.build({})
    got = cap.constants(real, ["freqs_cis"])["freqs_cis"]
    assert torch.equal(got, torch.view_as_real(real.freqs_cis))


@pytest.mark.slow
def test_complex_buffer_rotary_trains_like_eager(tmp_path):
    model = tmp_path / "meta_llama.py"
    model.write_text(META_LLAMA)
    train_and_compare(tmp_path / "run", str(model), {}, "numpy+torch")


def test_a_complex_op_without_a_pair_form_is_a_located_error(tmp_path):
    model = tmp_path / "bad.py"
    model.write_text(META_LLAMA.replace("torch.view_as_real(xq_ * f)",
                                        "torch.view_as_real((xq_ * f).sqrt())"))
    with pytest.raises(H2Error) as e:
        capture(str(model), {}, MB, SEQ)
    assert "on complex values has no real-pair form" in e.value.message
    lines = {i for i, l in enumerate(model.read_text().splitlines(), 1)
             if ".sqrt()" in l or "apply_rotary_emb(q, k" in l}      # the op, or its call
    assert e.value.file == str(model) and e.value.line in lines


def test_a_complex_model_output_is_an_error(tmp_path):
    model = tmp_path / "out.py"
    model.write_text(META_LLAMA.replace("return self.head(self.norm(x))",
                                        "return torch.polar(self.head(x), self.head(x))"))
    with pytest.raises(H2Error, match="the model's output is complex"):
        capture(str(model), {}, MB, SEQ)


# ---- experts routed by Python loops ------------------------------------------------------------

def _dbrx_experts():
    pytest.importorskip("transformers")
    import sys
    sys.path.insert(0, str(ROOT / "examples/hf"))
    from decoders import build_model
    torch.manual_seed(0)
    return build_model("dbrx").lm.transformer.blocks[0].ffn.experts


def test_static_forward_equals_the_loop():
    """The dense static form (every expert on every token, weighted) against DBRX's own loop,
    on real tensors, a routing that leaves an expert without tokens included."""
    from frontend.routing import make_static, is_routed_experts
    ex = _dbrx_experts()
    assert is_routed_experts(ex)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 8, 64, generator=g)
    index = torch.randint(0, 3, (16, 2), generator=g)           # expert 3 gets nothing
    index[:, 1] = (index[:, 0] + 1) % 3
    weights = torch.rand(16, 2, generator=g)
    want = ex(x, index, weights)
    holder = torch.nn.Module()
    holder.experts = ex
    assert make_static(holder) == ["experts"] and make_static(holder) == []   # once
    torch.testing.assert_close(ex(x, index, weights), want, rtol=1e-6, atol=1e-6)


def test_flat_expert_stacks_shard_by_expert():
    """DBRX's stacks are [E * F, D]: an EP rank's shard holds whole experts, in slot order."""
    from frontend.moe import shards
    E, F, D = 4, 3, 2
    w = np.arange(E * F * D, dtype=np.float32).reshape(E * F, D)
    order = [2, 0, 3, 1]
    got = shards({"w": w}, {"w": "experts"}, {"experts": order}, 2)
    experts = w.reshape(E, F, D)
    assert np.array_equal(got[0]["w"], np.concatenate([experts[2], experts[0]]))
    assert np.array_equal(got[1]["w"], np.concatenate([experts[3], experts[1]]))


ROUTED_BY_A_PERMUTATION = '''
import torch, torch.nn as nn


class Experts(nn.Module):
    def __init__(self, dim, num_experts):
        super().__init__()
        self.num_experts = num_experts
        self.w = nn.Parameter(torch.randn(num_experts, dim, dim) * 0.1)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for e in top_k_index.unique():
            token_idx, pos = torch.where(top_k_index == e)
            token_idx = token_idx.roll(1)           # an index that is no range
            y = hidden_states[token_idx] @ self.w[e]
            out.index_add_(0, token_idx, y * top_k_weights[token_idx, pos, None])
        return out


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.router = nn.Embedding(64, 16), nn.Linear(16, 4)
        self.experts, self.head = Experts(16, 4), nn.Linear(16, 64)

    def forward(self, ids):
        x = self.emb(ids).reshape(-1, 16)
        w, i = self.router(x).softmax(-1).topk(2)
        return self.head(self.experts(x, i, w)).reshape(*ids.shape, 64)


def build_model():
    return Model()
'''


def test_routing_that_cannot_be_made_static_is_an_error(tmp_path):
    model = tmp_path / "perm.py"
    model.write_text(ROUTED_BY_A_PERMUTATION)
    with pytest.raises(H2Error, match="neither constant nor a range") as e:
        capture(str(model), {}, MB, SEQ)
    assert e.value.file == str(model) and e.value.line == next(
        i for i, l in enumerate(ROUTED_BY_A_PERMUTATION.splitlines(), 1) if "[token_idx] @" in l)


# ---- every family x attention x backend (make test-slow) ---------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("backends", list(BACKENDS))
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("family", ["llama4_text", "dbrx"])
def test_family_trains_like_eager_transformers(tmp_path, family, attn, backends):
    pytest.importorskip("transformers")
    train_and_compare(tmp_path, HF, {"family": family, "attn": attn}, backends)


@pytest.mark.slow
@pytest.mark.parametrize("backends", list(BACKENDS))
def test_dbrx_with_ep2_trains_like_eager_transformers(tmp_path, backends):
    pytest.importorskip("transformers")
    train_and_compare(tmp_path, HF, {"family": "dbrx", "attn": "sdpa"}, backends, ep=2)


# Other transformers families of the same kinds: DeepSeek-V2's rotary is complex too; any
# transformers MoE family with its experts kernel set to "eager" is transformers' own
# per-expert loop (the one DBRX's is written after).
OTHERS = {"deepseek_v2": {}, "mixtral": {"experts": "eager"}, "qwen2_moe": {"experts": "eager"}}


@pytest.mark.slow
@pytest.mark.parametrize("backends", list(BACKENDS))
@pytest.mark.parametrize("family", sorted(OTHERS))
def test_other_families_of_the_same_kinds(tmp_path, family, backends):
    pytest.importorskip("transformers")
    train_and_compare(tmp_path, HF, {"family": family, "attn": "sdpa", **OTHERS[family]}, backends)


@pytest.mark.slow
def test_loop_experts_with_ep2_trains_like_eager_transformers(tmp_path):
    """transformers' own loop (Mixtral, experts kernel "eager") with 2 EP ranks."""
    pytest.importorskip("transformers")
    train_and_compare(tmp_path, HF, {"family": "mixtral", "attn": "sdpa", "experts": "eager"},
                      "torch", ep=2)


@pytest.mark.slow
def test_dbrx_ep2_round_trip_after_migration(tmp_path):
    """DBRX's [E * F, D] stacks: from a transformers checkpoint, experts moved between the EP
    ranks by migration (whole experts: F rows each), and `h2x export` putting them back in
    expert order; transformers loads the export and computes the eager model's logits."""
    pytest.importorskip("transformers")
    from test_interop import round_trip
    _, _, migrated = round_trip(
        tmp_path, "dbrx", plan_kw={
            "cluster": "examples/clusters/local4.toml", "dp": 2, "ep": " ep=2",
            "batch": "global=8 micro=2 seq=32",
            "extra": "moe ep=2 placement=contiguous a2a=flat migration=periodic(2) "
                     "threshold=1.0 capacity=none\n"}, read="stage by stage")
    assert migrated > 0, "no expert moved: the test would not check the reordering"
