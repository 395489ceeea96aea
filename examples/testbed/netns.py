"""Emulated hosts on one machine: one Linux network namespace per host, a bridge between them.

    with Testbed(2, rate_mbit=100) as tb:               # or Testbed.from_cluster("testbed-2host")
        server = tb.run(1, [sys.executable, "server.py", tb.addr(1)], stdout=subprocess.PIPE)
        tb.exec(0, [sys.executable, "client.py", tb.addr(1)], timeout=30)
        tb.cut_link(1)                                  # host 1's cable pulled: peers time out
        tb.kill_host(1)                                 # SIGKILL every process in host 1

What one test bed with prefix P creates (nothing in the root namespace, whose addresses and
routes stay untouched):

    netns P-sw      the switch: bridge br0 with ports p0..p{N-1}, no IP address
    netns P-h{i}    host i: lo up, eth0 = the other end of p{i}, address subnet.{i+1}/24,
                    no default route (the only reachable addresses are the other hosts')
    tc tbf          on host i's eth0 (its egress) and on p{i} (its ingress) when host i has a
                    rate: a full-duplex NIC of that rate; traffic i -> j gets min(rate i, rate j)

tbf limits the rate and queues (and drops at the queue limit); it adds no delay or loss of its
own. netem, which would, is not available on the kernels this runs on.

Teardown (SIGKILL every process in the namespaces, delete them: the veths and the bridge go
with them) runs on every exit path of `with`, at interpreter exit (atexit), on SIGTERM/SIGHUP,
and from a watchdog process when the owner dies without running any of those (SIGKILL):
the watchdog holds the read end of a pipe whose write end only the owner holds. A state file
per test bed (/run/h2-testbed/P.json: owner pid, its start time, the subnet) lets
`cleanup_stale()` remove what a crashed run left without touching live test beds of other
processes.

This file imports only the standard library at module level (h2ir only inside from_cluster),
so it also runs as a script by path: the watchdog is started that way.
"""
from __future__ import annotations

import argparse
import atexit
import ipaddress
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

NS_PREFIX = "h2tb-"             # every namespace a test bed creates starts with this
MAX_HOSTS = 64
STATE_DIR = Path(os.environ.get("H2TB_STATE_DIR", "/run/h2-testbed"))
NETNS_ETC = Path("/etc/netns")  # per-namespace /etc overlay that `ip netns exec` applies
SUBNET_POOL = ipaddress.ip_network("10.213.0.0/16")   # /24s are picked from here by default
DEFAULT_LATENCY_S = 0.05        # tbf queue: at most this much traffic waits before tail drop

_PREFIX_RE = re.compile(r"^h2tb-[a-z0-9][a-z0-9-]{0,30}$")
_NS_RE = re.compile(r"^(h2tb-[a-z0-9][a-z0-9-]*?)-(sw|h\d+)$")


class TestbedError(RuntimeError):
    """The test bed cannot be created or used as asked (the message says why)."""

    __test__ = False            # not a pytest test class despite its name


@dataclass(frozen=True)
class HostSpec:
    """One emulated host: a label, its NIC rate (None: unlimited), and what runs on it."""
    name: str = ""
    rate_mbit: float | None = None
    chip: str | None = None     # chip type from the cluster file, if it came from one
    chips: int = 1              # chips (= worker processes) the host stands for


# ----------------------------------------------------------------------------------------------
# can this machine do it?

def available() -> tuple[bool, str]:
    """(True, "") when this process may create network namespaces, veths and tbf qdiscs, else
    (False, why). Probes by creating and deleting a namespace with a veth and a tbf qdisc."""
    if not sys.platform.startswith("linux"):
        return False, f"network namespaces need Linux (this is {sys.platform})"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"'{tool}' (iproute2) is not installed"
    if os.geteuid() != 0 and not _has_caps(("CAP_NET_ADMIN", "CAP_SYS_ADMIN")):
        return False, "needs root (or CAP_NET_ADMIN and CAP_SYS_ADMIN) to create network namespaces"
    probe = f"{NS_PREFIX}probe{os.getpid()}-{secrets.token_hex(2)}"
    try:
        _ip("netns", "add", probe)
    except TestbedError as e:
        return False, f"'ip netns add' failed: {e}"
    try:
        _ip("-n", probe, "link", "add", "name", "a", "type", "veth", "peer", "name", "b")
        _tc("-n", probe, "qdisc", "add", "dev", "a", "root", "tbf", "rate", "100mbit",
            "burst", "64kb", "latency", "50ms")
    except TestbedError as e:
        return False, f"veth/tbf unavailable inside a namespace: {e}"
    finally:
        _ip("netns", "del", probe, check=False)
    return True, ""


