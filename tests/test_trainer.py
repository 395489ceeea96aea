"""The training recipe against an eager oracle, and the trainer's guards.

The oracle is single-process PyTorch (executor/reference.py `eager_train`): torch.optim.AdamW with
the same parameter groups, LambdaLR with a warmup + cosine lambda written here (not h2's), and
torch.nn.utils.clip_grad_norm_ at a max-norm that clips most steps. h2x's per-step losses,
global gradient norms, learning rates and held-out losses must equal it."""
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, run_cli

TINY = ["--arg", "n_layers=2", "--arg", "dim=64", "--arg", "n_heads=4", "--arg", "ffn=96",
        "--arg", "vocab=256"]
STEPS, WARMUP, LR, MIN_LR, CLIP = 50, 5, 3e-3, 3e-4, 0.5

RECIPE = f"""
[optimizer]
lr = {LR}
weight_decay = 0.1
[lr_schedule]
kind = "cosine"
warmup_steps = {WARMUP}
min_lr = {MIN_LR}
[training]
clip_grad_norm = {CLIP}
[eval]
data = "{ROOT / 'README.md'}"
every = 25
steps = 1
"""


def oracle_lambda(step: int) -> float:
    """Warmup then cosine to MIN_LR over the remaining steps, written independently of h2."""
    if step < WARMUP:
        return (step + 1) / WARMUP
    p = (step - WARMUP) / (STEPS - WARMUP)
    floor = MIN_LR / LR
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * p))


def _plan(tmp_path, model: str, cluster: str, body: str, batch="global=4 micro=1 seq=32") -> Path:
    p = tmp_path / "p.h2plan"
    p.write_text(f'model "{model}"\ncluster "{cluster}"\nbatch {batch}\n{body}')
    return p


def _rel(a, b) -> float:
    return max(abs(x - y) / max(abs(y), 1e-30) for x, y in zip(a, b))


def oracle_check(tmp_path, model, args, plan, steps=STEPS, tol=1e-5, compile_args=()):
    """Compile, train `steps` with RECIPE, and compare with the eager oracle; returns the worst
    relative differences (loss, grad norm, eval loss)."""
    from executor.build import BuildDir
    from executor.reference import eager_train
    from h2ir.config import build_config
    cfgf = tmp_path / "train.toml"
    cfgf.write_text(RECIPE)
    build = tmp_path / "build"
    r = run_cli("h2c", "compile", model, *args, "--plan", str(plan), *compile_args, "-o",
                str(build))
    assert r.returncode == 0, r.stderr
    log = tmp_path / "log.jsonl"
    r = run_cli("h2x", "run", str(build), "--config", str(cfgf), "--steps", str(steps),
                "--json-log", str(log))
    assert r.returncode == 0, r.stderr + r.stdout
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    got = [x for x in lines if "loss" in x]
    got_eval = [x for x in lines if "eval_loss" in x]
    cfg = build_config(base=BuildDir(str(build)).config(), config_file=str(cfgf))
    ref = eager_train(str(build), steps, config=cfg, lr_lambda=oracle_lambda)
    assert len(got) == steps
    worst = {"loss": _rel([x["loss"] for x in got], ref.losses),
             "grad_norm": _rel([x["grad_norm"] for x in got], ref.grad_norms),
             "lr": _rel([x["lr"] for x in got], ref.lrs),
             "eval": _rel([x["eval_loss"] for x in got_eval], [e for _, e in ref.eval_losses])}
    assert [x["step"] for x in got_eval] == [s for s, _ in ref.eval_losses] == \
        [s for s in (25, 50) if s <= steps] + ([steps] if steps % 25 else [])
    clipped = sum(n > CLIP for n in ref.grad_norms)
    assert clipped >= steps // 2, ("clipping must act on most steps", ref.grad_norms)
    assert all(v <= tol for v in worst.values()), (worst, got[-1], ref.losses[-1])
    assert got[-1]["loss"] < got[0]["loss"]
    print(f"oracle {tmp_path.name}: worst relative difference {worst}; clipped {clipped}/{steps}")
    return worst


