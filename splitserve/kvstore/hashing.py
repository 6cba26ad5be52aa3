"""Block identity: chained hashes of full KV blocks.

One pure function shared by the engine's block manager, the router and the block store:
block i's hash covers its own token ids and, through the parent hash, every token before it.
Hashes are unsigned 64-bit integers so they travel in msgpack and Redis keys unchanged.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

ROOT_HASH = 0


def hash_block(parent: int, token_ids: Sequence[int], extra: bytes = b"") -> int:
    """Hash of one block given its parent's hash, its token ids and optional extra keys."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(parent.to_bytes(8, "little"))
    digest.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    digest.update(extra)
    return int.from_bytes(digest.digest(), "little")


def block_hashes(
    token_ids: Sequence[int], block_size: int, parent: int = ROOT_HASH, extra: bytes = b""
) -> list[int]:
    """Chained hashes of every *full* block of token_ids (a trailing partial block has none)."""
    hashes: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size], extra)
        hashes.append(parent)
    return hashes
