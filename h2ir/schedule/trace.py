"""Timelines of a stream's execution, predicted (simulator) or measured (executor), in one shape:
`TraceEvent`s, written as Chrome/Perfetto trace JSON (one process per worker, a thread per lane)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

LANES = ("compute", "comm")


@dataclass(frozen=True)
class TraceEvent:
    worker: int
    lane: str              # 'compute' | 'comm' | 'counter' (a value track: args are its series)
    name: str              # 'F3', 'B3', 'send_act 3', 'all_reduce grads', 'opt_step'
    start_s: float
    dur_s: float
    args: dict | None = None


def chrome_trace(events: list[TraceEvent], worker_names: dict[int, str] | None = None,
                 metadata: dict | None = None) -> dict:
    """Chrome/Perfetto trace JSON: one process per worker, one thread per lane, 'X' events in µs."""
    out = []
    workers = sorted({e.worker for e in events} | set(worker_names or {}))
    lanes = list(LANES) + sorted({e.lane for e in events} - set(LANES) - {"counter"})
    for w in workers:
        out.append({"ph": "M", "name": "process_name", "pid": w, "tid": 0,
                    "args": {"name": (worker_names or {}).get(w, f"w{w}")}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": w, "tid": 0, "args": {"sort_index": w}})
        for i, lane in enumerate(lanes):
            out.append({"ph": "M", "name": "thread_name", "pid": w, "tid": i, "args": {"name": lane}})
    tid = {lane: i for i, lane in enumerate(lanes)}
    for e in sorted(events, key=lambda e: (e.worker, e.start_s)):
        if e.lane == "counter":          # a counter track (e.g. a MoE layer's tokens per expert)
            out.append({"ph": "C", "name": e.name, "pid": e.worker,
                        "ts": round(e.start_s * 1e6, 3), "args": e.args or {}})
            continue
        ev = {"ph": "X", "name": e.name, "pid": e.worker, "tid": tid[e.lane],
              "ts": round(e.start_s * 1e6, 3), "dur": round(e.dur_s * 1e6, 3),
              "cat": e.lane}
        if e.args:
            ev["args"] = e.args
        out.append(ev)
    d = {"traceEvents": out, "displayTimeUnit": "ms"}
    if metadata:
        d["otherData"] = metadata
    return d


def write_chrome_trace(path: str | Path, events: list[TraceEvent],
                       worker_names: dict[int, str] | None = None, metadata: dict | None = None) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(chrome_trace(events, worker_names, metadata)))
    return p
