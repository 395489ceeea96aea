"""What one `h2x run` leaves on disk, and what it checks there before step 1.

- `RunLock`: one run per build directory, and one per checkpoint directory (several builds may
  point --checkpoint-dir at one). An exclusive flock on `BUILD/.h2x-run.lock` and on
  `CKPT/.h2x-ckpt.lock`, each holding its owner's pid, host, build and start time for the
  refusal message. The kernel drops a lock when its process dies; the owner's record then stays
  in the file, and the next run takes the lock over with a note naming it. Only a run that holds
  the checkpoint directory's lock removes the partial files of killed writers there.
- `writable_dir` / `writable_file`: every output path is probed for real (a file created and
  removed, or the file opened for writing) before any worker starts: permission bits say nothing
  for root, and a read-only mount or a path under a regular file shows only when written.
- `run_temp_dir`: the per-run scratch directory (status slots, per-worker traces), removed on
  every exit path by its context manager.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

from executor.checkpoint import remove_partial_writes
from h2ir.errors import H2Error

LOCK_FILE = ".h2x-run.lock"      # frontend/compiler.py refuses to recompile a build that holds it
CKPT_LOCK_FILE = ".h2x-ckpt.lock"
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL)   # a file system without flock


class RunLock:
    """`with RunLock(build_dir, checkpoint_dir, writes=..., out=print):` — refuse (H2Error) if
    another h2x run holds the build or the checkpoint directory. `checkpoint_dir`: the one this
    run reads (--resume) or writes (`writes`: created if missing), else None."""

    def __init__(self, build_path: Path, checkpoint_dir: Path | None = None, *,
                 writes: bool = False, out=print):
        self.build_path = Path(build_path)
        self.path = self.build_path / LOCK_FILE
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.writes, self.out = writes, out
        self.fds: list[int] = []

    def __enter__(self):
        try:
            self.fds.append(_lock(
                self.path, "the run lock", self.build_path, "build directory",
                "wait for it to finish, or copy the build and run the copy", self.build_path,
                hint_create="h2x run writes its lock, worker logs and checkpoints into the "
                "build directory"))
            if self.checkpoint_dir is not None:
                self._lock_checkpoints()
        except BaseException:
            self._release()
            raise
        return self

    def _lock_checkpoints(self) -> None:
        d = self.checkpoint_dir
        if self.writes:
            writable_dir(d, "the checkpoint directory")
        elif not d.is_dir():
            return                        # nothing there to read or to guard
        try:
            fd = _lock(d / CKPT_LOCK_FILE, "the checkpoint directory's lock", d,
                       "checkpoint directory", "give this run a --checkpoint-dir of its own, or "
                       "wait for that run to finish", self.build_path, out=self.out)
        except _Unlockable as e:
            if self.writes:
                self.out(f"note: {d}: cannot lock the checkpoint directory ({e}); another run "
                         "pointed at it would not be refused")
            return                        # read-only: resume reads, writes and removes nothing
        self.fds.append(fd)
        partial = remove_partial_writes(d)
        if partial:
            self.out(f"note: removed {len(partial)} partial checkpoint file(s) left by a stopped "
                     "run: " + ", ".join(str(p) for p in partial[:4])
                     + (" ..." if len(partial) > 4 else ""))

    def __exit__(self, *exc):
        self._release()
        return False

    def _release(self) -> None:
        while self.fds:
            fd = self.fds.pop()
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)      # a clean end leaves no owner record behind
            os.close(fd)                 # releases the flock


class _Unlockable(Exception):
    """The lock file cannot be created or locked (read-only, or no flock on this file system)."""


def _lock(path: Path, what: str, guarded: Path, kind: str, hint: str, build: Path,
          hint_create: str = "", out=None) -> int:
    """An flocked descriptor of `path` holding this process's owner record; H2Error naming the
    owner when another run holds it. `out`: where to note taking over a dead owner's lock (the
    run lock's is not noted: a killed run is common and harmless there)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        if out is not None and e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise _Unlockable(e.strerror) from None
        raise H2Error(f"cannot create {what}: {e.strerror}"
                      + (f" ({hint_create})" if hint_create else ""), str(path)) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _describe_holder(os.pread(fd, 4096, 0))
        os.close(fd)
        raise H2Error(f"another h2x run is using this {kind} ({holder}); two runs would "
                      "overwrite each other's checkpoints", str(guarded), hint=hint) from None
    except OSError as e:
        os.close(fd)
        if out is not None and e.errno in _NO_LOCKS:
            raise _Unlockable(e.strerror) from None
        raise H2Error(f"cannot lock {what}: {e.strerror}", str(path)) from None
    before = os.pread(fd, 4096, 0)
    if out is not None and before.strip():
        out(f"note: {guarded}: took over the lock of a run that ended without releasing it "
            f"({_describe_holder(before, 'no owner recorded')}; that process is gone)")
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                              "build": str(build),
                              "started": time.time()}).encode(), 0)
    return fd


def _describe_holder(raw: bytes, unknown: str = "its owner is starting up") -> str:
    try:
        h = json.loads(raw.decode())
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(h["started"]))
        build = f", build {h['build']}" if h.get("build") else ""
        return f"pid {h['pid']} on {h['host']}{build}, started {started}"
    except (ValueError, KeyError, TypeError, OverflowError, OSError):
        return unknown


def _probe_name(d: Path) -> Path:
    return d / f".h2x-probe-{os.getpid()}"


def writable_dir(path: Path, what: str) -> Path:
    """Create `path` if needed and prove a file can be created in it."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise H2Error(f"{what} exists and is not a directory", str(path)) from None
    except OSError as e:
        raise H2Error(f"cannot create {what}: {e.strerror}", str(path)) from None
    probe = _probe_name(path)
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise H2Error(f"{what} is not writable: {e.strerror}", str(path)) from None
    return path


def writable_file(path: str | Path, what: str) -> Path:
    """Prove `path` can be written (an existing file is opened for appending, left unchanged; a new
    one is created and removed)."""
    path = Path(path)
    if path.is_dir():
        raise H2Error(f"{what} is a directory; give a file name", str(path))
    existed = path.exists()
    try:
        with open(path, "ab"):
            pass
    except OSError as e:
        raise H2Error(f"cannot write {what}: {e.strerror}", str(path)) from None
    if not existed:
        path.unlink()
    return path


_TEMP_PREFIX = "h2x-run-"


def _sweep_stale_temp_dirs() -> None:
    """Remove scratch directories of earlier runs whose launcher is gone (a SIGKILLed launcher
    cannot clean up after itself). The owner's pid is the first part of the name; only
    directories of dead pids are touched."""
    for d in Path(tempfile.gettempdir()).glob(_TEMP_PREFIX + "*"):
        pid = d.name[len(_TEMP_PREFIX):].split("-")[0]
        if not pid.isdigit() or not d.is_dir():
            continue
        try:
            os.kill(int(pid), 0)
            continue                # still running (or another user's: not ours to remove)
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)
        except PermissionError:
            continue


@contextlib.contextmanager
def run_temp_dir():
    """The run's scratch directory, removed when the run ends however it ends; leftovers of
    killed earlier launchers are removed first."""
    _sweep_stale_temp_dirs()
    d = Path(tempfile.mkdtemp(prefix=f"{_TEMP_PREFIX}{os.getpid()}-"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)
