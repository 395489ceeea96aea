"""Cluster description files: TOML text -> `h2ir.clusters.cluster.Cluster`, plus the built-in chip catalog.

A cluster file declares chip types (optionally starting from a catalog entry, `base = "H800"`,
with per-field overrides) and groups of identical nodes. docs/clusters.md is the reference;
in short:

    name  = "h2-1024"                 # optional, defaults to the file name
    dtype = "bf16"                    # compute dtype plans are costed for (default bf16)
    shared_cores = "auto"             # optional: the chips are processes sharing this many
                                      # CPU cores (a number, or "auto": this machine's)
    [machines.box]                    # optional: a machine some node groups' chips share
    cores = 16                        # (a number, or "auto")

    [chips.Chip-A]
    base        = "H800"              # catalog entry (h2ir/catalog/chips.toml); optional
    mem_gib     = 64                  # any field may be overridden
    peak_tflops = { bf16 = 900 }      # merged per dtype with the base's table

    [[nodes]]
    chip           = "Chip-A"         # a [chips] name, or a catalog name used as is
    count          = 32               # nodes in this group
    chips_per_node = 8
    intra_bw_gbs   = 200              # chip-to-chip inside a node, GB/s per direction
    nics_per_node  = 4                # chips_per_node / nics_per_node chips share one NIC
    nic_gbps       = 200              # per NIC, Gbit/s (as NICs are sold)
    host_cores     = 64               # optional: each node is a host whose chips share 64 cores
    # machine      = "box"            # or: these nodes are processes on [machines.box]

Units in the file are the ones datasheets use (TFLOP/s, GiB, GB/s, Gbit/s, microseconds); the
`Cluster` holds SI base units (FLOP/s, bytes, B/s, s), as h2ir/clusters/cluster.py documents.

Every error is an H2Error naming the file, the line (tomllib's for syntax errors; for schema
errors the line of the offending key, found by scanning the text) and the key path, e.g.
`h2-1024.toml:14: error: chips.Chip-A.mem_gib: expected a positive number (GiB), got "lots"`.
"""
from __future__ import annotations

import difflib
import functools
import math
import os
import re
import tomllib
from pathlib import Path

from h2ir.clusters.cluster import OP_CLASSES, ChipType, Cluster, NodeGroup
from h2ir.errors import H2Error, read_user_file, too_deep

CATALOG_PATH = Path(__file__).resolve().parent / "catalog" / "chips.toml"
# Built-in clusters live in the repository's examples/clusters; with `pip install -e .` the
# package directory is the repository's h2ir/, so this path resolves there.
BUILTIN_DIR = Path(__file__).resolve().parents[2] / "examples" / "clusters"

GIB = 2 ** 30

_TOP_KEYS = ("name", "dtype", "chips", "nodes", "shared_cores", "machines")
_CHIP_KEYS = ("base", "vendor", "backend", "peak_tflops", "mem_gib", "mem_bw_gbs", "efficiency",
              "price_per_hour", "power_w", "measured", "fused_attention", "mem_reserved_gib",
              "mem_fragmentation")
_CATALOG_KEYS = tuple(k for k in _CHIP_KEYS if k != "base")
_REQUIRED_CHIP_KEYS = ("vendor", "backend", "peak_tflops", "mem_gib", "mem_bw_gbs")
_NODE_KEYS = ("chip", "count", "chips_per_node", "intra_bw_gbs", "nics_per_node", "nic_gbps",
              "intra_latency_us", "inter_latency_us", "iface", "host_cores", "machine")


# ----------------------------------------------------------------------------------------------
# public API

def load_cluster(path_or_name: str | Path) -> Cluster:
    """Load a cluster from a .toml path, or a built-in name (`local`, `local-mixed`, `h2-768`,
    `h2-1024`: the files in examples/clusters)."""
    path = _resolve(path_or_name)
    text = read_user_file(path, "cluster file")
    return parse_cluster(text, file=str(path), default_name=path.stem)


