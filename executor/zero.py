"""ZeRO-1: a stage's AdamW state sharded over its data-parallel group (a stage's `zero=1`).

ZeRO stage 1 (Rajbhandari et al., SC'20, Sec. 5.1, P_os), laid out as Megatron-LM's distributed
optimizer and DeepSpeed lay it out: the stage's optimizer parameters (`Worker.opt_names`: its
parameters in signature order, less tied copies; on a TP rank its own shards) are put end to end
as one flat f32 buffer, which `shard_bounds` cuts into dp contiguous shards of near-equal size
(they differ by at most one element); the replica at index r of the dp group owns shard r. A
shard may begin or end inside a parameter, so a worker's `exp_avg[k]` / `exp_avg_sq[k]` hold
the 1-D segment [lo, hi) of parameter k's flattened elements that lies in its shard (`segments`),
and there is no entry for a parameter wholly outside it: optimizer state per worker is 1/dp of
zero=0's, to the element.

The step's end runs the ring all-reduce's two halves around the optimizer step (streams:
`reduce_scatter grads [..]`, `opt_step`, `all_gather params [..]`):
- reduce-scatter: each replica gets the gradients of its shard, averaged over the group;
- opt_step: the global gradient norm counts each replica's shard (over the group, every element
  once); AdamW updates the shard's segments, each with its own parameter's weight decay group;
- all-gather: every replica gets the whole updated parameters.
All of it goes through DiComm on host NumPy arrays, so replicas on different backends share a
group. A checkpoint holds each worker's segments and `layout` (executor/checkpoint.py);
`h2x export` and `h2x reshard` join them back into whole moments (executor/export.py).
"""
from __future__ import annotations

import math

import numpy as np

from executor.dicomm.comm import shard_bounds
from h2ir.errors import H2Error


def segments(sizes: list[tuple[str, int]], dp: int, rank: int) -> dict[str, tuple[int, int]]:
    """name -> (lo, hi): the elements of each parameter (flattened) that fall in shard `rank` of
    `dp` of the parameters laid end to end in `sizes`' order; parameters outside it are left
    out."""
    b = shard_bounds(sum(n for _, n in sizes), dp)
    lo, hi = b[rank], b[rank + 1]
    out, off = {}, 0
    for name, n in sizes:
        a, z = max(lo, off), min(hi, off + n)
        if a < z:
            out[name] = (a - off, z - off)
        off += n
    return out


