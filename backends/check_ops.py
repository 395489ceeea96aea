"""`h2c check-ops`: op-level accuracy of a backend against an independent float64 reference.

H2's bottom-up accuracy alignment (DiTorch, arXiv 2505.17548, Sec. 3.1) starts at the single
operator: before a chip trains anything, every kernel of its op library must agree with a trusted
reference on fresh random inputs. For every op of the h2ir op set that a backend implements
(COMM and MOE ops are executed by the runtime, not by kernels), this module

1. draws inputs from the op's spec below (seeded per op; realistic shapes; valid indices for
   embedding/nll_loss; positive inputs for log/sqrt/rsqrt; distinct values for topk),
2. rounds the floating inputs to the dtype under test and runs the backend's kernel on them,
3. runs the same op on the *rounded* inputs in float64 in a library other than the one under
   test, so the error measured is the kernel's, not the inputs' quantisation, and a wrong kernel
   cannot agree with itself: the torch backend is checked against the NumPy backend's kernels
   ("numpy-f64"), the NumPy backend against torch eager calling the ATen function itself, e.g.
   `_scaled_dot_product_flash_attention_for_cpu` ("torch-f64", REFERENCE below). An op the NumPy
   backend lacks falls back to torch-f64 and is reported with `reference_independent: false`,
4. compares with allclose semantics: |out - ref| <= atol + rtol * |ref| per element, with the
   tolerances of TOLERANCE (integer and bool results must match exactly), and checks each result's
   shape and dtype against the op set's type rule.

Reported errors: max abs error over all elements; max rel error |out - ref| / |ref| over the
elements with |ref| > atol (near zero the absolute tolerance is what applies).
"""
from __future__ import annotations

import argparse
import json
import operator
import sys
import zlib
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from h2ir import opset
from h2ir.errors import SEED_MAX, H2Error, int_flag
from h2ir.opset import Group
from h2ir.types import DTYPE_TABLE, FLOAT_DTYPES, TensorType, dtype_of_host

aten = torch.ops.aten

# float dtype (h2ir.types.FLOAT_DTYPES) -> (atol, rtol); integer and bool results match exactly.
# fp32 is DIOPI's (atol = rtol = 1e-5). bf16/f16 take torch.testing's
# default rtol for the dtype (1.6e-2, 1e-3) with atol raised to the same order: kernels on those
# chips accumulate in f32 but round every result, so an O(1) result that cancels to ~0 keeps
# about one ulp of 1.0 (2^-8 = 3.9e-3 for bf16, 2^-11 = 4.9e-4 for f16) as absolute error.
# f64 kernels should agree with the f64 reference to round-off: 1e-10 leaves room for
# reductions over a few thousand terms and NumPy's own erf.
TOLERANCE = {"f64": (1e-10, 1e-10), "f32": (1e-5, 1e-5), "f16": (1e-3, 1e-3),
             "bf16": (1e-2, 1.6e-2)}
EXCLUDED_GROUPS = (Group.COMM, Group.MOE)      # executed by the runtime and DiComm


# The float64 references, by the library that computes them. A backend is checked against the
# other library's (its own would share the kernel's code and any bug in it).
REFERENCES = {"numpy-f64": "the numpy backend's kernels in float64",
              "torch-f64": "torch eager (ATen) in float64"}
_LIBRARY = {"numpy-f64": "numpy", "torch-f64": "torch"}


def reference_for(backend_name: str) -> str:
    """The default reference of a backend: the numpy kernels for torch, torch for the rest."""
    return "numpy-f64" if backend_name == "torch" else "torch-f64"


def _torch_dtype(h2: str) -> torch.dtype:
    return getattr(torch, DTYPE_TABLE[h2].torch)


def checked_ops() -> list[str]:
    """The ops a backend's kernel library is meant to cover (the coverage denominator)."""
    return [n for n, d in opset.OPS.items() if d.group not in EXCLUDED_GROUPS]


# ---- input specs ---------------------------------------------------------------------------------

@dataclass
class Arg:
    """A tensor input. dtype None: the dtype under test (data is float64 before rounding)."""
    data: np.ndarray
    dtype: str | None = None


@dataclass
class Case:
    inputs: list
    attrs: dict = field(default_factory=dict)


class Draw:
    """Random inputs for one op (one seeded generator per op, so specs are order-independent)."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)

    def normal(self, *shape, scale=1.0) -> Arg:
        return Arg(self.rng.standard_normal(shape) * scale)

    def positive(self, *shape, low=0.1, high=4.0) -> Arg:
        return Arg(self.rng.uniform(low, high, shape))

    def away_from_zero(self, *shape) -> Arg:
        return Arg(self.rng.uniform(0.5, 2.0, shape) * self.rng.choice([-1.0, 1.0], shape))

    def ids(self, high: int, *shape) -> Arg:
        return Arg(self.rng.integers(0, high, shape).astype(np.int64), "i64")

    def mask(self, *shape, p=0.5) -> Arg:
        return Arg(self.rng.random(shape) < p, "bool")

    def distinct(self, *shape, dim=-1) -> Arg:
        """Values distinct along `dim` (a random permutation of 0..n-1 there, n <= 256), scaled to
        multiples of 1/8: exact in bf16 (8 significant bits), so rounding makes no ties."""
        perm = np.argsort(self.rng.random(shape), axis=dim)
        return Arg(perm / 8.0 - shape[dim] / 16.0)

    def near(self, a: Arg, p=0.3) -> Arg:
        """Like `a` but a fraction p of entries equal to a's (so eq/ge/le see ties)."""
        b = self.rng.standard_normal(a.data.shape)
        return Arg(np.where(self.rng.random(a.data.shape) < p, a.data, b))


def _log_softmax64(x: np.ndarray, dim=-1) -> np.ndarray:
    return torch.log_softmax(torch.from_numpy(x), dim).numpy()


def _attention64(q, k, v, causal, scale):
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
        torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v), 0.0, causal, scale=scale)
    return out.numpy(), lse.numpy()


