"""Discrete-event simulation of a plan's per-worker instruction streams.

The simulator is the second interpreter of the streams the executor runs: `SimulatedWorker`
subclasses `h2ir.schedule.interpret.StreamInterpreter` as the executor's `Worker` does, and
differs only in what executing one instruction means: here, advancing a worker's clock by the
resource model's duration (`h2ir/planner/resource/`). `h2x run` and `h2c compile` pass it the
stream files of a build; `h2c plan` and the search let it build the plan's streams.

- `fwd` / `bwd` occupy the worker's compute lane for the stage's per-micro-batch time.
- `send_*` are asynchronous: the transfer occupies the sender's comm lane (one link queue per
  worker), the compute lane moves on. `recv_*` waits until the matching send has arrived.
- A tensor-parallel stage's `fwd`/`bwd` include its programs' collectives (`program_comm`:
  the op set's comm volumes of the compiled programs, timed by the resource model's intra-node
  links), or the resource model's per-layer estimate for plans not yet compiled.
- Redistribution between TP degrees: each sender's share goes to every receiver; a receive
  waits for every sender's share.
- `all_reduce` is a barrier over its group: it starts when every member has reached it and the
  link is free, and takes the data-parallel all-reduce time for the stage; ZeRO-1's
  `reduce_scatter` and `all_gather` likewise, each with its half of the ring.
- `opt_step` is memory-bound: state bytes touched / memory bandwidth.

Replicas of a pipeline run identical streams, so for built streams only replica 0 is simulated
by default (`symmetric=True`); every member of an all-reduce group then arrives at the same time.
The full simulation (`symmetric=False`) is kept for tests that check the symmetry argument.

Predicted timelines are `h2ir.schedule.trace.TraceEvent`s, the shape of the executor's measured
ones, and `SimResult.grid()` turns one into schedule.csv's grid.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from h2ir.clusters.cluster import Cluster
from h2ir.costs import ModelCosts
from h2ir.errors import H2Error
from h2ir.opset import comm_volume
from h2ir.plans.plan import Plan
from h2ir.planner.calibration import contention
from h2ir.planner.resource import MemoryBreakdown, ResourceModel, StageTimes, stage_memory
from h2ir.schedule.grid import ScheduleGrid, grid_from_events
from h2ir.schedule.interpret import StreamInterpreter
from h2ir.schedule.streams import (Instr, WorkerLayout, build_streams, chunk_stages,
                                   tied_stage_groups, worker_hosts)
from h2ir.schedule.trace import TraceEvent, chrome_trace


# ----------------------------------------------------------------------------------------------
# result

@dataclass
class SimResult:
    step_time_s: float
    bubble_fraction: float            # idle share of compute lanes until the pipeline flush
    flush_time_s: float               # when the last backward ends
    stage_times: list[StageTimes]
    stage_memory: list[MemoryBreakdown]   # per stage, peak per device, from the tracked in-flight count
    inflight_peak: dict[int, int]     # worker -> max micro-batches with live activations
    busy_s: dict[int, float]          # worker -> forward+backward seconds
    tokens_per_s: float
    mfu: dict[str, float]             # chip type -> model FLOPs / (chips x peak) over the step
    events: list[TraceEvent] = field(default_factory=list)
    worker_names: dict[int, str] = field(default_factory=dict)
    stage_of: dict[int, int] = field(default_factory=dict)    # simulated worker -> its stage
    # virtual-stage schedules: the stages (chunks) of each worker, which share its device
    chunk_groups: list[list[int]] | None = None
    # layers of stages on `measured` chips that had no measured layer time (FLOP estimate)
    estimated_layers: list = field(default_factory=list)
    planned_layers: int = 0                               # layers over the plan's stages

    def estimate_note(self) -> str | None:
        """What a prediction from FLOP-estimated layer times leaves out (None: every layer of a
        measured chip had measured times)."""
        if not self.estimated_layers:
            return None
        n, total = len(self.estimated_layers), self.planned_layers
        return (f"{'all ' if n == total else ''}{n}{'' if n == total else f' of {total}'} "
                "layers' times are a FLOP estimate (no measured times of this model at this "
                "micro-batch and sequence length on this host): it leaves out per-op and "
                "memory-bound work and runs low, far low for a small model")

    @property
    def fits(self) -> bool:
        if self.chunk_groups:
            return all(sum(self.stage_memory[j].total for j in g)
                       <= self.stage_memory[g[0]].capacity for g in self.chunk_groups)
        return all(m.fits for m in self.stage_memory)

    def grid(self, slot_s: float | None = None) -> ScheduleGrid:
        """The predicted timeline as schedule.csv's time-aligned grid (needs `record`)."""
        return grid_from_events(self.events, self.stage_of, slot_s)

    def trace(self) -> dict:
        return chrome_trace(self.events, self.worker_names,
                            {"kind": "predicted", "step_time_s": self.step_time_s})

    def to_json(self) -> dict:
        return {"step_time_s": self.step_time_s, "bubble_fraction": self.bubble_fraction,
                "tokens_per_s": self.tokens_per_s, "mfu": self.mfu,
                "stage_memory": [{"total": m.total, "capacity": m.capacity, "items": m.items,
                                  "inflight": m.inflight} for m in self.stage_memory]}


