"""Unmodified transformers decoders lower to h2ir and train on both backends: `trace_model`
captures them, and the single-stage forward/backward programs (every layer in one stage) give
the loss and every parameter gradient of eager PyTorch autograd on the torch and NumPy backends.

The model file is examples/hf/decoders.py (a tiny random-weight config, all dropout 0). Cases: llama with grouped-query attention (4 query heads, 2
kv heads), gpt2 (layer_norm, gelu_new, tied embedding/LM head, bias terms), mixtral (MoE
routing: topk, sort, index, scatter of the experts), each with transformers' default attention
(sdpa: one fused `attention_masked` op with the causal/packed-sequence mask tensor) and eager
attention (matmul, additive float mask, softmax).
"""
from pathlib import Path

import numpy as np
import pytest
import torch

from backends.base import run_program
from backends.registry import get_backend
from frontend.capture import load_model_file, trace_model
from frontend.stages import build_stage_programs

MB, SEQ, VOCAB = 2, 16, 512


@pytest.fixture(scope="module")
def model_file():
    return str(Path(__file__).resolve().parent.parent / "examples/hf/decoders.py")


def _rel(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def _eager(path, args, tokens, targets):
    """(loss, {parameter name: grad}, parameters, buffers, names of each distinct parameter)
    of eager autograd; tied parameters appear under each of their names."""
    torch.manual_seed(0)
    model = load_model_file(path).build(args)
    params = dict(model.named_parameters(remove_duplicate=False))
    out = model(tokens)
    loss = torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), targets.reshape(-1))
    loss.backward()
    names: dict[int, set] = {}
    for k, p in params.items():
        names.setdefault(id(p), set()).add(k)
    return (loss.item(), {k: p.grad.numpy() for k, p in params.items()},
            {k: p.detach().numpy() for k, p in params.items()},
            {k: b.numpy() for k, b in model.named_buffers()}, list(names.values()))


def _run_stage(prog, backend: str, host: dict):
    """The stage's forward, then its backward from d loss = 1: (loss, {name: grad})."""
    be = get_backend(backend)
    fwd_in = prog.fwd.inputs + prog.fwd.consts + prog.fwd.all_params()
    env = {v.name: be.from_numpy(np.array(host[v.name]), v.type.dtype) for v in fwd_in}
    outs = run_program(prog.fwd, be, env)
    saved = {v.name: o for v, o in zip(prog.fwd.outputs[1:], outs[1:])}
    benv = {}
    for v in prog.bwd.inputs + prog.bwd.consts + prog.bwd.all_params():
        if v.name in saved:
            benv[v.name] = saved[v.name]
        elif v.name == "grad.loss":
            benv[v.name] = be.from_numpy(np.array(1.0, dtype=np.float32), "f32")
        else:
            benv[v.name] = env[v.name]
    grads = run_program(prog.bwd, be, benv)
    return (float(be.to_numpy(outs[0])),
            {k: np.asarray(be.to_numpy(g)) for k, g in zip(prog.input_grads, grads)})


CASES = [("llama", "sdpa", ""), ("llama", "eager", ""), ("gpt2", "sdpa", ""),
         ("gpt2", "eager", ""), ("mixtral", "sdpa", "batched_mm"),
         # eager attention is the llama and gpt2 cases'; MoE routing mixtral-sdpa's
         pytest.param("mixtral", "eager", "batched_mm", marks=pytest.mark.slow)]


@pytest.mark.parametrize("family,attn,experts", CASES)
def test_decoder_stage_programs_equal_eager_autograd_on_both_backends(model_file, family, attn,
                                                                      experts):
    args = {"family": family, "attn": attn, **({"experts": experts} if experts else {})}
    cap = trace_model(model_file, args, MB, SEQ)
    assert cap.how == "torch.export"
    ops = cap.graph.ops_used()
    if attn == "sdpa":      # attention stays ONE fused op, with transformers' mask tensor
        assert "attention_masked" in ops
    prog = build_stage_programs(cap, [[l.name for l in cap.graph.layers]])[0]
    if attn == "sdpa":
        assert "attention_masked_bwd" in prog.bwd.ops_used()
    if family == "gpt2":     # gelu_new: 0.5 x (1 + tanh(...)) in plain ops, tanh_backward too
        assert {"layer_norm", "tanh"} <= prog.fwd.ops_used()
        assert "layer_norm_bwd" in prog.bwd.ops_used()

    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (MB, SEQ), generator=g)
    targets = torch.randint(0, VOCAB, (MB, SEQ), generator=g)
    ref_loss, ref_grads, params, bufs, distinct = _eager(model_file, args, tokens, targets)
    host = {**params, **bufs, prog.inputs[0]: tokens.numpy(), "targets": targets.numpy()}
    # every trained tensor (a tied one under one of its names) is one program parameter
    assert set(prog.params) <= set(ref_grads) and set(prog.params) <= set(prog.input_grads)
    assert sorted(len(names & set(prog.params)) for names in distinct) == [1] * len(distinct)
    for backend in ("torch", "numpy"):
        loss, grads = _run_stage(prog, backend, host)
        assert _rel(loss, ref_loss) <= 1e-5, (backend, loss, ref_loss)
        worst = max((_rel(grads[k], ref_grads[k]), k) for k in prog.params)
        assert worst[0] <= 1e-4, (backend, worst)


def test_moe_grouped_mm_experts_lower_to_one_grouped_matmul(model_file):
    """transformers 5's default experts kernel (grouped_mm: sort by expert, histc counts,
    cumsum offsets, the grouped_mm_fallback custom op) captures and lowers: the experts are ONE
    grouped_mm op each, their token order restored by an index_put of the permutation."""
    cap = trace_model(model_file, {"family": "mixtral", "attn": "sdpa"}, MB, SEQ)
    ops = cap.graph.ops_used()
    assert {"grouped_mm", "sort", "histc", "cumsum", "index_put", "index"} <= ops
    n = sum(n.op == "grouped_mm" for n in cap.graph.nodes())
    assert n == 2 * 2          # up and down projection per block


def test_moe_grouped_mm_stage_programs(model_file):
    # transformers bins expert ids with an int histc on the meta device; frontend/stages.py
    # counts them in float for AOTAutograd (its fake CPU kernels have no int histc)
    cap = trace_model(model_file, {"family": "mixtral", "attn": "sdpa"}, MB, SEQ)
    build_stage_programs(cap, [[l.name for l in cap.graph.layers]])
