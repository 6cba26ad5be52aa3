"""Products and lookups on GGUF block-quantized weights, and their torch references.

A weight is kept as the file stores it: ``[N, K / 32 * block_bytes]`` uint8, one row of blocks
per output (``blocks.c`` has the formats). ``block_matmul`` runs the native kernel on the
widest instruction set the CPU has (AVX-512, AVX2, else portable C), or a narrower one named by
``SPLITSERVE_NATIVE_ISA`` (``avx2``, ``portable``; read once) or ``set_native_isa``; the decode
stack (``engine/layers/native_decode.py``) takes the same. ``dequantize_ref`` is the torch
reference, the same float32 operations as gguf's numpy ``dequantize``, and
``block_matmul_ref`` multiplies by its result.
"""

from __future__ import annotations

import os

import torch

from splitserve.kernels.native.build import load

QK = 32
Q4_0, Q4_1, Q8_0 = 2, 3, 8
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34}
NAMES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q8_0: "Q8_0"}
ISAS = ("portable", "avx2", "avx512")  # the C code's isa numbers, narrowest first

_isa: str | None = None


def set_native_isa(name: str | None) -> None:
    """Cap the instruction set of the block products at name (None: SPLITSERVE_NATIVE_ISA,
    else the widest); the CPU's own limit still applies."""
    global _isa
    if name is not None and name not in ISAS:
        raise ValueError(f"native isa {name!r}: one of {', '.join(ISAS)}")
    _isa = name


def native_isa() -> str:
    """The instruction set block products run on: the cap, or the CPU's widest if lower."""
    if _isa is None:
        set_native_isa(os.environ.get("SPLITSERVE_NATIVE_ISA") or ISAS[-1])
    assert _isa is not None
    return ISAS[min(ISAS.index(_isa), best_isa())]


def best_isa() -> int:
    """The widest instruction set of this CPU, as an index into ISAS (0 without the kernels)."""
    lib = load()
    return 0 if lib is None else int(lib.splitserve_best_isa())


def native_available() -> bool:
    return load() is not None


def row_bytes(qtype: int, in_features: int) -> int:
    return in_features // QK * BLOCK_BYTES[qtype]


def in_features(qtype: int, blocks: torch.Tensor) -> int:
    return blocks.shape[-1] // BLOCK_BYTES[qtype] * QK


def block_matmul(
    x: torch.Tensor,
    blocks: torch.Tensor,
    qtype: int,
    isa: str | None = None,
    interleaved: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] float32 @ dequantize(blocks [N, ...]).T -> [M, N] float32 (native kernel).

    isa names the instruction set (tests and benchmarks compare them); None: ``native_isa()``.
    One the CPU lacks falls back to the widest below it. interleaved: ``interleave(blocks)``,
    which the AVX-512 path takes from two rows (Q8_0: eight; blocks.c)."""
    lib = load()
    if lib is None:
        raise RuntimeError("the native CPU kernels are not built")
    x = x.contiguous()
    n, k = blocks.shape[0], in_features(qtype, blocks)
    if x.dtype != torch.float32 or x.shape[-1] != k or blocks.dtype != torch.uint8:
        raise ValueError(f"block_matmul needs float32 [M, {k}] and uint8 blocks")
    out = torch.empty(x.shape[0], n, dtype=torch.float32)
    level = ISAS.index(isa or native_isa())
    il = None if interleaved is None else interleaved.data_ptr()
    code = lib.splitserve_block_matmul(
        qtype, level, x.data_ptr(), x.shape[0], k, blocks.data_ptr(), il, n, out.data_ptr()
    )
    if code != 0:
        raise ValueError(f"block_matmul: unsupported type {qtype} or K {k}")
    return out


def interleave(blocks: torch.Tensor, qtype: int) -> torch.Tensor | None:
    """The copy of blocks [N, ...] that the AVX-512 kernel takes from a few rows: groups of
    16 outputs side by side (the layout is in blocks_avx512.c), the same bytes as blocks give
    or take a padding group. None where the block products do not run on AVX-512."""
    lib = load()
    if lib is None or native_isa() != "avx512":
        return None
    blocks = blocks.contiguous()
    n, k = blocks.shape[0], in_features(qtype, blocks)
    out = torch.empty(lib.splitserve_interleaved_bytes(qtype, n, k), dtype=torch.uint8)
    lib.splitserve_interleave(qtype, blocks.data_ptr(), n, k, out.data_ptr())
    return out


def dequantize_rows(blocks: torch.Tensor, qtype: int, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of the block matrix as float32 [len(ids), K] (embedding lookups)."""
    lib = load()
    if lib is None:
        return dequantize_ref(blocks.index_select(0, ids.reshape(-1)), qtype)
    ids = ids.reshape(-1).to(torch.int64).contiguous()
    k = in_features(qtype, blocks)
    out = torch.empty(ids.shape[0], k, dtype=torch.float32)
    lib.splitserve_dequant_rows(
        qtype, blocks.data_ptr(), k, ids.data_ptr(), ids.shape[0], out.data_ptr()
    )
    return out


def dequantize_ref(blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    """[N, K / 32 * block_bytes] uint8 -> [N, K] float32, as gguf's numpy dequantize."""
    n = blocks.shape[0]
    b = blocks.reshape(n, -1, BLOCK_BYTES[qtype])
    d = b[..., 0:2].contiguous().view(torch.float16).float()
    if qtype == Q8_0:
        q = b[..., 2:].contiguous().view(torch.int8).float()
        return (d * q).reshape(n, -1)
    nibbles = b[..., 4:] if qtype == Q4_1 else b[..., 2:]
    q = torch.cat((nibbles & 0x0F, nibbles >> 4), dim=-1).float()
    if qtype == Q4_1:
        m = b[..., 2:4].contiguous().view(torch.float16).float()
        return (q * d + m).reshape(n, -1)
    return ((q - 8) * d).reshape(n, -1)


def block_matmul_ref(x: torch.Tensor, blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    return x @ dequantize_ref(blocks, qtype).T
