"""Stage programs: split the captured ATen graph at a plan's layer boundaries and get each stage's
forward and backward programs from AOTAutograd, lowered to h2ir.

    forward:  (boundary inputs, params, consts[, targets]) -> (boundary outputs | loss, saved...)
    backward: (saved..., grads of outputs) -> (grads of boundary inputs, grads of params)

No autodiff of our own: AOTAutograd's joint graph and default partitioner decide what is saved.
No decomposition table: torch 2.13's blanket `core_aten_decompositions()` decomposes attention's
forward but not its backward and gives wrong gradients on CPU; ATen ops are lowered as they are.

Values that cross a boundary without being touched by a stage (e.g. rotary tables computed once
before the first block) are *pass-through*: the executor forwards them and adds their gradient.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx
from torch._functorch.partitioners import default_partition
from functorch.compile import aot_function, make_boxed_func

from frontend.capture import Capture
from frontend.lower import lower_fx, tensor_type
from frontend.recompute import apply_recompute
from h2ir.opset import DROPOUT_SEED_INPUT as RNG_INPUT
from h2ir.errors import H2Error
from h2ir.graph import Graph, Layer, Node, Value
from h2ir.types import TensorType


@dataclass
class StageProgram:
    index: int
    layers: list
    fwd: Graph
    bwd: Graph
    inputs: list            # boundary activation names received (stage 0: model inputs)
    outputs: list           # boundary activation names sent on (last stage: ['loss'])
    passthrough: list       # names among outputs forwarded unchanged from inputs
    params: list            # parameter FQNs of this stage
    consts: list            # buffer FQNs this stage reads
    saved: list             # names of forward outputs the backward reads
    tangents: list          # names of outputs whose gradient the backward takes ('loss' on the last)
    input_grads: list       # names (inputs or params) whose gradients the backward returns, in order
    input_types: dict = field(default_factory=dict)     # name -> str(TensorType)
    output_types: dict = field(default_factory=dict)
    tp: int = 1             # tensor-parallel degree: the programs are one rank's (SPMD)
    sharding: dict = field(default_factory=dict)        # param FQN -> ParamSharding (tp > 1)
    # sparse MoE (frontend/moe.py): {'ep', 'capacity_factor', 'experts': {module path:
    # {'experts', 'params', 'placement'}}}, set by the compiler; None for a plan without 'moe'
    moe: dict | None = None
    # stage 0: the model inputs after the token ids (`Capture.fixed_inputs`), whose values the
    # compiler stores with the stage's constants
    fixed_inputs: list = field(default_factory=list)

    def meta(self) -> dict:
        m = {k: getattr(self, k) for k in (
            "index", "layers", "inputs", "outputs", "passthrough", "params", "consts", "saved",
            "tangents", "input_grads", "input_types", "output_types")}
        if self.tp > 1:
            m["tp"] = self.tp
            m["sharding"] = {k: {"kind": v.kind, "dim": v.dim} for k, v in self.sharding.items()}
        if self.moe:
            m["moe"] = self.moe
        if self.fixed_inputs:
            m["fixed_inputs"] = self.fixed_inputs
        return m


def _stage_of(cap: Capture, stage_layers: list[list[str]]):
    owner = {l: s for s, ls in enumerate(stage_layers) for l in ls}
    out = {}
    for node in cap.aten.graph.nodes:
        if node.op == "call_function":
            lname = cap.layer_of(node)[0]
            if lname not in owner:
                raise H2Error(f"layer {lname} is not assigned to any stage")
            out[node.name] = owner[lname]
    return out


def _is_assert(n) -> bool:
    return n.op == "call_function" and "_assert" in str(n.target)


def _off_meta(x):
    meta, cpu = torch.device("meta"), torch.device("cpu")
    if isinstance(x, torch.device):
        return cpu if x == meta else x
    if isinstance(x, (list, tuple)):
        return type(x)(_off_meta(v) for v in x)
    if isinstance(x, dict):
        return {k: _off_meta(v) for k, v in x.items()}
    return x


def split_stages(cap: Capture, stage_layers: list[list[str]]):
    """One fx GraphModule per stage plus its boundary names (graph order)."""
    g = cap.aten.graph
    stage_of = _stage_of(cap, stage_layers)
    S = len(stage_layers)
    nodes = list(g.nodes)
    model_outs = _model_outputs(nodes)
    defined, last_use = _activation_lifetimes(cap, nodes, stage_of, model_outs, S)
    order = {n.name: i for i, n in enumerate(nodes)}
    by_name = {n.name: n for n in nodes}

    def crossing(s):   # activations defined before stage s and used at or after it
        return sorted((k for k, d in defined.items() if d < s and last_use.get(k, -1) >= s),
                      key=order.get)

    stages = []
    for s in range(S):
        ins = crossing(s) if s > 0 else [k for k in cap.inputs]
        outs = crossing(s + 1) if s < S - 1 else [a.name for a in model_outs]
        members = [n for n in nodes if stage_of.get(n.name) == s]
        stages.append(_stage_module(cap, members, ins, outs, by_name))
    return stages


def _model_outputs(nodes: list) -> list:
    out_node = next(n for n in nodes if n.op == "output")
    return [a for a in (out_node.args[0] if isinstance(out_node.args[0], (tuple, list))
                        else [out_node.args[0]])]


def _activation_lifetimes(cap: Capture, nodes: list, stage_of: dict, model_outs: list, S: int):
    """(defined, last_use): the stage that defines each activation (model inputs: -1) and the
    last stage that reads it (model outputs: S, past the last stage)."""
    defined = {n.name: -1 for n in nodes if n.op == "placeholder" and n.name in cap.inputs}
    defined.update(stage_of)
    last_use: dict[str, int] = {}
    for n in nodes:
        if n.op == "call_function":
            for a in n.all_input_nodes:
                if a.name in defined:
                    last_use[a.name] = max(last_use.get(a.name, -1), stage_of[n.name])
    for a in model_outs:
        last_use[a.name] = S
    return defined, last_use


def _stage_module(cap: Capture, members: list, ins: list, outs: list, by_name: dict):
    """(GraphModule, ins, outs, passthrough, params, buffers) of the stage made of `members`:
    placeholders for its boundary inputs, then for the parameters and buffers it reads, then
    copies of its nodes; it returns the outputs that are not passed through unchanged."""
    fg = torch.fx.Graph()
    env = {}
    for k in ins:
        env[k] = fg.placeholder(k)
    used_params = _weight_placeholders(fg, env, members, cap.params)
    used_bufs = _weight_placeholders(fg, env, members, cap.buffers)
    for n in members:
        if _is_assert(n):
            continue                  # runtime checks recorded on the meta device
        c = fg.node_copy(n, lambda a: env[a.name])
        # the capture ran on the meta device; programs are traced for real devices
        c.args, c.kwargs = _off_meta(c.args), _off_meta(c.kwargs)
        c.meta = dict(n.meta)
        env[n.name] = c
    passthrough = [k for k in outs if k in ins]
    fg.output(tuple(env[k] for k in outs if k not in passthrough))
    for k, n in env.items():          # placeholders carry the traced value's type too
        src = by_name.get(k)
        if src is not None and "val" in src.meta:
            n.meta["val"] = src.meta["val"]
    gm = torch.fx.GraphModule(torch.nn.Module(), fg)
    return gm, ins, outs, passthrough, used_params, used_bufs


def _weight_placeholders(fg: torch.fx.Graph, env: dict, members: list, weights) -> list:
    """Add a placeholder for each of `weights` (parameter or buffer names) that `members` read
    and `env` lacks, in first-use order; their names."""
    used = []
    for n in members:
        for a in n.all_input_nodes:
            if a.name in weights and a.name not in env:
                env[a.name] = fg.placeholder(a.name)
                used.append(a.name)
    return used


def _val(cap: Capture, name: str):
    """The traced (meta) value of the ATen graph's node `name`."""
    index = cap.__dict__.get("_node_index")
    if index is None:
        index = cap.__dict__["_node_index"] = {n.name: n for n in cap.aten.graph.nodes}
    return index[name].meta["val"]


