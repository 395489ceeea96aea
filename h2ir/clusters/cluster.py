"""Cluster description: chip types, nodes and links.

Data only here; loading from TOML and the built-in chip catalog live in `h2ir/clusters/clusterfile.py`.
Units: FLOP/s, bytes, bytes/s, seconds.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ChipType:
    name: str
    backend: str                       # op library that runs on it: 'torch', 'numpy', 'cuda', ...
    vendor: str
    peak_flops: dict                   # dtype ('fp32', 'bf16', 'fp16', ...) -> peak FLOP/s
    mem_bytes: int
    mem_bw: float                      # device memory bandwidth, B/s
    efficiency: float = 0.5            # achievable fraction of peak on transformer layers (MFU)
    price_per_hour: float | None = None
    power_w: float | None = None
    measured: bool = False             # True when peak/efficiency come from `h2c profile`

    def flops(self, dtype: str = "bf16") -> float:
        """Achievable FLOP/s for `dtype` (peak * efficiency)."""
        peak = self.peak_flops.get(dtype) or self.peak_flops.get("fp32")
        return peak * self.efficiency


@dataclass(frozen=True)
class NodeGroup:
    """`nodes` identical nodes, each with `chips_per_node` chips of one type."""
    chip: str
    nodes: int
    chips_per_node: int
    intra_bw: float                    # chip-to-chip bandwidth inside a node, B/s (per direction)
    nics_per_node: int = 1
    nic_bw: float = 12.5e9             # per NIC, B/s
    intra_latency: float = 5e-6        # s
    inter_latency: float = 10e-6       # s
    iface: str | None = None           # network interface h2x workers listen on (None: the one
                                       # that routes to the rendezvous host)

    @property
    def chips(self) -> int:
        return self.nodes * self.chips_per_node

    @property
    def chips_per_nic(self) -> int:
        return max(1, self.chips_per_node // max(1, self.nics_per_node))


@dataclass(frozen=True)
class Cluster:
    name: str
    chip_types: dict                   # name -> ChipType
    groups: tuple                      # NodeGroup, ...
    dtype: str = "bf16"                # training compute dtype the plan is costed for
    source: str | None = field(default=None, compare=False)

    def count(self, chip: str) -> int:
        return sum(g.chips for g in self.groups if g.chip == chip)

    def group(self, chip: str) -> NodeGroup:
        for g in self.groups:
            if g.chip == chip:
                return g
        raise KeyError(chip)

    def chip(self, name: str) -> ChipType:
        return self.chip_types[name]

    @property
    def total_chips(self) -> int:
        return sum(g.chips for g in self.groups)