def _has_caps(names) -> bool:
    bits = {"CAP_NET_ADMIN": 12, "CAP_SYS_ADMIN": 21}
    try:
        eff = next(int(line.split()[1], 16) for line in Path("/proc/self/status").read_text().split("\n")
                   if line.startswith("CapEff:"))
    except (OSError, StopIteration, ValueError):
        return False
    return all(eff >> bits[n] & 1 for n in names)


# ----------------------------------------------------------------------------------------------
# the test bed

class Testbed:
    """N emulated hosts; a context manager (`with Testbed(...) as tb:`), or `up()`/`down()`.

    hosts: a count, or one HostSpec per host (1..64). rate_mbit: every host's NIC rate in
    Mbit/s, overriding the HostSpecs' (None: keep theirs; a host without one is unlimited).
    prefix: names every namespace (`<prefix>-h0`, `<prefix>-sw`); must be unique among live
    test beds; "h2tb-" is prepended when missing; default h2tb-<6 random hex digits>.
    subnet: an IPv4 private /24; default: the first free one of 10.213.0.0/16 that overlaps
    nothing on this machine's root namespace nor another live test bed.
    """

    __test__ = False

    def __init__(self, hosts: int | list[HostSpec], rate_mbit: float | None = None,
                 prefix: str | None = None, subnet: str | None = None,
                 latency_s: float = DEFAULT_LATENCY_S, burst_bytes: int | None = None,
                 watchdog: bool = True):
        if isinstance(hosts, bool) or not isinstance(hosts, (int, list, tuple)):
            raise TestbedError(f"hosts: expected a count or a list of HostSpec, got {hosts!r}")
        specs = [HostSpec(name=f"h{i}") for i in range(hosts)] if isinstance(hosts, int) else list(hosts)
        if not 1 <= len(specs) <= MAX_HOSTS:
            raise TestbedError(f"a test bed has 1..{MAX_HOSTS} hosts, asked for {len(specs)}")
        if rate_mbit is not None:
            if not rate_mbit > 0:
                raise TestbedError(f"rate_mbit: expected a positive rate in Mbit/s, got {rate_mbit!r}")
            specs = [HostSpec(s.name, float(rate_mbit), s.chip, s.chips) for s in specs]
        for i, s in enumerate(specs):
            if s.rate_mbit is not None and not s.rate_mbit > 0:
                raise TestbedError(f"host {i} ({s.name}): rate_mbit must be positive, got {s.rate_mbit!r}")
        self.hosts: list[HostSpec] = specs
        prefix = prefix or f"{NS_PREFIX}{secrets.token_hex(3)}"
        if not prefix.startswith(NS_PREFIX):
            prefix = NS_PREFIX + prefix
        if not _PREFIX_RE.match(prefix) or prefix.endswith("-"):
            raise TestbedError(f"prefix '{prefix}': expected {NS_PREFIX} then 1-31 of [a-z0-9-]")
        self.prefix = prefix
        self._subnet_arg = subnet
        self.subnet: ipaddress.IPv4Network | None = None
        self.latency_s = latency_s
        self.burst_bytes = burst_bytes
        self.use_watchdog = watchdog
        self._procs: list[tuple[int, subprocess.Popen]] = []
        self._watchdog: subprocess.Popen | None = None
        self._up = False
        self._owner = os.getpid()
        self.cluster = None             # the h2ir Cluster, when made by from_cluster

    @classmethod
    def from_cluster(cls, path, hosts: int | None = None, rate_mbit: float | None = None,
                     **kwargs) -> "Testbed":
        """One emulated host per node of a cluster file (a path or a built-in name), its rate
        the node's NICs together: nics_per_node * nic_gbps. hosts=N keeps N nodes, taken round
        robin over the node groups so a mixed cluster stays mixed; rate_mbit overrides every
        rate (tests use 1000 and 100)."""
        from h2ir.clusters.clusterfile import load_cluster
        cluster = load_cluster(path)
        per_group = [[HostSpec(name=f"{g.chip}[{k}]", rate_mbit=g.nic_bw * g.nics_per_node * 8 / 1e6,
                               chip=g.chip, chips=g.chips_per_node) for k in range(g.nodes)]
                     for g in cluster.groups]
        total = sum(len(p) for p in per_group)
        if hosts is None:
            if total > MAX_HOSTS:
                raise TestbedError(f"{cluster.name} has {total} nodes, more than the {MAX_HOSTS} a "
                                   f"test bed emulates; pass hosts=N to emulate N of them")
            chosen = [s for p in per_group for s in p]
        else:
            if not 1 <= hosts <= min(total, MAX_HOSTS):
                raise TestbedError(f"hosts={hosts}: {cluster.name} has {total} nodes and a test bed "
                                   f"at most {MAX_HOSTS} hosts")
            taken = [0] * len(per_group)
            while sum(taken) < hosts:
                for gi, p in enumerate(per_group):
                    if taken[gi] < len(p) and sum(taken) < hosts:
                        taken[gi] += 1
            chosen = [s for gi, p in enumerate(per_group) for s in p[:taken[gi]]]
        tb = cls(chosen, rate_mbit=rate_mbit, **kwargs)
        tb.cluster = cluster
        return tb

    # -- names and addresses -------------------------------------------------------------------

    @property
    def n(self) -> int:
        return len(self.hosts)

    @property
    def switch_ns(self) -> str:
        return f"{self.prefix}-sw"

    def host_ns(self, i: int) -> str:
        self._check_host(i)
        return f"{self.prefix}-h{i}"

    def namespaces(self) -> list[str]:
        return [self.host_ns(i) for i in range(self.n)] + [self.switch_ns]

    def addr(self, i: int) -> str:
        """Host i's IPv4 address (subnet .i+1); known once the test bed is up."""
        self._check_host(i)
        if self.subnet is None:
            raise TestbedError("the test bed is not up: addresses are chosen by up()")
        return str(self.subnet.network_address + i + 1)

    def hostname(self, i: int) -> str:
        """Host i's hostname: resolvable on every host (/etc/netns/<ns>/hosts), and what
        gethostname() returns for processes started by run()/exec() (each gets its own UTS
        namespace; without util-linux `unshare` they keep this machine's hostname)."""
        return self.host_ns(i)

    def host_env(self, i: int) -> dict:
        """What run()/exec() add to a process's environment so it learns where it is."""
        return {"H2TB_HOST": str(i), "H2TB_ADDR": self.addr(i), "H2TB_HOSTS": str(self.n),
                "H2TB_HOSTNAME": self.hostname(i),
                "H2TB_ADDRS": ",".join(self.addr(j) for j in range(self.n)),
                "H2TB_PREFIX": self.prefix}

    # -- lifecycle ----------------------------------------------------------------------------

    def __enter__(self) -> "Testbed":
        self.up()
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    def up(self) -> "Testbed":
        if self._up:
            return self
        ok, why = available()
        if not ok:
            raise TestbedError(f"cannot create a test bed: {why}")
        existing = set(list_namespaces())
        if any(ns in existing for ns in self.namespaces()):
            cleanup_stale(self.prefix)       # a crashed run's leftovers under this prefix
            if any(ns in set(list_namespaces()) for ns in self.namespaces()):
                raise TestbedError(f"prefix '{self.prefix}' is in use by a live test bed")
        self.subnet = _pick_subnet(self._subnet_arg, self.prefix)
        _write_state(self.prefix, {"owner": os.getpid(), "start": _start_time(os.getpid()),
                                   "subnet": str(self.subnet), "hosts": self.n})
        _LIVE[self.prefix] = self
        self._owner = os.getpid()
        _install_exit_handlers()
        self._up = True
        try:
            if self.use_watchdog:
                self._start_watchdog()
            self._create()
        except BaseException:
            self.down()
            raise
        return self

    def _create(self) -> None:
        sw = self.switch_ns
        # namespaces and veths in one `ip` process; each veth is born with its ends already in
        # the host and switch namespaces, so no interface ever appears in the root namespace
        root = [f"netns add {ns}" for ns in self.namespaces()]
        root += [f"link add name eth0 netns {self.host_ns(i)} type veth peer name p{i} netns {sw}"
                 for i in range(self.n)]
        _ip_batch(None, root)
        _ip_batch(sw, ["link set lo up", "link add br0 type bridge stp_state 0 forward_delay 0"]
                  + [c for i in range(self.n) for c in (f"link set p{i} master br0", f"link set p{i} up")]
                  + ["link set br0 up"])
        plen = self.subnet.prefixlen
        hosts = "127.0.0.1 localhost\n" + "".join(f"{self.addr(i)} {self.hostname(i)}\n"
                                                   for i in range(self.n))
        for i in range(self.n):
            # `ip netns exec` bind-mounts /etc/netns/<ns>/* over /etc/*: every host resolves
            # every host's name, its own to its test bed address
            for attempt in range(3):          # another test bed may rmdir an empty /etc/netns
                try:
                    (NETNS_ETC / self.host_ns(i)).mkdir(parents=True, exist_ok=True)
                    (NETNS_ETC / self.host_ns(i) / "hosts").write_text(hosts)
                    break
                except FileNotFoundError:
                    if attempt == 2:
                        raise
        for i in range(self.n):
            _ip_batch(self.host_ns(i), ["link set lo up", f"addr add {self.addr(i)}/{plen} dev eth0",
                                        "link set eth0 up"])
        for i, h in enumerate(self.hosts):
            if h.rate_mbit is not None:
                self._apply_rate(i, h.rate_mbit)
        self._wait_operstate([(self.host_ns(i), "eth0") for i in range(self.n)]
                             + [(sw, f"p{i}") for i in range(self.n)])

    @staticmethod
    def _wait_operstate(links, timeout: float = 5.0) -> None:
        # A link that was just set up drops every frame until the kernel's link watch marks it
        # UP (up to a second later), so wait for that instead of losing the first packets.
        deadline = time.monotonic() + timeout
        pending = {}
        for ns, dev in links:
            pending.setdefault(ns, set()).add(dev)
        while pending:
            for ns in list(pending):
                up = {e["ifname"].split("@")[0] for e in json.loads(_ip("-n", ns, "-j", "link", "show") or "[]")
                      if e.get("operstate") == "UP"}
                pending[ns] -= up
                if not pending[ns]:
                    del pending[ns]
            if pending and time.monotonic() > deadline:
                raise TestbedError(f"links not up after {timeout:g} s: {pending}")
            if pending:
                time.sleep(0.02)

    def set_rate(self, i: int, rate_mbit: float | None) -> None:
        """Change host i's NIC rate on a running test bed (None: unlimited)."""
        self._check_host(i)
        if rate_mbit is not None and not rate_mbit > 0:
            raise TestbedError(f"rate_mbit: expected a positive rate in Mbit/s, got {rate_mbit!r}")
        h = self.hosts[i]
        self.hosts[i] = HostSpec(h.name, None if rate_mbit is None else float(rate_mbit), h.chip, h.chips)
        if self._up:
            self._apply_rate(i, rate_mbit)

    def _apply_rate(self, i: int, rate_mbit: float | None) -> None:
        for ns, dev in ((self.host_ns(i), "eth0"), (self.switch_ns, f"p{i}")):
            if rate_mbit is None:
                _tc("-n", ns, "qdisc", "del", "dev", dev, "root", check=False)
            else:
                _tc("-n", ns, "qdisc", "replace", "dev", dev, "root", *self._tbf_args(rate_mbit))

    def tbf_burst(self, rate_mbit: float) -> int:
        """tbf's bucket at `rate_mbit`, bytes: what passes at once after the link has been idle
        long enough (1 ms at rate, at least one 64 KiB GSO packet: smaller would make tbf split
        every TSO packet)."""
        return self.burst_bytes or max(64 * 1024, int(rate_mbit * 1e6 / 8 * 1e-3))

    def _tbf_args(self, rate_mbit: float) -> list[str]:
        rate_bps = rate_mbit * 1e6 / 8
        # queue: latency_s at rate on top of the bucket, capped so tc's u32 limit holds
        burst = self.tbf_burst(rate_mbit)
        limit = min(int(rate_bps * self.latency_s) + burst, 1 << 30)
        return ["tbf", "rate", f"{rate_mbit:g}mbit", "burst", str(burst), "limit", str(limit)]

    def down(self) -> None:
        """Kill every process in the namespaces and delete them (idempotent)."""
        if not self._up:
            return
        try:
            _remove_namespaces(self.namespaces())
            for _, p in self._procs:
                _reap(p)
            self._procs.clear()
        finally:
            _remove_state(self.prefix)
            self._stop_watchdog()
            _LIVE.pop(self.prefix, None)
            self._up = False

    def _start_watchdog(self) -> None:
        # The owner writes "done" before it closes the pipe on a normal teardown; EOF without
        # it means the owner died, and the watchdog removes the namespaces itself.
        self._watchdog = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "_watchdog", self.prefix],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True, cwd="/")

    def _stop_watchdog(self) -> None:
        w, self._watchdog = self._watchdog, None
        if w is None:
            return
        try:
            w.stdin.write(b"done\n")
            w.stdin.close()
        except OSError:
            pass
        _reap(w, timeout=5)

    # -- running things on hosts -----------------------------------------------------------------

    def _check_host(self, i: int) -> None:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.n:
            raise TestbedError(f"host {i!r}: this test bed has hosts 0..{self.n - 1}")

    def _command(self, i: int, argv, env) -> tuple[list, dict]:
        if not self._up:
            raise TestbedError("the test bed is not up")
        if isinstance(argv, (str, bytes)):
            raise TestbedError("argv: expected a list of arguments, not a string")
        full_env = dict(os.environ if env is None else env)
        full_env.update(self.host_env(i))
        cmd = [_tool("ip"), "netns", "exec", self.host_ns(i)]
        if shutil.which("unshare"):
            # its own UTS namespace, so gethostname() tells emulated hosts apart (DiComm and
            # torch decide "same machine" by it); unshare and sh exec, keeping the Popen's pid
            cmd += ["unshare", "--uts", "--", "sh", "-c", 'hostname "$0" && exec "$@"', self.hostname(i)]
        return cmd + [*map(str, argv)], full_env

    def run(self, i: int, argv, env: dict | None = None, **popen_kwargs) -> subprocess.Popen:
        """Start argv on host i (`ip netns exec`, which execs argv: the Popen's pid is argv's).
        env as for Popen (default: this process's), plus host_env(i)."""
        cmd, full_env = self._command(i, argv, env)
        p = subprocess.Popen(cmd, env=full_env, **popen_kwargs)
        self._procs.append((i, p))
        return p

    def exec(self, i: int, argv, timeout: float = 60, env: dict | None = None,
             **run_kwargs) -> subprocess.CompletedProcess:
        """Run argv on host i to completion; stdout and stderr captured as text unless given."""
        cmd, full_env = self._command(i, argv, env)
        run_kwargs.setdefault("capture_output", "stdout" not in run_kwargs and "stderr" not in run_kwargs)
        run_kwargs.setdefault("text", True)
        return subprocess.run(cmd, env=full_env, timeout=timeout, **run_kwargs)

    def pids(self, i: int) -> list[int]:
        """Processes whose network namespace is host i's (`ip netns pids`)."""
        return _ns_pids(self.host_ns(i))

    def kill_host(self, i: int, timeout: float = 5.0) -> int:
        """SIGKILL every process in host i's namespace (its children too); returns how many."""
        killed = _kill_namespace(self.host_ns(i), timeout)
        for j, p in self._procs:
            if j == i:
                _reap(p)
        return killed

    def cut_link(self, i: int) -> None:
        """Pull host i's cable: its switch port goes down, so frames from and to it are dropped.
        Host i's eth0 loses carrier but keeps its address and route, so on both sides
        connections and connects time out rather than fail at once."""
        self._check_host(i)
        _ip("-n", self.switch_ns, "link", "set", f"p{i}", "down")

    def restore_link(self, i: int) -> None:
        self._check_host(i)
        _ip("-n", self.switch_ns, "link", "set", f"p{i}", "up")
        self._wait_operstate([(self.host_ns(i), "eth0"), (self.switch_ns, f"p{i}")])

    def describe(self) -> str:
        lines = [f"test bed {self.prefix}: {self.n} hosts on {self.subnet}, switch netns {self.switch_ns}"]
        for i, h in enumerate(self.hosts):
            rate = "unlimited" if h.rate_mbit is None else f"{h.rate_mbit:g} Mbit/s"
            what = f" {h.chips}x {h.chip}" if h.chip else ""
            lines.append(f"  h{i}  netns {self.host_ns(i)}  {self.addr(i) if self.subnet else '-'}"
                         f"  {rate}{what}  {h.name}")
        return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# leftovers, exit paths

