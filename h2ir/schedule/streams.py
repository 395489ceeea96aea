"""Per-worker instruction streams: the schedule as data.

A worker is one (replica, stage, tp rank) triple; `WorkerLayout` is the one map between worker
ids and triples (replica-major, then stage, then TP rank: with tp = 1 everywhere, worker id =
replica * S + stage). Each worker runs an ordered list of small instructions. The executor interprets them; the simulator times them with
the resource model (both subclass `h2ir.schedule.interpret.StreamInterpreter`). Every instruction
has a one-line text form that round-trips:

    fwd 3                   forward of micro-batch 3 (on stage 0 this also loads its input batch)
    bwd 3                   backward of micro-batch 3 (on the last stage this starts from the loss)
    bwd_input 3             zero-bubble schedules: the backward's part that makes the gradient
                            of the stage's inputs (B; what the previous stage waits for) ...
    bwd_weight 3            ... and the part that makes the parameter gradients (W), later
    send_act 3 -> w1        send micro-batch 3's boundary activations to worker 1
    recv_act 3 <- w0        receive micro-batch 3's boundary activations from worker 0
    send_grad 3 -> w0       send the gradient w.r.t. the stage's inputs upstream
    recv_grad 3 <- w1       receive the gradient w.r.t. the stage's outputs
    all_reduce grads [w0 w2]      average parameter gradients across the replicas of a stage
    fwd 3 ep[w0 w2]         forward of an expert-parallel stage: the program's dispatch and
                            combine all-to-alls run over the EP group written out (the stage's
                            replicas that share out its experts; frontend/moe.py)
    all_reduce grads [w0 w2] ep 2   an EP stage's step end: non-expert gradients averaged over
                            the replicas; expert gradients (already summed over the EP group by
                            the all-to-all's backward) divided by ep and averaged over the
                            replicas holding the same experts (expert-data parallelism)
    reduce_scatter grads [w0 w2]  ZeRO-1 (a stage's `zero=1`): the first half of the ring
                            all-reduce; each replica keeps the averaged gradients of its shard
                            of the stage's flat optimizer buffer (executor/zero.py) ...
    all_gather params [w0 w2]     ... and after opt_step updated its shard, the second half:
                            every replica gets the whole updated parameters
    migrate [w0 w2]         expert migration at the step boundary: the EP group sums its expert
                            loads and, when the plan's policy says so, moves experts (weights and
                            AdamW state) between its ranks
    send_tied_grads -> w0   hand this stage's gradients of tied parameters to their owner
    recv_tied_grads <- w1   the owner adds a holder's gradients of the parameters they share
    opt_step                optimizer step on this worker's parameters
    fwd 3 tp[w1 w2]         forward of a tensor-parallel stage: the program's collectives run
                            over the TP group written out (every rank's stream names it)
    send_act 3 -> [w3 w4] share 0/2   redistribution between TP degrees (H2's NIC-affinity
                            redistribution): this sender transmits its share 0 of 2 slices of
                            the (replicated) boundary tensor to every receiver of the next stage
    recv_act 3 <- [w1 w2]   a receiver takes one share from each sender and concatenates them
                            (`share_dim` says along which dim); gradients flow back alike
    send_tied_params -> w1  the owner sends the updated tied parameters to a holder
    recv_tied_params <- w0  a holder takes the owner's updated tied parameters
    fwd 3 c1                virtual-stage schedules (interleaved, izb, zbv): any instruction
                            with a trailing chunk id runs on that layer chunk of the worker
                            (`chunk_stages` says which stage each chunk is)

Tied parameters (an embedding tied to the LM head on another stage) stay one logical parameter,
as Megatron-LM keeps its embedding group: the stage of the first layer that reads one owns it
(weights, gradient, AdamW state); every other stage that reads it holds a copy, hands its
gradient to the owner after its last backward, and receives the owner's updated values after the
optimizer step. The sum is taken by the owner in stage order, so it is deterministic, and the
copies stay bit-identical to the owner's, whichever backends the stages run.
"""
from __future__ import annotations

import bisect
import itertools
import re
from dataclasses import dataclass
from functools import cached_property

from h2ir.errors import H2Error

OPS = ("fwd", "bwd", "bwd_input", "bwd_weight", "send_act", "recv_act", "send_grad", "recv_grad",
       "all_reduce", "all_to_all", "opt_step", "migrate",
       "send_tied_grads", "recv_tied_grads", "send_tied_params", "recv_tied_params",
       "reduce_scatter", "all_gather")
