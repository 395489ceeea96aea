"""Complex values as real pairs: a rewrite of the captured ATen graph, before lowering.

h2ir has no complex dtypes: a complex tensor z of shape S becomes the real tensor
`view_as_real(z)` of shape S + [2] (real, imaginary), and each op on complex values becomes
the real ops that compute its pair:

    polar(r, a)            stack(r cos a, r sin a)
    view_as_complex(x)     x                        (x already ends in a pair)
    view_as_real(z)        pair(z)
    z * w                  (zr wr - zi wi, zr wi + zi wr)
    z * r, z / r           pair(z) * r[..., None]   (r real)
    view, permute, ...     the same op on the pair, its dims moved clear of the last one

So rotary embeddings written with complex multiplication (Llama 4, DeepSeek-V2, Meta's
reference Llama) reach the op set as sin/cos products, which every backend already runs, and
the stage programs' backward (AOTAutograd, after this rewrite) is real too. Complex tensors
the model holds as buffers become their pair (`Capture.constants` stores `view_as_real`); a
complex parameter, model input or output is an error, as is an op without a rule below.

Chosen over complex dtypes in h2ir: a vendor library needs no complex kernels (few have them),
and the op set stays the one check-ops verifies on every backend.
"""
from __future__ import annotations

import contextlib
import operator
import os
import re

import torch
import torch.fx

from h2ir.errors import H2Error
from frontend.lower import op_name, source_info

aten = torch.ops.aten

_REAL = {torch.complex32: torch.float16, torch.complex64: torch.float32,
         torch.complex128: torch.float64}


def _is_complex(v) -> bool:
    return isinstance(v, torch.Tensor) and v.is_complex()


def _vals(v):
    return v if isinstance(v, (tuple, list)) else [v]


def has_complex(gm: torch.fx.GraphModule) -> bool:
    """Whether any value of the graph is complex."""
    return any(_is_complex(x) for n in gm.graph.nodes for x in _vals(n.meta.get("val")))


class _Rewrite:
    """One pass over the graph in order; `pair[n]` is the real node holding complex node n."""

    def __init__(self, gm: torch.fx.GraphModule, path: str | None, consts):
        self.gm, self.g, self.path, self.consts = gm, gm.graph, path, consts
        self.pair: dict[torch.fx.Node, torch.fx.Node] = {}
        vals = [x for n in self.g.nodes for x in _vals(n.meta.get("val"))
                if isinstance(x, torch.Tensor)]
        self.fake_mode = torch._guards.detect_fake_mode(vals)
        self.at = None              # the node being rewritten: new nodes take its metadata

    # -- building nodes ---------------------------------------------------------------------------
    def emit(self, target, *args, **kwargs) -> torch.fx.Node:
        with self.g.inserting_before(self.at):
            n = self.g.call_function(target, args, kwargs)
        n.meta = {k: v for k, v in self.at.meta.items() if k not in ("val", "tensor_meta")}
        a, k = torch.fx.node.map_arg((args, kwargs), lambda x: x.meta["val"])
        with self.fake_mode or contextlib.nullcontext():
            n.meta["val"] = target(*a, **k)
        return n

    def parts(self, z):
        p = self.pair[z]
        return self.emit(aten.select.int, p, -1, 0), self.emit(aten.select.int, p, -1, 1)

    def join(self, re, im):
        return self.emit(aten.cat.default, [self.emit(aten.unsqueeze.default, re, -1),
                                            self.emit(aten.unsqueeze.default, im, -1)], -1)

    def as_pair(self, x):
        """A complex node's pair, a real tensor node as (x, 0), a Python number as itself."""
        if isinstance(x, torch.fx.Node):
            if x in self.pair:
                return self.pair[x]
            return self.join(x, self.emit(aten.zeros_like.default, x))
        return x

    # -- the pass ---------------------------------------------------------------------------------
    def run(self) -> list[str]:
        """Rewrites the graph in place; the placeholders (names) now holding a complex buffer's
        pair."""
        pairs_in = []
        dead = []
        for n in list(self.g.nodes):
            self.at = n
            complex_in = [a for a in n.all_input_nodes if a in self.pair]
            complex_out = any(_is_complex(x) for x in _vals(n.meta.get("val")))
            if n.op == "placeholder" and complex_out:
                if n.name not in self.consts:
                    self.fail(n, f"a parameter or model input ({n.name}) is complex")
                pairs_in.append(n.name)
                with self.fake_mode or contextlib.nullcontext():
                    n.meta["val"] = torch.view_as_real(n.meta["val"])
                self.pair[n] = n
                continue
            if not complex_in and not complex_out:
                continue
            if n.op == "output":
                self.fail(n, "the model's output is complex")
            if n.op != "call_function":
                self.fail(n, f"a complex value in a '{n.op}' node")
            if n.target is operator.getitem:            # an element of a split's result list
                self.pair[n] = self.emit(operator.getitem, self.pair[n.args[0]], n.args[1])
                dead.append(n)
                continue
            if "assert" in op_name(n.target):           # metadata checks of the complex value
                dead.append(n)
                continue
            rule = _RULES.get(n.target)
            if rule is None:
                self.fail(n, f"op {op_name(n.target)} on complex values has no real-pair form")
            out = rule(self, n, *n.args, **n.kwargs)
            if complex_out or isinstance(n.meta.get("val"), (tuple, list)):
                self.pair[n] = out
            else:
                n.replace_all_uses_with(out)
            dead.append(n)
        for n in reversed(dead):
            self.g.erase_node(n)
        self.g.lint()
        self.gm.recompile()
        return pairs_in

    def fail(self, n, what: str):
        src = source_info(n)
        at = re.match(r"(.+?):(\d+): ", src.line or "")
        line = int(at.group(2)) if at and self.path and \
            os.path.realpath(at.group(1)) == os.path.realpath(self.path) else None
        raise H2Error(f"{what} (from module '{src.module}'): h2 computes complex values as "
                      "real pairs and knows no pair form for this", self.path, line,
                      hint=(f"at {src.line}\n  " if src.line else "") +
                      "write it with real tensors (cos/sin for rotary embeddings), or add a rule "
                      "to frontend/complex_pairs.py")


