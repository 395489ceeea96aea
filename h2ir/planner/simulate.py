"""Discrete-event simulation of a plan's per-worker instruction streams.

The simulator is an interpreter of the same `Instr` streams the executor runs
(`h2ir.schedule.streams.build_streams`); it differs only in what executing one instruction means: here,
advancing a worker's clock by the resource model's duration (`h2ir/planner/resource.py`).

- `fwd` / `bwd` occupy the worker's compute lane for the stage's per-micro-batch time.
- `send_*` are asynchronous: the transfer occupies the sender's comm lane (one link queue per
  worker), the compute lane moves on. `recv_*` waits until the matching send has arrived.
- `all_reduce` is a barrier over its group: it starts when every member has reached it and the
  link is free, and takes the data-parallel all-reduce time for the stage.
- `opt_step` is memory-bound: state bytes touched / memory bandwidth.

Replicas of a pipeline run identical streams, so by default only replica 0 is simulated
(`symmetric=True`); every member of an all-reduce group then arrives at the same time. The full
simulation (`symmetric=False`) is kept for tests that check the symmetry argument.

The trace writer takes plain `TraceEvent`s so that the executor's measured trace and this
predicted one come out in the same Chrome/Perfetto shape.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from h2ir.clusters.cluster import Cluster
from h2ir.costs import ModelCosts
from h2ir.errors import H2Error
from h2ir.plans.plan import Plan
from h2ir.planner.resource import MemoryBreakdown, ResourceModel, StageTimes, stage_memory
from h2ir.schedule.streams import Instr, build_streams


# ----------------------------------------------------------------------------------------------
# traces (shared with the executor's measured trace)

@dataclass(frozen=True)
class TraceEvent:
    worker: int
    lane: str              # 'compute' | 'comm'
    name: str              # 'F3', 'B3', 'send_act 3', 'all_reduce grads', 'opt_step'
    start_s: float
    dur_s: float
    args: dict | None = None


LANES = ("compute", "comm")


def chrome_trace(events: list[TraceEvent], worker_names: dict[int, str] | None = None,
                 metadata: dict | None = None) -> dict:
    """Chrome/Perfetto trace JSON: one process per worker, one thread per lane, 'X' events in µs."""
    out = []
    workers = sorted({e.worker for e in events} | set(worker_names or {}))
    lanes = list(LANES) + sorted({e.lane for e in events} - set(LANES))
    for w in workers:
        out.append({"ph": "M", "name": "process_name", "pid": w, "tid": 0,
                    "args": {"name": (worker_names or {}).get(w, f"w{w}")}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": w, "tid": 0, "args": {"sort_index": w}})
        for i, lane in enumerate(lanes):
            out.append({"ph": "M", "name": "thread_name", "pid": w, "tid": i, "args": {"name": lane}})
    tid = {lane: i for i, lane in enumerate(lanes)}
    for e in sorted(events, key=lambda e: (e.worker, e.start_s)):
        ev = {"ph": "X", "name": e.name, "pid": e.worker, "tid": tid[e.lane],
              "ts": round(e.start_s * 1e6, 3), "dur": round(e.dur_s * 1e6, 3),
              "cat": e.lane}
        if e.args:
            ev["args"] = e.args
        out.append(ev)
    d = {"traceEvents": out, "displayTimeUnit": "ms"}
    if metadata:
        d["otherData"] = metadata
    return d


def write_chrome_trace(path: str | Path, events: list[TraceEvent],
                       worker_names: dict[int, str] | None = None, metadata: dict | None = None) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(chrome_trace(events, worker_names, metadata)))
    return p


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

    @property
    def fits(self) -> bool:
        return all(m.fits for m in self.stage_memory)

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

class _Blocked(Exception):
    pass


class StreamSimulator:
    """Times the instruction streams of one plan. One method per opcode, like torch.fx's
    Interpreter; `run` drives the workers until every stream has finished."""

    def __init__(self, plan: Plan, times: list[StageTimes], streams: dict[int, list[Instr]],
                 workers: list[int], record: bool = True):
        self.plan = plan
        self.S = plan.num_stages
        self.times = times
        self.streams = streams
        self.workers = workers
        self.simulated = set(workers)
        self.record = record
        self.clock = {w: 0.0 for w in workers}
        self.link_free = {w: 0.0 for w in workers}
        self.arrivals: dict[tuple, float] = {}
        self.barriers: dict[tuple, dict] = {}
        self.ar_count = {w: 0 for w in workers}
        self.inflight = {w: 0 for w in workers}
        self.inflight_peak = {w: 0 for w in workers}
        self.busy = {w: 0.0 for w in workers}
        self.last_bwd_end = {w: 0.0 for w in workers}
        self.events: list[TraceEvent] = []

    def stage(self, w: int) -> int:
        return w % self.S

    def _emit(self, w, lane, name, start, dur):
        if self.record:
            self.events.append(TraceEvent(w, lane, name, start, dur))

    # -- opcodes ----------------------------------------------------------------------------
    def fwd(self, w: int, ins: Instr):
        d = self.times[self.stage(w)].fwd_s
        self._emit(w, "compute", f"F{ins.mb}", self.clock[w], d)
        self.clock[w] += d
        self.busy[w] += d
        self.inflight[w] += 1
        self.inflight_peak[w] = max(self.inflight_peak[w], self.inflight[w])

    def bwd(self, w: int, ins: Instr):
        d = self.times[self.stage(w)].bwd_s
        self._emit(w, "compute", f"B{ins.mb}", self.clock[w], d)
        self.clock[w] += d
        self.busy[w] += d
        self.inflight[w] -= 1
        self.last_bwd_end[w] = self.clock[w]

    def _send(self, w: int, ins: Instr, kind: str, dur: float):
        start = max(self.clock[w], self.link_free[w])
        self.link_free[w] = start + dur
        self.arrivals[(kind, ins.mb, w, ins.peer)] = start + dur
        self._emit(w, "comm", f"send_{kind} {ins.mb}", start, dur)

    def _recv(self, w: int, ins: Instr, kind: str):
        key = (kind, ins.mb, ins.peer, w)
        if key not in self.arrivals:
            if ins.peer not in self.simulated:
                raise H2Error(f"worker w{w} receives from w{ins.peer}, which is not simulated")
            raise _Blocked
        self.clock[w] = max(self.clock[w], self.arrivals.pop(key))

    def send_act(self, w, ins):
        self._send(w, ins, "act", self.times[self.stage(w)].send_act_s)

    def send_grad(self, w, ins):
        self._send(w, ins, "grad", self.times[self.stage(w)].send_grad_s)

    def recv_act(self, w, ins):
        self._recv(w, ins, "act")

    def recv_grad(self, w, ins):
        self._recv(w, ins, "grad")

    def all_reduce(self, w, ins):
        members = [g for g in ins.group if g in self.simulated]
        key = (ins.group, self.ar_count[w])
        bar = self.barriers.setdefault(key, {"arrived": {}, "end": None})
        if w not in bar["arrived"]:
            bar["arrived"][w] = max(self.clock[w], self.link_free[w])
        if bar["end"] is None:
            if len(bar["arrived"]) < len(members):
                raise _Blocked
            start = max(bar["arrived"].values())
            # members are replicas of one stage, so they share one all-reduce time
            dur = self.times[self.stage(w)].dp_allreduce_s
            bar["start"], bar["end"] = start, start + dur
        self._emit(w, "comm", "all_reduce grads", bar["start"], bar["end"] - bar["start"])
        self.clock[w] = bar["end"]
        self.link_free[w] = bar["end"]
        self.ar_count[w] += 1

    def all_to_all(self, w, ins):
        # MoE token exchange is costed inside fwd/bwd (resource model); the stream op is a no-op
        pass

    def opt_step(self, w, ins):
        d = self.times[self.stage(w)].opt_step_s
        self._emit(w, "compute", "opt_step", self.clock[w], d)
        self.clock[w] += d

    # -- driver -----------------------------------------------------------------------------
    def run(self) -> float:
        pc = {w: 0 for w in self.workers}
        remaining = set(self.workers)
        while remaining:
            progress = False
            for w in sorted(remaining):
                stream = self.streams[w]
                while pc[w] < len(stream):
                    ins = stream[pc[w]]
                    try:
                        getattr(self, ins.op)(w, ins)
                    except _Blocked:
                        break
                    pc[w] += 1
                    progress = True
                if pc[w] == len(stream):
                    remaining.discard(w)
                    progress = True
            if not progress:
                stuck = ", ".join(f"w{w}: {self.streams[w][pc[w]]}" for w in sorted(remaining))
                raise H2Error(f"instruction streams deadlock ({stuck})")
        return max(max(self.clock.values()), max(self.link_free.values()))


def _worker_name(plan: Plan, w: int) -> str:
    S = plan.num_stages
    st = plan.stages[w % S]
    return f"w{w} r{w // S} stage {w % S} {st.chip}" + (f" tp{st.tp}" if st.tp > 1 else "")


def simulate(costs: ModelCosts, plan: Plan, cluster: Cluster, calibration=None, *,
             symmetric: bool = True, record: bool = True,
             resource: ResourceModel | None = None) -> SimResult:
    """Simulate one training step of `plan`; durations from the resource model."""
    if plan.num_stages == 0:
        raise H2Error("plan has no stages", file=plan.source)
    if plan.global_batch % (plan.dp * plan.micro_batch) or plan.num_microbatches < 1:
        raise H2Error(f"global batch {plan.global_batch} is not a multiple of dp x micro-batch = "
                      f"{plan.dp} x {plan.micro_batch}", file=plan.source)
    rm = resource or ResourceModel(costs, cluster, plan.micro_batch, plan.seq_len, calibration)
    S, m = plan.num_stages, plan.num_microbatches
    times = [rm.stage_times(plan, j) for j in range(S)]
    if symmetric:
        # Replicas run the same stream up to worker ids, and replica 0's stream has the same
        # structure for every dp >= 2, so two replicas are built and replica 0 is timed (its
        # all-reduce takes the plan's dp-way time from the resource model).
        streams = build_streams(plan.schedule, S, m, min(plan.dp, 2))
        workers = list(range(S))
    else:
        streams = build_streams(plan.schedule, S, m, plan.dp)
        workers = sorted(streams)
    sim = StreamSimulator(plan, times, streams, workers, record=record)
    step = sim.run()

    flush = max(sim.last_bwd_end.values())
    busy_total = sum(sim.busy.values())
    bubble = 1.0 - busy_total / (len(workers) * flush) if flush > 0 else 0.0
    mem = []
    for j in range(S):
        peak = max(sim.inflight_peak[w] for w in workers if w % S == j)
        mem.append(stage_memory(rm.costs, plan, cluster, j, inflight=peak))

    # MFU per chip type: model FLOPs it executed (no recompute) / (its chips x peak x step)
    flops_by_chip: dict[str, float] = {}
    chips_by_chip: dict[str, int] = {}
    for j, st in enumerate(plan.stages):
        flops_by_chip[st.chip] = flops_by_chip.get(st.chip, 0.0) + rm.stage_flops(plan, j) * m * plan.dp
        chips_by_chip[st.chip] = chips_by_chip.get(st.chip, 0) + st.chips
    mfu = {c: f / (chips_by_chip[c] * rm.rates(c).peak_flops * step) for c, f in flops_by_chip.items()}

    return SimResult(step_time_s=step, bubble_fraction=bubble, flush_time_s=flush, stage_times=times,
                     stage_memory=mem, inflight_peak=dict(sim.inflight_peak), busy_s=dict(sim.busy),
                     tokens_per_s=plan.global_batch * plan.seq_len / step, mfu=mfu,
                     events=sim.events, worker_names={w: _worker_name(plan, w) for w in workers})
