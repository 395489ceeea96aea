"""HALO all-to-all (executor/dicomm/halo.py): bit-identical to the flat one over several host
layouts, dtypes and shapes; its errors; the cost model (h2ir/planner/alltoall.py); bench-comm
--collective all_to_all; and (slow, where network namespaces may be created) the 2-host test bed.

The DiComm groups here are threads of this process, one Comm each, over loopback: the `hosts=`
layout is what HALO aggregates by, whatever machine the ranks are really on (they all use shm).
"""
from __future__ import annotations

import threading
import uuid

from dataclasses import replace

import numpy as np
import pytest

from executor import dicomm
from executor.dicomm import halo
from h2ir.planner import alltoall

SECRET = "test-secret-halo"


def _run_group(world: int, body, transport: str = "shm", timeout: float = 30.0) -> list:
    """body(comm) on `world` threads, each its own Comm; their return values, rank order."""
    store = dicomm.host_store()
    ns = f"halo-{uuid.uuid4().hex[:8]}"
    results: list = [None] * world
    errors: list = []

    def one(rank: int) -> None:
        try:
            with dicomm.connect(rank, world, "127.0.0.1", store.port, SECRET, transport=transport,
                                timeout=timeout, namespace=ns, store=None) as comm:
                results[rank] = body(comm)
                comm.barrier()
        except BaseException as e:   # reported in the main thread
            errors.append((rank, e))

    threads = [threading.Thread(target=one, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 10)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return results


def _payload(src: int, dst: int, uneven: bool) -> np.ndarray:
    rng = np.random.default_rng(100 * src + dst)
    if not uneven:
        return rng.standard_normal((3, 4)).astype(np.float32)
    names = list(dicomm.DTYPES)
    name = names[(src + 2 * dst) % len(names)]
    shape = [(0,), (2, 0, 3), (), (5,), (7, 3), (1000,), (3, 17)][(src * 3 + dst) % 7]
    if name == "bool":
        return rng.random(shape) > 0.5
    if name in ("i32", "i64"):
        return rng.integers(-1 << 30, 1 << 30, shape).astype(dicomm.DTYPES[name])
    if name == "bf16":
        return dicomm.to_bf16(rng.standard_normal(shape).astype(np.float32))
    a = rng.standard_normal(shape).astype(dicomm.DTYPES[name])
    return a.T if a.ndim == 2 else a     # non-contiguous inputs too


@pytest.mark.parametrize("hosts,uneven", [
    ([0, 0, 1, 1], False),            # 2 hosts x 2
    ([0, 0, 0, 1], True),             # 3 + 1
    (["b", "a", "b", "a"], True),     # interleaved, host names
    ([0, 1, 2, 2, 1], True),          # 3 hosts, uneven: aggregator roles wrap
    ([0, 0, 0, 0], True),             # one host: halo is flat
])
def test_halo_equals_flat_bit_for_bit(hosts, uneven):
    world = len(hosts)
    group = list(range(world))

    def body(comm):
        mine = [_payload(comm.rank, d, uneven) for d in group]
        flat = comm.all_to_all(mine, group)
        hal = comm.all_to_all(mine, group, algo="halo", hosts=hosts)
        again = comm.all_to_all(mine, group, algo="halo", hosts=hosts)   # tags stay unique
        return flat, hal, again

    for rank, (flat, hal, again) in enumerate(_run_group(world, body)):
        for src, (f, h, a) in enumerate(zip(flat, hal, again)):
            want = _payload(src, rank, uneven)
            for got in (f, h, a):
                assert got.dtype == want.dtype and got.shape == want.shape, (rank, src)
                assert got.tobytes() == np.ascontiguousarray(want).tobytes(), (rank, src)
                assert got.flags.writeable


def test_halo_subgroup_and_big_arrays():
    """A sub-group in a non-sorted order; arrays large enough to go through shm segments."""
    group, hosts = [3, 0, 2, 1], [1, 0, 1, 0]

    def body(comm):
        mine = [np.full(300_000 + 7 * d, comm.rank * 10 + d, np.float64) for d in group]
        return comm.all_to_all(mine, group, algo="halo", hosts=hosts)

    results = _run_group(4, body)
    for rank, outs in enumerate(results):
        for i, src in enumerate(group):
            assert np.array_equal(outs[i], np.full(300_000 + 7 * rank, src * 10 + rank))


def test_bad_hosts_and_algo_are_clear_errors():
    def body(comm):
        with pytest.raises(ValueError, match="one host per group member: 3 hosts for the 2"):
            comm.all_to_all([np.zeros(1)] * 2, [0, 1], algo="halo", hosts=[0, 1, 1])
        with pytest.raises(ValueError, match="algo must be 'flat' or 'halo'"):
            comm.all_to_all([np.zeros(1)] * 2, [0, 1], algo="ring")
        return True

    assert _run_group(2, body) == [True, True]


def test_pack_round_trip_and_corrupt_bundles():
    arrays = [np.arange(5, dtype=np.int64), np.zeros((0, 3), np.float32), np.float64(2.5),
              dicomm.to_bf16(np.ones(3, np.float32)), np.array([True, False])]
    packed = halo.pack(arrays)
    assert packed.dtype == np.int32
    back = halo.unpack(packed)
    for a, b in zip(arrays, back):
        assert np.asarray(a).dtype == b.dtype and np.asarray(a).shape == b.shape
        assert np.asarray(a).tobytes() == b.tobytes()
    with pytest.raises(dicomm.CommError, match="overruns"):
        halo.unpack(packed[: packed.size // 2])
    with pytest.raises(dicomm.CommError, match="shorter"):
        halo.unpack(np.zeros(1, np.int32))


def test_aggregator_roles_spread_over_local_ranks():
    p = halo.plan(list(range(8)), [0, 0, 1, 1, 2, 2, 3, 3])
    # node 0's remote nodes counted from the next: 1, 2, 3 -> local ranks 0, 1, 0
    assert [p.aggregator(0, m) for m in (1, 2, 3)] == [0, 1, 0]
    # node 1 sees 2, 3, 0: local ranks 2, 3, 2 (group indices)
    assert [p.aggregator(1, m) for m in (2, 3, 0)] == [2, 3, 2]
    assert halo.plan([0, 1], None) is None and halo.plan([0, 1], [5, 5]) is None


# -- cost model -------------------------------------------------------------------------------

def test_cost_model_halo_beats_flat_when_message_overhead_dominates():
    topo = alltoall.Topology(ranks_per_node=8, nics_per_node=4, nic_bw=25e9, intra_bw=50e9,
                             intra_latency=1e-6, inter_latency=20e-6)
    small = 1 << 20
    for n in (64, 256, 1024):
        assert alltoall.halo_time(small, n, topo) < alltoall.flat_time(small, n, topo) / 2
    # bandwidth-bound and no overhead: the same inter-node bytes plus two intra phases
    bulk = alltoall.Topology(ranks_per_node=8, nics_per_node=4, nic_bw=25e9, intra_bw=50e9,
                             intra_latency=0.0, inter_latency=0.0)
    assert alltoall.halo_time(1 << 30, 64, bulk) > alltoall.flat_time(1 << 30, 64, bulk)


def test_cost_model_is_flat_on_one_node_and_zero_for_nothing():
    topo = alltoall.FRONTIER
    for b in (4096, 1 << 24):
        assert alltoall.halo_time(b, 8, topo) == alltoall.flat_time(b, 8, topo) > 0
    assert alltoall.flat_time(0, 64, topo) == alltoall.halo_time(1 << 20, 1, topo) == 0.0
    assert sum(alltoall.halo_phases(1 << 20, 64, topo)) == alltoall.halo_time(1 << 20, 64, topo)


def test_cost_model_testbed_terms_act_where_they_should():
    """The three terms bench_halo measures on the emulated hosts: one flow each way at once
    (the exchange's rate, checksums included), tbf's bucket (refilled while the link sat idle in
    gather and scatter) and the hosts' shared cores (gather and scatter only)."""
    base = alltoall.Topology(ranks_per_node=2, nic_bw=118e6, intra_bw=8e9, intra_latency=50e-6,
                             inter_latency=200e-6, copy_bw=25e9, digest_bw=3e9)
    b, n = 4 * (2 << 20), 4
    g, x, s = alltoall.halo_phases(b, n, base)
    buffer = 2 * 2 * (2 << 20)
    slow = replace(base, inter_single_bw=100e6)
    g1, x1, s1 = alltoall.halo_phases(b, n, slow)
    assert (g1, s1) == (g, s) and x1 == pytest.approx(buffer / 100e6 + 200e-6 * 2, rel=1e-9)
    assert alltoall.flat_time(b, n, slow) == alltoall.flat_time(b, n, base)   # flat streams
    g2, x2, s2 = alltoall.halo_phases(b, n, replace(base, intra_contention=2.0))
    assert x2 <= x and g2 - 50e-6 == pytest.approx(2 * (g - 50e-6))
    assert s2 - 50e-6 == pytest.approx(2 * (s - 50e-6))
    # the bucket saves at most its size, and at most what the idle link earned
    big = alltoall.halo_phases(b, n, replace(base, nic_burst=1 << 30))[1]
    assert x - big == pytest.approx(g + s, rel=1e-9)
    one = alltoall.halo_phases(b, n, replace(base, nic_burst=64 << 10))[1]
    assert x - one == pytest.approx((64 << 10) / 118e6, rel=1e-9)


def test_topology_of_cluster_and_group():
    from h2ir.clusters.clusterfile import load_cluster
    cluster = load_cluster("examples/clusters/testbed-2host.toml")
    topo = alltoall.topology_of(cluster)
    g = cluster.groups[0]
    assert (topo.ranks_per_node, topo.nics_per_node, topo.nic_bw) == \
        (g.chips_per_node, g.nics_per_node, g.nic_bw)
    assert alltoall.topology_of(g, ranks_per_node=1, inter_latency=1e-3).inter_latency == 1e-3


# -- bench-comm ---------------------------------------------------------------------------------

def test_bench_comm_all_to_all_runs(capsys):
    from executor.dicomm.bench import bench_main
    assert bench_main(["--collective", "all_to_all", "--ranks", "4", "--hosts", "0,0,1,1",
                       "--max-size", "65536", "--min-size", "4096", "--iters", "2"]) == 0
    out = capsys.readouterr().out
    assert "halo/flat" in out and "64 KiB" in out
    assert bench_main(["--collective", "all_to_all", "--ranks", "3", "--hosts", "0,1"]) == 2
    assert "--hosts" in capsys.readouterr().err


# -- emulated test bed ----------------------------------------------------------------------------

@pytest.mark.slow
def test_halo_on_two_emulated_hosts():
    from examples.testbed.netns import available
    ok, why = available()
    if not ok:
        pytest.skip(f"network namespaces unavailable: {why}")
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "bench/bench_halo.py", "--rate-mbit", "100",
                        "--sizes", "16384,262144", "--iters", "2", "--runs", "1"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "measured halo/flat" in r.stdout
