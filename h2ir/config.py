"""The training job's configuration: one typed tree that `h2c` and `h2x` both read.

Sections (torchtitan's JobConfig layout): model, data, batch, plan, optimizer, lr_schedule,
training, eval, checkpoint, logging, run. Every field has a type, a default, a one-line meaning
and, where it has one, a range or a set of choices; `h2c config` prints them all.

A job is configured by, later winning:
    the defaults below
    < a build's own `train.toml` (written by `h2c compile`: h2x runs what was compiled)
    < `--config FILE.toml`
    < `--section.field VALUE` on the command line (and the short flags that alias fields).
A bad value is an H2Error naming the file, line, section and field and what was expected.

Fields marked `program` decide the compiled stage programs (model, batch shape, plan, seed):
`h2x run` refuses a change to them. The others (optimizer, schedule, clipping, steps, data,
eval, checkpoint, logging) may change between runs of one build, checkpoints included.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import re
import tomllib
from dataclasses import dataclass, field
from typing import Any

from h2ir.plans.plan import SCHEDULES as PIPELINE_SCHEDULES
from h2ir.errors import (MAX_GLOBAL_BATCH, MAX_MICRO_BATCH, MAX_SEQ_LEN, SEED_MAX, H2Error,
                         read_user_file)

MAX_STEPS = 10 ** 12
SCHEDULES = ("constant", "linear", "cosine", "wsd")
NAN_POLICIES = ("stop", "skip")


def _f(default, doc: str, *, lo=None, hi=None, choices=None, program: bool = False,
       optional: bool = False, kind: str | None = None):
    """A field: its default, meaning, bounds/choices; `program`: the stage programs depend on
    it; `optional`: None is allowed ("none" on the command line); `kind`: 'list[float]',
    'list[str]', 'table', 'sources' for the structured fields."""
    meta = {"doc": doc, "lo": lo, "hi": hi, "choices": choices, "program": program,
            "optional": optional, "kind": kind}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class Model:
    file: str = _f("", "the model file (.py defining build_model)", program=True)
    args: dict = _f({}, "keyword arguments of build_model (a TOML table)", program=True,
                    kind="table")


@dataclass
class Init:
    from_: str = _f(None, "initial weights from a pretrained checkpoint: a transformers "
                    "directory (config.json + safetensors) for a transformers model file, else "
                    "a directory with model.safetensors under the model's own names; none: "
                    "random with training.seed", optional=True, program=True)


@dataclass
class Data:
    path: str = _f(None, "training data: a text file or directory, or a token file "
                   "(.bin/.u16/.u32); none: the Python standard library's sources", optional=True)
    format: str = _f("auto", "how to read it", choices=("auto", "text", "bytes", "tokens-u16",
                                                        "tokens-u32"))
    tokenizer: str = _f(None, "the model's tokenizer.json, for text data", optional=True)
    max_bytes: int = _f(4 << 20, "read at most this many bytes of text", lo=2, hi=1 << 40)
    sources: list = _f([], "a blend instead of `path`: [{path=..., weight=0.7, format=...}, ...]",
                       kind="sources")
    eod_token: int = _f(None, "end-of-document id appended after each text file (none: the "
                        "tokenizer's own, if it has one)", lo=0, hi=1 << 32, optional=True)
    shuffle: bool = _f(True, "visit the windows of each epoch in a seeded shuffled order")
    packing: str = _f("concat", "concat: windows pack across documents (causal attention over "
                      "the whole window); document: every window inside one document, so "
                      "attention never crosses a document boundary (needs an eod id)",
                      choices=("concat", "document"))


@dataclass
class Batch:
    global_: int = _f(16, "sequences per optimizer step (all replicas)", lo=1,
                      hi=MAX_GLOBAL_BATCH, program=True)
    micro: int = _f(None, "sequences per micro-batch (none: the plan search chooses)", lo=1,
                    hi=MAX_MICRO_BATCH, program=True, optional=True)
    seq: int = _f(128, "tokens per sequence", lo=1, hi=MAX_SEQ_LEN, program=True)


@dataclass
class Plan:
    cluster: str = _f("local", "cluster TOML file or built-in name", program=True)
    plan: str = _f("auto", "auto | uniform | FILE.h2plan", program=True)
    schedule: str = _f("1f1b", "pipeline schedule", program=True,
                       choices=(*PIPELINE_SCHEDULES, "auto"))
    search: str = _f("heuristic", "HeteroAuto's search", choices=("heuristic", "exhaustive"),
                     program=True)
    time_limit: float = _f(None, "stop the plan search after this many seconds", lo=0.0,
                           optional=True)
    output: str = _f("build", "the build directory h2c compile writes")


@dataclass
class Optimizer:
    name: str = _f("adamw", "the optimizer", choices=("adamw",))
    lr: float = _f(1e-3, "peak learning rate", lo=0.0, hi=1e6)
    beta1: float = _f(0.9, "AdamW beta1", lo=0.0, hi=1.0)
    beta2: float = _f(0.95, "AdamW beta2", lo=0.0, hi=1.0)
    eps: float = _f(1e-8, "AdamW epsilon", lo=0.0, hi=1.0)
    weight_decay: float = _f(0.1, "decoupled weight decay", lo=0.0, hi=1e3)
    no_decay_1d: bool = _f(True, "exclude every 1-D parameter (biases, norm weights) from "
                           "weight decay (Megatron-Core's default)")
    no_decay: list = _f(["bias", "norm"], "also exclude parameters whose name has one of these "
                        "words (a dotted component contains it)", kind="list[str]")


@dataclass
class LRSchedule:
    kind: str = _f("constant", "constant | linear | cosine | wsd (warmup-stable-decay)",
                   choices=SCHEDULES)
    warmup_steps: int = _f(0, "linear warmup from lr/warmup_steps to lr", lo=0, hi=MAX_STEPS)
    decay_steps: int = _f(None, "linear/cosine: steps of decay after warmup (none: to "
                          "training.steps); wsd: the final decay's length (none: 10 % of "
                          "training.steps)", lo=1, hi=MAX_STEPS, optional=True)
    min_lr: float = _f(0.0, "the lr at the end of decay", lo=0.0, hi=1e6)


@dataclass
class Training:
    steps: int = _f(20, "train until this step", lo=1, hi=MAX_STEPS)
    seed: int = _f(0, "initial weights and data order", lo=0, hi=SEED_MAX, program=True)
    clip_grad_norm: float = _f(0.0, "clip gradients to this global L2 norm (0: off)", lo=0.0)
    nan_policy: str = _f("stop", "a non-finite loss or gradient norm: stop the run, or skip "
                         "the step", choices=NAN_POLICIES)
    max_skipped: int = _f(5, "with nan_policy = skip: stop after this many skipped steps in "
                          "a row", lo=1, hi=MAX_STEPS)


@dataclass
class Eval:
    data: str = _f(None, "held-out data (same forms as data.path); none: no evaluation",
                   optional=True)
    format: str = _f("auto", "how to read it", choices=("auto", "text", "bytes", "tokens-u16",
                                                        "tokens-u32"))
    every: int = _f(0, "evaluate every this many steps (0: only at the end)", lo=0,
                    hi=MAX_STEPS)
    steps: int = _f(1, "global batches of held-out data per evaluation", lo=1, hi=1 << 20)


@dataclass
class Checkpoint:
    every: int = _f(0, "save every this many steps (0: never)", lo=0, hi=MAX_STEPS)
    dir: str = _f(None, "where checkpoints go (none: BUILD/ckpt)", optional=True)
    resume: str = _f("no", "no | yes (the newest sound checkpoint) | auto (if there is one)",
                     choices=("no", "yes", "auto"))
    keep_last: int = _f(0, "keep the newest this many complete checkpoints, delete older ones "
                        "(0: keep all)", lo=0, hi=1 << 20)


@dataclass
class Logging:
    json_log: str = _f(None, "one JSON object per step to this file", optional=True)
    trace: str = _f(None, "the measured Chrome/Perfetto trace to this file", optional=True)
    tensorboard: str = _f(None, "TensorBoard scalars to this directory (needs the "
                          "tensorboard package)", optional=True)


@dataclass
class Run:
    transport: str = _f("shm", "between the workers of one host", choices=("tcp", "shm", "rdma"))
    strict_transport: bool = _f(False, "refuse to run if the transport is unavailable")
    timeout: float = _f(10.0, "communication timeout, seconds", lo=1e-3, hi=7 * 24 * 3600.0)
    device: str = _f(None, "torch device for torch-backend stages (none: as compiled)",
                     optional=True)
    device_map: str = _f(None, "per-worker torch devices, e.g. \"w0=cuda:1,w1=cuda:0\"; "
                         "\"w0+w1=cuda:0\" shares one on purpose (none: as compiled)",
                         optional=True)


SECTIONS: dict[str, type] = {
    "model": Model, "init": Init, "data": Data, "batch": Batch, "plan": Plan, "optimizer": Optimizer,
    "lr_schedule": LRSchedule, "training": Training, "eval": Eval, "checkpoint": Checkpoint,
    "logging": Logging, "run": Run,
}


def _key(f: dataclasses.Field) -> str:
    return f.name.rstrip("_")           # `global_`: `global` in TOML and on the command line


@dataclass
class Config:
    model: Model = field(default_factory=Model)
    init: Init = field(default_factory=Init)
    data: Data = field(default_factory=Data)
    batch: Batch = field(default_factory=Batch)
    plan: Plan = field(default_factory=Plan)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_schedule: LRSchedule = field(default_factory=LRSchedule)
    training: Training = field(default_factory=Training)
    eval: Eval = field(default_factory=Eval)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    logging: Logging = field(default_factory=Logging)
    run: Run = field(default_factory=Run)

    def to_dict(self, sections=None) -> dict:
        out = {}
        for s in sections or SECTIONS:
            sec = getattr(self, s)
            out[s] = {_key(f): getattr(sec, f.name) for f in dataclasses.fields(sec)}
        return out

    def set(self, section: str, key: str, value, where: "Where") -> None:
        """Set one field from a parsed value (TOML or command line), checked."""
        f = _field(section, key, where)
        setattr(getattr(self, section), f.name, check_value(section, f, value, where))

    def to_toml(self, sections=None) -> str:
        """The configuration as TOML text (every field; a None is left out, so it reads back
        as its default None)."""
        lines = []
        for s, vals in self.to_dict(sections).items():
            lines.append(f"[{s}]")
            for k, v in vals.items():
                if v is None:
                    continue
                lines.append(f"{k} = {_toml_value(v)}")
            lines.append("")
        return "\n".join(lines)

    def check(self, file: str | None = None) -> None:
        """Constraints between fields (each field's own bounds are checked when it is set)."""
        if self.lr_schedule.min_lr > self.optimizer.lr:
            raise H2Error(f"lr_schedule.min_lr ({self.lr_schedule.min_lr:g}) is above "
                          f"optimizer.lr ({self.optimizer.lr:g}): the schedule would raise the lr",
                          file)
        if self.data.path and self.data.sources:
            raise H2Error("data.path and data.sources are both set: give one (a single path, "
                          "or a blend of sources)", file)

    def recipe(self) -> dict:
        """What the workers need of the training recipe (JSON): optimizer, schedule, steps,
        clipping and the NaN policy."""
        d = self.to_dict(("optimizer", "lr_schedule", "training"))
        return d


# ---- values -----------------------------------------------------------------------------------

class Where:
    """Where a value came from, for errors: a file and line, or a command-line flag."""

    def __init__(self, file: str | None = None, line: int | None = None, flag: str | None = None):
        self.file, self.line, self.flag = file, line, flag

    def fail(self, message: str, hint: str | None = None):
        if self.flag and not message.startswith(self.flag.lstrip("-").split(".")[0]):
            message = f"{self.flag}: {message}"
        raise H2Error(message, self.file, self.line, hint=hint)


def _field(section: str, key: str, where: Where) -> dataclasses.Field:
    """The field `section.key`, or a located error suggesting the nearest name."""
    cls = SECTIONS.get(section)
    if cls is None:
        where.fail(f"unknown section [{section}]", _suggest(section, SECTIONS))
    fields = {_key(f): f for f in dataclasses.fields(cls)}
    if key not in fields:
        where.fail(f"unknown field {section}.{key}", _suggest(key, fields))
    return fields[key]


def _suggest(word: str, choices) -> str | None:
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f"did you mean '{close[0]}'?" if close else \
        f"expected one of: {', '.join(choices)}"


def _type_name(f: dataclasses.Field) -> str:
    kind = f.metadata.get("kind")
    if kind:
        return {"table": "a table", "sources": "a list of tables", "list[str]": "a list of "
                "strings", "list[float]": "a list of numbers"}[kind]
    t = type(f.default) if f.default is not None else None
    if t is None:
        t = {"eod_token": int, "micro": int, "decay_steps": int, "time_limit": float}.get(
            f.name, str)
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[t]


def _base_type(f: dataclasses.Field):
    if f.metadata.get("kind"):
        return None
    if f.default is not None:
        return type(f.default)
    return {"eod_token": int, "micro": int, "decay_steps": int, "time_limit": float}.get(
        f.name, str)


def check_value(section: str, f: dataclasses.Field, v, where: Where):
    """`v` as field `f`'s type, within its bounds; else a located error."""
    m = f.metadata
    name = f"{section}.{_key(f)}"
    if v is None:
        if m["optional"]:
            return None
        where.fail(f"{name} cannot be none; expected {_type_name(f)}")
    kind = m.get("kind")
    if kind == "table":
        if not isinstance(v, dict):
            where.fail(f"{name}: expected a table, got {_show(v)}")
        return dict(v)
    if kind == "sources":
        if not isinstance(v, list) or not all(isinstance(x, dict) for x in v):
            where.fail(f"{name}: expected a list of tables like {{path = \"a.bin\", weight = "
                       f"0.7}}, got {_show(v)}")
        allowed = {"path", "weight", "format", "max_bytes"}
        for i, src in enumerate(v):
            bad = set(src) - allowed
            if bad:
                where.fail(f"{name}[{i}]: unknown key {sorted(bad)[0]!r}",
                           f"expected keys: {', '.join(sorted(allowed))}")
            if not isinstance(src.get("path"), str):
                where.fail(f"{name}[{i}]: expected path = \"FILE\" (a string)")
            w = src.get("weight", 1.0)
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not \
                    (_finite(w) and w > 0):
                where.fail(f"{name}[{i}].weight: expected a number > 0, got {_show(w)}")
        return [dict(x) for x in v]
    if kind in ("list[str]", "list[float]"):
        want = str if kind == "list[str]" else (int, float)
        if not isinstance(v, list) or not all(isinstance(x, want) and not isinstance(x, bool)
                                              for x in v):
            where.fail(f"{name}: expected {_type_name(f)}, got {_show(v)}")
        if kind == "list[float]" and not all(_finite(x) for x in v):
            where.fail(f"{name}: expected finite numbers, got {_show(v)}")
        return list(v)
    t = _base_type(f)
    if t is bool:
        if not isinstance(v, bool):
            where.fail(f"{name}: expected true or false, got {_show(v)}")
    elif t is int:
        if isinstance(v, bool) or not isinstance(v, int):
            where.fail(f"{name}: expected an integer, got {_show(v)}")
    elif t is float:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            where.fail(f"{name}: expected a number, got {_show(v)}")
        if not _finite(v):
            where.fail(f"{name}: expected a finite number, got {_show(v)}")
        v = float(v)
    elif t is str:
        if not isinstance(v, str):
            where.fail(f"{name}: expected a string, got {_show(v)}")
    if m["choices"] and v not in m["choices"]:
        where.fail(f"{name}: expected one of {', '.join(m['choices'])}, got {_show(v)}")
    if m["lo"] is not None and v < m["lo"]:
        where.fail(f"{name}: must be ≥ {_bound(m['lo'])}, got {_show(v)}")
    if m["hi"] is not None and v > m["hi"]:
        where.fail(f"{name}: must be ≤ {_bound(m['hi'])}, got {_show(v)}")
    return v


def _finite(v) -> bool:
    """A finite float, or an integer a float can hold (TOML integers have no size limit)."""
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


def _bound(v) -> str:
    if isinstance(v, int):
        return str(v) if v < 10 ** 6 else f"2**{v.bit_length() - 1}" if v & (v - 1) == 0 \
            else f"{v:.0e}"
    return f"{v:g}"


def _show(v) -> str:
    if isinstance(v, int) and v.bit_length() > 1000:
        return f"a {len(str(abs(v))) if v.bit_length() < 13000 else 'several-thousand'}-digit number"
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"no TOML form for {v!r}")


