"""Unmodified transformers decoders (examples/hf/decoders.py) through the whole of h2: `h2c ir`,
a 2-stage `h2c compile`, and `h2x run` on the torch and on the NumPy backend, with losses equal
to eager transformers training (same weights, data and AdamW). One fast case runs in `make
test`; every family x attention x backend is a slow test (`make test-slow`)."""
import json
from pathlib import Path

import pytest

from conftest import ROOT, run_cli

MODEL = str(ROOT / "examples/hf/decoders.py")
FAMILIES = ["llama", "mistral", "qwen2", "gemma", "phi3", "gpt2", "mixtral", "qwen2_moe"]
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
def test_llama_multi_head_attention(tmp_path, backend):
    train_and_compare(tmp_path, "llama", "eager", backend, extra=[("kv_heads", 4)])
