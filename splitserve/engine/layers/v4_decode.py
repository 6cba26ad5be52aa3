"""DeepSeek-V4 attention's decode rows in one batch (``layers/v4_attention.py``): the
softmax with sinks and the entries' gather that its torch path uses, the torch reference of
``kernels/v4_decode.py`` built from them (a row at a time), the state rows of the windows a
step's decode rows close (gathered in fixed shapes), and the launches of the kernels (the
lightning indexer's, then the attention's) for those rows; on the same kernels, a prefill
chunk's rows, each a decode row over its own context."""

from __future__ import annotations

import torch

from splitserve.engine.layers.attention import AttentionMetadata

Entries = tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]
"""(entry_cache [blocks, block_size, piece], group 0's tables [B, width], context_lens [B],
rate): a compressed layer's entries for a batch of decode rows."""


def decode_reference(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    key_tables: torch.Tensor,
    key_lens: torch.Tensor,
    sinks: torch.Tensor,
    window: int,
    entries: Entries | None = None,
    index: torch.Tensor | None = None,
) -> torch.Tensor:
    """``kernels/v4_decode.py: v4_decode_attention`` in torch, its arguments the same: each
    row's query over the last ``window`` of its key rows and, in a compressed layer, the
    entries of its context (those of its index list where one is given)."""
    out = torch.empty_like(q)
    for row, key_len in enumerate(key_lens.tolist()):
        keys = key_cache[key_tables[row]].flatten(0, 1)[max(0, key_len - window) : key_len]
        mask = torch.ones(1, keys.shape[0], dtype=torch.bool, device=q.device)
        if entries is not None:
            entry_cache, tables, lens, rate = entries
            count = int(lens[row]) // rate
            held = held_entries(entry_cache, tables[row], count, rate)[:, : q.shape[-1]]
            chosen = torch.ones(1, count, dtype=torch.bool, device=q.device)
            if index is not None:
                picked = index[row][(index[row] >= 0) & (index[row] < count)]
                chosen = torch.zeros_like(chosen).index_fill_(1, picked, True)
            keys = torch.cat([keys, held])
            mask = torch.cat([mask, chosen], dim=1)
        out[row] = sink_attention(q[row : row + 1], keys, mask, sinks)[0]
    return out


def sink_attention(
    q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, sinks: torch.Tensor
) -> torch.Tensor:
    """q [L, heads, dim] over keys (also the values) [K, dim] where mask [L, K], with each
    head's sink (sinks [heads]) in the softmax, in float32; in passes of rows whose scores
    stay within SCORE_BYTES (an 8k-token prefill's would take 16 GiB at once)."""
    rows = score_rows(q.shape[1] * keys.shape[0])
    if q.shape[0] > rows:
        passes = range(0, q.shape[0], rows)
        return torch.cat(
            [sink_attention(q[i : i + rows], keys, mask[i : i + rows], sinks) for i in passes]
        )
    scores = torch.einsum("lhd,kd->hlk", q.float(), keys.float()) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~mask[None], -torch.inf)
    sink = sinks.float()[:, None, None].expand(-1, q.shape[0], 1)
    logits = torch.cat([scores, sink], dim=-1)
    probs = (logits - logits.amax(dim=-1, keepdim=True)).softmax(dim=-1)[..., :-1]
    return torch.einsum("hlk,kd->lhd", probs, keys.float()).to(q.dtype)


SCORE_BYTES = 256 << 20
SPLIT = 256
"""Keys a program of the decode kernel takes (``kernels/v4_decode.py``: a row's window and
entries in splits of this many, merged after)."""


