"""Which library carries each communication group of a build: DiComm, or the members' own software
stack's collective library ("ccl": torch.distributed's gloo on CPUs, NCCL on CUDA, RCCL on ROCm
builds of torch; executor/ccl.py runs it).

H2 keeps each vendor's stack inside its chips and joins different chips through DiComm (H2, arXiv
2505.17548); Megatron-LM and torchtitan run their DP, TP and EP collectives on NCCL inside a
homogeneous group. So a group whose members all run one stack — the torch backend on one kind of
device — may use that stack's library, and a group that crosses stacks (torch and NumPy, one
vendor and another) always goes through DiComm. The plan's `comm` says which:

    dicomm   every group on DiComm
    ccl      every group that shares a stack on its library
    auto     per group, the library with the lower time for the group's messages (`choose`)

The groups are read from the streams (`build_groups`): a stage's data-parallel all-reduce (and,
on an EP stage, the expert gradients' sub-groups), a TP stage's program collectives, an EP
stage's all-to-all, and each direction of a one-peer stage-to-stage link. Everything else —
ZeRO-1's shards, TP share redistribution, tied parameters, the global gradient norm, expert
migration — stays on DiComm.
"""
from __future__ import annotations

from dataclasses import dataclass

from h2ir.planner.resource import all_to_all_flat_time, nic_share, ring_allreduce_time

KINDS = ("dp", "tp", "ep", "p2p")

# (latency per message s, bandwidth B/s) of each library between processes of one machine
# through host memory: DiComm's shm ring and gloo's loopback TCP. bench/bench_collectives.py
# measures both and prints this fit; these are its figures on the 2-core development machine.
HOST_RATES = {"dicomm": (80e-6, 1.3e9), "gloo": (410e-6, 0.31e9)}


@dataclass(frozen=True)
class Member:
    """What decides a worker's side of a group: its stack (the cluster chip's `backend`), the op
    library it runs (torch, numpy), its torch device kind, host, chip type and stage."""
    stack: str
    backend: str
    device: str | None
    host: int
    chip: str
    stage: int

    @property
    def library(self) -> str | None:
        """The collective library of the member's stack: gloo for torch on CPUs, NCCL on CUDA
        (RCCL, torch's "nccl" backend on ROCm builds, on a rocm stack); None without torch."""
        if self.backend != "torch":
            return None
        if (self.device or "cpu") == "cpu":
            return "gloo"
        return "rccl" if self.stack == "rocm" else "nccl"

    def describe(self) -> str:
        return self.backend if self.backend == self.stack else f"{self.stack} ({self.backend})"


@dataclass(frozen=True)
class CommGroup:
    """One group and the library that carries it. `workers`: the members in the order the
    collective takes them; a p2p group is (sender, receiver)."""
    kind: str
    workers: tuple[int, ...]
    via: str              # "ccl" | "dicomm"
    library: str          # "gloo" | "nccl" | "rccl" | "dicomm"
    why: str

    def __str__(self) -> str:
        ws = " ".join(f"w{w}" for w in self.workers)
        return f"{self.kind} [{ws}] {self.library}: {self.why}"

    def to_json(self) -> dict:
        return {"kind": self.kind, "workers": list(self.workers), "via": self.via,
                "library": self.library, "why": self.why}

    @classmethod
    def from_json(cls, d: dict) -> "CommGroup":
        return cls(d["kind"], tuple(int(w) for w in d["workers"]), d["via"], d["library"],
                   d["why"])


def message_time(library: str, kind: str, nbytes: float, n: int,
                 link: tuple[float, float] | None = None) -> float:
    """Seconds for one of a group's messages of `nbytes` over `n` members: a ring all-reduce (dp,
    tp), a flat all-to-all (ep) or one transfer (p2p). `link`: the cluster's (latency, bandwidth)
    between the members, None for CPU processes of one machine. NCCL and RCCL move the bytes
    device to device at the link's rates; DiComm and gloo move them through host memory at
    HOST_RATES, paced by the link too where it is slower."""
    if library in HOST_RATES:
        lat, bw = HOST_RATES[library]
        if link is not None:
            lat, bw = max(lat, link[0]), min(bw, link[1])
    elif link is None:
        raise ValueError(f"{library}'s time needs the cluster's link between the members")
    else:
        lat, bw = link
    if kind == "p2p":
        return lat + nbytes / bw
    if kind == "ep":
        return all_to_all_flat_time(nbytes, n, n, bw, bw, lat, lat)
    return ring_allreduce_time(nbytes, n, bw, lat)