_LIVE: dict[str, Testbed] = {}
_HANDLERS_INSTALLED = False


def list_namespaces() -> list[str]:
    out = _ip("netns", "list", check=False)
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def testbed_namespaces(prefix: str = NS_PREFIX) -> dict[str, list[str]]:
    """Test bed prefix -> its namespaces now present, for prefixes starting with `prefix`."""
    out: dict[str, list[str]] = {}
    for ns in list_namespaces():
        m = _NS_RE.match(ns)
        if m and m[1].startswith(prefix):
            out.setdefault(m[1], []).append(ns)
    return out


def owner_alive(prefix: str) -> bool:
    """Whether the process that created test bed `prefix` is still running."""
    state = _read_state(prefix)
    if not state:
        return False
    pid = state.get("owner")
    return isinstance(pid, int) and pid > 0 and _start_time(pid) == state.get("start")


def cleanup_stale(prefix: str = NS_PREFIX, force: bool = False) -> list[str]:
    """Remove test bed namespaces under `prefix` whose owner is gone (all of them with force);
    returns the namespaces removed. Live test beds of other processes are left alone."""
    removed = []
    for tb_prefix, names in sorted(testbed_namespaces(prefix).items()):
        if tb_prefix in _LIVE or (not force and owner_alive(tb_prefix)):
            continue
        _remove_namespaces(names)
        _remove_state(tb_prefix)
        removed += names
    # state files and /etc/netns entries whose namespaces are already gone
    live = testbed_namespaces(prefix)
    for f in (STATE_DIR.glob(f"{prefix}*.json") if STATE_DIR.is_dir() else ()):
        if f.stem not in live and f.stem not in _LIVE and (force or not owner_alive(f.stem)):
            _remove_state(f.stem)
    present = set(list_namespaces())
    for d in (NETNS_ETC.glob(f"{prefix}*") if NETNS_ETC.is_dir() else ()):
        m = _NS_RE.match(d.name)
        if m and d.name not in present and m[1] not in _LIVE and (force or not owner_alive(m[1])):
            _remove_namespaces([d.name])
    return removed


