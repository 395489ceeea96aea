"""Cluster description: chip types, nodes and links.

Data only here; loading from TOML and the built-in chip catalog live in `h2ir/clusters/clusterfile.py`.
Units: FLOP/s, bytes, bytes/s, seconds.
"""
from __future__ import annotations

from dataclasses import dataclass, field


# Op classes a layer's work is split into for costing (h2ir/planner/resource/): dense
# matmuls (GEMMs: projections, MLP, LM head), the attention core (scores and values), and
# memory-bound work (norms, activations, residuals, softmax/loss: bytes moved / bandwidth).
OP_CLASSES = ("matmul", "attention", "memory")

# Used only for a chip that states no efficiency of its own (the catalog's entries all do, with
# their sources; docs/clusters.md): a chosen middle value, not a measurement.
DEFAULT_EFFICIENCY = {"matmul": 0.5, "attention": 0.35, "memory": 0.7}
# Memory a chip cannot give to model state and activations: runtime context (CUDA context and
# library workspaces), communication buffers, allocator fragmentation. Chosen defaults, see
# docs/clusters.md: 1 GiB reserved + 5 % of capacity for accelerators, 0.25 GiB + 5 % for CPUs.
DEFAULT_MEM_RESERVED_GIB = {"cpu": 0.25}
DEFAULT_MEM_RESERVED_GIB_ACCEL = 1.0
DEFAULT_MEM_FRAGMENTATION = 0.05


