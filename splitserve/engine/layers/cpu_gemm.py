"""Dense projections on the CPU through oneDNN, with each weight packed once.

PyTorch's CPU ``F.linear`` in float32 goes to MKL's GEMM, which on the AMD EPYC machines this
project runs on does not take its AVX-512 code paths. oneDNN (bundled with PyTorch as
``mkldnn``) does: with the weight reordered once into its blocked layout, a projection runs
2-2.5x faster at every row count (SmolLM2's gate|up at 32 rows: 858 -> 337 us; the 49k-row
lm_head at one row: 6.7 -> 2.9 ms; `docs/performance.md`). Results are float32 like MKL's,
summed in another order (differences of ~1e-6 relative).

Each ``nn.Linear`` keeps its packed copy beside its weight (twice the weight memory on the
CPU), repacked if the weight is replaced or written to. ``set_onednn_enabled(False)`` goes back
to ``F.linear`` (for A/B benchmarks); builds without oneDNN's linear ops never use it.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import torch
from torch import nn

_enabled = True
_PACKED = "_splitserve_onednn"
_ROWS = "_splitserve_onednn_rows"
_TILED = "_splitserve_row_tiles"
ROW_TILE = 16
"""Rows per GEMM call of a row-tiled layer (``set_row_tiles``)."""


def set_onednn_enabled(enabled: bool) -> None:
    global _enabled
    _enabled = enabled


@cache
def onednn_available() -> bool:
    ops = torch.ops.mkldnn
    if not (torch.backends.mkldnn.is_available() and hasattr(ops, "_linear_pointwise")):
        return False
    return _multiplies_ones(lambda: ops._reorder_linear_weight(torch.ones(8, 8)))


@cache
def _dense_weights_taken() -> bool:
    """Whether oneDNN's linear takes a plain (not reordered) float32 weight here."""
    return onednn_available() and _multiplies_ones(lambda: torch.ones(8, 8))


def _multiplies_ones(weight: Callable[[], torch.Tensor]) -> bool:
    """Whether oneDNN's linear gives 8s for ones times weight() (ones, 8 x 8, in the form to
    try: packed or plain)."""
    try:
        out = packed_linear(torch.ones(2, 8), weight())
    except RuntimeError:
        return False
    return bool(torch.equal(out, torch.full((2, 8), 8.0)))


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """weight ([out, in], float32 or bfloat16) in oneDNN's blocked layout for packed_linear;
    None where this torch has no oneDNN linear, or none for this dtype."""
    if not onednn_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight)
    except RuntimeError:  # e.g. a oneDNN build without bfloat16 kernels
        return None


def packed_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x @ weight.T (+ bias) through oneDNN: weight from pack_weight, or plain where
    ``_dense_weights_taken``."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def dense_gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T for a float32 weight made for this call (a dequantized one): oneDNN on the
    plain weight where it takes one, else ``F.linear``. Packing a weight used once costs more
    than it saves; unpacked, oneDNN still ran SmolLM2's gate|up at 128 rows in 2.3 ms against
    4.7 ms for MKL and 3.1 ms for the native block kernel (one AMD EPYC thread)."""
    if _enabled and x.device.type == "cpu" and _dense_weights_taken():
        return packed_linear(x.contiguous(), weight)
    return torch.nn.functional.linear(x, weight)


def onednn_linear(x: torch.Tensor, layer: nn.Linear, force: bool = False) -> torch.Tensor | None:
    """layer(x) through oneDNN for float32 CPU tensors; None where it does not apply or where
    the layer's measured choice for this many rows is F.linear (unless force)."""
    if not (_enabled and x.device.type == "cpu" and x.dtype == torch.float32):
        return None
    chosen = getattr(layer, _ROWS, None)
    if chosen is not None and not force and not chosen(x.numel() // x.shape[-1]):
        return None
    packed = _packed(layer)
    if packed is None:
        return None
    bias = None if layer.bias is None else layer.bias.detach()
    return packed_linear(x.contiguous(), packed, bias)


def set_onednn_choice(layer: nn.Linear, takes_onednn: Callable[[int], bool], ever: bool) -> None:
    """The layer takes oneDNN for a step of n rows where takes_onednn(n) (measured at load by
    ``projection_choice.py``), else ``F.linear``; one that never does (not ever) drops its
    packed copy."""
    object.__setattr__(layer, _ROWS, takes_onednn)
    if not ever and hasattr(layer, _PACKED):
        object.__delattr__(layer, _PACKED)


def prepack(model: nn.Module) -> int:
    """Packs every float32 CPU projection of the model now (at load) rather than on its first
    call; returns how many were packed."""
    if not _enabled:
        return 0
    layers = [
        m for m in model.modules() if isinstance(m, nn.Linear) and m.weight.device.type == "cpu"
    ]
    return sum(_packed(layer) is not None for layer in layers)


def _packed(layer: nn.Linear) -> torch.Tensor | None:
    """The layer's weight in oneDNN's layout, packed again if the weight changed since."""
    weight = layer.weight
    if not onednn_available() or weight.dtype != torch.float32:
        return None
    key = (weight.data_ptr(), weight._version)
    held = getattr(layer, _PACKED, None)
    if held is None or held[0] != key:
        with torch.no_grad():
            held = (key, pack_weight(weight.detach()))
        object.__setattr__(layer, _PACKED, held)
    return held[1]


def set_row_tiles(layer: nn.Linear) -> None:
    """The layer's products become batch-invariant (deterministic mode): ``tiled_linear`` on
    the CPU, the Triton kernel of ``kernels/invariant_matmul.py`` on the kernels
    (``linear.dense``)."""
    object.__setattr__(layer, _TILED, True)


def row_tiled(layer: nn.Module) -> bool:
    return bool(getattr(layer, _TILED, False))


def tiled_linear(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    """layer(x) with each row's sums in one order whatever the row count: the rows go to the
    GEMM ``ROW_TILE`` at a time, the last tile padded with zero rows, so that every call has
    the same shape. MKL and oneDNN pick their kernels by the row count (on this project's AMD
    EPYC VM a row of ``F.linear`` differs between 1-3 rows and 4 or more, oneDNN's between 1
    row and more at K = 1536) but, at one shape, sum each row alike wherever it sits in the
    tile (tests/test_batch_invariance.py checks the tiles)."""
    flat = x.reshape(-1, layer.in_features)
    rows = flat.shape[0]
    padded = flat.new_zeros(-(-rows // ROW_TILE) * ROW_TILE, layer.in_features)
    padded[:rows] = flat
    tiles = [_tile_product(tile, layer) for tile in padded.split(ROW_TILE)]
    return torch.cat(tiles)[:rows].reshape(*x.shape[:-1], layer.out_features)


def _tile_product(tile: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    out = onednn_linear(tile, layer, force=True)
    return torch.nn.functional.linear(tile, layer.weight, layer.bias) if out is None else out
