"""Experts modules whose routing is Python control flow on tensor values, made static.

transformers' experts interface is `experts(hidden_states, top_k_index, top_k_weights)`: token
t's output is sum_j top_k_weights[t, j] * expert_{top_k_index[t, j]}(hidden_states[t]). Many
modules compute it with a loop over the experts tokens were routed to (`nonzero`, `where`):
DBRX's, and the eager form of every transformers MoE family. Such a loop cannot be captured as
one graph of static shapes; its routing depends on the data.

This rewrite keeps the module's own code and only makes its routing known at capture time:
expert e's function is the module's forward with every token routed to e at weight 1
(`expert_output`). Under `_KnownRouting` the routing tensors of that call are real tensors
computed as the forward runs (so its loop, `nonzero` and `where` run for real, once), and
where one meets the traced hidden states it enters the graph as what it is — an `arange` of
the tokens, a `full` of one expert or weight. The graph then holds, per expert, just the
expert's computation on every token. Two static forms are built from it:

    dense      sum over e of expert_output(e) * (the weight the router gave e, 0 if none)
               (`static_forward`, installed when capture meets data-dependent control flow)
    sparse     h2's dispatch / experts / combine with capacity and expert parallelism
               (frontend/moe.py), each local expert's tokens through expert_output

No assumption about how the module stores its weights beyond one: every parameter of a routed
experts module is a stack of per-expert slices along dim 0 (E slices: [E, ...], or DBRX's
[E * F, D]), which is what expert parallelism shards.
"""
from __future__ import annotations

import contextlib
import inspect
import os
import traceback
import types

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakIdKeyDictionary

from h2ir.errors import H2Error

EXPERTS_ARGS = ("hidden_states", "top_k_index", "top_k_weights")
_COUNT_NAMES = ("num_experts", "num_local_experts", "moe_num_experts", "n_routed_experts")


def forward_args(m: nn.Module) -> tuple:
    """The names of the arguments of m's forward, after self."""
    try:
        return tuple(inspect.signature(type(m).forward).parameters)[1:]
    except (TypeError, ValueError):
        return ()


def expert_count(m: nn.Module) -> int | None:
    """E as the module states it (num_experts and its spellings), else None."""
    for name in _COUNT_NAMES:
        v = getattr(m, name, None)
        if isinstance(v, int) and not isinstance(v, bool) and v >= 1:
            return v
    return None


def is_routed_experts(m: nn.Module) -> bool:
    """A module of transformers' experts interface — forward(hidden_states, top_k_index,
    top_k_weights) — that states E, whose parameters are all E-slice stacks along dim 0."""
    if forward_args(m)[:3] != EXPERTS_ARGS:
        return False
    E = expert_count(m)
    params = list(m.parameters())
    return E is not None and bool(params) and all(p.dim() >= 1 and p.shape[0] % E == 0
                                                  for p in params)


# ---- routing known at capture time --------------------------------------------------------------

@contextlib.contextmanager
def _untraced():
    """Real tensors, real kernels: no tracing or fake-tensor mode, no torch-function mode."""
    with _disable_current_modes(), torch._C.DisableTorchFunction():
        yield


def _unroutable(message: str, path: str | None) -> H2Error:
    """The error, at the experts module's line that made the call (the innermost frame outside
    torch and h2's frontend): in the model file, or named in the hint."""
    here = os.path.dirname(os.path.abspath(__file__))
    for f in reversed(traceback.extract_stack()):
        if f"{os.sep}torch{os.sep}" not in f.filename and \
                not os.path.abspath(f.filename).startswith(here):
            mine = path is not None and os.path.realpath(f.filename) == os.path.realpath(path)
            return H2Error(message, path, f.lineno if mine else None,
                           hint=None if mine else f"at {f.filename}:{f.lineno}: "
                                                  f"{(f.line or '').strip()}")
    return H2Error(message, path)


_WRITES = {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
           "__imod__", "__ipow__", "__imatmul__", "__iand__", "__ior__", "__ixor__"}


