"""What one `h2x run` leaves on disk, and what it checks there before step 1.

- `RunLock`: one run per build directory. An exclusive flock on `BUILD/.h2x-run.lock`, which
  holds the owner's pid, host and start time for the refusal message. The kernel drops the lock
  when its process dies, so a killed run leaves no stale lock (the file itself stays, harmless).
- `writable_dir` / `writable_file`: every output path is probed for real (a file created and
  removed, or the file opened for writing) before any worker starts: permission bits say nothing
  for root, and a read-only mount or a path under a regular file shows only when written.
- `run_temp_dir`: the per-run scratch directory (status slots, per-worker traces), removed on
  every exit path by its context manager.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

from h2ir.errors import H2Error

LOCK_FILE = ".h2x-run.lock"      # frontend/compiler.py refuses to recompile a build that holds it


class RunLock:
    """`with RunLock(build_dir):` — refuse (H2Error) if another h2x run holds the build."""

    def __init__(self, build_path: Path):
        self.build_path = Path(build_path)
        self.path = self.build_path / LOCK_FILE
        self.fd = None

    def __enter__(self):
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise H2Error(f"cannot create the run lock: {e.strerror} (h2x run writes its lock, "
                          "worker logs and checkpoints into the build directory)",
                          str(self.path)) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe_holder(os.pread(fd, 4096, 0))
            os.close(fd)
            raise H2Error(f"another h2x run is using this build directory ({holder}); two runs "
                          "would overwrite each other's checkpoints", str(self.build_path),
                          hint="wait for it to finish, or copy the build and run the copy") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                  "started": time.time()}).encode(), 0)
        self.fd = fd
        return self

    def __exit__(self, *exc):
        if self.fd is not None:
            os.ftruncate(self.fd, 0)
            os.close(self.fd)            # releases the flock
            self.fd = None
        return False


def _describe_holder(raw: bytes) -> str:
    try:
        h = json.loads(raw.decode())
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(h["started"]))
        return f"pid {h['pid']} on {h['host']}, started {started}"
    except (ValueError, KeyError, TypeError):
        return "its owner is starting up"


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
