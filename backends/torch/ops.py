"""The torch backend's op table: one PyTorch kernel per h2ir op (h2ir/opset.py).

Kernels are called as `kernel(*inputs, **attrs)` with the op's attributes (defaults filled in);
inputs are tensors on the backend's device or Python scalars (a binary op may get a scalar on
either side). Every kernel is device-agnostic; only creation ops need the device, and only the
matrix ops, the loss path and mixed-dtype binary ops look at the dtype policy.

Attention on CPU calls the same ATen kernels AOTAutograd records when the model is traced
(`_scaled_dot_product_flash_attention_for_cpu` and its backward), so an h2ir program reproduces
eager PyTorch. On CUDA it calls the fused kernels torch's scaled_dot_product_attention uses
(FlashAttention-2, memory-efficient) and their backward, per call where they apply; otherwise
it runs in math form — scores, mask, logsumexp, softmax — which is correct on any device by
construction and is exercised on CPU by the tests (`attention="math"`). COMM and MOE ops are
not kernels: the runtime and DiComm execute them.
"""
from __future__ import annotations

import math
import operator
import os

import torch
import torch.nn.functional as F

from h2ir.opset import DROPOUT_RNG, dropout_threshold
from h2ir.types import DTYPE_POLICIES, DTYPE_TABLE

aten = torch.ops.aten

# h2ir dtype name <-> torch dtype (from the one dtype table)
TORCH_DTYPE = {n: getattr(torch, d.torch) for n, d in DTYPE_TABLE.items()}
H2_DTYPE = {v: k for k, v in TORCH_DTYPE.items()}

# nll_loss reduction names -> ATen's enum (at::Reduction)
REDUCTION = {"none": 0, "mean": 1, "sum": 2}


def _dims(dims, rank: int) -> list[int]:
    return list(range(rank)) if dims is None else [d % rank for d in dims]


def _slice_index(rank: int, dim: int, index) -> tuple:
    return (slice(None),) * (dim % rank) + (index,)


def _tensor_operand(x, like: torch.Tensor) -> torch.Tensor:
    """A Python scalar as a 0-d tensor of the dtype torch's scalar promotion gives (for ops that
    take no scalar)."""
    if isinstance(x, torch.Tensor):
        return x
    return torch.full((), x, dtype=torch.result_type(like, x), device=like.device)


def _first_tensor(*xs) -> torch.Tensor:
    return next(x for x in xs if isinstance(x, torch.Tensor))


# ---- elementwise ---------------------------------------------------------------------------------

UNARY = {
    "erf": torch.erf, "atan": torch.atan, "sign": torch.sign,
    "neg": torch.neg, "exp": torch.exp, "log": torch.log, "sqrt": torch.sqrt, "rsqrt": torch.rsqrt,
    "tanh": torch.tanh, "sigmoid": torch.sigmoid, "relu": torch.relu, "silu": F.silu,
    "abs": torch.abs, "reciprocal": torch.reciprocal, "sin": torch.sin,
    "cos": torch.cos, "logical_not": torch.logical_not, "bitwise_not": torch.bitwise_not,
    "copy": torch.clone, "log1p": torch.log1p, "expm1": torch.expm1,
}

# Python operators accept a scalar on either side and promote it as torch promotes scalars.
BINARY = {"add": operator.add, "sub": operator.sub, "mul": operator.mul, "div": operator.truediv,
          "eq": operator.eq, "ne": operator.ne, "lt": operator.lt, "le": operator.le,
          "gt": operator.gt, "ge": operator.ge, "power": operator.pow,
          "floor_divide": operator.floordiv, "remainder": operator.mod,
          "bitwise_and": operator.and_,
          "bitwise_or": operator.or_, "bitwise_xor": operator.xor}


def _tensor_pair(fn):
    def kernel(a, b):
        t = _first_tensor(a, b)
        return fn(_tensor_operand(a, t), _tensor_operand(b, t))
    kernel.__name__ = fn.__name__
    return kernel


def where(cond, a, b):
    return torch.where(cond, a, b)


def cast(x, dtype):
    return x.to(TORCH_DTYPE[dtype])


def pow_(x, exponent):
    return torch.pow(x, exponent)


def gelu(x, approximate="none"):
    return F.gelu(x, approximate=approximate)


def gelu_bwd(grad, x, approximate="none"):
    return aten.gelu_backward(grad, x, approximate=approximate)


def cumsum(x, dim, dtype=None):
    out = TORCH_DTYPE[dtype] if dtype else (x.dtype if x.is_floating_point() else torch.int64)
    if out in _LOW_PRECISION:       # CUDA's scan adds in the half type itself: add in f32
        return torch.cumsum(x, dim, dtype=torch.float32).to(out)
    return torch.cumsum(x, dim, dtype=out)


# ---- reductions ----------------------------------------------------------------------------------

def _reduction(fn):
    def kernel(x, dims=None, keepdim=False):
        if x.dim() == 0:
            return fn(x)
        return fn(x, dim=_dims(dims, x.dim()), keepdim=keepdim)
    kernel.__name__ = fn.__name__
    return kernel