# ---- one layer at a time: AOTAutograd once per distinct layer structure -------------------------

@dataclass
class _Unit:
    """One model layer's fx module with its boundary (what split_stages gives per layer)."""
    layer: str
    gm: torch.fx.GraphModule
    ins: list
    outs: list
    passthrough: list
    params: list        # placeholder names (cap.params keys)
    bufs: list          # placeholder names (cap.buffers keys)
    last: bool
    loss_inside: bool = False   # the loss is traced into gm (tensor-parallel last layer)


@dataclass
class _Traced:
    """AOTAutograd's forward/backward graphs of one layer structure (shared by identical layers)."""
    fw: torch.fx.GraphModule
    bw: torch.fx.GraphModule
    n_out: int
    tangent_pos: list   # positions (among computed outputs) whose gradient the backward takes
    grad_pos: list      # positions (among primals) whose gradient the backward returns


def _signature(u: _Unit) -> tuple:
    """Structure of a layer up to the names of its values: equal signatures, equal programs."""
    index = {}
    sig = [u.last, len(u.ins), len(u.params), len(u.bufs)]
    for i, n in enumerate(u.gm.graph.nodes):
        index[n] = i
        val = n.meta.get("val")
        vt = (tuple(val.shape), str(val.dtype)) if isinstance(val, torch.Tensor) else None
        args = torch.fx.node.map_arg((n.args, n.kwargs), lambda a: ("%", index[a]))
        sig.append((n.op, str(n.target) if n.op != "placeholder" else "", repr(args), vt))
    return tuple(sig)


