"""The `.h2plan` text form of a Plan: parse (h2ir/h2plan.lark, LALR) and print.

    # 100B on the 1,024-chip cluster
    model    "examples/llama_100b.py"
    cluster  "h2-1024"
    batch    global=1024 micro=1 seq=4096
    schedule 1f1b
    dp       4
    stage chip=Chip-A chips=32 tp=8 recompute=full layers=embed, 0..17
    stage chip=Chip-B chips=32 tp=8 recompute=none layers=18..95, head
    moe ep=4 placement=balanced a2a=halo migration=periodic(100) capacity=1.25 threshold=1.3
    comm     ccl

A stage may set its own expert-parallel degree (`stage ... ep=2`); without it the moe section's
`ep` applies. `stage ... zero=1` shards the stage's AdamW state over its dp replicas (ZeRO-1). `comm
auto|dicomm|ccl` says which library carries a group whose members share a software stack
(h2ir/planner/collectives.py; auto when absent).
`format_plan` prints the canonical form (the layout above, every option spelled out), and
`parse_plan(format_plan(p)) == p` for every plan that parses. Source positions are kept out of
equality: StagePlan.line / MoEPlan.line and Plan.locations ('stage.1.tp' -> (line, column)) let
h2ir/planner/validate.py point its errors at the text.

This module checks what the text alone can tell (syntax, known words, positive numbers, each
statement once); whether the plan fits the model and cluster is h2ir/planner/validate.py's job.
"""
from __future__ import annotations

import difflib
import functools
import re
from pathlib import Path

from lark import Lark, Token, Tree
from lark.exceptions import UnexpectedInput

from h2ir.errors import H2Error, lark_error, read_user_file
from h2ir.plans.plan import (A2A_ALGOS, COMM_SETTINGS, MIGRATION, PLACEMENTS, RECOMPUTE,
                             SCHEDULES, VIRTUAL_SCHEDULES, ZERO_STAGES, MoEPlan, Plan, StagePlan)

GRAMMAR_PATH = Path(__file__).resolve().parent / "h2plan.lark"

# Bounds that keep parsing linear in the text: a range like 0..10**15 must not expand into a
# list of 10**15 names. No model has anywhere near these many layers.
MAX_NUMBER = 10 ** 18
MAX_BLOCK = 99_999
MAX_LAYER_ENTRIES = 100_000
MAX_TEXT_CHARS = 16 << 20       # lark's parse tree is ~100x its text

_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")
_BLOCK_RE = re.compile(r"block\.(0|[1-9][0-9]*)")

# Plain words for the grammar's named terminals, used in "expected ..." lists (literal ones are
# shown quoted).
_TERMINAL_WORDS = {
    "INT": "a number", "NAME": "a name", "WORD": "a word", "STRING": "a quoted string",
    "BATCH_KEY": "global, micro or seq", "_NL": "end of line",
}


# ----------------------------------------------------------------------------------------------
# public API

def parse_plan(text: str, file: str = "<string>") -> Plan:
    """Parse .h2plan text into a Plan (H2Error with file/line/column on any mistake)."""
    if len(text) > MAX_TEXT_CHARS:
        raise H2Error(f"plan text is larger than {MAX_TEXT_CHARS >> 20} MiB", file=file)
    try:
        tree = _parser().parse(text + "\n")
    except UnexpectedInput as e:
        raise lark_error(e, text, file, _parser().terminals, _TERMINAL_WORDS) from None
    plan = _PlanBuilder(file).build(tree)
    plan.source = file
    return plan


def load_plan(path: str | Path) -> Plan:
    path = Path(path)
    return parse_plan(read_user_file(path, "plan file"), file=str(path))


def format_plan(plan: Plan) -> str:
    """Canonical .h2plan text of `plan`."""
    out = [
        f"model    {_quote(plan.model)}",
        f"cluster  {_quote(plan.cluster)}",
        f"batch    global={plan.global_batch} micro={plan.micro_batch} seq={plan.seq_len}",
        f"schedule {plan.schedule}" + (f" virtual={plan.virtual}" if plan.is_virtual else ""),
        f"dp       {plan.dp}",
    ]
    for s in plan.stages:
        ep = f" ep={s.ep}" if s.ep is not None else ""
        zero = f" zero={s.zero}" if s.zero else ""      # plans without ZeRO print as before
        out.append(f"stage chip={_name_or_quote(s.chip)} chips={s.chips} tp={s.tp}{ep}{zero} "
                   f"recompute={s.recompute} layers={format_layers(s.layers)}")
    if plan.moe is not None:
        m = plan.moe
        migration = m.migration + (f"({m.migration_every})" if m.migration == "periodic" else "")
        cap = "none" if m.capacity is None else format_factor(m.capacity)
        thr = f" threshold={format_factor(m.threshold)}" if m.migration != "none" else ""
        out.append(f"moe ep={m.ep} placement={m.placement} a2a={m.a2a} migration={migration} "
                   f"capacity={cap}{thr}")
    if plan.comm != "auto":                             # plans without it print as before
        out.append(f"comm     {plan.comm}")
    return "\n".join(out) + "\n"