# ---- movement ------------------------------------------------------------------------------------

def reshape(x, shape):
    return x.reshape(shape)


def permute(x, dims):
    return x.permute(dims)


def transpose(x, dim0, dim1):
    return x.transpose(dim0, dim1)


def expand(x, shape):
    return x.expand(shape)


def slice_(x, dim, start=None, end=None, step=1):
    return x[_slice_index(x.dim(), dim, slice(start, end, step))]


def select(x, dim, index):
    return x.select(dim, index)


def cat(*xs, dim=0):
    return torch.cat(xs, dim=dim)


def split(x, dim, sizes):
    return tuple(torch.split(x, list(sizes), dim=dim))


# ---- nn / index / loss ---------------------------------------------------------------------------

def softmax(x, dim):
    return torch.softmax(x, dim)


def log_softmax(x, dim):
    return torch.log_softmax(x, dim)


def tril(x, diagonal=0):
    return torch.tril(x, diagonal)


def topk(x, k, dim=-1):
    values, indices = torch.topk(x, k, dim=dim, largest=True, sorted=True)
    return values, indices


def sort(x, dim=-1, descending=False):
    values, indices = torch.sort(x, dim=dim, descending=descending, stable=True)
    return values, indices


_LOW_PRECISION = (torch.bfloat16, torch.float16)


def histc(x, bins, min, max):
    # torch.histc has no integer kernel on CPU: integers are binned in f64 (exact for ids);
    # bf16/f16 in f32 (ATen computes their bin positions and counts in the low precision)
    xf = x.to(torch.float64) if not x.is_floating_point() else \
        x.float() if x.dtype in _LOW_PRECISION else x
    return torch.histc(xf, bins, min, max).to(x.dtype)


def layer_norm(x, weight, bias, normalized_ndim=1, eps=1e-5):
    out, mean, rstd = aten.native_layer_norm(x, list(x.shape[x.dim() - normalized_ndim:]), weight,
                                             bias, eps)
    return out, mean.to(x.dtype), rstd.to(x.dtype)   # CUDA keeps the statistics in f32


def layer_norm_bwd(grad, x, mean, rstd, weight, bias, normalized_ndim=1):
    shape = list(x.shape[x.dim() - normalized_ndim:])
    if weight is None:           # ATen returns no weight gradient then: differentiate at ones
        weight = x.new_ones(shape)
    if bias is None:
        bias = x.new_zeros(shape)
    if x.dtype in _LOW_PRECISION:
        # ATen's CPU kernel sums dweight/dbias in bf16/f16 (errors of ~sqrt(rows) ulps): sum in
        # f32, as its CUDA kernel does, and round once
        ins = (t.float() for t in (grad, x, mean, rstd, weight, bias))
        return tuple(t.to(x.dtype) for t in layer_norm_bwd(*ins, normalized_ndim))
    return tuple(aten.native_layer_norm_backward(grad, x, shape, mean, rstd, weight, bias,
                                                 [True, True, True]))


def _as_signed(u: int) -> int:
    """A uint64 constant as the int64 with the same bits (torch has no uint64 arithmetic)."""
    return u - (1 << 64) if u >= 1 << 63 else u