def _rank(n: torch.fx.Node) -> int:
    """The logical rank of a (complex) node: that of its traced value."""
    v = n.meta["val"]
    return v.dim() if isinstance(v, torch.Tensor) else v[0].dim()


def _dim(d: int, rank: int) -> int:
    return d % rank if rank else 0


# ---- rules: (rewrite, node, *its args) -> the pair node (or the real result) ------------------

def _polar(rw, n, r, a):
    return rw.join(rw.emit(aten.mul.Tensor, r, rw.emit(aten.cos.default, a)),
                   rw.emit(aten.mul.Tensor, r, rw.emit(aten.sin.default, a)))


def _complex(rw, n, re, im):
    return rw.join(re, im)


def _view_as_complex(rw, n, x):
    return x


def _view_as_real(rw, n, z):
    return rw.pair[z]


def _real_part(i):
    return lambda rw, n, z: rw.emit(aten.select.int, rw.pair[z], -1, i)


def _scaled(rw, op, z, r):
    """op(pair(z), r) for a real r: a number, or a tensor broadcast over the pair."""
    if isinstance(r, torch.fx.Node):
        r = rw.emit(aten.unsqueeze.default, r, -1)
        return rw.emit(op, rw.pair[z], r)
    return rw.emit(op, rw.pair[z], r)


def _mul(rw, n, a, b):
    ca, cb = a in rw.pair, isinstance(b, torch.fx.Node) and b in rw.pair
    if ca and cb:
        ar, ai = rw.parts(a)
        br, bi = rw.parts(b)
        m = lambda x, y: rw.emit(aten.mul.Tensor, x, y)         # noqa: E731
        return rw.join(rw.emit(aten.sub.Tensor, m(ar, br), m(ai, bi)),
                       rw.emit(aten.add.Tensor, m(ar, bi), m(ai, br)))
    if not ca:
        a, b = b, a
    if isinstance(b, complex):
        rw.fail(n, "a complex Python number in a product")
    return _scaled(rw, aten.mul.Tensor, a, b)


def _div(rw, n, a, b):
    if not (isinstance(a, torch.fx.Node) and a in rw.pair):
        rw.fail(n, "a real value divided by a complex one")
    if isinstance(b, torch.fx.Node) and b in rw.pair:
        ar, ai = rw.parts(a)
        br, bi = rw.parts(b)
        m = lambda x, y: rw.emit(aten.mul.Tensor, x, y)         # noqa: E731
        den = rw.emit(aten.add.Tensor, m(br, br), m(bi, bi))
        re = rw.emit(aten.add.Tensor, m(ar, br), m(ai, bi))
        im = rw.emit(aten.sub.Tensor, m(ai, br), m(ar, bi))
        return rw.join(rw.emit(aten.div.Tensor, re, den), rw.emit(aten.div.Tensor, im, den))
    return _scaled(rw, aten.div.Tensor, a, b)


