"""The torch backend's runtime: host transfer, allocation, synchronisation and AdamW on a device.

`TorchBackend(device='cpu'|'cuda'|'cuda:1', dtype_policy='fp32'|'bf16')`. The dtype policy is
per chip (a plan may give each chip type its own):
- fp32: every op computes in the dtype of its inputs.
- bf16: mixed precision with f32 master weights. Parameters, their accumulated gradients and the
  AdamW state stay f32; the programs read bf16 copies of the parameters (`compute_params`, made
  once per optimizer step), so activations flow in bf16 from op to op. Matrix ops compute in
  bf16 (f32 operands are cast; an f32 first operand gets f32 back, as autocast), a binary op of
  a bf16 and an f32 tensor computes in bf16, log-softmax and the embedding gradient in f32.
  A stage's boundary values and parameter gradients leave in their declared dtypes (`as_dtype`).
"""
from __future__ import annotations

import numpy as np
import torch
from torch.optim.adamw import adamw as torch_adamw

from backends.torch.ops import DTYPE_POLICIES, H2_DTYPE, TORCH_DTYPE, kernel_table
from h2ir.types import host_dtype


class TorchBackend:
    name = "torch"
    dtypes = set(TORCH_DTYPE)

    def __init__(self, device: str = "cpu", dtype_policy: str = "fp32", attention: str = "auto",
                 scan: str = "auto"):
        if dtype_policy not in DTYPE_POLICIES:
            raise ValueError(f"unknown dtype policy {dtype_policy!r} (expected one of "
                             f"{', '.join(DTYPE_POLICIES)})")
        self.device = torch.device(device)
        self.dtype_policy = dtype_policy
        self.ops = kernel_table(self.device, dtype_policy, attention, scan)
        self._copies: dict = {}      # name -> (master, its version, its bf16 copy)

    def __repr__(self) -> str:
        return f"TorchBackend(device={str(self.device)!r}, dtype_policy={self.dtype_policy!r})"

    # ---- host transfer -------------------------------------------------------------------------
    def from_numpy(self, a: np.ndarray, dtype: str) -> torch.Tensor:
        """Host array -> tensor of h2ir `dtype`; on CPU it shares the array's memory when the array
        already has that dtype and is writeable (AdamW updates parameters in place)."""
        a = np.asarray(a)
        want = host_dtype(dtype)                  # bf16 crosses the host boundary as uint16 bits
        if dtype == "bf16" and a.dtype != np.uint16:
            # a float array asked to become bf16: round through torch (numpy has no bf16)
            return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).to(
                self.device, torch.bfloat16)
        if a.dtype != want or not a.flags.writeable or any(s < 0 for s in a.strides):
            a = np.array(a, dtype=want)           # a private, writeable copy
        t = torch.from_numpy(a)
        if dtype == "bf16":
            t = t.view(torch.bfloat16)
        return t.to(self.device)                  # a no-op on CPU

    def accumulate(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.add_(src)

    def to_numpy(self, t: torch.Tensor) -> np.ndarray:
        """Tensor -> host array; on CPU a view of the tensor's memory (bf16 leaves as its uint16
        bits)."""
        t = t.detach()
        if t.dtype == torch.bfloat16:
            t = t.view(torch.uint16)
        return t.cpu().numpy()

    def zeros(self, shape: tuple, dtype: str) -> torch.Tensor:
        return torch.zeros(tuple(shape), dtype=TORCH_DTYPE[dtype], device=self.device)

    def dtype_of(self, t: torch.Tensor) -> str:
        return H2_DTYPE[t.dtype]

    # ---- mixed precision -----------------------------------------------------------------------
    def compute_params(self, params: dict) -> dict:
        """The parameters as the programs read them: under bf16, a bf16 copy of each f32 master,
        cast again only once the master changed (its version counter: AdamW and loads update in
        place); otherwise `params` itself."""
        if self.dtype_policy != "bf16":
            return params
        out = {}
        for k, t in params.items():
            if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
                out[k] = t
                continue
            hit = self._copies.get(k)
            if hit is None or hit[0] is not t or hit[1] != t._version:
                hit = (t, t._version, t.to(torch.bfloat16))
                self._copies[k] = hit
            out[k] = hit[2]
        return out

    def as_dtype(self, t, dtype: str):
        """`t` in h2ir dtype `dtype` (itself when it already is): a value leaving a bf16 program
        in the dtype the stage's signature declares."""
        want = TORCH_DTYPE[dtype]
        return t if not isinstance(t, torch.Tensor) or t.dtype == want else t.to(want)

    def storage(self, t) -> tuple | None:
        """(key, bytes) of the memory `t` lives in (views share it); None for a non-tensor."""
        if not isinstance(t, torch.Tensor):
            return None
        s = t.untyped_storage()
        return s.data_ptr(), s.nbytes()

    def device_peak(self) -> int | None:
        """On CUDA, the allocator's peak of allocated bytes since the last call (then reset);
        None on the CPU (backends/memory.py counts live tensors there)."""
        if self.device.type != "cuda":
            return None
        peak = int(torch.cuda.max_memory_allocated(self.device))
        torch.cuda.reset_peak_memory_stats(self.device)
        return peak

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ---- optimizer -----------------------------------------------------------------------------
    def l2_norm(self, t: torch.Tensor) -> float:
        return float(torch.linalg.vector_norm(t))

    def adamw_step(self, params: list, grads: list, exp_avg: list, exp_avg_sq: list, step: int,
                   lr: float, beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
        """In-place AdamW through torch's own functional implementation (torch.optim.adamw.adamw):
        bit-for-bit what torch.optim.AdamW does with the same state."""
        # torch increments each state step before using it: pass step - 1.
        steps = [torch.tensor(float(step - 1)) for _ in params]
        with torch.no_grad():
            torch_adamw(params, grads, exp_avg, exp_avg_sq, [], steps, amsgrad=False,
                        beta1=beta1, beta2=beta2, lr=lr, weight_decay=weight_decay, eps=eps,
                        maximize=False, foreach=True)   # multi-tensor kernels: one call per op
