"""DiComm: frame format, transports between real processes, collectives, security, failures.

Multi-process tests use workers started with multiprocessing's spawn context, given only ints and
strings; results come back through the rendezvous store (see the harness below).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import traceback
import uuid

import numpy as np
import pytest
import torch

from executor import dicomm
from executor.dicomm import rdma
from executor.dicomm.errors import CommError
from executor.dicomm.frame import PREFIX_BYTES

SECRET = "test-secret-4f1c"


# -- frames (in process) ----------------------------------------------------------------------

def _sample(name: str, shape, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if name == "bool":
        return rng.random(shape) > 0.5
    if name in ("i32", "i64"):
        return rng.integers(-1000, 1000, shape).astype(dicomm.DTYPES[name])
    if name == "bf16":
        return dicomm.to_bf16(rng.standard_normal(shape).astype(np.float32))
    return rng.standard_normal(shape).astype(dicomm.DTYPES[name])


@pytest.mark.parametrize("name", list(dicomm.DTYPES))
@pytest.mark.parametrize("shape", [(3, 5), (0, 4), ()])
def test_frame_round_trip(name, shape):
    a = _sample(name, shape)
    parts = dicomm.encode_frame(a, kind="grad", stage=2, mb=7, seq=3, src=1, dtype=name)
    header, b = dicomm.decode_frame(b"".join(bytes(p) for p in parts))
    assert (header.kind, header.stage, header.mb, header.seq, header.src) == ("grad", 2, 7, 3, 1)
    assert header.dtype == name and header.shape == shape and header.nbytes == a.nbytes
    assert b.dtype == a.dtype and b.shape == a.shape and np.array_equal(a, b)


def test_payload_travels_without_copy():
    a = np.arange(1000, dtype=np.float32)
    _, payload = dicomm.encode_frame(a, kind="act")
    a[0] = 42.0   # the payload part is a view of the caller's array, not a copy
    assert np.frombuffer(payload, dtype=np.float32)[0] == 42.0


def test_bf16_conversion_matches_torch():
    x = np.concatenate([np.random.default_rng(1).standard_normal(10_000).astype(np.float32) * 100,
                        np.array([0.0, -0.0, np.inf, -np.inf, 3.4e38, 1e-40], np.float32)])
    ours = dicomm.to_bf16(x)
    ref = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(ours, ref)
    assert np.array_equal(dicomm.from_bf16(ours), torch.from_numpy(x).to(torch.bfloat16).float()
                          .numpy())
    assert np.isnan(dicomm.from_bf16(dicomm.to_bf16(np.array([np.nan], np.float32)))).all()
    assert dicomm.dtype_name(ours.dtype) == "bf16"


def test_payload_digest_tree_and_fused_copy_agree():
    import hashlib
    from executor.dicomm import checksum
    data = np.random.default_rng(2).integers(0, 256, 3 * checksum.PARALLEL_BYTES + 12345,
                                             dtype=np.uint8)
    small = data[:checksum.PARALLEL_BYTES - 1]
    assert checksum.digest(small) == hashlib.sha256(small).digest()
    leaves = b"".join(hashlib.sha256(data[i:i + checksum.CHUNK_BYTES]).digest()
                      for i in range(0, data.size, checksum.CHUNK_BYTES))
    tree = hashlib.sha256(b"h2-tree" + data.size.to_bytes(8, "little") + leaves).digest()
    assert checksum.digest(data) == tree                        # chunked on the thread pool
    for part in (small, data):
        out = np.zeros_like(part)
        assert checksum.copy_with_digest(out, part) == checksum.digest(part)
        assert np.array_equal(out, part)


def _frame_bytes() -> bytearray:
    a = np.arange(64, dtype=np.int32)
    return bytearray(b"".join(bytes(p) for p in dicomm.encode_frame(a, kind="act", mb=1)))


def test_corrupt_payload_is_detected():
    buf = _frame_bytes()
    buf[-5] ^= 0x01
    with pytest.raises(CommError, match="does not match the SHA-256 digest"):
        dicomm.decode_frame(buf)


def test_truncated_frame_is_detected():
    buf = _frame_bytes()
    with pytest.raises(CommError, match="truncated"):
        dicomm.decode_frame(buf[:-1])
    with pytest.raises(CommError, match="truncated"):
        dicomm.decode_frame(buf[:PREFIX_BYTES + 3])
    with pytest.raises(CommError, match="truncated"):
        dicomm.decode_frame(buf[:5])


def test_garbage_and_inconsistent_headers_are_rejected():
    buf = _frame_bytes()
    with pytest.raises(CommError, match="expected b'h2'"):
        dicomm.decode_frame(b"GET / HTTP/1.1\r\n" + bytes(buf))
    from executor.dicomm.frame import encode_message
    lie = encode_message({"kind": "act", "stage": 0, "mb": 0, "dtype": "f32", "shape": [4],
                          "nbytes": 8, "seq": 0, "digest": bytes(32), "src": 0})
    with pytest.raises(CommError, match="nbytes 8 but f32"):
        dicomm.decode_frame(lie + bytes(8))


# -- multi-process harness ----------------------------------------------------------------------
# Spawned interpreters pay ~2 s each importing torch (for TCPStore), which would dominate this
# file if every test started its own. So a module-scoped pool of 3 spawned workers runs the
# scenarios one after another: a scenario is a module-level function (rank, world, port, ns, arg)
# named by a task in the store; each worker writes "ok" or its traceback under
# <task ns>/result/<rank>. Only the crash scenario, which kills a worker, gets fresh processes.

POOL_SIZE = 3


def _serve(rank: int, port: int, ns: str) -> None:
    from datetime import timedelta
    from torch.distributed import TCPStore
    store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=300))
    n = 0
    while True:
        worker, world, arg = store.get(f"{ns}/task/{n}").decode().split("|")
        if worker == "exit":
            return
        task_ns = f"{ns}/{n}"
        if rank < int(world):
            _report(store, task_ns, rank, worker, int(world), port, arg)
        n += 1


def _report(store, ns: str, rank: int, worker: str, world: int, port: int, arg: str) -> None:
    try:
        globals()[worker](rank, world, port, ns, arg)
        result = "ok"
    except BaseException:
        result = f"rank {rank}:\n{traceback.format_exc()}"
    store.set(f"{ns}/result/{rank}", result)


def _entry(worker: str, rank: int, world: int, port: int, ns: str, arg: str) -> None:
    from datetime import timedelta
    from torch.distributed import TCPStore
    store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    _report(store, ns, rank, worker, world, port, arg)


def _collect(store, ns: str, world: int, timeout: float, exitcodes=None,
             crashes: dict[int, int] | None = None) -> None:
    from datetime import timedelta
    keys = [f"{ns}/result/{r}" for r in range(world)]
    try:
        store.wait([k for r, k in enumerate(keys) if not crashes or r not in crashes],
                   timedelta(seconds=timeout))
    except Exception:
        pass   # reported below per rank
    failures = []
    for r, key in enumerate(keys):
        code = exitcodes[r] if exitcodes else None
        if crashes and r in crashes and code == crashes[r] and not store.check([key]):
            continue
        result = store.get(key).decode() if store.check([key]) else \
            f"rank {r}: no result (exit code {code})"
        if result != "ok":
            failures.append(result)
    assert not failures, "\n".join(failures)


@pytest.fixture(scope="module")
def pool():
    store = dicomm.host_store()
    ns = f"pool-{uuid.uuid4().hex[:8]}"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_serve, args=(r, store.port, ns), daemon=True)
             for r in range(POOL_SIZE)]
    for p in procs:
        p.start()
    tasks = iter(range(1 << 30))

    def run(worker: str, world: int, arg: str = "", timeout: float = 60.0) -> None:
        n = next(tasks)
        store.set(f"{ns}/task/{n}", f"{worker}|{world}|{arg}")
        _collect(store, f"{ns}/{n}", world, timeout)

    yield run
    store.set(f"{ns}/task/{next(tasks)}", "exit|0|")
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.kill()


def _run_fresh(worker: str, world: int, arg: str = "", timeout: float = 60.0,
               crashes: dict[int, int] | None = None) -> None:
    """Run `worker` on `world` new processes; `crashes` maps a rank to the exit code it dies with."""
    store = dicomm.host_store()
    ns = f"test-{uuid.uuid4().hex[:8]}"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_entry, args=(worker, r, world, store.port, ns, arg))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
        if p.is_alive():
            p.kill()
    _collect(store, ns, world, 1.0, [p.exitcode for p in procs], crashes)


def _connect(rank, world, port, ns, transport="tcp", **kw):
    kw.setdefault("timeout", 10.0)
    return dicomm.connect(rank, world, "127.0.0.1", port, kw.pop("secret", SECRET),
                          transport=transport, namespace=f"{ns}/{transport}", **kw)


# -- point to point -----------------------------------------------------------------------------

_BIG = 6 * 1024 * 1024 // 4      # 6 MiB of f32: many socket writes, and an shm segment


def _exchange(rank, world, port, ns, transport):
    """All dtypes, received in the reverse order of sending; a 6 MiB tensor; a reply."""
    comm = _connect(rank, world, port, ns, transport, fallback=False)
    tensors = {(name, mb): _sample(name, (4, 3 + mb), seed=mb) for name in dicomm.DTYPES
               for mb in range(2)}
    big = np.arange(_BIG, dtype=np.float32)
    if rank == 0:
        for (name, mb), a in tensors.items():
            comm.send(1, a, kind=f"act-{name}", mb=mb, stage=0, dtype=name)
        comm.send(1, big, kind="big", mb=0, stage=0)
        assert comm.link_transport(1) == transport, comm.link_transport(1)
        back = comm.recv(1, kind="grad", mb=5)
        assert np.array_equal(back, big[::-1])
    else:
        frame = comm.recv_frame(0, kind="big", mb=0)     # sent last, received first
        assert frame.header.dtype == "f32" and frame.array.flags.writeable
        assert np.array_equal(frame.array, big)
        for (name, mb), a in reversed(list(tensors.items())):
            got = comm.recv_frame(0, kind=f"act-{name}", mb=mb)
            assert got.header.dtype == name and got.header.stage == 0
            assert got.array.dtype == a.dtype and np.array_equal(got.array, a), (name, mb)
        comm.send(0, big[::-1], kind="grad", mb=5)       # non-contiguous input
    comm.barrier()
    comm.close()


def _point_to_point(rank, world, port, ns, _):
    for transport in ("tcp", "shm"):
        _exchange(rank, world, port, ns, transport)
    _views(rank, world, port, ns)


def test_send_recv_between_two_processes_tcp_and_shm(pool):
    pool("_point_to_point", 2)


def _views(rank, world, port, ns):
    """shm recv(view=True): read-only views into the sender's segment, released on the next recv."""
    comm = _connect(rank, world, port, ns, "shm", fallback=False)
    a = np.arange(1 << 18, dtype=np.float64)           # 2 MiB: goes through a segment
    if rank == 0:
        for mb in range(3):
            comm.send(1, a + mb, kind="act", mb=mb)
        comm.recv(1, kind="done")
    else:
        v0 = comm.recv(0, kind="act", mb=0, view=True)
        assert not v0.flags.writeable and np.array_equal(v0, a)
        v1 = comm.recv(0, kind="act", mb=1, view=True)  # releases v0's segment
        assert np.array_equal(v1, a + 1)
        comm.release()
        assert np.array_equal(comm.recv(0, kind="act", mb=2), a + 2)
        comm.send(0, np.zeros(1, np.int32), kind="done")
    comm.close()


