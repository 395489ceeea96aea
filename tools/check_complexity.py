"""Functions whose cyclomatic complexity is above a threshold (radon's `cc_visit`).

    .venv/bin/python tools/check_complexity.py [--max 20] [PATH ...]

PATHs are files or folders (every .py under them; default: h2ir/planner). Prints one line per
offender, most complex first, and exits 1 when there is any, so `make test` can run it.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from radon.complexity import cc_visit

ROOT = Path(__file__).resolve().parent.parent


def python_files(paths: list[str]) -> list[Path]:
    out = []
    for p in map(Path, paths):
        out += sorted(p.rglob("*.py")) if p.is_dir() else [p]
    return out


def offenders(paths: list[str], limit: int) -> list[tuple[int, str]]:
    """(complexity, 'file:line name') of every function or method above `limit`."""
    out = []
    for f in python_files(paths):
        for b in cc_visit(f.read_text(encoding="utf-8")):
            # functions and methods (a closure counts in its function); a class's own score
            # sums its methods, which are listed on their own
            if hasattr(b, "methods") or b.complexity <= limit:
                continue
            name = f"{b.classname}.{b.name}" if b.classname else b.name
            out.append((b.complexity, f"{f}:{b.lineno} {name}"))
    return sorted(out, key=lambda x: (-x[0], x[1]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="*", default=[str(ROOT / "h2ir" / "planner")])
    ap.add_argument("--max", type=int, default=20, help="highest complexity allowed (default 20)")
    a = ap.parse_args(argv)
    found = offenders(a.paths, a.max)
    for cc, where in found:
        print(f"{cc:4d}  {where}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
