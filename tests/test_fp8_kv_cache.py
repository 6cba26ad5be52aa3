"""The FP8 KV cache (``kv_cache_dtype="fp8"``, engine/layers/fp8_kv.py): each row's e4m3
values and its float32 scale in the block; prefix-cache hits and the prefill -> decode
handoff carry the blocks as they are, at 80 / 256 of SmolLM2's float32 bytes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.engine.config import EngineConfig
from splitserve.engine.layers.fp8_kv import fp8_groups, pack_kv, unpack_kv
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.shapes import shape_config
from splitserve.kvstore.store import BlockStore, BlockStoreConfig
from tests.support.handoff import disaggregated
from tests.support.reference import PROMPT, prompt_logits
from tests.support.tiny_models import CALM, tiny_deepseek_v3, tiny_llm

GREEDY = SamplingParams(max_tokens=16, temperature=0)
CHATS = ["What is the capital of France?", "How do I boil an egg?"]


def test_a_row_keeps_its_values_in_e4m3_and_its_scale_after_them() -> None:
    rows = torch.tensor([[[1.0, -2.0, 0.5, 4.0]], [[0.0, 0.0, 0.0, 0.0]]])
    packed = pack_kv(rows)
    assert packed.dtype == torch.float8_e4m3fn and packed.shape == (2, 1, 4 + 16)
    assert packed[0, 0, :4].float().tolist() == [112.0, -224.0, 56.0, 448.0]
    assert packed[0, 0, 4:8].view(torch.float32).item() == pytest.approx(4.0 / 448)
    assert packed.view(torch.uint8)[..., 8:].eq(0).all()  # the rows' 16-byte alignment
    torch.testing.assert_close(unpack_kv(packed, torch.float32), rows, rtol=1e-6, atol=0)
    never_written = torch.zeros(1, 1, 4 + 16, dtype=torch.float8_e4m3fn)
    assert unpack_kv(never_written, torch.float32).tolist() == [[[0.0] * 4]]


def test_smollm2_with_an_fp8_cache_answers_as_float32_and_carries_its_blocks(
    smollm2_tokenizer: Any, smollm2_llm: LLM
) -> None:
    """Greedy chat answers equal float32's; a second engine reading the prompts' blocks from
    the store's host tier, and a handoff to it, give the same tokens; a token's K/V takes
    30 layers x 2 x 3 heads x (64 + 16) bytes (float32: x 64 x 4), in the store too."""
    store = BlockStore(BlockStoreConfig(host_bytes=64 << 20))
    config = EngineConfig(max_model_len=512, kv_cache_bytes=64 << 20, kv_cache_dtype="fp8")
    fp8 = LLM.from_engine(LLMEngine(config, smollm2_tokenizer, store))
    runner = fp8.engine.runner
    assert runner.kv_cache.dtype == torch.uint8 and runner.kv_cache.shape[-1] == 80
    layer = runner.model.layers[0].self_attn
    assert layer.k_cache.dtype == torch.float8_e4m3fn
    assert runner.kv_bytes_per_block() == 30 * 2 * 3 * 80 * 16
    assert smollm2_llm.engine.runner.kv_bytes_per_block() == 30 * 2 * 3 * 64 * 4 * 16
    chats = [[{"role": "user", "content": c}] for c in CHATS]
    expected = [o.outputs[0].text for o in smollm2_llm.chat(chats, GREEDY, use_tqdm=False)]
    assert [o.outputs[0].text for o in fp8.chat(chats, GREEDY, use_tqdm=False)] == expected
    entries = [store.host.get(h) for h in store.host.keys()]  # noqa: SIM118 (not a dict)
    assert entries and all(e is not None and e.nbytes == 30 * 2 * 3 * 80 * 16 for e in entries)
    assert all(e is not None and e.tensor.dtype == torch.uint8 for e in entries)

    second = LLM.from_engine(LLMEngine(config, smollm2_tokenizer, store))
    assert [o.outputs[0].text for o in second.chat(chats, GREEDY, use_tqdm=False)] == expected
    assert second.engine.stats().cached_tokens_by_tier["host"] > 0
    prompts = ["Question 1: name a colour and a number", "Tea is a drink made from"]
    colocated = fp8.generate(prompts, GREEDY, use_tqdm=False)
    handed = disaggregated(fp8.engine, second.engine, prompts, GREEDY)
    assert [handed[str(i)] for i in range(len(prompts))] == [
        o.outputs[0].token_ids for o in colocated
    ]


def test_a_latent_cache_in_fp8_tracks_float32_and_reads_back_its_prefix(
    smollm2_tokenizer: Any, tmp_path: Path
) -> None:
    """Tiny DeepSeek-V3: one e4m3 row of latent | RoPE key (32 + 16) and one scale a token
    and layer. Stated tolerance: a prompt's logits within 6% RMS of their spread of the
    float32 cache's (measured 2.9%), the top token equal at 15 of 16 positions or more
    (measured 16); the greedy tokens again from the prefix cache, which prefill reads back."""
    _, path = tiny_deepseek_v3(smollm2_tokenizer, tmp_path, **CALM)
    fp8 = tiny_llm(path, smollm2_tokenizer, max_model_len=64, block_size=8, kv_cache_dtype="fp8")
    reference = tiny_llm(path, smollm2_tokenizer, max_model_len=64, block_size=8)
    cache = fp8.engine.runner.model.layers[0].self_attn.latent_cache
    assert cache.dtype == torch.float8_e4m3fn and cache.shape[-2:] == (1, 32 + 16 + 16)
    got, expected = prompt_logits(fp8), prompt_logits(reference)
    spread = (expected - expected.mean(dim=-1, keepdim=True)).norm()
    assert (got - expected).norm() / spread < 0.06
    assert int((got.argmax(-1) == expected.argmax(-1)).sum()) >= 15
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompt = [[*PROMPT, 3, 4]]
    first = fp8.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert fp8.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == first
    assert fp8.engine.stats().cached_tokens_by_tier["device"] == 16


def test_fp8_cache_is_refused_where_no_attention_reads_it() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="fp8e5m2")
    with pytest.raises(ValueError, match="not built for deepseek_v4"):
        fp8_groups([], shape_config("tiny-deepseek-v4"))
