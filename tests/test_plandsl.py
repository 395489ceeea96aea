"""The .h2plan DSL (parse, print, round trip, syntax errors) and semantic plan validation."""
from __future__ import annotations

import dataclasses
import types
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from h2ir.clusters.clusterfile import load_cluster, parse_cluster
from h2ir.costs import LayerCost, ModelCosts, MoEInfo
from h2ir.errors import H2Error
from h2ir.plans.plan import A2A_ALGOS, PLACEMENTS, MoEPlan, Plan, StagePlan
from h2ir.plans.dsl import format_layers, format_plan, load_plan, parse_plan

ROOT = Path(__file__).resolve().parent.parent
from h2ir.planner.validate import validate_plan

# ----------------------------------------------------------------------------------------------
# fixtures: a small synthetic model, a small cluster, and a resource model with known numbers


def synthetic_costs(n_blocks=8, n_heads=8, experts=0, block_params=1_000_000, seq=128,
                    name="synthetic"):
    """embed, block.0..N-1, head with round numbers; MoE blocks when `experts` > 0."""
    def layer(lname, kind, params, moe=None):
        return LayerCost(name=lname, kind=kind, params=params, param_bytes=4 * params,
                         fwd_flops=2 * params * seq, bwd_flops=4 * params * seq,
                         act_saved_bytes=10_000_000, out_bytes=100_000, moe=moe)
    moe = MoEInfo(num_experts=experts, top_k=2, d_model=64, d_ffn=256,
                  expert_params=block_params // (2 * experts)) if experts else None
    layers = [layer("embed", "embedding", 2 * block_params)]
    layers += [layer(f"block.{i}", "moe_block" if experts else "transformer_block",
                     block_params, moe) for i in range(n_blocks)]
    layers.append(layer("head", "head", 2 * block_params))
    return ModelCosts(model=name, micro_batch=1, seq_len=seq, layers=tuple(layers),
                      d_model=64, n_heads=n_heads, vocab=1000, dtype_bytes=4)


CLUSTER_TOML = """
name = "test"
dtype = "fp32"
[chips.big]
vendor = "x"
backend = "torch"
peak_tflops = { fp32 = 1 }
mem_gib = 8
mem_bw_gbs = 10
[chips.small]
vendor = "x"
backend = "numpy"
peak_tflops = { fp32 = 1 }
mem_gib = 0.05
mem_bw_gbs = 10
[[nodes]]
chip = "big"
count = 2
chips_per_node = 4
intra_bw_gbs = 10
nic_gbps = 10
[[nodes]]
chip = "small"
count = 1
chips_per_node = 4
intra_bw_gbs = 10
nic_gbps = 10
"""


def fake_stage_memory(costs, plan, cluster, i):
    """The contract of h2ir.planner.resource.stage_memory with simple, known numbers: 4 B weights,
    4 B grads, 8 B optimizer per parameter over tp; activations of the S - i in-flight
    micro-batches (1F1B), only the boundary outputs under recompute=full."""
    s = plan.stages[i]
    by_name = {l.name: l for l in costs.layers}
    params = sum(by_name[n].params for n in s.layers)
    inflight = max(1, plan.num_stages - i)
    act = sum(by_name[n].out_bytes if s.recompute == "full" else by_name[n].act_saved_bytes
              for n in s.layers)
    items = {"weights": 4 * params // s.tp, "grads": 4 * params // s.tp,
             "optimizer": 8 * params // s.tp, "activations": inflight * act // s.tp}
    return types.SimpleNamespace(items=items, total=sum(items.values()),
                                 capacity=cluster.chip(s.chip).mem_bytes)


@pytest.fixture
def fake_resource(monkeypatch):
    """Validation tests use known memory numbers, not the resource model's (tested elsewhere)."""
    import h2ir.planner.validate
    monkeypatch.setattr(h2ir.planner.validate, "stage_memory", fake_stage_memory)


@pytest.fixture
def cluster():
    return parse_cluster(CLUSTER_TOML, file="test.toml")


HEADER = """\
model   "synthetic.py"
cluster "test"
batch   global=8 micro=1 seq=128
schedule 1f1b
dp 2
"""
GOOD_STAGES = """\
stage chip=big chips=4 tp=2 layers=embed, 0..3
stage chip=big chips=4 tp=2 layers=4..7, head
"""


def plan_text(stages=GOOD_STAGES, header=HEADER, extra=""):
    return header + stages + extra


def validation_error(text, costs=None, cluster=None) -> H2Error:
    costs = costs or synthetic_costs()
    cluster = cluster or parse_cluster(CLUSTER_TOML, file="test.toml")
    plan = parse_plan(text, file="p.h2plan")
    with pytest.raises(H2Error) as ei:
        validate_plan(plan, costs, cluster)
    assert ei.value.file == "p.h2plan"
    return ei.value


def line_of(text: str, needle: str) -> int:
    return next(i for i, l in enumerate(text.split("\n"), 1) if needle in l)


# ----------------------------------------------------------------------------------------------
# parsing

EXAMPLE_100B = """\
# 100B on the 1,024-chip cluster
model   "examples/llama_100b.py"
cluster "h2-1024"
batch   global=1024 micro=1 seq=4096   # tokens per step: 4M
schedule 1f1b
dp 4

stage chip=Chip-A chips=32 tp=8 layers=embed,0..17 recompute=full
stage chip=Chip-B chips=32 tp=8 layers=18..40
stage chip="Chip-C" chips=32 tp=8 layers=41 .. 80
stage chip=Chip-D chips=32 tp=8 layers=81..95, head
moe ep=4 placement=balanced a2a=halo migration=periodic(100)
"""


def test_parse_reads_every_field():
    p = parse_plan(EXAMPLE_100B, file="x.h2plan")
    assert (p.model, p.cluster) == ("examples/llama_100b.py", "h2-1024")
    assert (p.global_batch, p.micro_batch, p.seq_len, p.dp, p.schedule) == (1024, 1, 4096, 4, "1f1b")
    assert [s.chip for s in p.stages] == ["Chip-A", "Chip-B", "Chip-C", "Chip-D"]
    s0 = p.stages[0]
    assert s0.layers == ["embed"] + [f"block.{i}" for i in range(18)]
    assert (s0.chips, s0.tp, s0.recompute, s0.line) == (32, 8, "full", 8)
    assert p.stages[1].recompute == "none" and p.stages[1].layers[0] == "block.18"
    assert p.stages[3].layers[-2:] == ["block.95", "head"]
    assert p.moe == MoEPlan(ep=4, placement="balanced", a2a="halo", migration="periodic",
                            migration_every=100)
    assert p.moe.line == 12
    assert p.source == "x.h2plan"
    line8 = EXAMPLE_100B.split("\n")[7]
    assert p.locations["stage.0.recompute"] == (8, line8.index("recompute") + 1)
    assert p.num_microbatches == 256


def test_defaults_and_any_statement_order():
    p = parse_plan('stage chip=a chips=1 layers=embed\nbatch seq=4 micro=1 global=2\n'
                   'cluster local\nmodel "m.py"\n')
    assert (p.dp, p.schedule, p.moe) == (1, "1f1b", None)
    assert p.stages[0].tp == 1 and p.stages[0].recompute == "none"
    assert p.cluster == "local"


def test_moe_defaults():
    p = parse_plan(plan_text(extra="moe\n"))
    assert p.moe == MoEPlan()


def test_load_plan_reads_a_file(tmp_path):
    f = tmp_path / "a.h2plan"
    f.write_text(EXAMPLE_100B)
    assert load_plan(f) == parse_plan(EXAMPLE_100B)
    f.write_text(EXAMPLE_100B.replace("dp 4", "dp four"))
    with pytest.raises(H2Error) as ei:
        load_plan(f)
    assert ei.value.file == str(f) and ei.value.line == 6


# ----------------------------------------------------------------------------------------------
# printing and the round trip

def test_format_is_canonical_and_compact():
    text = format_plan(parse_plan(EXAMPLE_100B))
    assert text == """\
model    "examples/llama_100b.py"
cluster  "h2-1024"
batch    global=1024 micro=1 seq=4096
schedule 1f1b
dp       4
stage chip=Chip-A chips=32 tp=8 recompute=full layers=embed, 0..17
stage chip=Chip-B chips=32 tp=8 recompute=none layers=18..40
stage chip=Chip-C chips=32 tp=8 recompute=none layers=41..80
stage chip=Chip-D chips=32 tp=8 recompute=none layers=81..95, head
moe ep=4 placement=balanced a2a=halo migration=periodic(100) capacity=none threshold=1.3
"""


@pytest.mark.parametrize("layers, text", [
    (["embed", "block.0", "block.1", "block.2"], "embed, 0..2"),
    (["block.5"], "5"),
    (["block.3", "block.4", "block.6", "head"], "3..4, 6, head"),
    (["block.2", "block.1"], "2, 1"),                 # order kept, even when wrong
    (["block.007", "my layer"], '"block.007", "my layer"'),
])
def test_format_layers(layers, text):
    assert format_layers(layers) == text


ROUND_TRIP_PLANS = [
    EXAMPLE_100B,
    plan_text(),
    plan_text(extra="moe ep=2 placement=round_robin a2a=flat migration=none\n"),
    'model "a \\"quoted\\" path\\\\x.py"\ncluster "c"\nbatch global=6 micro=3 seq=1\n'
    'schedule gpipe\nstage chip="odd chip!" chips=1 layers="weird-layer", embed, 0, 2..3\n',
]


@pytest.mark.parametrize("text", ROUND_TRIP_PLANS)
def test_round_trip(text):
    p = parse_plan(text)
    canon = format_plan(p)
    assert parse_plan(canon) == p
    assert format_plan(parse_plan(canon)) == canon


def test_equality_ignores_source_positions():
    p = parse_plan(EXAMPLE_100B)
    q = parse_plan("\n\n# shifted\n" + EXAMPLE_100B)
    assert p.stages[0].line != q.stages[0].line
    assert p == q
    r = parse_plan(EXAMPLE_100B.replace("tp=8 layers=18..40", "tp=4 layers=18..40"))
    assert p != r


_name = st.from_regex(r"[A-Za-z_][A-Za-z0-9_.\-]{0,8}", fullmatch=True)
_text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)


@st.composite
def plans(draw):
    def layer_name():
        return draw(st.one_of(st.sampled_from(["embed", "head"]),
                              st.integers(0, 300).map(lambda i: f"block.{i}"),
                              _text.filter(bool)))
    stages = [StagePlan(chip=draw(st.one_of(_name, _text.filter(bool))),
                        chips=draw(st.integers(1, 10 ** 6)),
                        layers=[layer_name() for _ in range(draw(st.integers(1, 6)))],
                        tp=draw(st.integers(1, 64)),
                        recompute=draw(st.sampled_from(["none", "full"])),
                        zero=draw(st.sampled_from([0, 1])))
              for _ in range(draw(st.integers(1, 5)))]
    moe = None
    if draw(st.booleans()):
        periodic = draw(st.booleans())
        moe = MoEPlan(ep=draw(st.integers(1, 64)), placement=draw(st.sampled_from(PLACEMENTS)),
                      a2a=draw(st.sampled_from(A2A_ALGOS)),
                      migration="periodic" if periodic else "none",
                      migration_every=draw(st.integers(1, 10 ** 6)) if periodic else 0)
    return Plan(model=draw(_text), cluster=draw(_text),
                global_batch=draw(st.integers(1, 10 ** 9)), micro_batch=draw(st.integers(1, 512)),
                seq_len=draw(st.integers(1, 10 ** 6)), stages=stages,
                dp=draw(st.integers(1, 4096)), schedule=draw(st.sampled_from(["1f1b", "gpipe"])),
                moe=moe)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plans())
