"""The shm link's frame ring: one shared-memory ring per directed link, read in the receiving
rank's own thread, so that a small message costs no thread hand-off.

A shm link src -> dst keeps its AF_UNIX socket (handshake, segment descriptors, control messages,
EOF when a process dies) and adds, at open, one memfd ring written only by src and an eventfd
"doorbell" (both passed to dst over the socket with SCM_RIGHTS). Every tensor frame of the link is
one ring record, in send order:

  * a payload up to INLINE_BYTES is copied into the record itself;
  * a larger one is copied into a shm segment (shm.py) and its record says (segment, offset).

Layout of the ring file: a control block (head at byte 0, written only by the sender; tail at byte
64, written only by the receiver; both u64 byte counts that only grow), then RING_BYTES of data.
A record starts 8-aligned with u32 length (the whole record, padded to 8; WRAP means "continue at
the start of the data") and u32 zero, then

    prefix   b"h2", version 2, b"R", u32 length of the rest of the head
    fixed    seq q, src i, stage q, mb q, nbytes q, segment q (-1: inline), offset q,
             dtype u8 (index in WIRE_DTYPES), ndim u8, kind length u16
    shape    ndim x q
    kind     utf-8
    tag      HMAC-SHA256(ring key, u64 record number || prefix..kind); the ring key is derived from
             the link's forward key, the record number is counted by both ends and never sent
    payload  (inline records) at the next 8-aligned offset

The sender writes the record, then advances head (one aligned 8-byte store), then writes the
doorbell. x86-64 keeps stores in order and loads in order (TSO), which is all the ring needs: a
reader that sees the new head sees the record. Other architectures need fences Python cannot
issue, so `available()` keeps the ring to x86-64 (elsewhere shm frames travel on the socket).
The doorbell is written on every record, so a wake-up can never be lost; a receiver that is
spinning simply finds it set once and clears it.

Receiving: `take` consumes records until one matches the wanted (kind, mb); others go to the
Comm's inbox. It polls with os.sched_yield() for SPIN_S, then sleeps on the doorbell (select). On
2 shared cores a spin must yield, and must stop: the peer may need this very core.

A sender that finds the ring full asks the receiver's socket reader thread to drain it into the
inbox (a "drain" control message), so a receiver that is busy computing still never blocks its
senders for long, and two ranks flooding each other cannot deadlock.
"""
from __future__ import annotations

import hmac
import mmap
import os
import platform
import select
import struct
import threading
import time

import numpy as np

from executor.dicomm.errors import CommError
from executor.dicomm.frame import (DTYPES, FORMAT_VERSION, MAGIC, MAX_KIND_CHARS,
                                   MAX_PAYLOAD_BYTES, WIRE_DTYPES, Header)
from executor.dicomm.link import Frame
from executor.dicomm.seal import TAG_BYTES

RING_BYTES = 2 << 20            # data bytes per link: 32 frames of 64 KiB; small enough to stay
                                # in cache when it carries small frames
CONTROL_BYTES = 4096            # head and tail on separate cache lines, data page-aligned
INLINE_BYTES = 64 * 1024        # larger payloads go through a segment (shm.py)
# A receiver polls the ring (yielding the CPU between polls) for up to SPIN_S before it sleeps on
# the doorbell; after LONG_WAITS consecutive waits longer than that (the peer computes between
# frames) spinning would only burn CPU, and it polls for SPIN_MIN_S only, until a wait is short.
# Measured on 2 shared cores with one busy neighbour: 4 KiB half round trip 42-52 us with a 100 us
# spin, 21 us with 500 us (a wake-up from the doorbell costs tens of us there).
SPIN_S = float(os.environ.get("H2_DICOMM_SPIN_US", "500")) * 1e-6
SPIN_MIN_S = 20e-6
LONG_WAITS = 8
WAKE_CHECK_S = 0.05             # a sleeping receiver re-checks for a dead peer this often
RECORD = b"R"
WRAP = 0xFFFFFFFF
_LEN = struct.Struct("<II")
_PREFIX = struct.Struct("<2sBcI")
_FIXED = struct.Struct("<qiqqqqqBBH")
_HEAD_FIXED = _PREFIX.size + _FIXED.size
_DTYPE_CODE = {name: i for i, name in enumerate(WIRE_DTYPES)}
_hmac = hmac.digest
_HEAD_STRUCTS: dict[int, struct.Struct] = {}