# ----------------------------------------------------------------------------------------------
# the interpreter

class StreamDeadlock(H2Error):
    """The instruction streams wait on each other: no worker can take its next instruction."""


class _Blocked(Exception):
    """A receive or barrier whose data has not arrived yet: the worker waits, others go on."""


@dataclass
class Timeline:
    """What the simulated workers share: clocks, link queues, arrivals, barriers, events."""
    record: bool = True
    clock: dict = field(default_factory=dict)           # worker -> compute lane's time
    link_free: dict = field(default_factory=dict)       # worker -> when its send queue is free
    arrivals: dict = field(default_factory=dict)        # (kind, mb, src, dst) -> arrival time
    barriers: dict = field(default_factory=dict)        # (group, index) -> {arrived, start, end}
    events: list = field(default_factory=list)
    # shared CPU cores (`Cluster.shared_cores`): (worker, pc) -> how much longer that compute
    # takes than alone, and every compute's (worker, pc, start, end) for the next estimate
    stretch: dict = field(default_factory=dict)
    computes: list | None = None

    def emit(self, w, lane, name, start, dur):
        if self.record:
            self.events.append(TraceEvent(w, lane, name, start, dur))


@dataclass
class Chunks:
    """A virtual-stage worker's chunks: their virtual stages, times and B shares, and where
    the other stages run (to tag tied-parameter transfers by the holder's stage)."""
    vstages: list[int]
    times: list[StageTimes]
    b_fractions: list[float]
    host: dict                       # virtual stage -> worker id (this replica)
    ties: dict                       # owner stage -> holder stages

    def holder_on(self, owner: int, worker: int) -> int:
        return next(h for h in self.ties.get(owner, ()) if self.host[h] == worker)


