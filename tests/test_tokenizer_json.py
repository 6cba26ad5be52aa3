"""A worker's tokenizer read without transformers (engine/tokenizer_json.py) encodes, decodes and
names its special ids as transformers' tokenizer of the same files; folders that transformers
would read differently load through transformers; a worker's engine never imports it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from splitserve.engine.detokenizer import IncrementalDetokenizer
from splitserve.engine.loader import load_tokenizer
from splitserve.engine.tokenizer_cache import cached_folder
from splitserve.engine.tokenizer_json import JsonTokenizer, full_tokenizer

TEXTS = [
    "Hello, world!",
    "  several   spaces\n\nnew lines\t tabs",
    "émojis 🤖 and 中文",
    "<|im_start|>user\nhi<|im_end|>",
]


@pytest.fixture(scope="module")
def light(smollm2_path: str, smollm2_tokenizer: Any) -> JsonTokenizer:
    assert cached_folder(smollm2_path).is_dir()  # written when the session's tokenizer loaded
    tokenizer = load_tokenizer(smollm2_path, light=True)
    assert isinstance(tokenizer, JsonTokenizer)
    return tokenizer


def test_encode_decode_and_special_ids_equal_transformers(
    light: JsonTokenizer, smollm2_tokenizer: Any
) -> None:
    hf = smollm2_tokenizer
    for text in TEXTS:
        for special in (True, False):
            assert light.encode(text, special) == hf.encode(text, add_special_tokens=special)
    generator = torch.Generator().manual_seed(0)
    special_ids = hf.all_special_ids
    for _ in range(50):
        ids = torch.randint(0, len(hf), (40,), generator=generator).tolist()
        for at in range(0, len(ids), 7):  # special tokens among them
            ids[at] = special_ids[at % len(special_ids)]
        for skip in (True, False):
            assert light.decode(ids, skip_special_tokens=skip) == hf.decode(
                ids, skip_special_tokens=skip
            )
    assert (light.eos_token_id, len(light)) == (hf.eos_token_id, len(hf))


def test_streamed_text_with_a_stop_string_equals_transformers(
    light: JsonTokenizer, smollm2_tokenizer: Any
) -> None:
    """The detokenizer on both, one token at a time, a multi-byte character split across
    tokens and a stop string inside."""
    ids = smollm2_tokenizer.encode("The café 🤖 said: hello END and more")
    texts = []
    for tokenizer in (light, smollm2_tokenizer):
        detok = IncrementalDetokenizer(tokenizer, ids[:2], ["END"])
        stops = [detok.add(token) for token in ids[2:]]
        texts.append((detok.visible_text(finished=False), [s for s in stops if s]))
    assert texts[0] == texts[1]
    assert texts[0][1] == ["END"]


def test_the_full_tokenizer_loads_once_on_first_use(
    light: JsonTokenizer, smollm2_tokenizer: Any
) -> None:
    full = full_tokenizer(light)
    assert full is light.hf()
    assert full.chat_template == smollm2_tokenizer.chat_template
    assert full_tokenizer(smollm2_tokenizer) is smollm2_tokenizer


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"tokenizer_class": "LlamaTokenizer"}, "a class that builds its own pipeline"),
        ({"clean_up_tokenization_spaces": True}, "a clean-up after decode"),
        ({"eos_token": "<|not-in-the-vocabulary|>"}, "a special token transformers adds"),
        ({"add_bos_token": True}, "a post-processor rebuilt"),
    ],
)
def test_a_folder_transformers_reads_differently_loads_through_transformers(
    smollm2_path: str, tmp_path: Path, change: dict[str, Any], why: str
) -> None:
    folder = tmp_path / "tokenizer"
    shutil.copytree(cached_folder(smollm2_path), folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(config | change))
    assert not isinstance(load_tokenizer(str(folder), light=True), JsonTokenizer), why


def test_a_workers_engine_loads_without_importing_transformers(smollm2_path: str) -> None:
    code = (
        "import sys\n"
        "from splitserve.engine.config import EngineConfig\n"
        "from splitserve.engine.llm_engine import LLMEngine\n"
        "from splitserve.engine.loader import load_tokenizer\n"
        "from splitserve import SamplingParams\n"
        f"engine = LLMEngine(EngineConfig(model={smollm2_path!r}, max_model_len=256),\n"
        f"                   load_tokenizer({smollm2_path!r}, light=True))\n"
        "engine.add_request('a', [1, 2, 3], SamplingParams(max_tokens=3, temperature=0))\n"
        "while engine.has_unfinished_requests():\n"
        "    engine.step()\n"
        "print('transformers' in sys.modules)\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.splitlines()[-1] == "False"
