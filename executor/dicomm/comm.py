"""`Comm`: one rank's endpoint. Point-to-point send/recv with (kind, micro-batch) tags, ring
all-reduce, all-to-all and barrier, over tcp, shm or rdma links opened on first use.

Threading: a Comm is driven by one thread (the worker's instruction loop). Behind it, one accept
thread per listener authenticates incoming connections, and one reader thread per incoming link
moves frames into the inbox, where `recv` picks them by (src, kind, mb) in whatever order they
arrived. On a shm link with a ring (ring.py) `recv` reads the ring in its own thread instead, and
the reader thread handles only the link's control messages.

Every wait has a deadline (`timeout`, default 10 s): a peer whose process died is reported as soon
as its link closes (the kernel closes its sockets), and a peer that never connects or stops
sending is reported when the deadline passes.
"""
from __future__ import annotations

import errno
import logging
import os
import socket
import threading
import time
from collections import defaultdict, deque

import msgpack
import numpy as np

from executor.dicomm import halo, handshake, rdma, ring, shm
from executor.dicomm.errors import CommError
from executor.dicomm.frame import contiguous, dtype_name, from_bf16, make_header, to_bf16
from executor.dicomm.link import Frame, PeerFinished, StreamReceiver, StreamSender
from executor.dicomm.rendezvous import Rendezvous
from executor.dicomm.tcp import SocketStream, dial_tcp, dial_unix, listen_tcp, listen_unix, tune

TRANSPORTS = handshake.TRANSPORTS
DEFAULT_TIMEOUT = 10.0
MAX_PENDING_HANDSHAKES = 32     # connections being authenticated at once, per rank
# accept() errors that mean the listener itself is gone (closed), not a passing shortage
_LISTENER_GONE = frozenset({errno.EBADF, errno.EINVAL, errno.ENOTSOCK})
# Which transports a link may use, best first, when the requested one is unusable for a peer.
_FALLBACK_ORDER = {"rdma": ("rdma", "shm", "tcp"), "shm": ("shm", "tcp"), "tcp": ("tcp",)}

log = logging.getLogger("h2.dicomm")


