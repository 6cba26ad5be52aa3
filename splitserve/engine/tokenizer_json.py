"""A worker's tokenizer without transformers: the ``tokenizers`` library on a tokenizer.json.

A worker only decodes (its prompts arrive as token ids): the incremental detokenizer, stop
strings, the text of logprobs. transformers' tokenizer does that by calling the backend's
``decode`` (plus a clean-up step that SmolLM2's and other BPE tokenizers turn off), but
importing transformers costs about 1.4 s of CPU in every worker start, more than the rest of
the tokenizer. So a worker reads the tokenizer.json itself, and only where transformers would
read the same file unchanged: a folder written by transformers 5 for its generic class
(``TokenizersBackend``, what the GGUF tokenizer cache holds), clean-up off, every special token
of the config in the vocabulary. Anything else loads through transformers as before.

A grammar needs the whole transformers tokenizer (xgrammar reads its vocabulary): ``hf()`` loads
it on first use. tests/test_tokenizer_json.py checks encode, decode and the special ids against
transformers on the same folder.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

GENERIC_CLASSES = frozenset({"TokenizersBackend"})
"""tokenizer_config classes whose transformers tokenizer is the tokenizer.json as written."""
SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
CHANGES_THE_FILE = (
    "clean_up_tokenization_spaces",
    "added_tokens_decoder",
    "additional_special_tokens",
    "extra_special_tokens",
    "add_bos_token",
    "add_eos_token",
)
"""Config keys with which transformers changes what the file does (a clean-up after decode,
tokens added or marked special, a post-processor rebuilt): such a folder loads through it."""


class JsonTokenizer:
    def __init__(self, backend: Any, eos_token_id: int | None, full: Callable[[], Any]) -> None:
        self.backend = backend
        self.eos_token_id = eos_token_id
        self._full = full
        self._hf: Any = None
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return str(self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def hf(self) -> Any:
        """transformers' tokenizer of the same files, loaded once, on first use."""
        with self._lock:
            if self._hf is None:
                self._hf = self._full()
            return self._hf


def json_tokenizer(folder: Path, full: Callable[[], Any]) -> JsonTokenizer | None:
    """The tokenizer of ``folder`` read without transformers, or None where transformers would
    not read its tokenizer.json unchanged. full: loads transformers' tokenizer (``hf()``)."""
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text())
        if not (folder / "tokenizer.json").is_file():
            return None
    except (OSError, ValueError):
        return None
    if config.get("tokenizer_class") not in GENERIC_CLASSES:
        return None
    if any(config.get(key) for key in CHANGES_THE_FILE):
        return None
    from tokenizers import Tokenizer

    backend = Tokenizer.from_file(str(folder / "tokenizer.json"))
    ids = {key: _special_id(backend, config.get(key)) for key in SPECIAL_KEYS}
    if any(config.get(key) is not None and ids[key] is None for key in SPECIAL_KEYS):
        return None  # transformers would add it to the vocabulary
    return JsonTokenizer(backend, ids["eos_token"], full)


def full_tokenizer(tokenizer: Any) -> Any:
    """transformers' tokenizer behind ``tokenizer`` (itself when it is one)."""
    return tokenizer.hf() if isinstance(tokenizer, JsonTokenizer) else tokenizer


def _special_id(backend: Any, token: Any) -> int | None:
    """A config's special token (a string, or a dict with its ``content``) -> its id."""
    if isinstance(token, dict):
        token = token.get("content")
    if not isinstance(token, str):
        return None
    found = backend.token_to_id(token)
    return None if found is None else int(found)
