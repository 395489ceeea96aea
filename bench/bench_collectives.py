"""Benchmark: DiComm against the stack's own collective library (gloo here) on the same workers.

The two paths the worker uses (executor/worker.py): DiComm's ring all-reduce over its shm links
on NumPy arrays, and executor/ccl.py's all-reduce on a gloo process group on torch tensors; and
one stage-to-stage send of a tensor (ping-pong between two workers, half the round trip).
Every size runs in alternated rounds (DiComm first in even rounds, gloo first in odd ones) in
the same processes, so drift and noise hit both; a round's time is its slowest rank's mean per
call. It prints per size the median time of each, and the ratio DiComm / gloo as the median
over rounds with its min..max spread (above 1: DiComm is slower).

    python bench/bench_collectives.py [--workers 2 4] [--max-size BYTES] [--rounds N] [--json]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SIZES = [1 << 10, 4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
LIBS = ("dicomm", "gloo")


def _iters(size: int) -> int:
    """Calls per timed round: ~16 MiB moved per round, 3..300 calls."""
    return max(3, min(300, (16 << 20) // size))


def _rank_main(rank: int, n: int, port: int, secret: str, sizes: list[int], rounds: int,
               queue) -> None:
    from backends.threads import single_thread_env
    single_thread_env()
    from datetime import timedelta

    import numpy as np
    import torch
    from torch.distributed import TCPStore

    from executor import dicomm
    from executor.ccl import CCL
    from h2ir.planner.collectives import CommGroup
    torch.set_num_threads(1)
    group = list(range(n))
    comm = dicomm.connect(rank, n, "127.0.0.1", port, secret, transport="shm", timeout=120)
    store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))
    groups = [CommGroup("dp", tuple(group), "ccl", "gloo", "bench"),
              CommGroup("p2p", (0, 1), "ccl", "gloo", "bench"),
              CommGroup("p2p", (1, 0), "ccl", "gloo", "bench")]
    ccl = CCL(rank, groups, store, device="cpu", timeout=120)
    rng = np.random.default_rng(rank)
    out = {"all_reduce": {}, "send": {}}
    for size in sizes:
        a = rng.standard_normal(size // 4).astype(np.float32)
        t = torch.from_numpy(a.copy())
        calls = {"dicomm": lambda: comm.all_reduce([a], group, op="avg"),
                 "gloo": lambda: ccl.all_reduce([t], group, op="avg")}
        out["all_reduce"][size] = _timed(comm, group, calls, _iters(size), rounds)
        if n == 2:
            peer = 1 - rank

            def dicomm_pp(i=[0]):
                i[0] += 1
                if rank == 0:
                    comm.send(peer, a, kind="pp", mb=i[0])
                    comm.recv(peer, kind="pp", mb=i[0])
                else:
                    got = comm.recv(peer, kind="pp", mb=i[0])
                    comm.send(peer, got, kind="pp", mb=i[0])

            def gloo_pp(i=[0]):
                i[0] += 1
                if rank == 0:
                    ccl.send(peer, t, "pp", i[0])
                    ccl.recv(peer, t.shape, "f32", "pp", i[0])
                else:
                    got = ccl.recv(peer, t.shape, "f32", "pp", i[0])
                    ccl.send(peer, got, "pp", i[0])
            out["send"][size] = _timed(comm, group, {"dicomm": dicomm_pp, "gloo": gloo_pp},
                                       _iters(size), rounds, per_call=0.5)
    ccl.close()
    comm.barrier(group)
    comm.close()
    queue.put((rank, out))


def _timed(comm, group, calls: dict, iters: int, rounds: int, per_call: float = 1.0) -> dict:
    """{lib: [seconds per call, one per round]} on this rank, rounds alternating the order."""
    times = {lib: [] for lib in LIBS}
    for lib in LIBS:                       # warm-up: links, buffers, first-touch pages
        calls[lib]()
    for r in range(rounds):
        for lib in (LIBS if r % 2 == 0 else LIBS[::-1]):
            comm.barrier(group)
            t0 = time.perf_counter()
            for _ in range(iters):
                calls[lib]()
            times[lib].append((time.perf_counter() - t0) / iters * per_call)
    return times


def run(n: int, sizes: list[int], rounds: int) -> dict:
    """{op: {size: {lib: [slowest rank's seconds per call, per round]}}} for n workers."""
    import multiprocessing as mp

    from executor import dicomm
    store = dicomm.host_store("127.0.0.1")
    secret = dicomm.new_secret()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, n, store.port, secret, sizes, rounds, queue))
             for r in range(n)]
    for p in procs:
        p.start()
    got = dict(queue.get(timeout=3600) for _ in procs)
    for p in procs:
        p.join()
    merged: dict = {}
    for op in ("all_reduce", "send"):
        for size in got[0][op]:
            merged.setdefault(op, {})[size] = {
                lib: [max(got[r][op][size][lib][k] for r in range(n)) for k in range(rounds)]
                for lib in LIBS}
    return merged


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def _median(xs):
    s = sorted(xs)
    return (s[(len(s) - 1) // 2] + s[len(s) // 2]) / 2


def _auto(op: str, n: int, size: int) -> str:
    """What `comm = "auto"` picks for this message between n CPU workers of one machine."""
    from h2ir.planner.collectives import Member, choose
    cpu = Member("torch", "torch", "cpu", 0, "cpu", 0)
    return choose("auto", "p2p" if op == "send" else "dp", [cpu] * n, size)[1]


def table(results: dict) -> str:
    lines = []
    for (n, op), rows in sorted(results.items()):
        what = f"all-reduce (avg), {n} workers" if op == "all_reduce" else \
            "stage-to-stage send (ping-pong / 2), 2 workers"
        lines.append(f"\n{what}")
        lines.append(f"{'size':>8} {'dicomm us':>11} {'gloo us':>11} {'dicomm/gloo':>12} "
                     f"{'spread':>13}  {'faster':>6}  auto")
        for size, t in sorted(rows.items()):
            ratios = [d / g for d, g in zip(t["dicomm"], t["gloo"])]
            r = _median(ratios)
            faster = "gloo" if min(ratios) > 1 else "dicomm" if max(ratios) < 1 else "~"
            auto = _auto(op, n, size)
            lines.append(f"{_size(size):>8} {_median(t['dicomm']) * 1e6:11.1f} "
                         f"{_median(t['gloo']) * 1e6:11.1f} {r:12.2f} "
                         f"{min(ratios):6.2f}..{max(ratios):<6.2f}  {faster:>6}  {auto}"
                         + ("" if faster in ("~", auto) else "  <- not the faster"))
    return "\n".join(lines)


def fit(results: dict) -> dict:
    """Per library, HOST_RATES' (latency per message s, bandwidth B/s): the latency from the
    rows of at most 4 KiB (time / messages), the bandwidth from those of 16 MiB or more (bytes
    moved / the time less the messages' latency), medians over the rows. A ring all-reduce of n
    is 2(n-1) messages moving 2(n-1)/n of the bytes; a send one message, all of them."""
    out = {}
    for lib in LIBS:
        small, large = [], []
        for (n, op), by_size in results.items():
            steps, share = (2 * (n - 1), 2 * (n - 1) / n) if op == "all_reduce" else (1, 1.0)
            for size, t in by_size.items():
                (small if size <= 4 << 10 else large if size >= 16 << 20 else []).append(
                    (steps, share * size, _median(t[lib])))
        lat = _median([t / k for k, _, t in small]) if small else 0.0
        bw = _median([v / max(t - k * lat, 1e-9) for k, v, t in large]) if large else float("inf")
        out[lib] = (lat, bw)
    return out


# why one library is slower than the other on the same workers, for the rows where it is
WHY = {
    "dicomm": """DiComm is slower at {sizes}.
Per message it pays what gloo does not:
  - a SHA-256 digest of the payload on both ends and HMAC tags on every frame (it authenticates
    its links and checks every payload; gloo does neither), which bounds large messages at the
    hash's rate per core (docs/dicomm.md "Cost of the frame tags and SHA-256 digests");
  - its ring in Python: per ring step a frame header (msgpack), an inbox lookup and a NumPy
    add, where gloo's ring is C++;
  - a receive that is not a view copies the payload out of the shm segment.""",
    "gloo": """gloo is slower at {sizes}.
Its bytes cross loopback TCP (two kernel copies per message, where DiComm's shm ring is one copy
into shared memory), and every operation goes from the caller to a ProcessGroupGloo worker
thread, gloo's I/O thread and back through a condition variable, where DiComm's receiver reads
the shm ring on its own thread; with more runnable threads than cores each hand-off waits for
a time slice.""",
}


def why(results: dict) -> str:
    """For each library slower than the other somewhere (every round), where and why."""
    import textwrap
    slower: dict[str, dict] = {"dicomm": {}, "gloo": {}}
    for (n, op), rows in sorted(results.items()):
        what = "send" if op == "send" else f"all-reduce x{n}"
        for size, t in sorted(rows.items()):
            ratios = [d / g for d, g in zip(t["dicomm"], t["gloo"])]
            if min(ratios) > 1 or max(ratios) < 1:
                lib = "dicomm" if min(ratios) > 1 else "gloo"
                slower[lib].setdefault(what, []).append(_size(size).replace(" ", ""))
    out = []
    for lib, where in slower.items():
        if where:
            at = "; ".join(f"{what}: {', '.join(sizes)}" for what, sizes in where.items())
            out.append(textwrap.fill(WHY[lib].split("\n")[0].format(sizes=at), 96) + "\n"
                       + "\n".join(WHY[lib].split("\n")[1:]))
    return "\n\n".join(out)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--max-size", type=int, default=SIZES[-1])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    sizes = [s for s in SIZES if s <= a.max_size] or SIZES[:1]
    results = {}
    for n in a.workers:
        for op, rows in run(n, sizes, a.rounds).items():
            if rows:
                results[(n, op)] = rows
    if a.json:
        print(json.dumps({f"{op}/{n}": {str(s): t for s, t in rows.items()}
                          for (n, op), rows in results.items()}, indent=1))
        return 0
    print(table(results))
    rates = fit(results)
    print("\nfit (latency per message, bandwidth) of HOST_RATES' form: " + ", ".join(
        f"{lib} ({lat * 1e6:.0f} us, {bw / 1e9:.2f} GB/s)" for lib, (lat, bw) in rates.items()))
    print("\n" + why(results))
    print("\ncomm = \"auto\" (h2ir/planner/collectives.py) prices both with HOST_RATES, in this "
          "fit's form;\nthe auto column is its choice.")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
