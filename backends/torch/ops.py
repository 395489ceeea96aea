"""The torch backend's op table: one PyTorch kernel per h2ir op (h2ir/opset.py).

Kernels are called as `kernel(*inputs, **attrs)` with the op's attributes (defaults filled in);
inputs are tensors on the backend's device or Python scalars (a binary op may get a scalar on
either side). Every kernel is device-agnostic; only creation ops need the device, and only the
matrix ops (mm, bmm, attention, attention_bwd) look at the dtype policy.

Attention on CPU calls the same ATen kernels AOTAutograd records when the model is traced
(`_scaled_dot_product_flash_attention_for_cpu` and its backward), so an h2ir program reproduces
eager PyTorch. Elsewhere (CUDA) it runs in math form — scores, mask, logsumexp, softmax — which
is correct on any device by construction and is exercised on CPU by the tests
(`attention="math"`). COMM and MOE ops are not kernels: the runtime and DiComm execute them.
"""
from __future__ import annotations

import math
import operator

import torch
import torch.nn.functional as F

from h2ir.types import DTYPE_TABLE

aten = torch.ops.aten

# h2ir dtype name <-> torch dtype (from the one dtype table)
TORCH_DTYPE = {n: getattr(torch, d.torch) for n, d in DTYPE_TABLE.items()}
H2_DTYPE = {v: k for k, v in TORCH_DTYPE.items()}

# nll_loss reduction names -> ATen's enum (at::Reduction)
REDUCTION = {"none": 0, "mean": 1, "sum": 2}

DTYPE_POLICIES = ("fp32", "bf16")


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
    "neg": torch.neg, "exp": torch.exp, "log": torch.log, "sqrt": torch.sqrt, "rsqrt": torch.rsqrt,
    "tanh": torch.tanh, "sigmoid": torch.sigmoid, "relu": torch.relu, "silu": F.silu,
    "gelu": F.gelu, "abs": torch.abs, "reciprocal": torch.reciprocal, "sin": torch.sin,
    "cos": torch.cos, "logical_not": torch.logical_not, "copy": torch.clone,
}

# Python operators accept a scalar on either side and promote it as torch promotes scalars.
BINARY = {"add": operator.add, "sub": operator.sub, "mul": operator.mul, "div": operator.truediv,
          "eq": operator.eq, "ne": operator.ne, "lt": operator.lt, "le": operator.le,
          "gt": operator.gt, "ge": operator.ge}


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


def one_hot(ids, num_classes):
    return F.one_hot(ids, num_classes)


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


def embedding_bwd(grad, ids, num_weights):
    # index_add_ is several times faster than embedding_dense_backward on CPU; on CUDA the
    # dense backward kernel is the tuned one.
    if grad.device.type != "cpu":
        return aten.embedding_dense_backward(grad, ids, num_weights, -1, False)
    d = grad.shape[-1]
    return grad.new_zeros(num_weights, d).index_add_(0, ids.reshape(-1), grad.reshape(-1, d))


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


