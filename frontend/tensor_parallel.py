"""Tensor parallelism as a transformation of a stage's program (Megatron-LM, Shoeybi et al. 2019,
arXiv 1909.08053, Sec. 3): a sharding-propagation pass over a layer's captured ATen fx graph,
run before AOTAutograd, so the backward — with its mirrored collectives — is derived, not written.

Every value gets a placement on the `tp` ranks of a stage:

    R      replicated: every rank holds the whole value
    S(d)   sharded: rank r holds the r-th of tp equal contiguous slices along dim d
    P      partial sum: the value is the sum of the ranks' local values

Parameters are decided by their first consumer: a linear (`t` then `mm`/`addmm`) whose input is
R becomes column-parallel (weight split on its output dim, result S), one whose input is S on its
contraction dim becomes row-parallel (weight split on its input dim, result P); an embedding
table becomes vocabulary-parallel (rows split; masked lookup, then an all-reduce); any other
parameter is replicated. The rule table (`_RULES`) carries placements through views (a reshape's
shape constant is rewritten on the split dim: heads H -> H/tp), transposes, elementwise ops with
broadcasting, reductions, attention (on the head dim), and the vocabulary-parallel
log-softmax / NLL loss. Collectives are inserted where placements change:

    f  h2tp::copy         identity forward, all-reduce (sum) backward — an R value entering S compute
    g  h2tp::all_reduce   all-reduce (sum) forward, identity backward — a P value needed as R
       h2tp::all_reduce_max  max all-reduce (no gradient: the softmax's stabiliser)
       h2tp::rank         this rank's index (vocabulary offsets of the masked lookups)

They are torch custom ops (torch.library) with autograd formulas and fake kernels, so AOTAutograd
derives the backward with f and g swapped; they lower to the op set's COMM ops `tp_all_reduce`
and `tp_rank`, which a worker runs over its TP group (backends/base.py `run_program`'s comm hook).
An op without a rule whose inputs are sharded is a located H2Error, never a silently wrong
program. Stage boundaries stay replicated (every block ends in a residual add after g).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx
from torch.fx.experimental.proxy_tensor import make_fx

from frontend.lower import op_name, source_info
from h2ir.errors import H2Error

aten = torch.ops.aten

# ---- the collectives as torch custom ops -------------------------------------------------------
# Outside an h2 program (eager torch) they act as a group of one.


@torch.library.custom_op("h2tp::copy", mutates_args=())
def tp_copy(x: torch.Tensor, size: int) -> torch.Tensor:
    return x.clone()


@tp_copy.register_fake
def _(x, size):
    return torch.empty_like(x)


@torch.library.custom_op("h2tp::all_reduce", mutates_args=())
def tp_all_reduce(x: torch.Tensor, size: int) -> torch.Tensor:
    return x.clone()


@tp_all_reduce.register_fake
def _(x, size):
    return torch.empty_like(x)


@torch.library.custom_op("h2tp::all_reduce_max", mutates_args=())
def tp_all_reduce_max(x: torch.Tensor, size: int) -> torch.Tensor:
    return x.clone()


@tp_all_reduce_max.register_fake
def _(x, size):
    return torch.empty_like(x)


@torch.library.custom_op("h2tp::rank", mutates_args=())
def tp_rank(anchor: torch.Tensor, size: int) -> torch.Tensor:
    return torch.zeros((), dtype=torch.int64, device=anchor.device)


@tp_rank.register_fake
def _(anchor, size):
    return torch.empty((), dtype=torch.int64, device=anchor.device)


def _setup_size(ctx, inputs, output):
    ctx.size = inputs[1]


tp_copy.register_autograd(lambda ctx, g: (tp_all_reduce(g, ctx.size), None),
                          setup_context=_setup_size)
tp_all_reduce.register_autograd(lambda ctx, g: (g, None), setup_context=_setup_size)

F_OP = torch.ops.h2tp.copy.default
G_OP = torch.ops.h2tp.all_reduce.default
MAX_OP = torch.ops.h2tp.all_reduce_max.default
RANK_OP = torch.ops.h2tp.rank.default


# ---- placements -------------------------------------------------------------------------------

R, P = "R", "P"          # a shard is the int dim it is split on


def _is_shard(p) -> bool:
    return isinstance(p, int) and not isinstance(p, bool)


@dataclass
class ParamSharding:
    name: str            # parameter FQN
    kind: str            # 'column' | 'row' | 'vocab' | 'replicated'
    dim: int | None      # the dim split across the ranks (None: replicated)

    def __str__(self) -> str:
        return self.kind if self.dim is None else f"{self.kind} (dim {self.dim})"


class _Pending:
    """A parameter whose sharding its consumer decides; `transposed` after t()/transpose."""

    def __init__(self, fqn: str, transposed: bool = False):
        self.fqn, self.transposed = fqn, transposed


def _meta(v):
    """A meta-device tensor like `v` (a traced or fake value), or v's structure of them."""
    if isinstance(v, torch.Tensor):
        return torch.empty(v.shape, dtype=v.dtype, device="meta")
    if isinstance(v, (list, tuple)):
        return type(v)(_meta(x) for x in v)
    return v


