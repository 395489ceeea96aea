"""Fuzz the .h2plan front door: thousands of mutated plans through parse + validate.

The only exception allowed out is H2Error, with a clean message that names the file and a line
(except for "missing '<statement>'", which has no line to name). Time per case is bounded by
construction: texts stay a few hundred characters, the parser caps numbers, block indices and
layer entries, and LALR parsing and validation are linear in the text.
"""
from __future__ import annotations

import random
import re
import sys
import types

import pytest

from h2ir.clusters.clusterfile import parse_cluster
from h2ir.costs import LayerCost, ModelCosts, MoEInfo
from h2ir.errors import H2Error
from h2ir.plans.dsl import format_plan, parse_plan
from h2ir.planner.validate import validate_plan

CASES = 4000
FILE = "fuzz.h2plan"

CLUSTER = parse_cluster("""
name = "fuzz"
dtype = "fp32"
[chips.big]
vendor = "x"
backend = "torch"
peak_tflops = { fp32 = 1 }
mem_gib = 8
mem_bw_gbs = 10
[chips.small]
base = "A100-40"
mem_gib = 0.05
mem_reserved_gib = 0        # a deliberately tiny chip: no runtime headroom
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
""", file="fuzz.toml")


def costs(experts: int) -> ModelCosts:
    moe = MoEInfo(num_experts=experts, top_k=2, d_model=64, d_ffn=256,
                  expert_params=1000) if experts else None
    layers = [LayerCost("embed", "embedding", 20_000, 80_000, 10 ** 6, 2 * 10 ** 6, 10 ** 6, 10 ** 4)]
    layers += [LayerCost(f"block.{i}", "moe_block" if moe else "transformer_block", 50_000,
                         200_000, 10 ** 7, 2 * 10 ** 7, 10 ** 7, 10 ** 4, moe) for i in range(8)]
    layers.append(LayerCost("head", "head", 20_000, 80_000, 10 ** 6, 2 * 10 ** 6, 10 ** 6, 10))
    return ModelCosts(model="fuzz", micro_batch=1, seq_len=128, layers=tuple(layers),
                      d_model=64, n_heads=8, vocab=1000)


DENSE, MOE = costs(0), costs(8)

SEEDS = [
    """\
# dense, two chip types
model   "examples/llama_tiny.py"
cluster "fuzz"
batch   global=8 micro=1 seq=128
schedule 1f1b
dp 2
stage chip=big chips=4 tp=2 layers=embed, 0..3 recompute=full
stage chip=small chips=2 tp=1 layers=4..5
stage chip=big chips=2 tp=1 layers=6..7, head
""",
    """\
model "examples/moe_tiny.py"   # experts
cluster fuzz
batch seq=128 global=16 micro=2
schedule gpipe
dp 4
stage chip=big chips=4 tp=1 layers=embed,0..7,head
moe ep=2 placement=balanced a2a=halo migration=periodic(100)
""",
]
SEEDS.append(format_plan(parse_plan(SEEDS[0])))

WORDS = ["model", "cluster", "batch", "schedule", "dp", "stage", "moe", "chip", "chips", "tp",
         "layers", "recompute", "ep", "placement", "a2a", "migration", "global", "micro", "seq",
         "embed", "head", "1f1b", "gpipe", "none", "full", "flat", "halo", "balanced",
         "periodic", "periodic(3)", "big", "small", "Chip-A", '"quoted"', '"bad\\q"', "=", ",",
         "..", "(", ")", "#", "0..7", "7..0", "3"]
CHARS = list("=,.()#\"\\- \t\n0123456789abcz_") + ["é", "\u2028", "\x00", "\ufeff", "日", "\r"]
NUMBERS = ["0", "-1", "-7", "1", "2", "3", "4", "7", "8", "16", "99999", "100000", "4096",
           str(10 ** 12), str(10 ** 18), str(10 ** 18 + 1), str(10 ** 40), "007"]
TOKEN = re.compile(r'\s+|"(?:[^"\\\n]|\\.)*"|\.\.|[=,()#]|[^\s=,()#".]+|.', re.S)