class SimulatedWorker(StreamInterpreter):
    """One worker's stream timed with its stage's durations (`StageTimes`)."""

    def __init__(self, wid: int, stream: list[Instr], times: StageTimes, timeline: Timeline,
                 simulated: set, b_fraction: float = 0.5, chunks: "Chunks | None" = None):
        super().__init__(wid, stream)
        self.times, self.tl, self.simulated = times, timeline, simulated
        # zero-bubble: the share of the backward its input-gradient part (B) takes (FLOPs of
        # the build's split programs), the rest is W
        self.b_fraction = b_fraction
        self.chunks = chunks            # virtual stages: this worker's chunks and their times
        timeline.clock[wid] = timeline.link_free[wid] = 0.0
        self.ar_count = 0
        self.inflight = self.inflight_peak = 0
        self.chunk_inflight: dict[int, int] = {}
        self.chunk_peak: dict[int, int] = {}
        self.busy = self.last_bwd_end = 0.0

    def _t(self, ins) -> StageTimes:
        return self.times if ins.chunk is None else self.chunks.times[ins.chunk]

    def _frac(self, ins) -> float:
        return self.b_fraction if ins.chunk is None else self.chunks.b_fractions[ins.chunk]

    def _count(self, ins, d: int):
        self.inflight += d
        self.inflight_peak = max(self.inflight_peak, self.inflight)
        if ins.chunk is not None:
            n = self.chunk_inflight.get(ins.chunk, 0) + d
            self.chunk_inflight[ins.chunk] = n
            self.chunk_peak[ins.chunk] = max(self.chunk_peak.get(ins.chunk, 0), n)

    def _name(self, kind: str, ins) -> str:
        return f"{kind}{ins.mb}" + ("" if ins.chunk is None else f"c{ins.chunk}")

    def _tag(self, ins, kind: str, sending: bool):
        """What tells apart two transfers between one pair of workers: the virtual stage
        that sends an activation or gradient; for tied parameters the holder's stage."""
        if ins.chunk is None:
            return None
        ch = self.chunks
        v = ch.vstages[ins.chunk]
        if kind == "act":
            return v if sending else v - 1
        if kind == "grad":
            return v if sending else v + 1
        holder_sends = kind == "tied_grads"
        if sending == holder_sends:     # the holder: its own stage
            return v
        return ch.holder_on(v, ins.peer)

    def _compute(self, name: str, dur: float) -> float:
        """Occupy the compute lane for `dur` (stretched where cores are shared); returns the
        time it took."""
        w, tl = self.wid, self.tl
        dur *= tl.stretch.get((w, self.pc), 1.0)
        start = tl.clock[w]
        tl.emit(w, "compute", name, start, dur)
        tl.clock[w] += dur
        if tl.computes is not None:
            tl.computes.append((w, self.pc, start, start + dur))
        return dur

    def fwd(self, ins):
        t = self._t(ins)
        self.busy += self._compute(self._name("F", ins), t.fwd_s)
        self._count(ins, 1)

    def bwd(self, ins):
        t = self._t(ins)
        self.busy += self._compute(self._name("B", ins), t.bwd_s)
        self._count(ins, -1)
        self.last_bwd_end = self.tl.clock[self.wid]

    def bwd_input(self, ins):
        dur = self._t(ins).bwd_s * self._frac(ins)
        self.busy += self._compute(self._name("I", ins), dur)

    def bwd_weight(self, ins):
        dur = self._t(ins).bwd_s * (1.0 - self._frac(ins))
        self.busy += self._compute(self._name("W", ins), dur)
        self._count(ins, -1)
        self.last_bwd_end = self.tl.clock[self.wid]

    def _send(self, ins, kind: str, dur: float):
        """One send, or a TP sender's share to every receiver: `dur` is the resource model's
        time of the whole boundary transfer with every sender's share in flight at once. A
        transfer between two chunks of one worker costs nothing."""
        w, tl = self.wid, self.tl
        tag = self._tag(ins, kind, True)
        if ins.peers == (w,):
            tl.arrivals[(kind, ins.mb, w, w, tag)] = tl.clock[w]
            return
        start = max(tl.clock[w], tl.link_free[w])
        tl.link_free[w] = start + dur
        for peer in ins.peers:
            tl.arrivals[(kind, ins.mb, w, peer, tag)] = start + dur
        tl.emit(w, "comm", f"send_{kind}" + (f" {ins.mb}" if ins.mb >= 0 else ""), start, dur)

    def _recv(self, ins, kind: str):
        tag = self._tag(ins, kind, False)
        keys = [(kind, ins.mb, peer, self.wid, tag) for peer in ins.peers]
        for peer, key in zip(ins.peers, keys):
            if key not in self.tl.arrivals:
                if peer not in self.simulated:
                    raise H2Error(f"worker w{self.wid} receives from w{peer}, which is not "
                                  "simulated")
                raise _Blocked
        for key in keys:
            self.tl.clock[self.wid] = max(self.tl.clock[self.wid], self.tl.arrivals.pop(key))

    def send_act(self, ins):
        self._send(ins, "act", self._t(ins).send_act_s)

    def send_grad(self, ins):
        self._send(ins, "grad", self._t(ins).send_grad_s)

    def recv_act(self, ins):
        self._recv(ins, "act")

    def recv_grad(self, ins):
        self._recv(ins, "grad")

    # tied parameters: one tensor set each way per step, queued on the sender's link like any
    # send; the key has no micro-batch (-1: one exchange of each kind per step)
    def send_tied_grads(self, ins):
        self._send(Instr(ins.op, -1, ins.peer, chunk=ins.chunk), "tied_grads",
                   self._t(ins).tied_s)

    def recv_tied_grads(self, ins):
        self._recv(Instr(ins.op, -1, ins.peer, chunk=ins.chunk), "tied_grads")

    def send_tied_params(self, ins):
        self._send(Instr(ins.op, -1, ins.peer, chunk=ins.chunk), "tied_params",
                   self._t(ins).tied_s)

    def recv_tied_params(self, ins):
        self._recv(Instr(ins.op, -1, ins.peer, chunk=ins.chunk), "tied_params")

    def all_reduce(self, ins):
        self._collective(ins, "all_reduce grads", self._t(ins).dp_allreduce_s)

    # ZeRO-1: the all-reduce's two halves, around an optimizer step on 1/dp of the parameters
    def reduce_scatter(self, ins):
        self._collective(ins, "reduce_scatter grads", self._t(ins).reduce_scatter_s)

    def all_gather(self, ins):
        self._collective(ins, "all_gather params", self._t(ins).all_gather_s)

    def _collective(self, ins, name: str, dur: float):
        w, tl = self.wid, self.tl
        members = [g for g in ins.group if g in self.simulated]
        bar = tl.barriers.setdefault((ins.group, self.ar_count, ins.chunk),
                                     {"arrived": {}, "end": None})
        if w not in bar["arrived"]:
            bar["arrived"][w] = max(tl.clock[w], tl.link_free[w])
        if bar["end"] is None:
            if len(bar["arrived"]) < len(members):
                raise _Blocked
            start = max(bar["arrived"].values())
            # members are replicas of one stage, so they share one collective time
            bar["start"], bar["end"] = start, start + dur
        tl.emit(w, "comm", name, bar["start"], bar["end"] - bar["start"])
        tl.clock[w] = tl.link_free[w] = bar["end"]
        self.ar_count += 1

    def all_to_all(self, ins):
        # MoE token exchange is costed inside fwd/bwd (resource model); the stream op is a no-op
        pass

    def opt_step(self, ins):
        self._compute("opt_step", self._t(ins).opt_step_s)

    def migrate(self, ins):
        # expert migration at the step boundary (h2ir/schedule/streams.py): a load exchange in
        # every step, weights moved only when the policy fires; not costed (amortised over the
        # policy's interval, and zero on the steps it does not fire)
        pass


