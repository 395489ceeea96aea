"""Mutual HMAC-SHA256 challenge-response on every new DiComm connection, and the keys that
authenticate every message after it.

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

After "accept" both sides derive the link's two message keys (`link_keys`) from the secret, both
nonces, both ranks and the transport, and every later message carries a tag under them (seal.py):
a relay that passed the handshake through unchanged still cannot alter, drop, replay or reorder
anything that follows.

Everything read before authentication is bounded before it is used: a handshake message is at
most MAX_HANDSHAKE_BYTES, and every field is checked for type and size (nonce and mac exactly 32
bytes, setup at most 64, rank an int in range, transport a known name) before it is hashed,
copied or compared, so a hostile peer costs a few microseconds, not an allocation it chose.
"""
from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from typing import Callable

import msgpack

from executor.dicomm.errors import CommError
from executor.dicomm.frame import CONTROL, PREFIX_BYTES, decode_body, encode_message, parse_prefix

PROTOCOL = "h2-dicomm/2"
NONCE_BYTES = 32
MAC_BYTES = 32
MAX_SETUP_BYTES = 64                  # a digest (SHA-256 today)
MAX_HANDSHAKE_BYTES = 4096            # hello/auth/accept/reject are ~200 bytes
MAX_REASON_CHARS = 512
MAX_RANK = 1 << 20
TRANSPORTS = ("tcp", "shm", "rdma")


def new_secret() -> str:
    """A fresh per-run secret for the launcher to pass to every worker (as H2_SECRET)."""
    return secrets.token_hex(32)


def setup_digest(record: bytes | None) -> bytes:
    return hashlib.sha256(record).digest() if record else b""


def run_mac(secret: bytes, *fields) -> bytes:
    """HMAC-SHA256 under the run secret of msgpack([PROTOCOL, *fields]); the first field names
    what is authenticated ("connect", "accept", "record", "frames"), so no MAC of one kind can
    stand in for another."""
    return hmac.new(secret, msgpack.packb([PROTOCOL, *fields], use_bin_type=True),
                    hashlib.sha256).digest()


def run_key(secret: bytes, run: bytes) -> bytes:
    """The key a run's handshakes use: the shared secret bound to the run's id (b"": the secret
    itself), so no connection can join a run with a record or endpoint of another."""
    return run_mac(secret, "run", run) if run else secret


@dataclass(frozen=True)
class LinkKeys:
    """The two message keys of one connection (seal.py)."""
    forward: bytes        # messages src -> dst (frames, shm map/drop, bye)
    reverse: bytes        # messages dst -> src (shm releases)


def link_keys(secret: bytes, na: bytes, nc: bytes, src: int, dst: int, transport: str) -> LinkKeys:
    """Fresh per connection (both nonces), bound to its ranks and transport."""
    return LinkKeys(run_mac(secret, "frames", "src->dst", na, nc, src, dst, transport),
                    run_mac(secret, "frames", "dst->src", na, nc, src, dst, transport))


class StaleEndpoint(CommError):
    """The address published for a rank answers as another rank: a record left by an earlier run."""


@dataclass(frozen=True)
class Accepted:
    """What the acceptor learned about an authenticated connector."""
    src: int
    transport: str
    setup: bytes          # digest of the connector's published setup record (b"" if none)
    keys: LinkKeys


@dataclass(frozen=True)
class Connected:
    """What the connector learned about an authenticated acceptor."""
    setup: bytes          # digest of the acceptor's published setup record (b"" if none)
    keys: LinkKeys


def send_control(stream, body: dict) -> None:
    stream.send_parts([encode_message(body, CONTROL)])


def read_control(stream, peer: int | None = None) -> dict:
    """One unauthenticated control message, at most MAX_HANDSHAKE_BYTES (checked on the prefix,
    before the body is read)."""
    msg_type, length = parse_prefix(bytes(stream.recv_exact(PREFIX_BYTES)), peer,
                                    MAX_HANDSHAKE_BYTES)
    if msg_type != CONTROL:
        raise CommError("expected a handshake message, got a tensor frame", peer)
    return decode_body(stream.recv_exact(length), peer)


class _Malformed(CommError):
    pass


def _field(msg: dict, name: str, kind: str, *, size: int | None = None, max_size: int = 0,
           low: int = 0, high: int = 0, choices: tuple = ()):
    """msg[name] checked for type and size before anything else touches it."""
    v = msg.get(name)
    if kind == "bytes":
        ok = type(v) is bytes and (len(v) == size if size is not None else len(v) <= max_size)
        want = f"{size} bytes" if size is not None else f"at most {max_size} bytes"
    elif kind == "int":
        ok = type(v) is int and low <= v < high
        want = f"an int in {low}..{high - 1}"
    else:
        ok = type(v) is str and (v in choices if choices else len(v) <= max_size)
        want = f"one of {', '.join(choices)}" if choices else f"a string of <= {max_size} chars"
    if not ok:
        shown = f"{type(v).__name__} of size {len(v)}" if isinstance(v, (bytes, str, list, dict)) \
            else type(v).__name__
        raise _Malformed(f"handshake field {name!r} should be {want}, got {shown}")
    return v