def score_rows(scores_per_row: int) -> int:
    """How many query rows of ``scores_per_row`` float32 scores fit in SCORE_BYTES (a context
    with no compressed entry yet has none: every row at once)."""
    return max(1, SCORE_BYTES // max(4 * scores_per_row, 1))


def held_entries(
    entry_cache: torch.Tensor, table: torch.Tensor, count: int, rate: int
) -> torch.Tensor:
    """The first ``count`` compressed entries [count, rate * piece] in entry_cache [blocks,
    block_size, piece], read through group 0's table of a sequence: entry i's pieces fill
    slots i * rate .. (i + 1) * rate - 1."""
    block_size, piece = entry_cache.shape[1], entry_cache.shape[2]
    held = entry_cache[table[: -(-count * rate // block_size)]].flatten(0, 1)
    return held[: count * rate].reshape(count, rate * piece)


def closing_windows(
    state_cache: torch.Tensor,
    state_meta: AttentionMetadata,
    lens: torch.Tensor,
    rate: int,
    reach: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """For decode rows whose contexts are lens [n]: the window each one's position closes if
    any (lens // rate - 1, at least 0) and its state rows [n, reach, width], those of
    positions (window + 1) * rate - reach .. (window + 1) * rate - 1, read from state_cache
    [blocks, block_size, width] through the state group's tables (state_meta), whose first
    row is at position lens - the group's context length. Positions off a row's table read
    one of its rows instead: fixed shapes, and no length goes to the host."""
    n, block_size = lens.shape[0], state_cache.shape[1]
    windows = (lens // rate - 1).clamp(min=0)
    offsets = torch.arange(rate - reach, rate, device=lens.device)
    positions = windows[:, None] * rate + offsets
    first = lens - state_meta.decode_context_lens[:n]
    tables = state_meta.decode_block_tables[:n]
    rows = (positions - first[:, None]).clamp(0, tables.shape[1] * block_size - 1)
    blocks = tables.gather(1, rows // block_size)
    return windows, state_cache[blocks, rows % block_size]


Indexing = tuple[torch.Tensor, torch.Tensor, int, int]
"""(index queries [B, heads, dim], head weights [B, heads], the index keys' offset in an
entry, topk): a CSA layer's lightning indexer for a batch of rows."""


def decode_kernels(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    keys: tuple[torch.Tensor, torch.Tensor],
    sinks: torch.Tensor,
    window: int,
    entries: Entries | None,
    indexer: Indexing | None,
) -> torch.Tensor:
    """The rows q [n, heads, dim] over their window (keys: the key group's tables [n, width]
    and context lengths [n]) and entries; in a CSA layer ``indexer`` picks them. Every launch
    reads its lengths on the device."""
    from splitserve.kernels.v4_decode import v4_decode_attention  # lazy: Triton
    from splitserve.kernels.v4_indexer import index_scores, select_topk

    index = None
    if indexer is not None and entries is not None:
        index_q, weights, offset, topk = indexer
        index = select_topk(index_scores(index_q, weights, entries, offset), topk)
    tables, lens = keys
    return v4_decode_attention(q, key_cache, tables, lens, sinks, window, entries, index, SPLIT)


def prefill_kernels(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    keys: tuple[torch.Tensor, torch.Tensor],
    sinks: torch.Tensor,
    window: int,
    entries: Entries | None,
) -> torch.Tensor:
    """A prefill chunk's rows of a layer without an indexer through the decode kernel, each
    row a decode row over its own context (``keys`` and ``entries`` as ``decode_kernels``', a
    row's lengths up to its position), in passes whose partial outputs (where a row's keys
    take more than one split) stay within SCORE_BYTES."""
    held = 0
    if entries is not None:
        held = entries[1].shape[1] * entries[0].shape[1] // entries[3]
    splits = -(-(window + held) // SPLIT)
    rows = q.shape[0]
    if splits > 1:
        rows = score_rows(q.shape[1] * (splits + 1) * (q.shape[2] + 1))
    out = torch.empty_like(q) if rows < q.shape[0] else None
    for i in range(0, q.shape[0], rows):
        r = slice(i, i + rows)
        part = None if entries is None else (entries[0], entries[1][r], entries[2][r], entries[3])
        got = decode_kernels(q[r], key_cache, (keys[0][r], keys[1][r]), sinks, window, part, None)
        if out is None:
            return got
        out[r] = got
    assert out is not None
    return out