def _teardown_all() -> None:
    for tb in list(_LIVE.values()):
        if tb._owner != os.getpid():          # a forked child exiting: not its test bed
            continue
        try:
            tb.down()
        except Exception as e:                # keep tearing down the others
            print(f"h2 testbed: teardown of {tb.prefix} failed: {e}", file=sys.stderr)


def _install_exit_handlers() -> None:
    """atexit, and SIGTERM/SIGHUP (which skip atexit by default): tear down, then let the
    previous handler (or the default action) run."""
    global _HANDLERS_INSTALLED
    if _HANDLERS_INSTALLED:
        return
    _HANDLERS_INSTALLED = True
    atexit.register(_teardown_all)
    if threading.current_thread() is not threading.main_thread():
        return                                # signal handlers only from the main thread
    for sig in (signal.SIGTERM, signal.SIGHUP):
        previous = signal.getsignal(sig)
        if previous is signal.SIG_IGN:
            continue

        def handler(signum, frame, previous=previous):
            _teardown_all()
            if callable(previous):
                previous(signum, frame)
            else:
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)
        signal.signal(sig, handler)


def _watchdog_main(prefix: str) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    data = b""
    while True:
        chunk = sys.stdin.buffer.read1(64)
        if not chunk:
            break
        data += chunk
    if b"done" in data:
        return 0
    names = testbed_namespaces(prefix).get(prefix, [])
    _remove_namespaces(names)
    _remove_state(prefix)
    return 0


