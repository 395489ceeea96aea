"""Cluster TOML loading: built-in clusters, the chip catalog, overrides, located errors."""
from __future__ import annotations

import random
import re
from pathlib import Path

import pytest

from h2ir.clusters.clusterfile import (BUILTIN_DIR, CATALOG_PATH, builtin_clusters, catalog_chip,
                              catalog_names, load_cluster, parse_cluster)
from h2ir.errors import H2Error

GIB = 2 ** 30

NODE = """
[[nodes]]
chip = "{chip}"
count = 2
chips_per_node = 8
intra_bw_gbs = 200
nics_per_node = 4
nic_gbps = 200
"""


def cluster_text(chips: str, chip: str = "X") -> str:
    return chips + NODE.format(chip=chip)


def error_of(text: str) -> H2Error:
    with pytest.raises(H2Error) as ei:
        parse_cluster(text, file="c.toml")
    return ei.value


def line_of(text: str, needle: str) -> int:
    return next(i for i, l in enumerate(text.split("\n"), 1) if needle in l)


# ----------------------------------------------------------------------------------------------
# built-in clusters

def test_builtin_names_resolve_without_a_path():
    assert {"local", "local-mixed", "h2-768", "h2-1024"} <= set(builtin_clusters())
    c = load_cluster("h2-1024")
    assert c.name == "h2-1024"
    assert Path(c.source) == BUILTIN_DIR / "h2-1024.toml"


def test_local_is_two_measured_torch_workers():
    c = load_cluster("local")
    assert c.total_chips == 2
    (chip,) = c.chip_types.values()
    assert chip.backend == "torch" and chip.measured
    assert chip.mem_bytes == 8 * GIB
    assert c.dtype == "fp32" and "fp32" in chip.peak_flops


def test_local_mixed_has_one_torch_and_one_numpy_worker():
    c = load_cluster("local-mixed")
    assert c.total_chips == 2
    assert sorted(ct.backend for ct in c.chip_types.values()) == ["numpy", "torch"]
    assert all(c.count(name) == 1 for name in c.chip_types)
    # 2 workers x 8 GiB fits the 24 GiB machine with room for the driver process
    assert sum(ct.mem_bytes * c.count(n) for n, ct in c.chip_types.items()) <= 16 * GIB


@pytest.mark.parametrize("name, chips, types", [("h2-768", 768, 3), ("h2-1024", 1024, 4)])
def test_h2_clusters_are_heterogeneous(name, chips, types):
    c = load_cluster(name)
    assert c.total_chips == chips
    assert len(c.chip_types) == types
    bf16 = {ct.peak_flops["bf16"] for ct in c.chip_types.values()}
    mem = {ct.mem_bytes for ct in c.chip_types.values()}
    per_node = {g.chips_per_node for g in c.groups}
    assert len(bf16) == types and len(mem) == types and len(per_node) >= 2
    # the 100B model needs tp=8 inside a node: every chip type must offer that
    assert all(g.chips_per_node % 8 == 0 for g in c.groups)
    # the invented chips are said to be invented
    assert "INVENTED" in (BUILTIN_DIR / f"{name}.toml").read_text()


def test_load_by_path_defaults_name_to_file_stem(tmp_path):
    p = tmp_path / "my-rack.toml"
    p.write_text(cluster_text("", chip="H100-SXM"))
    c = load_cluster(p)
    assert c.name == "my-rack" and c.total_chips == 16
    assert load_cluster(str(p)).name == "my-rack"


def test_unknown_cluster_name_lists_builtins():
    with pytest.raises(H2Error) as ei:
        load_cluster("h2-1042")
    text = str(ei.value)
    assert "h2-1042" in text and "h2-1024" in text


def test_missing_cluster_file_is_an_h2error(tmp_path):
    with pytest.raises(H2Error, match="no such cluster file"):
        load_cluster(tmp_path / "nope.toml")


# ----------------------------------------------------------------------------------------------
# catalog

def test_catalog_has_the_promised_chips():
    for name in ("A100-40", "A100-80", "H100-SXM", "H800", "H20", "H200", "MI250X-GCD",
                 "MI300X", "Ascend-910B", "Gaudi2", "Gaudi3"):
        assert name in catalog_names()


