"""The numpy backend's runtime: the host is the device, so transfers are views and AdamW is NumPy.

Dtypes: f64, f32 and the integer/bool types. NumPy has no bf16 and its f16 arithmetic is slow
and unlike any accelerator's, so the numpy backend computes in neither: `from_numpy` widens bf16
(uint16 bits) and f16 arrays to f32, and a program typed in bf16/f16 fails the capability check
(`dtypes`) before it runs.
"""
from __future__ import annotations

import numpy as np

from backends.memory import host_storage
from backends.numpy.ops import NP_DTYPE, NP_DTYPES, kernel_table

_H2_DTYPE = {dt: name for name, dt in NP_DTYPE.items()}


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """bf16 is the top half of an f32: shift the 16 stored bits back into place."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


class NumpyBackend:
    name = "numpy"
    dtypes = set(NP_DTYPES)

    def __init__(self):
        self.ops = kernel_table()

    def __repr__(self) -> str:
        return "NumpyBackend()"

    # ---- host transfer -------------------------------------------------------------------------
    def from_numpy(self, a: np.ndarray, dtype: str) -> np.ndarray:
        """The array itself when it already has `dtype` (zero-copy); else a converted copy."""
        a = np.asarray(a)
        if dtype == "bf16":
            return bf16_bits_to_f32(a) if a.dtype == np.uint16 else a.astype(np.float32)
        if dtype == "f16":
            return a.astype(np.float32)
        want = NP_DTYPE[dtype]
        if a.dtype == want and a.flags.writeable:
            return a
        return np.array(a, dtype=want)          # writeable: AdamW updates parameters in place

    def accumulate(self, dst: np.ndarray, src: np.ndarray) -> None:
        np.add(dst, src, out=dst)

    def to_numpy(self, t: np.ndarray) -> np.ndarray:
        return np.asarray(t)

    # (key, bytes) of the buffer an array views (its base-most array); None for a non-array
    storage = staticmethod(host_storage)

    def device_peak(self) -> None:
        return None

    def zeros(self, shape: tuple, dtype: str) -> np.ndarray:
        return np.zeros(tuple(shape), dtype=NP_DTYPE[dtype])

    def dtype_of(self, t: np.ndarray) -> str:
        return _H2_DTYPE[np.asarray(t).dtype]

    def synchronize(self) -> None:
        pass                                     # NumPy calls return when their work is done

    # no dtype policy: programs compute in their traced dtypes
    def compute_params(self, params: dict) -> dict:
        return params

    def as_dtype(self, t, dtype: str):
        return t

    # ---- optimizer -----------------------------------------------------------------------------
    def l2_norm(self, t: np.ndarray) -> float:
        return float(np.linalg.norm(np.asarray(t).reshape(-1)))

    def adamw_step(self, params: list, grads: list, exp_avg: list, exp_avg_sq: list, step: int,
                   lr: float, beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
        """In-place AdamW (Loshchilov & Hutter 2019, Alg. 2) in torch.optim.AdamW's operation order:
        decoupled decay p *= 1 - lr*wd; m += (1-b1)(g - m); v = b2 v + (1-b2) g^2;
        p -= lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps)."""
        bias_correction1 = 1 - beta1 ** step
        bias_correction2_sqrt = (1 - beta2 ** step) ** 0.5
        step_size = lr / bias_correction1
        for p, g, m, v in zip(params, grads, exp_avg, exp_avg_sq):
            t = p.dtype.type
            if weight_decay != 0:
                p *= t(1 - lr * weight_decay)
            m += t(1 - beta1) * (g - m)                 # torch's lerp_(g, 1 - beta1)
            v *= t(beta2)
            v += (t(1 - beta2) * g) * g                 # torch's addcmul_(g, g, value=1 - beta2)
            denom = np.sqrt(v)
            denom /= t(bias_correction2_sqrt)
            denom += t(eps)
            p += (t(-step_size) * m) / denom            # torch's addcdiv_(m, denom, -step_size)
