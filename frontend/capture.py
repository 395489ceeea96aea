"""Capture a model file into h2ir on the meta device (no weights allocated).

Model-file convention:
    build_model(**kwargs) -> nn.Module          required; kwargs come from `--arg key=value`
    example_inputs(micro_batch, seq_len)        optional; default: int64 token ids [mb, seq]
    loss_fn(outputs, targets)                   optional; default: next-token cross-entropy

Capture path: `torch.fx.symbolic_trace` first (keeps the module hierarchy per node); the traced
module is then lowered to ATen with `make_fx` while preserving each node's module stack. Models
symbolic_trace cannot handle (data-dependent control flow, e.g. models from popular model
libraries) go through non-strict `torch.export`, whose graph also carries module stacks.
Nodes are grouped into layers: nodes before the first block -> `embed`, each element of the
model's block list -> `block.<i>`, nodes after the last block -> `head`.
"""
from __future__ import annotations

import contextlib
import importlib.util
import operator
import io
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F

from h2ir.costs import ModelCosts
from h2ir.errors import H2Error
from h2ir.graph import Graph
from frontend.lower import lower_fx, module_path


@dataclass
class ModelFile:
    path: str
    module: object

    @property
    def name(self) -> str:
        return Path(self.path).stem

    def build(self, args: dict) -> nn.Module:
        try:
            return self.module.build_model(**args)
        except TypeError as e:
            raise H2Error(f"build_model() rejected the arguments {args}: {e}", self.path) from None

    def example_inputs(self, micro_batch: int, seq_len: int) -> tuple:
        if hasattr(self.module, "example_inputs"):
            ex = self.module.example_inputs(micro_batch, seq_len)
            return tuple(ex) if isinstance(ex, (tuple, list)) else (ex,)
        return (torch.zeros(micro_batch, seq_len, dtype=torch.long),)

    def loss_fn(self):
        return getattr(self.module, "loss_fn", default_loss)


def default_loss(outputs, targets):
    """Next-token cross-entropy over the last dim (targets are already shifted by the loader)."""
    return F.cross_entropy(outputs.reshape(-1, outputs.shape[-1]), targets.reshape(-1))


def load_model_file(path: str) -> ModelFile:
    p = Path(path)
    if not p.is_file():
        raise H2Error("model file not found", path)
    name = f"h2_model_{p.stem}_{abs(hash(str(p.resolve())))}"
    spec = importlib.util.spec_from_file_location(name, p)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)
    except SyntaxError as e:
        raise H2Error(f"syntax error in model file: {e.msg}", path, e.lineno, e.offset) from None
    except Exception as e:  # a model file is user code: report, don't crash
        tb = e.__traceback__
        line = None
        while tb is not None:
            if tb.tb_frame.f_code.co_filename == str(p):
                line = tb.tb_lineno
            tb = tb.tb_next
        raise H2Error(f"importing the model file failed: {type(e).__name__}: {e}", path, line) from None
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

def find_block_list(model: nn.Module) -> str | None:
    """Path of the ModuleList holding the repeated blocks: the one with the most parameters."""
    best, best_n = None, -1
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and len(m) > 0 and "expert" not in name.split(".")[-1]:
            n = sum(p.numel() for p in m.parameters())
            if n > best_n:
                best, best_n = name, n
    return best


def moe_attrs(block: nn.Module) -> dict | None:
    """MoE shape of a block that holds an `experts` ModuleList (Piper's expert terms need it)."""
    for name, m in block.named_modules():
        if isinstance(m, nn.ModuleList) and name.split(".")[-1] == "experts" and len(m) > 0:
            parent = block.get_submodule(name.rsplit(".", 1)[0]) if "." in name else block
            top_k = getattr(parent, "top_k", None) or getattr(parent, "num_experts_per_tok", None) or 1
            lin = [l for l in m[0].modules() if isinstance(l, nn.Linear)]
            d_model = lin[0].in_features if lin else 0
            d_ffn = lin[0].out_features if lin else 0
            return {"experts": len(m), "top_k": int(top_k), "d_model": d_model, "d_ffn": d_ffn,
                    "expert_params": sum(p.numel() for p in m[0].parameters())}
    return None


