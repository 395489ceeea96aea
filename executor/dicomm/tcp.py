"""Stream sockets for DiComm: TCP (the CPU-mediated baseline) and the AF_UNIX control channel
that the shm transport runs beside its shared segments.

`SocketStream` gives the frame layer what it needs from a byte stream: gathered writes with no
payload copy in user space (sendmsg), exact reads into a caller's buffer (recv_into), and on
AF_UNIX file-descriptor passing (how shm segments travel, see shm.py).

Descriptors are taken only from an authenticated peer: until the handshake is done (and on a
stream that never expects any) a message carrying SCM_RIGHTS closes what it carried at once
and ends the connection, so a stranger cannot fill a worker's descriptor table. Reads before
authentication also share one deadline (`deadline`), however slowly the bytes drip in.
"""
from __future__ import annotations

import array
import os
import secrets
import socket
import time
from collections import deque

from executor.dicomm.errors import CommError

_MAX_FDS = 4
_ANC_BYTES = socket.CMSG_SPACE(_MAX_FDS * array.array("i").itemsize)
_MAX_QUEUED_FDS = 64         # descriptors received but not yet claimed by a map/ring message
# Big socket buffers let a 64 MiB frame stream without the sender stalling on every few KiB.
_SOCKET_BUFFER_BYTES = 4 * 1024 * 1024


class PeerClosed(CommError):
    """The stream ended; `got` bytes of the read in progress had arrived."""

    def __init__(self, message: str, peer: int | None, got: int):
        super().__init__(message, peer)
        self.got = got


class SocketStream:
    def __init__(self, sock: socket.socket, peer: int | None = None):
        self.sock = sock
        self.peer = peer
        self.unix = sock.family == socket.AF_UNIX
        self._fds: deque[int] = deque()
        self.takes_fds = False      # set once the peer is authenticated and may pass segments
        self.deadline: float | None = None   # time.monotonic() by which every read must end

    def send_parts(self, parts, fds: tuple[int, ...] = ()) -> None:
        """Write all parts in order with as few syscalls as the kernel allows; fds ride on the
        first byte (AF_UNIX only)."""
        views = [memoryview(p).cast("B") for p in parts]
        views = [v for v in views if v.nbytes]
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
        while views:
            n = self.sock.sendmsg(views, anc)
            anc = []
            while n:
                if n >= views[0].nbytes:
                    n -= views[0].nbytes
                    views.pop(0)
                else:
                    views[0] = views[0][n:]
                    n = 0

    def recv_into(self, buf) -> None:
        """Fill `buf` exactly; PeerClosed if the stream ends first."""
        mv = memoryview(buf).cast("B")
        got = 0
        while got < mv.nbytes:
            if self.deadline is not None:
                left = self.deadline - time.monotonic()
                if left <= 0:
                    raise socket.timeout(f"no complete message from {_who(self.peer)} in time")
                self.sock.settimeout(left)
            if self.unix:
                n, anc, _flags, _addr = self.sock.recvmsg_into([mv[got:]], _ANC_BYTES)
                if anc:
                    self._take_fds(anc)
            else:
                n = self.sock.recv_into(mv[got:])
            if n == 0:
                raise PeerClosed(f"connection closed by {_who(self.peer)} after {got} of "
                                 f"{mv.nbytes} bytes", self.peer, got)
            got += n

    def _take_fds(self, anc) -> None:
        fds = array.array("i")
        for level, kind, data in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
        if self.takes_fds and len(self._fds) + len(fds) <= _MAX_QUEUED_FDS:
            self._fds.extend(fds)
            return
        for fd in fds:
            os.close(fd)
        raise CommError(f"{_who(self.peer)} passed {len(fds)} file descriptor(s) "
                        + ("before authenticating" if not self.takes_fds else
                           f"beyond the {_MAX_QUEUED_FDS} a link may hold unclaimed")
                        + "; closed them and the connection", self.peer)

    def recv_exact(self, n: int) -> bytearray:
        buf = bytearray(n)
        self.recv_into(buf)
        return buf

    def take_fd(self) -> int:
        if not self._fds:
            raise CommError(f"{_who(self.peer)} announced a shared segment but passed no file "
                            f"descriptor", self.peer)
        return self._fds.popleft()

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def listen_tcp(host: str) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((host, 0))
    sock.listen(64)
    return sock


def listen_unix() -> tuple[socket.socket, str]:
    """A listener in Linux's abstract socket namespace (no file to clean up; the handshake, not
    file permissions, keeps strangers out)."""
    name = f"h2-dicomm-{os.getpid()}-{secrets.token_hex(8)}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind("\0" + name)
    sock.listen(64)
    return sock, name


def dial_tcp(host: str, port: int, timeout: float) -> socket.socket:
    sock = socket.create_connection((host, port), timeout=timeout)
    tune(sock)
    return sock


def dial_unix(name: str, timeout: float) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect("\0" + name)
    except OSError:
        sock.close()
        raise
    return sock


def tune(sock: socket.socket) -> None:
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        # Frames go out as one gathered write; Nagle would only delay the small ones.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, _SOCKET_BUFFER_BYTES)
        except OSError:
            pass


def _who(peer: int | None) -> str:
    return f"rank {peer}" if peer is not None else "peer"
