"""The standardized op set: every op h2ir knows, with its signature, shape/dtype rule and cost rule.

In the spirit of DIOPI (H2, arXiv 2505.17548, Sec. 3.1): one vendor-neutral list of operators;
a backend is a table from these names to kernels, so a missing kernel is detectable before a run
(`missing_ops`). Ops are grouped (as tinygrad's GroupOp) so passes ask "is this a movement op",
not long if-chains of names.

Conventions
- Inputs are values (tensors) or scalar literals; attributes are keyword literals.
- Shapes follow NumPy broadcasting; dims may be negative (normalised by the rule).
- Costs: `flops` counts multiply-adds as 2 FLOPs (matmul 2*m*n*k; attention its matmuls, see
  the cost rules); elementwise ops count one FLOP per output element.
  `bytes` is the data an op reads and writes (views move nothing).
- `saves` names what the op's backward needs (inputs 'i0', 'i1', ... or outputs 'o0', ...):
  the activation-memory model sums these per layer. `bwd_factor` is backward FLOPs / forward FLOPs
  (matmul: two matmuls of the same size; attention: 2.5x, FlashAttention-2, Dao 2023, Sec. 3).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable

from h2ir.types import DTYPE_TABLE, DTYPES, TensorType, broadcast_shapes


class Group(str, Enum):
    UNARY = "unary"            # elementwise, one tensor in
    BINARY = "binary"          # elementwise with broadcasting, two operands (tensor or scalar)
    TERNARY = "ternary"
    REDUCE = "reduce"
    MOVEMENT = "movement"      # reshape/permute/slice...: no arithmetic
    MATMUL = "matmul"
    ATTENTION = "attention"
    INDEX = "index"            # embedding, gather, scatter
    NN = "nn"                  # softmax-like composite kernels
    LOSS = "loss"
    GRAD = "grad"              # fused backward kernels appearing in backward programs
    CREATION = "creation"
    COMM = "comm"              # send/recv/all_reduce/all_to_all as first-class graph nodes
    MOE = "moe"                # token dispatch/combine of an expert-parallel region
    SEQUENCE = "sequence"      # mixers along the time axis: depthwise convolution, selective scan


REQUIRED = object()


@dataclass(frozen=True)
class OpDef:
    name: str
    group: Group
    inputs: tuple[str, ...]              # input names; a trailing '*' name is variadic
    attrs: dict = field(default_factory=dict)   # attr name -> default (REQUIRED if none)
    infer: Callable = None               # (ins: list[TensorType|scalar], attrs) -> list[TensorType]
    flops: Callable = None               # (ins, outs, attrs) -> int
    saves: tuple[str, ...] = ()
    bwd_factor: float = 1.0
    doc: str = ""

    @property
    def variadic(self) -> bool:
        return bool(self.inputs) and self.inputs[-1].endswith("*")

    def bytes(self, ins, outs) -> int:
        if self.group is Group.MOVEMENT:
            return 0
        return sum(t.nbytes for t in ins if isinstance(t, TensorType)) + sum(t.nbytes for t in outs)


OPS: dict[str, OpDef] = {}

# products: an input these ops save is needed only for the other inputs' gradients (d(a*b)/db
# = a), so it is saved only when another input requires a gradient (the cost model's rule)
SAVES_FOR_OTHERS = frozenset({"mul", "mm", "bmm"})


def _op(name, group, inputs, attrs=None, infer=None, flops=None, saves=(), bwd_factor=1.0, doc=""):
    OPS[name] = OpDef(name, group, tuple(inputs), dict(attrs or {}), infer, flops, tuple(saves),
                      bwd_factor, doc)


# ---- shape rules ---------------------------------------------------------------------------------

def _tensors(ins):
    return [t for t in ins if isinstance(t, TensorType)]


def _dim(d: int, rank: int) -> int:
    if not -rank <= d < max(rank, 1):
        raise ValueError(f"dim {d} out of range for rank {rank}")
    return d % rank if rank else 0


def _same(ins, a):
    return [_tensors(ins)[0]]


def _elementwise(ins, a):
    ts = _tensors(ins)
    shape = ts[0].shape
    for t in ts[1:]:
        shape = broadcast_shapes(shape, t.shape)
    dtype = ts[0].dtype
    for t in ts[1:]:
        if t.dtype != dtype and t.shape != ():
            raise ValueError(f"dtype mismatch {dtype} vs {t.dtype}")
    return [TensorType(dtype, shape)]


def _compare(ins, a):
    return [TensorType("bool", _elementwise(ins, a)[0].shape)]


def _where(ins, a):
    ts = _tensors(ins)
    shape = ts[0].shape
    for t in ts[1:]:
        shape = broadcast_shapes(shape, t.shape)
    vals = [t for t in ins[1:] if isinstance(t, TensorType)]
    return [TensorType(vals[0].dtype if vals else "f32", shape)]


def _reduce(ins, a):
    x = ins[0]
    dims = {_dim(d, x.rank) for d in (a["dims"] if a["dims"] is not None else range(x.rank))}
    if a["keepdim"]:
        shape = tuple(1 if i in dims else s for i, s in enumerate(x.shape))
    else:
        shape = tuple(s for i, s in enumerate(x.shape) if i not in dims)
    return [TensorType(x.dtype, shape)]


def _reshape(ins, a):
    x, shape = ins[0], list(a["shape"])
    if shape.count(-1) > 1:
        raise ValueError("at most one -1 in reshape")
    if -1 in shape:
        known = math.prod(s for s in shape if s != -1)
        shape[shape.index(-1)] = x.numel // known if known else 0
    if math.prod(shape) != x.numel:
        raise ValueError(f"cannot reshape {list(x.shape)} to {list(a['shape'])}")
    return [TensorType(x.dtype, tuple(shape))]


def _permute(ins, a):
    x = ins[0]
    dims = [_dim(d, x.rank) for d in a["dims"]]
    if sorted(dims) != list(range(x.rank)):
        raise ValueError(f"permute dims {a['dims']} are not a permutation of rank {x.rank}")
    return [TensorType(x.dtype, tuple(x.shape[d] for d in dims))]


def _transpose(ins, a):
    x = ins[0]
    d0, d1 = _dim(a["dim0"], x.rank), _dim(a["dim1"], x.rank)
    s = list(x.shape)
    s[d0], s[d1] = s[d1], s[d0]
    return [TensorType(x.dtype, tuple(s))]


def _expand(ins, a):
    x, shape = ins[0], list(a["shape"])
    off = len(shape) - x.rank
    out = [x.shape[i - off] if s == -1 else s for i, s in enumerate(shape)]
    for i in range(x.rank):
        if x.shape[i] not in (1, out[i + off]):
            raise ValueError(f"cannot expand {list(x.shape)} to {shape}")
    return [TensorType(x.dtype, tuple(out))]


def _slice_bounds(size, start, end, step):
    start = 0 if start is None else start
    end = size if end is None else end
    if start < 0:
        start += size
    if end < 0:
        end += size
    start, end = max(0, min(start, size)), max(0, min(end, size))
    return start, end, step


def _slice(ins, a):
    x = ins[0]
    d = _dim(a["dim"], x.rank)
    start, end, step = _slice_bounds(x.shape[d], a["start"], a["end"], a["step"])
    s = list(x.shape)
    s[d] = max(0, (end - start + step - 1) // step)
    return [TensorType(x.dtype, tuple(s))]


def _select(ins, a):
    x = ins[0]
    d = _dim(a["dim"], x.rank)
    return [TensorType(x.dtype, x.shape[:d] + x.shape[d + 1:])]


def _cat(ins, a):
    ts = _tensors(ins)
    d = _dim(a["dim"], ts[0].rank)
    s = list(ts[0].shape)
    s[d] = sum(t.shape[d] for t in ts)
    return [TensorType(ts[0].dtype, tuple(s))]


def _split(ins, a):
    x = ins[0]
    d = _dim(a["dim"], x.rank)
    outs = []
    for n in a["sizes"]:
        s = list(x.shape)
        s[d] = n
        outs.append(TensorType(x.dtype, tuple(s)))
    if sum(a["sizes"]) != x.shape[d]:
        raise ValueError(f"split sizes {a['sizes']} do not sum to {x.shape[d]}")
    return outs


def _mm(ins, a):
    x, y = ins
    if x.rank != 2 or y.rank != 2 or x.shape[1] != y.shape[0]:
        raise ValueError(f"mm of {list(x.shape)} and {list(y.shape)}")
    return [TensorType(x.dtype, (x.shape[0], y.shape[1]))]


def _bmm(ins, a):
    x, y = ins
    if x.rank != 3 or y.rank != 3 or x.shape[0] != y.shape[0] or x.shape[2] != y.shape[1]:
        raise ValueError(f"bmm of {list(x.shape)} and {list(y.shape)}")
    return [TensorType(x.dtype, (x.shape[0], x.shape[1], y.shape[2]))]

def _argmax(ins, a):
    x = ins[0]
    if a["dim"] is None:
        return [TensorType("i64", (1,) * x.rank if a["keepdim"] else ())]
    d = _dim(a["dim"], x.rank)
    shape = tuple(1 if i == d else s for i, s in enumerate(x.shape)) if a["keepdim"] else \
        tuple(s for i, s in enumerate(x.shape) if i != d)
    return [TensorType("i64", shape)]


def _cumsum(ins, a):
    x = ins[0]
    _dim(a["dim"], x.rank)
    dtype = a["dtype"] or (x.dtype if DTYPE_TABLE[x.dtype].is_float else "i64")
    return [TensorType(dtype, x.shape)]


def _index_shape(x: TensorType, dims: list, index_shapes: list) -> tuple:
    """Result shape of advanced indexing x[..., i0, ..., i1, ...] with index tensors at `dims`
    (NumPy's and torch's rule): the broadcast index shape replaces the indexed dims in place
    when they are adjacent, else it comes first."""
    if len(dims) != len(index_shapes) or not dims:
        raise ValueError(f"{len(index_shapes)} index tensor(s) for dims {dims}")
    dims = [_dim(d, x.rank) for d in dims]
    if sorted(dims) != dims or len(set(dims)) != len(dims):
        raise ValueError(f"index dims {dims} must be increasing")
    b = ()
    for sh in index_shapes:
        b = broadcast_shapes(b, sh)
    rest = [s for i, s in enumerate(x.shape) if i not in dims]
    if dims == list(range(dims[0], dims[-1] + 1)):
        return x.shape[:dims[0]] + b + x.shape[dims[-1] + 1:]
    return b + tuple(rest)


def _index(ins, a):
    x, idx = ins[0], _tensors(ins[1:])
    for t in idx:
        if DTYPE_TABLE[t.dtype].kind != "int":
            raise ValueError(f"index tensors must be integers (got {t.dtype})")
    return [TensorType(x.dtype, _index_shape(x, list(a["dims"]), [t.shape for t in idx]))]


def _index_put(ins, a):
    x, values, idx = ins[0], ins[1], _tensors(ins[2:])
    target = _index_shape(x, list(a["dims"]), [t.shape for t in idx])
    if isinstance(values, TensorType) and broadcast_shapes(target, values.shape) != target:
        raise ValueError(f"values {list(values.shape)} do not broadcast to {list(target)}")
    return [x]


def _gather(ins, a):
    x, index = ins
    d = _dim(a["dim"], x.rank)
    if index.rank != x.rank or any(index.shape[i] > x.shape[i] for i in range(x.rank) if i != d):
        raise ValueError(f"gather index {list(index.shape)} does not fit {list(x.shape)} (dim {d})")
    return [TensorType(x.dtype, index.shape)]


def _scatter(ins, a):
    x, index, src = ins
    _dim(a["dim"], x.rank)
    if index.rank != x.rank:
        raise ValueError(f"scatter index rank {index.rank} differs from the input's {x.rank}")
    return [x]


def _sort(ins, a):
    x = ins[0]
    _dim(a["dim"], x.rank)
    return [x, TensorType("i64", x.shape)]


def _histc(ins, a):
    if a["max"] <= a["min"]:
        raise ValueError(f"histc range [{a['min']}, {a['max']}] is empty")
    return [TensorType(ins[0].dtype, (a["bins"],))]


def _layer_norm(ins, a):
    x, n = ins[0], a["normalized_ndim"]
    if not 1 <= n <= x.rank:
        raise ValueError(f"layer_norm over {n} trailing dims of a rank-{x.rank} tensor")
    for t in ins[1:]:
        if isinstance(t, TensorType) and t.shape != x.shape[x.rank - n:]:
            raise ValueError(f"layer_norm weight/bias {list(t.shape)} differ from "
                             f"{list(x.shape[x.rank - n:])}")
    stat = TensorType(x.dtype, x.shape[:x.rank - n] + (1,) * n)
    return [x, stat, stat]


def _layer_norm_bwd(ins, a):
    x, n = ins[1], a["normalized_ndim"]
    w = TensorType(x.dtype, x.shape[x.rank - n:])
    return [x, w, w]


def _grouped_mm(ins, a):
    x, w, offs = ins
    if x.rank != 2 or w.rank != 3 or x.shape[1] != w.shape[1] or offs.shape != (w.shape[0],):
        raise ValueError(f"grouped_mm of {list(x.shape)}, {list(w.shape)} with offsets "
                         f"{list(offs.shape)}")
    return [TensorType(x.dtype, (x.shape[0], w.shape[2]))]


def _dropout(ins, a):
    x, seed = ins
    if seed.dtype != "i64" or seed.shape != (2,):
        raise ValueError(f"dropout seed must be i64[2] (seed, counter), got {seed}")
    if not 0.0 <= a["p"] < 1.0:
        raise ValueError(f"dropout p={a['p']} outside [0, 1)")
    return [x, TensorType("bool", x.shape)]


def _attention(ins, a):
    q, k, v = ins[:3]
    b, h, s, _ = q.shape
    if k.shape[:2] != v.shape[:2] or k.shape[0] != b or h % k.shape[1]:
        raise ValueError(f"attention q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}: "
                         "batch must match and query heads be a multiple of key/value heads")
    return [TensorType(q.dtype, q.shape[:-1] + (v.shape[-1],)), TensorType("f32", (b, h, s))]


def _attention_masked(ins, a):
    q, k, mask = ins[0], ins[1], ins[3]
    full = q.shape[:-1] + (k.shape[-2],)
    if broadcast_shapes(full, mask.shape) != full:
        raise ValueError(f"attention mask {list(mask.shape)} does not broadcast to {list(full)}")
    if mask.dtype != "bool" and mask.dtype != q.dtype:
        raise ValueError(f"attention mask must be bool or {q.dtype}, got {mask.dtype}")
    return _attention(ins, a)


def _attention_bwd(ins, a):
    return [ins[1], ins[2], ins[3]]


def _embedding(ins, a):
    w, ids = ins
    return [TensorType(w.dtype, ids.shape + (w.shape[1],))]


def _embedding_bwd(ins, a):
    g = ins[0]
    return [TensorType(g.dtype, (a["num_weights"], g.shape[-1]))]


def _nll_loss(ins, a):
    logp = ins[0]
    shape = () if a["reduction"] != "none" else logp.shape[:1]
    return [TensorType(logp.dtype, shape), TensorType(logp.dtype, ())]


def _nll_loss_bwd(ins, a):
    return [ins[1]]


def _cast(ins, a):
    if a["dtype"] not in DTYPES:
        raise ValueError(f"unknown dtype {a['dtype']}")
    return [TensorType(a["dtype"], ins[0].shape)]


def _full(ins, a):
    return [TensorType(a["dtype"], tuple(a["shape"]))]


def _topk(ins, a):
    x = ins[0]
    d = _dim(a["dim"], x.rank)
    s = list(x.shape)
    s[d] = a["k"]
    return [TensorType(x.dtype, tuple(s)), TensorType("i64", tuple(s))]


def _one_hot(ins, a):
    return [TensorType("i64", ins[0].shape + (a["num_classes"],))]


def _tril(ins, a):
    return [ins[0]]


def _arange(ins, a):
    return [TensorType(a["dtype"], (len(range(a["start"], a["end"], a["step"])),))]


def _conv_pads(x: TensorType, w: TensorType, a) -> tuple[int, int, int]:
    """(left pad, right pad, output length) of depthwise_conv1d; a left pad of None is k-1."""
    k = w.shape[1]
    left = k - 1 if a["pad_left"] is None else a["pad_left"]
    right = a["pad_right"]
    if left < 0 or right < 0:
        raise ValueError(f"depthwise_conv1d pads ({left}, {right}) must be >= 0")
    return left, right, x.shape[2] + left + right - k + 1


def _depthwise_conv1d(ins, a):
    x, w, bias = ins
    if x.rank != 3 or w.rank != 2 or w.shape[0] != x.shape[1]:
        raise ValueError(f"depthwise_conv1d of x {list(x.shape)} ([b, c, l]) with weight "
                         f"{list(w.shape)} ([c, k])")
    if isinstance(bias, TensorType) and bias.shape != (x.shape[1],):
        raise ValueError(f"depthwise_conv1d bias {list(bias.shape)}, expected [{x.shape[1]}]")
    out = _conv_pads(x, w, a)[2]
    if out < 1:
        raise ValueError(f"depthwise_conv1d of length {x.shape[2]} with kernel {w.shape[1]} "
                         "has no output")
    return [TensorType(x.dtype, (x.shape[0], x.shape[1], out))]


def _depthwise_conv1d_bwd(ins, a):
    g, x, w = ins
    if _depthwise_conv1d([x, w, None], a)[0].shape != g.shape:
        raise ValueError(f"depthwise_conv1d_bwd grad {list(g.shape)} does not fit x "
                         f"{list(x.shape)} and weight {list(w.shape)}")
    return [x, w, TensorType(w.dtype, (w.shape[0],))]


def _selective_scan(ins, a):
    u, delta, A, B, C = ins
    if u.rank != 3 or delta.shape != u.shape:
        raise ValueError(f"selective_scan u {list(u.shape)} and delta {list(delta.shape)} must "
                         "both be [b, d, l]")
    b, d, l = u.shape
    if A.rank != 2 or A.shape[0] != d:
        raise ValueError(f"selective_scan A {list(A.shape)}, expected [{d}, n]")
    n = A.shape[1]
    if B.rank != 4 or B.shape != C.shape or B.shape[0] != b or B.shape[2:] != (n, l) \
            or d % B.shape[1]:
        raise ValueError(f"selective_scan B {list(B.shape)} and C {list(C.shape)} must be "
                         f"[{b}, g, {n}, {l}] with g dividing {d}")
    if len({t.dtype for t in ins}) != 1:
        raise ValueError(f"selective_scan inputs of mixed dtypes {[t.dtype for t in ins]}")
    return [u]


def _selective_scan_bwd(ins, a):
    if ins[0].shape != ins[1].shape:
        raise ValueError(f"selective_scan_bwd grad {list(ins[0].shape)} differs from u "
                         f"{list(ins[1].shape)}")
    _selective_scan(ins[1:], a)
    return list(ins[1:])


# ---- cost rules ----------------------------------------------------------------------------------

def _numel_out(ins, outs, a):
    return sum(t.numel for t in outs)


def _numel_in(ins, outs, a):
    return _tensors(ins)[0].numel


def _zero(ins, outs, a):
    return 0


# Matmul and attention FLOPs are h2ir's own formulas (a second copy of torch.utils.flop_counter's
# would make the FlopCounterMode cross-check in tests/test_frontend.py compare a formula with
# itself). An [m,k] @ [k,n] product does m*n*k multiply-adds: 2*m*n*k FLOPs (the standard count,
# e.g. Kaplan et al. 2020, arXiv 2001.08361, Sec. 2.1: "2 N FLOPs per token" for N matmul params).

def _matmul_flops(m: int, n: int, k: int, batch: int = 1) -> int:
    return 2 * batch * m * n * k


def _mm_flops(ins, outs, a):
    (m, k), (_, n) = ins[0].shape, ins[1].shape
    return _matmul_flops(m, n, k)


def _bmm_flops(ins, outs, a):
    (b, m, k), (_, _, n) = ins[0].shape, ins[1].shape
    return _matmul_flops(m, n, k, b)


def _attention_shapes(q, k, v):
    """(b*h, s_q, s_k, d_qk, d_v) of attention over q [b,h,s_q,d], k [b,h,s_k,d], v [b,h,s_k,d_v]."""
    *bh, s_q, d = q.shape
    return math.prod(bh), s_q, k.shape[-2], d, v.shape[-1]


def _attention_flops(ins, outs, a):
    """The two matmuls S = Q K^T and O = P V (FlashAttention-2, Dao 2023, arXiv 2307.08691,
    Sec. 4.1: 4 * seqlen^2 * head_dim * heads per sequence). The softmax is not counted, and the
    causal mask does not halve the count: dense, as torch's FlopCounterMode counts it."""
    bh, s_q, s_k, d, d_v = _attention_shapes(*ins[:3])
    return _matmul_flops(s_q, s_k, d, bh) + _matmul_flops(s_q, d_v, s_k, bh)


