"""Communication: collective formulas (ring, hierarchical, all-to-all), link and group
geometry, EP groups and their all-to-all, and `LinePlacement` (the build's hosts and NICs)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from h2ir.clusters.cluster import Cluster, NodeGroup
from h2ir.costs import ModelCosts, MoEInfo
from h2ir.errors import H2Error
from h2ir.planner import alltoall
from h2ir.schedule.streams import WorkerLayout, worker_hosts


def ring_allreduce_time(nbytes: float, n: int, bw: float, latency: float) -> float:
    """Ring all-reduce: 2(n-1)/n * bytes / bw (Patarasuk & Yuan 2009, Sec. 3), plus 2(n-1)
    message latencies (reduce-scatter then all-gather, Thakur et al. 2005 Sec. 4)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * latency


def hierarchical_allreduce_time(nbytes: float, per_node: int, nodes: int, intra_bw: float,
                                inter_bw: float, intra_latency: float, inter_latency: float) -> float:
    """Two-level all-reduce: intra-node reduce-scatter, inter-node ring on each 1/per_node shard
    (all shards in parallel, each over its chip's NIC share), intra-node all-gather.
    (Hierarchical/2D all-reduce as in Jia et al. 2018 "Highly scalable DL training system with
    mixed-precision", Sec. 3.3; Thakur et al. 2005 for the reduce-scatter/all-gather halves.)"""
    if per_node * nodes <= 1 or nbytes <= 0:
        return 0.0
    k, N = per_node, nodes
    rs = (k - 1) / k * nbytes / intra_bw + (k - 1) * intra_latency
    inter = ring_allreduce_time(nbytes / k, N, inter_bw, inter_latency)
    return 2 * rs + inter


def all_to_all_flat_time(nbytes: float, n: int, per_node: int, intra_bw: float, inter_bw: float,
                         intra_latency: float, inter_latency: float) -> float:
    """Flat all-to-all: every device sends 1/n of its `nbytes` to each of the n-1 others directly.
    The (n - per_node)/n share that leaves the node goes over the NIC share, the rest over the
    intra-node links, concurrently; one message per peer."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    k = min(per_node, n)
    intra = (k - 1) / n * nbytes / intra_bw
    inter = (n - k) / n * nbytes / inter_bw
    lat = (k - 1) * intra_latency + (n - k) * inter_latency
    return max(intra, inter) + lat


def all_to_all_halo_time(nbytes: float, n: int, per_node: int, intra_bw: float, inter_bw: float,
                         intra_latency: float, inter_latency: float) -> float:
    """Hierarchical (HALO-style) all-to-all: intra-node gather so each chip holds the tokens of
    its node bound for one remote node, one aggregated exchange per node pair, intra-node scatter.
    The inter-node bytes are the same as flat, but N-1 large messages replace n-k small ones, and
    the two intra-node phases are added (Piper arXiv 2605.05049, hierarchical all-to-all)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    k = min(per_node, n)
    N = max(1, math.ceil(n / k))
    if N == 1:
        return all_to_all_flat_time(nbytes, n, per_node, intra_bw, inter_bw, intra_latency, inter_latency)
    local = (k - 1) / k * nbytes / intra_bw + (k - 1) * intra_latency
    inter = (N - 1) / N * nbytes / inter_bw + (N - 1) * inter_latency
    return 2 * local + inter


# ----------------------------------------------------------------------------------------------
# links

def nic_share(g: NodeGroup) -> float:
    """Inter-node bandwidth one chip gets when every chip of its node communicates at once."""
    return g.nics_per_node * g.nic_bw / g.chips_per_node


@dataclass(frozen=True)
class GroupGeometry:
    """How a group of `n` chips (one per TP group) spreads over nodes: `per_node` per node."""
    n: int
    per_node: int

    @property
    def nodes(self) -> int:
        return max(1, math.ceil(self.n / self.per_node))


