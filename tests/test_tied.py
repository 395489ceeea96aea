"""Tied weights (embedding = LM head) split across stages: one logical parameter, owned by the
first stage that reads it; its gradient is the sum over the stages; the copies never drift."""
import json

import numpy as np
import pytest

from conftest import ROOT, run_cli
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
    from test_compiler import _pipeline_grads, _rel      # chains the stage programs as h2x does
    cap = trace_model(MODEL, ARGS, 2, 16)
    names = [l.name for l in cap.graph.layers]
    bounds = np.cumsum([0] + split)
    progs = build_stage_programs(cap, [names[a:b] for a, b in zip(bounds, bounds[1:])])
    holders = [p.index for p in progs if "embed.weight" in p.params]
    assert holders == sorted({0, len(split) - 1})     # both ends hold it
    loss, grads, ref, eager = _pipeline_grads(MODEL, ARGS, split)
    assert _rel(loss, ref.detach()) <= 1e-5
    worst = max(_rel(grads[k], eager[k]) for k in eager)
    assert worst <= 1e-5, worst


PLAN = """model    "examples/llama_tiny.py"
cluster  "{cluster}"
batch    global=4 micro=2 seq=32
schedule 1f1b
dp       1
stage chip={c0} chips=1 tp=1 layers=embed, 0
stage chip={c1} chips=1 tp=1 layers=1, head
"""


@pytest.mark.parametrize("cluster,c0,c1", [pytest.param("local", "cpu-torch", "cpu-torch",
                                                         marks=pytest.mark.slow),
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
