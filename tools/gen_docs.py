"""Regenerate the measured and counted tables of docs/ from the commands they cite.

    .venv/bin/python tools/gen_docs.py [--only NAME ...] [--list] [--timeout S]

A generated region of a markdown file sits between two markers:

    <!-- gen:NAME -->
    ...  rewritten by this script; edit REGIONS below, not the text ...
    <!-- /gen:NAME -->

Each region runs its command(s) from the repository root with the venv's python and writes a
header (this script's invocation, the date, the machine), the exact command(s), and the result:
a markdown table built from the command's `--json` output where it has one, else its stdout
verbatim in a fenced block. Text outside the markers is never touched. A region whose command
fails or runs past the timeout is replaced by a "not regenerated yet: <reason>" line rather than
keeping figures nobody can reproduce; the script then exits 1.

Each region is written back as soon as it is done (the file is re-read first), so an interrupted
run keeps what it finished and edits made to the rest of the file meanwhile survive.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
SHOWN_PYTHON = ".venv/bin/python"          # how commands are written in the docs
DEFAULT_TIMEOUT_S = 900

MARKER = re.compile(r"<!--\s*(/?)gen:([A-Za-z0-9_.-]+)\s*-->")


class GenDocsError(Exception):
    """Bad markers in a document, or an unknown region name: `path:line: message`."""


class RegionFailed(Exception):
    """A region's command failed; the message is the reason written into the document."""


# ---- markers -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Span:
    name: str
    body_start: int       # offset just after the opening marker
    body_end: int         # offset of the closing marker
    line: int             # line of the opening marker


def find_regions(text: str, path: str = "<text>") -> list[Span]:
    """The regions of a document, in order. Regions do not nest, each closes by name, and a
    name appears once per document."""
    spans, open_ = [], None
    for m in MARKER.finditer(text):
        closing, name = m.group(1) == "/", m.group(2)
        line = text.count("\n", 0, m.start()) + 1
        if not closing:
            if open_ is not None:
                raise GenDocsError(f"{path}:{line}: gen:{name} opens inside gen:{open_[0]} "
                                   f"(opened on line {open_[2]}); regions do not nest")
            open_ = (name, m.end(), line)
            continue
        if open_ is None or open_[0] != name:
            expected = f"<!-- /gen:{open_[0]} -->" if open_ else "no closing marker"
            raise GenDocsError(f"{path}:{line}: <!-- /gen:{name} --> closes nothing (expected "
                               f"{expected})")
        if any(s.name == name for s in spans):
            raise GenDocsError(f"{path}:{open_[2]}: region gen:{name} appears twice")
        spans.append(Span(name, open_[1], m.start(), open_[2]))
        open_ = None
    if open_ is not None:
        raise GenDocsError(f"{path}:{open_[2]}: gen:{open_[0]} is never closed "
                           f"(expected <!-- /gen:{open_[0]} -->)")
    return spans


def rewrite(text: str, bodies: dict[str, str], known, path: str = "<text>") -> str:
    """`text` with the body of every region named in `bodies` replaced; other regions and all
    text outside markers kept byte for byte. A marker naming a region not in `known` is an error,
    and so is a name in `bodies` that the document lacks."""
    spans = find_regions(text, path)
    for s in spans:
        if s.name not in known:
            raise GenDocsError(f"{path}:{s.line}: unknown region gen:{s.name} (known: "
                               f"{', '.join(sorted(known))})")
    missing = set(bodies) - {s.name for s in spans}
    if missing:
        raise GenDocsError(f"{path}: no <!-- gen:{sorted(missing)[0]} --> marker in this file")
    out, pos = [], 0
    for s in spans:
        if s.name not in bodies:
            continue
        body = bodies[s.name].strip("\n")
        if MARKER.search(body):
            raise GenDocsError(f"{path}:{s.line}: generated text for gen:{s.name} contains a marker")
        out += [text[pos:s.body_start], "\n", body, "\n"]
        pos = s.body_end
    out.append(text[pos:])
    return "".join(out)


# ---- running commands ----------------------------------------------------------------------------

@dataclass
class Run:
    args: tuple            # arguments after the python executable
    rc: int | None = None  # None: timed out
    stdout: str = ""
    stderr: str = ""
    seconds: float = 0.0

    @property
    def shown(self) -> str:
        return " ".join([SHOWN_PYTHON, *self.args])

    def why_failed(self) -> str:
        if self.rc is None:
            return f"`{self.shown}` ran past the timeout ({self.seconds:.0f} s)"
        tail = [ln for ln in (self.stderr or self.stdout).strip().splitlines() if ln.strip()]
        return f"`{self.shown}` exited with code {self.rc}" + (f": {tail[-1].strip()}" if tail else "")


