"""Rendezvous through torch.distributed.TCPStore, every record authenticated with the run secret.

The launcher (or rank 0) hosts the store; every rank publishes a msgpack record under
`<namespace>/rank/<r>` (listening address, shm socket name, boot id, usable transports), and RDMA
links publish their queue-pair info under `<namespace>/link/<src>-<dst>/<side>`. Lookups wait for
the key up to the comm timeout, so a rank that never starts surfaces as a CommError, not a hang.

The store itself authenticates nobody: anyone who can reach its port can read and overwrite keys.
So a stored value is the msgpack record, the run it belongs to (RUN_BYTES, or nothing outside a
run), and a 32-byte HMAC-SHA256 under the shared secret of (protocol, "record", namespace, run,
key, record bytes); a lookup verifies it (after a size bound) before the record is decoded or
acted on. A value rewritten by a process without the secret, or moved from another key, is a
CommError naming the key. A value that is authentic but belongs to another run (a replay of an
earlier run's record under a long-lived secret) is named in a note and skipped: the lookup waits
for this run's own record to replace it. The connection handshake then proves the endpoint a
record names holds the secret too.

The store listens on loopback unless told otherwise: `host_store` binds its own socket to `host`
and hands it to TCPStore (`master_listen_fd`), because TCPStore's master binds every interface
whatever host it is given.
"""
from __future__ import annotations

import hmac
import logging
import socket
import time
from datetime import timedelta

import msgpack

from executor.dicomm.errors import CommError
from executor.dicomm.handshake import MAC_BYTES, run_mac

MAX_RECORD_BYTES = 64 * 1024          # records are ~300 bytes
RUN_BYTES = 16                        # a run's id: the nonce its processes agreed on
POLL_S = 0.02                         # how often a lookup re-reads a record of another run

log = logging.getLogger("h2.dicomm")


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


class ForeignRecord(CommError):
    """An authentic record of another run (`run`; b"": written outside any run)."""

    def __init__(self, message: str, run: bytes):
        super().__init__(message)
        self.run = run


def describe_run(run: bytes) -> str:
    return f"run {run.hex()}" if run else "no run (written before a run was agreed)"


class Rendezvous:
    def __init__(self, host: str, port: int, timeout: float, namespace: str, store=None, *,
                 secret: bytes, run: bytes = b"", on_foreign=None):
        """`run`: the id of the run every record belongs to (RUN_BYTES; b"" outside a run).
        `on_foreign(text)` hears of each record of another run that a lookup skipped (default:
        a logged warning)."""
        self.namespace = namespace.rstrip("/")
        self._secret = secret
        self.run = run
        self.on_foreign = on_foreign or (lambda text: log.warning("dicomm: %s", text))
        self._noted: set = set()
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
            self.store.set(f"{self.namespace}/{key}",
                           packed + self.run + self._mac(self.run, key, packed))
        except Exception as e:
            raise CommError(f"rendezvous store at {self.where} failed while publishing "
                            f"{key!r}: {e}") from None
        return packed

    def _mac(self, run: bytes, key: str, packed: bytes) -> bytes:
        return run_mac(self._secret, "record", self.namespace, run, key, packed)

    def _open(self, key: str, value: bytes) -> bytes:
        """The record bytes of an authentic value of this run; ForeignRecord for an authentic
        value of another run; CommError for anything else."""
        full = f"{self.namespace}/{key}"
        if not MAC_BYTES <= len(value) <= MAX_RECORD_BYTES + RUN_BYTES + MAC_BYTES:
            raise CommError(f"rendezvous record at {full!r} failed authentication: it is "
                            f"{len(value)} bytes, not a record with its MAC (written by a process "
                            f"without the run secret?)",
                            hint="something other than this run's workers wrote to its store")
        mac = value[-MAC_BYTES:]
        # this run's layout first, then the other (a record of a run, or one outside any run)
        for run_len in dict.fromkeys((len(self.run), RUN_BYTES, 0)):
            if len(value) < MAC_BYTES + run_len:
                continue
            packed = value[:len(value) - MAC_BYTES - run_len]
            run = value[len(packed):len(value) - MAC_BYTES]
            if hmac.compare_digest(mac, self._mac(run, key, packed)):
                if run == self.run:
                    return packed
                raise ForeignRecord(f"rendezvous record {full!r} belongs to another run "
                                    f"({describe_run(run)}; this run is "
                                    f"{describe_run(self.run)})", run)
        raise CommError(f"rendezvous record at {full!r} failed authentication (written by a "
                        f"process without the run secret)",
                        hint="something other than this run's workers wrote to its store")

    def _note(self, key: str, value: bytes, e: ForeignRecord) -> None:
        if (key, value) not in self._noted:
            self._noted.add((key, value))
            self.on_foreign(f"ignored {e.message}: replayed into the store by something that "
                            "can reach it; this run reads only its own records")

    def lookup_raw(self, key: str, what: str, timeout: float | None = None) -> bytes:
        """The authenticated record bytes of this run stored under `key` (without their MAC),
        waiting past records of another run until this run's own replaces them."""
        t = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + t
        value = self._fetch(key, what, t)
        while True:
            try:
                return self._open(key, value)
            except ForeignRecord as e:
                self._note(key, value, e)
                if time.monotonic() >= deadline:
                    raise CommError(f"{e.message}; {what} of this run did not replace it "
                                    f"within {t:g} s",
                                    hint="something that can reach the store replayed a record "
                                         "of an earlier run; keep the store's port private "
                                         "(--iface, firewall)") from None
                time.sleep(POLL_S)
                value = self._get(key, what)

    def try_lookup(self, key: str, what: str) -> dict | None:
        """The record under `key` if one of this run is there now; None if none is (a record of
        another run is noted and skipped)."""
        full = f"{self.namespace}/{key}"
        try:
            if not self.store.check([full]):
                return None
        except Exception as e:
            raise CommError(f"rendezvous store at {self.where} failed while reading {what} "
                            f"({full!r}): {e}") from None
        value = self._get(key, what)
        try:
            return self._decode(key, self._open(key, value))
        except ForeignRecord as e:
            self._note(key, value, e)
            return None

    def _get(self, key: str, what: str) -> bytes:
        full = f"{self.namespace}/{key}"
        try:
            return self.store.get(full)
        except Exception as e:
            raise CommError(f"rendezvous store at {self.where} failed while reading {what} "
                            f"({full!r}): {str(e).splitlines()[0] if str(e) else e}") from None

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
        return self._decode(key, self.lookup_raw(key, what, timeout))

    @staticmethod
    def _decode(key: str, raw: bytes) -> dict:
        try:
            record = msgpack.unpackb(raw, raw=False)
        except Exception as e:
            raise CommError(f"rendezvous record {key!r} is not msgpack: {e}") from None
        if not isinstance(record, dict):
            raise CommError(f"rendezvous record {key!r} should be a map, got {type(record).__name__}")
        return record