def _shr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits (>> on int64 is arithmetic: mask the sign copies)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def _mix64(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser on int64 tensors read as uint64 (h2ir.opset.DROPOUT_RNG); int64
    multiplication wraps modulo 2^64 like uint64's."""
    s1, s2, s3 = DROPOUT_RNG["shifts"]
    z = (z ^ _shr(z, s1)) * _as_signed(DROPOUT_RNG["m1"])
    z = (z ^ _shr(z, s2)) * _as_signed(DROPOUT_RNG["m2"])
    return z ^ _shr(z, s3)


def dropout_keep(seed: torch.Tensor, shape, p: float) -> torch.Tensor:
    gamma = _as_signed(DROPOUT_RNG["gamma"])
    seed = seed.to(torch.int64)
    key = _mix64(seed[0:1] ^ _mix64(seed[1:2] + gamma))
    i = torch.arange(1, math.prod(shape) + 1, dtype=torch.int64, device=seed.device)
    bits = _shr(_mix64(key + i * gamma), 64 - DROPOUT_RNG["bits"])
    return (bits >= dropout_threshold(p)).reshape(shape)


def dropout(x, seed, p):
    keep = dropout_keep(seed, tuple(x.shape), p)
    scale = torch.tensor(1.0 / (1.0 - p), dtype=x.dtype, device=x.device)
    return torch.where(keep, x * scale, torch.zeros((), dtype=x.dtype, device=x.device)), keep


def one_hot(ids, num_classes):
    return F.one_hot(ids, num_classes)


def _index_list(dims, indices) -> list:
    key = [None] * (max(dims) + 1)
    for d, i in zip(dims, indices):
        key[d] = i
    return key


def index(x, *indices, dims):
    return aten.index(x, _index_list(dims, indices))


def index_put(x, values, *indices, dims, accumulate=False):
    values = _tensor_operand(values, x).to(x.dtype)
    return aten.index_put(x, _index_list(dims, indices), values, accumulate)


def gather(x, index, dim):
    return torch.gather(x, dim, index)


def scatter(x, index, src, dim):
    return torch.scatter(x, dim, index, src)


def scatter_add(x, index, src, dim):
    return torch.scatter_add(x, dim, index, src)


def embedding(weight, ids):
    return F.embedding(ids, weight)


def nll_loss(logp, target, reduction="mean", ignore_index=-100):
    return tuple(aten.nll_loss_forward(logp, target, None, REDUCTION[reduction], ignore_index))


def silu_bwd(grad, x):
    return aten.silu_backward(grad, x)


def softmax_bwd(grad, out, dim):
    return aten._softmax_backward_data(grad, out, dim, out.dtype)


def log_softmax_bwd(grad, out, dim):
    return aten._log_softmax_backward_data(grad, out, dim, out.dtype)


def embedding_bwd(grad, ids, num_weights, padding_idx=-1):
    # index_add_ is several times faster than embedding_dense_backward on CPU; on CUDA the
    # dense backward kernel is the tuned one.
    if grad.device.type != "cpu":
        return aten.embedding_dense_backward(grad, ids, num_weights, padding_idx, False)
    d = grad.shape[-1]
    out = grad.new_zeros(num_weights, d).index_add_(0, ids.reshape(-1), grad.reshape(-1, d))
    if padding_idx >= 0:
        out[padding_idx] = 0
    return out


def slice_bwd(grad, shape, dim, start=None, end=None, step=1):
    out = grad.new_zeros(shape)
    idx = [slice(None)] * len(shape)
    idx[dim] = slice(start, end, step)
    out[tuple(idx)] = grad
    return out


def nll_loss_bwd(grad, logp, target, total_weight, reduction="mean", ignore_index=-100):
    return aten.nll_loss_backward(grad, logp, target, None, REDUCTION[reduction], ignore_index,
                                  total_weight)


# ---- attention -----------------------------------------------------------------------------------

def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _causal_mask(s_q: int, s_k: int, device) -> torch.Tensor:
    # Top-left aligned, as torch's is_causal: query i sees keys 0..i.
    return torch.ones(s_q, s_k, dtype=torch.bool, device=device).tril()


def _repeat_heads(t: torch.Tensor, h_q: int) -> torch.Tensor:
    """Grouped-query attention: key/value head j serves query heads j*g .. j*g+g-1."""
    g = h_q // t.shape[1]
    return t if g == 1 else t.repeat_interleave(g, dim=1)


def _sum_heads(dt: torch.Tensor, h_kv: int) -> torch.Tensor:
    b, h, *rest = dt.shape
    return dt if h == h_kv else dt.reshape(b, h_kv, h // h_kv, *rest).sum(2)


def _additive_mask(mask, dtype) -> torch.Tensor | None:
    """A bool mask (true attends) as the additive 0/-inf form ATen's kernels take."""
    if mask is None or mask.dtype != torch.bool:
        return None if mask is None else mask.to(dtype)
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, -math.inf)


def _math_scores(q_, k_, causal, scale, mask):
    scores = torch.matmul(q_, _repeat_heads(k_, q_.shape[1]).transpose(-2, -1)) * scale
    if causal:
        scores = scores.masked_fill(~_causal_mask(q_.shape[-2], k_.shape[-2], q_.device), -math.inf)
    if mask is not None:
        scores = scores + _additive_mask(mask, scores.dtype)
    return scores


def attention_masked_math(q, k, v, mask, causal=False, scale=None):
    """softmax(q k^T * scale + mask) v and its logsumexp (f32 [b,h,s]), in the accumulate dtype."""
    acc = _acc_dtype(q.dtype)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = _math_scores(q.to(acc), k.to(acc), causal, scale, mask)
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.exp(scores - lse.unsqueeze(-1))
    out = torch.matmul(p, _repeat_heads(v.to(acc), q.shape[1])).to(q.dtype)
    return out, lse.to(torch.float32)


def attention_masked_bwd_math(grad, q, k, v, out, lse, mask, causal=False, scale=None):
    """FlashAttention-2's backward (Dao 2023, Alg. 2): P from the saved logsumexp,
    dS = P * (dP - rowsum(dO * O)); grouped-query heads summed back into their kv head."""
    acc = _acc_dtype(q.dtype)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    q_, k_, v_, g_, o_ = (t.to(acc) for t in (q, k, v, grad, out))
    h = q.shape[1]
    p = torch.exp(_math_scores(q_, k_, causal, scale, mask) - lse.to(acc).unsqueeze(-1))
    dv = torch.matmul(p.transpose(-2, -1), g_)
    dp = torch.matmul(g_, _repeat_heads(v_, h).transpose(-2, -1))
    ds = p * (dp - (g_ * o_).sum(-1, keepdim=True))
    dq = torch.matmul(ds, _repeat_heads(k_, h)) * scale
    dk = torch.matmul(ds.transpose(-2, -1), q_) * scale
    return (dq.to(q.dtype), _sum_heads(dk, k.shape[1]).to(k.dtype),
            _sum_heads(dv, v.shape[1]).to(v.dtype))


def attention_math(q, k, v, causal=False, scale=None):
    return attention_masked_math(q, k, v, None, causal, scale)


def attention_bwd_math(grad, q, k, v, out, lse, causal=False, scale=None):
    return attention_masked_bwd_math(grad, q, k, v, out, lse, None, causal, scale)


def attention_masked_flash_cpu(q, k, v, mask, causal=False, scale=None):
    # ATen's CPU flash kernel takes grouped-query heads as they are and an additive mask in q's
    # dtype
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, attn_mask=_additive_mask(mask, q.dtype), scale=scale)
    return out, lse.to(torch.float32)     # the op set's logsumexp is f32 (f64 runs included)


