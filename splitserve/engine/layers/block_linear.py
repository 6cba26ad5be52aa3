"""Projections and embeddings whose weights stay in a GGUF file's quantized blocks (CPU).

SmolLM2's file stores every projection as Q4_1 and the (tied) embedding as Q8_0: about 100 MB
against 540 MB dequantized to float32, and CPU decode is bound by the bytes it reads per token.
``BlockLinear`` keeps the blocks (``weight``: uint8 ``[N, K / 32 * block_bytes]``, a parameter
so that ``load_weights`` copies rows into it like any weight) and multiplies through the native
kernel, which dequantizes each block on the fly with gguf's own float32 operations: the result
equals the dequantized checkpoint's up to summation order. Where the measured choice says so
(``engine/layers/projection_choice.py``), rows past a threshold dequantize the whole weight and
take a float32 GEMM instead (oneDNN where torch has it, ``cpu_gemm.dense_gemm``).

``to_block_layers`` swaps a model's ``nn.Linear`` / ``nn.Embedding`` modules for these before
its weights are loaded.
"""

from __future__ import annotations

import torch
from torch import nn

from splitserve.engine.layers.cpu_gemm import dense_gemm
from splitserve.kernels.native.blocks import (
    block_matmul,
    dequantize_rows,
    in_features,
    interleave,
    row_bytes,
)


class BlockLinear(nn.Module):
    """y = x @ dequantize(weight).T, without a float copy of the weight."""

    def __init__(self, in_features: int, out_features: int, qtype: int) -> None:
        super().__init__()
        self.in_features, self.out_features, self.qtype = in_features, out_features, qtype
        blocks = torch.zeros(out_features, row_bytes(qtype, in_features), dtype=torch.uint8)
        self.weight = nn.Parameter(blocks, requires_grad=False)
        self.dequantize_from: int | None = None
        """Steps of at least this many rows dequantize the weight and take a GEMM (as
        measured at load, ``projection_choice.py``); None: every step takes the native kernel."""
        self.interleaved: torch.Tensor | None = None
        """The weight's interleaved copy (``interleave``), which the AVX-512 kernel takes from a
        few rows; made by ``interleave_blocks`` once the weight is loaded."""
        self.invariant = False
        """Batch-invariant products: each row's output the same bits at any row count
        (deterministic mode, ``batch_invariant.py``; never with ``dequantize_from``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if self.dequantize_from is None or flat.shape[0] < self.dequantize_from:
            il, invariant = self.interleaved, self.invariant
            out = block_matmul(flat, self.weight, self.qtype, interleaved=il, invariant=invariant)
        else:
            out = dense_gemm(flat, self.dequantized())
        return out.reshape(*x.shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        rows = torch.arange(self.out_features)
        return dequantize_rows(self.weight, self.qtype, rows)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, qtype={self.qtype}"


class BlockEmbedding(nn.Module):
    """Token embeddings from quantized rows: a lookup dequantizes only the rows it reads."""

    def __init__(self, num_embeddings: int, embedding_dim: int, qtype: int) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.qtype = num_embeddings, embedding_dim, qtype
        blocks = torch.zeros(num_embeddings, row_bytes(qtype, embedding_dim), dtype=torch.uint8)
        self.weight = nn.Parameter(blocks, requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = dequantize_rows(self.weight, self.qtype, ids)
        return rows.reshape(*ids.shape, self.embedding_dim)


def to_block_layers(model: nn.Module, qtypes: dict[str, int]) -> int:
    """Replaces each module whose ``<module>.weight`` is in qtypes (parameter name -> GGUF
    type) by its block-weight form; a replaced embedding stays tied to an lm_head that shared
    its weight. Returns how many modules were replaced."""
    tied = _tied_pairs(model)
    replaced = 0
    for name, qtype in qtypes.items():
        module_name = name.removesuffix(".weight")
        module = model.get_submodule(module_name)
        new: BlockLinear | BlockEmbedding
        if isinstance(module, nn.Linear):
            new = BlockLinear(module.in_features, module.out_features, qtype)
        elif isinstance(module, nn.Embedding):
            new = BlockEmbedding(module.num_embeddings, module.embedding_dim, qtype)
        else:
            raise TypeError(f"{module_name} is a {type(module).__name__}, not a projection")
        model.set_submodule(module_name, new)
        replaced += 1
        for other in tied.get(module_name, ()):
            blocks = new.weight
            linear = BlockLinear(in_features(qtype, blocks), blocks.shape[0], qtype)
            linear.weight = blocks
            model.set_submodule(other, linear)
    return replaced


def interleave_blocks(model: nn.Module) -> None:
    """Gives every ``BlockLinear`` of a loaded model its interleaved copy (where the kernels run
    on AVX-512; the same bytes again as the blocks, SmolLM2: +96 MB)."""
    for module in model.modules():
        if isinstance(module, BlockLinear):
            module.interleaved = interleave(module.weight.data, module.qtype)


def _tied_pairs(model: nn.Module) -> dict[str, list[str]]:
    """Module name -> the other modules holding the very same weight tensor."""
    owners: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and isinstance(module, nn.Linear | nn.Embedding):
            owners.setdefault(id(weight), []).append(name)
    return {names[0]: names[1:] for names in owners.values() if len(names) > 1}
