"""The numpy backend's op table: every h2ir op except COMM and MOE, in NumPy alone.

This is a second, independent vendor library (H2, arXiv 2505.17548, Sec. 3.1: one op set, many
op libraries): no torch anywhere, so agreement with the torch backend means something.

Numerics
- f32 ops compute in f32 and f64 ops in f64, except that sums and means accumulate f32 in f64
  (NumPy's pairwise summation does not apply along strided axes) and gelu's erf is evaluated in
  f64 (NumPy has no erf; `erf` below is accurate to ~1e-14).
- NumPy ufuncs return NumPy scalars for 0-d results; `_as_array` keeps every kernel's result an
  ndarray so the runtime's host transfer and shapes stay uniform.
"""
from __future__ import annotations

import math
from functools import wraps

import numpy as np

from h2ir.types import host_dtype

# The h2ir dtypes the numpy backend computes in: none of bf16/f16 (see runtime.py).
NP_DTYPES = ("f64", "f32", "i64", "i32", "i8", "u8", "bool")
# h2ir dtype name -> NumPy dtype (from the one dtype table)
NP_DTYPE = {n: host_dtype(n) for n in NP_DTYPES}


def _dims(dims, rank: int) -> tuple[int, ...]:
    return tuple(range(rank)) if dims is None else tuple(d % rank for d in dims)


def _acc(dtype) -> np.dtype:
    """Accumulation dtype of a reduction: f64 for floats (f32 sums stay accurate), else as is."""
    return np.float64 if np.issubdtype(dtype, np.floating) else None


def _as_array(fn):
    @wraps(fn)
    def kernel(*args, **attrs):
        out = fn(*args, **attrs)
        if isinstance(out, tuple):
            return tuple(np.asarray(o) for o in out)
        return np.asarray(out)
    return kernel


def _float_dtype(x) -> np.dtype:
    return x.dtype if np.issubdtype(x.dtype, np.floating) else np.dtype(np.float32)


# ---- special functions ---------------------------------------------------------------------------

_TWO_OVER_SQRT_PI = 2.0 / math.sqrt(math.pi)


def erf(x: np.ndarray) -> np.ndarray:
    """erf in f64: Maclaurin series for |x| < 2.5, the erfc continued fraction beyond
    (Abramowitz & Stegun 7.1.5 and 7.1.14); max abs error ~1e-14 against math.erf."""
    x = np.asarray(x, dtype=np.float64)
    ax = np.abs(x)
    small = ax < 2.5
    out = np.empty_like(x)
    xs = x[small]
    x2 = xs * xs
    term = xs.copy()
    acc = xs.copy()
    for n in range(1, 60):       # terms fall below 1e-17 of the sum by n = 60 for |x| < 2.5
        term *= -x2 / n
        acc += term / (2 * n + 1)
    out[small] = acc * _TWO_OVER_SQRT_PI
    xl = ax[~small]
    f = np.zeros_like(xl)
    for n in range(80, 0, -1):   # continued fraction, evaluated bottom-up
        f = (n / 2) / (xl + f)
    erfc = np.exp(-xl * xl) / math.sqrt(math.pi) / (xl + f)
    out[~small] = np.sign(x[~small]) * (1.0 - erfc)
    return out


def _one_plus_exp_neg(x):
    # e^-x overflows to inf for x << 0, and 1/inf = 0 is then the right limit: no warning wanted
    with np.errstate(over="ignore"):
        e = np.exp(-x)
    e += 1
    return e


def sigmoid(x):
    e = _one_plus_exp_neg(x)
    return np.reciprocal(e, out=e)


def silu(x):
    e = _one_plus_exp_neg(x)
    return np.divide(x, e, out=e)


def gelu(x):
    phi = 0.5 * (1.0 + erf(x * (1.0 / math.sqrt(2.0))))
    return (x * phi).astype(x.dtype, copy=False)


def rsqrt(x):
    return np.reciprocal(np.sqrt(x))


def relu(x):
    return np.maximum(x, x.dtype.type(0))