def test_every_catalog_entry_cites_a_source():
    lines = CATALOG_PATH.read_text().split("\n")
    for i, line in enumerate(lines):
        m = re.match(r"^\[([^\]]+)\]\s*$", line)
        if not m:
            continue
        comment = []
        j = i - 1
        while j >= 0 and lines[j].startswith("#"):
            comment.append(lines[j])
            j -= 1
        block = "\n".join(comment)
        assert "Source:" in block and "https://" in block, f"[{m[1]}] has no cited source"


def test_catalog_units_are_converted_to_si():
    h100 = catalog_chip("H100-SXM")
    assert h100.peak_flops["bf16"] == pytest.approx(989.4e12)
    assert h100.peak_flops["fp32"] == pytest.approx(67e12)
    assert h100.mem_bytes == 80 * GIB
    assert h100.mem_bw == pytest.approx(3.35e12)
    assert h100.power_w == 700


def test_catalog_entry_with_unpublished_figure_cannot_be_used_directly():
    with pytest.raises(H2Error, match="mem_bw_gbs"):
        catalog_chip("Ascend-910B")


# ----------------------------------------------------------------------------------------------
# chips: base + overrides, nodes

def test_base_with_overrides_merges_per_field():
    c = parse_cluster(cluster_text("""
[chips.X]
base = "H100-SXM"
mem_gib = 64
peak_tflops = { bf16 = 900 }
price_per_hour = 2.5
"""))
    x = c.chip("X")
    assert x.mem_bytes == 64 * GIB                          # overridden
    assert x.peak_flops["bf16"] == pytest.approx(900e12)    # overridden
    assert x.peak_flops["fp32"] == pytest.approx(67e12)     # kept from the base
    assert x.mem_bw == pytest.approx(3.35e12)               # kept from the base
    assert x.backend == "cuda" and x.vendor == "nvidia"
    assert x.price_per_hour == 2.5


def test_node_may_name_a_catalog_chip_directly():
    c = parse_cluster(cluster_text("", chip="MI300X"))
    assert c.count("MI300X") == 16
    assert c.chip("MI300X").mem_bytes == 192 * GIB


def test_node_links_and_nic_sharing():
    c = parse_cluster(cluster_text("", chip="H200") + """
[[nodes]]
chip = "A100-80"
count = 3
chips_per_node = 16
intra_bw_gbs = 300
nics_per_node = 2
nic_gbps = 400
inter_latency_us = 4
""")
    g = c.group("A100-80")
    assert g.chips == 48 and g.chips_per_nic == 8
    assert g.nic_bw == pytest.approx(50e9)          # 400 Gbit/s
    assert g.intra_bw == pytest.approx(300e9)
    assert g.inter_latency == pytest.approx(4e-6)
    assert c.group("H200").nic_bw == pytest.approx(25e9)
    assert c.total_chips == 64


# ----------------------------------------------------------------------------------------------
# errors name the file, the line and what was expected

def test_bad_toml_reports_tomllib_position():
    text = cluster_text('[chips.X]\nbase = "H100-SXM"\nmem_gib = = 3\n')
    e = error_of(text)
    assert e.file == "c.toml" and e.line == 3 and e.col
    assert "invalid TOML" in e.message


def test_unknown_base_names_the_key_line_and_suggests():
    text = cluster_text('[chips.X]\nvendor = "v"\nbase = "H100"\n')
    e = error_of(text)
    assert e.line == line_of(text, 'base = "H100"')
    assert "chips.X.base" in e.message and "unknown catalog chip 'H100'" in e.message
    assert "H100-SXM" in e.hint


def test_missing_field_names_the_key_path():
    text = cluster_text('[chips.X]\nvendor = "v"\nbackend = "torch"\n'
                        'peak_tflops = { fp32 = 1 }\nmem_bw_gbs = 10\n')
    e = error_of(text)
    assert "chips.X.mem_gib" in e.message and "missing" in e.message
    assert e.line == line_of(text, "[chips.X]")