def _aot(cap: Capture, u: _Unit, loss_fn, fake_mode) -> _Traced:
    # the placeholders' traced values: the layer's own (a tensor-parallel layer's are one rank's)
    example = [n.meta["val"] for n in u.gm.graph.nodes if n.op == "placeholder"]
    n_args = len(example)
    computed = [k for k in u.outs if k not in u.passthrough]
    if u.last and not u.loss_inside:
        out_val = _val(cap, computed[0])
        example.append(torch.empty(out_val.shape[:-1], dtype=torch.long, device="meta"))
    # Fake CPU tensors: CPU kernels' dispatch (flash attention, nll_loss autograd) without
    # allocating a byte, so a 100 B-parameter model compiles here too.
    args = []
    with fake_mode:
        for i, v in enumerate(example):
            t = torch.empty(v.shape, dtype=v.dtype, device="cpu")
            if t.is_floating_point() and i < len(u.ins) + len(u.params):
                t.requires_grad_(True)
            args.append(t)
    captured = {}

    def fw_compiler(fgm, example_inputs):
        captured["fw"] = fgm
        return make_boxed_func(fgm.forward)

    def bw_compiler(bgm, example_inputs):
        captured["bw"] = bgm
        return make_boxed_func(bgm.forward)

    gm = u.gm
    if u.loss_inside:
        def fn(*a):
            return gm(*a)[0]
    elif u.last:
        def fn(*a):
            res = gm(*a[:n_args])
            res = res[0] if isinstance(res, (tuple, list)) else res
            return loss_fn(res, a[n_args])
    else:
        def fn(*a):
            return tuple(gm(*a))

    compiled = aot_function(fn, fw_compiler=fw_compiler, bw_compiler=bw_compiler,
                            partition_fn=default_partition, decompositions={})
    result = compiled(*args)
    results = [result] if u.last else list(result)
    need = [r for r in results if isinstance(r, torch.Tensor) and r.requires_grad]
    if need:
        with fake_mode:
            torch.autograd.backward(need, [torch.ones_like(r) for r in need])
    tangent_pos = [i for i, r in enumerate(results) if isinstance(r, torch.Tensor) and r.requires_grad]
    if "bw" not in captured:       # nothing to differentiate (e.g. a layer of buffers only)
        return _Traced(captured["fw"], None, len(results), [], [])
    bw = captured["bw"]
    bw_out = next(n for n in bw.graph.nodes if n.op == "output").args[0]
    grad_pos = [i for i, o in enumerate(bw_out) if o is not None]
    return _Traced(captured["fw"], bw, len(results), tangent_pos, grad_pos)