def _attention_bwd_flops(ins, outs, a):
    """The five matmuls of the backward (FlashAttention-2, Alg. 2): S = Q K^T recomputed,
    dV = P^T dO, dP = dO V^T, dQ = dS K, dK = dS^T Q — 2.5x the forward when d_v = d."""
    bh, s_q, s_k, d, d_v = _attention_shapes(*ins[1:4])
    return (_matmul_flops(s_q, s_k, d, bh)          # S = Q K^T
            + _matmul_flops(s_k, d_v, s_q, bh)      # dV = P^T dO
            + _matmul_flops(s_q, s_k, d_v, bh)      # dP = dO V^T
            + _matmul_flops(s_q, d, s_k, bh)        # dQ = dS K
            + _matmul_flops(s_k, d, s_q, bh))       # dK = dS^T Q


def _grouped_mm_flops(ins, outs, a):
    """Each row goes through exactly one expert: one [S,k] @ [k,n] worth of multiply-adds."""
    (m, k), n = ins[0].shape, ins[1].shape[2]
    return _matmul_flops(m, n, k)


def _grouped_mm_bwd_flops(ins, outs, a):
    return 2 * _grouped_mm_flops(ins[1:], outs, a)      # dX = dY W^T and dW = X^T dY per expert


def _conv_flops(ins, outs, a):
    """A multiply-add per output element and tap, and the bias."""
    k = ins[1].shape[1]
    return (2 * k + (1 if isinstance(ins[2], TensorType) else 0)) * outs[0].numel


