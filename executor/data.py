"""Training data: token ids from text or from pre-tokenized files, read in epochs, blended by
weight, and drawn as micro-batches.

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
byte limit, the end-of-document id and the model's vocabulary: a resumed run finds the same cache,
and a rebuilt one has the same bytes. Beside it, `<cache>.json` records its sha256, size and
largest id as written; a run that reuses the cache checks all three in one pass (a truncated or
changed cache, or one with ids outside the vocabulary, is refused; a cache without its record is
tokenized again). Tokenizing once in the launcher also means the first and
last stages, which both need the batch, never tokenize twice or disagree.

Documents: each text file is a document, and tokenized text gets an end-of-document (eod) id after
each one (the tokenizer's own `<|endoftext|>`, `</s>`, ... or an explicit id); token files carry
theirs already, bytes have none. Packing, per mix:
- `concat` (the default): windows are packed across documents, as nanoGPT's and Megatron's default
  packing: attention is causal over the whole window, not masked at document boundaries.
- `document`: every window lies inside one document, so causal attention never crosses a document
  boundary (no per-document masks needed in the stage programs). A document is a maximal run of
  tokens ending with (and including) an eod id; the last one may lack it. A document of L tokens
  holds (L-1) // seq_len windows at stride seq_len from its start; a tail shorter than seq_len+1
  is dropped, and so is a document shorter than seq_len+1. It needs the source's eod id (the
  explicit one, `data.eod_token`, else the tokenizer's own for text, else an error).

Sampling, as a trainer reads data (Megatron's global sample index): a source of n tokens holds
N = (n-1) // seq_len windows of seq_len+1 tokens at stride seq_len over all of its tokens
(packing `concat`), or the windows inside its documents, as above (packing `document`). The
samples are numbered globally: with B = dp * num_microbatches * micro_batch, row j of micro-batch
mb of replica r at a step is sample g = step * B + (r * num_microbatches + mb) * micro_batch + j.
Several sources blend by weight: each sample g goes to one source by a closed-form count
(`_Blend`), and each source runs through its own epochs: its a-th sample is window a % N of
epoch a // N, an epoch reading every window once, in an order reshuffled every epoch (or in
order, for evaluation data). So replicas never draw the same window within an epoch, and the
samples of a step (in `global_batch` order) depend only on the seed, the step and B, not on how
B is split into replicas and micro-batches: a checkpoint resumes under another plan with the same
global batch on exactly the samples the old run would have drawn. Batches are a pure function of
(seed, step, replica, micro-batch): every worker that needs data (the first stage for tokens, the
last for targets) draws the same batch without talking to the others, and a resumed run draws
exactly the samples the uninterrupted run drew (the data position in a checkpoint is the step;
`TokenBatches.position` spells it out).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from frontend import progress
from h2ir.errors import H2Error

MAX_BYTES = 4 << 20       # of text, by default: 4 MiB is plenty for the tiny models
TEXT_CHUNK = 1 << 20      # bytes of text tokenized at a time
SCAN_ELEMS = 1 << 20      # token ids read at a time by the vocabulary check and the eod scan
PROGRESS_BYTES = 256 << 20    # a scan of a smaller file takes well under a second: no bar
CACHE_VERSION = b"h2-token-cache/2"      # 2: an end-of-document id after each file
CACHE_RECORD = "h2-token-cache-record/1"

FORMATS = ("auto", "text", "bytes", "tokens-u16", "tokens-u32")
TOKEN_DTYPES = {"tokens-u16": np.dtype("<u2"), "tokens-u32": np.dtype("<u4")}
SUFFIX_FORMATS = {".bin": "tokens-u16", ".u16": "tokens-u16", ".u32": "tokens-u32"}
TEXT_SUFFIXES = {".py", ".txt", ".md", ".rst"}
# a tokenizer's end-of-document token: the first of these its vocabulary holds (GPT-2/Qwen,
# LLaMA 1-2/Mistral, Gemma-style, LLaMA 3, BERT)
EOD_TOKENS = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]")
PACKINGS = ("concat", "document")


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


def _is_weight(w) -> bool:
    """A blend weight: a positive finite number (not a bool)."""
    return isinstance(w, (int, float, np.integer, np.floating)) and not isinstance(w, bool) \
        and math.isfinite(w) and w > 0


@dataclass(frozen=True)
class MixSource:
    """One source of a DataMix: a DataSpec, its weight in the blend, and its end-of-document id
    (None: none known; packing `document` needs one)."""
    path: str | None
    format: str
    max_bytes: int = MAX_BYTES
    weight: float = 1.0
    eod: int | None = None

    @property
    def spec(self) -> DataSpec:
        return DataSpec(self.path, self.format, self.max_bytes)

    @property
    def name(self) -> str:
        return self.path or str(default_corpus_dir())


@dataclass(frozen=True)
class DataMix:
    """What every worker opens when data blends several sources (or reads one in order, for
    evaluation): the launcher's choices, serialisable so that workers rebuild exactly them."""
    sources: tuple[MixSource, ...]
    shuffle: bool = True
    packing: str = "concat"               # one of PACKINGS

    @classmethod
    def single(cls, spec: DataSpec, shuffle: bool = True, packing: str = "concat",
               eod: int | None = None) -> "DataMix":
        return cls((MixSource(spec.path, spec.format, spec.max_bytes, 1.0, eod),), shuffle,
                   packing)

    def to_json(self) -> dict:
        return {"sources": [{"path": s.path, "format": s.format, "max_bytes": s.max_bytes,
                             "weight": s.weight, "eod": s.eod} for s in self.sources],
                "shuffle": self.shuffle, "packing": self.packing}

    @classmethod
    def from_json(cls, d, where: str | None = None) -> "DataMix":
        """The DataMix of `to_json`; anything else is an H2Error located at `where`."""
        def bad(what):
            return H2Error(f"malformed data mix: {what}", where,
                           hint='expected {"sources": [{"path", "format", "max_bytes", '
                                '"weight", "eod"}, ...], "shuffle": bool, '
                                '"packing": "concat" | "document"}')
        if not isinstance(d, dict) or set(d) != {"sources", "shuffle", "packing"}:
            raise bad("not an object with keys sources, shuffle and packing")
        if not isinstance(d["shuffle"], bool):
            raise bad(f"shuffle is {d['shuffle']!r}, not true or false")
        if d["packing"] not in PACKINGS:
            raise bad(f"packing is {d['packing']!r}, not one of {', '.join(PACKINGS)}")
        if not isinstance(d["sources"], list) or not d["sources"]:
            raise bad("sources is not a non-empty list")
        out = []
        for i, s in enumerate(d["sources"]):
            if not isinstance(s, dict) or \
                    set(s) != {"path", "format", "max_bytes", "weight", "eod"}:
                raise bad(f"source {i} is not an object with keys path, format, max_bytes, "
                          "weight, eod")
            if s["path"] is not None and not isinstance(s["path"], str):
                raise bad(f"source {i}: path {s['path']!r} is not a string or null")
            if s["format"] not in ("bytes", *TOKEN_DTYPES):
                raise bad(f"source {i}: format {s['format']!r} is not bytes or a token format")
            if type(s["max_bytes"]) is not int or s["max_bytes"] < 2:
                raise bad(f"source {i}: max_bytes {s['max_bytes']!r} is not an integer >= 2")
            w = s["weight"]
            if not _is_weight(w):
                raise bad(f"source {i}: weight {w!r} is not a positive finite number")
            eod = s["eod"]
            if eod is not None and (type(eod) is not int or eod < 0):
                raise bad(f"source {i}: eod {eod!r} is not a non-negative integer or null")
            out.append(MixSource(s["path"], s["format"], s["max_bytes"], float(w), eod))
        return cls(tuple(out), d["shuffle"], d["packing"])


