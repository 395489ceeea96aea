"""State-space and convolutional hybrids (issue 30): the op set's depthwise convolution and
selective scan on both backends (check-ops, with broken kernels that must fail), the
Mamba-family mixers captured with their scan as one op (frontend/ssm.py), and unmodified
transformers Mamba / Jamba / Mamba-2 / ... training in h2 with losses equal to eager
transformers', on torch and on a torch + NumPy pipeline."""
import json
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import ROOT, run_cli

from backends.check_ops import check_backend
from backends.numpy import ops as numpy_ops
from backends.numpy.runtime import NumpyBackend
from backends.torch import ops as torch_ops
from backends.torch.runtime import TorchBackend

MODEL = str(ROOT / "examples/hf/decoders.py")
SEQ_OPS = ["depthwise_conv1d", "depthwise_conv1d_bwd", "selective_scan", "selective_scan_bwd"]
MB, SEQ, GB, STEPS = 2, 32, 4, 3


# ---- the ops ---------------------------------------------------------------------------------------

CHUNKED = lambda: TorchBackend(scan="chunked")          # noqa: E731  (accelerators' form)


@pytest.mark.parametrize("backend,dtype", [(TorchBackend, "f32"), (TorchBackend, "bf16"),
                                           (CHUNKED, "f32"), (CHUNKED, "bf16"),
                                           (NumpyBackend, "f32"), (TorchBackend, "f64")])
def test_sequence_ops_pass_check_ops(backend, dtype):
    rep = check_backend(backend(), dtype, ops=SEQ_OPS)
    assert [r.op for r in rep.results] == SEQ_OPS and not rep.failed
    assert all(r.reference_independent for r in rep.results)
    assert all(r.max_abs > 0 for r in rep.results)          # real numerics, not a copy


def test_the_two_scan_forms_agree_with_each_other_and_the_paper():
    """The sequential form (both backends on the CPU), the chunked one (the torch backend on
    accelerators; chunk boundaries inside the sequence, the last chunk cut short) and the
    paper's loop, in float64."""
    from backends.check_ops import _scan64
    rng = np.random.default_rng(1)
    b, d, n, l, g = 2, 6, 3, torch_ops.SCAN_CHUNK * 2 + 5, 3
    ins = [rng.standard_normal((b, d, l)), rng.uniform(0.05, 2.0, (b, d, l)),
           -rng.uniform(0.1, 6.0, (d, n)), rng.standard_normal((b, g, n, l)),
           rng.standard_normal((b, g, n, l))]
    want = _scan64(*(torch.from_numpy(a) for a in ins)).numpy()
    t_ins = [torch.from_numpy(a) for a in ins]
    got = {"numpy": numpy_ops.selective_scan(*ins),
           **{form: TorchBackend(scan=form).ops["selective_scan"](*t_ins).numpy()
              for form in torch_ops.SCANS}}
    assert {k: float(np.abs(v - want).max()) < 1e-10 for k, v in got.items()} == \
        {"numpy": True, "sequential": True, "chunked": True}


class _Broken:
    def __init__(self, inner, **ops):
        self._inner, self.name, self.dtypes = inner, inner.name, inner.dtypes
        self.ops = {**inner.ops, **ops}

    def __getattr__(self, item):
        return getattr(self._inner, item)


def _numpy_mutants():
    k = NumpyBackend().ops

    def decay_late(u, delta, A, B, C):
        # h[t] = exp(delta[t-1] A) h[t-1] + ...: the decay of the step before
        keep = numpy_ops._linear_scan

        def late(a_log, x, reverse=False):
            return keep(np.concatenate([np.zeros_like(a_log[:1]), a_log[:-1]]), x, reverse)
        numpy_ops._linear_scan = late
        try:
            return k["selective_scan"](u, delta, A, B, C)
        finally:
            numpy_ops._linear_scan = keep

    def conv_flipped(x, weight, bias, pad_left=None, pad_right=0):
        return k["depthwise_conv1d"](x, weight[:, ::-1].copy(), bias, pad_left, pad_right)

    def conv_bwd_no_bias(grad, x, weight, pad_left=None, pad_right=0):
        gx, gw, gb = k["depthwise_conv1d_bwd"](grad, x, weight, pad_left, pad_right)
        return gx, gw, gb * np.float32(0)

    def scan_bwd_half_dA(grad, u, delta, A, B, C):
        du, ddelta, dA, dB, dC = k["selective_scan_bwd"](grad, u, delta, A, B, C)
        return du, ddelta, dA * np.float32(0.5), dB, dC
    return {"selective_scan": decay_late, "depthwise_conv1d": conv_flipped,
            "depthwise_conv1d_bwd": conv_bwd_no_bias, "selective_scan_bwd": scan_bwd_half_dA}