def reciprocal(x):
    return np.reciprocal(x) if np.issubdtype(x.dtype, np.floating) else 1.0 / x


UNARY = {
    "neg": np.negative, "exp": np.exp, "log": np.log, "sqrt": np.sqrt, "rsqrt": rsqrt,
    "tanh": np.tanh, "sigmoid": sigmoid, "relu": relu, "silu": silu, "gelu": gelu,
    "abs": np.abs, "reciprocal": reciprocal, "sin": np.sin, "cos": np.cos,
    "logical_not": np.logical_not, "copy": np.copy,
}

# NumPy >= 2 treats Python scalars as weak (NEP 50): f32 array + 1e-5 stays f32, as in torch.
BINARY = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.true_divide,
    "maximum": np.maximum, "minimum": np.minimum,
    "eq": np.equal, "ne": np.not_equal, "lt": np.less, "le": np.less_equal,
    "gt": np.greater, "ge": np.greater_equal,
    "logical_and": np.logical_and, "logical_or": np.logical_or,
}


def where(cond, a, b):
    if not isinstance(a, np.ndarray) and not isinstance(b, np.ndarray):
        return np.where(cond, a, b).astype(np.float32)     # two scalars: the op set says f32
    return np.where(cond, a, b)


def cast(x, dtype):
    return x.astype(NP_DTYPE[dtype])


def pow_(x, exponent):
    return np.power(x, exponent)


# ---- reductions ----------------------------------------------------------------------------------

def sum_(x, dims=None, keepdim=False):
    return np.sum(x, axis=_dims(dims, x.ndim), keepdims=keepdim, dtype=_acc(x.dtype)).astype(
        x.dtype, copy=False)


def mean(x, dims=None, keepdim=False):
    return np.mean(x, axis=_dims(dims, x.ndim), keepdims=keepdim, dtype=_acc(x.dtype)).astype(
        x.dtype, copy=False)


def amax(x, dims=None, keepdim=False):
    return np.amax(x, axis=_dims(dims, x.ndim), keepdims=keepdim)


def amin(x, dims=None, keepdim=False):
    return np.amin(x, axis=_dims(dims, x.ndim), keepdims=keepdim)


# ---- movement (views where NumPy can) ------------------------------------------------------------

def reshape(x, shape):
    return np.reshape(x, tuple(shape))


def permute(x, dims):
    return np.transpose(x, tuple(dims))


def transpose(x, dim0, dim1):
    return np.swapaxes(x, dim0, dim1)


def expand(x, shape):
    off = len(shape) - x.ndim
    shape = tuple(x.shape[i - off] if s == -1 else s for i, s in enumerate(shape))
    return np.broadcast_to(x, shape)


def slice_(x, dim, start=None, end=None, step=1):
    return x[(slice(None),) * (dim % x.ndim) + (slice(start, end, step),)]


def select(x, dim, index):
    return x[(slice(None),) * (dim % x.ndim) + (index,)]


def cat(*xs, dim=0):
    return np.concatenate(xs, axis=dim)


def split(x, dim, sizes):
    return tuple(np.split(x, np.cumsum(sizes)[:-1], axis=dim))


# ---- matmul & attention --------------------------------------------------------------------------

def mm(a, b):
    return np.matmul(a, b)


def bmm(a, b):
    return np.matmul(a, b)


