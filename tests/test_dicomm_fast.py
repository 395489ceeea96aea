"""DiComm's shm ring (executor/dicomm/ring.py): the same-host path where the receiving thread reads
frames from shared memory itself.

In process: record round trip, and a tampered, replayed or reordered ring record raising
CommError. Between 2 spawned processes: the ring carries every frame of a shm link, same-tag
frames keep their order across inline and segment payloads, a sender flooding a receiver that is
busy computing is not held up (the reader thread drains the full ring on request), a recv with
nothing sent times out, and a peer that dies after sending has its frames delivered before the
CommError.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback
import uuid

import numpy as np
import pytest

from executor import dicomm
from executor.dicomm import ring
from executor.dicomm.errors import CommError
from executor.dicomm.shm import ring_header

SECRET = "test-secret-ring"
KEY = b"k" * 32

pytestmark = pytest.mark.skipif(not ring.available()[0], reason=ring.available()[1])


# -- in process ---------------------------------------------------------------------------------

def _pair(size: int = 1 << 16):
    w = ring.RingWriter(KEY, 0, 1, size=size)
    r = ring.RingReader(os.dup(w.fds[0]), os.dup(w.fds[1]), size, KEY, 0, 1, None)
    return w, r


def _put(w: ring.RingWriter, seq: int, a: np.ndarray, kind: str = "act", mb: int = 0) -> None:
    h = ring_header(a, kind, 0, mb, seq, 0, None)
    head, n = w.record(seq=seq, kind=kind, stage=0, mb=mb, dtype=h.dtype, shape=h.shape,
                       nbytes=h.nbytes)
    assert w.fits(n)
    w.put(head, n, memoryview(a.reshape(-1).view(np.uint8)) if a.size else None)


def _all(r: ring.RingReader) -> list:
    got = []
    while (f := r.poll(lambda h: True, None)) is not None:
        got.append(f)
    return got


def test_ring_round_trip_every_dtype_and_wraps():
    w, r = _pair()
    seq = 0
    for rep in range(40):     # 40 x ~3.5 KiB through a 64 KiB ring: wraps several times
        for name in dicomm.DTYPES:
            a = (np.arange(12 * (rep % 5 + 1)) % 2).astype(dicomm.DTYPES[name]).reshape(-1, 2)
            _put(w, seq, a, kind=f"k-{name}", mb=rep)
            seq += 1
        for f, name in zip(_all(r), dicomm.DTYPES):
            assert f.header.kind == f"k-{name}" and f.header.mb == rep
            assert f.array.dtype == dicomm.DTYPES[name] and f.array.flags.writeable
            assert np.array_equal(f.array, (np.arange(12 * (rep % 5 + 1)) % 2)
                                  .astype(dicomm.DTYPES[name]).reshape(-1, 2))
    _put(w, seq, np.zeros((), np.float32))            # 0-d
    _put(w, seq + 1, np.zeros((0, 3), np.int64))      # empty
    a, b = _all(r)
    assert a.array.shape == () and b.array.shape == (0, 3)
    w.close()
    r.close()


@pytest.mark.parametrize("attack", ["header byte", "tag byte", "replay", "skip"])
def test_tampered_ring_records_are_rejected(attack):
    w, r = _pair()
    _put(w, 0, np.arange(4, dtype=np.float32))
    assert len(_all(r)) == 1
    _put(w, 1, np.arange(4, dtype=np.float32))
    pos = r._tail % r.size                     # where record 1 starts
    if attack == "header byte":                # a byte of its fixed fields (stage)
        w._map.data[pos + 8 + 30] ^= 0x40
    elif attack == "tag byte":                 # a byte of its tag
        w._map.data[pos + 8 + 100] ^= 0x40
    elif attack == "replay":                   # rewind the tail: record 0 read again
        r._tail = 0
    elif attack == "skip":                     # record 1 checked as if it were record 0
        r._n -= 1
    with pytest.raises(CommError, match="integrity check|corrupt shm ring"):
        _all(r)
    with pytest.raises(CommError):             # sticky: nothing after a bad record
        _all(r)
    w.close()
    r.close()


# -- between processes --------------------------------------------------------------------------

def _entry(fn: str, rank: int, port: int, ns: str, q) -> None:
    try:
        comm = dicomm.connect(rank, 2, "127.0.0.1", port, SECRET, transport="shm",
                              fallback=False, timeout=10.0, namespace=ns)
        globals()[fn](comm, rank)
        q.put((rank, "ok"))
    except BaseException:
        q.put((rank, traceback.format_exc()))


def _run(fn: str, crash: int | None = None, timeout: float = 60.0) -> None:
    store = dicomm.host_store()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ns = f"ring-{uuid.uuid4().hex[:8]}"
    procs = [ctx.Process(target=_entry, args=(fn, r, store.port, ns, q)) for r in range(2)]
    for p in procs:
        p.start()
    results = {}
    deadline = time.monotonic() + timeout
    while len(results) < 2 - (crash is not None) and time.monotonic() < deadline:
        try:
            rank, res = q.get(timeout=1.0)
            results[rank] = res
        except Exception:
            pass
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
    bad = [f"rank {r}: {res}" for r, res in results.items() if res != "ok"]
    assert not bad, "\n".join(bad)
    assert len(results) == 2 - (crash is not None), f"no result from some rank: {results}"


def _order_and_sizes(comm, rank):
    small, big = np.arange(1000, dtype=np.float32), np.arange(1 << 19, dtype=np.float32)  # 2 MiB
    if rank == 0:
        for i in range(6):   # same tag, alternating inline and segment payloads
            comm.send(1, (small if i % 2 else big) + i, kind="same", mb=0)
        for mb in range(50):
            comm.send(1, np.full(3, mb, np.int64), kind="many", mb=mb)
        assert comm.recv(1, kind="done").tolist() == [1]
    else:
        for mb in reversed(range(50)):        # received in the reverse order of sending
            assert comm.recv(0, kind="many", mb=mb).tolist() == [mb] * 3
        assert 0 in comm._rings, "the shm link has no ring"
        for i in range(6):
            got = comm.recv(0, kind="same", mb=0, view=bool(i % 3))
            assert np.array_equal(got, (small if i % 2 else big) + i), i
        comm.send(0, np.ones(1, np.int32), kind="done")
    comm.barrier()
    comm.close()


def test_ring_keeps_same_tag_order_across_inline_and_segment_payloads():
    _run("_order_and_sizes")


def _flood(comm, rank):
    """3000 x 4 KiB (12 MiB, six ring-fulls) at a receiver that computes for 1.5 s first."""
    a = np.zeros(1024, np.float32)
    comm.barrier()
    if rank == 0:
        t0 = time.monotonic()
        for mb in range(3000):
            comm.send(1, a + mb, kind="flood", mb=mb)
        sent = time.monotonic() - t0
        assert sent < 1.2, f"the sender waited {sent:.2f} s for a busy receiver"
    else:
        time.sleep(1.5)
        for mb in range(3000):
            assert comm.recv(0, kind="flood", mb=mb)[0] == mb
    comm.barrier()
    comm.close()


def test_full_ring_is_drained_for_a_busy_receiver():
    _run("_flood")


def _timeout_and_death(comm, rank):
    if rank == 1:
        comm.send(0, np.zeros(1, np.int32), kind="hello")
        t0 = time.monotonic()
        with pytest.raises(CommError, match="within 0.3 s"):
            comm.recv(0, kind="never", timeout=0.3)
        assert 0.25 < time.monotonic() - t0 < 2.0
        comm.send(0, np.zeros(1, np.int32), kind="go")
        # rank 0 sends two frames and dies: both arrive, then CommError at once
        assert comm.recv(0, kind="last", mb=0).tolist() == [7]
        assert comm.recv(0, kind="last", mb=1).tolist() == [8]
        t0 = time.monotonic()
        with pytest.raises(CommError, match="rank 0"):
            comm.recv(0, kind="after", timeout=5.0)
        assert time.monotonic() - t0 < 2.0
        comm.close()
    else:
        comm.recv(1, kind="hello")
        comm.recv(1, kind="go")
        comm.send(1, np.array([7]), kind="last", mb=0)
        comm.send(1, np.array([8]), kind="last", mb=1)
        os._exit(3)


def test_ring_timeout_and_dead_peer():
    _run("_timeout_and_death", crash=0)