def _head_struct(ndim: int) -> struct.Struct:
    """prefix + fixed fields + shape of an ndim-dimensional frame, as one struct."""
    st = _HEAD_STRUCTS.get(ndim)
    if st is None:
        st = _HEAD_STRUCTS[ndim] = struct.Struct(_PREFIX.format + _FIXED.format[1:] + "q" * ndim)
    return st


def available() -> tuple[bool, str]:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False, f"the shm ring relies on x86-64 store ordering ({platform.machine()})"
    if not hasattr(os, "eventfd"):
        return False, "the shm ring needs os.eventfd (Linux, Python 3.10+)"
    return True, ""


def ring_key(forward_key: bytes) -> bytes:
    """The ring's tag key: its own key, so its record numbers never mix with the socket's."""
    return hmac.digest(forward_key, b"h2-dicomm shm ring", "sha256")


def _align8(n: int) -> int:
    return (n + 7) & ~7


class _Mapping:
    def __init__(self, fd: int, size: int):
        # MAP_POPULATE: fault every page in now, on both ends, not on the first pass of frames
        # (a fresh page cost several us per small frame).
        self.mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        self.ctl = memoryview(self.mm)[:CONTROL_BYTES].cast("Q")   # aligned 8-byte loads/stores
        self.data = memoryview(self.mm)[CONTROL_BYTES:]
        self.np = np.frombuffer(self.mm, dtype=np.uint8, offset=CONTROL_BYTES)

    def close(self) -> None:
        self.ctl.release()
        self.data.release()
        self.np = None
        try:
            self.mm.close()
        except BufferError:   # an array copied out still shares nothing; a stray view keeps it
            pass


