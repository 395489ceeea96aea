"""Peak memory of a worker as the high-water mark of its live tensors.

What is counted: every distinct storage (views share their base's) that the worker holds —
parameters, buffers, gradients, AdamW moments, the activations saved for backward, boundary
tensors received or waiting to be sent — plus, while a stage program runs, every tensor its
kernels return, from creation to the program's last use (`compile_program` drops each value
there). Not counted: scratch memory inside one kernel (a matmul's packing buffers), DiComm's
frames and the host copies of send/receive, the Python interpreter and the libraries' own
memory — which is why the figure is below the process's resident set. Host arrays a worker
builds outside programs (ZeRO-1's flat gradient and parameter buffers) are sampled when made.

On a CUDA device the backend's own allocator already keeps this count:
`torch.cuda.max_memory_allocated` (`TorchBackend.device_peak`).
"""
from __future__ import annotations


def host_storage(a) -> tuple | None:
    """(key, bytes) of a NumPy array's base buffer (the DiComm and ZeRO host buffers a torch
    worker holds beside its tensors); None for anything else."""
    import numpy as np
    if not isinstance(a, np.ndarray):
        return None
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a.__array_interface__["data"][0], a.nbytes


class LiveTensorMeter:
    """Counts live bytes by storage. `begin(held)` starts a program over the tensors the worker
    holds (counted as live throughout); `add`/`drop` follow the program's own values; `sample`
    counts a moment outside programs."""

    def __init__(self, storage):
        self.storage = storage          # tensor -> (key, nbytes) | None (backend.storage)
        self.peak = 0
        self._base: dict = {}
        self._base_bytes = 0
        self._refs: dict = {}
        self._live = 0
        self._label = ""
        self.at = ("", 0, 0)            # where the peak was: (label, held bytes, program bytes)

    def reset_peak(self) -> int:
        """The peak since the last reset, and start a new one."""
        p, self.peak = self.peak, 0
        return p

    def _raise(self, total: int, held: int) -> None:
        if total > self.peak:
            self.peak = total
            self.at = (self._label, held, total - held)

    def _distinct(self, tensors) -> tuple[dict, int]:
        seen: dict = {}
        total = 0
        for t in tensors:
            s = self.storage(t) or host_storage(t)
            if s is not None and s[0] not in seen:
                seen[s[0]] = s[1]
                total += s[1]
        return seen, total

    def sample(self, tensors) -> int:
        """Live bytes of `tensors` (distinct storages) now; raises the peak."""
        _, total = self._distinct(tensors)
        self._label = "outside programs"
        self._raise(total, total)
        return total

    def begin(self, held, label: str = "") -> None:
        self._base, self._base_bytes = self._distinct(held)
        self._refs, self._live, self._label = {}, 0, label
        self._raise(self._base_bytes, self._base_bytes)

    def add(self, *tensors) -> None:
        for t in tensors:
            s = self.storage(t)
            if s is None or s[0] in self._base:
                continue
            r = self._refs.get(s[0])
            if r is None:
                self._refs[s[0]] = [s[1], 1]
                self._live += s[1]
                if self._base_bytes + self._live > self.peak:
                    self._raise(self._base_bytes + self._live, self._base_bytes)
            else:
                r[1] += 1

    def drop(self, *tensors) -> None:
        for t in tensors:
            s = self.storage(t)
            if s is None:
                continue
            r = self._refs.get(s[0])
            if r is None:
                continue
            r[1] -= 1
            if r[1] == 0:
                del self._refs[s[0]]
                self._live -= r[0]
