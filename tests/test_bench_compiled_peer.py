"""The compiled-PyTorch peer (static KV cache) computes the same model as transformers: its
greedy tokens equal `generate`'s on tiny random checkpoints, run eagerly on the CPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from splitserve.bench.compiled_peer import compiled_throughput, load_compiled_peer
from tests.support.tiny_models import tiny_model


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_compiled_peer_greedy_tokens_equal_transformers(
    smollm2_tokenizer: Any, tmp_path: Path, family: str
) -> None:
    reference, path = tiny_model(smollm2_tokenizer, tmp_path / family, family)
    peer = load_compiled_peer(path, torch.device("cpu"), torch.float32, seed=0)
    generator = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, len(smollm2_tokenizer), (3, 9), generator=generator)
    expected = reference.generate(
        input_ids=prompts,
        attention_mask=torch.ones_like(prompts),
        max_new_tokens=12,
        min_new_tokens=12,
        do_sample=False,
        pad_token_id=0,
    )[:, 9:]
    assert peer.generate(prompts.tolist(), 12) == expected.tolist()


def test_compiled_peer_reuses_its_cache_across_calls_of_one_batch_shape(
    smollm2_tokenizer: Any, tmp_path: Path
) -> None:
    _, path = tiny_model(smollm2_tokenizer, tmp_path / "llama")
    peer = load_compiled_peer(path, torch.device("cpu"), torch.float32, seed=0)
    prompts = torch.randint(0, 1000, (2, 6), generator=torch.Generator().manual_seed(2)).tolist()
    first = peer.generate(prompts, 10)
    cache = peer.model.layers[0].attention.k_cache
    stats = compiled_throughput(peer, prompts, 10)
    assert peer.model.layers[0].attention.k_cache is cache
    assert stats["decode_steps"] == 9
    assert peer.generate(prompts, 10) == first
