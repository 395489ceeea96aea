"""DiComm: h2's communication library. One interface over three transports.

    tcp    sockets; every byte goes through the kernel (the CPU-mediated baseline)
    shm    same host: payloads in shared memory segments, the receiver can read them in place
           (the zero-copy "device-direct" analogue available on a CPU machine)
    rdma   verbs via pyverbs: RC queue pairs, registered memory (needs an RDMA device)

Launcher (the executor's parent process):

    store = dicomm.host_store("127.0.0.1")          # torch TCPStore master; keep it alive
    secret = dicomm.new_secret()                    # give it to workers as H2_SECRET
    # start workers with rank, world_size, store.port, secret

Worker:

    comm = dicomm.connect(rank, world_size, "127.0.0.1", store_port, secret,
                          transport="shm", fallback=True, timeout=10.0)
    comm.send(dst, array, kind="act", mb=0, stage=0)      # np.ndarray; bf16 as uint16 bits
    arr = comm.recv(src, kind="act", mb=0)                 # np.ndarray, header checked
    arr = comm.recv(src, kind="act", mb=0, view=True)      # shm: read-only view, valid until the
                                                           # next recv from src or comm.release()
    comm.all_reduce([grad_a, grad_b], group=[0, 2], op="avg")   # in place, ring algorithm
    shard = comm.reduce_scatter(flat, group=[0, 2], op="avg")  # its two halves (ZeRO-1):
    whole = comm.all_gather(shard, group=[0, 2], size=flat.size)   # shard_bounds cuts
    outs = comm.all_to_all([to_r0, to_r1], group=[0, 1])       # outs[i] came from group[i]
    comm.barrier([0, 1, 2])
    comm.close()

Frames are tagged (kind, micro-batch) and may arrive in any order; `recv` waits for the matching
one. Every wait is bounded by `timeout`: a dead or silent peer raises `CommError`, never hangs.
Connections are authenticated with an HMAC-SHA256 challenge over the per-run secret; a peer
without it is rejected and listed in `comm.rejected`. Every message after the handshake carries
an HMAC tag under per-connection keys, and every rendezvous record an HMAC under the secret, so
neither altered traffic nor a rewritten store record is acted on. `comm.links()` says which
transport each opened link really uses (and why, when it is not the requested one).

Frame format, transports, handshake and measured figures: docs/dicomm.md.
Benchmark: `h2x bench-comm` (executor.dicomm.bench.bench_main).
"""
from executor.dicomm.comm import (DEFAULT_TIMEOUT, TRANSPORTS, Comm, connect, describe_links,
                                  shard_bounds)
from executor.dicomm.errors import CommError
from executor.dicomm.checksum import DIGEST_IMPL
from executor.dicomm.frame import (DTYPES, Header, decode_frame, dtype_name,
                                   encode_frame, from_bf16, to_bf16)
from executor.dicomm.handshake import new_secret
from executor.dicomm.link import Frame
from executor.dicomm.rdma import probe as rdma_probe
from executor.dicomm.rendezvous import host_store, reserve_store

__all__ = ["connect", "Comm", "CommError", "Frame", "Header", "host_store", "reserve_store",
           "new_secret", "encode_frame", "decode_frame", "to_bf16", "from_bf16", "dtype_name",
           "DTYPES", "TRANSPORTS", "DEFAULT_TIMEOUT", "DIGEST_IMPL", "rdma_probe", "describe_links",
           "shard_bounds"]
