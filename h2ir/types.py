"""Value types of h2ir: a dtype and a static shape, printed like jaxprs (`f32[2,128,256]`)."""
from __future__ import annotations

from dataclasses import dataclass
import math

# h2ir dtype name -> bytes per element
DTYPES = {"f64": 8, "f32": 4, "f16": 2, "bf16": 2, "i64": 8, "i32": 4, "i8": 1, "u8": 1, "bool": 1}


@dataclass(frozen=True)
class TensorType:
    dtype: str
    shape: tuple[int, ...]

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r} (expected one of {', '.join(DTYPES)})")
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPES[self.dtype]

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.shape))}]"

    @classmethod
    def parse(cls, text: str) -> "TensorType":
        """Inverse of str(): 'f32[2,128]' -> TensorType('f32', (2, 128))."""
        dtype, _, rest = text.partition("[")
        dims = rest.rstrip("]")
        return cls(dtype, tuple(int(d) for d in dims.split(",")) if dims else ())


def broadcast_shapes(a: tuple, b: tuple) -> tuple:
    out = []
    for i in range(max(len(a), len(b))):
        x = a[len(a) - 1 - i] if i < len(a) else 1
        y = b[len(b) - 1 - i] if i < len(b) else 1
        if x != y and 1 not in (x, y):
            raise ValueError(f"shapes {list(a)} and {list(b)} do not broadcast")
        out.append(max(x, y) if 1 in (x, y) else x)
    return tuple(reversed(out))