# -- collectives ----------------------------------------------------------------------------------

def _grads(rank: int) -> list[np.ndarray]:
    """Integer-valued floats, so sums are exact whatever order the ring adds them in."""
    rng = np.random.default_rng(100 + rank)
    return [rng.integers(-50, 50, 100_003).astype(np.float32),      # not divisible by 3; > 64 KiB
            rng.integers(-50, 50, (7, 3)).astype(np.float64),
            rng.integers(-50, 50, (2,)).astype(np.float32),         # fewer elements than ranks
            dicomm.to_bf16(rng.integers(-50, 50, 9).astype(np.float32)),
            rng.integers(-50, 50, 5).astype(np.int64)]


def _collectives(rank, world, port, ns, _):
    for transport in ("tcp", "shm"):
        comm = _connect(rank, world, port, ns, transport, fallback=False)
        group = list(range(world))
        mine = _grads(rank)
        expected = [sum(_grads(r)[i].astype(np.float64) if i != 3 else
                        dicomm.from_bf16(_grads(r)[i]).astype(np.float64) for r in group)
                    for i in range(len(mine))]
        comm.all_reduce(mine, group, op="sum")
        for i, (got, want) in enumerate(zip(mine, expected)):
            value = dicomm.from_bf16(got) if i == 3 else got
            assert np.array_equal(value, want), (transport, i)
        floats = [g for i, g in enumerate(_grads(rank)) if i != 4]
        comm.all_reduce(floats, group, op="avg")
        assert np.allclose(floats[0], expected[0] / world)
        assert np.allclose(floats[1], expected[1] / world)
        if rank != 1:   # a sub-group, as for one stage's data-parallel replicas
            x = np.full(10, float(rank + 1), dtype=np.float32)
            comm.all_reduce([x], [0, 2], op="sum")
            assert np.array_equal(x, np.full(10, 4.0, np.float32))
        outs = comm.all_to_all([np.full(3 + dst, 10 * rank + dst, dtype=np.int32)
                                for dst in group], group)
        for src, o in enumerate(outs):
            assert np.array_equal(o, np.full(3 + rank, 10 * src + rank, dtype=np.int32))
        comm.barrier(group)
        comm.close()