TWO_TORCH = """schedule 1f1b
dp 1
stage chip=cpu-torch chips=1 tp=1 layers=embed, 0
stage chip=cpu-torch chips=1 tp=1 layers=1, head
"""


@pytest.mark.slow          # the torch-and-NumPy case below runs in make test
def test_recipe_equals_eager_oracle_two_torch_stages(tmp_path):
    plan = _plan(tmp_path, "examples/llama_tiny.py", "local", TWO_TORCH)
    oracle_check(tmp_path, "examples/llama_tiny.py", TINY, plan)


def test_recipe_equals_eager_oracle_torch_and_numpy(tmp_path):
    plan = _plan(tmp_path, "examples/llama_tiny.py", "examples/clusters/local-mixed.toml",
                 TWO_TORCH.replace("chip=cpu-torch chips=1 tp=1 layers=1",
                                   "chip=cpu-numpy chips=1 tp=1 layers=1"))
    oracle_check(tmp_path, "examples/llama_tiny.py", TINY, plan)


@pytest.mark.slow
def test_recipe_equals_eager_oracle_dp2(tmp_path):
    plan = _plan(tmp_path, "examples/llama_tiny.py", "examples/clusters/local4.toml",
                 TWO_TORCH.replace("dp 1", "dp 2").replace("chips=1", "chips=2"))
    oracle_check(tmp_path, "examples/llama_tiny.py", TINY, plan)


@pytest.mark.slow
def test_recipe_equals_eager_oracle_tp2(tmp_path):
    plan = _plan(tmp_path, "examples/llama_tiny.py", "examples/clusters/local4.toml",
                 TWO_TORCH.replace("chips=1 tp=1 layers=embed", "chips=2 tp=2 layers=embed"))
    oracle_check(tmp_path, "examples/llama_tiny.py", TINY, plan)


@pytest.mark.slow
def test_recipe_equals_eager_oracle_zbv(tmp_path):
    build_args = TINY + ["--arg", "n_layers=4"]
    plan = _plan(tmp_path, "examples/llama_tiny.py", "local", """schedule zbv
dp 1
stage chip=cpu-torch chips=1 tp=1 layers=embed, 0
stage chip=cpu-torch chips=1 tp=1 layers=1
stage chip=cpu-torch chips=1 tp=1 layers=2
stage chip=cpu-torch chips=1 tp=1 layers=3, head
""")
    oracle_check(tmp_path, "examples/llama_tiny.py", build_args, plan)


@pytest.mark.slow
def test_recipe_equals_eager_oracle_moe_ep2(tmp_path):
    args = ["--arg", "vocab=256", "--arg", "dim=64", "--arg", "ffn=96", "--arg", "n_layers=2"]
    plan = _plan(tmp_path, "examples/moe_tiny.py", "examples/clusters/local4.toml", """schedule 1f1b
dp 2
stage chip=cpu-torch chips=2 tp=1 ep=2 recompute=none layers=embed, 0
stage chip=cpu-torch chips=2 tp=1 ep=2 recompute=none layers=1, head
moe ep=2 placement=contiguous a2a=flat migration=none capacity=none
""", batch="global=8 micro=2 seq=32")
    oracle_check(tmp_path, "examples/moe_tiny.py", args, plan)


@pytest.mark.slow
def test_recipe_equals_eager_oracle_transformers_tied(tmp_path):
    pytest.importorskip("transformers")
    model = str(ROOT / "examples/hf/decoders.py")
    args = ["--arg", "family=gpt2", "--arg", "tie=true", "--arg", "vocab=256"]
    from frontend.capture import capture
    names = [l.name for l in capture(model, {"family": "gpt2", "tie": True, "vocab": 256}, 1,
                                     32).layers]
    half = len(names) // 2
    body = "schedule 1f1b\ndp 1\n" + "".join(
        f"stage chip=cpu-torch chips=1 tp=1 layers={', '.join(p)}\n"
        for p in (names[:half], names[half:]))
    oracle_check(tmp_path, model, args, _plan(tmp_path, model, "local", body))


