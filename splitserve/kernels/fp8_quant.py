"""FP8 (e4m3) quantization as DeepSeek-V3 runs it, in torch: the reference and the CPU path.

A weight ``[N, K]`` is held in float8_e4m3fn with one float32 scale per ``BLOCK`` x ``BLOCK``
block (``[ceil(N / BLOCK), ceil(K / BLOCK)]``; the last blocks of a row or column may be
partial): each block scaled so that its largest magnitude lands on e4m3's largest finite
value, 448. Activations are quantized when they enter a projection: one scale per token and
``BLOCK``-channel group (``[M, ceil(K / BLOCK)]``). A product then is, per group of K,
``(a_fp8 . w_fp8) * a_scale * w_scale`` accumulated in float32; ``fp8_matmul_ref`` computes
it by dequantizing both operands to float32 (the exact value of every FP8 product, summed in
float32), which the Triton kernel (``kernels/grouped_gemm.py``) must match up to summation
order.

No Triton here: the CPU path of ``engine/layers/fp8_linear.py`` takes these functions.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = 128
"""The weight block's rows and columns, and the activation group's channels."""
TINY = 1e-12
"""The smallest scale's numerator: an all-zero block keeps a finite scale (its values 0)."""
KV_SCALE_VALUES = 16
"""An FP8 KV cache row's last e4m3 slots: its float32 scale's 4 bytes, then 12 zero bytes
that keep every row 16-byte aligned (``engine/layers/fp8_kv.py``); the attention kernels
read the scale. With 4 bytes (rows of 132) the Triton kernels loaded each row byte by byte:
the decode kernel at batch 16 and 4k context took 443 µs a layer on an H200 against
bfloat16's 114, for half the bytes."""


@dataclass(frozen=True)
class BlockFp8:
    """A block-quantized weight: ``data`` [..., N, K] in e4m3 and ``scale`` [..., ceil(N /
    BLOCK), ceil(K / BLOCK)] float32 (a stack of experts keeps one of each per expert)."""

    data: torch.Tensor
    scale: torch.Tensor


def blocks(size: int) -> int:
    return -(-size // BLOCK)


def _padded(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return F.pad(x, (0, cols - x.shape[-1], 0, rows - x.shape[-2]))


def quantize_blocks(weight: torch.Tensor) -> BlockFp8:
    """weight [..., N, K] (any float dtype) -> its e4m3 blocks and their scales."""
    *lead, n, k = weight.shape
    nb, kb = blocks(n), blocks(k)
    tiles = _padded(weight.float(), nb * BLOCK, kb * BLOCK)
    tiles = tiles.reshape(*lead, nb, BLOCK, kb, BLOCK)
    amax = tiles.abs().amax(dim=(-3, -1))
    scale = amax.clamp(min=TINY) / FP8_MAX
    scaled = tiles / scale.unsqueeze(-1).unsqueeze(-3)
    data = scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8).reshape(*lead, nb * BLOCK, kb * BLOCK)
    return BlockFp8(data[..., :n, :k].contiguous(), scale)


def dequantize_blocks(weight: BlockFp8) -> torch.Tensor:
    """The float32 value of every weight: its e4m3 value times its block's scale."""
    n, k = weight.data.shape[-2:]
    scales = weight.scale.repeat_interleave(BLOCK, dim=-2)[..., :n, :]
    scales = scales.repeat_interleave(BLOCK, dim=-1)[..., :k]
    return weight.data.float() * scales


def quantize_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations x [M, K] -> (e4m3 [M, K], float32 scales [M, ceil(K / BLOCK)]): one scale
    per token and BLOCK-channel group."""
    m, k = x.shape
    kb = blocks(k)
    groups = F.pad(x.float(), (0, kb * BLOCK - k)).reshape(m, kb, BLOCK)
    scale = groups.abs().amax(dim=-1).clamp(min=TINY) / FP8_MAX
    data = (groups / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return data.reshape(m, kb * BLOCK)[:, :k].contiguous(), scale


def dequantize_groups(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    k = data.shape[-1]
    return data.float() * scale.repeat_interleave(BLOCK, dim=-1)[..., :k]


def fp8_matmul_ref(
    x_fp8: torch.Tensor, x_scale: torch.Tensor | None, weight: BlockFp8, out_dtype: torch.dtype
) -> torch.Tensor:
    """[M, K] quantized activations times a [N, K] block-quantized weight -> [M, N]; x_scale
    None: the activations are not quantized (W8A16) and meet the dequantized weight as
    they are."""
    rows = x_fp8.float() if x_scale is None else dequantize_groups(x_fp8, x_scale)
    return (rows @ dequantize_blocks(weight).T).to(out_dtype)


def fp8_grouped_ref(
    x_fp8: torch.Tensor,
    x_scale: torch.Tensor | None,
    weight: BlockFp8,
    offsets: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The grouped expert GEMM on quantized rows (already in expert order): rows
    [offsets[e], offsets[e + 1]) times expert e's weight; the offsets are read on the host
    (x_scale None: W8A16, as in ``fp8_matmul_ref``)."""
    out = torch.empty((x_fp8.shape[0], weight.data.shape[1]), dtype=out_dtype, device=x_fp8.device)
    for expert, (start, end) in enumerate(itertools.pairwise(offsets.tolist())):
        if end > start:
            one = BlockFp8(weight.data[expert], weight.scale[expert])
            scale = None if x_scale is None else x_scale[start:end]
            out[start:end] = fp8_matmul_ref(x_fp8[start:end], scale, one, out_dtype)
    return out