def run_streams(workers: list[SimulatedWorker]) -> float:
    """Advance every worker as far as its data allows, round after round, until all streams end;
    returns the step time (the last clock or link to go idle)."""
    remaining = {w.wid: w for w in workers}
    while remaining:
        progress = False
        for wid in sorted(remaining):
            sw = remaining[wid]
            while sw.pc < len(sw.stream):
                try:
                    sw.run_instr(sw.stream[sw.pc])
                except _Blocked:
                    break
                sw.pc += 1
                progress = True
            if sw.pc == len(sw.stream):
                del remaining[wid]
                progress = True
        if not progress:
            stuck = ", ".join(f"w{w}: {remaining[w].stream[remaining[w].pc]}" for w in sorted(remaining))
            raise StreamDeadlock(f"instruction streams deadlock ({stuck})")
    tl = workers[0].tl if workers else Timeline()
    return max(max(tl.clock.values(), default=0.0), max(tl.link_free.values(), default=0.0))


def plan_layout(plan: Plan) -> WorkerLayout:
    """The worker layout of a plan: dp replicas of its stages, stage s with tp ranks (with
    virtual stages: of its workers, each holding `plan.virtual` chunks)."""
    if plan.is_virtual:
        return WorkerLayout(plan.dp, (1,) * plan.num_physical)
    return WorkerLayout(plan.dp, tuple(st.tp for st in plan.stages))


def plan_chunks(plan: Plan) -> list[list[int]]:
    """Per physical stage, the stages (chunks) its worker runs: [[0], [1], ...] without
    virtual stages."""
    if not plan.is_virtual:
        return [[s] for s in range(plan.num_stages)]
    return chunk_stages(plan.schedule, plan.num_physical, plan.virtual)