def parse_cluster(text: str, file: str = "<string>", default_name: str | None = None) -> Cluster:
    """Parse cluster TOML text (see the module docstring for the schema)."""
    doc = _parse_toml(text, file)
    r = _Reader(file, text)
    r.only_keys(doc, (), _TOP_KEYS, "top-level key")
    name = r.string(doc, ("name",), required=False)
    if name is None:
        name = default_name or Path(file).stem
    dtype = r.string(doc, ("dtype",), required=False) or "bf16"

    chips_table = r.table(doc, ("chips",), required=False) or {}
    chip_types: dict[str, ChipType] = {}
    for chip_name, spec in chips_table.items():
        path = ("chips", chip_name)
        if not isinstance(spec, dict):
            r.fail(path, f"expected a table [chips.{chip_name}], got {_describe(spec)}")
        chip_types[chip_name] = _chip_from_table(r, chip_name, spec, path)

    nodes = doc.get("nodes")
    if nodes is None:
        r.fail((), "missing [[nodes]]: a cluster needs at least one node group")
    if not isinstance(nodes, list) or not nodes or not all(isinstance(n, dict) for n in nodes):
        r.fail(("nodes",), f"expected one or more [[nodes]] tables, got {_describe(nodes)}")
    shared = _shared_cores(r, doc)
    machines = _machines(r, doc, shared)
    groups = []
    total = 0
    for i, node in enumerate(nodes):
        groups.append(_node_group(r, node, ("nodes", i), chip_types, machines, shared))
        total += groups[-1].nodes * groups[-1].chips_per_node
        if total > MAX_CHIPS:
            r.fail(("nodes", i), f"the cluster has more than {MAX_CHIPS:.0e} chips")

    for chip_name, chip in chip_types.items():
        if dtype not in chip.peak_flops:
            r.fail(("chips", chip_name, "peak_tflops"),
                   f"no peak for the cluster's dtype '{dtype}' (has "
                   f"{', '.join(sorted(chip.peak_flops)) or 'none'}); add peak_tflops.{dtype}")
    for m in machines:
        if not any(g.machine == m for g in groups):
            r.fail(("machines", m), f"no node group runs on machine '{m}' (a [[nodes]] table "
                   f"says machine = \"{m}\")")
    return Cluster(name=name, chip_types=chip_types, groups=tuple(groups), dtype=dtype,
                   source=file, shared_cores=shared, machines=machines)


def _shared_cores(r: "_Reader", doc: dict) -> int | None:
    """`shared_cores = N` or `"auto"` (the cores this process may run on): the cluster's chips
    are processes sharing that many CPU cores."""
    if "shared_cores" not in doc:
        return None
    return _cores(r, doc, ("shared_cores",))


def _cores(r: "_Reader", table: dict, path: tuple, auto: bool = True) -> int:
    """A count of CPU cores: a positive integer or, where `auto`, "auto" (this machine's)."""
    v = table[path[-1]]
    if auto and v == "auto":
        # the cores this process may run on; a process pinned to one (an h2x worker) asks the
        # machine instead, so every process of a run reads the same number
        try:
            n = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            n = 1
        return n if n > 1 else os.cpu_count() or 1
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        r.fail(path, "expected a positive number of cores" + (' or "auto"' if auto else "")
               + f", got {_describe(v)}")
    r._at_most(path, v, "cores")
    return v


def _machines(r: "_Reader", doc: dict, shared: int | None) -> dict[str, int]:
    """`[machines.NAME] cores = N | "auto"`: machines whose CPU cores the chips of the node
    groups naming them (`machine = "NAME"`) share."""
    tab = r.table(doc, ("machines",), required=False)
    if not tab:
        return {}
    if shared is not None:
        r.fail(("machines", next(iter(tab))), "shared_cores already puts every chip on one machine; state "
               "either shared_cores or [machines], not both")
    out = {}
    for name, spec in tab.items():
        path = ("machines", name)
        if not isinstance(spec, dict):
            r.fail(path, f"expected a table [machines.{name}], got {_describe(spec)}")
        r.only_keys(spec, path, ("cores",), "machine field")
        if "cores" not in spec:
            r.fail(path + ("cores",), "missing (expected a positive number of cores or \"auto\")")
        out[name] = _cores(r, spec, path + ("cores",))
    return out


def builtin_clusters() -> list[str]:
    """Names `load_cluster` accepts without a path."""
    if not BUILTIN_DIR.is_dir():
        return []
    return sorted(p.stem for p in BUILTIN_DIR.glob("*.toml"))


