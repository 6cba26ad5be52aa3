"""The GGUF tokenizer cache: the cached tokenizer is the converted one, a broken cache is
converted again, and a cache that cannot be written costs nothing but time."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from splitserve.engine.tokenizer_cache import cache_key, gguf_tokenizer

TEXTS = [
    "Hello, world!",
    "  several   spaces\n\nnew lines\t tabs",
    "émojis 🤖 and 中文",
    "<|im_start|>user\nhi<|im_end|>",
]
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi!"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Again"},
]


@pytest.fixture(scope="module")
def converted(smollm2_path: str) -> Any:
    """transformers' own conversion of the GGUF tokenizer, no cache involved."""
    folder, name = os.path.split(smollm2_path)
    return AutoTokenizer.from_pretrained(folder, gguf_file=name)


def assert_same(cached: Any, converted: Any) -> None:
    for text in TEXTS:
        assert cached.encode(text) == converted.encode(text)
    ids = list(range(0, len(converted), 997))
    assert cached.decode(ids) == converted.decode(ids)
    assert cached.apply_chat_template(
        CHAT, tokenize=False, add_generation_prompt=True
    ) == converted.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert (cached.eos_token_id, cached.bos_token_id, cached.all_special_ids, len(cached)) == (
        converted.eos_token_id,
        converted.bos_token_id,
        converted.all_special_ids,
        len(converted),
    )


def test_second_load_reads_the_cache_and_equals_the_conversion(
    smollm2_path: str, converted: Any, tmp_path: Path
) -> None:
    first = gguf_tokenizer(smollm2_path, tmp_path)
    folder = tmp_path / cache_key(smollm2_path)
    assert (folder / "tokenizer.json").is_file()
    assert [p.name for p in tmp_path.iterdir()] == [folder.name]  # no staging folder left
    stamp = (folder / "tokenizer.json").stat().st_mtime_ns
    second = gguf_tokenizer(smollm2_path, tmp_path)
    assert (folder / "tokenizer.json").stat().st_mtime_ns == stamp  # read, not rewritten
    assert_same(first, converted)
    assert_same(second, converted)


def test_corrupt_cache_is_converted_again(
    smollm2_path: str, converted: Any, tmp_path: Path
) -> None:
    folder = tmp_path / cache_key(smollm2_path)
    folder.mkdir()
    (folder / "tokenizer.json").write_text("{not json")
    assert_same(gguf_tokenizer(smollm2_path, tmp_path), converted)
    assert (folder / "tokenizer.json").read_text().startswith("{\n")


def test_unwritable_cache_still_gives_the_tokenizer(
    smollm2_path: str, converted: Any, tmp_path: Path
) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("a file where the cache folder would go")
    assert_same(gguf_tokenizer(smollm2_path, blocked), converted)
