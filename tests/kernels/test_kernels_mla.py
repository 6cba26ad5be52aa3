"""The paged MLA decode kernel (absorbed form) against the engine's torch reference, through
Triton's interpreter: one split and several, ragged contexts, heads not a multiple of the
head tile."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from splitserve import SamplingParams
from splitserve.engine.layers.fp8_kv import pack_kv
from splitserve.engine.layers.mla import mla_decode
from splitserve.kernels.mla_decode import mla_decode_attention
from tests.support.tiny_models import tiny_deepseek_v3, tiny_llm


@pytest.mark.parametrize(
    ("heads", "lora", "rope", "splits", "block_size", "fp8"),
    [
        (4, 32, 16, 1, 8, False),
        (20, 64, 16, 3, 16, False),
        (16, 32, 32, 2, 4, False),
        (20, 64, 16, 3, 16, True),
    ],
)
def test_mla_decode_kernel_matches_the_torch_reference(
    heads: int, lora: int, rope: int, splits: int, block_size: int, fp8: bool
) -> None:
    """fp8: the cache's rows in e4m3 with their scales (engine/layers/fp8_kv.py), which the
    kernel and the reference both dequantize."""
    generator = torch.Generator().manual_seed(heads)
    contexts = [1, 29, 70]
    width = -(-max(contexts) // block_size)
    num_blocks = width * len(contexts) + 1
    cache = torch.randn(num_blocks, block_size, 1, lora + rope, generator=generator)
    if fp8:
        cache = pack_kv(cache)
    tables = torch.randperm(num_blocks, generator=generator)[: 3 * width].view(3, width)
    lens = torch.tensor(contexts)
    query = torch.randn(3, heads, lora + rope, generator=generator)
    scale = (lora + rope) ** -0.5
    got = mla_decode_attention(
        query, cache, tables, lens, scale, lora, num_splits=splits, block_n=16
    )
    expected = mla_decode(query, cache, tables, lens, scale, lora)
    torch.testing.assert_close(got, expected, rtol=2e-5, atol=2e-5)


def test_triton_backend_deepseek_greedy_tokens_equal_torch_backend(
    smollm2_tokenizer: Any, tmp_path: Path
) -> None:
    """Decode steps of the tiny V3 through the kernel (its cache starting as NaN: no slot is
    read before it is written) give the torch reference's tokens."""
    _, path = tiny_deepseek_v3(smollm2_tokenizer, tmp_path / "v3")
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 40000, (n,), generator=generator).tolist() for n in (5, 40)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    tokens = {}
    for backend, fill in (("torch", 0.0), ("triton", float("nan"))):
        llm = tiny_llm(
            path, smollm2_tokenizer, attention_backend=backend, max_model_len=128, block_size=16
        )
        llm.engine.runner.kv_cache.fill_(fill)
        assert llm.engine.runner.model.mla_layers()[0].kernel == (backend == "triton")
        tokens[backend] = [
            o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)
        ]
    assert tokens["triton"] == tokens["torch"]
