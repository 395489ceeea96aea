"""The torch and numpy backends: kernels against torch autograd, whole programs against each other,
AdamW against torch.optim.AdamW, host transfer, and the numpy backend's independence from torch."""
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from backends.base import missing_kernels, run_program

from backends.registry import get_backend
from backends.numpy.runtime import NumpyBackend
from backends.torch.runtime import TorchBackend
from conftest import ROOT
from h2ir import opset
from h2ir.opset import Group

BACKENDS = {
    "torch": lambda: TorchBackend(),
    "torch-math-attention": lambda: TorchBackend(attention="math"),   # the CUDA code path
    "numpy": lambda: NumpyBackend(),
}


@pytest.fixture(params=list(BACKENDS))
def backend(request):
    return BACKENDS[request.param]()


def _to(be, a: np.ndarray):
    dtype = {np.dtype(np.float32): "f32", np.dtype(np.float64): "f64",
             np.dtype(np.int64): "i64"}[a.dtype]
    return be.from_numpy(np.array(a), dtype)


def _np(be, t) -> np.ndarray:
    return np.asarray(be.to_numpy(t))


# ---- kernels against torch autograd ------------------------------------------------------------

@pytest.mark.parametrize("causal", [True, False])
def test_attention_forward_and_backward_match_torch_autograd(backend, causal):
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((2, 3, 24, 16)).astype(np.float32) for _ in range(3))
    g = rng.standard_normal((2, 3, 24, 16)).astype(np.float32)
    scale = None if causal else 0.2

    tq, tk, tv = (torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in (q, k, v))
    ref = F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal, scale=scale)
    ref.backward(torch.tensor(g, dtype=torch.float64))
    s = torch.matmul(tq, tk.transpose(-1, -2)) * (scale or 16 ** -0.5)
    if causal:
        s = s.masked_fill(~torch.ones(24, 24, dtype=torch.bool).tril(), float("-inf"))
    ref_lse = torch.logsumexp(s, -1)

    out, lse = backend.ops["attention"](_to(backend, q), _to(backend, k), _to(backend, v),
                                        causal=causal, scale=scale)
    assert _np(backend, lse).dtype == np.float32 and _np(backend, lse).shape == (2, 3, 24)
    np.testing.assert_allclose(_np(backend, out), ref.detach().numpy(), atol=1e-5, rtol=1e-4)
    np.testing.assert_allclose(_np(backend, lse), ref_lse.detach().numpy(), atol=1e-5, rtol=1e-5)
    grads = backend.ops["attention_bwd"](_to(backend, g), _to(backend, q), _to(backend, k),
                                         _to(backend, v), out, lse, causal=causal, scale=scale)
    for got, want in zip(grads, (tq.grad, tk.grad, tv.grad)):
        np.testing.assert_allclose(_np(backend, got), want.numpy(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("mask_kind", ["bool", "additive", "none"])
def test_masked_grouped_query_attention_matches_torch_autograd(backend, mask_kind):
    """attention_masked (and attention, for mask none) with 4 query heads over 2 kv heads: out
    and (dq, dk, dv) as autograd through F.scaled_dot_product_attention(enable_gqa=True)."""
    rng = np.random.default_rng(5)
    q = rng.standard_normal((2, 4, 12, 8)).astype(np.float32)
    k, v = (rng.standard_normal((2, 2, 12, 8)).astype(np.float32) for _ in range(2))
    g = rng.standard_normal((2, 4, 12, 8)).astype(np.float32)
    keep = rng.random((2, 1, 12, 12)) < 0.6
    keep[..., np.arange(12), np.arange(12)] = True                # no row fully masked
    mask = {"bool": keep, "additive": rng.standard_normal((1, 1, 12, 12)).astype(np.float32),
            "none": None}[mask_kind]
    tq, tk, tv = (torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in (q, k, v))
    tm = None if mask is None else torch.tensor(mask if mask.dtype == bool else
                                                mask.astype(np.float64))
    ref = F.scaled_dot_product_attention(tq, tk, tv, attn_mask=tm, is_causal=mask is None,
                                         scale=0.3, enable_gqa=True)
    ref.backward(torch.tensor(g, dtype=torch.float64))
    ins = [_to(backend, a) for a in (q, k, v)]
    if mask is None:
        fwd, bwd, extra, attrs = "attention", "attention_bwd", [], {"causal": True, "scale": 0.3}
    else:
        m = backend.from_numpy(mask, "bool") if mask.dtype == bool else _to(backend, mask)
        fwd, bwd, extra, attrs = "attention_masked", "attention_masked_bwd", [m], {"scale": 0.3}
    out, lse = backend.ops[fwd](*ins, *extra, **attrs)
    np.testing.assert_allclose(_np(backend, out), ref.detach().numpy(), atol=1e-5, rtol=1e-4)
    grads = backend.ops[bwd](_to(backend, g), *ins, out, lse, *extra, **attrs)
    for got, want in zip(grads, (tq.grad, tk.grad, tv.grad)):
        assert _np(backend, got).shape == tuple(want.shape)
        np.testing.assert_allclose(_np(backend, got), want.numpy(), atol=1e-4, rtol=1e-4)


def test_layer_norm_and_gelu_backward_match_torch_autograd(backend):
    rng = np.random.default_rng(6)
    x = rng.standard_normal((3, 5, 16)).astype(np.float32)
    w, b = (rng.standard_normal(16).astype(np.float32) for _ in range(2))
    g = rng.standard_normal((3, 5, 16)).astype(np.float32)
    tx, tw, tb = (torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in (x, w, b))
    ref = F.gelu(F.layer_norm(tx, (16,), tw, tb, 1e-5), approximate="tanh")
    ref.backward(torch.tensor(g, dtype=torch.float64))
    ops = backend.ops
    y, mean, rstd = ops["layer_norm"](_to(backend, x), _to(backend, w), _to(backend, b), eps=1e-5)
    out = ops["gelu"](y, approximate="tanh")
    np.testing.assert_allclose(_np(backend, out), ref.detach().numpy(), atol=1e-5, rtol=1e-4)
    gy = ops["gelu_bwd"](_to(backend, g), y, approximate="tanh")
    gx, gw, gb = ops["layer_norm_bwd"](gy, _to(backend, x), mean, rstd, _to(backend, w),
                                       _to(backend, b))
    for got, want in zip((gx, gw, gb), (tx.grad, tw.grad, tb.grad)):
        np.testing.assert_allclose(_np(backend, got), want.numpy(), atol=1e-4, rtol=1e-4)


def test_grouped_mm_matches_per_expert_autograd(backend):
    """Rows sorted by expert: rows offs[e-1]:offs[e] go through w[e]; an empty group and rows
    past the last offset (no expert: zero output, zero gradient) included."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((20, 6)).astype(np.float32)
    w = rng.standard_normal((3, 6, 5)).astype(np.float32)
    offs = np.array([7, 7, 18], dtype=np.int64)
    g = rng.standard_normal((20, 5)).astype(np.float32)
    tx, tw = (torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in (x, w))
    ref = torch.cat([tx[:7] @ tw[0], tx[7:18] @ tw[2], tx[18:] * 0 @ tw[0]])
    ref.backward(torch.tensor(g, dtype=torch.float64))
    ins = [_to(backend, x), _to(backend, w), _to(backend, offs)]
    np.testing.assert_allclose(_np(backend, backend.ops["grouped_mm"](*ins)), ref.detach().numpy(),
                               atol=1e-5, rtol=1e-5)
    gx, gw = backend.ops["grouped_mm_bwd"](_to(backend, g), *ins)
    np.testing.assert_allclose(_np(backend, gx), tx.grad.numpy(), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(_np(backend, gw), tw.grad.numpy(), atol=1e-5, rtol=1e-5)


def test_dropout_masks_are_the_same_bits_on_both_backends():
    """The dropout op's mask is a counter-based hash of (seed, counter, element index): the same
    on every backend, a fresh one per counter, and about 1 - p of it kept."""
    tb, nb = TorchBackend(), NumpyBackend()
    x = np.random.default_rng(8).standard_normal((4, 1000)).astype(np.float32)
    masks = []
    for seed, counter in [(0, 0), (0, 1), (1, 0), (-7, 2 ** 40)]:
        s = np.array([seed, counter], dtype=np.int64)
        out_t, keep_t = tb.ops["dropout"](tb.from_numpy(x, "f32"), tb.from_numpy(s, "i64"), p=0.25)
        out_n, keep_n = nb.ops["dropout"](x, s, p=0.25)
        np.testing.assert_array_equal(tb.to_numpy(keep_t), keep_n)
        np.testing.assert_array_equal(tb.to_numpy(out_t), out_n)
        np.testing.assert_array_equal(out_n, np.where(keep_n, x * np.float32(1 / 0.75), 0))
        assert abs(keep_n.mean() - 0.75) < 0.02
        masks.append(keep_n)
    assert all((a != b).mean() > 0.3 for i, a in enumerate(masks) for b in masks[i + 1:])
    _, none_dropped = nb.ops["dropout"](x, np.array([3, 4]), p=0.0)
    assert none_dropped.all()


def test_cross_entropy_backward_through_nll_and_log_softmax_kernels(backend):
    """log_softmax -> nll_loss (mean, ignore_index) forward and both backward kernels compose to
    the gradient torch autograd gives for F.cross_entropy."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((20, 50)).astype(np.float32)
    t = rng.integers(0, 50, 20).astype(np.int64)
    t[[3, 7]] = -100
    tx = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    ref = F.cross_entropy(tx, torch.tensor(t), ignore_index=-100)
    ref.backward()

    ops = backend.ops
    logp = ops["log_softmax"](_to(backend, x), dim=1)
    loss, total = ops["nll_loss"](logp, _to(backend, t), reduction="mean", ignore_index=-100)
    assert float(_np(backend, total)) == 18.0
    assert _np(backend, loss).shape == ()
    np.testing.assert_allclose(float(_np(backend, loss)), ref.item(), rtol=1e-5)
    one = _to(backend, np.array(1.0, dtype=np.float32))
    g_logp = ops["nll_loss_bwd"](one, logp, _to(backend, t), total, reduction="mean",
                                 ignore_index=-100)
    gx = ops["log_softmax_bwd"](g_logp, logp, dim=1)
    np.testing.assert_allclose(_np(backend, gx), tx.grad.numpy(), atol=1e-6, rtol=1e-5)
    assert not _np(backend, gx)[3].any()       # ignored rows get no gradient


def test_embedding_backward_sums_repeated_ids(backend):
    rng = np.random.default_rng(3)
    ids = np.array([[1, 4, 1, 1], [4, 0, 9, 1]], dtype=np.int64)      # 1 four times; 2,3.. absent
    grad = rng.standard_normal((2, 4, 8)).astype(np.float32)
    w = torch.zeros(12, 8, dtype=torch.float64, requires_grad=True)
    F.embedding(torch.tensor(ids), w).backward(torch.tensor(grad, dtype=torch.float64))
    got = _np(backend, backend.ops["embedding_bwd"](_to(backend, grad), _to(backend, ids),
                                                    num_weights=12))
    assert got.shape == (12, 8) and got.dtype == np.float32
    np.testing.assert_allclose(got, w.grad.numpy(), atol=1e-6)
    np.testing.assert_allclose(got[1], grad[0, 0] + grad[0, 2] + grad[0, 3] + grad[1, 3],
                               atol=1e-6)


def test_binary_ops_take_a_scalar_on_either_side_and_keep_f32(backend):
    x = np.array([[-2.0, 0.5], [3.0, 0.0]], dtype=np.float32)
    ops, tx = backend.ops, _to(backend, x)
    cases = [("sub", (1.5, tx), 1.5 - x), ("sub", (tx, 1.5), x - 1.5),
             ("div", (1.0, _to(backend, x + 4)), 1.0 / (x + 4)),
             ("maximum", (0.0, tx), np.maximum(0.0, x)), ("minimum", (tx, 0.0), np.minimum(x, 0.0)),
             ("lt", (0.0, tx), 0.0 < x), ("eq", (tx, 0.0), x == 0.0),
             ("where", (_to(backend, x) > 0, tx, 0.0), np.where(x > 0, x, np.float32(0)))]
    for op, args, want in cases:
        got = _np(backend, ops[op](*args))
        assert got.dtype == want.dtype, (op, got.dtype)
        np.testing.assert_allclose(got, want, rtol=1e-6)


def test_numpy_backend_lacks_exactly_the_runtime_executed_ops():
    runtime_ops = {n for n, d in opset.OPS.items() if d.group in (Group.COMM, Group.MOE)}
    assert set(opset.OPS) - set(NumpyBackend().ops) == runtime_ops
    assert set(opset.OPS) - set(TorchBackend().ops) == runtime_ops


# ---- whole programs ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llama_program():
    from frontend.capture import capture
    g = capture(str(ROOT / "examples/llama_tiny.py"),
                {"n_layers": 1, "dim": 64, "n_heads": 4, "ffn": 128, "vocab": 256}, 2, 16)
    rng = np.random.default_rng(0)
    host = {v.name: rng.integers(0, 256, v.type.shape).astype(np.int64) for v in g.inputs}
    for v in g.consts + g.all_params():       # consts are rotary tables: any values compare
        host[v.name] = (rng.standard_normal(v.type.shape) * 0.1).astype(np.float32)
    return g, host


def _run(g, host, be) -> np.ndarray:
    assert not missing_kernels(g, be)
    ins = {v.name: be.from_numpy(host[v.name], v.type.dtype)
           for v in g.inputs + g.consts + g.all_params()}
    (out,) = run_program(g, be, ins)
    return np.asarray(be.to_numpy(out))


def test_llama_program_agrees_across_backends(llama_program):
    g, host = llama_program
    ref = _run(g, host, get_backend("torch"))
    assert ref.shape == (2, 16, 256) and np.abs(ref).max() > 0.05
    np.testing.assert_allclose(_run(g, host, get_backend("numpy")), ref, atol=1e-5, rtol=1e-4)
    np.testing.assert_allclose(_run(g, host, TorchBackend(attention="math")), ref, atol=1e-5,
                               rtol=1e-4)


def test_bf16_policy_keeps_f32_values_with_bf16_matmul_error(llama_program):
    g, host = llama_program
    ref = _run(g, host, TorchBackend())
    bf = _run(g, host, TorchBackend(dtype_policy="bf16"))
    assert bf.dtype == np.float32
    err = np.abs(bf - ref).max() / np.abs(ref).max()
    assert 1e-5 < err < 3e-2          # visibly rounded through bf16, yet the same function


def test_bf16_policy_casts_matmul_inputs_only():
    be = TorchBackend(dtype_policy="bf16")
    a = torch.tensor([[1.0 + 2 ** -10]])        # not representable in bf16 (8 significant bits)
    assert be.ops["mm"](a, torch.ones(1, 1)).item() == 1.0
    assert be.ops["mm"](a, torch.ones(1, 1)).dtype == torch.float32
    assert be.ops["add"](a, 0.0).item() == 1.0 + 2 ** -10
    assert TorchBackend().ops["mm"](a, torch.ones(1, 1)).item() == 1.0 + 2 ** -10


# ---- optimizer ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["torch", "numpy"])
def test_adamw_matches_torch_optim_adamw(name):
    rng = np.random.default_rng(4)
    shapes = [(5, 7), (13,), (3, 4, 5)]
    init = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    ref = [torch.tensor(p, requires_grad=True) for p in init]
    opt = torch.optim.AdamW(ref, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    be = get_backend(name)
    params = [be.from_numpy(p.copy(), "f32") for p in init]
    m = [be.zeros(s, "f32") for s in shapes]
    v = [be.zeros(s, "f32") for s in shapes]
    for step in range(1, 6):
        grads = [rng.standard_normal(s).astype(np.float32) for s in shapes]
        for p, gr in zip(ref, grads):
            p.grad = torch.tensor(gr)
        opt.step()
        be.adamw_step(params, [be.from_numpy(gr, "f32") for gr in grads], m, v, step, lr=3e-3,
                      beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    for p, r, p0 in zip(params, ref, init):
        got, want = np.asarray(be.to_numpy(p)), r.detach().numpy()
        assert np.abs(got - p0).max() > 1e-3                 # the steps moved it
        if name == "torch":
            np.testing.assert_array_equal(got, want)        # torch's own implementation
        else:
            np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-6)
    for s, st in zip(opt.state.values(), m):
        np.testing.assert_allclose(np.asarray(be.to_numpy(st)), s["exp_avg"].numpy(), atol=1e-7)


# ---- host transfer -----------------------------------------------------------------------------

def test_torch_from_numpy_is_zero_copy_on_cpu_and_copies_read_only_arrays():
    be = TorchBackend()
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    t = be.from_numpy(a, "f32")
    a[0, 0] = 42.0
    assert t[0, 0].item() == 42.0
    assert np.shares_memory(be.to_numpy(t), a)
    ro = np.ones(3, dtype=np.float32)
    ro.flags.writeable = False
    t2 = be.from_numpy(ro, "f32")
    t2 += 1                                      # in-place updates must not touch the source
    assert ro[0] == 1.0
    assert be.from_numpy(np.ones(3), "f32").dtype == torch.float32   # converts f64 input


def test_bf16_host_bits_round_trip_and_widen_on_numpy():
    vals = torch.tensor([1.0, -2.5, 3.140625, 1e-3], dtype=torch.bfloat16)
    bits = vals.view(torch.uint16).numpy()
    tb = TorchBackend()
    t = tb.from_numpy(bits, "bf16")
    assert t.dtype == torch.bfloat16 and torch.equal(t, vals)
    assert np.array_equal(tb.to_numpy(t), bits)
    widened = NumpyBackend().from_numpy(bits, "bf16")
    assert widened.dtype == np.float32
    np.testing.assert_array_equal(widened, vals.float().numpy())


def test_numpy_backend_declares_no_half_dtypes():
    assert not {"bf16", "f16"} & NumpyBackend().dtypes
    assert {"f32", "f64", "i64", "bool"} <= NumpyBackend().dtypes


def test_numpy_backend_runs_without_torch():
    code = """
import sys
sys.modules['torch'] = None              # any `import torch` now raises ImportError
import numpy as np
from backends.registry import get_backend
be = get_backend('numpy')
import backends.numpy.ops, backends.numpy.runtime
q = np.ones((1, 1, 4, 8), np.float32)
out, lse = be.ops['attention'](q, q, q, causal=True)
assert out.shape == (1, 1, 4, 8) and lse.dtype == np.float32
assert not any(m == 'torch' or m.startswith('torch.') for m, v in sys.modules.items()
               if v is not None)
print('ok')
"""
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


# ---- the workers' allocator policy (backends/allocator.py) --------------------------------------

_FAULTS = """
import json, resource, sys
import numpy as np
from backends.allocator import keep_freed_memory
applied = keep_freed_memory()
np.zeros(8 << 20, np.uint8)                   # a first one freed (glibc then raises its threshold)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):          # a micro-batch's tensors (8 x 8 MiB) made, written, then all freed
    bufs = [np.zeros(8 << 20, np.uint8) for _ in range(8)]
    for a in bufs:
        a[::4096] = 1
    del bufs, a
print(json.dumps({"applied": applied,
                  "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""


def _alloc_faults(env_value):
    import json
    import os
    import subprocess
    import sys
    env = dict(os.environ, H2_KEEP_FREED_MEMORY=env_value)
    out = subprocess.run([sys.executable, "-c", _FAULTS], env=env, capture_output=True, text=True,
                         check=True, cwd=os.path.dirname(os.path.dirname(__file__)))
    return json.loads(out.stdout)


def test_freed_memory_is_kept_so_a_buffer_made_again_costs_no_page_faults():
    import platform
    if platform.libc_ver()[0] != "glibc":
        pytest.skip("the allocator policy sets glibc's malloc; this libc is not glibc")
    kept, default = _alloc_faults("1"), _alloc_faults("0")
    assert kept["applied"] and not default["applied"]
    # kept, only the first round faults its 64 MiB (16,384 pages) in; glibc's defaults give
    # freed heap top back to the kernel, to be faulted in again in later rounds (seen: 81,787)
    assert kept["faults"] < 1.25 * 16384
    assert default["faults"] > 2.5 * 16384
