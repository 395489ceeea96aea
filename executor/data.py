"""Training data: byte-level tokens from text.

`--data PATH` is a text file or a directory of text files; the default corpus is the Python
standard library's own source files found at run time (real text, nothing to download).
Token = byte value (0..255), so any model with vocab >= 256 trains on it.

Batches are a pure function of (seed, step, replica, micro-batch): every worker that needs data
(the first stage for tokens, the last for targets) draws the same batch without talking to the
others, and a resumed run draws exactly what the uninterrupted run drew.
"""
from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np

from h2ir.errors import H2Error

MAX_BYTES = 4 << 20       # 4 MB of real text is plenty for the tiny models


def _files(root: Path) -> list[Path]:
    if root.is_file():
        return [root]
    exts = {".py", ".txt", ".md", ".rst"}
    top = sorted(p for p in root.glob("*") if p.is_file() and p.suffix in exts)
    if sum(p.stat().st_size for p in top) >= MAX_BYTES:
        return top                        # the stdlib's top level alone is > 8 MB of Python
    return top + sorted(p for p in root.rglob("*/**/*") if p.is_file() and p.suffix in exts)


def default_corpus_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def load_corpus(path: str | None = None, max_bytes: int = MAX_BYTES) -> np.ndarray:
    root = Path(path) if path else default_corpus_dir()
    if not root.exists():
        raise H2Error("data path not found", str(root))
    chunks, total = [], 0
    for f in _files(root):
        if "test" in f.parts and path is None:
            continue                      # stdlib tests hold odd encodings; skip them by default
        try:
            b = f.read_bytes()
        except OSError:
            continue
        chunks.append(np.frombuffer(b, dtype=np.uint8))
        total += len(b)
        if total >= max_bytes:
            break
    if not chunks or total < 2:
        raise H2Error("no text found to train on (expected a text file or a directory of "
                      ".py/.txt/.md/.rst files)", str(root))
    return np.concatenate(chunks)[:max_bytes]


class TokenBatches:
    """Deterministic (tokens, targets) micro-batches of byte tokens."""

    def __init__(self, corpus: np.ndarray, micro_batch: int, seq_len: int, num_microbatches: int,
                 dp: int, seed: int = 0):
        if len(corpus) <= seq_len + 1:
            raise H2Error(f"corpus has {len(corpus)} tokens; need more than seq_len+1 = {seq_len + 1}")
        self.corpus = corpus
        self.mb, self.seq, self.m, self.dp, self.seed = micro_batch, seq_len, num_microbatches, dp, seed

    def micro_batch(self, step: int, replica: int, mb: int) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng([self.seed, step, replica, mb])
        starts = rng.integers(0, len(self.corpus) - self.seq - 1, size=self.mb)
        idx = starts[:, None] + np.arange(self.seq + 1)[None, :]
        window = self.corpus[idx].astype(np.int64)
        return window[:, :-1], window[:, 1:]

    def global_batch(self, step: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """All micro-batches of a step in the order the pipeline consumes them."""
        return [self.micro_batch(step, r, i) for r in range(self.dp) for i in range(self.m)]
