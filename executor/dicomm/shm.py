"""Same-host shared-memory transport: the zero-copy "device-direct" analogue on this machine.

Each directed link src -> dst has an AF_UNIX control socket (the authenticated connection), a
frame ring (ring.py: on x86-64 every frame is a ring record read by the receiving thread itself,
with small payloads inside it) and a pool of shared segments owned by the sender. Without a ring
(other architectures) frames go on the socket:

  * small payloads (<= INLINE_BYTES) travel inline on the socket, exactly as on tcp: for them a
    syscall costs less than segment bookkeeping;
  * a larger payload is copied once into a free segment; the frame header (with `at`: segment,
    offset and size) follows on the socket, tagged like every message (seal.py), and the receiver
    hands out either a copy (default) or a read-only numpy view
    straight into the segment (`recv(..., view=True)`, what the bandwidth figure measures);
  * when the receiver is done with a segment it sends {"op": "release"} back on the same socket
    and the sender may reuse it.

Segments are memfd_create() files whose descriptors pass over the socket (SCM_RIGHTS): nothing is
named in /dev/shm, no other process can open them, and the kernel frees them when both ends are
gone, even after a crash. (A process of the same user can still reach a segment through
/proc/<pid>/fd or ptrace -- and so could rewrite the payload after any check -- so segment
payloads carry no digest: hashing them would halve shm bandwidth and defend against no one the
threat model covers. See docs/dicomm.md, threat model.)
The socket write that carries a header happens after the payload copy,
and the receiver reads the header before touching the payload, so the syscall pair orders the
memory accesses on every architecture.
"""
from __future__ import annotations

import mmap
import os
import select
import threading
import time

import numpy as np

from executor.dicomm import ring
from executor.dicomm.errors import CommError
from executor.dicomm.frame import (CONTROL, DTYPES, MAX_KIND_CHARS, PREFIX_BYTES, Header,
                                   contiguous, decode_body,
                                   encode_message, make_header, parse_prefix, payload_array, payload_bytes)
from executor.dicomm.link import Frame, StreamReceiver, StreamSender
from executor.dicomm.seal import TAG_BYTES, Opener

INLINE_BYTES = 64 * 1024
MIN_SEGMENT_BYTES = 1 << 20
# A sender keeps at most this many bytes of segments per link before it waits for releases.
DEFAULT_MAX_BYTES = 1 << 30


def available() -> tuple[bool, str]:
    if not hasattr(os, "memfd_create"):
        return False, "shm needs os.memfd_create (Linux)"
    import socket
    if not hasattr(socket, "AF_UNIX") or not hasattr(socket.socket, "sendmsg"):
        return False, "shm needs AF_UNIX sockets with sendmsg (fd passing)"
    return True, ""