def test_round_trip_property(p):
    canon = format_plan(p)
    q = parse_plan(canon)
    assert q == p
    assert format_plan(q) == canon


# ----------------------------------------------------------------------------------------------
# syntax and text-level errors: file, line, column, expected words; never lark internals

@pytest.mark.parametrize("bad, line, col, words", [
    ("stage chip=Chip-A chips=32 tp 8 layers=1\n", 1, 31, ["'='"]),
    ("stage chip=é chips=1 layers=1\n", 1, 12, ["U+00E9", "a name", "a quoted string"]),
    ("model \"m\"\nwat 3\n", 2, 1, ["'stage'", "'batch'"]),
    ("stage chip=A chips=1 layers=3..\n", 1, 32, ["end of line", "a number"]),
    ("stage chip=A chips=1 layers=embed,,3\n", 1, 35, ["','", "a number", "a name"]),
    ("moe migration=periodic(5\n", 1, 25, ["')'"]),
    ("batch global=1 micro=1 sequence=4\n", 1, 27, ["'='"]),
])
def test_syntax_errors_say_where_and_what_was_expected(bad, line, col, words):
    with pytest.raises(H2Error) as ei:
        parse_plan(bad, file="s.h2plan")
    e = ei.value
    assert (e.file, e.line, e.col) == ("s.h2plan", line, col)
    for w in words:
        assert w in e.message
    assert "Token(" not in e.message and "lark" not in str(e).lower()
    assert str(e).startswith(f"s.h2plan:{line}:{col}: error: ")


