"""Lowering ATen-level torch.fx graphs to h2ir: the one mapping table from ATen ops to the op set.

Both the frontend (models traced on the meta device) and the compiler (forward/backward graphs
from AOTAutograd) lower through `lower_fx`. Each entry of `ATEN` turns one ATen call into h2ir
nodes through an `Emitter`; an ATen op without an entry is a clear error naming the op, the
module path and the model source line.
"""
from __future__ import annotations

import math
import operator
import zlib
import re
from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx

from h2ir.errors import H2Error
from h2ir.opset import DROPOUT_SEED_INPUT as RNG_INPUT
from h2ir.graph import Graph, Layer, Node, Value, infer_types
from h2ir.types import DTYPE_TABLE, FLOAT_DTYPES, TensorType

aten = torch.ops.aten

# torch dtype -> h2ir dtype name (from the one dtype table)
TORCH_DTYPES = {getattr(torch, d.torch): n for n, d in DTYPE_TABLE.items()}


def h2_dtype(dt: torch.dtype) -> str:
    if dt not in TORCH_DTYPES:
        raise H2Error(f"dtype {dt} is not supported by h2ir (expected one of "
                      f"{', '.join(TORCH_DTYPES.values())})")
    return TORCH_DTYPES[dt]


def tensor_type(val) -> TensorType:
    return TensorType(h2_dtype(val.dtype), tuple(int(s) for s in val.shape))


class Unsupported(Exception):
    """An ATen call that the mapping table cannot express (message says why)."""


class Emitter:
    """Appends h2ir nodes to the current layer; types come from the op set's shape rules."""

    def __init__(self, namer: Callable[[str], str], rng_seed: Callable[[], Value] | None = None):
        self.nodes: list[Node] = []
        self.namer = namer
        self.hint = "t"
        self.rng_seed = rng_seed      # the program's `rng.seed` input (i64[2]), made on demand
        self.layer = ""               # the layer being emitted (dropout sites are keyed by it)
        self.sites: dict[str, int] = {}

    def dropout_site(self) -> int:
        """A number for the next dropout site of the current layer, the same in every program
        that holds the layer (capture, stage programs): crc32 of (layer, index), 20 bits."""
        k = self.sites.get(self.layer, 0)
        self.sites[self.layer] = k + 1
        return zlib.crc32(f"{self.layer}:{k}".encode()) & 0xFFFFF

    def __call__(self, op: str, *inputs, **attrs):
        from h2ir import opset
        defaults = opset.get(op).attrs
        attrs = {k: v for k, v in attrs.items() if k not in defaults or defaults[k] != v
                 or type(defaults[k]) is not type(v)}
        try:
            types = infer_types(op, list(inputs), attrs)
        except (ValueError, IndexError, TypeError, KeyError) as e:
            raise Unsupported(f"{op}: {e}") from None
        outs = [Value(self.namer(self.hint), t) for t in types]
        self.nodes.append(Node(op, list(inputs), attrs, outs))
        return outs[0] if len(outs) == 1 else tuple(outs)


def _dims(dims, rank):
    if dims is None:
        return None
    if isinstance(dims, int):
        dims = [dims]
    return [d % rank for d in dims]


def _shape(v: Value):
    return list(v.type.shape)


def _reduction(r: int) -> str:
    return {0: "none", 1: "mean", 2: "sum"}[r]


def _linear(em, x, w, b=None):
    wt = em("transpose", w, dim0=0, dim1=1)
    lead = _shape(x)[:-1]
    x2 = em("reshape", x, shape=[-1, _shape(x)[-1]]) if x.type.rank != 2 else x
    y = em("mm", x2, wt)
    if x.type.rank != 2:
        y = em("reshape", y, shape=lead + [_shape(w)[0]])
    return em("add", y, b) if b is not None else y


def _matmul(em, a, b):
    if a.type.rank == 2 and b.type.rank == 2:
        return em("mm", a, b)
    if b.type.rank == 2:
        lead = _shape(a)[:-1]
        y = em("mm", em("reshape", a, shape=[-1, _shape(a)[-1]]), b)
        return em("reshape", y, shape=lead + [_shape(b)[-1]])
    if a.type.rank < 2 or b.type.rank < 2:
        raise Unsupported(f"matmul of {a.type} and {b.type} (a vector operand) is not lowered yet")
    # batch dims broadcast (one key head against several query heads, ...): expand both to the
    # common batch shape, then one bmm
    ra, rb = a.type.rank - 2, b.type.rank - 2
    n = max(ra, rb)
    ba = [1] * (n - ra) + _shape(a)[:-2]
    bb = [1] * (n - rb) + _shape(b)[:-2]
    if any(x != y and 1 not in (x, y) for x, y in zip(ba, bb)):
        raise Unsupported(f"matmul of {a.type} and {b.type}: batch dims do not broadcast")
    lead = [max(x, y) for x, y in zip(ba, bb)]

    def batched(v, vb):
        if vb != lead:
            if len(vb) != v.type.rank - 2:
                v = em("reshape", v, shape=vb + _shape(v)[-2:])
            v = em("expand", v, shape=lead + _shape(v)[-2:])
        return em("reshape", v, shape=[-1] + _shape(v)[-2:])
    y = em("bmm", batched(a, ba), batched(b, bb))
    return em("reshape", y, shape=lead + [_shape(a)[-2], _shape(b)[-1]])


def _copy_into(em, dst, src):
    """aten.copy (functional): `src` cast to `dst`'s dtype and broadcast to its shape."""
    if not isinstance(src, Value):
        return em("full", shape=_shape(dst), value=src, dtype=dst.type.dtype)
    if src.type.dtype != dst.type.dtype:
        src = em("cast", src, dtype=dst.type.dtype)
    if _shape(src) != _shape(dst):
        if src.type.rank < dst.type.rank:
            src = em("reshape", src, shape=[1] * (dst.type.rank - src.type.rank) + _shape(src))
        src = em("expand", src, shape=_shape(dst))
    return em("copy", src)


def _slice_scatter(em, x, src, dim=0, start=None, end=None, step=1):
    """x with x[start:end] along `dim` replaced by src (functionalized `x[..., a:b].copy_(src)`):
    the parts before and after, and src between them, concatenated."""
    dim %= x.type.rank
    n = x.type.shape[dim]
    lo = 0 if start is None else (start + n if start < 0 else min(start, n))
    hi = n if end is None else (end + n if end < 0 else min(end, n))
    if step != 1:
        raise Unsupported(f"slice_scatter with step {step}")
    if src.type.dtype != x.type.dtype:
        src = em("cast", src, dtype=x.type.dtype)
    parts = ([_slice(em, x, dim, 0, lo)] if lo > 0 else []) + [src] + \
            ([_slice(em, x, dim, hi, None)] if hi < n else [])
    return parts[0] if len(parts) == 1 else em("cat", *parts, dim=dim)


def _split(em, x, size, dim=0):
    dim %= x.type.rank
    n = x.type.shape[dim]
    sizes = [min(size, n - i) for i in range(0, n, size)]
    out = em("split", x, dim=dim, sizes=sizes)
    return out if isinstance(out, tuple) else (out,)


def _split_sizes(em, x, sizes, dim=0):
    out = em("split", x, dim=dim % x.type.rank, sizes=list(sizes))
    return out if isinstance(out, tuple) else (out,)


