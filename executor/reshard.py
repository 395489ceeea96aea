"""`h2x reshard OLD_BUILD NEW_BUILD`: a checkpoint written under one plan, laid out for another.

A cluster changes (a host lost, a chip type added), so the model is compiled again under a new
plan — another stage split, dp, tp, ep, schedule, chip types or backends. The old build's
newest sound checkpoint (or `--step N`) is merged into whole tensors (executor/export.py
`merged_tensors`: parameters and both AdamW moments, TP shards concatenated, experts in expert
order, a ZeRO-1 stage's moments joined from its replicas' segments) and cut again the way the
new build's workers hold them: each stage's parameters, TP shards by the new stage's sharding,
an EP rank's experts by the new build's placement, a tied parameter's moments at its new owner,
a ZeRO-1 replica's segments of the moments (executor/zero.py). The step, the optimizer step count and the NaN guard's
count carry over; the data position is the step, and the data order does not depend on the
layout (executor/data.py: one global sample index), so the resumed run trains on the samples
the old one would have. Expert load averages start again (they steer migration, not the math).

The result is a COMPLETE checkpoint of the new build (its fingerprint), in its checkpoint
directory: `h2x run NEW_BUILD --resume` continues from it. Both builds must be of the same
model (file content and arguments), global batch, sequence length and seed. torch.distributed's
checkpoint module is not used: h2's checkpoints are per-worker safetensors with per-file digests,
and the resharding is an offline rewrite, not a collective load.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import msgpack
import numpy as np

from executor.build import BuildDir
from executor.checkpoint import (_durable_write, build_fingerprint, invalidate, mark_complete,
                                 run_identity, step_dir, worker_files, write_safetensors)
from executor.export import checkpoint_to_export, merged_tensors
from executor.rundir import RunLock
from executor.zero import segments as zero_segments
from h2ir.errors import H2Error

MUST_MATCH = (("model", "sha256"), ("model", "args"), ("global_batch",), ("seq_len",), ("seed",))


def _field(m: dict, path: tuple):
    for k in path:
        m = (m or {}).get(k)
    return m


def _aliases(build: BuildDir) -> dict[str, list[str]]:
    """Each parameter name -> every name of the same (tied) parameter, from the model built on
    the meta device (no weights allocated)."""
    import torch

    from frontend.capture import load_model_file
    m = build.manifest
    with torch.device("meta"):
        model = load_model_file(m["model"]["path"]).build(m["model"]["args"])
    groups: dict[int, list[str]] = {}
    for k, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(k)
    return {k: names for names in groups.values() for k in names}


def _whole(table: dict, k: str, aliases: dict, what: str, where: str) -> np.ndarray:
    for n in [k] + aliases.get(k, []):
        if n in table:
            return table[n]
    raise H2Error(f"the checkpoint has no {what} for {k}", where,
                  hint="are both builds of the same model?")


def _cut(arr: np.ndarray, sharding: dict | None, tp: int, rank: int) -> np.ndarray:
    """TP rank `rank`'s slice of a whole tensor (frontend/tensor_parallel.py `shard_weight`)."""
    if tp == 1 or not sharding or sharding.get("dim") is None:
        return arr
    d = sharding["dim"]
    n = arr.shape[d] // tp
    index = [slice(None)] * arr.ndim
    index[d] = slice(rank * n, (rank + 1) * n)
    return np.ascontiguousarray(arr[tuple(index)])


def reshard(old_path: str, new_path: str, *, step: int | None = None,
            old_checkpoint_dir: str | None = None, new_checkpoint_dir: str | None = None,
            out=print) -> Path:
    old, new = BuildDir(old_path), BuildDir(new_path)
    for path in MUST_MATCH:
        a, b = _field(old.manifest, path), _field(new.manifest, path)
        if a != b:
            name = ".".join(path)
            raise H2Error(f"the builds differ in {name} ({a!r} against {b!r}): a checkpoint "
                          "carries over only to a build of the same model, global batch, "
                          "sequence length and seed", str(new.path / "manifest.json"))
    src = checkpoint_to_export(old, Path(old_checkpoint_dir) if old_checkpoint_dir
                               else old.path / "ckpt", step, out)
    whole = merged_tensors(old, src)
    meta0 = msgpack.unpackb((src / worker_files(0)[1]).read_bytes())
    aliases = _aliases(new)
    root = Path(new_checkpoint_dir) if new_checkpoint_dir else new.path / "ckpt"
    # no run of the new build, nor any run on the target directory, is writing checkpoints
    with RunLock(new.path, root, writes=True, out=out):
        return _write(old, new, src, whole, meta0, aliases, root, new_checkpoint_dir, out)