# ----------------------------------------------------------------------------------------------
# subnets and state files

def _pick_subnet(subnet: str | None, prefix: str) -> ipaddress.IPv4Network:
    taken = _root_networks()
    for f in (STATE_DIR.glob("*.json") if STATE_DIR.is_dir() else ()):
        if f.stem != prefix and owner_alive(f.stem):
            try:
                taken.append(ipaddress.ip_network(_read_state(f.stem)["subnet"]))
            except (KeyError, TypeError, ValueError):
                pass
    if subnet is not None:
        try:
            net = ipaddress.ip_network(subnet)
        except ValueError as e:
            raise TestbedError(f"subnet '{subnet}': {e}") from None
        if net.version != 4 or net.prefixlen != 24 or not net.is_private:
            raise TestbedError(f"subnet '{subnet}': expected a private IPv4 /24, e.g. 10.213.7.0/24")
        clash = [t for t in taken if net.overlaps(t)]
        if clash:
            raise TestbedError(f"subnet {net} overlaps {clash[0]}, already on this machine")
        return net
    subnets = list(SUBNET_POOL.subnets(new_prefix=24))
    start = int.from_bytes(prefix.encode(), "little") % len(subnets)   # spread parallel test beds
    for k in range(len(subnets)):
        net = subnets[(start + k) % len(subnets)]
        if not any(net.overlaps(t) for t in taken):
            return net
    raise TestbedError(f"no free /24 left in {SUBNET_POOL}")


