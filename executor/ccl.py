"""Collectives inside one software stack on the vendor's library: torch.distributed process groups
(gloo on CPU workers, NCCL on CUDA, RCCL on ROCm builds of torch) for the groups a build puts
there (h2ir/planner/collectives.py decides, per group, at compile time).

`CCL` holds one process group per group this worker belongs to and offers what the worker's
instructions need, on torch tensors that stay on the worker's device: the data-parallel gradient
all-reduce, one-peer stage-to-stage sends, the TP programs' collectives (`TPCollectives`, the
hook `TPGroupComm` is on DiComm) and the EP all-to-all (`EPExchange`). Everything else — groups
that cross stacks (torch and NumPy, one vendor and another), ZeRO-1's shards, tied parameters,
the global gradient norm, expert migration — stays on DiComm.

Process groups are built directly (`ProcessGroupGloo` / `ProcessGroupNCCL` on a `PrefixStore` of
the run's rendezvous store), not through `init_process_group`: only a group's members take part
in making it, so NumPy workers and workers of other stacks never join a torch world. Every
worker makes its groups in one global order (sorted by kind and members), so two workers
sharing several groups cannot wait on each other in opposite orders.

Stage-to-stage sends use one group per direction (sender, receiver): NCCL matches a pair's
sends and receives in order and ignores tags, and with one communicator per direction an
activation going down and a gradient coming up never wait on each other. Sends are
asynchronous (the tensor is kept until its work completes), as DiComm's are buffered: a
schedule where both ends send before they receive cannot deadlock.

NOTE: gloo and NCCL connections are not authenticated, unlike DiComm's links (docs/dicomm.md
"Threat model"); the rendezvous store's keys are not signed either. Use them on trusted
networks.
"""
from __future__ import annotations

import zlib
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from backends.torch.ops import TORCH_DTYPE
from executor.dicomm.errors import CommError
from h2ir.errors import H2Error
from h2ir.planner.collectives import KINDS, CommGroup

# time allowed for every member of a group to arrive when it is made: workers start their
# stages at different times (loading weights, importing), which the comm timeout need not cover
MAKE_TIMEOUT_S = 120.0


def tag_of(kind: str, mb: int) -> int:
    """The gloo tag of a (kind, micro-batch) transfer: one per tensor, so receives match sends in
    any order, as DiComm's tags do (NCCL ignores tags; see the module docstring)."""
    return zlib.crc32(f"{kind}#{mb}".encode()) & 0x7FFFFFFF


