"""Training data: token ids from text or from a pre-tokenized file, drawn as micro-batches.

`h2x run BUILD --data PATH --data-format F [--tokenizer tokenizer.json]`:

| format       | PATH                                              | tokens                              |
|--------------|---------------------------------------------------|-------------------------------------|
| `bytes`      | a text file or a directory of .py/.txt/.md/.rst   | byte values 0..255                  |
| `text`       | the same, tokenized with `--tokenizer`            | the tokenizer's ids                 |
| `tokens-u16` | a flat little-endian uint16 array (nanoGPT's `train.bin`, Megatron's `.bin` for vocabularies < 65 536) | memory-mapped |
| `tokens-u32` | the same, uint32 (also Megatron's int32 files: same bytes for ids < 2**31) | memory-mapped |

`auto` (the default) picks by suffix: `.bin` and `.u16` are uint16, `.u32` uint32; anything else
is `text` when a tokenizer is given and `bytes` otherwise. Without `--data` the corpus is the
Python standard library's own source files (real text, nothing to download).

Memory is bounded whatever the file size. Token files are memory-mapped, never read whole; their
vocabulary check reads them in SCAN_ELEMS-sized pieces. Text is read only up to
`--data-max-bytes` (default MAX_BYTES) from the start, never read whole to be cut: `bytes`
memory-maps that prefix of a single file and reads a directory's files up to the limit;
`text` streams them through the tokenizer in TEXT_CHUNK pieces (each cut where the tokenizer's
own pre-tokenizer would split, see `_cut`; each file on its own) into a token cache file
in the build directory, `BUILD/data/<name>-<key>.u16|.u32`, which the workers then memory-map like
any token file. The key hashes the tokenizer file, the text files' paths, sizes and mtimes, the
byte limit and the model's vocabulary: a resumed run finds the same cache, and a rebuilt one has
the same bytes. Tokenizing once in the launcher also means the first and last stages, which both
need the batch, never tokenize twice or disagree.

Batches are a pure function of (seed, step, replica, micro-batch), over every format: every worker
that needs data (the first stage for tokens, the last for targets) draws the same batch without
talking to the others, and a resumed run draws exactly the samples the uninterrupted run drew (the
data position in a checkpoint is the step). Replica r of dp draws its windows from the r-th of dp
contiguous, equal shares of the tokens: replicas never see the same token.
"""
from __future__ import annotations

import hashlib
import os
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from h2ir.errors import H2Error

MAX_BYTES = 4 << 20       # of text, by default: 4 MiB is plenty for the tiny models
TEXT_CHUNK = 1 << 20      # bytes of text tokenized at a time
SCAN_ELEMS = 1 << 20      # token ids read at a time by the vocabulary check
CACHE_VERSION = b"h2-token-cache/1"

FORMATS = ("auto", "text", "bytes", "tokens-u16", "tokens-u32")
TOKEN_DTYPES = {"tokens-u16": np.dtype("<u2"), "tokens-u32": np.dtype("<u4")}
SUFFIX_FORMATS = {".bin": "tokens-u16", ".u16": "tokens-u16", ".u32": "tokens-u32"}
TEXT_SUFFIXES = {".py", ".txt", ".md", ".rst"}


@dataclass(frozen=True)
class DataSpec:
    """What every worker opens: the launcher has picked the format and tokenized text already,
    so `format` is `bytes` or a token format, and `path` None means the default corpus."""
    path: str | None
    format: str
    max_bytes: int = MAX_BYTES

    def worker_args(self) -> list[str]:
        args = ["--data-format", self.format, "--data-max-bytes", str(self.max_bytes)]
        return (["--data", self.path] if self.path else []) + args