def accept(stream, my_rank: int, secret: bytes, prepare: Callable[[int, str, bytes], bytes],
           world_size: int = MAX_RANK) -> Accepted:
    """Acceptor side. `prepare(src, transport, connector_digest)` builds the link's local resources
    and returns the digest of this side's setup record; it may raise CommError to refuse."""
    na = secrets.token_bytes(NONCE_BYTES)
    send_control(stream, {"op": "hello", "rank": my_rank, "nonce": na})
    try:
        auth = read_control(stream)
        if auth.get("op") != "auth":
            raise _Malformed(f"expected an auth message, got op {str(auth.get('op'))[:40]!r}")
        src = _field(auth, "rank", "int", high=world_size)
        nc = _field(auth, "nonce", "bytes", size=NONCE_BYTES)
        transport = _field(auth, "transport", "str", choices=TRANSPORTS)
        dc = _field(auth, "setup", "bytes", max_size=MAX_SETUP_BYTES)
        mac = _field(auth, "mac", "bytes", size=MAC_BYTES)
    except CommError as e:
        _reject(stream, f"malformed auth message: {e.message}")
        raise CommError(f"rank {my_rank}: rejected a connection: malformed auth message "
                        f"({e.message})") from None
    if not hmac.compare_digest(mac, run_mac(secret, "connect", na, nc, src, my_rank, transport, dc)):
        _reject(stream, "bad handshake MAC")
        raise CommError(f"rank {my_rank}: rejected a connection claiming to be rank {src}: "
                        f"bad handshake MAC (wrong secret, or not a DiComm peer)", src)
    try:
        da = prepare(src, transport, dc)
    except CommError as e:
        _reject(stream, e.message)
        raise
    send_control(stream, {"op": "accept", "setup": da,
                          "mac": run_mac(secret, "accept", na, nc, my_rank, src, transport, da)})
    return Accepted(src=src, transport=transport, setup=dc,
                    keys=link_keys(secret, na, nc, src, my_rank, transport))


def connect(stream, my_rank: int, dst: int, secret: bytes, transport: str,
            setup: bytes = b"") -> Connected:
    """Connector side; returns the acceptor's setup digest and the link's message keys. Raises
    CommError if rejected."""
    try:
        hello = read_control(stream, dst)
        if hello.get("op") != "hello":
            raise _Malformed(f"expected a hello message, got op {str(hello.get('op'))[:40]!r}")
        rank = _field(hello, "rank", "int", high=MAX_RANK)
        na = _field(hello, "nonce", "bytes", size=NONCE_BYTES)
    except CommError as e:
        raise CommError(f"rank {my_rank}: no handshake from rank {dst}: {e.message}", dst) from None
    if rank != dst:
        raise StaleEndpoint(f"rank {my_rank}: connected to rank {rank}'s endpoint while "
                            f"expecting rank {dst} (stale rendezvous record?)", dst)
    nc = secrets.token_bytes(NONCE_BYTES)
    send_control(stream, {"op": "auth", "rank": my_rank, "nonce": nc, "transport": transport,
                          "setup": setup,
                          "mac": run_mac(secret, "connect", na, nc, my_rank, dst, transport, setup)})
    try:
        reply = read_control(stream, dst)
    except CommError as e:
        raise CommError(f"rank {dst} closed the connection during the handshake ({e.message})",
                        dst, hint="every worker must get the same H2_SECRET") from None
    try:
        if reply.get("op") == "reject":
            reason = _field(reply, "reason", "str", max_size=MAX_REASON_CHARS)
            raise CommError(f"rank {dst} rejected the handshake from rank {my_rank}: {reason}",
                            dst, hint="every worker must get the same H2_SECRET")
        if reply.get("op") != "accept":
            raise _Malformed(f"expected accept or reject, got op {str(reply.get('op'))[:40]!r}")
        da = _field(reply, "setup", "bytes", max_size=MAX_SETUP_BYTES)
        mac = _field(reply, "mac", "bytes", size=MAC_BYTES)
    except _Malformed as e:
        raise CommError(f"rank {my_rank}: malformed handshake reply from the endpoint published "
                        f"for rank {dst}: {e.message}", dst) from None
    if not hmac.compare_digest(mac, run_mac(secret, "accept", na, nc, dst, my_rank, transport, da)):
        raise CommError(f"rank {my_rank}: the endpoint published for rank {dst} failed to prove it "
                        f"holds the run secret (impostor or wrong secret)", dst)
    return Connected(setup=da, keys=link_keys(secret, na, nc, my_rank, dst, transport))


def _reject(stream, reason: str) -> None:
    try:
        send_control(stream, {"op": "reject", "reason": reason[:MAX_REASON_CHARS]})
    except (OSError, CommError):
        pass
