"""The h2ir graph: typed values, op nodes from the standardized op set, grouped into layers.

A `Graph` is a straight-line program. Its values are graph inputs (activations, token ids),
constants (non-trained buffers such as rotary tables), parameters (owned by a layer, or by the
program when it is a compiled stage program) and node outputs. Layers are the units a pipeline
plan assigns; each layer knows its costs (`layer_costs`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator, Union

from h2ir import opset, recompute
from h2ir.costs import LayerCost, ModelCosts, MoEInfo, TiedParam
from h2ir.types import FLOAT_DTYPES, TensorType

Scalar = Union[int, float, bool, None]
VIEW_OPS = {"reshape", "permute", "transpose", "expand", "slice", "select"}


@dataclass(eq=False)
class Value:
    name: str
    type: TensorType

    def __repr__(self) -> str:
        return f"%{self.name}:{self.type}"


@dataclass(eq=False)
class Node:
    op: str
    inputs: list            # Value or scalar literal
    attrs: dict
    outputs: list           # Value

    @property
    def opdef(self) -> opset.OpDef:
        return opset.get(self.op)

    def input_values(self) -> list[Value]:
        return [v for v in self.inputs if isinstance(v, Value)]


@dataclass(eq=False)
class Layer:
    name: str
    kind: str
    attrs: dict = field(default_factory=dict)
    params: list = field(default_factory=list)     # Value
    nodes: list = field(default_factory=list)      # Node


@dataclass(eq=False)
class Graph:
    name: str
    attrs: dict = field(default_factory=dict)
    inputs: list = field(default_factory=list)     # Value
    consts: list = field(default_factory=list)     # Value
    params: list = field(default_factory=list)     # Value not owned by a layer (stage programs)
    layers: list = field(default_factory=list)     # Layer
    outputs: list = field(default_factory=list)    # Value

    # ---- iteration ---------------------------------------------------------------------------
    def nodes(self) -> Iterator[Node]:
        for layer in self.layers:
            yield from layer.nodes

    def all_params(self) -> list[Value]:
        return list(self.params) + [p for l in self.layers for p in l.params]

    def ops_used(self) -> set[str]:
        return {n.op for n in self.nodes()}

    def layer(self, name: str) -> Layer:
        for l in self.layers:
            if l.name == name:
                return l
        raise KeyError(name)

    # ---- passes ------------------------------------------------------------------------------
    def eliminate_dead_code(self) -> int:
        """Drop nodes none of whose results is used (communication ops are kept: they have
        effects). Returns how many nodes were removed."""
        used = {id(v) for v in self.outputs}
        removed = 0
        for layer in reversed(self.layers):
            keep = []
            for n in reversed(layer.nodes):
                if n.opdef.group is opset.Group.COMM or any(id(v) in used for v in n.outputs):
                    keep.append(n)
                    used.update(id(v) for v in n.input_values())
                else:
                    removed += 1
            layer.nodes = keep[::-1]
        return removed

    # ---- checking ----------------------------------------------------------------------------
    def verify(self) -> None:
        """Every value defined once before use; every node's types match its op's shape rule."""
        defined: dict[str, Value] = {}

        def define(v: Value):
            if v.name in defined:
                raise ValueError(f"value %{v.name} defined twice")
            defined[v.name] = v

        for v in self.inputs + self.consts + self.params:
            define(v)
        for layer in self.layers:
            for p in layer.params:
                define(p)
            for n in layer.nodes:
                if n.op not in opset.OPS:
                    raise ValueError(f"unknown op {n.op!r} (not in the h2ir op set)")
                for v in n.input_values():
                    if defined.get(v.name) is not v:
                        raise ValueError(f"%{v.name} used by {n.op} before it is defined")
                check_node_types(n)
                for v in n.outputs:
                    define(v)
        for v in self.outputs:
            if defined.get(v.name) is not v:
                raise ValueError(f"output %{v.name} is not defined")

    # ---- costs -------------------------------------------------------------------------------
    def layer_costs(self) -> ModelCosts:
        """Per-layer costs for the planner (see h2ir/costs.py for what each figure means)."""
        storage = self._storage_of()
        not_activation = {id(v) for v in self.all_params() + self.consts}
        last_use = self._last_layer_use()
        needs_grad = self._needs_grad()
        fa = recompute.ForwardIndex(self, self.outputs)
        seq_len = int(self.attrs.get("seq_len", 0) or 0)
        layers = []
        live: dict[int, Value] = {id(v): v for v in self.inputs}
        for li, layer in enumerate(self.layers):
            fwd, bwd = _layer_flops(layer)
            saved = _saved_for_backward(layer, storage, not_activation, needs_grad)
            selective = _selective_saved(fa, saved, storage, not_activation, seq_len)
            for n in layer.nodes:
                for v in n.outputs:
                    live[id(v)] = v
            # activations still read by a later layer (or the graph's outputs) leave this one
            crossing = [v for k, v in live.items() if last_use.get(k, -1) > li]
            live = {id(v): v for v in crossing}
            layers.append(_layer_cost(layer, fwd, bwd, saved, crossing, selective))
        a = self.attrs
        return ModelCosts(model=self.name, micro_batch=a.get("micro_batch", 1),
                          seq_len=a.get("seq_len", 0), layers=tuple(layers),
                          d_model=a.get("d_model", 0), n_heads=a.get("n_heads", 0),
                          vocab=a.get("vocab", 0), dtype_bytes=a.get("dtype_bytes", 4),
                          ties=self._ties())

    def _ties(self) -> tuple[TiedParam, ...]:
        """Parameters that layers other than their owner read (the `tied` layer attribute)."""
        owner = {p.name: (l.name, p) for l in self.layers for p in l.params}
        users: dict[str, list[str]] = {}
        for l in self.layers:
            for name in l.attrs.get("tied", ()):
                users.setdefault(name, []).append(l.name)
        return tuple(TiedParam(n, owner[n][1].type.nbytes, owner[n][0], tuple(u))
                     for n, u in users.items() if n in owner)

    def _needs_grad(self) -> set[int]:
        """ids of the values a gradient flows to: parameters, float graph inputs and every float
        value computed from one of them."""
        out = {id(p) for p in self.all_params()}
        out |= {id(v) for v in self.inputs if v.type.dtype in FLOAT_DTYPES}
        for n in self.nodes():
            if any(id(v) in out for v in n.input_values()):
                out.update(id(o) for o in n.outputs if o.type.dtype in FLOAT_DTYPES)
        return out

    def _storage_of(self) -> Callable[[Value], Value]:
        """storage(v): the value whose buffer holds v. A view saved for backward keeps its base
        alive, not a new buffer."""
        producer: dict[int, Node] = {}
        for n in self.nodes():
            for v in n.outputs:
                producer[id(v)] = n

        def storage(v: Value) -> Value:
            while id(v) in producer and producer[id(v)].op in VIEW_OPS:
                v = producer[id(v)].inputs[0]
            return v
        return storage

    def _last_layer_use(self) -> dict[int, int]:
        """id(value) -> index of the last layer that reads it (graph outputs: past the last)."""
        last_use: dict[int, int] = {}
        for li, layer in enumerate(self.layers):
            for n in layer.nodes:
                for v in n.input_values():
                    last_use[id(v)] = li
        for v in self.outputs:
            last_use[id(v)] = len(self.layers)
        return last_use


def _saved_for_backward(layer: Layer, storage: Callable[[Value], Value],
                        not_activation: set, needs_grad: set) -> dict[int, Value]:
    """The activation buffers a layer's ops save for backward (the op set's `saves`), by id;
    parameters and constants are not activations. An op no gradient flows through saves
    nothing; a product saves an input only for another input's gradient (SAVES_FOR_OTHERS)."""
    saved: dict[int, Value] = {}
    for n in layer.nodes:
        grad_in = [isinstance(v, Value) and id(v) in needs_grad for v in n.inputs]
        if not any(grad_in):
            continue
        for s in n.opdef.saves:
            idx = int(s[1:])
            src = n.inputs if s[0] == "i" else n.outputs
            if s[0] == "i" and n.op in opset.SAVES_FOR_OTHERS and \
                    not any(g for j, g in enumerate(grad_in) if j != idx):
                continue
            if idx < len(src) and isinstance(src[idx], Value):
                base = storage(src[idx])
                if id(base) not in not_activation:
                    saved[id(base)] = base
    return saved