_UNARY = {aten.neg.default, aten.exp.default, aten.log.default, aten.sqrt.default,
          aten.rsqrt.default, aten.tanh.default, aten.sigmoid.default, aten.relu.default,
          aten.silu.default, aten.gelu.default, aten.abs.default, aten.reciprocal.default,
          aten.sin.default, aten.cos.default, aten.pow.Tensor_Scalar, aten._to_copy.default,
          aten.clone.default, aten.alias.default, aten.detach.default, aten.contiguous.default,
          aten.zeros_like.default, aten.ones_like.default, aten.full_like.default,
          aten.empty_like.default, aten.type_as.default, aten.lift_fresh_copy.default,
          aten.logical_not.default, aten.to.dtype}
_LINEAR_UNARY = {aten.neg.default, aten._to_copy.default, aten.clone.default, aten.alias.default,
                 aten.contiguous.default, aten.to.dtype}      # P passes through these
_BINARY = {aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.add.Scalar,
           aten.sub.Scalar, aten.mul.Scalar, aten.div.Scalar, aten.rsub.Scalar, aten.rsub.Tensor,
           aten.maximum.default, aten.minimum.default, aten.pow.Tensor_Tensor, aten.where.self,
           aten.where.ScalarSelf, aten.where.ScalarOther, aten.masked_fill.Scalar,
           aten.masked_fill.Tensor, aten.eq.Tensor, aten.eq.Scalar, aten.ne.Tensor,
           aten.ne.Scalar, aten.lt.Tensor, aten.lt.Scalar, aten.le.Tensor, aten.le.Scalar,
           aten.gt.Tensor, aten.gt.Scalar, aten.ge.Tensor, aten.ge.Scalar,
           aten.logical_and.default, aten.logical_or.default, aten.clamp.default,
           aten.clamp_min.default, aten.clamp_max.default}
_RESHAPE = {aten.view.default, aten._unsafe_view.default, aten.reshape.default,
            aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default,
            aten.flatten.using_ints}
_SHAPE_ARG = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}
_REDUCE = {aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.amin.default}
_ATTENTION = {aten._scaled_dot_product_flash_attention_for_cpu.default,
              aten._scaled_dot_product_efficient_attention.default,
              aten._scaled_dot_product_flash_attention.default,
              aten.scaled_dot_product_attention.default,
              aten._scaled_dot_product_attention_math.default}
_ALIASES = {aten.t.default, aten.transpose.int, aten.permute.default}


class ShardingError(H2Error):
    pass