def _one_rank_layout(plan: Plan) -> WorkerLayout:
    """The layout with one worker per stage: the tp ranks of a stage run the same stream, each
    sender's share of a boundary tensor is timed as the whole transfer and a receive waits for
    all shares, which arrive together, so rank 0 alone times the stage (`simulate(one_rank=)`,
    the search's fast path; a test checks it against every rank)."""
    return WorkerLayout(plan.dp, (1,) * plan.num_stages)


def _worker_name(plan: Plan, w: int) -> str:
    r, s, k = plan_layout(plan).where(w)
    if plan.is_virtual:
        cs = plan_chunks(plan)[s]
        return f"w{w} r{r} stages {'+'.join(map(str, cs))} {plan.stages[cs[0]].chip}"
    st = plan.stages[s]
    return f"w{w} r{r} stage {s} {st.chip}" + (f" tp{st.tp} rank {k}" if st.tp > 1 else "")


def simulate(costs: ModelCosts, plan: Plan, cluster: Cluster, calibration=None, *,
             streams: dict[int, list[Instr]] | None = None, workers: list[int] | None = None,
             symmetric: bool = True, record: bool = True,
             resource: ResourceModel | None = None,
             program_comm: dict | None = None, one_rank: bool = False,
             b_fractions: dict | None = None) -> SimResult:
    """Simulate one training step of `plan`; durations from the resource model.

    `streams` are the instruction streams to time — a build's stream files, as h2x and h2c
    compile pass them — keyed by worker id (`WorkerLayout`: replica, stage, tp rank); without
    them the plan's streams are built here. `program_comm` (stage -> (forward, backward) comm
    volumes of its compiled programs) times TP stages by their programs' collectives. `workers` limits the simulation to some workers (their peers'
    transfers must come from inside the set); by default every worker of `streams` is simulated,
    or, for built streams with `symmetric`, the first replica only: replicas run the same stream
    up to worker ids, so replica 0 is timed and its all-reduce takes the plan's dp-way time.
    `one_rank` (built streams only) times each stage by its tp rank 0 (`_one_rank_layout`).
    `b_fractions` (stage -> share of its backward FLOPs in the input-gradient part) times a
    zero-bubble schedule's bwd_input / bwd_weight; without it a split stage is timed 50/50."""
    _check_batch(plan)
    rm = resource or ResourceModel(costs, cluster, plan.micro_batch, plan.seq_len, calibration)
    lay = plan_layout(plan)
    if one_rank and streams is None and symmetric and not plan.is_virtual:
        lay = _one_rank_layout(plan)
    times = _stage_times(rm, plan, program_comm or {})
    ties = tied_stage_groups(costs.ties, [list(s.layers) for s in plan.stages])
    if streams is None:
        streams = _plan_streams(plan, lay, times, ties, symmetric, b_fractions or {})
        if symmetric:
            workers = workers or list(range(lay.per_replica))
    workers = sorted(workers if workers is not None else streams)
    _check_workers(plan, lay, streams, workers)
    stage_of = {w: lay.where(w)[1] for w in workers}
    simulated = set(workers)
    tl = Timeline(record=record)
    fr = b_fractions or {}
    groups = plan_chunks(plan)

    def run_once(stretch: dict, computes: list | None):
        tl = Timeline(record=record, stretch=stretch, computes=computes)
        sims = [SimulatedWorker(w, streams[w], times[groups[stage_of[w]][0]], tl, simulated,
                                fr.get(stage_of[w], 0.5),
                                _chunks_of(plan, lay, groups, times, fr, ties, w, stage_of[w]))
                for w in workers]
        return tl, sims, run_streams(sims)

    sharing = core_sharing(plan, cluster, rm, lay, workers)
    if sharing is not None:
        tl, sims, step = _shared_cores_fixed_point(run_once, sharing)
    else:
        tl, sims, step = run_once({}, None)

    return _result(plan, cluster, rm, lay, workers, stage_of, groups, times, tl, sims, step)