def _selective_saved(fa, saved: dict[int, Value], storage: Callable[[Value], Value],
                     not_activation: set, seq_len: int) -> int:
    """Bytes a layer saves under selective recomputation (h2ir/recompute.py's rule, as the
    stage programs apply it): distinct buffers, parameters and constants excluded."""
    def nbytes(v: Value) -> int:
        base = storage(v)
        return 0 if id(base) in not_activation else base.type.nbytes
    kept, _ = recompute.choose(fa, list(saved.values()), "selective", seq_len, nbytes)
    bases = {id(storage(v)): storage(v) for v in kept}
    return sum(v.type.nbytes for k, v in bases.items() if k not in not_activation)


def _layer_flops(layer: Layer) -> tuple[int, int]:
    """(forward, backward) FLOPs of a layer by the op set's cost rules."""
    fwd = bwd = 0
    for n in layer.nodes:
        ins = [v.type if isinstance(v, Value) else v for v in n.inputs]
        outs = [v.type for v in n.outputs]
        f = n.opdef.flops(ins, outs, n.attrs)
        fwd += f
        bwd += int(f * n.opdef.bwd_factor)
    return fwd, bwd


def _layer_cost(layer: Layer, fwd: int, bwd: int, saved: dict[int, Value],
                crossing: list[Value], selective: int) -> LayerCost:
    """A layer's cost row: parameters, FLOPs, saved bytes, the bytes crossing its end, MoE shape."""
    moe = None
    if layer.kind == "moe_block":
        a = layer.attrs
        moe = MoEInfo(num_experts=a["experts"], top_k=a["top_k"], d_model=a["d_model"],
                      d_ffn=a["d_ffn"], expert_params=a["expert_params"])
    return LayerCost(
        name=layer.name, kind=layer.kind, params=sum(p.type.numel for p in layer.params),
        param_bytes=sum(p.type.nbytes for p in layer.params),
        fwd_flops=fwd, bwd_flops=bwd,
        act_saved_bytes=sum(v.type.nbytes for v in saved.values()),
        act_selective_bytes=min(selective, sum(v.type.nbytes for v in saved.values())),
        out_bytes=sum(v.type.nbytes for v in crossing), moe=moe)