@dataclass
class _LayerProgram:
    fwd: Graph
    bwd: Graph | None
    out_names: list         # computed outputs ('loss' for the loss layer)
    saved: list             # names of forward outputs the backward reads
    tangents: list          # output names whose gradient the backward takes
    grads: list             # primal names whose gradient the backward returns (order of bwd outputs)


def _lower_layer(cap: Capture, u: _Unit, t: _Traced, tag: str) -> _LayerProgram:
    primals = list(u.ins) + [cap.params[p] for p in u.params] + [cap.buffers[b] for b in u.bufs] + \
        (["targets"] if u.last else [])
    fw_ph = [n for n in t.fw.graph.nodes if n.op == "placeholder"]
    np_, nb = len(u.params), len(u.bufs)
    ni = len(u.ins)
    pmap = {ph.name: primals[i] for i, ph in enumerate(fw_ph) if ni <= i < ni + np_}
    cmap = {ph.name: primals[i] for i, ph in enumerate(fw_ph) if ni + np_ <= i < ni + np_ + nb}
    imap = {ph.name: primals[i] for i, ph in enumerate(fw_ph) if ph.name not in pmap and ph.name not in cmap}
    layer = lambda node: (u.layer, "program", {})      # noqa: E731
    fwd = lower_fx(t.fw, "fwd", inputs=imap, params=pmap, consts=cmap, layer_of=layer,
                   prefix=f"{tag}.")
    out_names = ["loss"] if u.last else [k for k in u.outs if k not in u.passthrough]
    named: set[int] = set()
    for i, (v, k) in enumerate(zip(fwd.outputs[:t.n_out], out_names)):
        if any(x is v for x in fwd.inputs + fwd.consts + fwd.all_params()):
            continue
        if id(v) in named:      # two outputs lowered to one value (x and x.clone()): a copy
            c = Value(k, v.type)
            fwd.layers[-1].nodes.append(Node("copy", [v], {}, [c]))
            fwd.outputs[i] = c
            continue
        v.name = k
        named.add(id(v))
    saved_vals = fwd.outputs[t.n_out:]
    if t.bw is None:
        return _LayerProgram(fwd, None, out_names, [], [], [])
    bw_ph = [n for n in t.bw.graph.nodes if n.op == "placeholder"]
    saved_ph = [n for n in bw_ph if not n.name.startswith("tangents")]
    tangent_ph = [n for n in bw_ph if n.name.startswith("tangents")]
    tangents = [out_names[i] for i in t.tangent_pos]
    bmap = {ph.name: saved_vals[i].name for i, ph in enumerate(saved_ph)}
    bmap.update({ph.name: f"grad.{tangents[i]}" for i, ph in enumerate(tangent_ph)})
    bwd = lower_fx(t.bw, "bwd", inputs=bmap, params={}, consts={}, layer_of=layer,
                   prefix=f"{tag}.g.")
    grads = [primals[i] for i in t.grad_pos]
    return _LayerProgram(fwd, bwd, out_names, [v.name for v in saved_vals], tangents, grads)


# ---- composing layer programs into stage programs ------------------------------------------------

def _compose(name: str, s: int, unit_progs: list[_LayerProgram], stage_ins: list, stage_outs: list,
             passthrough: list, in_types: dict, last: bool) -> tuple[Graph, Graph, dict]:
    """Join stage `s`'s layer programs into its forward and backward programs, and what the
    StageProgram says about them (saved values, tangents, input gradients, params, consts)."""
    fwd, env, saved = _join_forward(f"{name}.stage{s}.fwd", s, unit_progs,
                                    stage_ins + (["targets"] if last else []), in_types)
    if any(v.name == RNG_INPUT for lp in unit_progs if lp.bwd is not None for v in lp.bwd.inputs) \
            and RNG_INPUT not in saved:
        # AOTAutograd's partitioner may recompute a dropout in the backward (from the same seed
        # and site number, so the same mask): the backward takes the micro-batch's seed, saved
        if RNG_INPUT not in env:
            env[RNG_INPUT] = Value(RNG_INPUT, TensorType("i64", (2,)))
            fwd.inputs.append(env[RNG_INPUT])
        saved.append(RNG_INPUT)
    computed_outs = ["loss"] if last else [k for k in stage_outs if k not in passthrough]
    fwd.outputs = [env[k] for k in computed_outs] + [env[k] for k in saved]
    bwd, grad, stage_tangents = _join_backward(f"{name}.stage{s}.bwd", s, unit_progs, env, saved,
                                               computed_outs)
    param_names = [p.name for l in fwd.layers for p in l.params]
    input_grads = [k for k in stage_ins if k in grad] + [k for k in param_names if k in grad]
    _set_input_grad_outputs(bwd, grad, input_grads)
    info = {"saved": saved, "tangents": ["loss"] if last else stage_tangents,
            "input_grads": input_grads, "params": param_names,
            "consts": [c.name for c in fwd.consts],
            "output_types": {k: str(env[k].type) for k in computed_outs}}
    return fwd, bwd, info


