"""A GGUF file's metadata and tensors, read without decoding what the engine never uses.

gguf's own ``GGUFReader`` turns every element of every metadata array into numpy views (3.8 s
for SmolLM2's 49k-token vocabulary and merges on the 2-core VM, in every process that loads
the model). The engine needs the model's hyperparameters, the vocabulary's length and the
tensors; the tokenizer comes from transformers (engine/tokenizer_cache.py). This reads the
header, decodes the metadata keys outside ``tokenizer.ggml.`` (those arrays are only skipped,
their lengths kept), and maps each tensor's bytes from the file in the layout gguf's
``dequantize`` takes, as GGUFReader does. tests/test_gguf_file.py holds it to GGUFReader.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np

MAGIC = b"GGUF"
SKIPPED_PREFIX = "tokenizer.ggml."
DEFAULT_ALIGNMENT = 32
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}  # fmt: skip
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
          6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}  # fmt: skip
_STRING, _ARRAY = 8, 9
_PLAIN = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8,
          "I16": np.int16, "I32": np.int32, "I64": np.int64}  # fmt: skip


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: Any
    """gguf's GGMLQuantizationType."""
    shape: tuple[int, ...]
    """As GGUF stores it: the fastest-moving dimension first."""
    data: np.ndarray
    """Elements (plain types) or bytes per row (quantized types), rows in numpy order."""


@dataclass
class GGUFFile:
    metadata: dict[str, Any] = field(default_factory=dict)
    """Every key outside tokenizer.ggml.: scalars, strings and lists of them."""
    array_lengths: dict[str, int] = field(default_factory=dict)
    """The length of each skipped tokenizer.ggml. array."""
    tensors: list[GGUFTensor] = field(default_factory=list)


class _Cursor:
    def __init__(self, buffer: memoryview) -> None:
        self.buffer, self.at = buffer, 0

    def unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buffer, self.at)
        self.at += struct.calcsize(fmt)
        return value

    def string(self, decode: bool = True) -> str | None:
        length = self.unpack("<Q")
        start, self.at = self.at, self.at + length
        return bytes(self.buffer[start : self.at]).decode("utf-8") if decode else None

    def _skip_strings(self, count: int) -> None:
        """Past ``count`` strings (a vocabulary's 49k tokens in about 15 ms, against 0.4 s
        through ``value``)."""
        buffer, at, length = self.buffer, self.at, struct.Struct("<Q").unpack_from
        for _ in range(count):
            at += 8 + length(buffer, at)[0]
        self.at = at

    def value(self, kind: int, decode: bool) -> Any:
        if kind == _STRING:
            return self.string(decode)
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind])
        if kind != _ARRAY:
            raise ValueError(f"GGUF: unknown metadata value type {kind}")
        item, count = self.unpack("<I"), self.unpack("<Q")
        if item in _NUMPY:
            size = np.dtype(_NUMPY[item]).itemsize * count
            start, self.at = self.at, self.at + size
            if not decode:
                return count
            return np.frombuffer(self.buffer[start : self.at], _NUMPY[item]).tolist()
        if item == _STRING and not decode:
            self._skip_strings(count)
            return count
        values = [self.value(item, decode) for _ in range(count)]
        return values if decode else count


def read_gguf(path: str) -> GGUFFile:
    """The file's metadata and tensors; tensor data are read-only maps of the file."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    cursor = _Cursor(mapped.data)
    if bytes(cursor.buffer[:4]) != MAGIC:
        raise ValueError(f"{path} is not a GGUF file")
    cursor.at = 4
    version, num_tensors, num_keys = cursor.unpack("<I"), cursor.unpack("<Q"), cursor.unpack("<Q")
    if version < 2:
        raise ValueError(f"{path}: GGUF version {version} is not supported")
    result = GGUFFile()
    for _ in range(num_keys):
        key = cursor.string()
        assert key is not None
        skipped, kind = key.startswith(SKIPPED_PREFIX), cursor.unpack("<I")
        value = cursor.value(kind, decode=not skipped)
        if not skipped:
            result.metadata[key] = value
        elif kind == _ARRAY:
            result.array_lengths[key] = value
    infos = []
    for _ in range(num_tensors):
        name = cursor.string()
        dims = tuple(cursor.unpack("<Q") for _ in range(cursor.unpack("<I")))
        infos.append((name, dims, GGMLQuantizationType(cursor.unpack("<I")), cursor.unpack("<Q")))
    alignment = int(result.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    start = -(-cursor.at // alignment) * alignment
    for name, dims, qtype, offset in infos:
        count = int(np.prod(dims))
        rows: tuple[int, ...] = tuple(reversed(dims))
        plain = _PLAIN.get(qtype.name)
        if plain is not None:
            dtype, nbytes = np.dtype(plain), count * np.dtype(plain).itemsize
        else:
            block, type_size = GGML_QUANT_SIZES[qtype]
            dtype, nbytes = np.dtype(np.uint8), count * type_size // block
            rows = quant_shape_to_byte_shape(rows, qtype)
        at = start + offset
        data = np.frombuffer(mapped[at : at + nbytes], dtype).reshape(rows)
        result.tensors.append(GGUFTensor(str(name), qtype, dims, data))
    return result
