"""Host-memory tier of the block store: CPU tensors under a byte budget, LRU first out."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass
class HostEntry:
    tensor: torch.Tensor
    expiry: float

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


class HostTier:
    """Blocks in host memory; ``put`` returns the entries it pushed out (for demotion)."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.used_bytes = 0
        self._entries: OrderedDict[int, HostEntry] = OrderedDict()

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[int]:
        """Hashes from least to most recently used."""
        return list(self._entries)

    def get(self, block_hash: int) -> HostEntry | None:
        """The entry, now the most recently used; None if absent."""
        entry = self._entries.get(block_hash)
        if entry is not None:
            self._entries.move_to_end(block_hash)
        return entry

    def put(self, block_hash: int, entry: HostEntry) -> list[tuple[int, HostEntry]]:
        """Insert or replace; returns the least recently used entries evicted to fit it.

        A block larger than the whole budget is not kept: it comes back as the only victim.
        """
        self.pop(block_hash)
        if entry.nbytes > self.budget_bytes:
            return [(block_hash, entry)]
        victims: list[tuple[int, HostEntry]] = []
        while self.used_bytes + entry.nbytes > self.budget_bytes:
            victim_hash, victim = self._entries.popitem(last=False)
            self.used_bytes -= victim.nbytes
            victims.append((victim_hash, victim))
        self._entries[block_hash] = entry
        self.used_bytes += entry.nbytes
        return victims

    def pop(self, block_hash: int) -> HostEntry | None:
        entry = self._entries.pop(block_hash, None)
        if entry is not None:
            self.used_bytes -= entry.nbytes
        return entry

    def expired(self, now: float) -> list[int]:
        """Hashes whose retention ended at or before ``now``."""
        return [h for h, entry in self._entries.items() if entry.expiry <= now]
