"""A worker's side of sparse MoE (frontend/moe.py): the programs' expert-parallel all-to-alls,
per-expert loads, and expert migration (Piper, arXiv 2605.05049).

`StageComm` is the comm hook of a stage's programs (backends/base.py run_program): TP ops go to
the TP group (executor/redistribute.py), `ep_all_to_all` to the EP group over DiComm (flat or
HALO, as the plan says), `moe_stats` adds one micro-batch's per-expert token counts to the
step's loads.

Migration. Every `migrate` instruction (an EP stage's step end, h2ir/schedule/streams.py) sums
the step's loads over the stage's replicas — every rank then holds the same numbers and takes
the same decision, so no coordinator is needed — and folds them into a moving average (weight
LOAD_EMA for the newest step: one step's tokens are a noisy sample of where the router sends
them, and the router keeps learning). On a step the policy selects (`periodic(N)`: every N-th
step), per MoE layer, the load of an EP rank is the sum of the averaged loads of the experts in
its slots; when max/mean across ranks exceeds the plan's threshold, a greedy hill-climb (Piper's:
move the heaviest rank's expert / swap with the lightest rank's expert while the maximum
falls) finds a new placement, and each expert that changes rank is sent with its AdamW state
(exp_avg, exp_avg_sq) to its new rank. The step-count of AdamW is the worker's, the same for
all experts. The placement constants of the programs (`h2_placement`, `h2_slot`) change with
it; the programs do not. Migration changes where an expert's rows are computed, never which
tokens it sees or in which order: losses are those of the run without migration.
"""
from __future__ import annotations

import numpy as np

from executor.redistribute import TPGroupComm
from h2ir.errors import H2Error

LOAD_EMA = 0.5          # weight of the newest step in the loads migration decides on


def rank_loads(loads: np.ndarray, placement: list[int], ep: int) -> np.ndarray:
    """Tokens each EP rank computes: the loads of the experts in its slots (placement: the
    expert in each slot, rank-major)."""
    per = len(placement) // ep
    return np.array([loads[placement[r * per:(r + 1) * per]].sum() for r in range(ep)],
                    dtype=np.float64)


def imbalance(loads: np.ndarray, placement: list[int], ep: int) -> float:
    """max / mean of the EP ranks' loads (1.0: even; 1.0 too when nothing was routed)."""
    r = rank_loads(loads, placement, ep)
    mean = r.mean()
    return float(r.max() / mean) if mean > 0 else 1.0


def rebalance(loads: np.ndarray, placement: list[int], ep: int, max_rounds: int = 10_000) -> list[int]:
    """A placement with a lower maximum rank load, by greedy swaps: repeatedly, between the
    heaviest rank and each lighter one, take the swap of one expert each that lowers the larger
    of the two ranks' loads the most; stop when no swap lowers the maximum. Deterministic
    (ties go to the lower rank, then the lower slot)."""
    order = list(placement)
    per = len(order) // ep
    loads = np.asarray(loads, dtype=np.float64)
    for _ in range(max_rounds):
        r = rank_loads(loads, order, ep)
        hi = int(np.argmax(r))
        best = None                          # (new max of the pair, slot a, slot b)
        for lo in np.argsort(r, kind="stable"):
            lo = int(lo)
            if lo == hi:
                continue
            for a in range(hi * per, (hi + 1) * per):
                for b in range(lo * per, (lo + 1) * per):
                    d = loads[order[a]] - loads[order[b]]
                    if d <= 0:
                        continue
                    pair_max = max(r[hi] - d, r[lo] + d)
                    if pair_max < r[hi] - 1e-9 and (best is None or pair_max < best[0] - 1e-9):
                        best = (pair_max, a, b)
        if best is None:
            return order
        _, a, b = best
        order[a], order[b] = order[b], order[a]
    return order


