"""Lower bounds of the simulated step: of one layer split (`step_lower_bound`) and of every
line of a configuration (`config_bound`)."""
from __future__ import annotations

import math

import numpy as np

from h2ir.clusters.cluster import Cluster
from h2ir.planner.resource import ResourceModel, device_capacity, zero_optimizer_bytes
from h2ir.planner.search.stage_kind import first_backward_late


def step_lower_bound(fs, bs, cs, tails, m: int, dp: int, gpipe: bool, mx=max):
    """A lower bound of the simulator's step time (h2ir/planner/simulate.py) for a line of S
    stages with per-micro-batch forward fs[j] and backward bs[j], boundary p2p time cs[j]
    (stage j to j+1, the same both ways: the simulator times both directions over
    `LinePlacement.boundary(j)`) and tails[j] (gradient
    all-reduce + optimizer step). Entries may be floats or numpy columns (then `mx` is
    np.maximum). Every term is a chain of waits the simulator must respect:

    compute lane of j:  pre_j + m (f_j + b_j) + T_j, where pre_j = sum_{k<j} (f_k + c_k) is the
        earliest first forward (micro-batch 0 must cross stages 0..j-1), and
        T_j = max(tail_j, c_{j-1} + b_{j-1} + T_{j-1}) what must follow j's last backward
        (its own tail, and the last gradient's way back to stage 0 and its tail);
    link of j:          one queue carries j's m activations and m gradients (both directions
        of a worker's sends serialise, as in the simulator); it cannot start before j's
        first forward ends, its last send is the last gradient, which stage j-1 must then
        take through its backward and T_{j-1};
    GPipe, in addition: no backward before the stage's last forward (phases), the last
        forward needs the last activation, the first backward the first gradient.

    Ties (embedding = head) only add sends, so leaving them out keeps it a lower bound."""
    S = len(fs)
    pre, back, lb = 0.0, 0.0, 0.0
    for j in range(S):
        T = mx(tails[j], back)
        lb = mx(lb, pre + m * (fs[j] + bs[j]) + T)
        cin = cs[j - 1] if j > 0 else 0.0
        cout = cs[j] if j < S - 1 else 0.0
        after = mx(back - cin, tails[j]) if dp > 1 else back - cin
        if j == 0:
            if S > 1:
                lb = mx(lb, fs[0] + (m + 1) * cout + bs[0] + T)
        elif j < S - 1:
            lb = mx(lb, pre + fs[j] + m * (cin + cout) + after)
        else:
            lb = mx(lb, pre + fs[j] + bs[j] + m * cin + after)
        pre = pre + fs[j] + cout
        back = cout + bs[j] + T
    if gpipe and S > 1:
        fe = [m * fs[0]]
        pre_j = fs[0] + cs[0]
        for j in range(1, S):
            fe.append(mx(mx(fe[j - 1] + cs[j - 1] + fs[j], pre_j + m * fs[j]),
                         pre_j - cs[j - 1] + m * cs[j - 1] + fs[j]))
            if j < S - 1:
                pre_j = pre_j + fs[j] + cs[j]
        bs_ = fe[S - 1]
        be = fe[S - 1] + m * bs[S - 1]
        lb = mx(lb, be + tails[S - 1])
        for j in range(S - 2, -1, -1):
            first_grad = bs_ + bs[j + 1] + cs[j]
            be = mx(mx(mx(fe[j], first_grad) + m * bs[j], be + cs[j] + bs[j]),
                    bs_ + bs[j + 1] + m * cs[j] + bs[j])
            bs_ = mx(fe[j], first_grad)
            lb = mx(lb, be + tails[j])
    return lb


def config_bound(rm: ResourceModel, cluster: Cluster, budgets: dict, tps: dict, m: int,
                  schedule: str, ep, a2a: str, inflight: int | None = None, dp: int = 1) -> float:
    """A lower bound of every line of a configuration: some stage runs at least T per
    micro-batch, m times, where T is the smallest bottleneck at which the types' chips could
    hold every transformer block (a stage of (chip, tp) holds at most the blocks that fit
    under T by time and by memory at its least in-flight count: GPipe m, 1F1B 1), with each
    type's chips at the tp that holds the most blocks per chip; and one micro-batch crosses
    every layer on its fastest (chip, tp). A stage that may take ZeRO-1 (dp > 1, ep 1) is
    bounded with its optimizer state sharded."""
    la = rm.la
    block = la.is_block if la.is_block.any() else np.ones(la.L, bool)
    N = int(block.sum())
    infl = inflight or (m if schedule == "gpipe" else 1)
    kinds, pass_t = [], np.full(la.L, np.inf)
    for c, B in budgets.items():
        cap_mem = device_capacity(cluster.chip(c))
        e = ep.get(c, 1) if isinstance(ep, dict) else ep
        for t in tps[c]:
            lt = rm.layer_times(c, t, e, a2a)
            tau = np.add(lt.fwd_layer, lt.bwd_layer)
            pass_t = np.minimum(pass_t, tau)
            dev = la.device(t, e)
            tb = float(tau[block].min())
            rb = float((tau + np.array(lt.fwd_layer))[block].min())
            # (a stage whose forwards all run first, or that runs one micro-batch, has no
            # gradient sums at its peak)
            st, p = la.state, dev.params[block]
            opt = p * st.optimizer
            opt = zero_optimizer_bytes(opt, dp) if dp > 1 and e == 1 else opt
            grads = 0 if first_backward_late(infl, m) or m == 1 else st.grads
            state = float((p * (st.weights + grads) + opt).min())
            act = float(dev.act[block].min())
            out = float(dev.out[block].min())
            # (optimistic, as a bound must be: receive buffers, the loss and the backward's
            # working set beyond one layer's re-made activations are left out)
            M = max(0, math.floor(cap_mem / (state + infl * act)))
            R = max(0, math.floor((cap_mem - act) / (state + infl * out)))
            # selective recomputation: less kept (`act_sel`), the backward re-making what it
            # dropped (`bwd_sel`); where it keeps no less than none, none's term dominates it
            Ms, sb = 0, tb
            act_sel = float(dev.act_sel[block].min())
            if act_sel < act:
                Ms = max(0, math.floor(cap_mem / (state + infl * act_sel)))
                sb = float((tau + np.diff(lt.bwd_sel) - lt.bwd_layer)[block].min())
            kinds.append((c, B / t, tb, sb, rb, min(M, N), min(Ms, N), min(R, N)))
    if not kinds:
        return math.inf

    def blocks(T):
        per = {}
        for c, n, tb, sb, rb, M, Ms, R in kinds:
            held = n * max(min(int(T / tb * (1 + 1e-12)), M), min(int(T / sb * (1 + 1e-12)), Ms),
                           min(int(T / rb * (1 + 1e-12)), R))
            per[c] = max(per.get(c, 0.0), held)
        return sum(per.values())

    cands = np.unique(np.concatenate([np.arange(1, N + 1) * x for _, _, tb, sb, rb, *_ in kinds
                                      for x in {tb, sb, rb}]))
    if blocks(cands[-1]) < N:
        return math.inf
    lo, hi = 0, len(cands) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if blocks(cands[mid]) >= N:
            hi = mid
        else:
            lo = mid + 1
    return max(m * float(cands[lo]), float(pass_t.sum())) * (1 - 1e-9)