# ---- text files ------------------------------------------------------------------------------
def default_corpus_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _files(root: Path) -> list[Path]:
    if root.is_file():
        return [root]
    top = sorted(p for p in root.glob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
    if sum(p.stat().st_size for p in top) >= MAX_BYTES:
        return top                        # the stdlib's top level alone is > 8 MB of Python
    return top + sorted(p for p in root.rglob("*/**/*") if p.is_file() and p.suffix in TEXT_SUFFIXES)


def text_files(path: str | None, max_bytes: int = MAX_BYTES) -> list[Path]:
    """The text files read, in order, for their first `max_bytes` bytes in all."""
    root = Path(path) if path else default_corpus_dir()
    if not root.exists():
        raise H2Error("data path not found", str(root))
    out, total = [], 0
    for f in _files(root):
        if "test" in f.parts and path is None:
            continue                      # stdlib tests hold odd encodings; skip them by default
        try:
            size = f.stat().st_size
        except OSError:
            continue
        out.append(f)
        total += size
        if total >= max_bytes:
            break
    return out


def load_corpus(path: str | None = None, max_bytes: int = MAX_BYTES,
                vocab: int | None = None) -> np.ndarray:
    """Byte tokens: the first `max_bytes` bytes of the text files (only those are read). One
    file is memory-mapped (its first `max_bytes` bytes), so a worker's memory does not grow
    with --data-max-bytes; the files of a directory are read and joined."""
    files = text_files(path, max_bytes)
    if len(files) == 1:
        arr = _map_prefix(files[0], max_bytes)
        if arr is not None:
            if vocab:
                check_ids_in_pieces(arr, vocab, str(files[0]), unit=1)
            return arr
    chunks, total = [], 0
    for f in files:
        try:
            with open(f, "rb") as fh:
                b = fh.read(max_bytes - total)
        except OSError:
            continue
        arr = np.frombuffer(b, dtype=np.uint8)
        if vocab:
            _check_ids(arr, vocab, str(f), unit=1)
        chunks.append(arr)
        total += len(b)
        if total >= max_bytes:
            break
    if not chunks or total < 2:
        raise H2Error("no text found to train on (expected a text file or a directory of "
                      ".py/.txt/.md/.rst files)", str(path or default_corpus_dir()))
    return np.concatenate(chunks)


def _map_prefix(f: Path, max_bytes: int) -> np.ndarray | None:
    """The first `max_bytes` bytes of `f` as a read-only uint8 memory map; None when the file
    cannot be mapped (too short, a pipe, unreadable: the caller reads it instead)."""
    try:
        size = f.stat().st_size
        if not f.is_file() or size < 2:
            return None
        return np.memmap(f, dtype=np.uint8, mode="r", shape=(min(size, max_bytes),))
    except (OSError, ValueError):
        return None


def check_ids_in_pieces(ids: np.ndarray, vocab: int, file: str, unit: int) -> None:
    """`_check_ids` over a memory map, SCAN_ELEMS ids at a time."""
    if vocab >= 1 << (8 * ids.dtype.itemsize):
        return
    for base in range(0, len(ids), SCAN_ELEMS):
        _check_ids(np.asarray(ids[base:base + SCAN_ELEMS]), vocab, file, unit, base)


# ---- token files -----------------------------------------------------------------------------
def open_token_file(path: str, fmt: str) -> np.memmap:
    """A flat little-endian token array, memory-mapped read-only (nothing is read yet)."""
    dtype = TOKEN_DTYPES[fmt]
    try:
        size = os.path.getsize(path)
    except OSError as e:
        raise H2Error(f"cannot read token file: {e.strerror}", str(path)) from None
    if size == 0:
        raise H2Error("token file is empty", str(path))
    if size % dtype.itemsize:
        other = "tokens-u16" if fmt == "tokens-u32" else "tokens-u32"
        raise H2Error(f"token file has {size} bytes, not a whole number of {dtype.itemsize}-byte "
                      f"ids ({fmt})", str(path), hint=f"is it {other}? say so with --data-format")
    return np.memmap(path, dtype=dtype, mode="r")


def check_token_file(path: str, fmt: str, vocab: int) -> None:
    """The first id >= vocab is an error naming its element index and byte offset. The file is
    read SCAN_ELEMS ids at a time into one buffer (plain reads, not the memory map: nothing of
    the file stays resident, and no fresh pages are faulted in per piece)."""
    dtype = TOKEN_DTYPES[fmt]
    if vocab >= 1 << (8 * dtype.itemsize):
        return                            # every id the file can hold is in the vocabulary
    buf = np.empty(SCAN_ELEMS, dtype=dtype)
    raw = memoryview(buf).cast("B")
    with open(path, "rb") as fh:          # buffered: readinto fills the buffer up to EOF
        base = 0
        while n := fh.readinto(raw) // dtype.itemsize:
            _check_ids(buf[:n], vocab, path, unit=dtype.itemsize, base=base)
            base += n


def _check_ids(ids: np.ndarray, vocab: int, file: str, unit: int, base: int = 0):
    if ids.size == 0 or int(ids.max()) < vocab:
        return
    i = int(np.argmax(ids >= vocab))
    where = f"byte offset {base + i}" if unit == 1 else \
        f"element {base + i} (byte offset {(base + i) * unit})"
    raise H2Error(f"token id {int(ids[i])} at {where} is outside the model's vocabulary "
                  f"(vocab {vocab}: ids 0..{vocab - 1})", file)


# ---- text through a tokenizer, streamed into a token cache ------------------------------------
def load_tokenizer(path: str):
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise H2Error("--tokenizer needs the `tokenizers` package (pip install tokenizers)",
                      str(path)) from None
    if not Path(path).is_file():
        raise H2Error("tokenizer file not found", str(path))
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:               # the library raises a bare Exception on a bad file
        raise H2Error(f"not a tokenizer.json the `tokenizers` library can read: {e}",
                      str(path)) from None


def _cut(buf: bytes) -> int:
    """Where to end a piece of text so that tokenizing the pieces one by one gives the ids of the
    whole text: after a newline between two non-space bytes, else before a space between two
    ("x| y"), both boundaries that byte-level BPE (GPT-2, LLaMA 3), WordPiece and whitespace
    pre-tokenizers make themselves; else at the last whole UTF-8 character."""
    for sep, after in ((b"\n", 1), (b" ", 0)):
        end = len(buf) - 1
        while (i := buf.rfind(sep, 1, end)) > 0:
            if not buf[i - 1:i].isspace() and not buf[i + 1:i + 2].isspace():
                return i + after
            end = i
    return _char_boundary(buf)


def _char_boundary(buf: bytes) -> int:
    """len(buf) less an incomplete UTF-8 character at its end."""
    for back in range(1, min(4, len(buf)) + 1):
        b = buf[-back]
        if b & 0xC0 != 0x80:              # a lead byte (or ASCII): is its character whole?
            need = 1 if b < 0x80 else 2 if b >> 5 == 0b110 else 3 if b >> 4 == 0b1110 else 4
            return len(buf) if back >= need else len(buf) - back
    return len(buf)


def text_pieces(files: list[Path], max_bytes: int, chunk: int = TEXT_CHUNK):
    """(file, byte offset in it, text) pieces of the files' first `max_bytes` bytes in all,
    in order. At most `chunk` bytes are read at a time and a piece is at most ~2 chunks."""
    budget = max_bytes
    for f in files:
        if budget <= 0:
            return
        try:
            fh = open(f, "rb")
        except OSError as e:
            raise H2Error(f"cannot read text file: {e.strerror}", str(f)) from None
        with fh:
            carry, pos = b"", 0           # pos: offset in the file of carry's first byte
            while True:
                raw = fh.read(min(chunk, budget)) if budget > 0 else b""
                budget -= len(raw)
                buf = carry + raw
                if raw:
                    cut = _cut(buf)
                elif budget <= 0:         # the byte limit ends this file: drop a half character
                    cut = _char_boundary(buf)
                else:
                    cut = len(buf)
                piece, carry = buf[:cut], buf[cut:]
                if piece:
                    try:
                        text = piece.decode("utf-8")
                    except UnicodeDecodeError as e:
                        raise H2Error(f"not UTF-8 text ({e.reason} at byte offset {pos + e.start})",
                                      str(f)) from None
                    yield f, pos, text
                pos += cut
                if not raw:
                    break


def tokenize_text(tokenizer, files: list[Path], max_bytes: int, vocab: int | None,
                  write, chunk: int = TEXT_CHUNK) -> int:
    """Stream the files' text through the tokenizer; write(ids) each piece's ids (uint32).
    Returns the number of tokens. Special tokens (BOS/EOS) are not added."""
    n = 0
    for f, pos, text in text_pieces(files, max_bytes, chunk):
        enc = tokenizer.encode(text, add_special_tokens=False)
        ids = np.asarray(enc.ids, dtype=np.uint32)
        if vocab and ids.size and int(ids.max()) >= vocab:
            i = int(np.argmax(ids >= vocab))
            at = pos + len(text[:enc.offsets[i][0]].encode("utf-8"))
            raise H2Error(f"token id {int(ids[i])} ({enc.tokens[i]!r}) at byte offset {at} is "
                          f"outside the model's vocabulary (vocab {vocab}: ids 0..{vocab - 1})",
                          str(f), hint=f"the tokenizer has {tokenizer.get_vocab_size()} ids; "
                          "is it the model's own tokenizer?")
        write(ids)
        n += ids.size
    return n


def _cache_key(tokenizer_path: str, files: list[Path], max_bytes: int, vocab: int | None,
               chunk: int) -> str:
    h = hashlib.sha256(CACHE_VERSION)
    h.update(hashlib.sha256(Path(tokenizer_path).read_bytes()).digest())
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    h.update(f"{max_bytes}\0{vocab}\0{chunk}".encode())
    return h.hexdigest()[:16]


def token_cache(cache_dir: Path, text_path: str | None, tokenizer_path: str, max_bytes: int,
                vocab: int | None, out=print, chunk: int = TEXT_CHUNK) -> tuple[Path, str]:
    """The token cache file of this text and tokenizer (written if missing) and its format."""
    tok = load_tokenizer(tokenizer_path)
    fmt = "tokens-u16" if tok.get_vocab_size() <= 1 << 16 else "tokens-u32"
    files = text_files(text_path, max_bytes)
    if not files:
        raise H2Error("no text found to train on (expected a text file or a directory of "
                      ".py/.txt/.md/.rst files)", str(text_path or default_corpus_dir()))
    key = _cache_key(tokenizer_path, files, max_bytes, vocab, chunk)
    suffix = ".u16" if fmt == "tokens-u16" else ".u32"
    cache = Path(cache_dir) / f"{files[0].stem}-{key}{suffix}"
    if cache.is_file():
        out(f"data: tokens of {text_path or 'the stdlib sources'} cached in {cache}")
        return cache, fmt
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_name(f"{cache.name}.tmp{os.getpid()}")
    dtype = TOKEN_DTYPES[fmt]
    t0 = time.perf_counter()
    try:
        with open(tmp, "wb") as fh:
            n = tokenize_text(tok, files, max_bytes, vocab, lambda ids: ids.astype(dtype).tofile(fh),
                              chunk)
        os.replace(tmp, cache)
    finally:
        tmp.unlink(missing_ok=True)
    out(f"data: tokenized {text_path or 'the stdlib sources'} with {tokenizer_path}: {n} tokens "
        f"in {time.perf_counter() - t0:.1f} s, cached in {cache}")
    return cache, fmt


# ---- choosing and opening a source -----------------------------------------------------------
def resolve_format(path: str | None, fmt: str, tokenizer: str | None) -> tuple[str, str]:
    """(format, why) for --data-format `fmt`; `auto` picks by the path's suffix."""
    if fmt not in FORMATS:
        raise H2Error(f"unknown data format {fmt!r} (expected one of: {', '.join(FORMATS)})")
    if fmt != "auto":
        return fmt, "--data-format"
    suffix = Path(path).suffix.lower() if path else ""
    if suffix in SUFFIX_FORMATS:
        return SUFFIX_FORMATS[suffix], f"from the {suffix} suffix"
    if tokenizer:
        return "text", "--tokenizer given"
    return "bytes", "no --tokenizer"


def prepare_data(manifest: dict, cache_dir: Path, path: str | None = None, fmt: str = "auto",
                 tokenizer: str | None = None, max_bytes: int | None = None,
                 out=print) -> DataSpec:
    """Check the data against the build (vocabulary, enough tokens per replica), tokenize text
    into its cache, and say what was chosen; the DataSpec is what the workers open."""
    max_bytes = MAX_BYTES if max_bytes is None else max_bytes
    if max_bytes < 2:
        raise H2Error(f"--data-max-bytes must be at least 2 (got {max_bytes})")
    fmt, why = resolve_format(path, fmt, tokenizer)
    vocab = int((manifest.get("model") or {}).get("vocab") or 0) or None
    if tokenizer and fmt != "text":
        raise H2Error(f"--tokenizer is only used with text data, but the data is read as {fmt} "
                      f"({why})", str(path), hint="say --data-format text to tokenize it")
    if fmt == "text" and not tokenizer:
        raise H2Error("--data-format text needs --tokenizer tokenizer.json (the model's own); "
                      "--data-format bytes trains on byte values instead", path)
    if fmt in TOKEN_DTYPES:
        if not path:
            raise H2Error(f"--data-format {fmt} needs --data PATH (a token file)")
        spec = DataSpec(path, fmt, max_bytes)
        tokens = open_token_file(path, fmt)
        if vocab:
            check_token_file(path, fmt, vocab)
        what = f"{path}: {len(tokens)} {TOKEN_DTYPES[fmt].name} token ids, memory-mapped ({why})"
    elif fmt == "text":
        cache, cfmt = token_cache(Path(cache_dir), path, tokenizer, max_bytes, vocab, out)
        spec = DataSpec(str(cache), cfmt, max_bytes)
        tokens = open_token_file(spec.path, cfmt)
        what = f"{path or 'the stdlib sources'}: {len(tokens)} tokens from {tokenizer}"
    else:
        spec = DataSpec(path, "bytes", max_bytes)
        tokens = load_corpus(path, max_bytes, vocab)
        what = f"{path or 'the stdlib sources'}: {len(tokens)} byte tokens ({why})"
    TokenBatches(tokens, manifest["micro_batch"], manifest["seq_len"],
                 manifest["num_microbatches"], manifest["dp"], manifest["seed"],
                 name=spec.path or str(default_corpus_dir()))
    out(f"data: {what}; {manifest['dp']} replica share(s)")
    return spec


def open_tokens(spec: DataSpec) -> np.ndarray:
    """The token array a worker draws from (a memory map for token formats)."""
    if spec.format in TOKEN_DTYPES:
        return open_token_file(spec.path, spec.format)
    return load_corpus(spec.path, spec.max_bytes)


class TokenBatches:
    """Deterministic (tokens, targets) micro-batches drawn from a token array (an ndarray or a
    memory map: only the drawn windows are read)."""

    def __init__(self, corpus: np.ndarray, micro_batch: int, seq_len: int, num_microbatches: int,
                 dp: int, seed: int = 0, name: str | None = None):
        self.corpus = corpus
        self.mb, self.seq, self.m, self.dp, self.seed = micro_batch, seq_len, num_microbatches, dp, seed
        n = len(corpus)
        bounds = [r * n // dp for r in range(dp + 1)]
        self.shards = list(zip(bounds[:-1], bounds[1:]))   # replica r: tokens [lo, hi)
        share = min(hi - lo for lo, hi in self.shards)
        if share <= seq_len + 1:
            per = f" ({share} per replica of {dp})" if dp > 1 else ""
            raise H2Error(f"data has {n} tokens{per}; need more than seq_len+1 = {seq_len + 1} "
                          "per replica", name)

    def micro_batch(self, step: int, replica: int, mb: int) -> tuple[np.ndarray, np.ndarray]:
        lo, hi = self.shards[replica]
        rng = np.random.default_rng([self.seed, step, replica, mb])
        starts = lo + rng.integers(0, hi - lo - self.seq - 1, size=self.mb)
        idx = starts[:, None] + np.arange(self.seq + 1)[None, :]
        window = np.asarray(self.corpus[idx]).astype(np.int64)
        return window[:, :-1], window[:, 1:]

    def global_batch(self, step: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """All micro-batches of a step in the order the pipeline consumes them."""
        return [self.micro_batch(step, r, i) for r in range(self.dp) for i in range(self.m)]