def infer_types(op: str, inputs: list, attrs: dict) -> list[TensorType]:
    """Output types of `op` on `inputs` (Values or scalars) by the op set's shape rule."""
    d = opset.get(op)
    full = {k: v for k, v in d.attrs.items()}
    full.update(attrs)
    missing = [k for k, v in full.items() if v is opset.REQUIRED]
    if missing:
        raise ValueError(f"{op}: missing attribute(s) {', '.join(missing)}")
    unknown = set(attrs) - set(d.attrs)
    if unknown:
        raise ValueError(f"{op}: unknown attribute(s) {', '.join(sorted(unknown))}")
    ins = [v.type if isinstance(v, Value) else v for v in inputs]
    if not d.variadic and len(ins) != len(d.inputs):
        raise ValueError(f"{op} takes {len(d.inputs)} input(s) ({', '.join(d.inputs)}), got {len(ins)}")
    return d.infer(ins, full)


def check_node_types(n: Node) -> None:
    try:
        want = infer_types(n.op, n.inputs, n.attrs)
    except (ValueError, IndexError, TypeError, KeyError) as e:
        raise ValueError(f"{n.op}: {e}") from None
    got = [v.type for v in n.outputs]
    if want != got:
        raise ValueError(f"{n.op}: declared result type(s) {', '.join(map(str, got))} but the op set "
                         f"gives {', '.join(map(str, want))}")


def full_attrs(node: Node) -> dict:
    """The node's attributes with the op's defaults filled in (what kernels receive)."""
    a = {k: v for k, v in node.opdef.attrs.items()}
    a.update(node.attrs)
    return a
