"""CPU projections with bfloat16 weights (``EngineConfig.cpu_weights="bfloat16"``, opt-in).

A step of many rows (batch-32 decode, prefill) is compute-bound on a CPU. CPUs with AVX512-BF16
(AMD Zen 4, Intel Cooper Lake and later) or AMX multiply bfloat16 pairs at twice to many times
their float32 rate, and oneDNN takes those instructions for a weight packed once in its
layout: SmolLM2's gate|up at 32 rows ran at 212 GFLOP/s on one Zen 4 thread against 68 for
the native Q4_1 kernel and about 80 for oneDNN in float32 (docs/performance.md).

``Bf16Linear`` keeps only the bfloat16 weight (packed for oneDNN where this torch has its
linear ops, else plain for ``F.linear``). Its input is rounded to bfloat16 and its output
comes back in bfloat16 (neither PyTorch CPU op returns float32 from bfloat16 inputs), then
returns to the caller's dtype: everything between the projections (norms, rotary, attention,
the KV cache, the residual stream) stays float32. That changes the arithmetic against the
float32 oracle, so this mode is not the default; its agreement with transformers is measured
(tests/test_bf16_weights.py, docs/performance.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.engine.layers.cpu_gemm import pack_weight, packed_linear
from splitserve.engine.layers.moe import SparseMoE


class Bf16Linear(nn.Module):
    """y = bf16(x) @ bf16(W).T (+ bias in float32), returned in x's dtype."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().to(torch.bfloat16)
        self.packed = pack_weight(weight)
        self.weight: torch.Tensor | None = None if self.packed is not None else weight
        """The plain bfloat16 weight, kept only where there is no oneDNN packed copy."""
        self.bias = None if linear.bias is None else linear.bias.detach().float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        if self.packed is not None:
            out = packed_linear(flat, self.packed)
        else:
            assert self.weight is not None
            out = F.linear(flat, self.weight)
        out = out.to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def held_bytes(self) -> int:
        """The bfloat16 weight's bytes (held outside parameters: the roofline counts them)."""
        return self.in_features * self.out_features * 2

    def extra_repr(self) -> str:
        packed = "oneDNN-packed" if self.packed is not None else "plain"
        return f"in={self.in_features}, out={self.out_features}, bfloat16 {packed}"


def to_bf16_layers(model: nn.Module) -> int:
    """Replaces every float32 CPU ``nn.Linear`` of the model (the projections and the LM
    head; a tied LM head gets its own bfloat16 copy, the embedding stays float32) by a
    ``Bf16Linear``; returns how many were replaced. A mixture-of-experts layer keeps its
    router in float32 (the experts' choice would move with its rounding) and its experts
    as they are."""
    inside_moe = {
        id(sub) for moe in model.modules() if isinstance(moe, SparseMoE) for sub in moe.modules()
    }
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if type(module) is nn.Linear
        and id(module) not in inside_moe
        and module.weight.device.type == "cpu"
        and module.weight.dtype == torch.float32
    ]
    for name, module in targets:
        model.set_submodule(name, Bf16Linear(module))
    return len(targets)
