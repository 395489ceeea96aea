"""One stage kind's costs: for a (chip, tp, ep, a2a) stage, prefix sums of its times and, for
every layer range, whether it fits in memory at a given in-flight count and recomputation."""
from __future__ import annotations

import bisect
import math

import numpy as np

from h2ir.planner.limits import CAP_MARGIN
from h2ir.planner.resource import (ResourceModel, attention_score_bytes, device_capacity,
                                   zero_optimizer_bytes)


class KindTable:
    """What one (chip, tp, ep, a2a) stage costs for every layer range [a, b), independent of
    the in-flight count: prefix sums for time, and the memory fits (`_Fits`) of zero=0
    (`plain`) and of zero=1 over dp replicas (`sharded(dp)`, for stages that may shard their
    optimizer state: dp > 1 and ep 1, as the validator has it). Memory numbers are
    h2ir/planner/resource/'s (`memory_items`, the attention scores of
    `attention_score_bytes`, `device_capacity`, `zero_optimizer_bytes`), evaluated for all
    (a, b) at once: bytes = base + inflight * per_mb, so a range fits iff
    inflight <= (cap - base) / per_mb."""

    def __init__(self, rm: ResourceModel, chip: str, tp: int, ep: int, a2a: str):
        lt = rm.layer_times(chip, tp, ep, a2a)
        self.chip, self.tp = chip, tp
        self.F, self.B, self.Bsel, self.Brc = lt.fwd, lt.bwd, lt.bwd_sel, lt.bwd_rc
        self.FB = [f + b for f, b in zip(lt.fwd, lt.bwd)]
        self.FBsel = [f + b for f, b in zip(lt.fwd, lt.bwd_sel)]
        self.FBrc = [f + b for f, b in zip(lt.fwd, lt.bwd_rc)]
        self.tau = np.add(lt.fwd_layer, lt.bwd_layer)
        dev = rm.la.device(tp, ep)
        self.Pp = dev.P_params
        self.out = dev.out.tolist()
        L = rm.L
        Pp = np.array(dev.P_params)
        a = np.arange(L)[:, None]
        b = np.arange(1, L + 1)[None, :]
        P = Pp[b] - Pp[a]
        st = rm.la.state
        # the resource model's own terms of every range [a, b): fixed + inflight * per_mb
        # (`DeviceArrays.memory_terms`, what `memory_items` itemises)
        fixed_n, per_n = dev.memory_terms("none")
        fixed_s, per_s = dev.memory_terms("selective")
        fixed_f, per_f = dev.memory_terms("full")
        ct = rm.cluster.chip(chip)
        cap = device_capacity(ct) * CAP_MARGIN
        # attention scores of chips without a fused kernel (resource.attention_score_bytes):
        # every in-flight micro-batch keeps them, or, with either recomputation (both re-make
        # the attention core, as resource.stage_memory has it), the re-run block only
        sc = _score_bytes(rm, ct, tp)
        Psc = np.concatenate([[0.0], np.cumsum(sc)])
        sc_rc = np.where(Psc[b] - Psc[a] > 0, sc.max() if L else 0.0, 0.0)
        before = b <= a
        # (base, per micro-batch) of each recompute tier, besides the model state; and the
        # gradient sums, for `_Fits.late`
        tiers = ((fixed_n, per_n + Psc[b] - Psc[a], per_n), (fixed_s + sc_rc, per_s, per_s),
                 (fixed_f + sc_rc, per_f, per_f))
        grads = P * st.grads
        self.plain = _Fits(P * st.total, tiers, grads, cap, before)
        self._fits_args = (tiers, grads, cap, before)
        self._P, self._state = P, st
        self._sharded: dict = {1: self.plain}

    def sharded(self, dp: int) -> "_Fits":
        """The fits of zero=1 over dp replicas (dp 1: zero=0's)."""
        if dp not in self._sharded:
            P, st = self._P, self._state
            state = P * (st.weights + st.grads) + zero_optimizer_bytes(P * st.optimizer, dp)
            self._sharded[dp] = _Fits(state, *self._fits_args)
        return self._sharded[dp]


