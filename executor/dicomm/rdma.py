"""RDMA transport over verbs (pyverbs): one reliable-connected (RC) queue pair per directed link.

Resources per link end: device context, protection domain (PD), a send and a receive completion
queue (CQ), two registered memory regions (MR) cut into `SLOTS` slots of `SLOT_BYTES`, and the RC
QP. Bring-up: the QP is created in INIT; each side publishes {qpn, psn, lid, gid, mtu} in the
rendezvous store under link/<src>-<dst>/{src,dst}; the handshake MACs bind both records by digest;
each side then moves its QP INIT -> RTR (needs the peer's qpn/psn/address) -> RTS.

Data path: the frame byte stream (prefix, header, payload: the same bytes as on tcp) is cut into
slot-sized SENDs. The receiver keeps every receive slot posted, so RC's receiver-not-ready retry is
only a backstop. Payload bytes are copied once into a registered slot on each side; registering
caller arrays to drop those copies is future work. The TCP connection that carried the handshake
stays open beside the QP: its EOF is how a dead peer is noticed without waiting for RC retries.

pyverbs comes from Debian's python3-pyverbs (rdma-core), built for Debian's Python 3.11; when the
venv cannot import it we retry with /usr/lib/python3/dist-packages appended to sys.path.

NOT EXERCISED: the machine this was written on has no RDMA device, so only the probe (no pyverbs /
no device -> clear refusal or fallback) and the construction of verbs attribute objects have run.
The queue-pair and data-path code below has never moved a byte. See docs/dicomm.md.
"""
from __future__ import annotations

import ctypes
import os
import secrets
import select
import socket
import sys
import threading
import time
from collections import deque
from types import SimpleNamespace

import numpy as np

from executor.dicomm.errors import CommError
from executor.dicomm.link import StreamReceiver, StreamSender
from executor.dicomm.tcp import PeerClosed

DEBIAN_DIST_PACKAGES = "/usr/lib/python3/dist-packages"
SLOTS = 64
SLOT_BYTES = 1 << 20
# ibv_rc_pingpong's values: 14 -> 4.096 us * 2^14 = 67 ms ACK timeout, 7 retries; rnr_retry 7 = forever
_ACK_TIMEOUT, _RETRY_CNT, _RNR_RETRY, _MIN_RNR_TIMER = 14, 7, 7, 12

_verbs: SimpleNamespace | None = None
_verbs_error: str | None = None


def _load() -> SimpleNamespace:
    """Import pyverbs once; raise CommError saying why it is unusable."""
    global _verbs, _verbs_error
    if _verbs is not None:
        return _verbs
    if _verbs_error is not None:
        raise CommError(_verbs_error)
    added = False
    try:
        try:
            import pyverbs  # noqa: F401
        except ImportError:
            if not os.path.isdir(os.path.join(DEBIAN_DIST_PACKAGES, "pyverbs")):
                raise
            sys.path.append(DEBIAN_DIST_PACKAGES)
            added = True
        import pyverbs.addr as addr
        import pyverbs.cq as cq
        import pyverbs.device as device
        import pyverbs.enums as enums
        import pyverbs.mr as mr
        import pyverbs.pd as pd
        import pyverbs.pyverbs_error as errors
        import pyverbs.qp as qp
        import pyverbs.wr as wr
    except ImportError as e:
        _verbs_error = (f"rdma unavailable: pyverbs cannot be imported ({e}); install Debian's "
                        f"python3-pyverbs (built for Python 3.11, this is "
                        f"{sys.version_info.major}.{sys.version_info.minor})")
        raise CommError(_verbs_error) from None
    finally:
        if added:  # pyverbs is loaded; keep the rest of Debian's packages out of this venv
            sys.path.remove(DEBIAN_DIST_PACKAGES)
    _verbs = SimpleNamespace(addr=addr, cq=cq, device=device, e=enums, mr=mr, pd=pd, qp=qp,
                             wr=wr, Error=errors.PyverbsError)
    return _verbs


