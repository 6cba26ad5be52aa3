"""DeepSeek-V4 attention's decode rows in one batch: the torch reference of
``kernels/v4_decode.py`` (a row at a time, through the torch path's own ``sink_attention``
and ``held_entries``)."""

from __future__ import annotations

import torch

from splitserve.engine.layers.v4_attention import held_entries, sink_attention


def decode_reference(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    key_tables: torch.Tensor,
    key_lens: torch.Tensor,
    sinks: torch.Tensor,
    window: int,
    entries: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None = None,
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
