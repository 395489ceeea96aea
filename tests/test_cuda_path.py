"""The torch backend's CUDA path, as far as a CPU can check it: which attention form a table
picks, the fused forms' fallbacks, the bf16 policy's dtype flow with f32 masters, a bf16 2-stage
run tracking an fp32 one, and bench/bench_gpu.py's CPU smoke mode. CUDA-only checks run where
a GPU is (skipped otherwise)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from backends.base import run_program
from backends.torch import ops
from backends.torch.runtime import TorchBackend

ROOT = Path(__file__).resolve().parent.parent
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


# ---- attention form --------------------------------------------------------------------------

def test_auto_attention_is_cpu_flash_on_cpu_and_fused_on_cuda(monkeypatch):
    monkeypatch.delenv("H2_TORCH_ATTENTION", raising=False)
    assert ops.attention_form(torch.device("cpu")) == "flash"
    assert ops.attention_form(torch.device("cuda")) == "fused"
    assert ops.attention_form(torch.device("cuda:1")) == "fused"
    assert ops.attention_form(torch.device("meta")) == "math"
    assert ops.attention_form(torch.device("cuda"), "math") == "math"
    monkeypatch.setenv("H2_TORCH_ATTENTION", "math")
    assert ops.attention_form(torch.device("cuda")) == "math"
    with pytest.raises(ValueError, match="unknown attention form"):
        ops.attention_form(torch.device("cpu"), "nope")


def test_cpu_table_is_unchanged_by_the_cuda_forms(monkeypatch):
    monkeypatch.delenv("H2_TORCH_ATTENTION", raising=False)
    t = ops.kernel_table(torch.device("cpu"))
    assert t["attention"] is ops.attention_flash_cpu
    assert t["attention_masked_bwd"] is ops.attention_masked_bwd_flash_cpu
    t = ops.kernel_table(torch.device("cuda"))       # tables are built without touching a GPU
    assert t["attention"] is ops.attention_cuda and t["attention_bwd"] is ops.attention_bwd_cuda


def _qkv(dtype, device="cpu", h=4, h_kv=2, s=16, d=8):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, n, s, d, generator=g, dtype=dtype).to(device) for n in (h, h_kv, h_kv)]


def test_fused_kind_by_dtype_mask_and_shape():
    q = torch.empty(1, 2, 16, 64, dtype=torch.bfloat16, device="meta")
    kind = ops.fused_attention_kind
    assert kind(q, q, q) is None                                  # not CUDA
    fake = type("T", (), {})                                      # duck-typed CUDA tensors

    def t(dtype, s=16, d=64):
        x = fake()
        x.device, x.dtype, x.shape = torch.device("cuda"), dtype, (1, 2, s, d)
        return x
    bf, f32, f64 = t(torch.bfloat16), t(torch.float32), t(torch.float64)
    assert kind(bf, bf, bf) == "flash"
    assert kind(bf, bf, bf, mask=object()) == "efficient"
    assert kind(f32, f32, f32) == "efficient"
    assert kind(f64, f64, f64) is None
    assert kind(bf, t(torch.bfloat16, s=8), t(torch.bfloat16, s=8), causal=True) is None
    assert kind(bf, t(torch.bfloat16, s=8), t(torch.bfloat16, s=8)) == "flash"
    assert kind(t(torch.bfloat16, d=60), t(torch.bfloat16, d=60), t(torch.bfloat16, d=60)) \
        is None                                                   # half kernels: d % 8
    assert kind(t(torch.float32, d=60), t(torch.float32, d=60), t(torch.float32, d=60)) \
        == "efficient"                                            # f32: d % 4
    assert kind(t(torch.float32, d=30), t(torch.float32, d=30), t(torch.float32, d=30)) is None
    assert kind(bf, f32, f32) is None                             # mixed dtypes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_forms_run_the_math_form_off_cuda(dtype):
    q, k, v = _qkv(dtype)
    out, lse = ops.attention_cuda(q, k, v, causal=True)
    ref_out, ref_lse = ops.attention_math(q, k, v, causal=True)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    grads = ops.attention_bwd_cuda(q, q, k, v, out, lse, causal=True)
    for a, b in zip(grads, ops.attention_bwd_math(q, q, k, v, out, lse, causal=True)):
        assert torch.equal(a, b)


def test_efficient_bias_is_aligned_and_additive():
    q = torch.zeros(2, 4, 5, 8)
    k = torch.zeros(2, 4, 7, 8)
    mask = torch.ones(2, 1, 5, 7, dtype=torch.bool)
    mask[..., 3] = False
    b = ops._efficient_bias(mask, q, k)
    assert b.shape == (2, 4, 5, 7) and b.stride(-2) % 16 == 0 and b.stride(-1) == 1
    assert torch.isinf(b[..., 3]).all() and (b[..., :3] == 0).all()


# ---- bf16 policy ------------------------------------------------------------------------------

def test_bf16_policy_keeps_f32_programs_f32_and_bf16_activations_bf16():
    be = TorchBackend(dtype_policy="bf16")
    x32 = torch.randn(3, 4)
    w32 = torch.randn(4, 5)
    assert be.ops["mm"](x32, w32).dtype == torch.float32            # autocast-like, unchanged
    x16 = x32.to(torch.bfloat16)
    y = be.ops["mm"](x16, w32)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, torch.mm(x16, w32.to(torch.bfloat16)))
    assert be.ops["mul"](x16, torch.ones(4)).dtype == torch.bfloat16
    assert be.ops["add"](x32, x32).dtype == torch.float32
    assert be.ops["log_softmax"](x16, dim=-1).dtype == torch.float32
    ids = torch.tensor([0, 2, 2])
    assert be.ops["embedding_bwd"](x16[:, :2].reshape(3, 2).contiguous(), ids,
                                   num_weights=3).dtype == torch.float32
    fp = TorchBackend()                                               # fp32 policy untouched
    assert fp.ops["mul"] is ops.BINARY["mul"] and fp.ops["mm"] is torch.mm


def test_compute_params_cast_once_per_change():
    be = TorchBackend(dtype_policy="bf16")
    p = {"w": torch.randn(4, 4), "ids": torch.arange(3)}
    a = be.compute_params(p)
    assert a["w"].dtype == torch.bfloat16 and a["ids"] is p["ids"]
    assert be.compute_params(p)["w"] is a["w"]                       # cached
    p["w"].add_(1.0)                                                 # an in-place update
    b = be.compute_params(p)
    assert b["w"] is not a["w"] and torch.equal(b["w"], p["w"].to(torch.bfloat16))
    assert TorchBackend().compute_params(p) is p
    assert be.as_dtype(b["w"], "f32").dtype == torch.float32
    assert be.as_dtype(p["w"], "f32") is p["w"]


def test_adamw_after_bf16_grads_cast_to_master_matches_f32_step():
    be = TorchBackend(dtype_policy="bf16")
    p = [torch.randn(5, 3)]
    g16 = torch.randn(5, 3).to(torch.bfloat16)
    ref = [p[0].clone()]
    be.adamw_step(p, [be.as_dtype(g16, "f32")], [torch.zeros(5, 3)], [torch.zeros(5, 3)], 1,
                  1e-3, 0.9, 0.95, 1e-8, 0.1)
    TorchBackend().adamw_step(ref, [g16.float()], [torch.zeros(5, 3)], [torch.zeros(5, 3)], 1,
                              1e-3, 0.9, 0.95, 1e-8, 0.1)
    assert torch.equal(p[0], ref[0]) and p[0].dtype == torch.float32


def test_llama_forward_in_bf16_tracks_fp32():
    from frontend.capture import capture
    g = capture(str(ROOT / "examples/llama_tiny.py"),
                {"n_layers": 2, "dim": 64, "n_heads": 4, "ffn": 128, "vocab": 256}, 2, 16)
    rng = np.random.default_rng(0)
    host = {v.name: rng.integers(0, 256, v.type.shape).astype(np.int64) for v in g.inputs}
    for v in g.consts + g.all_params():
        host[v.name] = (rng.standard_normal(v.type.shape) * 0.1).astype(np.float32)

    def run(be):
        ins = {v.name: be.from_numpy(host[v.name], v.type.dtype)
               for v in g.inputs + g.consts + g.all_params()}
        ins.update(be.compute_params({v.name: ins[v.name] for v in g.all_params()}))
        return run_program(g, be, ins)[0]
    ref, bf = run(TorchBackend()), run(TorchBackend(dtype_policy="bf16"))
    assert ref.dtype == torch.float32 and bf.dtype == torch.bfloat16
    err = float((bf.float() - ref).abs().max() / ref.abs().max())
    assert 1e-5 < err < 3e-2


# ---- end to end on the CPU ----------------------------------------------------------------------

def test_bench_gpu_attention_part_runs_on_cpu(tmp_path):
    out = tmp_path / "r.json"
    r = subprocess.run([sys.executable, str(ROOT / "bench/bench_gpu.py"), "--device", "cpu",
                        "--tiny", "--part", "attn", "--json", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(out.read_text())["attn"]
    assert res["ok"] and len(res["cases"]) == 10


@pytest.mark.slow
def test_bench_gpu_cpu_smoke_trains_bf16_tracking_fp32(tmp_path):
    """bench_gpu.py --device cpu --tiny: the attention check, a 1-stage bf16 build against eager
    PyTorch, and 10 steps of a 2-stage bf16 build against fp32 (losses within bf16 tolerance)."""
    out = tmp_path / "r.json"
    r = subprocess.run([sys.executable, str(ROOT / "bench/bench_gpu.py"), "--device", "cpu",
                        "--tiny", "--part", "all", "--rounds", "1", "--workdir",
                        str(tmp_path / "w"), "--json", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["attn"]["ok"]
    assert res["perf1"]["h2_step_s"] > 0 and res["perf1"]["eager_step_s"] > 0
    c = res["curve"]
    assert len(c["bf16"]["losses"]) == len(c["fp32"]["losses"]) == 10
    assert c["bf16"]["losses"] != c["fp32"]["losses"]          # bf16 did run in bf16
    assert c["max_rel_diff"] < 3e-2


# ---- CUDA ---------------------------------------------------------------------------------------

@cuda
def test_fused_attention_matches_math_on_cuda():
    sys.path.insert(0, str(ROOT / "bench"))
    from bench_gpu import attention_self_check
    res = attention_self_check("cuda")
    assert res["ok"], res