class RingWriter:
    """The sender's end. Created with the link; `fds` go to the receiver once, then are closed."""

    def __init__(self, forward_key: bytes, src: int, dst: int, size: int = RING_BYTES):
        self.size = size
        self.src, self.dst = src, dst
        fd = os.memfd_create(f"h2-dicomm-ring-{src}-{dst}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, CONTROL_BYTES + size)
            self._map = _Mapping(fd, CONTROL_BYTES + size)
            self.doorbell = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        except OSError:
            os.close(fd)
            raise
        self.fds = (fd, self.doorbell)
        self._key = ring_key(forward_key)
        self._n = 0
        self._head = 0

    def free(self) -> int:
        return self.size - (self._head - self._map.ctl[8])

    def record(self, *, seq: int, kind: str, stage: int, mb: int, dtype: str,
               shape: tuple[int, ...], nbytes: int, segment: int = -1,
               offset: int = 0) -> tuple[bytes, int]:
        """(head bytes incl. tag, whole record length) for one frame."""
        kind_b = kind.encode()
        ndim = len(shape)
        head = _head_struct(ndim).pack(
            MAGIC, FORMAT_VERSION, RECORD, _FIXED.size + 8 * ndim + len(kind_b), seq, self.src,
            stage, mb, nbytes, segment, offset, _DTYPE_CODE[dtype], ndim, len(kind_b),
            *shape) + kind_b
        head += _hmac(self._key, self._n.to_bytes(8, "little") + head, "sha256")
        return head, _align8(8 + len(head)) + (_align8(nbytes) if segment < 0 else 0)

    def fits(self, length: int) -> bool:
        pos = self._head % self.size
        wrap = self.size - pos if self.size - pos < length else 0
        return length + wrap <= self.free()

    def put(self, head: bytes, length: int, payload=None) -> None:
        """Write a record built by `record` (the caller checked `fits`) and ring the doorbell."""
        data, pos = self._map.data, self._head % self.size
        if self.size - pos < length:           # no room before the end: wrap to the start
            data[pos:pos + 8] = _LEN.pack(WRAP, 0)
            self._head += self.size - pos
            pos = 0
        data[pos:pos + 8] = _LEN.pack(length, 0)
        end = pos + 8 + len(head)
        data[pos + 8:end] = head
        if payload is not None and payload.nbytes:
            start = _align8(end)
            data[start:start + payload.nbytes] = payload
        self._n += 1
        self._head += length
        self._map.ctl[0] = self._head           # publish: one aligned store, after the record
        os.eventfd_write(self.doorbell, 1)

    def close(self) -> None:
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds = ()
        self._map.close()


class RingReader:
    """The receiver's end, driven by the Comm's thread (`take`) and, when the sender asks, by the
    link's socket reader thread (`drain`); a lock keeps them from consuming at the same time."""

    def __init__(self, ring_fd: int, doorbell: int, size: int, forward_key: bytes, src: int,
                 dst: int, segment):
        if os.fstat(ring_fd).st_size < CONTROL_BYTES + size:
            raise CommError(f"rank {src} passed a shm ring smaller than it announced", src)
        self.size = size
        self.src, self.dst = src, dst
        self._map = _Mapping(ring_fd, CONTROL_BYTES + size)
        self.doorbell = doorbell
        self._key = ring_key(forward_key)
        self._n = 0
        self._tail = 0
        self._seq = 0
        self._segment = segment    # (seg id, header, consuming: bool) -> Frame or None (unmapped)
        self.lock = threading.Lock()
        self.error: CommError | None = None
        self._closed = False
        self._long_waits = 0       # consecutive takes that waited longer than SPIN_S

    # -- consuming ----------------------------------------------------------------------------
    def poll(self, match, deliver, wait_for_segments: bool = True):
        """Consume records until one satisfies match(header) (returned) or none is left (None);
        the others go to deliver(frame)."""
        with self.lock:
            while True:
                frame = self._next(wait_for_segments)
                if frame is None:
                    return None
                if match is not None and match(frame.header):
                    return frame
                deliver(frame)

    def _next(self, wait_for_segments: bool):
        if self._closed:
            return None
        if self.error is not None:
            raise self.error
        try:
            return self._read(wait_for_segments)
        except CommError as e:
            self.error = e
            raise

    def _read(self, wait_for_segments: bool):
        ctl, data = self._map.ctl, self._map.data
        while True:
            avail = ctl[0] - self._tail
            if avail == 0:
                return None
            if not 0 < avail <= self.size:
                raise self._corrupt(f"ring head {ctl[0]} is inconsistent with tail {self._tail}")
            pos = self._tail % self.size
            length, zero = _LEN.unpack_from(data, pos)
            if length == WRAP and zero == 0:
                self._advance(self.size - pos)
                continue
            if zero != 0 or length % 8 or not 8 + _HEAD_FIXED + TAG_BYTES <= length <= avail \
                    or pos + length > self.size:
                raise self._corrupt(f"record length {length} at ring offset {pos}")
            return self._decode(pos, length, wait_for_segments)

    def _decode(self, pos: int, length: int, wait_for_segments: bool):
        data = self._map.data
        magic, version, rtype, rest = _PREFIX.unpack_from(data, pos + 8)
        if magic != MAGIC or version != FORMAT_VERSION or rtype != RECORD \
                or not _FIXED.size <= rest <= length - 8 - _PREFIX.size - TAG_BYTES:
            raise self._corrupt(f"record prefix {bytes(data[pos + 8:pos + 16])!r}")
        head_end = pos + 8 + _PREFIX.size + rest
        head = bytes(data[pos + 8:head_end + TAG_BYTES])   # checked and decoded from a copy
        tag = head[-TAG_BYTES:]
        head = head[:-TAG_BYTES]
        if not hmac.compare_digest(tag, _hmac(self._key, self._n.to_bytes(8, "little") + head,
                                              "sha256")):
            raise CommError(f"frame from rank {self.src} failed its integrity check (altered in "
                            f"shared memory, or dropped, replayed or reordered: ring record "
                            f"{self._n} on link {self.src}->{self.dst})", self.src)
        (seq, src, stage, mb, nbytes, segment, offset, code, ndim,
         kind_len) = _FIXED.unpack_from(head, _PREFIX.size)
        if src != self.src or seq != self._seq:
            raise CommError(f"frame out of sequence on link {self.src}->{self.dst}: got src {src} "
                            f"seq {seq}, expected src {self.src} seq {self._seq}", self.src)
        if code >= len(WIRE_DTYPES) or ndim > 64 \
                or _HEAD_FIXED + 8 * ndim + kind_len != len(head) \
                or not 0 < kind_len <= 4 * MAX_KIND_CHARS:
            raise self._corrupt(f"record fields (dtype {code}, ndim {ndim}, kind {kind_len} bytes)")
        shape = struct.unpack_from(f"<{ndim}q", head, _HEAD_FIXED) if ndim else ()
        try:
            kind = head[_HEAD_FIXED + 8 * ndim:].decode()
        except UnicodeDecodeError:
            raise self._corrupt("kind is not utf-8") from None
        dtype = WIRE_DTYPES[code]
        dt = DTYPES[dtype]
        count = 1
        for s in shape:
            if s < 0:
                count = -1
                break
            count *= s
        if count * dt.itemsize != nbytes or nbytes > MAX_PAYLOAD_BYTES \
                or len(kind) > MAX_KIND_CHARS:
            raise self._corrupt(f"shape {list(shape)} of {dtype} does not hold {nbytes} bytes")
        header = Header(kind, stage, mb, dtype, shape, nbytes, seq, b"", src,
                        (segment, offset) if segment >= 0 else None)
        start = _align8(head_end + TAG_BYTES)
        if segment >= 0:
            if offset < 0 or length != start - pos:
                raise self._corrupt(f"segment record at ring offset {pos}")
            frame = self._segment(header, wait_for_segments)
            if frame is None:
                return None            # its segment is not mapped yet; leave it in the ring
        else:
            if start + nbytes > pos + length:
                raise self._corrupt(f"inline payload of {nbytes} bytes overruns its record")
            flat = self._map.np[start:start + nbytes].copy().view(dt) if nbytes else \
                np.empty(0, dtype=dt)
            frame = Frame(header, flat.reshape(shape))
        self._n += 1
        self._seq += 1
        self._advance(length)
        return frame

    def _advance(self, n: int) -> None:
        self._tail += n
        self._map.ctl[8] = self._tail

    def _corrupt(self, what: str) -> CommError:
        return CommError(f"corrupt shm ring on link {self.src}->{self.dst}: {what}", self.src)

    # -- waiting ------------------------------------------------------------------------------
    def take(self, match, deliver, deadline: float, stop):
        """The first record satisfying match(header), waiting until `deadline` (monotonic);
        None once stop() is true (checked after the ring was found empty) or at the deadline."""
        start = time.monotonic()
        spin_end = start + (SPIN_S if self._long_waits < LONG_WAITS else SPIN_MIN_S)
        while True:
            frame = self.poll(match, deliver)
            if frame is not None:
                self._long_waits = self._long_waits + 1 if time.monotonic() - start > SPIN_S else 0
                return frame
            if stop():
                return self.poll(match, deliver)   # records written just before the peer died
            now = time.monotonic()
            if now >= deadline:
                return None
            if now < spin_end:
                os.sched_yield()
                continue
            ready, _, _ = select.select([self.doorbell], [], [], min(deadline - now, WAKE_CHECK_S))
            if ready:
                self._clear_doorbell()

    def _clear_doorbell(self) -> None:
        try:
            os.eventfd_read(self.doorbell)
        except (BlockingIOError, OSError):
            pass

    def ring(self) -> None:
        """Wake a receiver sleeping in `take` (a frame reached the inbox, or the link failed)."""
        with self.lock:       # close() may not free the descriptor number meanwhile
            if not self._closed:
                try:
                    os.eventfd_write(self.doorbell, 1)
                except OSError:
                    pass

    def close(self) -> None:
        with self.lock:
            self._closed = True
            self._map.close()
            try:
                os.close(self.doorbell)
            except OSError:
                pass
