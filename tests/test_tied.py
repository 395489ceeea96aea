"""Tied weights (embedding = LM head) split across stages: one logical parameter, owned by the
first stage that reads it; its gradient is the sum over the stages; the copies never drift."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import ROOT, run_cli
from backends.base import run_program
from backends.registry import get_backend
from frontend.capture import load_model_file, trace_model
from frontend.stages import build_stage_programs
from h2ir.schedule.streams import tied_stage_groups

ARGS = {"n_layers": 2, "vocab": 512, "dim": 64, "n_heads": 4, "ffn": 128, "max_seq": 64, "tie": True}
CLI_ARGS = [a for k, v in ARGS.items() for a in ("--arg", f"{k}={str(v).lower()}")]
MODEL = str(ROOT / "examples/llama_tiny.py")


def test_capture_keeps_one_tied_parameter():
    cap = trace_model(MODEL, ARGS, 1, 16)
    costs = cap.graph.layer_costs()
    (tie,) = costs.ties
    assert (tie.name, tie.owner, tie.users) == ("embed.weight", "embed", ("head",))
    assert tie.nbytes == 512 * 64 * 4
    eager = sum(p.numel() for p in load_model_file(MODEL).build(ARGS).parameters())
    assert costs.total_params == eager            # counted once
    assert tied_stage_groups(costs.ties, [["embed", "block.0"], ["block.1", "head"]]) == {0: (1,)}
    assert tied_stage_groups(costs.ties, [["embed", "block.0", "block.1", "head"]]) == {}


@pytest.mark.parametrize("split", [[4], [2, 2], [1, 2, 1]])
def test_tied_gradient_summed_over_stages_equals_eager_autograd(split):
    mb, seq = 2, 16
    cap = trace_model(MODEL, ARGS, mb, seq)
    names = [l.name for l in cap.graph.layers]
    stage_layers, i = [], 0
    for n in split:
        stage_layers.append(names[i:i + n])
        i += n
    progs = build_stage_programs(cap, stage_layers)
    holders = [p.index for p in progs if "embed.weight" in p.params]
    assert holders == sorted({0, len(split) - 1})     # both ends hold it
    torch.manual_seed(0)
    model = load_model_file(MODEL).build(ARGS)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    bufs = {k: v.detach().clone() for k, v in model.named_buffers()}
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 512, (mb, seq), generator=g)
    targets = torch.randint(0, 512, (mb, seq), generator=g)
    be = get_backend("torch")
    acts, saved = {progs[0].inputs[0]: tokens}, []
    for p in progs:
        env = {**{k: params[k] for k in p.params}, **{k: bufs[k] for k in p.consts}, **acts}
        if p is progs[-1]:
            env["targets"] = targets
        outs = run_program(p.fwd, be, env)
        n = len(p.outputs) - len(p.passthrough)
        saved.append({v.name: o for v, o in zip(p.fwd.outputs[n:], outs[n:])})
        acts = dict(zip([k for k in p.outputs if k not in p.passthrough], outs[:n]))
        acts.update({k: env[k] for k in p.passthrough})
    grads, upstream = {}, {"loss": torch.tensor(1.0)}
    for p, sv in zip(reversed(progs), reversed(saved)):
        env = {**{k: params[k] for k in p.params}, **{k: bufs[k] for k in p.consts}, **sv}
        env.update({f"grad.{k}": upstream[k] for k in p.tangents})
        gmap = dict(zip(p.input_grads, run_program(p.bwd, be, env)))
        for k, v in gmap.items():
            if k in params:
                grads[k] = grads[k] + v if k in grads else v      # the owner's sum
        upstream = {k: v for k, v in gmap.items() if k not in params}
    out = model(tokens)
    torch.nn.functional.cross_entropy(out.reshape(-1, 512), targets.reshape(-1)).backward()
    for k, prm in model.named_parameters():
        ref = prm.grad.numpy()
        err = np.abs(grads[k].numpy() - ref).max() / np.abs(ref).max()
        assert err <= 1e-5, (k, err)


PLAN = """model    "examples/llama_tiny.py"
cluster  "{cluster}"
batch    global=4 micro=2 seq=32
schedule 1f1b
dp       1
stage chip={c0} chips=1 tp=1 layers=embed, 0
stage chip={c1} chips=1 tp=1 layers=1, head
"""


@pytest.mark.parametrize("cluster,c0,c1", [("local", "cpu-torch", "cpu-torch"),
                                            ("local-mixed", "cpu-torch", "cpu-numpy")])
def test_tied_run_equals_eager_and_the_ends_stay_identical(tmp_path, cluster, c0, c1):
    from executor.reference import eager_losses
    plan = tmp_path / "p.h2plan"
    plan.write_text(PLAN.format(cluster=cluster, c0=c0, c1=c1))
    build = tmp_path / "b"
    r = run_cli("h2c", "compile", MODEL, *CLI_ARGS, "--plan", str(plan), "-o", str(build))
    assert r.returncode == 0, r.stderr
    m = json.loads((build / "manifest.json").read_text())
    assert m["stages"][0]["tied"] == {"copies": [], "shared": {"1": ["embed.weight"]}}
    assert m["stages"][1]["tied"] == {"copies": ["embed.weight"], "shared": {}, "owner": 0}
    assert "send_tied_grads -> w0" in (build / "streams/w1.txt").read_text()
    log = tmp_path / "log.jsonl"
    r = run_cli("h2x", "run", str(build), "--steps", "5", "--json-log", str(log),
                "--checkpoint-every", "5")
    assert r.returncode == 0, r.stderr + r.stdout
    got = [json.loads(l)["loss"] for l in log.read_text().splitlines()]
    ref = eager_losses(str(build), 5)
    assert max(abs(a - b) / abs(b) for a, b in zip(got, ref)) <= 1e-5, (got, ref)
    from safetensors.numpy import load_file
    ck = build / "ckpt" / "step_00000005"
    w0, w1 = load_file(str(ck / "w0.safetensors")), load_file(str(ck / "w1.safetensors"))
    assert np.array_equal(w0["param.embed.weight"], w1["param.embed.weight"])   # bit-identical
    assert "exp_avg.embed.weight" in w0 and "exp_avg.embed.weight" not in w1    # one AdamW state
    init = load_file(str(build / "weights/stage0.safetensors"))["embed.weight"]
    assert not np.array_equal(init, w0["param.embed.weight"])                   # it trained