def _groups_swapped(u, delta, A, B, C):
    """Channel i reading group g-1-i//(d/g): caught only where there are groups (Mamba-2)."""
    return NumpyBackend().ops["selective_scan"](u, delta, A, B[:, ::-1].copy(), C)


def _torch_mutants():
    k = TorchBackend().ops

    def output_before_update(u, delta, A, B, C):
        # y[t] read from h[t-1]: the loop's two lines in the wrong order
        u5, d5, A5, B5, C5 = torch_ops._scan_operands(u, delta, A, B, C)
        H = torch_ops.linear_scan_sequential(d5 * A5, d5 * u5 * B5)
        H = torch.cat([torch.zeros_like(H[:1]), H[:-1]])
        return torch_ops._from_steps((H * C5).sum(-1), u.shape).to(u.dtype)

    def anticausal(x, weight, bias, pad_left=None, pad_right=0):
        left = weight.shape[1] - 1 if pad_left is None else pad_left
        return k["depthwise_conv1d"](x, weight, bias, pad_right, left)   # the pads swapped

    def dx_lost_tap(grad, x, weight, pad_left=None, pad_right=0):
        w = weight.clone()
        w[:, 0] = 0
        gx, _, _ = k["depthwise_conv1d_bwd"](grad, x, w, pad_left, pad_right)
        _, gw, gb = k["depthwise_conv1d_bwd"](grad, x, weight, pad_left, pad_right)
        return gx, gw, gb

    def reversed_time(grad, u, delta, A, B, C):
        flip = [t.flip(-1) for t in (grad, u, delta)]
        du, ddelta, dA, dB, dC = k["selective_scan_bwd"](*flip, A, B.flip(-1), C.flip(-1))
        return du.flip(-1), ddelta.flip(-1), dA, dB.flip(-1), dC.flip(-1)
    return {"selective_scan": output_before_update, "depthwise_conv1d": anticausal,
            "depthwise_conv1d_bwd": dx_lost_tap, "selective_scan_bwd": reversed_time}


def _chunked_without_carry(a_log, x, reverse=False):
    """The chunked form with every chunk starting from a zero state."""
    c = torch_ops.SCAN_CHUNK
    return torch.cat([torch_ops.linear_scan_chunked(a_log[i:i + c], x[i:i + c], reverse)
                      for i in range(0, x.shape[0], c)])


def test_a_broken_scan_or_convolution_fails_check_ops():
    mutants = _numpy_mutants()
    rep = check_backend(_Broken(NumpyBackend(), **mutants), ops=SEQ_OPS)
    assert sorted(r.op for r in rep.failed) == sorted(mutants)
    assert all(r.error is None for r in rep.failed)              # wrong numbers, not a crash
    rep = check_backend(_Broken(NumpyBackend(), selective_scan=_groups_swapped),
                        ops=["selective_scan"])
    assert [r.op for r in rep.failed] == ["selective_scan"]
    rep = check_backend(_Broken(TorchBackend(), **_torch_mutants()), ops=SEQ_OPS)
    assert sorted(r.op for r in rep.failed) == sorted(SEQ_OPS)
    # the chunked form losing the state carried between chunks (right inside the first one)
    broken = _Broken(TorchBackend(scan="chunked"),
                     selective_scan=torch_ops._selective_scan(_chunked_without_carry),
                     selective_scan_bwd=torch_ops._selective_scan_bwd(_chunked_without_carry))
    rep = check_backend(broken, ops=SEQ_OPS)
    assert sorted(r.op for r in rep.failed) == ["selective_scan", "selective_scan_bwd"]


