"""Reading the GGUF container: header, metadata, tensor table, and zero-copy views of tensor data.

``gguf.GGUFReader`` builds a numpy view per metadata value, which takes ~5 s for a 49k-token
vocabulary; this reader parses the same layout with ``struct`` in a fraction of that and keeps
the ``gguf`` package for what it is good at: type constants and ``gguf.quants.dequantize``.
Tensor ``data`` has exactly the form ``GGUFReader`` gives (values for float/int types, bytes
``[..., row_bytes]`` for block-quantised types), so ``dequantize`` accepts it as is.

Layout (little-endian, GGUF v2/v3): magic "GGUF", u32 version, u64 tensor count, u64 metadata
count; metadata as (string key, u32 type, value); tensor infos as (string name, u32 n_dims,
u64 dims[ne0 first], u32 ggml type, u64 offset); then tensor data from the next multiple of
``general.alignment`` (default 32).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_NUMPY = {
    0: "<u1",
    1: "<i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "?",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}
_STRING, _ARRAY = 8, 9
# ggml types stored as plain values (not blocks) and their numpy dtype
_VALUE_TYPES = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True)
class GgufTensor:
    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]  # torch order: rows first (the file lists ne0, the contiguous one, first)
    data: np.ndarray  # read-only view into the file (see module docstring for its form)


class GgufFile:
    """A parsed GGUF file: ``metadata`` (key -> int/float/bool/str/list) and ``tensors``.
    ValueError naming the file for anything that is not a complete little-endian GGUF v2/v3."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self._buffer = np.memmap(self.path, mode="r")
        except (OSError, ValueError) as error:  # ValueError: numpy cannot map an empty file
            raise ValueError(f"{self.path}: cannot map as a GGUF file ({error})") from error
        self._view = memoryview(self._buffer)
        self._offset = 0
        try:
            self._parse()
        except (struct.error, UnicodeDecodeError, IndexError, KeyError, ValueError) as error:
            raise ValueError(
                f"{self.path}: not a valid or complete GGUF file ({type(error).__name__}: {error})"
            ) from error

    def _parse(self) -> None:
        if bytes(self._view[:4]) != b"GGUF":
            raise ValueError(f"bad magic {bytes(self._view[:4])!r}, expected b'GGUF'")
        self._offset = 4
        self.version = self._scalar("<I")
        if self.version not in (2, 3):
            raise ValueError(f"GGUF version {self.version} (or a big-endian file); supported: 2, 3")
        tensor_count, kv_count = self._scalar("<Q"), self._scalar("<Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key = self._string()
            self.metadata[key] = self._value(self._scalar("<I"))
        infos = [self._tensor_info() for _ in range(tensor_count)]
        alignment = int(self.metadata.get("general.alignment", 32))
        data_start = -(-self._offset // alignment) * alignment
        self.tensors = [self._tensor(data_start, *info) for info in infos]

    def _scalar(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self._view, self._offset)
        self._offset += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        length = self._scalar("<Q")
        end = self._offset + length
        if end > len(self._view):
            raise ValueError(f"string of {length} bytes runs past the end of the file")
        text = bytes(self._view[self._offset : end]).decode("utf-8")
        self._offset = end
        return text

    def _value(self, kind: int):
        if kind in _SCALARS:
            return self._scalar(_SCALARS[kind])
        if kind == _STRING:
            return self._string()
        if kind != _ARRAY:
            raise ValueError(f"unknown metadata value type {kind}")
        item_kind, count = self._scalar("<I"), self._scalar("<Q")
        if item_kind in _NUMPY:  # one vectorised read for numeric arrays
            values = np.frombuffer(self._view, dtype=_NUMPY[item_kind], count=count, offset=self._offset)
            self._offset += values.nbytes
            return values.tolist()
        return [self._value(item_kind) for _ in range(count)]

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        dims = tuple(self._scalar("<Q") for _ in range(self._scalar("<I")))
        return name, dims, self._scalar("<I"), self._scalar("<Q")

    def _tensor(
        self, data_start: int, name: str, dims: tuple[int, ...], type_id: int, offset: int
    ) -> GgufTensor:
        ggml_type = GGMLQuantizationType(type_id)
        shape = tuple(reversed(dims))
        block_size, type_size = GGML_QUANT_SIZES[ggml_type]
        elements = int(np.prod(dims, dtype=np.int64))
        nbytes = elements * type_size // block_size
        start = data_start + offset
        if start + nbytes > len(self._view):
            raise ValueError(
                f"tensor {name!r} needs bytes {start}..{start + nbytes}, the file has {len(self._view)}"
            )
        raw = self._buffer[start : start + nbytes]
        if ggml_type in _VALUE_TYPES:
            data = raw.view(_VALUE_TYPES[ggml_type]).reshape(shape)
        else:
            data = raw.reshape(quant_shape_to_byte_shape(shape, ggml_type))
        return GgufTensor(name, ggml_type, shape, data)