class _Pass:
    """One run of the pass over one layer's fx graph (global shapes in, local shapes out)."""

    def __init__(self, gm: torch.fx.GraphModule, tp: int, params: dict, decided: dict,
                 layer: str, file: str | None):
        self.old, self.tp, self.params, self.decided = gm, tp, params, decided
        self.layer, self.file = layer, file
        self.g = torch.fx.Graph()
        self.env: dict = {}
        self.pl: dict = {}          # new node -> placement (or a list of them, for tuples)
        self.gval: dict = {}        # new node -> meta tensor of the global value
        self.pending: dict = {}     # new node -> _Pending
        self.ph: dict = {}          # FQN -> new placeholder
        self.f_cache: dict = {}
        self.g_cache: dict = {}
        self.src = None             # the old node being rewritten (for errors and meta)

    # -- errors ---------------------------------------------------------------------------------
    def fail(self, why: str):
        src = source_info(self.src) if self.src is not None else None
        what = op_name(self.src.target) if self.src is not None else "?"
        module = src.module if src else "?"
        line, hint = None, None
        if src and src.line:
            hint = f"at {src.line}"
            path, _, rest = src.line.partition(":")
            if self.file and path and _same(path, self.file) and rest.split(":")[0].isdigit():
                line = int(rest.split(":")[0])
        raise ShardingError(f"tensor parallelism (tp={self.tp}), layer {self.layer}, op {what} "
                            f"(from module '{module}'): {why}", self.file, line, hint=hint)

    # -- emitting -------------------------------------------------------------------------------
    def emit(self, target, args, kwargs=None, placement=R):
        kwargs = kwargs or {}
        n = self.g.call_function(target, tuple(args), dict(kwargs))
        if self.src is not None:
            n.meta = _src_meta(self.src)
        self.gval[n] = _meta(self._replicated_meta(target, args, kwargs))
        self.pl[n] = placement
        return n

    def rank_shape(self, n) -> list:
        return list(self.gval[n].shape)

    def f(self, n):
        """R -> S compute: identity forward, all-reduce of the gradient backward. A reshape of a
        replicated value gets f on the value it reshapes (then the reshape again), so every
        column-parallel linear reading one activation — Q, K and V; gate and up — shares one f,
        and the backward all-reduces their summed gradient once (Megatron's two per block)."""
        if not self.gval[n].is_floating_point():
            return n
        if n in self.f_cache:
            return self.f_cache[n]
        if (getattr(n, "op", None) == "call_function" and n.target in _SHAPE_ARG and n.args
                and isinstance(n.args[0], torch.fx.Node) and self.pl.get(n.args[0]) == R
                and n.args[0] in self.gval and self.gval[n.args[0]].is_floating_point()):
            base = self.f(n.args[0])
            self.f_cache[n] = self.emit(n.target, (base, *n.args[1:]), dict(n.kwargs),
                                        placement=R)
        else:
            self.f_cache[n] = self.emit(F_OP, (n, self.tp), placement=R)
        return self.f_cache[n]

    def reduce(self, n):
        """P -> R: the all-reduce (g)."""
        if self.pl.get(n) != P:
            return n
        if n not in self.g_cache:
            self.g_cache[n] = self.emit(G_OP, (n, self.tp), placement=R)
        return self.g_cache[n]

    def decide(self, fqn: str, kind: str, dim: int | None):
        prev = self.decided.get(fqn)
        if prev is not None and prev.dim != dim:
            self.fail(f"parameter {fqn} is used as {kind} here but was sharded as {prev} "
                      "elsewhere (a tied parameter must be split the same way at both ends)")
        if prev is None:
            self.decided[fqn] = ParamSharding(fqn, kind, dim)
        if fqn in self.ph:
            self.pl[self.ph[fqn]] = R if dim is None else dim
        if dim is not None:
            size = self.gval[self.ph[fqn]].shape[dim]
            if size % self.tp:
                self.fail(f"parameter {fqn} has {size} rows/columns along dim {dim}, not "
                          f"divisible by tp={self.tp}")

    def value(self, n):
        """A tensor argument; a pending parameter used by an op without a sharding of its own
        is replicated."""
        p = self.pending.get(n)
        if p is not None:
            self.decide(p.fqn, "replicated", None)
            del self.pending[n]
        return n

    # -- the pass -------------------------------------------------------------------------------
    def run(self) -> torch.fx.GraphModule:
        for node in self.old.graph.nodes:
            self.src = node
            if node.op == "placeholder":
                self.placeholder(node)
            elif node.op == "call_function":
                args = torch.fx.node.map_arg(node.args, lambda a: self.env[a])
                kwargs = torch.fx.node.map_arg(node.kwargs, lambda a: self.env[a])
                self.env[node] = self.call(node.target, args, kwargs)
            elif node.op == "output":
                self.output(node)
            else:
                self.fail(f"unexpected fx node {node.op}")
        for n, p in list(self.pending.items()):      # parameters only ever transposed
            if p.fqn not in self.decided:
                self.decide(p.fqn, "replicated", None)
        return self.finish()

    def placeholder(self, node):
        n = self.g.placeholder(node.name)
        n.meta = dict(node.meta)
        self.gval[n] = _meta(node.meta["val"])
        self.pl[n] = R
        if node.name in self.params:
            fqn = self.params[node.name]
            self.ph[fqn] = n
            prev = self.decided.get(fqn)
            if prev is None:
                self.pending[n] = _Pending(fqn)
            elif prev.dim is not None:
                self.pl[n] = prev.dim
        self.env[node] = n

    def output(self, node):
        outs = []
        for a in node.args[0]:
            n = self.reduce(self.value(self.env[a]))
            if _is_shard(self.pl[n]):
                self.fail(f"output {a.name} of the layer is sharded on dim {self.pl[n]}; stage "
                          "boundaries must be replicated (no all-gather rule)")
            outs.append(n)
        self.g.output(tuple(outs))

    def finish(self) -> torch.fx.GraphModule:
        gm = torch.fx.GraphModule(torch.nn.Module(), self.g)
        for n in gm.graph.nodes:      # placeholders: local shapes
            if n.op == "placeholder":
                v = self.gval[n]
                shape = list(v.shape)
                p = self.pl[n]
                fqn = self.params.get(n.name)
                if fqn is not None and self.decided[fqn].dim is not None:
                    shape[self.decided[fqn].dim] //= self.tp
                n.meta["val"] = torch.empty(shape, dtype=v.dtype, device="meta")
                assert not (_is_shard(p) and fqn is None)
        _propagate_local(gm)
        return gm

    # -- one call -------------------------------------------------------------------------------
    def call(self, target, args, kwargs):
        if target is operator.getitem:
            tup, i = args
            n = self.g.call_function(operator.getitem, (tup, i))
            n.meta = _src_meta(self.src)
            self.gval[n] = self.gval[tup][i]
            self.pl[n] = self.pl[tup][i]
            return n
        rule = _RULES.get(target)
        if rule is None:
            for group, r in _GROUP_RULES:
                if target in group:
                    rule = r
                    break
        tensors = [a for a in _flat(args, kwargs) if isinstance(a, torch.fx.Node)]
        if rule is None:
            for a in tensors:
                if self.pl.get(a) not in (R, None) or a in self.pending:
                    if a in self.pending:
                        self.value(a)
                        continue
                    self.fail(f"no sharding rule for this op, and its input is "
                              f"{_describe(self.pl[a])}")
            return self.emit(target, args, kwargs, placement=self._replicated_out(target, args,
                                                                                  kwargs))
        return rule(self, target, args, kwargs)

    def _replicated_out(self, target, args, kwargs):
        out = self._replicated_meta(target, args, kwargs)
        return [R] * len(out) if isinstance(out, (tuple, list)) else R


def _src_meta(node) -> dict:
    """What a rewritten node keeps of its source's meta: where it came from, not its type."""
    return {k: v for k, v in node.meta.items() if k not in ("val", "tensor_meta")}


def _same(a: str, b: str) -> bool:
    from pathlib import Path
    try:
        return Path(a).resolve() == Path(b).resolve()
    except OSError:
        return False


def _flat(args, kwargs):
    out = []

    def walk(x):
        if isinstance(x, (list, tuple)):
            for y in x:
                walk(y)
        elif isinstance(x, dict):
            for y in x.values():
                walk(y)
        else:
            out.append(x)
    walk(args)
    walk(kwargs)
    return out


def _describe(p) -> str:
    return {R: "replicated", P: "a partial sum"}.get(p, f"sharded on dim {p}")


