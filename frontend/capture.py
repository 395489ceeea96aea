"""Capture a model file into h2ir on the meta device (no weights allocated).

Model-file convention:
    build_model(**kwargs) -> nn.Module          required; kwargs come from `--arg key=value`
    example_inputs(micro_batch, seq_len)        optional; default: int64 token ids [mb, seq]
    loss_fn(outputs, targets)                   optional; default: next-token cross-entropy

Capture path: `torch.fx.symbolic_trace` first (keeps the module hierarchy per node); the traced
module is then lowered to ATen with `make_fx` while preserving each node's module stack. Models
symbolic_trace cannot handle (data-dependent control flow, e.g. models from popular model
libraries) go through non-strict `torch.export`, whose graph also carries module stacks.
Nodes are grouped into layers: nodes before the first block -> `embed`, each of the model's
blocks (`find_blocks`: a ModuleList, a Sequential run or an attribute run) -> `block.<i>`
(`moe_block` with its expert shape when it holds experts and a router, `moe_attrs`), nodes after
the last block -> `head`.

The model's output is its logits: a tensor, or a tuple, dict or transformers ModelOutput holding
them (`pick_logits`); the IR header's `model_output` says which part was taken. What the model
file's own code raises is reported as an error in the model file, at its line.
"""
from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import inspect
import io
import logging
import operator
import os
import re
import sys
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F

from h2ir.costs import ModelCosts
from h2ir.errors import H2Error
from h2ir.graph import Graph
from frontend import ssm
from frontend.lower import lower_fx, module_path, op_name, source_info
from frontend.complex_pairs import to_real_pairs
from frontend.routing import expert_count, is_routed_experts, make_static


@dataclass
class ModelFile:
    path: str
    module: object

    @property
    def name(self) -> str:
        return Path(self.path).stem

    def build(self, args: dict) -> nn.Module:
        fn = self.module.build_model
        try:
            inspect.signature(fn).bind(**args)
        except TypeError as e:
            raise H2Error(f"build_model() rejected the arguments {args}: {e}", self.path,
                          _first_line(fn)) from None
        except ValueError:          # no signature to check (a builtin)
            pass
        model = self._call("build_model()", fn, **args)
        if not isinstance(model, nn.Module):
            raise H2Error(f"build_model() returned {_describe(model)}, not a torch.nn.Module",
                          self.path, _first_line(fn))
        other = [(n, p.dtype) for n, p in model.named_parameters() if p.dtype != torch.float32]
        if other:
            n, dt = other[0]
            raise H2Error(
                f"build_model() returned a model with {str(dt).replace('torch.', '')} parameters "
                f"({n}{f' and {len(other) - 1} more' if len(other) > 1 else ''}); expected float32",
                self.path, _first_line(fn),
                hint="h2 keeps parameters, gradients and optimizer state in float32 and computes "
                     "in the cluster's dtype (`dtype = \"bf16\"` in the cluster file runs matmuls "
                     "and attention in bf16): build the model in float32")
        return model

    def example_inputs(self, micro_batch: int, seq_len: int) -> tuple:
        if hasattr(self.module, "example_inputs"):
            ex = self._call("example_inputs()", self.module.example_inputs, micro_batch, seq_len)
            return tuple(ex) if isinstance(ex, (tuple, list)) else (ex,)
        return (torch.zeros(micro_batch, seq_len, dtype=torch.long),)

    def fixed_inputs(self, micro_batch: int, seq_len: int) -> list:
        """The model's inputs after the token ids, for real (CPU): what `example_inputs`
        returns for them, the same for every micro-batch (position ids, an all-ones mask)."""
        ex = self.example_inputs(micro_batch, seq_len)
        return [e.detach().cpu().contiguous() for e in ex[1:] if isinstance(e, torch.Tensor)]

    def loss_fn(self):
        """The loss of the last stage: the model file's `loss_fn` (default: next-token
        cross-entropy) applied to the model's logits, picked from its output by
        `model_logits` (a tensor is used as it is)."""
        user = getattr(self.module, "loss_fn", None)

        def loss(outputs, targets):
            logits = model_logits(outputs, self.path)[1]
            if user is None:
                return default_loss(logits, targets)
            return self._call("loss_fn()", user, logits, targets)
        return loss

    def _call(self, what: str, fn, *args, **kwargs):
        """Call a function of the model file; what it raises is an error in the model file."""
        try:
            return fn(*args, **kwargs)
        except H2Error:
            raise
        except (Exception, SystemExit) as e:
            raise user_code_error(e, self.path, what) from None


def default_loss(outputs, targets):
    """Next-token cross-entropy over the last dim (targets are already shifted by the loader)."""
    return F.cross_entropy(outputs.reshape(-1, outputs.shape[-1]), targets.reshape(-1))


# ---- errors in the user's code -------------------------------------------------------------------

_H2_DIRS = tuple(str(Path(__file__).resolve().parent.parent / d) + os.sep
                 for d in ("frontend", "backends", "h2ir", "executor"))