def _conv_bwd_flops(ins, outs, a):
    """dx and dweight: a multiply-add per tap of every output gradient each; dbias: a sum."""
    g, k = ins[0], ins[2].shape[1]
    return (4 * k + 1) * g.numel


# The selective scan h[t] = exp(delta[t] A) h[t-1] + delta[t] u[t] B[t], y[t] = C[t] . h[t]
# (Gu & Dao 2023, arXiv 2312.00752, Alg. 2) does per state element (b, d, n) and step: delta*A,
# exp, (delta u)*B, the recurrence's multiply-add and the C contraction's: 7 FLOPs.
_SCAN_FWD = 7
# the backward re-runs the forward recurrence (5), scans the state gradients in reverse (3: C g
# and a multiply-add) and forms the input gradients: the decay's (h[t-1] a dh: 2), then a
# product and a sum over states or channels each for delta, u, A, B and C (10)
_SCAN_BWD = 20


def _scan_elements(u: TensorType, A: TensorType) -> int:
    return u.numel * A.shape[1]


def _scan_flops(ins, outs, a):
    return _SCAN_FWD * _scan_elements(ins[0], ins[2])


def _scan_bwd_flops(ins, outs, a):
    return _SCAN_BWD * _scan_elements(ins[1], ins[3])


def _norm_flops(ins, outs, a):
    return 8 * outs[0].numel     # mean, centre, square, mean, rsqrt, scale, weight, bias