def _scores(q, k, causal, scale):
    """Scaled scores q k^T * scale with the causal mask applied as an additive 0/-inf table
    (a broadcast add is ~6x faster than boolean-index assignment on [b,h,s,s])."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = np.matmul(q * q.dtype.type(scale), np.swapaxes(k, -1, -2))
    if causal:
        # top-left aligned, as torch's is_causal: query i sees keys 0..i
        s_q, s_k = q.shape[-2], k.shape[-2]
        s += np.where(np.triu(np.ones((s_q, s_k), dtype=bool), k=1), -np.inf, 0).astype(q.dtype)
    return s, scale


def attention(q, k, v, causal=False, scale=None):
    """softmax(q k^T * scale [+ causal mask]) v over [b,h,s,d] and the logsumexp of the scaled,
    masked scores (f32 [b,h,s]) — what the backward recomputes P from."""
    p, _ = _scores(q, k, causal, scale)
    m = p.max(axis=-1, keepdims=True)
    p -= m                                   # in place: the [b,h,s,s] buffer is the big one
    np.exp(p, out=p)
    denom = p.sum(axis=-1, keepdims=True)
    p /= denom
    out = np.matmul(p, v)
    lse = (m + np.log(denom))[..., 0]
    return out, lse.astype(np.float32)


def attention_bwd(grad, q, k, v, out, lse, causal=False, scale=None):
    """(dq, dk, dv) with P recomputed from the logsumexp; dS = P * (dP - rowsum(dO * O))
    (FlashAttention-2, Dao 2023, Alg. 2)."""
    p, scale = _scores(q, k, causal, scale)
    p -= lse.astype(q.dtype)[..., None]
    np.exp(p, out=p)
    dv = np.matmul(np.swapaxes(p, -1, -2), grad)
    dp = np.matmul(grad, np.swapaxes(v, -1, -2))
    delta = np.sum(grad * out, axis=-1, keepdims=True, dtype=_acc(q.dtype)).astype(q.dtype)
    ds = p * (dp - delta)
    ds *= q.dtype.type(scale)
    dq = np.matmul(ds, k)
    dk = np.matmul(np.swapaxes(ds, -1, -2), q)
    return dq, dk, dv


# ---- nn ------------------------------------------------------------------------------------------

def softmax(x, dim):
    e = np.exp(x - np.max(x, axis=dim, keepdims=True))
    e /= np.sum(e, axis=dim, keepdims=True, dtype=_acc(x.dtype)).astype(x.dtype)
    return e


def log_softmax(x, dim):
    shifted = x - np.max(x, axis=dim, keepdims=True)
    lse = np.log(np.sum(np.exp(shifted), axis=dim, keepdims=True, dtype=_acc(x.dtype)))
    return shifted - lse.astype(x.dtype)


def softmax_bwd(grad, out, dim):
    dot = np.sum(grad * out, axis=dim, keepdims=True, dtype=_acc(out.dtype)).astype(out.dtype)
    return out * (grad - dot)


def log_softmax_bwd(grad, out, dim):
    total = np.sum(grad, axis=dim, keepdims=True, dtype=_acc(out.dtype)).astype(out.dtype)
    return grad - np.exp(out) * total


def silu_bwd(grad, x):
    s = sigmoid(x)
    return grad * s * (1 + x * (1 - s))


def tril(x, diagonal=0):
    return np.tril(x, diagonal)      # on the last two dims, batched


def topk(x, k, dim=-1):
    xm = np.moveaxis(x, dim, -1)
    if k < xm.shape[-1]:
        part = np.argpartition(xm, xm.shape[-1] - k, axis=-1)[..., -k:]
    else:
        part = np.broadcast_to(np.arange(xm.shape[-1]), xm.shape)
    vals = np.take_along_axis(xm, part, axis=-1)
    order = np.argsort(vals, axis=-1, kind="stable")[..., ::-1]    # largest first
    idx = np.take_along_axis(part, order, axis=-1)
    vals = np.take_along_axis(vals, order, axis=-1)
    return np.moveaxis(vals, -1, dim).copy(), np.moveaxis(idx, -1, dim).astype(np.int64)


def one_hot(ids, num_classes):
    return (ids[..., None] == np.arange(num_classes)).astype(np.int64)


# ---- index & loss --------------------------------------------------------------------------------

def embedding(weight, ids):
    return np.take(weight, ids, axis=0)


def slice_bwd(grad, shape, dim, start=None, end=None, step=1):
    out = np.zeros(shape, dtype=grad.dtype)
    idx = [slice(None)] * len(shape)
    idx[dim] = slice(start, end, step)
    out[tuple(idx)] = grad
    return out


def embedding_bwd(grad, ids, num_weights):
    """Scatter-add of grad rows into a [num_weights, d] table: sort the ids once, then sum each
    run of equal ids with one np.add.reduceat (no per-element Python loop)."""
    d = grad.shape[-1]
    flat = ids.reshape(-1)
    rows = grad.reshape(-1, d)
    out = np.zeros((num_weights, d), dtype=grad.dtype)
    if flat.size == 0:
        return out
    order = np.argsort(flat, kind="stable")
    sorted_ids = flat[order]
    starts = np.flatnonzero(np.r_[True, sorted_ids[1:] != sorted_ids[:-1]])
    out[sorted_ids[starts]] = np.add.reduceat(rows[order], starts, axis=0)
    return out


def _nll_parts(logp, target, ignore_index):
    logp2 = logp.reshape(-1, logp.shape[-1])
    t = target.reshape(-1)
    keep = t != ignore_index
    picked = np.take_along_axis(logp2, np.where(keep, t, 0)[:, None], axis=1)[:, 0]
    return logp2, t, keep, picked


def nll_loss(logp, target, reduction="mean", ignore_index=-100):
    """(loss, total_weight) as ATen's nll_loss_forward: total_weight counts the targets that are
    not ignore_index (0 for reduction='none'); 'mean' divides by it (0/0 -> nan, as torch)."""
    _, _, keep, picked = _nll_parts(logp, target, ignore_index)
    losses = np.where(keep, -picked, logp.dtype.type(0))
    if reduction == "none":
        return losses.reshape(target.shape), np.zeros((), dtype=logp.dtype)
    total_weight = np.asarray(keep.sum(), dtype=logp.dtype)
    loss = np.sum(losses, dtype=_acc(logp.dtype))
    if reduction == "mean":
        with np.errstate(invalid="ignore", divide="ignore"):
            loss = loss / total_weight
    return np.asarray(loss, dtype=logp.dtype), total_weight


def nll_loss_bwd(grad, logp, target, total_weight, reduction="mean", ignore_index=-100):
    logp2, t, keep, _ = _nll_parts(logp, target, ignore_index)
    g = np.asarray(grad, dtype=logp.dtype)
    if reduction == "none":
        per_row = g.reshape(-1)
    elif reduction == "mean":
        with np.errstate(invalid="ignore", divide="ignore"):    # all ignored: no row uses it
            per_row = np.broadcast_to(g / np.asarray(total_weight, dtype=logp.dtype), t.shape)
    else:
        per_row = np.broadcast_to(g, t.shape)
    out = np.zeros_like(logp2)
    rows = np.flatnonzero(keep)
    out[rows, t[rows]] = -per_row[rows]
    return out.reshape(logp.shape)


# ---- creation ------------------------------------------------------------------------------------

def full(shape, value, dtype="f32"):
    return np.full(tuple(shape), value, dtype=NP_DTYPE[dtype])


def arange(start=0, end=None, step=1, dtype="i64"):
    return np.arange(start, end, step, dtype=NP_DTYPE[dtype])


# ---- the table -----------------------------------------------------------------------------------

def kernel_table() -> dict:
    """h2ir op name -> NumPy kernel (all groups but COMM and MOE)."""
    ops = dict(UNARY)
    ops.update(BINARY)
    ops.update({
        "cast": cast, "pow": pow_, "where": where,
        "sum": sum_, "mean": mean, "amax": amax, "amin": amin,
        "reshape": reshape, "permute": permute, "transpose": transpose, "expand": expand,
        "slice": slice_, "select": select, "cat": cat, "split": split,
        "mm": mm, "bmm": bmm, "attention": attention, "attention_bwd": attention_bwd,
        "softmax": softmax, "log_softmax": log_softmax, "tril": tril, "topk": topk,
        "one_hot": one_hot, "embedding": embedding, "nll_loss": nll_loss,
        "full": full, "arange": arange,
        "silu_bwd": silu_bwd, "softmax_bwd": softmax_bwd, "log_softmax_bwd": log_softmax_bwd,
        "embedding_bwd": embedding_bwd, "nll_loss_bwd": nll_loss_bwd, "slice_bwd": slice_bwd,
    })
    return {name: _as_array(fn) for name, fn in ops.items()}
