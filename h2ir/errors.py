"""User-facing errors. Every CLI catches `H2Error`, prints `str(err)` and exits with code 2.

An error names where the bad input is (file, line, column when known) and what was expected;
it is never shown as a traceback. A bad command-line value is argparse's usage error (exit 2)
naming the flag and its range (`int_flag`, `float_flag`). Anything else is a bug of ours: the
CLI says so in one line and writes the traceback to a crash report (`crash_report`), whose
path it prints.
"""
from __future__ import annotations

import argparse
import errno
import math
import os
import sys
import time
import traceback
from importlib import import_module

SEED_MAX = 2 ** 63 - 1           # seeds travel as int64 (numpy's generators, the dropout counter)
# Sizes every command line and artifact reader bounds, so that a typo is an error, not an hour of
# planning or a machine out of memory. Generous: far past any model or cluster h2 plans.
MAX_SEQ_LEN = 1 << 24            # tokens per sequence
MAX_MICRO_BATCH = 1 << 20        # sequences per micro-batch
MAX_GLOBAL_BATCH = 1 << 24       # sequences per step
MAX_MICROBATCHES = 1 << 16       # micro-batches per replica per step (stream length grows with it)
MAX_WORKERS = 1 << 16            # worker processes of one build


MAX_INPUT_BYTES = 16 << 20       # a cluster file, a plan: parser memory stays bounded


def read_user_file(path, what: str, max_bytes: int = MAX_INPUT_BYTES) -> str:
    """Text of a user's input file (a BOM is tolerated); unreadable, larger than `max_bytes`
    (checked while reading, so /dev/zero is refused too) or non-UTF-8 is an H2Error."""
    return decode_user_text(read_user_bytes(path, what, max_bytes), path, what)


def read_user_bytes(path, what: str, max_bytes: int = MAX_INPUT_BYTES) -> bytes:
    """The bytes of a user's input file, as `read_user_file` bounds them (a reader that checks
    a digest hashes exactly the bytes it then parses)."""
    from pathlib import Path
    path = Path(path)
    try:
        if path.is_dir():
            raise H2Error(f"cannot read {what}: it is a directory", file=str(path))
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as e:
        raise H2Error(f"cannot read {what}: {e.strerror or e}", file=str(path)) from None
    if len(data) > max_bytes:
        raise H2Error(f"{what} is larger than {max_bytes >> 20} MiB; refusing to parse it",
                      file=str(path))
    return data


def decode_user_text(data: bytes, path, what: str) -> str:
    """`read_user_bytes`' bytes as text: UTF-8 (a BOM tolerated), universal newlines."""
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise H2Error(f"{what} is not UTF-8 text ({e.reason} at byte {e.start})",
                      file=str(path)) from None
    return text.replace("\r\n", "\n").replace("\r", "\n")     # universal newlines, as read_text


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


def too_deep(text: str, file: str | None, what: str) -> H2Error:
    """The error for input that made a parser recurse too deeply (RecursionError): located at
    the first bracket past MAX_NESTING levels (brackets inside strings are counted too, so the
    spot is a best effort)."""
    depth, line, col = 0, 1, 0
    at = (None, None)
    for ch in text:
        col += 1
        if ch == "\n":
            line, col = line + 1, 0
        elif ch in "[{(":
            depth += 1
            if depth > MAX_NESTING:
                at = (line, col)
                break
        elif ch in "]})":
            depth -= 1
    return H2Error(f"{what} is nested too deeply to read (more than {MAX_NESTING} levels of "
                   "brackets)", file=file, line=at[0], col=at[1])


MAX_NESTING = 100


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


# ---- command-line values -------------------------------------------------------------------

def int_flag(lo: int | None = 1, hi: int | None = None, words: tuple = ()):
    """argparse `type=` for an integer in [lo, hi]; a word of `words` (e.g. "auto") is returned
    as None. A bad value is argparse's usage error: `PROG: error: argument --steps: must be
    ≥ 1, got 0`, exit 2."""
    def parse(text: str):
        if text in words:
            return None
        t = text.strip()
        if len(t) > 100 and t.lstrip("+-").isdigit():   # past int()'s digit limit: out of range
            raise argparse.ArgumentTypeError(f"must be {'≥' if t[0] == '-' else '≤'} "
                                             f"{_num(lo if t[0] == '-' else hi)}, got a "
                                             f"{len(t.lstrip('+-'))}-digit number")
        try:
            v = int(t, 10)
        except ValueError:
            also = "".join(f" or '{w}'" for w in words)
            raise argparse.ArgumentTypeError(f"expected an integer{also}, got {_shown(text)}") \
                from None
        _check_range(v, lo, hi)
        return v
    parse.__name__ = "integer"
    return parse


def float_flag(lo: float | None = None, hi: float | None = None, lo_open: bool = False):
    """argparse `type=` for a finite number in [lo, hi] ((lo, hi] with `lo_open`)."""
    def parse(text: str):
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {_shown(text)}") from None
        if not math.isfinite(v):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {_shown(text)}")
        if lo_open and lo is not None and v <= lo:
            raise argparse.ArgumentTypeError(f"must be > {lo:g}, got {v:g}")
        _check_range(v, None if lo_open else lo, hi)
        return v
    parse.__name__ = "number"
    return parse