def _softmax_flops(ins, outs, a):
    return 5 * outs[0].numel     # max, sub, exp, sum, div


# ---- the dropout op's random bits -----------------------------------------------------------------

# Counter-based, so every backend draws the same mask for the same (seed, counter) without
# sharing a generator's state: SplitMix64 (Steele, Lea, Flood 2014, "Fast splittable
# pseudorandom number generators"; the constants of Vigna's splitmix64.c). In uint64 arithmetic
# (wrapping):
#   mix(z)  = z ^= z >> 30; z *= M1; z ^= z >> 27; z *= M2; z ^ (z >> 31)
#   key     = mix(seed ^ mix(counter + GAMMA))
#   bits(i) = mix(key + (i + 1) * GAMMA) >> 40                  (24 bits per element)
#   keep(i) = bits(i) >= round(p * 2^24)                      (integer compare: no float rounding)
DROPOUT_RNG = {"gamma": 0x9E3779B97F4A7C15, "m1": 0xBF58476D1CE4E5B9, "m2": 0x94D049BB133111EB,
               "shifts": (30, 27, 31), "bits": 24}


# The program input dropout sites draw from: i64[2] = (run seed, micro-batch counter << 20); the
# lowering adds each site's 20-bit number, the executor supplies the input per micro-batch.
DROPOUT_SEED_INPUT = "rng.seed"