def _propagate_local(gm: torch.fx.GraphModule) -> None:
    """Local (per-rank) shapes on every node, from the placeholders' local shapes."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        args = [torch.empty(n.meta["val"].shape, dtype=n.meta["val"].dtype, device="cpu")
                for n in gm.graph.nodes if n.op == "placeholder"]
    FakeTensorProp(gm, mode).propagate(*args)


# ---- rules ----------------------------------------------------------------------------------------

def _rule_alias(ps: _Pass, target, args, kwargs):
    """t / transpose / permute: the shard dim moves with its dim."""
    x = args[0]
    rank = len(ps.gval[x].shape)
    if target is aten.t.default:
        perm = [1, 0] if rank == 2 else list(range(rank))
    elif target is aten.transpose.int:
        d0, d1 = args[1] % rank, args[2] % rank
        perm = list(range(rank))
        perm[d0], perm[d1] = perm[d1], perm[d0]
    else:
        perm = [d % rank for d in args[1]]
    out = ps.emit(target, args, kwargs)
    pend = ps.pending.get(x)
    if pend is not None:
        if perm == [1, 0]:
            ps.pending[out] = _Pending(pend.fqn, not pend.transposed)
            return out
        ps.value(x)
    p = ps.pl[x]
    ps.pl[out] = perm.index(p) if _is_shard(p) else p
    return out


def _rule_unary(ps: _Pass, target, args, kwargs):
    x = ps.value(args[0])
    if ps.pl[x] == P and target not in _LINEAR_UNARY:
        x = ps.reduce(x)
    if target in (aten.native_dropout.default,) and _is_shard(ps.pl[x]):
        ps.fail("dropout on a sharded value would draw other masks than tp=1")
    return ps.emit(target, (x,) + tuple(args[1:]), kwargs, placement=ps.pl[x])


def _rule_binary(ps: _Pass, target, args, kwargs):
    """Elementwise with broadcasting: S(d) wins; an R operand must be broadcast (size 1 or
    absent) along d and enters through f; P survives only P +- P and P * or / a scalar."""
    ins = [ps.value(a) if isinstance(a, torch.fx.Node) else a for a in args]
    nodes = [a for a in ins if isinstance(a, torch.fx.Node)]
    pls = [ps.pl[a] for a in nodes]
    keep_p = (P in pls and (
        (target in (aten.add.Tensor, aten.sub.Tensor) and all(p == P for p in pls))
        or (target in (aten.mul.Tensor, aten.div.Tensor, aten.mul.Scalar, aten.div.Scalar)
            and len(nodes) == 1)
        or (target in (aten.add.Scalar, aten.sub.Scalar) and False)))
    if keep_p:
        return ps.emit(target, ins, kwargs, placement=P)
    ins = [ps.reduce(a) if isinstance(a, torch.fx.Node) else a for a in ins]
    nodes = [a for a in ins if isinstance(a, torch.fx.Node)]
    out_rank = len(ps._replicated_meta(target, ins, kwargs).shape)
    shard = None
    for a in nodes:
        p = ps.pl[a]
        if _is_shard(p):
            d = p + out_rank - len(ps.gval[a].shape)
            if shard is not None and shard != d:
                ps.fail(f"operands sharded on different dims ({shard} and {d})")
            shard = d
    if shard is None:
        return ps.emit(target, ins, kwargs, placement=R)
    fixed = []
    for a in ins:
        if isinstance(a, torch.fx.Node) and ps.pl[a] == R:
            shape = ps.rank_shape(a)
            d = shard - (out_rank - len(shape))
            if d >= 0 and shape[d] != 1:
                ps.fail(f"a replicated operand of shape {shape} meets a value sharded on dim "
                        f"{shard} (it would need slicing by rank)")
            a = ps.f(a)
        fixed.append(a)
    return ps.emit(target, fixed, kwargs, placement=shard)


def _replicated_meta(self, target, args, kwargs):
    """The op's global result as meta tensors (the source node's traced value when the op
    cannot run on meta tensors, e.g. one that reads a constant's data)."""
    margs = torch.fx.node.map_arg((tuple(args), dict(kwargs)), lambda a: self.gval[a])
    try:
        return target(*margs[0], **margs[1])
    except (NotImplementedError, RuntimeError):
        if self.src is not None and target is self.src.target:
            return _meta(self.src.meta["val"])
        raise


_Pass._replicated_meta = _replicated_meta


def _dim_groups(a: list, b: list):
    """Pair up the dims of two shapes of one element count into groups of equal products
    (size-1 dims join no group): [(dims of a, dims of b)]."""
    ia = [i for i, s in enumerate(a) if s != 1]
    ib = [i for i, s in enumerate(b) if s != 1]
    groups, i, j = [], 0, 0
    while i < len(ia) or j < len(ib):
        ga, gb = [ia[i]], [ib[j]]
        pa, pb = a[ia[i]], b[ib[j]]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb:
                ga.append(ia[i]); pa *= a[ia[i]]; i += 1
            else:
                gb.append(ib[j]); pb *= b[ib[j]]; j += 1
        groups.append((ga, gb))
    return groups


