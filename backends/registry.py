"""The one backend registry: which op libraries exist, how to load them, how to calibrate them,
and which cluster software stacks they serve.

A chip's `backend` in a cluster file names its software stack; `STACKS` says which op library
and device run that stack here. Stacks without an op library in this repository (Ascend CANN,
Habana) can be planned and compiled (--dry-run) but not run.
"""
from __future__ import annotations

from dataclasses import dataclass
from importlib import import_module

from h2ir.errors import H2Error


@dataclass(frozen=True)
class BackendEntry:
    name: str
    runtime: str          # "module:Class" of the device runtime (its op table is `.ops`)
    calibrate: str        # module with `measure(sizes, mem_mib, min_time) -> dict`
    summary: str


REGISTRY = {
    "torch": BackendEntry("torch", "backends.torch.runtime:TorchBackend", "backends.torch.calibrate",
                          "PyTorch kernels, CPU and CUDA"),
    "numpy": BackendEntry("numpy", "backends.numpy.runtime:NumpyBackend", "backends.numpy.calibrate",
                          "an independent NumPy op library (no torch)"),
}
BACKENDS = tuple(REGISTRY)

STACKS = {"torch": ("torch", "cpu"), "numpy": ("numpy", None), "cuda": ("torch", "cuda"),
          "rocm": ("torch", "cuda")}


def entry(name: str) -> BackendEntry:
    try:
        return REGISTRY[name]
    except KeyError:
        raise H2Error(f"unknown backend {name!r} (expected one of: {', '.join(BACKENDS)})") from None


def get_backend(name: str, **options):
    """A runtime of the backend registered under `name` ('torch', 'numpy')."""
    mod, cls = entry(name).runtime.split(":")
    return getattr(import_module(mod), cls)(**options)


def resolve_stack(stack: str) -> tuple[str, str | None] | None:
    """(op library, device) for a chip's software stack, or None if no op library here."""
    return STACKS.get(stack)


def measured_backends(cluster) -> list[str]:
    """Op libraries of the cluster's `measured` chips (this machine's): what calibration covers."""
    return sorted({STACKS[c.backend][0] for c in cluster.chip_types.values()
                   if c.measured and c.backend in STACKS})