def dropout_seed(run_seed: int, step: int, replica: int, dp: int, microbatches: int, mb: int):
    """(seed, counter) of one micro-batch's dropout masks: a pure function of where it is in
    training, so a resumed run draws the masks the uninterrupted run drew."""
    return run_seed, (((step * dp + replica) * microbatches + mb) << 20)


def dropout_threshold(p: float) -> int:
    """The 24-bit integer threshold of keep(i) = bits(i) >= threshold."""
    return int(round(p * (1 << DROPOUT_RNG["bits"])))


# ---- the op set ----------------------------------------------------------------------------------

for _n, _s, _d in [
    ("neg", (), "-x"), ("exp", ("o0",), "e^x"), ("log", ("i0",), "ln x"), ("sqrt", ("o0",), "sqrt x"),
    ("rsqrt", ("o0",), "1/sqrt x"), ("tanh", ("o0",), "tanh x"), ("sigmoid", ("o0",), "1/(1+e^-x)"),
    ("relu", ("o0",), "max(x, 0)"), ("silu", ("i0",), "x * sigmoid(x)"),
    ("abs", ("i0",), "|x|"), ("log1p", ("i0",), "ln(1 + x)"), ("expm1", ("o0",), "e^x - 1"),
    ("reciprocal", ("o0",), "1/x"), ("sin", ("i0",), "sin x"), ("cos", ("i0",), "cos x"),
    ("logical_not", (), "not x"), ("bitwise_not", (), "~x (integers and bool)"),
    ("erf", ("i0",), "erf x"), ("atan", ("i0",), "arctan x"),
    ("sign", (), "-1, 0 or 1 (0 at 0)"),
]:
    _op(_n, Group.UNARY, ["x"], infer=_same, flops=_numel_out, saves=_s, doc=_d)
_op("gelu", Group.UNARY, ["x"], {"approximate": "none"}, infer=_same, flops=_numel_out,
    saves=("i0",), doc="x * Phi(x): erf form ('none') or the tanh approximation ('tanh')")
_op("copy", Group.UNARY, ["x"], infer=_same, flops=_zero, doc="a fresh copy of x")
_op("cast", Group.UNARY, ["x"], {"dtype": REQUIRED}, infer=_cast, flops=_zero, doc="convert dtype")
_op("pow", Group.UNARY, ["x"], {"exponent": REQUIRED}, infer=_same, flops=_numel_out, saves=("i0",),
    doc="x ** exponent")

for _n, _s, _d in [
    ("add", (), "a + b"), ("sub", (), "a - b"), ("mul", ("i0", "i1"), "a * b"),
    ("div", ("i0", "i1"), "a / b"), ("maximum", ("i0", "i1"), "max(a, b)"),
    ("minimum", ("i0", "i1"), "min(a, b)"),
]:
    _op(_n, Group.BINARY, ["a", "b"], infer=_elementwise, flops=_numel_out, saves=_s, doc=_d)
for _n, _s, _d in [
    ("power", ("i0", "i1"), "a ** b (either side may be a scalar: 10000 ** x)"),
    ("floor_divide", (), "floor(a / b)"),
    ("remainder", (), "a - floor(a / b) * b: the sign of b (Python's %)"),
    ("fmod", (), "a - trunc(a / b) * b: the sign of a (C's fmod)"),
    ("bitwise_and", (), "a & b (integers and bool)"),
    ("bitwise_or", (), "a | b (integers and bool)"), ("bitwise_xor", (), "a ^ b (integers and bool)"),
]:
    _op(_n, Group.BINARY, ["a", "b"], infer=_elementwise, flops=_numel_out, saves=_s, doc=_d)