def _rule_reshape(ps: _Pass, target, args, kwargs):
    """view/reshape/_unsafe_view/(un)squeeze/flatten: the shard dim must lead its group of
    merged/split dims; the output's leading dim of that group is then split (its size divisible
    by tp), and a shape constant is rewritten to the local shape (heads H -> H/tp)."""
    x = ps.value(args[0])
    p = ps.pl[x]
    if not _is_shard(p):
        return ps.emit(target, (x,) + tuple(args[1:]), kwargs, placement=p)
    a = ps.rank_shape(x)
    b = list(ps.src.meta["val"].shape)
    out_dim = None
    if a[p] == 1:
        ps.fail("a sharded dim of size 1")
    for ga, gb in _dim_groups(a, b):
        if p in ga:
            if ga[0] != p:
                ps.fail(f"reshape {a} -> {b} merges the sharded dim {p} into a dim that does not "
                        "lead it (no contiguous split per rank)")
            out_dim = gb[0]
            if b[out_dim] % ps.tp:
                ps.fail(f"reshape {a} -> {b}: the split dim becomes {b[out_dim]} (of "
                        f"{[b[d] for d in gb]}), not divisible by tp={ps.tp} — e.g. key/value "
                        "heads that tp does not divide")
    rest = tuple(args[1:])
    if target in _SHAPE_ARG:
        local = list(b)
        local[out_dim] //= ps.tp
        rest = (local,)
    out = ps.g.call_function(target, (x,) + rest, dict(kwargs))
    out.meta = _src_meta(ps.src)
    ps.gval[out] = _meta(ps.src.meta["val"])
    ps.pl[out] = out_dim
    return out


def _rule_expand(ps: _Pass, target, args, kwargs):
    x = ps.value(args[0])
    p = ps.pl[x]
    if p == P:
        x, p = ps.reduce(x), R
    shape = list(args[1])
    if not _is_shard(p):
        return ps.emit(target, (x,) + tuple(args[1:]), kwargs, placement=p)
    d = p + len(shape) - len(ps.rank_shape(x))
    local = list(ps.src.meta["val"].shape)
    local[d] //= ps.tp
    out = ps.g.call_function(target, (x, local) + tuple(args[2:]), dict(kwargs))
    out.meta = _src_meta(ps.src)
    ps.gval[out] = _meta(ps.src.meta["val"])
    ps.pl[out] = d
    return out


def _rule_dim_op(ps: _Pass, target, args, kwargs):
    """slice / narrow / select / split / chunk / unbind along a dim other than the shard dim."""
    x = ps.reduce(ps.value(args[0]))
    p = ps.pl[x]
    rank = len(ps.rank_shape(x))
    if target in (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default):
        dim = (args[2] if len(args) > 2 else kwargs.get("dim", 0)) % rank
    elif target is aten.unbind.int:
        dim = (args[1] if len(args) > 1 else 0) % rank
    else:
        dim = (args[1] if len(args) > 1 else kwargs.get("dim", 0)) % rank
    if _is_shard(p) and dim == p:
        ps.fail(f"slicing along the sharded dim {p}")
    meta = ps._replicated_meta(target, (x,) + tuple(args[1:]), kwargs)
    removes = target in (aten.select.int, aten.unbind.int)
    q = p - 1 if (_is_shard(p) and removes and dim < p) else p
    placement = [q] * len(meta) if isinstance(meta, (list, tuple)) else q
    return ps.emit(target, (x,) + tuple(args[1:]), kwargs, placement=placement)


def _rule_cat(ps: _Pass, target, args, kwargs):
    xs = [ps.reduce(ps.value(a)) for a in args[0]]
    dim = (args[1] if len(args) > 1 else kwargs.get("dim", 0)) % len(ps.rank_shape(xs[0]))
    pls = {ps.pl[a] for a in xs}
    if len(pls) > 1:
        ps.fail(f"concatenating values of different placements ({', '.join(map(_describe, pls))})")
    p = pls.pop()
    if _is_shard(p) and dim == p:
        ps.fail(f"concatenating along the sharded dim {p}")
    return ps.emit(target, (xs,) + tuple(args[1:]), kwargs, placement=p)


def _rule_reduce(ps: _Pass, target, args, kwargs):
    """A sum over the shard dim is a partial sum (P); mean/amax/amin over it have no rule."""
    x = ps.reduce(ps.value(args[0]))
    p = ps.pl[x]
    rank = len(ps.rank_shape(x))
    dims = args[1] if len(args) > 1 else kwargs.get("dim")
    dims = list(range(rank)) if dims in (None, []) else [d % rank for d in
                                                          ([dims] if isinstance(dims, int) else dims)]
    keep = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
    if not _is_shard(p):
        return ps.emit(target, (x,) + tuple(args[1:]), kwargs, placement=p)
    if p in dims:
        if target is not aten.sum.dim_IntList:
            ps.fail(f"{op_name(target)} over the sharded dim {p}")
        return ps.emit(target, (x,) + tuple(args[1:]), kwargs, placement=P)
    q = p if keep else p - sum(1 for d in dims if d < p)
    return ps.emit(target, (x,) + tuple(args[1:]), kwargs, placement=q)


def _rule_sum_all(ps: _Pass, target, args, kwargs):
    x = ps.reduce(ps.value(args[0]))
    return ps.emit(target, (x,) + tuple(args[1:]), kwargs,
                   placement=P if _is_shard(ps.pl[x]) else R)


