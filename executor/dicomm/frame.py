"""DiComm frames: a msgpack header followed by the raw tensor bytes.

Every message on a DiComm link starts with an 8-byte prefix, then a msgpack map, then (for tensor
frames) the payload:

    offset 0  b"h2"            magic: a desynchronised or foreign stream fails here, not later
    offset 2  u8 version       FORMAT_VERSION (2)
    offset 3  u8 type          b"F" tensor frame, b"C" control message (handshake, shm bookkeeping)
    offset 4  u32 LE length    length of the msgpack map that follows (at most MAX_HEADER_BYTES)
    offset 8  msgpack map      for b"F": the `Header` fields below
    (on a link: 32-byte tag    HMAC over the message number, prefix and map: seal.py)
    then      nbytes bytes     the payload, C order, little-endian, unless the header says `at`
                               (then the payload lies in a shared-memory segment, see shm.py)

The payload is never copied into the header buffer: senders pass [prefix+header, memoryview(array)]
to one gathered write (socket.sendmsg), receivers read the payload straight into its final numpy
buffer (recv_into).

Digest: SHA-256 of the payload bytes (a hash tree for large payloads), in the header; see
checksum.py. On a link the header is authenticated, so the digest is what makes the payload
tamper-evident; in memory (`decode_frame`) it catches accidents.

dtypes are h2ir names. numpy has no bfloat16, so a bf16 tensor travels as a uint16 view whose bits
are the bf16 bits; `to_bf16`/`from_bf16` convert from/to float32. Since h2ir has no u16 dtype, a
uint16 array is always read as bf16.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import msgpack
import numpy as np

from executor.dicomm.checksum import DIGEST_BYTES, digest as payload_digest
from executor.dicomm.errors import CommError
from h2ir.types import host_dtype

FORMAT_VERSION = 2            # 2: SHA-256 payload digest instead of CRC-32, tagged link messages
MAGIC = b"h2"
FRAME = b"F"
CONTROL = b"C"
PREFIX = struct.Struct("<2sBcI")
PREFIX_BYTES = PREFIX.size
MAX_HEADER_BYTES = 64 * 1024          # a header is ~100 bytes; anything bigger is garbage
MAX_PAYLOAD_BYTES = 1 << 40           # refuse to allocate more than 1 TiB because a header said so
MAX_KIND_CHARS = 256          # kinds are tags like "act:<tensor name>"

# The h2ir dtypes a frame may carry, and the numpy dtype of their bytes on the wire (from the one
# dtype table; this order is the order error messages list them in).
WIRE_DTYPES = ("f32", "f64", "f16", "bf16", "i64", "i32", "bool")
DTYPES: dict[str, np.dtype] = {name: host_dtype(name) for name in WIRE_DTYPES}
_NAME_OF = {dt: name for name, dt in DTYPES.items()}


def dtype_name(dtype: np.dtype) -> str:
    """The h2ir name of a numpy dtype (uint16 -> 'bf16')."""
    name = _NAME_OF.get(dtype)
    if name is not None:
        return name
    dt = np.dtype(dtype)
    name = _NAME_OF.get(dt.newbyteorder("<") if dt.byteorder == ">" else dt)
    if name is None:
        raise CommError(f"dtype {np.dtype(dtype)} has no h2ir name; expected one of "
                        f"{', '.join(f'{n} ({d})' for n, d in DTYPES.items())}")
    return name


def to_bf16(x) -> np.ndarray:
    """float32 values -> uint16 array holding their bfloat16 bits (round to nearest even)."""
    x32 = np.asarray(x, dtype=np.float32)
    x32 = np.ascontiguousarray(x32).reshape(x32.shape)   # keeps 0-d arrays 0-d
    bits = x32.view(np.uint32)
    # Round to nearest even on the 16 dropped bits, the same rule torch's bfloat16 cast uses.
    rounded = ((bits + (0x7FFF + ((bits >> 16) & 1))) >> 16).astype(np.uint16)
    nan = np.isnan(x32)
    if nan.any():  # the addition above can carry a NaN's mantissa into the sign bit
        rounded[nan] = 0x7FC0
    return rounded


def from_bf16(bits) -> np.ndarray:
    """uint16 array of bfloat16 bits -> float32 values (exact)."""
    b = np.asarray(bits)
    if b.dtype != np.uint16:
        raise CommError(f"from_bf16 expects the uint16 bit view of a bf16 tensor, got {b.dtype}")
    return (b.astype(np.uint32) << 16).view(np.float32)   # astype made it contiguous


@dataclass(slots=True)   # not frozen: frozen dataclasses cost microseconds per frame to build
class Header:
    """What a tensor frame says about its payload. `at` is set only for shared-memory payloads."""
    kind: str
    stage: int
    mb: int
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    seq: int
    digest: bytes       # payload digest (checksum.py)
    src: int
    at: tuple[int, int] | None = None   # (segment id, byte offset) in the sender's shm segment

    def to_map(self) -> dict:
        m = {"kind": self.kind, "stage": self.stage, "mb": self.mb, "dtype": self.dtype,
             "shape": list(self.shape), "nbytes": self.nbytes, "seq": self.seq, "digest": self.digest,
             "src": self.src}
        if self.at is not None:
            m["at"] = list(self.at)
        return m


def contiguous(array: np.ndarray) -> np.ndarray:
    """The array as C-contiguous little-endian; copies only when the input is neither."""
    a = np.asarray(array)
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    # (np.ascontiguousarray would also turn a 0-d array into a 1-d one)
    return a if a.flags.c_contiguous else np.ascontiguousarray(a)


def payload_bytes(array: np.ndarray) -> memoryview:
    """A flat byte view of a C-contiguous array (no copy)."""
    return memoryview(array.reshape(-1).view(np.uint8)) if array.size else memoryview(b"")


def make_header(array: np.ndarray, *, kind: str, stage: int, mb: int, seq: int, src: int,
                dtype: str | None = None, digest: bytes | None = None,
                at: tuple[int, int] | None = None) -> Header:
    """Header for a C-contiguous array; computes the payload digest unless the caller has it."""
    name = dtype if dtype is not None else dtype_name(array.dtype)
    if name not in DTYPES:
        raise CommError(f"unknown dtype {name!r}; expected one of {', '.join(DTYPES)}")
    if DTYPES[name].itemsize != array.dtype.itemsize:
        raise CommError(f"dtype {name!r} needs {DTYPES[name].itemsize}-byte elements, "
                        f"array has {array.dtype}")
    if not isinstance(kind, str) or not kind or len(kind) > MAX_KIND_CHARS:
        raise CommError(f"frame kind must be a non-empty string of at most {MAX_KIND_CHARS} "
                        f"characters, got {kind!r}")
    return Header(kind=kind, stage=int(stage), mb=int(mb), dtype=name,
                  shape=tuple(int(s) for s in array.shape), nbytes=int(array.nbytes),
                  seq=int(seq),
                  digest=payload_digest(payload_bytes(array)) if digest is None else bytes(digest),
                  src=int(src), at=at)


def encode_message(body: dict, msg_type: bytes = FRAME) -> bytes:
    """prefix + msgpack map."""
    packed = msgpack.packb(body, use_bin_type=True)
    if len(packed) > MAX_HEADER_BYTES:
        raise CommError(f"message header is {len(packed)} bytes, more than {MAX_HEADER_BYTES}")
    return PREFIX.pack(MAGIC, FORMAT_VERSION, msg_type, len(packed)) + packed


def encode_frame(array: np.ndarray, *, kind: str, stage: int = 0, mb: int = 0, seq: int = 0,
                 src: int = 0, dtype: str | None = None) -> list:
    """[prefix+header, payload view]: the parts of one frame, ready for one gathered write."""
    a = contiguous(array)
    header = make_header(a, kind=kind, stage=stage, mb=mb, seq=seq, src=src, dtype=dtype)
    return [encode_message(header.to_map()), payload_bytes(a)]


def parse_prefix(prefix: bytes, peer: int | None = None,
                 max_length: int = MAX_HEADER_BYTES) -> tuple[bytes, int]:
    """(message type, header length) from the 8 prefix bytes; a length over `max_length` is
    refused before anything is allocated for it."""
    if len(prefix) != PREFIX_BYTES:
        raise CommError(f"truncated frame from {_who(peer)}: got {len(prefix)} of "
                        f"{PREFIX_BYTES} prefix bytes", peer)
    magic, version, msg_type, length = PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise CommError(f"corrupt frame from {_who(peer)}: prefix starts with {magic!r}, "
                        f"expected {MAGIC!r} (stream out of sync or not a DiComm peer)", peer)
    if version != FORMAT_VERSION:
        raise CommError(f"frame from {_who(peer)} has format version {version}, this DiComm "
                        f"speaks version {FORMAT_VERSION}", peer)
    if msg_type not in (FRAME, CONTROL):
        raise CommError(f"corrupt frame from {_who(peer)}: message type {msg_type!r}, "
                        f"expected b'F' or b'C'", peer)
    if length > max_length:
        raise CommError(f"corrupt frame from {_who(peer)}: header length {length} exceeds "
                        f"{max_length}", peer)
    return msg_type, length


def decode_body(body: bytes, peer: int | None = None) -> dict:
    try:
        m = msgpack.unpackb(bytes(body), raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types for bad input
        raise CommError(f"corrupt frame header from {_who(peer)}: not msgpack ({e})", peer) from None
    if not isinstance(m, dict):
        raise CommError(f"corrupt frame header from {_who(peer)}: expected a msgpack map, "
                        f"got {type(m).__name__}", peer)
    return m


_FIELDS = (("kind", str), ("stage", int), ("mb", int), ("dtype", str), ("shape", list),
           ("nbytes", int), ("seq", int), ("digest", bytes), ("src", int))


def decode_header(body: bytes, peer: int | None = None) -> Header:
    """Header from the msgpack map of a b'F' message; every field is checked."""
    m = decode_body(body, peer)
    for key, typ in _FIELDS:
        if type(m.get(key)) is not typ:
            raise CommError(f"corrupt frame header from {_who(peer)}: field {key!r} should be "
                            f"{typ.__name__}, got {m.get(key)!r}", peer)
    # A frame placed in a shared-memory segment carries no payload digest (see shm.py: the
    # segment is reachable only by the two ends and processes of their uid, which the threat
    # model does not defend against); every other frame carries one.
    if len(m["digest"]) != DIGEST_BYTES and not (m["digest"] == b"" and m.get("at") is not None):
        raise CommError(f"corrupt frame header from {_who(peer)}: digest has "
                        f"{len(m['digest'])} bytes, expected {DIGEST_BYTES}", peer)
    dt = DTYPES.get(m["dtype"])
    if dt is None:
        raise CommError(f"frame from {_who(peer)} has unknown dtype {m['dtype']!r}", peer)
    shape = m["shape"]
    if len(shape) > 64 or not all(type(s) is int and 0 <= s <= MAX_PAYLOAD_BYTES for s in shape):
        raise CommError(f"corrupt frame header from {_who(peer)}: bad shape {shape!r}", peer)
    expected = math.prod(shape) * dt.itemsize
    if m["nbytes"] != expected or expected > MAX_PAYLOAD_BYTES:
        raise CommError(f"corrupt frame header from {_who(peer)}: nbytes {m['nbytes']} but "
                        f"{m['dtype']}{shape} needs {expected}", peer)
    at = m.get("at")
    if at is not None and not (type(at) is list and len(at) == 2
                               and all(type(v) is int and v >= 0 for v in at)):
        raise CommError(f"corrupt frame header from {_who(peer)}: bad placement {at!r}", peer)
    return Header(m["kind"], m["stage"], m["mb"], m["dtype"], tuple(shape), m["nbytes"],
                  m["seq"], m["digest"], m["src"], tuple(at) if at is not None else None)


def payload_array(header: Header, payload, peer: int | None = None) -> np.ndarray:
    """The tensor a header describes, viewing `payload` (no copy) after length and digest checks."""
    got = memoryview(payload).nbytes
    if got != header.nbytes:
        raise CommError(f"truncated frame from {_who(peer)}: {header.kind} mb {header.mb} "
                        f"carries {got} of {header.nbytes} payload bytes", peer)
    if (header.digest or header.at is None) and payload_digest(payload) != header.digest:
        raise CommError(f"corrupt frame from {_who(peer)}: {header.kind} mb {header.mb} payload "
                        f"does not match the SHA-256 digest in its header", peer)
    dt = DTYPES[header.dtype]
    flat = np.frombuffer(payload, dtype=dt, count=header.nbytes // dt.itemsize) \
        if header.nbytes else np.empty(0, dtype=dt)
    return flat.reshape(header.shape)


def decode_frame(buf, peer: int | None = None) -> tuple[Header, np.ndarray]:
    """Decode one whole frame held in memory (the inverse of b''.join(encode_frame(...)))."""
    mv = memoryview(buf).cast("B")
    msg_type, length = parse_prefix(bytes(mv[:PREFIX_BYTES]), peer)
    if msg_type != FRAME:
        raise CommError(f"expected a tensor frame from {_who(peer)}, got a control message", peer)
    if len(mv) < PREFIX_BYTES + length:
        raise CommError(f"truncated frame from {_who(peer)}: header needs {length} bytes, "
                        f"{len(mv) - PREFIX_BYTES} present", peer)
    header = decode_header(mv[PREFIX_BYTES:PREFIX_BYTES + length], peer)
    if header.at is not None:
        raise CommError(f"frame from {_who(peer)} points into shared memory; decode it on its link",
                        peer)
    payload = mv[PREFIX_BYTES + length:]
    if len(payload) > header.nbytes:
        raise CommError(f"corrupt frame from {_who(peer)}: {len(payload) - header.nbytes} bytes "
                        f"after the payload", peer)
    return header, payload_array(header, payload, peer)


def _who(peer: int | None) -> str:
    return f"rank {peer}" if peer is not None else "peer"
