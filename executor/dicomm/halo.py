"""HALO all-to-all (Piper, arXiv 2605.05049): hierarchical, aggregated all-to-all across nodes.

The flat all-to-all (`Comm.all_to_all(..., algo="flat")`) sends n-1 messages per rank, so a
node's k ranks push k(n-k) small messages through its NICs. HALO sends the same bytes as
N-1 large messages per node (N nodes):

  (a) gather   every rank sends its messages for ranks of its own node directly, and for each
               remote node M one bundle (its arrays for M's ranks, packed) to M's aggregator on
               its own node. Local rank j aggregates remote nodes j, j+L, j+2L, ... (L ranks on
               the node; remote nodes counted from the next node on), so the aggregator roles,
               and the NICs they drive, are spread over the node's ranks;
  (b) exchange each aggregator packs the L bundles for M into ONE buffer and sends it to its peer
               aggregator on M (the rank of M that aggregates this node), over the inter-host
               link; DiComm picks shm inside a host and tcp (or rdma) across hosts by itself;
  (c) scatter  the receiving aggregator splits the buffer by destination and sends each local
               rank one bundle holding the arrays every rank of the source node sent it.

The phases run one after another on each rank (h2ir/planner/alltoall.py models exactly this).
A bundle is one int32 frame: a msgpack table of (dtype, shape) per array, then the payloads at
8-byte offsets; arrays are copied byte for byte, so results are bit-identical to flat's.
"""
from __future__ import annotations

import math
import time
import weakref
from dataclasses import dataclass

import msgpack
import numpy as np

from executor.dicomm.errors import CommError
from executor.dicomm.frame import DTYPES, contiguous, dtype_name

_ALIGN = 8

# Where this process's HALO calls spent their time, summed since the last reset (bench_halo
# prints it beside the model's phases). On an aggregator: gather = start until its first
# aggregated buffer is packed, exchange = until its last buffer from a peer aggregator arrived,
# scatter = the rest; a rank that aggregates nothing counts only `calls`.
PHASE_S = {"gather": 0.0, "exchange": 0.0, "scatter": 0.0, "calls": 0}


def reset_phases() -> None:
    PHASE_S.update(gather=0.0, exchange=0.0, scatter=0.0, calls=0)


@dataclass(frozen=True)
class HaloPlan:
    """Who sits where: `nodes[m]` = group indices on node m (group order), `node_of[i]` = node of
    group index i. Nodes are numbered in order of first appearance in the group."""
    nodes: tuple
    node_of: tuple

    def aggregator(self, node: int, remote: int) -> int:
        """Group index of the rank on `node` that aggregates the traffic to and from `remote`."""
        local = self.nodes[node]
        return local[((remote - node - 1) % len(self.nodes)) % len(local)]


def plan(group: list[int], hosts) -> HaloPlan | None:
    """The HaloPlan for `group` whose members sit on `hosts` (one host id per member, any
    hashable: an int node index or a host name); None when HALO has nothing to aggregate (no
    hosts given, or every member on one host)."""
    if hosts is None:
        return None
    hosts = list(hosts)
    if len(hosts) != len(group):
        raise ValueError(f"all_to_all hosts= needs one host per group member: {len(hosts)} hosts "
                         f"for the {len(group)} ranks {group}")
    index: dict = {}
    node_of = tuple(index.setdefault(h, len(index)) for h in hosts)
    if len(index) <= 1:
        return None
    nodes = tuple(tuple(i for i, m in enumerate(node_of) if m == n) for n in range(len(index)))
    return HaloPlan(nodes, node_of)