def mutate(text: str, rng: random.Random) -> str:
    # weights: character edits mostly break the syntax, so number/token/line edits (which
    # mostly reach validation) are drawn more often
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        op = rng.choices(range(10), weights=(1, 1, 1, 1, 1, 1, 1, 5, 2, 2))[0]
        if not text:
            text = rng.choice(SEEDS)
        i = rng.randrange(len(text))
        if op == 0:                                      # delete a span of characters
            text = text[:i] + text[i + rng.randint(1, 6):]
        elif op == 1:                                    # duplicate a span
            text = text[:i] + text[i:i + rng.randint(1, 12)] + text[i:]
        elif op == 2 and len(text) > 1:                  # swap two adjacent characters
            i = min(i, len(text) - 2)
            text = text[:i] + text[i + 1] + text[i] + text[i + 2:]
        elif op == 3:                                    # insert a character, incl. unicode
            text = text[:i] + rng.choice(CHARS) + text[i:]
        elif op in (4, 5, 6):                            # token-level edits
            toks = TOKEN.findall(text)
            j, k = rng.randrange(len(toks)), rng.randrange(len(toks))
            kind = rng.randrange(4)
            if kind == 0:
                del toks[j]
            elif kind == 1:
                toks.insert(j, toks[k])
            elif kind == 2:
                toks[j], toks[k] = toks[k], toks[j]
            else:
                toks[j] = rng.choice(WORDS)
            text = "".join(toks)
        elif op == 7:                                    # numbers: 0, negative, huge
            nums = list(re.finditer(r"-?\d+", text))
            if nums:
                m = rng.choice(nums)
                text = text[:m.start()] + rng.choice(NUMBERS) + text[m.end():]
        else:                                            # line edits, splicing other seeds
            lines = text.split("\n")
            j = rng.randrange(len(lines))
            kind = rng.randrange(4)
            if kind == 0:
                lines.insert(j, rng.choice(rng.choice(SEEDS).split("\n")))
            elif kind == 1:
                del lines[j]
            elif kind == 2:
                lines.insert(j, lines[rng.randrange(len(lines))])
            else:
                k = rng.randrange(len(lines))
                lines[j], lines[k] = lines[k], lines[j]
            text = "\n".join(lines)
    return text[:2000]


def fake_stage_memory(costs, plan, cluster, i):
    """h2ir.planner.resource.stage_memory's contract, with simple numbers (as in test_plandsl.py)."""
    s = plan.stages[i]
    by_name = {l.name: l for l in costs.layers}
    params = sum(by_name[n].params for n in s.layers)
    act = sum(by_name[n].out_bytes if s.recompute == "full" else by_name[n].act_saved_bytes
              for n in s.layers)
    items = {"weights": 4 * params // s.tp, "grads": 4 * params // s.tp,
             "optimizer": 8 * params // s.tp,
             "activations": max(1, plan.num_stages - i) * act // s.tp}
    return types.SimpleNamespace(items=items, total=sum(items.values()),
                                 capacity=cluster.chip(s.chip).mem_bytes)


@pytest.fixture
def fake_resource(monkeypatch):
    module = types.ModuleType("h2ir.planner.resource")
    module.stage_memory = fake_stage_memory
    monkeypatch.setitem(sys.modules, "h2ir.planner.resource", module)


def check_error(e: H2Error, text: str):
    message = str(e)
    assert e.file == FILE, message
    assert "Traceback" not in message and "Token(" not in message, message
    assert "lark" not in message.lower(), message
    if e.message.startswith("missing '"):
        return
    assert isinstance(e.line, int) and 1 <= e.line <= text.count("\n") + 1, (message, text)
    assert message.startswith(f"{FILE}:{e.line}"), message


def test_seeds_are_valid(fake_resource):
    assert validate_plan(parse_plan(SEEDS[0], FILE), DENSE, CLUSTER) == []
    assert validate_plan(parse_plan(SEEDS[1], FILE), MOE, CLUSTER) == []


def test_mutated_plans_only_raise_h2error(fake_resource):
    rng = random.Random(20250523)
    outcome = {"syntax": 0, "semantic": 0, "valid": 0}
    messages = set()
    for n in range(CASES):
        text = mutate(rng.choice(SEEDS), rng)
        model = MOE if rng.random() < 0.5 else DENSE
        stage = "parse"
        try:
            plan = parse_plan(text, file=FILE)
            stage = "validate"
            validate_plan(plan, model, CLUSTER)
            outcome["valid"] += 1
        except H2Error as e:
            check_error(e, text)
            outcome["syntax" if stage == "parse" else "semantic"] += 1
            messages.add(re.sub(r"[\d'\"].*", "", e.message)[:30])
        except Exception as e:      # noqa: BLE001 - the point of the test
            pytest.fail(f"case {n}: {stage} raised {type(e).__name__}: {e}\n--- text ---\n{text}")
    # the mutator must reach every layer, or the test proves little
    assert outcome["syntax"] > 300 and outcome["semantic"] > 300 and outcome["valid"] > 50, outcome
    assert len(messages) > 25, sorted(messages)