@dataclass(frozen=True)
class ChipType:
    name: str
    backend: str                       # op library that runs on it: 'torch', 'numpy', 'cuda', ...
    vendor: str
    peak_flops: dict                   # dtype ('fp32', 'bf16', 'fp16', ...) -> peak FLOP/s
    mem_bytes: int
    mem_bw: float                      # device memory bandwidth, B/s
    # achievable fraction of peak per op class (OP_CLASSES; memory: of mem_bw); a float sets
    # every class (the old single figure)
    efficiency: object = None
    price_per_hour: float | None = None
    power_w: float | None = None
    measured: bool = False             # True when peak/efficiency come from `h2c profile`
    fused_attention: bool = True       # a fused (flash) attention kernel: no s x s scores kept
    mem_reserved_bytes: int | None = None     # runtime context + comm buffers (None: default)
    mem_fragmentation: float | None = None    # fraction of capacity lost to fragmentation

    def eff(self, op_class: str) -> float:
        e = self.efficiency
        if e is None:
            return DEFAULT_EFFICIENCY[op_class]
        if isinstance(e, (int, float)):
            return float(e)
        return float(e.get(op_class, DEFAULT_EFFICIENCY[op_class]))

    def flops(self, dtype: str = "bf16", op_class: str = "matmul") -> float:
        """Achievable FLOP/s for `dtype` on `op_class` (peak * that class's efficiency)."""
        peak = self.peak_flops.get(dtype) or self.peak_flops.get("fp32")
        return peak * self.eff(op_class)

    @property
    def usable_mem_bytes(self) -> int:
        """Capacity left for model state and activations: minus the reserved runtime/comm bytes
        and the fragmentation share."""
        frag = DEFAULT_MEM_FRAGMENTATION if self.mem_fragmentation is None else self.mem_fragmentation
        if self.mem_reserved_bytes is not None:
            res = self.mem_reserved_bytes
        else:
            res = DEFAULT_MEM_RESERVED_GIB.get(self.vendor, DEFAULT_MEM_RESERVED_GIB_ACCEL) * 2**30
        return max(0, int(self.mem_bytes * (1 - frag) - res))


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
    # the CPU cores a node's chips share (`Cluster.core_domains`): each node its own host with
    # `host_cores`, or every node of the group a process set on the machine named `machine`
    host_cores: int | None = None
    machine: str | None = None

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
    # the chips are processes on one machine with this many CPU cores (this machine's clusters,
    # the emulated test bed): the simulator slows workers that compute at once on them as
    # measured (`h2ir.planner.calibration.contention`), or by time sharing past the cores
    shared_cores: int | None = None
    machines: dict = field(default_factory=dict)     # machine name -> its CPU cores

    @property
    def shares_cores(self) -> bool:
        """Some chips share CPU cores (`shared_cores`, a group's `machine` or `host_cores`)."""
        return bool(self.shared_cores or any(g.machine or g.host_cores for g in self.groups))

    def node_domain(self, node: int):
        """The set of CPU cores node `node` shares with others, as a hashable key (`domain_cores`
        gives its cores), or None where the cluster says nothing. Nodes are numbered as
        `h2ir.schedule.streams.worker_hosts(renumber=False)` numbers them: node groups in file
        order, node by node. `shared_cores`: one machine holds every node; a group's `machine`:
        every node of the groups naming it; `host_cores`: each node its own host."""
        if self.shared_cores:
            return "machine"
        for g in self.groups:
            if node < g.nodes:
                if g.machine is not None:
                    return ("machine", g.machine)
                return ("node", node) if g.host_cores else None
            node -= g.nodes
        return None

    def domain_cores(self, key) -> int:
        if key == "machine":
            return self.shared_cores
        if key[0] == "machine":
            return self.machines[key[1]]
        return self.group_of_node(key[1]).host_cores

    def group_of_node(self, node: int) -> NodeGroup:
        for g in self.groups:
            if node < g.nodes:
                return g
            node -= g.nodes
        raise IndexError(node)

    def colocation(self) -> tuple[int, dict] | None:
        """(cores, {backend: chips}) of the set of shared cores that holds the most `measured`
        chips: the co-location their layer times are measured under (frontend/profile.py);
        None where no measured chips share cores."""
        sets: list[tuple[int, list]] = []
        if self.shared_cores:
            sets.append((self.shared_cores, [(g, g.chips) for g in self.groups]))
        for name, cores in self.machines.items():
            sets.append((cores, [(g, g.chips) for g in self.groups if g.machine == name]))
        sets += [(g.host_cores, [(g, g.chips_per_node)]) for g in self.groups
                 if g.host_cores and g.machine is None and not self.shared_cores]
        best = None
        for cores, members in sets:
            n: dict[str, int] = {}
            for g, k in members:
                if self.chip(g.chip).measured:
                    b = self.chip(g.chip).backend
                    n[b] = n.get(b, 0) + k
            if n and (best is None or sum(n.values()) > sum(best[1].values())):
                best = (cores, n)
        return best

    def count(self, chip: str) -> int:
        return sum(g.chips for g in self.groups if g.chip == chip)

    def groups_of(self, chip: str) -> tuple:
        return tuple(g for g in self.groups if g.chip == chip)

    def group(self, chip: str) -> NodeGroup:
        """The node group a chip type's stages are costed on. One group: itself. Several (the
        same chip in nodes of different shapes or links): every one of them counts, as the group
        that bounds them all — replicas of a stage run identical streams, so the slowest node
        sets the pace: fewest chips per node, slowest intra-node link and per-chip NIC share,
        longest latencies; its chips are all the type's chips."""
        gs = self.groups_of(chip)
        if not gs:
            raise KeyError(chip)
        if len(gs) == 1:
            return gs[0]
        cache = self.__dict__.setdefault("_merged_groups", {})
        if chip not in cache:
            cpn = min(g.chips_per_node for g in gs)
            share = min(g.nics_per_node * g.nic_bw / g.chips_per_node for g in gs)
            total = sum(g.chips for g in gs)
            ifaces = {g.iface for g in gs}
            cache[chip] = NodeGroup(
                chip=chip, nodes=-(-total // cpn), chips_per_node=cpn,
                intra_bw=min(g.intra_bw for g in gs), nics_per_node=1, nic_bw=share * cpn,
                intra_latency=max(g.intra_latency for g in gs),
                inter_latency=max(g.inter_latency for g in gs),
                iface=ifaces.pop() if len(ifaces) == 1 else None)
        return cache[chip]

    def chip(self, name: str) -> ChipType:
        return self.chip_types[name]

    @property
    def total_chips(self) -> int:
        return sum(g.chips for g in self.groups)