def python_executable() -> str:
    venv = ROOT / SHOWN_PYTHON
    return str(venv) if venv.exists() else sys.executable


def run_command(args: tuple, timeout_s: float) -> Run:
    t0 = time.perf_counter()
    try:
        p = subprocess.run([python_executable(), *args], cwd=ROOT, capture_output=True, text=True,
                           timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return Run(args, None, out, "", time.perf_counter() - t0)
    return Run(args, p.returncode, p.stdout, p.stderr, time.perf_counter() - t0)


def machine() -> str:
    """CPU model, cores this process may use, RAM; and the versions that the figures depend on."""
    model = platform.processor() or "unknown CPU"
    ram = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                ram = f", {int(line.split()[1]) / 2 ** 20:.1f} GiB RAM"
                break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    versions = [f"Python {platform.python_version()}"]
    for dist, label in (("torch", "torch"), ("numpy", "NumPy")):
        try:
            versions.append(f"{label} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            pass
    return f"{model} ({cores} cores{ram}; {', '.join(versions)})"


def header(name: str) -> str:
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    load = f", load average {os.getloadavg()[0]:.1f} at start" if hasattr(os, "getloadavg") else ""
    return f"Generated by `tools/gen_docs.py --only {name}` on {date} on {machine()}{load}."


# ---- rendering -----------------------------------------------------------------------------------

def fenced(text: str, info: str = "text") -> str:
    longest = max((len(m) for m in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}{info}\n{text.rstrip()}\n{fence}"


def table(head: list[str], rows: list[list]) -> str:
    cell = lambda x: str(x).replace("|", "\\|")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(cell(x) for x in r) + " |" for r in rows]
    return "\n".join(lines)


def parse_json(run: Run):
    out = run.stdout
    start = min((i for i in (out.find("{"), out.find("[")) if i >= 0), default=-1)
    if start < 0:
        raise RegionFailed(f"`{run.shown}` printed no JSON")
    try:
        return json.loads(out[start:])
    except json.JSONDecodeError as e:
        raise RegionFailed(f"`{run.shown}` printed malformed JSON ({e})") from None


def render_verbatim(runs: list[Run]) -> str:
    """Each command, then its stdout exactly as printed."""
    parts = []
    for r in runs:
        if r.rc != 0:
            raise RegionFailed(r.why_failed())
        parts.append(f"`{r.shown}` ({r.seconds:.0f} s):\n\n" + fenced(r.stdout))
    return "\n\n".join(parts)


def render_opset(runs: list[Run]) -> str:
    (r,) = runs
    if r.rc != 0:
        raise RegionFailed(r.why_failed())
    d = parse_json(r)
    backends = list(d["backends"])
    rows = []
    for g in d["groups"]:
        where = "kernels" if g["kernels"] else "runtime / DiComm"
        rows.append([g["group"], g["ops"], where] + [g["implemented"][b] for b in backends])
    rows.append(["**all**", d["total"], ""] + [f"**{d['implemented'][b]}**" for b in backends])
    rows.append(["kernel ops", d["kernel_total"], "kernels"]
                + [f"{d['kernel_implemented'][b]} of {d['kernel_total']}" for b in backends])
    return (f"`{r.shown}`:\n\n"
            + table(["group", "ops", "executed by", *(f"{b} implements" for b in backends)], rows))


def render_ops(runs: list[Run]) -> str:
    """`h2c ops --check --json`: one row per op (signature, per backend: implemented, aligned,
    max rel error), then the counts."""
    (r,) = runs
    if r.rc not in (0, 1):          # 1: an op failed check-ops; the table is still complete
        raise RegionFailed(r.why_failed())
    d = parse_json(r)
    backends = list(d["backends"])
    status = {"pass": "pass", "fail": "**FAIL**", "not run": "not run", "not implemented": "—",
              "runtime": "runtime"}

    def cell(b: dict) -> str:
        text = status.get(b["aligned"], b["aligned"])
        return f"{text} ({_e(b['max_rel'])})" if "max_rel" in b else text

    def signature(o: dict) -> str:
        attrs = [a["name"] if a["required"] else f"{a['name']}={json.dumps(a['default'])}"
                 for a in o["attrs"]]
        return (", ".join(o["inputs"]) or "—") + ("; " + ", ".join(attrs) if attrs else "")

    rows = [[f"`{o['op']}`", o["group"], signature(o)] + [cell(o["backends"][b]) for b in backends]
            for o in d["ops"]]
    c = d["counts"]
    aligned = c["aligned_on_all"] if c["aligned_on_all"] is not None else "not run"
    per = "; ".join(f"{b}: {v['implemented']} implemented, {v['aligned']} aligned"
                    for b, v in c["per_backend"].items())
    return (f"`{r.shown}` (check-ops at {d['check']['dtype']}; a cell is the result and the op's "
            "max rel error, `runtime` an op the runtime and DiComm execute):\n\n"
            + table(["op", "group", "inputs; attributes", *backends], rows)
            + f"\n\n**{c['ops']} ops** ({c['kernel_ops']} kernel ops); implemented by all of "
              f"{', '.join(backends)}: **{c['implemented_by_all']}**; aligned on all: "
              f"**{aligned}** ({per}).")


def _e(x: float) -> str:
    return f"{x:.1e}"


def _references(ops: list[dict]) -> dict:
    refs: dict = {}
    for o in ops:
        if o.get("reference"):
            refs[o["reference"]] = refs.get(o["reference"], 0) + 1
    return refs


def render_check_ops(runs: list[Run], per_op: int = 3) -> str:
    """One summary row per command; then max abs / max rel error per op for the first `per_op`
    commands. A per-op "reference" field (check_ops may name a reference per backend) is shown
    when present; commands whose JSON has none show "not reported"."""
    reports = _check_ops_reports(runs)
    cmds = "\n".join(r.shown for r in runs)
    summary, notes = [], []
    for r, rep in reports:
        if rep is None:
            summary.append(_not_run_row(r))
            continue
        summary.append(_summary_row(rep))
        notes += _report_notes(rep)
    out = [fenced(cmds), "",
           table(["backend", "dtype", "reference", "ops checked", "passed", "failed",
                  "worst max abs err (op)", "worst max rel err (op)"], summary)]
    if notes:
        out += ["", "Notes from the reports:", "", "\n".join(notes)]

    shown = [(r, rep) for r, rep in reports[:per_op] if rep is not None]
    if shown:
        head, rows = _per_op_table([rep for _, rep in shown])
        out += ["", f"Per op, the first {len(shown)} commands above:", "", table(head, rows)]
    return "\n".join(out)


def _check_ops_reports(runs: list[Run]) -> list[tuple]:
    """(run, its JSON report, or None when it did not finish); fails when none finished."""
    reports = []
    for r in runs:
        if r.rc in (0, 1):          # 1: some op failed; the JSON report is still complete
            reports.append((r, parse_json(r)))
        else:
            reports.append((r, None))
    if all(rep is None for _, rep in reports):
        raise RegionFailed(runs[0].why_failed())
    return reports


def _not_run_row(r: Run) -> list:
    opt = lambda flag, default: r.args[r.args.index(flag) + 1] if flag in r.args else default
    return [opt("--backend", "?"), opt("--dtype", "f32"), "—", "—", "—", "—",
            f"not run: {r.why_failed()}", ""]


def _summary_row(rep: dict) -> list:
    """backend, dtype, reference(s), ops checked, passed, failed, worst abs and rel error."""
    ops = rep.get("ops", [])
    failed = [o for o in ops if not o.get("pass")]
    refs = _references(ops)
    ref = rep.get("reference") or (", ".join(f"{k} ({n})" if len(refs) > 1 else k
                                             for k, n in refs.items()) if refs else "not reported")
    wa = max(ops, key=lambda o: o.get("max_abs", 0.0), default=None)
    wr = max(ops, key=lambda o: o.get("max_rel", 0.0), default=None)
    cov = rep.get("coverage", {})
    return [rep.get("backend"), rep.get("dtype"), ref,
            f"{len(ops)} ({cov.get('implemented', '?')}/{cov.get('total', '?')} implemented)",
            len(ops) - len(failed),
            ", ".join(o["op"] for o in failed) if failed else "0",
            f"{_e(wa['max_abs'])} ({wa['op']})" if wa else "—",
            f"{_e(wr['max_rel'])} ({wr['op']})" if wr else "—"]


def _report_notes(rep: dict) -> list[str]:
    """Bullets for a report's op errors, reference gaps and non-independent references."""
    ops = rep.get("ops", [])
    notes = [f"- {rep.get('backend')} {rep.get('dtype')}, {o['op']}: {o['error']}"
             for o in ops if o.get("error")]
    if rep.get("reference_gaps"):
        notes.append(f"- {rep.get('backend')} {rep.get('dtype')}: the reference library lacks "
                     f"{', '.join(rep['reference_gaps'])}; checked against another reference")
    dependent = [o["op"] for o in ops if o.get("reference_independent") is False]
    if dependent:
        notes.append(f"- {rep.get('backend')} {rep.get('dtype')}: reference not independent of "
                     f"the tested library for {', '.join(dependent)}")
    return notes


def _per_op_table(reps: list[dict]) -> tuple[list, list]:
    """(head, rows): one row per op of any report, a max abs / max rel column per report, and
    a reference column for each report that used more than one reference."""
    names, by = [], []
    for rep in reps:
        d = {o["op"]: o for o in rep.get("ops", [])}
        by.append(d)
        names += [n for n in d if n not in names]
    ref_cols = [i for i, rep in enumerate(reps) if len(_references(rep.get("ops", []))) > 1]
    head = ["op"]
    for i, rep in enumerate(reps):
        head.append(f"{rep.get('backend')} {rep.get('dtype')}: max abs / max rel")
        if i in ref_cols:
            head.append(f"{rep.get('backend')} {rep.get('dtype')}: reference")
    rows = []
    for n in names:
        row = [n]
        for i, d in enumerate(by):
            o = d.get(n)
            row.append("—" if o is None else f"{_e(o['max_abs'])} / {_e(o['max_rel'])}"
                       + ("" if o.get("pass") else " **FAIL**"))
            if i in ref_cols:
                row.append(o.get("reference", "") if o else "")
        rows.append(row)
    return head, rows


# ---- the op-set counts (run as a command, so the doc cites something runnable) --------------------

def opset_counts() -> dict:
    sys.path.insert(0, str(ROOT))
    from backends.check_ops import EXCLUDED_GROUPS
    from backends.registry import BACKENDS, get_backend
    from h2ir import opset
    tables = {b: set(get_backend(b).ops) for b in BACKENDS}
    groups = []
    for g in opset.Group:
        names = [n for n, d in opset.OPS.items() if d.group is g]
        if names:
            groups.append({"group": g.value, "ops": len(names), "kernels": g not in EXCLUDED_GROUPS,
                           "implemented": {b: len(tables[b] & set(names)) for b in BACKENDS}})
    kernel_ops = {n for n, d in opset.OPS.items() if d.group not in EXCLUDED_GROUPS}
    return {"total": len(opset.OPS), "kernel_total": len(kernel_ops), "groups": groups,
            "backends": list(BACKENDS),
            "implemented": {b: len(tables[b] & set(opset.OPS)) for b in BACKENDS},
            "kernel_implemented": {b: len(tables[b] & kernel_ops) for b in BACKENDS}}


# ---- the regions ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Region:
    name: str
    doc: str                               # markdown file, relative to the repository root
    commands: tuple                        # each: arguments after the python executable
    render: Callable[[list[Run]], str]


def _check_ops(*args) -> tuple:
    return ("-m", "frontend.cli", "check-ops", *args, "--json")


BENCH = "docs/performance.md"
REGIONS = {r.name: r for r in [
    Region("opset", "docs/backends.md", (("tools/gen_docs.py", "--opset-counts"),), render_opset),
    Region("ops", "docs/backends.md", (("-m", "frontend.cli", "ops", "--check", "--json"),),
           render_ops),
    Region("check-ops", "docs/backends.md", (
        _check_ops("--backend", "numpy"), _check_ops("--backend", "torch"),
        _check_ops("--backend", "torch", "--dtype", "bf16"),
        _check_ops("--backend", "numpy", "--dtype", "f64"),
        _check_ops("--backend", "torch", "--dtype", "f64"),
        _check_ops("--backend", "torch", "--dtype", "f16")), render_check_ops),
    Region("bench-search", BENCH, (("bench/bench_search.py",),), render_verbatim),
    Region("bench-backends", BENCH, (("bench/bench_backends.py",),), render_verbatim),
    Region("bench-comm", BENCH, (("bench/bench_comm.py",),), render_verbatim),
    Region("bench-hetero-local", BENCH, (("bench/bench_hetero_local.py", "--rounds", "5"),),
           render_verbatim),
    Region("bench-frontend", BENCH, (("bench/bench_frontend.py",),), render_verbatim),
    Region("bench-pipeline", BENCH, (("bench/bench_pipeline.py", "--steps", "8", "--rounds", "3"),),
           render_verbatim),
    Region("bench-models", BENCH, (("bench/bench_models.py",),), render_verbatim),
    Region("bench-checkpoint", BENCH, (("bench/bench_checkpoint.py", "--rounds", "5"),),
           render_verbatim),
    Region("bench-memory", BENCH, (("bench/bench_memory.py",),), render_verbatim),
    Region("bench-recompute", BENCH, (("bench/bench_recompute.py", "--steps", "10",
                                       "--rounds", "2"),), render_verbatim),
    Region("bench-init-from", BENCH, (("bench/bench_init_from.py",),), render_verbatim),
    Region("bench-multihost", BENCH, (("bench/bench_multihost.py", "--steps", "8", "--rounds", "2"),),
           render_verbatim),
    Region("bench-multihost-plan", BENCH, (("bench/bench_multihost_plan.py", "--rounds", "5"),),
           render_verbatim),
    Region("hf-families", "docs/backends.md", (("tools/family_matrix.py",),), render_verbatim),
    Region("hf-more-families", "docs/backends.md",
           (("tools/family_matrix.py", "--families=", "--more=all"),), render_verbatim),
]}


def produce(region: Region, timeout_s: float, log=print) -> tuple[str, bool]:
    """(the region's new body, whether it was regenerated)."""
    head = header(region.name)
    runs = []
    for args in region.commands:
        log(f"  $ {' '.join([SHOWN_PYTHON, *args])}")
        runs.append(run_command(args, timeout_s))
        log(f"    {'timed out' if runs[-1].rc is None else f'exit {runs[-1].rc}'} "
            f"after {runs[-1].seconds:.1f} s")
    try:
        return head + "\n\n" + region.render(runs), True
    except RegionFailed as e:
        return f"Not regenerated yet: {e} ({head[len('Generated by '):].rstrip('.')}).", False


def write_region(region: Region, body: str, regions: dict):
    path = ROOT / region.doc
    text = path.read_text()
    new = rewrite(text, {region.name: body}, regions, region.doc)
    tmp = path.with_suffix(path.suffix + ".gen-tmp")
    tmp.write_text(new)
    os.replace(tmp, path)


def regenerate(names: list[str], regions: dict = REGIONS, timeout_s: float = DEFAULT_TIMEOUT_S,
               log=print) -> list[str]:
    """Regenerate the named regions one at a time; the names of those that failed."""
    unknown = [n for n in names if n not in regions]
    if unknown:
        raise GenDocsError(f"unknown region {unknown[0]!r} (known: {', '.join(regions)})")
    for doc in sorted({regions[n].doc for n in names}):     # every marker checked before any run
        text = (ROOT / doc).read_text()
        rewrite(text, {}, regions, doc)                         # unknown or unbalanced markers
        present = {s.name for s in find_regions(text, doc)}
        for n in names:
            if regions[n].doc == doc and n not in present:
                raise GenDocsError(f"{doc}: no <!-- gen:{n} --> marker in this file")
    failed = []
    for n in names:
        log(f"gen:{n} ({regions[n].doc})")
        body, ok = produce(regions[n], timeout_s, log)
        write_region(regions[n], body, regions)
        if not ok:
            failed.append(n)
            log(f"  not regenerated: {body}")
    return failed


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+", metavar="NAME", help="regenerate only these regions")
    ap.add_argument("--list", action="store_true", help="list the regions and their commands")
    ap.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                    help=f"seconds per command (default {DEFAULT_TIMEOUT_S})")
    ap.add_argument("--opset-counts", action="store_true",
                    help="print ops per group of the op set and per backend, as JSON")
    a = ap.parse_args(argv)
    if a.opset_counts:
        print(json.dumps(opset_counts(), indent=1))
        return 0
    if a.list:
        for r in REGIONS.values():
            print(f"{r.name:<20} {r.doc}")
            for args in r.commands:
                print(f"{'':<20}   {' '.join([SHOWN_PYTHON, *args])}")
        return 0
    try:
        failed = regenerate(a.only or list(REGIONS), timeout_s=a.timeout)
    except GenDocsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if failed:
        print(f"not regenerated: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