def _root_networks() -> list:
    nets = []
    for cmd in (("-j", "addr", "show"), ("-j", "route", "show", "table", "all")):
        try:
            entries = json.loads(_ip(*cmd) or "[]")
        except (TestbedError, ValueError):
            continue
        for e in entries:
            items = [(a.get("local"), a.get("prefixlen")) for a in e.get("addr_info", [])] or \
                    [(e.get("dst"), None)]
            for addr, plen in items:
                if not addr or addr == "default":
                    continue
                try:
                    net = ipaddress.ip_network(f"{addr}/{plen}" if plen is not None else addr, strict=False)
                except ValueError:
                    continue
                if net.version == 4:
                    nets.append(net)
    return nets


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (tells a reused pid apart)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def _state_path(prefix: str) -> Path:
    return STATE_DIR / f"{prefix}.json"


def _write_state(prefix: str, state: dict) -> None:
    for attempt in range(3):                  # another test bed may rmdir an empty STATE_DIR
        try:
            STATE_DIR.mkdir(parents=True, exist_ok=True)
            _state_path(prefix).write_text(json.dumps(state))
            return
        except FileNotFoundError:
            continue
        except OSError as e:
            raise TestbedError(f"cannot write the test bed state file {_state_path(prefix)}: {e}") from None
    raise TestbedError(f"cannot write the test bed state file {_state_path(prefix)}")


