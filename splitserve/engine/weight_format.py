"""Which of a GGUF checkpoint's weights the CPU keeps in their quantized blocks.

With ``dtype="auto"`` on the CPU, every projection and embedding whose tensors the file stores
in a block type the native kernels read (Q4_0, Q4_1, Q8_0) stays in those blocks
(``engine/layers/block_linear.py``); a fused projection (q|k|v, gate|up) does when all its
parts share one such type, and a projection with a bias (Qwen2's q|k|v) is dequantized.
Everything else, everything with ``dtype="float32"`` (the
oracle tests' mode), and everything with ``cpu_weights="bfloat16"`` (then converted,
``engine/layers/bf16_linear.py``) is dequantized to float32 as before.
"""

from __future__ import annotations

from typing import Protocol

from torch import nn

from splitserve.engine.config import EngineConfig
from splitserve.engine.loader import gguf_tensor_types, is_gguf
from splitserve.kernels.native.blocks import BLOCK_BYTES, native_available


class WeightTargets(Protocol):
    def weight_target(self, hf_name: str) -> tuple[str, int]: ...

    def get_submodule(self, target: str) -> nn.Module: ...


def keeps_blocks(config: EngineConfig, path: str) -> bool:
    return (
        config.device == "cpu"
        and config.dtype == "auto"
        and config.cpu_weights == "auto"
        and is_gguf(path)
        and native_available()
    )


def block_weight_plan(
    config: EngineConfig, path: str, model: WeightTargets, tied_embeddings: bool
) -> tuple[dict[str, int], frozenset[str]]:
    """(our parameter name -> GGUF type for each weight kept in blocks, the checkpoint's
    tensor names to load as blocks). Empty where the blocks are not kept."""
    if not keeps_blocks(config, path):
        return {}, frozenset()
    sources: dict[str, list[tuple[str, int]]] = {}
    for hf_name, qtype in gguf_tensor_types(path).items():
        if not hf_name.endswith(".weight") or "rope_freqs" in hf_name:
            continue
        if hf_name == "lm_head.weight" and tied_embeddings:
            continue
        param, _ = model.weight_target(hf_name)
        sources.setdefault(param, []).append((hf_name, qtype))
    plan = {
        param: parts[0][1]
        for param, parts in sources.items()
        if parts[0][1] in BLOCK_BYTES
        and len({qtype for _, qtype in parts}) == 1
        and getattr(model.get_submodule(param.removesuffix(".weight")), "bias", None) is None
    }
    keep = frozenset(name for param in plan for name, _ in sources[param])
    return plan, keep
