"""Reading a build directory (the compiler's artifact). h2x needs only this and the backends.

A build may have been edited or damaged since `h2c compile` wrote it, so every manifest field h2x
reads is checked when the build is opened (type, range, that the files it names exist inside the
build), each stream against the build's micro-batches and workers, and each stage's weight files
against their own headers and against the types its programs take: a bad field or file is an
H2Error naming manifest.json (and the field's line) or the file, never a worker's traceback.

Beyond structure, every file h2c wrote (train.toml aside: its non-program fields are the user's
to edit) is checked against the sha256 and size it recorded in `digests.json`, on the very bytes
that are then parsed: a changed weight, a stream without its `opt_step` or a swapped file is
refused, not trained on. Each file is hashed once per reader: `BuildDir(path)` hashes every file
but the weights when it opens the build; a worker (`check="used"`) hashes only what it reads,
its stage's weights included (`load_tensors`).
"""
from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from backends.registry import BACKENDS
from h2ir.errors import (MAX_GLOBAL_BATCH, MAX_MICRO_BATCH, MAX_MICROBATCHES, MAX_SEQ_LEN,
                         MAX_WORKERS, SEED_MAX, H2Error, decode_user_text, read_user_bytes,
                         read_user_file, too_deep)
from h2ir.plans.plan import SCHEDULES
from h2ir.schedule.streams import parse_stream
from h2ir.text import MAX_H2IR_BYTES, parse_graph
from h2ir.types import DTYPE_POLICIES, TensorType, dtype_of_host

SUPPORTED_FORMATS = ("h2-build/1",)
DIGESTS = "digests.json"                # frontend/compiler.py write_digests
DIGEST_FORMATS = ("h2-digests/1",)
_SHA256 = re.compile(r"[0-9a-f]{64}")
_DEVICE = re.compile(r"cpu|cuda(:\d{1,3})?")     # what h2c writes for a stage's device
RECOMPILE = "a build is not edited after h2c compile (train.toml aside): compile it again"
MAX_MANIFEST_BYTES = 64 << 20
MAX_STREAM_BYTES = 256 << 20    # a stream grows with micro-batches: MAX_MICROBATCHES bounds it
MAX_SAFETENSORS_HEADER = 100 << 20      # the safetensors format's own limit
# the manifest's batch shape: field -> (lowest, highest)
_BATCH_FIELDS = {"global_batch": (1, MAX_GLOBAL_BATCH), "micro_batch": (1, MAX_MICRO_BATCH),
                 "seq_len": (1, MAX_SEQ_LEN), "num_microbatches": (1, MAX_MICROBATCHES),
                 "dp": (1, MAX_WORKERS), "seed": (0, SEED_MAX)}
_STAGE_FILES = ("fwd", "bwd", "signature", "weights", "consts")


@dataclass
class StageArtifacts:
    index: int
    backend: str
    device: str | None
    dtype_policy: str
    fwd: object             # h2ir Graph
    bwd: object
    sig: dict               # stageN.json (frontend.stages.StageProgram.meta)
    weights: Path | None
    consts: Path | None
    zero_bubble: dict | None = None     # zb1 builds: bwd_input / bwd_weight programs and names


