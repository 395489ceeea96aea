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

import operator
from dataclasses import dataclass, field

import torch
import torch.fx
from torch._functorch.partitioners import default_partition
from functorch.compile import aot_function, make_boxed_func

from frontend.capture import Capture
from frontend.lower import lower_fx, tensor_type
from h2ir.errors import H2Error
from h2ir.graph import Graph


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

    def meta(self) -> dict:
        return {k: getattr(self, k) for k in (
            "index", "layers", "inputs", "outputs", "passthrough", "params", "consts", "saved",
            "tangents", "input_grads", "input_types", "output_types")}


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


def split_stages(cap: Capture, stage_layers: list[list[str]]):
    """One fx GraphModule per stage plus its boundary names (graph order)."""
    g = cap.aten.graph
    stage_of = _stage_of(cap, stage_layers)
    S = len(stage_layers)
    nodes = list(g.nodes)
    out_node = next(n for n in nodes if n.op == "output")
    model_outs = [a for a in (out_node.args[0] if isinstance(out_node.args[0], (tuple, list))
                              else [out_node.args[0]])]
    # defining stage of every activation (model inputs: -1)
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
    order = {n.name: i for i, n in enumerate(nodes)}

    def crossing(s):   # activations defined before stage s and used at or after it
        return sorted((k for k, d in defined.items() if d < s and last_use.get(k, -1) >= s),
                      key=order.get)

    stages = []
    for s in range(S):
        ins = crossing(s) if s > 0 else [k for k in cap.inputs]
        outs = crossing(s + 1) if s < S - 1 else [a.name for a in model_outs]
        fg = torch.fx.Graph()
        env = {}
        for k in ins:
            env[k] = fg.placeholder(k)
        used_params, used_bufs = [], []
        members = [n for n in nodes if stage_of.get(n.name) == s]
        for n in members:
            for a in n.all_input_nodes:
                if a.name in cap.params and a.name not in env:
                    env[a.name] = fg.placeholder(a.name)
                    used_params.append(a.name)
        for n in members:
            for a in n.all_input_nodes:
                if a.name in cap.buffers and a.name not in env:
                    env[a.name] = fg.placeholder(a.name)
                    used_bufs.append(a.name)
        for n in members:
            env[n.name] = fg.node_copy(n, lambda a: env[a.name])
            env[n.name].meta = dict(n.meta)
        passthrough = [k for k in outs if k in ins]
        fg.output(tuple(env[k] for k in outs if k not in passthrough))
        for k, n in env.items():
            src = next(x for x in nodes if x.name == k) if k not in cap.params else None
            if src is not None and "val" in src.meta:
                n.meta["val"] = src.meta["val"]
        gm = torch.fx.GraphModule(torch.nn.Module(), fg)
        stages.append((gm, ins, outs, passthrough, used_params, used_bufs))
    return stages


def _val(cap: Capture, name: str):
    for n in cap.aten.graph.nodes:
        if n.name == name:
            return n.meta["val"]
    raise KeyError(name)


def build_stage_programs(cap: Capture, stage_layers: list[list[str]], loss_fn=None,
                         name: str = "model") -> list[StageProgram]:
    """Forward/backward h2ir programs for every stage (AOTAutograd on the meta device)."""
    loss_fn = loss_fn or cap.model_file.loss_fn()
    from torch._subclasses.fake_tensor import FakeTensorMode
    fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
    progs = []
    S = len(stage_layers)
    for s, (gm, ins, outs, passthrough, params, bufs) in enumerate(split_stages(cap, stage_layers)):
        last = s == S - 1
        computed_outs = [k for k in outs if k not in passthrough]
        example = [_val(cap, k) for k in ins] + [_val(cap, p) for p in params] + \
                  [_val(cap, b) for b in bufs]
        n_args = len(example)
        if last:
            out_val = _val(cap, computed_outs[0])
            example.append(torch.empty(out_val.shape[:-1], dtype=torch.long, device="meta"))
        # Fake CPU tensors: CPU kernels' dispatch (flash attention, nll_loss autograd) without
        # allocating a byte, so a 100 B-parameter model compiles here too.
        args = []
        with fake_mode:
            for i, v in enumerate(example):
                t = torch.empty(v.shape, dtype=v.dtype, device="cpu")
                if t.is_floating_point() and i < len(ins) + len(params):
                    t.requires_grad_(True)
                args.append(t)

        captured = {}

        def fw_compiler(fgm, example_inputs):
            captured["fw"] = fgm
            return make_boxed_func(fgm.forward)

        def bw_compiler(bgm, example_inputs):
            captured["bw"] = bgm
            return make_boxed_func(bgm.forward)

        if last:
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
        results = [result] if last else list(result)
        grads_needed = [r for r in results if isinstance(r, torch.Tensor) and r.requires_grad]
        if grads_needed:
            with fake_mode:
                torch.autograd.backward(grads_needed, [torch.ones_like(r) for r in grads_needed])
        if "bw" not in captured:
            raise H2Error(f"stage {s} has no backward (no parameter or input needs a gradient)")
        out_names = ["loss"] if last else computed_outs
        tangents = [k for k, r in zip(out_names, results)
                    if isinstance(r, torch.Tensor) and r.requires_grad]
        progs.append(_lower_stage(cap, s, stage_layers[s], captured["fw"], captured["bw"], ins,
                                  out_names, passthrough, params, bufs, last, tangents, args, name))
    return progs


