"""All-to-all cost model: DiComm's flat all-to-all and its HALO (hierarchical, aggregated)
all-to-all, as executor/dicomm/comm.py and executor/dicomm/halo.py run them.

Notation: n ranks, k = ranks per node, N = ceil(n/k) nodes, B = bytes each rank sends in one
all-to-all (B/n to every rank, itself included: the even split of MoE token dispatch), s = B/n.
Per message, in the terms of LogP (Culler et al., "LogP: towards a realistic model of parallel
computation", PPoPP 1993) with Hockney's bytes/bandwidth (Parallel Computing 20(3), 1994):
`*_latency` is paid once per dependent hop (messages in flight together overlap it); `*_gap` is
the per-message cost that serializes where messages queue (a NIC's message gap for inter-node
messages, one rank's send overhead for its own sends); bytes go at the link's bandwidth; an
inter-node message is also checksummed before it leaves and after it lands (DiComm's SHA-256
payload digest) at `digest_bw`, which a stream of several messages overlaps with the wire but a
single aggregated message cannot.

flat  Each rank sends its k-1 node-local messages over the intra-node link and its n-k remote ones
      over the node's NICs, which all k ranks of the node share: k(n-k) messages of s bytes leave a
      node through `nics_per_node` NICs. The intra- and inter-node transfers run concurrently
      (different links), the messages on one link one after another.
HALO  Piper (arXiv 2605.05049) HALO all-to-all, as halo.py implements it, three phases one after
      another (the aggregator waits for all its local inputs before sending, and the receiver for
      the whole aggregated buffer before redistributing):
      (a) intra-node gather: every rank sends its node-local messages directly and, for each
          remote node M, one bundle (its k messages for M's ranks) to M's aggregator on its own
          node; local rank j aggregates remote nodes j, j+k, ... (NIC affinity: its NIC is
          j mod nics_per_node);
      (b) inter-node exchange: ONE message of k*k*s bytes per ordered node pair, from the
          aggregator to its peer aggregator; a NIC carries the messages of its aggregators;
      (c) intra-node scatter: the receiving aggregator splits the buffer into one bundle per
          local destination rank.
      Inter-node bytes are the same as flat; what changes is the message count through each NIC
      (N-1 per node over the NICs instead of k(n-k)) and the two intra-node phases (plus the
      aggregator's pack/unpack copies at `copy_bw`).

Three terms describe what the emulated test bed (examples/testbed) does differently from a
machine of its own, each measured or read off the test bed by bench/bench_halo.py, never fitted
to an all-to-all: `inter_single_bw` (one flow each way at once, HALO's exchange, is slower than
a stream of several), `nic_burst` (tc tbf's token bucket: HALO's exchange finds the link idle
after its gather) and `intra_contention` (every emulated host shares one machine's cores, so
the gathers and scatters that run on all hosts at once get a share of them). Their defaults
(None, 0, 1) leave a real cluster's model as above.

Units: bytes, bytes/s, seconds.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Topology:
    """What an all-to-all over ranks spread k per node sees of the machine."""
    ranks_per_node: int
    nics_per_node: int = 1
    nic_bw: float = 12.5e9           # per NIC, per direction, B/s
    intra_bw: float = 100e9          # rank-to-rank inside a node, per direction, B/s
    intra_latency: float = 5e-6      # per intra-node message, s
    inter_latency: float = 10e-6     # per inter-node message, s
    copy_bw: float | None = None     # memory copy bandwidth for HALO's packing (None: free)
    inter_gap: float | None = None   # serialized cost per inter-node message, s (None: latency)
    intra_gap: float | None = None   # serialized cost per intra-node message, s (None: latency)
    digest_bw: float | None = None   # payload checksum rate at each end, B/s (None: free)
    # the rate of ONE large intra-node message that nothing overlaps (send, wake-up, receive,
    # each copy in series), below the streaming intra_bw; HALO's gather and scatter are such
    # transfers on its critical path (None: intra_bw)
    intra_single_bw: float | None = None
    # the rate of ONE inter-node message each way at once, checksums included (HALO's exchange
    # is such a pair per node pair). One flow per direction reaches less than a stream of
    # several: on the test bed 780-830 Mbit/s against 940 at 1 Gbit/s, as each direction's
    # ACKs queue behind the other direction's data. None: nic_bw, plus digest_bw's checksums
    inter_single_bw: float | None = None
    # a token-bucket rate limiter's bucket on the inter-node link (tc tbf on the test bed;
    # 0 on a real NIC), bytes: after the link was idle for t, min(nic_burst, t * nic_bw) bytes
    # pass at once. HALO's exchange finds the link idle for its gather and scatter
    nic_burst: float = 0.0
    # how many times slower intra-node transfers and copies run when every node does them at
    # once: 1 on a real cluster; on the emulated test bed all hosts share one machine's cores,
    # so HALO's gather and scatter, which run on every host at the same time, get
    # cores / ranks of them (the calibration measured one pair with the others idle)
    intra_contention: float = 1.0
    nodes_per_switch: int | None = None   # nodes under one switch (None: one switch for all)
    switch_latency: float = 0.0      # extra per message that leaves its switch group, s

    def __post_init__(self):
        if self.ranks_per_node < 1 or self.nics_per_node < 1:
            raise ValueError(f"Topology needs ranks_per_node >= 1 and nics_per_node >= 1, got "
                             f"{self.ranks_per_node} and {self.nics_per_node}")
        if min(self.nic_bw, self.intra_bw) <= 0:
            raise ValueError("Topology bandwidths must be > 0")


def topology_of(cluster_group_or_cluster, chip: str | None = None, *,
                ranks_per_node: int | None = None, **overrides) -> Topology:
    """The Topology of a NodeGroup, or of a Cluster's group for `chip` (Cluster.group: the group
    that bounds a chip type spread over several). ranks_per_node defaults to the node's chips (an
    expert-parallel group of one rank per chip; pass chips_per_node // tp when each rank is a TP
    group). overrides replace fields (e.g. measured latencies)."""
    g = cluster_group_or_cluster
    if hasattr(g, "groups"):            # a Cluster
        if chip is None:
            chips = {x.chip for x in g.groups}
            if len(chips) != 1:
                raise ValueError(f"cluster {g.name!r} has chip types {sorted(chips)}: name one")
            chip = chips.pop()
        g = g.group(chip)
    topo = Topology(ranks_per_node=ranks_per_node or g.chips_per_node,
                    nics_per_node=g.nics_per_node, nic_bw=g.nic_bw, intra_bw=g.intra_bw,
                    intra_latency=g.intra_latency, inter_latency=g.inter_latency)
    return replace(topo, **overrides) if overrides else topo


def _shape(ranks: int, topo: Topology) -> tuple[int, int]:
    k = max(1, min(topo.ranks_per_node, ranks))
    return k, math.ceil(ranks / k)


def _switch_extra(nodes: int, topo: Topology) -> float:
    """Mean extra latency of an inter-node message: the share of remote nodes outside the
    sender's switch group times switch_latency."""
    if not topo.nodes_per_switch or topo.switch_latency <= 0 or nodes <= 1:
        return 0.0
    inside = min(nodes, topo.nodes_per_switch) - 1
    return (nodes - 1 - inside) / (nodes - 1) * topo.switch_latency