# ---- text files ------------------------------------------------------------------------------
def default_corpus_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


DEFAULT_CORPUS = ("the default corpus (no data path given: this Python's standard library "
                  f"sources in {default_corpus_dir()})")


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
    for ids, base in _pieces(path, dtype, "checking token ids against the vocabulary"):
        _check_ids(ids, vocab, path, unit=dtype.itemsize, base=base)


def _pieces(path, dtype: np.dtype, what: str):
    """(ids, index of the first) of a token file, SCAN_ELEMS ids at a time read into one buffer
    (plain reads, not a memory map: nothing of the file stays resident); a big file shows a
    progress bar on a terminal."""
    buf = np.empty(SCAN_ELEMS, dtype=dtype)
    raw = memoryview(buf).cast("B")
    size = os.path.getsize(path)
    with open(path, "rb") as fh, \
            progress.counter(f"{Path(path).name}: {what}",
                             size if size >= PROGRESS_BYTES else 0) as advance:
        base = 0                          # buffered: readinto fills the buffer up to EOF
        while n := fh.readinto(raw) // dtype.itemsize:
            yield buf[:n], base
            base += n
            advance(n * dtype.itemsize)


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


def end_of_document(tok, eod: int | None, vocab: int | None, where: str) -> tuple[int | None, str]:
    """(id, what the data line says) of the end-of-document token: `eod` when given (a negative
    one: none), else the first of EOD_TOKENS the tokenizer holds, else none."""
    if eod is not None and eod < 0:
        return None, "no end-of-document token (none asked for)"
    if eod is not None:
        how = f"end-of-document id {eod} (given) after each file"
    else:
        found = next(((t, i) for t in EOD_TOKENS if (i := tok.token_to_id(t)) is not None), None)
        if found is None:
            return None, ("no end-of-document token (the tokenizer has none of "
                          f"{', '.join(EOD_TOKENS)})")
        eod = found[1]
        how = f"end-of-document id {eod} ({found[0]}, the tokenizer's own) after each file"
    if vocab and eod >= vocab:
        raise H2Error(f"end-of-document id {eod} is outside the model's vocabulary (vocab {vocab}: "
                      f"ids 0..{vocab - 1})", where)
    return eod, how


