"""Deterministic mode's kernels: every row the same bits alone or among others."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from splitserve.kernels.invariant_matmul import (
    invariant_matmul,
    invariant_matmul_ref,
    num_splits,
)

# Triton's interpreter computes bfloat16 dots on raw bits: bfloat16 runs on the GPU only.
TOL = {torch.float32: 1e-4, torch.float16: 2e-2}


@pytest.mark.parametrize(
    ("n", "k", "bias", "dtype"),
    [
        (192, 256, True, torch.float32),
        (192, 1024, False, torch.float16),
        (130, 1000, True, torch.float32),
    ],
)
def test_invariant_matmul_rows_equal_alone_and_batched(
    n: int, k: int, bias: bool, dtype: torch.dtype
) -> None:
    torch.manual_seed(n + k)
    x = torch.randn(70, k, dtype=dtype)
    weight = torch.randn(n, k, dtype=dtype) / k**0.5
    b = torch.randn(n, dtype=dtype) if bias else None
    full = invariant_matmul(x, weight, b)
    torch.testing.assert_close(
        full.float(), invariant_matmul_ref(x, weight, b), atol=TOL[dtype], rtol=TOL[dtype]
    )
    for row in (0, 37, 69):
        assert torch.equal(invariant_matmul(x[row : row + 1], weight, b)[0], full[row])
    assert torch.equal(invariant_matmul(x[5:40], weight, b), full[5:40])


def test_invariant_matmul_split_count_reads_only_the_weight_shape() -> None:
    assert num_splits(192, 256) == 1
    assert num_splits(192, 1024) == 2
    assert num_splits(4096, 4096) == 4  # Llama-3-8B o_proj: 32 column tiles x 4
    assert num_splits(4096, 14336) == 4
    assert num_splits(28672, 4096) == 1