def _gaps(topo: Topology) -> tuple[float, float]:
    return (topo.intra_latency if topo.intra_gap is None else topo.intra_gap,
            topo.inter_latency if topo.inter_gap is None else topo.inter_gap)


def _digest(nbytes: float, topo: Topology) -> float:
    return 2 * nbytes / topo.digest_bw if topo.digest_bw else 0.0


def flat_time(bytes_per_rank: float, ranks: int, topo: Topology) -> float:
    """Flat all-to-all time: the busier of one rank's k-1 intra-node messages and one NIC's share
    of its node's k(n-k) inter-node messages (each gap + bytes / bandwidth; a rank also pays its
    n-k send gaps), plus one latency and one message's checksums (the stream's fill)."""
    if ranks <= 1 or bytes_per_rank <= 0:
        return 0.0
    k, N = _shape(ranks, topo)
    s = bytes_per_rank / ranks
    g_intra, g_inter = _gaps(topo)
    intra = (k - 1) * (s / topo.intra_bw + g_intra)
    if N == 1:
        return intra + topo.intra_latency
    per_nic = k * (ranks - k) / topo.nics_per_node
    lat = topo.inter_latency + _switch_extra(N, topo)
    inter = max(per_nic * (s / topo.nic_bw + g_inter), (ranks - k) * g_inter)
    return max(intra, inter) + lat + _digest(s, topo)


