"""Activation recomputation changes the stage programs, not the losses; the live-tensor meter
counts what the workers hold; the resource model predicts the measured peak."""
import json
from pathlib import Path

import numpy as np
import pytest

from conftest import run_cli

from backends.base import compile_program, run_program
from backends.memory import LiveTensorMeter
from backends.registry import get_backend
from executor.build import BuildDir
from h2ir.graph import Graph, Layer, Node, Value
from h2ir.types import TensorType

TINY = ["--arg", "n_layers=4", "--arg", "dim=64", "--arg", "n_heads=4", "--arg", "ffn=96",
        "--arg", "vocab=256"]

# softmax(Q K^T) V written out (no fused kernel), with dropout on the probabilities: selective
# recomputation must drop the s x s values and re-make the same dropout mask
EAGER = '''
import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.qkv = nn.Linear(d, 3 * d)
        self.o = nn.Linear(d, d)
        self.n1 = nn.LayerNorm(d)
        self.n2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.n1(x)).view(b, s, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-1, -2)) / (d // self.h) ** 0.5
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        att = F.dropout(att.masked_fill(mask, float("-inf")).softmax(-1), 0.1, self.training)
        x = x + self.o((att @ v).transpose(1, 2).reshape(b, s, d))
        return x + self.mlp(self.n2(x))


class Model(nn.Module):
    def __init__(self, vocab=256, d=32, h=4, n=2):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, h) for _ in range(n))
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        x = self.emb(ids)
        for blk in self.blocks:
            x = blk(x)
        return self.head(x)


def build_model():
    return Model()
'''


def _compile(tmp_path: Path, name: str, model: str, args, plan_body: str, batch: str,
             cluster: str = "local") -> Path:
    plan = tmp_path / f"{name}.h2plan"
    plan.write_text(f'model "{model}"\ncluster "{cluster}"\nbatch {batch}\nschedule 1f1b\n'
                    f"{plan_body}")
    b = tmp_path / name
    r = run_cli("h2c", "compile", model, *args, "--plan", str(plan), "-o", str(b))
    assert r.returncode == 0, r.stderr
    return b


def _run(build: Path, steps: int, *extra) -> list[dict]:
    log = build.parent / f"{build.name}.jsonl"
    r = run_cli("h2x", "run", str(build), "--steps", str(steps), "--json-log", str(log), *extra)
    assert r.returncode == 0, r.stderr + r.stdout
    assert "of live tensors, predicted" in r.stdout
    return [json.loads(x) for x in log.read_text().splitlines() if '"loss"' in x]


def _saved_bytes(build: Path, stage: int) -> int:
    """Distinct activation bytes a stage's forward hands its backward per micro-batch."""
    st = BuildDir(build).stage(stage)
    n_out = len(st.sig["outputs"]) - len(st.sig["passthrough"])
    weights = {v.name for v in st.fwd.all_params() + st.fwd.consts}
    return sum(v.type.nbytes for v in st.fwd.outputs[n_out:] if v.name not in weights)


def _two(mode: str, chips="chips=1 tp=1", split=("embed, 0..1", "2..3, head")) -> str:
    return "dp 1\n" + "".join(f"stage chip=cpu-torch {chips} recompute={mode} layers={ls}\n"
                              for ls in split)


def test_recompute_saves_less_and_trains_the_same(tmp_path):
    builds = {m: _compile(tmp_path, m, "examples/llama_tiny.py", TINY, _two(m),
                          "global=8 micro=2 seq=128") for m in ("none", "selective", "full")}
    saved = {m: [_saved_bytes(b, s) for s in range(2)] for m, b in builds.items()}
    for s in range(2):
        assert saved["full"][s] < saved["selective"][s] < saved["none"][s], saved
    # the backward re-makes what the forward no longer saves
    ops = {m: sum(1 for _ in BuildDir(b).stage(0).bwd.nodes()) for m, b in builds.items()}
    assert ops["none"] < ops["selective"] < ops["full"], ops
    logs = {m: _run(b, 3) for m, b in builds.items()}
    for m in ("selective", "full"):
        assert [x["loss"] for x in logs[m]] == [x["loss"] for x in logs["none"]], m
        assert [x["grad_norm"] for x in logs[m]] == [x["grad_norm"] for x in logs["none"]], m
    peak = {m: max(x["peak_memory"]["w0"]["tensors"] for x in logs[m]) for m in logs}
    assert peak["full"] < peak["selective"] < peak["none"], peak
    for m, log in logs.items():          # the resource model's prediction, measured
        for w, mem in log[-1]["peak_memory"].items():
            assert abs(mem["tensors"] / mem["predicted"] - 1) <= 0.15, (m, w, mem)