def _add_sub(op):
    def rule(rw, n, a, b, alpha=1):
        if isinstance(b, complex):
            rw.fail(n, "a complex Python number in a sum")
        if not isinstance(b, torch.fx.Node):            # a real number: the real part only
            re, im = rw.parts(a)
            return rw.join(rw.emit(op, re, b, alpha=alpha), im)
        return rw.emit(op, rw.as_pair(a), rw.as_pair(b), alpha=alpha)
    return rule


def _conj(rw, n, z):
    re, im = rw.parts(z)
    return rw.join(re, rw.emit(aten.neg.default, im))


def _exp(rw, n, z):
    re, im = rw.parts(z)
    e = rw.emit(aten.exp.default, re)
    return rw.join(rw.emit(aten.mul.Tensor, e, rw.emit(aten.cos.default, im)),
                   rw.emit(aten.mul.Tensor, e, rw.emit(aten.sin.default, im)))


def _abs(rw, n, z):
    re, im = rw.parts(z)
    return rw.emit(aten.hypot.default, re, im)


def _same(rw, n, z, *args, **kwargs):
    """An op that acts on the pair as it acts on the complex tensor (clone, alias, ...)."""
    return rw.emit(n.target, rw.pair[z], *args, **kwargs)


def _to_copy(rw, n, x, dtype=None, **kwargs):
    kwargs = {k: v for k, v in kwargs.items() if k != "memory_format"}
    if x in rw.pair:
        if dtype is None or dtype.is_complex:
            d = _REAL[dtype] if dtype is not None else None
            return rw.emit(aten._to_copy.default, rw.pair[x], **({"dtype": d} if d else {}),
                           **kwargs)
        return rw.emit(aten._to_copy.default, rw.emit(aten.select.int, rw.pair[x], -1, 0),
                       dtype=dtype, **kwargs)          # complex -> real keeps the real part
    return rw.as_pair(rw.emit(aten._to_copy.default, x, dtype=_REAL[dtype], **kwargs))


def _shape_from_val(target):
    """view / reshape / expand: the traced result's shape, with the pair's 2."""
    def rule(rw, n, z, *args):
        return rw.emit(target, rw.pair[z], [*n.meta["val"].shape, 2])
    return rule


def _unsqueeze(rw, n, z, d):
    return rw.emit(aten.unsqueeze.default, rw.pair[z], _dim(d, _rank(n)))


def _squeeze(rw, n, z, dims=None):
    r = _rank(z)
    if dims is None:
        dims = [i for i, s in enumerate(z.meta["val"].shape) if s == 1]
    dims = [_dim(d, r) for d in (dims if isinstance(dims, (list, tuple)) else [dims])]
    return rw.emit(aten.squeeze.dims, rw.pair[z], dims)


def _permute(rw, n, z, dims):
    r = _rank(z)
    return rw.emit(aten.permute.default, rw.pair[z], [_dim(d, r) for d in dims] + [r])


def _transpose(rw, n, z, a=0, b=1):
    r = _rank(z)
    return rw.emit(aten.transpose.int, rw.pair[z], _dim(a, r), _dim(b, r))


def _at_dim(target):
    """An op whose second argument is a dim of its (complex) first: select, slice, split, ..."""
    def rule(rw, n, z, d=0, *args, **kwargs):
        return rw.emit(target, rw.pair[z], _dim(d, _rank(z)), *args, **kwargs)
    return rule


def _split_like(target):
    """split / chunk / unbind: (x, [size,] dim) with the dim after the size."""
    def rule(rw, n, z, size=None, d=0):
        if target is aten.unbind.int:
            return rw.emit(target, rw.pair[z], _dim(size or 0, _rank(z)))
        return rw.emit(target, rw.pair[z], size, _dim(d, _rank(z)))
    return rule


def _cat(rw, n, zs, d=0):
    r = _rank(n)
    return rw.emit(aten.cat.default, [rw.as_pair(z) for z in zs], _dim(d, r))


def _stack(rw, n, zs, d=0):
    r = _rank(n)
    return rw.emit(aten.stack.default, [rw.as_pair(z) for z in zs], _dim(d, r))


