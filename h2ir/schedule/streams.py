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
       "send_tied_grads", "recv_tied_grads", "send_tied_params", "recv_tied_params")
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


def worker_hosts(layout: WorkerLayout, stage_chips: list[str], cluster) -> list[int]:
    """The host (node) index of every worker, from the cluster's chip assignment: hosts are
    numbered over the node groups in file order, then node by node (a group of `count` nodes
    with `chips_per_node` chips each); each worker, in id order, takes the next free chip of its
    stage's chip type. Replica-major ids put a replica's stages on consecutive chips, so a
    pipeline stays inside a host when it fits, and a stage's TP ranks (consecutive ids) share
    one. A cluster with too few chips of a type (not a valid plan) wraps around. Hosts no
    worker uses are left out: the others are renumbered 0..N-1 in order."""
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

    @property
    def peers(self) -> tuple[int, ...]:
        """Send/recv peers: one worker, or every worker of the other stage's TP group."""
        return (self.peer,) if self.peer is not None else tuple(self.group or ())

    def __str__(self) -> str:
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
        if self.op == "migrate":
            return f"migrate [{_ws(self.group)}]"
        if self.op == "all_to_all":
            return f"all_to_all {self.mb} [" + " ".join(f"w{g}" for g in self.group) + "]"
        return self.op

    @classmethod
    def parse(cls, text: str) -> "Instr":
        t = text.strip()
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
                  migrate: bool = False) -> list[Instr]:
    """Expand an order of ('F'|'B', mb) compute actions into recv/compute/send instructions,
    then the step's end: tied-gradient hand-over, data-parallel all-reduce, optimizer step,
    tied-parameter update. `tie_owner` is the stage owning parameters this stage holds copies
    of; `tie_holders` the stages holding copies of parameters this one owns. `groups(stage)` is
    a stage's TP group in this replica, `rank` this worker's rank in its own. `ep_group`: the
    EP group of an expert-parallel stage (its programs' all-to-alls; `migrate` adds the
    step-boundary migration check)."""
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
    if len(dp_group) > 1:
        out.append(Instr("all_reduce", group=tuple(dp_group),
                         ep=(len(ep_group),) if ep_group else None))
    out.append(Instr("opt_step"))
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


def build_streams(schedule: str, num_stages: int, num_microbatches: int, dp: int = 1,
                  ties: dict[int, tuple[int, ...]] | None = None,
                  tp: list[int] | tuple[int, ...] | None = None,
                  ep: list[int] | tuple[int, ...] | None = None,
                  migrate: bool = False) -> dict[int, list[Instr]]:
    """Instruction streams for every worker of a dp x num_stages pipeline whose stage s has
    tp[s] ranks (`WorkerLayout`); `ties` is `tied_stage_groups`' owner -> holders map (tied
    parameters are exchanged inside a replica, rank with rank: tied stages share one tp).
    `ep[s]` > 1 makes stage s expert-parallel: replicas b*ep .. b*ep+ep-1 form one EP group
    (`WorkerLayout.ep_group`); `migrate` adds expert migration at each EP stage's step end."""
    S = num_stages
    lay = WorkerLayout(dp, tuple(tp or (1,) * S))
    ties = ties or {}
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
                    migrate=migrate)
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
