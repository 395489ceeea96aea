"""Value types of h2ir: a dtype and a static shape, printed like jaxprs (`f32[2,128,256]`)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class DType:
    """One h2ir dtype: its size, kind, how its bytes look on the host and on the wire (a numpy
    dtype, little-endian; bf16 travels as the uint16 of its bits) and torch's name for it."""
    name: str
    itemsize: int
    kind: str              # 'float' | 'int' | 'bool'
    host: str              # numpy dtype string of the host / wire form
    torch: str             # attribute of the torch module

    @property
    def is_float(self) -> bool:
        return self.kind == "float"

    @property
    def host_dtype(self) -> np.dtype:
        return np.dtype(self.host)


# The one dtype table. Backends, the frontend, checkpoints and DiComm derive their maps from it.
DTYPE_TABLE: dict[str, DType] = {d.name: d for d in (
    DType("f64", 8, "float", "<f8", "float64"),
    DType("f32", 4, "float", "<f4", "float32"),
    DType("f16", 2, "float", "<f2", "float16"),
    DType("bf16", 2, "float", "<u2", "bfloat16"),
    DType("i64", 8, "int", "<i8", "int64"),
    DType("i32", 4, "int", "<i4", "int32"),
    DType("i8", 1, "int", "i1", "int8"),
    DType("u8", 1, "int", "u1", "uint8"),
    DType("bool", 1, "bool", "?", "bool"),
)}
DTYPES = {n: d.itemsize for n, d in DTYPE_TABLE.items()}          # name -> bytes per element
FLOAT_DTYPES = tuple(n for n, d in DTYPE_TABLE.items() if d.is_float)
_BY_HOST = {d.host_dtype: n for n, d in DTYPE_TABLE.items()}


@dataclass(frozen=True)
class TrainDType:
    """A training dtype as cluster files, the planner and a stage's dtype policy name it
    (`fp32`, `bf16`, ...): the h2ir dtype that holds its values, and whether a stage trains in
    it (`policy`: a build's `dtype_policy`) or the planner only costs it."""
    name: str
    storage: str | None        # its DTYPE_TABLE row; None: h2ir has no such dtype
    policy: bool = False
    itemsize: int = 0          # bytes per element; only given where `storage` is None

    def __post_init__(self):
        if self.storage is not None:
            object.__setattr__(self, "itemsize", DTYPE_TABLE[self.storage].itemsize)


# The one table of training dtypes. The resource model charges `itemsize` bytes per weight and
# activation element; compile gives a stage the cluster's dtype as its policy where `policy`.
TRAIN_DTYPES: dict[str, TrainDType] = {t.name: t for t in (
    TrainDType("fp32", "f32", policy=True),
    TrainDType("tf32", "f32"),                 # f32 values, TF32 tensor-core matmuls
    TrainDType("bf16", "bf16", policy=True),
    TrainDType("fp16", "f16"),                 # executing it needs dynamic loss scaling
    TrainDType("fp8", None, itemsize=1),
)}
DTYPE_POLICIES = tuple(n for n, t in TRAIN_DTYPES.items() if t.policy)


def host_dtype(name: str) -> np.dtype:
    """The numpy dtype that holds an h2ir `name` value on the host (bf16 -> uint16 bits)."""
    return DTYPE_TABLE[name].host_dtype


def dtype_of_host(dt) -> str:
    """The h2ir name of a host numpy dtype (uint16 is read as bf16 bits); KeyError if none."""
    dt = np.dtype(dt)
    if dt.byteorder == ">":
        dt = dt.newbyteorder("<")
    return _BY_HOST[dt]


MAX_DIM_DIGITS = 18            # a dimension fits an int64 with room: no tensor has 10**18 elements
MAX_SHAPE_CHARS = 64 * (MAX_DIM_DIGITS + 1)


@dataclass(frozen=True)
class TensorType:
    dtype: str
    shape: tuple[int, ...]

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r} (expected one of {', '.join(DTYPES)})")
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        if any(s < 0 for s in self.shape):
            raise ValueError(f"negative dimension in shape {list(self.shape)}")

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
        if len(dims) > MAX_SHAPE_CHARS:         # int() of a 100k-digit string is slow, then fails
            raise ValueError(f"shape of {len(dims):,} characters; dimensions have at most "
                             f"{MAX_DIM_DIGITS} digits")
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