def test_ring_all_reduce_all_to_all_barrier_three_processes(pool):
    pool("_collectives", 3)


# -- security -------------------------------------------------------------------------------------

def _bad_secret(rank, world, port, ns, _):
    import time
    if rank == 0:
        comm = _connect(rank, world, port, ns, "tcp")
        deadline = time.monotonic() + 10
        while not comm.rejected and time.monotonic() < deadline:
            time.sleep(0.05)
        assert comm.rejected and "bad handshake MAC" in comm.rejected[0], comm.rejected
        with pytest.raises(CommError, match="no 'act' frame"):
            comm.recv(1, kind="act", timeout=0.5)
    else:
        comm = _connect(rank, world, port, ns, "tcp", secret="not-the-secret")
        with pytest.raises(CommError, match="record at .*rank/0' failed authentication"):
            comm.send(0, np.ones(4, np.float32), kind="act")   # rank 0's record: wrong MAC
        # Dialled anyway (the record's bytes read without their MAC), the handshake refuses it.
        import msgpack
        from executor.dicomm import handshake
        from executor.dicomm.tcp import SocketStream, dial_tcp
        raw = comm._rdv._fetch("rank/0", "rank 0's record", 5.0)[:-handshake.MAC_BYTES]
        record = msgpack.unpackb(raw)
        stream = SocketStream(dial_tcp(record["host"], record["port"], 5.0), 0)
        with pytest.raises(CommError, match="rejected the handshake"):
            handshake.connect(stream, 1, 0, b"not-the-secret", "tcp")
        stream.close()
    comm.close()


