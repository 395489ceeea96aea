"""Data read as a trainer reads it: epochs that see every window once in a fresh order, blends of
sources by weight, end-of-document ids between tokenized files, the data position, and the
serialisable DataMix the workers rebuild. Token files of np.arange ids, so a window's first id
names the window."""
import json
import math

import numpy as np
import pytest

from executor.data import (DataMix, DataSpec, MixSource, TokenBatches, _cache_key, open_batches,
                           open_tokens, prepare_data, prepare_mix, text_files, token_cache)
from h2ir.errors import H2Error


def _manifest(vocab=1 << 20, dp=1, mb=3, seq=8, m=2, seed=0):
    return {"model": {"vocab": vocab}, "micro_batch": mb, "seq_len": seq, "num_microbatches": m,
            "dp": dp, "seed": seed}


def _token_file(path, ids):
    np.asarray(ids, dtype="<u4").tofile(path)
    return str(path)


def _quiet(*_):
    pass


def _drawn(data: TokenBatches, replica: int, steps: int) -> list[int]:
    """The first token id of every sample replica `replica` draws in steps 0..steps-1, in sample
    order (step, micro-batch, row)."""
    out = []
    for step in range(steps):
        for mb in range(data.m):
            x, y = data.micro_batch(step, replica, mb)
            assert np.array_equal(x[:, 1:], y[:, :-1])
            out += x[:, 0].tolist()
    return out


