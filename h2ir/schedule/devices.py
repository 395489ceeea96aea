"""A device per worker: which accelerator of its host each worker runs on.

A cluster's node groups say how many chips of a type a host has, and h2c gives each worker the
next free chip of its stage's type in worker-id order (`worker_hosts` in streams.py). So the
workers of one chip type on one host take that host's devices 0, 1, 2, ... in id order: a
worker's device index is its rank among its host's workers of its chip type
(`device_indices`). A torch stage on CUDA runs on `cuda:<index>`, a torch stage on the CPU on
`cpu`; a NumPy stage has no torch device. The manifest records each worker's `device` and
`device_index`; a run may override them (`run_devices`):

    run.device       a device type for every torch worker: `cuda` numbers each machine's
                     torch workers 0, 1, ...; an indexed one (`cuda:0`) puts them all on it
    run.device_map   per worker: "w0=cuda:1,w1=cuda:0"; "w0+w1=cuda:0" shares a device on purpose

Two workers never share an indexed device of one machine unless a map entry (or an indexed
run.device) says so: anything else is refused before a worker starts. A single-host `h2x run`
starts every worker on this machine, so a build of several hosts' GPUs needs `--device cuda`
or a map there.
"""
from __future__ import annotations

import re

from h2ir.errors import H2Error

DEVICE_TYPES = ("cpu", "cuda")      # torch device types h2's backends run on (ROCm's is cuda)
_DEVICE = re.compile(r"cpu|cuda:\d+")
_ENTRY = re.compile(r"\s*(w\d+(?:\s*\+\s*w\d+)*)\s*=\s*([A-Za-z_]+(?::\d+)?)\s*")


def device_indices(hosts: list[int], chips: list[str]) -> list[int]:
    """Each worker's device index on its host: how many workers of its chip type on its host
    come before it (hosts and chips per worker, in id order)."""
    seen: dict[tuple[int, str], int] = {}
    out = []
    for h, c in zip(hosts, chips):
        out.append(seen.get((h, c), 0))
        seen[(h, c)] = out[-1] + 1
    return out


def device_name(kind: str | None, index: int) -> str | None:
    """The torch device of a worker whose stage runs on `kind` ('cuda', 'cpu', None: no torch)."""
    if kind in (None, "cpu"):
        return kind
    return f"{kind}:{index}"


def assign_devices(workers: list[dict], kinds: list[str | None], cluster) -> list[dict]:
    """{"device", "device_index"} per worker of a manifest (`workers[w]`: its "host", "chip" and
    "stage"; `kinds[s]`: stage s's device type). A chip type with more workers than the
    cluster has chips of it would put two on one device: refused."""
    chips = [w["chip"] for w in workers]
    for chip in sorted(set(chips)):
        have, want = cluster.count(chip), chips.count(chip)
        if want > have:
            raise H2Error(f"the plan runs {want} workers on {chip} chips but cluster "
                          f"'{cluster.name}' has {have}: two workers would share a device",
                          cluster.source, hint="give the plan fewer chips of this type, or the "
                          "cluster more; to share devices on purpose, run with "
                          "--device-map (e.g. \"w0+w1=cuda:0\")")
    idx = device_indices([w.get("host", 0) for w in workers], chips)
    return [{"device": device_name(kinds[w["stage"]], i), "device_index": i}
            for w, i in zip(workers, idx)]


def parse_device_map(text: str | None, num_workers: int) -> tuple[dict[int, str], list[set[int]]]:
    """(worker -> device, the groups of workers a map entry shares one device among) of a
    `run.device_map` text such as "w0=cuda:1, w1+w2=cuda:0"."""
    devices: dict[int, str] = {}
    shared: list[set[int]] = []
    if not text or not text.strip():
        return devices, shared
    for part in text.split(","):
        m = _ENTRY.fullmatch(part)
        if not m:
            raise H2Error(f"--device-map: '{part.strip()}' is not an entry like w0=cuda:1 or "
                          "w0+w1=cuda:0 (a device shared on purpose)")
        if not _DEVICE.fullmatch(m[2]):
            raise H2Error(f"--device-map: '{m[2]}' is not a device: expected cpu or cuda:<index>")
        ws = [int(w.strip()[1:]) for w in m[1].split("+")]
        for w in ws:
            if w >= num_workers:
                raise H2Error(f"--device-map: w{w} is not a worker of this build (it has "
                              f"w0..w{num_workers - 1})")
            if w in devices:
                raise H2Error(f"--device-map: w{w} is given twice ({devices[w]} and {m[2]})")
            devices[w] = m[2]
        if len(ws) > 1:
            shared.append(set(ws))
    return devices, shared


def run_devices(workers: list[dict], device: str | None = None, device_map: str | None = None,
                hosts: list[int] | None = None) -> list[str | None]:
    """Each worker's torch device for a run: the manifest's, then `device` (run.device) for
    every torch worker, then `device_map` (see the module docstring). None: the stage's own
    (a manifest written before devices were recorded, or a worker without torch). `hosts`: the
    machine each worker runs on in this run (None: all on this one); a device type in
    `device` numbers each machine's torch workers from 0."""
    hosts = hosts or [0] * len(workers)
    if device and not (device in DEVICE_TYPES or _DEVICE.fullmatch(device)):
        raise H2Error(f"--device: '{device}' is not a device: expected one of "
                      f"{', '.join(DEVICE_TYPES)}, or one with an index such as cuda:0")
    mapped, shared = parse_device_map(device_map, len(workers))
    out: list[str | None] = []
    same: set[int] = set()          # workers an indexed run.device puts on one device
    on_host: dict[int, int] = {}
    for i, w in enumerate(workers):
        dev = w.get("device")
        if dev is not None and not _DEVICE.fullmatch(str(dev)):
            raise H2Error(f"manifest.json: workers[{i}].device is {str(dev)[:40]!r}, not a torch "
                          "device such as cpu or cuda:0", hint="recompile the build with "
                          "`h2c compile`")
        if device and w.get("backend") == "torch":
            if ":" in device or device == "cpu":
                dev = device
                same.add(i)
            else:
                dev = device_name(device, on_host.get(hosts[i], 0))
            on_host[hosts[i]] = on_host.get(hosts[i], 0) + 1
        if i in mapped:
            if w.get("backend") != "torch" and mapped[i] != "cpu":
                raise H2Error(f"--device-map: w{i} runs the {w.get('backend')} backend, which "
                              f"has no {mapped[i]} device")
            dev = mapped[i]
            same.discard(i)
        out.append(dev)
    check_exclusive(out, shared + [same], hosts)
    return out


def check_exclusive(devices: list[str | None], stated: list[set[int]], hosts: list[int]) -> None:
    """Refuse two workers on one indexed device of one machine unless one group of `stated`
    holds them both."""
    users: dict[tuple[int, str], list[int]] = {}
    for w, dev in enumerate(devices):
        if dev and ":" in dev:
            users.setdefault((hosts[w], dev), []).append(w)
    for (_, dev), ws in sorted(users.items()):
        if len(ws) > 1 and not any(set(ws) <= s for s in stated):
            names = " and ".join(f"w{w}" for w in ws)
            raise H2Error(f"{names} would share {dev}; two workers share a device only when "
                          "the run says so", hint=f"--device-map \"{'+'.join(f'w{w}' for w in ws)}"
                          f"={dev}\" shares it on purpose; else give each its own device "
                          "(--device with a type, e.g. cuda, numbers them per machine)")
