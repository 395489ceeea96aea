"""DiComm against a hostile local process: rewritten store records, a relay in the middle of a
link, oversized and malformed pre-authentication messages, fuzzed handshakes and frames, and the
addresses a default run listens on.

Self-contained (own helpers and fixtures). Everything runs in this process (several Comms, each
driven by the test's thread, with DiComm's own accept and reader threads behind them) except the
listener check, which runs `h2c compile` and `h2x run` on a tiny model. Only loopback is used.
"""
from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from executor import dicomm
from executor.dicomm import handshake
from executor.dicomm.checksum import digest as payload_digest
from executor.dicomm.errors import CommError
from executor.dicomm.frame import CONTROL, FRAME, PREFIX, PREFIX_BYTES, encode_message, parse_prefix
from executor.dicomm.link import StreamReceiver
from executor.dicomm.rendezvous import Rendezvous
from executor.dicomm.seal import TAG_BYTES, Sealer
from executor.dicomm.tcp import PeerClosed

ROOT = Path(__file__).resolve().parents[1]
SECRET = "hostile-test-secret-91ab"
KEY = SECRET.encode()


# -- helpers ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def store():
    return dicomm.host_store()


@pytest.fixture
def comms(store):
    """comms(world, transport) -> list of Comm on a fresh namespace; all closed afterwards."""
    opened = []

    def make(world: int, transport: str = "tcp", **kw):
        ns = f"hostile-{uuid.uuid4().hex[:8]}"
        kw.setdefault("timeout", 3.0)
        kw.setdefault("fallback", False)
        made = [dicomm.connect(r, world, "127.0.0.1", store.port, SECRET, transport=transport,
                               namespace=ns, **kw) for r in range(world)]
        opened.extend(made)
        return made, ns

    yield make
    for c in opened:
        c.close()


def _raw_store(port: int):
    """A store client that has no secret: what any process that reaches the port gets."""
    from datetime import timedelta
    from torch.distributed import TCPStore
    return TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=5),
                    wait_for_workers=False)


def _recv_message(sock: socket.socket) -> tuple[bytes, bytes]:
    """(prefix, map bytes) of one message from a raw socket."""
    prefix = _recv_n(sock, PREFIX_BYTES)
    _, length = parse_prefix(prefix, max_length=1 << 16)
    return prefix, _recv_n(sock, length)


