"""User-facing errors. Every CLI catches `H2Error`, prints `str(err)` and exits with code 2.

An error names where the bad input is (file, line, column when known) and what was expected;
it is never shown as a traceback.
"""
from __future__ import annotations


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