class _Fits:
    """For one model-state table (bytes of every range [a, b)), the largest in-flight count at
    which [a, b') still fits for every b' <= b without recomputation (`inone`), with at most
    selective recomputation (`isel`) and with any (`iany`)."""

    def __init__(self, state: np.ndarray, tiers: tuple, grads: np.ndarray, cap: float,
                 before: np.ndarray):
        (fixed_n, per_n, _), (fixed_s, per_s, _), (fixed_f, per_f, _) = tiers
        with np.errstate(divide="ignore", invalid="ignore"):
            inone = _max_inflight(cap - state - fixed_n, per_n)
            isel = _max_inflight(cap - state - fixed_s, per_s)
            irc = _max_inflight(cap - state - fixed_f, per_f)
        inone[before] = np.inf
        isel[before] = np.inf
        irc[before] = np.inf
        # monotone: what fits without recomputation fits with at most selective, and that
        # with any (each the max of the in-flight limits of the tiers below it); kept as whole
        # counts (x >= n iff floor(x) >= n), exact in float32 below 2^24 micro-batches
        isel = np.maximum(inone, isel)
        whole = lambda x: np.clip(np.floor(np.minimum.accumulate(x, axis=1)), -1, 2 ** 24
                                  ).astype(np.float32)
        self.inone, self.isel, self.iany = whole(inone), whole(isel), whole(np.maximum(isel, irc))
        # for `late`: the same terms, and the gradient sums that do not exist yet while the
        # first backward's micro-batch is still held (`stage_memory`)
        self.state, self.tiers = state, tiers
        self.cap, self.before, self.grads = cap, before, grads

    def limits(self, inflight: int, late: bool, single: bool = False) -> tuple[list, list, list]:
        """For every start layer a, the furthest end b that fits at `inflight` micro-batches
        without recomputation, with at most selective and with any (`StageKind`)."""
        if late or single:
            return tuple(f.sum(axis=1).tolist() for f in self.late(inflight, single))
        return tuple((i >= inflight).sum(axis=1).tolist()
                     for i in (self.inone, self.isel, self.iany))

    def late(self, inflight: int, single: bool = False) -> tuple[np.ndarray, ...]:
        """(fit without recomputation, fit with at most selective, fit with any) at
        `inflight` micro-batches when every
        micro-batch's forward runs before the stage's first backward: the gradient sums then
        first exist once that backward has released its micro-batch's activations, so the peak
        holds min(grads, one micro-batch's activations) less; with `single` (one micro-batch
        per step) there are no sums besides the backward's own gradients, so it holds none of
        them (resource.stage_memory)."""
        less = (lambda per: self.grads) if single else (lambda per: np.minimum(self.grads, per))
        with np.errstate(invalid="ignore"):
            none, sel, full = (self.state + fixed + inflight * per - less(act) <= self.cap
                               for fixed, per, act in self.tiers)
        none = none | self.before
        sel = none | sel | self.before
        full = sel | full | self.before
        return (np.logical_and.accumulate(none, axis=1),
                np.logical_and.accumulate(sel, axis=1),
                np.logical_and.accumulate(full, axis=1))


def first_backward_late(inflight: int, m: int) -> bool:
    """Whether a stage holding `inflight` of m micro-batches runs every forward before its
    first backward (as `stage_memory` tells it for a one-chunk schedule)."""
    return inflight >= m > 1


def _max_inflight(room: np.ndarray, per_mb: np.ndarray) -> np.ndarray:
    """Largest in-flight count with room - inflight * per_mb >= 0 (inf when per_mb is 0 and
    there is room, -inf when there is none)."""
    return np.where(per_mb > 0, room / np.where(per_mb > 0, per_mb, 1.0),
                    np.where(room >= 0, np.inf, -np.inf))


