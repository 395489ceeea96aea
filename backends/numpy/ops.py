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

from h2ir.opset import DROPOUT_RNG, dropout_threshold
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


_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_GELU_KAPPA = 0.044715


def _gelu_tanh_inner(x64):
    return np.tanh(_SQRT_2_OVER_PI * (x64 + _GELU_KAPPA * x64 * x64 * x64))


def gelu(x, approximate="none"):
    """x * Phi(x), Phi evaluated in f64: by erf, or by the tanh approximation
    0.5 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) (Hendrycks & Gimpel 2016, Sec. 2)."""
    x64 = x.astype(np.float64)
    if approximate == "tanh":
        phi = 0.5 * (1.0 + _gelu_tanh_inner(x64))
    else:
        phi = 0.5 * (1.0 + erf(x64 * (1.0 / math.sqrt(2.0))))
    return (x64 * phi).astype(x.dtype, copy=False)


def gelu_bwd(grad, x, approximate="none"):
    """grad * d gelu/dx in f64: Phi(x) + x phi(x) (erf form), or the derivative of the tanh form."""
    x64 = x.astype(np.float64)
    if approximate == "tanh":
        t = _gelu_tanh_inner(x64)
        d = 0.5 * (1.0 + t) + 0.5 * x64 * (1.0 - t * t) * _SQRT_2_OVER_PI * (
            1.0 + 3.0 * _GELU_KAPPA * x64 * x64)
    else:
        d = 0.5 * (1.0 + erf(x64 * (1.0 / math.sqrt(2.0)))) + x64 * np.exp(-0.5 * x64 * x64) / \
            math.sqrt(2.0 * math.pi)
    return (grad.astype(np.float64) * d).astype(grad.dtype, copy=False)


def rsqrt(x):
    return np.reciprocal(np.sqrt(x))


def relu(x):
    return np.maximum(x, x.dtype.type(0))


def reciprocal(x):
    return np.reciprocal(x) if np.issubdtype(x.dtype, np.floating) else 1.0 / x


def erf_(x):
    """erf in x's dtype, evaluated in f64 (`erf`)."""
    return erf(x).astype(x.dtype, copy=False)


UNARY = {
    "erf": erf_, "atan": np.arctan, "sign": np.sign,
    "neg": np.negative, "exp": np.exp, "log": np.log, "sqrt": np.sqrt, "rsqrt": rsqrt,
    "tanh": np.tanh, "sigmoid": sigmoid, "relu": relu, "silu": silu,
    "abs": np.abs, "reciprocal": reciprocal, "sin": np.sin, "cos": np.cos,
    "logical_not": np.logical_not, "bitwise_not": np.invert, "copy": np.copy,
    "log1p": np.log1p, "expm1": np.expm1,
}

# NumPy >= 2 treats Python scalars as weak (NEP 50): f32 array + 1e-5 stays f32, as in torch.
BINARY = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.true_divide,
    "maximum": np.maximum, "minimum": np.minimum,
    "eq": np.equal, "ne": np.not_equal, "lt": np.less, "le": np.less_equal,
    "gt": np.greater, "ge": np.greater_equal,
    "logical_and": np.logical_and, "logical_or": np.logical_or, "logical_xor": np.logical_xor,
    "power": np.power, "floor_divide": np.floor_divide, "bitwise_and": np.bitwise_and,
    "remainder": np.remainder, "fmod": np.fmod,
    "bitwise_or": np.bitwise_or, "bitwise_xor": np.bitwise_xor,
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


def cumsum(x, dim, dtype=None):
    """Prefix sums; floats accumulate in f64 (as torch's CPU kernel), ints and bool in i64."""
    out = NP_DTYPE[dtype] if dtype else (x.dtype if np.issubdtype(x.dtype, np.floating)
                                         else np.dtype(np.int64))
    acc = np.float64 if np.issubdtype(out, np.floating) else np.int64
    return np.cumsum(x, axis=dim, dtype=acc).astype(out, copy=False)


