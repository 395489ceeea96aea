"""Rendezvous through torch.distributed.TCPStore.

The launcher (or rank 0) hosts the store; every rank publishes a msgpack record under
`<namespace>/rank/<r>` (listening address, shm socket name, boot id, usable transports), and RDMA
links publish their queue-pair info under `<namespace>/link/<src>-<dst>/<side>`. Lookups wait for
the key up to the comm timeout, so a rank that never starts surfaces as a CommError, not a hang.

The store is not authenticated; the connection handshake (handshake.py) is what keeps strangers
out, and it binds any setup record read from here by digest.
"""
from __future__ import annotations

from datetime import timedelta

import msgpack

from executor.dicomm.errors import CommError


def host_store(host: str = "127.0.0.1", port: int = 0, timeout: float = 30.0):
    """Start a TCPStore master (the launcher calls this, keeps the object alive for the whole run,
    and passes `store.port` to the workers). port=0 picks a free port."""
    from torch.distributed import TCPStore
    try:
        return TCPStore(host, port, world_size=None, is_master=True,
                        timeout=timedelta(seconds=timeout), wait_for_workers=False)
    except Exception as e:  # torch raises RuntimeError/DistNetworkError
        raise CommError(f"cannot host the rendezvous store on {host}:{port}: {e}") from None


class Rendezvous:
    def __init__(self, host: str, port: int, timeout: float, namespace: str, store=None):
        self.namespace = namespace.rstrip("/")
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
            self.store.set(f"{self.namespace}/{key}", packed)
        except Exception as e:
            raise CommError(f"rendezvous store at {self.where} failed while publishing "
                            f"{key!r}: {e}") from None
        return packed

    def lookup_raw(self, key: str, what: str, timeout: float | None = None) -> bytes:
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