def catalog_names() -> list[str]:
    return list(_catalog())


def catalog_chip(name: str) -> ChipType:
    """The catalog entry `name` as a ChipType (H2Error if unknown or missing a figure)."""
    entries = _catalog()
    if name not in entries:
        raise H2Error(f"unknown catalog chip '{name}'", file=str(CATALOG_PATH),
                      hint=_suggest(name, entries))
    fields = dict(entries[name])
    missing = [k for k in _REQUIRED_CHIP_KEYS if k not in fields]
    if missing:
        raise H2Error(f"catalog chip '{name}' has no published {', '.join(missing)}; "
                      f"define a [chips.<name>] table with base = \"{name}\" and set it",
                      file=str(CATALOG_PATH))
    return _make_chip(name, fields)


# ----------------------------------------------------------------------------------------------
# chips and nodes

def _chip_from_table(r: "_Reader", name: str, spec: dict, path: tuple) -> ChipType:
    r.only_keys(spec, path, _CHIP_KEYS, "chip field")
    fields: dict = {}
    base = r.string(spec, path + ("base",), required=False)
    if base is not None:
        entries = _catalog()
        if base not in entries:
            r.fail(path + ("base",), f"unknown catalog chip '{base}'", hint=_suggest(base, entries))
        fields = dict(entries[base])
        fields["peak_tflops"] = dict(fields.get("peak_tflops", {}))
    overrides = _chip_fields(r, spec, path)
    peak = overrides.pop("peak_tflops", None)
    if isinstance(overrides.get("efficiency"), dict) and isinstance(fields.get("efficiency"), dict):
        overrides["efficiency"] = {**fields["efficiency"], **overrides["efficiency"]}
    fields.update(overrides)
    if peak is not None:
        fields.setdefault("peak_tflops", {}).update(peak)
    for key in _REQUIRED_CHIP_KEYS:
        if key not in fields or (key == "peak_tflops" and not fields[key]):
            why = (f"catalog entry '{base}' has no published figure for it, so set it here"
                   if base else "set it, or start from a catalog entry with base = \"...\"")
            r.fail(path + (key,), f"missing ({_UNIT[key]}); {why}")
    return _make_chip(name, fields)


def _chip_fields(r: "_Reader", spec: dict, path: tuple) -> dict:
    """Type-checked chip fields present in `spec` (file units), without 'base'."""
    out: dict = {}
    for key in ("vendor", "backend"):
        v = r.string(spec, path + (key,), required=False)
        if v is not None:
            out[key] = v
    if "peak_tflops" in spec:
        peak = r.table(spec, path + ("peak_tflops",), required=True)
        out["peak_tflops"] = {dt: r.positive(peak, path + ("peak_tflops", dt), "TFLOP/s")
                              for dt in peak}
    for key in ("mem_gib", "mem_bw_gbs", "price_per_hour", "power_w"):
        if key in spec:
            out[key] = r.positive(spec, path + (key,), _UNIT[key])
    if "efficiency" in spec:
        # one fraction of peak for every op class, or a table per op class (OP_CLASSES)
        if isinstance(spec["efficiency"], dict):
            tab = r.table(spec, path + ("efficiency",), required=True)
            r.only_keys(tab, path + ("efficiency",), OP_CLASSES, "op class")
            out["efficiency"] = {k: _fraction(r, tab, path + ("efficiency", k)) for k in tab}
        else:
            out["efficiency"] = _fraction(r, spec, path + ("efficiency",))
    if "measured" in spec:
        out["measured"] = r.boolean(spec, path + ("measured",))
    if "fused_attention" in spec:
        out["fused_attention"] = r.boolean(spec, path + ("fused_attention",))
    if "mem_reserved_gib" in spec:
        v = spec["mem_reserved_gib"]
        if v != 0:
            v = r.positive(spec, path + ("mem_reserved_gib",), "GiB")
        out["mem_reserved_gib"] = v
    if "mem_fragmentation" in spec:
        v = spec["mem_fragmentation"]
        if v != 0:
            v = _fraction(r, spec, path + ("mem_fragmentation",))
            if v >= 1:
                r.fail(path + ("mem_fragmentation",), f"expected a fraction below 1, got {v}")
        out["mem_fragmentation"] = v
    return out