def _join_forward(gname: str, s: int, unit_progs: list[_LayerProgram], inputs: list,
                  in_types: dict) -> tuple[Graph, dict, list]:
    """The forward: layers in order; boundary values are shared by name. Returns the graph (its
    outputs not set yet), name -> value of everything it defines, and the names the layers save
    for the backward."""
    fwd = Graph(name=gname, attrs={"stage": s})
    env: dict[str, Value] = {}
    for k in inputs:
        v = Value(k, in_types[k])
        fwd.inputs.append(v)
        env[k] = v
    rng = next((v for lp in unit_progs for v in lp.fwd.inputs if v.name == RNG_INPUT), None)
    if rng is not None:           # a layer draws dropout masks: the stage takes the seed
        fwd.inputs.append(rng)
        env[RNG_INPUT] = rng
    saved: list[str] = []
    for lp in unit_progs:
        fwd.layers.append(_join_forward_layer(fwd, s, lp, env))
        for k in lp.saved:
            if k not in saved:
                saved.append(k)
    return fwd, env, saved


def _join_forward_layer(fwd: Graph, s: int, lp: _LayerProgram, env: dict) -> Layer:
    """One layer's forward as a layer of the stage's: its inputs rewired to the values already in
    `env`, its consts added to `fwd`, what it defines added to `env`."""
    g = lp.fwd
    for c in g.consts:
        if c.name not in env:
            fwd.consts.append(c)
            env[c.name] = c
    for v in g.inputs:
        if v.name not in env:
            raise H2Error(f"internal: stage {s} input %{v.name} of layer "
                          f"{g.layers[0].name if g.layers else '?'} is not defined")
    layer = Layer(g.layers[0].name if g.layers else lp.out_names[0], "program")
    for gl in g.layers:
        for p in gl.params:
            if p.name in env:          # a tied parameter an earlier layer of the stage owns
                layer.attrs.setdefault("tied", []).append(p.name)
                continue
            layer.params.append(p)
            env[p.name] = p
        for n in gl.nodes:
            n.inputs = [env[v.name] if isinstance(v, Value) else v for v in n.inputs]
            layer.nodes.append(n)
            for o in n.outputs:
                env[o.name] = o
    for v in g.outputs:          # outputs of an identity layer may be its inputs
        env.setdefault(v.name, v)
    return layer


def _join_backward(gname: str, s: int, unit_progs: list[_LayerProgram], env: dict, saved: list,
                   computed_outs: list) -> tuple[Graph, dict, list]:
    """The backward: layers in reverse; gradients of values used by several layers are summed.
    Returns the graph (its outputs not set yet), name -> gradient value, and the stage's tangents
    (the outputs whose gradient it takes)."""
    bwd = Graph(name=gname, attrs={"stage": s})
    benv: dict[str, Value] = {}
    for k in saved:
        v = Value(k, env[k].type)
        bwd.inputs.append(v)
        benv[k] = v
    grad: dict[str, Value] = {}
    producer = {k: lp for lp in unit_progs for k in lp.out_names}
    stage_tangents = []
    for k in computed_outs:
        if k in producer[k].tangents:
            v = Value(f"grad.{k}", env[k].type)
            bwd.inputs.append(v)
            grad[k] = v
            stage_tangents.append(k)
    bwd.layers = [_join_backward_layer(lp, benv, grad) for lp in reversed(unit_progs)
                  if lp.bwd is not None]
    return bwd, grad, stage_tangents