def _additive64(mask):
    """A bool mask (true attends) as ATen's additive 0/-inf form; an additive mask as it is."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=torch.float64).masked_fill(~mask, -torch.inf)


def _attention_masked64(q, k, v, mask, causal, scale):
    return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal,
                                                            attn_mask=_additive64(mask),
                                                            scale=scale)


def _attention_masked_bwd64(g, q, k, v, o, lse, mask, causal, scale):
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(
        g, q, k, v, o, lse.to(torch.float64), 0.0, causal, attn_mask=_additive64(mask), scale=scale)


# h_kv < h: grouped-query attention (ATen's CPU flash kernel takes it as it is)
ATTENTION_CASES = [dict(b=2, h=4, h_kv=4, s=64, t=64, d=32, causal=True, scale=None),
                   dict(b=2, h=4, h_kv=4, s=64, t=64, d=32, causal=False, scale=0.3),
                   dict(b=1, h=2, h_kv=2, s=48, t=64, d=16, causal=True, scale=None),
                   dict(b=2, h=4, h_kv=2, s=32, t=32, d=16, causal=True, scale=None)]
# masks: bool [b,1,s,t] (true attends; the diagonal always, so no row is fully masked), additive
# [1,1,s,t] with finite values, and none beyond the causal flag
MASKED_ATTENTION_CASES = [dict(b=2, h=4, h_kv=2, s=32, t=32, d=16, causal=False, scale=None,
                               mask="bool"),
                          dict(b=2, h=4, h_kv=4, s=32, t=32, d=16, causal=True, scale=0.3,
                               mask="bool"),
                          dict(b=1, h=2, h_kv=1, s=24, t=32, d=16, causal=False, scale=None,
                               mask="additive")]


def _mask_arg(r: Draw, c: dict) -> Arg:
    if c["mask"] == "bool":
        m = r.rng.random((c["b"], 1, c["s"], c["t"])) < 0.6
        m[..., np.arange(c["s"]), np.arange(c["s"]) % c["t"]] = True
        return Arg(m, "bool")
    return Arg(r.rng.standard_normal((1, 1, c["s"], c["t"])))


def _attention_cases(r: Draw, backward: bool, masked: bool = False) -> list[Case]:
    cases = []
    for c in MASKED_ATTENTION_CASES if masked else ATTENTION_CASES:
        q = r.normal(c["b"], c["h"], c["s"], c["d"])
        k, v = (r.normal(c["b"], c["h_kv"], c["t"], c["d"]) for _ in range(2))
        mask = [_mask_arg(r, c)] if masked else []
        attrs = {"causal": c["causal"], "scale": c["scale"]}
        if not backward:
            cases.append(Case([q, k, v] + mask, attrs))
            continue
        m64 = torch.from_numpy(mask[0].data) if masked else None
        out, lse = (t.numpy() for t in _attention_masked64(
            *(torch.from_numpy(a.data) for a in (q, k, v)), m64, c["causal"], c["scale"]))
        grad = r.normal(*out.shape)
        cases.append(Case([grad, q, k, v, Arg(out), Arg(lse, "f32")] + mask, attrs))
    return cases


def _layer_norm_cases(r: Draw, backward: bool) -> list[Case]:
    cases = []
    for x, w, b, n in ((r.normal(4, 16, 64), r.normal(64), r.normal(64), 1),
                       (Arg(r.rng.standard_normal((8, 4, 8)) * 3 + 1), None, None, 2)):
        attrs = {"normalized_ndim": n}
        if not backward:
            cases.append(Case([x, w, b], {**attrs, "eps": 1e-5}))
            continue
        _, mean, rstd = aten.native_layer_norm(torch.from_numpy(x.data),
                                               list(x.data.shape[-n:]), None, None, 1e-5)
        cases.append(Case([r.normal(*x.data.shape), x, Arg(mean.numpy()), Arg(rstd.numpy()), w, b],
                          attrs))
    return cases


def _grouped_mm_cases(r: Draw, backward: bool) -> list[Case]:
    # expert 1's group is empty; rows 36.. are past the last offset (no expert: zeros)
    cases = []
    for offs in (Arg(np.array([10, 10, 25, 36]), "i64"), Arg(np.array([0, 40, 40, 40]), "i32")):
        x, w = r.normal(40, 32), r.normal(4, 32, 24)
        cases.append(Case([r.normal(40, 24), x, w, offs] if backward else [x, w, offs]))
    return cases


# depthwise_conv1d: causal with a bias, nn.Conv1d's equal pads (Mamba's conv before its slice)
# without one, and unequal pads
CONV_CASES = [dict(b=2, c=16, l=40, k=4, pads=(None, 0), bias=True),
              dict(b=2, c=8, l=33, k=4, pads=(3, 3), bias=False),
              dict(b=1, c=6, l=17, k=3, pads=(1, 2), bias=True)]


def _conv_cases(r: Draw, backward: bool) -> list[Case]:
    cases = []
    for c in CONV_CASES:
        x, w = r.normal(c["b"], c["c"], c["l"]), r.normal(c["c"], c["k"], scale=0.5)
        attrs = {"pad_left": c["pads"][0], "pad_right": c["pads"][1]}
        if not backward:
            cases.append(Case([x, w, r.normal(c["c"]) if c["bias"] else None], attrs))
            continue
        left = c["k"] - 1 if c["pads"][0] is None else c["pads"][0]
        m = c["l"] + left + c["pads"][1] - c["k"] + 1
        cases.append(Case([r.normal(c["b"], c["c"], m), x, w], attrs))
    return cases


# selective_scan: Mamba's (one group of B and C, A per channel and state) and Mamba-2's (groups
# of heads, A one value per head); delta as softplus gives it, A = -exp(A_log) as both init it
SCAN_CASES = [dict(b=2, d=16, n=8, l=40, g=1, head=1), dict(b=1, d=12, n=4, l=33, g=3, head=2)]


def _scan_cases(r: Draw, backward: bool) -> list[Case]:
    cases = []
    for c in SCAN_CASES:
        b, d, n, l, g = c["b"], c["d"], c["n"], c["l"], c["g"]
        A = -r.rng.uniform(0.5, 8.0, (d // c["head"], n)).repeat(c["head"], axis=0)
        ins = [r.normal(b, d, l), r.positive(b, d, l, low=0.01, high=0.5), Arg(A),
               r.normal(b, g, n, l), r.normal(b, g, n, l)]
        cases.append(Case(([r.normal(b, d, l)] if backward else []) + ins))
    return cases


def _perm_ids(r: Draw, n: int, k: int, rows: int | None = None) -> Arg:
    """Distinct indices < n (k per row): scatter targets without duplicates (whose winner is
    implementation-defined)."""
    if rows is None:
        return Arg(r.rng.permutation(n)[:k].astype(np.int64), "i64")
    return Arg(np.argsort(r.rng.random((rows, n)), axis=1)[:, :k].astype(np.int64), "i64")


def _dropout_cases(r: Draw) -> list[Case]:
    return [Case([r.normal(64, 128), Arg(np.array([1234, 7]), "i64")], {"p": 0.3}),
            Case([r.normal(3, 5, 67), Arg(np.array([-1, 2 ** 40]), "i64")], {"p": 0.9}),
            Case([r.normal(16, 16), Arg(np.array([0, 0]), "i64")], {"p": 0.0})]


def _nll_cases(r: Draw, backward: bool) -> list[Case]:
    n, c = 32, 100
    logp = Arg(_log_softmax64(r.rng.standard_normal((n, c)) * 2))
    target = r.ids(c, n)
    target.data[r.rng.choice(n, 4, replace=False)] = -100
    target0 = r.ids(c, n)                       # ignore_index 0 instead of the default
    cases = []
    for red, tgt, ign in (("mean", target, -100), ("sum", target, -100), ("none", target, -100),
                          ("mean", target0, 0)):
        attrs = {"reduction": red, "ignore_index": ign}
        if not backward:
            cases.append(Case([logp, tgt], attrs))
            continue
        grad = r.normal(n) if red == "none" else Arg(np.array(r.rng.uniform(0.5, 2.0)))
        total = Arg(np.array(float((tgt.data != ign).sum()) if red != "none" else 0.0))
        cases.append(Case([grad, logp, tgt, total], attrs))
    return cases


def _int_binary_cases(r: Draw) -> list[Case]:
    a = r.ids(1 << 20, 64, 128)
    return [Case([a, r.ids(1 << 20, 128)]), Case([r.mask(64, 128), r.mask(128)]),
            Case([a, 6]), Case([r.mask(64, 128), True])]


def _binary_cases(r: Draw) -> list[Case]:
    a = r.normal(64, 128)
    return [Case([a, r.normal(128)]), Case([a, 0.75]), Case([-1.25, a])]


def _compare_cases(r: Draw) -> list[Case]:
    a = r.normal(64, 128)
    a.data[:, :8] = 0.0
    return [Case([a, r.near(a)]), Case([a, 0.0]), Case([0.0, a])]


def _softmax_bwd_cases(r: Draw, log: bool) -> list[Case]:
    x = torch.from_numpy(r.rng.standard_normal((16, 256)) * 2)
    out = torch.log_softmax(x, -1) if log else torch.softmax(x, -1)
    x0 = torch.from_numpy(r.rng.standard_normal((32, 8)))
    out0 = torch.log_softmax(x0, 0) if log else torch.softmax(x0, 0)
    return [Case([r.normal(16, 256), Arg(out.numpy())], {"dim": 1}),
            Case([r.normal(32, 8), Arg(out0.numpy())], {"dim": 0})]


def _unary_cases(draw: str):
    def cases(r: Draw) -> list[Case]:
        x = {"normal": lambda: r.normal(64, 128), "wide": lambda: r.normal(64, 128, scale=3.0),
             "positive": lambda: r.positive(64, 128), "nonzero": lambda: r.away_from_zero(64, 128),
             "bool": lambda: r.mask(64, 128)}[draw]()
        return [Case([x])]
    return cases


UNARY_DRAW = {"neg": "normal", "exp": "normal", "log": "positive", "sqrt": "positive",
              "rsqrt": "positive", "tanh": "wide", "sigmoid": "wide", "relu": "normal",
              "silu": "wide", "abs": "normal", "reciprocal": "nonzero",
              "sin": "wide", "cos": "wide", "logical_not": "bool", "copy": "normal",
              "log1p": "positive", "expm1": "normal", "erf": "wide", "atan": "wide"}

SPECS: dict[str, Callable[[Draw], list[Case]]] = {n: _unary_cases(d) for n, d in UNARY_DRAW.items()}
SPECS.update({
    "cast": lambda r: [Case([r.normal(64, 128, scale=8.0)], {"dtype": "i64"}),
                       Case([r.normal(64, 128)], {"dtype": "bool"})],
    "gelu": lambda r: [Case([r.normal(64, 128, scale=3.0)]),
                       Case([r.normal(64, 128, scale=3.0)], {"approximate": "tanh"})],
    "bitwise_not": lambda r: [Case([r.ids(1 << 20, 64, 128)]), Case([r.mask(64, 128)])],
    **{n: _int_binary_cases for n in ("bitwise_and", "bitwise_or", "bitwise_xor")},
    "logical_xor": lambda r: [Case([r.mask(64, 128), r.mask(128)]), Case([r.mask(64, 128), True])],
    "power": lambda r: [Case([r.positive(64, 128), r.normal(128)]),
                        Case([10000.0, Arg(r.rng.uniform(0, 1, 64))]),
                        Case([r.positive(64, 128), 2.5])],
    "floor_divide": lambda r: [Case([Arg(r.rng.integers(-1000, 1000, (64, 128)), "i64"),
                                     Arg(r.rng.integers(1, 50, 128), "i64")]),
                               Case([r.normal(64, 128, scale=4.0), r.away_from_zero(128)]),
                               Case([Arg(r.rng.integers(-1000, 1000, 256), "i64"), 3])],
    **{n: (lambda r: [Case([Arg(r.rng.integers(-1000, 1000, (64, 128)), "i64"),
                            Arg(r.rng.integers(1, 50, 128) * r.rng.choice([-1, 1], 128), "i64")]),
                      Case([r.normal(64, 128, scale=4.0), r.away_from_zero(128)]),
                      Case([r.normal(256, scale=4.0), 1.5]),
                      Case([Arg(r.rng.integers(-1000, 1000, 256), "i64"), 7])])
       for n in ("remainder", "fmod")},
    "sign": lambda r: [Case([Arg(np.where(r.rng.random((64, 128)) < 0.1, 0.0,
                                          r.rng.standard_normal((64, 128))))]),
                       Case([Arg(r.rng.integers(-3, 4, 256), "i64")])],
    "argmax": lambda r: [Case([r.distinct(8, 64)], {"dim": 1}),
                         Case([r.distinct(32, 6, dim=0)], {"dim": 0, "keepdim": True}),
                         Case([r.ids(4, 8, 16)], {"dim": -1}),          # ties: the first
                         Case([r.distinct(64)], {"dim": None})],
    "flip": lambda r: [Case([r.normal(8, 16, 32)], {"dims": [2]}),
                       Case([r.normal(8, 16, 32)], {"dims": [0, 1]})],
    "cumsum": lambda r: [Case([r.normal(8, 16, 32)], {"dim": 1}),
                         Case([r.mask(4, 64)], {"dim": -1}),
                         Case([r.ids(100, 4, 64)], {"dim": 0, "dtype": "i32"})],
    "index": lambda r: [Case([r.normal(8, 16, 32), r.ids(16, 5)], {"dims": [1]}),
                        Case([r.normal(8, 16, 32), r.ids(8, 3, 1), r.ids(32, 1, 4)],
                             {"dims": [0, 2]}),                # apart: the index dims go first
                        Case([r.normal(2, 4, 6), r.ids(2, 3), Arg(np.array([-1, 0, 3]), "i64")],
                             {"dims": [0, 1]})],
    "index_put": lambda r: [
        Case([r.normal(16, 8), r.normal(24, 8), r.ids(16, 24)], {"dims": [0], "accumulate": True}),
        Case([r.normal(4, 10, 3), r.normal(4, 6, 3), r.ids(10, 6)],
             {"dims": [1], "accumulate": True}),
        Case([r.normal(16, 8), r.normal(5, 8), _perm_ids(r, 16, 5)], {"dims": [0]}),
        Case([r.normal(4, 10, 3), r.normal(3), _perm_ids(r, 10, 4)], {"dims": [1]}),
        Case([Arg(np.zeros(12, dtype=np.int64), "i64"), Arg(np.arange(12), "i64"),
              _perm_ids(r, 12, 12)], {"dims": [0]})],    # the inverse of a permutation
    "gather": lambda r: [Case([r.normal(8, 16), r.ids(16, 8, 5)], {"dim": 1}),
                         Case([r.normal(8, 16), r.ids(8, 4, 16)], {"dim": 0}),
                         Case([r.normal(8, 16), r.ids(16, 4, 3)], {"dim": 1})],
    "scatter": lambda r: [Case([r.normal(8, 16), _perm_ids(r, 16, 5, rows=8), r.normal(8, 16)],
                               {"dim": 1}),
                          Case([r.normal(8, 16), _perm_ids(r, 16, 3, rows=4), 0.5], {"dim": 1})],
    "scatter_add": lambda r: [Case([r.normal(8, 16), r.ids(16, 8, 20), r.normal(8, 20)],
                                   {"dim": 1}),
                              Case([r.normal(6, 5), r.ids(6, 9, 5), r.normal(9, 5)], {"dim": 0})],
    "sort": lambda r: [Case([r.ids(5, 6, 40)]),                        # ties: stable order
                       Case([r.normal(32, 8)], {"dim": 0, "descending": True}),
                       Case([r.ids(7, 4, 128)], {"descending": True})],
    "histc": lambda r: [Case([Arg(r.rng.integers(0, 4, 256).astype(np.float64))],
                             {"bins": 4, "min": 0, "max": 3}),
                        Case([Arg(r.rng.integers(0, 8, 256), "i32")], {"bins": 8, "min": 0, "max": 7}),
                        # (k + 0.5) / 16: exact in bf16 and never on a bin edge
                        Case([Arg((r.rng.integers(-40, 40, 1000) + 0.5) / 16)],
                             {"bins": 10, "min": -2, "max": 2})],
    "layer_norm": lambda r: _layer_norm_cases(r, backward=False),
    "layer_norm_bwd": lambda r: _layer_norm_cases(r, backward=True),
    "dropout": _dropout_cases,
    "attention_masked": lambda r: _attention_cases(r, backward=False, masked=True),
    "attention_masked_bwd": lambda r: _attention_cases(r, backward=True, masked=True),
    "depthwise_conv1d": lambda r: _conv_cases(r, backward=False),
    "depthwise_conv1d_bwd": lambda r: _conv_cases(r, backward=True),
    "selective_scan": lambda r: _scan_cases(r, backward=False),
    "selective_scan_bwd": lambda r: _scan_cases(r, backward=True),
    "grouped_mm": lambda r: _grouped_mm_cases(r, backward=False),
    "grouped_mm_bwd": lambda r: _grouped_mm_cases(r, backward=True),
    "gelu_bwd": lambda r: [Case([r.normal(64, 128), r.normal(64, 128, scale=3.0)]),
                           Case([r.normal(64, 128), r.normal(64, 128, scale=3.0)],
                                {"approximate": "tanh"})],
    "pow": lambda r: [Case([r.normal(64, 128)], {"exponent": 2}),
                      Case([r.positive(64, 128)], {"exponent": 0.5}),
                      Case([r.normal(64, 128)], {"exponent": 3.0})],
    **{n: _binary_cases for n in ("add", "sub", "mul")},
    "div": lambda r: [Case([r.normal(64, 128), r.away_from_zero(128)]),
                      Case([r.normal(64, 128), 3.0]), Case([2.0, r.away_from_zero(64, 128)])],
    **{n: _compare_cases for n in ("maximum", "minimum", "eq", "ne", "lt", "le", "gt", "ge")},
    **{n: (lambda r: [Case([r.mask(64, 128), r.mask(128)]), Case([r.mask(64, 128), True])])
       for n in ("logical_and", "logical_or")},
    "where": lambda r: [Case([r.mask(64, 128), r.normal(64, 128), r.normal(128)]),
                        Case([r.mask(64, 128), r.normal(64, 128), 0.0])],
    **{n: (lambda r: [Case([r.normal(8, 16, 32)], {"dims": [2], "keepdim": True}),
                      Case([r.normal(8, 16, 32)], {"dims": [0, 2]}),
                      Case([r.normal(8, 16, 32)], {"dims": None})])
       for n in ("sum", "mean", "amax", "amin")},
    "reshape": lambda r: [Case([r.normal(8, 16, 32)], {"shape": [8, -1, 4]})],
    "permute": lambda r: [Case([r.normal(8, 16, 32)], {"dims": [2, 0, 1]})],
    "transpose": lambda r: [Case([r.normal(8, 16, 32)], {"dim0": 0, "dim1": 2})],
    "expand": lambda r: [Case([r.normal(16, 1)], {"shape": [4, 16, 32]}),
                         Case([r.normal(1, 32)], {"shape": [16, -1]})],
    "slice": lambda r: [Case([r.normal(8, 16, 32)], {"dim": 1, "start": 2, "end": 14, "step": 3}),
                        Case([r.normal(8, 16, 32)], {"dim": 2, "start": -5})],
    "select": lambda r: [Case([r.normal(8, 16, 32)], {"dim": 1, "index": 3})],
    "cat": lambda r: [Case([r.normal(8, 4, 32), r.normal(8, 16, 32), r.normal(8, 1, 32)],
                           {"dim": 1})],
    "split": lambda r: [Case([r.normal(8, 16, 32)], {"dim": 2, "sizes": [8, 8, 16]})],
    "mm": lambda r: [Case([r.normal(64, 96), r.normal(96, 80)])],
    "bmm": lambda r: [Case([r.normal(4, 32, 48), r.normal(4, 48, 40)])],
    "attention": lambda r: _attention_cases(r, backward=False),
    "attention_bwd": lambda r: _attention_cases(r, backward=True),
    "softmax": lambda r: [Case([r.normal(16, 256, scale=2.0)], {"dim": 1}),
                          Case([r.normal(32, 8)], {"dim": 0})],
    "log_softmax": lambda r: [Case([r.normal(16, 256, scale=2.0)], {"dim": 1}),
                              Case([r.normal(32, 8)], {"dim": 0})],
    "softmax_bwd": lambda r: _softmax_bwd_cases(r, log=False),
    "log_softmax_bwd": lambda r: _softmax_bwd_cases(r, log=True),
    "silu_bwd": lambda r: [Case([r.normal(64, 128), r.normal(64, 128, scale=3.0)])],
    "tril": lambda r: [Case([r.normal(2, 16, 16)]), Case([r.normal(16, 24)], {"diagonal": -2})],
    "topk": lambda r: [Case([r.distinct(8, 64)], {"k": 5}), Case([r.distinct(32, 6, dim=0)],
                                                                   {"k": 3, "dim": 0})],
    "one_hot": lambda r: [Case([r.ids(10, 4, 16)], {"num_classes": 10})],
    "embedding": lambda r: [Case([r.normal(100, 32), r.ids(100, 4, 16)])],
    "embedding_bwd": lambda r: [Case([r.normal(4, 16, 32), r.ids(20, 4, 16)], {"num_weights": 40}),
                                Case([r.normal(4, 16, 32), r.ids(20, 4, 16)],
                                     {"num_weights": 20, "padding_idx": 3})],
    "slice_bwd": lambda r: [Case([r.normal(4, 5, 8)], {"shape": [4, 16, 8], "dim": 1, "start": 3,
                                                       "end": 13, "step": 2}),
                            Case([r.normal(6, 8)], {"shape": [10, 8], "dim": 0, "end": 6})],
    "nll_loss": lambda r: _nll_cases(r, backward=False),
    "nll_loss_bwd": lambda r: _nll_cases(r, backward=True),
    "full": lambda r: [Case([], {"shape": [4, 8], "value": 1.5}),
                       Case([], {"shape": [3], "value": -2})],
    "arange": lambda r: [Case([], {"start": 2, "end": 50, "step": 3}), Case([], {"end": 17})],
})
# creation ops build the dtype under test (their dtype attribute defaults to something else)
DTYPE_ATTR_OPS = {"full", "arange"}


# ---- the float64 reference: torch eager, calling the ATen op directly ----------------------------

def _as_tensors(*xs):
    t = next(x for x in xs if isinstance(x, torch.Tensor))
    return [x if isinstance(x, torch.Tensor) else torch.tensor(x, dtype=t.dtype) for x in xs]


def _ref_dtype(h2: str) -> torch.dtype:
    return torch.float64 if h2 in FLOAT_DTYPES else _torch_dtype(h2)


_REDUCTION = {"none": 0, "mean": 1, "sum": 2}

def _index_list(dims, indices) -> list:
    key = [None] * (max(dims) + 1)
    for d, i in zip(dims, indices):
        key[d] = i
    return key


def _grouped_mm64(x, w, offs):
    out, start = x.new_zeros(x.shape[0], w.shape[2]), 0
    for e, end in enumerate(offs.tolist()):
        out[start:end] = x[start:end] @ w[e]
        start = max(start, end)
    return out


def _grouped_mm_bwd64(g, x, w, offs):
    gx, gw, start = torch.zeros_like(x), torch.zeros_like(w), 0
    for e, end in enumerate(offs.tolist()):
        gx[start:end] = g[start:end] @ w[e].T
        gw[e] = x[start:end].T @ g[start:end]
        start = max(start, end)
    return gx, gw


def _conv64(x, w, bias, pad_left, pad_right):
    left = w.shape[1] - 1 if pad_left is None else pad_left
    return F.conv1d(F.pad(x, (left, pad_right)), w.unsqueeze(1), bias, groups=x.shape[1])


def _conv_bwd64(g, x, w, pad_left, pad_right):
    """torch autograd through F.conv1d."""
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    bias = torch.zeros(w.shape[0], dtype=w.dtype, requires_grad=True)
    return torch.autograd.grad(_conv64(x, w, bias, pad_left, pad_right), (x, w, bias), g)


def _scan64(u, delta, A, B, C):
    """The selective scan as Mamba's paper writes it (Alg. 2), one step at a time: every (b,
    d) row separately from h = 0, each channel reading its group's B and C."""
    b, d, l = u.shape
    per = d // B.shape[1]
    ys = []
    for i in range(d):
        Bi, Ci = B[:, i // per], C[:, i // per]                  # [b, n, l]
        h = torch.zeros(b, A.shape[1], dtype=u.dtype)
        yi = []
        for t in range(l):
            h = torch.exp(delta[:, i, t, None] * A[i]) * h + \
                (delta[:, i, t] * u[:, i, t])[:, None] * Bi[:, :, t]
            yi.append((h * Ci[:, :, t]).sum(-1))
        ys.append(torch.stack(yi, -1))
    return torch.stack(ys, 1)


def _scan_bwd64(g, u, delta, A, B, C):
    """torch autograd through `_scan64`: no hand-written gradient shared with either backend."""
    ins = [t.clone().requires_grad_() for t in (u, delta, A, B, C)]
    return torch.autograd.grad(_scan64(*ins), ins, g)


def _layer_norm_bwd64(g, x, mean, rstd, w, b, n):
    shape = list(x.shape[x.dim() - n:])
    w = torch.ones(shape, dtype=x.dtype) if w is None else w     # ATen gives no dweight without w
    b = torch.zeros(shape, dtype=x.dtype) if b is None else b
    return aten.native_layer_norm_backward(g, x, shape, mean, rstd, w, b, [True, True, True])


def _torch_dropout(x, seed, p):
    """The torch library's dropout (its own implementation of the op set's counter-based hash):
    the numpy backend's masks must equal it bit for bit."""
    from backends.torch.ops import dropout
    return dropout(x, seed, p)


REFERENCE: dict[str, Callable] = {
    "neg": torch.neg, "exp": torch.exp, "log": torch.log, "sqrt": torch.sqrt, "rsqrt": torch.rsqrt,
    "tanh": torch.tanh, "sigmoid": torch.sigmoid, "relu": torch.relu, "silu": F.silu,
    "gelu": lambda x, approximate: F.gelu(x, approximate=approximate),
    "abs": torch.abs, "reciprocal": torch.reciprocal, "sin": torch.sin,
    "cos": torch.cos, "logical_not": torch.logical_not, "copy": torch.clone,
    "bitwise_not": torch.bitwise_not, "log1p": torch.log1p, "expm1": torch.expm1,
    "erf": torch.erf, "atan": torch.atan, "sign": torch.sign,
    "remainder": lambda a, b: torch.remainder(*_as_tensors(a, b)),
    "fmod": lambda a, b: torch.fmod(*_as_tensors(a, b)),
    "argmax": lambda x, dim, keepdim: torch.argmax(x, dim=dim, keepdim=keepdim),
    "flip": lambda x, dims: torch.flip(x, dims),
    "cast": lambda x, dtype: x.to(_ref_dtype(dtype)),
    "pow": lambda x, exponent: torch.pow(x, exponent),
    "add": operator.add, "sub": operator.sub, "mul": operator.mul, "div": operator.truediv,
    "maximum": lambda a, b: torch.maximum(*_as_tensors(a, b)),
    "minimum": lambda a, b: torch.minimum(*_as_tensors(a, b)),
    **{n: (lambda fn: lambda a, b: fn(*_as_tensors(a, b)))(getattr(torch, n))
       for n in ("eq", "ne", "lt", "le", "gt", "ge")},
    "logical_and": lambda a, b: torch.logical_and(*_as_tensors(a, b)),
    "logical_or": lambda a, b: torch.logical_or(*_as_tensors(a, b)),
    **{n: (lambda fn: lambda a, b: fn(*_as_tensors(a, b)))(getattr(torch, n))
       for n in ("logical_xor", "bitwise_and", "bitwise_or", "bitwise_xor", "floor_divide")},
    "power": lambda a, b: torch.pow(a, b),
    "where": lambda c, a, b: torch.where(c, a, b),
    "sum": lambda x, dims, keepdim: torch.sum(x, dim=dims, keepdim=keepdim),
    "mean": lambda x, dims, keepdim: torch.mean(x, dim=dims, keepdim=keepdim),
    "amax": lambda x, dims, keepdim: torch.amax(x, dim=dims if dims is not None else [],
                                                keepdim=keepdim),
    "amin": lambda x, dims, keepdim: torch.amin(x, dim=dims if dims is not None else [],
                                                keepdim=keepdim),
    "cumsum": lambda x, dim, dtype: torch.cumsum(x, dim, dtype=_ref_dtype(dtype) if dtype else None),
    "reshape": lambda x, shape: x.reshape(shape),
    "permute": lambda x, dims: x.permute(dims),
    "transpose": lambda x, dim0, dim1: x.transpose(dim0, dim1),
    "expand": lambda x, shape: x.expand(shape),
    "slice": lambda x, dim, start, end, step: aten.slice(x, dim, start, end, step),
    "select": lambda x, dim, index: x.select(dim, index),
    "cat": lambda *xs, dim: torch.cat(xs, dim),
    "split": lambda x, dim, sizes: torch.split(x, sizes, dim),
    "mm": torch.mm, "bmm": torch.bmm,
    "attention": lambda q, k, v, causal, scale: aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, scale=scale),
    "attention_bwd": lambda g, q, k, v, o, lse, causal, scale:
        aten._scaled_dot_product_flash_attention_for_cpu_backward(g, q, k, v, o, lse, 0.0, causal,
                                                                  scale=scale),
    "attention_masked": _attention_masked64,
    "attention_masked_bwd": _attention_masked_bwd64,
    "depthwise_conv1d": _conv64,
    "depthwise_conv1d_bwd": _conv_bwd64,
    "selective_scan": _scan64,
    "selective_scan_bwd": _scan_bwd64,
    "grouped_mm": lambda x, w, offs: _grouped_mm64(x, w, offs),
    "grouped_mm_bwd": lambda g, x, w, offs: _grouped_mm_bwd64(g, x, w, offs),
    "softmax": lambda x, dim: aten._softmax(x, dim, False),
    "log_softmax": lambda x, dim: aten._log_softmax(x, dim, False),
    "softmax_bwd": lambda g, out, dim: aten._softmax_backward_data(g, out, dim, out.dtype),
    "log_softmax_bwd": lambda g, out, dim: aten._log_softmax_backward_data(g, out, dim, out.dtype),
    "silu_bwd": aten.silu_backward,
    "gelu_bwd": lambda g, x, approximate: aten.gelu_backward(g, x, approximate=approximate),
    "layer_norm": lambda x, w, b, normalized_ndim, eps: aten.native_layer_norm(
        x, list(x.shape[x.dim() - normalized_ndim:]), w, b, eps),
    "layer_norm_bwd": lambda g, x, mean, rstd, w, b, normalized_ndim: _layer_norm_bwd64(
        g, x, mean, rstd, w, b, normalized_ndim),
    "sort": lambda x, dim, descending: torch.sort(x, dim=dim, descending=descending, stable=True),
    "histc": lambda x, bins, min, max: torch.histc(
        x if x.is_floating_point() else x.to(torch.float64), bins, min, max),
    "dropout": lambda x, seed, p: _torch_dropout(x, seed, p),
    "index": lambda x, *idx, dims: aten.index(x, _index_list(dims, idx)),
    "index_put": lambda x, values, *idx, dims, accumulate: aten.index_put(
        x, _index_list(dims, idx), torch.as_tensor(values, dtype=x.dtype), accumulate),
    "gather": lambda x, index, dim: torch.gather(x, dim, index),
    "scatter": lambda x, index, src, dim: torch.scatter(x, dim, index, src),
    "scatter_add": lambda x, index, src, dim: torch.scatter_add(x, dim, index, src),
    "tril": lambda x, diagonal: torch.tril(x, diagonal),
    "topk": lambda x, k, dim: torch.topk(x, k, dim),
    "one_hot": lambda ids, num_classes: F.one_hot(ids, num_classes),
    "embedding": lambda w, ids: aten.embedding(w, ids),
    "embedding_bwd": lambda g, ids, num_weights, padding_idx: aten.embedding_dense_backward(
        g, ids, num_weights, padding_idx, False),
    "slice_bwd": lambda g, shape, dim, start=None, end=None, step=1: aten.slice_backward(
        g, shape, dim, 0 if start is None else start, shape[dim] if end is None else end, step),
    "nll_loss": lambda logp, t, reduction, ignore_index: aten.nll_loss_forward(
        logp, t, None, _REDUCTION[reduction], ignore_index),
    "nll_loss_bwd": lambda g, logp, t, tw, reduction, ignore_index: aten.nll_loss_backward(
        g, logp, t, None, _REDUCTION[reduction], ignore_index, tw),
    "full": lambda shape, value, dtype: torch.full(shape, value, dtype=_ref_dtype(dtype)),
    "arange": lambda start, end, step, dtype: torch.arange(start, end, step,
                                                           dtype=_ref_dtype(dtype)),
}