def _linear_parallel(ps: _Pass, x, w_t, fqn_transposed):
    """(x, placement of the result, kind) of x @ W^T for a pending W: column-parallel when x is
    replicated, row-parallel when x is split on its contraction (last) dim."""
    fqn, transposed = fqn_transposed
    x = ps.reduce(x)
    px = ps.pl[x]
    last = len(ps.rank_shape(x)) - 1
    # the weight W is [out, in]; w_t is W^T ([in, out]) when the parameter was transposed once
    if px == R:
        ps.decide(fqn, "column", 0)
        ps.pl[w_t] = 1 if transposed else 0
        return ps.f(x), len(ps.rank_shape(x)) - 1, "column"
    if px == last:
        ps.decide(fqn, "row", 1)
        ps.pl[w_t] = 0 if transposed else 1
        return x, P, "row"
    ps.fail(f"a linear whose input is {_describe(px)} (neither replicated nor split on its "
            "contraction dim)")


def _rule_mm(ps: _Pass, target, args, kwargs):
    """mm / addmm with a parameter operand (t(W)): column- or row-parallel; mm of two
    activations: split contraction dims give P, split free dims pass."""
    if target is aten.addmm.default:
        bias, a, b = args[0], args[1], args[2]
    else:
        bias, (a, b) = None, args[:2]
    pend = ps.pending.pop(b, None)
    if pend is not None and pend.transposed:
        ps.pl[b] = R
        x, out_p, kind = _linear_parallel(ps, ps.value(a), b, (pend.fqn, True))
        if bias is None:
            return ps.emit(aten.mm.default, (x, b), placement=out_p)
        bp = ps.pending.pop(bias, None)
        if kind == "column":
            if bp is not None:
                ps.decide(bp.fqn, "column", 0)
                ps.pl[bias] = 0
            elif ps.pl[bias] != 0:
                ps.fail("a column-parallel linear whose bias is not split with it")
            return ps.emit(aten.addmm.default, (bias, x, b) + tuple(args[3:]), kwargs,
                           placement=1)
        if bp is not None:
            ps.decide(bp.fqn, "replicated", None)
        y = ps.reduce(ps.emit(aten.mm.default, (x, b), placement=P))
        return ps.emit(aten.add.Tensor, (y, bias), placement=R)
    if pend is not None:
        ps.pending[b] = pend
    a, b = ps.reduce(ps.value(a)), ps.reduce(ps.value(b))
    if bias is not None:
        bias = ps.reduce(ps.value(bias))
    pa, pb = ps.pl[a], ps.pl[b]
    if pa == R and pb == R and (bias is None or ps.pl[bias] == R):
        return ps.emit(target, args if bias is None else (bias, a, b) + tuple(args[3:]), kwargs)
    if bias is None:
        if pa == 1 and pb == 0:
            return ps.emit(target, (a, b), kwargs, placement=P)
        if pa == 0 and pb == R:
            return ps.emit(target, (a, ps.f(b)), kwargs, placement=0)
        if pa == R and pb == 1:
            return ps.emit(target, (ps.f(a), b), kwargs, placement=1)
    ps.fail(f"a matrix product of operands {_describe(pa)} and {_describe(pb)}")


def _rule_linear(ps: _Pass, target, args, kwargs):
    """aten.linear (torch.export keeps it): x @ W^T + b, column- or row-parallel as mm."""
    x, w = args[0], args[1]
    bias = args[2] if len(args) > 2 else kwargs.get("bias")
    pend = ps.pending.pop(w, None)
    if pend is None or pend.transposed:
        if pend is not None:
            ps.pending[w] = pend
        return _rule_default_replicated(ps, target, args, kwargs)
    x, out_p, kind = _linear_parallel(ps, ps.value(x), w, (pend.fqn, False))
    if bias is None:
        return ps.emit(target, (x, w), placement=out_p)
    bp = ps.pending.pop(bias, None)
    if kind == "column":
        if bp is not None:
            ps.decide(bp.fqn, "column", 0)
        elif ps.pl[bias] != 0:
            ps.fail("a column-parallel linear whose bias is not split with it")
        return ps.emit(target, (x, w, bias), placement=out_p)
    if bp is not None:
        ps.decide(bp.fqn, "replicated", None)
    y = ps.reduce(ps.emit(target, (x, w), placement=P))
    return ps.emit(aten.add.Tensor, (y, bias), placement=R)


def _rule_bmm(ps: _Pass, target, args, kwargs):
    a, b = (ps.reduce(ps.value(x)) for x in args[:2])
    pa, pb = ps.pl[a], ps.pl[b]
    if pa == R and pb == R:
        return ps.emit(target, (a, b), kwargs)
    if pa == 0 and pb == 0:
        return ps.emit(target, (a, b), kwargs, placement=0)
    if pa == 2 and pb == 1:
        return ps.emit(target, (a, b), kwargs, placement=P)
    ps.fail(f"a batched product of operands {_describe(pa)} and {_describe(pb)}")


def _rule_attention(ps: _Pass, target, args, kwargs):
    """Attention runs per head: q, k, v split on the head dim (1) give outputs split on it;
    a mask must broadcast along the heads."""
    q, k, v = (ps.reduce(ps.value(x)) for x in args[:3])
    pls = [ps.pl[x] for x in (q, k, v)]
    rest = list(args[3:])
    mask = kwargs.get("attn_mask")
    if target is aten.scaled_dot_product_attention.default and rest and \
            isinstance(rest[0], torch.fx.Node):
        mask = rest[0]
    if pls == [R, R, R]:
        if mask is not None and isinstance(mask, torch.fx.Node) and ps.pl[mask] != R:
            ps.fail("attention with a sharded mask")
        return ps.emit(target, (q, k, v) + tuple(rest), kwargs,
                       placement=ps._replicated_out(target, (q, k, v) + tuple(rest), kwargs))
    if pls != [1, 1, 1]:
        ps.fail(f"attention with q, k, v {', '.join(map(_describe, pls))}: every one must be "
                "split on the head dim (key/value heads that tp does not divide stay whole and "
                "cannot meet split query heads)")
    if isinstance(mask, torch.fx.Node):
        shape = ps.rank_shape(mask)
        if len(shape) == 4 and shape[1] != 1:
            ps.fail(f"attention mask of shape {shape} varies along the heads")
    meta = ps._replicated_meta(target, (q, k, v) + tuple(rest), kwargs)
    placement = [1 if isinstance(m, torch.Tensor) and m.dim() >= 3 else R for m in meta] \
        if isinstance(meta, (tuple, list)) else 1
    return ps.emit(target, (q, k, v) + tuple(rest), kwargs, placement=placement)


