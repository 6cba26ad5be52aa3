"""Deterministic mode on the Triton kernels (``EngineConfig.deterministic`` on CUDA; on the CPU
under the Triton interpreter in the tests): the GPU counterpart of ``batch_invariant.py``.

What chose its reduction order by the step, and what this mode takes instead:

- projections and the LM head: cuBLAS (``F.linear``) picks its tile and split-K by the row
  count, and one-row steps took the GEMV (``kernels/gemv.py``) with the RMSNorm folded in.
  Here every ``nn.Linear`` takes ``kernels/invariant_matmul.py`` at every row count (one tile
  shape, a split-K from the weight's shape alone), and the RMSNorm and SiLU their own per-row
  kernels (``layers/linear.py``);
- attention: the decode kernel split the context by the batch size, the fused decode kernel
  had its own rotary, and prompt chunks took the prefill kernel (another order, fresh keys
  from registers). Here every row takes ``InvariantAttention``;
- mixtures of experts (``SparseMoE``: Mixtral, Qwen3-MoE): the grouped GEMM chose its tile
  height by the rows routed, and the combine summed a token's experts by a reduction tree in
  small steps and by torch in large ones. Here the router's gate is an ``nn.Linear`` like the
  others, the grouped GEMM takes ``INVARIANT_TILES`` and the combine ``ordered_combine`` (a
  token's experts added in slot order) at every step.

RMSNorm (a program a row, its width from the hidden size), SiLU-and-mul, rotary with the K/V
write, the embedding lookup and the greedy argmax (fixed chunks of the vocabulary) were per
row already. Sampling draws on the host from (seed, token index) (``engine/sampler.py``).
``make_kernels_invariant`` refuses what it cannot make invariant yet: sliding-window layers,
latent attention, MoE layers of other kinds (DeepSeek's shared experts) or spread over
expert-parallel ranks.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from splitserve.engine.layers.attention import AttentionBackend
from splitserve.engine.layers.cpu_gemm import set_row_tiles
from splitserve.engine.layers.moe import SparseMoE


def make_kernels_invariant(model: nn.Module) -> None:
    """Gives every projection of a model on the Triton kernels its batch-invariant product and
    every attention layer ``InvariantAttention``, every MoE layer its fixed tiles and combine
    order; ValueError for a model with a part that has none yet."""
    from splitserve.engine.layers.invariant_attention import InvariantAttention  # Triton: optional

    layers: list[Any] = list(getattr(model, "layers", []))
    if not layers:
        raise ValueError(f"deterministic mode does not cover {type(model).__name__} yet")
    # One replacement per backend, so that the layers sharing one share its step cache; the
    # originals are held until the end, so no id is reused meanwhile.
    replaced: dict[int, tuple[AttentionBackend, AttentionBackend]] = {}
    for layer in layers:
        attn: Any = getattr(layer, "self_attn", None)
        backend: AttentionBackend | None = getattr(attn, "backend", None)
        if getattr(attn, "qkv_proj", None) is None or backend is None:
            raise ValueError(
                f"deterministic mode covers grouped-query attention only ({type(model).__name__})"
            )
        for moe in (m for m in layer.modules() if isinstance(m, SparseMoE)):
            if type(moe) is not SparseMoE or moe.ep is not None:
                raise ValueError(
                    f"deterministic mode covers plain MoE layers on one device only, not "
                    f"{type(moe).__name__} (expert parallel: {moe.ep is not None})"
                )
            moe.invariant = True
        if id(backend) not in replaced:
            replaced[id(backend)] = backend, InvariantAttention.replacing(backend)
        attn.backend = replaced[id(backend)][1]
    for module in model.modules():
        if type(module) is nn.Linear:
            set_row_tiles(module)