def tokenize_text(tokenizer, files: list[Path], max_bytes: int, vocab: int | None,
                  write, chunk: int = TEXT_CHUNK, eod: int | None = None) -> int:
    """Stream the files' text through the tokenizer; write(ids) each piece's ids (uint32), and
    [eod] after each file's last piece when `eod` is an id (each file is a document). Returns the
    number of tokens. The tokenizer's own special tokens (BOS/EOS) are not added."""
    n, doc = 0, None
    end = np.array([] if eod is None else [eod], dtype=np.uint32)
    for f, pos, text in text_pieces(files, max_bytes, chunk):
        if doc is not None and f != doc:
            write(end)
            n += end.size
        doc = f
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
    if doc is not None:
        write(end)
        n += end.size
    return n


def _cache_key(tokenizer_path: str, files: list[Path], max_bytes: int, vocab: int | None,
               chunk: int, eod: int | None = None) -> str:
    h = hashlib.sha256(CACHE_VERSION)
    h.update(hashlib.sha256(Path(tokenizer_path).read_bytes()).digest())
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    h.update(f"{max_bytes}\0{vocab}\0{chunk}\0{eod}".encode())
    return h.hexdigest()[:16]


def token_cache(cache_dir: Path, text_path: str | None, tokenizer_path: str, max_bytes: int,
                vocab: int | None, out=print, chunk: int = TEXT_CHUNK, eod: int | None = None,
                what: str = "data") -> tuple[Path, str, str]:
    """The token cache file of this text and tokenizer (written if missing), its format, and
    what the data line says of its end-of-document id (`eod`: as `end_of_document` takes it)."""
    return _token_cache(cache_dir, text_path, tokenizer_path, max_bytes, vocab, out, chunk, eod,
                        what)[:3]


def _token_cache(cache_dir: Path, text_path: str | None, tokenizer_path: str, max_bytes: int,
                 vocab: int | None, out=print, chunk: int = TEXT_CHUNK, eod: int | None = None,
                 what: str = "data") -> tuple[Path, str, str, int | None]:
    """`token_cache`, and the end-of-document id after each file (None: none)."""
    tok = load_tokenizer(tokenizer_path)
    eod, eod_note = end_of_document(tok, eod, vocab, str(tokenizer_path))
    ids = max(tok.get_vocab_size(), 0 if eod is None else eod + 1)
    fmt = "tokens-u16" if ids <= 1 << 16 else "tokens-u32"
    files = text_files(text_path, max_bytes)
    label = text_path or DEFAULT_CORPUS
    if not files:
        raise H2Error("no text found to train on (expected a text file or a directory of "
                      ".py/.txt/.md/.rst files)", str(text_path or default_corpus_dir()))
    key = _cache_key(tokenizer_path, files, max_bytes, vocab, chunk, eod)
    suffix = ".u16" if fmt == "tokens-u16" else ".u32"
    cache = Path(cache_dir) / f"{files[0].stem}-{key}{suffix}"
    record = _cache_record(cache)
    if cache.is_file() and record.is_file():
        check_token_cache(cache, fmt, vocab)
        out(f"{what}: tokens of {label} cached in {cache}")
        return cache, fmt, eod_note, eod
    if cache.is_file():
        out(f"note: {cache} has no record of its digest ({record.name}: an older h2x wrote it, "
            "or its writer was stopped); tokenizing again")
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_name(f"{cache.name}.tmp{os.getpid()}")
    tmp_record = record.with_name(f"{record.name}.tmp{os.getpid()}")
    dtype = TOKEN_DTYPES[fmt]
    t0 = time.perf_counter()
    h, top = hashlib.sha256(), [-1]

    def write(ids, fh):
        data = ids.astype(dtype).tobytes()
        h.update(data)
        fh.write(data)
        if ids.size:
            top[0] = max(top[0], int(ids.max()))
    try:
        with open(tmp, "wb") as fh:
            n = tokenize_text(tok, files, max_bytes, vocab, lambda ids: write(ids, fh), chunk,
                              eod)
        tmp_record.write_text(json.dumps({"format": CACHE_RECORD, "sha256": h.hexdigest(),
                                          "size": n * dtype.itemsize, "max_id": top[0]}))
        os.replace(tmp, cache)            # a cache without its record is tokenized again
        os.replace(tmp_record, record)
    finally:
        tmp.unlink(missing_ok=True)
        tmp_record.unlink(missing_ok=True)
    out(f"{what}: tokenized {label} with {tokenizer_path}: {n} tokens "
        f"in {time.perf_counter() - t0:.1f} s, cached in {cache}")
    return cache, fmt, eod_note, eod