def _rank_offset(ps: _Pass, anchor, rows: int):
    """rank * rows: the first global index of this rank's slice of a split dim."""
    r = ps.emit(RANK_OP, (anchor, ps.tp))
    return ps.emit(aten.mul.Tensor, (r, rows))


def _local_index(ps: _Pass, ids, rows: int):
    """(ids - offset with out-of-range entries set to 0, the out-of-range mask)."""
    local = ps.emit(aten.sub.Tensor, (ids, _rank_offset(ps, ids, rows)))
    below = ps.emit(aten.lt.Scalar, (local, 0))
    above = ps.emit(aten.ge.Scalar, (local, rows))
    oob = ps.emit(aten.logical_or.default, (below, above))
    return ps.emit(aten.masked_fill.Scalar, (local, oob, 0)), oob


def _rule_embedding(ps: _Pass, target, args, kwargs):
    """Vocabulary-parallel embedding: rank r holds rows [r V/tp, (r+1) V/tp); ids outside are
    looked up as row 0 and zeroed; the all-reduce (g) sums the ranks' rows."""
    w, ids = args[0], ps.value(args[1])
    pend = ps.pending.pop(w, None)
    if (pend is None and ps.pl[w] != 0) or (pend is not None and pend.transposed):
        if pend is not None:
            ps.pending[w] = pend
        return _rule_default_replicated(ps, target, args, kwargs)
    padding = args[2] if len(args) > 2 else kwargs.get("padding_idx", -1)
    if padding is not None and padding >= 0:
        ps.fail("a vocabulary-parallel embedding with padding_idx (its row lives on one rank)")
    if pend is not None:
        ps.decide(pend.fqn, "vocab", 0)
    if ps.pl[ids] != R:
        ps.fail("embedding of sharded ids")
    rows = ps.rank_shape(w)[0] // ps.tp
    local, oob = _local_index(ps, ids, rows)
    e = ps.emit(target, (w, local), placement=P)
    e.meta["h2tp_global_rows"] = rows
    ps.gval[e] = ps._replicated_meta(target, (w, ids), {})
    mask = ps.emit(aten.unsqueeze.default, (oob, -1))
    e = ps.emit(aten.masked_fill.Scalar, (e, mask, 0.0), placement=P)
    return ps.reduce(e)


def _rule_default_replicated(ps: _Pass, target, args, kwargs):
    for a in _flat(args, kwargs):
        if isinstance(a, torch.fx.Node):
            ps.value(a)
            if ps.pl[a] != R:
                ps.fail(f"no sharding rule for this op with an input {_describe(ps.pl[a])}")
    return ps.emit(target, args, kwargs, placement=ps._replicated_out(target, args, kwargs))


def _rule_log_softmax(ps: _Pass, target, args, kwargs):
    """Vocabulary-parallel log-softmax over the split dim d: the max and the sum of exps are
    all-reduced (max without gradient; the sum through g) — Megatron's vocab-parallel
    cross-entropy, written as elementary ops so AOTAutograd derives its backward."""
    x = ps.reduce(ps.value(args[0]))
    p = ps.pl[x]
    d = args[1] % len(ps.rank_shape(x))
    if not _is_shard(p) or p != d:
        return _rule_unary(ps, target, (x,) + tuple(args[1:]), kwargs)
    if target is not aten._log_softmax.default:
        ps.fail("softmax over the sharded dim (only log_softmax feeding the loss has a rule)")
    m = ps.emit(aten.amax.default, (x, [d], True), placement=R)
    m = ps.emit(aten.detach.default, (m,), placement=R)
    m = ps.emit(MAX_OP, (m, ps.tp), placement=R)
    shifted = _rule_binary(ps, aten.sub.Tensor, (x, m), {})
    e = _rule_unary(ps, aten.exp.default, (shifted,), {})
    s = _rule_reduce(ps, aten.sum.dim_IntList, (e, [d], True), {})
    ls = _rule_unary(ps, aten.log.default, (ps.reduce(s),), {})
    return _rule_binary(ps, aten.sub.Tensor, (shifted, ls), {})