@pytest.mark.parametrize("bad, line, needle", [
    ("schedule 2f2b\n", 1, "unknown schedule '2f2b'; expected one of: 1f1b, gpipe"),
    ("stage chip=A chips=1 layers=1 recompute=some\n", 1, "unknown recompute 'some'"),
    ("moe placement=random\n", 1, "unknown expert placement 'random'"),
    ("moe a2a=ring\n", 1, "unknown all-to-all algorithm 'ring'"),
    ("moe migration=periodic\n", 1, "needs an interval"),
    ("moe migration=none(4)\n", 1, "takes no interval"),
    ("moe migration=periodic(0)\n", 1, "migration interval must be a positive integer, got 0"),
    ("dp 0\n", 1, "dp must be a positive integer, got 0"),
    ("dp -3\n", 1, "dp must be a positive integer, got -3"),
    ("\ndp 2\ndp 3\n", 3, "second 'dp' statement (the first is on line 2)"),
    ("stage chip=A chips=1 tp=2 tp=2 layers=1\n", 1, "stage option 'tp' given twice"),
    ("stage chip=A layers=1\n", 1, "missing chips="),
    ("batch global=8 micro=1\n", 1, "missing seq="),
    ("stage chip=A chips=1 layers=9..2\n", 1, "empty layer range 9..2"),
    ("stage chip=A chips=1 layers=0..100000\n", 1, "block index 100000 out of range"),
    ("stage chip=A chips=99999999999999999999 layers=1\n", 1, "is too large"),
    ('model "a\\qb"\n', 1, "unknown escape '\\q'"),
])
def test_text_level_errors(bad, line, needle):
    with pytest.raises(H2Error) as ei:
        parse_plan(bad, file="s.h2plan")
    assert ei.value.line == line
    assert needle in ei.value.message