def _fraction(r: "_Reader", table: dict, path: tuple) -> float:
    v = r.positive(table, path, "fraction")
    if v > 1:
        r.fail(path, f"expected a fraction in (0, 1], got {v}")
    return v


def _make_chip(name: str, f: dict) -> ChipType:
    extra = {k: f[k] for k in ("efficiency", "price_per_hour", "power_w", "measured",
                               "fused_attention", "mem_fragmentation") if k in f}
    if "mem_reserved_gib" in f:
        extra["mem_reserved_bytes"] = int(f["mem_reserved_gib"] * GIB)
    return ChipType(
        name=name, backend=f["backend"], vendor=f["vendor"],
        peak_flops={dt: v * 1e12 for dt, v in f["peak_tflops"].items()},
        mem_bytes=int(f["mem_gib"] * GIB), mem_bw=f["mem_bw_gbs"] * 1e9, **extra)


def _node_group(r: "_Reader", node: dict, path: tuple, chip_types: dict, machines: dict,
                shared: int | None) -> NodeGroup:
    r.only_keys(node, path, _NODE_KEYS, "node field")
    chip = r.string(node, path + ("chip",), required=True)
    if chip not in chip_types:
        # a catalog name can be used directly when the file does not define it
        if chip in _catalog():
            try:
                chip_types[chip] = catalog_chip(chip)
            except H2Error as e:
                r.fail(path + ("chip",), e.message)
        else:
            known = list(chip_types) + [c for c in _catalog() if c not in chip_types]
            r.fail(path + ("chip",), f"unknown chip type '{chip}': not a [chips] table in this "
                   f"file nor a catalog entry", hint=_suggest(chip, known))
    kw = dict(
        chip=chip,
        nodes=r.count(node, path + ("count",), required=True),
        chips_per_node=r.count(node, path + ("chips_per_node",), required=True),
        intra_bw=r.positive(node, path + ("intra_bw_gbs",), "GB/s per direction") * 1e9,
        nic_bw=r.positive(node, path + ("nic_gbps",), "Gbit/s per NIC") * 1e9 / 8,
    )
    if "nics_per_node" in node:
        kw["nics_per_node"] = r.count(node, path + ("nics_per_node",), required=True)
    for key, field in (("intra_latency_us", "intra_latency"), ("inter_latency_us", "inter_latency")):
        if key in node:
            kw[field] = r.positive(node, path + (key,), "microseconds") * 1e-6
    if "iface" in node:         # an interface name, as `ip link` lists it (Linux: at most 15 bytes)
        iface = r.string(node, path + ("iface",), required=True)
        if not re.fullmatch(r"[A-Za-z0-9_.:@-]{1,15}", iface):
            r.fail(path + ("iface",), f"'{iface}' is not a network interface name (1-15 of "
                   "letters, digits and _ . : @ -)")
        kw["iface"] = iface
    # the cores the group's chips share: one named machine's, or each node's own
    if ("machine" in node or "host_cores" in node) and shared is not None:
        key = "machine" if "machine" in node else "host_cores"
        r.fail(path + (key,), "shared_cores already puts every chip on one machine; drop one")
    if "machine" in node and "host_cores" in node:
        r.fail(path + ("host_cores",), "a node group runs on a named machine or on hosts of its "
               "own (host_cores), not both")
    if "machine" in node:
        m = r.string(node, path + ("machine",), required=True)
        if m not in machines:
            r.fail(path + ("machine",), f"unknown machine '{m}': not a [machines] table in this "
                   "file", hint=_suggest(m, machines))
        kw["machine"] = m
    if "host_cores" in node:
        kw["host_cores"] = _cores(r, node, path + ("host_cores",), auto=False)
    return NodeGroup(**kw)


# Upper bounds of the numeric fields (file units): a figure past these is a typo, and the
# resource model's arithmetic (bytes as int, FLOP/s products) stays finite. Each is far past any
# chip or network sold.
_MAX = {"peak_tflops": 1e6, "mem_gib": 1e6, "mem_reserved_gib": 1e6, "mem_bw_gbs": 1e7, "price_per_hour": 1e9,
        "power_w": 1e7, "intra_bw_gbs": 1e7, "nic_gbps": 1e8, "intra_latency_us": 1e9,
        "inter_latency_us": 1e9, "count": 10 ** 9, "chips_per_node": 10 ** 6,
        "nics_per_node": 10 ** 6, "shared_cores": 10 ** 6, "cores": 10 ** 6,
        "host_cores": 10 ** 6}