class StageKind:
    """Costing of one stage for a (chip, tp, ep, a2a, dp, in-flight micro-batches) combination:
    the `KindTable`'s prefix sums for time, and for every start layer a the furthest end b up
    to which the stage still fits in memory without recomputation (`fit_none`), with at most
    selective recomputation (`fit_sel`) and with full recomputation if needed (`fit_any`):
    fit_none <= fit_sel <= fit_any. A range up to fit_none runs without recomputation, one up
    to fit_sel with selective, one up to fit_any with full. Where the stage may take ZeRO-1
    (`zero`) the fits are those of zero=1, its least memory, and `plain_fit` zero=0's (whether
    it fits at the same recomputation: `StageLine.step_end`)."""

    def __init__(self, rm: ResourceModel, chip: str, tp: int, ep: int, a2a: str, inflight: int,
                 table: KindTable | None = None, late: bool = False, single: bool = False,
                 zero_dp: int = 1):
        """`late`: every micro-batch's forward runs before the stage's first backward (GPipe,
        or 1F1B with m <= S - j; `first_backward_late`); `single`: one micro-batch per step;
        `zero_dp`: the replicas a ZeRO-1 stage shards over (1: zero=0 only)."""
        t = table or KindTable(rm, chip, tp, ep, a2a)
        self.chip, self.tp = chip, tp
        self.F, self.B, self.Bsel, self.Brc = t.F, t.B, t.Bsel, t.Brc
        self.FB, self.FBsel, self.FBrc = t.FB, t.FBsel, t.FBrc
        self.tau, self.Pp, self.out = t.tau, t.Pp, t.out
        self.zero = zero_dp > 1
        self.fit_none, self.fit_sel, self.fit_any = t.sharded(zero_dp).limits(inflight, late, single)
        self.plain_fit = t.plain.limits(inflight, late, single) if self.zero else \
            (self.fit_none, self.fit_sel, self.fit_any)

    def stage(self, a: int, b: int):
        """(fwd, bwd, recompute) for layers [a, b), or None if they do not fit."""
        if b <= self.fit_none[a]:
            return self.F[b] - self.F[a], self.B[b] - self.B[a], "none"
        if b <= self.fit_sel[a]:
            return self.F[b] - self.F[a], self.Bsel[b] - self.Bsel[a], "selective"
        if b <= self.fit_any[a]:
            return self.F[b] - self.F[a], self.Brc[b] - self.Brc[a], "full"
        return None

    def fits_plain(self, a: int, b: int) -> bool:
        """Layers [a, b) fit with zero=0 at the recomputation `stage` gives them."""
        for fit, plain in zip((self.fit_none, self.fit_sel, self.fit_any), self.plain_fit):
            if b <= fit[a]:
                return b <= plain[a]
        return False

    def time(self, a: int, b: int) -> float:
        if b <= self.fit_none[a]:
            return self.FB[b] - self.FB[a]
        if b <= self.fit_sel[a]:
            return self.FBsel[b] - self.FBsel[a]
        if b <= self.fit_any[a]:
            return self.FBrc[b] - self.FBrc[a]
        return math.inf

    def furthest(self, a: int, T: float) -> int:
        """Largest b with time(a, b) <= T and memory fitting (a if none): feasibility is
        downward closed in b (fewer layers: less time, less memory; each layer's selective
        time lies between its times without and with full recomputation, so time(a, b) grows
        with b across the tiers too), so it is one bisection per tier, the furthest first."""
        if self.fit_any[a] > self.fit_sel[a]:
            b3 = min(self.fit_any[a], bisect.bisect_right(self.FBrc, self.FBrc[a] + T) - 1)
            if b3 > self.fit_sel[a]:
                return b3
        if self.fit_sel[a] > self.fit_none[a]:
            b2 = min(self.fit_sel[a], bisect.bisect_right(self.FBsel, self.FBsel[a] + T) - 1)
            if b2 > self.fit_none[a]:
                return b2
        b = min(self.fit_none[a], bisect.bisect_right(self.FB, self.FB[a] + T) - 1)
        return max(b, a)


# per-layer attention-score bytes, memoised by `_score_bytes`
_SCORES: dict = {}


def _score_bytes(rm: ResourceModel, chip, tp: int) -> np.ndarray:
    """Per layer, the attention-score bytes one micro-batch keeps on `chip` at `tp`
    (resource.attention_score_bytes), memoised per layer arrays."""
    # keyed by id() but holding the object: an id is reused once its object is collected, so
    # the hit must be the same object, not only the same id
    key = (id(rm.la), chip.name, chip.fused_attention, tp)
    hit = _SCORES.get(key)
    if hit is None or hit[0] is not rm.la:
        if len(_SCORES) > 4096:
            _SCORES.clear()
        hit = _SCORES[key] = (rm.la, np.array([attention_score_bytes(rm.la, chip, tp, i, i + 1)
                                               for i in range(rm.L)]))
    return hit[1]
