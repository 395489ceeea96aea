"""h2's CUDA path: fused attention, bf16 training throughput (MFU) against eager PyTorch, and a
bf16 pipeline's losses against an fp32 one.

Parts (`--part`), each printing its results and adding them to the `--json` file:
- attn: ATen's fused attention kernels (backends/torch/ops.py, 'fused') against the math form,
  forward and backward, f32 and bf16, causal, masked, grouped-query heads: max errors.
- perf: a llama-style model (examples/llama_tiny.py; `--config 1b`: d=2048, 18 layers, 16 heads
  of 128, FFN 5632, vocab 32000, 1.06 B parameters), bf16 with f32 master weights, seq 2048,
  compiled by `h2c compile` with a fixed plan of `--stages` stages and run by `h2x run`; stages
  share one GPU through `--device-map` (w0+w1=cuda:0) when there is one. Alternated, round by
  round, with an eager step of the same model in one process: f32 parameters, bf16 autocast,
  SDPA, fused AdamW, the same micro-batches. Step time: median of steps after the warm-up ones.
- curve: a ~134 M model (d=768, 12 layers, seq 512), 2 stages, 50 steps in bf16 and in fp32
  from the same weights and data: both loss curves and their max relative difference.

MFU = model FLOPs per step / step time / peak, model FLOPs per token = 6 N + 12 L d s (N: the
parameters of matrix multiplies, embedding table excluded; attention counted over the full
s x s, causal or not, as PaLM does). Peaks: H200 dense bf16 989 TFLOP/s (datasheet) and a
measured matmul ceiling (`--ceiling-tflops`, 790 by default).

    python3 bench/bench_gpu.py --part perf --stages 1 --json OUT.json          # on the GPU
    .venv/bin/python bench/bench_gpu.py --device cpu --tiny --part all         # smoke test
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODEL = ROOT / "examples/llama_tiny.py"
PEAK_TFLOPS = 989.0            # H200 SXM dense bf16, datasheet
CEILING_TFLOPS = 790.0         # a bf16 matmul ceiling measured on the H200

# model, micro-batch, micro-batches per step, seq, steps (the first `warmup` not timed)
CONFIGS = {
    "1b": dict(model=dict(vocab=32000, dim=2048, n_layers=18, n_heads=16, ffn=5632),
               micro=4, m=4, seq=2048, steps=8, warmup=3),
    "curve": dict(model=dict(vocab=32000, dim=768, n_layers=12, n_heads=12, ffn=2048),
                  micro=8, m=2, seq=512, steps=50, warmup=0),
    "tiny": dict(model=dict(vocab=512, dim=64, n_layers=4, n_heads=4, ffn=128),
                 micro=2, m=2, seq=64, steps=4, warmup=1),
    "tiny-curve": dict(model=dict(vocab=512, dim=64, n_layers=4, n_heads=4, ffn=128),
                       micro=2, m=2, seq=64, steps=10, warmup=0),
}

CLUSTER = """# one GPU host for bench/bench_gpu.py: H100 figures with the H200's memory
name  = "bench-gpu"
dtype = "{dtype}"

[chips.gpu]
base        = "H100-SXM"
backend     = "cuda"
mem_gib     = 139

