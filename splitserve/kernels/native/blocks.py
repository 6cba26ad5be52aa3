"""Products and lookups on GGUF block-quantized weights, and their torch references.

A weight is kept as the file stores it: ``[N, K / block_values * block_bytes]`` uint8, one row
of blocks per output (``blocks.c`` has the formats: Q4_0, Q4_1, Q5_0, Q8_0 in blocks of 32
values, the K-quants Q4_K and Q6_K in blocks of 256). ``block_matmul`` runs the native kernel on the
widest instruction set the CPU has (AVX-512, AVX2, else portable C), or a narrower one named by
``SPLITSERVE_NATIVE_ISA`` (``avx2``, ``portable``; read once) or ``set_native_isa``; the decode
stack (``engine/layers/native_decode.py``) takes the same. ``dequantize_ref`` is the torch
reference, the same float32 operations as gguf's numpy ``dequantize``, and
``block_matmul_ref`` multiplies by its result.

A one-row product of Q8_0, Q5_0, Q4_K or Q6_K on AVX-512 (with BW) or AVX2 rounds its row to
int16 in blocks of 32 values first (``blocks_row16.c``, ``blocks_row16_avx2.c``): each value to
within 2^-15 of its block's largest (``rounds_one_row``, ``one_row_error_bound``); every other
product takes x in float32.
"""

from __future__ import annotations

import os

import torch

from splitserve.kernels.native.build import load

QK = 32
Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K = 2, 3, 6, 8, 12, 14
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q5_0: 22, Q8_0: 34, Q4_K: 144, Q6_K: 210}
BLOCK_VALUES = {Q4_0: QK, Q4_1: QK, Q5_0: QK, Q8_0: QK, Q4_K: 256, Q6_K: 256}
NAMES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q5_0: "Q5_0", Q8_0: "Q8_0", Q4_K: "Q4_K", Q6_K: "Q6_K"}
INTERLEAVED_TYPES = frozenset({Q4_0, Q4_1, Q8_0})
"""The types with an interleaved copy (``interleave``); the others take the one-output passes
on AVX-512 at every row count."""
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


ROUNDED_ONE_ROW = frozenset({Q8_0, Q5_0, Q4_K, Q6_K})


def rounds_one_row(qtype: int, isa: str | None = None) -> bool:
    """Whether a one-row product of qtype on isa (None: ``native_isa()``) here rounds its row
    to 16 bits (``blocks_row16.c``)."""
    lib = load()
    if lib is None or qtype not in ROUNDED_ONE_ROW:
        return False
    return min(ISAS.index(isa or native_isa()), best_isa()) >= ISAS.index("avx2")


