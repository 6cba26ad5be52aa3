"""DeepSeek's FP8 block-scaled checkpoints, dequantized to bfloat16 at load.

A quantized projection is stored as ``<name>.weight`` in float8_e4m3fn beside
``<name>.weight_scale_inv`` in float32, one scale per block of the config's
``quantization_config.weight_block_size`` (128 x 128 in DeepSeek-V3's): the real weight is the
FP8 value times its block's scale (the last blocks of a row or column may be partial). The
loader yields the product in bfloat16 under the weight's name and no scale tensor, so a model
loads it like any other checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

SCALE_SUFFIX = "_scale_inv"
DEFAULT_BLOCK = (128, 128)


def weight_block_size(path: str) -> tuple[int, int]:
    """The checkpoint's FP8 block shape (rows, columns) from its config.json."""
    config_file = Path(path) / "config.json"
    config = json.loads(config_file.read_text()) if config_file.exists() else {}
    block = (config.get("quantization_config") or {}).get("weight_block_size")
    return (int(block[0]), int(block[1])) if block else DEFAULT_BLOCK


def is_scale(name: str) -> bool:
    return name.endswith(SCALE_SUFFIX)


def is_fp8(tensor: torch.Tensor) -> bool:
    return tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def dequantize_block_fp8(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """weight [R, C] in FP8 times the scale of each (block[0] x block[1]) block -> bfloat16."""
    rows, cols = weight.shape
    scales = scale_inv.float().repeat_interleave(block[0], dim=0)[:rows]
    scales = scales.repeat_interleave(block[1], dim=1)[:, :cols]
    return (weight.float() * scales).to(torch.bfloat16)


class ScaleIndex:
    """Which file of a sharded checkpoint holds each scale tensor (a scale may sit in another
    shard than its weight); ``get`` reads one."""

    def __init__(self, files: list[Path]) -> None:
        from safetensors import safe_open

        self.files: dict[str, Path] = {}
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                self.files.update((n, file) for n in f.keys() if is_scale(n))  # noqa: SIM118

    def get(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        if name not in self.files:
            raise ValueError(f"an FP8 tensor without its scale: no {name!r} in the checkpoint")
        with safe_open(str(self.files[name]), framework="pt") as f:
            return f.get_tensor(name)