class MoEState:
    """One worker's MoE layers: their placements, the current step's loads and dropped tokens."""

    def __init__(self, stage_moe: dict | None, ep: int, ep_rank: int):
        self.ep, self.ep_rank = ep, ep_rank
        experts = (stage_moe or {}).get("experts", {})
        self.placement = {path: list(e["placement"]) for path, e in experts.items()}
        self.params = {path: list(e["params"]) for path, e in experts.items()}
        self.num_experts = {path: int(e["experts"]) for path, e in experts.items()}
        self.load_ema: dict[str, list[float]] = {}       # layer -> averaged loads (all replicas)
        self.reset()

    def __bool__(self) -> bool:
        return bool(self.placement)

    def reset(self):
        # the placement this step computes with (a migration at its end changes the next one's)
        self.step_placement = {p: list(o) for p, o in self.placement.items()}
        self.loads = {p: np.zeros(n, dtype=np.int64) for p, n in self.num_experts.items()}
        self.dropped = {p: 0 for p in self.num_experts}
        self.capacity = {}
        self.migrated: dict[str, dict] = {}

    def record(self, layer: str, counts: np.ndarray, capacity: int):
        counts = np.asarray(counts, dtype=np.int64).reshape(-1)
        if layer not in self.loads:          # a MoE layer the compiler did not list: still count it
            self.loads[layer] = np.zeros(counts.size, dtype=np.int64)
            self.dropped[layer] = 0
        self.loads[layer] += counts
        self.dropped[layer] += int(np.maximum(counts - capacity, 0).sum())
        self.capacity[layer] = int(capacity)

    def report(self) -> dict:
        """This worker's step: per layer its tokens' loads, dropped tokens, capacity, placement."""
        out = {}
        for p in sorted(self.loads):
            out[p] = {"load": [int(x) for x in self.loads[p]], "dropped": int(self.dropped[p]),
                      "capacity": self.capacity.get(p)}
            if p in self.step_placement and self.ep > 1:
                out[p]["placement"] = list(self.step_placement[p])
                out[p]["ep"] = self.ep
            if p in self.migrated:
                out[p]["migrated"] = self.migrated[p]
        return out


class StageComm:
    """The comm hook of one worker's stage programs: TP collectives, EP all-to-alls, MoE loads."""

    def __init__(self, comm_of, be, *, tp_group: list[int], tp_rank: int, ep_group: list[int],
                 a2a: str = "flat", hosts: list[int] | None = None, moe: MoEState | None = None,
                 loss_scale: float = 1.0):
        self.comm_of, self.be = comm_of, be
        self.loss_scale = float(loss_scale)      # one micro-batch's loss gradient (1/m)
        self.tp = TPGroupComm(comm_of, be, tp_group, tp_rank) if len(tp_group) > 1 else None
        self.ep_group, self.a2a, self.hosts = list(ep_group), a2a, hosts
        self.moe = moe
        self.a2a_bytes = 0                   # payload bytes this worker sent in all-to-alls
        self.a2a_calls = 0

    def __call__(self, op: str, *inputs, **attrs):
        if op in ("tp_all_reduce", "tp_rank"):
            if self.tp is None:
                raise RuntimeError(f"program op {op} on a worker without a TP group")
            return self.tp(op, *inputs, **attrs)
        if op == "moe_stats":
            if self.moe is not None:
                self.moe.record(attrs["layer"], self.be.to_numpy(inputs[1]), attrs["capacity"])
            return inputs[0]
        if op == "ep_all_to_all":
            return self._all_to_all(inputs[0], attrs["size"])
        if op == "moe_aux_scale":
            return self.be.from_numpy(np.array(self.loss_scale, dtype=np.float32), "f32")
        raise RuntimeError(f"no runtime implementation for program op {op}")

    def _all_to_all(self, x, size: int):
        from h2ir.types import dtype_of_host
        if size != len(self.ep_group):
            raise RuntimeError(f"program's all-to-all expects an EP group of {size}, this "
                               f"worker's has {len(self.ep_group)}")
        a = np.asarray(self.be.to_numpy(x))
        parts = [np.ascontiguousarray(p) for p in np.split(a, size, axis=0)]
        comm = self.comm_of()
        if self.a2a == "flat":
            got = comm.all_to_all(parts, group=self.ep_group)
        else:
            got = comm.all_to_all(parts, group=self.ep_group, algo=self.a2a, hosts=self.hosts)
        me = self.ep_group.index(comm.rank) if hasattr(comm, "rank") else None
        self.a2a_bytes += sum(p.nbytes for i, p in enumerate(parts) if i != me)
        self.a2a_calls += 1
        out = np.concatenate(got, axis=0)
        return self.be.from_numpy(out, dtype_of_host(out.dtype))