def _cache_record(cache: Path) -> Path:
    return cache.with_name(cache.name + ".json")


def check_token_cache(cache: Path, fmt: str, vocab: int | None) -> None:
    """The token cache is what was written (size and sha256 of its record) and holds only ids of
    the vocabulary, checked in one pass over it; anything else is an H2Error naming it."""
    record = _cache_record(cache)
    hint = f"delete {cache} and {record.name} to tokenize the text again"
    try:
        rec = json.loads(record.read_bytes()[:1 << 16])
    except (OSError, ValueError, RecursionError) as e:
        raise H2Error(f"cannot read the token cache's record: {e}", str(record),
                      hint=hint) from None
    if not (isinstance(rec, dict) and rec.get("format") == CACHE_RECORD
            and isinstance(rec.get("sha256"), str) and type(rec.get("size")) is int
            and type(rec.get("max_id")) is int):
        raise H2Error("not a token cache record of this h2 (expected format, sha256, size, "
                      "max_id)", str(record), hint=hint)
    dtype = TOKEN_DTYPES[fmt]
    size = os.path.getsize(cache)
    if size != rec["size"]:
        raise H2Error(f"token cache is {size} bytes, {rec['size']} were written when the text "
                      f"was tokenized: it was {'truncated' if size < rec['size'] else 'extended'}"
                      " or replaced since", str(cache), hint=hint)
    h = hashlib.sha256()
    for ids, base in _pieces(cache, dtype, "checking the token cache"):
        h.update(memoryview(ids).cast("B"))
        if vocab:
            _check_ids(ids, vocab, str(cache), unit=dtype.itemsize, base=base)
    if h.hexdigest() != rec["sha256"]:
        raise H2Error("token cache changed since the text was tokenized (its sha256 differs "
                      f"from the one in {record.name})", str(cache), hint=hint)


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


def _prepare_source(manifest: dict, cache_dir: Path, path: str | None, fmt: str,
                    tokenizer: str | None, max_bytes: int, eod: int | None, out, what: str,
                    alone: bool) -> tuple[DataSpec, np.ndarray, str, int | None]:
    """One source checked against the build (vocabulary) and tokenized into its cache: its
    DataSpec, its tokens, what its data line says of it, and its end-of-document id (`eod` when
    given, >= 0; else the tokenizer's own for text; else None). `alone`: the only source, so a
    tokenizer it does not use is an error here (in a blend, a token file beside text is fine)."""
    if type(max_bytes) is not int or max_bytes < 2:
        raise H2Error(f"--data-max-bytes must be at least 2 (got {max_bytes})", path)
    fmt, why = resolve_format(path, fmt, tokenizer)
    vocab = int((manifest.get("model") or {}).get("vocab") or 0) or None
    if tokenizer and (fmt == "bytes" or alone and fmt != "text"):
        raise H2Error(f"--tokenizer is only used with text data, but the data is read as {fmt} "
                      f"({why})", str(path), hint="say --data-format text to tokenize it")
    if fmt == "text" and not tokenizer:
        raise H2Error("--data-format text needs --tokenizer tokenizer.json (the model's own); "
                      "--data-format bytes trains on byte values instead", path)
    label = path or DEFAULT_CORPUS
    doc_id = eod if eod is not None and eod >= 0 else None
    if fmt in TOKEN_DTYPES:
        if not path:
            raise H2Error(f"--data-format {fmt} needs --data PATH (a token file)")
        spec = DataSpec(path, fmt, max_bytes)
        tokens = open_token_file(path, fmt)
        if vocab:
            check_token_file(path, fmt, vocab)
        desc = f"{path}: {len(tokens)} {TOKEN_DTYPES[fmt].name} token ids, memory-mapped ({why})"
    elif fmt == "text":
        cache, cfmt, eod_note, doc_id = _token_cache(Path(cache_dir), path, tokenizer, max_bytes,
                                                     vocab, out, eod=eod, what=what)
        spec = DataSpec(str(cache), cfmt, max_bytes)
        tokens = open_token_file(spec.path, cfmt)
        desc = f"{label}: {len(tokens)} tokens from {tokenizer}, {eod_note}"
    else:
        spec = DataSpec(path, "bytes", max_bytes)
        tokens = load_corpus(path, max_bytes, vocab)
        desc = f"{label}: {len(tokens)} byte tokens ({why})"
    return spec, tokens, desc, doc_id