def _stage_times(rm: ResourceModel, plan: Plan, program_comm: dict) -> list[StageTimes]:
    """Each stage's times; a TP stage's by its compiled programs' collectives when given."""
    return [rm.stage_times(plan, j, program_comm.get(j) if plan.stages[j].tp > 1 else None)
            for j in range(plan.num_stages)]


def _plan_streams(plan: Plan, lay: WorkerLayout, times, ties, symmetric: bool,
                  b_fractions: dict) -> dict:
    """The plan's instruction streams (two replicas stand for all when `symmetric`)."""
    return build_streams(plan.schedule, plan.num_stages, plan.num_microbatches,
                         min(plan.dp, 2) if symmetric else plan.dp,
                         ties=ties, tp=None if plan.is_virtual else lay.tps,
                         virtual=plan.virtual, zero=[st.zero for st in plan.stages],
                         durations=chunk_durations(times, b_fractions))


def _result(plan: Plan, cluster: Cluster, rm: ResourceModel, lay: WorkerLayout, workers, stage_of,
            groups, times, tl, sims, step: float) -> SimResult:
    """The step's figures from the simulated workers: bubble, peak memory per stage, MFU."""
    flush = max(s.last_bwd_end for s in sims)
    busy_total = sum(s.busy for s in sims)
    bubble = 1.0 - busy_total / (len(sims) * flush) if flush > 0 else 0.0
    peak_of = _stage_peaks(plan, sims, groups, stage_of)
    mem = [stage_memory(rm.costs, plan, cluster, j, inflight=peak_of.get(j, 0))
           for j in range(plan.num_stages)]
    return SimResult(step_time_s=step, bubble_fraction=bubble, flush_time_s=flush, stage_times=times,
                     stage_memory=mem, inflight_peak={s.wid: s.inflight_peak for s in sims},
                     busy_s={s.wid: s.busy for s in sims},
                     tokens_per_s=plan.global_batch * plan.seq_len / step,
                     mfu=_mfu(rm, plan, step), events=tl.events,
                     worker_names=_worker_names(plan, lay, workers, stage_of),
                     stage_of=stage_of, chunk_groups=groups if plan.is_virtual else None,
                     estimated_layers=[l for st in plan.stages for l in st.layers
                                       if (st.chip, l) in rm.estimated],
                     planned_layers=sum(len(st.layers) for st in plan.stages))


def _check_workers(plan: Plan, lay: WorkerLayout, streams: dict, workers: list[int]):
    """Every worker to simulate has a stream and is one of the plan's workers."""
    for w in workers:
        if w not in streams:
            raise H2Error(f"no instruction stream for worker w{w}")
        if w >= lay.num_workers:
            raise H2Error(f"worker w{w} is outside the plan's {lay.num_workers} workers "
                          f"({plan.dp} replicas of {plan.num_stages} stages, tp {list(lay.tps)})")


def _chunks_of(plan: Plan, lay: WorkerLayout, groups, times, fr: dict, ties, w: int, stage: int):
    """Worker w's chunks under a virtual-stage schedule (None otherwise)."""
    if not plan.is_virtual:
        return None
    r = lay.where(w)[0]
    vs = groups[stage]
    return Chunks(vs, [times[v] for v in vs], [fr.get(v, 0.5) for v in vs],
                  {v: lay.wid(r, q) for q, g in enumerate(groups) for v in g}, ties)


def _stage_peaks(plan: Plan, sims, groups, stage_of: dict) -> dict[int, int]:
    """Stage -> the most micro-batches in flight on it (each chunk is a stage when virtual)."""
    peak_of: dict[int, int] = {}
    for sw in sims:
        if plan.is_virtual:
            pairs = [(v, sw.chunk_peak.get(c, 0)) for c, v in enumerate(groups[stage_of[sw.wid]])]
        else:
            pairs = [(stage_of[sw.wid], sw.inflight_peak)]
        for j, n in pairs:
            peak_of[j] = max(peak_of.get(j, 0), n)
    return peak_of


def _worker_names(plan: Plan, lay: WorkerLayout, workers: list[int], stage_of: dict) -> dict:
    """Each simulated worker's name; a one-rank layout says which tp rank stands for a stage."""
    full = lay.tps == plan_layout(plan).tps
    return {w: (_worker_name(plan, w) if full
                else f"w{w} stage {stage_of[w]} {plan.stages[stage_of[w]].chip} "
                f"tp rank 0 of {plan.stages[stage_of[w]].tp}")
            for w in workers}