# ---- the guards ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_build(tmp_path_factory):
    d = tmp_path_factory.mktemp("trainer")
    plan = _plan(d, "examples/llama_tiny.py", "local", TWO_TORCH)
    r = run_cli("h2c", "compile", "examples/llama_tiny.py", *TINY, "--plan", str(plan), "-o",
                str(d / "build"))
    assert r.returncode == 0, r.stderr
    return d / "build"


def _log(path) -> list[dict]:
    """The JSON log's lines, strictly: a bare NaN/Infinity (not JSON) fails the test."""
    def bad(c):
        raise AssertionError(f"not valid JSON: {c}")
    return [json.loads(line, parse_constant=bad) for line in Path(path).read_text().splitlines()]


def test_nonfinite_stops_keeps_finite_checkpoints_and_resumes(small_build, tmp_path):
    from executor.checkpoint import complete_steps
    ck = tmp_path / "ck"
    # a sane start, then lr 1e3 from step 3: the run stops with the step and stage named
    r = run_cli("h2x", "run", str(small_build), "--steps", "2", "--checkpoint-every", "1",
                "--checkpoint-dir", str(ck))
    assert r.returncode == 0, r.stderr
    r = run_cli("h2x", "run", str(small_build), "--steps", "12", "--checkpoint-every", "1",
                "--checkpoint-dir", str(ck), "--resume", "--optimizer.lr", "1e3",
                "--json-log", str(tmp_path / "bad.jsonl"))
    assert r.returncode == 2, r.stdout + r.stderr
    assert "not finite" in r.stderr and "nan_policy" in r.stderr and "step " in r.stderr
    assert "Traceback" not in r.stderr
    done = complete_steps(ck)
    bad = [x for x in _log(tmp_path / "bad.jsonl") if "loss" in x]
    stopped = len(bad) + 3           # the step the guard stopped (the log holds those before)
    assert max(done) < stopped
    # every complete checkpoint is finite
    from safetensors.numpy import load_file
    import numpy as np
    for s in done:
        for f in (ck / f"step_{s:08d}").glob("*.safetensors"):
            assert all(np.isfinite(v).all() for v in load_file(str(f)).values()), f
    # --resume takes the newest (finite) one (its weights diverged at lr 1e3 but are finite;
    # skipping lets the run go on)
    r = run_cli("h2x", "run", str(small_build), "--steps", str(max(done) + 2),
                "--checkpoint-dir", str(ck), "--resume", "--training.nan_policy", "skip",
                "--training.max_skipped", "100", "--json-log", str(tmp_path / "ok.jsonl"))
    assert r.returncode == 0, r.stderr
    assert f"(step {max(done)})" in r.stdout
    assert [x["step"] for x in _log(tmp_path / "ok.jsonl")] == [max(done) + 1, max(done) + 2]


def test_skip_policy_counts_skipped_steps(small_build, tmp_path):
    log = tmp_path / "log.jsonl"
    r = run_cli("h2x", "run", str(small_build), "--steps", "6", "--optimizer.lr", "1e3",
                "--training.nan_policy", "skip", "--training.max_skipped", "3",
                "--json-log", str(log))
    lines = [x for x in _log(log) if "loss" in x]
    skipped = [x for x in lines if x["skipped"]]
    assert all(x["loss"] is None or math.isfinite(x["loss"]) for x in lines)
    assert skipped and skipped[-1]["skipped_steps"] == len(skipped)
    assert "SKIPPED" in r.stdout
    if r.returncode != 0:       # three in a row: stopped, saying so
        assert "in a row" in r.stderr and len(skipped) >= 3