class CCL:
    """One worker's process groups on its stack's collective library."""

    def __init__(self, rank: int, groups: list[CommGroup], store, *, device: str, timeout: float,
                 host: str = "127.0.0.1", namespace: str = "ccl"):
        self.rank, self.timeout = rank, timeout
        self.device = torch.device(device)
        self.library = "nccl" if self.device.type == "cuda" else "gloo"
        self.groups = sorted({(g.kind, tuple(g.workers)) for g in groups
                              if g.via == "ccl" and rank in g.workers})
        self._pgs: dict[tuple, object] = {}
        self._pending: list[tuple] = []          # (work, tensor, pair) of sends not yet out
        # one gloo transport (its own I/O thread) for all of this worker's groups
        self._gloo = dist.ProcessGroupGloo.create_device(hostname=host) \
            if self.library == "gloo" and self.groups else None
        for kind, members in self.groups:
            name = f"{namespace}/{kind}/" + "-".join(map(str, members))
            self._pgs[(kind, members)] = self._make(dist.PrefixStore(name, store),
                                                    members.index(rank), len(members), name)

    def __repr__(self) -> str:
        return f"CCL(rank={self.rank}, {self.library}, groups={len(self._pgs)})"

    def _make(self, store, rank: int, size: int, name: str):
        try:
            if self.library == "nccl":
                opts = dist.ProcessGroupNCCL.Options()
                opts.is_high_priority_stream = False
                opts._timeout = timedelta(seconds=self.timeout)
                return dist.ProcessGroupNCCL(store, rank, size, opts)
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = timedelta(seconds=max(self.timeout, MAKE_TIMEOUT_S))
            opts._devices = [self._gloo]
            pg = dist.ProcessGroupGloo(store, rank, size, opts)
            pg.set_timeout(timedelta(seconds=self.timeout))
            return pg
        except (RuntimeError, ValueError) as e:
            raise CommError(f"rank {self.rank}: cannot make the {self.library} process group "
                            f"{name}: {_first_line(e)}",
                            hint="every member of the group must be running; see its log") \
                from None

    # -- which groups --------------------------------------------------------------------------
    def owns(self, kind: str, members) -> bool:
        return (kind, tuple(members)) in self._pgs

    def _pg(self, kind: str, members) -> tuple[object, int]:
        members = tuple(members)
        try:
            return self._pgs[(kind, members)], members.index(self.rank)
        except KeyError:
            raise CommError(f"rank {self.rank}: the build puts no {kind} group "
                            f"{list(members)} on {self.library} for this worker") from None

    def _wait(self, work, what: str, members) -> None:
        try:
            work.wait()
        except RuntimeError as e:       # gloo's timeouts and closed peers; NCCL's errors
            raise CommError(f"rank {self.rank}: {self.library} {what} over "
                            f"{[int(m) for m in members]} failed: {_first_line(e)}",
                            hint="a peer died, hung, or never reached this collective") from None

    # -- collectives ---------------------------------------------------------------------------
    def all_reduce(self, tensors: list, members, op: str = "avg", kind: str = "dp") -> list:
        """The group's sum (or mean) of each tensor, as new tensors: views of one flat buffer per
        dtype, one collective each, as DiComm buckets them. The inputs are not changed."""
        pg, _ = self._pg(kind, members)
        out: list = [None] * len(tensors)
        buckets: dict = {}
        for i, t in enumerate(tensors):
            if op == "avg" and not t.is_floating_point():
                raise ValueError(f"all_reduce op 'avg' is not defined for {t.dtype} tensors")
            buckets.setdefault(t.dtype, []).append(i)
        for idx in buckets.values():
            flat = torch.cat([tensors[i].detach().reshape(-1) for i in idx])
            self._wait(pg.allreduce([flat]), "all_reduce", members)
            if op == "avg":
                flat /= len(members)
            at = 0
            for i in idx:
                n = tensors[i].numel()
                out[i] = flat[at:at + n].view(tensors[i].shape)
                at += n
        return out

    def all_reduce_(self, t: torch.Tensor, members, reduce: str = "sum", kind: str = "tp") -> None:
        """In place: the group's sum or maximum of `t` (a contiguous tensor)."""
        pg, _ = self._pg(kind, members)
        opts = dist.AllreduceOptions()
        opts.reduceOp = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[reduce]
        self._wait(pg.allreduce([t], opts), "all_reduce", members)

    def all_to_all(self, x: torch.Tensor, members, kind: str = "ep") -> torch.Tensor:
        """Equal slices of `x` along dim 0: slice i goes to members[i]; returns the slices
        received, slice i from members[i], in one tensor of x's shape."""
        pg, _ = self._pg(kind, members)
        x = x.contiguous()
        out = torch.empty_like(x)
        self._wait(pg.alltoall_base(out, x, [], [], dist.AllToAllOptions()), "all_to_all",
                   members)
        return out

    # -- stage to stage ------------------------------------------------------------------------
    def send(self, dst: int, t: torch.Tensor, kind: str, mb: int) -> int:
        """Send `t` to worker `dst` (asynchronously; `t` is kept until it is out); returns the
        bytes sent."""
        pg, _ = self._pg("p2p", (self.rank, dst))
        self._reap()
        t = t.detach().contiguous()
        try:
            work = pg.send([t], 1, tag_of(kind, mb))
        except RuntimeError as e:
            raise CommError(f"rank {self.rank}: {self.library} send of {kind!r} mb {mb} to "
                            f"rank {dst} failed: {_first_line(e)}", dst) from None
        self._pending.append((work, t, (self.rank, dst)))
        return t.numel() * t.element_size()

    def recv(self, src: int, shape: tuple, dtype: str, kind: str, mb: int) -> torch.Tensor:
        """The tensor worker `src` sent as (kind, mb), of h2ir `dtype` and `shape`."""
        pg, _ = self._pg("p2p", (src, self.rank))
        t = torch.empty(tuple(shape), dtype=TORCH_DTYPE[dtype], device=self.device)
        self._wait(pg.recv([t], 0, tag_of(kind, mb)), f"recv of {kind!r} mb {mb}", (src, self.rank))
        return t

    def _reap(self) -> None:
        """Drop the sends that are out (their tensors may be freed)."""
        self._pending = [p for p in self._pending if not p[0].is_completed()]

    def flush(self) -> None:
        """Wait until every send is out."""
        pending, self._pending = self._pending, []
        for work, _, members in pending:
            self._wait(work, "send", members)

    def links(self) -> list[dict]:
        """The groups this worker runs here, as `Comm.links()` entries (one per peer it sends to
        or reduces with), for the run's links line."""
        peers = sorted({m for kind, ms in self._pgs for m in (ms[1:] if kind == "p2p" else ms)
                        if m != self.rank and (kind != "p2p" or ms[0] == self.rank)})
        return [{"dst": p, "transport": self.library, "fallback": None} for p in peers]

    def close(self) -> None:
        self.flush()
        for pg in self._pgs.values():
            try:
                pg.shutdown()
            except (RuntimeError, AttributeError):      # gloo groups may not implement it
                pass
        self._pgs.clear()