# ---- running and comparing -----------------------------------------------------------------------

@dataclass
class OpResult:
    op: str
    dtype: str
    max_abs: float = 0.0
    max_rel: float = 0.0
    passed: bool = True
    error: str | None = None
    reference: str = "torch-f64"
    reference_independent: bool = True      # the reference is not the tested backend's library

    def to_json(self) -> dict:
        d = {"op": self.op, "dtype": self.dtype, "max_abs": self.max_abs, "max_rel": self.max_rel,
             "pass": self.passed, "reference": self.reference,
             "reference_independent": self.reference_independent}
        if self.error:
            d["error"] = self.error
        return d


@dataclass
class CheckReport:
    backend: str
    dtype: str
    results: list                  # OpResult, in op-set order
    missing: list                  # checked ops the backend has no kernel for
    reference: str = "torch-f64"   # the reference asked for (REFERENCES)
    reference_gaps: list = field(default_factory=list)   # ops it lacks: checked with torch-f64

    @property
    def implemented(self) -> int:
        return len(self.results)

    @property
    def total(self) -> int:
        return len(self.results) + len(self.missing)

    @property
    def failed(self) -> list:
        return [r for r in self.results if not r.passed]

    def to_json(self) -> dict:
        return {"backend": self.backend, "dtype": self.dtype, "reference": self.reference,
                "reference_gaps": list(self.reference_gaps),
                "coverage": {"implemented": self.implemented, "total": self.total},
                "ops": [r.to_json() for r in self.results]}