def _toml_key(k: str) -> str:
    return k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else _toml_value(k)


def parse_cli_value(section: str, key: str, text: str, flag: str):
    """A `--section.field VALUE` string as the field's type: TOML syntax for numbers, booleans,
    lists and tables; a plain string as itself; `none` for an optional field."""
    where = Where(flag=flag)
    f = _field(section, key, where)
    if text.strip().lower() == "none" and f.metadata["optional"]:
        return None
    if _base_type(f) is str:
        return text
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except ValueError:              # TOMLDecodeError, or a number past the digit limit
        where.fail(f"expected {_type_name(f)}, got {_show(text)}")


# ---- files and command lines ------------------------------------------------------------------

def _field_line(text: str, section: str, key: str) -> int | None:
    """The line of `key = ...` under `[section]` ("" before any) in TOML text (best effort)."""
    cur = ""
    for i, line in enumerate(text.splitlines(), 1):
        s = line.strip()
        m = re.fullmatch(r"\[\s*([A-Za-z0-9_.-]+)\s*\]\s*(#.*)?", s)
        if m:
            cur = m.group(1)
            continue
        if cur == section and re.match(rf"{re.escape(key)}\s*=", s):
            return i
    return None


def apply_toml(cfg: Config, path: str, only=None) -> Config:
    """Set `cfg`'s fields from a TOML file (`only`: sections to take; others are ignored)."""
    text = read_user_file(path, "the config file")
    try:
        doc = tomllib.loads(text)
    except ValueError as e:         # a number past Python's digit limit: no position given
        if not isinstance(e, tomllib.TOMLDecodeError):
            line = next((i for i, ln in enumerate(text.splitlines(), 1)
                         if re.search(r"\d{4000}", ln)), None)
            raise H2Error("not valid TOML: a number with thousands of digits", path, line) \
                from None
        m = re.search(r"\(at line (\d+), column (\d+)\)", str(e))
        msg = re.sub(r"\s*\(at line \d+, column \d+\)", "", str(e))
        raise H2Error(f"not valid TOML: {msg}", path, int(m.group(1)) if m else None,
                      int(m.group(2)) if m else None) from None
    for section, vals in doc.items():
        if not isinstance(vals, dict):
            Where(path, _field_line(text, "", section)).fail(
                f"top-level key {section!r}: expected a [section] table",
                f"sections: {', '.join(SECTIONS)}")
        if only is not None and section not in only:
            continue
        for key, v in vals.items():
            cfg.set(section, key, v, Where(path, _field_line(text, section, key)))
    return cfg