def device_config() -> tuple[str | None, int, int]:
    """(device name or None for the first, port, GID index) from H2_RDMA_DEVICE/_PORT/_GID_INDEX."""
    return (os.environ.get("H2_RDMA_DEVICE") or None, int(os.environ.get("H2_RDMA_PORT", "1")),
            int(os.environ.get("H2_RDMA_GID_INDEX", "0")))


_probe_result: tuple[bool, str] | None = None


def probe() -> tuple[bool, str]:
    """(usable, why): is there pyverbs, an RDMA device, and an active port? Cached per process."""
    global _probe_result
    if _probe_result is None:
        _probe_result = _probe()
    return _probe_result


def _probe() -> tuple[bool, str]:
    try:
        v = _load()
    except CommError as e:
        return False, e.message
    try:
        devices = v.device.get_device_list()
    except v.Error as e:
        devices, detail = [], f" ({e})"
    else:
        detail = ""
    if not devices:
        return False, (f"rdma unavailable: no RDMA device{detail}; ibv_get_device_list found "
                       f"none (no InfiniBand/RoCE driver loaded: /sys/class/infiniband is "
                       f"{'empty' if os.path.isdir('/sys/class/infiniband') else 'absent'})")
    names = [d.name.decode() for d in devices]
    name, port, _gid = device_config()
    name = name or names[0]
    if name not in names:
        return False, f"rdma unavailable: H2_RDMA_DEVICE={name} not among {', '.join(names)}"
    try:
        ctx = v.device.Context(name=name)
        try:
            state = ctx.query_port(port).state
        finally:
            ctx.close()
    except v.Error as e:
        return False, f"rdma unavailable: cannot open {name} port {port}: {e}"
    if state != v.e.IBV_PORT_ACTIVE:
        return False, f"rdma unavailable: {name} port {port} is not active (state {state})"
    return True, f"{name} port {port}"


def rtr_attributes(v, local: dict, remote: dict, port: int, gid_index: int):
    """QPAttr for INIT -> RTR -> RTS toward `remote` (a peer's published QP record)."""
    attr = v.qp.QPAttr(port_num=port)
    attr.path_mtu = min(local["mtu"], remote["mtu"])
    attr.dest_qp_num = remote["qpn"]
    attr.rq_psn = remote["psn"]          # first PSN the peer will send
    attr.sq_psn = local["psn"]           # first PSN this side sends
    attr.max_dest_rd_atomic = 1
    attr.max_rd_atomic = 1
    attr.min_rnr_timer = _MIN_RNR_TIMER
    attr.timeout = _ACK_TIMEOUT
    attr.retry_cnt = _RETRY_CNT
    attr.rnr_retry = _RNR_RETRY
    # RoCE (and any peer without a LID) needs a global route header addressed by GID.
    is_global = int(local["ethernet"] or remote["lid"] == 0)
    gr = v.addr.GlobalRoute(dgid=v.addr.GID(val=remote["gid"]), sgid_index=gid_index) \
        if is_global else None
    ah_kwargs = dict(port_num=port, dlid=remote["lid"], is_global=is_global)
    if gr is not None:
        ah_kwargs["gr"] = gr
    attr.ah_attr = v.addr.AHAttr(**ah_kwargs)
    return attr