# ---- capture --------------------------------------------------------------------------------------

def test_mamba_mixer_is_one_scan_and_one_convolution_per_layer():
    from frontend.capture import trace_model
    cap = trace_model(MODEL, {"family": "mamba", "attn": "eager"}, MB, SEQ)
    for layer in cap.graph.layers[1:-1]:
        ops = [n.op for n in layer.nodes]
        assert ops.count("selective_scan") == 1 and ops.count("depthwise_conv1d") == 1
        # in_proj, x_proj, dt_proj, out_proj: no matmul, and no node at all, per sequence step
        assert ops.count("mm") + ops.count("bmm") == 4 and len(ops) < SEQ * 2
    # the interface is patched only while capturing: eager transformers stays transformers'
    from transformers.models.mamba import modeling_mamba
    from frontend import ssm
    assert ssm.ssm_functions(cap.model) == ["transformers.models.mamba.modeling_mamba."
                                            "mamba_selective_scan"]
    assert getattr(modeling_mamba.mamba_selective_scan, "kernel_layer_name",
                   "selective_scan_fn") == "selective_scan_fn"


def test_a_convolution_the_op_set_lacks_is_a_located_error(tmp_path):
    from frontend.capture import capture
    from h2ir.errors import H2Error
    model = tmp_path / "strided.py"
    model.write_text(
        "import torch.nn as nn\n"
        "class M(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.emb = nn.Embedding(64, 8)\n"
        "        self.conv = nn.Conv1d(8, 8, 3, stride=2, padding=1)\n"
        "        self.head = nn.Linear(8, 64)\n"
        "    def forward(self, ids):\n"
        "        x = self.conv(self.emb(ids).transpose(1, 2))\n"
        "        return self.head(x.transpose(1, 2))\n"
        "def build_model():\n"
        "    return M()\n")
    with pytest.raises(H2Error) as e:
        capture(str(model), {}, 1, 16)
    assert e.value.file == str(model) and e.value.line == 9
    assert "depthwise 1-D convolution" in str(e.value) and "stride [2]" in str(e.value)


def test_a_value_and_its_clone_both_leaving_a_layer(tmp_path):
    """Zamba2 keeps the embedding's output and a clone of it for its hybrid layers: two outputs
    of the embed layer that lower to one value (clone is no op in h2ir) each get their name."""
    from frontend.capture import trace_model
    from frontend.stages import build_stage_programs
    model = tmp_path / "keep.py"
    model.write_text(textwrap.dedent('''
        import torch.nn as nn

        class LM(nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = nn.Embedding(64, 16)
                self.layers = nn.ModuleList([nn.Sequential(nn.Linear(16, 16), nn.Tanh())
                                             for _ in range(2)])
                self.head = nn.Linear(16, 64)

            def forward(self, ids):
                x = self.emb(ids)
                keep = x.clone()
                for i, layer in enumerate(self.layers):
                    x = layer(x) + (keep if i else x)
                return self.head(x)

        def build_model():
            return LM()
    '''))
    cap = trace_model(str(model), {}, 1, 8)
    names = [l.name for l in cap.graph.layers]
    progs = build_stage_programs(cap, [names[:2], names[2:]])
    assert len(progs[0].outputs) == 2 and len(set(progs[0].outputs)) == 2


# ---- training against eager transformers -------------------------------------------------------------

CLUSTERS = {("torch", "torch"): ("local", "cpu-torch", "cpu-torch"),
            ("torch", "numpy"): ("local-mixed", "cpu-torch", "cpu-numpy")}