[[nodes]]
chip           = "gpu"
count          = 1
chips_per_node = 2
intra_bw_gbs   = 450
nics_per_node  = 1
nic_gbps       = 200
"""


def log(msg: str) -> None:
    print(msg, flush=True)


# ---- model FLOPs -----------------------------------------------------------------------------

def model_numbers(cfg: dict) -> dict:
    a = cfg["model"]
    d, L, f, V, s = a["dim"], a["n_layers"], a["ffn"], a["vocab"], cfg["seq"]
    matmul = L * (4 * d * d + 3 * d * f) + d * V          # blocks and the LM head
    params = matmul + V * d + L * 2 * d + d               # + embedding, norms
    tokens = cfg["micro"] * cfg["m"] * s
    per_token = 6 * matmul + 12 * L * d * s
    return {"params": params, "matmul_params": matmul, "tokens_per_step": tokens,
            "flops_per_token": per_token, "flops_per_step": per_token * tokens,
            "formula": "6*N_matmul + 12*L*d*s per token (full s x s attention)"}


def mfu(flops: float, step_s: float) -> dict:
    achieved = flops / step_s / 1e12
    return {"tflops": achieved, "mfu_datasheet": achieved / PEAK_TFLOPS,
            "mfu_ceiling": achieved / CEILING_TFLOPS}


# ---- attention self-check --------------------------------------------------------------------

def attention_self_check(device: str) -> dict:
    """The torch backend's fused attention ('fused' form) against its math form on `device`,
    forward (output, logsumexp) and backward (dq, dk, dv); errors relative to the largest
    |value| of the math result, from the same inputs."""
    import torch
    from backends.torch import ops
    dev = torch.device(device)
    fused, math_ = ops.ATTENTION_FORMS["fused"], ops.ATTENTION_FORMS["math"]
    cases = []
    for dtype in (torch.float32, torch.bfloat16):
        for name, h, h_kv, s, d, causal, masked in (
                ("causal", 8, 8, 256, 64, True, False), ("plain", 8, 8, 200, 128, False, False),
                ("gqa-causal", 8, 2, 256, 64, True, False), ("masked", 4, 4, 128, 64, False, True),
                ("masked-causal-gqa", 4, 2, 96, 64, True, True)):
            g = torch.Generator(device="cpu").manual_seed(0)
            mk = lambda *shape: torch.randn(*shape, generator=g).to(dev, dtype)   # noqa: E731
            q, k, v = mk(2, h, s, d), mk(2, h_kv, s, d), mk(2, h_kv, s, d)
            grad = mk(2, h, s, d)
            mask = (torch.rand(2, 1, s, s, generator=g) > 0.2).to(dev) if masked else None
            if mask is not None:
                mask[..., 0] = True          # every row attends somewhere
            kind = ops.fused_attention_kind(q, k, v, mask, causal)
            bwd_kind = ops.fused_attention_bwd_kind(q, k, v, mask, causal)
            res = {}
            for form, (fwd, bwd, mfwd, mbwd) in (("fused", fused), ("math", math_)):
                out, lse = mfwd(q, k, v, mask, causal) if masked else fwd(q, k, v, causal)
                # each backward from the math forward's saved values: the same inputs
                res[form] = (out, lse)
            out, lse = res["math"]
            grads = {form: (mbwd(grad, q, k, v, out, lse, mask, causal) if masked
                            else bwd(grad, q, k, v, out, lse, causal))
                     for form, (fwd, bwd, mfwd, mbwd) in (("fused", fused), ("math", math_))}

            def err(a, b):
                return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))
            row = {"dtype": str(dtype).replace("torch.", ""), "case": name, "kernel": kind or "math",
                   "bwd_kernel": bwd_kind or "math",
                   "out": err(res["fused"][0], res["math"][0]),
                   "lse": err(res["fused"][1], res["math"][1]),
                   **{n: err(a, b) for n, a, b in zip(("dq", "dk", "dv"), grads["fused"],
                                                      grads["math"])}}
            tol = 1e-4 if dtype == torch.float32 else 3e-2
            row["ok"] = all(row[n] <= tol for n in ("out", "lse", "dq", "dk", "dv"))
            cases.append(row)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    failed = sorted(ops._FUSED_FAILED)
    log(f"attention self-check on {device} (fused vs math; max |err| / max |math|):")
    log(f"  {'dtype':<9} {'case':<18} {'fwd/bwd kernel':<20} {'out':>8} {'lse':>8} {'dq':>8} {'dk':>8} "
        f"{'dv':>8}  ok")
    for r in cases:
        log(f"  {r['dtype']:<9} {r['case']:<18} {r['kernel'] + '/' + r['bwd_kernel']:<20} " +
            " ".join(f"{r[n]:8.1e}" for n in ("out", "lse", "dq", "dk", "dv")) +
            f"  {'yes' if r['ok'] else 'NO'}")
    if failed:
        log(f"  kernels that raised and fell back to math: {', '.join(failed)}")
    return {"device": device, "cases": cases, "fell_back": failed,
            "ok": all(r["ok"] for r in cases) and not failed}


# ---- h2: compile and run ---------------------------------------------------------------------

def _py() -> list[str]:
    return [sys.executable]


def write_plan(path: Path, cfg: dict, stages: int, cluster: Path) -> None:
    L = cfg["model"]["n_layers"]
    parts = [[str(i) for i in range(L)]] if stages == 1 else \
        [[str(i) for i in range(L // 2)], [str(i) for i in range(L // 2, L)]]
    parts[0].insert(0, "embed")
    parts[-1].append("head")
    lines = [f'model    "{MODEL}"', f'cluster  "{cluster}"',
             f"batch    global={cfg['micro'] * cfg['m']} micro={cfg['micro']} seq={cfg['seq']}",
             "schedule 1f1b", "dp       1",
             # NCCL refuses two ranks on one GPU: stage boundaries go through DiComm (host shm)
             "comm     dicomm"]
    for p in parts:
        lines.append(f"stage chip=gpu chips=1 tp=1 layers={_layer_range(p)}")
    path.write_text("\n".join(lines) + "\n")


def _layer_range(p: list[str]) -> str:
    nums = [x for x in p if x.isdigit()]
    mid = [f"{nums[0]}..{nums[-1]}"] if nums else []
    return ", ".join(([p[0]] if p[0] == "embed" else []) + mid + (["head"] if p[-1] == "head" else []))


def compile_build(work: Path, cfg: dict, stages: int, dtype: str, name: str) -> tuple[Path, float]:
    cluster = work / f"cluster-{dtype}.toml"
    cluster.write_text(CLUSTER.format(dtype=dtype))
    plan = work / f"{name}.h2plan"
    write_plan(plan, cfg, stages, cluster)
    out = work / name
    args = [f"--arg={k}={v}" for k, v in cfg["model"].items()] + [f"--arg=max_seq={cfg['seq']}"]
    cmd = _py() + ["-m", "frontend.cli", "compile", str(MODEL), *args, "--plan", str(plan),
                   "-o", str(out)]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    secs = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"h2c compile failed ({name}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    log(f"  compiled {name} ({stages} stage(s), {dtype}) in {secs:.1f} s")
    return out, secs


def run_h2(build: Path, cfg: dict, device: str, stages: int, tag: str, steps: int | None = None,
           lr: float | None = None) -> dict:
    steps = steps or cfg["steps"]
    jl = build.parent / f"{tag}.jsonl"
    jl.unlink(missing_ok=True)
    cmd = _py() + ["-m", "executor.cli", "run", str(build), "--steps", str(steps),
                   "--json-log", str(jl), "--timeout", "300"]
    if device == "cpu":
        cmd += ["--device", "cpu"]
    elif stages > 1:
        cmd += ["--device-map", "+".join(f"w{i}" for i in range(stages)) + "=cuda:0"]
    else:
        cmd += ["--device", "cuda:0"]
    if lr is not None:
        cmd += ["--optimizer.lr", str(lr)]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"h2x run failed ({tag}):\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}")
    rows = [json.loads(x) for x in jl.read_text().splitlines() if x.strip()]
    rows = [x for x in rows if "step_s" in x]
    timed = [x["step_s"] for x in rows[cfg["warmup"]:]] or [x["step_s"] for x in rows]
    return {"tag": tag, "step_s": statistics.median(timed), "steps_s": [x["step_s"] for x in rows],
            "losses": [x["loss"] for x in rows], "wall_s": wall}


# ---- eager PyTorch ---------------------------------------------------------------------------

def eager_main(cfg_name: str, device: str, steps: int) -> None:
    """One eager run in this process: prints a JSON line with the step times."""
    import torch
    import torch.nn.functional as F
    from examples.llama_tiny import build_model
    cfg = CONFIGS[cfg_name]
    torch.manual_seed(0)
    dev = torch.device(device)
    model = build_model(**cfg["model"], max_seq=cfg["seq"]).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=dev.type == "cuda")
    g = torch.Generator(device="cpu").manual_seed(1)
    V, mb, s, m = cfg["model"]["vocab"], cfg["micro"], cfg["seq"], cfg["m"]
    batches = [torch.randint(0, V, (mb, s + 1), generator=g).to(dev) for _ in range(m)]
    times, losses = [], []
    for _ in range(steps):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        total = 0.0
        for b in batches:
            x, y = b[:, :-1], b[:, 1:]
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                logits = model(x)
            loss = F.cross_entropy(logits.float().reshape(-1, V), y.reshape(-1)) / m
            loss.backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(total))          # syncs, as h2x's loss does
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None
    print(json.dumps({"steps_s": times, "losses": losses, "peak_bytes": peak}), flush=True)


def run_eager(cfg_name: str, device: str, tag: str) -> dict:
    cfg = CONFIGS[cfg_name]
    cmd = _py() + [str(Path(__file__).resolve()), "--eager-worker", "--config", cfg_name,
                   "--device", device, "--steps", str(cfg["steps"])]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"eager run failed ({tag}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    d = json.loads(r.stdout.strip().splitlines()[-1])
    timed = d["steps_s"][cfg["warmup"]:] or d["steps_s"]
    return {"tag": tag, "step_s": statistics.median(timed), **d, "wall_s": wall}


# ---- parts -----------------------------------------------------------------------------------

def part_perf(a, work: Path) -> dict:
    cfg = CONFIGS[a.config]
    nums = model_numbers(cfg)
    log(f"perf: {a.config} model, {nums['params'] / 1e9:.3f} B parameters "
        f"({nums['matmul_params'] / 1e9:.3f} B in matmuls), {cfg['m']} x {cfg['micro']} x "
        f"{cfg['seq']} tokens per step, {a.stages} stage(s), bf16, device {a.device}")
    build, csecs = compile_build(work, cfg, a.stages, "bf16", f"perf{a.stages}")
    h2, eager = [], []
    for r in range(a.rounds):
        h2.append(run_h2(build, cfg, a.device, a.stages, f"h2-s{a.stages}-r{r}"))
        if not a.no_eager:
            eager.append(run_eager(a.config, a.device, f"eager-r{r}"))
        line = f"  round {r}: h2 {h2[-1]['step_s'] * 1e3:.1f} ms/step (wall {h2[-1]['wall_s']:.0f} s)"
        if eager:
            line += (f", eager {eager[-1]['step_s'] * 1e3:.1f} ms/step (wall "
                     f"{eager[-1]['wall_s']:.0f} s), eager/h2 = "
                     f"{eager[-1]['step_s'] / h2[-1]['step_s']:.3f}")
        log(line)
    res = {"config": a.config, "stages": a.stages, "device": a.device, "model": nums,
           "compile_s": csecs, "h2": h2, "eager": eager}
    h2_s = statistics.median(x["step_s"] for x in h2)
    res["h2_step_s"] = h2_s
    res["h2_mfu"] = mfu(nums["flops_per_step"], h2_s)
    log(f"  h2 ({a.stages} stage(s)): {h2_s * 1e3:.1f} ms/step, "
        f"{nums['tokens_per_step'] / h2_s:,.0f} tokens/s, {res['h2_mfu']['tflops']:.1f} TFLOP/s: "
        f"MFU {100 * res['h2_mfu']['mfu_datasheet']:.1f} % of {PEAK_TFLOPS:.0f} (datasheet), "
        f"{100 * res['h2_mfu']['mfu_ceiling']:.1f} % of {CEILING_TFLOPS:.0f} (matmul ceiling)")
    if eager:
        e_s = statistics.median(x["step_s"] for x in eager)
        ratios = [e["step_s"] / h["step_s"] for e, h in zip(eager, h2)]
        res.update(eager_step_s=e_s, eager_mfu=mfu(nums["flops_per_step"], e_s),
                   ratio_rounds=ratios, ratio=e_s / h2_s)
        log(f"  eager: {e_s * 1e3:.1f} ms/step, MFU {100 * res['eager_mfu']['mfu_datasheet']:.1f} %"
            f" (datasheet); h2 speed / eager = {res['ratio']:.3f} (rounds: "
            f"{', '.join(f'{x:.3f}' for x in ratios)}; spread {max(ratios) - min(ratios):.3f})")
    return res


def part_curve(a, work: Path) -> dict:
    name = "tiny-curve" if a.tiny else "curve"
    cfg = CONFIGS[name]
    nums = model_numbers(cfg)
    log(f"curve: {name} model, {nums['params'] / 1e6:.0f} M parameters, 2 stages, "
        f"{cfg['steps']} steps, bf16 vs fp32, device {a.device}")
    runs = {}
    for dtype in ("bf16", "fp32"):
        build, _ = compile_build(work, cfg, 2, dtype, f"curve-{dtype}")
        runs[dtype] = run_h2(build, cfg, a.device, 2, f"curve-{dtype}", lr=3e-4)
    bf, fp = runs["bf16"]["losses"], runs["fp32"]["losses"]
    rel = [abs(x - y) / abs(y) for x, y in zip(bf, fp)]
    log(f"  {'step':>4} {'bf16':>9} {'fp32':>9} {'rel diff':>9}")
    for i, (x, y, r) in enumerate(zip(bf, fp, rel)):
        log(f"  {i + 1:>4} {x:9.4f} {y:9.4f} {r:9.2e}")
    res = {"config": name, "bf16": runs["bf16"], "fp32": runs["fp32"], "max_rel_diff": max(rel),
           "tolerance": 3e-2, "ok": max(rel) <= 3e-2}
    log(f"  max relative difference {max(rel):.2e} (bf16 tolerance 3e-2: "
        f"{'within' if res['ok'] else 'OUTSIDE'}); step time bf16 "
        f"{runs['bf16']['step_s'] * 1e3:.1f} ms, fp32 {runs['fp32']['step_s'] * 1e3:.1f} ms")
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=["attn", "perf", "curve", "all"], default="all")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tiny", action="store_true", help="tiny configs (a CPU smoke test)")
    ap.add_argument("--config", default=None, help="perf model config (default 1b; tiny)")
    ap.add_argument("--stages", type=int, default=1, choices=[1, 2])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--no-eager", action="store_true")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--ceiling-tflops", type=float, default=None)
    ap.add_argument("--workdir", default=None, help="where builds go (default: a temp dir)")
    ap.add_argument("--json", default=None, help="append this part's results to FILE (a JSON "
                    "object keyed by part)")
    ap.add_argument("--eager-worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.config = a.config or ("tiny" if a.tiny else "1b")
    if a.eager_worker:
        eager_main(a.config, a.device, a.steps or CONFIGS[a.config]["steps"])
        return 0
    global CEILING_TFLOPS
    CEILING_TFLOPS = a.ceiling_tflops or CEILING_TFLOPS
    if a.steps:
        CONFIGS[a.config]["steps"] = a.steps
    work = Path(a.workdir) if a.workdir else Path(tempfile.mkdtemp(prefix="h2-bench-gpu-"))
    work.mkdir(parents=True, exist_ok=True)
    results = {}
    if a.part in ("attn", "all"):
        results["attn"] = attention_self_check(a.device)
    if a.part in ("perf", "all"):
        results[f"perf{a.stages}"] = part_perf(a, work)
    if a.part in ("curve", "all"):
        results["curve"] = part_curve(a, work)
    if a.json:
        p = Path(a.json)
        old = json.loads(p.read_text()) if p.exists() and p.stat().st_size else {}
        old.update(results)
        p.write_text(json.dumps(old, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