for _n in ("eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_xor"):
    _op(_n, Group.BINARY, ["a", "b"], infer=_compare, flops=_numel_out, doc=f"elementwise {_n}")
_op("where", Group.TERNARY, ["cond", "a", "b"], infer=_where, flops=_numel_out, saves=("i0",),
    doc="cond ? a : b")

for _n in ("sum", "mean", "amax", "amin"):
    _op(_n, Group.REDUCE, ["x"], {"dims": None, "keepdim": False}, infer=_reduce, flops=_numel_in,
        doc=f"{_n} over dims (None: all)")

_op("argmax", Group.REDUCE, ["x"], {"dim": None, "keepdim": False}, infer=_argmax,
    flops=_numel_in, doc="index (i64) of the largest value along dim, the first of equals "
                         "(None: of the flattened tensor)")
_op("cumsum", Group.REDUCE, ["x"], {"dim": REQUIRED, "dtype": None}, infer=_cumsum,
    flops=_numel_in, doc="inclusive prefix sum along dim (dtype None: ints and bool sum in i64)")

_op("reshape", Group.MOVEMENT, ["x"], {"shape": REQUIRED}, infer=_reshape, flops=_zero)
_op("permute", Group.MOVEMENT, ["x"], {"dims": REQUIRED}, infer=_permute, flops=_zero)
_op("transpose", Group.MOVEMENT, ["x"], {"dim0": REQUIRED, "dim1": REQUIRED}, infer=_transpose,
    flops=_zero)
_op("expand", Group.MOVEMENT, ["x"], {"shape": REQUIRED}, infer=_expand, flops=_zero)
_op("slice", Group.MOVEMENT, ["x"], {"dim": REQUIRED, "start": None, "end": None, "step": 1},
    infer=_slice, flops=_zero)
_op("select", Group.MOVEMENT, ["x"], {"dim": REQUIRED, "index": REQUIRED}, infer=_select, flops=_zero)
_op("flip", Group.MOVEMENT, ["x"], {"dims": REQUIRED}, infer=_same, flops=_zero,
    doc="x reversed along dims")
_op("cat", Group.MOVEMENT, ["xs*"], {"dim": 0}, infer=_cat, flops=_zero, doc="concatenate along dim")
_op("split", Group.MOVEMENT, ["x"], {"dim": REQUIRED, "sizes": REQUIRED}, infer=_split, flops=_zero,
    doc="split into pieces of the given sizes (one output each)")

_op("mm", Group.MATMUL, ["a", "b"], infer=_mm, flops=_mm_flops, saves=("i0", "i1"), bwd_factor=2.0,
    doc="[m,k] @ [k,n]")
_op("bmm", Group.MATMUL, ["a", "b"], infer=_bmm, flops=_bmm_flops, saves=("i0", "i1"), bwd_factor=2.0,
    doc="[b,m,k] @ [b,k,n]")
_op("attention", Group.ATTENTION, ["q", "k", "v"], {"causal": False, "scale": None}, infer=_attention,
    flops=_attention_flops, saves=("i0", "i1", "i2", "o0", "o1"), bwd_factor=2.5,
    doc="softmax(q k^T * scale [+ causal mask]) v over [b,h,s,d]; outputs (out, logsumexp). "
        "k and v may have fewer heads than q (grouped-query attention: query head i reads "
        "key/value head i // (h_q / h_kv))")
_op("attention_masked", Group.ATTENTION, ["q", "k", "v", "mask"], {"causal": False, "scale": None},
    infer=_attention_masked, flops=_attention_flops, saves=("i0", "i1", "i2", "i3", "o0", "o1"),
    bwd_factor=2.5,
    doc="attention with a mask tensor broadcastable to [b,h,s_q,s_k]: bool (true = attend) or "
        "additive in q's dtype (0 / -inf); the causal flag, scale and grouped-query heads as "
        "attention")

_op("grouped_mm", Group.MATMUL, ["x", "w", "offsets"], infer=_grouped_mm, flops=_grouped_mm_flops,
    saves=("i0", "i1", "i2"), bwd_factor=2.0,
    doc="rows offsets[e-1]:offsets[e] of x [S,k] times w[e] [k,n] (experts' tokens sorted by "
        "expert); rows past offsets[-1] are 0")

_op("softmax", Group.NN, ["x"], {"dim": REQUIRED}, infer=_same, flops=_softmax_flops, saves=("o0",))
_op("log_softmax", Group.NN, ["x"], {"dim": REQUIRED}, infer=_same, flops=_softmax_flops,
    saves=("o0",))
_op("tril", Group.NN, ["x"], {"diagonal": 0}, infer=_tril, flops=_zero, doc="lower triangle, rest 0")
_op("topk", Group.NN, ["x"], {"k": REQUIRED, "dim": -1}, infer=_topk, flops=_numel_in,
    doc="(values, indices) of the k largest along dim, largest first")
_op("sort", Group.NN, ["x"], {"dim": -1, "descending": False}, infer=_sort, flops=_numel_in,
    doc="(values, indices) sorted along dim; stable: equal keys keep their order")
_op("histc", Group.NN, ["x"], {"bins": REQUIRED, "min": REQUIRED, "max": REQUIRED}, infer=_histc,
    flops=_numel_in, doc="counts of x in `bins` equal-width bins over [min, max] (x = max falls "
                         "in the last bin; values outside are not counted), in x's dtype")
