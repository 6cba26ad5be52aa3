"""A vision worker's cache of image embeddings by content hash, least recently used first out.

Bounded by bytes, not entries: one image's embeddings are tokens x hidden x dtype, which
differs by model. An entry larger than the whole budget is simply not kept.
"""

from __future__ import annotations

from collections import OrderedDict

import torch


class EncoderCache:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, image_hash: str) -> torch.Tensor | None:
        tensor = self._entries.get(image_hash)
        if tensor is not None:
            self._entries.move_to_end(image_hash)
        return tensor

    def put(self, image_hash: str, embeddings: torch.Tensor) -> None:
        size = embeddings.numel() * embeddings.element_size()
        if size > self.capacity_bytes or image_hash in self._entries:
            return
        while self.used_bytes + size > self.capacity_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.used_bytes -= evicted.numel() * evicted.element_size()
        self._entries[image_hash] = embeddings
        self.used_bytes += size