def _recv_n(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError(f"closed after {len(buf)} of {n} bytes")
        buf += chunk
    return buf


class _Relay:
    """A man in the middle on loopback: accepts the connector, dials the real acceptor, passes the
    handshake through unchanged, then hands each later connector->acceptor message (as
    [prefix+map, tag, payload]) to `tamper`, which returns the list of messages to forward."""

    def __init__(self, upstream: tuple[str, int], tamper):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.upstream, self.tamper = upstream, tamper
        self.seen = 0
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        client, _ = self.listener.accept()
        server = socket.create_connection(self.upstream)
        threading.Thread(target=self._pipe, args=(server, client), daemon=True).start()
        try:
            server.sendall(b"".join(_recv_message(client)))           # auth: passed unchanged
            while True:
                prefix, body = _recv_message(client)
                tag = _recv_n(client, TAG_BYTES)
                m = msgpack.unpackb(body) if prefix[3:4] == FRAME else {}
                payload = _recv_n(client, m["nbytes"]) if m and "at" not in m else b""
                for msg in self.tamper(self.seen, [prefix + body, tag, payload]):
                    server.sendall(b"".join(msg))
                self.seen += 1
        except (EOFError, OSError):
            pass

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass


def _point_rank_at(store_port: int, ns: str, rank: int, port: int) -> None:
    """Publish an *authentic* record for `rank` naming `port` on loopback. Only a holder of the
    secret can do this; the test uses it to put a relay in the middle of a link the way an
    attacker on the network path would be, to show what the frame tags do on their own."""
    rdv = Rendezvous("127.0.0.1", store_port, 3.0, ns, secret=KEY)
    record = rdv.lookup(f"rank/{rank}", "record")
    rdv.publish(f"rank/{rank}", dict(record, port=port, transports=["tcp"]))


# -- the rendezvous store -------------------------------------------------------------------------

def test_store_record_rewrite_is_detected(store, comms):
    """A process with store access but no secret points rank 1's record at its own listener and
    strips shm from it (a downgrade to tcp): rank 0 refuses the record, nothing reaches either."""
    (c0, c1), ns = comms(2, "shm")
    trap = socket.create_server(("127.0.0.1", 0))
    trap.settimeout(0.3)
    attacker = _raw_store(store.port)
    value = attacker.get(f"{ns}/rank/1")
    record = msgpack.unpackb(value[:-32])
    assert record["transports"][:2] == ["tcp", "shm"] and record["host"] == "127.0.0.1"
    forged = msgpack.packb(dict(record, port=trap.getsockname()[1], transports=["tcp"]))
    for rewrite in (forged, forged + value[-32:], value[:-33] + b"\x00" + value[-32:]):
        attacker.set(f"{ns}/rank/1", rewrite)       # no MAC; the old MAC; one byte changed
        with pytest.raises(CommError, match=rf"record at '{ns}/rank/1' failed authentication"):
            c0.send(1, np.ones(8, np.float32), kind="act")
    with pytest.raises(socket.timeout):
        trap.accept()                               # rank 0 never dialled the forged endpoint
    assert c0.link_transport(1) is None
    attacker.set(f"{ns}/rank/1", value)             # the authentic record still works (over shm)
    c0.send(1, np.arange(4, dtype=np.float32), kind="act")
    assert np.array_equal(c1.recv(0, kind="act"), np.arange(4, dtype=np.float32))
    assert c0.links() == [{"dst": 1, "transport": "shm", "fallback": None}]


def test_record_moved_to_another_key_is_detected(store, comms):
    (c0, c1, c2), ns = comms(3)
    attacker = _raw_store(store.port)
    attacker.set(f"{ns}/rank/2", attacker.get(f"{ns}/rank/1"))   # authentic, but rank 1's
    with pytest.raises(CommError, match="rank/2' failed authentication"):
        c0.send(2, np.ones(2, np.float32))


# -- a relay in the middle of a link --------------------------------------------------------------

def _alter_payload(n, msg):
    """Flip a payload bit and fix the digest in the header (the CRC fix of the old format)."""
    if n != 0:
        return [msg]
    head, tag, payload = msg
    m = msgpack.unpackb(head[PREFIX_BYTES:])
    payload = bytearray(payload)
    payload[5] ^= 0x40
    m["digest"] = payload_digest(payload)
    return [[encode_message(m), tag, bytes(payload)]]


def _alter_header(n, msg):
    if n != 0:
        return [msg]
    m = msgpack.unpackb(msg[0][PREFIX_BYTES:])
    m["mb"] = 7
    return [[encode_message(m), msg[1], msg[2]]]


TAMPER = {
    "payload altered, digest fixed": (_alter_payload, 0),
    "header altered": (_alter_header, 0),
    "frame replayed": (lambda n, msg: [msg, msg] if n == 0 else [msg], 1),
    "frame dropped": (lambda n, msg: [] if n == 0 else [msg], 0),
    "frames reordered": (lambda n, msg: [] if n == 0 else [msg, _Held.first] if n == 1 else [msg],
                         0),
}


class _Held:
    first = None


@pytest.mark.parametrize("how", list(TAMPER))
def test_relay_that_tampers_after_the_handshake_is_detected(store, comms, how):
    tamper, bad_mb = TAMPER[how]
    (c0, c1), ns = comms(2)

    def recording(n, msg):
        if n == 0:
            _Held.first = msg
        return tamper(n, msg)

    relay = _Relay(("127.0.0.1", c1._listeners[0].getsockname()[1]), recording)
    _point_rank_at(store.port, ns, 1, relay.port)
    sent = [np.arange(64, dtype=np.float32) + mb for mb in range(3)]
    for mb, a in enumerate(sent):
        c0.send(1, a, kind="act", mb=mb)
    for mb in range(bad_mb):   # frames before the tampering arrive intact
        assert np.array_equal(c1.recv(0, kind="act", mb=mb), sent[mb])
    with pytest.raises(CommError, match="frame from rank 0 failed its integrity check") as e:
        c1.recv(0, kind="act", mb=bad_mb)
    assert "altered in transit" in str(e.value)
    for mb in range(bad_mb, 3):    # nothing after it is delivered, altered or not
        with pytest.raises(CommError, match="integrity check"):
            c1.recv(0, kind="act", mb=mb, timeout=0.2)


# -- pre-authentication bounds ---------------------------------------------------------------------

def _auth(**fields) -> bytes:
    body = {"op": "auth", "rank": 1, "nonce": bytes(32), "transport": "tcp", "setup": b"",
            "mac": bytes(32)}
    body.update(fields)
    return encode_message(body, CONTROL)


HOSTILE = {
    "setup huge int": _auth(setup=(1 << 63) - 1),
    "setup 3000 bytes": _auth(setup=bytes(3000)),
    "nonce huge int": _auth(nonce=(1 << 64) - 1),
    "nonce 33 bytes": _auth(nonce=bytes(33)),
    "mac as list": _auth(mac=[1] * 500),
    "rank out of range": _auth(rank=1 << 40),
    "rank a bool": _auth(rank=True),
    "transport unknown": _auth(transport="x" * 1000),
    "prefix length 2 GiB": PREFIX.pack(b"h2", 2, CONTROL, 1 << 31),
    "prefix length 5 KiB": PREFIX.pack(b"h2", 2, CONTROL, 5000) + bytes(5000),
    "tensor frame": PREFIX.pack(b"h2", 2, FRAME, 2) + b"\x80\x00",
    "not msgpack": PREFIX.pack(b"h2", 2, CONTROL, 4) + b"\xc1\xc1\xc1\xc1",
}


def test_oversized_pre_auth_fields_are_rejected_quickly(comms):
    (c0, c1), _ = comms(2)
    errors = []
    old_hook = threading.excepthook
    threading.excepthook = lambda args: errors.append(args.exc_type)
    try:
        port = c0._listeners[0].getsockname()[1]
        for name, attack in HOSTILE.items():
            t = time.perf_counter()
            with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
                _recv_message(s)                    # hello
                try:
                    s.sendall(attack)
                    s.shutdown(socket.SHUT_WR)
                except OSError:                     # the worker already rejected and closed
                    pass
                reply = b""
                try:
                    while chunk := s.recv(4096):    # a reject message, then the close
                        reply += chunk
                except ConnectionResetError:        # closed with our unread bytes in its buffer
                    pass
            assert time.perf_counter() - t < 1.0, name
            assert not reply or msgpack.unpackb(reply[PREFIX_BYTES:])["op"] == "reject", name
        deadline = time.monotonic() + 2
        while len(c0.rejected) < len(HOSTILE) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(c0.rejected) == len(HOSTILE), c0.rejected
        assert not any("MemoryError" in r for r in c0.rejected), c0.rejected
        # the listener still serves a legitimate peer
        c1.send(0, np.arange(5, dtype=np.int64), kind="act")
        assert np.array_equal(c0.recv(1, kind="act"), np.arange(5))
    finally:
        threading.excepthook = old_hook
    assert not errors, errors


# -- fuzzing: only CommError comes out, quickly ---------------------------------------------------

class _BytesStream:
    """A byte stream over fixed input; what is sent is kept."""

    def __init__(self, data: bytes, peer=None):
        self.data, self.off, self.peer, self.sent = memoryview(data), 0, peer, []

    def recv_into(self, buf) -> None:
        mv = memoryview(buf).cast("B")
        got = min(mv.nbytes, len(self.data) - self.off)
        mv[:got] = self.data[self.off:self.off + got]
        self.off += got
        if got < mv.nbytes:
            raise PeerClosed("closed", self.peer, got)

    def recv_exact(self, n: int) -> bytearray:
        buf = bytearray(n)
        self.recv_into(buf)
        return buf

    def send_parts(self, parts, fds=()) -> None:
        self.sent.append(b"".join(bytes(p) for p in parts))

    def close(self) -> None:
        pass


_values = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 63), (1 << 64) - 1),
                    st.binary(max_size=80), st.text(max_size=20),
                    st.lists(st.integers(0, 10), max_size=5),
                    st.sampled_from(["tcp", "shm", "rdma", "auth", "hello", "accept", "reject"]))