def manifest_b_fractions(stages: list[dict]) -> dict:
    """stage -> its split backward's B share of FLOPs, from a build manifest's stage entries
    (those of a zero-bubble build carry "zero_bubble"): `simulate(b_fractions=)`."""
    return {i: st["zero_bubble"]["b_flops_fraction"] for i, st in enumerate(stages)
            if st.get("zero_bubble")}


def chunk_durations(times: list[StageTimes], b_fractions: dict) -> dict:
    """Per stage, (forward, input-gradient B, weight-gradient W) seconds of one micro-batch:
    what the zero-bubble list scheduler orders a virtual-stage pipeline by
    (h2ir/schedule/streams.py `_greedy_orders`), so its streams follow the stages' speeds."""
    out = {}
    for j, t in enumerate(times):
        fr = b_fractions.get(j, 0.5)
        out[j] = (t.fwd_s, t.bwd_s * fr, t.bwd_s * (1.0 - fr))
    return out


SHARING_ROUNDS = 12            # fixed-point rounds of the shared-core stretch (few are needed)


@dataclass(frozen=True)
class CoreSharing:
    """Who shares which CPU cores, for `_shared_cores_fixed_point`: per simulated worker, its
    chip's contention curve and how many workers it stands for on each set of shared cores
    (itself, and the replicas and TP ranks that run its stream unsimulated)."""
    curves: dict              # simulated worker -> {n: slow-down}
    weights: dict             # simulated worker -> {domain: workers it stands for there}
    cores: dict               # domain -> CPU cores


def core_sharing(plan: Plan, cluster: Cluster, rm: ResourceModel, lay: WorkerLayout,
                 workers: list[int]) -> CoreSharing | None:
    """The plan's workers on the cluster's sets of shared cores (`Cluster.node_domain`, nodes
    as `worker_hosts` assigns them), or None where no compute can be slowed: no set holds more
    of the plan's workers than cores, and no chip's measured contention curve rises."""
    if not cluster.shares_cores:
        return None
    real = plan_layout(plan)
    chips = [plan.stages[g[0]].chip for g in plan_chunks(plan)]
    nodes = worker_hosts(real, chips, cluster, renumber=False)
    domain = [cluster.node_domain(n) for n in nodes]
    per_domain: dict = {}
    for d in domain:
        if d is not None:
            per_domain[d] = per_domain.get(d, 0) + 1
    cores = {d: cluster.domain_cores(d) for d in per_domain}
    one_replica = {lay.where(w)[0] for w in workers} == {0} and real.dp > 1
    curves, weights = {}, {}
    for w in workers:
        r, j, _ = lay.where(w)
        chip = chips[j]
        curves[w] = rm.contention_curve(chip)
        stand = [v for q in (range(real.dp) if one_replica else (r,)) for v in real.tp_group(q, j)]
        weights[w] = {}
        for v in stand:
            if domain[v] is not None:
                weights[w][domain[v]] = weights[w].get(domain[v], 0) + 1
    crowded = any(n > cores[d] for d, n in per_domain.items())
    rising = any(max(c.values()) > 1.0 for c in curves.values())
    return CoreSharing(curves, weights, cores) if per_domain and (crowded or rising) else None


