"""Same-host shared-memory transport: the zero-copy "device-direct" analogue on this machine.

Each directed link src -> dst has an AF_UNIX control socket (the authenticated connection) and a
pool of shared segments owned by the sender:

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

from executor.dicomm.errors import CommError
from executor.dicomm.frame import (CONTROL, PREFIX_BYTES, Header, contiguous, decode_body,
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


class ShmSender(StreamSender):
    transport = "shm"

    def __init__(self, stream, src: int, dst: int, keys, timeout: float,
                 max_bytes: int = DEFAULT_MAX_BYTES):
        super().__init__(stream, src, dst, keys)
        self._releases = Opener(keys.reverse, dst, f"{dst}->{src} (shm releases)")
        self.timeout = timeout
        self.max_bytes = max_bytes
        self.segments: dict[int, _Segment] = {}
        self._next_id = 0

    def send(self, array: np.ndarray, *, kind: str, stage: int, mb: int,
             dtype: str | None = None) -> None:
        a = contiguous(array)
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


class ShmReceiver(StreamReceiver):
    transport = "shm"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.segments: dict[int, mmap.mmap] = {}
        self._release_lock = threading.Lock()

    def on_control(self, body: dict) -> None:
        op, seg_id = body.get("op"), body.get("seg")
        if op == "map" and isinstance(seg_id, int) and isinstance(body.get("size"), int):
            fd = self.stream.take_fd()
            try:
                if os.fstat(fd).st_size < body["size"]:
                    raise CommError(f"rank {self.src} passed a shm segment smaller than it "
                                    f"announced", self.src)
                self.segments[seg_id] = mmap.mmap(fd, body["size"], prot=mmap.PROT_READ)
            finally:
                os.close(fd)
        elif op == "drop" and seg_id in self.segments:
            _close_mapping(self.segments.pop(seg_id))
        else:
            super().on_control(body)

    def place(self, header: Header) -> Frame:
        if header.at is None:
            return super().place(header)
        seg_id, offset = header.at
        mm = self.segments.get(seg_id)
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
        for mm in self.segments.values():
            _close_mapping(mm)
        self.segments.clear()


def _close_mapping(mm: mmap.mmap) -> None:
    try:
        mm.close()
    except BufferError:  # a view handed out earlier is still alive; it keeps the mapping
        pass