OVERRIDE = re.compile(r"--([a-z_]+)\.([a-z_0-9]+)(?:=(.*))?$", re.S)


def split_overrides(argv: list[str]) -> tuple[list[str], list[tuple[str, str, str, str]]]:
    """(argv without them, [(section, field, value text, flag)]) for `--section.field VALUE`
    and `--section.field=VALUE`."""
    rest, out = [], []
    i = 0
    while i < len(argv):
        m = OVERRIDE.match(argv[i])
        if m:
            if m.group(3) is not None:
                out.append((m.group(1), m.group(2), m.group(3), argv[i].split("=")[0]))
            else:
                if i + 1 >= len(argv):
                    raise H2Error(f"{argv[i]}: expected a value after it")
                out.append((m.group(1), m.group(2), argv[i + 1], argv[i]))
                i += 1
        else:
            rest.append(argv[i])
        i += 1
    return rest, out


def build_config(*, base: Config | None = None, base_file: str | None = None,
                 config_file: str | None = None, overrides=(), aliases: dict | None = None,
                 only=None) -> Config:
    """defaults < base_file (a build's train.toml) < config_file < overrides and aliases
    ({(section, field): value} from short flags). `only` limits the sections files may set."""
    cfg = base or Config()
    if base_file:
        apply_toml(cfg, base_file)
    if config_file:
        apply_toml(cfg, config_file, only)
    for (section, key), v in (aliases or {}).items():
        cfg.set(section, key, v, Where(flag=f"--{section}.{key}"))
    for section, key, text, flag in overrides:
        cfg.set(section, key, parse_cli_value(section, key, text, flag), Where(flag=flag))
    cfg.check(config_file)
    return cfg