def _shared_cores_fixed_point(run_once, share: CoreSharing):
    """Time the streams on CPU cores that workers share (a fluid model): a compute that
    overlaps n computes of its set of shared cores on average (itself included; a simulated
    worker counts as every worker it stands for there) takes `contention(curve, n, cores)`
    times its alone duration: the chip's measured slow-down at n workers computing at once,
    time sharing past the measured ones (h2ir/planner/calibration.py). The stretch of every
    compute is found by iteration — simulate, measure each compute's overlap, stretch it,
    simulate again — damped, until the step time moves by less than 0.1 %."""
    stretch: dict = {}
    step = None
    for _ in range(SHARING_ROUNDS):
        computes: list = []
        tl, sims, new = run_once(stretch, computes)
        if step is not None and abs(new - step) <= 1e-3 * step:
            return tl, sims, new
        step = new
        if not computes:
            break
        iv = np.array([(c[2], c[3]) for c in computes], dtype=np.float64)
        pts = np.unique(iv.ravel())
        i0, i1 = np.searchsorted(pts, iv[:, 0]), np.searchsorted(pts, iv[:, 1])
        span = np.maximum(iv[:, 1] - iv[:, 0], 1e-15)
        factor = np.ones(len(computes))
        for d, cores in share.cores.items():
            # computing workers of set d on each elementary interval [pts[i], pts[i+1]), and
            # the running integral of that level
            wt = np.array([share.weights[c[0]].get(d, 0) for c in computes], dtype=np.float64)
            if not wt.any():
                continue
            delta = np.zeros(len(pts) + 1)
            np.add.at(delta, i0, wt)
            np.add.at(delta, i1, -wt)
            level = np.cumsum(delta)[:-1]
            area = np.concatenate([[0.0], np.cumsum(level[:-1] * np.diff(pts))])
            n = (area[i1] - area[i0]) / span
            for k, c in enumerate(computes):
                if wt[k]:
                    factor[k] = max(factor[k], contention(share.curves[c[0]], float(n[k]), cores))
        nxt = {}
        for (w, pc, _, _), target in zip(computes, factor.tolist()):
            nxt[(w, pc)] = 0.5 * stretch.get((w, pc), 1.0) + 0.5 * target
        stretch = nxt
    return tl, sims, step


def _check_batch(plan: Plan) -> None:
    if plan.num_stages == 0:
        raise H2Error("plan has no stages", file=plan.source)
    if plan.global_batch % (plan.dp * plan.micro_batch) or plan.num_microbatches < 1:
        raise H2Error(f"global batch {plan.global_batch} is not a multiple of dp x micro-batch = "
                      f"{plan.dp} x {plan.micro_batch}", file=plan.source)


def _mfu(rm: ResourceModel, plan: Plan, step: float) -> dict[str, float]:
    """MFU per chip type: model FLOPs it executed (no recompute) / (its chips x peak x step)."""
    flops_by_chip: dict[str, float] = {}
    chips_by_chip: dict[str, int] = {}
    leaders = {g[0] for g in plan_chunks(plan)}      # a worker's later chunks use its chips
    for j, st in enumerate(plan.stages):
        flops = rm.stage_flops(plan, j) * plan.num_microbatches * plan.dp
        flops_by_chip[st.chip] = flops_by_chip.get(st.chip, 0.0) + flops
        chips_by_chip[st.chip] = chips_by_chip.get(st.chip, 0) + (st.chips if j in leaders else 0)
    return {c: f / (chips_by_chip[c] * rm.rates(c).peak_flops * step) for c, f in flops_by_chip.items()}


# Above this many workers the build's streams are timed for the first replica only (the others
# run the same stream up to worker ids; h2ir/planner/simulate.py).
FULL_SIMULATION_MAX_WORKERS = 256


def simulate_build(costs, plan, cluster, cal, streams: dict,
                   program_comm: dict | None = None, b_fractions: dict | None = None) -> SimResult:
    """Time the streams a build holds: all of them, or replica 0's for very large plans;
    `program_comm` and `b_fractions` as `simulate`'s."""
    workers = None if len(streams) <= FULL_SIMULATION_MAX_WORKERS else \
        [w for w in streams if w < plan_layout(plan).per_replica]
    return simulate(costs, plan, cluster, cal, streams=streams, workers=workers,
                    program_comm=program_comm, b_fractions=b_fractions)


def program_comm_volumes(fwd, bwd) -> tuple[list, list]:
    """(forward, backward) comm volumes of a stage's programs (h2ir Graphs), for
    `simulate(program_comm=...)`: one (collective, bytes, group size) per COMM node."""

    def vols(g):
        out = []
        for n in g.nodes():
            v = comm_volume(n.op, [x.type if hasattr(x, "type") else x for x in n.inputs],
                            {**n.opdef.attrs, **n.attrs})
            if v is not None:
                out.append(v)
        return out
    return vols(fwd), vols(bwd)
