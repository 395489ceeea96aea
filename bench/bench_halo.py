"""HALO against flat all-to-all on the emulated 2-host test bed, beside the cost model's prediction.

examples/testbed/netns.py builds 2 hosts (network namespaces, tc tbf on each host's link, rates
--rates in Mbit/s, default 1000 and 100); 2 DiComm ranks per host (examples/clusters/
testbed-2host.toml's shape): shm inside a host, tcp across. For each message size (bytes each
rank sends to each other rank) the workers (executor/dicomm/bench.py's a2a_worker) time flat
and HALO all-to-all alternating, best of --runs means of --iters calls; the figure is the ratio
HALO/flat = flat time / halo time, flat being the anchor measured in the same run.

The cost model (h2ir/planner/alltoall.py) predicts the same ratio from terms measured in the same
run on the same test bed: per-message latency (median half round trip of a 64-byte message) and
stream bandwidth, rank 0 to its host peer (shm) and to a remote rank (tcp through tbf), and
memcpy bandwidth here for HALO's pack copies. Predicted and measured are printed side by side.

--simulate prints only the model for a Frontier-like machine (h2ir/planner/alltoall.py FRONTIER:
8 GCDs and 4 Slingshot-11 NICs of 25 GB/s per node, 4 nodes per switch group) at 64..1,024 GPUs,
beside Piper's reported 1.2-9x (arXiv 2605.05049).

Where network namespaces cannot be created, the test bed part is skipped (exit 0, saying why).

    .venv/bin/python bench/bench_halo.py [--rates 1000,100] [--sizes 4096,...] [--runs 3]
    .venv/bin/python bench/bench_halo.py --simulate
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from h2ir.planner import alltoall  # noqa: E402

HOSTS = [0, 0, 1, 1]
SIZES = [4096, 32768, 262144, 1 << 21]
FRONTIER_GPUS = [64, 128, 256, 512, 1024]
FRONTIER_BYTES = [1 << 20, 8 << 20, 64 << 20]      # bytes each GPU sends per all-to-all
PORT = 29471
DUPLEX_BYTES = 4 << 20      # one message each way at once: the inter_single_bw term


def load() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def measure(rate_mbit: float, sizes: list[int], iters: int, runs: int) -> dict:
    """One test bed at `rate_mbit`: the a2a workers' timings and calibration (rank 0's JSON)."""
    from examples.testbed.netns import Testbed
    stream = 1 << 20
    count = max(2, min(8, int(rate_mbit * 1e6 / 8 * 0.3 / stream)))   # ~0.3 s per stream rep
    env = dict(os.environ, H2_SECRET=secrets.token_hex(32), OMP_NUM_THREADS="1",
               PYTHONPATH=str(ROOT))
    with Testbed(2, rate_mbit=rate_mbit) as tb:
        spec = {"world": len(HOSTS), "hosts": HOSTS, "sizes": sizes, "iters": iters,
                "runs": runs, "store_host": tb.addr(0), "port": PORT, "host_store": True,
                "transport": "shm",
                "calibrate": {"latency_bytes": 64, "stream_bytes": stream, "stream_count": count,
                              "duplex_bytes": [DUPLEX_BYTES]}}
        procs = [tb.run(h, [sys.executable, "-m", "executor.dicomm.bench", "--a2a-worker",
                            json.dumps(dict(spec, rank=r, listen=tb.addr(h)))],
                        env=env, cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                        text=True) for r, h in enumerate(HOSTS)]
        outs = [p.communicate(timeout=900) for p in procs]
        burst = tb.tbf_burst(rate_mbit)
    for r, (p, (out, err)) in enumerate(zip(procs, outs)):
        if p.returncode != 0:
            raise SystemExit(f"a2a worker {r} failed (exit {p.returncode}):\n{err[-3000:]}")
    return dict(json.loads(outs[0][0]), tbf_burst=burst)


def memcpy_bps(nbytes: int = 8 << 20) -> float:
    from executor.dicomm.bench import _memcpy_gib_s
    return _memcpy_gib_s(nbytes) * 2 ** 30


def digest_bps(nbytes: int = 8 << 20) -> float:
    """DiComm's payload digest rate here (best of 5), the checksum term of tcp messages."""
    import time

    import numpy as np

    from executor.dicomm import checksum
    data = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        checksum.digest(data)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def testbed_topology(cal: dict, copy_bw: float, digest_bw: float, burst: float = 0.0,
                     cores: int | None = None) -> alltoall.Topology:
    """The cost model's terms, all measured in this run, plus two facts of the test bed: tbf's
    bucket and the cores all emulated hosts share (HOSTS ranks on `cores`)."""
    inter = cal["inter"]
    single = None
    if inter.get("duplex"):
        size, t = inter["duplex"][-1]
        single = size / max(1e-9, t - inter["latency_s"])
    cores = cores or os.cpu_count() or 1
    return alltoall.Topology(
        inter_single_bw=single, nic_burst=burst,
        intra_contention=max(1.0, len(HOSTS) / cores),
        ranks_per_node=2, nics_per_node=1,
        nic_bw=cal["inter"]["bandwidth_Bps"], inter_latency=cal["inter"]["latency_s"],
        inter_gap=cal["inter"]["gap_s"],
        intra_bw=cal["intra"]["bandwidth_Bps"], intra_latency=cal["intra"]["latency_s"],
        intra_gap=cal["intra"]["gap_s"], copy_bw=copy_bw, digest_bw=digest_bw,
        intra_single_bw=cal["intra"].get("single_Bps"))


