"""Weights in and out: a transformers checkpoint as a build's start (`init.from`), and
`h2x export` back to a directory transformers loads."""
import json
import sys
from pathlib import Path

import pytest

from conftest import ROOT, run_cli

pytest.importorskip("transformers")
MODEL = str(ROOT / "examples/hf/decoders.py")
STEPS = 20


def _pretrained(tmp_path, family: str, **kw) -> Path:
    """A tiny transformers model of `family` saved by save_pretrained, bf16 on disk."""
    import torch
    sys.path.insert(0, str(ROOT / "examples/hf"))
    from decoders import build_model
    torch.manual_seed(123)
    lm = build_model(family=family, **kw).lm
    d = tmp_path / f"hf_{family}"
    lm.to(torch.bfloat16).save_pretrained(str(d))
    return d


def _two_stage_plan(tmp_path, args: dict, cluster="local", tp=(1, 1), dp=1, extra="",
                    batch="global=4 micro=2 seq=32", ep="") -> Path:
    from frontend.capture import capture
    names = [l.name for l in capture(MODEL, args, 2, 32).layers]
    half = len(names) // 2
    stages = "".join(f"stage chip=cpu-torch chips={t * dp} tp={t}{ep} layers={', '.join(p)}\n"
                     for p, t in zip((names[:half], names[half:]), tp))
    f = tmp_path / "p.h2plan"
    f.write_text(f'model "{MODEL}"\ncluster "{cluster}"\nbatch {batch}\nschedule 1f1b\ndp {dp}\n'
                 f"{stages}{extra}")
    return f