def _chunk(em, x, chunks, dim=0):
    n = x.type.shape[dim % x.type.rank]
    return _split(em, x, -(-n // chunks), dim)


def _slice(em, x, dim=0, start=None, end=None, step=1):
    size = x.type.shape[dim % x.type.rank]
    if start == 0:
        start = None
    if end is not None and end >= size:
        end = None
    if start is None and end is None and step == 1:
        return x
    return em("slice", x, dim=dim % x.type.rank, start=start, end=end, step=step)


def _alias(em, x, *args, **kwargs):
    return x


def _to_copy(em, x, dtype=None, **kwargs):
    if dtype is None or h2_dtype(dtype) == x.type.dtype:
        return x
    return em("cast", x, dtype=h2_dtype(dtype))


def _type_as(em, x, other):
    # a float `other` gives its dtype; any other gives f32 (as this lowering always has)
    want = other.type.dtype if other.type.dtype in FLOAT_DTYPES else "f32"
    return x if want == x.type.dtype else em("cast", x, dtype=want)


def _reduce(op):
    def f(em, x, dims=None, keepdim=False, dtype=None):
        if dtype is None and op == "sum" and x.type.dtype not in FLOAT_DTYPES:
            dtype = torch.int64            # ATen sums bool and integer tensors in int64
        if dtype is not None and h2_dtype(dtype) != x.type.dtype:
            x = em("cast", x, dtype=h2_dtype(dtype))
        return em(op, x, dims=_dims(dims, x.type.rank), keepdim=bool(keepdim))
    return f


def _promote(em, a, b):
    """ATen's type promotion for two tensors of different dtypes: a float beats an integer or
    bool (the other is cast to it); of two floats or two integers the wider wins."""
    if not (isinstance(a, Value) and isinstance(b, Value)) or a.type.dtype == b.type.dtype:
        return a, b
    da, db = DTYPE_TABLE[a.type.dtype], DTYPE_TABLE[b.type.dtype]
    if da.is_float != db.is_float:
        to = da if da.is_float else db
    else:
        to = da if da.itemsize >= db.itemsize else db
    cast = lambda v: v if v.type.dtype == to.name else em("cast", v, dtype=to.name)
    return cast(a), cast(b)


def _binary(op, swap=False):
    def f(em, a, b, alpha=1):
        if alpha != 1:
            b = em("mul", b, alpha)
        a, b = _promote(em, a, b)
        return em(op, b, a) if swap else em(op, a, b)
    return f


def _div_mode(em, a, b, rounding_mode):
    if rounding_mode is None:
        return em("div", a, b)
    if rounding_mode == "floor":
        return em("floor_divide", a, b)
    raise Unsupported(f"div(rounding_mode={rounding_mode!r})")


def _unary(op):
    return lambda em, x: em(op, x)


def _out_shape(op):
    """Shape-only ops whose result shape we take from the traced value."""
    def f(em, x, *args, _out=None, **kwargs):
        if op == "expand":
            return em("expand", x, shape=list(_out.shape))
        if list(_out.shape) == _shape(x):
            return x
        return em("reshape", x, shape=list(_out.shape))
    f.wants_out = True
    return f


def _full(em, size, value, dtype=None, _out=None, **kwargs):
    return em("full", shape=list(_out.shape), value=value, dtype=h2_dtype(_out.dtype))


_full.wants_out = True


def _like(value):
    """zeros_like/ones_like/full_like/new_*: a constant of the traced result's shape and dtype."""
    def f(em, x, *args, _out=None, **kwargs):
        v = value if value is not None else (args[0] if args else kwargs["fill_value"])
        return em("full", shape=list(_out.shape), value=v, dtype=h2_dtype(_out.dtype))
    f.wants_out = True
    return f


def _new_full(em, x, size, value, _out=None, **kwargs):
    return em("full", shape=list(_out.shape), value=value, dtype=h2_dtype(_out.dtype))


_new_full.wants_out = True


def _scalar_tensor(em, s, *args, _out=None, **kwargs):
    return em("full", shape=[], value=s, dtype=h2_dtype(_out.dtype))


_scalar_tensor.wants_out = True


def _no_attention_dropout(dropout_p):
    if dropout_p:
        raise Unsupported("attention dropout (dropout_p > 0) inside a fused attention backward: "
                          "the fused attention ops draw no mask (the forward lowers attention "
                          "with dropout in its math form)")


def _attention_math(em, q, k, v, dropout_p, is_causal, attn_mask, scale):
    """(out, logsumexp) of attention written out: scores, mask, softmax, the op set's dropout
    on the probabilities, matmul — attention with dropout, which the fused ops do not draw."""
    r = q.type.rank
    if k.type.shape[1] != q.type.shape[1]:       # grouped-query heads: each serves a group
        k = _repeat_interleave(em, k, q.type.shape[1] // k.type.shape[1], dim=1)
        v = _repeat_interleave(em, v, q.type.shape[1] // v.type.shape[1], dim=1)
    scale = float(scale) if scale is not None else q.type.shape[-1] ** -0.5
    scores = em("mul", _matmul(em, q, em("transpose", k, dim0=r - 2, dim1=r - 1)), scale)
    L, S = q.type.shape[-2], k.type.shape[-2]
    if is_causal:
        keep = em("tril", em("full", shape=[L, S], value=True, dtype="bool"), diagonal=0)
        scores = em("where", keep, scores, float("-inf"))
    if attn_mask is not None:
        scores = em("where", attn_mask, scores, float("-inf")) \
            if attn_mask.type.dtype == "bool" else em("add", scores, attn_mask)
    m = em("amax", scores, dims=[r - 1], keepdim=True)
    lse = em("add", em("log", em("sum", em("exp", em("sub", scores, m)), dims=[r - 1])),
             em("reshape", m, shape=_shape(m)[:-1]))
    probs = _native_dropout(em, em("softmax", scores, dim=r - 1), dropout_p, True)[0]
    return _matmul(em, probs, v), lse


def _attention_fwd(em, q, k, v, dropout_p=0.0, is_causal=False, attn_mask=None, scale=None):
    """One fused op either way: `attention` (causal flag only) or `attention_masked` (a mask
    tensor, bool or additive). Grouped-query heads (k/v with fewer heads) pass as they are.
    With dropout, the math form (`_attention_math`): AOTAutograd records that one too."""
    if dropout_p:
        return _attention_math(em, q, k, v, dropout_p, is_causal, attn_mask, scale)
    if attn_mask is None:
        return em("attention", q, k, v, causal=bool(is_causal), scale=scale)
    return em("attention_masked", q, k, v, attn_mask, causal=bool(is_causal), scale=scale)


def _sdpa(em, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    # one key/value head broadcasts over the query heads (multi-query attention, as Falcon
    # calls it): the same math as grouped-query attention with one group
    if q.type.shape[1] != k.type.shape[1] and not enable_gqa and k.type.shape[1] != 1:
        raise Unsupported(f"attention with {q.type.shape[1]} query and {k.type.shape[1]} key "
                          "heads needs enable_gqa=True")
    return _attention_fwd(em, q, k, v, dropout_p, is_causal, attn_mask, scale)[0]


def _attention_bwd(em, g, q, k, v, out, lse, dropout_p, is_causal, attn_mask=None, scale=None):
    _no_attention_dropout(dropout_p)
    if attn_mask is None:
        return em("attention_bwd", g, q, k, v, out, lse, causal=bool(is_causal), scale=scale)
    return em("attention_masked_bwd", g, q, k, v, out, lse, attn_mask, causal=bool(is_causal),
              scale=scale)


def _nll_fwd(em, x, target, weight, reduction, ignore_index):
    if weight is not None:
        raise Unsupported("nll_loss with class weights is not supported")
    return em("nll_loss", x, target, reduction=_reduction(reduction), ignore_index=ignore_index)


def _nll_bwd(em, g, x, target, weight, reduction, ignore_index, total_weight):
    if weight is not None:
        raise Unsupported("nll_loss with class weights is not supported")
    return em("nll_loss_bwd", g, x, target, total_weight, reduction=_reduction(reduction),
              ignore_index=ignore_index)


def _embedding_bwd(em, g, ids, num_weights, padding_idx=-1, scale_grad_by_freq=False):
    if scale_grad_by_freq:
        raise Unsupported("embedding backward with scale_grad_by_freq")
    padding_idx = -1 if padding_idx is None or padding_idx < 0 else padding_idx
    return em("embedding_bwd", g, ids, num_weights=num_weights, padding_idx=padding_idx)


def _where_scalar_other(em, c, a, other):
    return em("where", c, a, other)


def _where_scalars(em, c, a, b, _out=None):
    # two scalars: the traced dtype (the op set's `where` of two scalars is f32)
    if h2_dtype(_out.dtype) == "f32":
        return em("where", c, a, b)
    return em("where", c, em("full", shape=[], value=a, dtype=h2_dtype(_out.dtype)), b)


_where_scalars.wants_out = True


def _masked_fill(em, x, mask, value):
    if isinstance(value, Value) and value.type.dtype != x.type.dtype:
        value = em("cast", value, dtype=x.type.dtype)
    return em("where", mask, value, x)


def _topk(em, x, k, dim=-1, largest=True, sorted=True):
    if largest:
        return em("topk", x, k=k, dim=dim % x.type.rank)
    values, indices = em("topk", em("neg", x), k=k, dim=dim % x.type.rank)   # smallest k
    return em("neg", values), indices


def _max_dim(largest):
    """aten.max.dim / aten.min.dim: (values, indices) along one dim, as a top-1."""
    def f(em, x, dim, keepdim=False):
        dim %= x.type.rank
        values, indices = _topk(em, x, 1, dim, largest)
        if not keepdim:
            shape = _shape(x)[:dim] + _shape(x)[dim + 1:]
            values = em("reshape", values, shape=shape)
            indices = em("reshape", indices, shape=shape)
        return values, indices
    return f


# ---- indexing, scans, sorting ---------------------------------------------------------------------

def _index_dims(em, indices) -> tuple[list, list]:
    """(dims, index values) of an ATen index list (None where a dim is not indexed)."""
    dims, vals = [], []
    for d, i in enumerate(indices):
        if i is None:
            continue
        if not isinstance(i, Value):
            raise Unsupported(f"index list entry {i!r} is not a tensor")
        if i.type.dtype == "bool":
            raise Unsupported("indexing with a boolean mask (its result size depends on the data)")
        dims.append(d)
        vals.append(i)
    if not dims:
        raise Unsupported("an index list without index tensors")
    return dims, vals


def _index(em, x, indices):
    dims, vals = _index_dims(em, indices)
    return em("index", x, *vals, dims=dims)


def _index_put(em, x, indices, values, accumulate=False):
    dims, vals = _index_dims(em, indices)
    if isinstance(values, Value) and values.type.dtype != x.type.dtype:
        values = em("cast", values, dtype=x.type.dtype)
    return em("index_put", x, values, *vals, dims=dims, accumulate=bool(accumulate))


def _index_add(em, x, dim, index, source, alpha=1):
    if alpha != 1:
        source = em("mul", source, alpha)
    return em("index_put", x, source, index, dims=[dim % x.type.rank], accumulate=True)


def _cumsum(em, x, dim, dtype=None, _out=None):
    return em("cumsum", x, dim=dim % x.type.rank, dtype=h2_dtype(_out.dtype))


_cumsum.wants_out = True


def _diff(em, x, n=1, dim=-1, prepend=None, append=None):
    """x[1:] - x[:-1] along dim, n times, after concatenating prepend/append (bool: xor)."""
    dim %= x.type.rank
    parts = [t for t in (prepend, x, append) if t is not None]
    y = em("cat", *parts, dim=dim) if len(parts) > 1 else x
    for _ in range(n):
        size = y.type.shape[dim]
        hi = em("slice", y, dim=dim, start=1)
        lo = em("slice", y, dim=dim, end=size - 1)
        y = em("logical_xor" if y.type.dtype == "bool" else "sub", hi, lo)
    return y


def _sort(em, x, dim=-1, descending=False, stable=None):
    return em("sort", x, dim=dim % x.type.rank, descending=bool(descending))


def _histc(em, x, bins=100, min=0, max=0):
    if max <= min:
        raise Unsupported("histc with max <= min takes its range from the data")
    return em("histc", x, bins=bins, min=min, max=max)


def _one_hot(em, x, num_classes=-1):
    if num_classes < 0:
        raise Unsupported("one_hot without num_classes (its size depends on the data)")
    return em("one_hot", x, num_classes=num_classes)


def _repeat_interleave(em, x, repeats, dim=None, output_size=None):
    if not isinstance(repeats, int):
        raise Unsupported("repeat_interleave with a tensor of repeats")
    if dim is None:
        x, dim = em("reshape", x, shape=[-1]), 0
    dim %= x.type.rank
    s = _shape(x)
    y = em("reshape", x, shape=s[:dim + 1] + [1] + s[dim + 1:])
    y = em("expand", y, shape=s[:dim + 1] + [repeats] + s[dim + 1:])
    return em("reshape", y, shape=s[:dim] + [s[dim] * repeats] + s[dim + 1:])


def _repeat(em, x, repeats):
    """x.repeat(r0, r1, ...): tile each dim (a new leading dim per extra repeat)."""
    s = [1] * (len(repeats) - x.type.rank) + _shape(x)
    y = em("reshape", x, shape=s) if s != _shape(x) else x
    for d, r in enumerate(repeats):
        if r == 1:
            continue
        cur = _shape(y)
        y = em("reshape", y, shape=cur[:d] + [1] + cur[d:])
        y = em("expand", y, shape=cur[:d] + [r] + cur[d:])
        y = em("reshape", y, shape=cur[:d] + [r * cur[d]] + cur[d + 1:])
    return y


# ---- norms and activations -------------------------------------------------------------------------

def _native_layer_norm(em, x, shape, weight, bias, eps):
    return em("layer_norm", x, weight, bias, normalized_ndim=len(shape), eps=float(eps))


def _layer_norm(em, x, shape, weight=None, bias=None, eps=1e-5, cudnn_enable=True):
    return _native_layer_norm(em, x, shape, weight, bias, eps)[0]


def _layer_norm_bwd(em, g, x, shape, mean, rstd, weight, bias, output_mask):
    return em("layer_norm_bwd", g, x, mean, rstd, weight, bias, normalized_ndim=len(shape))


def _var_mean(em, x, dims, correction, keepdim):
    """(variance, mean) over dims (None: all) with `correction` (1: Bessel's): the two-pass
    form, mean first, then the mean square deviation. Its backward, as AOTAutograd records it,
    is elementwise ops and a mean."""
    rank = x.type.rank
    ds = list(range(rank)) if dims is None else _dims(dims, rank)
    n = math.prod(x.type.shape[d] for d in ds) if ds else 1
    m = em("mean", x, dims=ds, keepdim=True)
    dev = em("sub", x, m)
    var = em("div", em("sum", em("mul", dev, dev), dims=ds, keepdim=bool(keepdim)),
             float(n - correction))
    return var, (m if keepdim else em("reshape", m, shape=_shape(var)))


def _var_forms(std: bool, with_mean: bool = False) -> tuple:
    """Lowerings of aten.var (std with `std`; var_mean / std_mean with `with_mean`) in its
    `correction`, `dim` (unbiased) and default forms."""
    def finish(em, x, dims, corr, keepdim):
        v, m = _var_mean(em, x, dims, corr, keepdim)
        v = em("sqrt", v) if std else v
        return (v, m) if with_mean else v

    def correction_form(em, x, dim=None, correction=None, keepdim=False):
        return finish(em, x, dim, 1 if correction is None else correction, keepdim)

    def dim_form(em, x, dim, unbiased=True, keepdim=False):
        return finish(em, x, dim, int(bool(unbiased)), keepdim)

    def default_form(em, x, unbiased=True):
        return finish(em, x, None, int(bool(unbiased)), False)
    return correction_form, dim_form, default_form


_VAR, _STD = _var_forms(False), _var_forms(True)


def _log_sigmoid_fwd(em, x):
    """(log sigmoid(x), buffer): min(x, 0) - log1p(e^-|x|), which never overflows. The buffer
    is what ATen's CPU kernel keeps for its backward, which this backward does not read: x
    stands in (its shape, no new tensor)."""
    out = em("sub", em("minimum", x, 0.0), em("log1p", em("exp", em("neg", em("abs", x)))))
    return out, x


def _mish_bwd(em, g, x):
    """grad * d/dx x tanh(softplus(x)) = grad * (t + x sigmoid(x) (1 - t^2)), t = tanh(softplus x);
    softplus(x) = max(x, 0) + log1p(e^-|x|). (ATen's own decomposition writes into a copy.)"""
    sp = em("add", em("maximum", x, 0.0), em("log1p", em("exp", em("neg", em("abs", x)))))
    t = em("tanh", sp)
    d = em("add", t, em("mul", em("mul", x, em("sigmoid", x)), em("sub", 1.0, em("mul", t, t))))
    return em("mul", g, d)


def _gelu(em, x, approximate="none"):
    return em("gelu", x, approximate=approximate)


def _tanh_bwd(em, g, y):
    """grad * (1 - tanh^2), from the saved output."""
    return em("mul", g, em("sub", 1.0, em("mul", y, y)))


def _sigmoid_bwd(em, g, y):
    return em("mul", g, em("mul", y, em("sub", 1.0, y)))


def _threshold_bwd(em, g, x, threshold):
    """relu's backward: grad where x > threshold, else 0."""
    return em("where", em("le", x, threshold), 0.0, g)


def _clamp(em, x, min=None, max=None):
    if min is not None:
        x = em("maximum", x, min)
    if max is not None:
        x = em("minimum", x, max)
    return x


def _native_dropout(em, x, p, train):
    """Dropout with h2's counter-based mask (the same bits on every backend): the program's
    `rng.seed` input — (run seed, a per-micro-batch counter), which the worker supplies — plus
    this site's number, so every dropout site of every layer draws its own mask."""
    if p == 0 or not train:
        return x, em("full", shape=_shape(x), value=True, dtype="bool")
    if em.rng_seed is None:
        raise Unsupported("dropout with p > 0 outside a program that takes an RNG seed")
    site = em("full", shape=[2], value=em.dropout_site(), dtype="i64")
    return em("dropout", x, em("add", em.rng_seed(), site), p=float(p))


def _dropout(em, x, p, train):
    return _native_dropout(em, x, p, train)[0] if p and train else x


def _native_dropout_bwd(em, g, mask, scale):
    return em("where", mask, em("mul", g, scale), 0.0)


def _grouped_mm(em, x, w, offs):
    return em("grouped_mm", x, w, offs)


def _grouped_mm_bwd(em, x, w, offs, g):
    return em("grouped_mm_bwd", g, x, w, offs)


def _constant_pad(em, x, pad, value=0.0):
    """F.pad's constant mode: pad = (last dim's before, after, the dim before's, ...); a
    negative amount cuts (torch's rule). Cuts by slices, pads by `full`s concatenated."""
    for i in range(len(pad) // 2):
        dim = x.type.rank - 1 - i
        lo, hi = int(pad[2 * i]), int(pad[2 * i + 1])
        n = x.type.shape[dim]
        x = _slice(em, x, dim, max(0, -lo), n - max(0, -hi))
        parts = [x]
        for at, k in ((0, lo), (1, hi)):
            if k > 0:
                shape = _shape(x)
                shape[dim] = k
                parts.insert(at * len(parts), em("full", shape=shape, value=value,
                                                 dtype=x.type.dtype))
        x = parts[0] if len(parts) == 1 else em("cat", *parts, dim=dim)
    return x


def _pad(em, x, pad, mode="constant", value=None):
    if mode != "constant":
        raise Unsupported(f"pad mode {mode!r} (the op set pads with a constant)")
    return _constant_pad(em, x, pad, 0.0 if value is None else value)


def _depthwise_pads(x, w, stride, padding, dilation, transposed, groups) -> int:
    """The (equal) pad of an ATen convolution the op set's depthwise_conv1d runs: 1-D, stride
    1, no dilation, one filter per channel (groups = channels)."""
    if x.type.rank != 3 or w.type.rank != 3 or transposed or list(stride) != [1] \
            or list(dilation) != [1] or len(padding) != 1 or groups != x.type.shape[1] \
            or w.type.shape[:2] != (groups, 1):
        raise Unsupported(f"convolution of {x.type} with {w.type} (stride {list(stride)}, "
                          f"dilation {list(dilation)}, groups {groups}, transposed {transposed}): "
                          "the op set has the depthwise 1-D convolution (groups = channels, "
                          "stride 1) of state-space and gated-convolution mixers only")
    return int(padding[0])


def _convolution(em, x, w, bias, stride, padding, dilation, transposed, output_padding, groups):
    pad = _depthwise_pads(x, w, stride, padding, dilation, transposed, groups)
    w2 = em("reshape", w, shape=[w.type.shape[0], w.type.shape[2]])
    return em("depthwise_conv1d", x, w2, bias, pad_left=pad, pad_right=pad)


def _convolution_bwd(em, g, x, w, bias_sizes, stride, padding, dilation, transposed,
                     output_padding, groups, output_mask):
    pad = _depthwise_pads(x, w, stride, padding, dilation, transposed, groups)
    w2 = em("reshape", w, shape=[w.type.shape[0], w.type.shape[2]])
    gx, gw, gb = em("depthwise_conv1d_bwd", g, x, w2, pad_left=pad, pad_right=pad)
    gw = em("reshape", gw, shape=_shape(w))
    return (gx if output_mask[0] else None, gw if output_mask[1] else None,
            gb if output_mask[2] else None)


def _inplace(fn):
    """An in-place ATen op (x.div_(y), inv[perm] = ...) lowered as its functional form; the
    lowering then rebinds the mutated input to the result, so later readers of it see the new
    value. torch.export graphs keep such ops; AOTAutograd's graphs are already functional."""
    def f(em, *args, **kwargs):
        return fn(em, *args, **kwargs)
    f.inplace = True
    f.wants_out = getattr(fn, "wants_out", False)
    return f


def _arange(em, *args, _out=None, dtype=None, **kwargs):
    start, end, step = (0, args[0], 1) if len(args) == 1 else (list(args) + [1])[:3]
    return em("arange", start=start, end=end, step=step, dtype=h2_dtype(_out.dtype))


_arange.wants_out = True


# The mapping table: ATen overload -> lowering. One table for the frontend and the compiler.
ATEN: dict = {
    aten.embedding.default: lambda em, w, ids, *a, **k: em("embedding", w, ids),
    aten.t.default: lambda em, x: em("transpose", x, dim0=0, dim1=1) if x.type.rank == 2 else x,
    aten.transpose.int: lambda em, x, d0, d1: em("transpose", x, dim0=d0 % x.type.rank,
                                                 dim1=d1 % x.type.rank),
    aten.permute.default: lambda em, x, dims: em("permute", x, dims=_dims(dims, x.type.rank)),
    aten.view.default: _out_shape("reshape"),
    aten._unsafe_view.default: _out_shape("reshape"),
    aten.reshape.default: _out_shape("reshape"),
    aten.unsqueeze.default: _out_shape("reshape"),
    aten.squeeze.dim: _out_shape("reshape"),
    aten.squeeze.dims: _out_shape("reshape"),
    aten.squeeze.default: _out_shape("reshape"),
    aten.flatten.using_ints: _out_shape("reshape"),
    aten.expand.default: _out_shape("expand"),
    aten.slice.Tensor: _slice,
    aten.slice_scatter.default: _slice_scatter,
    aten.narrow.default: lambda em, x, dim, start, length: _slice(em, x, dim, start, start + length),
    aten.select.int: lambda em, x, dim, index: em("select", x, dim=dim % x.type.rank,
                                                  index=index % x.type.shape[dim]),
    aten.cat.default: lambda em, xs, dim=0: em("cat", *xs, dim=dim % xs[0].type.rank),
    aten.split.Tensor: _split,
    aten.split_with_sizes.default: _split_sizes,
    aten.chunk.default: _chunk,
    aten.clone.default: _alias,
    aten.copy.default: lambda em, dst, src, non_blocking=False: _copy_into(em, dst, src),
    aten.detach.default: _alias,
    aten.alias.default: _alias,
    aten.contiguous.default: _alias,
    aten.lift_fresh_copy.default: _alias,
    aten.dropout.default: _dropout,
    aten.native_dropout.default: _native_dropout,
    aten.native_dropout_backward.default: _native_dropout_bwd,
    aten._to_copy.default: _to_copy,
    aten.to.dtype: lambda em, x, dtype, *a, **k: _to_copy(em, x, dtype),
    aten.to.dtype_layout: lambda em, x, *a, dtype=None, **k: _to_copy(em, x, dtype),
    aten.to.device: lambda em, x, device, dtype=None, *a, **k: _to_copy(em, x, dtype),
    aten.__and__.Tensor: _binary("bitwise_and"), aten.__or__.Tensor: _binary("bitwise_or"),
    aten.__xor__.Tensor: _binary("bitwise_xor"),
    aten.bitwise_and.Tensor: _binary("bitwise_and"), aten.bitwise_and.Scalar: _binary("bitwise_and"),
    aten.bitwise_or.Tensor: _binary("bitwise_or"), aten.bitwise_or.Scalar: _binary("bitwise_or"),
    aten.bitwise_xor.Tensor: _binary("bitwise_xor"), aten.bitwise_xor.Scalar: _binary("bitwise_xor"),
    aten.bitwise_not.default: _unary("bitwise_not"),
    aten.logical_xor.default: _binary("logical_xor"),
    aten.floor_divide.default: _binary("floor_divide"),
    aten.floor_divide.Scalar: _binary("floor_divide"),
    aten.div.Tensor_mode: lambda em, a, b, rounding_mode=None: _div_mode(em, a, b, rounding_mode),
    aten.pow.Scalar: lambda em, base, x: em("power", base, x),
    aten.pow.Tensor_Tensor: lambda em, a, b: em("power", *_promote(em, a, b)),
    aten.where.ScalarSelf: lambda em, c, a, b: em("where", c, a, b),
    aten.where.Scalar: _where_scalars,
    aten.masked_fill.Scalar: _masked_fill, aten.masked_fill.Tensor: _masked_fill,
    aten.clamp.default: _clamp,
    aten.clamp_min.default: lambda em, x, m: em("maximum", x, m),
    aten.clamp_max.default: lambda em, x, m: em("minimum", x, m),
    aten.type_as.default: _type_as,
    aten.add.Tensor: _binary("add"), aten.add.Scalar: _binary("add"),
    aten.sub.Tensor: _binary("sub"), aten.sub.Scalar: _binary("sub"),
    aten.rsub.Scalar: _binary("sub", swap=True), aten.rsub.Tensor: _binary("sub", swap=True),
    aten.mul.Tensor: _binary("mul"), aten.mul.Scalar: _binary("mul"),
    aten.div.Tensor: _binary("div"), aten.div.Scalar: _binary("div"),
    aten.maximum.default: _binary("maximum"), aten.minimum.default: _binary("minimum"),
    aten.eq.Tensor: _binary("eq"), aten.eq.Scalar: _binary("eq"),
    aten.ne.Tensor: _binary("ne"), aten.ne.Scalar: _binary("ne"),
    aten.lt.Tensor: _binary("lt"), aten.lt.Scalar: _binary("lt"),
    aten.le.Tensor: _binary("le"), aten.le.Scalar: _binary("le"),
    aten.gt.Tensor: _binary("gt"), aten.gt.Scalar: _binary("gt"),
    aten.ge.Tensor: _binary("ge"), aten.ge.Scalar: _binary("ge"),
    aten.logical_and.default: _binary("logical_and"), aten.logical_or.default: _binary("logical_or"),
    aten.logical_not.default: _unary("logical_not"),
    aten.where.self: lambda em, c, a, b: em("where", c, a, b),
    aten.where.ScalarOther: _where_scalar_other,
    aten.pow.Tensor_Scalar: lambda em, x, e: em("pow", x, exponent=e),
    aten.mean.dim: _reduce("mean"), aten.sum.dim_IntList: _reduce("sum"),
    aten.sum.default: lambda em, x, dtype=None: _reduce("sum")(em, x, None, False, dtype),
    aten.mean.default: lambda em, x, dtype=None: _reduce("mean")(em, x, None, False, dtype),
    aten.amax.default: _reduce("amax"), aten.amin.default: _reduce("amin"),
    # all(x): the minimum of x as 0/1 (AOTAutograd's index bounds checks of MoE backwards)
    aten.all.default: lambda em, x: em("cast", _reduce("amin")(em, em("cast", x, dtype="i64")),
                                       dtype="bool"),
    aten.mm.default: lambda em, a, b: em("mm", a, b),
    aten.bmm.default: lambda em, a, b: em("bmm", a, b),
    aten.matmul.default: _matmul,
    aten.linear.default: _linear,
    aten.addmm.default: lambda em, bias, a, b, beta=1, alpha=1: em("add", em("mm", a, b), bias),
    aten._scaled_dot_product_flash_attention_for_cpu.default: _attention_fwd,
    aten.scaled_dot_product_attention.default: _sdpa,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: _attention_bwd,
    aten._softmax.default: lambda em, x, dim, half_to_float=False: em("softmax", x, dim=dim % x.type.rank),
    aten.softmax.int: lambda em, x, dim, dtype=None: em("softmax", x, dim=dim % x.type.rank),
    aten._log_softmax.default: lambda em, x, dim, h=False: em("log_softmax", x, dim=dim % x.type.rank),
    aten.log_softmax.int: lambda em, x, dim, dtype=None: em("log_softmax", x, dim=dim % x.type.rank),
    aten._softmax_backward_data.default: lambda em, g, out, dim, dt: em("softmax_bwd", g, out,
                                                                        dim=dim % g.type.rank),
    aten._log_softmax_backward_data.default: lambda em, g, out, dim, dt: em(
        "log_softmax_bwd", g, out, dim=dim % g.type.rank),
    aten.silu_backward.default: lambda em, g, x: em("silu_bwd", g, x),
    aten.embedding_dense_backward.default: _embedding_bwd,
    aten.slice_backward.default: lambda em, g, sizes, dim, start, end, step: em(
        "slice_bwd", g, shape=list(sizes), dim=dim % len(sizes),
        start=None if start == 0 else start,
        end=None if end >= sizes[dim % len(sizes)] else end, step=step),
    aten.nll_loss_forward.default: _nll_fwd,
    aten.nll_loss_backward.default: _nll_bwd,
    aten.full.default: _full,
    aten.zeros.default: _like(0.0), aten.ones.default: _like(1.0),
    aten.scalar_tensor.default: _scalar_tensor,
    aten.zeros_like.default: _like(0.0), aten.ones_like.default: _like(1.0),
    aten.full_like.default: _like(None),
    aten.new_zeros.default: _like(0.0), aten.new_ones.default: _like(1.0),
    # uninitialised memory: any value is right; zeros keep the programs deterministic
    aten.empty_like.default: _like(0.0), aten.new_empty.default: _like(0.0),
    aten.empty.memory_format: _like(0.0), aten.new_empty_strided.default: _like(0.0),
    aten.empty_strided.default: _like(0.0),
    aten.new_full.default: _new_full,
    aten.arange.default: _arange, aten.arange.start: _arange, aten.arange.start_step: _arange,
    aten.tril.default: lambda em, x, diagonal=0: em("tril", x, diagonal=diagonal),
    aten.topk.default: _topk,
    aten.max.dim: _max_dim(True), aten.min.dim: _max_dim(False),
    aten.one_hot.default: _one_hot,
    aten.gelu.default: _gelu,
    aten.sgn.default: _unary("sign"),
    aten.remainder.Tensor: _binary("remainder"), aten.remainder.Scalar: _binary("remainder"),
    aten.remainder.Scalar_Tensor: _binary("remainder"),
    aten.fmod.Tensor: _binary("fmod"), aten.fmod.Scalar: _binary("fmod"),
    aten.argmax.default: lambda em, x, dim=None, keepdim=False: em(
        "argmax", x, dim=None if dim is None else dim % x.type.rank, keepdim=bool(keepdim)),
    aten.flip.default: lambda em, x, dims: em("flip", x, dims=[d % x.type.rank for d in dims]),
    aten.var.correction: _VAR[0], aten.var.dim: _VAR[1], aten.var.default: _VAR[2],
    aten.std.correction: _STD[0], aten.std.dim: _STD[1], aten.std.default: _STD[2],
    aten.var_mean.correction: _var_forms(False, True)[0],
    aten.std_mean.correction: _var_forms(True, True)[0],
    aten.hypot.default: lambda em, a, b: em("sqrt", em("add", em("mul", a, a), em("mul", b, b))),
    aten.log2.default: lambda em, x: em("mul", em("log", x), 1.0 / math.log(2.0)),
    aten.log10.default: lambda em, x: em("mul", em("log", x), 1.0 / math.log(10.0)),
    aten.log_sigmoid_forward.default: _log_sigmoid_fwd,
    aten.mish_backward.default: _mish_bwd,
    # d/dx log sigmoid(x) = sigmoid(-x)
    aten.log_sigmoid_backward.default: lambda em, g, x, buffer: em(
        "mul", g, em("sigmoid", em("neg", x))),
    aten.gelu_backward.default: lambda em, g, x, approximate="none": em(
        "gelu_bwd", g, x, approximate=approximate),
    aten.tanh_backward.default: _tanh_bwd,
    aten.sigmoid_backward.default: _sigmoid_bwd,
    aten.threshold_backward.default: _threshold_bwd,
    aten.layer_norm.default: _layer_norm,
    aten.native_layer_norm.default: _native_layer_norm,
    aten.native_layer_norm_backward.default: _layer_norm_bwd,
    aten.cumsum.default: _cumsum,
    aten.diff.default: _diff,
    aten.index.Tensor: _index, aten._unsafe_index.Tensor: _index,
    aten.index_put.default: _index_put, aten._unsafe_index_put.default: _index_put,
    aten.index_add.default: _index_add,
    aten.index_select.default: lambda em, x, dim, index: em("index", x, index,
                                                            dims=[dim % x.type.rank]),
    aten.gather.default: lambda em, x, dim, index, sparse_grad=False: em(
        "gather", x, index, dim=dim % x.type.rank),
    aten.scatter.src: lambda em, x, dim, index, src: em("scatter", x, index, src,
                                                        dim=dim % x.type.rank),
    aten.scatter.value: lambda em, x, dim, index, value: em("scatter", x, index, value,
                                                            dim=dim % x.type.rank),
    aten.scatter_add.default: lambda em, x, dim, index, src: em("scatter_add", x, index, src,
                                                                dim=dim % x.type.rank),
    aten.sort.default: _sort,
    aten.sort.stable: lambda em, x, stable=None, dim=-1, descending=False: _sort(
        em, x, dim, descending),
    aten.histc.default: _histc,
    aten.repeat_interleave.self_int: _repeat_interleave,
    aten.repeat.default: _repeat,
    # transformers 5's MoE experts kernel (integrations/moe.py: a custom op, so it is keyed by
    # name: the op exists only once transformers has registered it)
    "transformers::grouped_mm_fallback": _grouped_mm,
    "transformers::grouped_mm_fallback_backward": _grouped_mm_bwd,
    # a copy with other strides (decompositions keep a non-contiguous input's layout): h2ir
    # values have no strides, so the same values
    torch.ops.prims.copy_strided.default: lambda em, x, stride: x,
    aten.constant_pad_nd.default: _constant_pad,
    aten.pad.default: _pad,
    aten.convolution.default: _convolution,
    aten.convolution_backward.default: _convolution_bwd,
    # the selective scan of Mamba-family mixers (frontend/ssm.py)
    "h2ssm::selective_scan": lambda em, u, delta, A, B, C: em("selective_scan", u, delta, A, B, C),
    "h2ssm::selective_scan_bwd": lambda em, g, u, delta, A, B, C: em(
        "selective_scan_bwd", g, u, delta, A, B, C),
    # tensor parallelism's collectives (frontend/tensor_parallel.py): f is the identity forward
    # (its backward, an all-reduce, is what AOTAutograd writes into the backward program)
    "h2tp::copy": lambda em, x, size: x,
    "h2tp::all_reduce": lambda em, x, size: em("tp_all_reduce", x, size=size, reduce="sum"),
    "h2tp::all_reduce_max": lambda em, x, size: em("tp_all_reduce", x, size=size, reduce="max"),
    "h2tp::rank": lambda em, anchor, size: em("tp_rank", size=size),
    # expert parallelism's exchange and the MoE loads (frontend/moe.py)
    "h2moe::all_to_all": lambda em, x, size: em("ep_all_to_all", x, size=size),
    "h2moe::stats": lambda em, x, counts, capacity, layer: em("moe_stats", x, counts,
                                                              capacity=capacity, layer=layer),
    # the auxiliary loss (frontend/moe.py): identity forward; its backward asks the runtime
    # for this micro-batch's loss-gradient scale
    "h2moe::attach_aux": lambda em, x, aux, coef: x,
    "h2moe::aux_scale": lambda em, anchor: em("moe_aux_scale"),
}
# In-place ATen ops that torch.export graphs keep: lowered as their functional form.
for _fn_op, _ip_op in [(aten.div.Tensor, aten.div_.Tensor), (aten.div.Scalar, aten.div_.Scalar),
                       (aten.mul.Tensor, aten.mul_.Tensor), (aten.mul.Scalar, aten.mul_.Scalar),
                       (aten.add.Tensor, aten.add_.Tensor), (aten.add.Scalar, aten.add_.Scalar),
                       (aten.sub.Tensor, aten.sub_.Tensor), (aten.sub.Scalar, aten.sub_.Scalar),
                       (aten.masked_fill.Scalar, aten.masked_fill_.Scalar),
                       (aten.masked_fill.Tensor, aten.masked_fill_.Tensor),
                       (aten.index_put.default, aten.index_put_.default),
                       (aten.index_add.default, aten.index_add_.default),
                       (aten.scatter.src, aten.scatter_.src),
                       (aten.scatter.value, aten.scatter_.value),
                       (aten.scatter_add.default, aten.scatter_add_.default),
                       (aten.clamp.default, aten.clamp_.default),
                       (aten.clamp_min.default, aten.clamp_min_.default),
                       (aten.clamp_max.default, aten.clamp_max_.default)]:
    ATEN[_ip_op] = _inplace(ATEN[_fn_op])
# Runtime assertions carry no data: nothing to lower.
for _assert in ("_assert_tensor_metadata", "_assert_async", "_assert_scalar"):
    if hasattr(aten, _assert):
        for _ov in getattr(aten, _assert).overloads():
            ATEN[getattr(getattr(aten, _assert), _ov)] = lambda em, *a, **k: None
# floor(x) = x // 1 (Llama 4's attention temperature); an integer is its own floor
ATEN[aten.floor.default] = lambda em, x: x if x.type.dtype in ("i64", "i32", "i8", "u8") else \
    _binary("floor_divide")(em, x, 1.0)
for _name in ("neg", "exp", "log", "sqrt", "rsqrt", "tanh", "sigmoid", "relu", "silu", "abs",
              "reciprocal", "sin", "cos", "log1p", "expm1", "erf", "atan", "sign"):
    ATEN[getattr(aten, _name).default] = _unary(_name)


# ---- lowering a whole fx graph -------------------------------------------------------------------

@dataclass
class SourceInfo:
    module: str
    line: str


def source_info(node: torch.fx.Node) -> SourceInfo:
    stack = node.meta.get("nn_module_stack") or {}
    paths = [module_path(v[0]) for v in stack.values()]
    module = paths[-1] if paths else "<top level>"
    trace = node.meta.get("stack_trace") or ""
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)', trace)
    frames = [f for f in frames if "/torch/" not in f[0] and "/frontend/" not in f[0]]
    line = f'{frames[-1][0]}:{frames[-1][1]}: {frames[-1][3].strip()}' if frames else ""
    return SourceInfo(module, line)


def module_path(p: str) -> str:
    """Normalise torch.export's module paths (L['self'].layers[0]) to dotted paths (layers.0)."""
    p = re.sub(r"^L\['self'\]\.?", "", p)
    p = re.sub(r"\[(\d+)\]", r".\1", p)
    p = re.sub(r"\._modules\['([^']+)'\]", r".\1", p)
    return p.strip(".")


def op_name(target) -> str:
    return str(target) if not hasattr(target, "name") else target.name()


def lower_fx(gm: torch.fx.GraphModule, name: str, *, inputs: dict, params: dict, consts: dict,
             layer_of: Callable[[torch.fx.Node], tuple], attrs: dict | None = None,
             file: str | None = None, prefix: str = "") -> Graph:
    """Lower an ATen-level fx graph to h2ir.

    inputs/params/consts map placeholder (or get_attr) node names to h2ir value names.
    `layer_of(node)` gives (layer_name, kind, layer_attrs) for each call node; nodes are appended
    to layers in graph order (a new layer starts when the name changes). `prefix` is put before
    the names of computed values (so programs lowered separately can be joined).
    """
    gm.graph.eliminate_dead_code()
    low = _Lowering(gm, Graph(name=name, attrs=dict(attrs or {})), inputs, params, consts,
                    layer_of, file, prefix)
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            low.graph_input(node)
        elif node.op == "output":
            low.graph_outputs(node)
        elif node.op == "call_function":
            low.call_function(node)
        else:
            raise H2Error(f"unexpected fx node {node.op} {node.target} (lower to ATen first)", file)
    # lowerings may emit results nobody reads (the logsumexp of attention with dropout, in its
    # math form): they must not count in the layer costs
    low.g.eliminate_dead_code()
    return low.g


class _Lowering:
    """The state of one `lower_fx` run, with one step per fx opcode (as torch.fx.Interpreter):
    `env` maps fx node names to h2ir values (or Python scalars and tuples of values)."""

    def __init__(self, gm, g: Graph, inputs: dict, params: dict, consts: dict, layer_of,
                 file: str | None, prefix: str):
        self.gm, self.g = gm, g
        self.inputs, self.params, self.consts = inputs, params, consts
        self.layer_of, self.file, self.prefix = layer_of, file, prefix
        self.env: dict[str, object] = {}
        self.used_names: set[str] = set()
        self.param_owner: dict[str, str] = {}        # parameter value name -> its layer
        self.layers: dict[str, Layer] = {}
        self.em = Emitter(self.namer, self.rng_seed)
        self._rng: Value | None = None

    def rng_seed(self) -> Value:
        """The program input `rng.seed` (i64[2]: run seed, micro-batch counter), added the first
        time a dropout site needs it."""
        if self._rng is None:
            self._rng = Value(RNG_INPUT, TensorType("i64", (2,)))
            self.g.inputs.append(self._rng)
        return self._rng

    def namer(self, hint: str) -> str:
        """A value name from `hint`, made unique within the graph."""
        base = re.sub(r"[^A-Za-z0-9_.]", "_", hint)
        n, i = base, 1
        while n in self.used_names:
            n = f"{base}_{i}"
            i += 1
        self.used_names.add(n)
        return n

    def graph_input(self, node: torch.fx.Node) -> None:
        """A placeholder or get_attr: a parameter, constant, model input or lifted scalar."""
        val = node.meta.get("val")
        if val is None and node.op == "get_attr":
            val = getattr(self.gm, node.target)
        key = node.name if node.op == "placeholder" else node.target
        if key in self.params:
            self.env[node.name] = Value(self.namer(self.params[key]), tensor_type(val))
        elif key in self.consts:
            v = Value(self.namer(self.consts[key]), tensor_type(val))
            self.g.consts.append(v)
            self.env[node.name] = v
        elif key in self.inputs:
            same = [x for x in self.g.inputs if x.name == self.inputs[key]]
            if same:                      # one value passed twice (e.g. saved twice)
                self.env[node.name] = same[0]
                return
            v = Value(self.namer(self.inputs[key]), tensor_type(val))
            self.g.inputs.append(v)
            self.env[node.name] = v
        elif isinstance(val, torch.nn.Module):
            self.env[node.name] = None    # a higher-order op's body: the op that calls it fails
        elif val is not None and val.numel() == 1 and node.op == "get_attr":
            self.env[node.name] = val.item()     # a lifted scalar constant
        else:
            raise H2Error(f"graph input {key!r} is neither a model input, a parameter nor a buffer",
                          self.file)

    def graph_outputs(self, node: torch.fx.Node) -> None:
        outs = node.args[0]
        outs = outs if isinstance(outs, (list, tuple)) else [outs]
        for o in outs:
            if o is None:
                continue
            v = self.env[o.name]
            if not isinstance(v, Value):
                raise H2Error(f"graph output {o.name} is not a tensor", self.file)
            self.g.outputs.append(v)

    def call_function(self, node: torch.fx.Node) -> None:
        """One ATen call: its layer claims the parameters it reads, then ATEN emits its nodes."""
        args = torch.fx.node.map_arg(node.args, lambda n: self.env[n.name])
        kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: self.env[n.name])
        if node.target is operator.getitem:
            self.env[node.name] = args[0][args[1]]
            return
        layer = self.layer_for(node)
        self.claim_params(node, layer)
        self.em.hint = self.prefix + node.name
        self.em.nodes = layer.nodes
        self.em.layer = layer.name
        res, fn = self.lower_call(node, node, args, kwargs)
        self.env[node.name] = res
        if getattr(fn, "inplace", False) and isinstance(node.args[0], torch.fx.Node):
            self.env[node.args[0].name] = res       # later readers of the mutated input

    def lower_call(self, node: torch.fx.Node, origin: torch.fx.Node, args, kwargs, depth=0):
        """(h2ir result, lowering) of one ATen call whose inputs are already h2ir `args`.
        `origin` is the model's node it came from (for messages); an op with no entry in ATEN
        is lowered through its own ATen decomposition (`_decompose`)."""
        body = _grad_mode_body(node, args)
        if body is not None:        # torch.export's `with torch.no_grad():` region: inline it
            gm, ins = body
            return self.lower_subgraph((gm, list(range(len(ins)))), origin, ins, {}, depth), None
        fn = ATEN.get(node.target) or ATEN.get(op_name(node.target)) or _aten_twin(node.target)
        if fn is None:
            sub = _decompose(node) if depth < MAX_DECOMPOSE_DEPTH else None
            if sub is None:
                self.missing(node, origin)
            return self.lower_subgraph(sub, origin, args, kwargs, depth + 1), None
        try:
            if getattr(fn, "wants_out", False):
                res = fn(self.em, *args, _out=node.meta["val"], **kwargs)
            else:
                res = fn(self.em, *args, **kwargs)
        except Unsupported as e:
            src = source_info(origin)
            raise H2Error(f"cannot lower {op_name(node.target)} (from module '{src.module}'): {e}",
                          self.file, hint=f"at {src.line}" if src.line else None) from None
        _check_against_trace(node, res, self.file)
        return res, fn

    def lower_subgraph(self, sub, origin: torch.fx.Node, args, kwargs, depth: int):
        """Lower the decomposition `sub` of one call (`_decompose`: placeholders are the call's
        tensor arguments in order) into the current layer; its result in the call's structure."""
        gm, positions = sub
        flat, _ = torch.utils._pytree.tree_flatten((list(args), dict(kwargs)))
        env: dict[str, object] = {}
        ins = iter(positions)
        out = None
        for sn in gm.graph.nodes:
            if sn.op == "placeholder":
                env[sn.name] = flat[next(ins)]
            elif sn.op == "call_function":
                a = torch.fx.node.map_arg(sn.args, lambda n: env[n.name])
                k = torch.fx.node.map_arg(sn.kwargs, lambda n: env[n.name])
                if sn.target is operator.getitem:
                    env[sn.name] = a[0][a[1]]
                    continue
                env[sn.name], fn = self.lower_call(sn, origin, a, k, depth)
                if getattr(fn, "inplace", False) and isinstance(sn.args[0], torch.fx.Node):
                    env[sn.args[0].name] = env[sn.name]    # as in call_function
            elif sn.op == "output":
                out = torch.fx.node.map_arg(sn.args[0], lambda n: env[n.name])
            else:                           # a tensor constant the decomposition made
                self.missing(origin, origin)
        return tuple(out) if isinstance(out, list) else out

    def layer_for(self, node: torch.fx.Node) -> Layer:
        lname, kind, lattrs = self.layer_of(node)
        if lname not in self.layers:
            self.layers[lname] = Layer(lname, kind, dict(lattrs))
            self.g.layers.append(self.layers[lname])
        return self.layers[lname]

    def claim_params(self, node: torch.fx.Node, layer: Layer) -> None:
        """Parameters join the layer of their first use. A parameter another layer also reads is
        tied (e.g. embedding = LM head): it stays one parameter, owned by its first layer, and
        the other layers list it in their `tied` attribute."""
        for a in node.all_input_nodes:
            v = self.env.get(a.name)
            key = a.name if a.op == "placeholder" else a.target
            if key in self.params and isinstance(v, Value):
                owner = self.param_owner.setdefault(v.name, layer.name)
                if owner == layer.name and v not in layer.params:
                    layer.params.append(v)
                elif owner != layer.name and v.name not in layer.attrs.get("tied", []):
                    layer.attrs["tied"] = list(layer.attrs.get("tied", [])) + [v.name]

    def missing(self, node: torch.fx.Node, origin: torch.fx.Node):
        """Raise: `node`'s op has no lowering (`origin`: the model's call it came from)."""
        src = source_info(origin)
        via = "" if node is origin else f"in the decomposition of {op_name(origin.target)}\n  "
        raise H2Error(
            f"op {op_name(node.target)} (from module '{src.module}') is not in the h2ir op set",
            self.file, hint=(f"at {src.line}\n  " if src.line else "") + via +
            "add a lowering to frontend/lower.py ATEN (and the op to h2ir/opset.py) "
            "or rewrite the model with supported ops")


MAX_DECOMPOSE_DEPTH = 4


def _grad_mode_body(node: torch.fx.Node, args):
    """(body GraphModule, its inputs) of torch.export's wrap_with_set_grad_enabled(enabled, body,
    *inputs), else None. The region computes what its body computes; which values get
    gradients is AOTAutograd's business when the stage programs are built."""
    hop = getattr(getattr(torch._higher_order_ops, "wrap", None), "wrap_with_set_grad_enabled",
                  None)
    if hop is None or node.target is not hop:
        return None
    gm = node.args[1]
    gm = getattr(node.graph.owning_module, gm.target) if isinstance(gm, torch.fx.Node) else gm
    return gm, list(args[2:])


def _aten_twin(op):
    """The lowering of the ATen op a primitive stands for (prims::log1p -> aten::log1p): some
    of torch._decomp's decompositions are written in prims, with the same semantics."""
    if not isinstance(op, torch._ops.OpOverload) or op.namespace != "prims":
        return None
    twin = getattr(torch.ops.aten, op._schema.name.split("::")[-1], None)
    for overload in ("default", "Tensor", "Scalar"):
        fn = ATEN.get(getattr(twin, overload, None)) if twin is not None else None
        if fn is not None:
            return fn
    return None


def _decompose(node: torch.fx.Node):
    """(GraphModule, positions) of an ATen call that has no lowering of its own, traced on the
    meta device through the op's own decomposition: its CompositeImplicitAutograd kernel
    (`Tensor.T`, `swapaxes`, ...) or the one torch._decomp registers for it (`stack`, ...),
    which is exact (the same math in the ops it is built from). `positions`: where, in the
    flattened (args, kwargs) of the call, each placeholder's tensor sits. None when the op has
    neither, or its inputs are not all known tensors and plain values."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch._decomp import get_decompositions
    op = node.target
    if not isinstance(op, torch._ops.OpOverload):
        return None
    if torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd"):
        impl = op.decompose
    else:
        impl = get_decompositions([op]).get(op)
        if impl is None:
            return None
    flat, spec = torch.utils._pytree.tree_flatten((list(node.args), dict(node.kwargs)))
    positions, metas = [], []
    for i, a in enumerate(flat):
        if isinstance(a, torch.fx.Node):
            v = a.meta.get("val")
            if not isinstance(v, torch.Tensor):
                return None
            positions.append(i)
            metas.append(torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta"))

    def run(*tensors):
        f = list(flat)
        for i, t in zip(positions, tensors):
            f[i] = t
        a, k = torch.utils._pytree.tree_unflatten(f, spec)
        return impl(*a, **k)
    try:
        gm = make_fx(run)(*metas)
    except Exception:               # the decomposition does not trace here: report the op
        return None
    if any(n.op == "call_function" and n.target is node.target for n in gm.graph.nodes):
        return None                 # it did not decompose
    return gm, positions


def _check_against_trace(node, res, file):
    """The op set's shape rule must agree with what torch computed for the same call."""
    val = node.meta.get("val")
    if val is None:
        return
    vals = val if isinstance(val, (list, tuple)) else [val]
    outs = res if isinstance(res, tuple) else [res]
    for v, o in zip(vals, outs):
        if isinstance(v, torch.Tensor) and isinstance(o, Value):
            want = tensor_type(v)
            if want.shape != o.type.shape or want.dtype != o.type.dtype:
                src = source_info(node)
                raise H2Error(f"internal: h2ir type {o.type} for {op_name(node.target)} "
                              f"differs from torch's {want} (module '{src.module}')", file)
