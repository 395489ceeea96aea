"""The h2ir text form: a printer and a lark parser that round-trip byte for byte.

    h2ir llama_tiny micro_batch=2 seq_len=128
    input %tokens: i64[2,128]
    const %rope_cos: f32[1024,32]

    layer block.0 kind=transformer_block module="layers.0"
      # params 786.7K (3.1 MB) | fwd 403.7 MFLOP | bwd 807.4 MFLOP | act saved 5.8 MB | out 262.1 kB
      param %layers.0.attn_norm.weight: f32[256]
      %pow_1: f32[2,128,256] = pow(%embedding, exponent=2)
      %mm: f32[256,256] = mm(%view, %t)  # 33.6 MFLOP
      ...
    end
    output %mm_56

Every value is typed inline; costs are comments the printer derives from the op set, so a parsed
file prints back identically.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from lark import Lark, Transformer, UnexpectedInput, v_args
from lark.exceptions import VisitError

from h2ir.errors import H2Error, lark_error, read_user_file, too_deep
from h2ir.graph import Graph, Layer, Node, Value, check_node_types
from h2ir.types import MAX_DIM_DIGITS, TensorType

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*\Z")
_KEYWORDS = {"true", "false", "none", "inf", "nan", "input", "const", "param", "layer", "end",
             "output", "h2ir"}


# ---- printing ------------------------------------------------------------------------------------

def fmt_literal(x) -> str:
    if x is True:
        return "true"
    if x is False:
        return "false"
    if x is None:
        return "none"
    if isinstance(x, int):
        return str(x)
    if isinstance(x, float):
        return repr(x) if x == x else "nan"
    if isinstance(x, (list, tuple)):
        return "[" + ", ".join(fmt_literal(v) for v in x) + "]"
    if isinstance(x, str):
        if _IDENT.match(x) and x not in _KEYWORDS:
            return x
        return json.dumps(x)
    raise TypeError(f"cannot print attribute value {x!r}")


def human(n: float, unit: str) -> str:
    for div, p in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= div:
            return f"{n / div:.1f} {p}{unit}"
    return f"{n:.0f} {unit}"


def _kvs(attrs: dict) -> str:
    return "".join(f" {k}={fmt_literal(v)}" for k, v in attrs.items())


def _node_line(n: Node) -> str:
    outs = ", ".join(f"%{v.name}: {v.type}" for v in n.outputs)
    args = [f"%{v.name}" if isinstance(v, Value) else fmt_literal(v) for v in n.inputs]
    args += [f"{k}={fmt_literal(v)}" for k, v in n.attrs.items()]
    line = f"{outs} = {n.op}({', '.join(args)})"
    ins = [v.type if isinstance(v, Value) else v for v in n.inputs]
    flops = n.opdef.flops(ins, [v.type for v in n.outputs], n.attrs)
    if flops:
        line += f"  # {human(flops, 'FLOP')}"
    return line


def print_graph(g: Graph, costs: bool = True) -> str:
    out = [f"h2ir {fmt_literal(g.name)}{_kvs(g.attrs)}"]
    for kw, vals in (("input", g.inputs), ("const", g.consts), ("param", g.params)):
        out += [f"{kw} %{v.name}: {v.type}" for v in vals]
    layer_costs = g.layer_costs().layers if costs else [None] * len(g.layers)
    for layer, c in zip(g.layers, layer_costs):
        out.append("")
        out.append(f"layer {layer.name} kind={fmt_literal(layer.kind)}{_kvs(layer.attrs)}")
        if c is not None:
            out.append(f"  # params {human(c.params, '').strip()} ({human(c.param_bytes, 'B')}) | "
                       f"fwd {human(c.fwd_flops, 'FLOP')} | bwd {human(c.bwd_flops, 'FLOP')} | "
                       f"act saved {human(c.act_saved_bytes, 'B')} | out {human(c.out_bytes, 'B')}")
        out += [f"  param %{p.name}: {p.type}" for p in layer.params]
        out += [f"  {_node_line(n)}" for n in layer.nodes]
        out.append("end")
    out.append("output " + ", ".join(f"%{v.name}" for v in g.outputs))
    return "\n".join(out) + "\n"


# ---- parsing -------------------------------------------------------------------------------------

_GRAMMAR = (Path(__file__).with_name("h2ir.lark")).read_text()
_parser = Lark(_GRAMMAR, parser="lalr", propagate_positions=True, maybe_placeholders=True)

# Plain words for the named terminals in "expected ..." lists (literal ones are shown quoted).
_TOKEN_WORDS = {
    "VAR": "a value like %x", "NAME": "a name", "INT": "an integer", "FLOAT": "a number",
    "DTYPE": "a dtype like f32", "ESCAPED_STRING": "a quoted string",
}


MAX_INT_DIGITS = 64        # attribute integers (dims, sizes, seeds) are far shorter


def _clip(text: str) -> str:
    return text if len(text) <= 24 else f"{text[:10]}...{text[-10:]}"


class _Build(Transformer):
    def __init__(self, file):
        super().__init__()
        self.file = file

    def int(self, t):
        tok = t[0]
        if len(tok) > MAX_INT_DIGITS:
            raise H2Error(f"integer literal of {len(tok):,} digits; at most {MAX_INT_DIGITS}",
                          self.file, tok.line, tok.column)
        return int(tok)

    float = lambda self, t: float(t[0])                                   # noqa: E731
    true = lambda self, _: True                                           # noqa: E731
    false = lambda self, _: False                                         # noqa: E731
    none = lambda self, _: None                                           # noqa: E731
    string = lambda self, t: json.loads(t[0])                             # noqa: E731
    ident = lambda self, t: str(t[0])                                     # noqa: E731

    def list(self, items):
        return [] if items == [None] else list(items)

    def kv(self, t):
        return (str(t[0]), t[1])

    def type(self, t):
        dims = []
        for tok in t[1:]:
            if tok is None:
                continue
            if tok.startswith("-") or len(tok) > MAX_DIM_DIGITS:
                what = "negative" if tok.startswith("-") else f"{len(tok):,} digits long"
                raise H2Error(f"dimension {_clip(tok)} is {what}; a dimension is a whole number "
                              f"of at most {MAX_DIM_DIGITS} digits", self.file, tok.line,
                              tok.column)
            dims.append(int(tok))
        return TensorType(str(t[0]), tuple(dims))

    @v_args(meta=True)
    def vdecl(self, meta, t):
        return (str(t[0])[1:], t[1], meta.line, meta.column)

    @v_args(meta=True)
    def var(self, meta, t):
        return ("var", str(t[0])[1:], meta.line, meta.column)

    def kwarg(self, t):
        return ("kw", str(t[0]), t[1])

    def posarg(self, t):
        # a positional literal, tagged: a literal `none` (an absent optional input, such as a
        # layer norm without weight) must not read as lark's placeholder for an empty arg list
        return ("lit", t[0])


def parse_graph(text: str, file: str = "<string>") -> Graph:
    """Parse h2ir text. Errors are H2Error with file, line, column and what was expected."""
    try:
        tree = _parser.parse(text)
    except UnexpectedInput as e:
        raise lark_error(e, text, file, _parser.terminals, _TOKEN_WORDS) from None
    try:
        tree = _Build(file).transform(tree)
    except RecursionError:          # a literal list nested hundreds deep
        raise too_deep(text, file, "h2ir text") from None
    except VisitError as e:         # lark wraps what a rule raised: a located H2Error
        if isinstance(e.orig_exc, H2Error):
            raise e.orig_exc from None
        if isinstance(e.orig_exc, RecursionError):
            raise too_deep(text, file, "h2ir text") from None
        raise
    return _Resolve(file).graph(tree)


class _Resolve:
    """Turns the parse tree into a Graph: binds names to values, checks types against the op set."""

    def __init__(self, file):
        self.file = file
        self.values: dict[str, Value] = {}

    def define(self, decl) -> Value:
        name, ty, line, col = decl
        if name in self.values:
            raise H2Error(f"value %{name} is defined twice", self.file, line, col)
        v = Value(name, ty)
        self.values[name] = v
        return v

    def use(self, ref) -> Value:
        _, name, line, col = ref
        if name not in self.values:
            raise H2Error(f"value %{name} is used before it is defined", self.file, line, col)
        return self.values[name]

    def graph(self, tree) -> Graph:
        header, *items, output = tree.children
        g = Graph(name=str(header.children[0]), attrs=dict(header.children[1:]))
        for item in items:
            kind = item.data
            if kind in ("input", "const", "param"):
                getattr(g, {"input": "inputs", "const": "consts", "param": "params"}[kind]).append(
                    self.define(item.children[0]))
            elif kind == "layer":
                g.layers.append(self.layer(item))
        for ref in output.children:
            if ref is None:
                continue
            name = str(ref)[1:]
            if name not in self.values:
                raise H2Error(f"output %{name} is not defined", self.file, ref.line, ref.column)
            g.outputs.append(self.values[name])
        return g

    def layer(self, item) -> Layer:
        name, *rest = item.children
        attrs = {}
        layer = Layer(name=str(name), kind="")
        for c in rest:
            if isinstance(c, tuple):
                attrs[c[0]] = c[1]
            elif c.data == "param":
                layer.params.append(self.define(c.children[0]))
            else:
                layer.nodes.append(self.node(c))
        layer.kind = attrs.pop("kind", "")
        if not layer.kind:
            raise H2Error(f"layer {name} has no kind= attribute", self.file, item.meta.line,
                          item.meta.column)
        layer.attrs = attrs
        return layer

    def node(self, c) -> Node:
        from h2ir import opset
        decls = [x for x in c.children if isinstance(x, tuple) and len(x) == 4 and isinstance(x[1], TensorType)]
        op_tok = c.children[len(decls)]
        op = str(op_tok)
        line, col = c.meta.line, c.meta.column
        if op not in opset.OPS:
            raise H2Error(f"unknown op {op!r}; expected an op of the h2ir op set (see h2ir/opset.py)",
                          self.file, op_tok.line, op_tok.column)
        inputs, attrs = [], {}
        for a in c.children[len(decls) + 1:]:
            if a is None:
                continue
            if isinstance(a, tuple) and a[0] == "var":
                inputs.append(self.use(a))
            elif isinstance(a, tuple) and a[0] == "kw":
                attrs[a[1]] = a[2]
            else:
                inputs.append(a[1])
        outputs = [self.define(d) for d in decls]
        n = Node(op, inputs, attrs, outputs)
        try:
            check_node_types(n)
        except ValueError as e:
            raise H2Error(str(e), self.file, line, col) from None
        except (AttributeError, TypeError, IndexError, KeyError):
            # a literal where the op's rule needs a typed value (e.g. `view` for `%view`)
            bad = [repr(a) for a in inputs if not isinstance(a, Value)]
            raise H2Error(f"{op}: its inputs do not fit the op's signature "
                          f"({', '.join(opset.OPS[op].inputs)})"
                          + (f"; {', '.join(bad)} is a literal, expected a value like %name"
                             if bad else ""), self.file, line, col) from None
        return n


MAX_H2IR_BYTES = 64 << 20      # a 100B model's IR is ~0.5 MB; its stage programs a few MB


def load_graph(path: str) -> Graph:
    return parse_graph(read_user_file(path, "h2ir file", MAX_H2IR_BYTES), str(path))