def _join_backward_layer(lp: _LayerProgram, benv: dict, grad: dict) -> Layer:
    """One layer's backward as a layer of the stage's. It reads the saved values (`benv`) and the
    gradients flowing in so far (`grad`), and adds its own to `grad`."""
    g = lp.bwd
    layer = Layer(g.layers[0].name if g.layers else "?", "program")
    local: dict[str, Value] = {}
    for v in g.inputs:
        if v.name.startswith("grad."):
            k = v.name[5:]
            if k not in grad:   # no gradient flows into it downstream: zeros
                z = Value(f"{v.name}.zero", v.type)
                layer.nodes.append(Node("full", [], {"shape": list(v.type.shape), "value": 0.0,
                                                     "dtype": v.type.dtype}, [z]))
                grad[k] = z
            local[v.name] = grad[k]
        else:
            local[v.name] = benv[v.name]
    for gl in g.layers:
        for n in gl.nodes:
            n.inputs = [local.get(v.name, v) if isinstance(v, Value) else v for v in n.inputs]
            layer.nodes.append(n)
    for k, v in zip(lp.grads, g.outputs):
        v = local.get(v.name, v)
        if k in grad:           # a value read by several layers: sum its gradients
            acc = Value(f"{layer.name}.acc.{k}", v.type)
            layer.nodes.append(Node("add", [grad[k], v], {}, [acc]))
            grad[k] = acc
        else:
            grad[k] = v
    return layer


def _set_input_grad_outputs(bwd: Graph, grad: dict, input_grads: list) -> None:
    """The backward returns the gradients of `input_grads`, each named grad.<name> unless it is
    one of its inputs."""
    bwd.outputs = [grad[k] for k in input_grads]
    for k, v in zip(input_grads, bwd.outputs):
        if not any(x is v for x in bwd.inputs) and not v.name.startswith("grad."):
            v.name = f"grad.{k}"
    _unique_names(bwd)


def _unique_names(g: Graph):
    """Renaming outputs can collide with another value's name; make every name unique again."""
    seen = {v.name for v in g.inputs + g.consts + g.all_params()}
    for n in g.nodes():
        for v in n.outputs:
            base, i = v.name, 1
            while v.name in seen:
                v.name = f"{base}_{i}"
                i += 1
            seen.add(v.name)


def _float_histc(cap: Capture) -> None:
    """Integer `histc` (MoE routing counts: transformers bins expert ids with it when the model
    runs on the meta device) has no CPU kernel for AOTAutograd's fake tensors: count in float
    and cast back — exact for integer ids below 2**24. The new nodes join histc's layer."""
    g = cap.aten.graph
    changed = False
    for n in list(g.nodes):
        if n.op != "call_function" or n.target is not torch.ops.aten.histc.default:
            continue
        x = n.args[0]
        dt = x.meta["val"].dtype
        if dt.is_floating_point:
            continue
        with g.inserting_before(n):
            xf = g.call_function(torch.ops.aten._to_copy.default, (x,), {"dtype": torch.float32})
        xf.meta = dict(x.meta, val=x.meta["val"].float())
        n.args = (xf,) + tuple(n.args[1:])
        n.meta["val"] = n.meta["val"].float()
        with g.inserting_after(n):
            back = g.call_function(torch.ops.aten._to_copy.default, (n,), {"dtype": dt})
        n.replace_all_uses_with(back, delete_user_cb=lambda u: u is not back)
        back.meta = dict(n.meta, val=n.meta["val"].to(dt))
        for m in (xf, back):
            cap.layer_of.assign[m.name] = cap.layer_of.assign[n.name]
        changed = True
    if changed:
        cap.aten.recompile()