_op("layer_norm", Group.NN, ["x", "weight", "bias"], {"normalized_ndim": 1, "eps": 1e-5},
    infer=_layer_norm, flops=_norm_flops, saves=("i0", "i1", "o1", "o2"), bwd_factor=2.0,
    doc="(x - mean) * rstd * weight + bias over the last normalized_ndim dims; weight and bias "
        "may be none; outputs (out, mean, rstd), mean/rstd with the normalized dims kept as 1")
_op("dropout", Group.NN, ["x", "seed"], {"p": REQUIRED}, infer=_dropout, flops=_numel_out,
    saves=("o1",),
    doc="(x * keep / (1 - p), keep): keep[i] from the counter-based hash DROPOUT_RNG of "
        "(seed[0], seed[1], i), i the row-major element index — the same bits on every backend")
_op("one_hot", Group.NN, ["ids"], {"num_classes": REQUIRED}, infer=_one_hot, flops=_zero)

_op("depthwise_conv1d", Group.SEQUENCE, ["x", "weight", "bias"], {"pad_left": None, "pad_right": 0},
    infer=_depthwise_conv1d, flops=_conv_flops, saves=("i0", "i1"), bwd_factor=2.0,
    doc="out[b,c,t] = bias[c] + sum_j weight[c,j] x[b,c,t+j-pad_left] over x [b,c,l] padded "
        "with zeros (weight [c,k]; bias may be none); out length l + pad_left + pad_right - k "
        "+ 1. pad_left None is k-1: with pad_right 0 the causal convolution of Mamba's mixers "
        "and gated-convolution blocks (step t reads steps t-k+1 .. t)")
_op("selective_scan", Group.SEQUENCE, ["u", "delta", "A", "B", "C"], infer=_selective_scan,
    flops=_scan_flops, saves=("i0", "i1", "i2", "i3", "i4"), bwd_factor=_SCAN_BWD / _SCAN_FWD,
    doc="Mamba's selective scan over u, delta [b,d,l], A [d,n], B, C [b,g,n,l] (channel i "
        "reads group i // (d/g)): from h = 0, h[b,i,:,t] = exp(delta[b,i,t] A[i,:]) h[b,i,:,t-1] "
        "+ delta[b,i,t] u[b,i,t] B[b,g,:,t] and y[b,i,t] = sum_n C[b,g,n,t] h[b,i,n,t]. Mamba-2's "
        "scalar-A heads are the case A[i,:] = A[head]. Skip term, gate, delta's bias and "
        "softplus are ordinary ops around it")
_op("embedding", Group.INDEX, ["weight", "ids"], infer=_embedding, flops=_zero, saves=("i1",),
    doc="weight[ids]")
_op("index", Group.INDEX, ["x", "indices*"], {"dims": REQUIRED}, infer=_index, flops=_zero,
    saves=("i1", "i2", "i3"),
    doc="advanced indexing x[..., i0, ..., i1, ...]: integer index tensors (broadcast together) "
        "at the increasing `dims`, NumPy's placement rule")
_op("index_put", Group.INDEX, ["x", "values", "indices*"], {"dims": REQUIRED, "accumulate": False},
    infer=_index_put, flops=_numel_in, saves=("i2", "i3", "i4"),
    doc="a copy of x with x[indices at dims] = values (accumulate: +=, duplicates summed)")
_op("gather", Group.INDEX, ["x", "index"], {"dim": REQUIRED}, infer=_gather, flops=_zero,
    saves=("i1",), doc="out[..i..] = x[..index[..i..]..] along dim (torch.gather)")
_op("scatter", Group.INDEX, ["x", "index", "src"], {"dim": REQUIRED}, infer=_scatter, flops=_zero,
    saves=("i1",), doc="a copy of x with x[..index[..i..]..] = src[..i..] (src may be a scalar)")
_op("scatter_add", Group.INDEX, ["x", "index", "src"], {"dim": REQUIRED}, infer=_scatter,
    flops=_numel_in, saves=("i1",), doc="a copy of x with src added at index along dim")
_op("nll_loss", Group.LOSS, ["logp", "target"], {"reduction": "mean", "ignore_index": -100},
    infer=_nll_loss, flops=_numel_in, saves=("i1", "o1"),
    doc="negative log-likelihood over the last dim; outputs (loss, total_weight)")

_op("full", Group.CREATION, [], {"shape": REQUIRED, "value": REQUIRED, "dtype": "f32"}, infer=_full,
    flops=_zero)
_op("arange", Group.CREATION, [], {"start": 0, "end": REQUIRED, "step": 1, "dtype": "i64"},
    infer=_arange, flops=_zero)

# Fused backward kernels that AOTAutograd emits (so backends can implement them natively).
_op("silu_bwd", Group.GRAD, ["grad", "x"], infer=lambda i, a: [i[0]], flops=_numel_out,
    doc="grad * d silu(x)/dx")
_op("softmax_bwd", Group.GRAD, ["grad", "out"], {"dim": REQUIRED}, infer=lambda i, a: [i[0]],
    flops=_numel_out)
_op("log_softmax_bwd", Group.GRAD, ["grad", "out"], {"dim": REQUIRED}, infer=lambda i, a: [i[0]],
    flops=_numel_out)
_op("attention_bwd", Group.GRAD, ["grad", "q", "k", "v", "out", "lse"], {"causal": False, "scale": None},
    infer=_attention_bwd, flops=_attention_bwd_flops, doc="(grad_q, grad_k, grad_v)")
_op("gelu_bwd", Group.GRAD, ["grad", "x"], {"approximate": "none"}, infer=lambda i, a: [i[0]],
    flops=_numel_out, doc="grad * d gelu(x)/dx (erf form or tanh approximation)")
_op("layer_norm_bwd", Group.GRAD, ["grad", "x", "mean", "rstd", "weight", "bias"],
    {"normalized_ndim": 1}, infer=_layer_norm_bwd, flops=_norm_flops,
    doc="(grad_x, grad_weight, grad_bias) of layer_norm (weight none: as ones)")