def prepare_data(manifest: dict, cache_dir: Path, path: str | None = None, fmt: str = "auto",
                 tokenizer: str | None = None, max_bytes: int | None = None,
                 out=print, eod: int | None = None, what: str = "data") -> DataSpec:
    """Check one source against the build (vocabulary, at least one window), tokenize text
    into its cache, and say what was chosen; the DataSpec is what the workers open."""
    source = {"path": path, "format": fmt}
    if max_bytes is not None:
        source["max_bytes"] = max_bytes
    return prepare_mix(manifest, cache_dir, [source], tokenizer, eod, True, out, what) \
        .sources[0].spec


SOURCE_KEYS = ("path", "format", "weight", "max_bytes")


def prepare_mix(manifest: dict, cache_dir: Path, sources: list[dict], tokenizer: str | None = None,
                eod: int | None = None, shuffle: bool = True, out=print,
                what: str = "data", packing: str = "concat") -> DataMix:
    """`prepare_data` for a blend: each source ({"path": str | None (the default corpus),
    "format": "auto", "weight": 1.0, "max_bytes": MAX_BYTES}) is checked and tokenized on its own,
    and each gets one `what:` line (plus one line naming the weights of a blend). `eod`: the
    end-of-document id after each tokenized file (None: the tokenizer's own, if any; -1: none),
    and the id that ends each document of every source (packing `document`: see the module
    docstring; a source with no eod id known is then an error)."""
    if packing not in PACKINGS:
        raise H2Error(f"{what}: unknown packing {packing!r} (expected one of: "
                      f"{', '.join(PACKINGS)})")
    if not isinstance(sources, list) or not sources:
        raise H2Error(f"{what}: expected a non-empty list of data sources")
    checked = []
    for i, src in enumerate(sources):
        where = src.get("path") if isinstance(src, dict) else None
        if not isinstance(src, dict) or set(src) - set(SOURCE_KEYS):
            extra = sorted(set(src) - set(SOURCE_KEYS)) if isinstance(src, dict) else src
            raise H2Error(f"{what} source {i}: unknown key(s) {extra} (expected a dict of "
                          f"{', '.join(SOURCE_KEYS)})", where)
        w = src.get("weight", 1.0)
        if not _is_weight(w):
            raise H2Error(f"{what} source {i} has weight {w!r}; a weight is a positive finite "
                          "number", where or DEFAULT_CORPUS)
        max_bytes = src.get("max_bytes")
        checked.append((src.get("path"), src.get("format", "auto"), float(w),
                        MAX_BYTES if max_bytes is None else max_bytes))
    if tokenizer and len(checked) > 1 and \
            all(resolve_format(p, f, tokenizer)[0] != "text" for p, f, _, _ in checked):
        raise H2Error("--tokenizer is only used with text data, but no data source is read as "
                      "text", str(tokenizer), hint="say format text for a source to tokenize it")
    mix, tokens, lines = [], [], []
    for path, fmt, w, max_bytes in checked:
        spec, toks, desc, doc_id = _prepare_source(manifest, cache_dir, path, fmt, tokenizer,
                                                   max_bytes, eod, out, what,
                                                   alone=len(checked) == 1)
        if packing == "document":
            _check_eod(doc_id, path or DEFAULT_CORPUS, manifest)
        mix.append(MixSource(spec.path, spec.format, spec.max_bytes, w, doc_id))
        tokens.append((toks, w, spec.path or str(default_corpus_dir()), doc_id))
        lines.append(desc)
    data = DataMix(tuple(mix), shuffle, packing)
    batches = TokenBatches(tokens, manifest["micro_batch"], manifest["seq_len"],
                           manifest["num_microbatches"], manifest["dp"], manifest["seed"],
                           shuffle=shuffle, packing=packing)
    for desc, src in zip(lines, batches.sources):
        out(f"{what}: {desc}; {batches.describe(src)}")
    if len(mix) > 1:
        out(f"{what}: a blend of {len(mix)} sources by weight: " +
            ", ".join(f"{s.name} {100 * s.weight:.1f}%" for s in batches.sources))
    return data


def _check_eod(eod: int | None, name: str, manifest: dict | None = None) -> None:
    """Packing `document` needs the source's end-of-document id, inside the vocabulary."""
    if eod is None or eod < 0:
        raise H2Error('packing "document" needs an end-of-document id to find the documents '
                      "of this source, and none is known (no data.eod_token given, and no "
                      "tokenizer end-of-document token for it)", name,
                      hint="set data.eod_token to the id that ends each document (for token "
                           'files: the id written after each document), or use packing "concat"')
    vocab = int(((manifest or {}).get("model") or {}).get("vocab") or 0) or None
    if vocab and eod >= vocab:
        raise H2Error(f"end-of-document id {eod} is outside the model's vocabulary (vocab "
                      f"{vocab}: ids 0..{vocab - 1}), so no document would ever end", name)


