"""User-facing errors. Every CLI catches `H2Error`, prints `str(err)` and exits with code 2.

An error names where the bad input is (file, line, column when known) and what was expected;
it is never shown as a traceback.
"""
from __future__ import annotations


def read_user_file(path, what: str) -> str:
    """Text of a user's input file (a BOM is tolerated); unreadable or non-UTF-8 is an H2Error."""
    from pathlib import Path
    path = Path(path)
    try:
        return path.read_text(encoding="utf-8-sig")
    except OSError as e:
        raise H2Error(f"cannot read {what}: {e.strerror}", file=str(path)) from None
    except UnicodeDecodeError as e:
        raise H2Error(f"{what} is not UTF-8 text ({e.reason} at byte {e.start})",
                      file=str(path)) from None


class H2Error(Exception):
    def __init__(self, message: str, file: str | None = None, line: int | None = None,
                 col: int | None = None, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.file = file
        self.line = line
        self.col = col
        self.hint = hint

    def __str__(self) -> str:
        where = ""
        if self.file:
            where = self.file
            if self.line:
                where += f":{self.line}"
                if self.col:
                    where += f":{self.col}"
            where += ": "
        text = f"{where}error: {self.message}"
        if self.hint:
            text += f"\n  {self.hint}"
        return text