def _rule_nll(ps: _Pass, target, args, kwargs):
    """Vocabulary-parallel NLL: each rank picks the target's log-probability where it holds the
    target's column (0 elsewhere); the all-reduce (g) sums the picks."""
    logp, tgt, weight, reduction, ignore = (list(args) + [None, 1, -100])[:5]
    logp, tgt = ps.reduce(ps.value(logp)), ps.value(tgt)
    p = ps.pl[logp]
    if not _is_shard(p):
        return _rule_default_replicated(ps, target, (logp, tgt) + tuple(args[2:]), kwargs)
    rank = len(ps.rank_shape(logp))
    if p != rank - 1 or weight is not None:
        ps.fail("nll_loss over a value split on another dim than the classes, or with weights")
    rows = ps.rank_shape(logp)[-1] // ps.tp
    local, oob = _local_index(ps, tgt, rows)
    idx = ps.emit(aten.unsqueeze.default, (local, -1))
    picked = ps.emit(aten.gather.default, (logp, rank - 1, idx), placement=P)
    ps.gval[picked] = ps._replicated_meta(aten.gather.default, (logp, rank - 1, idx), {})
    picked = ps.emit(aten.squeeze.dim, (picked, -1), placement=P)
    picked = ps.reduce(ps.emit(aten.masked_fill.Scalar, (picked, oob, 0.0), placement=P))
    valid = ps.emit(aten.ne.Scalar, (tgt, ignore))
    invalid = ps.emit(aten.logical_not.default, (valid,))
    picked = ps.emit(aten.masked_fill.Scalar, (picked, invalid, 0.0))
    nll = ps.emit(aten.neg.default, (picked,))
    count = ps.emit(aten.sum.default, (ps.emit(aten._to_copy.default, (valid,),
                                                {"dtype": ps.gval[logp].dtype}),))
    if reduction == 0:
        loss = nll
    else:
        loss = ps.emit(aten.sum.default, (nll,))
        if reduction == 1:
            loss = ps.emit(aten.div.Tensor, (loss, count))
    out = ps.g.call_function(_pair, (loss, count))
    ps.gval[out] = (ps.gval[loss], ps.gval[count])
    ps.pl[out] = [R, R]
    return out


def _pair(a, b):
    return (a, b)


_RULES = {aten.linear.default: _rule_linear, aten.mm.default: _rule_mm, aten.addmm.default: _rule_mm, aten.bmm.default: _rule_bmm,
          aten.embedding.default: _rule_embedding, aten.expand.default: _rule_expand,
          aten.cat.default: _rule_cat, aten.sum.default: _rule_sum_all,
          aten._log_softmax.default: _rule_log_softmax, aten._softmax.default: _rule_log_softmax,
          aten.nll_loss_forward.default: _rule_nll,
          aten.native_dropout.default: _rule_unary}
_GROUP_RULES = [(_ALIASES, _rule_alias), (_UNARY, _rule_unary), (_BINARY, _rule_binary),
                (_RESHAPE, _rule_reshape), (_REDUCE, _rule_reduce), (_ATTENTION, _rule_attention),
                ({aten.slice.Tensor, aten.narrow.default, aten.select.int, aten.split.Tensor,
                  aten.split_with_sizes.default, aten.chunk.default, aten.unbind.int},
                 _rule_dim_op)]


# ---- the pass's entry points ------------------------------------------------------------------------

def with_loss(gm: torch.fx.GraphModule, loss_fn) -> torch.fx.GraphModule:
    """The last layer's graph with the loss traced into it (a `targets` placeholder after the
    others, the loss as its one output), so the vocabulary-parallel rules see the loss's ops."""
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    outs = out_node.args[0]
    logits = outs[0] if isinstance(outs, (tuple, list)) else outs
    lv = logits.meta["val"]
    tv = torch.empty(lv.shape[:-1], dtype=torch.long, device="meta")
    lg = make_fx(loss_fn, tracing_mode="fake")(torch.empty(lv.shape, dtype=lv.dtype,
                                                           device="meta"), tv)
    g = torch.fx.Graph()
    env = {}
    first = None
    for n in gm.graph.nodes:
        if n.op == "output":
            continue
        env[n] = g.node_copy(n, lambda a: env[a])
        if n.op == "placeholder":
            first = env[n]
    with g.inserting_after(first):
        targets = g.placeholder("targets")
    targets.meta["val"] = tv
    lph = [n for n in lg.graph.nodes if n.op == "placeholder"]
    lenv = {lph[0]: env[logits], lph[1]: targets}
    loss = None
    for n in lg.graph.nodes:
        if n.op == "placeholder":
            continue
        if n.op == "output":
            loss = lenv[n.args[0][0] if isinstance(n.args[0], (tuple, list)) else n.args[0]]
            continue
        c = g.node_copy(n, lambda a: lenv[a])
        c.meta = dict(n.meta)
        for k in ("nn_module_stack",):
            c.meta.pop(k, None)
        lenv[n] = c
    g.output((loss,))
    for n in g.nodes:
        if "val" in n.meta:
            n.meta["val"] = _meta(n.meta["val"])
    return torch.fx.GraphModule(torch.nn.Module(), g)


def shard_layer(gm: torch.fx.GraphModule, tp: int, params: dict, decided: dict, layer: str,
                file: str | None = None) -> torch.fx.GraphModule:
    """The layer graph `gm` (global shapes; `params`: placeholder name -> parameter FQN) rewritten
    for one of `tp` ranks. `decided` collects every parameter's ParamSharding (shared by the
    layers of a model, so a tied parameter is split the same way at both ends)."""
    return _Pass(gm, tp, params, decided, layer, file).run()


def shard_weight(array, sharding: ParamSharding | None, tp: int, rank: int):
    """Rank `rank`'s slice of a parameter's full array."""
    if sharding is None or sharding.dim is None or tp == 1:
        return array
    n = array.shape[sharding.dim] // tp
    index = [slice(None)] * array.ndim
    index[sharding.dim] = slice(rank * n, (rank + 1) * n)
    return array[tuple(index)]