def attention_math(q, k, v, causal=False, scale=None):
    """softmax(q k^T * scale) v and its logsumexp (f32 [b,h,s]), in the accumulate dtype."""
    acc = _acc_dtype(q.dtype)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = torch.matmul(q.to(acc), k.to(acc).transpose(-2, -1)) * scale
    if causal:
        scores = scores.masked_fill(~_causal_mask(q.shape[-2], k.shape[-2], q.device), -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.exp(scores - lse.unsqueeze(-1))
    out = torch.matmul(p, v.to(acc)).to(q.dtype)
    return out, lse.to(torch.float32)


def attention_bwd_math(grad, q, k, v, out, lse, causal=False, scale=None):
    """FlashAttention-2's backward (Dao 2023, Alg. 2): P from the saved logsumexp,
    dS = P * (dP - rowsum(dO * O))."""
    acc = _acc_dtype(q.dtype)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    q_, k_, v_, g_, o_ = (t.to(acc) for t in (q, k, v, grad, out))
    scores = torch.matmul(q_, k_.transpose(-2, -1)) * scale
    if causal:
        scores = scores.masked_fill(~_causal_mask(q.shape[-2], k.shape[-2], q.device), -math.inf)
    p = torch.exp(scores - lse.to(acc).unsqueeze(-1))
    dv = torch.matmul(p.transpose(-2, -1), g_)
    dp = torch.matmul(g_, v_.transpose(-2, -1))
    ds = p * (dp - (g_ * o_).sum(-1, keepdim=True))
    dq = torch.matmul(ds, k_) * scale
    dk = torch.matmul(ds.transpose(-2, -1), q_) * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def attention_flash_cpu(q, k, v, causal=False, scale=None):
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out, lse.to(torch.float32)     # the op set's logsumexp is f32 (f64 runs included)


def attention_bwd_flash_cpu(grad, q, k, v, out, lse, causal=False, scale=None):
    lse = lse.to(_acc_dtype(q.dtype))
    return tuple(aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad, q, k, v, out, lse, 0.0, causal, scale=scale))


# ---- the table -----------------------------------------------------------------------------------

def _autocast_bf16(fn, n_tensor_inputs: int):
    """bf16 dtype policy: f32 matrix-op inputs run in bf16, f32 results come back (as autocast)."""
    def kernel(*args, **attrs):
        if args[0].dtype != torch.float32:
            return fn(*args, **attrs)
        cast_in = [a.to(torch.bfloat16) if i < n_tensor_inputs else a for i, a in enumerate(args)]
        res = fn(*cast_in, **attrs)
        if isinstance(res, tuple):
            return tuple(r.to(torch.float32) if r.is_floating_point() else r for r in res)
        return res.to(torch.float32)
    kernel.__name__ = f"bf16_{fn.__name__}"
    return kernel


def kernel_table(device: torch.device, dtype_policy: str = "fp32", attention: str = "auto") -> dict:
    """h2ir op name -> kernel for tensors on `device`.

    attention: 'flash' (ATen's CPU flash kernels), 'math' (any device) or 'auto' (flash on CPU).
    """
    if dtype_policy not in DTYPE_POLICIES:
        raise ValueError(f"unknown dtype policy {dtype_policy!r} (expected one of "
                         f"{', '.join(DTYPE_POLICIES)})")
    if attention == "auto":
        attention = "flash" if device.type == "cpu" else "math"
    attn_fwd, attn_bwd = {"flash": (attention_flash_cpu, attention_bwd_flash_cpu),
                          "math": (attention_math, attention_bwd_math)}[attention]

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
        "cast": cast, "pow": pow_, "where": where,
        "sum": _reduction(torch.sum), "mean": _reduction(torch.mean),
        "amax": _reduction(torch.amax), "amin": _reduction(torch.amin),
        "reshape": reshape, "permute": permute, "transpose": transpose, "expand": expand,
        "slice": slice_, "select": select, "cat": cat, "split": split,
        "mm": torch.mm, "bmm": torch.bmm, "attention": attn_fwd, "attention_bwd": attn_bwd,
        "softmax": softmax, "log_softmax": log_softmax, "tril": tril, "topk": topk,
        "one_hot": one_hot, "embedding": embedding, "nll_loss": nll_loss,
        "full": full, "arange": arange,
        "silu_bwd": silu_bwd, "softmax_bwd": softmax_bwd, "log_softmax_bwd": log_softmax_bwd,
        "embedding_bwd": embedding_bwd, "nll_loss_bwd": nll_loss_bwd, "slice_bwd": slice_bwd,
    })
    if dtype_policy == "bf16":
        ops["mm"] = _autocast_bf16(torch.mm, 2)
        ops["bmm"] = _autocast_bf16(torch.bmm, 2)
        ops["attention"] = _autocast_bf16(attn_fwd, 3)
        ops["attention_bwd"] = _autocast_bf16(attn_bwd, 5)    # grad, q, k, v, out; lse stays f32
    return ops