def all_to_all(comm, arrays: list[np.ndarray], group: list[int], p: HaloPlan,
               kind: str) -> list[np.ndarray]:
    """HALO all-to-all on `comm` (a Comm): arrays[i] goes to group[i]; outs[i] came from
    group[i]. `kind` is this call's unique tag prefix."""
    t0 = time.perf_counter()
    me = group.index(comm.rank)
    home = p.node_of[me]
    local = p.nodes[home]
    n_nodes = len(p.nodes)
    remotes = [(home + d) % n_nodes for d in range(1, n_nodes)]
    mine = [m for m in remotes if p.aggregator(home, m) == me]
    outs: list = [None] * len(group)
    outs[me] = np.array(arrays[me], copy=True)
    k_local, k_gather, k_exchange, k_scatter = (f"{kind}.{x}" for x in "lgxs")

    # (a) gather: node-local arrays directly, bundles for remote nodes to their aggregators
    at = local.index(me)
    for i in local[at + 1:] + local[:at]:
        comm.send(group[i], arrays[i], kind=k_local)
    kept = {}
    for m in remotes:
        bundle = pack([arrays[d] for d in p.nodes[m]], _scratch(comm, ("gather", m)))
        agg = p.aggregator(home, m)
        if agg == me:
            kept[m] = bundle
        else:
            comm.send(group[agg], bundle, kind=k_gather, mb=m)

    # (b) exchange: one buffer per remote node this rank aggregates
    t1 = t2 = None
    for m in mine:
        bundles = [kept.pop(m) if s == me else comm.recv(group[s], k_gather, m, view=True)
                   for s in local]
        buffer = pack(bundles, _scratch(comm, ("exchange", m)))
        comm.release()
        t1 = t1 or time.perf_counter()
        comm.send(group[p.aggregator(m, home)], buffer, kind=k_exchange, mb=home)

    # (c) scatter: split each buffer by local destination
    for m in mine:
        peer = group[p.aggregator(m, home)]
        got = comm.recv(peer, k_exchange, m, view=True)
        t2 = time.perf_counter()
        per_src = [unpack(b, copy=False) for b in unpack(got, copy=False)]
        if len(per_src) != len(p.nodes[m]) or any(len(a) != len(local) for a in per_src):
            raise CommError(f"rank {comm.rank}: HALO buffer from rank {peer} does not match the "
                            f"group layout (the members passed different hosts=)", peer)
        for j, d in enumerate(local):
            column = [a[j] for a in per_src]
            if d == me:
                for s, a in zip(p.nodes[m], column):
                    outs[s] = np.array(a, copy=True)
            else:
                comm.send(group[d], pack(column, _scratch(comm, ("scatter", d))), kind=k_scatter,
                          mb=m)
        comm.release(peer)

    for i in local:
        if i != me:
            outs[i] = comm.recv(group[i], k_local)
    for m in remotes:
        agg = p.aggregator(home, m)
        if agg == me:
            continue
        got = unpack(comm.recv(group[agg], k_scatter, m, view=True), copy=True)
        comm.release(group[agg])
        if len(got) != len(p.nodes[m]):
            raise CommError(f"rank {comm.rank}: HALO bundle from rank {group[agg]} holds "
                            f"{len(got)} arrays, expected {len(p.nodes[m])}", group[agg])
        for s, a in zip(p.nodes[m], got):
            outs[s] = a
    t3 = time.perf_counter()
    PHASE_S["calls"] += 1
    if t1 is not None:
        PHASE_S["gather"] += t1 - t0
        PHASE_S["exchange"] += t2 - t1
        PHASE_S["scatter"] += t3 - t2
    return outs


# -- bundles ----------------------------------------------------------------------------------

# Pack buffers kept per Comm and role between calls: a fresh multi-MiB buffer faults its pages in
# on first write (measured ~1.4 GB/s here, against ~30 GB/s memcpy into a warm one), which made
# HALO 3-4x slower than flat at 1 MiB per destination on loopback. A buffer may be reused as soon
# as the send that carried it returns (the bytes were handed to the transport). Kept until the
# Comm is collected: at most the largest bundle and buffer sizes seen, per role.
_SCRATCH: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _scratch(comm, role):
    pool = _SCRATCH.setdefault(comm, {})

    def get(nbytes: int) -> np.ndarray:
        buf = pool.get(role)
        if buf is None or buf.size < nbytes:
            buf = pool[role] = np.empty(_pad(nbytes), dtype=np.uint8)
        return buf[:nbytes]
    return get


def _pad(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def pack(arrays: list[np.ndarray], scratch=None) -> np.ndarray:
    """Arrays of any wire dtypes and shapes as one int32 array (one frame): u64 table length,
    msgpack [[dtype name, shape], ...], payloads each at an 8-byte offset (padding zeroed).
    scratch(nbytes) -> a reusable uint8 buffer of that size (default: a new one)."""
    parts = [contiguous(a) for a in arrays]
    table = msgpack.packb([[dtype_name(a.dtype), list(a.shape)] for a in parts])
    head = _ALIGN + _pad(len(table))
    total = head + sum(_pad(a.nbytes) for a in parts)
    buf = scratch(total) if scratch else np.empty(total, dtype=np.uint8)
    buf[:_ALIGN] = np.frombuffer(np.uint64(len(table)).tobytes(), np.uint8)
    buf[_ALIGN:head] = 0
    buf[_ALIGN:_ALIGN + len(table)] = np.frombuffer(table, np.uint8)
    at = head
    for a in parts:
        buf[at:at + a.nbytes] = a.reshape(-1).view(np.uint8)
        buf[at + a.nbytes:at + _pad(a.nbytes)] = 0
        at += _pad(a.nbytes)
    return buf.view(np.int32)


def unpack(packed: np.ndarray, copy: bool = True) -> list[np.ndarray]:
    """The arrays `pack` packed: owned copies, or (copy=False) views into `packed`."""
    raw = np.ascontiguousarray(packed).reshape(-1).view(np.uint8)
    if raw.size < _ALIGN:
        raise CommError(f"HALO bundle of {raw.size} bytes is shorter than its table length")
    n = int(raw[:_ALIGN].view(np.uint64)[0])
    head = _ALIGN + _pad(n)
    if head > raw.size:
        raise CommError(f"HALO bundle table of {n} bytes overruns its {raw.size}-byte buffer")
    table = msgpack.unpackb(raw[_ALIGN:_ALIGN + n].tobytes(), raw=False)
    out, at = [], head
    for name, shape in table:
        dt = DTYPES.get(name)
        if dt is None:
            raise CommError(f"HALO bundle holds unknown dtype {name!r}")
        nbytes = math.prod(shape) * dt.itemsize
        if at + nbytes > raw.size:
            raise CommError(f"HALO bundle entry {dt}{shape} overruns its {raw.size}-byte buffer")
        a = raw[at:at + nbytes].view(dt).reshape(shape)
        out.append(a.copy() if copy else a)
        at += _pad(nbytes)
    return out