def report(rate: float, m: dict, copy_bw: float, digest_bw: float) -> list[dict]:
    from executor.dicomm.bench import _size
    cal = m["calibration"]
    topo = testbed_topology(cal, copy_bw, digest_bw, m.get("tbf_burst", 0.0))
    n = len(HOSTS)
    print(f"\n== tbf {rate:g} Mbit/s: 2 hosts x 2 ranks (shm inside a host, tcp across); "
          f"load average {load()}")
    print(f"   measured terms: inter latency {cal['inter']['latency_s'] * 1e6:.0f} us, gap "
          f"{cal['inter']['gap_s'] * 1e6:.0f} us, {cal['inter']['bandwidth_Bps'] * 8 / 1e6:.0f} "
          f"Mbit/s; intra latency {cal['intra']['latency_s'] * 1e6:.0f} us, gap "
          f"{cal['intra']['gap_s'] * 1e6:.0f} us, {cal['intra']['bandwidth_Bps'] / 2**30:.2f} "
          f"GiB/s streaming, {cal['intra'].get('single_Bps', 0) / 2**30:.2f} GiB/s one message at a "
          f"time; memcpy {copy_bw / 2**30:.1f} GiB/s; digest {digest_bw / 2**30:.2f} GiB/s")
    print(f"{'size':>8} {'flat ms':>9} {'halo ms':>9} {'measured halo/flat':>19} "
          f"{'predicted':>10} {'pred/meas':>10}")
    rows = []
    for size, f, h in zip(m["sizes"], m["flat_s"], m["halo_s"]):
        b = n * size
        pred = alltoall.flat_time(b, n, topo) / alltoall.halo_time(b, n, topo)
        meas = f / h
        rows.append({"rate_mbit": rate, "size": size, "flat_s": f, "halo_s": h,
                     "measured": meas, "predicted": pred,
                     "predicted_flat_s": alltoall.flat_time(b, n, topo),
                     "predicted_halo_s": alltoall.halo_time(b, n, topo)})
        print(f"{_size(size):>8} {f * 1e3:9.2f} {h * 1e3:9.2f} {meas:18.2f}x {pred:9.2f}x "
              f"{pred / meas:10.2f}")
    for size, t in cal["inter"].get("duplex", []):
        print(f"   one {_size(size)} message each way at once: {t * 1e3:.2f} ms "
              f"({topo.inter_single_bw * 8 / 1e6:.0f} Mbit/s, the exchange's rate); tbf bucket "
              f"{topo.nic_burst / 1024:.0f} KiB; intra contention x{topo.intra_contention:g} "
              f"({len(HOSTS)} ranks on {os.cpu_count()} cores)")
    print("   HALO phases on rank 0 (an aggregator), ms, measured mean / predicted: "
          "gather, exchange, scatter")
    for size, ph in zip(m["sizes"], m.get("halo_phases_s", [])):
        pr = alltoall.halo_phases(n * size, n, topo)
        rows[m["sizes"].index(size)].update(phases_s=ph, predicted_phases_s=list(pr))
        print(f"{_size(size):>8} " + "  ".join(f"{a * 1e3:7.2f} / {b * 1e3:6.2f}"
                                             for a, b in zip(ph, pr)))
    return rows


def simulate() -> None:
    topo = alltoall.FRONTIER
    lo, hi = alltoall.PIPER_REPORTED_SPEEDUP
    print("\n== cost model, Frontier-like (h2ir/planner/alltoall.py FRONTIER): "
          f"{topo.ranks_per_node} GCDs/node, {topo.nics_per_node} NICs x "
          f"{topo.nic_bw / 1e9:g} GB/s, {topo.nodes_per_switch} nodes per switch group; "
          f"inter {topo.inter_latency * 1e6:g} us (+{topo.switch_latency * 1e6:g} us across "
          f"groups), intra {topo.intra_bw / 1e9:g} GB/s, {topo.intra_latency * 1e6:g} us")
    print(f"predicted HALO/flat (flat time / halo time), per GPU bytes per all-to-all; "
          f"Piper reports {lo}-{hi:g}x")
    print(f"{'GPUs':>6} " + " ".join(f"{b >> 20:>7} MiB" for b in FRONTIER_BYTES))
    for n in FRONTIER_GPUS:
        print(f"{n:>6} " + " ".join(
            f"{alltoall.flat_time(b, n, topo) / alltoall.halo_time(b, n, topo):10.2f}x"
            for b in FRONTIER_BYTES))


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default="1000,100", help="tbf rates in Mbit/s, comma-separated")
    ap.add_argument("--rate-mbit", type=float, default=None, help="one rate (overrides --rates)")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)),
                    help="bytes per destination, comma-separated")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--simulate", action="store_true", help="only the Frontier-like model")
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    args = ap.parse_args(argv)
    if args.simulate:
        simulate()
        return 0
    from examples.testbed.netns import available
    ok, why = available()
    if not ok:
        print(f"bench_halo: test bed skipped: network namespaces unavailable: {why}")
        simulate()
        return 0
    rates = [args.rate_mbit] if args.rate_mbit else [float(x) for x in args.rates.split(",")]
    sizes = [int(x) for x in args.sizes.split(",")]
    print(f"bench_halo: {os.cpu_count()} CPUs, load average {load()} at start; best of "
          f"{args.runs} means of {args.iters} calls per algorithm and size")
    rows = []
    for rate in rates:
        copy_bw, digest_bw = memcpy_bps(), digest_bps()
        rows += report(rate, measure(rate, sizes, args.iters, args.runs), copy_bw, digest_bw)
    worst = max(abs(r["predicted"] / r["measured"] - 1) for r in rows)
    print(f"\nmeasured halo/flat vs predicted: largest deviation {worst:.0%} (target within 20%)")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    simulate()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
