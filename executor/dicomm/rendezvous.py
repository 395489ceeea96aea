"""Rendezvous through torch.distributed.TCPStore, every record authenticated with the run secret.

The launcher (or rank 0) hosts the store; every rank publishes a msgpack record under
`<namespace>/rank/<r>` (listening address, shm socket name, boot id, usable transports), and RDMA
links publish their queue-pair info under `<namespace>/link/<src>-<dst>/<side>`. Lookups wait for
the key up to the comm timeout, so a rank that never starts surfaces as a CommError, not a hang.

The store itself authenticates nobody: anyone who can reach its port can read and overwrite keys.
So a stored value is the msgpack record followed by a 32-byte HMAC-SHA256 under the run secret of
(protocol, "record", namespace, key, record bytes), and a lookup verifies it (after a size bound)
before the record is decoded or acted on. A value rewritten by a process without the secret, or
left by another run, or moved from another key, is a CommError naming the key. The connection
handshake then proves the endpoint a record names holds the secret too.

The store listens on loopback unless told otherwise: `host_store` binds its own socket to `host`
and hands it to TCPStore (`master_listen_fd`), because TCPStore's master binds every interface
whatever host it is given.
"""
from __future__ import annotations

import hmac
import socket
from datetime import timedelta

import msgpack

from executor.dicomm.errors import CommError
from executor.dicomm.handshake import MAC_BYTES, run_mac

MAX_RECORD_BYTES = 64 * 1024          # records are ~300 bytes


def host_store(host: str = "127.0.0.1", port: int = 0, timeout: float = 30.0):
    """Start a TCPStore master listening on `host` only (the launcher calls this, keeps the object
    alive for the whole run, and passes `store.port` to the workers). port=0 picks a free port.
    `host` is an interface address: loopback by default; a node's address for multi-host runs."""
    return reserve_store(host, port, timeout).start()


class ReservedStore:
    """A rendezvous store's listening socket, bound now, its TCPStore started later (`start`).

    Its port is known at once, so the launcher can start the workers first and only then import
    torch for the store: the two imports overlap instead of adding up (torch's import is ~2 s
    here). A worker that connects before `start` waits in the socket's backlog; TCPStore accepts
    it when it starts."""

    def __init__(self, host: str, port: int, timeout: float):
        self.host, self.timeout = host, timeout
        try:
            self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET,
                                      socket.SOCK_STREAM)
            try:
                self.sock.bind((host, port))
                self.sock.listen(128)
            except BaseException:
                self.sock.close()
                raise
        except OSError as e:
            raise CommError(f"cannot host the rendezvous store on {host}:{port}: {e}") from None
        self.port = self.sock.getsockname()[1]

    def start(self):
        """The TCPStore master on the reserved socket (which it then owns)."""
        from torch.distributed import TCPStore
        try:
            store = TCPStore(self.host, self.port, world_size=None, is_master=True,
                             timeout=timedelta(seconds=self.timeout), wait_for_workers=False,
                             master_listen_fd=self.sock.fileno(), use_libuv=True)
        except Exception as e:  # RuntimeError/DistNetworkError from torch
            self.close()
            raise CommError(f"cannot host the rendezvous store on {self.host}:{self.port}: "
                            f"{e}") from None
        self.sock.detach()      # the store owns the descriptor now and closes it when it goes
        return store

    def close(self) -> None:
        self.sock.close()


def reserve_store(host: str = "127.0.0.1", port: int = 0, timeout: float = 30.0) -> ReservedStore:
    """Bind and listen on `host`:`port` for a rendezvous store started later
    (`ReservedStore.start`)."""
    return ReservedStore(host, port, timeout)


class Rendezvous:
    def __init__(self, host: str, port: int, timeout: float, namespace: str, store=None, *,
                 secret: bytes):
        self.namespace = namespace.rstrip("/")
        self._secret = secret
        self.timeout = timeout
        self.where = f"{host}:{port}"
        if store is not None:
            self.store = store
            return
        from torch.distributed import TCPStore
        try:
            self.store = TCPStore(host, port, is_master=False,
                                  timeout=timedelta(seconds=timeout), wait_for_workers=False)
        except Exception as e:
            raise CommError(f"cannot reach the rendezvous store at {self.where} within "
                            f"{timeout} s: {e}", hint="the launcher must host the store "
                                                      "(dicomm.host_store) before workers connect") \
                from None

    def publish(self, key: str, record: dict) -> bytes:
        packed = msgpack.packb(record, use_bin_type=True)
        try:
            self.store.set(f"{self.namespace}/{key}", packed + self._mac(key, packed))
        except Exception as e:
            raise CommError(f"rendezvous store at {self.where} failed while publishing "
                            f"{key!r}: {e}") from None
        return packed

    def _mac(self, key: str, packed: bytes) -> bytes:
        return run_mac(self._secret, "record", self.namespace, key, packed)

    def lookup_raw(self, key: str, what: str, timeout: float | None = None) -> bytes:
        """The authenticated record bytes stored under `key` (without their MAC)."""
        value = self._fetch(key, what, timeout)
        full = f"{self.namespace}/{key}"
        if not MAC_BYTES <= len(value) <= MAX_RECORD_BYTES + MAC_BYTES:
            raise CommError(f"rendezvous record at {full!r} failed authentication: it is "
                            f"{len(value)} bytes, not a record with its MAC (written by a process "
                            f"without the run secret?)",
                            hint="something other than this run's workers wrote to its store")
        packed, mac = value[:-MAC_BYTES], value[-MAC_BYTES:]
        if not hmac.compare_digest(mac, self._mac(key, packed)):
            raise CommError(f"rendezvous record at {full!r} failed authentication (written by a "
                            f"process without the run secret, or left by another run)",
                            hint="something other than this run's workers wrote to its store; "
                                 "use a fresh store or namespace per run")
        return packed

    def _fetch(self, key: str, what: str, timeout: float | None) -> bytes:
        full = f"{self.namespace}/{key}"
        t = self.timeout if timeout is None else timeout
        try:
            self.store.wait([full], timedelta(seconds=t))
            return self.store.get(full)
        except Exception as e:
            raise CommError(f"{what} did not appear in the rendezvous store ({full!r}) within "
                            f"{t} s ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})",
                            hint="is that rank running, and on the same store and namespace?") \
                from None

    def lookup(self, key: str, what: str, timeout: float | None = None) -> dict:
        raw = self.lookup_raw(key, what, timeout)
        try:
            record = msgpack.unpackb(raw, raw=False)
        except Exception as e:
            raise CommError(f"rendezvous record {key!r} is not msgpack: {e}") from None
        if not isinstance(record, dict):
            raise CommError(f"rendezvous record {key!r} should be a map, got {type(record).__name__}")
        return record