def attention_masked_bwd_flash_cpu(grad, q, k, v, out, lse, mask, causal=False, scale=None):
    lse = lse.to(_acc_dtype(q.dtype))
    return tuple(aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad, q, k, v, out, lse, 0.0, causal, attn_mask=_additive_mask(mask, q.dtype),
        scale=scale))


def attention_flash_cpu(q, k, v, causal=False, scale=None):
    return attention_masked_flash_cpu(q, k, v, None, causal, scale)


def attention_bwd_flash_cpu(grad, q, k, v, out, lse, causal=False, scale=None):
    return attention_masked_bwd_flash_cpu(grad, q, k, v, out, lse, None, causal, scale)


# CUDA: ATen's fused kernels, the ones torch's scaled_dot_product_attention dispatches to.
# FlashAttention-2 takes f16/bf16 without a mask; the memory-efficient kernel (xFormers) also
# takes f32 and an additive bias, and returns its logsumexp padded to a multiple of 32 rows.
# A call neither applies to (f64, a head size they lack, a non-square causal mask) runs the math
# form, as does a call whose kernel raises (told once).
_EFFICIENT_LSE_ROWS = 32
_FUSED_FAILED: set = set()


def fused_attention_kind(q, k, v, mask=None, causal=False) -> str | None:
    """'flash', 'efficient' or None (math) for one attention call on CUDA."""
    if q.device.type != "cuda" or not q.dtype == k.dtype == v.dtype:
        return None
    d = q.shape[-1]
    if causal and q.shape[-2] != k.shape[-2]:
        return None       # their causal masks are aligned differently when not square
    if mask is None and q.dtype in _LOW_PRECISION and d % 8 == 0 and d <= 256 \
            and "flash" not in _FUSED_FAILED:
        return "flash"
    align = 8 if q.dtype in _LOW_PRECISION else 4
    if q.dtype in _LOW_PRECISION + (torch.float32,) and d % align == 0 and d <= 128 \
            and "efficient" not in _FUSED_FAILED:
        return "efficient"
    return None


def fused_attention_bwd_kind(q, k, v, mask=None, causal=False) -> str | None:
    """The backward's kernel: the forward's, except that the efficient kernel's bf16/f16
    backward with a bias gave wrong dq and dk on an H200 (torch 2.11; its fp32 backward and
    its forward were right): math there."""
    kind = fused_attention_kind(q, k, v, mask, causal)
    if kind == "efficient" and mask is not None and q.dtype in _LOW_PRECISION:
        return None
    return kind


def _fused_failed(kind: str, e: Exception) -> None:
    import warnings
    _FUSED_FAILED.add(kind)
    warnings.warn(f"h2: ATen's {kind} attention kernel failed ({str(e).splitlines()[0][:200]}); "
                  "attention runs in math form from now on")


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _efficient_bias(mask, q, k) -> torch.Tensor | None:
    """The mask as the efficient kernel's additive bias: q's dtype, [b, h, s_q, s_k], its rows
    16-element aligned (padded, then sliced back, as torch's sdpa does)."""
    if mask is None:
        return None
    b, h, s_q, s_k = q.shape[0], q.shape[1], q.shape[-2], k.shape[-2]
    bias = _additive_mask(mask, q.dtype).expand(b, h, s_q, s_k)
    pad = -s_k % 16
    if pad or bias.stride(-1) != 1:
        bias = F.pad(bias, (0, pad))[..., :s_k]
    return bias