def _write(old, new, src, whole, meta0, aliases, root: Path, named_root, out) -> Path:
    at, opt_steps = int(meta0["step"]), int(meta0["opt_steps"])
    d = step_dir(root, at)
    d.mkdir(parents=True, exist_ok=True)
    invalidate(d)
    reports = {}
    run = run_identity(build_fingerprint(new.path), src)   # the old checkpoint's lineage
    for w in new.workers:
        wid = w["id"]
        tp_rank, tp = int(w.get("tp_rank", 0)), len(w.get("tp_group") or [wid])
        ep, ep_rank = len(w.get("ep_group") or [wid]), int(w.get("ep_rank", 0))
        chunks = w.get("chunks")
        tensors, placement, zero = {}, {}, None
        for c, s in enumerate(chunks or [w["stage"]]):
            chunk = f"c{c}." if chunks else ""
            st = new.stage(s)
            meta_s = new.manifest["stages"][s]
            sharding = st.sig.get("sharding") or {}
            copies = set((meta_s.get("tied") or {}).get("copies", []))
            experts = {k: path for path, e in ((meta_s.get("moe") or {}).get("experts") or {})
                       .items() for k in e["params"]}
            orders = {path: list(e["placement"]) for path, e in
                      ((meta_s.get("moe") or {}).get("experts") or {}).items()}
            placement.update(orders)

            def cut(prefix, k):
                arr = _whole(whole[prefix], k, aliases, prefix.rstrip("."), str(src))
                if k in experts:
                    order = orders[experts[k]]
                    per = len(order) // ep
                    arr = arr[order[ep_rank * per:(ep_rank + 1) * per]]
                else:
                    arr = _cut(arr, sharding.get(k), tp, tp_rank)
                return np.ascontiguousarray(arr, dtype=np.float32)

            params = {k: cut("param.", k) for k in st.sig["params"]}
            tensors.update((f"param.{chunk}{k}", a) for k, a in params.items())
            owned = [k for k in st.sig["params"] if k not in copies]  # a tied copy's moments
            segs = None                                                # live with its owner
            if meta_s.get("zero") and new.manifest["dp"] > 1:
                # ZeRO-1: the worker's segments of the moments (executor/zero.py's partition)
                dp = int(new.manifest["dp"])
                segs = zero_segments([(k, params[k].size) for k in owned], dp, w["replica"])
                zero = zero or {"dp": dp, "rank": w["replica"], "segments": {}}
                zero["segments"].update((chunk + k, [lo, hi]) for k, (lo, hi) in segs.items())
            for prefix in ("exp_avg.", "exp_avg_sq."):
                for k in owned:
                    if segs is None:
                        tensors[f"{prefix}{chunk}{k}"] = cut(prefix, k)
                    elif k in segs:
                        lo, hi = segs[k]
                        tensors[f"{prefix}{chunk}{k}"] = np.ascontiguousarray(
                            cut(prefix, k).reshape(-1)[lo:hi])
        st_name, mp_name = worker_files(wid)
        meta = {"step": at, "build": run["build"], "lineage": run["lineage"],
                "data_position": at, "opt_steps": opt_steps, "rng": None,
                "worker": wid, "stage": w["stage"],
                "skipped_in_row": int(meta0.get("skipped_in_row", 0)),
                "resharded_from": str(src)}
        if placement:
            meta["moe_placement"] = placement
        if zero:
            meta["zero"] = zero
        reports[wid] = {
            st_name: _durable_write(d / st_name, lambda p, t=tensors: write_safetensors(p, t),
                                   hashed=True),
            mp_name: _durable_write(d / mp_name, lambda p, m=meta: p.write_bytes(msgpack.packb(m)))}
    mark_complete(root, at, run["build"], reports)
    out(f"resharded {src} ({len(old.workers)} workers) into {d} for {new.path} "
        f"({len(new.workers)} workers): step {at}; continue with `h2x run {new.path} --resume"
        + (f" --checkpoint-dir {root}`" if named_root else "`"))
    return d


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="h2x reshard", description="Lay out a checkpoint of one "
                                 "build for another build of the same model (another plan: "
                                 "stages, dp, tp, ep, schedule, chips or backends); then `h2x "
                                 "run NEW_BUILD --resume` continues from it.")
    ap.add_argument("old_build")
    ap.add_argument("new_build")
    ap.add_argument("--step", type=int, help="the old build's checkpoint of this step "
                    "(default: its newest sound one)")
    ap.add_argument("--checkpoint-dir", metavar="DIR", help="the old build's (default OLD/ckpt)")
    ap.add_argument("--to-checkpoint-dir", metavar="DIR", help="the new build's (default "
                    "NEW/ckpt)")
    a = ap.parse_args(argv)
    reshard(a.old_build, a.new_build, step=a.step, old_checkpoint_dir=a.checkpoint_dir,
            new_checkpoint_dir=a.to_checkpoint_dir)
    return 0
