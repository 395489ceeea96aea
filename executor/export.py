"""`h2x export BUILD -o DIR`: a build's weights (a checkpoint's, or the initial ones) as one
model another tool loads.

The per-worker tensors are merged back into the model's own parameters: pipeline stages joined,
TP shards concatenated along their sharded dim in rank order (a TP-replicated parameter from
rank 0), an EP stage's expert stacks put back in expert order through the placement the
checkpoint recorded (whatever migration did), a tied parameter once (its owner's). The merged
parameters are loaded into the model built from the build's model file; for a transformers
model, its own `save_pretrained` writes the directory (config.json, safetensors with an index
above the shard size, tied weights once, the checkpoint key format transformers reads back),
so `AutoModelForCausalLM.from_pretrained(DIR)` loads it. Any other model file gets
`model.safetensors` under its own parameter names and `h2-export.json` naming the model file.
The whole model is held in host memory while it is written.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import msgpack
import numpy as np

from executor.build import BuildDir
from executor.checkpoint import build_fingerprint, resume_point, step_dir, verify, worker_files
from frontend.pretrained import hf_module
from h2ir.errors import H2Error

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _stage_experts(build: BuildDir, s: int) -> dict[str, str]:
    """An EP stage's expert-stack parameters -> their experts module's path."""
    moe = build.manifest["stages"][s].get("moe") or {}
    return {k: path for path, e in (moe.get("experts") or {}).items() for k in e["params"]}


def _initial_placement(build: BuildDir, s: int) -> dict[str, list[int]]:
    moe = build.manifest["stages"][s].get("moe") or {}
    return {path: list(e["placement"]) for path, e in (moe.get("experts") or {}).items()}


def merged_parameters(build: BuildDir, ckpt: Path | None) -> dict[str, np.ndarray]:
    """Every parameter of the model, whole, from checkpoint directory `ckpt` (None: the build's
    initial weights)."""
    from safetensors.numpy import load_file
    if ckpt is None:
        full: dict[str, np.ndarray] = {}
        for s in range(build.num_stages):
            full.update(load_file(str(build.stage(s).weights)))
        return full
    return merged_tensors(build, ckpt, ("param.",))["param."]


def merged_tensors(build: BuildDir, ckpt: Path, prefixes=("param.", "exp_avg.", "exp_avg_sq."))\
        -> dict[str, dict[str, np.ndarray]]:
    """{prefix: {name: whole tensor}} of a checkpoint's parameters ("param.") and AdamW moments
    ("exp_avg.", "exp_avg_sq."; a tied parameter's only under its owner's name; a ZeRO-1
    stage's joined from its replicas' segments, executor/zero.py)."""
    from safetensors.numpy import load_file
    out: dict[str, dict] = {}
    for prefix in prefixes:
        out[prefix] = {}
    parts: dict[tuple, dict[int, np.ndarray]] = {}      # (prefix, name, "tp"|"ep") -> rank -> shard
    placements: dict[str, list[int]] = {}
    ep_of: dict[str, int] = {}
    sharding: dict[str, dict] = {}
    # ZeRO-1 stages: (prefix, name, tp rank) -> the shape and the replicas' segments of a moment
    zparts: dict[tuple, tuple] = {}

    def place(prefix, k, arr, replica, tp_rank, tp, ep, experts, placed):
        if k in experts:
            if replica < ep:        # the first EP group: every expert once
                parts.setdefault((prefix, k, "ep"), {})[replica % ep] = arr
                placements[k] = [int(e) for e in placed[experts[k]]]
                ep_of[k] = ep
        elif replica == 0 and tp > 1 and (sharding.get(k) or {}).get("dim") is not None:
            parts.setdefault((prefix, k, "tp"), {})[tp_rank] = arr
        elif replica == 0 and tp_rank == 0 and k not in out[prefix]:
            out[prefix][k] = arr    # a tied copy is equal to its owner's

    for w in build.workers:
        wid, replica = w["id"], w["replica"]
        tp_rank, ep = int(w.get("tp_rank", 0)), len(w.get("ep_group") or [wid])
        tensors_f, meta_f = (ckpt / n for n in worker_files(wid))
        tensors = load_file(str(tensors_f))
        meta = msgpack.unpackb(meta_f.read_bytes())
        segments = (meta.get("zero") or {}).get("segments") or {}
        chunks = w.get("chunks")
        for c, s in enumerate(chunks or [w["stage"]]):
            chunk = f"c{c}." if chunks else ""
            st = build.stage(s)
            experts = _stage_experts(build, s)
            placed = meta.get("moe_placement") or _initial_placement(build, s)
            sharding.update(st.sig.get("sharding") or {})
            tp = len(w.get("tp_group") or [0])
            zero = bool(build.manifest["stages"][s].get("zero")) and build.manifest["dp"] > 1
            for prefix in prefixes:
                for k in st.sig["params"]:
                    arr = tensors.get(f"{prefix}{chunk}{k}")
                    if arr is None:
                        if prefix == "param.":
                            raise H2Error(f"checkpoint file has no tensor param.{chunk}{k}",
                                          str(tensors_f))
                        continue    # a tied copy has no moments; a ZeRO-1 shard, some
                    if zero and prefix != "param.":
                        if chunk + k not in segments:
                            raise H2Error(f"checkpoint holds {prefix}{chunk}{k} of a ZeRO-1 "
                                          "stage without its segment in the metadata",
                                          str(meta_f))
                        shape = tensors[f"param.{chunk}{k}"].shape
                        zparts.setdefault((prefix, k, tp_rank), (shape, tp, ep, experts,
                                                                 placed, []))[-1].append(
                            (*segments[chunk + k], arr))
                        continue
                    place(prefix, k, arr, replica, tp_rank, tp, ep, experts, placed)
    for (prefix, k, tp_rank), (shape, tp, ep, experts, placed, segs) in zparts.items():
        # the dp group's segments of one TP rank's moment: whole again, then as replica 0's
        whole = np.zeros(int(np.prod(shape, dtype=np.int64)), dtype=np.float32)
        covered = 0
        for lo, hi, arr in segs:
            whole[lo:hi] = arr
            covered += hi - lo
        if covered != whole.size:
            raise H2Error(f"the checkpoint's ZeRO-1 segments of {prefix}{k} cover {covered} of "
                          f"its {whole.size} elements", str(ckpt))
        place(prefix, k, whole.reshape(shape), 0, tp_rank, tp, ep, experts, placed)
    for (prefix, k, kind), ranks in parts.items():
        if kind == "tp":
            out[prefix][k] = np.concatenate([ranks[r] for r in sorted(ranks)],
                                            axis=sharding[k]["dim"])
            continue
        order, ep = placements[k], ep_of[k]
        per = len(order) // ep
        shape = ranks[0].shape                  # [per * rows of one expert, ...]
        whole = np.empty((len(order), shape[0] // per) + shape[1:], dtype=ranks[0].dtype)
        for r in range(ep):
            whole[order[r * per:(r + 1) * per]] = ranks[r].reshape(per, -1, *shape[1:])
        out[prefix][k] = whole.reshape(-1, *shape[1:])
    return out


def checkpoint_to_export(build: BuildDir, root: Path, step: int | None, out) -> Path | None:
    """The checkpoint directory to export: step `step`, else the newest sound one; verified."""
    fp = build_fingerprint(build.path)
    if step is None:
        return resume_point(root, fp, len(build.workers), out)[1]
    d = step_dir(root, step)
    if not d.is_dir():
        raise H2Error(f"no checkpoint of step {step}", str(d))
    try:
        verify(d, fp, len(build.workers))
    except H2Error:
        raise
    except Exception as e:              # Unusable: a file missing or altered
        raise H2Error(f"checkpoint of step {step} is not usable: {e}", str(d)) from None
    return d


def export(build_path: str, out_dir: str, *, step: int | None = None, initial: bool = False,
           checkpoint_dir: str | None = None, dtype: str = "fp32", max_shard_size: str = "5GB",
           out=print) -> Path:
    import torch

    from frontend.capture import load_model_file
    build = BuildDir(build_path)
    ckpt = None if initial else checkpoint_to_export(
        build, Path(checkpoint_dir) if checkpoint_dir else build.path / "ckpt", step, out)
    weights = merged_parameters(build, ckpt)
    m = build.manifest
    model = load_model_file(m["model"]["path"]).build(m["model"]["args"])
    params = dict(model.named_parameters())                 # tied: once, under its first name
    aliases = dict(model.named_parameters(remove_duplicate=False))
    missing = []
    with torch.no_grad():
        for k, p in params.items():
            names = [n for n, q in aliases.items() if q is p]      # every name of a tied one
            src = next((weights[n] for n in names if n in weights), None)
            if src is None:
                missing.append(k)
                continue
            if tuple(src.shape) != tuple(p.shape):
                raise H2Error(f"merged tensor {k} has shape {list(src.shape)}, the model's is "
                              f"{list(p.shape)}", str(ckpt or build.path))
            p.copy_(torch.from_numpy(np.ascontiguousarray(src)))
    frozen = [k for k in missing if not params[k].requires_grad]
    if set(missing) - set(frozen):
        raise H2Error(f"the build holds no weights for {sorted(set(missing) - set(frozen))[0]}",
                      str(build.path))
    target = Path(out_dir)
    target.mkdir(parents=True, exist_ok=True)
    tdtype = getattr(torch, DTYPES[dtype])
    hf, prefix = hf_module(model)
    where = f"step {ckpt.name.split('_')[-1].lstrip('0') or 0}" if ckpt else "initial weights"
    if hf is not None:
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()       # its own bar: h2x prints one line instead
        hf.to(tdtype).save_pretrained(str(target), max_shard_size=max_shard_size)
        out(f"exported {m['model']['name']} ({where}) as a transformers {type(hf).__name__} to "
            f"{target} ({dtype})")
    else:
        from safetensors.torch import save_file
        sd = {k: p.detach().to(tdtype).contiguous() for k, p in params.items()}
        save_file(sd, str(target / "model.safetensors"))
        (target / "h2-export.json").write_text(json.dumps(
            {"model_file": m["model"]["path"], "args": m["model"]["args"], "dtype": dtype,
             "from": where}, indent=1))
        out(f"exported {m['model']['name']} ({where}) to {target}/model.safetensors ({dtype}; "
            "not a transformers model: its own parameter names)")
    return target


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="h2x export", description="Write a build's weights (a "
                                 "checkpoint, by default the newest sound one) as one model: a "
                                 "transformers directory for a transformers model file.")
    ap.add_argument("build", help="build directory written by `h2c compile`")
    ap.add_argument("-o", "--output", required=True, metavar="DIR")
    ap.add_argument("--step", type=int, help="the checkpoint of this step (default: the newest)")
    ap.add_argument("--initial", action="store_true", help="the build's initial weights")
    ap.add_argument("--checkpoint-dir", metavar="DIR", help="default BUILD/ckpt")
    ap.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    ap.add_argument("--max-shard-size", default="5GB",
                    help="safetensors shard size above which an index is written (default 5GB)")
    a = ap.parse_args(argv)
    if a.initial and a.step is not None:
        ap.error("--initial and --step exclude each other")
    export(a.build, a.output, step=a.step, initial=a.initial, checkpoint_dir=a.checkpoint_dir,
           dtype=a.dtype, max_shard_size=a.max_shard_size)
    return 0