def attention_masked_cuda(q, k, v, mask, causal=False, scale=None):
    kind = fused_attention_kind(q, k, v, mask, causal)
    if kind is None:
        return attention_masked_math(q, k, v, mask, causal, scale)
    h = q.shape[1]
    q_, k_, v_ = (_last_dim_contiguous(t) for t in (q, _repeat_heads(k, h), _repeat_heads(v, h)))
    try:
        if kind == "flash":
            out, lse = aten._scaled_dot_product_flash_attention(q_, k_, v_, 0.0, causal, False,
                                                                scale=scale)[:2]
        else:
            out, lse = aten._scaled_dot_product_efficient_attention(
                q_, k_, v_, _efficient_bias(mask, q, k), True, 0.0, causal, scale=scale)[:2]
            lse = lse[..., :q.shape[-2]].contiguous()
    except RuntimeError as e:
        _fused_failed(kind, e)
        return attention_masked_math(q, k, v, mask, causal, scale)
    return out, lse.to(torch.float32)


def attention_masked_bwd_cuda(grad, q, k, v, out, lse, mask, causal=False, scale=None):
    """The fused kernels' backward from the saved output and logsumexp (either form's: they are
    the same quantities); grouped-query heads summed back into their kv head."""
    kind = fused_attention_bwd_kind(q, k, v, mask, causal)
    if kind is None or out.dtype != q.dtype or grad.dtype != q.dtype:
        return attention_masked_bwd_math(grad, q, k, v, out, lse, mask, causal, scale)
    h, h_kv, s_q, s_k = q.shape[1], k.shape[1], q.shape[-2], k.shape[-2]
    q_, k_, v_, g_, o_ = (_last_dim_contiguous(t) for t in
                          (q, _repeat_heads(k, h), _repeat_heads(v, h), grad, out))
    lse = lse.to(torch.float32).contiguous()
    try:
        if kind == "flash":
            # no dropout: the philox state is not read, only passed
            seed = torch.zeros(2, dtype=torch.uint64, device=q.device)
            offset = torch.zeros((), dtype=torch.uint64, device=q.device)
            dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
                g_, q_, k_, v_, o_, lse, None, None, s_q, s_k, 0.0, causal, seed, offset,
                scale=scale)
        else:
            lse = F.pad(lse, (0, -s_q % _EFFICIENT_LSE_ROWS))
            seed = torch.zeros((), dtype=torch.int64)
            dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
                g_, q_, k_, v_, _efficient_bias(mask, q, k), o_, lse, seed, seed, 0.0,
                [True, True, True, False], causal, scale=scale)
    except RuntimeError as e:
        _fused_failed(kind, e)
        return attention_masked_bwd_math(grad, q, k, v, out, lse[..., :s_q], mask, causal, scale)
    return dq, _sum_heads(dk, h_kv), _sum_heads(dv, h_kv)


def attention_cuda(q, k, v, causal=False, scale=None):
    return attention_masked_cuda(q, k, v, None, causal, scale)


def attention_bwd_cuda(grad, q, k, v, out, lse, causal=False, scale=None):
    return attention_masked_bwd_cuda(grad, q, k, v, out, lse, None, causal, scale)


ATTENTION_FORMS = {
    "flash": (attention_flash_cpu, attention_bwd_flash_cpu, attention_masked_flash_cpu,
              attention_masked_bwd_flash_cpu),
    "fused": (attention_cuda, attention_bwd_cuda, attention_masked_cuda, attention_masked_bwd_cuda),
    "math": (attention_math, attention_bwd_math, attention_masked_math, attention_masked_bwd_math),
}


def attention_form(device: torch.device, attention: str = "auto") -> str:
    """The attention form a kernel table on `device` uses: 'auto' (or $H2_TORCH_ATTENTION when
    set) is ATen's CPU flash kernels on the CPU, the fused CUDA kernels on CUDA, math elsewhere."""
    if attention == "auto":
        attention = os.environ.get("H2_TORCH_ATTENTION", "auto")
    if attention == "auto":
        attention = {"cpu": "flash", "cuda": "fused"}.get(device.type, "math")
    if attention not in ATTENTION_FORMS:
        raise ValueError(f"unknown attention form {attention!r} (expected auto or one of "
                         f"{', '.join(ATTENTION_FORMS)})")
    return attention


# ---- grouped matmul (MoE experts) -----------------------------------------------------------------

def _groups(offsets: torch.Tensor):
    """(expert, start, end) of each non-empty row group; one host sync for the offsets."""
    start = 0
    for e, end in enumerate(offsets.tolist()):
        if end > start:
            yield e, start, end
        start = max(start, end)


def grouped_mm(x, w, offsets):
    out = x.new_zeros(x.shape[0], w.shape[2])
    for e, s, t in _groups(offsets):
        torch.mm(x[s:t], w[e], out=out[s:t])
    return out


def grouped_mm_bwd(grad, x, w, offsets):
    gx, gw = torch.zeros_like(x), torch.zeros_like(w)
    for e, s, t in _groups(offsets):
        torch.mm(grad[s:t], w[e].transpose(0, 1), out=gx[s:t])
        torch.mm(x[s:t].transpose(0, 1), grad[s:t], out=gw[e])
    return gx, gw


# ---- sequence mixers: depthwise convolution, selective scan ---------------------------------------

def _left_pad(weight, pad_left) -> int:
    return weight.shape[1] - 1 if pad_left is None else pad_left