class BuildDir:
    """`check`: "all" hashes every file but the weights now (the weights when loaded); "used"
    hashes each file when it is read (a worker reads its own stage's files only)."""

    def __init__(self, path: str, check: str = "all"):
        self.path = Path(path)
        mf = self.path / "manifest.json"
        if not mf.is_file():
            raise H2Error("not a build directory (no manifest.json); run `h2c compile` first",
                          str(self.path))
        raw = read_user_bytes(mf, "manifest", MAX_MANIFEST_BYTES)
        text = decode_user_text(raw, mf, "manifest")
        try:
            self.manifest = json.loads(text)
        except json.JSONDecodeError as e:
            raise H2Error(f"manifest is not valid JSON: {e.msg}", str(mf), e.lineno, e.colno) from None
        except RecursionError:
            raise too_deep(text, str(mf), "manifest") from None
        if not isinstance(self.manifest, dict):
            raise H2Error(f"manifest is not a JSON object (got {type(self.manifest).__name__})",
                          str(mf))
        if self.manifest.get("format") not in SUPPORTED_FORMATS:
            raise H2Error(f"build format {self.manifest.get('format')!r} is not supported (expected "
                          f"{', '.join(SUPPORTED_FORMATS)})", str(mf))
        if self.manifest.get("dry_run"):
            raise H2Error("this build was compiled with --dry-run (no weights); it cannot be run",
                          str(mf))
        self.fields = _ManifestCheck(self.path, mf, text, self.manifest)
        self.fields.run()
        self.digests = Digests(self.path)
        self.digests.check("manifest.json", raw)     # after the fields: their errors say more
        if check == "all":
            self.digests.check_all()

    @property
    def num_stages(self) -> int:
        return len(self.manifest["stages"])

    @property
    def workers(self) -> list[dict]:
        return self.manifest["workers"]

    @property
    def hosts(self) -> list[list[int]]:
        """The worker ids on each host (manifest `workers[i].host`, h2c's chip assignment),
        in id order: under torchrun, host h's local rank k runs hosts[h][k]."""
        out: list[list[int]] = []
        for w in self.workers:
            h = w.get("host", 0)
            while len(out) <= h:
                out.append([])
            out[h].append(w["id"])
        return out

    def read(self, rel: str, what: str, max_bytes: int = MAX_MANIFEST_BYTES) -> str:
        """The text of build file `rel`, its bytes checked against digests.json."""
        p = self.path / rel
        raw = read_user_bytes(p, what, max_bytes)
        self.digests.check(rel, raw)
        return decode_user_text(raw, p, what)

    def _json(self, rel: str, what: str):
        return _parse_json(self.read(rel, what), self.path / rel, what)

    def graph(self, rel):
        """A stage program (h2ir text) of the build, checked against digests.json."""
        return parse_graph(self.read(rel, "h2ir file", MAX_H2IR_BYTES), str(self.path / rel))

    def stage(self, s: int) -> StageArtifacts:
        st = self.manifest["stages"][s]
        sig_path = self.path / st["signature"]
        sig = self._json(st["signature"], "stage signature")
        _check_signature(sig, sig_path)
        for key in ("weights", "consts"):
            check_safetensors(self.path / st[key])
        art = StageArtifacts(
            index=s, backend=st["backend"], device=st.get("device"),
            dtype_policy=st.get("dtype_policy", "fp32"), fwd=self.graph(st["fwd"]),
            bwd=self.graph(st["bwd"]), sig=sig, weights=self.path / st["weights"],
            consts=self.path / st["consts"], zero_bubble=self._zero_bubble(st))
        self._check_batch_shape(art)
        return art

    def _check_batch_shape(self, art: StageArtifacts) -> None:
        """The first stage's token ids and the last stage's targets are micro_batch x seq_len:
        the programs were compiled for that batch shape, and the manifest says what h2x draws."""
        m, last = self.manifest, self.num_stages - 1
        want = (m["micro_batch"], m["seq_len"])
        ins = {v.name: v.type for v in art.fwd.inputs}
        names = ([art.sig["inputs"][0]] if art.index == 0 and art.sig["inputs"] else []) + \
            (["targets"] if art.index == last else [])
        for name in names:
            t = ins.get(name)
            if t is not None and t.rank == 2 and t.dtype == "i64" and t.shape != want:
                field = "micro_batch" if t.shape[0] != want[0] else "seq_len"
                self.fields.fail(field, f"micro_batch x seq_len is {want[0]} x {want[1]}, but "
                                 f"stage {art.index}'s program takes %{name} as {t} "
                                 f"({self.manifest['stages'][art.index]['fwd']})", hint=RECOMPILE)

    def _zero_bubble(self, st: dict) -> dict | None:
        """A zero-bubble build's split backward of a stage: its two programs and how they meet."""
        zb = st.get("zero_bubble")
        if not zb:
            return None
        for key in ("bwd_input", "bwd_weight"):
            self.fields.file_in_build(zb, key, f"stages[{st.get('index', '?')}].zero_bubble.{key}")
        return {**zb, "bwd_input": self.graph(zb["bwd_input"]),
                "bwd_weight": self.graph(zb["bwd_weight"])}

    def load_tensors(self, path: Path, what: str, want: dict[str, TensorType | None],
                     exact: bool) -> dict[str, np.ndarray]:
        """A weights or constants file of the build as arrays, after its header, its digest and
        its tensors' types are checked: `want` maps the names a stage program takes to their
        types (None: any type); `exact`: the file holds those names and no others (weights;
        constants may hold more). A swapped, reshaped or retyped file is an H2Error naming it."""
        from safetensors.numpy import load_file
        path = Path(path)
        check_safetensors(path)
        self.digests.check_file(path.relative_to(self.path).as_posix(), what)
        try:
            tensors = load_file(str(path))
        except Exception as e:          # safetensors raises its own error types
            raise H2Error(f"cannot read {what}: {e}", str(path)) from None
        missing = [k for k in want if k not in tensors]
        extra = [k for k in tensors if k not in want] if exact else []
        if missing or extra:
            raise H2Error(f"{what} " + (f"lacks {missing[0]}, which the stage's program takes"
                                        if missing else f"holds {extra[0]}, which the stage's "
                                        "program does not take") + " (a file of another stage "
                          "or build?)", str(path), hint=RECOMPILE)
        for k, t in want.items():
            a = tensors[k]
            if t is None:
                continue
            try:
                got = TensorType(dtype_of_host(a.dtype), a.shape)
            except KeyError:
                raise H2Error(f"{what}: tensor {k} has dtype {a.dtype}, which h2 has no type "
                              "for", str(path), hint=RECOMPILE) from None
            if got != t:
                raise H2Error(f"{what}: tensor {k} is {got}, the stage's program takes {t}",
                              str(path), hint=RECOMPILE)
        return tensors

    def config(self):
        """The job configuration the build was compiled with (train.toml; h2ir/config.py), h2x
        run's defaults (a build without one: the defaults)."""
        from h2ir.config import Config, apply_toml
        f = self.path / self.manifest.get("config", "train.toml")
        cfg = Config()
        if f.is_file():
            apply_toml(cfg, str(f))
        return cfg

    def calibration(self):
        """The calibration the compile planned and predicted this build with (compiler
        `_write_calibration`), or None for a build of catalog chips or of an older h2c."""
        from h2ir.planner.calibration import Calibration
        rel = self.manifest.get("calibration")
        if rel is None:
            return None
        p = self.path / rel
        d = self._json(rel, "calibration")
        if not isinstance(d, dict):
            raise H2Error(f"calibration is not a JSON object (got {type(d).__name__})", str(p))
        cal = Calibration.from_json(d, str(p))
        return cal.select(cal.records)

    def stream(self, worker: int):
        """Worker `worker`'s instructions; a line the build cannot run (a micro-batch, worker or
        chunk out of range, no optimizer step) is an H2Error naming it."""
        w = self.workers[worker]
        p = self.path / w["stream"]
        raw = read_user_bytes(p, "instruction stream", MAX_STREAM_BYTES)
        text = decode_user_text(raw, p, "instruction stream")
        instrs = parse_stream(text, file=str(p))     # before the digest: its errors say more
        _check_stream(instrs, text, p, worker, len(self.workers),
                      self.manifest["num_microbatches"], len(w.get("chunks") or ()))
        self.digests.check(w["stream"], raw)
        return instrs

    def model_costs(self):
        return self.graph("model.h2ir").layer_costs()