def program_differences(built: Config, wanted: Config) -> list[str]:
    """The `program` fields whose values differ: '(section.field: built X, asked Y)'; a model
    file counts as the same when both names resolve to one file."""
    import os
    out = []
    for s, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            if f.metadata.get("program"):
                a, b = getattr(getattr(built, s), f.name), getattr(getattr(wanted, s), f.name)
                if f.name == "file" and a and b and os.path.realpath(a) == os.path.realpath(b):
                    continue
                if a != b:
                    out.append(f"{s}.{_key(f)}: built {_show(a)}, asked {_show(b)}")
    return out


def describe() -> str:
    """Every field: name, type, default, meaning (h2c config)."""
    rows = []
    for s, cls in SECTIONS.items():
        rows.append(f"[{s}]")
        for f in dataclasses.fields(cls):
            m = f.metadata
            d = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            bound = ""
            if m["choices"]:
                bound = " (" + " | ".join(m["choices"]) + ")"
            elif m["lo"] is not None or m["hi"] is not None:
                lo = "" if m["lo"] is None else _bound(m["lo"])
                hi = "" if m["hi"] is None else _bound(m["hi"])
                bound = f" [{lo}..{hi}]"
            tag = "  [program]" if m["program"] else ""
            shown = "none" if d is None else _toml_value(d)
            rows.append(f"  {_key(f):<16} = {shown:<20} {m['doc']}{bound}{tag}")
        rows.append("")
    rows.append("[program]: the compiled stage programs depend on it; h2x run refuses a change "
                "(recompile). Every other field may change between runs of a build.")
    rows.append("Set fields in a TOML file (--config FILE) or as --section.field VALUE.")
    return "\n".join(rows) + "\n"