def train_and_compare(tmp_path: Path, family: str, backends=("torch", "numpy"), attn="eager",
                      extra=(), steps=STEPS):
    """A 2-stage build (layers split in halves, stage 0 on backends[0], stage 1 on
    backends[1]) trained `steps` steps; the worst relative loss difference to eager
    transformers from the same initial weights and data."""
    from executor.reference import eager_losses
    from frontend.capture import capture
    args = {"family": family, "attn": attn, **dict(extra)}
    names = [l.name for l in capture(MODEL, args, MB, SEQ).layers]
    half = len(names) // 2
    cluster, *chips = CLUSTERS[tuple(backends)]
    stages = "".join(f"stage chip={chip} chips=1 tp=1 layers={', '.join(part)}\n"
                     for chip, part in zip(chips, (names[:half], names[half:])))
    tmp_path.mkdir(parents=True, exist_ok=True)
    plan = tmp_path / "p.h2plan"
    plan.write_text(f'model "{MODEL}"\ncluster "{cluster}"\nbatch global={GB} micro={MB} '
                    f"seq={SEQ}\nschedule 1f1b\ndp 1\n{stages}")
    cli_args = [a for k, v in args.items() for a in ("--arg", f"{k}={v}")]
    build = tmp_path / "build"
    r = run_cli("h2c", "compile", MODEL, *cli_args, "--plan", str(plan), "-o", str(build))
    assert r.returncode == 0, r.stderr
    m = json.loads((build / "manifest.json").read_text())
    assert [s["backend"] for s in m["stages"]] == list(backends)
    log = tmp_path / "log.jsonl"
    r = run_cli("h2x", "run", str(build), "--steps", str(steps), "--json-log", str(log))
    assert r.returncode == 0, r.stderr + r.stdout
    got = [json.loads(l)["loss"] for l in log.read_text().splitlines()]
    ref = eager_losses(str(build), steps)
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, ref))
    assert worst <= 1e-5, (worst, got, ref)
    return worst


def test_mamba_trains_like_eager_transformers_on_torch_and_numpy(tmp_path):
    train_and_compare(tmp_path, "mamba", ("torch", "numpy"))


@pytest.mark.slow
@pytest.mark.parametrize("backends", [("torch", "torch"), ("torch", "numpy")])
@pytest.mark.parametrize("family,attn", [("mamba", "eager"), ("jamba", "eager"),
                                         ("jamba", "sdpa")])
def test_mamba_and_jamba_train_like_eager_transformers(tmp_path, family, attn, backends):
    train_and_compare(tmp_path, family, backends, attn)


# Other hybrids transformers ships: Mamba-1 (FalconMamba, Zamba), Mamba-2 (Mamba2, Bamba,
# GraniteMoeHybrid, Zamba2, FalconH1, NemotronH), gated convolutions (LFM2) and a gated
# DeltaNet (Qwen3-Next: its causal convolution is the op set's, its delta rule ordinary ops)
# (Zamba ties its shared attention block across hybrid layers: transformers needs two of them)
MORE_HYBRIDS = {"falcon_mamba": ("eager", {}), "zamba": ("eager", {"layers": 4}),
                "mamba2": ("eager", {}), "bamba": ("sdpa", {}), "granitemoehybrid": ("sdpa", {}),
                "zamba2": ("sdpa", {}), "falcon_h1": ("sdpa", {}), "nemotron_h": ("sdpa", {}),
                "lfm2": ("sdpa", {}), "qwen3_next": ("sdpa", {})}


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(MORE_HYBRIDS))
def test_more_hybrids_train_like_eager_transformers(tmp_path, family):
    attn, extra = MORE_HYBRIDS[family]
    train_and_compare(tmp_path, family, ("torch", "numpy"), attn, extra.items())


# ---- heterogeneous blocks ---------------------------------------------------------------------------