def open_tokens(spec: DataSpec) -> np.ndarray:
    """The token array a worker draws from (a memory map for token formats)."""
    if spec.format in TOKEN_DTYPES:
        return open_token_file(spec.path, spec.format)
    return load_corpus(spec.path, spec.max_bytes)


def open_batches(mix: DataMix, micro_batch: int, seq_len: int, num_microbatches: int, dp: int,
                 seed: int) -> "TokenBatches":
    """The micro-batches a worker draws from a DataMix (every source opened as `open_tokens`)."""
    return TokenBatches([(open_tokens(s.spec), s.weight, s.name, s.eod) for s in mix.sources],
                        micro_batch, seq_len, num_microbatches, dp, seed, shuffle=mix.shuffle,
                        packing=mix.packing)


# ---- sampling: epochs over windows, blends by weight ----------------------------------------
@dataclass
class Source:
    """One source's tokens, its weight (normalised) and the number of windows over all of its
    tokens. Packing `document` adds the window-start table (`starts`: window k begins at token
    starts[k], instead of k * seq_len) and the documents' counts (`documents`, see
    `_document_windows`)."""
    tokens: np.ndarray
    weight: float
    name: str
    windows: int
    eod: int | None = None
    starts: np.ndarray | None = None
    documents: dict | None = None


def _document_windows(tokens, eod: int, seq: int) -> tuple[np.ndarray, dict]:
    """Packing `document`: the start offsets of the windows inside the documents of `tokens`, in
    order, and the counts of documents, of those dropped as shorter than seq+1 tokens and of
    their tokens ({"documents", "short", "short_tokens"}).

    A document is a maximal run of tokens ending with (and including) an `eod` id; the last may
    lack it. A document [start, end) of L tokens holds windows [start + k*seq, start + k*seq +
    seq + 1) for k < (L-1) // seq (its tail of fewer than seq+1 tokens is dropped).

    The tokens (a memory map, usually) are scanned SCAN_ELEMS ids at a time, never held whole;
    what stays is the window-start table, int64: 8 bytes per window (8 / seq bytes per token).
    While it is built, a piece's windows (those of the documents ending in it) and the final
    concatenation hold a few times that at most."""
    n = len(tokens)
    parts: list[np.ndarray] = []
    counted = {"documents": 0, "short": 0, "short_tokens": 0}

    def add(starts: np.ndarray, ends: np.ndarray) -> None:
        lengths = ends - starts                        # >= 1: a document holds its eod
        counts = (lengths - 1) // seq
        total = int(counts.sum())
        before = np.concatenate(([0], np.cumsum(counts)))      # windows of the earlier documents
        doc = np.repeat(np.arange(len(starts)), counts)
        if total:
            parts.append(starts[doc] + (np.arange(total, dtype=np.int64) - before[doc]) * seq)
        dropped = counts == 0
        counted["documents"] += len(starts)
        counted["short"] += int(dropped.sum())
        counted["short_tokens"] += int(lengths[dropped].sum())

    start = 0                                          # where the current document began
    dtype = getattr(tokens, "dtype", None)
    findable = not (dtype is not None and dtype.kind in "ui" and
                    not np.iinfo(dtype).min <= eod <= np.iinfo(dtype).max)
    if findable:
        for base in range(0, n, SCAN_ELEMS):
            piece = np.asarray(tokens[base:base + SCAN_ELEMS])
            ends = np.flatnonzero(piece == eod).astype(np.int64) + (base + 1)
            if ends.size:
                add(np.concatenate(([start], ends[:-1])).astype(np.int64), ends)
                start = int(ends[-1])
    if start < n:                                      # the last document, without its eod
        add(np.array([start], dtype=np.int64), np.array([n], dtype=np.int64))
    table = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)
    return table, counted


FEISTEL_ROUNDS = 6
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)   # splitmix64's


def _mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser (Steele et al. 2014): every input bit flips about half the output
    bits, the round function of `permute`."""
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def permute(index: np.ndarray, n: int, keys: np.ndarray) -> np.ndarray:
    """π(index) for a permutation π of [0, n) keyed by `keys`, one index at a time: a balanced
    Feistel network over the fewest even bits that hold n-1, cycle-walked back into [0, n) (Black &
    Rogaway, "Ciphers with arbitrary finite domains", 2002). NOTE: not a materialised
    rng.permutation(n): an epoch of a large file has hundreds of millions of windows, and this
    keeps a worker's memory bounded and every batch O(micro_batch) to draw."""
    x = np.asarray(index, dtype=np.uint64).copy()
    if n <= 1:
        return np.zeros(x.shape, dtype=np.int64)
    half = ((n - 1).bit_length() + 1) // 2
    shift, mask = np.uint64(half), np.uint64((1 << half) - 1)
    todo = np.ones(x.shape, dtype=bool)
    with np.errstate(over="ignore"):
        while todo.any():                # expected < 4 rounds: the domain is < 4n
            y = x[todo]
            left, right = y >> shift, y & mask
            for k in keys:
                left, right = right, left ^ (_mix64(right ^ k) & mask)
            y = (left << shift) | right
            x[todo] = y
            todo[todo] = y >= np.uint64(n)
    return x.astype(np.int64)