def one_row_error_bound(x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The most a rounded one-row product x [K] @ weights [N, K].T can differ from the exact
    one, rounding aside: sum_k |w[n, k]| * 2^-15 * max |x| over k's block of 32."""
    block_max = x.abs().view(-1, QK).amax(dim=1).repeat_interleave(QK)
    return weights.abs().double() @ (block_max.double() * 2.0**-15)


def row_bytes(qtype: int, in_features: int) -> int:
    return in_features // BLOCK_VALUES[qtype] * BLOCK_BYTES[qtype]


def in_features(qtype: int, blocks: torch.Tensor) -> int:
    return blocks.shape[-1] // BLOCK_BYTES[qtype] * BLOCK_VALUES[qtype]


INVARIANT = 16
"""Or-ed into the C functions' isa argument: batch-invariant products (blocks.h)."""


def block_matmul(
    x: torch.Tensor,
    blocks: torch.Tensor,
    qtype: int,
    isa: str | None = None,
    interleaved: torch.Tensor | None = None,
    invariant: bool = False,
) -> torch.Tensor:
    """x [M, K] float32 @ dequantize(blocks [N, ...]).T -> [M, N] float32 (native kernel).

    isa names the instruction set (tests and benchmarks compare them); None: ``native_isa()``.
    One the CPU lacks falls back to the widest below it. interleaved: ``interleave(blocks)``,
    which the AVX-512 path takes from two rows (Q8_0: eight; blocks.c). invariant: every row's
    sums run in one order whatever M, so a row's output is the same bits alone or among any
    others (deterministic mode; the interleaved copy then serves every row count)."""
    lib = load()
    if lib is None:
        raise RuntimeError("the native CPU kernels are not built")
    x = x.contiguous()
    n, k = blocks.shape[0], in_features(qtype, blocks)
    if x.dtype != torch.float32 or x.shape[-1] != k or blocks.dtype != torch.uint8:
        raise ValueError(f"block_matmul needs float32 [M, {k}] and uint8 blocks")
    out = torch.empty(x.shape[0], n, dtype=torch.float32)
    level = ISAS.index(isa or native_isa()) | (INVARIANT if invariant else 0)
    il = None if interleaved is None else interleaved.data_ptr()
    code = lib.splitserve_block_matmul(
        qtype, level, x.data_ptr(), x.shape[0], k, blocks.data_ptr(), il, n, out.data_ptr()
    )
    if code == -2:
        raise MemoryError("block_matmul: no scratch memory")
    if code != 0:
        raise ValueError(f"block_matmul: unsupported type {qtype} or K {k}")
    return out


def interleave(blocks: torch.Tensor, qtype: int) -> torch.Tensor | None:
    """The copy of blocks [N, ...] that the AVX-512 kernel takes from a few rows: groups of
    16 outputs side by side (the layout is in blocks_interleaved.c), the same bytes as blocks
    give or take a padding group. None where the block products do not run on AVX-512, or for
    a type without the layout (``INTERLEAVED_TYPES``)."""
    lib = load()
    if lib is None or native_isa() != "avx512" or qtype not in INTERLEAVED_TYPES:
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
    """[N, K / block_values * block_bytes] uint8 -> [N, K] float32, as gguf's numpy
    dequantize: the same float32 operations in the same order."""
    n = blocks.shape[0]
    b = blocks.reshape(n, -1, BLOCK_BYTES[qtype])
    if qtype in (Q4_K, Q6_K):
        return _dequantize_k(b, qtype).reshape(n, -1)
    d = _half(b[..., 0:2])
    if qtype == Q8_0:
        q = b[..., 2:].contiguous().view(torch.int8).float()
        return (d * q).reshape(n, -1)
    nibbles = b[..., 6:] if qtype == Q5_0 else b[..., 4:] if qtype == Q4_1 else b[..., 2:]
    q = torch.cat((nibbles & 0x0F, nibbles >> 4), dim=-1).float()
    if qtype == Q5_0:
        high = b[..., 2:6].contiguous().view(torch.int32) >> torch.arange(32, dtype=torch.int32)
        return (d * ((q.int() | (high & 1) << 4) - 16).float()).reshape(n, -1)
    if qtype == Q4_1:
        return (q * d + _half(b[..., 2:4])).reshape(n, -1)
    return ((q - 8) * d).reshape(n, -1)


def _half(b: torch.Tensor) -> torch.Tensor:
    """Two bytes (the last dimension) -> float32 of their fp16, keeping the dimension."""
    return b.contiguous().view(torch.float16).float()


def _dequantize_k(b: torch.Tensor, qtype: int) -> torch.Tensor:
    """K-quant blocks [N, blocks, bytes] -> [N, blocks, 256] float32."""
    n, nb = b.shape[0], b.shape[1]
    if qtype == Q6_K:
        ql, qh = b[..., :128].reshape(n, nb, 2, 1, 64), b[..., 128:192].reshape(n, nb, 2, 1, 32)
        low = torch.cat((ql & 0x0F, ql >> 4), dim=3).reshape(n, nb, 2, 4, 32)
        high = torch.cat([(qh >> shift) & 3 for shift in (0, 2, 4, 6)], dim=3)
        q = ((low | high << 4).to(torch.int8) - 32).float().reshape(n, nb, 16, 16)
        scales = b[..., 192:208].contiguous().view(torch.int8).float()
        d = _half(b[..., 208:210]) * scales
        return (d[..., None] * q).reshape(n, nb, 256)
    d, dmin, sc = _half(b[..., 0:2]), _half(b[..., 2:4]), b[..., 4:16].int()
    lo, mid, top = sc[..., 0:4], sc[..., 4:8], sc[..., 8:12]
    scale = torch.cat((lo & 0x3F, (top & 0x0F) | ((lo >> 2) & 0x30)), dim=-1).float()
    least = torch.cat((mid & 0x3F, (top >> 4) | ((mid >> 2) & 0x30)), dim=-1).float()
    qs = b[..., 16:].reshape(n, nb, 4, 1, 32)
    q = torch.cat((qs & 0x0F, qs >> 4), dim=3).reshape(n, nb, 8, 32).float()
    return ((d * scale)[..., None] * q - (dmin * least)[..., None]).reshape(n, nb, 256)


WIDENS_TO_Q8_0 = frozenset({Q4_0, Q5_0})
"""Types whose blocks re-encode as Q8_0 without changing a weight (``to_q8_0``)."""


def to_q8_0(blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    """Q4_0 or Q5_0 blocks [N, ...] as Q8_0 blocks of the same weights, bit for bit: the same
    fp16 d, and each q - 8 (q - 16) as the int8 (gguf dequantizes both as float32 d times
    that integer). Costs 34 bytes a block instead of 18 (22)."""
    if qtype not in WIDENS_TO_Q8_0:
        raise ValueError(f"{NAMES.get(qtype, qtype)} blocks do not widen to Q8_0")
    n = blocks.shape[0]
    b = blocks.reshape(n, -1, BLOCK_BYTES[qtype])
    nibbles = b[..., 6:] if qtype == Q5_0 else b[..., 2:]
    q = torch.cat((nibbles & 0x0F, nibbles >> 4), dim=-1).int()
    if qtype == Q5_0:
        high = b[..., 2:6].contiguous().view(torch.int32) >> torch.arange(32, dtype=torch.int32)
        q = (q | (high & 1) << 4) - 16
    else:
        q = q - 8
    return torch.cat((b[..., 0:2], q.to(torch.int8).view(torch.uint8)), dim=-1).reshape(n, -1)


def block_matmul_ref(x: torch.Tensor, blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    return x @ dequantize_ref(blocks, qtype).T