class QueuePair:
    """One end of an RC connection with its registered send/receive slots."""

    def __init__(self, slots: int = SLOTS, slot_bytes: int = SLOT_BYTES):
        v = self.v = _load()
        try:
            self._open(slots, slot_bytes)
        except v.Error as e:
            raise CommError(f"RDMA setup failed: {e}") from None

    def _open(self, slots: int, slot_bytes: int) -> None:
        v = self.v
        name, self.port, self.gid_index = device_config()
        name = name or v.device.get_device_list()[0].name.decode()
        e = v.e
        self.slots, self.slot_bytes = slots, slot_bytes
        self.ctx = v.device.Context(name=name)
        self.pd = v.pd.PD(self.ctx)
        port_attr = self.ctx.query_port(self.port)
        self.send_cq = v.cq.CQ(self.ctx, slots, None, None, 0)
        self.recv_cq = v.cq.CQ(self.ctx, slots, None, None, 0)
        self.send_mr = v.mr.MR(self.pd, slots * slot_bytes, e.IBV_ACCESS_LOCAL_WRITE)
        self.recv_mr = v.mr.MR(self.pd, slots * slot_bytes, e.IBV_ACCESS_LOCAL_WRITE)
        self.send_bytes = _as_numpy(self.send_mr.buf, slots * slot_bytes)
        self.recv_bytes = _as_numpy(self.recv_mr.buf, slots * slot_bytes)
        cap = v.qp.QPCap(max_send_wr=slots, max_recv_wr=slots, max_send_sge=1, max_recv_sge=1)
        init = v.qp.QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.send_cq, rcq=self.recv_cq, cap=cap,
                               sq_sig_all=1)
        self.qp = v.qp.QP(self.pd, init, v.qp.QPAttr(port_num=self.port))  # RESET -> INIT
        gid = self.ctx.query_gid(self.port, self.gid_index).gid
        self.local = {"qpn": self.qp.qp_num, "psn": secrets.randbits(24), "lid": port_attr.lid,
                      "gid": gid, "mtu": int(port_attr.active_mtu),
                      "ethernet": port_attr.link_layer == e.IBV_LINK_LAYER_ETHERNET}

    def connect(self, remote: dict) -> None:
        try:
            attr = rtr_attributes(self.v, self.local, remote, self.port, self.gid_index)
            self.qp.to_rtr(attr)
            self.qp.to_rts(attr)
        except (self.v.Error, KeyError, TypeError) as e:
            raise CommError(f"RDMA queue pair could not reach RTS toward qpn "
                            f"{remote.get('qpn')}: {e}") from None

    def post_recv(self, slot: int) -> None:
        sge = self.v.wr.SGE(self.recv_mr.buf + slot * self.slot_bytes, self.slot_bytes,
                            self.recv_mr.lkey)
        try:
            self.qp.post_recv(self.v.wr.RecvWR(wr_id=slot, num_sge=1, sg=[sge]))
        except self.v.Error as e:
            raise CommError(f"RDMA post_recv failed: {e}") from None

    def post_send(self, slot: int, length: int) -> None:
        sge = self.v.wr.SGE(self.send_mr.buf + slot * self.slot_bytes, length, self.send_mr.lkey)
        try:
            self.qp.post_send(self.v.wr.SendWR(wr_id=slot, opcode=self.v.e.IBV_WR_SEND,
                                               num_sge=1, sg=[sge],
                                               send_flags=self.v.e.IBV_SEND_SIGNALED))
        except self.v.Error as e:
            raise CommError(f"RDMA post_send failed: {e}") from None

    def poll(self, cq, peer: int | None):
        """(slot, byte_len) of one completion, or None."""
        try:
            n, wcs = cq.poll(1)
        except self.v.Error as e:   # the CQ was closed under a polling reader thread
            raise CommError(f"RDMA completion queue of the link with rank {peer} is gone: {e}",
                            peer) from None
        if not n:
            return None
        wc = wcs[0]
        if wc.status != self.v.e.IBV_WC_SUCCESS:
            raise CommError(f"RDMA completion error on the link with rank {peer}: status "
                            f"{wc.status} (vendor {wc.vendor_err}); the peer died or the fabric "
                            f"dropped the connection", peer)
        return wc.wr_id, wc.byte_len

    def close(self) -> None:
        for obj in (self.qp, self.send_mr, self.recv_mr, self.send_cq, self.recv_cq, self.pd,
                    self.ctx):
            try:
                obj.close()
            except Exception:  # best effort teardown; the process may be exiting
                pass


def _as_numpy(address: int, length: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint8 * length).from_address(address))


