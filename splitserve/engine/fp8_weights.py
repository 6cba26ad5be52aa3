"""DeepSeek's FP8 block-scaled checkpoints, and FP8 weights at load (``quantization="fp8"``).

A quantized projection is stored as ``<name>.weight`` in float8_e4m3fn beside
``<name>.weight_scale_inv`` in float32, one scale per block of the config's
``quantization_config.weight_block_size`` (128 x 128 in DeepSeek-V3's): the real weight is the
FP8 value times its block's scale (the last blocks of a row or column may be partial).
Without ``quantization="fp8"`` the loader yields the product in bfloat16 under the weight's
name and no scale tensor, so a model loads it like any other checkpoint.

With ``quantization="fp8"`` (``to_fp8_layers``) the decoder layers' projections become
``Fp8Linear`` and their routed experts e4m3 stacks (``engine/layers/fp8_linear.py``): a float
checkpoint or a ``shape:`` model is loaded as it is and quantized after, with the same block
scheme.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from splitserve.engine.layers.fp8_linear import SCALE_SUFFIX as SCALE_SUFFIX
from splitserve.engine.layers.fp8_linear import Fp8Linear
from splitserve.engine.layers.moe import SparseMoE
from splitserve.kernels.fp8_quant import BLOCK, FP8, BlockFp8, blocks, quantize_blocks

DEFAULT_BLOCK = (128, 128)


def is_fp8_checkpoint(path: str) -> bool:
    """A Hugging Face directory whose config.json declares FP8 weights (DeepSeek's format)."""
    config_file = Path(path) / "config.json"
    if not config_file.exists():
        return False
    config = json.loads(config_file.read_text())
    return (config.get("quantization_config") or {}).get("quant_method") == "fp8"


def fp8_targets(
    model: nn.Module, weight_targets: Callable[[str], list[tuple[str, int]]]
) -> Callable[[str], bool]:
    """Whether a checkpoint tensor (by name) lands in FP8 parameters, i.e. loads as it is."""
    fp8 = {name for name, param in model.named_parameters() if param.dtype == FP8}

    def lands_in_fp8(hf_name: str) -> bool:
        targets = weight_targets(hf_name)
        return bool(targets) and all(name in fp8 for name, _ in targets)

    return lands_in_fp8


def fp8_copies(
    hf_name: str, tensor: torch.Tensor, target: str, offset: int, fp8_params: set[str]
) -> list[tuple[str, int, torch.Tensor]]:
    """What a checkpoint tensor bound for ``target``'s rows from ``offset`` on copies:
    itself; for a scale (``<name>_scale_inv``, its weight's target given), the rows of the
    target's scales from ``offset / 128``; for a float tensor bound for an FP8 parameter,
    its e4m3 blocks and their scales. A part must then start on a 128-row block."""
    scale = is_scale(hf_name)
    if not scale and (target not in fp8_params or is_fp8(tensor)):
        return [(target, offset, tensor)]
    if offset % BLOCK:
        raise ValueError(
            f"{hf_name} starts at row {offset} of {target}, not on a {BLOCK}-row FP8 "
            "block: this checkpoint loads without quantization='fp8'"
        )
    if scale:
        return [(target + SCALE_SUFFIX, offset // BLOCK, tensor)]
    quantized = quantize_blocks(tensor)
    return [
        (target, offset, quantized.data),
        (target + SCALE_SUFFIX, offset // BLOCK, quantized.scale),
    ]


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


def to_fp8_layers(model: nn.Module, empty: bool = False) -> int:
    """Quantizes the decoder layers' projections and routed experts in place (``empty``: only
    makes them FP8, of zeros, for an FP8 checkpoint to fill); returns how many projections
    and expert stacks changed. The LM head, embeddings, routers and anything outside
    ``layers`` keep their dtype."""
    routers = {id(moe.gate) for moe in model.modules() if isinstance(moe, SparseMoE)}
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if type(module) is nn.Linear and name.startswith("layers.") and id(module) not in routers
    ]
    for name, module in targets:
        new = Fp8Linear(module.in_features, module.out_features, module.bias)
        new.to(module.weight.device)
        if not empty:
            _set(new, "weight", quantize_blocks(module.weight.detach()))
        model.set_submodule(name, new)
    experts = [m for m in model.modules() if isinstance(m, SparseMoE)]
    for moe in experts:
        for name in ("w13", "w2"):
            weight = getattr(moe, name).detach()
            if empty:
                quantized = BlockFp8(
                    torch.zeros(weight.shape, dtype=FP8, device=weight.device),
                    torch.ones(*_scale_shape(weight.shape), device=weight.device),
                )
            else:
                quantized = quantize_blocks(weight)
            _set(moe, name, quantized)
    return len(targets) + len(experts)


def _scale_shape(shape: torch.Size) -> tuple[int, ...]:
    *lead, n, k = shape
    return (*lead, blocks(n), blocks(k))


def _set(module: nn.Module, name: str, weight: BlockFp8) -> None:
    setattr(module, name, nn.Parameter(weight.data, requires_grad=False))
    setattr(module, name + SCALE_SUFFIX, nn.Parameter(weight.scale, requires_grad=False))