def aggregated_nodes(local_rank: int, ranks_per_node: int, remote_nodes: int) -> int:
    """How many remote nodes local rank j aggregates: j, j+k, ... below remote_nodes."""
    if local_rank >= remote_nodes:
        return 0
    return -(-(remote_nodes - local_rank) // ranks_per_node)


def halo_phases(bytes_per_rank: float, ranks: int, topo: Topology) -> tuple[float, float, float]:
    """(gather, exchange, scatter) times of HALO; all zero on one node (it is flat there)."""
    if ranks <= 1 or bytes_per_rank <= 0:
        return 0.0, 0.0, 0.0
    k, N = _shape(ranks, topo)
    if N == 1:
        return 0.0, 0.0, 0.0
    s = bytes_per_rank / ranks
    R = N - 1
    bundle, buffer = k * s, k * k * s
    copy = (lambda nbytes: nbytes / topo.copy_bw) if topo.copy_bw else (lambda nbytes: 0.0)
    g_intra, g_inter = _gaps(topo)
    bw = topo.intra_single_bw or topo.intra_bw      # gather and scatter wait for each message
    # (a) gather, bounded by the busiest rank: what it sends (local messages + bundles for the
    # nodes others aggregate) or what it receives (local messages + k-1 bundles per node it
    # aggregates), then packs; one intra-node latency.
    gather = scatter = 0.0
    for j in range(k):
        h = aggregated_nodes(j, k, R)
        send = (k - 1) * (s / bw + g_intra) + \
            (R - h) * (bundle / bw + g_intra)
        recv = (k - 1) * (s / bw + g_intra) + \
            h * (k - 1) * (bundle / bw + g_intra)
        gather = max(gather, max(send, recv) + copy(h * buffer))
        # (c) scatter: the mirror image (the aggregator unpacks and sends k-1 bundles per node)
        scatter = max(scatter, copy(h * buffer) + max(
            h * (k - 1) * (bundle / bw + g_intra),
            (R - h) * (bundle / bw + g_intra)))
    gather = gather * topo.intra_contention + topo.intra_latency
    scatter = scatter * topo.intra_contention + topo.intra_latency
    # (b) exchange: local rank j's messages go out through NIC j mod nics; the busiest NIC bounds;
    # one latency and one buffer's checksums (the aggregator's messages stream one after another),
    # or all of it at inter_single_bw; less what a rate limiter's bucket, refilled while the link
    # sat idle during gather and scatter, lets through at once
    per_nic = [0] * topo.nics_per_node
    for j in range(k):
        per_nic[j % topo.nics_per_node] += aggregated_nodes(j, k, R)
    lat = topo.inter_latency + _switch_extra(N, topo)
    nbytes = max(per_nic) * buffer
    nbytes = max(0.0, nbytes - min(topo.nic_burst, (gather + scatter) * topo.nic_bw))
    if topo.inter_single_bw:
        exchange = nbytes / topo.inter_single_bw + max(per_nic) * g_inter + lat
    else:
        exchange = nbytes / topo.nic_bw + max(per_nic) * g_inter + lat + _digest(buffer, topo)
    return gather, exchange, scatter


def halo_time(bytes_per_rank: float, ranks: int, topo: Topology) -> float:
    """HALO all-to-all time: gather + exchange + scatter (they do not overlap in halo.py); flat on
    one node, where there is nothing to aggregate."""
    k, N = _shape(max(1, ranks), topo)
    if N == 1:
        return flat_time(bytes_per_rank, ranks, topo)
    return sum(halo_phases(bytes_per_rank, ranks, topo))


# Frontier (OLCF): a node is 4 AMD MI250X = 8 GCDs, 4 HPE Slingshot-11 NICs of 200 Gbit/s
# (25 GB/s) each (OLCF Frontier User Guide, "System Overview"); GCD-to-GCD Infinity Fabric
# 50 GB/s per direction between GCDs of different MI250X (same guide, node diagram). Latencies:
# Slingshot point-to-point latency of about 2 us (De Sensi et al., "An In-Depth Analysis of the
# Slingshot Interconnect", SC'20, report small-message MPI latencies of this order); ASSUMED, not
# sourced: +1 us per message leaving the switch group (a dragonfly global hop), 4 nodes per
# switch group (this study's stated topology), 5 us per intra-node message (a GPU copy launch),
# pack/unpack copies at 1.3 TB/s (about half of an MI250X GCD's 1.6 TB/s HBM peak).
FRONTIER = Topology(ranks_per_node=8, nics_per_node=4, nic_bw=25e9, intra_bw=50e9,
                    intra_latency=5e-6, inter_latency=2e-6, copy_bw=1.3e12,
                    nodes_per_switch=4, switch_latency=1e-6)
PIPER_REPORTED_SPEEDUP = (1.2, 9.0)   # HALO over flat all-to-all, Piper arXiv 2605.05049
