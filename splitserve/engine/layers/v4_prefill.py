"""DeepSeek-V4 attention over a prefill chunk's queries (``layers/v4_attention.py``), in
blocks rather than one score matrix over the whole chunk.

A chunk's L queries sit at consecutive positions start .. start + L - 1. Each sees the keys
of its last ``window`` positions, the compressed entries closed at or before it (in a CSA
layer those its lightning indexer picks, ``index_topk`` at most) and its head's sink. A
score matrix over all the chunk's keys, masked down to that, would compute L + window
scores a row for at most window + index_topk useful ones (an 8k chunk: 8,320 for 640).

Here queries go in blocks of ``window`` rows (fewer where the chunk is shorter): a block's
keys are the window before its first row and its own rows (2 window - 1, a banded mask), one
batched matmul over the blocks. Entries are either all those the rows may see (HCA, and CSA
while no row sees more than index_topk) in one matmul, or each row's picks gathered (CSA).
One softmax a row over window, entries and sink, in float32; on CUDA the bfloat16 matmuls
write float32 scores (their accumulators), and the probabilities go back to the model's
dtype for the values' matmul. Rows go in passes whose scores and gathered entries stay
within ``v4_decode.SCORE_BYTES``; the indexer scores and picks within the same passes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from splitserve.engine.layers import v4_decode
from splitserve.engine.layers.lightning_indexer import choose, index_scores


@dataclass(frozen=True)
class Indexer:
    """A CSA chunk's lightning-indexer inputs: its queries' index queries [L, heads, dim]
    (rotated) and head weights [L, heads] (float32), the entries' index keys [n, dim], and
    how many entries a query keeps."""

    q: torch.Tensor
    weights: torch.Tensor
    keys: torch.Tensor
    topk: int


@dataclass(frozen=True)
class Entries:
    """A compressed layer's entries of the context [n, dim] (also the values), one per
    ``rate`` positions, and in a CSA layer the indexer that picks among them."""

    keys: torch.Tensor
    rate: int
    indexer: Indexer | None = None


def float_scores(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b in float32 (2-d or batched 3-d): half-precision inputs on CUDA keep their
    matmul's float32 accumulators; elsewhere the inputs go up to float32 first."""
    if a.is_cuda and a.dtype in (torch.bfloat16, torch.float16):
        return (torch.mm if a.dim() == 2 else torch.bmm)(a, b, out_dtype=torch.float32)
    return torch.matmul(a.float(), b.float())


