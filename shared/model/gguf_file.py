"""A GGUF file's metadata and tensors, read straight from its layout (GGUF v2 and v3,
little-endian): a header, the metadata's key-value pairs, each tensor's name, shape, type and
offset, then the tensors' data, aligned.

gguf's own reader makes numpy views of every field part up front (a vocabulary's 98K strings:
~3 s, in every process that opens the file); here a string is a slice of the file's map and a
number array one ``frombuffer``, so opening a file costs tens of milliseconds. The tensors'
data are read-only views of the map, shaped as gguf's reader shapes them, so that
``gguf.quants.dequantize`` takes them as they are.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
STRING, ARRAY = 8, 9
SCALARS = {  # GGUF's value types → numpy's
    0: np.uint8,
    1: np.int8,
    2: np.uint16,
    3: np.int16,
    4: np.uint32,
    5: np.int32,
    6: np.float32,
    7: np.bool_,
    10: np.uint64,
    11: np.int64,
    12: np.float64,
}
# ggml's tensor types: id → (name, elements a block, bytes a block). (The ``gguf`` package
# has the same table, but importing it costs half a second: it imports mistral_common.)
GGML_TYPES = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    9: ("Q8_1", 32, 40),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66),
    17: ("IQ2_XS", 256, 74),
    18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18),
    21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82),
    23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1),
    25: ("I16", 1, 2),
    26: ("I32", 1, 4),
    27: ("I64", 1, 8),
    28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2),
    34: ("TQ1_0", 256, 54),
    35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17),
    40: ("NVFP4", 64, 36),
    41: ("Q1_0", 128, 18),
}
# Types whose data are numbers as they are (the others: bytes, a row's blocks each).
PLAIN = {
    "F32": np.float32,
    "F16": np.float16,
    "F64": np.float64,
    "I8": np.int8,
    "I16": np.int16,
    "I32": np.int32,
    "I64": np.int64,
}
U32, U64 = struct.Struct("<I"), struct.Struct("<Q")


class GGUFFormatError(ValueError):
    """Not a GGUF file this reader knows (the message says what was found where)."""


@dataclass(frozen=True)
class Tensor:
    name: str
    tensor_type: int  # ggml's id of its type (``gguf.GGMLQuantizationType``'s value)
    type_name: str
    shape: tuple[int, ...]  # GGUF's order: the fastest-moving dimension first
    data: np.ndarray  # read-only, over the file's map


class GGUFFile:
    """``fields`` (key → value: str, int, float, bool, or a list of them) and ``tensors``."""

    def __init__(self, path: Path | str) -> None:
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._pos = 0
        try:
            self._read()
        except GGUFFormatError:
            raise
        except (struct.error, ValueError, OverflowError) as err:  # (a length past the end)
            raise GGUFFormatError(f"damaged or cut short at byte {self._pos}: {err}") from None

    def _read(self) -> None:
        if self._map[:4] != MAGIC:
            raise GGUFFormatError(f"not a GGUF file (starts {bytes(self._map[:4])!r})")
        self._pos = 4
        version = self._u32()
        if version not in VERSIONS:
            raise GGUFFormatError(f"GGUF version {version}, not one of {VERSIONS}")
        n_tensors, n_fields = self._u64(), self._u64()
        self.fields: dict[str, Any] = {}
        for _ in range(n_fields):
            key = self._string()
            self.fields[key] = self._value(self._u32())
        infos = [self._tensor_info() for _ in range(n_tensors)]
        align = int(self.fields.get("general.alignment", DEFAULT_ALIGNMENT))
        start = -(-self._pos // align) * align
        self.tensors = [self._tensor(start, *info) for info in infos]

    def _u32(self) -> int:
        (value,) = U32.unpack_from(self._map, self._pos)
        self._pos += 4
        return value

    def _u64(self) -> int:
        (value,) = U64.unpack_from(self._map, self._pos)
        self._pos += 8
        return value

    def _string(self) -> str:
        n = self._u64()
        end = self._pos + n
        if end > len(self._map):
            raise GGUFFormatError(f"a string of {n} bytes at byte {self._pos} ends past the file")
        text = self._map[self._pos : end].decode("utf-8", errors="replace")
        self._pos = end
        return text

    def _value(self, kind: int) -> Any:  # noqa: ANN401 (a metadata value, of the file's type)
        if kind == STRING:
            return self._string()
        if kind == ARRAY:
            item, count = self._u32(), self._u64()
            if item in SCALARS:
                return self._numbers(SCALARS[item], count).tolist()
            return [self._value(item) for _ in range(count)]
        if kind not in SCALARS:
            raise GGUFFormatError(f"unknown value type {kind} at byte {self._pos - 4}")
        return self._numbers(SCALARS[kind], 1).tolist()[0]

    def _numbers(self, dtype: type, count: int) -> np.ndarray:
        values = np.frombuffer(self._map, dtype=dtype, count=count, offset=self._pos)
        self._pos += values.nbytes
        return values

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        shape = tuple(self._u64() for _ in range(self._u32()))
        return name, shape, self._u32(), self._u64()

    def _tensor(
        self, start: int, name: str, shape: tuple[int, ...], kind: int, offset: int
    ) -> Tensor:
        if kind not in GGML_TYPES:
            raise GGUFFormatError(f"tensor {name}: unknown type {kind}")
        type_name, block, size = GGML_TYPES[kind]
        dims = tuple(reversed(shape))  # numpy's order
        n = int(np.prod(shape, dtype=np.int64))
        if type_name in PLAIN:
            dtype, count = PLAIN[type_name], n
        else:  # rows of blocks' bytes, as gguf's reader gives them
            dtype, count = np.uint8, n // block * size
            dims = (*dims[:-1], dims[-1] // block * size)
        data = np.frombuffer(self._map, dtype=dtype, count=count, offset=start + offset)
        return Tensor(name, kind, type_name, shape, data.reshape(dims))