class _Blend:
    """Which source each global sample goes to, in closed form. Level l splits the samples left
    after levels 0..l-1 between source l and the rest: of the first n of them, source l gets
    A_l(n) = (p_l * n + c_l) // Q, with p_l / Q its share of what is left (quantised, exact
    integer arithmetic) and c_l < Q a seeded offset (so a blend does not always start with source
    0). A_l never falls and grows by 0 or 1 per sample, so sample g goes to the first level whose
    count grows between g and g+1, and its index within that source is the count before it. Over
    the first n samples, source l's count is within l+1 samples of weight * n (plus n / 2**33 for
    the quantised weights)."""
    Q = 1 << 32
    SALT = 0x626C656E64                   # b"blend": offsets apart from the epochs' keys

    def __init__(self, weights: list[float], seed: int):
        self.levels = []
        left = sum(weights)
        for l, w in enumerate(weights[:-1]):
            p = min(max(round(w / left * self.Q), 1), self.Q - 1)
            c = int(np.random.SeedSequence([seed, self.SALT, l]).generate_state(1, np.uint64)[0])
            self.levels.append((p, c % self.Q))
            left -= w

    def source_of(self, g: int) -> tuple[int, int]:
        """(source, index within that source) of sample g."""
        for l, (p, c) in enumerate(self.levels):
            before = (p * g + c) // self.Q
            if (p * (g + 1) + c) // self.Q > before:
                return l, before
            g -= before
        return len(self.levels), g

    def count(self, source: int, n: int) -> int:
        """How many of the first n samples go to `source`."""
        for p, c in self.levels[:source]:
            n -= (p * n + c) // self.Q
        if source < len(self.levels):
            p, c = self.levels[source]
            return (p * n + c) // self.Q
        return n