def _selective_builds(tmp_path, seq: int) -> dict:
    model = tmp_path / "eager.py"
    model.write_text(EAGER)
    return {m: _compile(tmp_path, m, str(model), [], _two(m, split=("embed, 0", "1, head")),
                        f"global=4 micro=2 seq={seq}") for m in ("none", "selective")}


def test_selective_drops_the_attention_core(tmp_path):
    seq = 48
    builds = _selective_builds(tmp_path, seq)

    def quadratic(build):
        st = BuildDir(build).stage(0)
        n_out = len(st.sig["outputs"]) - len(st.sig["passthrough"])
        return [v.name for v in st.fwd.outputs[n_out:] if tuple(v.type.shape[-2:]) == (seq, seq)]
    assert quadratic(builds["none"]), "the eager attention saves s x s values"
    assert quadratic(builds["selective"]) == []


@pytest.mark.slow          # a run of each build; test_recompute_saves_less... runs in make test
def test_selective_keeps_the_dropout_mask(tmp_path):
    builds = _selective_builds(tmp_path, 48)
    none, sel = (_run(builds[m], 2) for m in ("none", "selective"))
    assert [x["loss"] for x in sel] == [x["loss"] for x in none]


def _tp_builds(tmp_path) -> tuple[Path, Path]:
    l4 = "examples/clusters/local4.toml"
    return tuple(_compile(tmp_path, m, "examples/llama_tiny.py", TINY,
                          _two(m, "chips=2 tp=2"), "global=8 micro=2 seq=64", l4)
                 for m in ("none", "full"))


def test_tensor_parallel_full_recompute_does_not_rerun_collectives(tmp_path):
    none, full = _tp_builds(tmp_path)
    comm = lambda b, g: sum(1 for n in getattr(BuildDir(b).stage(0), g).nodes()  # noqa: E731
                            if n.op == "tp_all_reduce")
    assert comm(full, "bwd") == comm(none, "bwd") and comm(full, "fwd") == comm(none, "fwd")


@pytest.mark.slow          # four TP workers per run
def test_tensor_parallel_full_recompute_trains_the_same(tmp_path):
    none, full = _tp_builds(tmp_path)
    a, b = _run(none, 2), _run(full, 2)
    assert [x["loss"] for x in b] == [x["loss"] for x in a]


# ---- the meter ----------------------------------------------------------------------------------

def _chain() -> Graph:
    """y = ((x * 2) + 1) * 3 over f32[256, 256] (256 KiB each): at most two intermediates live."""
    t = TensorType("f32", (256, 256))
    x, a, b, y = Value("x", t), Value("a", t), Value("b", t), Value("y", t)
    g = Graph("chain", inputs=[x], outputs=[y])
    g.layers = [Layer("l", "program", {}, [], [Node("mul", [x, 2.0], {}, [a]),
                                                Node("add", [a, 1.0], {}, [b]),
                                                Node("mul", [b, 3.0], {}, [y])])]
    return g