def test_bad_secret_is_rejected(pool):
    pool("_bad_secret", 2)


def test_connect_requires_a_secret(monkeypatch):
    monkeypatch.delenv("H2_SECRET", raising=False)
    with pytest.raises(CommError, match="no run secret"):
        dicomm.connect(0, 1, "127.0.0.1", 1, secret=None)


# -- rdma without a device ------------------------------------------------------------------------

def test_rdma_without_device_falls_back_or_refuses():
    usable, why = dicomm.rdma_probe()
    if usable:
        pytest.skip(f"this machine has an RDMA device ({why})")
    assert why.startswith("rdma unavailable:") and ("pyverbs" in why or "no RDMA device" in why)
    store = dicomm.host_store()
    comm = dicomm.connect(0, 1, "127.0.0.1", store.port, SECRET, transport="rdma",
                          fallback=True, namespace="rdma-fallback")
    try:
        assert comm.requested == "rdma" and comm.transport in ("shm", "tcp")
        assert comm.fallback_reason.startswith(why) and "falling back to" in comm.fallback_reason
        comm.send(0, np.ones(2, np.float32), kind="self")
        assert np.array_equal(comm.recv(0, kind="self"), np.ones(2, np.float32))
    finally:
        comm.close()
    with pytest.raises(CommError, match="rdma unavailable") as err:
        dicomm.connect(0, 1, "127.0.0.1", store.port, SECRET, transport="rdma", fallback=False,
                       namespace="rdma-refuse")
    assert "fallback=True" in str(err.value)