MAX_CHIPS = 10 ** 12            # chips in one cluster, all groups together

_UNIT = {"vendor": "a string", "backend": "op library, e.g. \"torch\"",
         "peak_tflops": "a table dtype -> TFLOP/s", "mem_gib": "GiB", "mem_bw_gbs": "GB/s",
         "price_per_hour": "currency units per hour", "power_w": "watts"}


@functools.lru_cache(maxsize=1)
def _catalog() -> dict[str, dict]:
    """Catalog entries as validated field dicts in file units (may lack unpublished fields)."""
    file = str(CATALOG_PATH)
    try:
        text = CATALOG_PATH.read_text(encoding="utf-8")
    except OSError as e:
        raise H2Error(f"cannot read the chip catalog: {e.strerror}", file=file) from None
    doc = _parse_toml(text, file)
    r = _Reader(file, text)
    out = {}
    for name, spec in doc.items():
        if not isinstance(spec, dict):
            r.fail((name,), f"expected a table [{name}], got {_describe(spec)}")
        r.only_keys(spec, (name,), _CATALOG_KEYS, "catalog field")
        out[name] = _chip_fields(r, spec, (name,))
    return out


# ----------------------------------------------------------------------------------------------
# reading TOML values with located errors

def _parse_toml(text: str, file: str) -> dict:
    try:
        return tomllib.loads(text)
    except RecursionError:          # arrays or inline tables nested hundreds deep
        raise too_deep(text, file, "TOML") from None
    except tomllib.TOMLDecodeError as e:
        msg = str(e)
        line = col = None
        m = re.search(r"\s*\(at line (\d+), column (\d+)\)\s*$", msg)
        if m:
            line, col = int(m[1]), int(m[2])
            msg = msg[:m.start()]
        else:
            m = re.search(r"\s*\(at end of document\)\s*$", msg)
            if m:
                line = text.count("\n") + 1
                msg = msg[:m.start()] + " at end of file"
        raise H2Error(f"invalid TOML: {msg}", file=file, line=line, col=col) from None


class _Reader:
    """Typed access to a parsed TOML document that reports errors at the key's source line."""

    def __init__(self, file: str, text: str):
        self.file = file
        self.lines = _KeyLines(text)

    def fail(self, path: tuple, message: str, hint: str | None = None):
        where = _path_str(path)
        raise H2Error(f"{where}: {message}" if where else message, file=self.file,
                      line=self.lines.line(path), hint=hint)

    def only_keys(self, table: dict, path: tuple, allowed: tuple, what: str):
        for key in table:
            if key not in allowed:
                self.fail(path + (key,), f"unknown {what} '{key}'; expected one of: "
                          + ", ".join(allowed), hint=_suggest(key, allowed))

    def _get(self, table: dict, path: tuple, required: bool, what: str):
        key = path[-1]
        if key not in table:
            if required:
                self.fail(path, f"missing (expected {what})")
            return None
        return table[key]

    def string(self, table, path, required):
        v = self._get(table, path, required, "a string")
        if v is not None and not isinstance(v, str):
            self.fail(path, f"expected a string, got {_describe(v)}")
        return v

    def table(self, table, path, required):
        v = self._get(table, path, required, "a table")
        if v is not None and not isinstance(v, dict):
            self.fail(path, f"expected a table, got {_describe(v)}")
        return v

    def boolean(self, table, path):
        v = self._get(table, path, True, "true or false")
        if not isinstance(v, bool):
            self.fail(path, f"expected true or false, got {_describe(v)}")
        return v

    def positive(self, table, path, unit):
        v = self._get(table, path, True, f"a positive number ({unit})")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            self.fail(path, f"expected a positive number ({unit}), got {_describe(v)}")
        self._at_most(path, v, unit)
        return v

    def count(self, table, path, required):
        v = self._get(table, path, required, "a positive integer")
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            self.fail(path, f"expected a positive integer, got {_describe(v)}")
        if v is not None:
            self._at_most(path, v, "")
        return v

    def _at_most(self, path, v, unit):
        key = path[-2] if len(path) >= 2 and path[-2] == "peak_tflops" else path[-1]
        hi = _MAX.get(key)
        if hi is not None and v > hi:
            self.fail(path, f"{_describe(v)}{' ' + unit if unit else ''} is larger than any "
                      f"real one (at most {hi:g})")