def _sum(rw, n, z, dims=None, keepdim=False, dtype=None):
    r = _rank(z)
    dims = list(range(r)) if not dims else [_dim(d, r) for d in dims]
    return rw.emit(n.target if n.target is not aten.sum.default else aten.sum.dim_IntList,
                   rw.pair[z], dims, keepdim)


def _index(rw, n, z, indices):
    return rw.emit(aten.index.Tensor, rw.pair[z], list(indices))


def _repeat(rw, n, z, reps):
    return rw.emit(aten.repeat.default, rw.pair[z], [*reps, 1])


def _flip(rw, n, z, dims):
    r = _rank(z)
    return rw.emit(aten.flip.default, rw.pair[z], [_dim(d, r) for d in dims])


def _where(rw, n, c, a, b):
    return rw.emit(aten.where.self, rw.emit(aten.unsqueeze.default, c, -1),
                   rw.as_pair(a), rw.as_pair(b))


def _like(value):
    """zeros_like / ones_like of a complex tensor: (value, 0)."""
    def rule(rw, n, z, *args, dtype=None, **kwargs):
        re = rw.emit(aten.select.int, rw.pair[z], -1, 0)
        if value == 0:
            return rw.emit(aten.zeros_like.default, rw.pair[z])
        return rw.join(rw.emit(aten.full_like.default, re, value),
                       rw.emit(aten.zeros_like.default, re))
    return rule


_RULES = {
    aten.polar.default: _polar,
    aten.complex.default: _complex,
    aten.view_as_complex.default: _view_as_complex,
    aten.view_as_real.default: _view_as_real,
    aten.real.default: _real_part(0), aten.imag.default: _real_part(1),
    aten.mul.Tensor: _mul, aten.mul.Scalar: _mul,
    aten.div.Tensor: _div, aten.div.Scalar: _div,
    aten.add.Tensor: _add_sub(aten.add.Tensor), aten.sub.Tensor: _add_sub(aten.sub.Tensor),
    aten.neg.default: _same,
    aten.conj.default: _conj, aten._conj.default: _conj, aten.conj_physical.default: _conj,
    aten.resolve_conj.default: _same, aten.resolve_neg.default: _same,
    aten.clone.default: _same, aten.alias.default: _same, aten.detach.default: _same,
    aten.lift_fresh_copy.default: _same,
    aten.exp.default: _exp, aten.abs.default: _abs,
    aten._to_copy.default: _to_copy,
    aten.view.default: _shape_from_val(aten.view.default),
    aten._unsafe_view.default: _shape_from_val(aten.view.default),
    aten.reshape.default: _shape_from_val(aten.reshape.default),
    aten.expand.default: _shape_from_val(aten.expand.default),
    aten.unsqueeze.default: _unsqueeze,
    aten.squeeze.dim: _squeeze, aten.squeeze.dims: _squeeze, aten.squeeze.default: _squeeze,
    aten.permute.default: _permute, aten.transpose.int: _transpose, aten.t.default: _transpose,
    aten.select.int: _at_dim(aten.select.int), aten.slice.Tensor: _at_dim(aten.slice.Tensor),
    aten.index_select.default: _at_dim(aten.index_select.default),
    aten.split.Tensor: _split_like(aten.split.Tensor),
    aten.split_with_sizes.default: _split_like(aten.split_with_sizes.default),
    aten.chunk.default: _split_like(aten.chunk.default),
    aten.unbind.int: _split_like(aten.unbind.int),
    aten.cat.default: _cat, aten.stack.default: _stack,
    aten.sum.dim_IntList: _sum, aten.sum.default: _sum, aten.mean.dim: _sum,
    aten.index.Tensor: _index, aten.repeat.default: _repeat, aten.flip.default: _flip,
    aten.where.self: _where,
    aten.zeros_like.default: _like(0), aten.ones_like.default: _like(1),
}


def to_real_pairs(gm: torch.fx.GraphModule, path: str | None = None, consts=()) -> list[str]:
    """Rewrite every complex value of the captured graph `gm` as a real pair (in place);
    returns the placeholders that now hold a complex buffer's pair (`consts`: the placeholders
    that are buffers; any other complex placeholder is an error). A graph without complex
    values is left as it is."""
    if not has_complex(gm):
        return []
    return _Rewrite(gm, path, consts).run()