class TPCollectives:
    """The TP programs' `tp_all_reduce` / `tp_rank` ops (executor/redistribute.py TPGroupComm's
    call) on the stack's library: the tensor stays on the device."""

    def __init__(self, ccl: CCL, group: list[int], rank: int):
        self.ccl, self.group, self.rank = ccl, list(group), rank
        self.bytes = 0

    def __call__(self, op: str, *inputs, size: int, reduce: str = "sum"):
        if size != len(self.group):
            raise RuntimeError(f"program op {op} expects a TP group of {size}, this worker's "
                               f"has {len(self.group)}")
        if op == "tp_rank":
            return torch.tensor(self.rank, dtype=torch.int64, device=self.ccl.device)
        if op != "tp_all_reduce" or reduce not in ("sum", "max"):
            raise RuntimeError(f"no TP collective for op {op} (reduce={reduce!r})")
        t = inputs[0].detach().clone(memory_format=torch.contiguous_format)
        self.bytes += t.numel() * t.element_size()
        self.ccl.all_reduce_(t, self.group, reduce, kind="tp")
        return t


class EPExchange:
    """What the MoE programs' all-to-all (executor/experts.py StageComm) asks of a comm — `rank`
    and `all_to_all(parts, group)` over host arrays — on the stack's library."""

    def __init__(self, ccl: CCL):
        self.ccl, self.rank = ccl, ccl.rank

    def all_to_all(self, parts: list[np.ndarray], group, algo: str = "flat", hosts=None):
        x = torch.from_numpy(np.concatenate(parts, axis=0)).to(self.ccl.device)
        out = self.ccl.all_to_all(x, group, kind="ep").cpu().numpy()
        return np.split(out, len(parts), axis=0)


def groups_of(manifest: dict, devices: list) -> list[CommGroup]:
    """The build's groups on a stack's library that this run keeps there: those whose members all
    run torch on devices of one type (a run's --device or --device-map may move a worker, an
    edited manifest may put one on NumPy); the others fall back to DiComm, alike on every
    worker, since every worker reads the same manifest and devices."""
    workers = manifest["workers"]
    out = []
    for i, d in enumerate((manifest.get("comm") or {}).get("groups", [])):
        try:
            g = CommGroup.from_json(d)
            if g.kind not in KINDS or g.via not in ("ccl", "dicomm") or len(set(g.workers)) < 2 \
                    or not all(0 <= w < len(workers) for w in g.workers):
                raise ValueError
        except (KeyError, TypeError, ValueError):
            raise H2Error(f"manifest.json: comm.groups[{i}] is not a group of this build's "
                          f"workers ({str(d)[:80]})", hint="recompile the build with "
                          "`h2c compile`") from None
        kinds = {torch.device(devices[w] or "cpu").type for w in g.workers}
        if g.via == "ccl" and len(kinds) == 1 and \
                all(workers[w].get("backend") == "torch" for w in g.workers):
            out.append(g)
    return out


def open_ccl(manifest: dict, wid: int, devices: list, store_of, *, timeout: float,
             host: str = "127.0.0.1", namespace: str = "ccl") -> CCL | None:
    """Worker `wid`'s process groups (`groups_of`), made on the store `store_of()` returns; None
    when it has none. `devices`: every worker's torch device in this run."""
    groups = [g for g in groups_of(manifest, devices) if wid in g.workers]
    if not groups:
        return None
    return CCL(wid, groups, store_of(), device=devices[wid] or "cpu", timeout=timeout, host=host,
               namespace=namespace)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