def _global(data: TokenBatches, steps: int) -> tuple[list[int], list[int]]:
    """The first token id of every sample of steps 0..steps-1 in global sample order (the rows of
    `global_batch`, concatenated), and the replica that draws each."""
    firsts, replicas = [], []
    for step in range(steps):
        for k, (x, y) in enumerate(data.global_batch(step)):
            assert np.array_equal(x[:, 1:], y[:, :-1])
            firsts += x[:, 0].tolist()
            replicas += [k // data.m] * len(x)
    return firsts, replicas


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_every_window_once_per_epoch_in_a_new_order(tmp_path, dp):
    """Epochs are global: across all replicas, an epoch reads every window of the whole source
    once, and replicas never draw the same window within an epoch."""
    n, seq = 1001, 8
    f = _token_file(tmp_path / "train.u32", np.arange(n))
    man = _manifest(dp=dp, seq=seq)              # 6 samples a replica a step: epochs end inside one
    spec = prepare_data(man, tmp_path / "c", f, out=_quiet)
    data = TokenBatches(open_tokens(spec), 3, seq, 2, dp, 0)
    windows = (n - 1) // seq
    assert data.sources[0].windows == windows == 125
    per_step = 6 * dp
    firsts, replicas = _global(data, steps=-(-2 * windows // per_step))
    assert all(i % seq == 0 and i + seq < n for i in firsts)                # windows at stride seq
    order = [i // seq for i in firsts]
    one, two = order[:windows], order[windows:2 * windows]
    assert sorted(one) == sorted(two) == list(range(windows))              # each once per epoch
    assert one != two and one != sorted(one)                               # reshuffled
    for epoch in (0, 1):
        at = range(epoch * windows, (epoch + 1) * windows)
        mine = [{order[i] for i in at if replicas[i] == r} for r in range(dp)]
        assert sum(map(len, mine)) == windows                              # replicas disjoint
        if dp > 1:
            assert all(len(m) > 0 for m in mine)
    # the replica's own draws are its slice of the global order
    for r in range(dp):
        assert _drawn(data, r, 2) == [firsts[s * per_step + r * 6 + k]
                                      for s in range(2) for k in range(6)]


def test_shuffle_false_reads_windows_in_order(tmp_path):
    n, seq = 200, 8
    data = TokenBatches(np.arange(n), 3, seq, 2, 2, 0, shuffle=False)
    windows = (n - 1) // seq
    firsts, _ = _global(data, steps=5)                                     # 60 samples
    assert [i // seq for i in firsts] == [k % windows for k in range(60)]  # wraps to epochs 2, 3


def test_a_source_needs_one_whole_window():
    TokenBatches(np.arange(9), 1, 8, 1, 1)                                # 9 = seq_len+1: one
    one = TokenBatches(np.arange(9), 2, 8, 1, 4)                          # epochs wrap: enough
    x, _ = one.micro_batch(3, 2, 0)
    assert x[:, 0].tolist() == [0, 0]
    assert TokenBatches(np.arange(17), 1, 8, 1, 2).sources[0].windows == 2
    with pytest.raises(H2Error, match="data has 8 tokens; need more than seq_len = 8") as e:
        TokenBatches(np.arange(8), 1, 8, 1, 2, name="tiny.bin")
    assert e.value.file == "tiny.bin"


def test_a_70_30_blend_keeps_its_weights_and_each_source_its_epochs(tmp_path):
    a = _token_file(tmp_path / "a.u32", np.arange(10_000))
    b = _token_file(tmp_path / "b.u32", 50_000 + np.arange(3_000))
    man = _manifest(mb=4, m=5)                   # 20 samples a step
    lines = []
    mix = prepare_mix(man, tmp_path / "c", [{"path": a, "weight": 7}, {"path": b, "weight": 3}],
                      out=lines.append)
    assert [s.weight for s in mix.sources] == [7.0, 3.0]
    assert len(lines) == 3 and "70.0%" in lines[2] and "30.0%" in lines[2], lines
    data = open_batches(mix, 4, 8, 5, 1, 0)
    firsts = _drawn(data, 0, steps=500)
    assert len(firsts) == 10_000
    from_a = [i for i in firsts if i < 50_000]
    assert abs(len(from_a) - 7000) <= 1                                   # 70 % within one sample
    assert abs(len(from_a) / 10_000 - 0.7) <= 0.02
    # the two sources interleave all along, not in runs
    assert 0.6 < sum(i < 50_000 for i in firsts[:100]) / 100 < 0.8
    for order, lo, n in (([i // 8 for i in from_a], 0, 10_000),
                         ([(i - 50_000) // 8 for i in firsts if i >= 50_000], 50_000, 3_000)):
        windows = (n - 1) // 8
        full = len(order) // windows
        assert full >= 5
        epochs = [order[e * windows:(e + 1) * windows] for e in range(full)]
        assert all(sorted(ep) == list(range(windows)) for ep in epochs)
        assert len({tuple(ep) for ep in epochs}) == full                 # each its own order
    pos = data.position(500)["sources"]
    assert pos[0]["samples"] == len(from_a) and pos[1]["samples"] == 10_000 - len(from_a)
    assert pos[0]["epoch"] == len(from_a) // 1249 and pos[0]["index"] == len(from_a) % 1249


def test_three_sources_get_their_shares(tmp_path):
    srcs = [(np.arange(1000) + k * 10_000, w, f"s{k}") for k, w in enumerate((0.5, 0.3, 0.2))]
    data = TokenBatches(srcs, 10, 8, 1, 1, seed=3)
    firsts = _drawn(data, 0, steps=1000)
    for k, w in enumerate((0.5, 0.3, 0.2)):
        got = sum(i // 10_000 == k for i in firsts)
        assert abs(got - w * 10_000) <= 2, (k, got)                      # one per level at most
        assert data.position(1000)["sources"][k]["samples"] == got


@pytest.mark.parametrize("blend", [False, True])
def test_resume_draws_the_same_batches_across_an_epoch_boundary(tmp_path, blend):
    """Steps 5..9 from a fresh TokenBatches equal those of one that drew steps 0..4 first; with
    74 windows and 12 samples a step, epoch 1 starts inside step 6."""
    seq, n = 8, 2 * (37 * 8 + 1)
    srcs = [(np.arange(n), 1.0, "a")]
    if blend:
        srcs = [(np.arange(n), 0.5, "a"), (100_000 + np.arange(n // 2), 0.5, "b")]
    run = TokenBatches(srcs, 3, seq, 2, 2, seed=7)
    assert run.sources[0].windows == 74
    first = [run.global_batch(s) for s in range(10)]
    fresh = TokenBatches(srcs, 3, seq, 2, 2, seed=7)
    for s in range(5, 10):
        for (x, y), (x2, y2) in zip(first[s], fresh.global_batch(s)):
            assert np.array_equal(x, x2) and np.array_equal(y, y2)
    if not blend:
        assert fresh.position(6)["sources"][0]["epoch"] == 0
        assert fresh.position(7)["sources"][0]["epoch"] == 1
    other_seed = TokenBatches(srcs, 3, seq, 2, 2, seed=8)
    assert not np.array_equal(other_seed.micro_batch(5, 0, 0)[0], first[5][0][0])


def test_position_at_an_epoch_boundary():
    seq, windows = 8, 12
    data = TokenBatches(np.arange(windows * seq + 1), 2, seq, 1, 2)         # 4 samples a step
    assert json.loads(json.dumps(data.position(3))) == data.position(3)
    for step, samples, epoch, index in ((0, 0, 0, 0), (2, 8, 0, 8), (3, 12, 1, 0), (7, 28, 2, 4)):
        pos = data.position(step)
        assert pos["step"] == step and pos["samples"] == samples and pos["global_batch"] == 4
        assert "replicas" not in pos                                       # one global position
        src = pos["sources"][0]
        assert (src["samples"], src["epoch"], src["index"], src["windows"]) == \
            (samples, epoch, index, windows)
    # the position names the window the step draws first: step 3 starts epoch 1's order
    firsts, _ = _global(data, steps=6)
    order = [i // seq for i in firsts]
    assert sorted(order[12:24]) == list(range(12)) and order[12:24] != order[:12]
    # another layout of the same global batch is at the same position
    other = TokenBatches(np.arange(windows * seq + 1), 1, seq, 4, 1)
    assert other.position(7) == data.position(7)


def test_a_huge_epoch_is_drawn_without_materialising_its_order():
    """2**40 windows: the order of an epoch is computed per sample, not held."""
    class Virtual:                     # token i is i: only the drawn windows are ever made
        def __len__(self):
            return (1 << 43) + 1

        def __getitem__(self, idx):
            return np.asarray(idx)

    data = TokenBatches(Virtual(), 4, 8, 2, 1)
    assert data.sources[0].windows == 1 << 40
    x, y = data.micro_batch(123_456_789, 0, 1)
    assert x.shape == (4, 8) and np.all(x[:, 0] % 8 == 0) and np.array_equal(x[:, 1:], y[:, :-1])
    pos = data.position(1 << 38)
    assert pos["sources"][0]["epoch"] == 2


# ---- one global sample order: the same samples under any layout of the global batch ---------
LAYOUTS = [(1, 4, 2), (2, 2, 2), (4, 1, 2), (2, 4, 1)]       # (dp, num_microbatches, micro_batch)


@pytest.mark.parametrize("packing", ["concat", "document"])
def test_every_layout_of_a_global_batch_draws_the_same_rows(packing):
    """dp x num_microbatches x micro_batch = 8 four ways: each step's rows, concatenated in
    `global_batch` order, are the same (so a checkpoint resumes under another plan on the same
    samples), across epoch boundaries of both sources of a blend."""
    docs, _ = _documents([20, 5, 9, 33, 17], tail=0)                 # 84 tokens
    srcs = [(docs, 0.6, "docs", EOD), (100_000 + np.arange(57), 0.4, "plain", 7)]
    runs = [TokenBatches(srcs, mb, 8, m, dp, seed=3, packing=packing) for dp, m, mb in LAYOUTS]
    windows = [s.windows for s in runs[0].sources]
    assert windows == ([10, 7] if packing == "concat" else [9, 7])
    for step in range(3):
        rows = []
        for data in runs:
            batch = data.global_batch(step)
            assert len(batch) == data.dp * data.m
            assert all(x.shape == (data.mb, 8) for x, _ in batch)
            rows.append((np.concatenate([x for x, _ in batch]), np.concatenate([y for _, y in batch])))
        for x, y in rows[1:]:
            assert np.array_equal(x, rows[0][0]) and np.array_equal(y, rows[0][1])
        # as a multiset too, trivially: the same windows each step
        assert all(sorted(map(tuple, x.tolist())) == sorted(map(tuple, rows[0][0].tolist()))
                   for x, _ in rows)
        assert all(data.position(step) == runs[0].position(step) for data in runs)
    # the three steps cross an epoch boundary of each source
    assert all(src["epoch"] >= 1 for src in runs[0].position(3)["sources"])
    # a single micro-batch is the matching slice of the global order
    flat = np.concatenate([x for x, _ in runs[0].global_batch(2)])
    for data in runs:
        for r in range(data.dp):
            for i in range(data.m):
                at = (r * data.m + i) * data.mb
                assert np.array_equal(data.micro_batch(2, r, i)[0], flat[at:at + data.mb])
                assert data.first_sample(2, r, i) == 16 + at


# ---- documents: an end-of-document id between tokenized files --------------------------------
@pytest.fixture(scope="module")
def eos_tok(tmp_path_factory):
    """A byte-level BPE tokenizer.json with "</s>" (id 0) in its vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=290, show_progress=False, special_tokens=["</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 50, trainer)
    assert tok.token_to_id("</s>") == 0
    p = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(p))
    return p


@pytest.fixture
def two_docs(tmp_path):
    d = tmp_path / "docs"
    d.mkdir()
    (d / "a.txt").write_text("the quick brown fox\n" * 20)
    (d / "b.txt").write_text("jumps over the lazy dog\n" * 20)
    return d


def test_tokenized_files_end_with_the_tokenizers_end_of_document_id(tmp_path, eos_tok, two_docs):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(eos_tok))
    lines = []
    spec = prepare_data(_manifest(vocab=300), tmp_path / "c", str(two_docs), tokenizer=str(eos_tok),
                        out=lines.append)
    ids = open_tokens(spec).tolist()
    a = tok.encode((two_docs / "a.txt").read_text(), add_special_tokens=False).ids
    b = tok.encode((two_docs / "b.txt").read_text(), add_special_tokens=False).ids
    assert ids == a + [0] + b + [0]
    assert "end-of-document id 0 (</s>, the tokenizer's own)" in lines[-1], lines
    # an explicit id, and none: other caches, other tokens
    spec5 = prepare_data(_manifest(vocab=300), tmp_path / "c", str(two_docs),
                         tokenizer=str(eos_tok), eod=5, out=_quiet)
    assert open_tokens(spec5).tolist() == a + [5] + b + [5]
    lines = []
    none = prepare_data(_manifest(vocab=300), tmp_path / "c", str(two_docs), tokenizer=str(eos_tok),
                        eod=-1, out=lines.append)
    assert open_tokens(none).tolist() == a + b
    assert "no end-of-document token" in lines[-1]
    assert len({spec.path, spec5.path, none.path}) == 3
    files = text_files(str(two_docs))
    assert _cache_key(str(eos_tok), files, 1000, 300, 64, 0) != \
        _cache_key(str(eos_tok), files, 1000, 300, 64, None)
    with pytest.raises(H2Error, match="end-of-document id 300 is outside") as e:
        prepare_data(_manifest(vocab=300), tmp_path / "c", str(two_docs), tokenizer=str(eos_tok),
                     eod=300, out=_quiet)
    assert e.value.file == str(eos_tok)


def test_a_tokenizer_without_an_end_of_document_token_says_so(tmp_path, two_docs):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["plain words"], trainers.BpeTrainer(
        vocab_size=270, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    cache, fmt, note = token_cache(tmp_path / "c", str(two_docs), str(path), 1 << 20, 300,
                                   out=_quiet)
    assert note.startswith("no end-of-document token (the tokenizer has none of <|endoftext|>")
    assert fmt == "tokens-u16" and cache.is_file()


# ---- the serialisable mix --------------------------------------------------------------------
def test_data_mix_round_trips_through_json_and_opens_like_the_launcher_checked(tmp_path):
    a = _token_file(tmp_path / "a.u32", np.arange(500))
    b = _token_file(tmp_path / "b.bin", np.arange(400))
    b_u16 = tmp_path / "b.bin"
    np.arange(400, dtype="<u2").tofile(b_u16)
    mix = prepare_mix(_manifest(), tmp_path / "c",
                      [{"path": a, "weight": 0.25}, {"path": str(b_u16), "max_bytes": 1000}],
                      shuffle=False, out=_quiet)
    assert mix == DataMix((MixSource(a, "tokens-u32", 4 << 20, 0.25),
                           MixSource(str(b_u16), "tokens-u16", 1000, 1.0)), shuffle=False)
    back = DataMix.from_json(json.loads(json.dumps(mix.to_json())))
    assert back == mix
    x = open_batches(back, 3, 8, 2, 1, 0).global_batch(4)
    y = open_batches(mix, 3, 8, 2, 1, 0).global_batch(4)
    assert all(np.array_equal(p[0], q[0]) for p, q in zip(x, y))
    # one source: the same batches as the single DataSpec's
    spec = DataSpec(a, "tokens-u32")
    one = open_batches(DataMix.single(spec), 3, 8, 2, 1, 0)
    plain = TokenBatches(open_tokens(spec), 3, 8, 2, 1, 0)
    assert np.array_equal(one.micro_batch(9, 0, 1)[0], plain.micro_batch(9, 0, 1)[0])


def _src(**kw):
    return {"path": None, "format": "bytes", "max_bytes": 10, "weight": 1, "eod": None, **kw}


def _mix(*sources, **kw):
    return {"sources": list(sources), "shuffle": True, "packing": "concat", **kw}


@pytest.mark.parametrize("bad, what", [
    ({"sources": []}, "keys sources, shuffle and packing"),
    ({"sources": [_src()], "shuffle": True}, "keys sources, shuffle and packing"),
    (_mix(), "non-empty list"),
    (_mix({"path": "a", "format": "bytes", "max_bytes": 10, "eod": None}),
     "source 0 is not an object"),
    (_mix({"path": "a", "format": "bytes", "max_bytes": 10, "weight": 1}),
     "source 0 is not an object"),
    (_mix(_src(path=3)), "path 3"),
    (_mix(_src(format="text")), "format 'text'"),
    (_mix(_src(max_bytes=1.5)), "max_bytes 1.5"),
    (_mix(_src(weight=0)), "weight 0"),
    (_mix(_src(weight=math.nan)), "weight nan"),
    (_mix(_src(weight=True)), "weight True"),
    (_mix(_src(eod=-1)), "eod -1"),
    (_mix(_src(eod=2.0)), "eod 2.0"),
    (_mix(_src(eod=True)), "eod True"),
    (_mix(_src(), shuffle="yes"), "shuffle is 'yes'"),
    (_mix(_src(), packing="docs"), "packing is 'docs'"),
])
def test_a_malformed_data_mix_is_a_located_error(bad, what):
    with pytest.raises(H2Error, match="malformed data mix") as e:
        DataMix.from_json(bad, "run.json")
    assert what in e.value.message and e.value.file == "run.json"


@pytest.mark.parametrize("weight", [0, -1.0, math.inf, math.nan, "1"])
def test_a_bad_weight_names_the_source(tmp_path, weight):
    a = _token_file(tmp_path / "a.u32", np.arange(500))
    b = _token_file(tmp_path / "b.u32", np.arange(500))
    with pytest.raises(H2Error, match="weight is a positive finite number") as e:
        prepare_mix(_manifest(), tmp_path, [{"path": a}, {"path": b, "weight": weight}],
                    out=_quiet)
    assert e.value.file == b
    with pytest.raises(H2Error, match="weight is a positive finite number") as e:
        TokenBatches([(np.arange(100), 1.0, "a"), (np.arange(100), weight, "b")], 1, 8, 1, 1)
    assert e.value.file == "b"


def test_mix_sources_are_checked_like_single_ones(tmp_path):
    a = _token_file(tmp_path / "a.u32", np.arange(500))
    with pytest.raises(H2Error, match="unknown key"):
        prepare_mix(_manifest(), tmp_path, [{"path": a, "wieght": 2}], out=_quiet)
    with pytest.raises(H2Error, match="outside the model's vocabulary") as e:
        prepare_mix(_manifest(vocab=300), tmp_path, [{"path": a}, {"path": a}], out=_quiet)
    assert e.value.file == a
    short = _token_file(tmp_path / "short.u32", np.arange(8))    # not one window of 9
    with pytest.raises(H2Error, match="need more than seq_len") as e:
        prepare_mix(_manifest(dp=2), tmp_path, [{"path": a}, {"path": short}], out=_quiet)
    assert e.value.file == short


def test_without_a_path_the_line_says_the_default_corpus_is_used(tmp_path):
    lines = []
    mix = prepare_mix(_manifest(vocab=256), tmp_path, [{"path": None, "max_bytes": 1 << 16}],
                      out=lines.append)
    assert mix.sources[0].path is None and mix.sources[0].format == "bytes"
    assert len(lines) == 1
    assert lines[0].startswith("data: the default corpus (no data path given: this Python's "
                               "standard library sources"), lines
    lines = []
    prepare_mix(_manifest(vocab=256), tmp_path, [{"path": None, "max_bytes": 1 << 16}],
                shuffle=False, out=lines.append, what="eval data")
    assert lines[0].startswith("eval data: the default corpus") and "read in order" in lines[0]


# ---- packing "document": no window spans two documents ---------------------------------------
EOD = 0
# lengths with their eod: 9 = seq+1 (one window, ending on the eod), 8 = seq and shorter (none)
DOC_LENGTHS = [20, 5, 9, 8, 33, 17, 1, 12, 9, 40, 3, 26] * 3
TAIL = 30                                        # the last document, without an eod


def _documents(lengths=DOC_LENGTHS, tail=TAIL):
    """Token i is i + 1, except the eod (0) that ends each document: a window's first id, less
    one, is where it starts. Also the documents as (start, length)."""
    ids, docs, at = [], [], 0
    for length in lengths:
        ids += [at + i + 1 for i in range(length - 1)] + [EOD]
        docs.append((at, length))
        at += length
    if tail:
        ids += [at + i + 1 for i in range(tail)]
        docs.append((at, tail))
    return np.array(ids), docs


def _expected_windows(docs, seq):
    """The window starts of all documents."""
    return {start + k * seq for start, length in docs for k in range((length - 1) // seq)}


def _windows_drawn(data, replica, steps):
    """(first token, whole window) of every sample of `replica` in steps 0..steps-1."""
    out = []
    for step in range(steps):
        for mb in range(data.m):
            x, y = data.micro_batch(step, replica, mb)
            assert np.array_equal(x[:, 1:], y[:, :-1])
            out += [np.concatenate([x[j], y[j, -1:]]) for j in range(len(x))]
    return out


def _global_windows(data, steps):
    """(replica, whole window) of every sample of steps 0..steps-1, in global sample order."""
    out = []
    for step in range(steps):
        for k, (x, y) in enumerate(data.global_batch(step)):
            assert np.array_equal(x[:, 1:], y[:, :-1])
            out += [(k // data.m, np.concatenate([x[j], y[j, -1:]])) for j in range(len(x))]
    return out


@pytest.mark.parametrize("dp", [1, 2])
def test_document_packing_keeps_every_window_inside_one_document(tmp_path, dp):
    seq = 8
    ids, docs = _documents()
    f = _token_file(tmp_path / "docs.u32", ids)
    lines = []
    mix = prepare_mix(_manifest(dp=dp, seq=seq), tmp_path / "c", [{"path": f}], eod=EOD,
                      packing="document", out=lines.append)
    assert mix.packing == "document" and mix.sources[0].eod == EOD
    data = open_batches(mix, 3, seq, 2, dp, 0)
    src = data.sources[0]
    every = _expected_windows(docs, seq)
    n = src.windows
    assert n == len(every) == sum((length - 1) // seq for _, length in docs) == len(src.starts)
    drawn = _global_windows(data, steps=-(-2 * n // (6 * dp)))
    for _, w in drawn:
        assert len(w) == seq + 1
        assert EOD not in w[:-1].tolist()                      # an eod only as the last target
        assert np.array_equal(w[:-1], ids[w[0] - 1:w[0] - 1 + seq])
    starts = [int(w[0]) - 1 for _, w in drawn]
    one, two = starts[:n], starts[n:2 * n]
    assert sorted(one) == sorted(two) == sorted(every)         # each window once per epoch
    assert len(set(one)) == n and one != two                   # reshuffled
    seen = [{s for (r, _), s in zip(drawn[:n], one) if r == rep} for rep in range(dp)]
    assert set().union(*seen) == every
    if dp == 2:
        assert seen[0] and seen[1] and not seen[0] & seen[1]   # replicas disjoint in an epoch
    # documents shorter than seq+1 give nothing; one of exactly seq+1 gives one window ending on
    # its eod
    for start, length in docs:
        inside = {s for s in every if start <= s < start + length}
        assert len(inside) == (length - 1) // seq
        if length < seq + 1:
            assert not inside
    ends_on_eod = [s for s in every if ids[s + seq] == EOD]
    assert ends_on_eod and all(ids[s + seq - 1] != EOD for s in every)
    # the data line says the packing, documents, windows and what was dropped
    short = [length for _, length in docs if length < seq + 1]
    line = lines[-1]
    assert f"packing document (end-of-document id {EOD})" in line, line
    assert f"{len(docs)} documents, {len(every)} windows" in line, line
    assert f"{len(short)} documents ({sum(short)} tokens) shorter than seq_len+1 = 9" in line, line


def test_the_document_scan_reads_pieces_and_handles_their_edges(monkeypatch):
    """Any piece size gives the same windows (documents across pieces, an eod at a piece's end),
    and the scan reads at most SCAN_ELEMS ids at a time."""
    import executor.data as data_mod
    ids, docs = _documents()

    class Recording:                  # a stand-in memory map that records what is read
        dtype = ids.dtype
        largest = 0

        def __len__(self):
            return len(ids)

        def __getitem__(self, idx):
            if isinstance(idx, slice):
                Recording.largest = max(Recording.largest, len(range(*idx.indices(len(ids)))))
            return ids[idx]

    want = TokenBatches(ids, 1, 8, 1, 2, packing="document", eod=EOD).sources[0].starts
    assert want.tolist() == sorted(_expected_windows(docs, 8))
    for piece in (1, 7, 20, 29, 64):
        monkeypatch.setattr(data_mod, "SCAN_ELEMS", piece)
        Recording.largest = 0
        got = TokenBatches(Recording(), 1, 8, 1, 2, packing="document", eod=EOD).sources[0]
        assert Recording.largest <= piece
        assert np.array_equal(got.starts, want) and got.starts.dtype == np.int64
    # an eod that the token type cannot hold: one document, the whole file
    u16 = np.arange(1, 100, dtype="<u2")
    one = TokenBatches(u16, 1, 8, 1, 1, packing="document", eod=1 << 17).sources[0]
    assert one.documents["documents"] == 1 and one.starts.tolist() == list(range(0, 90, 8))


def test_document_packing_resumes_exactly():
    ids, _ = _documents()
    srcs = [(ids, 0.6, "docs", EOD), (100_000 + np.arange(500), 0.4, "plain", 7)]
    run = TokenBatches(srcs, 3, 8, 2, 2, seed=5, packing="document")
    windows = run.sources[0].windows
    first = [run.global_batch(s) for s in range(12)]            # past an epoch of the docs
    assert 12 * 12 * 0.6 > windows
    fresh = TokenBatches(srcs, 3, 8, 2, 2, seed=5, packing="document")
    for s in range(6, 12):
        for (x, y), (x2, y2) in zip(first[s], fresh.global_batch(s)):
            assert np.array_equal(x, x2) and np.array_equal(y, y2)
    pos = fresh.position(12)["sources"][0]
    assert pos["windows"] == windows and pos["epoch"] >= 1


def test_document_packing_round_trips_through_json(tmp_path):
    ids, _ = _documents()
    f = _token_file(tmp_path / "docs.u32", ids)
    g = _token_file(tmp_path / "more.u32", 50_000 + np.arange(400))
    mix = prepare_mix(_manifest(dp=2), tmp_path / "c", [{"path": f, "weight": 3}, {"path": g}],
                      eod=EOD, packing="document", out=_quiet)
    assert mix == DataMix((MixSource(f, "tokens-u32", 4 << 20, 3.0, EOD),
                           MixSource(g, "tokens-u32", 4 << 20, 1.0, EOD)), True, "document")
    as_json = mix.to_json()
    assert as_json["packing"] == "document" and [s["eod"] for s in as_json["sources"]] == [0, 0]
    back = DataMix.from_json(json.loads(json.dumps(as_json)))
    assert back == mix
    a, b = open_batches(back, 3, 8, 2, 2, 0), open_batches(mix, 3, 8, 2, 2, 0)
    for step in (0, 7):
        for p, q in zip(a.global_batch(step), b.global_batch(step)):
            assert np.array_equal(p[0], q[0]) and np.array_equal(p[1], q[1])
    # the same sources packed "concat" draw windows across documents: other batches
    concat = DataMix(mix.sources, True, "concat")
    assert DataMix.from_json(concat.to_json()) == concat
    c = open_batches(concat, 3, 8, 2, 2, 0)
    assert not all(np.array_equal(p[0], q[0]) for p, q in zip(c.global_batch(0), a.global_batch(0)))


def test_document_packing_without_an_eod_id_is_an_error(tmp_path, eos_tok, two_docs):
    ids, _ = _documents()
    f = _token_file(tmp_path / "docs.u32", ids)
    with pytest.raises(H2Error, match='packing "document" needs an end-of-document id') as e:
        prepare_mix(_manifest(), tmp_path / "c", [{"path": f}], packing="document", out=_quiet)
    assert e.value.file == f and "data.eod_token" in e.value.hint
    with pytest.raises(H2Error, match="needs an end-of-document id") as e:
        TokenBatches(ids, 1, 8, 1, 1, name="docs.bin", packing="document")
    assert e.value.file == "docs.bin"
    with pytest.raises(H2Error, match="needs an end-of-document id") as e:
        open_batches(DataMix((MixSource(f, "tokens-u32"),), True, "document"), 1, 8, 1, 1, 0)
    assert e.value.file == f
    with pytest.raises(H2Error, match="outside the model's vocabulary"):
        prepare_mix(_manifest(vocab=300), tmp_path / "c", [{"path": f}], eod=300,
                    packing="document", out=_quiet)
    with pytest.raises(H2Error, match="unknown packing 'docs'"):
        prepare_mix(_manifest(), tmp_path / "c", [{"path": f}], eod=EOD, packing="docs",
                    out=_quiet)
    # text: the tokenizer's own eod id serves; none asked for (-1) is the error, at the text
    mix = prepare_mix(_manifest(vocab=300, seq=4), tmp_path / "c",
                      [{"path": str(two_docs), "format": "text"}], tokenizer=str(eos_tok),
                      packing="document", out=_quiet)
    assert mix.sources[0].eod == 0
    with pytest.raises(H2Error, match="needs an end-of-document id") as e:
        prepare_mix(_manifest(vocab=300, seq=4), tmp_path / "c",
                    [{"path": str(two_docs), "format": "text"}], tokenizer=str(eos_tok), eod=-1,
                    packing="document", out=_quiet)
    assert e.value.file == str(two_docs)


def test_text_documents_are_the_files(tmp_path, eos_tok, two_docs):
    """Each tokenized file is one document: no window holds the eod between them but last."""
    mix = prepare_mix(_manifest(vocab=300, seq=4, dp=2), tmp_path / "c",
                      [{"path": str(two_docs), "format": "text"}], tokenizer=str(eos_tok),
                      packing="document", out=_quiet)
    data = open_batches(mix, 3, 4, 2, 2, 0)
    tokens = np.asarray(data.sources[0].tokens)
    ends = np.flatnonzero(tokens == 0)
    assert len(ends) == 2 and ends[-1] == len(tokens) - 1          # two files, two documents
    assert data.sources[0].documents["documents"] == 2
    assert data.sources[0].windows > 0
    for r in range(2):
        for w in _windows_drawn(data, r, steps=20):
            assert 0 not in w[:-1].tolist()


def test_documents_shorter_than_a_window_are_an_error():
    ids, _ = _documents([5, 9, 3, 8] * 4, tail=0)               # none holds seq+1 = 9 ... but one
    TokenBatches(ids, 1, 8, 1, 1, packing="document", eod=EOD)   # 9: one window each
    short, _ = _documents([5, 8, 3, 8] * 4, tail=0)
    with pytest.raises(H2Error, match="documents are shorter than seq_len\\+1") as e:
        TokenBatches(short, 1, 8, 1, 2, name="short.bin", packing="document", eod=EOD)
    assert e.value.file == "short.bin" and "(all 16 of them)" in e.value.message
    assert "replica" not in e.value.message
    # one long document among short ones: its windows serve every replica (epochs wrap)
    mixed, _ = _documents([40, 5, 5, 5, 5, 5, 5, 5, 3], tail=0)
    data = TokenBatches(mixed, 1, 8, 1, 2, packing="document", eod=EOD)
    assert data.sources[0].windows == 4 and data.sources[0].starts.tolist() == [0, 8, 16, 24]
    drawn = [int(w[0]) - 1 for _, w in _global_windows(data, steps=2)]
    assert sorted(drawn) == [0, 8, 16, 24]                      # 2 replicas x 2 steps: one epoch
    # one long document: its windows at stride seq from its start, the tail dropped
    one, _ = _documents([200], tail=0)
    src = TokenBatches(one, 1, 8, 1, 2, packing="document", eod=EOD).sources[0]
    assert src.windows == 199 // 8 == 24 and src.documents["documents"] == 1
    assert src.starts.tolist() == list(range(0, 200 - 9 + 1, 8))              # the last: 184


def test_concat_packing_is_unchanged_by_an_eod_id(tmp_path):
    """Packing concat (the default) reads windows at stride seq_len over the whole source,
    across documents, with or without an eod id known."""
    ids, _ = _documents()
    f = _token_file(tmp_path / "docs.u32", ids)
    lines = []
    plain = prepare_mix(_manifest(dp=2), tmp_path / "c", [{"path": f}], out=lines.append)
    with_eod = prepare_mix(_manifest(dp=2), tmp_path / "c", [{"path": f}], eod=EOD, out=_quiet)
    assert plain.packing == with_eod.packing == "concat" and plain.sources[0].eod is None
    assert "packing concat" in lines[-1] and "replica" not in lines[-1]
    a, b = open_batches(plain, 3, 8, 2, 2, 0), open_batches(with_eod, 3, 8, 2, 2, 0)
    assert a.sources[0].starts is None
    assert a.sources[0].windows == (len(ids) - 1) // 8
    spans = False
    for r in range(2):
        for wa, wb in zip(_windows_drawn(a, r, 10), _windows_drawn(b, r, 10)):
            assert np.array_equal(wa, wb)
            assert (wa[0] - 1) % 8 == 0 or wa[0] == EOD            # at stride seq_len
            spans |= EOD in wa[:-1].tolist()
    assert spans                                                   # across documents