def format_factor(x: float) -> str:
    """A factor as the grammar's FACTOR reads it back to the same float: 1.25, 2.0."""
    text = repr(float(x))
    if "e" in text or "inf" in text or "nan" in text:
        text = f"{float(x):.12f}".rstrip("0")
        text += "0" if text.endswith(".") else ""
    return text


def format_layers(layers: list[str]) -> str:
    """Compact DSL form of a layer list: ['embed', 'block.0', .., 'block.17'] -> 'embed, 0..17'.
    Runs of consecutive blocks become ranges; the list's order is kept exactly."""
    parts: list[str] = []
    run: list[int] = []

    def flush():
        if run:
            parts.append(str(run[0]) if len(run) == 1 else f"{run[0]}..{run[-1]}")
            run.clear()

    for name in layers:
        m = _BLOCK_RE.fullmatch(name)
        if m and int(m[1]) <= MAX_BLOCK:
            i = int(m[1])
            if run and i != run[-1] + 1:
                flush()
            run.append(i)
            continue
        flush()
        parts.append(name if name in ("embed", "head") else _quote(name))
    flush()
    return ", ".join(parts)


# ----------------------------------------------------------------------------------------------
# parsing

@functools.lru_cache(maxsize=1)
def _parser() -> Lark:
    return Lark(GRAMMAR_PATH.read_text(encoding="utf-8"), parser="lalr", lexer="contextual",
                propagate_positions=True, maybe_placeholders=False)


