"""Disk tier of the block store: one file per block under a directory and a byte budget.

Writes are atomic (a temporary file in the same directory, then ``os.replace``), so a crash
leaves either the old state or the new file, never half a block under its final name. Every
read verifies the checksum (kvstore/block_codec.py); a corrupt or truncated file is deleted and
reported as a miss, so the block is recomputed instead of serving wrong KV. Recency survives a
restart through the files' modification times, which each hit refreshes.

The tier touches only files of its own naming: ``<2 hex digits>/<16 hex digits>.kv`` and its
temporaries; anything else under the directory (another program's files) is never read,
adopted or deleted.

Several processes may share one directory (the workers of a node): each keeps its own LRU of
the files it wrote or adopted (``adopt`` takes in a file another one wrote), so the byte
budget holds per process, not for the directory as a whole.
"""

from __future__ import annotations

import logging
import os
import re
import uuid
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path

import torch

from splitserve.kvstore import block_codec
from splitserve.kvstore.block_codec import CorruptBlock

log = logging.getLogger(__name__)
_SUFFIX = ".kv"
_TMP_SUFFIX = ".tmp"
_FOLDER = re.compile(r"[0-9a-f]{2}")
_BLOCK_FILE = re.compile(r"[0-9a-f]{16}\.kv")
_TMP_FILE = re.compile(r"\.[0-9a-f]{16}\.kv\.[0-9a-f]{32}\.tmp")


class DiskTier:
    """Block files, least recently used first; ``put`` returns the hashes it evicted."""

    def __init__(self, path: str | Path, budget_bytes: int, fsync: bool = False) -> None:
        self.root = Path(path)
        self.budget_bytes = budget_bytes
        self.fsync = fsync
        self.used_bytes = 0
        self._entries: OrderedDict[int, tuple[int, float]] = OrderedDict()
        self.root.mkdir(parents=True, exist_ok=True)
        self._load()

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[int]:
        """Hashes from least to most recently used."""
        return list(self._entries)

    def expiry(self, block_hash: int) -> float | None:
        entry = self._entries.get(block_hash)
        return None if entry is None else entry[1]

    def set_expiry(self, block_hash: int, expiry: float) -> None:
        """Change the retention kept in memory (the file keeps the one it was written with)."""
        size, _ = self._entries[block_hash]
        self._entries[block_hash] = (size, expiry)

    def put(self, block_hash: int, tensor: torch.Tensor, expiry: float) -> list[int]:
        """Write the block; returns the least recently used hashes removed to fit it."""
        self.pop(block_hash)
        data = block_codec.encode(block_hash, expiry, tensor)
        if len(data) > self.budget_bytes:
            return []
        victims: list[int] = []
        while self.used_bytes + len(data) > self.budget_bytes:
            victim = next(iter(self._entries))
            self.pop(victim)
            victims.append(victim)
        self._write(self.path_of(block_hash), data)
        self._entries[block_hash] = (len(data), expiry)
        self.used_bytes += len(data)
        return victims

    def get(self, block_hash: int) -> torch.Tensor | None:
        """The verified block, now most recently used; None (and the file gone) if unusable."""
        if block_hash not in self._entries:
            return None
        path = self.path_of(block_hash)
        try:
            tensor, _ = block_codec.decode(path.read_bytes(), block_hash)
            os.utime(path)
        except (OSError, CorruptBlock) as exc:
            log.warning("block store: dropping unreadable block file %s: %s", path, exc)
            self.pop(block_hash)
            return None
        self._entries.move_to_end(block_hash)
        return tensor

    def adopt(self, block_hash: int) -> bool:
        """Take in a block file that another process sharing the directory wrote; False if
        there is none (or it is unusable, then it is deleted)."""
        if block_hash in self._entries:
            return True
        path = self.path_of(block_hash)
        try:
            data = path.read_bytes()
        except OSError:
            return False
        try:
            header = block_codec.decode_header(data)
        except CorruptBlock as exc:
            log.warning("block store: dropping unreadable block file %s: %s", path, exc)
            path.unlink(missing_ok=True)
            return False
        if header.block_hash != block_hash:
            path.unlink(missing_ok=True)
            return False
        self._entries[block_hash] = (len(data), header.expiry)
        self.used_bytes += len(data)
        return True

    def pop(self, block_hash: int) -> bool:
        """Delete the block's file; False if it was not there."""
        entry = self._entries.pop(block_hash, None)
        if entry is None:
            return False
        self.used_bytes -= entry[0]
        self.path_of(block_hash).unlink(missing_ok=True)
        return True

    def expired(self, now: float) -> list[int]:
        """Hashes whose retention ended at or before ``now``."""
        return [h for h, (_, expiry) in self._entries.items() if expiry <= now]

    def path_of(self, block_hash: int) -> Path:
        name = f"{block_hash:016x}"
        return self.root / name[:2] / (name + _SUFFIX)

    def _write(self, path: Path, data: bytes) -> None:
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}{_TMP_SUFFIX}")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def _load(self) -> None:
        """Adopt the files a previous run left, oldest access first; drop leftovers and junk."""
        found: list[tuple[float, int, int, float]] = []
        for path in self._own_files():
            if _TMP_FILE.fullmatch(path.name):
                path.unlink(missing_ok=True)
                continue
            try:
                with open(path, "rb") as f:
                    header = block_codec.decode_header(f.read())
                stat = path.stat()
            except (OSError, CorruptBlock):
                path.unlink(missing_ok=True)
                continue
            if path != self.path_of(header.block_hash):
                path.unlink(missing_ok=True)
                continue
            found.append((stat.st_mtime, header.block_hash, stat.st_size, header.expiry))
        for _, block_hash, size, expiry in sorted(found):
            self._entries[block_hash] = (size, expiry)
            self.used_bytes += size
        while self.used_bytes > self.budget_bytes:
            self.pop(next(iter(self._entries)))

    def _own_files(self) -> Iterator[Path]:
        """Block files and temporaries in the tier's two-hex-digit folders; nothing else."""
        for folder in self.root.iterdir():
            if _FOLDER.fullmatch(folder.name) and folder.is_dir():
                for path in folder.iterdir():
                    if _BLOCK_FILE.fullmatch(path.name) or _TMP_FILE.fullmatch(path.name):
                        yield path