def update_loads(worker, moe: MoEState, dp_group: list[int]) -> dict:
    """Sum the step's loads over the stage's replicas and fold them into `moe.load_ema`;
    returns the averaged loads per layer (the same on every replica)."""
    layers = sorted(moe.placement)
    if not layers:
        return {}
    flat = np.concatenate([moe.loads[p].astype(np.float64) for p in layers])
    if len(dp_group) > 1:
        worker.comm.all_reduce([flat], group=list(dp_group), op="sum")
    off = 0
    for p in layers:
        n = moe.num_experts[p]
        step = flat[off:off + n]
        off += n
        old = moe.load_ema.get(p)
        moe.load_ema[p] = list(step if old is None else
                               (1 - LOAD_EMA) * np.asarray(old) + LOAD_EMA * step)
    return {p: np.asarray(moe.load_ema[p]) for p in layers}


def migrate_experts(worker, moe: MoEState, ep_group: list[int], threshold: float) -> dict:
    """Move experts where a layer's max/mean rank load (averaged loads) exceeds `threshold`
    (see the module docstring). Returns {layer: what moved}."""
    layers = sorted(moe.placement)
    per_layer = {p: np.asarray(moe.load_ema[p]) for p in layers if p in moe.load_ema}
    ep, me = len(ep_group), ep_group.index(worker.wid)
    moved = {}
    for p in per_layer:
        old = moe.placement[p]
        before = imbalance(per_layer[p], old, ep)
        if before <= threshold:
            continue
        new = rebalance(per_layer[p], old, ep)
        if new == old:
            continue
        _move(worker, moe, p, old, new, ep, me, ep_group)
        moe.placement[p] = new
        moved[p] = {"before": round(before, 4), "after": round(imbalance(per_layer[p], new, ep), 4),
                    "placement": list(new)}
    if moved:
        worker.set_placement_consts(moe.placement)
    moe.migrated = moved
    return moved


def _move(worker, moe: MoEState, layer: str, old: list[int], new: list[int], ep: int, me: int,
          ep_group: list[int]):
    """Exchange the expert slices of `layer` so that this rank's slots hold `new`'s experts."""
    per = len(old) // ep
    slot_old = {e: s for s, e in enumerate(old)}
    be = worker.be
    tables = [("param", worker.params), ("exp_avg", worker.exp_avg), ("exp_avg_sq", worker.exp_avg_sq)]
    names = moe.params[layer]
    # each stack viewed as [slots, rows of one expert, ...]: an expert is one slot (DBRX's
    # [E * F, D] stacks too)
    raw = {(t, k): np.array(be.to_numpy(tab[k])) for t, tab in tables for k in names if k in tab}
    shapes = {k: a.shape for (_, k), a in raw.items()}
    host = {key: a.reshape(per, -1, *a.shape[1:]) for key, a in raw.items()}
    if not host:                     # before anything is sent: no rank is left waiting
        raise H2Error(f"worker w{worker.wid}: MoE layer {layer} has no expert weights here")
    # sends first: DiComm buffers on the receiving side, so no order of ranks can deadlock
    for s_new, e in enumerate(new):
        src, dst = slot_old[e] // per, s_new // per
        if src == me and dst != me:
            for (t, k), arr in host.items():
                worker.comm.send(ep_group[dst], np.ascontiguousarray(arr[slot_old[e] % per]),
                                 kind=f"migrate:{layer}:{e}:{t}:{k}", mb=0, stage=worker.stage_idx)
    fresh = {key: arr.copy() for key, arr in host.items()}
    for s_new in range(me * per, (me + 1) * per):
        e = new[s_new]
        src = slot_old[e] // per
        for (t, k), arr in host.items():
            if src == me:
                fresh[(t, k)][s_new % per] = arr[slot_old[e] % per]
            else:
                fresh[(t, k)][s_new % per] = worker.comm.recv(
                    ep_group[src], kind=f"migrate:{layer}:{e}:{t}:{k}", mb=0)
    for t, tab in tables:
        for k in names:
            if (t, k) in fresh:
                tab[k] = be.from_numpy(np.ascontiguousarray(fresh[(t, k)].reshape(shapes[k])),
                                       "f32")
