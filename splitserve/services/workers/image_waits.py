"""Prefill messages and image embeddings that wait for each other on a prefill worker.

Either may arrive first: the API server sends Prefill once the decode worker reserved blocks,
while the vision worker sends the embeddings as soon as they are encoded. Whatever waits
longer than the transfer timeout is dropped (a Prefill is then reported as failed).
"""

from __future__ import annotations

import time

import torch

from splitserve.engine.vision.multimodal import ImageInput
from splitserve.kvstore.hashing import ImageSpan
from splitserve.services import messages as msg


class ImageWaits:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._prefills: dict[str, tuple[msg.Prefill, float]] = {}
        self._embeddings: dict[str, tuple[torch.Tensor, float]] = {}

    def __bool__(self) -> bool:
        return bool(self._prefills or self._embeddings)

    def add_prefill(self, message: msg.Prefill) -> None:
        self._prefills[message.request_id] = (message, time.monotonic() + self.timeout_s)

    def add_embeddings(self, request_id: str, embeddings: torch.Tensor) -> None:
        self._embeddings[request_id] = (embeddings, time.monotonic() + self.timeout_s)

    def prefills(self) -> list[str]:
        """The prompts that wait for their embeddings."""
        return list(self._prefills)

    def discard(self, request_id: str) -> None:
        self._prefills.pop(request_id, None)
        self._embeddings.pop(request_id, None)

    def ready(self) -> list[tuple[msg.Prefill, torch.Tensor]]:
        """Pairs that are complete now (removed from the waits)."""
        both = [r for r in self._prefills if r in self._embeddings]
        return [(self._prefills.pop(r)[0], self._embeddings.pop(r)[0]) for r in both]

    def expired(self) -> list[str]:
        """Prefills that waited too long (removed); stale embeddings are dropped silently."""
        now = time.monotonic()
        late = [r for r, (_, deadline) in self._prefills.items() if deadline < now]
        for request_id in late:
            del self._prefills[request_id]
        for request_id in [r for r, (_, d) in self._embeddings.items() if d < now]:
            del self._embeddings[request_id]
        return late


def split_embeddings(spans: list[ImageSpan], embeddings: torch.Tensor) -> list[ImageInput]:
    """One [tokens, hidden] tensor of all images -> one ImageInput per span, in order."""
    lengths = [span.length for span in spans]
    if embeddings.shape[0] != sum(lengths):
        raise ValueError(f"{embeddings.shape[0]} embedding rows for {sum(lengths)} image tokens")
    parts = embeddings.split(lengths)
    return [ImageInput(span, part) for span, part in zip(spans, parts)]
