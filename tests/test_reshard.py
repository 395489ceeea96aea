"""Resume under another plan: `h2x reshard A B` lays build A's checkpoint out for build B; B's
next steps equal A's uninterrupted run (same global batch, same samples: the data order does
not depend on the layout)."""
import json
from pathlib import Path

import pytest

from conftest import run_cli

TINY = ["--arg", "n_layers=4", "--arg", "dim=64", "--arg", "n_heads=4", "--arg", "ffn=96",
        "--arg", "vocab=256"]
MOE = ["--arg", "vocab=256", "--arg", "dim=64", "--arg", "ffn=96", "--arg", "n_layers=2"]
RECIPE = ["--optimizer.lr", "3e-3", "--lr_schedule.kind", "cosine", "--lr_schedule.warmup_steps",
          "3", "--lr_schedule.decay_steps", "17", "--training.clip_grad_norm", "1.0"]
# (decay_steps fixed: the first run stops at step 10, and a schedule over training.steps would
# decay over 10 steps there)
FIRST, TOTAL = 10, 20


def _compile(tmp_path: Path, name: str, model: str, args, cluster: str, body: str,
             batch: str) -> Path:
    plan = tmp_path / f"{name}.h2plan"
    plan.write_text(f'model "{model}"\ncluster "{cluster}"\nbatch {batch}\nschedule '
                    f"{'zbv' if 'zbv' in name else '1f1b'}\n{body}")
    b = tmp_path / name
    r = run_cli("h2c", "compile", model, *args, "--plan", str(plan), "-o", str(b))
    assert r.returncode == 0, r.stderr
    return b


def _losses(log: Path) -> dict[int, float]:
    return {x["step"]: x["loss"] for x in map(json.loads, log.read_text().splitlines())
            if "loss" in x}


def resumed_equals_uninterrupted(tmp_path, model, args, cluster_a, plan_a, cluster_b, plan_b,
                                 batch="global=8 micro=2 seq=32"):
    a = _compile(tmp_path, "a", model, args, cluster_a, plan_a, batch)
    b = _compile(tmp_path, "b", model, args, cluster_b, plan_b, batch)
    full = tmp_path / "full.jsonl"
    r = run_cli("h2x", "run", str(a), "--steps", str(TOTAL), *RECIPE, "--json-log", str(full))
    assert r.returncode == 0, r.stderr + r.stdout
    ck = tmp_path / "ck_a"
    r = run_cli("h2x", "run", str(a), "--steps", str(FIRST), *RECIPE, "--checkpoint-every",
                str(FIRST), "--checkpoint-dir", str(ck))
    assert r.returncode == 0, r.stderr + r.stdout
    r = run_cli("h2x", "reshard", str(a), str(b), "--checkpoint-dir", str(ck))
    assert r.returncode == 0, r.stderr + r.stdout
    log = tmp_path / "b.jsonl"
    r = run_cli("h2x", "run", str(b), "--steps", str(TOTAL), *RECIPE, "--resume",
                "--json-log", str(log))
    assert r.returncode == 0, r.stderr + r.stdout
    want, got = _losses(full), _losses(log)
    assert sorted(got) == list(range(FIRST + 1, TOTAL + 1))
    worst = max(abs(got[s] - want[s]) / abs(want[s]) for s in got)
    assert worst <= 1e-5, (worst, got, want)
    print(f"reshard {tmp_path.name}: worst relative difference {worst:.2e}")
    return worst


TWO = """dp 1
stage chip=cpu-torch chips=1 tp=1 layers=embed, 0..1
stage chip=cpu-torch chips=1 tp=1 layers=2..3, head
"""
L4 = "examples/clusters/local4.toml"


def test_two_stages_to_four_stages(tmp_path):
    resumed_equals_uninterrupted(tmp_path, "examples/llama_tiny.py", TINY, "local", TWO, L4, """dp 1
stage chip=cpu-torch chips=1 tp=1 layers=embed, 0
stage chip=cpu-torch chips=1 tp=1 layers=1
stage chip=cpu-torch chips=1 tp=1 layers=2
stage chip=cpu-torch chips=1 tp=1 layers=3, head
""")


@pytest.mark.slow
def test_two_stages_to_dp2(tmp_path):
    resumed_equals_uninterrupted(tmp_path, "examples/llama_tiny.py", TINY, "local", TWO, L4,
                                 TWO.replace("dp 1", "dp 2").replace("chips=1", "chips=2"))


@pytest.mark.slow
def test_two_stages_to_tp2(tmp_path):
    resumed_equals_uninterrupted(tmp_path, "examples/llama_tiny.py", TINY, "local", TWO, L4,
                                 TWO.replace("chips=1 tp=1 layers=embed", "chips=2 tp=2 layers=embed"))


@pytest.mark.slow
def test_two_stages_to_torch_and_numpy(tmp_path):
    resumed_equals_uninterrupted(tmp_path, "examples/llama_tiny.py", TINY, "local", TWO,
                                 "examples/clusters/local-mixed.toml",
                                 TWO.replace("chip=cpu-torch chips=1 tp=1 layers=2",
                                             "chip=cpu-numpy chips=1 tp=1 layers=2"))


MOE_EP2 = """dp 2
stage chip=cpu-torch chips=2 tp=1 ep=2 recompute=none layers=embed, 0
stage chip=cpu-torch chips=2 tp=1 ep=2 recompute=none layers=1, head
moe ep=2 placement=contiguous a2a=flat migration=none capacity=none
"""


@pytest.mark.slow
@pytest.mark.parametrize("target", ["ep1", "ep4"])
def test_moe_ep2_to(tmp_path, target):
    plan_b = {"ep1": MOE_EP2.replace("ep=2", "ep=1"),
              "ep4": """dp 4
stage chip=cpu-torch chips=4 tp=1 ep=4 recompute=none layers=embed, 0, 1, head
moe ep=4 placement=round_robin a2a=flat migration=none capacity=none
"""}[target]
    resumed_equals_uninterrupted(tmp_path, "examples/moe_tiny.py", MOE, L4, MOE_EP2, L4, plan_b)


def test_reshard_refuses_another_model(tmp_path):
    a = _compile(tmp_path, "a", "examples/llama_tiny.py", TINY, "local", TWO,
                 "global=8 micro=2 seq=32")
    b = _compile(tmp_path, "b", "examples/llama_tiny.py", TINY + ["--arg", "ffn=128"], "local",
                 TWO, "global=8 micro=2 seq=32")
    # the builds' manifests are compared before any checkpoint is read: A needs none
    r = run_cli("h2x", "reshard", str(a), str(b))
    assert r.returncode == 2 and "model.args" in r.stderr, r.stderr