def amax(x, dims=None, keepdim=False):
    return np.amax(x, axis=_dims(dims, x.ndim), keepdims=keepdim)


def amin(x, dims=None, keepdim=False):
    return np.amin(x, axis=_dims(dims, x.ndim), keepdims=keepdim)


def argmax(x, dim=None, keepdim=False):
    return np.argmax(x, axis=dim, keepdims=keepdim).astype(np.int64)


def flip(x, dims):
    return np.flip(x, axis=tuple(dims))


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


def _repeat_heads(t, h_q):
    """Grouped-query attention: key/value head j serves query heads j*g .. j*g+g-1."""
    g = h_q // t.shape[1]
    return t if g == 1 else np.repeat(t, g, axis=1)


def _sum_heads(dt, h_kv):
    """The gradient of _repeat_heads: sum each group of query heads back into its kv head."""
    b, h, *rest = dt.shape
    return dt if h == h_kv else dt.reshape(b, h_kv, h // h_kv, *rest).sum(axis=2)


def _scores(q, k, causal, scale, mask=None):
    """Scaled scores q k^T * scale with the causal mask applied as an additive 0/-inf table
    (a broadcast add is ~6x faster than boolean-index assignment on [b,h,s,s]), and the mask
    tensor (bool: true attends; else additive)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = np.matmul(q * q.dtype.type(scale), np.swapaxes(_repeat_heads(k, q.shape[1]), -1, -2))
    if causal:
        # top-left aligned, as torch's is_causal: query i sees keys 0..i
        s_q, s_k = q.shape[-2], k.shape[-2]
        s += np.where(np.triu(np.ones((s_q, s_k), dtype=bool), k=1), -np.inf, 0).astype(q.dtype)
    if mask is not None:
        s += np.where(mask, 0, -np.inf).astype(q.dtype) if mask.dtype == np.bool_ else mask
    return s, scale


def attention(q, k, v, causal=False, scale=None):
    """softmax(q k^T * scale [+ causal mask]) v over [b,h,s,d] and the logsumexp of the scaled,
    masked scores (f32 [b,h,s]) — what the backward recomputes P from."""
    return attention_masked(q, k, v, None, causal, scale)


def attention_masked(q, k, v, mask, causal=False, scale=None):
    """attention with a mask tensor (bool or additive) broadcast over [b,h,s_q,s_k]."""
    p, _ = _scores(q, k, causal, scale, mask)
    m = p.max(axis=-1, keepdims=True)
    p -= m                                   # in place: the [b,h,s,s] buffer is the big one
    np.exp(p, out=p)
    denom = p.sum(axis=-1, keepdims=True)
    p /= denom
    out = np.matmul(p, _repeat_heads(v, q.shape[1]))
    lse = (m + np.log(denom))[..., 0]
    return out, lse.astype(np.float32)


def attention_bwd(grad, q, k, v, out, lse, causal=False, scale=None):
    """(dq, dk, dv) with P recomputed from the logsumexp; dS = P * (dP - rowsum(dO * O))
    (FlashAttention-2, Dao 2023, Alg. 2)."""
    return attention_masked_bwd(grad, q, k, v, out, lse, None, causal, scale)


def attention_masked_bwd(grad, q, k, v, out, lse, mask, causal=False, scale=None):
    p, scale = _scores(q, k, causal, scale, mask)
    p -= lse.astype(q.dtype)[..., None]
    np.exp(p, out=p)
    h = q.shape[1]
    dv = np.matmul(np.swapaxes(p, -1, -2), grad)
    dp = np.matmul(grad, np.swapaxes(_repeat_heads(v, h), -1, -2))
    delta = np.sum(grad * out, axis=-1, keepdims=True, dtype=_acc(q.dtype)).astype(q.dtype)
    ds = p * (dp - delta)
    ds *= q.dtype.type(scale)
    dq = np.matmul(ds, _repeat_heads(k, h))
    dk = np.matmul(np.swapaxes(ds, -1, -2), q)
    return dq, _sum_heads(dk, k.shape[1]), _sum_heads(dv, v.shape[1])


def grouped_mm(x, w, offsets):
    """Rows offsets[e-1]:offsets[e] of x times w[e]; rows past the last offset stay 0."""
    out = np.zeros((x.shape[0], w.shape[2]), dtype=x.dtype)
    start = 0
    for e, end in enumerate(np.asarray(offsets).tolist()):
        if end > start:
            np.matmul(x[start:end], w[e], out=out[start:end])
        start = max(start, end)
    return out


def grouped_mm_bwd(grad, x, w, offsets):
    gx = np.zeros_like(x)
    gw = np.zeros_like(w)
    start = 0
    for e, end in enumerate(np.asarray(offsets).tolist()):
        if end > start:
            gx[start:end] = np.matmul(grad[start:end], w[e].T)
            gw[e] = np.matmul(x[start:end].T, grad[start:end])
        start = max(start, end)
    return gx, gw


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


def layer_norm(x, weight, bias, normalized_ndim=1, eps=1e-5):
    """(out, mean, rstd) over the last normalized_ndim dims, computed in f64 for f32 inputs."""
    axes = tuple(range(x.ndim - normalized_ndim, x.ndim))
    x64 = x.astype(np.float64)
    mu = x64.mean(axis=axes, keepdims=True)
    xc = x64 - mu
    rstd = 1.0 / np.sqrt((xc * xc).mean(axis=axes, keepdims=True) + eps)
    out = xc * rstd
    if weight is not None:
        out = out * weight
    if bias is not None:
        out = out + bias
    return out.astype(x.dtype), mu.astype(x.dtype), rstd.astype(x.dtype)


def layer_norm_bwd(grad, x, mean, rstd, weight, bias, normalized_ndim=1):
    """dx = rstd (g - mean(g) - xhat mean(g xhat)) with g = grad * weight; dweight =
    sum(grad xhat), dbias = sum(grad) over the leading dims (f64 inside)."""
    axes = tuple(range(x.ndim - normalized_ndim, x.ndim))
    lead = tuple(range(x.ndim - normalized_ndim))
    g64, r64 = grad.astype(np.float64), rstd.astype(np.float64)
    xhat = (x.astype(np.float64) - mean.astype(np.float64)) * r64
    g = g64 * weight if weight is not None else g64
    dx = r64 * (g - g.mean(axis=axes, keepdims=True)
                - xhat * (g * xhat).mean(axis=axes, keepdims=True))
    dw = (g64 * xhat).sum(axis=lead)
    db = g64.sum(axis=lead)
    return dx.astype(x.dtype), dw.astype(x.dtype), db.astype(x.dtype)


def _mix64(z):
    """SplitMix64's finaliser on uint64 arrays (wrapping arithmetic; h2ir.opset.DROPOUT_RNG)."""
    s1, s2, s3 = DROPOUT_RNG["shifts"]
    z = (z ^ (z >> np.uint64(s1))) * np.uint64(DROPOUT_RNG["m1"])
    z = (z ^ (z >> np.uint64(s2))) * np.uint64(DROPOUT_RNG["m2"])
    return z ^ (z >> np.uint64(s3))


def _dropout_keep(seed: int, counter: int, shape: tuple, p: float) -> np.ndarray:
    gamma = np.uint64(DROPOUT_RNG["gamma"])
    s = np.array([seed], dtype=np.int64).view(np.uint64)
    c = np.array([counter], dtype=np.int64).view(np.uint64)
    key = _mix64(s ^ _mix64(c + gamma))
    i = np.arange(1, math.prod(shape) + 1, dtype=np.uint64)
    bits = _mix64(key + i * gamma) >> np.uint64(64 - DROPOUT_RNG["bits"])
    return (bits >= np.uint64(dropout_threshold(p))).reshape(shape)


def dropout(x, seed, p):
    """(x * keep / (1 - p), keep) with keep from the counter-based hash of (seed, counter, i)."""
    seed = np.asarray(seed)
    keep = _dropout_keep(int(seed[0]), int(seed[1]), x.shape, p)
    scale = x.dtype.type(1.0 / (1.0 - p))
    return np.where(keep, x * scale, x.dtype.type(0)), keep


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


def sort(x, dim=-1, descending=False):
    """Stable sort along dim; descending keeps equal keys in their order too (as torch's
    stable=True): an ascending stable sort of the reversed axis, read backwards."""
    if not descending:
        idx = np.argsort(x, axis=dim, kind="stable")
    else:
        n = x.shape[dim]
        rev = np.flip(x, axis=dim)
        idx = (n - 1) - np.flip(np.argsort(rev, axis=dim, kind="stable"), axis=dim)
    return np.take_along_axis(x, idx, axis=dim), idx.astype(np.int64)


def histc(x, bins, min, max):
    """torch.histc: bin = floor((x - min) * bins / (max - min)), x = max in the last bin, values
    outside [min, max] dropped; computed in x's float dtype (f64 for integers), counts in x's dtype."""
    ft = x.dtype if np.issubdtype(x.dtype, np.floating) else np.dtype(np.float64)
    xf = x.reshape(-1).astype(ft)
    lo, hi = ft.type(min), ft.type(max)
    xf = xf[(xf >= lo) & (xf <= hi)]
    pos = ((xf - lo) * ft.type(bins) / (hi - lo)).astype(np.int64)
    pos = np.minimum(pos, bins - 1)
    return np.bincount(pos, minlength=bins).astype(x.dtype)


def one_hot(ids, num_classes):
    return (ids[..., None] == np.arange(num_classes)).astype(np.int64)


# ---- index & loss --------------------------------------------------------------------------------

def embedding(weight, ids):
    return np.take(weight, ids, axis=0)


def _index_tuple(rank: int, dims, indices) -> tuple:
    key = [slice(None)] * (max(dims) + 1)
    for d, i in zip(dims, indices):
        key[d] = i
    return tuple(key)


def index(x, *indices, dims):
    return x[_index_tuple(x.ndim, dims, indices)]


def _sum_rows_into(out, ids, rows) -> None:
    """out[ids[i]] += rows[i] with repeated ids summed: sort the ids once, add each run of equal
    ids with one np.add.reduceat (np.add.at is an element-wise loop)."""
    if ids.size == 0:
        return
    order = np.argsort(ids, kind="stable")
    sorted_ids = ids[order]
    starts = np.flatnonzero(np.r_[True, sorted_ids[1:] != sorted_ids[:-1]])
    out[sorted_ids[starts]] += np.add.reduceat(rows[order], starts, axis=0)


def index_put(x, values, *indices, dims, accumulate=False):
    out = x.copy()
    key = _index_tuple(x.ndim, dims, indices)
    values = np.asarray(values, dtype=x.dtype)
    if accumulate and list(dims) == [0] and x.ndim >= 1:
        # the gradient of x[ids] (MoE routing, gathers): whole rows
        ids = np.asarray(indices[0]).reshape(-1) % max(x.shape[0], 1)
        target = indices[0].shape + x.shape[1:]
        rows = np.broadcast_to(values, target).reshape((ids.size,) + x.shape[1:])
        _sum_rows_into(out, ids, rows)
    elif accumulate:
        np.add.at(out, key, values)
    else:
        out[key] = values
    return out


def _along(index, dim: int) -> tuple:
    """The full index tuple of torch's gather/scatter: index at `dim`, the position elsewhere."""
    grid = list(np.ix_(*[np.arange(n) for n in index.shape]))
    grid[dim] = index
    return tuple(grid)


def _src_part(src, index):
    """src[..i..] for i in index's shape (src may be larger, or a scalar)."""
    if not isinstance(src, np.ndarray) or src.ndim == 0:
        return src
    return src[tuple(slice(0, n) for n in index.shape)]


def gather(x, index, dim):
    return x[_along(index, dim)]


def scatter(x, index, src, dim):
    out = x.copy()
    out[_along(index, dim)] = _src_part(src, index)
    return out


def scatter_add(x, index, src, dim):
    out = x.copy()
    np.add.at(out, _along(index, dim), _src_part(src, index))
    return out


def slice_bwd(grad, shape, dim, start=None, end=None, step=1):
    out = np.zeros(shape, dtype=grad.dtype)
    idx = [slice(None)] * len(shape)
    idx[dim] = slice(start, end, step)
    out[tuple(idx)] = grad
    return out


def embedding_bwd(grad, ids, num_weights, padding_idx=-1):
    """Scatter-add of grad rows into a [num_weights, d] table: sort the ids once, then sum each
    run of equal ids with one np.add.reduceat (no per-element Python loop). Row padding_idx
    (when >= 0) gets no gradient."""
    d = grad.shape[-1]
    out = np.zeros((num_weights, d), dtype=grad.dtype)
    _sum_rows_into(out, ids.reshape(-1), grad.reshape(-1, d))
    if padding_idx is not None and padding_idx >= 0:
        out[padding_idx] = 0
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


# ---- sequence mixers: depthwise convolution, selective scan ---------------------------------------

def _conv_pads(weight, pad_left, pad_right) -> tuple[int, int]:
    k = weight.shape[1]
    return (k - 1 if pad_left is None else pad_left), pad_right


def depthwise_conv1d(x, weight, bias, pad_left=None, pad_right=0):
    """One shifted multiply-add per tap over the zero-padded input."""
    left, right = _conv_pads(weight, pad_left, pad_right)
    k = weight.shape[1]
    xp = np.pad(x, ((0, 0), (0, 0), (left, right)))
    m = xp.shape[2] - k + 1
    out = np.zeros(x.shape[:2] + (m,), dtype=x.dtype)
    for j in range(k):
        out += weight[None, :, j, None] * xp[:, :, j:j + m]
    if bias is not None:
        out += bias[None, :, None]
    return out


def depthwise_conv1d_bwd(grad, x, weight, pad_left=None, pad_right=0):
    """grad_x: the gradient spread back through each tap, the padding cut off; grad_weight and
    grad_bias: sums over batch and time, accumulated in f64."""
    left, right = _conv_pads(weight, pad_left, pad_right)
    k, l = weight.shape[1], x.shape[2]
    m = grad.shape[2]
    xp = np.pad(x, ((0, 0), (0, 0), (left, right)))
    gxp = np.zeros(xp.shape, dtype=x.dtype)
    for j in range(k):
        gxp[:, :, j:j + m] += weight[None, :, j, None] * grad
    acc = _acc(grad.dtype)
    gw = np.stack([np.einsum("bct,bct->c", grad.astype(acc), xp[:, :, j:j + m].astype(acc))
                   for j in range(k)], axis=1)
    gb = grad.sum(axis=(0, 2), dtype=acc)
    return gxp[:, :, left:left + l], gw.astype(weight.dtype), gb.astype(weight.dtype)


# The scan's operands are time-major, channels split into their groups of B and C (d = g r):
# u, delta, grad [l,b,g,r,1]; A [g,r,n]; B, C [l,b,g,1,n]; every step of the recurrence is then
# one contiguous slice.

def _steps(t, groups: int):
    """[b, d, l] -> [l, b, g, r, 1]."""
    b, d, l = t.shape
    return np.ascontiguousarray(np.transpose(t, (2, 0, 1))).reshape(l, b, groups, d // groups, 1)


def _from_steps(t, shape):
    """[l, b, g, r] (or with a trailing 1) -> [b, d, l]."""
    return np.ascontiguousarray(np.transpose(t.reshape(t.shape[0], t.shape[1], -1),
                                             (1, 2, 0))).reshape(shape)


def _scan_operands(u, delta, A, B, C):
    g, n = B.shape[1], B.shape[2]

    def states(t):
        return np.ascontiguousarray(np.transpose(t, (3, 0, 1, 2)))[:, :, :, None, :]
    return _steps(u, g), _steps(delta, g), A.reshape(g, -1, n), states(B), states(C)


def _linear_scan(a_log, x, reverse: bool = False):
    """All states of h[t] = exp(a_log[t]) h[t-1] + x[t] (from h = 0) along the leading axis,
    in the sequential form: one multiply-add over every state per step (NumPy has nothing
    faster: the chunked form's small matmuls cost it more than they save). reverse: from the
    last step back, h[t] = exp(a_log[t]) h[t+1] + x[t]."""
    a = np.exp(a_log)
    H = np.empty_like(x)
    h = np.zeros_like(x[0])
    for t in (range(x.shape[0] - 1, -1, -1) if reverse else range(x.shape[0])):
        np.multiply(a[t], h, out=H[t])
        H[t] += x[t]
        h = H[t]
    return H


def selective_scan(u, delta, A, B, C):
    """y = C . h over every state of the recurrence (`_linear_scan`), C's sum in f64."""
    u5, d5, A5, B5, C5 = _scan_operands(u, delta, A, B, C)
    H = _linear_scan(d5 * A5, (d5 * u5) * B5)
    return _from_steps(np.sum(H * C5, axis=-1, dtype=np.float64), u.shape).astype(u.dtype)


def selective_scan_bwd(grad, u, delta, A, B, C):
    """The states by the scan forward, their gradients by the scan backward in time
    (dh[t] = C[t] g[t] + exp(a_log[t+1]) dh[t+1]); then every input's gradient from h, h[t-1]
    and dh, the sums over states, channels, batch and time in f64."""
    u5, d5, A5, B5, C5 = _scan_operands(u, delta, A, B, C)
    g5 = _steps(grad, B.shape[1])
    a_log = d5 * A5
    du5 = d5 * u5
    H = _linear_scan(a_log, du5 * B5)
    ahead = np.concatenate([a_log[1:], np.zeros_like(a_log[:1])])     # none after the end
    dH = _linear_scan(ahead, C5 * g5, reverse=True)
    h_prev = np.concatenate([np.zeros_like(H[:1]), H[:-1]])
    da_log = dH * np.exp(a_log) * h_prev
    f64 = np.float64
    dxB = np.sum(dH * B5, axis=-1, keepdims=True, dtype=f64)          # d loss / d (delta u)
    du = dxB * d5
    ddelta = np.sum(da_log * A5, axis=-1, keepdims=True, dtype=f64) + dxB * u5
    dA = np.sum(da_log * d5, axis=(0, 1), dtype=f64)

    def back(t):                                 # [l, b, g, 1, n] -> [b, g, n, l]
        return np.transpose(t[:, :, :, 0], (1, 2, 3, 0))
    dB = back(np.sum(dH * du5, axis=3, keepdims=True, dtype=f64))
    dC = back(np.sum(H * g5, axis=3, keepdims=True, dtype=f64))
    dt = u.dtype
    return (_from_steps(du, u.shape).astype(dt), _from_steps(ddelta, u.shape).astype(dt),
            dA.reshape(A.shape).astype(dt), np.ascontiguousarray(dB, dtype=dt),
            np.ascontiguousarray(dC, dtype=dt))


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
        "cast": cast, "pow": pow_, "where": where, "gelu": gelu,
        "sum": sum_, "mean": mean, "amax": amax, "amin": amin, "cumsum": cumsum,
        "argmax": argmax, "flip": flip,
        "reshape": reshape, "permute": permute, "transpose": transpose, "expand": expand,
        "slice": slice_, "select": select, "cat": cat, "split": split,
        "mm": mm, "bmm": bmm, "attention": attention, "attention_bwd": attention_bwd,
        "attention_masked": attention_masked, "attention_masked_bwd": attention_masked_bwd,
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
        "selective_scan": selective_scan, "selective_scan_bwd": selective_scan_bwd,
    })
    return {name: _as_array(fn) for name, fn in ops.items()}