class TokenBatches:
    """Deterministic (tokens, targets) micro-batches from one token array (an ndarray or a memory
    map: only the drawn windows are read) or a blend of several, [(tokens, weight, name), ...].

    One global sample index, as Megatron's: with B = dp * num_microbatches * micro_batch (the
    global batch), sample j of micro-batch mb of replica r at `step` is global sample
    g = step * B + (r * num_microbatches + mb) * micro_batch + j. Sample g goes to one source
    (`_Blend`, one counter for all replicas), as that source's a-th sample, which is window
    a % N of epoch a // N in that epoch's order (`permute`, keyed by seed, source and epoch; in
    order when not `shuffle`), N the windows over all of the source's tokens. So the samples of a
    step, in `global_batch` order, depend only on (seed, step) and B, never on how B is split into
    replicas and micro-batches: a checkpoint resumes under another plan with the same global batch
    on exactly the samples the old plan would have drawn.

    `packing`: "concat" (windows at stride seq_len over the whole source, across documents)
    or "document" (windows inside documents, `_document_windows`), which needs each source's
    end-of-document id: `eod`, or a fourth item of a source, (tokens, weight, name, eod)."""

    def __init__(self, corpus, micro_batch: int, seq_len: int, num_microbatches: int,
                 dp: int, seed: int = 0, name: str | None = None, *, shuffle: bool = True,
                 packing: str = "concat", eod: int | None = None):
        self.mb, self.seq, self.m, self.dp, self.seed = micro_batch, seq_len, num_microbatches, dp, seed
        self.global_samples = dp * num_microbatches * micro_batch     # B: samples a step
        self.shuffle = shuffle
        if packing not in PACKINGS:
            raise H2Error(f"unknown packing {packing!r} (expected one of: "
                          f"{', '.join(PACKINGS)})")
        self.packing = packing
        given = corpus if isinstance(corpus, list) else [(corpus, 1.0, name)]
        if not given:
            raise H2Error("no data sources to draw from")
        given = [tuple(g) if len(g) == 4 else (*g, eod) for g in given]
        total = 0.0
        for i, (_, w, src_name, _) in enumerate(given):
            if not _is_weight(w):
                raise H2Error(f"data source {i} has weight {w!r}; a weight is a positive finite "
                              "number", src_name)
            total += w
        self.sources = [self._source(tokens, w / total, src_name or f"source {i}", src_eod)
                        for i, (tokens, w, src_name, src_eod) in enumerate(given)]
        self.corpus = self.sources[0].tokens      # the (first) source's tokens
        self._blend = _Blend([s.weight for s in self.sources], seed)
        self._keys: dict[tuple[int, int], np.ndarray] = {}

    def _source(self, tokens: np.ndarray, weight: float, name: str, eod: int | None) -> Source:
        n, seq = len(tokens), self.seq
        if self.packing == "document":
            _check_eod(eod, name)
            starts, documents = _document_windows(tokens, eod, seq)
            if not len(starts):
                d = documents["documents"]
                raise H2Error(f'packing "document": no window of seq_len+1 = {seq + 1} tokens '
                              f"fits inside one document of the data ({n} tokens): its "
                              f"documents are shorter than seq_len+1 (all {d} of them), and a "
                              "window never spans two documents", name,
                              hint='use longer documents, a smaller seq_len, or packing "concat"')
            return Source(tokens, weight, name, len(starts), eod, starts, documents)
        if n < seq + 1:
            raise H2Error(f"data has {n} tokens; need more than seq_len = {seq} (a window is "
                          f"seq_len+1 = {seq + 1} tokens)", name)
        return Source(tokens, weight, name, (n - 1) // seq, eod)

    def _epoch_keys(self, source: int, epoch: int) -> np.ndarray:
        """The keys of one epoch's order (kept for the next micro-batches of the same epoch)."""
        k = (source, epoch)
        if k not in self._keys:
            if len(self._keys) >= 64:
                self._keys.clear()
            self._keys[k] = np.random.SeedSequence([self.seed, source, epoch]) \
                .generate_state(FEISTEL_ROUNDS, np.uint64)
        return self._keys[k]

    def _windows(self, source: int, index: np.ndarray) -> np.ndarray:
        """The window (0..N-1 over the whole source) of each of the source's samples `index`."""
        n = self.sources[source].windows
        epoch, pos = index // n, index % n
        if not self.shuffle:
            return pos
        out = np.empty_like(pos)
        for e in np.unique(epoch):
            at = epoch == e
            out[at] = permute(pos[at], n, self._epoch_keys(source, int(e)))
        return out

    def first_sample(self, step: int, replica: int, mb: int) -> int:
        """The global sample index of row 0 of micro-batch `mb` of `replica` at `step`."""
        return step * self.global_samples + (replica * self.m + mb) * self.mb

    def micro_batch(self, step: int, replica: int, mb: int) -> tuple[np.ndarray, np.ndarray]:
        first = self.first_sample(step, replica, mb)
        drawn = [self._blend.source_of(first + j) for j in range(self.mb)]
        window = np.empty((self.mb, self.seq + 1), dtype=np.int64)
        for s, src in enumerate(self.sources):
            rows = [j for j, (t, _) in enumerate(drawn) if t == s]
            if not rows:
                continue
            index = np.array([drawn[j][1] for j in rows], dtype=np.int64)
            k = self._windows(s, index)
            starts = src.starts[k] if src.starts is not None else k * self.seq
            window[rows] = src.tokens[starts[:, None] + np.arange(self.seq + 1)[None, :]]
        return window[:, :-1], window[:, 1:]

    def global_batch(self, step: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """All micro-batches of a step in the order the pipeline consumes them: replica by
        replica, micro-batch by micro-batch, which is global sample order."""
        return [self.micro_batch(step, r, i) for r in range(self.dp) for i in range(self.m)]

    def position(self, step: int) -> dict:
        """The data position at the start of `step` (for checkpoints and logs): the global samples
        drawn so far and, per source, its samples, the epoch and the index within it. The same for
        every layout of the same global batch."""
        samples = step * self.global_samples
        return {"step": step, "samples": samples, "global_batch": self.global_samples,
                "shuffle": self.shuffle, "sources": [
                    {"name": src.name, "samples": (a := self._blend.count(s, samples)),
                     "epoch": a // src.windows, "index": a % src.windows,
                     "windows": src.windows}
                    for s, src in enumerate(self.sources)]}

    def describe(self, src: Source) -> str:
        """A source's epochs, for its data line."""
        n = src.windows
        steps = n / (src.weight * self.global_samples)
        order = "reshuffled every epoch" if self.shuffle else "read in order"
        if src.starts is None:
            return (f"{n} windows of {self.seq}+1 tokens, packing concat (across documents), "
                    f"{order}; an epoch is {steps:.4g} steps")
        d = src.documents
        return (f"packing document (end-of-document id {src.eod}): {d['documents']} documents, "
                f"{n} windows; {d['short']} documents ({d['short_tokens']} tokens) shorter than "
                f"seq_len+1 = {self.seq + 1} dropped; windows of {self.seq}+1 tokens, each inside "
                f"one document, {order}; an epoch is {steps:.4g} steps")
