"""One directed link between two ranks: the sender's half and the receiver's half.

A link src -> dst is opened by src on its first send to dst and carries frames one way only, so
two ranks sending to each other never wait on each other's reads. On the receiving rank a reader
thread drains the link as fast as frames arrive and hands them to the Comm's inbox; a sender is
therefore never blocked by a receiver that is busy computing, and a ring of simultaneous sends
cannot deadlock.

`StreamSender`/`StreamReceiver` move frames over any byte stream with send_parts/recv_into (a
socket for tcp, an RC queue pair for rdma). shm.py extends them to place payloads in shared memory.

Every message on a link carries a tag under the connection's keys (seal.py): the receiver reads
prefix, map and tag, checks the tag, and only then decodes the map or allocates its payload; the
payload is then checked against the digest the authenticated map carries.
"""
from __future__ import annotations

import socket
import threading
from dataclasses import dataclass
from typing import Callable

import numpy as np

from executor.dicomm.errors import CommError
from executor.dicomm.frame import (CONTROL, FRAME, PREFIX_BYTES, Header, contiguous, decode_body,
                                   decode_header, encode_message, make_header, parse_prefix,
                                   payload_array, payload_bytes)
from executor.dicomm.seal import TAG_BYTES, Opener, Sealer
from executor.dicomm.tcp import PeerClosed


@dataclass
class Frame:
    """A received tensor frame. `release` is set when `array` views memory the sender owns."""
    header: Header
    array: np.ndarray
    release: Callable[[], None] | None = None


class StreamSender:
    transport = "tcp"

    def __init__(self, stream, src: int, dst: int, keys):
        self.stream = stream
        self.src = src
        self.dst = dst
        self.seq = 0
        self._sealer = Sealer(keys.forward)

    def sealed(self, body: dict, msg_type: bytes = FRAME) -> list:
        """[prefix+map, tag]: one message with its tag (the next message number)."""
        head = encode_message(body, msg_type)
        return [head, self._sealer.tag(head)]

    def send(self, array: np.ndarray, *, kind: str, stage: int, mb: int,
             dtype: str | None = None) -> None:
        a = contiguous(array)
        header = make_header(a, kind=kind, stage=stage, mb=mb, seq=self.seq, src=self.src,
                             dtype=dtype)
        self._write(header, self.sealed(header.to_map()) + [payload_bytes(a)])

    def _write(self, header: Header, parts, fds: tuple[int, ...] = (), frame: bool = True) -> None:
        """Write one message (or several); `frame`: it carries the frame `header` (counted in
        seq), as opposed to a control message sent on its behalf (named after it in errors)."""
        try:
            self.stream.send_parts(parts, fds)
        except (socket.timeout, TimeoutError):
            raise CommError(f"rank {self.src}: sending {header.kind} mb {header.mb} to rank "
                            f"{self.dst} timed out (rank {self.dst} stopped reading?)",
                            self.dst) from None
        except OSError as e:
            raise CommError(f"rank {self.src}: sending {header.kind} mb {header.mb} to rank "
                            f"{self.dst} failed: {e.strerror or e} (rank {self.dst} died?)",
                            self.dst) from None
        if frame:
            self.seq += 1

    def close(self) -> None:
        try:  # tell the receiver this is a clean end, not a crash
            self.stream.send_parts(self.sealed({"op": "bye"}, CONTROL))
        except (OSError, CommError):
            pass
        self.stream.close()


class PeerFinished(CommError):
    """The peer closed its comm on purpose (it finished), as opposed to dying."""


class StreamReceiver:
    """Reader thread for one incoming link. Frames go to `deliver`; the first error (peer gone,
    corrupt or truncated frame) goes to `fail` and ends the thread: a broken stream is never
    resynchronised, because nothing after a bad byte can be trusted."""

    transport = "tcp"

    def __init__(self, stream, src: int, dst: int, deliver: Callable[[Frame], None],
                 fail: Callable[[int, CommError], None], keys):
        self.stream = stream
        self._opener = Opener(keys.forward, src, f"{src}->{dst}")
        self._reverse = Sealer(keys.reverse)   # for messages back to the sender (shm releases)
        self.src = src
        self.dst = dst
        self._deliver = deliver
        self._fail = fail
        self._expected_seq = 0
        self.closing = False
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"dicomm-recv-{src}->{dst}")

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        try:
            while True:
                self._deliver(self._read_one())
        except CommError as e:
            if not self.closing:
                self._fail(self.src, e)
        except OSError as e:
            if not self.closing:
                self._fail(self.src, CommError(f"link from rank {self.src} to rank {self.dst} "
                                               f"broke: {e.strerror or e}", self.src))

    def _read_one(self) -> Frame:
        while True:
            try:
                prefix = self.stream.recv_exact(PREFIX_BYTES)
            except PeerClosed as e:
                if e.got == 0:
                    raise CommError(f"rank {self.src} closed its link to rank {self.dst} "
                                    f"(process exited or died)", self.src) from None
                raise CommError(f"truncated frame from rank {self.src}: the stream ended "
                                f"inside a frame prefix", self.src) from None
            msg_type, length = parse_prefix(bytes(prefix), self.src)
            body = self._read_exact(length, "frame header")
            tag = self._read_exact(TAG_BYTES, "tag")
            self._opener.check(bytes(prefix) + body, tag)
            if msg_type == CONTROL:
                control = decode_body(body, self.src)
                if control.get("op") == "bye":
                    raise PeerFinished(f"rank {self.src} closed its comm", self.src)
                self.on_control(control)
                continue
            header = decode_header(body, self.src)
            if header.src != self.src or header.seq != self._expected_seq:
                raise CommError(f"frame out of sequence on link {self.src}->{self.dst}: got "
                                f"src {header.src} seq {header.seq}, expected src {self.src} "
                                f"seq {self._expected_seq}", self.src)
            self._expected_seq += 1
            return self.place(header)

    def _read_exact(self, n: int, what: str) -> bytearray:
        buf = bytearray(n)
        self._read_into(buf, what)
        return buf

    def _read_into(self, buf, what: str, header: Header | None = None) -> None:
        try:
            self.stream.recv_into(buf)
        except PeerClosed as e:
            frame = f" ({header.kind} mb {header.mb})" if header else ""
            raise CommError(f"truncated frame from rank {self.src}{frame}: the link closed after "
                            f"{e.got} of {memoryview(buf).nbytes} {what} bytes", self.src) from None

    def place(self, header: Header) -> Frame:
        """Read the inline payload straight into the array that will be handed out."""
        if header.at is not None:
            raise CommError(f"rank {self.src} sent a shared-memory frame on a {self.transport} "
                            f"link", self.src)
        buf = np.empty(header.nbytes, dtype=np.uint8)
        self._read_into(buf, "payload", header)
        return Frame(header, payload_array(header, buf, self.src))

    def on_control(self, body: dict) -> None:
        raise CommError(f"unexpected control message {body.get('op')!r} from rank {self.src} on "
                        f"a {self.transport} link", self.src)

    def close(self) -> None:
        self.closing = True
        self.stream.close()