class LayerGrouper:
    """Maps each ATen node to its pipeline layer by the block list and the module stack."""

    def __init__(self, model: nn.Module, gm: torch.fx.GraphModule):
        self.blocks = find_block_list(model)
        self.n_blocks = len(model.get_submodule(self.blocks)) if self.blocks else 0
        self.kinds = {}
        for i in range(self.n_blocks):
            attrs = moe_attrs(model.get_submodule(self.blocks)[i]) if self.blocks else None
            self.kinds[i] = ("moe_block", {"module": f"{self.blocks}.{i}", **attrs}) if attrs else \
                ("transformer_block", {"module": f"{self.blocks}.{i}"})
        # index of each call node; first/last node inside any block
        self.block_of: dict[str, int] = {}
        for node in gm.graph.nodes:
            b = self._block(node)
            if b is not None:
                self.block_of[node.name] = b
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

    def _block(self, node) -> int | None:
        if not self.blocks:
            return None
        prefix = self.blocks + "."
        for v in (node.meta.get("nn_module_stack") or {}).values():
            p = module_path(v[0])
            if p.startswith(prefix):
                idx = p[len(prefix):].split(".")[0]
                if idx.isdigit():
                    return int(idx)
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


def _aten_from_export(model, example):
    ep = torch.export.export(model, example, strict=False)
    sig = ep.graph_signature
    pmap = dict(sig.inputs_to_parameters)
    bmap = dict(sig.inputs_to_buffers)
    bmap.update(getattr(sig, "inputs_to_lifted_tensor_constants", {}) or {})
    imap = {n: n for n in sig.user_inputs}
    return ep.graph_module, pmap, bmap, imap


def _input_names(model: nn.Module, n: int) -> list[str]:
    import inspect
    try:
        names = [p for p in inspect.signature(model.forward).parameters]
    except (TypeError, ValueError):
        names = []
    return (names + [f"input{i}" for i in range(len(names), n)])[:n]


def trace_aten(model: nn.Module, example: tuple, path: str):
    """ATen fx graph + placeholder maps + which capture path was used."""
    try:
        gm = _symbolic_trace(model)
        how = "symbolic_trace"
    except Exception:       # not symbolically traceable: fall back to non-strict export
        gm = None
    if gm is not None:
        try:
            return (*_aten_from_symbolic(model, gm, example), how)
        except Exception:
            gm = None
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            return (*_aten_from_export(model, example), "torch.export")
    except H2Error:
        raise
    except Exception as e:
        raise H2Error(f"could not capture the model with torch.fx or torch.export: "
                      f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", path) from None


def _model_dims(model: nn.Module) -> dict:
    cfg = getattr(model, "config", None)
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
    names = _input_names(model, len(imap))
    imap = {k: names[i] for i, k in enumerate(imap)}
    attrs = {"micro_batch": micro_batch, "seq_len": seq_len, **_model_dims(model)}
    grouper = LayerGrouper(model, agm)
    g = lower_fx(agm, mf.name, inputs=imap, params=pmap, consts=bmap, layer_of=grouper,
                 attrs=attrs, file=path)
    return Capture(mf, model, agm, pmap, bmap, imap, grouper, g, how)


def capture(path: str, model_args: dict | None = None, micro_batch: int = 1, seq_len: int = 128,
            model: nn.Module | None = None) -> Graph:
    """The h2ir graph of a model file (see `trace_model`)."""
    return trace_model(path, model_args, micro_batch, seq_len, model).graph


def model_costs(model_path: str, model_args: dict | None = None, micro_batch: int = 1,
                seq_len: int = 128) -> ModelCosts:
    """The planner's view of a model: per-layer costs (see h2ir/costs.py)."""
    return capture(model_path, model_args, micro_batch, seq_len).layer_costs()
