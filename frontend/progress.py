"""Live progress of h2c's long phases (calibration, layer-time measurement, plan search) on a
terminal: a tqdm line per phase with its elapsed time, ticking while the phase works. Nothing
is drawn when stderr is not a terminal, under `h2c plan --json`, or with H2_PROGRESS=0: logs
and pipes get the phase's own one-line messages only."""
from __future__ import annotations

import contextlib
import os
import sys
import threading

_quiet = False


def set_quiet(quiet: bool) -> None:
    """Machine-readable output (--json): no progress lines."""
    global _quiet
    _quiet = quiet


def enabled(stream=None) -> bool:
    stream = stream or sys.stderr
    if _quiet or os.environ.get("H2_PROGRESS", "").strip() == "0":
        return False
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


@contextlib.contextmanager
def phase(description: str, stream=None, tick_s: float = 0.5):
    """Show `description` with a running clock while the block runs (a terminal only)."""
    stream = stream or sys.stderr
    if not enabled(stream):
        yield
        return
    from tqdm import tqdm
    bar = tqdm(total=None, desc=description, file=stream, leave=False,
               bar_format="{desc}: {elapsed}", mininterval=tick_s)
    stop = threading.Event()

    def tick():
        while not stop.wait(tick_s):
            bar.refresh()

    t = threading.Thread(target=tick, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()
        bar.close()


@contextlib.contextmanager
def counter(description: str, total: int, unit: str = "B", stream=None):
    """A bar counting up to `total` units while the block reports progress through the function
    it is given (bytes scaled to KiB, MiB, ...); on a terminal only, elsewhere that function
    does nothing."""
    stream = stream or sys.stderr
    if not total or not enabled(stream):
        yield lambda n: None
        return
    from tqdm import tqdm
    bar = tqdm(total=total, desc=description, file=stream, leave=False, unit=unit,
               unit_scale=True, unit_divisor=1024)
    try:
        yield bar.update
    finally:
        bar.close()