def boot_id() -> str:
    """Identifies this kernel instance: two ranks share memory only if these match."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


class _Segment:
    def __init__(self, seg_id: int, size: int, name: str):
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            self.mm = mmap.mmap(fd, size)
        except OSError:
            os.close(fd)
            raise
        self.fd = fd        # closed once passed to the receiver
        self.id = seg_id
        self.size = size
        self.busy = False
        self.bytes = np.frombuffer(self.mm, dtype=np.uint8)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.bytes = None
        try:
            self.mm.close()
        except BufferError:  # a numpy view still exists; the mapping goes when it does
            pass


def ring_header(a: np.ndarray, kind: str, stage: int, mb: int, seq: int, src: int,
                dtype: str | None) -> Header:
    """make_header's checks without its digest, at a fraction of its cost for the common case
    (a plain dtype, an str kind), which is what a small shm frame spends most of its time on."""
    name = dtype if dtype is not None else _RING_DTYPE.get(a.dtype)
    if name is None or type(kind) is not str or not kind or len(kind) > MAX_KIND_CHARS \
            or DTYPES.get(name) is None or DTYPES[name].itemsize != a.dtype.itemsize:
        return make_header(a, kind=kind, stage=stage, mb=mb, seq=seq, src=src, dtype=dtype,
                           digest=b"")   # its checks raise the errors
    return Header(kind, int(stage), int(mb), name, a.shape, a.nbytes, seq, b"", src)


_RING_DTYPE = {dt: name for name, dt in DTYPES.items()}


class ShmSender(StreamSender):
    transport = "shm"

    def __init__(self, stream, src: int, dst: int, keys, timeout: float,
                 max_bytes: int = DEFAULT_MAX_BYTES, use_ring: bool = True):
        super().__init__(stream, src, dst, keys)
        self._releases = Opener(keys.reverse, dst, f"{dst}->{src} (shm releases)")
        self.timeout = timeout
        self.max_bytes = max_bytes
        self.segments: dict[int, _Segment] = {}
        self._next_id = 0
        self.ring: ring.RingWriter | None = None
        if use_ring and ring.available()[0]:
            self.ring = ring.RingWriter(keys.forward, src, dst)
            try:   # the ring and its doorbell reach the receiver before any frame
                stream.send_parts(self.sealed({"op": "ring", "size": self.ring.size}, CONTROL),
                                  self.ring.fds)
            except BaseException:
                self.ring.close()
                raise
            os.close(self.ring.fds[0])          # mapped on both ends now; the doorbell stays
            self.ring.fds = self.ring.fds[1:]

    def send(self, array: np.ndarray, *, kind: str, stage: int, mb: int,
             dtype: str | None = None) -> None:
        a = contiguous(array)
        if self.ring is not None:
            return self._send_ring(a, kind, stage, mb, dtype)
        if a.nbytes <= INLINE_BYTES:
            return super().send(a, kind=kind, stage=stage, mb=mb, dtype=dtype)
        seg, fds = self._acquire(a.nbytes, kind, mb)
        # No payload digest: the tagged header binds segment, offset and size, and the segment
        # itself is out of reach of everyone the threat model defends against (module doc).
        np.copyto(seg.bytes[:a.nbytes], np.frombuffer(payload_bytes(a), dtype=np.uint8))
        header = make_header(a, kind=kind, stage=stage, mb=mb, seq=self.seq, src=self.src,
                             dtype=dtype, digest=b"", at=(seg.id, 0))
        parts = []
        if fds:  # first use of the segment: map it on the receiver before the frame
            parts += self.sealed({"op": "map", "seg": seg.id, "size": seg.size}, CONTROL)
        parts += self.sealed(header.to_map())
        seg.busy = True
        try:
            self._write(header, parts, fds)
        except CommError:
            seg.busy = False
            raise
        if fds:
            os.close(seg.fd)
            seg.fd = -1

    def _send_ring(self, a: np.ndarray, kind: str, stage: int, mb: int,
                   dtype: str | None) -> None:
        """One ring record per frame (ring.py): inline up to ring.INLINE_BYTES, else the payload
        goes into a segment (mapped on the receiver first, over the socket) and the record
        points at it. Neither payload is digested (module doc)."""
        header = ring_header(a, kind, stage, mb, self.seq, self.src, dtype)
        payload = payload_bytes(a)
        seg = None
        if a.nbytes > ring.INLINE_BYTES:
            seg, fds = self._acquire(a.nbytes, kind, mb)
            np.copyto(seg.bytes[:a.nbytes], np.frombuffer(payload, dtype=np.uint8))
            if fds:
                self._write(header, self.sealed({"op": "map", "seg": seg.id, "size": seg.size},
                                                CONTROL), fds, frame=False)
                os.close(seg.fd)
                seg.fd = -1
            payload = None
        head, length = self.ring.record(
            seq=self.seq, kind=header.kind, stage=header.stage, mb=header.mb, dtype=header.dtype,
            shape=header.shape, nbytes=header.nbytes,
            segment=seg.id if seg is not None else -1)
        self._wait_for_ring(length, header)
        if seg is not None:
            seg.busy = True
        self.ring.put(head, length, payload)
        self.seq += 1

    def _wait_for_ring(self, length: int, header: Header) -> None:
        """Room for one record; a full ring is drained by the receiver's reader thread on request,
        so this waits only for that thread (or the receiver's own recv), never for its compute."""
        if self.ring.fits(length):
            return
        self._write(header, self.sealed({"op": "drain"}, CONTROL), frame=False)
        deadline = time.monotonic() + self.timeout
        pause = 20e-6
        while not self.ring.fits(length):
            if time.monotonic() > deadline:
                raise CommError(f"rank {self.src}: sending {header.kind} mb {header.mb} to rank "
                                f"{self.dst} timed out: its shm ring stayed full for "
                                f"{self.timeout} s (rank {self.dst} stopped reading?)", self.dst)
            self._drain_releases(0.0)           # also notices a receiver that died
            time.sleep(pause)
            pause = min(2 * pause, 1e-3)

    def _acquire(self, nbytes: int, kind: str, mb: int) -> tuple[_Segment, tuple[int, ...]]:
        size = max(MIN_SEGMENT_BYTES, 1 << (nbytes - 1).bit_length())
        deadline = time.monotonic() + self.timeout
        self._drain_releases(0.0)
        while True:
            for seg in self.segments.values():
                if not seg.busy and seg.size == size:
                    return seg, ()
            held = sum(s.size for s in self.segments.values())
            if held + size > self.max_bytes:
                self._drop_idle(size)  # idle segments of other sizes make room first
                held = sum(s.size for s in self.segments.values())
            if held + size <= self.max_bytes or not any(s.busy for s in self.segments.values()):
                seg = _Segment(self._next_id, size, f"h2-dicomm-{self.src}-{self.dst}")
                self._next_id += 1
                self.segments[seg.id] = seg
                return seg, (seg.fd,)
            left = deadline - time.monotonic()
            if left <= 0:
                busy = sum(s.busy for s in self.segments.values())
                raise CommError(f"rank {self.src}: cannot send {kind} mb {mb} to rank {self.dst}: "
                                f"rank {self.dst} holds all {busy} shm segments "
                                f"({held >> 20} MiB) and released none within {self.timeout} s",
                                self.dst, hint="release views from recv(view=True) with "
                                               "comm.release() once they are consumed")
            self._drain_releases(left)

    def _drop_idle(self, keep_size: int) -> None:
        for seg in [s for s in self.segments.values() if not s.busy and s.size != keep_size]:
            self.stream.send_parts(self.sealed({"op": "drop", "seg": seg.id}, CONTROL))
            del self.segments[seg.id]
            seg.close()

    def _drain_releases(self, wait: float) -> None:
        """Apply the receiver's release messages; wait up to `wait` seconds for the first."""
        sock = self.stream.sock
        while True:
            ready, _, _ = select.select([sock], [], [], wait)
            if not ready:
                return
            wait = 0.0
            try:
                prefix = bytes(self.stream.recv_exact(PREFIX_BYTES))
                msg_type, length = parse_prefix(prefix, self.dst)
                head = prefix + bytes(self.stream.recv_exact(length))
                self._releases.check(head, self.stream.recv_exact(TAG_BYTES))
                body = decode_body(head[PREFIX_BYTES:], self.dst)
            except CommError as e:
                raise CommError(f"rank {self.src}: link to rank {self.dst} broke: {e.message}",
                                self.dst) from None
            except OSError as e:
                raise CommError(f"rank {self.src}: link to rank {self.dst} broke: "
                                f"{e.strerror or e}", self.dst) from None
            seg = self.segments.get(body.get("seg")) if msg_type == CONTROL else None
            if body.get("op") != "release" or seg is None:
                raise CommError(f"rank {self.dst} sent an unexpected message {body!r} on the "
                                f"shm link from rank {self.src}", self.dst)
            seg.busy = False

    def close(self) -> None:
        try:  # unread releases would make the close look like a crash (ECONNRESET) to the peer
            self._drain_releases(0.0)
        except CommError:
            pass
        super().close()
        for seg in self.segments.values():
            seg.close()
        self.segments.clear()
        if self.ring is not None:
            self.ring.close()


class ShmReceiver(StreamReceiver):
    """Reader thread of a shm link: applies its control messages (ring, map, drop, drain, bye).
    With a ring (ring.py), the frames themselves are taken from the ring by the Comm's thread;
    `on_ring(receiver)` tells the Comm when the ring is mapped."""

    transport = "shm"

    def __init__(self, stream, src: int, dst: int, deliver, fail, keys, *, on_ring=None,
                 timeout: float = 10.0):
        super().__init__(stream, src, dst, deliver, fail, keys)
        self.segments: dict[int, mmap.mmap] = {}
        self._release_lock = threading.Lock()
        self._mapped = threading.Condition()
        self._forward_key = keys.forward
        self._on_ring = on_ring
        self.timeout = timeout
        self.ring: ring.RingReader | None = None

    def on_control(self, body: dict) -> None:
        op, seg_id = body.get("op"), body.get("seg")
        if op == "map" and isinstance(seg_id, int) and isinstance(body.get("size"), int):
            fd = self.stream.take_fd()
            try:
                if os.fstat(fd).st_size < body["size"]:
                    raise CommError(f"rank {self.src} passed a shm segment smaller than it "
                                    f"announced", self.src)
                with self._mapped:
                    self.segments[seg_id] = mmap.mmap(fd, body["size"], prot=mmap.PROT_READ)
                    self._mapped.notify_all()
            finally:
                os.close(fd)
        elif op == "ring" and self.ring is None and self._on_ring is not None \
                and type(body.get("size")) is int and 1 << 16 <= body["size"] <= 1 << 30 \
                and body["size"] % 8 == 0:
            ring_fd, doorbell = self.stream.take_fd(), self.stream.take_fd()
            try:
                self.ring = ring.RingReader(ring_fd, doorbell, body["size"], self._forward_key,
                                            self.src, self.dst, self._ring_segment)
            except BaseException:
                os.close(doorbell)
                raise
            finally:
                os.close(ring_fd)
            self._on_ring(self)
        elif op == "drain" and self.ring is not None:
            # The sender found the ring full: move what is there into the inbox (stopping at a
            # record whose segment this thread has not mapped yet: its map is still queued).
            self.ring.poll(None, self._deliver, wait_for_segments=False)
            self.ring.ring()
        elif op == "drop" and seg_id in self.segments:
            _close_mapping(self.segments.pop(seg_id))
        else:
            super().on_control(body)

    def place(self, header: Header) -> Frame:
        if self.ring is not None:
            raise CommError(f"rank {self.src} sent a frame on the control socket of a shm ring "
                            f"link", self.src)
        if header.at is None:
            return super().place(header)
        return self._segment_frame(header, self.segments.get(header.at[0]))

    def _ring_segment(self, header: Header, wait: bool) -> Frame | None:
        """The frame of a ring record that points into a segment. The segment's map message was
        sent before the record; unless `wait`, None if this thread has not applied it yet."""
        seg_id = header.at[0]
        deadline = time.monotonic() + self.timeout
        with self._mapped:
            while seg_id not in self.segments and wait:
                left = deadline - time.monotonic()
                if left <= 0 or self.closing or not self._thread.is_alive():
                    raise CommError(f"corrupt frame from rank {self.src}: {header.kind} mb "
                                    f"{header.mb} points at shm segment {seg_id}, which it never "
                                    f"passed", self.src)
                self._mapped.wait(min(left, 0.05))
            mm = self.segments.get(seg_id)
        if mm is None:
            return None
        return self._segment_frame(header, mm)

    def _segment_frame(self, header: Header, mm) -> Frame:
        seg_id, offset = header.at
        if mm is None or offset + header.nbytes > len(mm):
            raise CommError(f"corrupt frame from rank {self.src}: {header.kind} mb {header.mb} "
                            f"points at segment {seg_id} bytes {offset}..{offset + header.nbytes}, "
                            f"which is not mapped", self.src)
        view = np.frombuffer(mm, dtype=np.uint8, count=header.nbytes, offset=offset)
        array = payload_array(header, view, self.src)
        released = []

        def release() -> None:
            if not released:
                released.append(True)
                self._send_release(seg_id)
        return Frame(header, array, release)

    def _send_release(self, seg_id: int) -> None:
        with self._release_lock:
            try:
                self.stream.send_parts(self.sealed_back({"op": "release", "seg": seg_id}))
            except OSError:
                pass  # the sender is gone; the reader thread reports that

    def sealed_back(self, body: dict) -> list:
        head = encode_message(body, CONTROL)
        return [head, self._reverse.tag(head)]

    def close(self) -> None:
        super().close()
        if self.ring is not None:
            self.ring.close()
        for mm in self.segments.values():
            _close_mapping(mm)
        self.segments.clear()


def _close_mapping(mm: mmap.mmap) -> None:
    try:
        mm.close()
    except BufferError:  # a view handed out earlier is still alive; it keeps the mapping
        pass