# ZeRO-1's halves of the ring all-reduce, and what each moves
_ZERO_COLLECTIVES = {"reduce_scatter": "grads", "all_gather": "params"}
_SENDS = ("send_act", "send_grad")
_RECVS = ("recv_act", "recv_grad")
_TIED_SENDS = ("send_tied_grads", "send_tied_params")
_TIED_RECVS = ("recv_tied_grads", "recv_tied_params")


@dataclass(frozen=True)
class WorkerLayout:
    """Worker ids <-> (replica, stage, tp rank): replicas outermost, then stages, then the
    ranks of a stage's TP group (a stage's ranks are consecutive ids, so they share a host)."""
    dp: int
    tps: tuple[int, ...]          # TP degree per stage

    @property
    def num_stages(self) -> int:
        return len(self.tps)

    @cached_property
    def _first(self) -> tuple[int, ...]:
        """First worker id of each stage inside a replica (and the replica's size last)."""
        return tuple(itertools.accumulate(self.tps, initial=0))

    @cached_property
    def per_replica(self) -> int:
        return self._first[-1]

    @property
    def num_workers(self) -> int:
        return self.dp * self.per_replica

    def wid(self, replica: int, stage: int, rank: int = 0) -> int:
        return replica * self.per_replica + self._first[stage] + rank

    def where(self, wid: int) -> tuple[int, int, int]:
        """(replica, stage, tp rank) of worker `wid`."""
        r, k = divmod(wid, self.per_replica)
        s = bisect.bisect_right(self._first, k) - 1
        if not 0 <= s < len(self.tps):
            raise ValueError(f"worker w{wid} outside the layout")
        return r, s, k - self._first[s]

    def tp_group(self, replica: int, stage: int) -> tuple[int, ...]:
        return tuple(self.wid(replica, stage, k) for k in range(self.tps[stage]))

    def ep_group(self, replica: int, stage: int, ep: int, rank: int = 0) -> tuple[int, ...]:
        """The EP group of `replica`'s stage `stage` at expert-parallel degree `ep`: replicas
        b*ep .. b*ep+ep-1 (b = replica // ep), same TP rank; a worker's EP rank is
        replica % ep."""
        b = replica // ep
        return tuple(self.wid(b * ep + j, stage, rank) for j in range(ep))

    def dp_group(self, stage: int, rank: int = 0) -> tuple[int, ...]:
        """The workers holding the same shard of stage `stage` in every replica."""
        return tuple(self.wid(q, stage, rank) for q in range(self.dp))