@pytest.mark.parametrize("drop, needle", [
    ('model   "synthetic.py"\n', "missing 'model' statement"),
    ('cluster "test"\n', "missing 'cluster' statement"),
    ("batch   global=8 micro=1 seq=128\n", "missing 'batch' statement"),
    (GOOD_STAGES, "missing 'stage' statements"),
])
def test_missing_statements(drop, needle):
    with pytest.raises(H2Error, match=needle):
        parse_plan(plan_text().replace(drop, ""))


# ----------------------------------------------------------------------------------------------
# semantic validation

def test_valid_plan_passes_without_warnings(fake_resource, cluster):
    assert validate_plan(parse_plan(plan_text()), synthetic_costs(), cluster) == []


def test_missing_layer_is_named_at_the_stage_after_the_gap(fake_resource):
    text = plan_text("stage chip=big chips=4 tp=2 layers=embed, 0..2\n"
                     "stage chip=big chips=4 tp=2 layers=4..7, head\n")
    e = validation_error(text)
    assert "layer 'block.3' is not assigned to any stage" in e.message
    assert e.line == line_of(text, "layers=4..7")


def test_layer_assigned_twice_names_both_stages(fake_resource):
    text = plan_text("stage chip=big chips=4 tp=2 layers=embed, 0..4\n"
                     "stage chip=big chips=4 tp=2 layers=4..7, head\n")
    e = validation_error(text)
    assert "layer 'block.4' is assigned twice: to stage 0 (line 6) and to stage 1" in e.message
    assert e.line == 7
    assert e.col == text.split("\n")[6].index("layers=") + 1      # points at layers=


