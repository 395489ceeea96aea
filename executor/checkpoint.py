"""Checkpoints: per worker, weights and optimizer state as safetensors plus msgpack metadata.

    ckpt/step_00000010/w0.safetensors    param.<name>, exp_avg.<name>, exp_avg_sq.<name> (no
                                         optimizer state for a tied parameter's copy)
    ckpt/step_00000010/w0.msgpack        {step, data_position, opt_steps, rng}
    ckpt/step_00000010/COMPLETE          written by h2x once every worker's files are in place

Each file is written to a temporary name and renamed (atomic on POSIX), so a crash leaves either
the old file or the new one, never half of one; a step directory without COMPLETE is ignored.
"""
from __future__ import annotations

import os
from pathlib import Path

import msgpack
import numpy as np

from h2ir.errors import H2Error


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def _atomic_write(path: Path, write):
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_worker_checkpoint(root: Path, step: int, worker) -> None:
    from safetensors.numpy import save_file
    d = step_dir(root, step)
    d.mkdir(parents=True, exist_ok=True)
    be = worker.be
    tensors = {}
    for k in worker.param_names:
        tensors[f"param.{k}"] = np.ascontiguousarray(be.to_numpy(worker.params[k]))
    for k in worker.opt_names:       # a tied parameter's copy has no optimizer state of its own
        tensors[f"exp_avg.{k}"] = np.ascontiguousarray(be.to_numpy(worker.exp_avg[k]))
        tensors[f"exp_avg_sq.{k}"] = np.ascontiguousarray(be.to_numpy(worker.exp_avg_sq[k]))
    _atomic_write(d / f"w{worker.wid}.safetensors", lambda p: save_file(tensors, str(p)))
    # Data is a pure function of (seed, step, replica, micro-batch): the next step is the position.
    meta = {"step": step, "data_position": step, "opt_steps": worker.opt_steps, "rng": None,
            "worker": worker.wid, "stage": worker.stage_idx}
    _atomic_write(d / f"w{worker.wid}.msgpack", lambda p: p.write_bytes(msgpack.packb(meta)))


def load_worker_checkpoint(d: Path, worker) -> None:
    from safetensors.numpy import load_file
    f = d / f"w{worker.wid}.safetensors"
    try:
        tensors = load_file(str(f))
        meta = msgpack.unpackb((d / f"w{worker.wid}.msgpack").read_bytes())
    except (OSError, ValueError, msgpack.ExtraData) as e:
        raise H2Error(f"cannot read checkpoint: {e}", str(f)) from None
    be = worker.be
    wanted = [(worker.params, "param.", k) for k in worker.param_names]
    wanted += [(table, prefix, k) for k in worker.opt_names
               for table, prefix in ((worker.exp_avg, "exp_avg."), (worker.exp_avg_sq, "exp_avg_sq."))]
    for table, prefix, k in wanted:
        if prefix + k not in tensors:
            raise H2Error(f"checkpoint has no tensor {prefix + k}", str(f))
        table[k] = be.from_numpy(np.array(tensors[prefix + k]), "f32")
    worker.opt_steps = meta["opt_steps"]


def mark_complete(root: Path, step: int) -> None:
    d = step_dir(root, step)
    _atomic_write(d / "COMPLETE", lambda p: p.write_text(f"{step}\n"))


def latest_complete(root: Path) -> tuple[int, Path] | None:
    root = Path(root)
    if not root.is_dir():
        return None
    best = None
    for d in root.glob("step_*"):
        if (d / "COMPLETE").is_file():
            try:
                s = int(d.name.split("_")[1])
            except ValueError:
                continue
            if best is None or s > best[0]:
                best = (s, d)
    return best
