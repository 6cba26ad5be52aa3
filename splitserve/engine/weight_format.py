"""Which of a GGUF checkpoint's weights the CPU keeps in their quantized blocks.

With ``dtype="auto"`` on the CPU, every projection and embedding whose tensors the file stores
in a block type the native kernels read (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K) stays in those
blocks (``engine/layers/block_linear.py``); a fused projection (q|k|v, gate|up) does when all
its parts share one such type, or as Q8_0 when its parts mix Q8_0, Q5_0 and Q4_0 (Gemma 3
270M's q|k|v in its Q4_K_M file: Q5_0 q and k, a Q8_0 v): those re-encode as Q8_0 on the way
in without changing a weight (``blocks.to_q8_0``). A projection with a bias (Qwen2's q|k|v) is
dequantized, and so is a fused projection of other mixed types. Everything else, everything
with ``dtype="float32"`` (the oracle tests' mode), and everything with
``cpu_weights="bfloat16"`` (then converted, ``engine/layers/bf16_linear.py``) or
``quantization="fp8"`` (then quantized, ``engine/layers/fp8_linear.py``) is dequantized
to float32 as before.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from splitserve.engine.config import EngineConfig
from splitserve.engine.fp8_weights import fp8_targets, is_fp8_checkpoint, to_fp8_layers
from splitserve.engine.layers.bf16_linear import to_bf16_layers
from splitserve.engine.layers.block_linear import to_block_layers
from splitserve.engine.loader import gguf_tensor_types, is_gguf, iter_weights, text_weights
from splitserve.kernels.native.blocks import (
    BLOCK_BYTES,
    Q8_0,
    WIDENS_TO_Q8_0,
    native_available,
    to_q8_0,
)


class WeightTargets(Protocol):
    def weight_target(self, hf_name: str) -> tuple[str, int]: ...

    def weight_targets(self, hf_name: str) -> list[tuple[str, int]]: ...

    def get_submodule(self, target: str) -> nn.Module: ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None: ...


def load_checkpoint(config: EngineConfig, model: nn.Module, path: str) -> bool:
    """Loads the checkpoint at path into the model, the GGUF blocks the CPU keeps as they
    are, and with ``quantization="fp8"`` a DeepSeek-format FP8 checkpoint's e4m3 blocks and
    scales as they are (into FP8 layers made for them first). Returns True for the latter."""
    fp8 = config.quantization == "fp8" and is_fp8_checkpoint(path)
    if fp8:
        to_fp8_layers(model, empty=True)
    targets: WeightTargets = model  # type: ignore[assignment]
    tied = bool(model.config.tie_word_embeddings)  # type: ignore[union-attr]
    plan = block_weight_plan(config, path, targets, tied)
    to_block_layers(model, plan.types)
    keep = fp8_targets(model, targets.weight_targets) if fp8 else None
    stream = iter_weights(path, model.config, plan.keep, keep)  # type: ignore[arg-type]
    targets.load_weights(text_weights(plan.weights(stream)))
    return fp8


def convert_weights(config: EngineConfig, model: nn.Module, loaded_fp8: bool) -> None:
    """The loaded weights into the formats the config asks for (bfloat16 on the CPU, FP8)."""
    if torch.device(config.device).type == "cpu" and config.cpu_weights == "bfloat16":
        to_bf16_layers(model)
    if config.quantization == "fp8" and not loaded_fp8:
        to_fp8_layers(model)


@dataclass(frozen=True)
class BlockPlan:
    types: dict[str, int] = field(default_factory=dict)
    """Our parameter name -> the GGUF type it is kept in."""
    keep: frozenset[str] = frozenset()
    """The checkpoint's tensor names to load as blocks."""
    widen: dict[str, int] = field(default_factory=dict)
    """Checkpoint tensor name -> its type, for the parts re-encoded as Q8_0 on the way in."""

    def weights(
        self, stream: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors, the widened parts as Q8_0 blocks."""
        for name, tensor in stream:
            qtype = self.widen.get(name)
            yield name, tensor if qtype is None else to_q8_0(tensor, qtype)


def keeps_blocks(config: EngineConfig, path: str) -> bool:
    return (
        config.device == "cpu"
        and config.dtype == "auto"
        and config.cpu_weights == "auto"
        and config.quantization is None
        and is_gguf(path)
        and native_available()
    )


def block_weight_plan(
    config: EngineConfig, path: str, model: WeightTargets, tied_embeddings: bool
) -> BlockPlan:
    """The weights kept in blocks; empty where the blocks are not kept."""
    if not keeps_blocks(config, path):
        return BlockPlan()
    sources: dict[str, list[tuple[str, int]]] = {}
    for hf_name, qtype in gguf_tensor_types(path).items():
        if not hf_name.endswith(".weight") or "rope_freqs" in hf_name:
            continue
        if hf_name == "lm_head.weight" and tied_embeddings:
            continue
        param, _ = model.weight_target(hf_name)
        sources.setdefault(param, []).append((hf_name, qtype))
    types: dict[str, int] = {}
    widen: dict[str, int] = {}
    for param, parts in sources.items():
        module = model.get_submodule(param.removesuffix(".weight"))
        if (
            not isinstance(module, nn.Linear | nn.Embedding)
            or getattr(module, "bias", None) is not None
        ):
            continue
        kinds = {qtype for _, qtype in parts}
        if len(kinds) == 1 and parts[0][1] in BLOCK_BYTES:
            types[param] = parts[0][1]
        elif kinds <= WIDENS_TO_Q8_0 | {Q8_0}:
            types[param] = Q8_0
            widen.update((name, qtype) for name, qtype in parts if qtype != Q8_0)
    keep = frozenset(name for param in types for name, _ in sources[param])
    return BlockPlan(types, keep, widen)
