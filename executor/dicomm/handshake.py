"""Mutual HMAC-SHA256 challenge-response on every new DiComm connection.

Each run has a secret the launcher hands to its workers (env H2_SECRET). A link opens only after
both ends prove they hold it, so a stray process that finds a listening port (or rewrites a
rendezvous key) can neither inject frames nor receive them:

    acceptor  -> connector   C {"op": "hello", "rank": dst, "nonce": Na}
    connector -> acceptor    C {"op": "auth", "rank": src, "nonce": Nc, "transport": t,
                                "setup": Dc, "mac": HMAC(secret, ["connect", Na, Nc, src, dst, t, Dc])}
    acceptor  -> connector   C {"op": "accept", "setup": Da, "mac": HMAC(secret, ["accept", ...])}
                          or C {"op": "reject", "reason": "..."} and the connection closes

Na, Nc are fresh 32-byte nonces (no replay). Dc/Da are SHA-256 digests of transport setup records
the two sides published in the rendezvous store (RDMA queue-pair info); the MACs bind them, so a
forged store entry is detected. The MAC input is msgpack-encoded, which makes it unambiguous.
"""
from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from typing import Callable

import msgpack

from executor.dicomm.errors import CommError
from executor.dicomm.frame import CONTROL, decode_body, encode_message, parse_prefix, PREFIX_BYTES

PROTOCOL = "h2-dicomm/1"
NONCE_BYTES = 32


def new_secret() -> str:
    """A fresh per-run secret for the launcher to pass to every worker (as H2_SECRET)."""
    return secrets.token_hex(32)


def setup_digest(record: bytes | None) -> bytes:
    return hashlib.sha256(record).digest() if record else b""


def _mac(secret: bytes, *fields) -> bytes:
    return hmac.new(secret, msgpack.packb([PROTOCOL, *fields], use_bin_type=True),
                    hashlib.sha256).digest()


class StaleEndpoint(CommError):
    """The address published for a rank answers as another rank: a record left by an earlier run."""


@dataclass(frozen=True)
class Accepted:
    """What the acceptor learned about an authenticated connector."""
    src: int
    transport: str
    setup: bytes          # digest of the connector's published setup record (b"" if none)


def send_control(stream, body: dict) -> None:
    stream.send_parts([encode_message(body, CONTROL)])


def read_control(stream, peer: int | None = None) -> dict:
    msg_type, length = parse_prefix(bytes(stream.recv_exact(PREFIX_BYTES)), peer)
    body = decode_body(stream.recv_exact(length), peer)
    if msg_type != CONTROL:
        raise CommError("expected a handshake message, got a tensor frame", peer)
    return body


def accept(stream, my_rank: int, secret: bytes,
           prepare: Callable[[int, str, bytes], bytes]) -> Accepted:
    """Acceptor side. `prepare(src, transport, connector_digest)` builds the link's local resources
    and returns the digest of this side's setup record; it may raise CommError to refuse."""
    na = secrets.token_bytes(NONCE_BYTES)
    send_control(stream, {"op": "hello", "rank": my_rank, "nonce": na})
    auth = read_control(stream)
    try:
        src, nc, transport = int(auth["rank"]), bytes(auth["nonce"]), str(auth["transport"])
        dc, mac = bytes(auth["setup"]), bytes(auth["mac"])
    except (KeyError, TypeError, ValueError):
        _reject(stream, "malformed auth message")
        raise CommError(f"rank {my_rank}: rejected a connection: malformed auth message") from None
    if auth.get("op") != "auth" or len(nc) != NONCE_BYTES or \
            not hmac.compare_digest(mac, _mac(secret, "connect", na, nc, src, my_rank, transport, dc)):
        _reject(stream, "bad handshake MAC")
        raise CommError(f"rank {my_rank}: rejected a connection claiming to be rank {src}: "
                        f"bad handshake MAC (wrong secret, or not a DiComm peer)", src)
    try:
        da = prepare(src, transport, dc)
    except CommError as e:
        _reject(stream, e.message)
        raise
    send_control(stream, {"op": "accept", "setup": da,
                          "mac": _mac(secret, "accept", na, nc, my_rank, src, transport, da)})
    return Accepted(src=src, transport=transport, setup=dc)


def connect(stream, my_rank: int, dst: int, secret: bytes, transport: str,
            setup: bytes = b"") -> bytes:
    """Connector side; returns the acceptor's setup digest. Raises CommError if rejected."""
    try:
        hello = read_control(stream, dst)
    except CommError as e:
        raise CommError(f"rank {my_rank}: no handshake from rank {dst}: {e.message}", dst) from None
    if hello.get("op") != "hello" or hello.get("rank") != dst:
        raise StaleEndpoint(f"rank {my_rank}: connected to rank {hello.get('rank')!r}'s endpoint while "
                        f"expecting rank {dst} (stale rendezvous record?)", dst)
    na = bytes(hello["nonce"])
    nc = secrets.token_bytes(NONCE_BYTES)
    send_control(stream, {"op": "auth", "rank": my_rank, "nonce": nc, "transport": transport,
                          "setup": setup,
                          "mac": _mac(secret, "connect", na, nc, my_rank, dst, transport, setup)})
    try:
        reply = read_control(stream, dst)
    except CommError as e:
        raise CommError(f"rank {dst} closed the connection during the handshake ({e.message})",
                        dst, hint="every worker must get the same H2_SECRET") from None
    if reply.get("op") == "reject":
        raise CommError(f"rank {dst} rejected the handshake from rank {my_rank}: "
                        f"{reply.get('reason')}", dst, hint="every worker must get the same H2_SECRET")
    da = bytes(reply.get("setup", b""))
    if reply.get("op") != "accept" or not hmac.compare_digest(
            bytes(reply.get("mac", b"")), _mac(secret, "accept", na, nc, dst, my_rank, transport, da)):
        raise CommError(f"rank {my_rank}: the endpoint published for rank {dst} failed to prove it "
                        f"holds the run secret (impostor or wrong secret)", dst)
    return da


def _reject(stream, reason: str) -> None:
    try:
        send_control(stream, {"op": "reject", "reason": reason})
    except (OSError, CommError):
        pass
