"""Zero-bubble ZB-H1 (schedule zb1): the backward split into B and W gives the whole backward's
gradients on both backends, the streams round-trip and are timed, and a zb1 run's losses equal
1F1B's."""
import json
from pathlib import Path

import numpy as np
import pytest

from backends.base import run_program
from backends.registry import get_backend
from conftest import ROOT
from executor.launcher import run
from frontend.capture import trace_model
from frontend.compiler import compile_model
from frontend.stages import build_stage_programs, split_backward
from h2ir.schedule.streams import build_streams, compute_order, format_stream, parse_stream

LLAMA = str(ROOT / "examples/llama_tiny.py")
SMALL = {"n_layers": 3, "dim": 64, "n_heads": 4, "ffn": 128, "vocab": 256, "max_seq": 64}


@pytest.mark.parametrize("backend", ["torch", "numpy"])
def test_b_then_w_equals_the_whole_backward(backend):
    cap = trace_model(LLAMA, SMALL, 2, 16)
    progs = build_stage_programs(cap, [["embed", "block.0"], ["block.1"], ["block.2", "head"]])
    be = get_backend(backend)
    rng = np.random.default_rng(0)

    def rand(t):
        if t.dtype == "i64":
            return be.from_numpy(rng.integers(0, 10, size=t.shape).astype(np.int64), "i64")
        return be.from_numpy(rng.standard_normal(t.shape).astype(np.float32), t.dtype)
    for p in progs:
        sp = split_backward(p)
        assert sorted(sp["b_outputs"] + sp["w_outputs"]) == sorted(p.input_grads)
        assert set(sp["w_outputs"]) == set(p.input_grads) & set(p.params)
        env = {v.name: rand(v.type) for v in p.bwd.inputs + p.bwd.consts + p.bwd.all_params()}
        whole = dict(zip(p.input_grads, run_program(p.bwd, be, env)))
        b = run_program(sp["bwd_input"], be, env)
        n = len(sp["b_outputs"])
        w_env = {**env, **dict(zip(sp["stash"], b[n:]))}
        got = dict(zip(sp["b_outputs"], b[:n]))
        got.update(zip(sp["w_outputs"], run_program(sp["bwd_weight"], be, w_env)))
        for k, v in whole.items():
            assert np.array_equal(be.to_numpy(v), be.to_numpy(got[k])), (p.index, k)
        # B holds no parameter-gradient work it does not need: W is not empty where B is not
        if p.index > 0:
            assert 0 < sp["b_flops_fraction"] < 1


def test_zb1_order_and_streams():
    S, m = 4, 6
    for s in range(S):
        order = compute_order("zb1", s, S, m)
        kinds = [k for k, _ in order]
        assert kinds.count("F") == kinds.count("I") == kinds.count("W") == m
        for k, i in order:                  # W of a micro-batch after its I, I after its F
            if k == "W":
                assert order.index(("I", i)) < order.index(("W", i))
            if k == "I":
                assert order.index(("F", i)) < order.index(("I", i))
        # W's run in micro-batch order: gradients accumulate as in 1F1B
        assert [i for k, i in order if k == "W"] == list(range(m))
    streams = build_streams("zb1", S, m)
    for w, instrs in streams.items():
        assert parse_stream(format_stream(instrs)) == instrs


def _plan(tmp: Path, schedule: str) -> str:
    p = tmp / f"{schedule}.h2plan"
    p.write_text(f'model "{LLAMA}"\ncluster "{ROOT / "examples/clusters/local-mixed.toml"}"\n'
                 f"batch global=8 micro=2 seq=32\nschedule {schedule}\n"
                 "stage chip=cpu-torch chips=1 layers=embed, 0\n"
                 "stage chip=cpu-numpy chips=1 layers=1..2, head\n")
    return str(p)


def test_zb1_losses_equal_1f1b_over_20_steps_on_torch_and_numpy(tmp_path):
    losses = {}
    for sch in ("1f1b", "zb1"):
        out = tmp_path / sch
        res = compile_model(LLAMA, model_args=SMALL, plan_arg=_plan(tmp_path, sch),
                            out_dir=str(out), log=lambda *a: None)
        assert res.predicted.step_time_s > 0
        if sch == "zb1":
            m = json.loads((out / "manifest.json").read_text())
            assert all(st["zero_bubble"] for st in m["stages"])
            text = (out / "streams/w1.txt").read_text()
            assert "bwd_input 0" in text and "bwd_weight 3" in text and "\nbwd " not in text
        losses[sch] = run(str(out), steps=20, out=lambda *a: None, predict=False).losses
    rel = max(abs(a - b) / abs(b) for a, b in zip(losses["zb1"], losses["1f1b"]))
    assert len(losses["zb1"]) == 20 and rel <= 1e-6