def test_lr_and_schedule_change_on_resume(small_build, tmp_path):
    ck = tmp_path / "ck"
    r = run_cli("h2x", "run", str(small_build), "--steps", "4", "--checkpoint-every", "4",
                "--checkpoint-dir", str(ck), "--json-log", str(tmp_path / "a.jsonl"))
    assert r.returncode == 0, r.stderr
    assert {x["lr"] for x in _log(tmp_path / "a.jsonl")} == {1e-3}
    r = run_cli("h2x", "run", str(small_build), "--steps", "10", "--checkpoint-dir", str(ck),
                "--resume", "--optimizer.lr", "5e-4", "--lr_schedule.kind", "linear",
                "--lr_schedule.min_lr", "0", "--json-log", str(tmp_path / "b.jsonl"))
    assert r.returncode == 0, r.stderr
    assert "resuming from" in r.stdout
    b = _log(tmp_path / "b.jsonl")
    assert [x["step"] for x in b] == list(range(5, 11))
    want = [5e-4 * (1 - s / 10) for s in range(4, 10)]        # linear to 0 over 10 steps
    assert _rel([x["lr"] for x in b], want) < 1e-12
    # a field the programs depend on may not change
    r = run_cli("h2x", "run", str(small_build), "--steps", "2", "--batch.seq", "64")
    assert r.returncode == 2 and "batch.seq" in r.stderr and "recompile" in r.stderr