class ZeroShard:
    """One worker's ZeRO-1 shard of its stage's optimizer parameters (one chunk's, on a
    virtual-stage worker)."""

    def __init__(self, shapes: dict[str, tuple], dp: int, rank: int):
        self.shapes = dict(shapes)                  # opt_names order
        self.numel = {k: math.prod(s) for k, s in self.shapes.items()}
        self.total = sum(self.numel.values())
        self.dp, self.rank = dp, rank
        self.offset, off = {}, 0
        for k, n in self.numel.items():
            self.offset[k] = off
            off += n
        self.segments = segments(list(self.numel.items()), dp, rank)
        self.start = shard_bounds(self.total, dp)[rank]
        self.grads: dict[str, np.ndarray] = {}      # this step's averaged gradient segments
        self.updated: dict = {}                     # this step's updated parameter segments

    def state_shapes(self) -> dict[str, tuple]:
        """Shapes of the AdamW moments this worker holds: one 1-D segment per parameter."""
        return {k: (hi - lo,) for k, (lo, hi) in self.segments.items()}

    def layout(self) -> dict:
        """What a checkpoint records to join the segments back (executor/export.py)."""
        return {"dp": self.dp, "rank": self.rank,
                "segments": {k: [lo, hi] for k, (lo, hi) in self.segments.items()}}

    def _check_group(self, worker, ins) -> list[int]:
        group = list(ins.group)
        if len(group) != self.dp or worker.wid not in group or group.index(worker.wid) != self.rank:
            raise H2Error(f"worker w{worker.wid}: '{ins}' does not match the manifest (ZeRO-1 "
                          f"shard {self.rank} of dp {self.dp})", str(worker.build.path),
                          hint="recompile the build with `h2c compile`")
        return group

    def _param_segment(self, worker, k: str) -> np.ndarray:
        lo, hi = self.segments[k]
        flat = np.asarray(worker.be.to_numpy(worker.params[k]), dtype=np.float32).reshape(-1)
        return np.array(flat[lo:hi])

    # -- the instructions --------------------------------------------------------------------
    def reduce_scatter(self, worker, ins) -> None:
        group = self._check_group(worker, ins)
        be = worker.be
        parts = [np.asarray(be.to_numpy(worker._grad(k)), dtype=np.float32).reshape(-1)
                 for k in self.shapes]
        flat = np.concatenate(parts) if parts else np.zeros(0, np.float32)
        del parts
        worker.meter.sample(worker.mem_owner.held_tensors([flat]))
        # the whole gradients are in `flat` now; nothing reads them after this
        worker.param_grads.clear()
        worker.owned_grads.clear()
        mine = worker.comm.reduce_scatter(flat, group, op="avg").copy()
        self.grads = {}
        for k, (lo, hi) in self.segments.items():
            at = self.offset[k] + lo - self.start
            self.grads[k] = mine[at:at + hi - lo]

    def norm_share(self, worker) -> tuple[float, bool]:
        """(sum of squares, any non-finite) of this replica's gradient shard: the shards of
        the dp group cover each element once (a TP-replicated parameter: TP rank 0's)."""
        total, bad = 0.0, False
        for k, g in self.grads.items():
            if not worker.tp_counts(k):
                continue
            n = worker.be.l2_norm(worker.be.from_numpy(g, "f32"))
            if not math.isfinite(n):
                bad = True
            total += n * n
        return total, bad

    def apply(self, worker, v: dict) -> None:
        """AdamW on the shard's segments (the caller has counted the step), each in its
        parameter's weight decay group; the updated segments wait for `all_gather`."""
        be, o = worker.be, worker.opt["optimizer"]
        scale = np.float32(v["scale"]) if v["scale"] < 1.0 else None
        for wd, group in ((o["weight_decay"], [k for k in self.segments if worker.decayed[k]]),
                          (0.0, [k for k in self.segments if not worker.decayed[k]])):
            if not group:
                continue
            ps = [be.from_numpy(self._param_segment(worker, k), "f32") for k in group]
            gs = [be.from_numpy(self.grads[k] * scale if scale is not None else self.grads[k],
                                "f32") for k in group]
            be.adamw_step(ps, gs, [worker.exp_avg[k] for k in group],
                          [worker.exp_avg_sq[k] for k in group], worker.opt_steps, v["lr"],
                          o["beta1"], o["beta2"], o["eps"], wd)
            self.updated.update(zip(group, ps))

    def all_gather(self, worker, ins) -> None:
        """Every replica's updated shard to all: the whole parameters replace the worker's (a
        skipped step gathers the unchanged ones)."""
        group = self._check_group(worker, ins)
        be = worker.be
        parts = [np.asarray(be.to_numpy(self.updated[k]), dtype=np.float32).reshape(-1)
                 if k in self.updated else self._param_segment(worker, k)
                 for k in self.segments]
        part = np.concatenate(parts) if parts else np.zeros(0, np.float32)
        whole = worker.comm.all_gather(part, group, self.total)
        worker.meter.sample(worker.mem_owner.held_tensors([whole]))
        for k, shape in self.shapes.items():
            at = self.offset[k]
            worker.params[k] = be.from_numpy(whole[at:at + self.numel[k]].reshape(shape), "f32")
        self.grads, self.updated = {}, {}


def zero_shard(worker, shapes: dict[str, tuple]) -> ZeroShard | None:
    """The worker's ZeRO-1 shard when its stage has zero=1 in a build with dp > 1 (the dp group
    is the stage's replicas, the worker's index in it its replica); else None."""
    m = worker.build.manifest
    if not int(m["stages"][worker.stage_idx].get("zero") or 0) or int(m["dp"]) < 2:
        return None
    where = str(worker.build.path / "manifest.json")
    if len(worker.ep_group) > 1:        # h2ir/planner/validate.py refuses such a plan
        raise H2Error(f"stage {worker.stage_idx}: zero=1 on an expert-parallel stage (ep "
                      f"{len(worker.ep_group)}) is not supported", where)
    for k in shapes:
        dtype = worker.be.dtype_of(worker.params[k])
        if dtype != "f32":
            raise H2Error(f"stage {worker.stage_idx}: zero=1 needs f32 parameters, {k} is "
                          f"{dtype}", where)
    return ZeroShard(shapes, int(m["dp"]), int(worker.replica))
