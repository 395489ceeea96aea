"""Reading a build directory (the compiler's artifact). h2x needs only this and the backends.

A build may have been edited or damaged since `h2c compile` wrote it, so every manifest field h2x
reads is checked when the build is opened (type, range, that the files it names exist inside the
build) and each stage's weight files are checked against their own headers before they are
loaded: a bad field or file is an H2Error naming manifest.json (and the field's line) or the
file, never a worker's traceback.
"""
from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from h2ir.errors import (MAX_GLOBAL_BATCH, MAX_MICRO_BATCH, MAX_MICROBATCHES, MAX_SEQ_LEN,
                         MAX_WORKERS, SEED_MAX, H2Error, read_user_file, too_deep)
from h2ir.plans.plan import SCHEDULES
from h2ir.schedule.streams import parse_stream
from h2ir.text import load_graph
from h2ir.types import TensorType

SUPPORTED_FORMATS = ("h2-build/1",)
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
    def __init__(self, path: str):
        self.path = Path(path)
        mf = self.path / "manifest.json"
        if not mf.is_file():
            raise H2Error("not a build directory (no manifest.json); run `h2c compile` first",
                          str(self.path))
        text = read_user_file(mf, "manifest", MAX_MANIFEST_BYTES)
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
        _ManifestCheck(self.path, mf, text, self.manifest).run()

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

    def stage(self, s: int) -> StageArtifacts:
        st = self.manifest["stages"][s]
        sig_path = self.path / st["signature"]
        sig = _read_json(sig_path, "stage signature")
        _check_signature(sig, sig_path)
        for key in ("weights", "consts"):
            check_safetensors(self.path / st[key])
        return StageArtifacts(
            index=s, backend=st["backend"], device=st.get("device"), dtype_policy=st.get("dtype_policy", "fp32"),
            fwd=load_graph(str(self.path / st["fwd"])), bwd=load_graph(str(self.path / st["bwd"])),
            sig=sig, weights=self.path / st["weights"], consts=self.path / st["consts"],
            zero_bubble=self._zero_bubble(st))

    def _zero_bubble(self, st: dict) -> dict | None:
        """A zero-bubble build's split backward of a stage: its two programs and how they meet."""
        zb = st.get("zero_bubble")
        if not zb:
            return None
        return {**zb, "bwd_input": load_graph(str(self.path / zb["bwd_input"])),
                "bwd_weight": load_graph(str(self.path / zb["bwd_weight"]))}

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
        d = _read_json(p, "calibration")
        if not isinstance(d, dict):
            raise H2Error(f"calibration is not a JSON object (got {type(d).__name__})", str(p))
        cal = Calibration.from_json(d, str(p))
        return cal.select(cal.records)

    def stream(self, worker: int):
        w = self.workers[worker]
        p = self.path / w["stream"]
        return parse_stream(read_user_file(p, "instruction stream", MAX_STREAM_BYTES), file=str(p))

    def model_costs(self):
        g = load_graph(str(self.path / "model.h2ir"))
        return g.layer_costs()


def _read_json(path: Path, what: str):
    """A JSON file of the build, read within the size bound; bad JSON is an error naming the file
    and the spot."""
    text = read_user_file(path, what)
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
            self.string(st, "backend", f"stages[{i}].backend")
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
            self.string(w, "backend", f + ".backend")
            self.file_in_build(w, "stream", f + ".stream")
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
