"""What an OSError of this process says, in a run error: the cause in words and, for an exhausted
resource (descriptors, memory, disk), which limit it hit — the machine refused the worker
something, which is no bug of h2's and no failure of a peer's."""
from __future__ import annotations

import errno
import os

# this process's or this machine's own shortage: raised under a comm error, it is still the
# worker's own failure, not a broken link to a peer
LOCAL_ERRNOS = frozenset(getattr(errno, n) for n in (
    "EMFILE", "ENFILE", "ENOMEM", "ENOBUFS", "ENOSPC", "EDQUOT") if hasattr(errno, n))

_HINTS = {
    "EMFILE": "raise the open-file limit (ulimit -n); if it is already generous, something "
              "else holds the worker's descriptors (a leak, or another process connecting to it)",
    "ENFILE": "the whole machine is out of file descriptors: close other programs or raise "
              "fs.file-max",
    "ENOMEM": "the machine is out of memory: free some, or give the worker less to hold",
    "ENOSPC": "free space there, or point the run's files at another disk",
    "EDQUOT": "the disk quota is used up: free space there, or write elsewhere",
    "EACCES": "make it writable for this user, or write elsewhere",
    "EPERM": "make it writable for this user, or write elsewhere",
    "EROFS": "the file system is read-only: write elsewhere",
    "EIO": "the disk failed a read or write: check the device (dmesg)",
}


def descriptor_limit() -> str:
    """This process's open-file limit (RLIMIT_NOFILE) in words."""
    try:
        import resource
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        return "unknown"
    return "unlimited" if soft == resource.RLIM_INFINITY else f"{soft} open files"


def os_error_cause(e: OSError) -> str:
    """'Too many open files (EMFILE: this process's file descriptors are exhausted, limit 64
    open files)': the error's own words, its errno's name and, for descriptors, the limit."""
    name = errno.errorcode.get(e.errno, "") if e.errno else ""
    text = e.strerror or (os.strerror(e.errno) if e.errno else str(e) or type(e).__name__)
    if e.errno == errno.EMFILE:
        return (f"{text} (EMFILE: this process's file descriptors are exhausted, limit "
                f"{descriptor_limit()})")
    if e.errno == errno.ENFILE:
        return f"{text} (ENFILE: the machine's open-file table is full)"
    return f"{text} ({name})" if name else text


def os_error_hint(e: OSError) -> str | None:
    return _HINTS.get(errno.errorcode.get(e.errno, "")) if e.errno else None


def local_os_error(e: BaseException | None) -> OSError | None:
    """The OSError of this process's own shortage (LOCAL_ERRNOS) behind `e`: `e` itself, or an
    exception it was raised from or while handling; None if there is none."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in LOCAL_ERRNOS:
            return e
        e = e.__cause__ or e.__context__
    return None
