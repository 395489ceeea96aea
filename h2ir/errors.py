"""User-facing errors. Every CLI catches `H2Error`, prints `str(err)` and exits with code 2.

An error names where the bad input is (file, line, column when known) and what was expected;
it is never shown as a traceback.
"""
from __future__ import annotations

import os
import sys
from importlib import import_module


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


def lark_error(e, text: str, file: str | None, terminals, words: dict[str, str]) -> H2Error:
    """A lark syntax error (UnexpectedInput) as an H2Error in plain words: where, what was found,
    what was expected. `terminals` are the parser's (`Lark.terminals`): a literal one is shown as
    its quoted text; `words` names the others ('INT' -> 'a number'; '$END' is 'end of file'),
    else their lower-cased name. A position past the end of `text` (a parser may have been given
    a trailing newline) is put on its last line."""
    from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedToken
    words = {"$END": "end of file", **words}
    last_line = text.count("\n") + 1
    line = getattr(e, "line", None)
    col = getattr(e, "column", None)
    if not isinstance(line, int) or line < 1:
        line, col = last_line, None
    line = min(line, last_line)
    if isinstance(e, UnexpectedCharacters):
        ch = text[e.pos_in_stream] if 0 <= e.pos_in_stream < len(text) else ""
        found, expected = f"character {_show_char(ch)}", e.allowed
    elif isinstance(e, UnexpectedToken):
        found, expected = _show_token(e.token, words), e.expected
    elif isinstance(e, UnexpectedEOF):
        found, expected = "end of file", e.expected
    else:
        found, expected = "input", ()
    message = f"unexpected {found}"
    if expected:
        message += "; expected " + ", ".join(_expected_words(expected, terminals, words))
    return H2Error(message, file=file, line=line, col=col)


def _expected_words(names, terminals, words: dict[str, str]) -> list[str]:
    """Plain words for terminal names: keywords first (quoted, alphabetical), then kinds of value."""
    literal = {t.name: t.pattern.value for t in terminals
               if type(t.pattern).__name__ == "PatternStr"}
    shown = set()
    for name in names:
        if name in words:
            shown.add(words[name])
        elif name in literal:
            shown.add(f"'{literal[name]}'")
        else:
            shown.add(name.lower())
    return sorted(shown, key=lambda w: (not w.startswith("'"), w))


def _show_token(tok, words: dict[str, str]) -> str:
    if not str(tok).strip():             # end of file, a newline token: say which
        return words.get(tok.type, tok.type.lower())
    shown = str(tok) if len(tok) <= 30 else str(tok)[:27] + "..."
    return f"'{shown}'"


def _show_char(ch: str) -> str:
    if not ch:
        return "end of file"
    if ch.isprintable() and ch.isascii():
        return f"'{ch}'"
    if ch.isprintable():
        return f"'{ch}' (U+{ord(ch):04X})"
    return f"U+{ord(ch):04X}"


def run_subcommand(table: dict, prog: str, argv: list[str], doc: str) -> int:
    """Dispatch `prog CMD ...` to table[CMD]; H2Error becomes a clean message and exit code 2."""
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in table:
        print(doc)
        if argv and argv[0] not in ("-h", "--help"):
            print(f"{prog}: error: unknown command {argv[0]!r} (expected one of: "
                  f"{', '.join(table)})", file=sys.stderr)
            return 2
        return 0
    mod, fn = table[argv[0]].split(":")
    try:
        return int(getattr(import_module(mod), fn)(argv[1:]) or 0)
    except H2Error as e:
        print(str(e), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:      # a bug of ours, not the user's input: say so, briefly
        if os.environ.get("H2_DEBUG"):
            raise
        print(f"{prog} {argv[0]}: internal error: {type(e).__name__}: {e}\n"
              f"  this is a bug in h2, not in your input; rerun with H2_DEBUG=1 for the traceback "
              f"and report it", file=sys.stderr)
        return 1
