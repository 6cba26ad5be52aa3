"""Block identity: chained hashes of full KV blocks.

One pure function shared by the engine's block manager, the router and the block store:
block i's hash covers its own token ids and, through the parent hash, every token before it.
Hashes are unsigned 64-bit integers so they travel in msgpack and Redis keys unchanged.

A chain starts at its deployment's root (``hash_root``), derived from the model's identity,
the KV dtype and the block size: two models of one shape (or one model in two dtypes) that
share a block store directory or a prefix index never read each other's KV. Everything that
hashes for one deployment (the workers' block managers, their peer fetches, the API server's
prefix lookups, which take the root the workers report) starts from the same root.

Image placeholder tokens are all the same id, so token ids alone cannot tell two images
apart: a block that overlaps an image also mixes in that image's content hash (``ImageSpan``),
and every block after it inherits the difference through the chain. Two prompts that differ
only in their images therefore never share KV from the first image block on.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ImageSpan:
    """An image's placeholder tokens in a prompt: ``length`` positions from ``offset``.

    image_hash: hex digest of the image's content (the same image has the same hash)."""

    image_hash: str
    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


def hash_root(model: str, dtype: str, block_size: int) -> int:
    """The parent of a deployment's first block: model (its alias or path), the KV cache's
    resolved dtype (``float32``, ``bfloat16``, ...) and the block size."""
    key = f"splitserve-kv:{model}:{dtype}:{block_size}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")


def hash_block(parent: int, token_ids: Sequence[int], extra: bytes = b"") -> int:
    """Hash of one block given its parent's hash, its token ids and optional extra keys."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(parent.to_bytes(8, "little"))
    digest.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    digest.update(extra)
    return int.from_bytes(digest.digest(), "little")


def image_extra(images: Sequence[ImageSpan], start: int, end: int) -> bytes:
    """The extra key of the block of positions [start, end): the content hashes of the
    images overlapping it, in prompt order (empty when none does)."""
    overlapping = [s.image_hash for s in images if s.offset < end and start < s.end]
    return "".join(f"img:{h};" for h in overlapping).encode()


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    root: int,
    extra: bytes = b"",
    images: Sequence[ImageSpan] = (),
) -> list[int]:
    """Chained hashes of every *full* block of token_ids (a trailing partial block has none).

    root: the chain's start (``hash_root``); images: the prompt's image spans, blocks
    overlapping one mix in its content hash."""
    hashes: list[int] = []
    parent = root
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        end = start + block_size
        parent = hash_block(parent, token_ids[start:end], extra + image_extra(images, start, end))
        hashes.append(parent)
    return hashes
