"""Per-connection message authentication: every message after the handshake carries a tag.

The handshake (handshake.py) ends with both sides holding two keys derived from the run secret,
both nonces, both ranks and the transport: one for the link's direction src -> dst (frames, shm
map/drop, bye), one for dst -> src (shm releases). Each message is then

    prefix (8) | msgpack map (length from the prefix) | tag (TAG_BYTES) | payload (if inline)

with tag = HMAC-SHA256(direction key, u64 LE message number || prefix || map). Message numbers
count every message in that direction from 0 and are never sent: the receiver keeps its own
count, so a dropped, replayed or reordered message (or one from another connection, whose key
differs) fails the check just as an altered one does. A tensor frame's map carries the SHA-256
digest of its payload (checksum.py), so the tag covers the payload too; the receiver checks the
tag before it decodes the map or allocates anything, and the digest once the payload is read.
"""
from __future__ import annotations

import hmac

from executor.dicomm.errors import CommError

TAG_BYTES = 32


class Sealer:
    """Tags the messages one side sends in one direction of one connection."""

    def __init__(self, key: bytes):
        self._key = key
        self._n = 0

    def tag(self, head) -> bytes:
        t = hmac.digest(self._key, self._n.to_bytes(8, "little") + bytes(head), "sha256")
        self._n += 1
        return t


class Opener:
    """Checks the tags of the messages arriving in one direction of one connection."""

    def __init__(self, key: bytes, peer: int, link: str):
        self._key = key
        self._n = 0
        self.peer = peer
        self.link = link

    def check(self, head, tag) -> None:
        want = hmac.digest(self._key, self._n.to_bytes(8, "little") + bytes(head), "sha256")
        if not hmac.compare_digest(bytes(tag), want):
            raise CommError(f"frame from rank {self.peer} failed its integrity check (altered in "
                            f"transit, or dropped, replayed or reordered: message {self._n} on "
                            f"link {self.link})", self.peer,
                            hint="something between the two workers rewrote their traffic; the "
                                 "run's results cannot be trusted")
        self._n += 1