# A hybrid written by hand: gated short convolutions (LFM2's, Hyena's: nn.Conv1d with one
# filter per channel, padded and cut to the causal part) alternating with attention blocks in
# an nn.Sequential, whose classes differ from block to block.
HYBRID = textwrap.dedent('''
    import torch, torch.nn as nn, torch.nn.functional as F

    class ConvBlock(nn.Module):
        def __init__(self, d, k=4):
            super().__init__()
            self.norm = nn.LayerNorm(d)
            self.proj = nn.Linear(d, 2 * d)
            self.conv = nn.Conv1d(d, d, k, groups=d, padding=k - 1)
            self.out = nn.Linear(d, d)

        def forward(self, x):
            a, g = self.proj(self.norm(x)).chunk(2, -1)
            a = self.conv(a.transpose(1, 2))[..., :x.shape[1]].transpose(1, 2)
            return x + self.out(a * torch.sigmoid(g))

    class AttnBlock(nn.Module):
        def __init__(self, d, h=4):
            super().__init__()
            self.h = h
            self.norm = nn.LayerNorm(d)
            self.qkv = nn.Linear(d, 3 * d)
            self.o = nn.Linear(d, d)

        def forward(self, x):
            b, s, d = x.shape
            q, k, v = (t.reshape(b, s, self.h, -1).transpose(1, 2)
                       for t in self.qkv(self.norm(x)).chunk(3, -1))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return x + self.o(y.transpose(1, 2).reshape(b, s, d))

    class LM(nn.Module):
        def __init__(self, pairs, vocab=256, d=32):
            super().__init__()
            self.emb = nn.Embedding(vocab, d)
            self.blocks = nn.Sequential(*[m for _ in range(pairs)
                                          for m in (ConvBlock(d), AttnBlock(d))])
            self.head = nn.Linear(d, vocab)

        def forward(self, ids):
            return self.head(self.blocks(self.emb(ids)))

    def build_model(pairs=2):
        return LM(int(pairs))
''')


def test_alternating_blocks_are_found_and_each_kind_is_measured_on_its_own(tmp_path):
    from frontend.capture import capture, find_blocks
    from frontend.profile import layer_variants
    model = tmp_path / "hybrid.py"
    model.write_text(HYBRID)
    g = capture(str(model), {}, 1, 16)
    assert [l.name for l in g.layers] == ["embed"] + [f"block.{i}" for i in range(4)] + ["head"]
    assert [n.op for n in g.layers[1].nodes if n.op == "depthwise_conv1d"] == ["depthwise_conv1d"]
    variants = layer_variants(g, g.layer_costs())
    assert [variants[f"block.{i}"] for i in range(4)] == \
        ["transformer_block:conv", "transformer_block:attention"] * 2
    # Jamba: Mamba and attention mixers, each before a dense MLP or a MoE
    from frontend.capture import trace_model
    cap = trace_model(MODEL, {"family": "jamba", "attn": "eager", "layers": 6}, MB, SEQ)
    variants = layer_variants(cap.graph, cap.graph.layer_costs())
    assert [variants[f"block.{i}"] for i in range(6)] == [
        "transformer_block:ssm", "moe_block:attention", "transformer_block:ssm",
        "transformer_block:attention", "moe_block:ssm", "transformer_block:attention"]
    assert find_blocks(cap.model) == [f"lm.model.layers.{i}" for i in range(6)]


def test_every_variant_of_a_kind_gets_its_own_measured_time():
    """A record holds one entry per layer variant; the planner finds each layer's own."""
    from h2ir.costs import LayerCost
    from h2ir.planner.calibration import Calibration
    entry = lambda kind, params, t: {"kind": kind, "params": params, "fwd_flops": 1000 * params,  # noqa: E731
                                     "bwd_flops": 2000 * params, "fwd_s": t, "bwd_s": 2 * t}
    rec = {"key": {"backend": "torch", "micro_batch": 2, "seq_len": 32},
           "layers": {"transformer_block:ssm": entry("transformer_block", 10, 0.003),
                      "transformer_block:attention": entry("transformer_block", 20, 0.001),
                      "head": {**entry("head", 5, 0.0005)}}}
    del rec["layers"]["head"]["kind"]                      # a record from before variants
    cal = Calibration(records={"r": rec})
    layer = lambda kind, params: LayerCost("x", kind, params, 4 * params, 1000 * params,  # noqa: E731
                                           2000 * params, 0, 0)
    assert cal.layer_time("torch", layer("transformer_block", 10), 2, 32) == (0.003, 0.006)
    assert cal.layer_time("torch", layer("transformer_block", 20), 2, 32) == (0.001, 0.002)
    assert cal.layer_time("torch", layer("head", 5), 2, 32) == (0.0005, 0.001)
    assert cal.layer_time("torch", layer("transformer_block", 30), 2, 32) is None


