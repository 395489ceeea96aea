"""The resource model: compute rates per chip, layer and stage times, step-end collectives and
the optimizer step (`ResourceModel`), what the simulator and the search charge."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from h2ir.clusters.cluster import ChipType, Cluster
from h2ir.costs import LayerCost, ModelCosts
from h2ir.errors import H2Error
from h2ir.plans.plan import Plan
from h2ir.planner.calibration import colocation_key
from h2ir.planner.resource.links import (EPGeometry, LinePlacement, default_ep_geometry,
                                         group_allreduce_time, hockney_time, moe_a2a_pass_time,
                                         replica_geometry, tp_allreduce_time)
from h2ir.planner.resource.memory import (LayerArrays, capacity_of, costs_at, dtype_bytes,
                                          layer_arrays_cached, prefix_sums, stage_layer_range,
                                          tied_exchange_bytes)


@dataclass(frozen=True)
class ChipRates:
    flops: float                 # achievable FLOP/s on dense matmuls
    mem_bw: float                # B/s, for memory-bound work (optimizer step)
    peak_flops: float            # denominator of MFU
    source: str                  # 'catalog' or 'measured'
    backend: str = ""
    attn_flops: float = 0.0      # achievable FLOP/s on the attention core (0: same as flops)
    act_bw: float = 0.0          # achievable B/s on memory-bound layer work (0: mem_bw)
    opt_bw: float = 0.0          # the optimizer step's state bytes per second (0: mem_bw)


def measured_calibration(backend: str, calibration=None):
    """The calibration for a measured chip on `backend`: the one passed in. The planner never
    measures; the layer that measures (backends/calibrate.py, frontend/profile.py) writes the
    calibration file and the driver passes it in."""
    if calibration is not None and calibration.has_backend(backend):
        return calibration
    where = f" in {calibration.path}" if calibration is not None and calibration.path else ""
    raise H2Error(f"a `measured` chip runs the {backend!r} backend, but no calibration for it was "
                  f"given{where}", hint="run `h2c profile` on the machine that runs it, or plan "
                  "through `h2c plan`/`h2c compile`, which measure what is missing")


def chip_rates(chip: ChipType, cluster: Cluster, calibration=None) -> ChipRates:
    """Achievable FLOP/s of a chip: peak x efficiency from the catalog (chip.flops), or, for
    `measured` chips, what `h2c profile` measured (single-thread matmul FLOP/s and copy
    bandwidth of the chip's backend, `h2ir/planner/calibration.py`), which must be passed in."""
    if chip.measured:
        cal = measured_calibration(chip.backend, calibration)
        f = cal.matmul_flops(chip.backend)
        return ChipRates(flops=f, mem_bw=cal.mem_bw(chip.backend), peak_flops=f,
                         source="measured", backend=chip.backend,
                         opt_bw=cal.opt_bw(chip.backend) or 0.0)
    peak = chip.peak_flops.get(cluster.dtype) or chip.peak_flops.get("fp32")
    if not peak:
        raise H2Error(f"chip {chip.name!r} has no peak FLOP/s for {cluster.dtype} or fp32")
    return ChipRates(flops=chip.flops(cluster.dtype, "matmul"), mem_bw=chip.mem_bw,
                     peak_flops=peak, source="catalog", backend=chip.backend,
                     attn_flops=chip.flops(cluster.dtype, "attention"),
                     act_bw=chip.mem_bw * chip.eff("memory"))


def layer_op_split(la: "LayerArrays", i: int) -> tuple[float, float, float, float, float]:
    """Layer i's work by op class, per micro-batch: (matmul fwd FLOPs, attention fwd FLOPs,
    matmul bwd, attention bwd, memory-bound fwd bytes); memory-bound bwd bytes are twice the
    forward's.

    Attention core of a block: 4*b*s^2*d forward (QK^T and PV, dense count, FlashAttention-2,
    Dao 2023, Sec. 4.1, as h2ir/opset.py counts it), backward 2.5x (ibid.: five matmuls to the
    forward's two). Memory-bound work (norms, rotary, activations, residual adds, softmax,
    loss): each activation the layer saves is written once and read once in the forward, and
    read plus its gradient written and read in the backward (a roofline estimate, Williams et al.
    2009: these ops do O(1) FLOPs per byte)."""
    l = la.layers[i]
    c = la.costs
    attn_f = 4.0 * c.micro_batch * c.seq_len ** 2 * c.d_model if la.is_block[i] else 0.0
    attn_f = min(attn_f, 0.5 * l.fwd_flops)
    attn_b = min(2.5 * attn_f, 0.5 * l.bwd_flops)
    return (l.fwd_flops - attn_f, attn_f, l.bwd_flops - attn_b, attn_b, 2.0 * la.act[i])


def tp_memory_share(la: "LayerArrays", i: int, tp: int) -> float:
    """The fraction of layer i's memory-bound work one of `tp` ranks does. The kernels shard
    it as the activations are sharded (`LayerArrays.act_rep`): the elementwise work inside
    the column/row-parallel matmuls' outputs and the attention heads divides by t; the norms
    and residual adds on the replicated b*s*d stream run whole on every rank (Megatron-LM
    without sequence parallelism: Shoeybi et al. 2019 Sec. 3; Korthikanti et al. 2022
    Sec. 4.2.1)."""
    act = la.act[i]
    if tp <= 1 or act <= 0:
        return 1.0
    rep = la.act_rep[i] / act
    return rep + (1.0 - rep) / tp


# ----------------------------------------------------------------------------------------------
# time

@dataclass(frozen=True)
class LayerTimes:
    """Per-layer per-micro-batch times on one (chip, tp, ep), comm included, with prefix sums."""
    fwd: list            # prefix sums, len L+1
    bwd: list            # no recomputation
    bwd_rc: list         # full recomputation: backward + a re-run forward
    bwd_sel: list        # selective recomputation: backward + the re-made pointwise / attention work
    fwd_layer: list      # per layer (not prefix), for lower bounds
    bwd_layer: list


@dataclass(frozen=True)
class StageTimes:
    fwd_s: float                # one micro-batch's forward on the stage (TP / all-to-all included)
    bwd_s: float                # one micro-batch's backward (recompute included)
    send_act_s: float           # to the next stage (0 on the last)
    send_grad_s: float          # to the previous stage (0 on the first)
    dp_allreduce_s: float       # with ZeRO-1: its two halves below, together
    opt_step_s: float
    tied_s: float = 0.0         # one hand-over of tied gradients / parameters (0 without ties)
    reduce_scatter_s: float = 0.0   # ZeRO-1: the gradients' reduce-scatter ...
    all_gather_s: float = 0.0       # ... and the updated parameters' all-gather


class ResourceModel:
    """Times and memory of stages of one model on one cluster at one micro-batch/seq length."""

    def __init__(self, costs: ModelCosts, cluster: Cluster, micro_batch: int | None = None,
                 seq_len: int | None = None, calibration=None):
        mb = micro_batch or costs.micro_batch
        sl = seq_len or costs.seq_len
        self.costs = costs_at(costs, mb, sl)
        self.cluster = cluster
        self.calibration = calibration
        self.la = layer_arrays_cached(self.costs, cluster.dtype)
        self._rates: dict = {}
        self._times: dict = {}
        self._cals: dict = {}
        # (chip, layer name) of `measured` chips timed by the FLOP estimate: no measured record
        self.estimated: set = set()
        self._placements: dict = {}

    def placement(self, shapes, dp: int) -> LinePlacement:
        """The hosts of a line of stages ((chip, tp) per stage) with dp replicas, and its links."""
        key = (tuple(shapes), dp)
        if key not in self._placements:
            self._placements[key] = LinePlacement(self.cluster, key[0], dp)
        return self._placements[key]

    def plan_placement(self, plan: Plan) -> LinePlacement:
        return self.placement(tuple((st.chip, st.tp) for st in plan.stages), plan.dp)

    @property
    def L(self) -> int:
        return self.la.L

    def rates(self, chip: str) -> ChipRates:
        if chip not in self._rates:
            self._rates[chip] = chip_rates(self.cluster.chip(chip), self.cluster, self.calibration)
        return self._rates[chip]

    def _measured_layer_time(self, rates: ChipRates, l: LayerCost):
        if rates.source != "measured":
            return None
        cal = self._cals.get(rates.backend)
        if cal is None:
            cal = self._cals[rates.backend] = measured_calibration(rates.backend, self.calibration)
        return cal.layer_time(rates.backend, l, self.costs.micro_batch, self.costs.seq_len,
                              solo=self.cluster.shares_cores, colocation=self.colocation)

    @property
    def colocation(self) -> dict | None:
        """The co-location measured layer times must have been taken under: the cluster's
        busiest set of shared cores (`Cluster.colocation`, `calibration.colocation_key`)."""
        c = self.cluster.colocation()
        return colocation_key(*c) if c else None

    def contention_curve(self, chip: str) -> dict:
        """How much slower a worker of `chip` computes with n of its host's workers computing
        at once ({n: factor}, `h2ir.planner.calibration.contention_curve`): measured with its
        layer times on `measured` chips; otherwise {1: 1.0}, time sharing past the cores only.
        The simulator applies it (`simulate._shared_cores_fixed_point`)."""
        curves = self.__dict__.setdefault("_curves", {})
        if chip not in curves:
            r = self.rates(chip)
            # the curve of the record that times the model's heaviest layer
            top = max(self.costs.layers, key=lambda l: l.fwd_flops, default=None)
            curves[chip] = {1: 1.0} if r.source != "measured" else measured_calibration(
                r.backend, self.calibration).contention_curve(
                    r.backend, self.costs.micro_batch, self.colocation, top, self.costs.seq_len)
        return curves[chip]

    def layer_times(self, chip: str, tp: int, ep: int = 1, a2a: str = "flat",
                    tp_estimate: bool = True, ep_geo: "EPGeometry | None" = None,
                    capacity: float | None = None, tp_cross: bool = False) -> LayerTimes:
        """`tp_estimate=False` leaves out the per-layer TP all-reduce estimate (the caller adds
        the stage programs' own collectives instead: `stage_times(program_comm=...)`). `ep_geo`:
        how the stage's EP groups lie on hosts (`LinePlacement.ep_geometry`); None: node-local
        when ep x tp fits a node, else spread as `replica_geometry` says. `tp_cross`: the
        stage's TP groups span hosts (`LinePlacement.tp_crosses`)."""
        key = (chip, tp, ep, a2a, tp_estimate, ep_geo, capacity, tp_cross)
        if key in self._times:
            return self._times[key]
        r = self.rates(chip)
        g = self.cluster.group(chip)
        la = self.la
        fused = self.cluster.chip(chip).fused_attention
        fwd, bwd, rerun_rc, rerun_sel = [], [], [], []
        for i, l in enumerate(la.layers):
            measured = self._measured_layer_time(r, l)
            share = tp_memory_share(la, i, tp)
            if measured is not None:
                # h2c profile timings of this very layer. Under TP the matmul share (at most
                # FLOPs / the measured matmul rate) splits over the ranks; the rest — norms,
                # elementwise ops, per-op dispatch — splits as the activations it reads and
                # writes do (`tp_memory_share`: the replicated stream's part runs whole).
                mm_f = min(measured[0], l.fwd_flops / r.flops)
                mm_b = min(measured[1], l.bwd_flops / r.flops)
                f_c = mm_f / tp + (measured[0] - mm_f) * share
                b_c = mm_b / tp + (measured[1] - mm_b) * share
                sel = (measured[0] - mm_f) * share
            elif r.source == "measured":
                # a measured chip without a record of this layer: FLOPs / measured matmul rate
                self.estimated.add((chip, l.name))
                f_c = l.fwd_flops / (tp * r.flops)
                b_c = l.bwd_flops / (tp * r.flops)
                sel = 0.0
            else:
                # per op class: matmul and attention FLOPs at their achievable rates, split over
                # TP (Megatron-LM Sec. 3); memory-bound bytes at the achievable bandwidth, split
                # as the kernels split them (`tp_memory_share`)
                mm_f, at_f, mm_b, at_b, mem = layer_op_split(la, i)
                af = r.attn_flops or r.flops
                bw = r.act_bw or r.mem_bw
                f_c = (mm_f / r.flops + at_f / af) / tp + mem * share / bw
                b_c = (mm_b / r.flops + at_b / af) / tp + 2 * mem * share / bw
                # selective recomputation re-makes the pointwise values and, without a fused
                # kernel, the attention core (Korthikanti et al. 2022 Sec. 5;
                # frontend/recompute.py)
                sel = mem * share / bw + (0.0 if fused else at_f / af / tp)
            if r.source == "measured":
                b_c += self.grad_accumulation_time(r, l.params / tp)
            comm = 0.0
            if tp > 1 and tp_estimate:
                # Megatron-LM (Shoeybi et al. 2019) Sec. 3, Fig. 4: two all-reduces of the b*s*d
                # block output per transformer block in the forward and two in the backward; the
                # vocab-parallel embedding needs one per pass.
                n_ar = 2 if la.is_block[i] else (1 if la.is_embed[i] else 0)
                comm += n_ar * tp_allreduce_time(la.out[i], g, tp, tp_cross)
            if l.moe is not None and ep > 1:
                comm += moe_a2a_pass_time(self.costs, l.moe, g, tp, ep, a2a,
                                          ep_geo or default_ep_geometry(g, ep, tp), capacity,
                                          dtype_bytes(self.cluster.dtype))
            fwd.append(f_c + comm)
            bwd.append(b_c + comm)
            # recomputation re-runs compute only: the collectives' results are kept
            # (frontend/recompute.py never re-runs communication)
            rerun_rc.append(f_c)
            rerun_sel.append(sel)
        f = np.array(fwd)
        b = np.array(bwd)
        lt = LayerTimes(fwd=prefix_sums(f), bwd=prefix_sums(b), bwd_rc=prefix_sums(b + np.array(rerun_rc)),
                        bwd_sel=prefix_sums(b + np.array(rerun_sel)),
                        fwd_layer=f.tolist(), bwd_layer=b.tolist())
        self._times[key] = lt
        return lt

    def grad_accumulation_time(self, r: "ChipRates", params: float) -> float:
        """One micro-batch's parameter gradients added into the step's running sums: an h2x
        worker's backward does this with the backend's own add after the layer programs
        (executor/worker.py `_take_grads`), which the measured layer times do not contain. It is
        memory-bound: read both, write one, 3 x the gradient bytes at the copy bandwidth (llama_tiny,
        10.5 M parameters, torch, one thread: 9.9 ms measured, 12.7 ms from the 9.9 GB/s copy rate;
        a stage's backward ran 12-17 ms over its measured layers in `h2x run`). Charged on every
        micro-batch, the first too (which only keeps its gradients), so up to 1/m high. Catalog chips
        get none: a GPU trainer fuses it into the weight-gradient GEMM (Megatron-LM's
        gradient_accumulation_fusion)."""
        return 3.0 * params * self.la.grad_bytes / r.mem_bw

    # -- one stage ---------------------------------------------------------------------------
    def compute_times(self, chip: str, tp: int, a: int, b: int, recompute: str, ep: int = 1,
                      a2a: str = "flat", tp_estimate: bool = True, ep_geo=None,
                      capacity: float | None = None, tp_cross: bool = False) -> tuple[float, float]:
        lt = self.layer_times(chip, tp, ep, a2a, tp_estimate, ep_geo, capacity, tp_cross)
        f = lt.fwd[b] - lt.fwd[a]
        bw = {"full": lt.bwd_rc, "selective": lt.bwd_sel}.get(recompute, lt.bwd)
        return f, bw[b] - bw[a]

    def boundary_bytes(self, b: int) -> float:
        """Bytes of one micro-batch's activations leaving a stage that ends before layer b."""
        return float(self.la.out[b - 1])

    def dp_allreduce_time(self, chip: str, tp: int, dp: int, a: int, b: int, ep: int = 1,
                          placement: LinePlacement | None = None, stage: int = 0) -> float:
        """Gradient all-reduce over the stage's dp replicas (data parallelism; Patarasuk & Yuan
        ring); gradients in the training dtype's grad width. With `placement` (the line the
        stage is `stage` of) the ring runs over the links the build's hosts give it."""
        if dp <= 1:
            return 0.0
        dev = self.la.device(tp, ep)
        return self.grad_allreduce_time(chip, tp, dp, (dev.P_params[b] - dev.P_params[a]) * self.la.grad_bytes,
                                        placement, stage)

    def grad_allreduce_time(self, chip: str, tp: int, dp: int, nbytes: float,
                            placement: LinePlacement | None = None, stage: int = 0) -> float:
        """Without `placement`: replicas assumed on consecutive chips (`replica_geometry`)."""
        if dp <= 1:
            return 0.0
        if placement is not None:
            return placement.allreduce_time(stage, nbytes)
        g = self.cluster.group(chip)
        return group_allreduce_time(nbytes, g, replica_geometry(g, dp, tp))

    def opt_step_coef(self, chip: str) -> float:
        """Seconds per parameter (per device) of the optimizer step. AdamW is elementwise and
        memory-bound (roofline, Williams et al. 2009): it reads every state byte (weights,
        grads, optimizer) and writes back weights and optimizer state; at the rate the
        backend's own step was measured at (`opt_bw`), else the copy bandwidth."""
        st = self.la.state
        r = self.rates(chip)
        return (st.total + st.weights + st.optimizer) / (r.opt_bw or r.mem_bw)

    def opt_step_time(self, chip: str, tp: int, a: int, b: int, ep: int = 1) -> float:
        dev = self.la.device(tp, ep)
        return (dev.P_params[b] - dev.P_params[a]) * self.opt_step_coef(chip)

    def program_comm_time(self, chip: str, volumes: list, cross: bool = False) -> float:
        """Seconds of a stage program's collectives: `volumes` are the op set's comm_volume
        triples (collective, payload bytes, group size) of its COMM nodes, each all-reduce a
        ring over the TP group's links (`tp_allreduce_time`; `cross`: the group spans hosts)."""
        g = self.cluster.group(chip)
        return sum(tp_allreduce_time(nbytes, g, n, cross) for kind, nbytes, n in volumes
                   if kind == "all_reduce" and n > 1)

    def stage_times(self, plan: Plan, j: int, program_comm: tuple | None = None) -> StageTimes:
        """`program_comm` = (forward volumes, backward volumes) of the stage's compiled
        programs' collectives replaces the per-layer TP estimate (Megatron's two all-reduces
        per block) with the programs' own."""
        S = plan.num_stages
        st = plan.stages[j]
        ep = plan.stage_ep(j)
        a2a = plan.moe.a2a if plan.moe else "flat"
        a, b = stage_layer_range(plan, j, self.la.names)
        # links as the build's hosts give them (LinePlacement: worker_hosts, shared NICs)
        place = self.plan_placement(plan)
        # the all-to-all over the hosts the stage's EP groups really occupy
        geo = place.ep_geometry(j, ep) if ep > 1 and plan.dp % ep == 0 else None
        cross = st.tp > 1 and place.tp_crosses(j)
        f, bw = self.compute_times(st.chip, st.tp, a, b, st.recompute, ep, a2a,
                                   tp_estimate=program_comm is None, ep_geo=geo,
                                   capacity=capacity_of(plan), tp_cross=cross)
        if program_comm is not None:
            f += self.program_comm_time(st.chip, program_comm[0], cross)
            bw += self.program_comm_time(st.chip, program_comm[1], cross)
        send_act = send_grad = 0.0
        if j + 1 < S:
            send_act = hockney_time(self.boundary_bytes(b), place.boundary(j))
        if j > 0:
            send_grad = hockney_time(self.boundary_bytes(a), place.boundary(j - 1))
        # (expert gradients ring over all dp replicas here, not the dp / ep that hold the
        # same experts: an over-estimate of their share)
        allreduce, opt, rs, ag = self.step_end_times(st.chip, st.tp, plan.dp, a, b, ep, st.zero,
                                                     place, j)
        return StageTimes(fwd_s=f, bwd_s=bw, send_act_s=send_act, send_grad_s=send_grad,
                          dp_allreduce_s=allreduce, opt_step_s=opt,
                          tied_s=self.tied_time(plan, j), reduce_scatter_s=rs, all_gather_s=ag)

    def step_end_times(self, chip: str, tp: int, dp: int, a: int, b: int, ep: int = 1,
                       zero: int = 0, placement: LinePlacement | None = None,
                       stage: int = 0) -> tuple[float, float, float, float]:
        """(gradient all-reduce, optimizer step, reduce-scatter, all-gather) at the end of a
        step of a stage of layers [a, b); under ZeRO-1 (`zero`, dp > 1) the all-reduce is its
        two halves (`zero_collective_times`) and the optimizer step updates 1/dp of the
        parameters. The search's bound charges the same (`StageLine.tail_of`)."""
        opt = self.opt_step_time(chip, tp, a, b, ep)
        if not (zero and dp > 1):
            return self.dp_allreduce_time(chip, tp, dp, a, b, ep, placement, stage), opt, 0.0, 0.0
        rs, ag = self.zero_collective_times(chip, tp, dp, a, b, ep, placement, stage)
        return rs + ag, opt / dp, rs, ag

    def zero_collective_times(self, chip: str, tp: int, dp: int, a: int, b: int, ep: int = 1,
                              placement: LinePlacement | None = None,
                              stage: int = 0) -> tuple[float, float]:
        """ZeRO-1 (Rajbhandari et al. SC'20, Sec. 7.2.1): (reduce-scatter of the gradients,
        all-gather of the updated weights), each one half of a ring all-reduce (Thakur et al.
        2005 Sec. 4): (n-1)/n of its bytes and n-1 latencies. In fp32 the gradients and weights
        have one width, so the two together move what the all-reduce did."""
        dev = self.la.device(tp, ep)
        p = dev.P_params[b] - dev.P_params[a]
        rs = self.grad_allreduce_time(chip, tp, dp, p * self.la.grad_bytes, placement, stage) / 2
        ag = self.grad_allreduce_time(chip, tp, dp, p * self.la.state.weights, placement,
                                      stage) / 2
        return rs, ag

    def tied_time(self, plan: Plan, j: int) -> float:
        """One hand-over of stage j's tied tensors to or from its counterpart stage (the other
        end of the embedding/head tie: the first or the last stage), over the p2p path."""
        nbytes = tied_exchange_bytes(self.costs, plan, j)
        if not nbytes:
            return 0.0
        other = plan.num_stages - 1 if j == 0 else 0
        return hockney_time(nbytes, self.plan_placement(plan).boundary(j, other))

    def stage_flops(self, plan: Plan, j: int) -> float:
        """Model FLOPs (forward + backward, no recompute) of one micro-batch on stage j, all TP."""
        a, b = stage_layer_range(plan, j, self.la.names)
        return float(self.la.fwd_flops[a:b].sum() + self.la.bwd_flops[a:b].sum())