def _read_json(path: Path, what: str):
    """A JSON file of the build, read within the size bound; bad JSON is an error naming the file
    and the spot."""
    return _parse_json(read_user_file(path, what), path, what)


def _parse_json(text: str, path: Path, what: str):
    """`text` (of file `path`) as JSON; bad JSON is an error naming the file and the spot."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise H2Error(f"{what} is not valid JSON: {e.msg}", str(path), e.lineno, e.colno) from None
    except RecursionError:
        raise too_deep(text, str(path), what) from None


# ---- checks --------------------------------------------------------------------------------------

class _ManifestCheck:
    """The manifest fields h2x reads, each checked; an error names manifest.json, the field's
    line (the first line that spells its key) and what was expected."""

    def __init__(self, build: Path, file: Path, text: str, m: dict):
        self.build, self.file, self.text, self.m = build, file, text, m

    def fail(self, field: str, message: str, hint: str | None = None):
        key = field.rsplit(".", 1)[-1].split("[")[0]
        m = re.search(r'"' + re.escape(key) + r'"\s*:', self.text)
        line = self.text.count("\n", 0, m.start()) + 1 if m else None
        raise H2Error(f"{field}: {message}", str(self.file), line, hint=hint)

    def get(self, d: dict, key: str, field: str):
        if key not in d:
            self.fail(field, "missing")
        return d[key]

    def integer(self, d: dict, key: str, lo: int, hi: int, field: str | None = None) -> int:
        field = field or key
        v = self.get(d, key, field)
        if isinstance(v, bool) or not isinstance(v, int):
            self.fail(field, f"expected an integer, got {_show(v)}")
        if not lo <= v <= hi:
            self.fail(field, f"expected an integer in {lo}..{hi:,}, got {v}")
        return v

    def number(self, d: dict, key: str, lo: float, hi: float, field: str) -> float:
        v = self.get(d, key, field)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                or not lo <= v <= hi:
            self.fail(field, f"expected a number in [{lo:g}, {hi:g}], got {_show(v)}")
        return v

    def string(self, d: dict, key: str, field: str) -> str:
        v = self.get(d, key, field)
        if not isinstance(v, str) or not v:
            self.fail(field, f"expected a non-empty string, got {_show(v)}")
        return v

    def backend(self, d: dict, field: str) -> str:
        v = self.string(d, "backend", field)
        if v not in BACKENDS:
            self.fail(field, f"expected one of {', '.join(BACKENDS)}, got {_show(v)}",
                      hint=RECOMPILE)
        return v

    def listing(self, key: str) -> list:
        v = self.get(self.m, key, key)
        if not isinstance(v, list) or not v:
            self.fail(key, f"expected a non-empty list, got {_show(v)}")
        if len(v) > MAX_WORKERS:
            self.fail(key, f"{len(v):,} entries; at most {MAX_WORKERS:,}")
        if not all(isinstance(x, dict) for x in v):
            self.fail(key, "expected a list of objects")
        return v

    def file_in_build(self, d: dict, key: str, field: str) -> None:
        rel = self.string(d, key, field)
        p = Path(rel)
        if p.is_absolute() or ".." in p.parts:
            self.fail(field, f"{rel!r} is not a path inside the build directory")
        if not (self.build / p).is_file():
            self.fail(field, f"names {rel}, which is not in the build directory",
                      hint="the build is incomplete; compile it again with `h2c compile`")

    def run(self):
        m = self.m
        for key, (lo, hi) in _BATCH_FIELDS.items():
            self.integer(m, key, lo, hi)
        if m["global_batch"] != m["dp"] * m["micro_batch"] * m["num_microbatches"]:
            self.fail("global_batch", f"{m['global_batch']} is not dp {m['dp']} x micro_batch "
                      f"{m['micro_batch']} x num_microbatches {m['num_microbatches']}")
        if m.get("schedule") not in SCHEDULES:
            self.fail("schedule", f"expected one of {', '.join(SCHEDULES)}, got "
                      f"{_show(m.get('schedule'))}")
        model = m.get("model")
        if not isinstance(model, dict):
            self.fail("model", f"expected an object, got {_show(model)}")
        if model.get("vocab") is not None:
            self.integer(model, "vocab", 1, 1 << 31, "model.vocab")
        stages = self.listing("stages")
        for i, st in enumerate(stages):
            self.backend(st, f"stages[{i}].backend")
            if st.get("device") is not None and not (isinstance(st["device"], str)
                                                     and _DEVICE.fullmatch(st["device"])):
                self.fail(f"stages[{i}].device", f"expected cpu, cuda or cuda:N (or null), got "
                          f"{_show(st['device'])}", hint=RECOMPILE)
            if "dtype_policy" in st:
                if st["dtype_policy"] not in DTYPE_POLICIES:
                    self.fail(f"stages[{i}].dtype_policy", f"expected one of "
                              f"{', '.join(DTYPE_POLICIES)}, got {_show(st['dtype_policy'])}",
                              hint=RECOMPILE)
            if "zero" in st:             # absent in builds of older h2c: zero=0
                self.integer(st, "zero", 0, 1, f"stages[{i}].zero")
            for key in _STAGE_FILES:
                self.file_in_build(st, key, f"stages[{i}].{key}")
        workers = self.listing("workers")
        # a stage has `tp` workers per replica (h2ir.schedule.streams.WorkerLayout)
        tps = [self.integer(st, "tp", 1, MAX_WORKERS, f"stages[{i}].tp") if "tp" in st else 1
               for i, st in enumerate(stages)]
        virtual = self.integer(m, "virtual", 1, MAX_WORKERS, "virtual") if "virtual" in m else 1
        want = m["dp"] * sum(tps) // virtual     # virtual stages: a worker runs `virtual` stages
        if len(workers) != want:
            self.fail("workers", f"{len(workers)} workers; dp {m['dp']} x {len(stages)} stages "
                      f"(tp {tps})" + (f" over {virtual} chunks per worker" if virtual > 1 else "")
                      + f" needs {want}")
        for i, w in enumerate(workers):
            f = f"workers[{i}]"
            if self.integer(w, "id", 0, MAX_WORKERS, f + ".id") != i:
                self.fail(f + ".id", f"expected {i} (workers are listed in id order), got {w['id']}")
            self.integer(w, "replica", 0, m["dp"] - 1, f + ".replica")
            self.integer(w, "stage", 0, len(stages) - 1, f + ".stage")
            if virtual > 1:
                chunks = w.get("chunks")
                if not (isinstance(chunks, list) and len(chunks) == virtual and all(
                        isinstance(c, int) and 0 <= c < len(stages) for c in chunks)):
                    self.fail(f + ".chunks", f"expected a list of {virtual} stage indices "
                              f"(the worker's chunks), got {chunks!r}")
            self.backend(w, f + ".backend")
            self.file_in_build(w, "stream", f + ".stream")
            if w.get("weights") is not None:     # a TP or EP rank's own shard of its stage
                self.file_in_build(w, "weights", f + ".weights")
            if "host" in w:             # absent in builds of older h2c: every worker on host 0
                self.integer(w, "host", 0, MAX_WORKERS, f + ".host")
        if "config" in m:
            self.file_in_build(m, "config", "config")
        if "calibration" in m:          # absent in builds of older h2c and of catalog chips
            self.file_in_build(m, "calibration", "calibration")
        used = sorted({w.get("host", 0) for w in workers})
        if used != list(range(len(used))):
            missing = sorted(set(range(used[-1] + 1)) - set(used))
            self.fail("host", f"workers are on hosts {used}: host {missing[0]} has none (hosts "
                      "are numbered 0..N-1 with at least one worker each)")


def _check_signature(sig, path: Path) -> None:
    if not isinstance(sig, dict):
        raise H2Error("stage signature is not a JSON object", str(path))
    for key, kind in (("inputs", list), ("outputs", list), ("params", list), ("passthrough", list),
                      ("input_types", dict), ("output_types", dict)):
        if not isinstance(sig.get(key), kind):
            raise H2Error(f"stage signature: '{key}' is missing or not a JSON "
                          f"{'list' if kind is list else 'object'}", str(path))
    for key in ("input_types", "output_types"):
        for name, text in sig[key].items():
            try:
                TensorType.parse(text)
            except (ValueError, TypeError, KeyError, AttributeError) as e:
                raise H2Error(f"stage signature: {key}[{name!r}] is not a type like f32[2,8] "
                              f"({e})", str(path)) from None
    missing = [k for k in sig["inputs"] if k not in sig["input_types"]]
    if missing:
        raise H2Error(f"stage signature: inputs {missing[:3]} have no input_types", str(path))


class Digests:
    """The sha256 and size h2c recorded for every file it wrote (`digests.json`)."""

    def __init__(self, build: Path):
        self.build = Path(build)
        p = self.build / DIGESTS
        if not p.is_file():
            raise H2Error("the build has no digests.json (compiled by an older h2c, or the file "
                          "was removed): its files cannot be checked before they are trained on",
                          str(self.build), hint="compile it again with `h2c compile`")
        d = _read_json(p, "digest list")
        files = d.get("files") if isinstance(d, dict) else None
        if not isinstance(d, dict) or d.get("format") not in DIGEST_FORMATS or \
                not isinstance(files, dict):
            raise H2Error(f"not a digest list of this h2 (expected an object with format "
                          f"{', '.join(DIGEST_FORMATS)} and files)", str(p), hint=RECOMPILE)
        for rel, want in files.items():
            if Path(rel).is_absolute() or ".." in Path(rel).parts:
                raise H2Error(f"{rel!r} is not a path inside the build directory", str(p),
                              hint=RECOMPILE)
            if not (isinstance(want, dict) and isinstance(want.get("sha256"), str)
                    and _SHA256.fullmatch(want["sha256"]) and type(want.get("size")) is int
                    and want["size"] >= 0):
                raise H2Error(f"digest of {rel!r} is not {{sha256: 64 hex digits, size: bytes}}",
                              str(p), hint=RECOMPILE)
        self.files = files

    def _want(self, rel: str) -> dict:
        want = self.files.get(rel)
        if want is None:
            raise H2Error(f"not listed in {DIGESTS}: h2c compile did not write this file",
                          str(self.build / rel), hint=RECOMPILE)
        return want

    def _changed(self, rel: str, size: int, sha: str | None) -> None:
        want = self._want(rel)
        if size != want["size"]:
            raise H2Error(f"{size} bytes, h2c compile wrote {want['size']}: the file was "
                          f"{'truncated' if size < want['size'] else 'extended'} or replaced "
                          f"since", str(self.build / rel), hint=RECOMPILE)
        if sha is not None and sha != want["sha256"]:
            raise H2Error(f"changed since h2c compile wrote it (its sha256 differs from the one "
                          f"in {DIGESTS})", str(self.build / rel), hint=RECOMPILE)

    def check(self, rel: str, data: bytes) -> None:
        """`data`, read from build file `rel`, is what h2c wrote there."""
        self._want(rel)
        self._changed(rel, len(data), hashlib.sha256(data).hexdigest())

    def check_file(self, rel: str, what: str) -> None:
        """Build file `rel` (a weights file: read in pieces, never whole) is what h2c wrote."""
        h, size = hashlib.sha256(), 0
        try:
            with open(self.build / rel, "rb") as f:
                while chunk := f.read(1 << 20):
                    h.update(chunk)
                    size += len(chunk)
        except OSError as e:
            raise H2Error(f"cannot read {what}: {e.strerror}", str(self.build / rel)) from None
        self._changed(rel, size, h.hexdigest())

    def check_all(self) -> None:
        """Every listed file: the weights by size (a worker hashes them as it loads them), the
        rest by digest."""
        for rel in self.files:
            p = self.build / rel
            if rel.startswith("weights/"):
                try:
                    size = p.stat().st_size
                except OSError as e:
                    raise H2Error(f"cannot read weights file: {e.strerror}", str(p)) from None
                self._changed(rel, size, None)
            else:
                self.check_file(rel, "build file")


def _check_stream(instrs: list, text: str, path: Path, wid: int, workers: int,
                  microbatches: int, chunks: int) -> None:
    """Each instruction within the build: micro-batches 0..m-1, workers 0..W-1 (a peer other
    than this one), chunks of this worker, one optimizer step (per chunk)."""
    lines = [n for n, ln in enumerate(text.splitlines(), 1)
             if ln.strip() and not ln.lstrip().startswith("#")]

    def fail(n, message):
        raise H2Error(message, str(path), n, hint=RECOMPILE)
    steps = []
    for ins, n in zip(instrs, lines):
        if ins.mb is not None and not 0 <= ins.mb < microbatches:
            fail(n, f"'{ins}': micro-batch {ins.mb} out of range (the build runs micro-batches "
                    f"0..{microbatches - 1} per step)")
        peers = list(ins.peers) + (list(ins.ep or ()) if ins.op != "all_reduce" else [])
        bad = [p for p in peers if not 0 <= p < workers]
        if bad:
            fail(n, f"'{ins}': worker w{bad[0]} out of range (the build has workers "
                    f"w0..w{workers - 1})")
        if ins.peer == wid and not chunks:       # a V-shape's chunks do, on one worker
            fail(n, f"'{ins}': a worker does not send to or receive from itself")
        if ins.share is not None and not 0 <= ins.share[0] < ins.share[1]:
            fail(n, f"'{ins}': share {ins.share[0]}/{ins.share[1]} out of range")
        if chunks and ins.chunk is None:
            fail(n, f"'{ins}': no chunk (worker w{wid} runs {chunks} chunks)")
        if ins.chunk is not None and not 0 <= ins.chunk < chunks:
            fail(n, f"'{ins}': chunk c{ins.chunk} out of range (worker w{wid} runs "
                    + (f"chunks c0..c{chunks - 1})" if chunks else "one stage)"))
        if ins.op == "opt_step":
            steps.append(ins.chunk)
    want = sorted(range(chunks)) if chunks else [None]
    if sorted(steps, key=lambda c: -1 if c is None else c) != want:
        raise H2Error(f"the stream has {len(steps)} optimizer step(s) (opt_step); worker w{wid} "
                      f"takes one per step" + (f" for each of its {chunks} chunks" if chunks
                                               else ""), str(path), hint=RECOMPILE)


def check_safetensors(path: Path) -> None:
    """A weights file's header is whole and the tensors it lists fit in the file (a truncated
    or foreign file is an H2Error naming it; the loader itself says only 'invalid header')."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else None
            if n is None or n > MAX_SAFETENSORS_HEADER or 8 + n > size:
                raise H2Error(f"weights file is truncated or not a safetensors file ({size} "
                              "bytes; its header is not whole)", str(path))
            header = json.loads(f.read(n))
    except OSError as e:
        raise H2Error(f"cannot read weights file: {e.strerror or e}", str(path)) from None
    except (ValueError, RecursionError):
        raise H2Error("weights file's header is not valid JSON (not a safetensors file?)",
                      str(path)) from None
    if not isinstance(header, dict):
        raise H2Error("weights file's header is not a JSON object", str(path))
    end = 0
    for name, t in header.items():
        if name == "__metadata__":
            continue
        offs = t.get("data_offsets") if isinstance(t, dict) else None
        if not (isinstance(offs, list) and len(offs) == 2 and all(isinstance(o, int) for o in offs)):
            raise H2Error(f"weights file: tensor {name!r} has no valid data_offsets", str(path))
        end = max(end, offs[1])
    if 8 + n + end != size:
        raise H2Error(f"weights file is truncated or padded: it has {size} bytes, its header "
                      f"describes {8 + n + end}", str(path),
                      hint="compile the build again with `h2c compile`")


def _show(v) -> str:
    text = json.dumps(v) if not isinstance(v, float) or math.isfinite(v) else repr(v)
    return text if len(text) <= 40 else text[:37] + "..."