def depthwise_conv1d(x, weight, bias, pad_left=None, pad_right=0):
    """ATen's convolution with one filter per channel: equal pads are its padding, unequal
    ones are written into x first."""
    left = _left_pad(weight, pad_left)
    if left != pad_right:
        x, left = F.pad(x, (left, pad_right)), 0
    return aten.convolution(x, weight.unsqueeze(1), bias, [1], [left], [1], False, [0],
                            x.shape[1])


def depthwise_conv1d_bwd(grad, x, weight, pad_left=None, pad_right=0):
    left = _left_pad(weight, pad_left)
    l, xp, pad = x.shape[2], x, left
    if left != pad_right:
        xp, pad = F.pad(x, (left, pad_right)), 0
    gx, gw, gb = aten.convolution_backward(grad, xp, weight.unsqueeze(1), [weight.shape[0]], [1],
                                           [pad], [1], False, [0], x.shape[1], [True, True, True])
    if pad != left:
        gx = gx[:, :, left:left + l]
    return gx, gw.squeeze(1), gb


# The scan's operands are time-major, channels split into their groups of B and C (d = g r):
# u, delta, grad [l,b,g,r,1]; A [g,r,n]; B, C [l,b,g,1,n]; every step of the recurrence is then
# one contiguous slice. They compute in f32 (f64 for f64).