def worker_hosts(layout: WorkerLayout, stage_chips: list[str], cluster,
                 renumber: bool = True) -> list[int]:
    """The host (node) index of every worker, from the cluster's chip assignment: hosts are
    numbered over the node groups in file order, then node by node (a group of `count` nodes
    with `chips_per_node` chips each); each worker, in id order, takes the next free chip of its
    stage's chip type. Replica-major ids put a replica's stages on consecutive chips, so a
    pipeline stays inside a host when it fits, and a stage's TP ranks (consecutive ids) share
    one. A cluster with too few chips of a type (not a valid plan) wraps around. Hosts no
    worker uses are left out: the others are renumbered 0..N-1 in order (`renumber=False`:
    the cluster's own node numbers, `Cluster.node_domain`'s)."""
    # per chip type, its node groups as (first host, chips per node, chips in the group): the
    # k-th chip is found arithmetically, so the cost is in workers x groups, never in chips
    segments: dict[str, list[tuple[int, int, int]]] = {}
    host = 0
    for g in cluster.groups:
        segments.setdefault(g.chip, []).append((host, g.chips_per_node, g.nodes * g.chips_per_node))
        host += g.nodes
    total = {c: sum(n for _, _, n in segs) for c, segs in segments.items()}
    taken: dict[str, int] = {}
    hosts = []
    for w in range(layout.num_workers):
        chip = stage_chips[layout.where(w)[1]]
        k = taken.get(chip, 0)
        taken[chip] = k + 1
        if not total.get(chip):
            hosts.append(0)
            continue
        k %= total[chip]
        for first, per_node, n in segments[chip]:
            if k < n:
                hosts.append(first + k // per_node)
                break
            k -= n
    if not renumber:
        return hosts
    used = {h: i for i, h in enumerate(sorted(set(hosts)))}
    return [used[h] for h in hosts]


def share_dim(shape: tuple) -> int:
    """The dim a boundary tensor is split along when TP senders each transmit a share: the
    largest (the first of equals), so shares stay even; both ends compute it from the type."""
    shape = tuple(shape)
    return max(range(len(shape)), key=lambda d: (shape[d], -d)) if shape else 0


def _ws(group) -> str:
    return " ".join(f"w{g}" for g in group)


@dataclass(frozen=True)
class Instr:
    op: str
    mb: int | None = None
    peer: int | None = None
    group: tuple[int, ...] | None = None
    share: tuple[int, int] | None = None     # (index, count) of a TP sender's share
    ep: tuple[int, ...] | None = None        # fwd/bwd: the EP group; all_reduce: (ep degree,)
    chunk: int | None = None                 # virtual-stage schedules: which of the worker's
                                             # layer chunks the instruction runs on

    def __str__(self) -> str:
        text = self._text()
        return text if self.chunk is None else f"{text} c{self.chunk}"

    @property
    def peers(self) -> tuple[int, ...]:
        """Send/recv peers: one worker, or every worker of the other stage's TP group."""
        return (self.peer,) if self.peer is not None else tuple(self.group or ())

    def _text(self) -> str:
        if self.op in ("fwd", "bwd", "bwd_input", "bwd_weight"):
            return f"{self.op} {self.mb}" + (f" tp[{_ws(self.group)}]" if self.group else "") \
                + (f" ep[{_ws(self.ep)}]" if self.ep else "")
        if self.op in _SENDS:
            if self.peer is not None:
                return f"{self.op} {self.mb} -> w{self.peer}"
            return f"{self.op} {self.mb} -> [{_ws(self.group)}] share {self.share[0]}/{self.share[1]}"
        if self.op in _RECVS:
            if self.peer is not None:
                return f"{self.op} {self.mb} <- w{self.peer}"
            return f"{self.op} {self.mb} <- [{_ws(self.group)}]"
        if self.op in _TIED_SENDS:
            return f"{self.op} -> w{self.peer}"
        if self.op in _TIED_RECVS:
            return f"{self.op} <- w{self.peer}"
        if self.op == "all_reduce":
            return "all_reduce grads [" + " ".join(f"w{g}" for g in self.group) + "]" \
                + (f" ep {self.ep[0]}" if self.ep else "")
        if self.op in _ZERO_COLLECTIVES:
            return f"{self.op} {_ZERO_COLLECTIVES[self.op]} [{_ws(self.group)}]"
        if self.op == "migrate":
            return f"migrate [{_ws(self.group)}]"
        if self.op == "all_to_all":
            return f"all_to_all {self.mb} [" + " ".join(f"w{g}" for g in self.group) + "]"
        return self.op

    @classmethod
    def parse(cls, text: str) -> "Instr":
        t = text.strip()
        m = re.fullmatch(r"(.*\S) c(\d+)", t)
        if m:
            from dataclasses import replace
            return replace(cls.parse(m[1]), chunk=int(m[2]))
        m = re.fullmatch(r"(fwd|bwd|bwd_input|bwd_weight) (\d+)", t)
        if m:
            return cls(m[1], int(m[2]))
        m = re.fullmatch(r"(fwd|bwd|bwd_input|bwd_weight) (\d+)(?: tp\[((?:w\d+ ?)+)\])?(?: ep\[((?:w\d+ ?)+)\])?", t)
        if m:
            return cls(m[1], int(m[2]), group=_group(m[3]) if m[3] else None,
                       ep=_group(m[4]) if m[4] else None)
        m = re.fullmatch(r"(send_act|send_grad) (\d+) -> \[((?:w\d+ ?)+)\] share (\d+)/(\d+)", t)
        if m:
            return cls(m[1], int(m[2]), group=_group(m[3]), share=(int(m[4]), int(m[5])))
        m = re.fullmatch(r"(recv_act|recv_grad) (\d+) <- \[((?:w\d+ ?)+)\]", t)
        if m:
            return cls(m[1], int(m[2]), group=_group(m[3]))
        m = re.fullmatch(r"(send_act|send_grad) (\d+) -> w(\d+)", t)
        if m:
            return cls(m[1], int(m[2]), int(m[3]))
        m = re.fullmatch(r"(recv_act|recv_grad) (\d+) <- w(\d+)", t)
        if m:
            return cls(m[1], int(m[2]), int(m[3]))
        m = re.fullmatch(r"all_reduce grads \[((?:w\d+ ?)*)\](?: ep (\d+))?", t)
        if m:
            return cls("all_reduce", group=tuple(int(g[1:]) for g in m[1].split()),
                       ep=(int(m[2]),) if m[2] else None)
        m = re.fullmatch(r"(reduce_scatter grads|all_gather params) \[((?:w\d+ ?)+)\]", t)
        if m:
            return cls(m[1].split()[0], group=_group(m[2]))
        m = re.fullmatch(r"migrate \[((?:w\d+ ?)+)\]", t)
        if m:
            return cls("migrate", group=_group(m[1]))
        m = re.fullmatch(r"all_to_all (\d+) \[((?:w\d+ ?)*)\]", t)
        if m:
            return cls("all_to_all", int(m[1]), group=tuple(int(g[1:]) for g in m[2].split()))
        m = re.fullmatch(r"(send_tied_grads|send_tied_params) -> w(\d+)", t)
        if m:
            return cls(m[1], peer=int(m[2]))
        m = re.fullmatch(r"(recv_tied_grads|recv_tied_params) <- w(\d+)", t)
        if m:
            return cls(m[1], peer=int(m[2]))
        if t == "opt_step":
            return cls("opt_step")
        raise ValueError(f"not an instruction: {text!r} (expected one of: {', '.join(OPS)})")


def _group(text: str) -> tuple[int, ...]:
    return tuple(int(g[1:]) for g in text.split())


def _p2p(op: str, mb: int, peers: tuple, share: tuple[int, int]) -> Instr:
    """A send/recv with one peer (the pre-TP text form) or with a TP group (shares)."""
    if len(peers) == 1 and share[1] == 1:
        return Instr(op, mb, peers[0])
    return Instr(op, mb, group=tuple(peers), share=share if op in _SENDS else None)


def _stage_stream(order: list[tuple[str, int]], stage: int, S: int, worker, dp_group,
                  tie_owner: int | None = None, tie_holders: tuple[int, ...] = (),
                  groups=None, rank: int = 0, ep_group: tuple[int, ...] | None = None,
                  migrate: bool = False, zero: int = 0) -> list[Instr]:
    """Expand an order of ('F'|'B', mb) compute actions into recv/compute/send instructions,
    then the step's end: tied-gradient hand-over, data-parallel all-reduce, optimizer step,
    tied-parameter update. `tie_owner` is the stage owning parameters this stage holds copies
    of; `tie_holders` the stages holding copies of parameters this one owns. `groups(stage)` is
    a stage's TP group in this replica, `rank` this worker's rank in its own. `ep_group`: the
    EP group of an expert-parallel stage (its programs' all-to-alls; `migrate` adds the
    step-boundary migration check). `zero` 1: the all-reduce is split around the optimizer step
    (reduce_scatter, opt_step on the shard, all_gather; ZeRO-1)."""
    groups = groups or (lambda st: (worker(st),))
    out: list[Instr] = []
    mine = groups(stage)
    tp = len(mine)
    prev = groups(stage - 1) if stage > 0 else None
    nxt = groups(stage + 1) if stage < S - 1 else None
    tpg = mine if tp > 1 else None
    for kind, mb in order:
        if kind == "F":
            if prev is not None:
                out.append(_p2p("recv_act", mb, prev, (0, len(prev))))
            out.append(Instr("fwd", mb, group=tpg, ep=ep_group))
            if nxt is not None:
                out.append(_p2p("send_act", mb, nxt, (rank, tp)))
        elif kind == "W":                   # zero-bubble: the weight-gradient part, later
            out.append(Instr("bwd_weight", mb, group=tpg, ep=ep_group))
        else:                               # 'B': the whole backward; 'I': its input part
            if nxt is not None:
                out.append(_p2p("recv_grad", mb, nxt, (0, len(nxt))))
            out.append(Instr("bwd" if kind == "B" else "bwd_input", mb, group=tpg, ep=ep_group))
            if prev is not None:
                out.append(_p2p("send_grad", mb, prev, (rank, tp)))
    if tie_owner is not None:
        out.append(Instr("send_tied_grads", peer=worker(tie_owner)))
    out += [Instr("recv_tied_grads", peer=worker(h)) for h in tie_holders]
    sharded = zero and len(dp_group) > 1
    if sharded:
        out.append(Instr("reduce_scatter", group=tuple(dp_group)))
    elif len(dp_group) > 1:
        out.append(Instr("all_reduce", group=tuple(dp_group),
                         ep=(len(ep_group),) if ep_group else None))
    out.append(Instr("opt_step"))
    if sharded:     # before the tied copies are sent: they must be the whole updated values
        out.append(Instr("all_gather", group=tuple(dp_group)))
    out += [Instr("send_tied_params", peer=worker(h)) for h in tie_holders]
    if tie_owner is not None:
        out.append(Instr("recv_tied_params", peer=worker(tie_owner)))
    if ep_group and migrate:
        out.append(Instr("migrate", group=tuple(ep_group)))
    return out


def tied_stage_groups(ties, stage_layers: list[list[str]]) -> dict[int, tuple[int, ...]]:
    """owner stage -> the other stages holding copies of its tied parameters, for `ties`
    (`h2ir.costs.TiedParam`s) under a split of the layers into stages."""
    stage_of = {l: s for s, ls in enumerate(stage_layers) for l in ls}
    groups: dict[int, set] = {}
    for t in ties:
        owner = stage_of[t.owner]
        holders = {stage_of[u] for u in t.users} - {owner}
        if holders:
            groups.setdefault(owner, set()).update(holders)
    owners_of = {}
    for o, hs in groups.items():
        for h in hs:
            if owners_of.setdefault(h, o) != o:
                raise H2Error(f"stage {h} holds tied parameters of two owner stages "
                              f"({owners_of[h]} and {o}); h2 supports one owner per stage")
    return {o: tuple(sorted(hs)) for o, hs in sorted(groups.items())}


def compute_order(schedule: str, stage: int, S: int, m: int) -> list[tuple[str, int]]:
    """Order of forward/backward micro-batch computations on `stage` of S with m micro-batches."""
    if schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    if schedule == "1f1b":
        # PipeDream-Flush / Megatron 1F1B (Narayanan et al., SC'21, Sec. 2.2): stage s warms up
        # with S-1-s forwards, then alternates one forward / one backward, then drains.
        warm = min(S - 1 - stage, m)
        order = [("F", i) for i in range(warm)]
        f, b = warm, 0
        while f < m:
            order.append(("F", f)); f += 1
            order.append(("B", b)); b += 1
        order += [("B", i) for i in range(b, m)]
        return order
    if schedule == "zb1":
        # ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, Sec. 3.1): 1F1B's
        # order with each backward split into I (input gradient: sent upstream at once) and W
        # (weight gradient). Stage s runs W of micro-batch j after I of j + d, d = S-1-s: in the
        # steady state every stage does F, I, W per cycle; in the drain the postponed W's run
        # where 1F1B waits for the next gradient. Memory: W's inputs stay up to d micro-batches
        # longer than in 1F1B (the worker's stash).
        d = S - 1 - stage
        order, done_i = [], 0
        for kind, i in compute_order("1f1b", stage, S, m):
            if kind == "F":
                order.append(("F", i))
                continue
            order.append(("I", i))
            done_i += 1
            if i - d >= 0:
                order.append(("W", i - d))
        order += [("W", j) for j in range(max(0, m - d), m)]
        return order
    raise ValueError(f"unknown schedule {schedule!r} (expected 1f1b, gpipe or zb1)")


# ---- virtual stages: a worker holds several layer chunks ---------------------------------------
# The plan's stages are then virtual stages in model order; chunk c of physical stage s is
# virtual stage `chunk_stages(...)[s][c]`.
VIRTUAL_SCHEDULES = ("interleaved", "izb", "zbv")
SPLIT_SCHEDULES = ("zb1", "izb", "zbv")         # backward split into B (input) and W (weight)


def chunk_stages(schedule: str, S: int, V: int) -> list[list[int]]:
    """Per physical stage, the virtual stages its chunks run, in chunk order. Interleaved
    (Narayanan et al. SC'21 Sec. 2.2): chunk c of stage s is virtual stage c*S + s. V-shape
    (ZB-V, Qi et al. ICLR 2024 Sec. 6): stage s holds virtual stages s and 2S-1-s, so the first
    worker also runs the last chunk and the loss."""
    if schedule == "zbv":
        if V != 2:
            raise H2Error(f"schedule zbv runs 2 chunks per worker, not virtual={V}")
        return [[s, 2 * S - 1 - s] for s in range(S)]
    return [[c * S + s for c in range(V)] for s in range(S)]


def _interleaved_order(s: int, S: int, V: int, m: int) -> list[tuple[str, int, int]]:
    """Megatron-LM's interleaved 1F1B on stage s: forward k runs micro-batch
    (k // SV)·S + k % S on chunk (k // S) % V, backward k the same micro-batch on the mirrored
    chunk; (S-s-1)·2 + (V-1)·S warm-up forwards, then one forward / one backward, then the
    drain. Needs m to be a multiple of S."""
    total = m * V
    warm = min((S - s - 1) * 2 + (V - 1) * S, total)

    def mb(k):
        return (k // (S * V)) * S + k % S

    order = [("F", mb(k), (k // S) % V) for k in range(warm)]
    for i in range(total - warm):
        order.append(("F", mb(warm + i), ((warm + i) // S) % V))
        order.append(("B", mb(i), V - 1 - (i // S) % V))
    order += [("B", mb(i), V - 1 - (i // S) % V) for i in range(total - warm, total)]
    return order


def _greedy_orders(vstages: list[list[int]], m: int, caps: list[int],
                   durations: dict | None = None,
                   reserve: bool = False) -> list[list[tuple[str, int, int]]]:
    """Zero-bubble orders by list scheduling (the greedy of Qi et al. 2024, Sec. 3.2): every
    worker, when free, runs the ready action of highest priority — an input-gradient B first
    (it unblocks the stage upstream; deeper chunks first), then a forward while its in-flight
    activations stay under `caps[p]` (deeper chunks first), then a postponed weight-gradient W,
    which fills what would be a bubble. `durations[v]` = (F, B, W) seconds of virtual stage v
    (unit times by default), so a heterogeneous pipeline's order follows its stages' speeds.
    The orders come from one causal timeline, so the streams cannot deadlock."""
    from collections import deque
    P = len(vstages)
    VS = sum(len(cs) for cs in vstages)
    where = {v: (p, c) for p, cs in enumerate(vstages) for c, v in enumerate(cs)}
    dur = durations or {}
    nf, nb = [0] * VS, [0] * VS
    f_end: dict = {}
    b_end: dict = {}
    wq = [deque() for _ in range(P)]
    inflight, free = [0] * P, [0.0] * P
    orders: list[list[tuple[str, int, int]]] = [[] for _ in range(P)]
    left = 3 * VS * m
    eps = 1e-9 * max([1.0] if not dur else [max(t) for t in dur.values()])   # float ties
    while left:
        best = None
        for p in range(P):
            cands = []          # (ready time, priority, kind, v, mb)
            for v in vstages[p]:
                i = nb[v]
                if i < m and (v, i) in f_end and (v == VS - 1 or (v + 1, i) in b_end):
                    ready = max(f_end[(v, i)], b_end.get((v + 1, i), 0.0))
                    cands.append((ready, (0, -v), "I", v, i))
                i = nf[v]
                # a shallower chunk leaves a slot for each deeper one: the deepest pending
                # forward is never blocked by activations waiting on it
                room = caps[p] - (len(vstages[p]) - 1 - where[v][1] if reserve else 0)
                if i < m and inflight[p] < room and (v == 0 or (v - 1, i) in f_end):
                    cands.append((f_end.get((v - 1, i), 0.0), (1, -v), "F", v, i))
            if wq[p]:
                v, i = wq[p][0]
                cands.append((b_end[(v, i)], (2, 0), "W", v, i))
            if not cands:
                continue
            now = [c for c in cands if c[0] <= free[p] + eps]
            pick = min(now, key=lambda c: c[1]) if now else min(cands, key=lambda c: (c[0], c[1]))
            start = max(free[p], pick[0])
            if best is None or (start, p) < best[:2]:
                best = (start, p, pick)
        if best is None:
            # stuck: every worker's activations wait on forwards its cap keeps out. Again with
            # a slot kept for each deeper chunk, then with a slot more everywhere (at m per
            # chunk nothing is held back: GPipe's memory)
            if min(caps) >= len(vstages[0]) * m:
                raise H2Error("internal: the zero-bubble list scheduler found no runnable "
                              f"action (caps {caps})")
            if not reserve:
                return _greedy_orders(vstages, m, caps, durations, reserve=True)
            return _greedy_orders(vstages, m, [c + 1 for c in caps], durations, reserve=True)
        start, p, (_, _, kind, v, i) = best
        f, b, w = dur.get(v, (1.0, 1.0, 1.0))
        end = start + {"F": f, "I": b, "W": w}[kind]
        free[p] = end
        if kind == "F":
            f_end[(v, i)] = end
            nf[v] += 1
            inflight[p] += 1
        elif kind == "I":
            b_end[(v, i)] = end
            nb[v] += 1
            wq[p].append((v, i))
        else:
            wq[p].popleft()
            inflight[p] -= 1
        orders[p].append((kind, i, where[v][1]))
        left -= 1
    return orders


def chunk_orders(schedule: str, S: int, V: int, m: int,
                 durations: dict | None = None) -> list[list[tuple[str, int, int]]]:
    """Per physical stage, its (kind, micro-batch, chunk) computations for a virtual-stage
    schedule: 'interleaved' (interleaved 1F1B), 'izb' (interleaved zero bubble: the greedy
    with interleaved 1F1B's activation memory) or 'zbv' (V-shape zero bubble with 1F1B's
    activation memory: 2S chunk activations on every worker)."""
    if schedule in ("interleaved", "izb") and m % S:
        raise H2Error(f"schedule {schedule} needs the micro-batches per step ({m}) to be a "
                      f"multiple of the pipeline's {S} stages")
    if schedule == "interleaved":
        return [_interleaved_order(s, S, V, m) for s in range(S)]
    vst = chunk_stages(schedule, S, V)
    if schedule == "izb":
        caps = [_peak_inflight(_interleaved_order(s, S, V, m)) for s in range(S)]
    elif schedule == "zbv":
        caps = [2 * S] * S
    else:
        raise ValueError(f"not a virtual-stage schedule: {schedule!r}")
    return _greedy_orders(vst, m, caps, durations)


def _peak_inflight(order) -> int:
    n = peak = 0
    for kind, _, _ in order:
        n += 1 if kind == "F" else -1 if kind in ("B", "W") else 0
        peak = max(peak, n)
    return peak


def _chunked_stream(order, p: int, vstages: list[list[int]], worker, dp_group,
                    ties: dict[int, tuple[int, ...]], zero=()) -> list[Instr]:
    """`_stage_stream` for a worker holding chunks: every instruction names its chunk; a
    chunk's neighbours are the virtual stages before and after it, wherever they run (a
    transfer between two chunks of one worker is a send to itself). The step ends with each
    chunk's tied-gradient hand-over, all-reduce and optimizer step; a ZeRO-1 chunk (`zero[v]`
    of its virtual stage v) reduce-scatters instead, and all-gathers after every chunk's
    optimizer step (the worker updates its chunks together at the last one)."""
    VS = sum(len(cs) for cs in vstages)
    host = {v: q for q, cs in enumerate(vstages) for v in cs}
    mine = vstages[p]
    out: list[Instr] = []
    for kind, mb, c in order:
        v = mine[c]
        if kind == "F":
            if v > 0:
                out.append(Instr("recv_act", mb, worker(host[v - 1]), chunk=c))
            out.append(Instr("fwd", mb, chunk=c))
            if v < VS - 1:
                out.append(Instr("send_act", mb, worker(host[v + 1]), chunk=c))
        elif kind == "W":
            out.append(Instr("bwd_weight", mb, chunk=c))
        else:
            if v < VS - 1:
                out.append(Instr("recv_grad", mb, worker(host[v + 1]), chunk=c))
            out.append(Instr("bwd" if kind == "B" else "bwd_input", mb, chunk=c))
            if v > 0:
                out.append(Instr("send_grad", mb, worker(host[v - 1]), chunk=c))
    owner_of = {h: o for o, hs in ties.items() for h in hs}
    for c, v in enumerate(mine):
        if v in owner_of:
            out.append(Instr("send_tied_grads", peer=worker(host[owner_of[v]]), chunk=c))
    for c, v in enumerate(mine):
        for q in sorted({host[h] for h in ties.get(v, ())}):
            out.append(Instr("recv_tied_grads", peer=worker(q), chunk=c))
    sharded = [bool(zero and zero[v]) and len(dp_group) > 1 for v in mine]
    for c in range(len(mine)):
        if len(dp_group) > 1:
            out.append(Instr("reduce_scatter" if sharded[c] else "all_reduce",
                             group=tuple(dp_group), chunk=c))
        out.append(Instr("opt_step", chunk=c))
    out += [Instr("all_gather", group=tuple(dp_group), chunk=c)
            for c in range(len(mine)) if sharded[c]]
    for c, v in enumerate(mine):
        for q in sorted({host[h] for h in ties.get(v, ())}):
            out.append(Instr("send_tied_params", peer=worker(q), chunk=c))
    for c, v in enumerate(mine):
        if v in owner_of:
            out.append(Instr("recv_tied_params", peer=worker(host[owner_of[v]]), chunk=c))
    return out


def _check_tied_chunks(ties: dict[int, tuple[int, ...]], vstages: list[list[int]]) -> None:
    host = {v: q for q, cs in enumerate(vstages) for v in cs}
    for o, hs in ties.items():
        on = [host[h] for h in hs]
        if len(on) != len(set(on)):
            raise H2Error(f"two chunks of one worker hold copies of stage {o}'s tied "
                          "parameters; h2 supports one such chunk per worker")


def build_streams(schedule: str, num_stages: int, num_microbatches: int, dp: int = 1,
                  ties: dict[int, tuple[int, ...]] | None = None,
                  tp: list[int] | tuple[int, ...] | None = None,
                  ep: list[int] | tuple[int, ...] | None = None,
                  migrate: bool = False, virtual: int = 1,
                  durations: dict | None = None,
                  zero: list[int] | tuple[int, ...] | None = None) -> dict[int, list[Instr]]:
    """Instruction streams for every worker of a dp x num_stages pipeline whose stage s has
    tp[s] ranks (`WorkerLayout`); `ties` is `tied_stage_groups`' owner -> holders map (tied
    parameters are exchanged inside a replica, rank with rank: tied stages share one tp).
    `ep[s]` > 1 makes stage s expert-parallel: replicas b*ep .. b*ep+ep-1 form one EP group
    (`WorkerLayout.ep_group`); `migrate` adds expert migration at each EP stage's step end.
    `zero[s]` = 1 shards stage s's optimizer state over its dp group (ZeRO-1)."""
    S = num_stages
    ties = ties or {}
    zero = tuple(zero or (0,) * S)
    if schedule in VIRTUAL_SCHEDULES:
        return _build_chunked_streams(schedule, S, num_microbatches, dp, ties, tp, ep, virtual,
                                      durations, zero)
    lay = WorkerLayout(dp, tuple(tp or (1,) * S))
    owner_of = {h: o for o, hs in ties.items() for h in hs}
    for o, hs in ties.items():
        for h in hs:
            if lay.tps[o] != lay.tps[h]:
                raise H2Error(f"stages {o} and {h} share tied parameters but have tp "
                              f"{lay.tps[o]} and {lay.tps[h]}; tied stages need one tp")
    streams: dict[int, list[Instr]] = {}
    eps = tuple(ep or (1,) * S)
    for s, e in enumerate(eps):
        if e > 1 and dp % e:
            raise H2Error(f"stage {s}: ep={e} does not divide dp={dp}; an EP group is made of "
                          "the stage's data-parallel replicas")
    for r in range(dp):
        for s in range(S):
            order = compute_order(schedule, s, S, num_microbatches)
            for k in range(lay.tps[s]):
                streams[lay.wid(r, s, k)] = _stage_stream(
                    order, s, S, worker=lambda st, r=r, k=k: lay.wid(r, st, k),
                    dp_group=list(lay.dp_group(s, k)),
                    tie_owner=owner_of.get(s), tie_holders=ties.get(s, ()),
                    groups=lambda st, r=r: lay.tp_group(r, st), rank=k,
                    ep_group=lay.ep_group(r, s, eps[s], k) if eps[s] > 1 else None,
                    migrate=migrate, zero=zero[s])
    return streams


def _build_chunked_streams(schedule, VS, m, dp, ties, tp, ep, V, durations, zero=()):
    """build_streams for a virtual-stage schedule: `VS` virtual stages on VS / V workers per
    replica (tp 1, no EP)."""
    if V < 2 or VS % V:
        raise H2Error(f"schedule {schedule} with virtual={V} needs a multiple of {V} stages "
                      f"(the plan has {VS})")
    if any(t != 1 for t in (tp or ())) or any(e != 1 for e in (ep or ())):
        raise H2Error(f"schedule {schedule}: stages with tp or ep > 1 are not supported with "
                      "virtual stages")
    S = VS // V
    vstages = chunk_stages(schedule, S, V)
    _check_tied_chunks(ties, vstages)
    lay = WorkerLayout(dp, (1,) * S)
    orders = chunk_orders(schedule, S, V, m, durations)
    streams = {}
    for r in range(dp):
        for s in range(S):
            streams[lay.wid(r, s)] = _chunked_stream(
                orders[s], s, vstages, worker=lambda st, r=r: lay.wid(r, st),
                dp_group=list(lay.dp_group(s)), ties=ties, zero=zero)
    return streams


def format_stream(instrs: list[Instr]) -> str:
    return "".join(f"{i}\n" for i in instrs)


def parse_stream(text: str, file: str | None = None) -> list[Instr]:
    """Inverse of `format_stream`; '#' lines are comments. A bad line is a located H2Error."""
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            out.append(Instr.parse(line))
        except ValueError as e:
            raise H2Error(str(e), file=file, line=n) from None
    return out