def _same_file(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def _library_file(filename: str) -> bool:
    """torch's code and h2's own: never where a model went wrong."""
    f = os.path.realpath(filename)
    return f"{os.sep}torch{os.sep}" in f or f.startswith(_H2_DIRS) or filename.startswith("<")


def _first_line(fn) -> int | None:
    code = getattr(fn, "__code__", None)
    return code.co_firstlineno if code is not None else None


def _one_line(e: BaseException, limit: int = 300) -> str:
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    text = lines[0] if lines else ""
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _frames_in(e: BaseException, path: str) -> list:
    return [f for f in traceback.extract_tb(e.__traceback__) if _same_file(f.filename, path)]


def user_code_error(e: BaseException, path: str, what: str, message: str | None = None,
                    hint: str | None = None) -> H2Error:
    """An exception from code the model file runs (`what`: "build_model()", "the model's
    forward", ...) as an error at the deepest frame in the model file; when it was raised in
    other code (a library the model calls), the hint says where."""
    mine = _frames_in(e, path)
    line = mine[-1].lineno if mine else None
    if isinstance(e, SystemExit):
        return H2Error(f"{what} called sys.exit({e.code!r})", path, line,
                       hint="h2 calls the functions a model file defines; they must return, "
                            "not exit")
    outer = [f for f in traceback.extract_tb(e.__traceback__) if not _library_file(f.filename)]
    where = None
    if outer and not _same_file(outer[-1].filename, path):
        f = outer[-1]
        where = f"at {f.filename}:{f.lineno}: {(f.line or '').strip()}"
    if message is None:
        msg = _one_line(e)
        message = f"{what} raised {type(e).__name__}" + (f": {msg}" if msg else "")
    hint = "\n  ".join(h for h in (where, hint) if h) or None
    return H2Error(message, path, line, hint=hint)


def load_model_file(path: str) -> ModelFile:
    p = Path(path)
    if not p.is_file():
        raise H2Error("model file not found" if not p.exists() else "model file is not a file",
                      path, hint="a model file is a Python file that defines "
                                 "build_model(**kwargs) (README: 'Model files')")
    name = f"h2_model_{p.stem}_{abs(hash(str(p.resolve())))}"
    # any file name: a model file without the .py suffix is still read as Python source
    spec = importlib.util.spec_from_loader(name, importlib.machinery.SourceFileLoader(name, str(p)))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)
    except SyntaxError as e:
        if e.filename and not _same_file(e.filename, str(p)):     # a module the file imports
            mine = _frames_in(e, str(p))
            raise H2Error(f"importing the model file failed: syntax error in {e.filename}:"
                          f"{e.lineno}: {e.msg}", path, mine[-1].lineno if mine else None) from None
        raise H2Error(f"syntax error in model file: {e.msg}", path, e.lineno, e.offset) from None
    except (Exception, SystemExit) as e:    # a model file is user code: report, don't crash
        raise user_code_error(e, path, "importing the model file") from None
    if not hasattr(mod, "build_model"):
        raise H2Error("model file defines no build_model(**kwargs) function", path,
                      hint="see README: a model file defines build_model(**kwargs) -> nn.Module")
    return ModelFile(str(path), mod)


def parse_model_args(pairs: list[str]) -> dict:
    """`--arg key=value` pairs; values are int, float, bool or str."""
    out = {}
    for p in pairs or []:
        if "=" not in p:
            raise H2Error(f"--arg {p!r}: expected key=value")
        k, v = p.split("=", 1)
        if not k.isidentifier():
            raise H2Error(f"--arg {p[:60]!r}: {k[:40]!r} is not a Python keyword-argument name")
        for conv in (int, float):
            try:
                v = conv(v)
                break
            except ValueError:
                pass
        else:
            v = {"true": True, "false": False}.get(v.lower(), v)
        out[k] = v
    return out


# ---- block discovery -----------------------------------------------------------------------------

def _signature(m: nn.Module) -> tuple:
    """What makes two modules the same kind of block: class and parameter shapes."""
    return (type(m),) + tuple((n, tuple(p.shape)) for n, p in m.named_parameters())


