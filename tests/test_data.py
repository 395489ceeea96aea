"""Training data as users have it: token files (memory-mapped), text through the model's own
tokenizer (streamed into a token cache), bytes; replicas that never share a window, determinism,
one data order for every layout of the global batch, exact resume, vocabulary errors, bounded
memory; and h2x runs on both formats that resume exactly."""
import json
import shutil
import tracemalloc

import numpy as np
import pytest

from conftest import run_cli
from executor.data import (DataSpec, TokenBatches, load_corpus, open_tokens, prepare_data,
                           resolve_format, text_pieces)
from h2ir.errors import H2Error

WORDS = ("the quick brown fox jumps over lazy dog pipeline stage micro batch replica "
         "gradient all reduce tokenizer naïve café Ünïcödé façade 1f1b gpipe bubble").split()


def _text(n_lines: int, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    lines = []
    for i in range(n_lines):
        line = " ".join(WORDS[j] for j in rng.integers(0, len(WORDS), size=rng.integers(3, 14)))
        if i % 7 == 0:
            line += "  with  double  spaces,\tand a tab"
        lines.append(line + ("\n\n" if i % 5 == 0 else "\n"))
    return "".join(lines)


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory):
    """A byte-level BPE tokenizer.json (vocab 300) trained here on a few KB of text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_text(200).splitlines(), trainer)
    assert tok.get_vocab_size() == 300
    p = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(p))
    return p


@pytest.fixture(scope="module")
def text_path(tmp_path_factory):
    p = tmp_path_factory.mktemp("text") / "corpus.txt"
    p.write_text(_text(600, seed=1), encoding="utf-8")
    return p


def _manifest(vocab=320, dp=2, mb=2, seq=16, m=2):
    return {"model": {"vocab": vocab}, "micro_batch": mb, "seq_len": seq, "num_microbatches": m,
            "dp": dp, "seed": 0}


def _batches(spec: DataSpec, man: dict) -> TokenBatches:
    return TokenBatches(open_tokens(spec), man["micro_batch"], man["seq_len"],
                        man["num_microbatches"], man["dp"], man["seed"])


def _quiet(*_):
    pass


def test_auto_picks_the_format_by_suffix():
    assert resolve_format("train.bin", "auto", None)[0] == "tokens-u16"
    assert resolve_format("x.u16", "auto", None)[0] == "tokens-u16"
    assert resolve_format("x.U32", "auto", None)[0] == "tokens-u32"
    assert resolve_format("x.txt", "auto", "tok.json")[0] == "text"
    assert resolve_format("x.txt", "auto", None)[0] == "bytes"
    assert resolve_format(None, "auto", None)[0] == "bytes"
    assert resolve_format("train.bin", "tokens-u32", None) == ("tokens-u32", "--data-format")


def test_token_file_is_memory_mapped_deterministic_and_replicas_never_share_a_window(tmp_path):
    n, seq = 10_000, 16
    f = tmp_path / "train.u32"
    np.arange(n, dtype="<u4").tofile(f)       # an id names its own position
    man = _manifest(vocab=n, dp=2)
    spec = prepare_data(man, tmp_path / "cache", str(f), out=_quiet)
    assert spec == DataSpec(str(f), "tokens-u32", spec.max_bytes)
    a, b = _batches(spec, man), _batches(spec, man)
    assert isinstance(a.corpus, np.memmap)
    windows = (n - 1) // seq                  # over the whole file: 624, 8 samples a step
    assert a.sources[0].windows == windows
    seen = {0: [], 1: []}
    for step in range(20):                    # 160 samples: all in epoch 0
        for r in range(2):
            for mb in range(2):
                x, y = a.micro_batch(step, r, mb)
                x2, y2 = b.micro_batch(step, r, mb)
                assert np.array_equal(x, x2) and np.array_equal(y, y2)    # a pure function
                assert np.array_equal(x[:, 1:], y[:, :-1])                # targets: next token
                assert x.dtype == np.int64 and x.shape == (2, seq)
                assert np.all(x[:, 0] % seq == 0)                         # windows at stride seq
                assert np.array_equal(x, x[:, :1] + np.arange(seq))       # contiguous tokens
                seen[r] += (x[:, 0] // seq).tolist()
    both = seen[0] + seen[1]
    assert len(set(both)) == len(both) == 160                 # no window twice within the epoch
    assert not set(seen[0]) & set(seen[1])                    # replicas never share one
    # no replica shares of the file: each replica draws from all of it
    assert all(min(seen[r]) < windows // 2 <= max(seen[r]) for r in range(2))


def test_every_layout_of_the_global_batch_draws_the_same_samples(tmp_path):
    """dp 2 x 2 micro-batches of 2, dp 1 x 4 of 2, dp 4 x 1 of 2, dp 2 x 4 of 1: the same rows in
    the same global order each step, so a checkpoint resumes under another plan exactly."""
    n = 2_000                                 # 124 windows: epoch 1 starts in step 15
    f = tmp_path / "train.u32"
    np.arange(n, dtype="<u4").tofile(f)
    spec = prepare_data(_manifest(vocab=n), tmp_path / "cache", str(f), out=_quiet)
    layouts = [_batches(spec, _manifest(vocab=n, dp=dp, m=m, mb=mb))
               for dp, m, mb in ((2, 2, 2), (1, 4, 2), (4, 1, 2), (2, 4, 1))]
    for step in (0, 3, 15, 16):
        rows = [np.concatenate([x for x, _ in data.global_batch(step)]) for data in layouts]
        assert all(np.array_equal(r, rows[0]) for r in rows[1:]), step
        assert all(data.position(step) == layouts[0].position(step) for data in layouts)


def test_uint16_bin_and_a_size_that_is_not_whole_ids(tmp_path):
    f = tmp_path / "train.bin"
    (np.arange(5000) % 300).astype("<u2").tofile(f)
    spec = prepare_data(_manifest(), tmp_path, str(f), out=_quiet)
    assert spec.format == "tokens-u16"
    x, _ = _batches(spec, _manifest()).micro_batch(0, 0, 0)
    assert int(x.max()) < 300
    with open(f, "ab") as fh:
        fh.write(b"\0")                        # 10001 bytes: not uint16 ids
    with pytest.raises(H2Error, match="not a whole number of 2-byte ids") as e:
        prepare_data(_manifest(), tmp_path, str(f), out=_quiet)
    assert e.value.file == str(f)


def test_out_of_vocab_id_names_the_file_and_offset(tmp_path):
    f = tmp_path / "train.bin"
    ids = np.full(4000, 7, dtype="<u2")
    ids[2345] = 320                            # vocab 320: ids 0..319
    ids[3000] = 999
    ids.tofile(f)
    with pytest.raises(H2Error) as e:
        prepare_data(_manifest(vocab=320), tmp_path, str(f), out=_quiet)
    msg = str(e.value)
    assert msg.startswith(f"{f}: error: token id 320 at element 2345 (byte offset 4690)"), msg
    assert "vocab 320" in msg


def test_out_of_vocab_token_from_the_tokenizer_names_the_byte_offset(tmp_path, tok_path):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(tok_path))
    text = "é" * 3 + " plain ascii words here\n" * 4 + "the quick brown fox\n"
    f = tmp_path / "t.txt"
    f.write_text(text, encoding="utf-8")
    enc = tok.encode(text, add_special_tokens=False)
    vocab = 260                                # byte alphabet + 4 merges: the text uses more
    first = next(i for i, t in enumerate(enc.ids) if t >= vocab)
    byte_at = len(text[:enc.offsets[first][0]].encode("utf-8"))
    with pytest.raises(H2Error) as e:
        prepare_data(_manifest(vocab=vocab, seq=4, dp=1), tmp_path / "c", str(f),
                     tokenizer=str(tok_path), out=_quiet)
    assert e.value.file == str(f)
    assert f"token id {enc.ids[first]} " in e.value.message
    assert f"at byte offset {byte_at} " in e.value.message


def test_streamed_tokenization_equals_whole_text(text_path, tok_path):
    """Pieces of 64 bytes, cut where the pre-tokenizer splits: the same ids as one encode."""
    from tokenizers import Tokenizer
    from executor.data import tokenize_text
    tok = Tokenizer.from_file(str(tok_path))
    raw = text_path.read_bytes()
    pieces = list(text_pieces([text_path], 1 << 30, chunk=64))
    assert len(pieces) > 100 and max(len(p.encode()) for _, _, p in pieces) <= 128
    assert "".join(p for _, _, p in pieces).encode() == raw              # nothing lost or doubled
    assert all(raw[pos:].startswith(p.encode()) for _, pos, p in pieces)  # offsets are right
    got = []
    n = tokenize_text(tok, [text_path], 1 << 30, 300, got.append, chunk=64)
    whole = tok.encode(raw.decode(), add_special_tokens=False).ids
    assert n == len(whole) and np.concatenate(got).tolist() == whole


def test_pieces_never_split_a_character(tmp_path):
    """No newline or space to cut at, and a byte limit inside a character: whole characters only."""
    f = tmp_path / "t.txt"
    f.write_text("é€😀" * 50, encoding="utf-8")           # 2-, 3- and 4-byte characters
    pieces = list(text_pieces([f], 9 * 50 - 2, chunk=7))
    assert "".join(p for _, _, p in pieces) == "é€😀" * 49 + "é€"
    assert all(f.read_bytes()[pos:].startswith(p.encode()) for _, pos, p in pieces)


def test_text_with_tokenizer_is_cached_and_resumes_exactly(tmp_path, text_path, tok_path):
    man = _manifest(vocab=320, dp=2)
    cache_dir = tmp_path / "data"
    lines = []
    spec = prepare_data(man, cache_dir, str(text_path), tokenizer=str(tok_path), out=lines.append)
    assert spec.format == "tokens-u16" and spec.path.endswith(".u16")
    assert any("tokenized" in l for l in lines)
    full = _batches(spec, man)
    assert isinstance(full.corpus, np.memmap)
    uninterrupted = [full.global_batch(s) for s in range(8)]
    # a resumed run: a fresh launcher finds the cache, fresh workers draw steps 5..7
    lines = []
    spec2 = prepare_data(man, cache_dir, str(text_path), tokenizer=str(tok_path), out=lines.append)
    assert spec2 == spec and any("cached in" in l for l in lines)
    resumed = _batches(spec2, man)
    for s in range(5, 8):
        for (x, y), (x2, y2) in zip(uninterrupted[s], resumed.global_batch(s)):
            assert np.array_equal(x, x2) and np.array_equal(y, y2)
    # the cache lost: tokenizing again writes the same bytes
    before = (cache_dir / spec.path.rsplit("/", 1)[1]).read_bytes()
    shutil.rmtree(cache_dir)
    spec3 = prepare_data(man, cache_dir, str(text_path), tokenizer=str(tok_path), out=_quiet)
    assert spec3 == spec and (cache_dir / spec.path.rsplit("/", 1)[1]).read_bytes() == before
    # the same text under another layout of the global batch: the same rows in the same order
    other = _batches(spec, _manifest(vocab=320, dp=1, m=4))
    for s in (0, 7):
        want = np.concatenate([x for x, _ in uninterrupted[s]])
        assert np.array_equal(np.concatenate([x for x, _ in other.global_batch(s)]), want)


def test_text_needs_a_tokenizer_and_tokens_refuse_one(tmp_path, text_path, tok_path):
    with pytest.raises(H2Error, match="needs --tokenizer"):
        prepare_data(_manifest(), tmp_path, str(text_path), "text", out=_quiet)
    f = tmp_path / "train.bin"
    np.zeros(100, "<u2").tofile(f)
    with pytest.raises(H2Error, match="only used with text"):
        prepare_data(_manifest(), tmp_path, str(f), tokenizer=str(tok_path), out=_quiet)
    bad = tmp_path / "bad.json"
    bad.write_text("{not a tokenizer")
    with pytest.raises(H2Error, match="tokenizer.json") as e:
        prepare_data(_manifest(), tmp_path, str(text_path), tokenizer=str(bad), out=_quiet)
    assert e.value.file == str(bad)
    with pytest.raises(H2Error, match="data has 100 tokens; need more than seq_len = 100") as e:
        prepare_data(_manifest(seq=100, dp=2), tmp_path, str(f), out=_quiet)
    assert e.value.file == str(f)


def _sparse(path, size, head: bytes = b"", tail: bytes = b""):
    with open(path, "wb") as fh:
        fh.write(head)
        fh.truncate(size)
        if tail:
            fh.seek(size - len(tail))
            fh.write(tail)
    return path


def test_a_2_gib_file_is_never_read_whole(tmp_path, tok_path):
    """Sparse 2 GiB files: text and bytes read only a bounded prefix; a token file is mapped and
    only the drawn windows are read."""
    size = 2 << 30
    big = _sparse(tmp_path / "big.txt", size, head=_text(3000, seed=2).encode())
    tokens = _sparse(tmp_path / "big.bin", size)
    man = _manifest(vocab=1 << 16, dp=2)      # every uint16 id is in the vocabulary: no scan
    tracemalloc.start()
    try:
        corpus = load_corpus(str(big), max_bytes=1 << 20)
        assert len(corpus) == 1 << 20
        spec = prepare_data(man, tmp_path / "c", str(big), tokenizer=str(tok_path),
                            max_bytes=256 << 10, out=_quiet)
        assert 0 < len(open_tokens(spec)) < 256 << 10
        spec = prepare_data(man, tmp_path / "c", str(tokens), out=_quiet)
        data = _batches(spec, man)
        assert len(data.corpus) == size // 2
        for step in range(10):
            x, _ = data.micro_batch(step, 1, 0)
            assert x.shape == (2, 16)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, peak               # vs 2 GiB: only bounded pieces were ever held


def test_vocabulary_check_reads_a_token_file_in_bounded_pieces(tmp_path):
    """The check covers the whole file (the bad id is its very last element) holding only one
    piece of it at a time."""
    size = 64 << 20
    f = _sparse(tmp_path / "t.u32", size, tail=np.array([400], "<u4").tobytes())
    tracemalloc.start()
    try:
        with pytest.raises(H2Error, match=f"element {size // 4 - 1} "):
            prepare_data(_manifest(vocab=320), tmp_path, str(f), out=_quiet)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, peak


# ---- end to end: h2x run on a token file and on tokenized text, resumed -----------------------
BUILD_ARGS = ["--global-batch", "4", "--micro-batch", "2", "--seq-len", "32", "--arg", "family=qwen2",
              "--arg", "vocab=320"]
# two replicas by hand: a searched plan's dp follows the measured co-location slowdown
DP2_PLAN = """model "examples/hf/decoders.py"
cluster "local"
batch global=4 micro=2 seq=32
schedule 1f1b
dp 2
stage chip=cpu-torch chips=2 tp=1 layers=embed, 0..1, head
"""


def _losses(log):
    return [json.loads(l)["loss"] for l in log.read_text().splitlines()]


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """A public family (transformers' Qwen2ForCausalLM, tiny, vocab 320) on one stage with 2
    data-parallel replicas."""
    b = tmp_path_factory.mktemp("build") / "b"
    plan = b.parent / "dp2.h2plan"
    plan.write_text(DP2_PLAN)
    r = run_cli("h2c", "compile", "examples/hf/decoders.py", *BUILD_ARGS, "--plan", str(plan),
                "-o", str(b))
    assert r.returncode == 0, r.stderr
    assert json.loads((b / "manifest.json").read_text())["dp"] == 2
    return b


@pytest.mark.parametrize("kind", ["tokens", pytest.param("text", marks=pytest.mark.slow)])
def test_h2x_run_on_real_data_resumes_exactly(tmp_path, kind, build, text_path, tok_path):
    b = tmp_path / "b"
    shutil.copytree(build, b)
    if kind == "tokens":
        data = tmp_path / "train.bin"
        # 400 ids: 12 windows, 4 samples a step, an epoch every 3 steps: the resume at step 2
        # is mid-epoch and the resumed run crosses into the next, reshuffled epoch
        np.random.default_rng(0).integers(0, 320, size=400).astype("<u2").tofile(data)
        flags = ["--data", str(data)]
    else:
        flags = ["--data", str(text_path), "--tokenizer", str(tok_path)]
    full = tmp_path / "full.jsonl"
    r = run_cli("h2x", "run", str(b), "--steps", "5", *flags, "--json-log", str(full))
    assert r.returncode == 0, r.stderr + r.stdout
    assert "data: " in r.stdout
    r = run_cli("h2x", "run", str(b), "--steps", "3", *flags, "--checkpoint-every", "2")
    assert r.returncode == 0, r.stderr + r.stdout
    resumed = tmp_path / "resumed.jsonl"
    r = run_cli("h2x", "run", str(b), "--steps", "5", *flags, "--resume", "--json-log", str(resumed))
    assert r.returncode == 0, r.stderr + r.stdout
    assert "step_00000002" in r.stdout
    want, got = _losses(full), _losses(resumed)
    assert len(want) == 5 and len(got) == 3
    for g, w in zip(got, want[2:]):
        assert abs(g - w) <= 1e-6 * abs(w), (got, want)
    # bad data is a located error before any worker starts, never a traceback
    bad = tmp_path / "bad.bin"
    np.full(1000, 320, "<u2").tofile(bad)
    r = run_cli("h2x", "run", str(b), "--steps", "1", "--data", str(bad))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.startswith(f"{bad}: error: token id 320 at element 0"), r.stderr
