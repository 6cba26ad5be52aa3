"""Random GGUF blocks for the kernel tests."""

from __future__ import annotations

import numpy as np
import torch

from splitserve.kernels.native.blocks import (
    BLOCK_BYTES,
    BLOCK_VALUES,
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_0,
    Q6_K,
    Q8_0,
)

SCALES = {Q4_0: (0,), Q4_1: (0, 2), Q5_0: (0,), Q8_0: (0,), Q4_K: (0, 2), Q6_K: (208,)}
"""Offsets of each block's fp16 scales."""


def random_blocks(qtype: int, rows: int, inputs: int, seed: int = 0) -> torch.Tensor:
    """Random bytes as blocks of qtype, their fp16 scales finite (normal, 0.01)."""
    rng = np.random.default_rng(seed)
    shape = (rows, inputs // BLOCK_VALUES[qtype], BLOCK_BYTES[qtype])
    blocks = rng.integers(0, 256, shape, np.uint8)
    for at in SCALES[qtype]:
        scale = (rng.standard_normal(blocks.shape[:2]) * 0.01).astype(np.float16)
        blocks[..., at : at + 2] = scale[..., None].view(np.uint8)
    return torch.from_numpy(blocks.reshape(rows, -1))
