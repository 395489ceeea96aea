"""Activation recomputation in the stage programs: the forward saves less and the backward
re-runs part of the forward. Which values are dropped, and which nodes re-make them, is
h2ir/recompute.py's rule (the cost model prices the same rule); this module rewrites the
programs.

The recomputed nodes are copies of the forward's, placed in the backward right before the
layer's own backward nodes, so one layer's re-made activations are live at a time. Dropout
masks come from a counter keyed by the micro-batch's seed (a stage input, kept), so the re-run
forward is bit-identical to the first.
"""
from __future__ import annotations

from h2ir import recompute as rule
from h2ir.errors import H2Error
from h2ir.graph import Graph, Layer, Node, Value


def apply_recompute(fwd: Graph, bwd: Graph, saved: list[str], mode: str,
                    seq_len: int) -> list[str]:
    """Rewrite `fwd`/`bwd` (a stage's programs; `fwd`'s outputs end with `saved`, `bwd`'s
    inputs start with them) for `mode`; returns the new saved list. `seq_len` tells the
    attention core's values (two axes of that length) in selective mode."""
    if mode == "none" or not saved:
        return list(saved)
    n_out = len(fwd.outputs) - len(saved)
    fa = rule.ForwardIndex(fwd, fwd.outputs[:n_out])
    kept, plans = rule.choose(fa, [fa.by_name[k] for k in saved], mode, seq_len)
    if not plans:
        return list(saved)
    _rewrite(fa, fwd, bwd, saved, [v.name for v in kept], plans)
    return list(dict.fromkeys(v.name for v in kept))


def _rewrite(fa: rule.ForwardIndex, fwd: Graph, bwd: Graph, saved: list, kept: list,
             plans: dict) -> None:
    """Make the forward output `kept` instead of `saved`, and put each layer's recomputation in
    the backward before that layer's backward nodes."""
    kept = list(dict.fromkeys(kept))
    n_out = len(fwd.outputs) - len(saved)
    fwd.outputs = fwd.outputs[:n_out] + [fa.by_name[k] for k in kept]
    old_in = {v.name: v for v in bwd.inputs}
    saved_in = {k: old_in[k] for k in saved}
    grads_in = [v for v in bwd.inputs if v.name not in saved_in]
    new_in = [saved_in.get(k) or Value(k, fa.by_name[k].type) for k in kept]
    env = {v.name: v for v in new_in}            # forward name -> value in the backward
    by_layer: dict[str, dict[int, Node]] = {}     # every recomputed node once, by its layer
    for name, nodes in plans.items():
        home = fwd.layers[fa.layer_of[id(fa.by_name[name])]].name
        by_layer.setdefault(home, {}).update({id(n): n for n in nodes})
    copies: dict[str, list[Node]] = {}
    for layer in fwd.layers:
        nodes = by_layer.get(layer.name)
        if not nodes:
            continue
        out = []
        for n in sorted(nodes.values(), key=lambda n: fa.order[id(n)]):
            ins = [env[x.name] if isinstance(x, Value) else x for x in n.inputs]
            outs = []
            for o in n.outputs:
                # a re-made saved value is the backward's own Value object: its readers stay
                r = saved_in.get(o.name) if o.name in plans else None
                r = r or Value(f"{o.name}.rc", o.type)
                env[o.name] = r
                outs.append(r)
            out.append(Node(n.op, ins, dict(n.attrs), outs))
        copies[layer.name] = out
    missing = [k for k in plans if k not in env]
    if missing:
        raise H2Error(f"internal: recompute did not re-make {missing[:3]}")
    bwd.inputs = new_in + grads_in
    placed = set()
    for layer in bwd.layers:
        if layer.name in copies:
            layer.nodes = copies[layer.name] + layer.nodes
            placed.add(layer.name)
    rest = [n for k, ns in copies.items() if k not in placed for n in ns]
    if rest:          # a layer with no backward of its own: its recomputation goes first
        bwd.layers.insert(0, Layer("recompute", "program", {}, [], rest))
