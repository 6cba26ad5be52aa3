"""On-disk encoding of one KV block: a fixed header, the shape, then the raw tensor bytes.

No pickle anywhere: a block file is data, never code. The header carries the block hash, the
retention expiry, dtype and shape, and a BLAKE2b checksum over everything else in the file, so
a flipped bit, a truncated write or a file that belongs to another hash is detected on read.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

import torch

MAGIC = b"SSKV"
VERSION = 1
_HEADER = struct.Struct("<4sBBBxQdQ16s")
_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
)
_CODES = {dtype: code for code, dtype in enumerate(_DTYPES)}


class CorruptBlock(ValueError):
    """The bytes are not a valid block file (or not the block that was asked for)."""


@dataclass(frozen=True)
class BlockHeader:
    block_hash: int
    expiry: float
    dtype: torch.dtype
    shape: tuple[int, ...]


def encode(block_hash: int, expiry: float, tensor: torch.Tensor) -> bytes:
    """The file contents for ``tensor`` (any device; copied to CPU)."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    payload = flat.view(torch.uint8).numpy().tobytes()
    shape = struct.pack(f"<{tensor.dim()}Q", *tensor.shape)
    code = _CODES[tensor.dtype]
    fixed = _HEADER.pack(MAGIC, VERSION, code, tensor.dim(), block_hash, expiry, len(payload), b"")
    digest = _checksum(fixed, shape, payload)
    fixed = _HEADER.pack(
        MAGIC, VERSION, code, tensor.dim(), block_hash, expiry, len(payload), digest
    )
    return fixed + shape + payload


def decode_header(data: bytes) -> BlockHeader:
    """Parse the header and check the sizes (not the checksum); raises CorruptBlock."""
    header, _ = _parse(data)
    return header


def decode(data: bytes, block_hash: int) -> tuple[torch.Tensor, float]:
    """The tensor and expiry in ``data``, verified against its checksum and ``block_hash``."""
    header, digest = _parse(data)
    if header.block_hash != block_hash:
        raise CorruptBlock(f"file holds block {header.block_hash:016x}, not {block_hash:016x}")
    offset = _HEADER.size + 8 * len(header.shape)
    fixed = _HEADER.pack(*_HEADER.unpack_from(data)[:-1], b"")
    if _checksum(fixed, data[_HEADER.size : offset], data[offset:]) != digest:
        raise CorruptBlock("checksum mismatch")
    raw = torch.frombuffer(bytearray(data[offset:]), dtype=torch.uint8)
    return raw.view(header.dtype).reshape(header.shape), header.expiry


def _parse(data: bytes) -> tuple[BlockHeader, bytes]:
    if len(data) < _HEADER.size:
        raise CorruptBlock("truncated header")
    magic, version, code, ndim, block_hash, expiry, length, digest = _HEADER.unpack_from(data)
    if magic != MAGIC or version != VERSION or code >= len(_DTYPES):
        raise CorruptBlock("not a block file of this version")
    offset = _HEADER.size + 8 * ndim
    if len(data) != offset + length:
        raise CorruptBlock(f"size {len(data)}, header says {offset + length}")
    shape = struct.unpack_from(f"<{ndim}Q", data, _HEADER.size)
    dtype = _DTYPES[code]
    numel = 1
    for dim in shape:
        numel *= dim
    if numel * dtype.itemsize != length:
        raise CorruptBlock("payload length does not match dtype and shape")
    return BlockHeader(block_hash, expiry, dtype, tuple(shape)), digest


def _checksum(fixed: bytes, shape: bytes, payload: bytes) -> bytes:
    digest = hashlib.blake2b(digest_size=16)
    digest.update(fixed)
    digest.update(shape)
    digest.update(payload)
    return digest.digest()