def _runs(children: list, key) -> list[list]:
    """Maximal runs of consecutive (name, module) children whose `key(module)`s repeat with a
    period p at least twice: p = 1, all alike; p > 1, a pattern of kinds, as a hybrid's
    state-space and attention blocks alternate. From each start the longest run is taken (the
    shortest period among equals)."""
    keys = [key(m) for _, m in children]
    out, i = [], 0
    while i < len(keys):
        best = 1
        for p in range(1, (len(keys) - i) // 2 + 1):
            j = i + p
            while j < len(keys) and keys[j] == keys[j - p]:
                j += 1
            if j - i >= 2 * p and j - i > best:
                best = j - i
        if best > 1:
            out.append(children[i:i + best])
        i += best
    return out


def find_blocks(model: nn.Module) -> list[str]:
    """Module paths of the repeated blocks, in order: the candidate with the most parameters among
    * every ModuleList (its elements, whatever they are: transformers' `layers`),
    * runs of >= 2 consecutive elements of one class in an nn.Sequential, or of a pattern of
      classes repeated at least twice (a hybrid's alternating blocks, `_runs`),
    * such runs of consecutive child modules by class and parameter shapes anywhere
      (`self.b0, self.b1, ...`),
    where a Sequential's or an attribute run's elements must themselves hold submodules (a block,
    not three Linears side by side) and parameters. Expert lists are never the blocks."""
    best, best_n = [], -1

    def consider(prefix: str, members: list):
        nonlocal best, best_n
        n = sum(p.numel() for _, m in members for p in m.parameters())
        if n > best_n:
            best, best_n = [f"{prefix}{name}" for name, _ in members], n

    def composite(m: nn.Module) -> bool:
        return any(True for _ in m.children()) and any(True for _ in m.parameters())

    for name, m in model.named_modules():
        if "expert" in name.split(".")[-1]:
            continue
        prefix = f"{name}." if name else ""
        children = list(m.named_children())
        if isinstance(m, nn.ModuleList):
            if children:
                consider(prefix, children)
            continue
        key = type if isinstance(m, nn.Sequential) else _signature
        for run in _runs([c for c in children if composite(c[1])], key):
            consider(prefix, run)
    return best


@dataclass(frozen=True)
class _ExpertSet:
    """Candidate experts inside a block: E same-shaped FFNs, as a ModuleList of modules or as
    3-D parameter stacks [E, a, b] of one module (transformers' MixtralExperts form)."""
    path: str                   # module path inside the block
    count: int                  # E
    matrices: tuple             # (a, b) of each weight matrix of ONE expert
    expert_params: int          # parameters of ONE expert


def _expert_sets(block: nn.Module) -> list[_ExpertSet]:
    out = []
    for path, m in block.named_modules():
        if isinstance(m, nn.ModuleList) and len(m) >= 2:
            shapes = [tuple(tuple(p.shape) for p in e.parameters()) for e in m]
            mats = tuple(s for s in shapes[0] if len(s) == 2)
            if len(mats) >= 2 and all(s == shapes[0] for s in shapes):
                out.append(_ExpertSet(path, len(m), mats, sum(p.numel() for p in m[0].parameters())))
            continue
        own = list(m.parameters(recurse=False))
        stacks = [p for p in own if p.dim() == 3]
        counts = {p.shape[0] for p in stacks}
        if len(stacks) >= 2 and len(counts) == 1 and (E := counts.pop()) >= 2:
            per_expert = sum(p.numel() for p in own if p.dim() >= 2 and p.shape[0] == E) // E
            out.append(_ExpertSet(path, E, tuple(tuple(p.shape[1:]) for p in stacks), per_expert))
        elif is_routed_experts(m):          # E slices along dim 0 (DBRX's [E * F, D])
            E = expert_count(m)
            mats = tuple((p.shape[0] // E, *p.shape[1:]) for p in m.parameters() if p.dim() == 2)
            out.append(_ExpertSet(path, E, mats, sum(p.numel() for p in m.parameters()) // E))
    return out


def _inside(path: str, module: str) -> bool:
    return module == "" or path == module or path.startswith(module + ".")


def _router(block: nn.Module, ex: _ExpertSet) -> tuple[str, int] | None:
    """(module path, d_model) of the router of `ex`: a weight [E, D] outside the experts (a
    Linear(D, E) or a bare parameter) whose D is a dimension of every expert matrix."""
    for name, p in block.named_parameters():
        owner = name.rsplit(".", 1)[0] if "." in name else ""
        if p.dim() == 2 and p.shape[0] == ex.count and not _inside(owner, ex.path) \
                and all(p.shape[1] in mat for mat in ex.matrices):
            return owner, int(p.shape[1])
    return None


def _common_module(a: str, b: str) -> str:
    pa, pb = a.split(".") if a else [], b.split(".") if b else []
    common = []
    for x, y in zip(pa, pb):
        if x != y:
            break
        common.append(x)
    return ".".join(common)


_TOP_K_NAMES = ("top_k", "num_experts_per_tok", "experts_per_token", "moe_top_k", "router_topk",
                "num_selected_experts")


def _top_k_attribute(moe: nn.Module) -> int | None:
    """top-k as the MoE module or its config states it (transformers: num_experts_per_tok)."""
    for m in moe.modules():
        for holder in (m, getattr(m, "config", None)):
            for name in _TOP_K_NAMES:
                v = getattr(holder, name, None) if holder is not None else None
                if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                    return v
    return None


def _shared_experts(moe: nn.Module, skip: tuple, d_model: int) -> tuple[int, int, int]:
    """(count, FFN size, parameters) of the experts every token goes through: the MoE module's
    other children that are FFNs (at least two weight matrices on d_model)."""
    count = d_ffn = params = 0
    for name, child in moe.named_children():
        if any(_inside(s, name) for s in skip):
            continue
        parts = list(child) if isinstance(child, nn.ModuleList) else [child]
        mats = [tuple(p.shape) for p in parts[0].parameters() if p.dim() == 2]
        if len(mats) < 2 or not all(d_model in m for m in mats):
            continue
        count += len(parts)
        first = mats[0]
        d_ffn = d_ffn or (first[0] if first[1] == d_model else first[1])
        params += sum(p.numel() for p in child.parameters())
    return count, d_ffn, params


def moe_attrs(block: nn.Module, top_k: int | None = None) -> dict | None:
    """MoE shape of a block (Piper's expert terms need it), or None for a dense block.

    A block is MoE when it holds E same-shaped expert FFNs — a ModuleList of modules or 3-D
    parameter stacks [E, a, b] of one module, as transformers writes Mixtral and Qwen2-MoE
    (gate_up_proj [E, 2F, D], down_proj [E, D, F]) — and a router: a weight [E, D] (a
    Linear(D, E) or a bare parameter) outside them. d_model is the router's D, the expert FFN
    size the smaller other dimension of the expert matrices (F, not the fused 2F). `top_k` as
    traced (the router's topk) wins over what the module's attributes or config say. Experts
    beside them that every token passes (Qwen2-MoE's shared_expert) are `shared_experts`."""
    for ex in _expert_sets(block):
        r = _router(block, ex)
        if r is None:
            continue
        router, d = r
        d_ffn = min(b if a == d else a for a, b in ex.matrices)
        moe_path = _common_module(router, ex.path)
        moe = block.get_submodule(moe_path) if moe_path else block
        k = top_k or _top_k_attribute(moe) or 1
        attrs = {"experts": ex.count, "top_k": int(k), "d_model": d, "d_ffn": int(d_ffn),
                 "expert_params": int(ex.expert_params), "experts_module": ex.path}
        rel = lambda p: p[len(moe_path) + 1:] if moe_path else p      # noqa: E731
        n, shared_ffn, shared_params = _shared_experts(moe, (rel(ex.path), rel(router)), d) \
            if moe_path else (0, 0, 0)        # the block itself: its other children are no FFNs
        if n:
            attrs.update(shared_experts=n, shared_d_ffn=int(shared_ffn),
                         shared_params=int(shared_params))
        return attrs
    return None


def _traced_topks(gm: torch.fx.GraphModule) -> list[tuple[int, list[str]]]:
    """(k, module paths on its stack) of every topk the traced graph runs, in graph order —
    collected in one pass, so finding a block's router k costs nothing per block."""
    out = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and getattr(node.target, "__name__", "").startswith("topk") \
                and len(node.args) > 1 and isinstance(node.args[1], int):
            stack = node.meta.get("nn_module_stack") or {}
            out.append((node.args[1], [module_path(v[0]) for v in stack.values()]))
    return out


def _traced_top_k(topks: list[tuple[int, list[str]]], prefix: str) -> int | None:
    """k of the first topk the traced graph runs inside module `prefix` (the router's)."""
    for k, paths in topks:
        if any(_inside(p, prefix) for p in paths):
            return k
    return None


class LayerGrouper:
    """Maps each ATen node to its pipeline layer by the block list and the module stack."""

    def __init__(self, model: nn.Module, gm: torch.fx.GraphModule):
        self.blocks = find_blocks(model)
        self.block_index = {path: i for i, path in enumerate(self.blocks)}
        # each call of a block module is a layer, numbered in graph order: a module called at
        # two depths (weights shared, ALBERT-style) is two layers whose parameters are tied
        calls: dict[tuple, int] = {}
        self.block_of: dict[str, int] = {}
        for node in gm.graph.nodes:
            c = self._block_call(node)
            if c is not None:
                self.block_of[node.name] = calls.setdefault(c, len(calls))
        self.n_blocks = len(calls)
        self.kinds = {}
        topks = _traced_topks(gm)
        for (i, _), b in calls.items():
            path = self.blocks[i]
            attrs = moe_attrs(model.get_submodule(path), _traced_top_k(topks, path))
            self.kinds[b] = ("moe_block", {"module": path, **attrs}) if attrs else \
                ("transformer_block", {"module": path})
        order = [n.name for n in gm.graph.nodes]
        pos = {n: i for i, n in enumerate(order)}
        inside = [pos[n] for n in self.block_of]
        first = min(inside) if inside else len(order)
        last = max(inside) if inside else -1
        # node name -> (layer name, kind, attrs), decided once in graph order
        self.assign: dict[str, tuple] = {}
        current = 0
        for node in gm.graph.nodes:
            if node.op != "call_function":
                continue
            if node.target is operator.getitem:     # follows the node it unpacks
                self.assign[node.name] = self.assign[node.args[0].name]
                continue
            b = self.block_of.get(node.name)
            if b is None and pos[node.name] < first:
                self.assign[node.name] = ("embed", "embedding", {})
                continue
            if b is None and pos[node.name] > last:
                self.assign[node.name] = ("head", "head", {})
                continue
            current = b if b is not None else current    # glue between blocks joins the previous
            kind, attrs = self.kinds[current]
            self.assign[node.name] = (f"block.{current}", kind, attrs)

    def _block_call(self, node) -> tuple[int, int] | None:
        """(index in `blocks`, which call of that module) of the block a node runs in. The
        module stack's keys number repeated calls of one module (`layers.0@1`)."""
        for key, v in (node.meta.get("nn_module_stack") or {}).items():
            parts = module_path(v[0]).split(".")
            for j in range(1, len(parts) + 1):
                i = self.block_index.get(".".join(parts[:j]))
                if i is not None:
                    n = str(key).rpartition("@")[2]
                    return i, int(n) if "@" in str(key) and n.isdigit() else 0
        return None

    def __call__(self, node) -> tuple:
        return self.assign[node.name]


# ---- tracing -------------------------------------------------------------------------------------

class _SDPAInterpreter(torch.fx.Interpreter):
    """Replays a symbolic_trace graph under make_fx; keeps attention as ONE ATen call.

    On the meta device F.scaled_dot_product_attention would decompose into its math form; on CPU
    it dispatches to the flash kernel, which is what AOTAutograd records in the compiler. Using
    that kernel here too gives the frontend and the compiler the same `attention` op.
    """

    def call_function(self, target, args, kwargs):
        if target is F.scaled_dot_product_attention:
            q, k, v = args[:3]
            mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
            causal = kwargs.get("is_causal", args[5] if len(args) > 5 else False)
            if mask is None and not kwargs.get("enable_gqa", False):
                return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                    q, k, v, kwargs.get("dropout_p", 0.0), causal, scale=kwargs.get("scale"))[0]
        return super().call_function(target, args, kwargs)


def _symbolic_trace(model: nn.Module):
    tracer = torch.fx.Tracer()
    tracer.record_stack_traces = True
    graph = tracer.trace(model)
    return torch.fx.GraphModule(tracer.root, graph)


def _aten_from_symbolic(model, gm, example):
    from torch.fx.experimental.proxy_tensor import make_fx
    import torch.fx.traceback as fx_traceback

    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    pnames, bnames = list(params), list(buffers)

    def run(*flat):
        p = dict(zip(pnames, flat[:len(pnames)]))
        b = dict(zip(bnames, flat[len(pnames):len(pnames) + len(bnames)]))
        ins = flat[len(pnames) + len(bnames):]
        with torch.nn.utils.stateless._reparametrize_module(gm, {**p, **b}):
            return _SDPAInterpreter(gm).run(*ins)

    # no_grad: autograd's own bookkeeping (detach of saved outputs) must not enter the graph
    with fx_traceback.preserve_node_meta(), torch.no_grad():
        agm = make_fx(run)(*params.values(), *buffers.values(), *example)
    ph = [n for n in agm.graph.nodes if n.op == "placeholder"]
    pmap = {n.name: pnames[i] for i, n in enumerate(ph[:len(pnames)])}
    bmap = {n.name: bnames[i] for i, n in enumerate(ph[len(pnames):len(pnames) + len(bnames)])}
    imap = {n.name: n.name for n in ph[len(pnames) + len(bnames):]}
    return agm, pmap, bmap, imap


def _differentiable_copies(gm: torch.fx.GraphModule) -> None:
    """Functionalization writes `dst.copy_(src)` as aten.copy(dst, src), which autograd cannot
    differentiate; the stage programs are built by AOTAutograd from this graph, so each becomes
    what it computes: src cast to dst's dtype, broadcast to dst's shape, a fresh tensor."""
    aten = torch.ops.aten
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target is not aten.copy.default:
            continue
        dst, src = n.args[0], n.args[1]
        want = dst.meta["val"]
        with gm.graph.inserting_before(n):
            v = src
            if src.meta["val"].dtype != want.dtype:
                v = gm.graph.call_function(aten._to_copy.default, (v,), {"dtype": want.dtype})
                v.meta.update(n.meta)
                v.meta["val"] = src.meta["val"].to(want.dtype)
            if tuple(src.meta["val"].shape) != tuple(want.shape):
                v = gm.graph.call_function(aten.expand.default, (v, list(want.shape)))
                v.meta.update(n.meta)
            v = gm.graph.call_function(aten.clone.default, (v,))
            v.meta.update(n.meta)
        n.replace_all_uses_with(v)
        gm.graph.erase_node(n)
    gm.graph.lint()
    gm.recompile()


def _aten_from_export(model, example):
    ep = torch.export.export(model, example, strict=False)
    if any(n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
           and n.target._schema.is_mutable for n in ep.graph.nodes):
        # in-place ops remain (a `copy_` into a slice of a fresh tensor, DeepSeek's key
        # states): functionalize, so a write through a view updates its base (copy_ ->
        # slice_scatter); an empty table keeps every other op as it is
        ep = ep.run_decompositions({})
        _differentiable_copies(ep.graph_module)
    sig = ep.graph_signature
    pmap = dict(sig.inputs_to_parameters)
    bmap = dict(sig.inputs_to_buffers)
    bmap.update(getattr(sig, "inputs_to_lifted_tensor_constants", {}) or {})
    imap = {n: n for n in sig.user_inputs}
    gm = ep.graph_module
    gm.meta["h2_out_spec"] = ep.call_spec.out_spec
    return gm, pmap, bmap, imap


def _forward_parameters(model: nn.Module) -> list[str]:
    try:
        return list(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return []


def _input_names(model: nn.Module, n: int) -> list[str]:
    names = _forward_parameters(model)
    return (names + [f"input{i}" for i in range(len(names), n)])[:n]


# ---- the model's output: its logits --------------------------------------------------------------

class _Record(dict):
    """A dict-like output (dict, transformers ModelOutput) rebuilt around fx nodes; keeps the
    name of the type the model returned."""

    def __init__(self, type_name: str, items):
        super().__init__(items)
        self.type_name = type_name


def _type_name(x) -> str:
    return getattr(x, "type_name", None) or type(x).__name__


def _is_tensor(x) -> bool:
    return isinstance(x, torch.Tensor)


def _is_tensor_node(x) -> bool:
    return isinstance(x, torch.fx.Node) and isinstance(x.meta.get("val"), torch.Tensor)


def pick_logits(out, is_tensor=_is_tensor) -> tuple[str | None, object]:
    """(where, logits) in a model's output: ("", out) for a tensor; else the entry or attribute
    `logits` (a dict, a transformers ModelOutput); else the first tensor of a tuple or list.
    (None, None) when there is none."""
    if is_tensor(out):
        return "", out
    if isinstance(out, Mapping) and is_tensor(out.get("logits")):
        return f"{_type_name(out)}.logits", out["logits"]
    if not isinstance(out, (Mapping, tuple, list)) and is_tensor(getattr(out, "logits", None)):
        return f"{_type_name(out)}.logits", out.logits
    if isinstance(out, (tuple, list)):
        for i, v in enumerate(out):
            if is_tensor(v):
                return f"{_type_name(out)}[{i}]", v
    return None, None


def _describe(x, is_tensor=_is_tensor) -> str:
    """A model output in a few words: 'a tuple of 2 (tensor, None)', "a dict with keys 'a'"."""
    def short(v):
        return "tensor" if is_tensor(v) else "None" if v is None else _type_name(v)
    if x is None:
        return "None"
    if is_tensor(x):
        return "a tensor"
    if isinstance(x, Mapping):
        keys = ", ".join(repr(k) for k in list(x)[:8]) + (", ..." if len(x) > 8 else "")
        return f"a {_type_name(x)} with keys {keys}" if x else f"an empty {_type_name(x)}"
    if isinstance(x, (tuple, list)):
        items = ", ".join(short(v) for v in x[:8]) + (", ..." if len(x) > 8 else "")
        return f"a {_type_name(x)} of {len(x)} ({items})" if x else f"an empty {_type_name(x)}"
    return f"a value of type {_type_name(x)}"


_LOGITS_HINT = ("return the logits tensor, a tuple whose first tensor is the logits, or a dict "
                "or transformers ModelOutput with a 'logits' entry; loss_fn(outputs, targets) "
                "then receives that tensor")


def model_logits(outputs, path: str | None = None):
    """(where, logits) of a model's output at run time (see `pick_logits`); an output without
    logits is an error in the model file."""
    where, logits = pick_logits(outputs)
    if where is None:
        raise H2Error(f"the model's forward returned {_describe(outputs)}, which holds no "
                      "logits tensor", path, hint=_LOGITS_HINT)
    return where, logits


def _output_structure(gm: torch.fx.GraphModule):
    """The traced graph's output as the model returned it, with fx nodes for its tensors."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    spec = gm.meta.get("h2_out_spec")
    if spec is None:                                        # make_fx keeps the structure
        def rebuild(x):
            if isinstance(x, Mapping):
                return _Record("dict", {k: rebuild(v) for k, v in x.items()})
            if isinstance(x, (tuple, list)):
                items = [rebuild(v) for v in x]
                return tuple(items) if isinstance(x, tuple) else items
            return x
        return out, rebuild(out.args[0])
    leaves = iter(out.args[0])                              # torch.export flattens it

    def unflatten(s):
        if s.is_leaf():
            return next(leaves)
        kids = [unflatten(c) for c in s.children()]
        if s.type is type(None):
            return None
        if issubclass(s.type, dict):
            return _Record("dict" if s.type is dict else s.type.__name__, zip(s.context, kids))
        if issubclass(s.type, (tuple, list)):
            return tuple(kids) if issubclass(s.type, tuple) else list(kids)
        return _Record(s.type.__name__, zip(s.context, kids)) if isinstance(s.context, list) \
            else _Record(s.type.__name__, {})
    return out, unflatten(spec)


def _pick_graph_output(gm: torch.fx.GraphModule, model: nn.Module, path: str) -> str:
    """Make the traced graph return only the model's logits; '' when it already does, else
    where they were found (e.g. 'CausalLMOutputWithPast.logits', 'tuple[0]')."""
    out, structure = _output_structure(gm)
    where, logits = pick_logits(structure, _is_tensor_node)
    if where is None:
        fwd = type(model).forward
        line = _first_line(fwd) if _same_file(getattr(fwd, "__code__", None) and
                                              fwd.__code__.co_filename or "", path) else None
        raise H2Error(f"the model's forward returned {_describe(structure, _is_tensor_node)}, "
                      "which holds no logits tensor", path, line, hint=_LOGITS_HINT)
    if where:
        out.args = ((logits,),)
        gm.graph._codegen = torch.fx.graph.CodeGen()       # no pytree of the old output
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return where


def trace_aten(model: nn.Module, example: tuple, path: str):
    """ATen fx graph + placeholder maps + which capture path was used. What the model's forward
    raises is an error in the model file; what tracing cannot handle names the model's line."""
    odd = [(k, b.dtype) for k, b in model.named_buffers()
           if b.dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)]
    if odd:      # builds keep constants in NumPy dtypes, which have no bf16 / fp8
        raise H2Error(f"buffer {odd[0][0]!r} is {odd[0][1]}; h2 keeps a model's constants in "
                      f"float32, float16 or integer dtypes", path,
                      hint="register the buffer in float32 in build_model (the model's "
                           "arithmetic then promotes to float32 as it would with the bf16 one)")
    try:
        return _trace_aten(model, example)
    except H2Error:
        raise
    except (Exception, SystemExit) as e:
        if _data_dependent(e) and make_static(model, path):    # per-expert routing loops
            return trace_aten(model, example, path)
        raise _capture_error(e, path) from None


@contextlib.contextmanager
def _no_kv_cache(model: nn.Module):
    """transformers models whose config asks for a KV cache return a cache object, which is no
    tensor; training needs none, so capture runs with `config.use_cache = False`."""
    configs = {id(c): c for m in model.modules() if (c := getattr(m, "config", None)) is not None
               and getattr(c, "use_cache", None) is True}
    for c in configs.values():
        c.use_cache = False
    try:
        yield
    finally:
        for c in configs.values():
            c.use_cache = True


@contextlib.contextmanager
def _quiet_fake_tensors():
    """torch's fake-tensor and shape layers log every failing meta kernel or guard before the
    error reaches us; the error itself is what the user is told (`_capture_error`)."""
    logs = [logging.getLogger(n) for n in ("torch._subclasses.fake_tensor",
                                           "torch.fx.experimental.symbolic_shapes")]
    levels = [log.level for log in logs]
    for log in logs:
        log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for log, level in zip(logs, levels):
            log.setLevel(level)


def _trace_aten(model: nn.Module, example: tuple):
    with _no_kv_cache(model), _quiet_fake_tensors(), ssm.scan_kernels(model):
        return _trace_aten_paths(model, example)


def _holds_tensor_constants(gm: torch.fx.GraphModule) -> bool:
    """Whether make_fx's graph holds a tensor the forward built from Python values
    (torch.tensor([...])): on the meta device it has no value. torch.export lifts such a tensor,
    and the compiler reads its value from the real model (Capture.constants); a one-element one
    the lowering takes as a scalar."""
    for n in gm.graph.nodes:
        t = getattr(gm, n.target, None) if n.op == "get_attr" else None
        if isinstance(t, torch.Tensor) and t.numel() > 1:
            return True
    return False


def _trace_aten_paths(model: nn.Module, example: tuple):
    try:
        gm = _symbolic_trace(model)
    except Exception:       # not symbolically traceable: fall back to non-strict export
        gm = None
    if gm is not None:
        try:
            got = _aten_from_symbolic(model, gm, example)
        except Exception:
            got = None
        if got is not None and not _holds_tensor_constants(got[0]):
            return (*got, "symbolic_trace")
    with contextlib.redirect_stderr(io.StringIO()):
        return (*_aten_from_export(model, example), "torch.export")


_DATA_DEPENDENT = ("h2 captures one graph of static shapes: control flow on tensor values (e.g. "
                   "a loop over the experts that tokens were routed to) cannot be traced; compute "
                   "it for every case instead (transformers MoE models: "
                   "config._experts_implementation = 'batched_mm')")


def _capture_error(e: BaseException, path: str) -> H2Error:
    frames = traceback.extract_tb(e.__traceback__)
    if isinstance(e, SystemExit) or (frames and not _library_file(frames[-1].filename)):
        return user_code_error(e, path, "the model's forward")     # the model's own code raised
    return user_code_error(e, path, "the model's forward",
                           message="could not capture the model with torch.fx or torch.export: "
                                   f"{type(e).__name__}: {_one_line(e)}",
                           hint=_DATA_DEPENDENT if _data_dependent(e) else None)


def _data_dependent(e: BaseException) -> bool:
    return "data-dependent" in str(e) or "DataDependent" in type(e).__name__


def _model_dims(model: nn.Module) -> dict:
    # the model's config, or that of the model it wraps (a transformers LM inside a wrapper)
    cfg = next((c for m in model.modules() if (c := getattr(m, "config", None)) is not None), None)
    d = {}
    for key, names in (("n_heads", ("num_attention_heads", "n_heads")),
                       ("d_model", ("hidden_size", "dim", "d_model")),
                       ("vocab", ("vocab_size", "vocab"))):
        for n in names:
            v = getattr(cfg, n, None) if cfg is not None else None
            if v is None:
                v = getattr(model, n, None)
            if isinstance(v, int):
                d[key] = v
                break
    if "n_heads" not in d:
        for m in model.modules():
            if isinstance(getattr(m, "n_heads", None), int):
                d["n_heads"] = m.n_heads
                break
    emb = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if emb is not None:
        d.setdefault("vocab", emb.num_embeddings)
        d.setdefault("d_model", emb.embedding_dim)
    return d


@dataclass
class Capture:
    """Everything the frontend learned about a model: later steps read the IR, the compiler
    also splits `aten` (the ATen-level fx graph) at layer boundaries."""
    model_file: ModelFile
    model: nn.Module
    aten: torch.fx.GraphModule
    params: dict            # placeholder name -> parameter FQN
    buffers: dict           # placeholder name -> buffer FQN
    inputs: dict            # placeholder name -> model input name
    layer_of: "LayerGrouper"
    graph: Graph
    how: str                # 'symbolic_trace' or 'torch.export'

    def fixed_inputs(self) -> dict:
        """{input name: tensor} of the model inputs after the first (the token ids, which the
        data feeds): `ModelFile.fixed_inputs` at the capture's micro-batch and sequence length,
        checked against the captured input types. The compiler stores them with stage 0's
        constants."""
        names = list(self.inputs)[1:]
        if not names:
            return {}
        g = self.graph.attrs
        values = self.model_file.fixed_inputs(int(g.get("micro_batch", 1)),
                                              int(g.get("seq_len", 1)))
        types = {v.name: v.type for v in self.graph.inputs}
        fn = getattr(self.model_file.module, "example_inputs", None)
        if len(values) != len(names):
            raise H2Error(f"example_inputs() gave {len(values) + 1} tensor inputs but the "
                          f"model's graph takes {len(names) + 1}", self.model_file.path,
                          _first_line(fn) if fn else None)
        out = {}
        for k, v in zip(names, values):
            want = types.get(self.inputs[k])
            if want is not None and tuple(v.shape) != tuple(want.shape):
                raise H2Error(f"example_inputs() returned {self.inputs[k]} of shape "
                              f"{list(v.shape)} on the CPU but {list(want.shape)} on the meta "
                              "device", self.model_file.path, _first_line(fn) if fn else None)
            out[k] = v
        return out

    def constants(self, model: nn.Module, names) -> dict:
        """{name: tensor} for the programs' constant inputs `names`, from `model` (built for
        real): its buffers and frozen parameters, and the tensors torch.export lifted out of the
        forward (the index tensor of `x[..., [-2], :]`, a `torch.tensor(...)` in the code). The
        capture ran on the meta device, where those have no values, so when one is asked for, the
        real model is exported once more on the CPU to read them."""
        out = {k: v for k, v in model.named_buffers(remove_duplicate=False) if k in names}
        out = {k: torch.view_as_real(v) if v.is_complex() else v for k, v in out.items()}
        out.update({k: v.detach() for k, v in model.named_parameters(remove_duplicate=False)
                    if k in names and not v.requires_grad})
        missing = [k for k in names if k not in out]
        if missing and self.how == "torch.export":
            g = self.graph.attrs
            example = self.model_file.example_inputs(int(g.get("micro_batch", 1)),
                                                     int(g.get("seq_len", 1)))
            with torch.no_grad(), ssm.scan_kernels(model):
                ep = torch.export.export(model, tuple(example), strict=False)
            out.update({k: v for k, v in ep.constants.items()
                        if k in missing and isinstance(v, torch.Tensor)})
        missing = [k for k in names if k not in out]
        if missing:
            raise H2Error(f"the model's constant {missing[0]} has no value: it is neither a "
                          "buffer nor a tensor torch.export lifts from the forward",
                          self.model_file.path)
        return out

    def locate(self, e: H2Error) -> H2Error:
        """An error met lowering the stage programs (AOTAutograd's forward and backward graphs
        carry no model source lines) located in the model file: an op that is not in the op set
        is traced back to the model's op it comes from (aten::tanh for aten::tanh_backward) and
        that op's module and source line."""
        if e.file:
            return e
        path = self.model_file.path
        m = _UNSUPPORTED.match(e.message)
        if not m:
            return H2Error(e.message, path, hint=e.hint)
        op = m.group(1)
        node = self._forward_node(op)
        if node is None:
            return H2Error(f"op {op} (in a backward program) is not in the h2ir op set", path,
                           hint=_ADD_LOWERING)
        src = source_info(node)
        fwd = op_name(node.target)
        line = None
        at = re.match(r"(.+?):(\d+): ", src.line or "")
        if at and _same_file(at.group(1), path):
            line = int(at.group(2))
        via = "" if _op_base(fwd) == _op_base(op) else f"the backward of {fwd}, "
        return H2Error(f"op {op} ({via}from module '{src.module}') is not in the h2ir op set",
                       path, line, hint=(f"at {src.line}\n  " if src.line else "") + _ADD_LOWERING)

    def _forward_node(self, op: str):
        """The first node of the model's graph running `op`, else the op its name says it is
        the backward of (aten::tanh_backward -> aten::tanh)."""
        names = [_op_base(op)]
        base = re.sub(r"_backward(_data|_input|_weight)?$", "", names[0])
        if base != names[0]:
            names.append(base)
        calls = [n for n in self.aten.graph.nodes if n.op == "call_function"]
        for want in names:
            for n in calls:
                if _op_base(op_name(n.target)) in (want, want + "_"):
                    return n
        return None


_UNSUPPORTED = re.compile(r"op (\S+) \(from module '[^']*'\) is not in the h2ir op set")
_ADD_LOWERING = ("add a lowering to frontend/lower.py ATEN (and the op to h2ir/opset.py) or "
                 "rewrite the model with supported ops")


def _at_model_line(e: H2Error, path: str) -> H2Error:
    """`e` with the model file's line in front when its hint names one ("at FILE:LINE: ...")."""
    at = re.match(r"at (.+?):(\d+): ", e.hint or "")
    if e.line is None and e.file and at and _same_file(at.group(1), path):
        e.line = int(at.group(2))
    return e


def _op_base(name: str) -> str:
    """'aten::div_.Tensor' -> 'aten::div_': the op without its overload."""
    return name.split(".")[0]


def trace_model(path: str, model_args: dict | None = None, micro_batch: int = 1, seq_len: int = 128,
                model: nn.Module | None = None) -> Capture:
    """Trace a model file into h2ir (on the meta device unless a built `model` is given)."""
    mf = load_model_file(path)
    model_args = model_args or {}
    with torch.device("meta"):
        if model is None:
            model = mf.build(model_args)
        example = mf.example_inputs(micro_batch, seq_len)
    example = tuple(e.to("meta") if isinstance(e, torch.Tensor) else e for e in example)
    agm, pmap, bmap, imap, how = trace_aten(model, example, path)
    to_real_pairs(agm, path, consts=bmap)       # h2ir has no complex dtypes
    # a frozen parameter (requires_grad=False: a fine-tune's embedding) is a constant of the
    # programs, like a buffer: no gradient, no optimizer state, no all-reduce, never updated
    frozen = {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    for k in [k for k, fqn in pmap.items() if fqn in frozen]:
        bmap[k] = pmap.pop(k)
    picked = _pick_graph_output(agm, model, path)
    names = _input_names(model, len(imap))
    imap = {k: names[i] for i, k in enumerate(imap)}
    attrs = {"micro_batch": micro_batch, "seq_len": seq_len, **_model_dims(model)}
    if picked:                  # which part of the model's output the pipeline trains on
        attrs["model_output"] = picked
    grouper = LayerGrouper(model, agm)
    try:
        g = lower_fx(agm, mf.name, inputs=imap, params=pmap, consts=bmap, layer_of=grouper,
                     attrs=attrs, file=path)
    except H2Error as e:
        raise _at_model_line(e, path) from None
    return Capture(mf, model, agm, pmap, bmap, imap, grouper, g, how)


def capture(path: str, model_args: dict | None = None, micro_batch: int = 1, seq_len: int = 128,
            model: nn.Module | None = None) -> Graph:
    """The h2ir graph of a model file (see `trace_model`)."""
    return trace_model(path, model_args, micro_batch, seq_len, model).graph


def model_costs(model_path: str, model_args: dict | None = None, micro_batch: int = 1,
                seq_len: int = 128) -> ModelCosts:
    """The planner's view of a model: per-layer costs (see h2ir/costs.py)."""
    return capture(model_path, model_args, micro_batch, seq_len).layer_costs()