class _KnownRouting(TorchFunctionMode):
    """Tensors registered here (`known`) hold real values while the model is traced: a torch
    call whose tensors are all known runs for real, outside every tracing mode, and its results
    are known too. A call that mixes them with traced tensors gets each known tensor as a graph
    value of its own (`_to_graph`)."""

    def __init__(self, path: str | None):
        super().__init__()
        self.known = WeakIdKeyDictionary()
        self.path = path

    def constant(self, t: torch.Tensor) -> torch.Tensor:
        self.known[t] = True
        return t

    def _mark(self, out):
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.known[t] = True
        return out

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        known = [t for t in leaves if t in self.known]
        if not known:
            return func(*args, **kwargs)
        traced = [t for t in leaves if t not in self.known]
        if not traced:
            with _untraced():
                out = func(*args, **kwargs)
            if func is torch.Tensor.__iter__:        # the loop over the experts that were hit
                return iter(self._mark(list(out)))
            return self._mark(out)
        name = getattr(func, "__name__", "")
        if args and isinstance(args[0], torch.Tensor) and args[0] in self.known and \
                (name in _WRITES or (name.endswith("_") and not name.startswith("_"))):
            raise _unroutable(f"routing: {name} writes values computed from the hidden states "
                              "into a tensor computed from the routing; h2 cannot make that "
                              "experts module static", self.path)
        like = traced[0]
        args, kwargs = tree_map(lambda x: self._to_graph(x, like, func)
                                if isinstance(x, torch.Tensor) and x in self.known else x,
                                (args, kwargs))
        return func(*args, **kwargs)

    def _to_graph(self, t: torch.Tensor, like: torch.Tensor, func):
        """A known tensor as a traced value: a 0-d one as its Python number, a constant one as
        `full`, a 1-d integer progression as `arange`."""
        with _untraced():
            if t.dim() == 0:
                return t.item()
            flat = t.reshape(-1)
            first = flat[0].item()
            constant = bool((flat == flat[0]).all())
            step = (flat[1] - flat[0]).item() if t.dim() == 1 and t.numel() > 1 else 0
            progression = bool(step) and not t.is_floating_point() and torch.equal(
                flat, torch.arange(first, first + step * t.numel(), step, dtype=t.dtype))
        if constant:
            return torch.full(tuple(t.shape), first, dtype=t.dtype, device=like.device)
        if progression:
            return torch.arange(first, first + step * t.numel(), step, dtype=t.dtype,
                                device=like.device)
        raise _unroutable(f"routing: {getattr(func, '__name__', func)} takes an index computed "
                          f"from the routing ({list(t.shape)}, neither constant nor a range) "
                          "together with the hidden states; h2 cannot make that experts module "
                          "static", self.path)


def expert_output(m: nn.Module, x: torch.Tensor, e: int, path: str | None = None) -> torch.Tensor:
    """Expert e of the routed experts module `m` on every row of x [..., D]: m's own forward
    with every token routed to e at weight 1, its routing known at capture time. [..., D]."""
    D = x.shape[-1]
    T = x.numel() // D if x.numel() else 0
    mode = _KnownRouting(path)
    with _untraced():
        index = torch.full((T, 1), e, dtype=torch.long)
        weights = torch.ones((T, 1), dtype=x.dtype)
    with mode:
        mode.constant(index)
        mode.constant(weights)
        y = type(m).forward(m, x, index, weights)
    return y.reshape(x.shape)


def static_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                   top_k_weights: torch.Tensor) -> torch.Tensor:
    """The dense form: every expert on every token, weighted by what the router gave it (zero
    when it did not choose it), summed in expert order as the loop adds them."""
    out = None
    shape = (*hidden_states.shape[:-1], 1)
    for e in range(self.h2_experts):
        w = (top_k_weights * (top_k_index == e)).sum(-1)
        term = expert_output(self, hidden_states, e, self.h2_path) * \
            w.reshape(shape).to(hidden_states.dtype)
        out = term if out is None else out + term
    return out


def make_static(model: nn.Module, path: str | None = None) -> list[str]:
    """Give every routed experts module of `model` (see `is_routed_experts`) the dense static
    forward, on this instance; the modules' paths."""
    done = []
    for name, m in model.named_modules():
        if is_routed_experts(m) and "forward" not in vars(m):      # not yet replaced
            m.h2_experts, m.h2_path = expert_count(m), path
            m.forward = types.MethodType(static_forward, m)
            done.append(name)
    return done