_op("attention_masked_bwd", Group.GRAD, ["grad", "q", "k", "v", "out", "lse", "mask"],
    {"causal": False, "scale": None}, infer=_attention_bwd, flops=_attention_bwd_flops,
    doc="(grad_q, grad_k, grad_v) of attention_masked")
_op("grouped_mm_bwd", Group.GRAD, ["grad", "x", "w", "offsets"], infer=lambda i, a: [i[1], i[2]],
    flops=_grouped_mm_bwd_flops, doc="(grad_x, grad_w) of grouped_mm")
_op("embedding_bwd", Group.GRAD, ["grad", "ids"], {"num_weights": REQUIRED, "padding_idx": -1},
    infer=_embedding_bwd, flops=lambda i, o, a: i[0].numel,
    doc="scatter-add of grad rows into a [num_weights, d] table; row padding_idx (if >= 0) "
        "stays 0")
_op("slice_bwd", Group.GRAD, ["grad"], {"shape": REQUIRED, "dim": REQUIRED, "start": None,
                                        "end": None, "step": 1},
    infer=lambda i, a: [TensorType(i[0].dtype, tuple(a["shape"]))], flops=_zero,
    doc="zeros of `shape` with grad written into the slice (the gradient of `slice`)")
_op("depthwise_conv1d_bwd", Group.GRAD, ["grad", "x", "weight"], {"pad_left": None, "pad_right": 0},
    infer=_depthwise_conv1d_bwd, flops=_conv_bwd_flops,
    doc="(grad_x, grad_weight, grad_bias) of depthwise_conv1d")
_op("selective_scan_bwd", Group.GRAD, ["grad", "u", "delta", "A", "B", "C"],
    infer=_selective_scan_bwd, flops=_scan_bwd_flops,
    doc="(grad_u, grad_delta, grad_A, grad_B, grad_C) of selective_scan; the states are "
        "recomputed, not saved")
_op("nll_loss_bwd", Group.GRAD, ["grad", "logp", "target", "total_weight"],
    {"reduction": "mean", "ignore_index": -100}, infer=_nll_loss_bwd, flops=_numel_out)

# Communication as graph nodes: what a stage program does at its edges when collectives are
# fused into programs (tensor/expert parallelism on the roadmap). Shape-preserving.
_op("send", Group.COMM, ["x"], {"peer": REQUIRED, "tag": ""}, infer=lambda i, a: [], flops=_zero)
_op("recv", Group.COMM, [], {"peer": REQUIRED, "tag": "", "dtype": "f32", "shape": REQUIRED},
    infer=_full, flops=_zero)
_op("all_reduce", Group.COMM, ["x"], {"group": REQUIRED, "op": "sum"}, infer=_same, flops=_zero)
_op("all_to_all", Group.COMM, ["x"], {"group": REQUIRED, "split_dim": 0}, infer=_same, flops=_zero)
# Tensor parallelism inside a stage program (frontend/tensor_parallel.py; Megatron-LM, Shoeybi et
# al. 2019, Sec. 3): every rank of the stage's TP group runs the same program, and these ops
# are the points where the ranks meet. `size` is the TP group's size; the worker supplies the
# group (backends/base.py run_program's comm hook).
_op("tp_all_reduce", Group.COMM, ["x"], {"size": REQUIRED, "reduce": "sum"}, infer=_same, flops=_zero,
    doc="the sum (reduce='sum') or maximum (reduce='max') of x over the stage's TP group, on "
        "every rank")
_op("tp_rank", Group.COMM, [], {"size": REQUIRED},
    infer=lambda i, a: [TensorType("i64", ())], flops=_zero,
    doc="this worker's rank in its TP group (0 .. size-1), an i64 scalar")

# Expert parallelism inside a stage program (frontend/moe.py; Piper, arXiv 2605.05049): the
# dispatch buffer's experts leave for the EP rank holding them and come back. Dispatch and
# combine themselves are ordinary ops (one_hot, cumsum, index_add, index_select, bmm), so every
# backend runs them and AOTAutograd derives their backward.
_op("ep_all_to_all", Group.COMM, ["x"], {"size": REQUIRED}, infer=_same, flops=_zero,
    doc="dim 0 split into `size` equal chunks, chunk j sent to rank j of the stage's EP group; "
        "the result's chunk r is what rank r sent (its own inverse)")
_op("moe_aux_scale", Group.COMM, [], infer=lambda i, a: [TensorType("f32", ())], flops=_zero,
    doc="this micro-batch's loss-gradient scale (the worker's 1/m), an f32 scalar: the "
        "weight of a router's auxiliary loss in the backward")
_op("moe_stats", Group.COMM, ["x", "counts"], {"capacity": REQUIRED, "layer": REQUIRED},
    infer=lambda i, a: [i[0]], flops=_zero,
    doc="x unchanged; the runtime records `counts` (tokens routed to each expert of MoE layer "
        "`layer`, before dropping) and the layer's expert capacity")


def comm_volume(op: str, ins: list, attrs: dict) -> tuple[str, int, int] | None:
    """(collective, payload bytes, group size) of a TP comm node, for the cost model's link
    times (h2ir/planner/resource/); None for ops that move no data."""
    if op == "tp_all_reduce":
        return "all_reduce", ins[0].nbytes, attrs["size"]
    if op == "ep_all_to_all":
        return "all_to_all", ins[0].nbytes, attrs["size"]
    return None


def get(name: str) -> OpDef:
    return OPS[name]


def in_group(name: str, *groups: Group) -> bool:
    return OPS[name].group in groups


def missing_ops(used: set[str], implemented: set[str]) -> set[str]:
    """Ops a program uses that a backend lacks (a backend is a table over this op set)."""
    return set(used) - set(implemented)