class VerbsStream:
    """The frame byte stream over a connected QueuePair (send_parts / recv_into like a socket)."""

    def __init__(self, qp: QueuePair, control, peer: int, timeout: float):
        self.qp = qp
        self.control = control        # SocketStream kept open for liveness
        self.peer = peer
        self.timeout = timeout
        self.peer_closed = False
        self._free = deque(range(qp.slots))
        self._fill_slot: int | None = None
        self._fill = 0
        self._recv: tuple[int, int] | None = None
        self._recv_off = 0

    # -- sending ------------------------------------------------------------------------------
    def send_parts(self, parts, fds: tuple[int, ...] = ()) -> None:
        if fds:
            raise CommError("file descriptors cannot travel over RDMA", self.peer)
        for part in parts:
            mv = np.frombuffer(memoryview(part).cast("B"), dtype=np.uint8)
            off = 0
            while off < mv.size:
                if self._fill_slot is None:
                    self._fill_slot, self._fill = self._take_send_slot(), 0
                base = self._fill_slot * self.qp.slot_bytes
                n = min(mv.size - off, self.qp.slot_bytes - self._fill)
                self.qp.send_bytes[base + self._fill:base + self._fill + n] = mv[off:off + n]
                self._fill += n
                off += n
                if self._fill == self.qp.slot_bytes:
                    self._flush()
        self._flush()

    def _flush(self) -> None:
        if self._fill_slot is not None and self._fill:
            self.qp.post_send(self._fill_slot, self._fill)
            self._fill_slot = None

    def _take_send_slot(self) -> int:
        deadline = time.monotonic() + self.timeout
        pause = 0.0
        while not self._free:
            done = self.qp.poll(self.qp.send_cq, self.peer)
            if done is not None:
                self._free.append(done[0])
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"no RDMA send completion from rank {self.peer} in "
                                   f"{self.timeout} s")
            pause = _backoff(pause)
        return self._free.popleft()

    # -- receiving (reader thread) -------------------------------------------------------------
    def post_all_receives(self) -> None:
        for slot in range(self.qp.slots):
            self.qp.post_recv(slot)

    def recv_into(self, buf) -> None:
        mv = np.frombuffer(memoryview(buf).cast("B"), dtype=np.uint8)
        got = 0
        while got < mv.size:
            if self._recv is None:
                self._recv, self._recv_off = self._next_completion(got), 0
            slot, length = self._recv
            base = slot * self.qp.slot_bytes + self._recv_off
            n = min(mv.size - got, length - self._recv_off)
            mv[got:got + n] = self.qp.recv_bytes[base:base + n]
            got += n
            self._recv_off += n
            if self._recv_off == length:
                self.qp.post_recv(slot)
                self._recv = None

    def recv_exact(self, n: int) -> bytearray:
        buf = bytearray(n)
        self.recv_into(buf)
        return buf

    def _next_completion(self, got: int) -> tuple[int, int]:
        pause = 0.0
        while True:
            done = self.qp.poll(self.qp.recv_cq, self.peer)
            if done is not None:
                return done
            if self.peer_closed:
                raise PeerClosed(f"rank {self.peer} closed its RDMA link", self.peer, got)
            pause = _backoff(pause)

    def close(self) -> None:
        # Let posted SENDs (the goodbye included) complete before the QP is destroyed.
        deadline = time.monotonic() + 1.0
        try:
            while len(self._free) < self.qp.slots and time.monotonic() < deadline:
                done = self.qp.poll(self.qp.send_cq, self.peer)
                if done is not None:
                    self._free.append(done[0])
        except CommError:
            pass
        self.peer_closed = True
        self.control.close()
        self.qp.close()


def _backoff(pause: float) -> float:
    """Spin briefly, then sleep up to 1 ms: completions usually come within microseconds, and a
    Python thread that spins forever would steal a core from the compute."""
    if pause:
        time.sleep(pause)
    return min(1e-3, pause * 2 or 1e-6)


class RdmaSender(StreamSender):
    transport = "rdma"

    def send(self, array, **kw) -> None:
        sock = self.stream.control.sock
        ready, _, _ = select.select([sock], [], [], 0)
        if ready and not sock.recv(1, socket.MSG_PEEK):
            raise CommError(f"rank {self.src}: rank {self.dst} closed its link (process exited "
                            f"or died)", self.dst)
        super().send(array, **kw)


class RdmaReceiver(StreamReceiver):
    transport = "rdma"

    def start(self) -> None:
        threading.Thread(target=self._watch_control, daemon=True,
                         name=f"dicomm-rdma-watch-{self.src}->{self.dst}").start()
        super().start()

    def _watch_control(self) -> None:
        try:
            while self.stream.control.sock.recv(1):
                pass
        except OSError:
            pass
        self.stream.peer_closed = True
