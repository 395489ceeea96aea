"""Benchmark: DiComm transports against memcpy, the physical limit of moving bytes on this host.

Runs the same measurement as `h2x bench-comm` (2 processes, ping-pong latency and one-way
bandwidth for 4 KiB ... 64 MiB) and prints every figure as a ratio to an anchor measured in the
same run: bandwidth / memcpy bandwidth of the same size, and tcp latency / shm latency beside
H2's reported 9.94x (device-direct RDMA vs TCP/IP, arXiv 2505.17548).

    python bench/bench_comm.py [--transport tcp|shm|rdma|all] [--max-size BYTES] [--json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from executor.dicomm.bench import (SHM_LATENCY_RATIO_TARGET, SHM_LATENCY_TARGET_US,  # noqa: E402
                                   SHM_TARGET, SIZES, _size, format_table, run_bench)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transport", choices=["tcp", "shm", "rdma", "all"], default="all")
    parser.add_argument("--max-size", type=int, default=SIZES[-1])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    transports = ["tcp", "shm", "rdma"] if args.transport == "all" else [args.transport]
    result = run_bench(transports, [s for s in SIZES if s <= args.max_size] or SIZES[:1])
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(format_table(result))
    names = list(result["transports"])
    print("\nratios to the anchors measured in this run")
    print(f"{'size':>8} " + " ".join(f"{t + ' bw/memcpy':>15}" for t in names)
          + (f" {'tcp lat/shm lat':>16}" if "latency_ratio_tcp_over_shm" in result else ""))
    for i, n in enumerate(result["sizes"]):
        row = f"{_size(n):>8} " + " ".join(
            f"{result['transports'][t]['bandwidth_gib_s'][i] / result['memcpy_gib_s'][i]:15.3f}"
            for t in names)
        if "latency_ratio_tcp_over_shm" in result:
            row += f" {result['latency_ratio_tcp_over_shm'][i]:16.2f}"
        print(row)
    if "latency_ratio_tcp_over_shm" in result:
        print(f"H2 reported latency ratio (device-direct RDMA vs TCP/IP): "
              f"{result['h2_reported_ratio']}x")
    print(f"shm targets: bandwidth >= {SHM_TARGET:.0%} of memcpy at {_size(SIZES[-1])}; latency "
          f"at 4 KiB <= {SHM_LATENCY_TARGET_US:g} us and >= {SHM_LATENCY_RATIO_TARGET:g}x lower "
          "than tcp")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
