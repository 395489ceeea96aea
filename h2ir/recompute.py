"""Which saved activations recomputation drops, and the forward nodes that re-make them: one
rule for the stage programs (frontend/recompute.py rewrites them) and for the cost model
(`Graph.layer_costs` prices selective recomputation with it).

    full       a layer keeps only what crosses its boundaries (its inputs, the values later
               layers read) and re-runs its own forward before its backward: per-layer
               checkpointing (Chen et al. 2016; Megatron-LM's full recompute, one layer per
               checkpoint)
    selective  the attention core (values with two sequence-length axes: scores, softmax,
               dropout; Korthikanti et al. 2022 Sec. 5) and whatever pointwise ops (norms,
               activations, residual arithmetic, casts, views) re-make from values kept anyway;
               a value is dropped only when what it is re-made from adds fewer bytes than it
               frees, so selective never saves more than none

Never re-run: communication (TP all-reduces, EP all-to-alls and their MoE counters run once per
micro-batch: their results are kept); in selective also matmuls other than the attention
scores, fused attention, embeddings and losses.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from h2ir.opset import Group

if TYPE_CHECKING:       # h2ir/graph.py prices selective recomputation with this module
    from h2ir.graph import Graph, Node, Value

MODES = ("none", "selective", "full")

# op groups whose results selective recomputation may re-make (cheap next to the matmuls)
_POINTWISE = {Group.UNARY, Group.BINARY, Group.TERNARY, Group.REDUCE, Group.MOVEMENT, Group.NN,
              Group.CREATION}
_NEVER = {Group.COMM, Group.MOE}


class ForwardIndex:
    """Producers, layers and boundaries of a forward graph's values. `boundary`: the values
    that leave the graph for its consumers (the stage's boundary outputs; a model's outputs)."""

    def __init__(self, fwd: Graph, boundary: list[Value]):
        self.by_name: dict[str, Value] = {}
        self.producer: dict[int, Node] = {}
        self.layer_of: dict[int, int] = {}          # id(value) -> defining layer index
        self.order: dict[int, int] = {}             # id(node) -> position in the forward
        sources = fwd.inputs + fwd.consts + fwd.all_params()
        self.inputs = {id(v) for v in sources}
        for v in sources:
            self.by_name[v.name] = v
        i = 0
        for li, layer in enumerate(fwd.layers):
            for n in layer.nodes:
                self.order[id(n)] = i
                i += 1
                for o in n.outputs:
                    self.by_name[o.name] = o
                    self.producer[id(o)] = n
                    self.layer_of[id(o)] = li
        # values a later layer or a consumer reads: layer boundaries, always kept
        self.crossing: set[int] = {id(v) for v in boundary}
        for li, layer in enumerate(fwd.layers):
            for n in layer.nodes:
                for x in n.input_values():
                    if self.layer_of.get(id(x), li) != li:
                        self.crossing.add(id(x))

    def droppable(self, v: Value) -> bool:
        """Whether a saved `v` may be recomputed at all: made inside a layer, not a boundary."""
        return id(v) not in self.inputs and id(v) in self.producer and id(v) not in self.crossing


def quadratic(v: Value, seq_len: int) -> bool:
    """An attention-core value: its last two axes are both the sequence length."""
    s = v.type.shape
    return seq_len > 1 and len(s) >= 3 and s[-1] == seq_len and s[-2] == seq_len


def may_rerun(n: Node, mode: str, seq_len: int) -> bool:
    g = n.opdef.group
    if g in _NEVER:
        return False
    if mode == "full":
        return True
    if g is Group.MATMUL:        # the attention scores Q K^T
        return all(quadratic(o, seq_len) for o in n.outputs)
    return g in _POINTWISE


def closure(fa: ForwardIndex, v: Value, kept: set, mode: str, seq_len: int):
    """(nodes re-making `v` in forward order, the leaf values they read), or None when `v`
    cannot be re-made. Leaves: graph inputs, kept values, other layers' values, results of ops
    not re-run and, in full mode, the layer's boundary values."""
    home = fa.layer_of[id(v)]
    nodes: dict[int, Node] = {}
    leaves: dict[int, Value] = {}
    stack = [v]
    while stack:
        x = stack.pop()
        n = fa.producer.get(id(x))
        if id(x) in leaves or (n is not None and id(n) in nodes):
            continue
        leaf = (n is None or id(x) in fa.inputs or fa.layer_of.get(id(x)) != home
                or (x is not v and (x.name in kept or (mode == "full" and id(x) in fa.crossing)))
                or not may_rerun(n, mode, seq_len))
        if leaf:
            if x is v:
                return None
            leaves[id(x)] = x
            continue
        nodes[id(n)] = n
        stack.extend(n.input_values())
    return sorted(nodes.values(), key=lambda n: fa.order[id(n)]), list(leaves.values())


def choose(fa: ForwardIndex, saved: list[Value], mode: str, seq_len: int,
           nbytes=lambda v: v.type.nbytes) -> tuple[list[Value], dict[str, list[Node]]]:
    """(the values to keep, {dropped saved name: nodes re-making it}) for `mode`. `nbytes(v)`:
    what keeping `v` costs (0 for a value whose memory is held anyway)."""
    if mode not in MODES:
        raise ValueError(f"unknown recompute mode '{mode}'; expected one of: {', '.join(MODES)}")
    kept = list(dict.fromkeys(saved))
    plans: dict[str, list[Node]] = {}
    if mode == "none":
        return kept, plans
    for v in list(kept):
        if not fa.droppable(v):
            continue
        got = closure(fa, v, {x.name for x in kept if x is not v}, mode, seq_len)
        if got is None:
            continue
        nodes, leaves = got
        new = [x for x in leaves if all(x is not k for k in kept)]
        if mode == "selective" and sum(nbytes(x) for x in new) >= nbytes(v):
            continue
        kept = [k for k in kept if k is not v] + new
        plans[v.name] = nodes
    return kept, plans