def test_progress_lines_reach_a_pipe_while_the_run_is_live(small_build, tmp_path):
    exe = Path(sys.executable).parent / "h2x"
    p = subprocess.Popen([str(exe), "run", str(small_build), "--steps", "40"], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        for line in p.stdout:
            if line.startswith("step"):
                assert p.poll() is None, "the first step line came only after the run ended"
                break
        else:
            pytest.fail("no step line")
    finally:
        p.kill()
        p.wait()


def test_config_errors_are_located(tmp_path):
    f = tmp_path / "t.toml"
    f.write_text("[training]\nsteps = 10\nclip_grad_norm = -1\n")
    r = run_cli("h2c", "config", "--config", str(f))
    assert r.returncode == 2
    assert r.stderr.startswith(f"{f}:3: error: training.clip_grad_norm: must be ≥ 0")
    f.write_text("[optimiser]\nlr = 1\n")
    r = run_cli("h2c", "config", "--config", str(f))
    assert r.returncode == 2 and "unknown section [optimiser]" in r.stderr and \
        "optimizer" in r.stderr
    r = run_cli("h2c", "config", "--lr_schedule.kind", "cosinus")
    assert r.returncode == 2 and "lr_schedule.kind: expected one of" in r.stderr
    r = run_cli("h2c", "config")
    assert r.returncode == 0 and "clip_grad_norm" in r.stdout and "[program]" in r.stdout


def test_fp16_cluster_is_refused_at_compile(tmp_path):
    cl = (ROOT / "examples/clusters/local.toml").read_text()
    f = tmp_path / "fp16.toml"
    f.write_text(cl.replace('dtype = "fp32"', 'dtype = "fp16"').replace(
        "fp32 = ", "fp16 = 0.2, fp32 = "))
    r = run_cli("h2c", "compile", "examples/llama_tiny.py", *TINY, "--cluster", str(f),
                "--plan", "uniform", "-o", str(tmp_path / "b"))
    assert r.returncode == 2 and "fp16" in r.stderr and str(f) in r.stderr, r.stderr


def test_lr_schedules():
    from h2ir.config import lr_factor
    s = {"kind": "wsd", "warmup_steps": 2, "decay_steps": 4, "min_lr": 0.0}
    got = [lr_factor(s, k, 10, 1.0) for k in range(10)]
    assert got == [0.5, 1, 1, 1, 1, 1, 0.75, 0.5, 0.25, 0.0]
    s = {"kind": "linear", "warmup_steps": 0, "decay_steps": None, "min_lr": 0.1}
    assert lr_factor(s, 0, 10, 1.0) == 1.0 and abs(lr_factor(s, 10, 10, 1.0) - 0.1) < 1e-12


def test_tampered_train_toml_is_a_located_error(small_build, tmp_path):
    import shutil
    b = tmp_path / "b"
    shutil.copytree(small_build, b)
    text = (b / "train.toml").read_text()
    (b / "train.toml").write_text(text.replace("lr = 0.001", 'lr = "fast"'))
    r = run_cli("h2x", "run", str(b), "--steps", "1")
    assert r.returncode == 2
    line = next(i for i, l in enumerate((b / "train.toml").read_text().splitlines(), 1)
                if l.startswith("lr ="))
    assert r.stderr.startswith(f"{b / 'train.toml'}:{line}: error: optimizer.lr: expected a number")


def test_compile_phases_show_live_progress_only_on_a_terminal():
    import io
    from frontend import progress

    class Tty(io.StringIO):
        def isatty(self):
            return True
    tty, pipe = Tty(), io.StringIO()
    progress.set_quiet(False)       # an in-process `h2c plan --json` earlier in this worker sets it
    for stream in (tty, pipe):
        with progress.phase("searching plans", stream=stream, tick_s=0.05):
            time.sleep(0.2)
    assert "searching plans" in tty.getvalue() and pipe.getvalue() == ""
    progress.set_quiet(True)
    try:
        quiet = Tty()
        with progress.phase("searching plans", stream=quiet):
            pass
        assert quiet.getvalue() == ""
    finally:
        progress.set_quiet(False)


def test_tensorboard_scalars(small_build, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    r = run_cli("h2x", "run", str(small_build), "--steps", "3", "--logging.tensorboard",
                str(tmp_path / "tb"), "--training.clip_grad_norm", "1")
    assert r.returncode == 0, r.stderr
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert {"train/loss", "train/lr", "train/grad_norm"} <= set(acc.Tags()["scalars"])
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2, 3]


def test_shipped_training_configs_resolve():
    """examples/train/*.toml are valid, and the demo's (README's first command) has warmup +
    cosine, clipping and a held-out evaluation."""
    from h2ir.config import build_config
    files = sorted((ROOT / "examples/train").glob("*.toml"))
    assert {f.stem for f in files} >= {"llama_tiny", "moe_tiny", "hf_gpt2"}
    for f in files:
        cfg = build_config(config_file=str(f))
        assert (ROOT / cfg.model.file).is_file() and cfg.eval.data
    demo = build_config(config_file=str(ROOT / "examples/train/llama_tiny.toml"))
    assert demo.lr_schedule.kind == "cosine" and demo.lr_schedule.warmup_steps > 0
    assert demo.training.clip_grad_norm > 0 and demo.eval.every > 0
    assert "examples/train/llama_tiny.toml" in (ROOT / "examples/demo.sh").read_text()


def test_document_packing_runs_like_eager(small_build, tmp_path):
    """data.packing = "document": windows inside one document each (the data tests check the
    windows); h2x and the eager reference draw the same ones."""
    import numpy as np
    from executor.build import BuildDir
    from executor.reference import eager_train
    from h2ir.config import build_config
    rng = np.random.default_rng(1)
    parts = []
    for _ in range(200):
        parts += [rng.integers(1, 256, size=int(rng.integers(10, 120))), np.array([0])]
    data = tmp_path / "docs.bin"
    np.concatenate(parts).astype("<u2").tofile(data)
    flags = ["--data", str(data), "--data.packing", "document", "--data.eod_token", "0"]
    r = run_cli("h2x", "run", str(small_build), "--steps", "3", *flags,
                "--json-log", str(tmp_path / "log.jsonl"))
    assert r.returncode == 0, r.stderr
    assert "each inside one document" in r.stdout.splitlines()[0]
    cfg = build_config(base=BuildDir(str(small_build)).config(),
                       overrides=[("data", "packing", "document", ""),
                                  ("data", "eod_token", "0", ""), ("data", "path", str(data), "")])
    ref = eager_train(str(small_build), 3, config=cfg)
    assert _rel([x["loss"] for x in _log(tmp_path / "log.jsonl")], ref.losses) < 1e-5


def test_keep_last_leaves_the_newest_checkpoints(small_build, tmp_path):
    from executor.checkpoint import complete_steps
    ck = tmp_path / "ck"
    r = run_cli("h2x", "run", str(small_build), "--steps", "5", "--checkpoint-every", "1",
                "--checkpoint-dir", str(ck), "--checkpoint.keep_last", "2")
    assert r.returncode == 0, r.stderr
    assert sorted(complete_steps(ck)) == [4, 5]
    assert sorted(p.name for p in ck.glob("step_*")) == ["step_00000004", "step_00000005"]
    r = run_cli("h2x", "run", str(small_build), "--steps", "6", "--checkpoint-dir", str(ck),
                "--resume")
    assert r.returncode == 0 and "(step 5)" in r.stdout, r.stderr
