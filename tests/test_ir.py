"""h2ir: op set, typed graph, text form that round-trips, parse errors with locations."""
import pytest

from h2ir import opset
from h2ir.errors import H2Error
from h2ir.text import parse_graph, print_graph
from h2ir.types import TensorType


def test_round_trip_tiny_model(tiny_graph):
    text = print_graph(tiny_graph)
    again = print_graph(parse_graph(text))
    assert again == text
    assert "layer block.1 kind=transformer_block" in text
    assert "%tokens: i64[2,32]" in text


def test_parsed_graph_has_same_costs(tiny_graph):
    parsed = parse_graph(print_graph(tiny_graph))
    assert parsed.layer_costs() == tiny_graph.layer_costs()


SMALL = """h2ir toy micro_batch=1
input %x: f32[4,8]
layer block.0 kind=transformer_block
  param %w: f32[8,16]
  %y: f32[4,16] = mm(%x, %w)
  %z: f32[4,16] = mul(%y, 0.5)
end
output %z
"""


def test_small_text_round_trips_and_costs():
    g = parse_graph(SMALL)
    assert print_graph(parse_graph(print_graph(g))) == print_graph(g)
    c = g.layer_costs().layers[0]
    assert c.fwd_flops == 2 * 4 * 8 * 16 + 4 * 16
    assert c.params == 128
    # mm saves x for w's gradient (an activation, 4*8*4 B) and w for x's (a parameter, not
    # counted); a product with a constant saves nothing (d(0.5 y)/dy needs no y)
    assert c.act_saved_bytes == 4 * 8 * 4
    mul2 = parse_graph(SMALL.replace("mul(%y, 0.5)", "mul(%y, %y)"))
    assert mul2.layer_costs().layers[0].act_saved_bytes == 4 * 8 * 4 + 4 * 16 * 4


@pytest.mark.parametrize("bad, line, words", [
    (SMALL.replace("= mm(", "= mm("[:-1] + "["), 5, "expected"),
    (SMALL.replace("%z: f32[4,16] = mul", "%z: f32[4,17] = mul"), 6, "f32[4,16]"),
    (SMALL.replace("mm(%x, %w)", "mm(%x, %nope)"), 5, "%nope"),
    (SMALL.replace("= mul(", "= frobnicate("), 6, "frobnicate"),
    (SMALL.replace("end\n", ""), 7, "expected 'end'"),
])
def test_parse_errors_name_line_and_expectation(bad, line, words):
    with pytest.raises(H2Error) as e:
        parse_graph(bad, "toy.h2ir")
    assert e.value.file == "toy.h2ir"
    assert e.value.line == line, str(e.value)
    assert words in str(e.value)


def test_opset_is_data_with_rules():
    # every op has a shape rule and a cost rule; groups are properties, not name lists
    for op in opset.OPS.values():
        assert op.infer is not None and op.flops is not None, op.name
    assert opset.in_group("reshape", opset.Group.MOVEMENT)
    assert opset.in_group("all_to_all", opset.Group.COMM)
    assert opset.in_group("ep_all_to_all", opset.Group.COMM)
    mm = opset.get("mm")
    ins = [TensorType("f32", (4, 8)), TensorType("f32", (8, 16))]
    assert mm.infer(ins, {}) == [TensorType("f32", (4, 16))]
    assert mm.flops(ins, mm.infer(ins, {}), {}) == 2 * 4 * 8 * 16
    with pytest.raises(ValueError):
        mm.infer([TensorType("f32", (4, 8)), TensorType("f32", (9, 16))], {})


def test_literals_round_trip():
    text = SMALL.replace("mul(%y, 0.5)", "mul(%y, -1e-05)")
    assert print_graph(parse_graph(text)).count("-1e-05") == 1


def test_an_absent_optional_input_round_trips():
    """`none` as an input (a layer norm without weight and bias) is an input, not lark's
    placeholder for an empty argument list: it prints, parses and type-checks back."""
    text = ("h2ir g\ninput %x: f32[2,4]\n\nlayer l kind=norm\n"
            "  %y: f32[2,4], %m: f32[2,1], %r: f32[2,1] = layer_norm(%x, none, none)\n"
            "end\noutput %y\n")
    g = parse_graph(text)
    (n,) = list(g.nodes())
    assert n.inputs[1:] == [None, None]
    assert print_graph(parse_graph(print_graph(g))) == print_graph(g)


def test_a_literal_where_a_value_belongs_is_a_located_error(tiny_graph):
    from h2ir.errors import H2Error
    from h2ir.text import parse_graph, print_graph
    text = print_graph(tiny_graph)
    line = next(i for i, l in enumerate(text.splitlines(), 1) if " = mm(%" in l)
    lines = text.splitlines()
    lines[line - 1] = lines[line - 1].replace("mm(%", "mm(", 1)
    with pytest.raises(H2Error) as e:
        parse_graph("\n".join(lines) + "\n", "m.h2ir")
    assert e.value.line == line and "expected a value like %name" in e.value.message