def _shard_units(cap: Capture, units: list, stage_layers: list, tp: list, loss_fn) -> dict:
    """Rewrite the layers of tensor-parallel stages for one rank (frontend/tensor_parallel.py);
    returns every parameter's sharding (FQN -> ParamSharding)."""
    from frontend.tensor_parallel import shard_layer, with_loss
    tp_of = {l: t for ls, t in zip(stage_layers, tp) for l in ls}
    decided: dict = {}
    for u in units:
        t = tp_of[u.layer]
        if t == 1:
            continue
        gm = u.gm
        if u.last:
            gm = with_loss(gm, loss_fn)
            u.loss_inside = True
        u.gm = shard_layer(gm, t, {p: cap.params[p] for p in u.params}, decided, u.layer,
                           cap.model_file.path)
    return decided


def build_stage_programs(cap: Capture, stage_layers: list[list[str]], loss_fn=None,
                         name: str = "model", tp: list[int] | None = None,
                         recompute: list[str] | None = None) -> list[StageProgram]:
    """Forward/backward h2ir programs for every stage; `tp` gives each stage's tensor-parallel
    degree (the programs of a tp > 1 stage are one rank's, the same on every rank), `recompute`
    each stage's activation recomputation (frontend/recompute.py).

    AOTAutograd runs once per distinct layer structure (all blocks of a LLaMA are one), on fake
    tensors; the layer programs are then joined into stage programs. This keeps compiling a
    96-layer model about as cheap as compiling three layers."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    loss_fn = loss_fn or cap.model_file.loss_fn()
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    tp = list(tp or [1] * len(stage_layers))
    _float_histc(cap)
    flat = [l for st in stage_layers for l in st]
    unit_parts = split_stages(cap, [[l] for l in flat])
    units = [_Unit(l, gm, ins, outs, pt, ps, bs, i == len(flat) - 1)
             for i, (l, (gm, ins, outs, pt, ps, bs)) in enumerate(zip(flat, unit_parts))]
    sharding = _shard_units(cap, units, stage_layers, tp, loss_fn) if max(tp) > 1 else {}
    traced: dict[tuple, _Traced] = {}
    lprogs = []
    for u in units:
        sig = _signature(u)
        if sig not in traced:
            traced[sig] = _aot(cap, u, loss_fn, fake_mode)
        lprogs.append(_lower_layer(cap, u, traced[sig], u.layer))
    stages = split_stages(cap, stage_layers)
    progs, i = [], 0
    for s, (gm, ins, outs, passthrough, params, bufs) in enumerate(stages):
        n = len(stage_layers[s])
        last = s == len(stages) - 1
        in_types = {k: tensor_type(_val(cap, k)) for k in ins}
        if last:
            out_val = _val(cap, [k for k in outs if k not in passthrough][0])
            from h2ir.types import TensorType
            in_types["targets"] = TensorType("i64", tuple(out_val.shape[:-1]))
        fwd, bwd, info = _compose(name, s, lprogs[i:i + n], ins, outs, passthrough, in_types, last)
        i += n
        bwd.eliminate_dead_code()      # AOTAutograd's backward can carry unused recomputation
        fwd.eliminate_dead_code()
        rc = (recompute or ["none"] * len(stage_layers))[s]
        if rc != "none":
            info["saved"] = apply_recompute(fwd, bwd, info["saved"], rc, _seq_len(cap))
            fwd.eliminate_dead_code()
            bwd.eliminate_dead_code()
        fwd.verify()
        bwd.verify()
        progs.append(StageProgram(
            index=s, layers=list(stage_layers[s]), fwd=fwd, bwd=bwd, inputs=list(ins),
            outputs=["loss"] if last else list(outs), passthrough=list(passthrough),
            params=info["params"], consts=info["consts"], saved=info["saved"],
            tangents=info["tangents"], input_grads=info["input_grads"],
            input_types={k: str(v) for k, v in in_types.items()},
            output_types=info["output_types"], tp=tp[s],
            sharding={k: sharding[k] for k in info["params"] if k in sharding} if tp[s] > 1
            else {}, fixed_inputs=list(cap.inputs)[1:] if s == 0 else []))
    return progs


def _seq_len(cap: Capture) -> int:
    """The traced sequence length: the token ids' last axis."""
    first = next(iter(cap.inputs))
    shape = tuple(_val(cap, first).shape)
    return int(shape[-1]) if shape else 0


