"""DeepSeek-V4's blocked prefill attention (layers/v4_prefill.py) against one masked score
matrix over the chunk's keys and entries (its reference, the engine's path before it), in
float32 on the CPU: chunks shorter and longer than the window, at a sequence's start and
after a prefix, sliding, HCA and CSA (all entries, then the indexer's picks), at once and in
passes of one block."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine.layers import v4_decode
from splitserve.engine.layers.v4_prefill import (
    Entries,
    Indexer,
    prefill_attention,
    prefill_reference,
)

HEADS, DIM, WINDOW, INDEX_HEADS, INDEX_DIM, TOPK = 4, 32, 8, 16, 16, 3
"""16 index heads: an entry whose every head scores below 0 (a score of exactly 0, tied
with any other such) comes once in 65,536."""
RATES = {"sliding": 0, "hca": 8, "csa": 4}


def chunk(kind: str, start: int, rows: int) -> tuple[torch.Tensor, torch.Tensor, Entries | None]:
    """Queries at start .. start + rows - 1, the keys their windows reach, the entries."""
    g = torch.Generator().manual_seed(7 * start + rows)
    q = torch.randn(rows, HEADS, DIM, generator=g)
    keys = torch.randn(min(start + rows, rows + WINDOW - 1), DIM, generator=g)
    rate = RATES[kind]
    if not rate:
        return q, keys, None
    count = (start + rows) // rate
    held = torch.randn(count, DIM, generator=g)
    indexer = None
    if kind == "csa":
        index_q = torch.randn(rows, INDEX_HEADS, INDEX_DIM, generator=g)
        weights = torch.randn(rows, INDEX_HEADS, generator=g)
        index_keys = torch.randn(count, INDEX_DIM, generator=g)
        indexer = Indexer(index_q, weights, index_keys, TOPK)
    return q, keys, Entries(held, rate, indexer)


@pytest.mark.parametrize("kind", ["sliding", "hca", "csa"])
@pytest.mark.parametrize("score_bytes", [None, 1], ids=["at-once", "block-passes"])
def test_blocked_prefill_attention_equals_one_masked_score_matrix(
    kind: str, score_bytes: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    if score_bytes is not None:
        monkeypatch.setattr(v4_decode, "SCORE_BYTES", score_bytes)
    sinks = torch.randn(HEADS)
    for start, rows in ((0, 1), (0, 5), (0, 8), (0, 37), (3, 1), (3, 13), (29, 40), (64, 9)):
        q, keys, entries = chunk(kind, start, rows)
        got = prefill_attention(q, keys, start, sinks, WINDOW, entries)
        expected = prefill_reference(q, keys, start, sinks, WINDOW, entries)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, msg=f"{start}, {rows}")