def test_wrong_type_says_what_was_expected():
    text = cluster_text('[chips.X]\nbase = "H200"\nmem_gib = "lots"\n')
    e = error_of(text)
    assert e.line == line_of(text, "mem_gib")
    assert "expected a positive number (GiB)" in e.message and '"lots"' in e.message
    assert str(e).startswith(f"c.toml:{e.line}: error: chips.X.mem_gib")


@pytest.mark.parametrize("bad, expected", [
    ("count = true", "expected a positive integer, got true"),
    ("count = 0", "expected a positive integer, got 0"),
    ("count = 2.5", "expected a positive integer, got 2.5"),
    ("nic_gbps = -1", "expected a positive number (Gbit/s per NIC), got -1"),
    ("nic_gbps = nan", "expected a positive number"),
])
def test_node_field_types(bad, expected):
    key = bad.split(" ")[0]
    text = re.sub(rf"^{key} = .*$", bad, cluster_text("", chip="H200"), flags=re.M)
    e = error_of(text)
    assert expected in e.message and f"nodes[0].{key}" in e.message
    assert e.line == line_of(text, bad)


def test_unknown_node_chip_points_at_the_right_node_table():
    text = cluster_text("", chip="H200") + NODE.format(chip="Chip-Z")
    e = error_of(text)
    assert "nodes[1].chip" in e.message and "Chip-Z" in e.message
    assert e.line == line_of(text, 'chip = "Chip-Z"')


def test_unknown_key_is_a_typo_with_a_suggestion():
    text = cluster_text('[chips.X]\nbase = "H200"\nmem_gb = 64\n')
    e = error_of(text)
    assert "unknown chip field 'mem_gb'" in e.message and "mem_gib" in e.hint
    assert e.line == line_of(text, "mem_gb =")


def test_unpublished_catalog_figure_must_be_supplied():
    text = cluster_text('[chips.X]\nbase = "Ascend-910B"\npeak_tflops = { bf16 = 280 }\n')
    e = error_of(text)
    assert "chips.X.mem_bw_gbs" in e.message and "Ascend-910B" in e.message


def test_chip_without_the_cluster_dtype_is_rejected():
    text = cluster_text('[chips.X]\nbase = "Ascend-910B"\nmem_bw_gbs = 1600\n')
    e = error_of(text)
    assert "chips.X.peak_tflops" in e.message and "'bf16'" in e.message and "fp16" in e.message


def test_cluster_without_nodes_is_rejected():
    e = error_of('name = "empty"\n')
    assert "[[nodes]]" in e.message


# ----------------------------------------------------------------------------------------------
# fuzz: mutated cluster files raise H2Error or load, nothing else

def test_mutated_cluster_files_only_raise_h2error():
    seed = (BUILTIN_DIR / "h2-1024.toml").read_text()
    rng = random.Random(1234)
    junk = ['"', "=", "[", "]", "{", "}", ".", "-1", "0", "1e999", "nan", "true", "\n", "é",
            "[[nodes]]", "[chips.Q]", "base = \"H200\"", "count = ", "1" * 30]
    outcomes = {"ok": 0, "error": 0}
    for _ in range(400):
        text = seed
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(len(text))
            op = rng.randrange(4)
            if op == 0:
                text = text[:i] + text[i + rng.randint(1, 20):]
            elif op == 1:
                text = text[:i] + rng.choice(junk) + text[i:]
            elif op == 2:
                lines = text.split("\n")
                a, b = rng.randrange(len(lines)), rng.randrange(len(lines))
                lines[a], lines[b] = lines[b], lines[a]
                text = "\n".join(lines)
            else:
                text = re.sub(r"\d+(\.\d+)?", lambda m: rng.choice(["0", "-3", "7", "1e40"]),
                              text, count=1)
        try:
            parse_cluster(text, file="fuzz.toml")
            outcomes["ok"] += 1
        except H2Error as e:
            assert e.file == "fuzz.toml"
            assert "Traceback" not in str(e)
            outcomes["error"] += 1
    # the mutator must actually produce both kinds, or this test proves nothing
    assert outcomes["ok"] > 10 and outcomes["error"] > 100, outcomes