# ---- zero-bubble: the backward split into input-gradient (B) and weight-gradient (W) parts ---------

def _graph_flops(g: Graph) -> float:
    total = 0.0
    for n in g.nodes():
        ins = [v.type if hasattr(v, "type") else v for v in n.inputs]
        total += n.opdef.flops(ins, [v.type for v in n.outputs], {**n.opdef.attrs, **n.attrs})
    return total


def split_backward(p: StageProgram) -> dict:
    """Split stage `p`'s backward program into B (the gradients of the stage's boundary inputs:
    what the previous stage waits for) and W (the parameter gradients), as zero-bubble
    pipelines do (Qi et al., ICLR 2024, Sec. 2): B is every node the input gradients depend on;
    W the remaining nodes the parameter gradients need, reading B's results it shares (the
    stash, kept by the worker from B to W) and the saved values and output gradients as the
    whole backward does. Communication nodes go where their results are needed (B if both).
    Returns {'bwd_input', 'bwd_weight': Graph, 'b_outputs', 'w_outputs', 'stash', 'w_inputs',
    'b_flops_fraction'}; running B then W gives exactly the whole backward's gradients."""
    from h2ir.graph import Layer
    g = p.bwd
    names = list(p.input_grads)
    outs = dict(zip(names, g.outputs))
    b_names = [k for k in names if k not in p.params]
    w_names = [k for k in names if k in p.params]
    producer = {}
    for layer in g.layers:
        for n in layer.nodes:
            for v in n.outputs:
                producer[id(v)] = n

    def slice_of(values) -> set:
        need, stack = set(), [v for v in values]
        while stack:
            v = stack.pop()
            n = producer.get(id(v))
            if n is None or id(n) in need:
                continue
            need.add(id(n))
            stack.extend(n.input_values())
        return need

    b_nodes = slice_of([outs[k] for k in b_names])
    w_nodes = slice_of([outs[k] for k in w_names]) - b_nodes
    b_defined = {id(v) for layer in g.layers for n in layer.nodes if id(n) in b_nodes
                 for v in n.outputs}
    stash, seen = [], set()
    w_ext = []                          # graph inputs W reads (saved values, output grads)
    graph_inputs = {id(v) for v in g.inputs}
    for layer in g.layers:
        for n in layer.nodes:
            if id(n) not in w_nodes:
                continue
            for v in n.input_values():
                if id(v) in seen:
                    continue
                if id(v) in b_defined:
                    stash.append(v)
                    seen.add(id(v))
                elif id(v) in graph_inputs:
                    w_ext.append(v)
                    seen.add(id(v))
    # a parameter gradient that B computes (or that is an input) is handed over as a stash value
    for k in w_names:
        v = outs[k]
        if id(v) in b_defined and id(v) not in seen:
            stash.append(v)
            seen.add(id(v))
        elif id(v) in graph_inputs and id(v) not in seen:
            w_ext.append(v)
            seen.add(id(v))

    def sub(name, keep, inputs, outputs):
        out = Graph(name, attrs=dict(g.attrs), inputs=list(inputs), consts=list(g.consts),
                    params=list(g.params), outputs=list(outputs))
        out.layers = [Layer(l.name, l.kind, dict(l.attrs), list(l.params),
                            [n for n in l.nodes if id(n) in keep]) for l in g.layers]
        out.layers = [l for l in out.layers if l.nodes or l.params]
        return out

    b_inputs = [v for v in g.inputs]
    bg = sub(f"{g.name}.bwd_input", b_nodes, b_inputs, [outs[k] for k in b_names] + stash)
    wg = sub(f"{g.name}.bwd_weight", w_nodes, w_ext + stash, [outs[k] for k in w_names])
    bg.verify()
    wg.verify()
    fb, fw = _graph_flops(bg), _graph_flops(wg)
    return {"bwd_input": bg, "bwd_weight": wg, "b_outputs": b_names, "w_outputs": w_names,
            "stash": [v.name for v in stash], "w_inputs": [v.name for v in w_ext],
            "b_flops_fraction": fb / (fb + fw) if fb + fw > 0 else 0.5}
