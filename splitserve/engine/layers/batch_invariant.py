"""Deterministic mode on the CPU (``EngineConfig.deterministic``): a model whose every row is
computed the same way, whatever else shares its step.

A row's output must not depend on the step's row count, on where the row sits among them, or
on whether its position is a prompt token or a generated one. What chose an order by the row
count, and what this mode takes instead:

- GGUF block products (``BlockLinear``): the kernels picked their accumulators and the
  interleaved copy by the row count, and many rows switched to a dequantized GEMM. Here every
  row count takes the batch-invariant kernel (``block_matmul(..., invariant=True)``: the
  interleaved copy's one chain per output, or passes with as many accumulators at every
  count) and never the GEMM;
- float32 projections (``nn.Linear``): MKL and oneDNN choose their kernels by the row count;
  here they get fixed tiles of rows (``cpu_gemm.tiled_linear``);
- attention: a prompt chunk took prefill.c's kernel (another order than a decode row's), and a
  chunk of one token the decode kernel. The model runner lays every row out as a decode row
  in this mode (``model_runner.py``), so that every query runs decode.c's per-row walk over
  the paged cache after the step's K/V is written, in the same order whether its prefix was
  computed in this step, an earlier chunk, or came from the prefix cache (a run of a
  sequence's rows takes ``decode_rows.c``, the same operations for several rows at once); the
  whole-stack native decode (``native_decode.py``) then takes prefill steps too.

RMSNorm, rotary, SiLU-and-mul, the embedding lookups (row by row in the native kernels) and
torch's log-softmax (one row's reduction at any batch here, checked by the tests) were
invariant already. Sampling draws from (seed, token index) alone (``engine/sampler.py``).
``make_batch_invariant`` refuses what it cannot make invariant yet: sliding-window layers (torch's
SDPA), mixtures of experts, latent attention. An image's embeddings come from the vision
encoder's own batch, which this mode does not cover.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from splitserve.engine.layers.attention import TorchAttention
from splitserve.engine.layers.block_linear import BlockLinear
from splitserve.engine.layers.cpu_gemm import set_row_tiles
from splitserve.engine.layers.moe import SparseMoE
from splitserve.kernels.native.blocks import native_available


def make_batch_invariant(model: nn.Module) -> None:
    """Sets every projection of a loaded CPU model to its batch-invariant product; ValueError
    for a model with a part that has none yet."""
    _check_covered(model)
    for module in model.modules():
        if isinstance(module, BlockLinear):
            module.invariant, module.dequantize_from = True, None
        elif type(module) is nn.Linear:
            set_row_tiles(module)


def _check_covered(model: nn.Module) -> None:
    if not native_available():
        raise ValueError("deterministic mode needs the native CPU kernels (a C compiler)")
    layers: list[Any] = list(getattr(model, "layers", []))
    if not layers:
        raise ValueError(f"deterministic mode does not cover {type(model).__name__} yet")
    for layer in layers:
        attn = getattr(layer, "self_attn", None)
        backend = getattr(attn, "backend", None)
        if (
            getattr(attn, "qkv_proj", None) is None  # latent attention (DeepSeek) has none
            or type(backend) is not TorchAttention
            or backend.sliding_window is not None
        ):
            raise ValueError(
                "deterministic mode covers attention over the whole context only so far "
                f"({type(model).__name__} has another)"
            )
        if any(isinstance(m, SparseMoE) for m in layer.modules()):
            raise ValueError("deterministic mode does not cover mixtures of experts yet")
