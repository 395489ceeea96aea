"""Unmodified transformers decoders (examples/hf/decoders.py) through the whole of h2: `h2c ir`,
a 2-stage `h2c compile`, and `h2x run` on the torch and on the NumPy backend, with losses equal
to eager transformers training (same weights, data and AdamW). One fast case runs in `make
test`; every family x attention x backend is a slow test (`make test-slow`)."""
import json
import sys
from pathlib import Path

import pytest

from conftest import ROOT, run_cli

MODEL = str(ROOT / "examples/hf/decoders.py")
sys.path.insert(0, str(ROOT / "examples/hf"))
from decoders import CORE_FAMILIES as FAMILIES, MORE_FAMILIES  # noqa: E402
CLUSTER = {"torch": ("local", "cpu-torch"), "numpy": ("local-numpy", "cpu-numpy")}
STEPS = 5
MB, SEQ, GB = 2, 32, 4


def two_stage_plan(family: str, attn: str, backend: str, extra=()) -> str:
    """A 2-stage plan: the layers split in halves (embed with the first, head with the last)."""
    from frontend.capture import capture
    args = {"family": family, "attn": attn, **dict(extra)}
    names = [l.name for l in capture(MODEL, args, MB, SEQ).layers]
    half = len(names) // 2
    cluster, chip = CLUSTER[backend]
    stages = "".join(f"stage chip={chip} chips=1 tp=1 layers={', '.join(part)}\n"
                     for part in (names[:half], names[half:]))
    return (f'model "{MODEL}"\ncluster "{cluster}"\nbatch global={GB} micro={MB} seq={SEQ}\n'
            f"schedule 1f1b\ndp 1\n{stages}")


def train_and_compare(tmp_path: Path, family: str, attn: str, backend: str, extra=()):
    from executor.reference import eager_losses
    tmp_path.mkdir(parents=True, exist_ok=True)
    cli_args = ["--arg", f"family={family}", "--arg", f"attn={attn}"]
    for k, v in extra:
        cli_args += ["--arg", f"{k}={v}"]
    r = run_cli("h2c", "ir", MODEL, *cli_args, "--summary", "--seq-len", str(SEQ))
    assert r.returncode == 0, r.stderr
    plan = tmp_path / "p.h2plan"
    plan.write_text(two_stage_plan(family, attn, backend, extra))
    build = tmp_path / "build"
    r = run_cli("h2c", "compile", MODEL, *cli_args, "--plan", str(plan), "-o", str(build))
    assert r.returncode == 0, r.stderr
    m = json.loads((build / "manifest.json").read_text())
    assert [s["backend"] for s in m["stages"]] == [backend, backend]
    log = tmp_path / "log.jsonl"
    r = run_cli("h2x", "run", str(build), "--steps", str(STEPS), "--json-log", str(log))
    assert r.returncode == 0, r.stderr + r.stdout
    got = [json.loads(l)["loss"] for l in log.read_text().splitlines()]
    ref = eager_losses(str(build), STEPS)
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, ref))
    assert worst <= 1e-5, (worst, got, ref)
    return worst


@pytest.mark.slow          # ~40 s on 2 cores
def test_llama_gqa_default_attention_trains_on_both_backends(tmp_path):
    for backend in ("torch", "numpy"):
        train_and_compare(tmp_path / backend, "llama", "sdpa", backend)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "numpy"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("family", FAMILIES)
def test_family_trains_like_eager_transformers(tmp_path, family, attn, backend):
    train_and_compare(tmp_path, family, attn, backend)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "numpy"])
@pytest.mark.parametrize("family", sorted(MORE_FAMILIES))
def test_more_families_train_like_eager_transformers(tmp_path, family, backend):
    train_and_compare(tmp_path, family, MORE_FAMILIES[family], backend)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "numpy"])
def test_llama_multi_head_attention(tmp_path, backend):
    train_and_compare(tmp_path, "llama", "eager", backend, extra=[("kv_heads", 4)])


def test_dropout_sites_draw_from_the_programs_seed():
    """p > 0: every dropout site adds its own number to the program's `rng.seed` input."""
    from frontend.capture import trace_model
    from frontend.stages import build_stage_programs
    from h2ir.opset import DROPOUT_SEED_INPUT
    args = {"family": "llama", "attn": "eager", "dropout": 0.1}
    cap = trace_model(MODEL, args, MB, SEQ)
    (prog,) = build_stage_programs(cap, [[l.name for l in cap.graph.layers]])
    assert DROPOUT_SEED_INPUT in [v.name for v in prog.fwd.inputs]
    sites = [n.inputs[1] for n in prog.fwd.nodes() if n.op == "dropout"]
    assert len(sites) == 2                         # attention dropout in each of the 2 blocks
    offsets = [n.attrs["value"] for n in prog.fwd.nodes()
               if n.op == "full" and n.outputs[0].type.shape == (2,)]
    assert len(set(offsets)) == 2                  # distinct per layer
    assert not any(n.op == "dropout" for n in prog.bwd.nodes())   # the backward reuses the mask


