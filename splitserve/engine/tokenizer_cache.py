"""A GGUF file's tokenizer, converted once and then read back from a local cache.

transformers builds a fast tokenizer from a GGUF file's vocabulary and merges on every load
(about 5 s for SmolLM2 on a 2-core VM, paid by the API server and by every worker it starts).
The converted tokenizer is saved once (``save_pretrained``: tokenizer.json, its config and the
chat template) under a key of the file's absolute path, size, modification time and the
transformers version, and later loads read that folder (about 0.4 s). Encoding, decoding,
special tokens and the chat template are those of the conversion itself (tests/
test_tokenizer_cache.py). A cache that cannot be written only costs the conversion. A file
without a chat template of a family whose format is known gets it (``chat_formats.py``).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from splitserve.engine.chat_formats import FORMATS
from splitserve.engine.gguf_file import read_gguf


def cache_root() -> Path:
    """$XDG_CACHE_HOME/splitserve/tokenizers (default ~/.cache/splitserve/tokenizers)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "splitserve" / "tokenizers"


def cache_key(path: str) -> str:
    stat = os.stat(path)
    version = importlib.metadata.version("transformers")  # without importing it (1.5 s)
    identity = f"{os.path.abspath(path)}:{stat.st_size}:{stat.st_mtime_ns}:{version}"
    return hashlib.sha256(identity.encode()).hexdigest()[:24]


def cached_folder(path: str, root: Path | None = None) -> Path:
    """Where the converted tokenizer of the GGUF file at ``path`` is (or will be) cached."""
    return (root or cache_root()) / cache_key(path)


def gguf_tokenizer(path: str, root: Path | None = None) -> Any:
    """The tokenizer of the GGUF file at ``path``, from the cache under ``root`` when there."""
    from transformers import AutoTokenizer

    folder = cached_folder(path, root)
    if (folder / "tokenizer.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(folder)
        except Exception:  # unreadable (tokenizers raises its own types): convert again
            shutil.rmtree(folder, ignore_errors=True)
    metadata = read_gguf(path).metadata
    chat = FORMATS.get(metadata["general.architecture"])
    if "tokenizer.chat_template" in metadata or chat is None:
        chat, extra = None, {}
    else:
        extra = {"extra_special_tokens": {"eot_token": chat.end_of_turn}}
    tokenizer = AutoTokenizer.from_pretrained(
        os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path), **extra
    )
    if chat is not None:  # a file without a template, of a family whose format we know
        tokenizer.chat_template = chat.template
    _save(tokenizer, folder)
    return tokenizer


def _save(tokenizer: Any, folder: Path) -> None:
    """Write into a fresh folder beside the target, then rename it into place: a reader never
    sees a half-written cache, and of two processes converting at once one rename wins."""
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        staging = tempfile.mkdtemp(dir=folder.parent, prefix=".partial-")
    except OSError:
        return
    try:
        tokenizer.save_pretrained(staging)
        os.rename(staging, folder)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