def _read_state(prefix: str) -> dict | None:
    try:
        return json.loads(_state_path(prefix).read_text())
    except (OSError, ValueError):
        return None


def _remove_state(prefix: str) -> None:
    try:
        _state_path(prefix).unlink()
    except FileNotFoundError:
        pass
    try:
        STATE_DIR.rmdir()                     # only if empty
    except OSError:
        pass


# ----------------------------------------------------------------------------------------------
# ip / tc

def _tool(name: str) -> str:
    path = shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin:/usr/bin:/bin")
    if path is None:
        raise TestbedError(f"'{name}' (iproute2) is not installed")
    return path


def _ip(*args, check: bool = True, stdin: str | None = None) -> str:
    return _call(_tool("ip"), args, check, stdin)


def _tc(*args, check: bool = True) -> str:
    return _call(_tool("tc"), args, check, None)


def _call(exe: str, args, check: bool, stdin: str | None) -> str:
    r = subprocess.run([exe, *args], input=stdin, capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        what = " ".join(args) if stdin is None else " ".join(args) + ": " + stdin.strip().replace("\n", "; ")
        raise TestbedError(f"{Path(exe).name} {what}: {r.stderr.strip() or f'exit {r.returncode}'}")
    return r.stdout


def _ip_batch(ns: str | None, commands: list[str]) -> None:
    _ip(*(("-n", ns) if ns else ()), "-batch", "-", stdin="\n".join(commands) + "\n")


def _ns_pids(ns: str) -> list[int]:
    out = _ip("netns", "pids", ns, check=False)
    return [int(t) for t in out.split() if t.isdigit()]


def _kill_namespace(ns: str, timeout: float = 5.0) -> int:
    """SIGKILL until `ip netns pids` lists nobody (a process may fork while being killed)."""
    killed: set[int] = set()
    deadline = time.monotonic() + timeout
    while True:
        pids = [p for p in _ns_pids(ns) if p != os.getpid()]
        if not pids:
            return len(killed)
        if time.monotonic() > deadline:
            raise TestbedError(f"processes {pids} in {ns} survive SIGKILL")
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except ProcessLookupError:
                pass
        time.sleep(0.02)


def _remove_namespaces(names) -> None:
    for ns in names:
        shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)
    try:
        NETNS_ETC.rmdir()                     # only if empty: no other namespace uses it
    except OSError:
        pass
    present = set(list_namespaces())
    names = [ns for ns in names if ns in present]
    errors = []
    for ns in names:
        try:
            _kill_namespace(ns)
        except TestbedError as e:
            errors.append(str(e))
    if names:
        # -force: go on after a failed line; deleting a host namespace deletes its veth (and
        # so the switch's port), deleting the switch namespace deletes the bridge
        _ip("-force", "-batch", "-", check=False, stdin="".join(f"netns del {ns}\n" for ns in names))
    left = [ns for ns in names if ns in set(list_namespaces())]
    if left or errors:
        raise TestbedError(f"teardown left {left or 'no namespaces'}" + (f"; {'; '.join(errors)}" if errors else ""))


def _reap(p: subprocess.Popen, timeout: float = 1.0) -> None:
    try:
        p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


# ----------------------------------------------------------------------------------------------
# CLI

def _testbed_from_args(a) -> Testbed:
    kw = dict(prefix=a.prefix, subnet=a.subnet)
    if a.cluster:
        from h2ir.errors import H2Error
        try:
            return Testbed.from_cluster(a.cluster, hosts=a.hosts, rate_mbit=a.rate_mbit, **kw)
        except H2Error as e:                  # already says "file: error: ..."
            print(e, file=sys.stderr)
            raise SystemExit(2) from None
    return Testbed(a.hosts or 2, rate_mbit=a.rate_mbit, **kw)