def _steps(t, groups: int):
    """[b, d, l] -> [l, b, g, r, 1]."""
    b, d, l = t.shape
    return t.to(_acc_dtype(t.dtype)).permute(2, 0, 1).reshape(l, b, groups, d // groups, 1)


def _from_steps(t, shape):
    """[l, b, g, r] (or with a trailing 1) -> [b, d, l]."""
    return t.reshape(t.shape[0], t.shape[1], -1).permute(1, 2, 0).reshape(shape)


def _scan_operands(u, delta, A, B, C):
    g, n = B.shape[1], B.shape[2]
    states = lambda t: t.to(_acc_dtype(u.dtype)).permute(3, 0, 1, 2).unsqueeze(3)   # noqa: E731
    return (_steps(u, g), _steps(delta, g), A.to(_acc_dtype(u.dtype)).reshape(g, -1, n),
            states(B), states(C))


def linear_scan_sequential(a_log, x, reverse: bool = False):
    """All states of h[t] = exp(a_log[t]) h[t-1] + x[t] (from h = 0) along the leading axis,
    one step at a time, one fused multiply-add over every state per step (Mamba's reference
    loop, as transformers' slow path runs it). reverse: from the last step back,
    h[t] = exp(a_log[t]) h[t+1] + x[t]."""
    a = torch.exp(a_log)
    H = torch.empty_like(x)
    h = torch.zeros_like(x[0])
    for t in (reversed(range(x.shape[0])) if reverse else range(x.shape[0])):
        h = torch.addcmul(x[t], a[t], h, out=H[t])
    return H


SCAN_CHUNK = 16


def linear_scan_chunked(a_log, x, reverse: bool = False, chunk: int = SCAN_CHUNK):
    """The same states in chunks (Mamba-2's chunked scan, Dao & Gu 2024, arXiv 2405.21060,
    Sec. 6): inside each chunk every state from a zero start by one batched matmul with the
    decays exp(S[t] - S[s]), s <= t (S: the chunk's prefix sums, taken in f64 so that their
    differences keep f32's precision); then one carried state per chunk, in order, decayed
    into every state of the next: L / chunk sequential steps instead of L."""
    if reverse:
        return linear_scan_chunked(a_log.flip(0), x.flip(0), chunk=chunk).flip(0)
    L, *rest = x.shape
    n = -(-L // chunk)
    pad = (0, 0) * len(rest) + (0, n * chunk - L)
    a = F.pad(a_log, pad).reshape(n, chunk, *rest).movedim(1, -1)       # [n, ..., chunk]
    xs = F.pad(x, pad).reshape(n, chunk, *rest).movedim(1, -1)
    S = torch.cumsum(a.to(torch.float64), dim=-1)
    later = torch.ones(chunk, chunk, dtype=torch.bool, device=x.device).triu(1)
    decay = torch.exp((S[..., :, None] - S[..., None, :]).to(x.dtype).masked_fill(later, -math.inf))
    local = torch.matmul(decay, xs.unsqueeze(-1)).squeeze(-1)
    through = torch.exp(S[..., -1]).to(x.dtype)
    h, h_in = torch.zeros_like(x[0]), []
    for c in range(n):
        h_in.append(h)
        h = through[c] * h + local[c, ..., -1]
    H = local + torch.exp(S).to(x.dtype) * torch.stack(h_in).unsqueeze(-1)
    return H.movedim(-1, 1).reshape(n * chunk, *rest)[:L]


SCANS = {"sequential": linear_scan_sequential, "chunked": linear_scan_chunked}


def _selective_scan(scan):
    def selective_scan(u, delta, A, B, C):
        """y = C . h over the states of the recurrence (`scan`), in f32."""
        u5, d5, A5, B5, C5 = _scan_operands(u, delta, A, B, C)
        H = scan(d5 * A5, (d5 * u5) * B5)                       # [l, b, g, r, n]
        return _from_steps((H * C5).sum(-1), u.shape).to(u.dtype)
    return selective_scan


def _selective_scan_bwd(scan):
    def selective_scan_bwd(grad, u, delta, A, B, C):
        """The states forward and their gradients by the same scan backward in time,
        dh[t] = C[t] g[t] + exp(a_log[t+1]) dh[t+1]; then every input's gradient at once from
        h, h[t-1] and dh (the chain rule through exp(delta A) and delta u B)."""
        u5, d5, A5, B5, C5 = _scan_operands(u, delta, A, B, C)
        g5 = _steps(grad, B.shape[1])
        a_log = d5 * A5
        du5 = d5 * u5
        H = scan(a_log, du5 * B5)
        ahead = torch.cat([a_log[1:], torch.zeros_like(a_log[:1])])   # none after the end
        dH = scan(ahead, C5 * g5, reverse=True)
        h_prev = torch.cat([torch.zeros_like(H[:1]), H[:-1]])
        da_log = dH * torch.exp(a_log) * h_prev
        dxB = (dH * B5).sum(-1, keepdim=True)                   # d loss / d (delta u)
        du = dxB * d5
        ddelta = (da_log * A5).sum(-1, keepdim=True) + dxB * u5
        dA = (da_log * d5).sum((0, 1))
        back = lambda t: t.squeeze(3).permute(1, 2, 3, 0)               # noqa: E731
        dB = back((dH * du5).sum(3, keepdim=True))
        dC = back((H * g5).sum(3, keepdim=True))
        dtype = u.dtype
        return (_from_steps(du.squeeze(-1), u.shape).to(dtype),
                _from_steps(ddelta.squeeze(-1), u.shape).to(dtype),
                dA.reshape(A.shape).to(dtype), dB.to(dtype), dC.to(dtype))
    return selective_scan_bwd


selective_scan = _selective_scan(linear_scan_sequential)
selective_scan_bwd = _selective_scan_bwd(linear_scan_sequential)


# ---- the table -----------------------------------------------------------------------------------

def _autocast_bf16(fn, n_tensor_inputs: int, keep: tuple = ()):
    """bf16 dtype policy for a matrix op: it computes in bf16 and its result has the dtype of its
    first operand's data. f32 operands among the first n_tensor_inputs are cast to bf16, but for
    the positions in `keep` (masks, offsets and ids are not f32; a logsumexp stays f32); an f32
    first operand gets f32 results back (as autocast), a bf16 one bf16 results."""
    def kernel(*args, **attrs):
        if args[0].dtype not in (torch.float32, torch.bfloat16):
            return fn(*args, **attrs)
        cast_in = [a.to(torch.bfloat16) if i < n_tensor_inputs and i not in keep
                   and isinstance(a, torch.Tensor) and a.dtype == torch.float32 else a
                   for i, a in enumerate(args)]
        res = fn(*cast_in, **attrs)
        if args[0].dtype == torch.bfloat16:
            return res
        if isinstance(res, tuple):
            return tuple(r.to(torch.float32) if r.is_floating_point() else r for r in res)
        return res.to(torch.float32)
    kernel.__name__ = f"bf16_{fn.__name__}"
    return kernel


def _bf16_follows(fn):
    """bf16 policy for an elementwise binary op: a bf16 tensor with an f32 one computes in bf16
    (the f32 operand is rounded, as a norm weight or a rotary table is under autocast's users),
    so bf16 activations stay bf16; f32 with f32 is unchanged."""
    def kernel(a, b):
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype != b.dtype:
            if a.dtype == torch.bfloat16 and b.dtype == torch.float32:
                b = b.to(torch.bfloat16)
            elif b.dtype == torch.bfloat16 and a.dtype == torch.float32:
                a = a.to(torch.bfloat16)
        return fn(a, b)
    kernel.__name__ = f"bf16_{getattr(fn, '__name__', 'binary')}"
    return kernel


def _f32_from_bf16(fn):
    """bf16 policy for the loss path and the embedding gradient: bf16 inputs are computed in f32
    and the result stays f32 (log-probabilities and the loss keep f32's precision; an embedding
    row's gradient sums many tokens)."""
    def kernel(*args, **attrs):
        args = [a.float() if isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 else a
                for a in args]
        return fn(*args, **attrs)
    kernel.__name__ = f"f32_{fn.__name__}"
    return kernel


# binary ops whose bf16-with-f32 operands compute in bf16 under the bf16 policy
BF16_BINARY = ("add", "sub", "mul", "div", "power", "maximum", "minimum")


def kernel_table(device: torch.device, dtype_policy: str = "fp32", attention: str = "auto",
                 scan: str = "auto") -> dict:
    """h2ir op name -> kernel for tensors on `device`.

    attention: 'flash' (ATen's CPU flash kernels), 'fused' (ATen's CUDA flash and
    memory-efficient kernels, math where neither applies), 'math' (any device) or 'auto'
    (`attention_form`: flash on CPU, fused on CUDA).
    scan: the selective scan's 'sequential' or 'chunked' form, or 'auto': sequential on the
    CPU (a step costs one fused multiply-add there; chunks' small matmuls cost more), chunked
    elsewhere (L / chunk sequential steps, the rest batched matmuls).
    """
    if dtype_policy not in DTYPE_POLICIES:
        raise ValueError(f"unknown dtype policy {dtype_policy!r} (expected one of "
                         f"{', '.join(DTYPE_POLICIES)})")
    attention = attention_form(device, attention)
    if scan == "auto":
        scan = "sequential" if device.type == "cpu" else "chunked"
    if scan not in SCANS:
        raise ValueError(f"unknown scan form {scan!r} (expected auto or one of "
                         f"{', '.join(SCANS)})")
    attn_fwd, attn_bwd, masked_fwd, masked_bwd = ATTENTION_FORMS[attention]

    def full(shape, value, dtype="f32"):
        return torch.full(tuple(shape), value, dtype=TORCH_DTYPE[dtype], device=device)

    def arange(start=0, end=None, step=1, dtype="i64"):
        return torch.arange(start, end, step, dtype=TORCH_DTYPE[dtype], device=device)

    ops = dict(UNARY)
    ops.update(BINARY)
    ops.update({
        "maximum": _tensor_pair(torch.maximum), "minimum": _tensor_pair(torch.minimum),
        "logical_and": _tensor_pair(torch.logical_and),
        "logical_or": _tensor_pair(torch.logical_or),
        "logical_xor": _tensor_pair(torch.logical_xor),
        "cast": cast, "pow": pow_, "where": where, "gelu": gelu,
        "sum": _reduction(torch.sum), "mean": _reduction(torch.mean),
        "amax": _reduction(torch.amax), "amin": _reduction(torch.amin), "cumsum": cumsum,
        "argmax": lambda x, dim=None, keepdim=False: torch.argmax(x, dim=dim, keepdim=keepdim),
        "flip": lambda x, dims: torch.flip(x, list(dims)),
        "fmod": _tensor_pair(torch.fmod),
        "reshape": reshape, "permute": permute, "transpose": transpose, "expand": expand,
        "slice": slice_, "select": select, "cat": cat, "split": split,
        "mm": torch.mm, "bmm": torch.bmm, "attention": attn_fwd, "attention_bwd": attn_bwd,
        "attention_masked": masked_fwd, "attention_masked_bwd": masked_bwd,
        "grouped_mm": grouped_mm, "grouped_mm_bwd": grouped_mm_bwd,
        "softmax": softmax, "log_softmax": log_softmax, "tril": tril, "topk": topk,
        "sort": sort, "histc": histc, "layer_norm": layer_norm, "dropout": dropout,
        "one_hot": one_hot, "embedding": embedding, "nll_loss": nll_loss,
        "index": index, "index_put": index_put, "gather": gather, "scatter": scatter,
        "scatter_add": scatter_add,
        "full": full, "arange": arange,
        "silu_bwd": silu_bwd, "softmax_bwd": softmax_bwd, "log_softmax_bwd": log_softmax_bwd,
        "gelu_bwd": gelu_bwd, "layer_norm_bwd": layer_norm_bwd,
        "embedding_bwd": embedding_bwd, "nll_loss_bwd": nll_loss_bwd, "slice_bwd": slice_bwd,
        "depthwise_conv1d": depthwise_conv1d, "depthwise_conv1d_bwd": depthwise_conv1d_bwd,
        "selective_scan": _selective_scan(SCANS[scan]),
        "selective_scan_bwd": _selective_scan_bwd(SCANS[scan]),
    })
    if dtype_policy == "bf16":
        ops["mm"] = _autocast_bf16(torch.mm, 2)
        ops["bmm"] = _autocast_bf16(torch.bmm, 2)
        ops["grouped_mm"] = _autocast_bf16(grouped_mm, 2)
        ops["grouped_mm_bwd"] = _autocast_bf16(grouped_mm_bwd, 3)
        ops["attention"] = _autocast_bf16(attn_fwd, 3)
        ops["attention_bwd"] = _autocast_bf16(attn_bwd, 5)    # grad, q, k, v, out; lse stays f32
        ops["attention_masked"] = _autocast_bf16(masked_fwd, 4)
        ops["attention_masked_bwd"] = _autocast_bf16(masked_bwd, 7, keep=(5,))   # lse: f32
        for op in BF16_BINARY:
            ops[op] = _bf16_follows(ops[op])
        ops["log_softmax"] = _f32_from_bf16(log_softmax)
        ops["embedding_bwd"] = _f32_from_bf16(embedding_bwd)
    return ops
