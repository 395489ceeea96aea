"""`schedule.csv`: a simulated timeline as a time-aligned grid, the way
torch.distributed.pipelining writes its schedules (`_dump_csv`): one row per worker, one column
per time slot, each cell an action in PiPPy's text form (`1F3` = stage 1's forward of
micro-batch 3, `1B3` its backward), an empty cell a bubble.

Unlike PiPPy's grid, whose columns are logical steps, a column here is a slot of `slot_s`
simulated seconds (default: the shortest forward or backward), so stages of different speeds line
up: an action that lasts three slots fills three cells. A cell holds the compute action running at
the slot's midpoint (`OPT` for the optimizer step). Lines starting with '#' are comments; the first
one records the slot width and the workers, so `parse_grid(format_grid(g)) == g`.
"""
from __future__ import annotations

import csv
import io
import re
from dataclasses import dataclass

from h2ir.errors import H2Error
from h2ir.schedule.trace import TraceEvent

_HEAD = re.compile(r"# schedule\.csv slot_s=(\S+) workers=(\S*)")


@dataclass(frozen=True)
class ScheduleGrid:
    slot_s: float
    workers: tuple[int, ...]
    rows: tuple[tuple[str, ...], ...]         # rows[i] belongs to workers[i]; '' is a bubble

    def row(self, worker: int) -> tuple[str, ...]:
        return self.rows[self.workers.index(worker)]

    def bubble_slots(self, worker: int) -> int:
        """Empty cells of a worker up to its last busy slot."""
        r = self.row(worker)
        last = max((i for i, c in enumerate(r) if c), default=-1)
        return sum(1 for c in r[:last + 1] if not c)


def _cell(name: str, stage: int) -> str:
    if name == "opt_step":
        return "OPT"
    if name[:1] in "FB" and name[1:].isdigit():
        return f"{stage}{name[0]}{name[1:]}"
    return name


MAX_SLOTS = 4096          # columns of a predicted grid at most


def grid_from_events(events: list[TraceEvent], stage_of: dict[int, int],
                     slot_s: float | None = None) -> ScheduleGrid:
    """The compute-lane events of a timeline as a grid over the workers of `stage_of`."""
    compute = [e for e in events if e.lane == "compute" and e.dur_s > 0 and e.worker in stage_of]
    workers = tuple(sorted(stage_of))
    if not compute:
        return ScheduleGrid(slot_s or 0.0, workers, tuple(() for _ in workers))
    if slot_s is None:
        slot_s = min(e.dur_s for e in compute if e.name != "opt_step") if any(
            e.name != "opt_step" for e in compute) else min(e.dur_s for e in compute)
        # a timeline whose shortest action is tiny against the step (an embedding-only stage of
        # a 100 B model: microseconds in a 20 s step) would need millions of columns per worker
        # (24 GB for 232 workers: h2c compile was killed); past MAX_SLOTS a cell holds more time
        # and short actions may share one
        span = max(e.start_s + e.dur_s for e in compute)
        slot_s = max(slot_s, span / MAX_SLOTS)
    spans = []
    for e in compute:         # every action gets at least one cell, even a very short one
        first = int(round(e.start_s / slot_s))
        spans.append((e, first, max(first + 1, int(round((e.start_s + e.dur_s) / slot_s)))))
    n = max(last for _, _, last in spans)
    cells = {w: [""] * n for w in workers}
    for e, first, last in spans:
        for j in range(first, last):
            cells[e.worker][j] = _cell(e.name, stage_of[e.worker])
    return ScheduleGrid(slot_s, workers, tuple(tuple(cells[w]) for w in workers))


def format_grid(g: ScheduleGrid) -> str:
    buf = io.StringIO()
    buf.write(f"# schedule.csv slot_s={g.slot_s!r} workers={','.join(f'w{w}' for w in g.workers)}\n")
    buf.write("# one row per worker, one column per time slot; <stage>F<mb> forward, <stage>B<mb> "
              "backward, OPT optimizer step, empty cell = bubble\n")
    writer = csv.writer(buf, lineterminator="\n")
    for r in g.rows:
        writer.writerow(r)
    return buf.getvalue()


def parse_grid(text: str, file: str | None = None) -> ScheduleGrid:
    lines = text.splitlines()
    m = _HEAD.fullmatch(lines[0].strip()) if lines else None
    if not m:
        raise H2Error("expected a first line '# schedule.csv slot_s=<seconds> workers=w0,w1,...'",
                      file=file, line=1)
    try:
        slot = float(m[1])
        workers = tuple(int(w[1:]) for w in m[2].split(",") if w)
    except ValueError:
        raise H2Error("bad slot width or worker list in the header line", file=file, line=1) from None
    body = [l for l in lines[1:] if not l.startswith("#")]
    rows = tuple(tuple(r) for r in csv.reader(body))
    if len(rows) != len(workers):
        raise H2Error(f"{len(rows)} rows for {len(workers)} workers", file=file)
    return ScheduleGrid(slot, workers, rows)