def round_trip(tmp_path, family: str, plan_kw=None, model_kw=None, run_flags=(),
               read="stage by stage"):
    """init.from a bf16 transformers checkpoint -> STEPS steps equal eager transformers
    training from it (the first loss is transformers' own on that batch) -> h2x export ->
    from_pretrained's logits equal the eager model's after the same steps."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from executor.build import BuildDir
    from executor.reference import eager_train
    model_kw = model_kw or {}
    src = _pretrained(tmp_path, family, **model_kw)
    args = {"family": family, **model_kw}
    plan = _two_stage_plan(tmp_path, args, **(plan_kw or {}))
    cli_args = [a for k, v in args.items() for a in ("--arg", f"{k}={v}")]
    build = tmp_path / "build"
    r = run_cli("h2c", "compile", MODEL, *cli_args, "--plan", str(plan), "--init.from",
                str(src), "-o", str(build))
    assert r.returncode == 0, r.stderr
    # lazily, one stage at a time, where the checkpoint names every parameter as the model
    # does; through transformers' loader where its names need conversions (Mixtral's experts)
    assert f"parameters read {read}" in r.stdout, r.stdout
    log = tmp_path / "log.jsonl"
    r = run_cli("h2x", "run", str(build), "--steps", str(STEPS), "--checkpoint-every",
                str(STEPS), "--json-log", str(log), *run_flags)
    assert r.returncode == 0, r.stderr + r.stdout
    got = [json.loads(x)["loss"] for x in log.read_text().splitlines()]
    ref = eager_train(str(build), STEPS)
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, ref.losses))
    assert worst <= 1e-5, (worst, got, ref.losses)
    migrated = sum(1 for x in log.read_text().splitlines()
                   for layer in (json.loads(x).get("moe") or {}).values() if layer.get("migrated"))
    out = tmp_path / "export"
    r = run_cli("h2x", "export", str(build), "-o", str(out))
    assert r.returncode == 0, r.stderr
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    ids = torch.from_numpy(np.random.default_rng(0).integers(0, 256, size=(2, 32)))
    with torch.no_grad():
        a = hf(input_ids=ids, use_cache=False).logits
        b = ref.model(ids)
    rel = float((a - b).abs().max() / b.abs().max())
    assert rel <= 1e-5, rel
    return worst, rel, migrated


def test_qwen2_from_pretrained_trains_and_exports(tmp_path):
    round_trip(tmp_path, "qwen2")


@pytest.mark.slow
def test_tied_gpt2_round_trip(tmp_path):
    round_trip(tmp_path, "gpt2", model_kw={"tie": True})


@pytest.mark.slow
def test_tp2_round_trip(tmp_path):
    round_trip(tmp_path, "llama", plan_kw={"cluster": "examples/clusters/local4.toml",
                                           "tp": (2, 1)})


@pytest.mark.slow
def test_mixtral_ep2_round_trip_after_migration(tmp_path):
    """Experts moved between the EP ranks during training: the export puts them back in
    expert order (from the checkpoint's placement)."""
    _, _, migrated = round_trip(
        tmp_path, "mixtral", plan_kw={
            "cluster": "examples/clusters/local4.toml", "dp": 2, "ep": " ep=2",
            "batch": "global=8 micro=2 seq=32",
            "extra": "moe ep=2 placement=contiguous a2a=flat migration=periodic(2) "
                     "threshold=1.0 capacity=none\n"}, read="with transformers")
    assert migrated > 0, "no expert moved: the test would not check the reordering"


def test_init_from_errors_name_the_tensor(tmp_path):
    """The weight-reading phase of `h2c compile --init.from` (frontend/pretrained.py, called
    as compile writes the weights): each refusal names the tensor and the directory.
    test_qwen2_from_pretrained_trains_and_exports runs the same phase through h2c."""
    from safetensors.torch import load_file, save_file

    from frontend.capture import load_model_file
    from frontend.pretrained import lazy_weights, load_pretrained
    from h2ir.errors import H2Error
    src = _pretrained(tmp_path, "qwen2")
    sd = load_file(str(src / "model.safetensors"))
    bad = {k: v for k, v in sd.items() if "layers.1.mlp.down_proj" not in k}
    save_file(bad, str(src / "model.safetensors"), metadata={"format": "pt"})
    mf = load_model_file(MODEL)
    args = {"family": "qwen2"}

    def refusal(directory) -> str:         # as compile reads them (compiler._write_weights)
        with pytest.raises(H2Error) as e:
            if lazy_weights(mf, args, str(directory)) is None:
                load_pretrained(mf.build(args), str(directory))
        return str(e.value)
    err = refusal(src)
    assert "down_proj" in err and str(src) in err, err
    assert "init.from" in refusal(tmp_path / "nope")
    # a different width: the shape is named
    (tmp_path / "w").mkdir()
    err = refusal(_pretrained(tmp_path / "w", "qwen2", hidden=32))
    assert "shape" in err, err


def test_init_from_a_sharded_index_is_read_stage_by_stage(tmp_path):
    """A model file's own names in two safetensors shards with an index: read lazily (the
    model built with its parameters on the meta device), every stage's weights equal to the
    checkpoint's, fp16 on disk converted to fp32."""
    import json

    import numpy as np
    import torch
    from safetensors.numpy import load_file
    from safetensors.torch import save_file

    from frontend.capture import load_model_file
    from frontend.pretrained import parameters_on_meta
    args = {"n_layers": 2, "dim": 32, "n_heads": 4, "ffn": 48, "vocab": 64}
    with parameters_on_meta():
        meta = load_model_file("examples/llama_tiny.py").build(args)
    assert all(p.device.type == "meta" for p in meta.parameters())
    assert all(b.device.type == "cpu" for b in meta.buffers())
    g = torch.Generator().manual_seed(1)
    sd = {k: torch.randn(p.shape, generator=g).half() for k, p in meta.named_parameters()}
    names = sorted(sd)
    src = tmp_path / "ckpt"
    src.mkdir()
    shards = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
    for f, ks in shards.items():
        save_file({k: sd[k] for k in ks}, str(src / f))
    (src / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: f for f, ks in shards.items() for k in ks}}))
    cli = [a for k, v in args.items() for a in ("--arg", f"{k}={v}")]
    plan = tmp_path / "p.h2plan"          # a plan file: no layer times to measure first
    plan.write_text('model "examples/llama_tiny.py"\ncluster "local"\nbatch global=4 micro=2 '
                    "seq=16\nschedule 1f1b\ndp 1\n"
                    "stage chip=cpu-torch chips=1 tp=1 layers=embed, 0\n"
                    "stage chip=cpu-torch chips=1 tp=1 layers=1, head\n")
    r = run_cli("h2c", "compile", "examples/llama_tiny.py", *cli, "--plan", str(plan),
                "--init.from", str(src), "-o", str(tmp_path / "b"))
    assert r.returncode == 0, r.stderr
    assert "parameters read stage by stage" in r.stdout
    got = {}
    for f in (tmp_path / "b" / "weights").glob("stage?.safetensors"):
        got.update(load_file(str(f)))
    assert sorted(got) == names
    for k in names:
        assert got[k].dtype == np.float32
        assert np.array_equal(got[k], sd[k].float().numpy()), k