class _KeyLines:
    """Source line of each key path, found by scanning the text (tomllib keeps no positions).

    Best effort: table headers, array-of-table headers and `key =` lines; a key inside an inline
    table or a multi-line value reports the line of the enclosing key."""

    _HEADER_ARRAY = re.compile(r"^\[\[\s*(.+?)\s*\]\]")
    _HEADER = re.compile(r"^\[\s*(.+?)\s*\]")
    _KEY = re.compile(r"""^((?:"[^"]*"|'[^']*'|[A-Za-z0-9_\-]+)"""
                      r"""(?:\s*\.\s*(?:"[^"]*"|'[^']*'|[A-Za-z0-9_\-]+))*)\s*=""")

    def __init__(self, text: str):
        self.at: dict[tuple, int] = {}
        arrays: dict[tuple, int] = {}
        current: tuple = ()
        for no, raw in enumerate(text.split("\n"), 1):
            s = raw.strip()
            if not s or s.startswith("#"):
                continue
            m = self._HEADER_ARRAY.match(s)
            if m:
                p = _split_key(m[1])
                arrays[p] = arrays.get(p, -1) + 1
                current = p + (arrays[p],)
                self.at.setdefault(current, no)
                continue
            m = self._HEADER.match(s)
            if m:
                current = _split_key(m[1])
                self.at.setdefault(current, no)
                continue
            m = self._KEY.match(s)
            if m:
                self.at.setdefault(current + _split_key(m[1]), no)

    def line(self, path: tuple) -> int | None:
        p = tuple(path)
        while p:
            if p in self.at:
                return self.at[p]
            p = p[:-1]
        return None


def _split_key(dotted: str) -> tuple:
    parts = re.findall(r"""\s*("[^"]*"|'[^']*'|[^.\s]+)\s*(?:\.|$)""", dotted)
    return tuple(p[1:-1] if p[:1] in "\"'" and len(p) >= 2 else p for p in parts)


def _path_str(path: tuple) -> str:
    out = ""
    for p in path:
        if isinstance(p, int):
            out += f"[{p}]"
        else:
            out += ("." if out else "") + str(p)
    return out


def _describe(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return f'"{v}"' if len(v) <= 40 else f'"{v[:37]}..."'
    if isinstance(v, dict):
        return "a table"
    if isinstance(v, list):
        return "an array"
    return repr(v)


def _suggest(word: str, choices) -> str | None:
    choices = list(choices)
    w = word.lower()
    if not w:
        return None
    # same name in another case, then names it is a prefix of ('H100' -> 'H100-SXM'), then
    # spelling neighbours
    first = [c for c in choices if c.lower() == w] + [c for c in choices
                                                      if c.lower().startswith(w) and c.lower() != w]
    close = first + [c for c in difflib.get_close_matches(word, choices, n=3, cutoff=0.5)
                     if c not in first]
    close = close[:3]
    return ("did you mean " + " or ".join(f"'{c}'" for c in close) + "?") if close else None


def _resolve(path_or_name: str | Path) -> Path:
    p = Path(path_or_name)
    looks_like_path = isinstance(path_or_name, Path) or p.suffix == ".toml" or len(p.parts) > 1
    if looks_like_path or p.is_file():
        if not p.is_file():
            raise H2Error(f"no such cluster file: {p}", hint=_builtin_hint())
        return p
    candidate = BUILTIN_DIR / f"{p.name}.toml"
    if candidate.is_file():
        return candidate
    raise H2Error(f"unknown cluster '{path_or_name}': not a file and not a built-in cluster",
                  hint=_builtin_hint(str(path_or_name)))


def _builtin_hint(name: str | None = None) -> str:
    names = builtin_clusters()
    text = "built-in clusters: " + (", ".join(names) if names else f"none found in {BUILTIN_DIR}")
    close = _suggest(name, names) if name else None
    return f"{close} ({text})" if close else text