@pytest.mark.parametrize("backend", ["torch", "numpy"])
def test_meter_follows_a_program_and_counts_views_once(backend):
    be = get_backend(backend)
    g = _chain()
    x = be.from_numpy(np.ones((256, 256), np.float32), "f32")
    meter = LiveTensorMeter(be.storage)
    held = [x, x]                           # the same tensor twice: one storage
    meter.begin(held)
    out = run_program(g, be, {"x": x}, meter=meter)
    kib = 256 * 1024
    # x held; while b is made a is still live (its last use), then a is dropped: x + a + b
    assert meter.peak == 3 * kib
    assert np.allclose(be.to_numpy(out[0]), 9.0)
    assert np.array_equal(be.to_numpy(compile_program(g, be)({"x": x})[0]), be.to_numpy(out[0]))
    view = be.ops["reshape"](x, shape=[65536, 1]) if "reshape" in be.ops else x
    meter.reset_peak()
    assert meter.sample([x, view]) == kib


# ---- memory caps ----------------------------------------------------------------------------

def _capped_cluster(tmp_path: Path, mem_gib: float) -> Path:
    text = Path("examples/clusters/local.toml").read_text()
    text = text.replace("mem_gib     = 8", f"mem_gib     = {mem_gib}\nmem_reserved_gib = 0\n"
                        "mem_fragmentation = 0")
    assert f"mem_gib     = {mem_gib}" in text
    p = tmp_path / "capped.toml"
    p.write_text(text)
    return p


def test_compile_refuses_a_plan_over_the_cap_with_the_numbers(tmp_path):
    cl = _capped_cluster(tmp_path, 0.15)
    plan = tmp_path / "p.h2plan"
    plan.write_text(f'model "examples/llama_tiny.py"\ncluster "{cl}"\nbatch global=8 micro=2 '
                    f"seq=256\nschedule 1f1b\n{_two('none', split=('embed, 0..3', '4..7, head'))}")
    r = run_cli("h2c", "compile", "examples/llama_tiny.py", "--plan", str(plan), "-o",
                str(tmp_path / "b"))
    assert r.returncode == 2, r.stderr
    # located at the stage's line, with the stage's predicted peak and the chip's capacity
    assert "p.h2plan:6:1: error: stage 0 does not fit in memory: needs 184.0 MiB" in r.stderr, \
        r.stderr
    assert "cpu-torch has 153.6 MiB" in r.stderr and "Traceback" not in r.stderr


def test_a_worker_over_its_cap_stops_with_the_numbers(tmp_path):
    from types import SimpleNamespace

    from executor.worker import Worker
    from h2ir.errors import H2Error
    fake = SimpleNamespace(build=SimpleNamespace(path=tmp_path, manifest={"stages": [
        {"memory": {"capacity_bytes": 100 * 2**20, "predicted_bytes": 90 * 2**20}}]}),
        stage_idx=0, wid=3)
    Worker.check_memory_cap(fake, 0, {"tensors": 99 * 2**20, "at": "x.bwd"})      # under: fine
    with pytest.raises(H2Error) as e:
        Worker.check_memory_cap(fake, 4, {"tensors": 120 * 2**20, "at": "x.bwd"})
    msg = str(e.value)
    assert "w3 (stage 0) held 120.0 MiB" in msg and "step 5" in msg and "100.0 MiB" in msg
    assert "predicted 90.0 MiB" in msg


@pytest.mark.slow
def test_plan_auto_under_a_cap_picks_recomputation_and_stays_under_it(tmp_path):
    """0.15 GiB per worker: the 2-stage split without recomputation needs 184 MiB on stage 0
    (test above); --plan auto must recompute somewhere, and the run's peaks stay under the cap."""
    cl = _capped_cluster(tmp_path, 0.15)
    b = tmp_path / "auto"
    r = run_cli("h2c", "compile", "examples/llama_tiny.py", "--cluster", str(cl), "--plan", "auto",
                "--global-batch", "8", "--micro-batch", "2", "--seq-len", "256", "-o", str(b),
                timeout=900)
    assert r.returncode == 0, r.stderr
    plan = (b / "plan.h2plan").read_text()
    assert "recompute=full" in plan or "recompute=selective" in plan or "zero=1" in plan, plan
    log = _run(b, 2)
    cap = 0.15 * 2**30
    for w, mem in log[-1]["peak_memory"].items():
        assert mem["tensors"] <= cap, (w, mem)