def _check_range(v, lo, hi):
    if lo is not None and v < lo:
        raise argparse.ArgumentTypeError(f"must be ≥ {_num(lo)}, got {_num(v)}")
    if hi is not None and v > hi:
        raise argparse.ArgumentTypeError(f"must be ≤ {_num(hi)}, got {_num(v)}")


def _num(v) -> str:
    if isinstance(v, int) and abs(v) >= 10 ** 15:
        return f"{v:.3e}" if abs(v) < 10 ** 300 else f"a {len(str(abs(v)))}-digit number"
    return f"{v:g}" if isinstance(v, float) else str(v)


def _shown(text: str) -> str:
    return repr(text) if len(text) <= 40 else repr(text[:37] + "...")


def check_seed(seed: int, what: str = "--seed", file: str | None = None) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= SEED_MAX:
        raise H2Error(f"{what} must be an integer in 0..2**63-1, got {seed!r}", file=file)
    return seed


# ---- internal errors ---------------------------------------------------------------------------

def crash_dir() -> "os.PathLike":
    """Where crash reports go: $H2_LOG_DIR, else ~/.cache/h2/crash."""
    from pathlib import Path
    env = os.environ.get("H2_LOG_DIR")
    return Path(env) if env else Path.home() / ".cache" / "h2" / "crash"


def crash_report(prog: str, e: BaseException, argv: list[str] | None = None) -> str | None:
    """Write `e`'s traceback (and the command line) to a new file under `crash_dir()` (the
    system temp dir if that is not writable); its path, or None if nothing could be written."""
    import tempfile
    text = (f"{prog}: internal error at {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
            f"argv: {argv if argv is not None else sys.argv}\n"
            f"python: {sys.version.split()[0]}\n\n"
            + "".join(traceback.format_exception(type(e), e, e.__traceback__)))
    name = prog.replace(" ", "-").replace("/", "-")
    for d in (crash_dir(), tempfile.gettempdir()):
        try:
            os.makedirs(d, exist_ok=True)
            fd, path = tempfile.mkstemp(prefix=f"{name}-", suffix=".txt", dir=d)
            with os.fdopen(fd, "w") as f:
                f.write(text)
            return path
        except OSError:
            continue
    return None


class InternalError(Exception):
    """A bug found in another process (an h2x worker) whose crash report is already written:
    the CLI prints `internal_error_text` with that report and exits 1."""

    def __init__(self, prog: str, message: str, report: str | None, context: str = ""):
        super().__init__(message)
        self.prog, self.message, self.report, self.context = prog, message, report, context


def internal_error_text(prog: str, e: BaseException, report: str | None) -> str:
    """The two lines a CLI prints for a bug of ours (never the traceback itself)."""
    msg = " ".join(str(e).split())
    if len(msg) > 300:
        msg = msg[:297] + "..."
    where = f"the traceback is in {report}" if report else "rerun with H2_DEBUG=1 for the traceback"
    return (f"{prog}: internal error: {type(e).__name__}" + (f": {msg}" if msg else "") +
            f"\n  this is a bug in h2, not in your input; {where}; please report it")


# errno values that say a path cannot be used as it is (too long, a file where a directory must
# be, no permission, a full or read-only disk), whatever code opened it: the path or the machine
# is at fault, not h2. (A missing file is left to the code that expects it to say what it is.)
PATH_ERRNOS = frozenset(getattr(errno, n) for n in (
    "ENAMETOOLONG", "ENOTDIR", "EACCES", "EPERM", "EROFS", "ENOSPC", "EDQUOT", "ELOOP")
    if hasattr(errno, n))


def path_error_text(e: BaseException) -> str | None:
    """`PATH: error: STRERROR` for an OSError of PATH_ERRNOS that names its path, else None."""
    if not isinstance(e, OSError) or e.errno not in PATH_ERRNOS or not e.filename:
        return None
    name = str(e.filename)
    if len(name) > 160:
        name = name[:80] + "..." + name[-40:]
    return f"{name}: error: {e.strerror or os.strerror(e.errno)}"


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
    # progress lines reach a pipe (`h2x run ... | tee log`) as they are printed, not at exit
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(line_buffering=True)
        except (AttributeError, ValueError):
            pass
    try:
        return int(getattr(import_module(mod), fn)(argv[1:]) or 0)
    except H2Error as e:
        print(str(e), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except InternalError as e:
        print(f"{e.prog}: internal error: {e.message}\n  this is a bug in h2, not in your input; "
              + (f"the traceback is in {e.report}" if e.report else "its log has the traceback")
              + "; please report it" + (f"\n  {e.context}" if e.context else ""), file=sys.stderr)
        return 1
    except Exception as e:      # a bug of ours, not the user's input: say so, briefly
        if os.environ.get("H2_DEBUG"):
            raise
        told = path_error_text(e)
        if told:                # the file system refused a path: never a bug of ours
            print(told, file=sys.stderr)
            return 2
        print(internal_error_text(f"{prog} {argv[0]}", e, crash_report(f"{prog} {argv[0]}", e,
                                                                        argv)), file=sys.stderr)
        return 1