def shard_bounds(size: int, n: int) -> list[int]:
    """Where the n shards of a flat array of `size` elements begin (and the last ends): n + 1
    offsets, shard k = [b[k], b[k + 1]), contiguous and near-equal (sizes differ by at most
    one element). `reduce_scatter` and `all_gather` cut by it, ZeRO-1 partitions by it."""
    return [k * size // n for k in range(n + 1)]


def connect(rank: int, world_size: int, store_host: str = "127.0.0.1", store_port: int = 29400,
            secret: str | bytes | None = None, *, transport: str = "tcp", fallback: bool = True,
            timeout: float = DEFAULT_TIMEOUT, host: str = "127.0.0.1", namespace: str = "dicomm",
            store=None, shm_max_bytes: int = shm.DEFAULT_MAX_BYTES, run: bytes = b"",
            on_foreign=None) -> "Comm":
    """Join the run: publish this rank's endpoints in the rendezvous store and start listening.

    transport: "tcp" | "shm" | "rdma". If it cannot be used here (no RDMA device, no pyverbs, not
    Linux) or for a given peer (shm to another host), fallback=True picks the next usable one
    (rdma -> shm -> tcp) and logs why; fallback=False raises CommError instead.
    secret: the per-run secret (defaults to env H2_SECRET); peers without it are rejected.
    host: address to listen on and publish (loopback by default; a node address for multi-host).
    store: an existing TCPStore (e.g. the one rank 0 hosts in-process) instead of dialling one.
    run: the run's id (rendezvous.RUN_BYTES) when the secret outlives one run: every record and
    handshake is bound to it; `on_foreign(text)` hears of records of other runs that were skipped.
    """
    if transport not in TRANSPORTS:
        raise CommError(f"unknown transport {transport!r}; expected one of {', '.join(TRANSPORTS)}")
    if not 0 <= rank < world_size:
        raise CommError(f"rank {rank} is outside 0..{world_size - 1}")
    if secret is None:
        secret = os.environ.get("H2_SECRET", "")
    key = secret.encode() if isinstance(secret, str) else bytes(secret)
    if not key:
        raise CommError("no run secret: pass secret= or set H2_SECRET",
                        hint="the launcher creates one with dicomm.new_secret() and gives it to "
                             "every worker")
    chosen, reason = _usable_transport(transport, fallback)
    rendezvous = Rendezvous(store_host, store_port, timeout, namespace, store, secret=key,
                            run=run, on_foreign=on_foreign)
    return Comm(rank, world_size, rendezvous, handshake.run_key(key, run), requested=transport,
                transport=chosen, fallback=fallback, fallback_reason=reason, timeout=timeout,
                host=host, shm_max_bytes=shm_max_bytes)


def _usable_transport(requested: str, fallback: bool) -> tuple[str, str | None]:
    """(transport to use on this rank, why it differs from the request or None)."""
    first_reason = ""
    for candidate in _FALLBACK_ORDER[requested]:
        ok, why = _local_support(candidate)
        if ok:
            if candidate != requested:
                reason = f"{first_reason}; falling back to {candidate}"
                log.warning("dicomm: %s", reason)
                return candidate, reason
            return candidate, None
        if candidate == requested:
            first_reason = why
            if not fallback:
                raise CommError(why, hint="pass fallback=True to use shm/tcp instead")
    raise CommError(f"no usable transport for {requested!r}")  # tcp is always usable


def _local_support(transport: str) -> tuple[bool, str]:
    if transport == "rdma":
        return rdma.probe()
    if transport == "shm":
        return shm.available()
    return True, ""


class Comm:
    def __init__(self, rank: int, world_size: int, rendezvous: Rendezvous, secret: bytes, *,
                 requested: str, transport: str, fallback: bool, fallback_reason: str | None,
                 timeout: float, host: str, shm_max_bytes: int):
        self.rank = rank
        self.world_size = world_size
        self.requested = requested
        self.transport = transport
        self.fallback = fallback
        self.fallback_reason = fallback_reason
        self.timeout = timeout
        self.rejected: list[str] = []          # handshakes this rank refused, for the executor's log
        self._rdv = rendezvous
        self._secret = secret
        self._shm_max_bytes = shm_max_bytes
        self._cv = threading.Condition()
        self._inbox: dict[tuple[int, str, int], deque[Frame]] = {}
        self._failed: dict[int, CommError] = {}
        self._incoming: dict[int, StreamReceiver] = {}
        self._outgoing: dict[int, StreamSender] = {}
        self._rings: dict[int, ring.RingReader] = {}   # src -> ring of its shm link (ring.py)
        self._why: dict[int, str] = {}         # peer -> why its link is not self.requested
        self._held: dict[int, list[Frame]] = defaultdict(list)
        self._coll_seq: dict[tuple, int] = defaultdict(int)
        self._closed = False
        self._pending = threading.BoundedSemaphore(MAX_PENDING_HANDSHAKES)
        self._boot, self._hostname = shm.boot_id(), socket.gethostname()

        self._local = ["tcp"] + [t for t in ("shm", "rdma") if _local_support(t)[0]]
        self._listeners = [listen_tcp(host)]
        unix_name = None
        if "shm" in self._local:
            unix, unix_name = listen_unix()
            self._listeners.append(unix)
        self._rdv.publish(f"rank/{rank}", {
            "host": host, "port": self._listeners[0].getsockname()[1], "unix": unix_name,
            "boot": self._boot, "hostname": self._hostname, "pid": os.getpid(),
            "transports": self._local})
        for listener in self._listeners:
            threading.Thread(target=self._accept_loop, args=(listener,), daemon=True,
                             name=f"dicomm-accept-{rank}").start()

    def __repr__(self) -> str:
        return (f"Comm(rank={self.rank}, world_size={self.world_size}, transport={self.transport!r}"
                f"{', closed' if self._closed else ''})")

    def __enter__(self) -> "Comm":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- point to point -----------------------------------------------------------------------
    def send(self, dst: int, array: np.ndarray, kind: str = "act", mb: int = 0, stage: int = 0,
             dtype: str | None = None) -> None:
        """Send one tensor to `dst`, tagged (kind, mb). Returns once the bytes are handed to the
        transport (kernel socket buffer, shm segment, or RDMA slot); `array` may be reused."""
        self._check_open()
        if dst == self.rank:
            a = np.array(contiguous(array), copy=True)
            header = make_header(a, kind=kind, stage=stage, mb=mb, seq=0, src=self.rank,
                                 dtype=dtype)
            self._deliver(Frame(header, a))
            return
        self._sender(dst).send(array, kind=kind, stage=stage, mb=mb, dtype=dtype)

    def recv(self, src: int, kind: str = "act", mb: int = 0, *, view: bool = False,
             timeout: float | None = None) -> np.ndarray:
        """The tensor `src` sent with tag (kind, mb). Its tag, payload digest, dtype and shape were
        checked.

        view=True may return a read-only view into the sender's shm segment instead of a copy;
        it stays valid until the next recv from `src` or `release()`."""
        return self.recv_frame(src, kind, mb, view=view, timeout=timeout).array

    def recv_frame(self, src: int, kind: str = "act", mb: int = 0, *, view: bool = False,
                   timeout: float | None = None) -> Frame:
        """Like recv, but returns the Frame (header with stage, dtype name, seq...)."""
        self._check_open()
        self.release(src)
        frame = self._take(src, kind, mb, self.timeout if timeout is None else timeout)
        if frame.release is not None:
            if view:
                self._held[src].append(frame)
            else:
                frame.array = frame.array.copy()
                frame.release()
                frame.release = None
        return frame

    def release(self, src: int | None = None) -> None:
        """Give back the shm views handed out by recv(view=True) from `src` (or from everyone)."""
        for peer in ([src] if src is not None else list(self._held)):
            for frame in self._held.pop(peer, []):
                frame.release()

    def link_transport(self, peer: int) -> str | None:
        """Transport of the open link to `peer` (from this rank's sends), None if none is open."""
        link = self._outgoing.get(peer)
        return link.transport if link else None

    def links(self) -> list[dict]:
        """The links this rank opened (one per peer it sent to), as the transports that actually
        carry them: [{"dst", "transport", "fallback"}], fallback = why the link does not use the
        requested transport (None when it does)."""
        out = []
        for dst, link in sorted(self._outgoing.items()):
            why = None
            if link.transport != self.requested:
                why = self._why.get(dst) or self.fallback_reason or \
                    f"{self.requested} unusable for rank {dst}"
            out.append({"dst": dst, "transport": link.transport, "fallback": why})
        return out

    # -- collectives --------------------------------------------------------------------------
    def all_reduce(self, arrays: list[np.ndarray], group: list[int], op: str = "avg") -> None:
        """Ring all-reduce (reduce-scatter then all-gather) of each array, in place, across
        `group` (every member passes the same list in the same order). op: "sum" | "avg".
        Arrays are numpy (a torch backend passes tensor.numpy() views), so replicas on different
        backends reduce together. bf16 (uint16) arrays are summed in float32."""
        group = self._check_group(group)
        if op not in ("sum", "avg"):
            raise ValueError(f"all_reduce op must be 'sum' or 'avg', got {op!r}")
        buckets: dict[str, list[np.ndarray]] = {}
        for a in arrays:
            if not isinstance(a, np.ndarray) or not a.flags.writeable:
                raise ValueError("all_reduce reduces in place: pass writeable numpy arrays")
            name = dtype_name(a.dtype)
            if name == "bool" or (op == "avg" and name in ("i32", "i64")):
                raise ValueError(f"all_reduce op {op!r} is not defined for {name} arrays")
            buckets.setdefault(name, []).append(a)
        seq = self._next_seq("all_reduce", group)
        n = len(group)
        for b, (name, members) in enumerate(buckets.items()):
            in_place = name != "bf16" and len(members) == 1 and members[0].flags.c_contiguous
            if in_place:
                flat = members[0].reshape(-1)   # a view: reduce straight into the caller's array
            elif name == "bf16":
                flat = np.concatenate([from_bf16(a).reshape(-1) for a in members])
            else:
                flat = np.concatenate([a.reshape(-1) for a in members])
            if n > 1:
                self._ring_all_reduce(flat, group, f"all_reduce#{seq}.{b}")
            if op == "avg":
                flat /= n
            if not in_place:
                offset = 0
                for a in members:
                    part = flat[offset:offset + a.size].reshape(a.shape)
                    a[...] = to_bf16(part) if name == "bf16" else part
                    offset += a.size

    def reduce_scatter(self, flat: np.ndarray, group: list[int], op: str = "avg") -> np.ndarray:
        """The ring all-reduce's first half: every member passes a 1-D array of one size and
        dtype; returns this rank's shard of the sum (or mean) over the group,
        `flat[b[r]:b[r + 1]]` with b = `shard_bounds(flat.size, len(group))` and r the rank's
        index in `group`. The shard is a view of `flat`, which is the ring's scratch: its other
        shards hold partial sums afterwards. Each element is summed in the order `all_reduce`
        sums it, so ZeRO-1's gradients equal the all-reduced ones bit for bit."""
        group, n, r, flat = self._ring_args("reduce_scatter", flat, group, op)
        kind = f"reduce_scatter#{self._next_seq('reduce_scatter', group)}"
        b = shard_bounds(flat.size, n)
        self._ring_reduce_scatter(flat, group, kind, b)
        mine = flat[b[r]:b[r + 1]]
        if op == "avg":
            mine /= n
        return mine

    def all_gather(self, part: np.ndarray, group: list[int], size: int) -> np.ndarray:
        """The ring all-reduce's second half: every member passes its shard of a 1-D array of
        `size` elements (rank index r: `shard_bounds(size, n)[r:r + 2]`, as `reduce_scatter`
        returns it); returns the whole array, a new one, the same on every member."""
        group, n, r, part = self._ring_args("all_gather", part, group, "")
        b = shard_bounds(size, n)
        if part.size != b[r + 1] - b[r]:
            raise ValueError(f"all_gather: rank index {r} of {n} holds elements {b[r]}.."
                             f"{b[r + 1]} of {size}, got {part.size}")
        out = np.empty(size, dtype=part.dtype)
        out[b[r]:b[r + 1]] = part
        self._ring_all_gather(out, group, f"all_gather#{self._next_seq('all_gather', group)}",
                              b, 0)
        return out

    def _ring_args(self, what: str, flat, group, op: str):
        group = self._check_group(group)
        if not isinstance(flat, np.ndarray) or flat.ndim != 1 or not flat.flags.c_contiguous:
            raise ValueError(f"{what} takes a contiguous 1-D numpy array")
        if what == "reduce_scatter" and not flat.flags.writeable:
            raise ValueError("reduce_scatter reduces in place: pass a writeable array")
        name = dtype_name(flat.dtype)
        if what == "reduce_scatter" and (op not in ("sum", "avg") or name in ("bool", "bf16") or (
                op == "avg" and name in ("i32", "i64"))):
            raise ValueError(f"{what} op {op!r} is not defined for {name} arrays")
        return group, len(group), group.index(self.rank), flat

    def _ring_all_reduce(self, flat: np.ndarray, group: list[int], kind: str) -> None:
        """Reduce-scatter then all-gather (Patarasuk & Yuan 2009; Thakur et al. 2005 Sec. 4)."""
        b = shard_bounds(flat.size, len(group))
        self._ring_reduce_scatter(flat, group, kind, b)
        self._ring_all_gather(flat, group, kind, b, len(group) - 1)

    def _ring_reduce_scatter(self, flat: np.ndarray, group: list[int], kind: str,
                             b: list[int]) -> None:
        """In place: afterwards the rank at index r holds the group's sum of shard r. Step s
        sends shard r-s-1 to the right and adds the left's shard r-s-2 into its own, so after
        n-1 steps shard r is summed over every rank; tags: mb = step."""
        n, r, right, left, chunk = self._ring(flat, group, b)
        for s in range(n - 1):
            self.send(right, chunk(r - s - 1), kind=kind, mb=s)
            incoming = self._ring_recv(left, kind, s, chunk(r - s - 2))
            np.add(chunk(r - s - 2), incoming, out=chunk(r - s - 2))
            self.release(left)

    def _ring_all_gather(self, flat: np.ndarray, group: list[int], kind: str, b: list[int],
                         mb0: int) -> None:
        """In place: the rank at index r holds shard r of `flat`; afterwards every shard, passed
        round the ring (tags: mb = mb0 + step)."""
        n, r, right, left, chunk = self._ring(flat, group, b)
        for s in range(n - 1):
            self.send(right, chunk(r - s), kind=kind, mb=mb0 + s)
            chunk(r - s - 1)[...] = self._ring_recv(left, kind, mb0 + s, chunk(r - s - 1))
            self.release(left)

    def _ring(self, flat: np.ndarray, group: list[int], b: list[int]):
        """(n, this rank's index, right and left neighbours, chunk(c): shard c mod n of flat)."""
        n = len(group)
        r = group.index(self.rank)

        def chunk(c: int) -> np.ndarray:
            c %= n
            return flat[b[c]:b[c + 1]]
        return n, r, group[(r + 1) % n], group[(r - 1) % n], chunk

    def _ring_recv(self, left: int, kind: str, step: int, like: np.ndarray) -> np.ndarray:
        got = self.recv(left, kind, step, view=True)
        if got.shape != like.shape or got.dtype != like.dtype:
            raise CommError(f"{kind.split('#')[0]} mismatch: rank {left} sent "
                            f"{got.dtype}{list(got.shape)} "
                            f"where rank {self.rank} has {like.dtype}{list(like.shape)} (the group "
                            f"members passed different arrays)", left)
        return got

    def all_to_all(self, arrays: list[np.ndarray], group: list[int], *, algo: str = "flat",
                   hosts=None) -> list[np.ndarray]:
        """arrays[i] goes to group[i]; returns outs with outs[i] received from group[i].

        algo="halo" with hosts (host id of each group member, e.g. the manifest's
        workers[i].host) aggregates inter-host traffic per node pair (executor/dicomm/halo.py);
        without hosts, or with every member on one host, it is the flat exchange."""
        group = self._check_group(group)
        if len(arrays) != len(group):
            raise ValueError(f"all_to_all needs one array per group member: {len(arrays)} arrays "
                             f"for {len(group)} ranks")
        if algo not in ("flat", "halo"):
            raise ValueError(f"all_to_all algo must be 'flat' or 'halo', got {algo!r}")
        layout = halo.plan(group, hosts)     # checks hosts also for flat: one per member
        kind = f"all_to_all#{self._next_seq('all_to_all', group)}"
        if algo == "halo" and layout is not None:
            return halo.all_to_all(self, arrays, group, layout, kind)
        r = group.index(self.rank)
        order = [group[(r + k) % len(group)] for k in range(1, len(group))]  # spread the load
        for peer in order:
            self.send(peer, arrays[group.index(peer)], kind=kind)
        return [np.array(arrays[i], copy=True) if peer == self.rank else self.recv(peer, kind)
                for i, peer in enumerate(group)]

    def barrier(self, group: list[int] | None = None) -> None:
        """Dissemination barrier: ceil(log2 n) rounds of empty messages."""
        group = self._check_group(group if group is not None else list(range(self.world_size)))
        kind = f"barrier#{self._next_seq('barrier', group)}"
        n, r = len(group), group.index(self.rank)
        empty = np.zeros(0, dtype=np.bool_)
        step, round_ = 1, 0
        while step < n:
            self.send(group[(r + step) % n], empty, kind=kind, mb=round_)
            self.recv(group[(r - step) % n], kind, round_)
            step, round_ = step * 2, round_ + 1

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for listener in self._listeners:
            try:
                listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            listener.close()
        self.release()
        for link in list(self._outgoing.values()) + list(self._incoming.values()):
            link.close()
        with self._cv:
            self._cv.notify_all()

    # -- internals ----------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise CommError(f"rank {self.rank}: the comm is closed")

    def _check_group(self, group) -> list[int]:
        group = [int(g) for g in group]
        if self.rank not in group:
            raise ValueError(f"rank {self.rank} is not in the group {group}")
        if len(set(group)) != len(group) or not all(0 <= g < self.world_size for g in group):
            raise ValueError(f"group {group} must list distinct ranks in 0..{self.world_size - 1}")
        return group

    def _next_seq(self, what: str, group: list[int]) -> int:
        key = (what, tuple(group))
        self._coll_seq[key] += 1
        return self._coll_seq[key]

    def _take(self, src: int, kind: str, mb: int, timeout: float) -> Frame:
        if not 0 <= src < self.world_size:
            raise CommError(f"rank {src} is outside 0..{self.world_size - 1}")
        key = (src, kind, mb)
        deadline = time.monotonic() + timeout
        while True:
            with self._cv:
                frame = self._pop(key)
                if frame is not None:
                    return frame
                link_ring = self._rings.get(src)
                if link_ring is None:
                    self._check_waiting(src, kind, mb, timeout, deadline)
                    self._cv.wait(deadline - time.monotonic())
                    continue
            # A shm ring link: this thread reads the ring itself (no hand-off per frame); frames
            # with other tags go to the inbox on the way. It stops to re-check the inbox (the
            # link's reader thread drained the ring for a sender that found it full), a failure
            # (only after the ring is empty: frames sent before a peer died are delivered) and
            # the deadline.
            frame = link_ring.take(lambda h: h.kind == kind and h.mb == mb, self._deliver,
                                   deadline, lambda: key in self._inbox or src in self._failed
                                   or self._closed)
            if frame is not None:
                return frame
            with self._cv:
                frame = self._pop(key)
                if frame is not None:
                    return frame
                self._check_waiting(src, kind, mb, timeout, deadline)

    def _pop(self, key) -> Frame | None:
        queue = self._inbox.get(key)
        if not queue:
            return None
        frame = queue.popleft()
        if not queue:
            del self._inbox[key]
        return frame

    def _check_waiting(self, src: int, kind: str, mb: int, timeout: float,
                       deadline: float) -> None:
        """Raise if waiting for (src, kind, mb) is hopeless: link failed, comm closed, deadline."""
        if src in self._failed:
            raise CommError(f"rank {self.rank}: waiting for {kind!r} mb {mb} from rank "
                            f"{src}: {self._failed[src].message}", src)
        self._check_open()
        if deadline - time.monotonic() <= 0:
            never = "" if src in self._incoming else f"; rank {src} never connected"
            raise CommError(f"rank {self.rank}: no {kind!r} frame for micro-batch {mb} "
                            f"from rank {src} within {timeout:g} s{never}", src,
                            hint="the peer died, hung, or never sent it; a stage that "
                                 "legitimately computes longer needs a larger timeout")

    def _deliver(self, frame: Frame) -> None:
        key = (frame.header.src, frame.header.kind, frame.header.mb)
        with self._cv:
            self._inbox.setdefault(key, deque()).append(frame)
            self._cv.notify_all()

    def _link_failed(self, src: int, err: CommError) -> None:
        if self._closed:
            return
        if not isinstance(err, PeerFinished):
            log.warning("dicomm rank %d: link from rank %d failed: %s", self.rank, src,
                        err.message)
        with self._cv:
            self._failed.setdefault(src, err)
            self._cv.notify_all()
        link_ring = self._rings.get(src)
        if link_ring is not None:
            link_ring.ring()      # wake a recv sleeping on the ring's doorbell

    def _ring_ready(self, receiver) -> None:
        """A shm link's reader thread mapped the link's ring: recv reads it from now on."""
        with self._cv:
            self._rings[receiver.src] = receiver.ring
            self._cv.notify_all()

    # -- opening links ------------------------------------------------------------------------
    def _sender(self, dst: int) -> StreamSender:
        link = self._outgoing.get(dst)
        if link is not None:
            return link
        if not 0 <= dst < self.world_size:
            raise CommError(f"rank {dst} is outside 0..{self.world_size - 1}")
        record = self._rdv.lookup(f"rank/{dst}", f"rank {dst}'s endpoint record")
        deadline = time.monotonic() + self.timeout
        for transport in self._link_transports(dst, record):
            try:
                link = self._open_retrying(dst, record, transport, deadline)
                break
            except (OSError, CommError) as e:
                if transport == "tcp" or not self.fallback or isinstance(e, _Refused):
                    raise e if isinstance(e, CommError) else CommError(
                        f"rank {self.rank}: cannot connect to rank {dst} over {transport}: "
                        f"{e}", dst) from None
                why = e.message if isinstance(e, CommError) else (e.strerror or str(e))
                self._why[dst] = f"{transport} link failed: {why}"
                log.warning("dicomm rank %d: %s link to rank %d failed (%s); falling back",
                            self.rank, transport, dst, why)
        self._outgoing[dst] = link
        return link

    def _link_transports(self, dst: int, record: dict) -> list[str]:
        """Transports to try for the link to dst, best first."""
        theirs = record.get("transports", ["tcp"])
        same_host = bool(self._boot) and record.get("boot") == self._boot \
            and record.get("hostname") == self._hostname
        usable = []
        for t in _FALLBACK_ORDER[self.transport]:
            if t in theirs and t in self._local and (t != "shm" or same_host):
                usable.append(t)
            elif t == self.transport and not self.fallback:
                why = "is on another host" if t == "shm" and t in theirs else \
                    f"cannot use {t} (it offers {', '.join(theirs)})"
                raise CommError(f"rank {self.rank}: no {t} link to rank {dst}: rank {dst} {why}",
                                dst, hint="pass fallback=True to allow tcp")
        if not usable:
            raise CommError(f"rank {self.rank}: rank {dst}'s endpoint record offers no transport "
                            f"this rank can use ({', '.join(theirs)})", dst)
        if usable[0] != self.transport:
            t = self.transport
            if t not in theirs:
                self._why[dst] = f"rank {dst} does not offer {t}"
            elif t == "shm" and t in self._local:
                self._why[dst] = "peer on another host"
            else:
                self._why[dst] = f"{t} unusable on rank {self.rank}"
            log.warning("dicomm rank %d: link to rank %d uses %s instead of %s", self.rank, dst,
                        usable[0], self.transport)
        return usable

    def _open_retrying(self, dst: int, record: dict, transport: str,
                       deadline: float) -> StreamSender:
        """A refused connection may mean the record is a stale one from an earlier run on the
        same store: re-read it until the peer has published its own or the deadline passes."""
        while True:
            try:
                return self._open(dst, record, transport)
            except (ConnectionRefusedError, handshake.StaleEndpoint):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
                record = self._rdv.lookup(f"rank/{dst}", f"rank {dst}'s endpoint record")

    def _open(self, dst: int, record: dict, transport: str) -> StreamSender:
        if transport == "shm":
            sock = dial_unix(record["unix"], self.timeout)
        else:
            sock = dial_tcp(record["host"], record["port"], self.timeout)
        tune(sock)
        stream = SocketStream(sock, dst)
        try:
            if transport == "rdma":
                return self._open_rdma(dst, stream)
            keys = self._handshake(stream, dst, transport).keys
        except BaseException:
            stream.close()
            raise
        if transport == "shm":
            return shm.ShmSender(stream, self.rank, dst, keys, self.timeout, self._shm_max_bytes)
        return StreamSender(stream, self.rank, dst, keys)

    def _handshake(self, stream: SocketStream, dst: int, transport: str,
                   setup: bytes = b"") -> handshake.Connected:
        stream.deadline = time.monotonic() + self.timeout  # the whole handshake, however slow
        try:
            return handshake.connect(stream, self.rank, dst, self._secret, transport, setup)
        except handshake.StaleEndpoint:
            raise
        except CommError as e:
            raise _Refused(e.message, dst, e.hint) from None
        except (socket.timeout, TimeoutError):
            raise CommError(f"rank {self.rank}: handshake with rank {dst} timed out after "
                            f"{self.timeout} s", dst) from None
        finally:
            stream.deadline = None
            stream.sock.settimeout(self.timeout)

    def _open_rdma(self, dst: int, stream: SocketStream) -> StreamSender:
        qp = rdma.QueuePair()
        try:
            packed = self._rdv.publish(f"link/{self.rank}-{dst}/src", qp.local)
            connected = self._handshake(stream, dst, "rdma", handshake.setup_digest(packed))
            raw = self._rdv.lookup_raw(f"link/{self.rank}-{dst}/dst",
                                       f"rank {dst}'s RDMA queue-pair record")
            if handshake.setup_digest(raw) != connected.setup:
                raise _Refused(f"rank {dst}'s RDMA queue-pair record in the store does not match "
                               f"its handshake (tampered store?)", dst)
            qp.connect(msgpack.unpackb(raw, raw=False))
        except BaseException:
            qp.close()
            raise
        return rdma.RdmaSender(rdma.VerbsStream(qp, stream, dst, self.timeout), self.rank, dst,
                               connected.keys)

    # -- accepting links ----------------------------------------------------------------------
    def _accept_loop(self, listener: socket.socket) -> None:
        """Admit connections until the Comm closes. At most MAX_PENDING_HANDSHAKES are being
        authenticated at once (the rest wait in the listen backlog), and a failing accept()
        (out of descriptors, an aborted connection) is logged and retried, never fatal."""
        pause = 0.0
        while not self._closed:
            self._pending.acquire()
            try:
                sock, addr = listener.accept()
            except OSError as e:
                self._pending.release()
                if self._closed or e.errno in _LISTENER_GONE:
                    return
                pause = min(1.0, max(0.01, 2 * pause))
                if pause < 0.02 or pause == 1.0:        # the first of a run of failures, then 1/s
                    log.warning("dicomm rank %d: accept failed: %s; retrying", self.rank,
                                e.strerror or e)
                time.sleep(pause)
                continue
            pause = 0.0
            threading.Thread(target=self._admit_one, args=(sock, addr), daemon=True,
                             name=f"dicomm-admit-{self.rank}").start()

    def _admit_one(self, sock: socket.socket, addr) -> None:
        try:
            self._admit(sock, addr)
        finally:
            self._pending.release()

    def _admit(self, sock: socket.socket, addr) -> None:
        tune(sock)
        sock.settimeout(self.timeout)
        stream = SocketStream(sock)
        stream.deadline = time.monotonic() + self.timeout   # the whole handshake, however slow
        where = addr if addr else "a local socket"
        built: dict = {}

        def prepare(src: int, transport: str, digest: bytes) -> bytes:
            if not 0 <= src < self.world_size or src == self.rank:
                raise CommError(f"claimed rank {src} is not a peer of rank {self.rank}")
            if src in self._incoming:
                raise CommError(f"rank {src} is already connected")
            if transport not in self._local:
                raise CommError(f"rank {self.rank} cannot use {transport}")
            if (transport == "shm") != (sock.family == socket.AF_UNIX):
                raise CommError(f"{transport} link offered on the wrong listener")
            if transport != "rdma":
                return b""
            raw = self._rdv.lookup_raw(f"link/{src}-{self.rank}/src",
                                       f"rank {src}'s RDMA queue-pair record")
            if handshake.setup_digest(raw) != digest:
                raise CommError(f"rank {src}'s RDMA queue-pair record in the store does not "
                                f"match its handshake (tampered store?)")
            qp = rdma.QueuePair()
            built["qp"] = qp
            verbs = rdma.VerbsStream(qp, stream, src, self.timeout)
            verbs.post_all_receives()
            qp.connect(msgpack.unpackb(raw, raw=False))
            built["stream"] = verbs
            return handshake.setup_digest(
                self._rdv.publish(f"link/{src}-{self.rank}/dst", qp.local))

        try:
            accepted = handshake.accept(stream, self.rank, self._secret, prepare, self.world_size)
        except Exception as e:  # a hostile peer must never take the listener down with it
            reason = e.message if isinstance(e, CommError) else \
                f"handshake failed: {type(e).__name__}: {e}"
            if not self._closed:
                self.rejected.append(f"{where}: {reason}")
                log.warning("dicomm rank %d: rejected connection from %s: %s", self.rank, where,
                            reason)
            if "qp" in built:
                built["qp"].close()
            stream.close()
            return
        sock.settimeout(None)   # the reader waits as long as the run lasts; recv() has deadlines
        stream.deadline = None
        stream.peer = accepted.src
        stream.takes_fds = accepted.transport == "shm"      # its ring and segments
        kinds = {"tcp": StreamReceiver, "shm": shm.ShmReceiver, "rdma": rdma.RdmaReceiver}
        extra = {"on_ring": self._ring_ready, "timeout": self.timeout} \
            if accepted.transport == "shm" else {}
        receiver = kinds[accepted.transport](built.get("stream", stream), accepted.src, self.rank,
                                             self._deliver, self._link_failed, accepted.keys,
                                             **extra)
        with self._cv:
            if self._closed:
                receiver.close()
                return
            self._incoming[accepted.src] = receiver
            self._cv.notify_all()
        receiver.start()


class _Refused(CommError):
    """The peer answered but refused the link: falling back to another transport won't help."""


def describe_links(links: list[dict], name: str = "w{}") -> str:
    """One line for the run's log from every rank's `Comm.links()` (each entry with its "src"
    added): "links: 6 shm" or "links: 4 shm, 2 tcp (w0->w1: peer on another host; ...)"."""
    if not links:
        return "links: none opened"
    counts: dict[str, int] = {}
    for link in links:
        counts[link["transport"]] = counts.get(link["transport"], 0) + 1
    line = "links: " + ", ".join(f"{n} {t}" for t, n in counts.items())
    why = [f"{name.format(link['src'])}->{name.format(link['dst'])}: {link['fallback']}"
           for link in sorted(links, key=lambda l: (l["src"], l["dst"])) if link.get("fallback")]
    return line + (f" ({'; '.join(why)})" if why else "")