def _cmd_up(a) -> int:
    with _testbed_from_args(a) as tb:
        print(tb.describe())
        print(f"run a command on host i:  ip netns exec {tb.prefix}-h<i> CMD   (Ctrl-C tears it all down)",
              flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
    return 0


def _cmd_run(a) -> int:
    argv = a.argv[1:] if a.argv[:1] == ["--"] else a.argv
    if not argv:
        raise TestbedError("run: give a command after --")
    with _testbed_from_args(a) as tb:
        print(tb.describe(), file=sys.stderr, flush=True)
        procs, pumps = [], []
        for i in range(tb.n):
            fill = {"host": i, "addr": tb.addr(i), "addr0": tb.addr(0), "hosts": tb.n}
            p = tb.run(i, [s.format(**fill) for s in argv], stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            t = threading.Thread(target=_pump, args=(p.stdout, f"[h{i}] "), daemon=True)
            t.start()
            procs.append(p)
            pumps.append(t)
        deadline = None if a.timeout is None else time.monotonic() + a.timeout
        rc = 0
        while any(p.poll() is None for p in procs):
            failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
            if failed or (deadline and time.monotonic() > deadline):
                # one host failed (or time is up): the others would wait for it forever
                rc = failed[0] if failed else 124
                time.sleep(a.grace if failed else 0)
                break
            time.sleep(0.05)
        for i in range(tb.n):
            tb.kill_host(i)
        for t in pumps:
            t.join(timeout=2)
        rcs = [p.returncode for p in procs]
        print(f"exit codes: {rcs}", file=sys.stderr)
        return rc or next((r for r in rcs if r), 0)


def _pump(stream, tag: str) -> None:
    for line in iter(stream.readline, b""):
        sys.stdout.write(tag + line.decode(errors="replace"))
        sys.stdout.flush()


def _cmd_down(a) -> int:
    if a.prefix:
        prefix = a.prefix if a.prefix.startswith(NS_PREFIX) else NS_PREFIX + a.prefix
        names = testbed_namespaces(prefix).get(prefix, [])
        _remove_namespaces(names)
        _remove_state(prefix)
    else:
        names = cleanup_stale(force=a.force)
    print("removed: " + (" ".join(names) if names else "nothing"))
    return 0


def _cmd_list(a) -> int:
    beds = testbed_namespaces()
    for prefix, names in sorted(beds.items()):
        state = _read_state(prefix) or {}
        owner = f"owner pid {state.get('owner')} {'alive' if owner_alive(prefix) else 'gone'}"
        print(f"{prefix}  {state.get('subnet', '?')}  {len(names)} namespaces  {owner}")
    if not beds:
        print("no test beds")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m examples.testbed.netns",
                                 description="Emulated hosts in network namespaces (docs/testbed.md).")
    sub = ap.add_subparsers(dest="cmd", required=True)

    def bed_args(p):
        p.add_argument("--hosts", type=int, help="number of hosts (default 2; with --cluster: "
                       "how many of its nodes, default all)")
        p.add_argument("--cluster", help="cluster file or built-in name: one host per node, NIC rates")
        p.add_argument("--rate-mbit", type=float, help="every host's NIC rate, Mbit/s (default: "
                       "the cluster's, else unlimited)")
        p.add_argument("--prefix", help="namespace prefix (default h2tb-<random>)")
        p.add_argument("--subnet", help="private IPv4 /24 (default: a free one of 10.213.0.0/16)")

    p = sub.add_parser("up", help="create a test bed and hold it until Ctrl-C or SIGTERM")
    bed_args(p)
    p = sub.add_parser("run", help="run one command per host ({host} {addr} {addr0} {hosts} are "
                       "filled in), wait, tear down; exit code of the first failure")
    bed_args(p)
    p.add_argument("--timeout", type=float, help="seconds before every host is killed (exit 124)")
    p.add_argument("--grace", type=float, default=5.0,
                   help="seconds the other hosts get after one fails (default 5)")
    p.add_argument("argv", nargs=argparse.REMAINDER)
    p = sub.add_parser("down", help="remove a test bed by --prefix, or every stale one")
    p.add_argument("--prefix")
    p.add_argument("--force", action="store_true", help="also test beds whose owner is alive")
    sub.add_parser("list", help="test beds present, and whether their owner is alive")
    sub.add_parser("check", help="whether this machine can create test beds")
    w = sub.add_parser("_watchdog")
    w.add_argument("prefix")

    a = ap.parse_args(argv)
    if a.cmd == "_watchdog":
        return _watchdog_main(a.prefix)
    if a.cmd == "check":
        ok, why = available()
        print("ok" if ok else f"unavailable: {why}")
        return 0 if ok else 1
    try:
        return {"up": _cmd_up, "run": _cmd_run, "down": _cmd_down, "list": _cmd_list}[a.cmd](a)
    except TestbedError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