def prefill_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    start: int,
    sinks: torch.Tensor,
    window: int,
    entries: Entries | None = None,
) -> torch.Tensor:
    """q [L, heads, dim] at positions start .. start + L - 1 over keys (also the values)
    [K, dim] of positions start + L - K .. start + L - 1 (every one in the queries' windows
    that exists), and ``entries``; each head's sink in the softmax. -> [L, heads, dim]."""
    rows, heads, dim = q.shape
    block = min(window, rows)
    span = _aligned(block + window - 1)
    near, near_valid = _blocks(keys, rows, block, window)
    out = torch.empty_like(q)
    per_row = _row_values(heads, dim, span, entries, q.element_size())
    step = max(1, v4_decode.score_rows(per_row) // block) * block
    for first in range(0, rows, step):
        last = min(rows, first + step)
        b0, b1 = first // block, -(-last // block)
        padding = (b1 - b0) * block - (last - first)
        far = _entry_keys(entries, start, first, last, padding)
        qb = F.pad(q[first:last], (0, 0, 0, 0, 0, padding)) if padding else q[first:last]
        part = _attend(qb, near[b0:b1], near_valid[b0:b1], sinks, far)
        out[first:last] = part[: last - first]
    return out


def _blocks(
    keys: torch.Tensor, rows: int, block: int, window: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each block's keys [blocks, dim, span] (a view of the keys padded to positions
    start - window + 1 .. the last block's end, span ``block + window - 1`` aligned) and which
    its rows see [blocks, block, span]: row i of a block sees its keys i .. i + window - 1
    that exist."""
    span, blocks = _aligned(block + window - 1), -(-rows // block)
    lead = rows + window - 1 - keys.shape[0]  # padded positions before the first key
    padded = F.pad(keys, (0, 0, lead, blocks * block - rows + span - block - window + 1))
    at = torch.arange(padded.shape[0], device=keys.device)
    exists = (at >= lead) & (at < rows + window - 1)
    offset = (
        torch.arange(span, device=keys.device) - torch.arange(block, device=keys.device)[:, None]
    )
    band = (offset >= 0) & (offset < window)
    return padded.unfold(0, span, block), band & exists.unfold(0, span, block)[:, None, :]


def _aligned(n: int) -> int:
    """n rounded up to a multiple of 8: a score row's width, so that rows of bfloat16
    probabilities start on 16 bytes (cuBLAS takes its Hopper kernels, not align-1 ones)."""
    return -(-n // 8) * 8


def _row_values(heads: int, dim: int, span: int, entries: Entries | None, size: int) -> int:
    """A query row's float32 scores and, in CSA, its gathered entries (of ``size`` bytes a
    value) or its index scores, whichever are more (the index scores are gone before the
    entries are gathered), in float32 values: what ``score_rows`` counts."""
    if entries is None:
        return heads * span
    count, index = entries.keys.shape[0], entries.indexer
    if index is None or count <= index.topk:
        return heads * (span + count)
    gathered = size * dim * index.topk // 4
    return max(heads * (span + index.topk) + gathered, index.q.shape[1] * count)


def _entry_keys(
    entries: Entries | None, start: int, first: int, last: int, padding: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The entries that the chunk's rows first .. last - 1 (then ``padding`` rows more,
    seeing nothing more) attend to, and which each row sees: all those closed by row last - 1
    [m, dim] with [R, m], or each row's picks [R, k, dim] with [R, k]; None while none is
    closed."""
    if entries is None:
        return None
    rate, keys = entries.rate, entries.keys
    count = min(keys.shape[0], (start + last) // rate)
    if count == 0:
        return None
    seen = torch.arange(start + first + 1, start + last + 1, device=keys.device)[:, None] // rate
    index = entries.indexer
    if index is None or count <= index.topk:
        width = _aligned(count)  # the entries past count are zeros no row sees
        visible = torch.arange(width, device=keys.device)[None, :] < seen
        visible = F.pad(visible, (0, 0, 0, padding), value=True) if padding else visible
        return F.pad(keys[:count], (0, 0, 0, width - count)), visible
    picks = pick(index, first, last, count, seen)
    if padding:
        picks = F.pad(picks, (0, 0, 0, padding), value=-1)
    return keys[picks.clamp(min=0)], picks >= 0


def pick(index: Indexer, first: int, last: int, count: int, seen: torch.Tensor) -> torch.Tensor:
    """[R, min(topk, count)]: the entries (of the first ``count``) that the chunk's rows
    first .. last - 1 attend to, the ``topk`` best by the indexer's scores (``torch.topk``)
    of the ``seen`` [R, 1] each may see, -1 in place of any past those (a row that sees
    fewer)."""
    q, weights = index.q[first:last], index.weights[first:last]
    rows, heads, dim = q.shape
    scores = float_scores(q.reshape(rows * heads, dim), index.keys[:count].t())
    scores = scores.view(rows, heads, count).relu_()
    score = torch.bmm(weights[:, None, :], scores)[:, 0] * dim**-0.5
    visible = torch.arange(count, device=q.device)[None, :] < seen
    picks = score.masked_fill_(~visible, -torch.inf).topk(min(index.topk, count), dim=-1).indices
    return picks.masked_fill_(picks >= seen, -1)


def _attend(
    q: torch.Tensor,
    near: torch.Tensor,
    near_valid: torch.Tensor,
    sinks: torch.Tensor,
    far: tuple[torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    """One pass: q [R, heads, dim] (whole blocks) over its blocks' keys near [blocks, dim,
    span] where near_valid [blocks, block, span], and the entries ``far`` (``_entry_keys``).
    -> [R, heads, dim]."""
    rows, heads, dim = q.shape
    blocks, _, span = near.shape
    block = rows // blocks
    scores = [float_scores(q.view(blocks, block * heads, dim), near).view(rows, heads, span)]
    masks = [near_valid.reshape(rows, 1, span)]
    if far is not None:
        far_keys, far_valid = far
        if far_keys.dim() == 2:  # every row's the same entries
            s = float_scores(q.view(rows * heads, dim), far_keys.t()).view(rows, heads, -1)
        else:
            s = float_scores(q, far_keys.transpose(1, 2))
        scores.append(s)
        masks.append(far_valid[:, None, :])
    scale = dim**-0.5
    scores.append((sinks.float() / scale)[None, :, None].expand(rows, -1, 1))  # scaled below
    masks.append(masks[0].new_ones(1, 1, 1).expand(rows, 1, 1))
    logits = torch.cat(scores, dim=-1).mul_(scale)
    probs = logits.masked_fill_(~torch.cat(masks, dim=-1), -torch.inf).softmax(dim=-1)
    near_probs = probs[..., :span].to(q.dtype)  # in half precision a copy of its own
    out = torch.bmm(near_probs.view(blocks, block * heads, span), near.transpose(1, 2))
    out = out.view(rows, heads, dim)
    if far is None:
        return out
    far_probs = probs[..., span:-1].to(q.dtype)
    if far_keys.dim() == 2:
        flat = far_probs.reshape(rows * heads, -1)
        return torch.addmm(out.view(rows * heads, dim), flat, far_keys).view(rows, heads, dim)
    return torch.baddbmm(out, far_probs, far_keys)


def prefill_reference(
    q: torch.Tensor,
    keys: torch.Tensor,
    start: int,
    sinks: torch.Tensor,
    window: int,
    entries: Entries | None = None,
) -> torch.Tensor:
    """``prefill_attention`` as one masked score matrix over every key and entry of the
    chunk (the engine's path before it, its arguments the same): the reference of the
    tests and ``benchmarks/kernels/v4_prefill.py``."""
    end = start + q.shape[0]
    positions = torch.arange(start, end, device=q.device)
    ahead = torch.arange(end - keys.shape[0], end, device=q.device)[None, :] - positions[:, None]
    mask = (ahead <= 0) & (ahead > -window)
    if entries is not None:
        seen = (positions + 1) // entries.rate
        count = entries.keys.shape[0]
        visible = torch.arange(count, device=q.device)[None, :] < seen[:, None]
        index = entries.indexer
        if index is not None:
            scores = index_scores(index.q, index.weights, index.keys)
            visible = choose(scores, seen, index.topk)
        keys = torch.cat([keys, entries.keys])
        mask = torch.cat([mask, visible], dim=1)
    return v4_decode.sink_attention(q, keys, mask, sinks)