def test_rdma_queue_pair_attributes_from_peer_record():
    try:
        v = rdma._load()
    except CommError as e:
        pytest.skip(e.message)
    local = {"qpn": 11, "psn": 100, "lid": 0, "gid": "fe80:0000:0000:0000:0000:0000:0000:0001",
             "mtu": 5, "ethernet": True}
    remote = {"qpn": 22, "psn": 200, "lid": 0, "gid": "fe80:0000:0000:0000:0000:0000:0000:0002",
              "mtu": 3, "ethernet": True}
    attr = rdma.rtr_attributes(v, local, remote, port=1, gid_index=3)
    assert (attr.dest_qp_num, attr.rq_psn, attr.sq_psn, attr.path_mtu) == (22, 200, 100, 3)
    assert attr.ah_attr.is_global == 1 and attr.ah_attr.sgid_index == 3
    assert attr.ah_attr.dgid == remote["gid"]


# -- failures -------------------------------------------------------------------------------------

def _dies(rank, world, port, ns, _):
    comms = {t: _connect(rank, world, port, ns, t, timeout=2.0, fallback=False)
             for t in ("tcp", "shm")}
    if rank == 1:
        for t, comm in comms.items():
            comm.send(0, np.ones(1 << 17, np.float32), kind="act", mb=0)   # inline and segment
            comm.send(0, np.ones(8, np.float32), kind="act", mb=1)
        comms["tcp"].recv(0, kind="go")
        os._exit(3)   # a crash: no close(), no goodbye
    comms["tcp"].send(1, np.zeros(1, np.int32), kind="go")
    for t, comm in comms.items():
        assert comm.recv(1, kind="act", mb=1).shape == (8,)     # frames sent before death arrive
        with pytest.raises(CommError, match="closed its link"):
            comm.recv(1, kind="act", mb=2)
        assert comm.recv(1, kind="act", mb=0).shape == (1 << 17,)
    silent = _connect(rank, world, port, ns + "-silent", "tcp")  # the dead rank never joins it
    with pytest.raises(CommError, match="never connected"):
        silent.recv(1, kind="grad", timeout=1.0)
    silent.close()
    for comm in comms.values():
        comm.close()


def test_dead_peer_raises_comm_error():
    _run_fresh("_dies", 2, crashes={1: 3})