def group_link(cluster, members: list[Member]) -> tuple[float, float] | None:
    """(latency, bandwidth) between the members from the cluster's link table: the chip type's
    intra-node link on one host, else its per-chip NIC share; None for CPU processes of one
    host, which talk through its memory."""
    one_host = len({m.host for m in members}) == 1
    if one_host and all(m.device in (None, "cpu") for m in members):
        return None
    g = cluster.group(members[0].chip)
    if one_host:
        return g.intra_latency, g.intra_bw
    return g.inter_latency, min(g.intra_bw, nic_share(g))


def choose(setting: str, kind: str, members: list[Member], nbytes: float,
           cluster=None) -> tuple[str, str, str]:
    """(via, library, why) for one group under the plan's `comm` setting (`cluster`: for `auto`
    between accelerators or hosts, its link table)."""
    stacks = sorted({m.describe() for m in members})
    if len({(m.stack, m.backend, m.device) for m in members}) > 1:
        return "dicomm", "dicomm", f"crosses stacks ({', '.join(stacks)})"
    lib = members[0].library
    if lib is None:
        return "dicomm", "dicomm", f"{stacks[0]} has no collective library"
    if setting == "dicomm":
        return "dicomm", "dicomm", "plan comm dicomm"
    if setting == "ccl":
        return "ccl", lib, f"one stack ({stacks[0]}), plan comm ccl"
    link = group_link(cluster, members)
    t_ccl = message_time(lib, kind, nbytes, len(members), link)
    t_dicomm = message_time("dicomm", kind, nbytes, len(members), link)
    cost = f"{_size(nbytes)} messages: {lib} {t_ccl * 1e6:.0f} us, dicomm {t_dicomm * 1e6:.0f} us"
    if t_ccl < t_dicomm:
        return "ccl", lib, f"one stack ({stacks[0]}), auto: {cost}"
    return "dicomm", "dicomm", f"auto: {cost}"


def build_groups(streams: dict, members: list[Member], setting: str, cluster=None,
                 volumes: dict | None = None, virtual: bool = False) -> list[CommGroup]:
    """Every group of the build that may run on a stack's library, with its choice, in a
    stable order. `streams`: worker -> its instructions (h2ir/schedule/streams.py Instr);
    `members[w]`: worker w; `volumes[(kind, stage)]`: the bytes of one of that stage's messages
    of the kind (p2p: the boundary tensor after the stage); a missing one counts 1 MiB."""
    volumes = volumes or {}
    found: dict[tuple, int] = {}            # (kind, workers) -> stage its bytes are costed at
    for w, instrs in streams.items():
        stage = members[w].stage
        for ins in instrs:
            for key in _groups_of(ins, w):
                found[key] = min(stage, members[ins.peer].stage) if key[0] == "p2p" else stage
    out = []
    for (kind, ws), stage in sorted(found.items()):
        if kind == "p2p" and virtual:
            out.append(CommGroup(kind, ws, "dicomm", "dicomm", "virtual-stage transfers arrive "
                                 "out of order: DiComm matches them by tag"))
            continue
        nbytes = volumes.get((kind, stage), 1 << 20)
        via, lib, why = choose(setting, kind, [members[w] for w in ws], nbytes, cluster)
        out.append(CommGroup(kind, ws, via, lib, why))
    return out


def _groups_of(ins, w: int) -> list[tuple]:
    """(kind, workers) of every group instruction `ins` of worker w communicates in."""
    out = []
    if ins.op == "all_reduce" and ins.group and len(ins.group) > 1:
        out.append(("dp", tuple(ins.group)))
        if ins.ep:              # the expert gradients' sub-groups (executor/worker.py)
            ep = ins.ep[0]
            subs = (tuple(g for i, g in enumerate(ins.group) if i % ep == r) for r in range(ep))
            out += [("dp", sub) for sub in subs if len(sub) > 1]
    elif ins.op in ("fwd", "bwd", "bwd_input", "bwd_weight"):
        if ins.group and len(ins.group) > 1:
            out.append(("tp", tuple(ins.group)))
        if ins.ep and len(ins.ep) > 1:
            out.append(("ep", tuple(ins.ep)))
    elif ins.op in ("send_act", "send_grad") and ins.peer is not None and ins.peer != w:
        out.append(("p2p", (w, ins.peer)))
    return out


def stream_notes(groups: list[CommGroup], wid: int) -> str:
    """The comment lines a worker's stream file starts with: each of its groups and the library
    that carries it."""
    mine = [g for g in groups if wid in g.workers]
    if not mine:
        return ""
    return "".join(f"# comm {g}\n" for g in mine) + "# comm: all other transfers on DiComm\n"


def _size(n: float) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{int(n)} B"