# ---- the learning-rate schedule ---------------------------------------------------------------

def lr_factor(sched: dict, step: int, total: int, lr: float) -> float:
    """The multiplier of the peak lr at optimizer step `step` (0-based) of `total` — the
    LambdaLR lambda: linear warmup (step+1)/warmup, then constant, linear or cosine decay to
    min_lr, or warmup-stable-decay (constant, then linear decay over the last decay_steps)."""
    kind, warm = sched["kind"], int(sched.get("warmup_steps") or 0)
    floor = (float(sched.get("min_lr") or 0.0) / lr) if lr > 0 else 0.0
    if step < warm:
        return (step + 1) / warm
    if kind == "constant":
        return 1.0
    decay = sched.get("decay_steps")
    if kind == "wsd":
        decay = int(decay) if decay else max(1, total // 10)
        start = max(warm, total - decay)
        if step < start:
            return 1.0
        p = min(1.0, (step - start + 1) / decay)
        return 1.0 - (1.0 - floor) * p
    decay = int(decay) if decay else max(1, total - warm)
    p = min(1.0, (step - warm) / decay)
    if kind == "linear":
        return 1.0 - (1.0 - floor) * p
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * p))     # cosine


def learning_rate(recipe: dict, step: int) -> float:
    lr = float(recipe["optimizer"]["lr"])
    return lr * lr_factor(recipe["lr_schedule"], step, int(recipe["training"]["steps"]), lr)


def decays(name: str, ndim: int, opt: dict) -> bool:
    """Whether parameter `name` (of `ndim` dimensions) is weight-decayed under `opt`."""
    if opt.get("no_decay_1d", True) and ndim <= 1:
        return False
    words = [w.lower() for w in opt.get("no_decay") or []]
    parts = name.lower().split(".")
    return not any(w in p for w in words for p in parts)
