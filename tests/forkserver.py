"""A warm parent for the tests' h2c / h2x runs: a process that has imported torch and h2's
command-line modules once, and forks a child per command. Each child is its own process, with
its own exit status, stdout and stderr, cwd and environment (the caller's, sent with the
request), as `subprocess.run([h2c, ...])` gives; it only skips the ~2 s of imports a fresh
interpreter pays, which 100-odd CLI runs of the default suite paid one after another.

    server = ForkServer()                  # starts the warm parent (lazily, once per session)
    cp = server.run(["h2c", "ir", "model.py"], cwd=..., env=..., timeout=60)  # CompletedProcess

Protocol over the parent's stdin / stdout, one JSON object per line:
    request  {"prog": "h2c"|"h2x", "args": [...], "cwd": ..., "env": {...}, "out": path,
              "err": path}
    replies  {"pid": child pid} as soon as it is forked, then {"rc": exit status} when it ends
             (negative: killed by that signal, as subprocess reports it).
A timeout kills the child's process group (it runs in its own session) and raises
subprocess.TimeoutExpired, as subprocess.run does.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAINS = {"h2c": "frontend.cli", "h2x": "executor.cli"}


class ForkServer:
    def __init__(self):
        self.proc: subprocess.Popen | None = None
        self.lock = threading.Lock()

    def _start(self) -> subprocess.Popen:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), "--serve"], cwd=ROOT,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
            ready = self.proc.stdout.readline()
            if json.loads(ready).get("ready") is not True:
                raise RuntimeError(f"fork server did not start: {ready!r}")
        return self.proc

    def run(self, argv: list[str], cwd, env: dict | None = None,
            timeout: float | None = None) -> subprocess.CompletedProcess:
        with self.lock, tempfile.TemporaryDirectory(prefix="h2-fork-") as tmp:
            proc = self._start()
            out, err = Path(tmp) / "out", Path(tmp) / "err"
            proc.stdin.write(json.dumps({
                "prog": argv[0], "args": list(argv[1:]), "cwd": str(cwd),
                "env": dict(os.environ if env is None else env),
                "out": str(out), "err": str(err)}) + "\n")
            proc.stdin.flush()
            pid = json.loads(proc.stdout.readline())["pid"]
            result: dict = {}
            reader = threading.Thread(
                target=lambda: result.update(json.loads(proc.stdout.readline())), daemon=True)
            reader.start()
            reader.join(timeout)
            if reader.is_alive():
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                reader.join(30)
                if reader.is_alive():           # no exit reported: start a new parent next time
                    proc.kill()
                    self.proc = None
                raise subprocess.TimeoutExpired(argv, timeout, output=_read(out),
                                                stderr=_read(err))
            return subprocess.CompletedProcess(argv, result["rc"], _read(out), _read(err))

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


# ---- the warm parent ----------------------------------------------------------------------------

def _child(req: dict) -> None:
    """In the forked child: become the command, then leave with its exit status."""
    code = 1
    try:
        os.setsid()             # its own process group: a timeout kills it and its workers
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        fd = os.open(os.devnull, os.O_RDONLY)
        os.dup2(fd, 0)
        for target, path in ((1, req["out"]), (2, req["err"])):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(fd, target)
            os.close(fd)
        sys.stdin = open(0, closefd=False)
        sys.stdout = open(1, "w", closefd=False)
        sys.stderr = open(2, "w", closefd=False)
        sys.argv = [req["prog"], *req["args"]]
        import importlib
        main = importlib.import_module(MAINS[req["prog"]]).main
        code = main(req["args"])
        code = 0 if code is None else code
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:                       # noqa: BLE001 - what an interpreter prints
        import traceback
        traceback.print_exc()
        code = 1
    finally:
        for f in (sys.stdout, sys.stderr):
            try:
                f.flush()
            except Exception:                   # noqa: BLE001
                pass
        os._exit(code & 0xFF if code >= 0 else 1)


def serve() -> None:
    sys.path.insert(0, str(ROOT))
    import importlib
    for mod in ("torch", *MAINS.values()):     # the point: imported once, before any fork
        importlib.import_module(mod)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(req)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        rc = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        print(json.dumps({"rc": rc}), flush=True)


if __name__ == "__main__" and sys.argv[1:] == ["--serve"]:
    serve()