@pytest.mark.slow
def test_dropout_masks_are_the_same_on_both_backends(tmp_path):
    runs = {}
    for backend in ("torch", "numpy"):
        for p in (0.1, 0.0):
            d = tmp_path / f"{backend}-{p}"
            d.mkdir()
            plan = d / "p.h2plan"
            plan.write_text(two_stage_plan("llama", "eager", backend, [("dropout", p)]))
            r = run_cli("h2c", "compile", MODEL, "--arg", "family=llama", "--arg", "attn=eager",
                        "--arg", f"dropout={p}", "--plan", str(plan), "-o", str(d / "b"))
            assert r.returncode == 0, r.stderr
            r = run_cli("h2x", "run", str(d / "b"), "--steps", "4", "--json-log", str(d / "l"))
            assert r.returncode == 0, r.stderr + r.stdout
            runs[backend, p] = [json.loads(l)["loss"] for l in (d / "l").read_text().splitlines()]
    t, n = runs["torch", 0.1], runs["numpy", 0.1]
    assert max(abs(a - b) / abs(b) for a, b in zip(t, n)) <= 1e-5, (t, n)
    assert max(abs(a - b) for a, b in zip(t, runs["torch", 0.0])) > 1e-3   # masks really drop


def test_dropout_the_partitioner_moves_into_the_backward():
    """AOTAutograd's partitioner copies Seed-OSS's residual dropouts into the backward graph (its
    `rng.seed` input with them); the stage backward then takes the micro-batch's seed, saved by
    the forward (this was a KeyError). The stage's gradients are checked against a central
    difference of its forward loss along a random direction: the masks are a function of the
    seed, so with the seed fixed the loss is smooth in the weights."""
    import numpy as np
    import torch
    from backends.base import run_program
    from backends.registry import get_backend
    from frontend.capture import trace_model
    from frontend.stages import build_stage_programs
    from h2ir.opset import DROPOUT_SEED_INPUT
    # sdpa: attention dropout too, which lowers in its math form (AOTAutograd records that)
    args = {"family": "seed_oss", "attn": "sdpa", "dropout": 0.3, "layers": 1}
    cap = trace_model(MODEL, args, MB, SEQ)
    (prog,) = build_stage_programs(cap, [[l.name for l in cap.graph.layers]])
    assert DROPOUT_SEED_INPUT in [v.name for v in prog.bwd.inputs]
    be = get_backend("torch")
    torch.manual_seed(0)
    model = cap.model_file.build(args)
    params = {k: v.detach().double().float() for k, v in model.named_parameters()}
    rng = np.random.default_rng(0)
    ids = torch.from_numpy(rng.integers(0, 512, size=(MB, SEQ)))
    base = {prog.inputs[0]: ids, "targets": torch.from_numpy(rng.integers(0, 512, size=(MB, SEQ))),
            DROPOUT_SEED_INPUT: torch.tensor([7, 3], dtype=torch.int64),
            **{k: v.detach() for k, v in model.named_buffers() if k in prog.consts}}

    def forward(p):
        outs = run_program(prog.fwd, be, {**base, **{k: p[k] for k in prog.params}})
        return outs
    outs = forward(params)
    saved = {v.name: o for v, o in zip(prog.fwd.outputs[1:], outs[1:])}
    env = {**base, **{k: params[k] for k in prog.params}, **saved,
           "grad.loss": torch.tensor(1.0)}
    grads = dict(zip(prog.input_grads, run_program(prog.bwd, be, env)))
    direction = {k: torch.randn(params[k].shape, generator=torch.Generator().manual_seed(i))
                 for i, k in enumerate(prog.params)}
    h = 1e-3
    lp = float(forward({k: params[k] + h * direction[k] for k in prog.params})[0])
    lm = float(forward({k: params[k] - h * direction[k] for k in prog.params})[0])
    numeric = (lp - lm) / (2 * h)
    analytic = sum(float((grads[k] * direction[k]).sum()) for k in prog.params if k in grads)
    assert abs(numeric - analytic) <= 2e-2 * abs(analytic), (numeric, analytic)
