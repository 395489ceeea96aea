"""What a backend ("vendor") is: an op table over the h2ir op set plus a device runtime.

A backend implements kernels for ops of `h2ir.opset` (by name) and a small runtime: moving host
bytes in and out (numpy arrays are the vendor-neutral host form), allocation, dtype support,
synchronisation and the optimizer update. `run_program` interprets an h2ir program with any
backend, node by node (as torch.fx.Interpreter does for fx graphs).

Capability check: `missing_kernels(graph, backend)` lists the ops a program needs that the backend
lacks — the compiler calls it before anything runs.

Communication ops (the op set's COMM group: a tensor-parallel stage's `tp_all_reduce` and
`tp_rank`) are not kernels of a backend: the rank's group lives in the worker. `run_program`
takes a `comm` hook, `comm(op, *inputs, **attrs) -> tensor`, which the worker binds to its TP
group's collectives over DiComm (tests bind it to an in-process group).
"""
from __future__ import annotations

from typing import Callable, Protocol

import numpy as np

from h2ir.graph import Graph, Value, full_attrs
from h2ir.opset import Group


class Backend(Protocol):
    name: str
    ops: dict            # h2ir op name -> kernel(*inputs, **attrs) -> tensor | tuple of tensors
    dtypes: set          # h2ir dtype names this backend computes in

    def from_numpy(self, a: np.ndarray, dtype: str):
        """Host array -> device tensor of h2ir dtype `dtype` (bf16 arrives as a uint16 view)."""

    def to_numpy(self, t) -> np.ndarray:
        """Device tensor -> host array (bf16 leaves as a uint16 view)."""

    def zeros(self, shape: tuple, dtype: str):
        ...

    def synchronize(self) -> None:
        ...

    def compute_params(self, params: dict) -> dict:
        """The parameters as the programs read them under the backend's dtype policy (a torch
        bf16 stage: bf16 copies of the f32 masters); `params` itself where there is none."""

    def as_dtype(self, t, dtype: str):
        """`t` in h2ir dtype `dtype` (itself when it already is): a value leaving a program in
        the dtype the stage's signature declares."""

    def accumulate(self, dst, src) -> None:
        """dst += src in place (gradient accumulation across micro-batches)."""

    def adamw_step(self, params: list, grads: list, exp_avg: list, exp_avg_sq: list, step: int,
                   lr: float, beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
        """In-place AdamW (Loshchilov & Hutter 2019), same formula as torch.optim.AdamW."""

    def l2_norm(self, t) -> float:
        """The L2 norm of a tensor in its own dtype's arithmetic (the vendor's reduction, as
        torch.nn.utils.clip_grad_norm_ takes each gradient's norm); inf/nan when it is not
        finite."""


def is_comm(op: str) -> bool:
    """A communication op: run by the worker's comm hook, not by a backend kernel."""
    from h2ir import opset
    return opset.get(op).group is Group.COMM


def missing_kernels(graph: Graph, backend) -> set[str]:
    return {n.op for n in graph.nodes() if not is_comm(n.op)} - set(backend.ops)


def comm_ops(graph: Graph) -> set[str]:
    return {n.op for n in graph.nodes() if is_comm(n.op)}


def _no_comm(op, *inputs, **attrs):
    raise RuntimeError(f"program runs comm op {op} but run_program was given no comm hook")


def run_program(graph: Graph, backend, inputs: dict, comm=None, meter=None) -> list:
    """Run `graph` on `backend`. `inputs` maps every input/const/param name to a tensor;
    `comm(op, *inputs, **attrs)` runs the program's communication ops; `meter` (a
    backends.memory.LiveTensorMeter, begun over what the caller holds) follows every value the
    program makes until its last use."""
    if meter is None:
        return compile_program(graph, backend)(inputs, comm or _no_comm)
    return compile_program(graph, backend, metered=True)(inputs, comm or _no_comm, meter)


def interpret_program(graph: Graph, backend, inputs: dict, comm=None) -> list:
    """Reference interpreter: one dict lookup per value, node by node (torch.fx.Interpreter's
    way). `compile_program` must give the same results."""
    env = dict(inputs)
    ops = backend.ops
    comm = comm or _no_comm
    for layer in graph.layers:
        for n in layer.nodes:
            args = [env[v.name] if isinstance(v, Value) else v for v in n.inputs]
            if is_comm(n.op):
                out = comm(n.op, *args, **full_attrs(n))
            else:
                out = ops[n.op](*args, **full_attrs(n))
            if len(n.outputs) == 1:
                env[n.outputs[0].name] = out
            else:
                for v, o in zip(n.outputs, out):
                    env[v.name] = o
    return [env[v.name] for v in graph.outputs]


def compile_program(graph: Graph, backend, metered: bool = False):
    """Lower `graph` to a Python function over `backend`'s kernels (as torch.fx's codegen does):
    values become local variables, attributes are bound once, and each intermediate is dropped
    right after its last use so the allocator reuses hot memory. Cached per (graph, backend).
    `metered`: the function takes a third argument, a meter told of each value made (`add`)
    and dropped (`drop`)."""
    cache = backend.__dict__.setdefault("_h2_programs", {})   # lives as long as the backend
    key = (id(graph), metered)
    hit = cache.get(key)
    if hit is not None and hit[0] is graph:
        return hit[1]
    names: dict[int, str] = {}

    def var(v: Value) -> str:
        if id(v) not in names:
            names[id(v)] = f"v{len(names)}"
        return names[id(v)]

    nodes = [n for layer in graph.layers for n in layer.nodes]
    last_use: dict[int, int] = {}
    for i, n in enumerate(nodes):
        for v in n.input_values():
            last_use[id(v)] = i
    keep = {id(v) for v in graph.outputs}
    consts: dict[str, object] = {}
    lines = ["def program(env, comm=_no_comm, meter=None):"]
    if metered:
        lines.append("    _add, _drop = meter.add, meter.drop")
    for v in graph.inputs + graph.consts + graph.all_params():
        if id(v) in last_use or id(v) in keep:
            lines.append(f"    {var(v)} = env[{v.name!r}]")
    for i, n in enumerate(nodes):
        k = f"k{i}"
        comm_op = is_comm(n.op)
        if not comm_op:
            consts[k] = backend.ops[n.op]
        args = [repr(n.op)] if comm_op else []
        for a in n.inputs:
            if isinstance(a, Value):
                args.append(var(a))
            else:
                c = f"c{len(consts)}"
                consts[c] = a
                args.append(c)
        attrs = full_attrs(n)
        if attrs:
            c = f"a{i}"
            consts[c] = attrs
            args.append(f"**{c}")
        outs = ", ".join(var(v) for v in n.outputs) + ("," if len(n.outputs) > 1 else "")
        lines.append(f"    {outs} = {'comm' if comm_op else k}({', '.join(args)})")
        if metered:
            lines.append(f"    _add({outs})")
        dead = [var(v) for v in n.input_values() if last_use.get(id(v)) == i and id(v) not in keep]
        dead += [var(v) for v in n.outputs if id(v) not in last_use and id(v) not in keep]
        if dead:
            dead_s = ", ".join(dict.fromkeys(dead))
            if metered:
                lines.append(f"    _drop({dead_s})")
            lines.append(f"    del {dead_s}")
    lines.append(f"    return [{', '.join(var(v) for v in graph.outputs)}]")
    code = "\n".join(lines) + "\n"
    scope: dict = dict(consts, _no_comm=_no_comm)
    exec(compile(code, f"<h2ir program {graph.name} on {backend.name}>", "exec"), scope)
    fn = scope["program"]
    cache[key] = (graph, fn)
    return fn


KernelTable = dict[str, Callable]