def replica_geometry(g: NodeGroup, n: int, tp: int) -> GroupGeometry:
    """A stage's n replicas are placed on consecutive chips (Megatron rank order tp, dp, pp:
    Narayanan et al. SC'21 Sec. 3), so a node holds chips_per_node // tp of them."""
    return GroupGeometry(n=n, per_node=max(1, min(n, g.chips_per_node // max(1, tp))))


def group_allreduce_time(nbytes: float, g: NodeGroup, geo: GroupGeometry) -> float:
    """All-reduce over a stage's replicas: ring inside one node, else the faster of a flat ring
    (bottlenecked by the NIC share) and the hierarchical scheme — what NCCL-like libraries pick."""
    if geo.n <= 1:
        return 0.0
    if geo.nodes == 1:
        return ring_allreduce_time(nbytes, geo.n, g.intra_bw, g.intra_latency)
    flat = ring_allreduce_time(nbytes, geo.n, min(g.intra_bw, nic_share(g)), g.inter_latency)
    hier = hierarchical_allreduce_time(nbytes, geo.per_node, geo.nodes, g.intra_bw, nic_share(g),
                                       g.intra_latency, g.inter_latency)
    return min(flat, hier)


def tp_allreduce_time(nbytes: float, g: NodeGroup, tp: int, cross: bool = False) -> float:
    """A TP group inside one node rings over the intra-node links; one that spans nodes (tp >
    chips_per_node, or `cross`: a group the build's placement puts on two hosts; the validator
    warns) is paced by the edges that cross a NIC, each chip's share of its node's NICs with
    every chip in a TP ring at once (Patarasuk & Yuan 2009: a ring runs at its slowest edge)."""
    if tp <= g.chips_per_node and not cross:
        return ring_allreduce_time(nbytes, tp, g.intra_bw, g.intra_latency)
    return ring_allreduce_time(nbytes, tp, min(g.intra_bw, nic_share(g)),
                               max(g.intra_latency, g.inter_latency))


def p2p_link(cluster: Cluster, chip_a: str, tp_a: int, chip_b: str, tp_b: int,
             dp: int) -> tuple[float, float]:
    """(latency, bandwidth) of the path from a stage on `chip_a` to the next on `chip_b`.

    With TP, each of the tp ranks sends 1/tp of the tensor (scatter/gather optimisation,
    Narayanan et al. SC'21 Sec. 4.1), so the path's bandwidth is min(tp_a * bw_a, tp_b * bw_b).
    Intra-node when both stages are on the same node group and the two stages' chips of all
    replicas (dp * (tp_a + tp_b)) fit in one node; otherwise over NICs, limited by the slower
    side's per-chip NIC share.
    """
    ga, gb = cluster.group(chip_a), cluster.group(chip_b)
    if ga is gb and dp * (tp_a + tp_b) <= ga.chips_per_node:
        return ga.intra_latency, min(tp_a, tp_b) * ga.intra_bw
    return max(ga.inter_latency, gb.inter_latency), min(tp_a * nic_share(ga), tp_b * nic_share(gb))


def p2p_time(nbytes: float, cluster: Cluster, chip_a: str, tp_a: int, chip_b: str, tp_b: int,
             dp: int) -> float:
    """One micro-batch's boundary tensor between consecutive stages: latency + bytes / bandwidth
    (Hockney's model), over the path `p2p_link` picks."""
    if nbytes <= 0:
        return 0.0
    lat, bw = p2p_link(cluster, chip_a, tp_a, chip_b, tp_b, dp)
    return lat + nbytes / bw


def hockney_time(nbytes: float, link: tuple[float, float]) -> float:
    """latency + bytes / bandwidth (Hockney's model) over a (latency, bandwidth) link."""
    return link[0] + nbytes / link[1] if nbytes > 0 else 0.0


@dataclass(frozen=True)
class EPGeometry:
    """How one stage's expert-parallel groups lie on hosts: `per_node` members of a group per
    host (the busiest), `nodes` hosts per group, and `nic_share`, the fraction of a host's NICs
    one group's members get while every EP group of the stage on that host runs its
    all-to-all at once (the dp / ep groups of a stage are in lock step)."""
    ep: int
    per_node: int
    nodes: int = 1
    nic_share: float = 1.0

    @property
    def local(self) -> bool:
        return self.nodes <= 1


def ep_groups(layout: WorkerLayout, stage: int, ep: int, rank: int = 0) -> list[tuple[int, ...]]:
    """The expert-parallel groups of `stage` (TP rank `rank`): group b is replicas
    b*ep .. b*ep+ep-1 of the stage (the compiler's rule: EP is carved out of dp, Plan.stage_ep)."""
    if ep < 1 or layout.dp % ep:
        raise H2Error(f"ep={ep} does not divide dp={layout.dp}")
    return [tuple(layout.wid(q, stage, rank) for q in range(b * ep, (b + 1) * ep))
            for b in range(layout.dp // ep)]


def default_ep_geometry(g: NodeGroup, ep: int, tp: int) -> EPGeometry:
    """Without a placement: consecutive replicas, chips_per_node // tp of them per node."""
    geo = replica_geometry(g, ep, tp)
    return EPGeometry(ep=ep, per_node=geo.per_node, nodes=geo.nodes,
                      nic_share=min(1.0, geo.per_node * tp / g.chips_per_node))


def moe_a2a_pass_time(costs: ModelCosts, moe: MoEInfo, g: NodeGroup, tp: int, ep: int, a2a: str,
                      geo: EPGeometry, capacity: float | None, bpe: int) -> float:
    """One pass (forward or backward) of one MoE layer's expert parallelism: a dispatch and a
    combine all-to-all (GShard, Lepikhin et al. 2020 Sec. 2.2; the backward runs the same two
    on the gradients), each rank sending its routed tokens' hidden states, b*s*k*d elements,
    / tp (each TP rank routes its sequence shard), x the capacity factor when buffers are
    padded to it. Time from `h2ir.planner.alltoall` (DiComm's flat or HALO algorithm) over the
    hosts the group occupies: `geo.per_node` ranks per node sharing `geo.nic_share` of the NICs."""
    if ep <= 1:
        return 0.0
    nbytes = costs.micro_batch * costs.seq_len * moe.top_k * moe.d_model * bpe / tp * (capacity or 1.0)
    topo = alltoall.topology_of(g, ranks_per_node=max(1, geo.per_node),
                                nic_bw=g.nic_bw * max(1e-9, geo.nic_share))
    fn = alltoall.halo_time if a2a == "halo" else alltoall.flat_time
    return 2 * fn(nbytes, ep, topo)


class LinePlacement:
    """Where the workers of one line of stages run, and what that makes each link cost.

    The hosts come from `h2ir.schedule.streams.worker_hosts`, the rule h2c writes into a
    build's manifest (replica-major worker ids, each worker the next chip of its stage's type,
    node by node), so the links costed here are the links h2x opens: shm inside a host, the
    NIC between hosts. A NIC is shared by every flow that crosses it at once; each gets an equal
    share (long-lived TCP flows through one bottleneck queue converge to equal rates: Chiu &
    Jain 1989; the test bed's tbf is one FIFO per port, docs/testbed.md). Flows counted per
    host and direction:

    - p2p: the host's workers with a peer stage (same replica) on another host; activations and
      gradients flow during the same pipeline phase, so they are counted together;
    - DP all-reduce: the ring edges leaving the host, over the rings of every stage and TP rank
      (the stages' all-reduces follow the pipeline flush, so they overlap).

    A ring all-reduce moves in lock step, so its slowest edge paces it: 2(n-1)/n * B / bw_min
    (Patarasuk & Yuan 2009), the ring in the dp group's order as DiComm runs it
    (executor/dicomm/comm.py: reduce-scatter then all-gather, no hierarchical phase)."""

    def __init__(self, cluster: Cluster, shapes: tuple, dp: int):
        self.cluster = cluster
        self.shapes = tuple(shapes)               # (chip, tp) per stage
        self.layout = WorkerLayout(dp, tuple(tp for _, tp in self.shapes))
        lay = self.layout
        self.hosts = worker_hosts(lay, [c for c, _ in self.shapes], cluster)
        S = len(self.shapes)
        self.group_of = {}                        # host -> its NodeGroup (NIC rate)
        for w, h in enumerate(self.hosts):
            self.group_of.setdefault(h, cluster.group(self.shapes[lay.where(w)[1]][0]))
        self.p2p_flows: dict = {}
        for w in range(lay.num_workers):
            r, s, _ = lay.where(w)
            peers = [v for t in (s - 1, s + 1) if 0 <= t < S for v in lay.tp_group(r, t)]
            if any(self.hosts[v] != self.hosts[w] for v in peers):
                self.p2p_flows[self.hosts[w]] = self.p2p_flows.get(self.hosts[w], 0) + 1
        self.ring_flows: dict = {}
        self.rings = [[lay.dp_group(s, k) for k in range(tp)] for s, (_, tp) in enumerate(self.shapes)]
        if dp > 1:
            for rings in self.rings:
                for ring in rings:
                    for a, b in zip(ring, ring[1:] + ring[:1]):
                        if self.hosts[a] != self.hosts[b]:
                            self.ring_flows[self.hosts[a]] = self.ring_flows.get(self.hosts[a], 0) + 1

    def _nic(self, h: int) -> float:
        g = self.group_of[h]
        return g.nics_per_node * g.nic_bw

    def boundary(self, j: int, k: int | None = None) -> tuple[float, float]:
        """(latency, bandwidth) between stage j and stage k (default j + 1), as `p2p_link`:
        each TP rank sends 1/tp (scatter/gather, Narayanan et al. SC'21 Sec. 4.1). Inside a
        host in every replica: the intra-node links; else each crossing sender's NIC share."""
        k = j + 1 if k is None else k
        (ca, ta), (cb, tb) = self.shapes[j], self.shapes[k]
        ga, gb = self.cluster.group(ca), self.cluster.group(cb)
        lay = self.layout
        pairs = [(a, b) for r in range(lay.dp) for a in lay.tp_group(r, j) for b in lay.tp_group(r, k)]
        cross = [(self.hosts[a], self.hosts[b]) for a, b in pairs if self.hosts[a] != self.hosts[b]]
        if not cross:
            return ga.intra_latency, min(ta, tb) * ga.intra_bw
        share = min(min(self._nic(ha) / self.p2p_flows.get(ha, 1),
                        self._nic(hb) / self.p2p_flows.get(hb, 1)) for ha, hb in cross)
        return max(ga.inter_latency, gb.inter_latency), min(ta, tb) * share

    def allreduce_time(self, j: int, nbytes: float) -> float:
        """Stage j's gradient all-reduce (each TP rank's ring of its 1/tp shard, concurrently):
        ring over the dp group in order, paced by its slowest edge."""
        ring = self.rings[j][0]
        n = len(ring)
        if n <= 1 or nbytes <= 0:
            return 0.0
        return ring_allreduce_time(nbytes, n, *self._ring_link(j))

    def _ring_link(self, j: int) -> tuple[float, float]:
        """(bandwidth, latency) of stage j's slowest ring edge (memoised: the search times
        many layer ranges of one stage)."""
        cache = self.__dict__.setdefault("_rings", {})
        if j not in cache:
            ring = self.rings[j][0]
            g = self.cluster.group(self.shapes[j][0])
            bw, lat = g.intra_bw, g.intra_latency
            for a, b in zip(ring, ring[1:] + ring[:1]):
                ha, hb = self.hosts[a], self.hosts[b]
                if ha != hb:
                    bw = min(bw, self._nic(ha) / self.ring_flows[ha],
                             self._nic(hb) / self.ring_flows[hb])
                    lat = max(lat, g.inter_latency)
            cache[j] = (bw, lat)
        return cache[j]

    def ep_geometry(self, j: int, ep: int) -> EPGeometry:
        """Stage j's EP groups (`ep_groups`, every TP rank) on this line's hosts: the most
        hosts one group spans, the most members it has on one host, and its share of that
        host's NICs (its members there over the stage's workers there)."""
        key = (j, ep)
        cache = self.__dict__.setdefault("_ep_geo", {})
        if key in cache:
            return cache[key]
        lay = self.layout
        tp = lay.tps[j]
        stage_on = {}
        for r in range(lay.dp):
            for w in lay.tp_group(r, j):
                stage_on[self.hosts[w]] = stage_on.get(self.hosts[w], 0) + 1
        nodes, per_node, share = 1, 1, 1.0
        for k in range(tp):
            for grp in ep_groups(lay, j, ep, k):
                on: dict = {}
                for w in grp:
                    on[self.hosts[w]] = on.get(self.hosts[w], 0) + 1
                nodes = max(nodes, len(on))
                per_node = max(per_node, max(on.values()))
                if len(on) > 1:
                    share = min(share, min(n / stage_on[h] for h, n in on.items()))
        cache[key] = EPGeometry(ep=ep, per_node=per_node, nodes=nodes, nic_share=share)
        return cache[key]

    def tp_crosses(self, j: int) -> bool:
        """Some TP group of stage j has workers on two hosts (its all-reduces cross a NIC)."""
        lay = self.layout
        return any(len({self.hosts[w] for w in lay.tp_group(r, j)}) > 1 for r in range(lay.dp))

    def ep_local(self, j: int, ep: int) -> bool:
        """Every EP group of stage j (every TP rank) inside one host."""
        return ep <= 1 or self.ep_geometry(j, ep).local

    @property
    def crossing(self) -> dict:
        """What crosses hosts: {'boundaries': [j, ...], 'allreduce': [stage, ...]} (reports)."""
        S = len(self.shapes)
        return {"boundaries": [j for j in range(S - 1) if self._crosses(j)],
                "allreduce": [j for j in range(S) if len({self.hosts[w] for w in self.rings[j][0]}) > 1]}

    def _crosses(self, j: int) -> bool:
        lay = self.layout
        return any(self.hosts[a] != self.hosts[b] for r in range(lay.dp)
                   for a in lay.tp_group(r, j) for b in lay.tp_group(r, j + 1))