class _PlanBuilder:
    """Walks the parse tree; checks what needs more than the grammar (each statement once,
    required options, known words, positive numbers)."""

    def __init__(self, file: str):
        self.file = file
        self.locations: dict[str, tuple[int, int]] = {}
        self.first_line: dict[str, int] = {}
        self.layer_entries = 0

    def fail(self, message: str, at=None, hint: str | None = None):
        line = col = None
        if isinstance(at, Token):
            line, col = at.line, at.column
        elif isinstance(at, Tree):
            line, col = at.meta.line, at.meta.column
        elif isinstance(at, tuple):
            line, col = at
        raise H2Error(message, file=self.file, line=line, col=col, hint=hint)

    def build(self, tree: Tree) -> Plan:
        values: dict = {}
        stages: list[StagePlan] = []
        moe = None
        for stmt in tree.children:
            kind = str(stmt.data)
            if kind != "stage":
                if kind in self.first_line:
                    self.fail(f"second '{kind}' statement (the first is on line "
                              f"{self.first_line[kind]}); each may appear once", stmt)
                self.first_line[kind] = stmt.meta.line
                self.locations[kind] = (stmt.meta.line, stmt.meta.column)
            if kind in ("model", "cluster"):
                values[kind] = self.text(stmt.children[0])
            elif kind == "batch":
                values.update(self.batch(stmt))
            elif kind == "schedule":
                values["schedule"] = self.word(stmt.children[0], SCHEDULES, "schedule")
                if len(stmt.children) > 1:
                    if values["schedule"] not in VIRTUAL_SCHEDULES:
                        self.fail(f"virtual= applies to the virtual-stage schedules "
                                  f"({', '.join(VIRTUAL_SCHEDULES)}), not "
                                  f"{values['schedule']}", stmt.children[1])
                    values["virtual"] = self.positive(stmt.children[1], "virtual")
                    if values["virtual"] < 2:
                        self.fail("virtual= must be at least 2 (chunks per worker)",
                                  stmt.children[1])
                elif values["schedule"] in VIRTUAL_SCHEDULES:
                    values["virtual"] = 2
            elif kind == "dp":
                values["dp"] = self.positive(stmt.children[0], "dp")
            elif kind == "stage":
                stages.append(self.stage(stmt, len(stages)))
            elif kind == "moe":
                moe = self.moe(stmt)
            elif kind == "comm":
                values["comm"] = self.word(stmt.children[0], COMM_SETTINGS, "comm setting")
        for kind, example in (("model", 'model "examples/tiny_gpt.py"'),
                              ("cluster", 'cluster "local"'),
                              ("batch", "batch global=8 micro=1 seq=128")):
            if kind not in self.first_line:
                self.fail(f"missing '{kind}' statement", hint=f"e.g. {example}")
        if not stages:
            self.fail("missing 'stage' statements: a plan needs at least one stage",
                      hint="e.g. stage chip=cpu-torch chips=1 layers=embed, 0..3, head")
        return Plan(model=values["model"], cluster=values["cluster"],
                    global_batch=values["global"], micro_batch=values["micro"],
                    seq_len=values["seq"], stages=stages, dp=values.get("dp", 1),
                    schedule=values.get("schedule", "1f1b"), moe=moe,
                    virtual=values.get("virtual", 1), comm=values.get("comm", "auto"),
                    locations=self.locations)

    def batch(self, stmt: Tree) -> dict:
        got: dict = {}
        for opt in stmt.children:
            key_tok, num = opt.children
            key = str(key_tok)
            if key in got:
                self.fail(f"batch option '{key}' given twice", key_tok)
            got[key] = self.positive(num, f"batch {key}")
            self.locations[f"batch.{key}"] = (key_tok.line, key_tok.column)
        missing = [k for k in ("global", "micro", "seq") if k not in got]
        if missing:
            self.fail("batch needs global=, micro= and seq= (missing "
                      + ", ".join(f"{k}=" for k in missing) + ")", stmt)
        return got

    def stage(self, stmt: Tree, index: int) -> StagePlan:
        prefix = f"stage.{index}"
        self.locations[prefix] = (stmt.meta.line, stmt.meta.column)
        got: dict = {}
        for key, opt in self.options(stmt, prefix, "stage", got):
            if key == "chip":
                got[key] = self.text(opt.children[0])
            elif key in ("chips", "tp", "ep"):
                got[key] = self.positive(opt.children[0], key)
            elif key == "recompute":
                got[key] = self.word(opt.children[0], RECOMPUTE, "recompute")
            elif key == "zero":
                got[key] = self.number(opt.children[0])
                if got[key] not in ZERO_STAGES:
                    self.fail(f"zero={got[key]}: expected 0 (AdamW state on every replica) or 1 "
                              "(ZeRO-1: AdamW state sharded over the stage's dp replicas)",
                              opt.children[0])
            elif key == "layers":
                got[key] = self.layers(opt)
        missing = [k for k in ("chip", "chips", "layers") if k not in got]
        if missing:
            self.fail("stage needs chip=, chips= and layers= (missing "
                      + ", ".join(f"{k}=" for k in missing) + ")", stmt)
        return StagePlan(chip=got["chip"], chips=got["chips"], layers=got["layers"],
                         tp=got.get("tp", 1), recompute=got.get("recompute", "none"),
                         ep=got.get("ep"), zero=got.get("zero", 0), line=stmt.meta.line)

    def options(self, stmt: Tree, prefix: str, what: str, got: dict):
        """(key, option) of a statement's `key=value` options, each located; an option already
        in `got` (the values read so far) is an error."""
        for opt in stmt.children:
            key = str(opt.data)
            if key in got:
                self.fail(f"{what} option '{key}' given twice", opt)
            self.locations[f"{prefix}.{key}"] = (opt.meta.line, opt.meta.column)
            yield key, opt

    def layers(self, opt: Tree) -> list[str]:
        names: list[str] = []
        for item in opt.children:
            if item.data == "layer_range":
                lo_tok, hi_tok = item.children
                lo, hi = self.block_index(lo_tok), self.block_index(hi_tok)
                if hi < lo:
                    self.fail(f"empty layer range {lo}..{hi}: a range runs low..high, inclusive",
                              lo_tok)
                self.count(hi - lo + 1, lo_tok)
                new = [f"block.{i}" for i in range(lo, hi + 1)]
            elif item.data == "layer_block":
                self.count(1, item.children[0])
                new = [f"block.{self.block_index(item.children[0])}"]
            else:
                self.count(1, item.children[0])
                new = [self.text(item)]
            names.extend(new)
        return names

    def count(self, n: int, at) -> None:
        self.layer_entries += n
        if self.layer_entries > MAX_LAYER_ENTRIES:
            self.fail(f"too many layer entries (more than {MAX_LAYER_ENTRIES:,})", at)

    def block_index(self, tok: Token) -> int:
        i = self.number(tok)
        if i < 0 or i > MAX_BLOCK:
            self.fail(f"block index {i} out of range: expected 0..{MAX_BLOCK}", tok)
        return i

    def moe(self, stmt: Tree) -> MoEPlan:
        got: dict = {}
        for key, opt in self.options(stmt, "moe", "moe", got):
            if key == "ep":
                got[key] = self.positive(opt.children[0], "ep")
            elif key == "placement":
                got[key] = self.word(opt.children[0], PLACEMENTS, "expert placement")
            elif key == "a2a":
                got[key] = self.word(opt.children[0], A2A_ALGOS, "all-to-all algorithm")
            elif key == "migration":
                word_tok = opt.children[0]
                got[key] = self.word(word_tok, MIGRATION, "migration policy")
                every = opt.children[1] if len(opt.children) > 1 else None
                if got[key] == "periodic":
                    if every is None:
                        self.fail("migration=periodic needs an interval in steps, "
                                  "e.g. migration=periodic(100)", word_tok)
                    got["every"] = self.positive(every, "migration interval")
                elif every is not None:
                    self.fail("migration=none takes no interval", every)
            elif key == "capacity":
                tok = opt.children[0]
                got[key] = None if str(tok) == "none" else self.factor(tok, "capacity factor")
            elif key == "threshold":
                tok = opt.children[0]
                if str(tok) == "none":
                    self.fail("threshold needs a number (max/mean expert load), e.g. "
                              "threshold=1.3", tok)
                got[key] = self.factor(tok, "migration threshold")
                if got[key] < 1.0:
                    self.fail(f"migration threshold must be at least 1.0 (max/mean load), got "
                              f"{tok}", tok)
        return MoEPlan(ep=got.get("ep", 1), placement=got.get("placement", "contiguous"),
                       a2a=got.get("a2a", "flat"), migration=got.get("migration", "none"),
                       migration_every=got.get("every", 0), capacity=got.get("capacity"),
                       threshold=got.get("threshold", 1.3), line=stmt.meta.line)

    # -- leaves

    def number(self, tok: Token) -> int:
        digits = tok.lstrip("-")
        if len(digits) > 19 or int(tok) > MAX_NUMBER or int(tok) < -MAX_NUMBER:
            self.fail(f"number {tok[:24]}{'...' if len(tok) > 24 else ''} is too large "
                      f"(at most 10^18)", tok)
        return int(tok)

    def factor(self, tok: Token, what: str) -> float:
        if len(tok) > 24:
            self.fail(f"{what} {tok[:24]}... is too long a number", tok)
        v = float(tok)
        if not 0 < v <= 1e6:
            self.fail(f"{what} must be a positive number up to 10^6, got {tok}", tok)
        return v

    def positive(self, tok: Token, what: str) -> int:
        v = self.number(tok)
        if v < 1:
            self.fail(f"{what} must be a positive integer, got {v}", tok)
        return v

    def word(self, tok: Token, allowed: tuple, what: str) -> str:
        w = str(tok)
        if w not in allowed:
            close = difflib.get_close_matches(w, allowed, n=1)
            self.fail(f"unknown {what} '{w}'; expected one of: {', '.join(allowed)}", tok,
                      hint=f"did you mean '{close[0]}'?" if close else None)
        return w

    def text(self, tree: Tree) -> str:
        tok = tree.children[0]
        return self.unquote(tok) if tok.type == "STRING" else str(tok)

    def unquote(self, tok: Token) -> str:
        body = tok[1:-1]
        out = []
        i = 0
        while i < len(body):
            c = body[i]
            if c == "\\":
                nxt = body[i + 1]            # the STRING pattern never ends on a lone backslash
                if nxt not in _UNESCAPE:
                    self.fail(f"unknown escape '\\{nxt}' in string; expected one of "
                              + ", ".join("\\" + k for k in _UNESCAPE), (tok.line, tok.column + 1 + i))
                out.append(_UNESCAPE[nxt])
                i += 2
            else:
                out.append(c)
                i += 1
        return "".join(out)


_UNESCAPE = {"\\": "\\", '"': '"', "n": "\n", "t": "\t"}
_ESCAPE = {v: "\\" + k for k, v in _UNESCAPE.items()}


def _quote(s: str) -> str:
    return '"' + "".join(_ESCAPE.get(c, c) for c in s) + '"'


def _name_or_quote(s: str) -> str:
    return s if _NAME_RE.fullmatch(s) else _quote(s)