_fields = ["op", "rank", "nonce", "transport", "setup", "mac", "reason"]
_maps = st.dictionaries(st.sampled_from(_fields) | st.text(max_size=5), _values, max_size=8)
_handshake_bytes = st.one_of(
    _maps.map(lambda m: encode_message(m, CONTROL)),
    st.binary(max_size=200),
    st.tuples(st.integers(0, (1 << 32) - 1), st.binary(max_size=64)).map(
        lambda t: PREFIX.pack(b"h2", 2, CONTROL, t[0]) + t[1]))
FUZZ = settings(max_examples=150, deadline=500, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(_handshake_bytes)
def test_fuzz_handshake_accept(data):
    t = time.perf_counter()
    with pytest.raises(CommError):
        handshake.accept(_BytesStream(data), 0, KEY, lambda *a: b"", world_size=4)
    assert time.perf_counter() - t < 0.2


@FUZZ
@given(_handshake_bytes, _handshake_bytes)
def test_fuzz_handshake_connect(hello, reply):
    with pytest.raises(CommError):
        handshake.connect(_BytesStream(hello + reply, 1), 0, 1, KEY, "tcp")


_frame_maps = st.fixed_dictionaries(
    {}, optional={k: _values | st.lists(st.integers(-2, 1 << 40), max_size=4) for k in
                  ["kind", "stage", "mb", "dtype", "shape", "nbytes", "seq", "digest", "src",
                   "at", "op", "seg", "size"]})


@FUZZ
@given(st.one_of(st.binary(max_size=300),
                 _frame_maps.map(lambda m: encode_message(m, FRAME)),
                 st.tuples(_frame_maps, st.binary(max_size=64)).map(
                     lambda t: encode_message(t[0], FRAME) + t[1])))
def test_fuzz_decode_frame(data):
    with pytest.raises(CommError):
        dicomm.decode_frame(data)


@FUZZ
@given(st.lists(st.tuples(st.sampled_from([FRAME, CONTROL]), _frame_maps,
                          st.binary(max_size=64), st.booleans()), min_size=1, max_size=4))
def test_fuzz_link_receiver(messages):
    """A peer that holds the link's key (so its tags pass) and sends arbitrary maps and payloads,
    or a stranger whose tags are wrong: the reader ends with a CommError, nothing else."""
    keys = handshake.LinkKeys(b"k" * 32, b"r" * 32)
    sealer, stream = Sealer(keys.forward), b""
    for msg_type, m, payload, good_tag in messages:
        head = encode_message(m, msg_type)
        tag = sealer.tag(head)
        stream += head + (tag if good_tag else bytes(TAG_BYTES)) + payload
    got = []
    receiver = StreamReceiver(_BytesStream(stream, 1), 1, 0, got.append, lambda *a: None, keys)
    with pytest.raises(CommError):
        while True:
            got.append(receiver._read_one())


# -- a default run listens on loopback only --------------------------------------------------------

PLAN = """model    "examples/llama_tiny.py"
cluster  "local"
batch    global=4 micro=2 seq=32
schedule 1f1b
dp       1
stage chip=cpu-torch chips=1 tp=1 layers=embed, 0
stage chip=cpu-torch chips=1 tp=1 layers=1, head
"""


def _descendants(pid: int) -> set[int]:
    parents = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                parents[int(p.name)] = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    family, grew = {pid}, True
    while grew:
        new = {c for c, parent in parents.items() if parent in family} - family
        family |= new
        grew = bool(new)
    return family


def _listeners(pids: set[int]) -> set[tuple[str, int]]:
    """(local address, pid) of the TCP listeners `ss -ltnp` shows for these processes."""
    import re
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout
    found = set()
    for line in out.splitlines():
        for pid in map(int, re.findall(r"pid=(\d+)", line)):
            if pid in pids:
                found.add((line.split()[3], pid))
    return found


def test_default_run_listens_on_loopback_only(tmp_path):
    bindir = Path(sys.executable).parent
    (tmp_path / "p.h2plan").write_text(PLAN)
    r = subprocess.run([str(bindir / "h2c"), "compile", "examples/llama_tiny.py", "--global-batch",
                        "4", "--micro-batch", "2", "--seq-len", "32", "--arg", "n_layers=2",
                        "--arg", "max_seq=64", "--plan", str(tmp_path / "p.h2plan"), "-o",
                        str(tmp_path / "b")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    run = subprocess.Popen([str(bindir / "h2x"), "run", str(tmp_path / "b"), "--steps", "3"],
                           cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: set = set()
    while run.poll() is None:
        seen |= _listeners(_descendants(run.pid))
        time.sleep(0.05)
    out, err = run.communicate()
    assert run.returncode == 0, err + out
    addresses = {a for a, _ in seen}
    assert len({p for _, p in seen}) >= 3, seen   # the launcher's store and both workers
    assert all(a.startswith(("127.0.0.1:", "[::1]:")) for a in addresses), seen
    assert "links: 2 shm" in out, out              # what really carried the run