def test_unknown_layer(fake_resource):
    text = plan_text("stage chip=big chips=4 tp=2 layers=embed, 0..3\n"
                     "stage chip=big chips=4 tp=2 layers=4..8, head\n")
    e = validation_error(text)
    assert "unknown layer 'block.8'" in e.message and "embed, block.0..block.7, head" in e.message
    assert e.line == 7


def test_stage_layers_not_contiguous(fake_resource):
    text = plan_text("stage chip=big chips=4 tp=2 layers=embed, 0, 1, 3\n"
                     "stage chip=big chips=4 tp=2 layers=2, 4..7, head\n")
    e = validation_error(text)
    assert "not contiguous: 'block.1' is followed by 'block.3'" in e.message
    assert e.line == 6


def test_stage_layers_in_reverse_order(fake_resource):
    text = plan_text("stage chip=big chips=4 tp=2 layers=embed, 3, 2, 1, 0\n"
                     "stage chip=big chips=4 tp=2 layers=4..7, head\n")
    e = validation_error(text)
    assert "lists 'block.2' after 'block.3'" in e.message and e.line == 6


def test_stages_out_of_model_order(fake_resource):
    text = plan_text("stage chip=big chips=4 tp=2 layers=4..7, head\n"
                     "stage chip=big chips=4 tp=2 layers=embed, 0..3\n")
    e = validation_error(text)
    assert "stages out of model order: stage 1 starts at 'embed'" in e.message
    assert e.line == 7


def test_more_chips_than_the_cluster_has(fake_resource):
    text = plan_text("stage chip=small chips=4 tp=2 layers=embed, 0..1\n"
                     "stage chip=small chips=4 tp=2 layers=2..7, head\n")
    e = validation_error(text)
    assert "stages 0, 1 request 8 small chips but cluster 'test' has 4" in e.message
    assert e.line == 7


def test_chip_type_not_in_cluster(fake_resource):
    text = plan_text("stage chip=Chip-A chips=4 tp=2 layers=embed, 0..3\n"
                     "stage chip=big chips=4 tp=2 layers=4..7, head\n")
    e = validation_error(text)
    assert "chip type 'Chip-A' is not in cluster 'test' (it has: big (8), small (4))" in e.message
    assert (e.line, e.col) == (6, 7)


def test_chips_must_equal_dp_times_tp(fake_resource):
    text = plan_text("stage chip=big chips=3 tp=2 layers=embed, 0..3\n"
                     "stage chip=big chips=4 tp=2 layers=4..7, head\n")
    e = validation_error(text)
    assert "chips=3 but dp x tp = 2 x 2 = 4" in e.message and e.line == 6


def test_tp_must_divide_heads(fake_resource):
    text = plan_text("stage chip=big chips=6 tp=3 layers=embed, 0..3\n"
                     "stage chip=big chips=4 tp=2 layers=4..7, head\n")
    e = validation_error(text)
    assert "tp=3 does not divide the model's 8 attention heads" in e.message
    assert e.line == 6 and "1, 2, 4, 8" in e.hint


