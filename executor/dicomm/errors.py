"""The one error DiComm raises for anything that goes wrong on the wire.

A `CommError` names the peer and what was expected (a frame, a handshake, a live connection), so
the executor can report "worker 3 died" instead of a socket traceback. It is an `H2Error`, so the
CLIs print it without a traceback.
"""
from __future__ import annotations

from h2ir.errors import H2Error


class CommError(H2Error):
    """A dead or silent peer, a corrupt or truncated frame, a rejected handshake, an unusable transport."""

    def __init__(self, message: str, peer: int | None = None, hint: str | None = None):
        super().__init__(message, hint=hint)
        self.peer = peer