@pytest.mark.slow
def test_a_hand_written_hybrid_trains_like_eager_on_torch_and_numpy(tmp_path):
    from conftest import trains_like_eager
    model = tmp_path / "hybrid.py"
    model.write_text(HYBRID)
    trains_like_eager(tmp_path, model,
                      f'model "{model}"\ncluster "local-mixed"\nbatch global=4 micro=2 seq=16\n'
                      "schedule 1f1b\ndp 1\n"
                      "stage chip=cpu-torch chips=1 tp=1 layers=embed, block.0, block.1\n"
                      "stage chip=cpu-numpy chips=1 tp=1 layers=block.2, block.3, head\n", 3)


# Two torch workers as two chip types (so no data parallelism), memory for the whole model
TWO_CHIPS = """name = "two"
dtype = "fp32"
shared_cores = "auto"
""" + "".join(f"""
[chips.cpu-{c}]
vendor = "cpu"
backend = "torch"
peak_tflops = {{ fp32 = 0.1 }}
mem_gib = 8
mem_bw_gbs = 10
measured = true
""" for c in "ab") + "".join(f"""
[[nodes]]
chip = "cpu-{c}"
count = 1
chips_per_node = 1
intra_bw_gbs = 2
nic_gbps = 16
""" for c in "ab")

# fwd and bwd ms of a Jamba layer of each variant (hidden 64), of the order this machine
# measures: a Mamba layer costs about ten attention layers
JAMBA_MS = {"embedding": (0.2, 0.1), "head": (0.2, 0.3), "transformer_block:ssm": (2.5, 16.0),
            "transformer_block:attention": (0.3, 0.5), "moe_block:attention": (0.8, 1.2),
            "moe_block:ssm": (3.2, 18.0)}


def test_the_plan_search_balances_a_hybrids_stages_by_each_variants_time(tmp_path):
    """Jamba's layers of four variants over two workers: with each variant's own measured time
    (a Mamba layer costs about ten attention layers, with 1.4x their FLOPs) the search splits
    them where the stages' compute is the same within 15 %."""
    from frontend.capture import trace_model
    from frontend.profile import layer_variants
    from h2ir.clusters.clusterfile import load_cluster
    from h2ir.planner import search as heteroauto
    from h2ir.planner.calibration import Calibration
    cap = trace_model(MODEL, {"family": "jamba", "attn": "eager", "layers": 8}, MB, SEQ)
    costs = cap.graph.layer_costs()
    variant = layer_variants(cap.graph, costs)
    entries = {}
    for l in costs.layers:
        f, b = JAMBA_MS[variant[l.name]]
        entries.setdefault(variant[l.name], {
            "kind": l.kind, "params": l.params, "fwd_flops": l.fwd_flops,
            "bwd_flops": l.bwd_flops, "fwd_s": f / 1e3, "bwd_s": b / 1e3})
    rec = {"key": {"backend": "torch", "micro_batch": MB, "seq_len": SEQ}, "layers": entries}
    rates = {"torch": {"matmul_flops": 2e10, "mem_bw": 1e10}}
    (tmp_path / "two.toml").write_text(TWO_CHIPS)
    cluster = load_cluster(str(tmp_path / "two.toml"))

    res = heteroauto.search(costs, cluster, 8, seq_len=SEQ, micro_batch=MB,
                            calibration=Calibration(backends=rates, records={"jamba": rec}))
    stages = res.best.plan.stages
    assert len(stages) == 2 and sum(len(st.layers) for st in stages) == len(costs.layers)
    ms = [sum(sum(JAMBA_MS[variant[n]]) for n in st.layers) for st in stages]
    assert abs(ms[0] - ms[1]) <= 0.15 * max(ms), (ms, [st.layers for st in stages])