def test_global_batch_divisible_by_micro_times_dp(fake_resource):
    text = plan_text(header=HEADER.replace("global=8 micro=1", "global=10 micro=3"))
    e = validation_error(text)
    assert "global batch 10 is not divisible by micro-batch x dp = 3 x 2 = 6" in e.message
    assert (e.line, e.col) == (3, 9)


def test_unknown_words_in_programmatic_plans(fake_resource, cluster):
    p = parse_plan(plan_text())
    bad = dataclasses.replace(p, schedule="zigzag")
    with pytest.raises(H2Error, match="unknown schedule 'zigzag'"):
        validate_plan(bad, synthetic_costs(), cluster)
    stages = [dataclasses.replace(s, recompute="half") for s in p.stages]
    with pytest.raises(H2Error, match="unknown recompute 'half'") as ei:
        validate_plan(dataclasses.replace(p, stages=stages, locations={}), synthetic_costs(),
                      cluster)
    assert ei.value.line == 6       # falls back to StagePlan.line without locations
    with pytest.raises(H2Error, match="tp must be a positive integer, got 0"):
        stages = [dataclasses.replace(s, tp=0) for s in p.stages]
        validate_plan(dataclasses.replace(p, stages=stages), synthetic_costs(), cluster)


def test_stage_that_does_not_fit_reports_bytes_and_biggest_consumers(fake_resource):
    # 'small' has 0.05 GiB = 53,687,091 B; stage 0 holds embed + 4 blocks = 6 M params
    text = plan_text("stage chip=small chips=2 tp=1 layers=embed, 0..3\n"
                     "stage chip=big chips=2 tp=1 layers=4..7, head\n",
                     header=HEADER.replace("dp 2", "dp 2\n"))
    e = validation_error(text)
    assert e.line == line_of(text, "chip=small")
    assert "stage 0 does not fit in memory" in e.message
    # 6 M params x 16 B + 2 in-flight micro-batches x 5 layers x 10 MB saved activations
    assert "(196,000,000 B) per device, small has" in e.message
    assert "(53,687,091 B)" in e.message
    m = e.message                                                    # biggest first
    assert m.index("activations") < m.index("optimizer") < m.index("weights")
    assert "recompute=selective or full" in e.hint


def test_memory_check_uses_recompute(fake_resource):
    text = plan_text("stage chip=big chips=2 tp=1 recompute=full layers=embed, 0..3\n"
                     "stage chip=big chips=2 tp=1 layers=4..7, head\n")
    big = synthetic_costs(block_params=100_000_000)      # 1.6 GB/block of state
    e = validation_error(text, costs=big)                # 6 x 1.6 GB > 8 GiB
    assert "stage 0 does not fit" in e.message


def test_moe_section_checks(fake_resource):
    moe_costs = synthetic_costs(experts=8)
    ok = plan_text(extra="moe ep=2 placement=balanced a2a=halo migration=periodic(10)\n")
    cl = parse_cluster(CLUSTER_TOML)
    ws = validate_plan(parse_plan(ok), moe_costs, cl)       # legal; its EP groups span hosts
    assert ws and all("expert-parallel groups of 2 replicas span 2 hosts" in w for w in ws)
    e = validation_error(ok.replace("ep=2", "ep=3"), costs=moe_costs)
    assert "ep=3 does not divide" in e.message and (e.line, e.col) == (8, 5)
    e = validation_error(ok.replace("ep=2", "ep=4"), costs=moe_costs)
    assert "ep=4 does not divide dp=2" in e.message
    e = validation_error(ok)                              # dense model
    assert "has no MoE layers" in e.message and e.line == 8