def _round_to(data: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """(host array in `dtype` for the backend, the same values for the reference: float64 for a
    float dtype, else `dtype` itself; a copy, so no kernel shares memory with the reference)."""
    if dtype in FLOAT_DTYPES:                  # numpy has no bf16: torch rounds
        t = torch.from_numpy(np.asarray(data, dtype=np.float64)).to(_torch_dtype(dtype))
        host = t.view(torch.uint16).numpy() if dtype == "bf16" else t.numpy()
        return host, t.to(torch.float64).numpy().copy()
    t = torch.from_numpy(np.asarray(data)).to(_torch_dtype(dtype))
    return t.numpy(), t.numpy().copy()


def _host_to_f64(a: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bf16":
        return (a.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return a.astype(np.float64)


def _compare(out: np.ndarray, ref: np.ndarray, atol: float, rtol: float, exact: bool):
    """(max abs err, max rel err, within tolerance). NaNs must sit where the reference has NaNs."""
    if out.shape != ref.shape:
        raise AssertionError(f"shape {list(out.shape)}, reference {list(ref.shape)}")
    if out.size == 0:
        return 0.0, 0.0, True
    out, ref = out.astype(np.float64), ref.astype(np.float64)
    both_nan = np.isnan(out) & np.isnan(ref)
    with np.errstate(invalid="ignore"):
        err = np.where(both_nan, 0.0, np.abs(out - ref))
    err = np.where(np.isnan(err), np.inf, err)
    big = np.abs(ref) > atol
    max_rel = float((err[big] / np.abs(ref[big])).max()) if big.any() else 0.0
    ok = bool(np.all(err == 0)) if exact else bool(np.all(err <= atol + rtol * np.abs(
        np.where(np.isnan(ref), 0.0, ref))))
    return float(err.max()), max_rel, ok


def _tolerance(test_dtype: str, out_dtype: str) -> tuple[float, float]:
    """The looser of the dtype under test and the result's dtype (an f32 logsumexp computed from
    bf16 inputs is held to bf16's tolerance; one computed in an f64 run to f32's)."""
    a = TOLERANCE.get(test_dtype, (0.0, 0.0))
    b = TOLERANCE.get(out_dtype, (0.0, 0.0))
    return max(a[0], b[0]), max(a[1], b[1])


def _reference_kernel(op: str, reference: str, numpy_ops: dict | None) -> Callable:
    """The f64 kernel of `op` in `reference`: (*inputs as f64/int/bool numpy arrays, **attrs) ->
    result(s), numpy arrays (numpy-f64) or tensors (torch-f64)."""
    if reference == "numpy-f64":
        kernel = numpy_ops[op]

        def run(*ins, **attrs):
            if attrs.get("dtype") in FLOAT_DTYPES:        # creation/cast ops: float means f64
                attrs = {**attrs, "dtype": "f64"}
            return kernel(*ins, **attrs)
        return run
    fn = REFERENCE[op]

    def run(*ins, **attrs):
        return fn(*(torch.from_numpy(x) if isinstance(x, np.ndarray) else x for x in ins), **attrs)
    return run


def _as_f64(r) -> np.ndarray:
    if isinstance(r, torch.Tensor):
        return r.detach().to(torch.float64).numpy()
    return np.asarray(r).astype(np.float64)


def _host_dtype_name(a: np.ndarray) -> str:
    try:
        return dtype_of_host(a.dtype)                    # uint16 reads as bf16 bits
    except KeyError:
        return str(a.dtype)


def check_op(backend, op: str, dtype: str, seed: int = 0, reference: str | None = None,
             numpy_ops: dict | None = None) -> OpResult:
    """Run every case of `op`'s spec on `backend` at `dtype` and compare with the f64 reference
    (default: `reference_for(backend.name)`; numpy-f64 uses `numpy_ops`, the numpy backend's op
    table, looked up in the registry when not given)."""
    reference, numpy_ops = _op_reference(backend, op, reference, numpy_ops)
    res = OpResult(op, dtype, reference=reference,
                   reference_independent=_LIBRARY[reference] != backend.name)
    d = opset.get(op)
    if op not in SPECS or (reference == "torch-f64" and op not in REFERENCE):
        res.passed, res.error = False, "no input spec/reference in backends/check_ops.py"
        return res
    ref_kernel = _reference_kernel(op, reference, numpy_ops)
    draw = Draw(seed + zlib.crc32(op.encode()))
    for case in SPECS[op](draw):
        attrs = _case_attrs(d, op, case, dtype)
        ins, ref_ins, types = _case_inputs(backend, case, dtype)
        try:
            _check_case(res, backend, d, op, ref_kernel, ins, ref_ins, types, attrs)
        except Exception as e:        # a kernel that raises fails its op; the sweep goes on
            res.passed = False
            res.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return res


def _op_reference(backend, op: str, reference: str | None, numpy_ops: dict | None):
    """(reference, numpy_ops) for checking `op`: torch-f64 where the numpy library lacks it."""
    reference = reference or reference_for(backend.name)
    if reference not in REFERENCES:
        raise H2Error(f"reference {reference!r}: expected one of {', '.join(REFERENCES)}")
    if reference == "numpy-f64" and numpy_ops is None:
        from backends.registry import get_backend
        numpy_ops = get_backend("numpy").ops
    if reference == "numpy-f64" and op not in numpy_ops:
        reference = "torch-f64"                          # the numpy library lacks it: fall back
    return reference, numpy_ops


def _case_attrs(d: opset.OpDef, op: str, case: Case, dtype: str) -> dict:
    """The op's default attributes, overridden by the case's; creation/cast ops make `dtype`."""
    attrs = {k: v for k, v in d.attrs.items()}
    attrs.update(case.attrs)
    if op in DTYPE_ATTR_OPS:
        attrs["dtype"] = dtype
    return attrs


def _case_inputs(backend, case: Case, dtype: str) -> tuple[list, list, list]:
    """(backend inputs, reference inputs, input types) of a case: each array rounded to its
    dtype (default: the dtype under test), scalars as they are."""
    ins, ref_ins, types = [], [], []
    for x in case.inputs:
        if isinstance(x, Arg):
            xdt = x.dtype or dtype
            host, ref = _round_to(x.data, xdt)
            ins.append(backend.from_numpy(host, xdt))
            ref_ins.append(ref)
            types.append(TensorType(xdt, host.shape))
        else:
            ins.append(x)
            ref_ins.append(x)
            types.append(x)
    return ins, ref_ins, types


def _check_case(res: OpResult, backend, d: opset.OpDef, op: str, ref_kernel: Callable,
                ins: list, ref_ins: list, types: list, attrs: dict) -> None:
    """Run one case on the backend and the reference and fold its errors into `res` (at the
    dtype under test, `res.dtype`). Raises when a kernel raises or a result's count, dtype or
    shape differs from the op set's."""
    want = d.infer(types, attrs)
    got = backend.ops[op](*ins, **attrs)
    backend.synchronize()
    got = list(got) if isinstance(got, (tuple, list)) else [got]
    ref = ref_kernel(*ref_ins, **attrs)
    ref = list(ref) if isinstance(ref, (tuple, list)) else [ref]
    if len(got) != len(want):
        raise AssertionError(f"{len(got)} result(s), the op set declares {len(want)}")
    for g, r, w in zip(got, ref, want):
        _compare_result(res, backend.to_numpy(g), r, w, res.dtype)


def _compare_result(res: OpResult, host: np.ndarray, ref, want: TensorType, dtype: str) -> None:
    """One result against the op set's declared type and the reference, at the looser of the
    tolerances of `dtype` (under test) and the result's dtype."""
    host_dt = _host_dtype_name(host)
    if host_dt != want.dtype or tuple(host.shape) != want.shape:
        raise AssertionError(f"result {host_dt}{list(host.shape)}, the op set declares {want}")
    atol, rtol = _tolerance(dtype, want.dtype)
    exact = want.dtype not in FLOAT_DTYPES
    mabs, mrel, ok = _compare(_host_to_f64(host, want.dtype), _as_f64(ref), atol, rtol, exact)
    res.max_abs = max(res.max_abs, mabs)
    res.max_rel = max(res.max_rel, mrel)
    res.passed = res.passed and ok


def check_backend(backend, dtype: str = "f32", seed: int = 0, ops: list[str] | None = None,
                  reference: str | None = None) -> CheckReport:
    """Check every op of the set (but COMM/MOE) that `backend` implements, at `dtype`, against
    `reference` (default: `reference_for(backend.name)`, never the backend's own library)."""
    if dtype not in FLOAT_DTYPES:
        raise H2Error(f"--dtype {dtype}: expected one of {', '.join(FLOAT_DTYPES)}")
    if dtype not in backend.dtypes:
        raise H2Error(f"backend {backend.name} does not compute in {dtype} (its dtypes: "
                      f"{', '.join(sorted(backend.dtypes))})")
    reference = reference or reference_for(backend.name)
    if reference not in REFERENCES:
        raise H2Error(f"--reference {reference}: expected one of {', '.join(REFERENCES)}")
    numpy_ops = None
    if reference == "numpy-f64":
        from backends.registry import get_backend
        numpy_ops = get_backend("numpy").ops
    wanted = checked_ops() if ops is None else ops
    results, missing = [], []
    for op in wanted:
        if op in backend.ops:
            results.append(check_op(backend, op, dtype, seed, reference, numpy_ops))
        else:
            missing.append(op)
    gaps = [r.op for r in results if r.reference != reference]
    return CheckReport(backend.name, dtype, results, missing, reference, gaps)


def format_report(rep: CheckReport) -> str:
    w = max([18] + [len(r.op) + 2 for r in rep.results])       # the op column
    lines = [f"check-ops: backend {rep.backend}, dtype {rep.dtype}; reference: "
             f"{REFERENCES[rep.reference]} ({rep.reference}) on the rounded inputs; tolerance "
             f"atol {_tolerance(rep.dtype, rep.dtype)[0]:g}, "
             f"rtol {_tolerance(rep.dtype, rep.dtype)[1]:g}",
             f"{'op':<{w}}{'dtype':<7}{'reference':<11}{'max abs err':>13}{'max rel err':>13}  result"]
    for r in rep.results:
        status = "pass" if r.passed else "FAIL" + (f"  ({r.error})" if r.error else "")
        if not r.reference_independent:
            status += "  [reference not independent]"
        lines.append(f"{r.op:<{w}}{r.dtype:<7}{r.reference:<11}{r.max_abs:>13.3e}"
                     f"{r.max_rel:>13.3e}  {status}")
    lines.append(f"coverage: {rep.implemented}/{rep.total} ops implemented (COMM and MOE ops are "
                 "executed by the runtime, not by kernels)")
    if rep.missing:
        lines.append(f"not implemented: {', '.join(rep.missing)}")
    if rep.reference_gaps:
        lines.append(f"not in the {_LIBRARY[rep.reference]} backend, checked against torch-f64 "
                     f"instead: {', '.join(rep.reference_gaps)}")
    dependent = [r.op for r in rep.results if not r.reference_independent]
    if dependent:
        lines.append(f"reference computed by the {rep.backend} library itself (a check that "
                     f"cannot fail on a shared bug): {', '.join(dependent)}")
    if rep.results:
        worst_abs = max(rep.results, key=lambda r: r.max_abs)
        worst_rel = max(rep.results, key=lambda r: r.max_rel)
        exact = sum(r.max_abs == 0 for r in rep.results)
        lines.append(f"largest errors: abs {worst_abs.max_abs:.3e} ({worst_abs.op}), rel "
                     f"{worst_rel.max_rel:.3e} ({worst_rel.op}); {exact} op(s) exact")
    failed = rep.failed
    lines.append(f"{len(failed)} op(s) failed: {', '.join(r.op for r in failed)}" if failed
                 else f"all {rep.implemented} implemented ops pass")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="h2c check-ops", description="Op-level accuracy of a "
                                 "backend against a float64 reference computed by the other "
                                 "backend's library (exit 1 on a failure).")
    ap.add_argument("--backend", choices=["torch", "numpy"], required=True)
    ap.add_argument("--dtype", choices=list(FLOAT_DTYPES), default="f32")
    ap.add_argument("--device", default=None, help="torch backend only: cpu (default), cuda, ...")
    ap.add_argument("--op", action="append", default=None, help="check only this op (repeatable)")
    ap.add_argument("--reference", choices=list(REFERENCES), default=None,
                    help="float64 reference (default: numpy-f64 for torch, torch-f64 for numpy)")
    ap.add_argument("--seed", type=int_flag(0, SEED_MAX), default=0)
    ap.add_argument("--json", action="store_true", help="machine-readable report")
    a = ap.parse_args(argv)

    from backends.registry import get_backend
    if a.device is not None and a.backend != "torch":
        raise H2Error(f"--device applies to the torch backend only (got --backend {a.backend})")
    if a.op:
        unknown = [o for o in a.op if o not in SPECS]
        if unknown:
            raise H2Error(f"--op {', '.join(unknown)}: not a checked op of the h2ir op set "
                          f"(expected one of {', '.join(checked_ops())})")
    backend = get_backend(a.backend, **({"device": a.device} if a.device else {}))
    rep = check_backend(backend, a.dtype, a.seed, a.op, a.reference)
    if a.json:
        sys.stdout.write(json.dumps(rep.to_json(), indent=1) + "\n")
    else:
        sys.stdout.write(format_report(rep))
    return 1 if rep.failed else 0


if __name__ == "__main__":
    from h2ir.errors import run_subcommand
    sys.exit(run_subcommand({"check-ops": "backends.check_ops:main"}, "h2c",
                            ["check-ops"] + sys.argv[1:], __doc__))