def _lower_stage(cap, s, layers, fw, bw, ins, out_names, passthrough, params, bufs, last,
                 tangents, args, name) -> StageProgram:
    fw_ph = [n for n in fw.graph.nodes if n.op == "placeholder"]
    primal_names = list(ins) + [cap.params[p] for p in params] + [cap.buffers[b] for b in bufs] + \
        (["targets"] if last else [])
    inputs = {ph.name: primal_names[i] for i, ph in enumerate(fw_ph)}
    pmap = {ph.name: primal_names[i] for i, ph in enumerate(fw_ph)
            if len(ins) <= i < len(ins) + len(params)}
    cmap = {ph.name: primal_names[i] for i, ph in enumerate(fw_ph)
            if len(ins) + len(params) <= i < len(ins) + len(params) + len(bufs)}
    imap = {k: v for k, v in inputs.items() if k not in pmap and k not in cmap}

    def one_layer(tag):
        return lambda node: (f"stage{s}.{tag}", "program", {"layers": list(layers)})

    fwd = lower_fx(fw, f"{name}.stage{s}.fwd", inputs=imap, params=pmap, consts=cmap,
                   layer_of=one_layer("fwd"), attrs={"stage": s})
    # forward outputs: the stage's outputs, then the values the backward saves
    n_out = len(out_names)
    # rename the user-visible outputs so the next stage's inputs carry the same names
    for v, k in zip(fwd.outputs[:n_out], out_names):
        if v.name != k and not any(x is v for x in fwd.inputs + fwd.params + fwd.consts):
            _rename(fwd, v, k)
    saved = [v.name for v in fwd.outputs[n_out:]]
    bw_ph = [n for n in bw.graph.nodes if n.op == "placeholder"]
    saved_ph = [n for n in bw_ph if not n.name.startswith("tangents")]
    tangent_ph = [n for n in bw_ph if n.name.startswith("tangents")]
    if len(saved_ph) != len(saved) or len(tangent_ph) != len(tangents):
        raise H2Error(f"internal: stage {s} backward takes {len(saved_ph)} saved values and "
                      f"{len(tangent_ph)} gradients; forward saves {len(saved)} and has "
                      f"{len(tangents)} differentiable outputs")
    # a value saved twice arrives twice: keep one placeholder per saved name
    first: dict[str, torch.fx.Node] = {}
    for i, ph in enumerate(saved_ph):
        if saved[i] in first:
            ph.replace_all_uses_with(first[saved[i]])
            bw.graph.erase_node(ph)
        else:
            first[saved[i]] = ph
    bmap = {ph.name: k for k, ph in first.items()}
    saved = list(first)
    bmap.update({ph.name: f"grad.{tangents[i]}" for i, ph in enumerate(tangent_ph)})
    bw_out = next(n for n in bw.graph.nodes if n.op == "output").args[0]
    input_grads = [primal_names[i] for i, o in enumerate(bw_out) if o is not None]
    bwd = lower_fx(bw, f"{name}.stage{s}.bwd", inputs=bmap, params={}, consts={},
                   layer_of=one_layer("bwd"), attrs={"stage": s})
    # the program's outputs carry the names of the gradients they are
    for v, k in zip(bwd.outputs, input_grads):
        if not any(x is v for x in bwd.inputs):
            _rename(bwd, v, f"grad.{k}")
    fwd.verify()
    bwd.verify()
    in_types = {k: str(tensor_type(a)) for k, a in zip(primal_names, args)}
    out_types = {v.name: str(v.type) for v in fwd.outputs[:n_out]}
    return StageProgram(
        index=s, layers=list(layers), fwd=fwd, bwd=bwd, inputs=list(ins), outputs=list(out_names),
        passthrough=list(passthrough), params=[cap.params[p] for p in params],
        consts=[cap.buffers[b] for b in bufs], saved=saved, tangents=tangents,
        input_grads=input_grads, input_types=in_types, output_types=out_types)


def _rename(g: Graph, v, new: str):
    taken = {x.name for x in g.inputs + g.consts + g.all_params()} | \
            {o.name for n in g.nodes() for o in n.outputs}
    if new in taken and v.name != new:
        raise H2Error(f"internal: cannot rename %{v.name} to %{new}: name taken")
    v.name = new