def test_warnings_for_tp_across_nodes(fake_resource):
    text = plan_text("stage chip=big chips=8 tp=8 layers=embed, 0..7, head\n",
                     header=HEADER.replace("dp 2", "dp 1"))
    warnings = validate_plan(parse_plan(text), synthetic_costs(), parse_cluster(CLUSTER_TOML))
    assert len(warnings) == 1
    assert "line 6: stage 0: tp=8 spans 2 nodes of big (4 per node)" in warnings[0]


def test_real_resource_model_accepts_100b_on_h2_1024():
    """End to end with the resource model the planner uses (not the fake): the 100B model at
    tp=8 inside a node, dp=4, fits every stage of the 1,024-chip cluster."""
    pytest.importorskip("h2ir.planner.resource")
    # H2's 100B (examples/llama_100b.py): hidden 8192, 64 heads, 96 layers, SwiGLU 36864;
    # per block 4*8192^2 + 3*8192*36864 = 1,174,405,120 params (+ norms).
    # A bf16 program (2-byte activations): the resource model counts activations at the
    # width the program keeps them, and an f32 one (h2's bf16 policy keeps f32 values) would
    # need recomputation on the first stages of this split.
    block = 1_174_421_504
    def layer(name, kind, params, act, out):
        return LayerCost(name=name, kind=kind, params=params, param_bytes=2 * params,
                         fwd_flops=2 * params * 4096, bwd_flops=4 * params * 4096,
                         act_saved_bytes=act, out_bytes=out)
    layers = ([layer("embed", "embedding", 32000 * 8192, 67_108_864, 67_108_864)]
              + [layer(f"block.{i}", "transformer_block", block, 2_148_024_320, 67_108_864)
                 for i in range(96)]
              + [layer("head", "head", 32000 * 8192 + 8192, 524_288_000, 2)])
    costs = ModelCosts(model="llama_100b", micro_batch=1, seq_len=4096, layers=tuple(layers),
                       d_model=8192, n_heads=64, vocab=32000, dtype_bytes=2)
    assert 110e9 < costs.total_params < 116e9
    lines = ['model "examples/llama_100b.py"', 'cluster "h2-1024"',
             "batch global=1024 micro=1 seq=4096", "schedule 1f1b", "dp 4"]
    for k in range(32):                       # 8 stages per chip type, 3 blocks each
        chip = "ABCD"[k // 8]
        layers_k = ", ".join((["embed"] if k == 0 else []) + [f"{3 * k}..{3 * k + 2}"]
                             + (["head"] if k == 31 else []))
        lines.append(f"stage chip=Chip-{chip} chips=32 tp=8 layers={layers_k}")
    plan = parse_plan("\n".join(lines) + "\n")
    assert validate_plan(plan, costs, load_cluster("h2-1024")) == []
    # and the same split does not fit without tensor parallelism
    no_tp = parse_plan("\n".join(lines).replace("chips=32 tp=8", "chips=4 tp=1") + "\n")
    with pytest.raises(H2Error, match="does not fit in memory"):
        validate_plan(no_tp, costs, load_cluster("h2-1024"))


def test_load_plan_tolerates_a_byte_order_mark(tmp_path):
    f = tmp_path / "bom.h2plan"
    f.write_bytes("\ufeff".encode() + EXAMPLE_100B.encode())
    assert load_plan(f) == parse_plan(EXAMPLE_100B)


@pytest.mark.parametrize("path", sorted(str(p) for p in (ROOT / "examples/plans").glob("*.h2plan")))
def test_shipped_plans_validate_against_their_models(path):
    """Every plan under examples/plans parses, round-trips and validates against the model and
    cluster it names (the README's commands compile them)."""
    from frontend.capture import capture
    from h2ir.clusters.clusterfile import load_cluster
    from h2ir.planner.validate import validate_plan
    plan = load_plan(path)
    assert parse_plan(format_plan(plan)) == plan
    costs = capture(str(ROOT / plan.model), {}, plan.micro_batch, plan.seq_len).layer_costs()
    validate_plan(plan, costs, load_cluster(str(ROOT / plan.cluster) if plan.cluster.endswith(".toml")
                                            else plan.cluster))
