"""DeepSeek's latent KV blocks through the KV cache system: prefill on one engine and decode
on another (the handoff carries latents), prefix reuse on the device and from the host or
disk tier of a block store shared by two engines, outputs equal to the colocated engine's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.engine.config import EngineConfig
from splitserve.engine.llm_engine import LLMEngine
from splitserve.kvstore.store import BlockStore, BlockStoreConfig
from tests.support.handoff import disaggregated
from tests.support.tiny_models import tiny_deepseek_v3

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
BLOCK = 8
LATENT = 32 + 16  # kv_lora_rank + qk_rope_head_dim of the tiny V3


@pytest.fixture(scope="module")
def v3_path(smollm2_tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_deepseek_v3(smollm2_tokenizer, tmp_path_factory.mktemp("v3") / "v3")[1]


def engine(path: str, tokenizer: Any, store: BlockStore | None = None) -> LLMEngine:
    config = EngineConfig(model=path, max_model_len=512, block_size=BLOCK, num_kv_blocks=64)
    return LLMEngine(config, tokenizer, store)


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 40000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def tokens(llm: LLM, prompt: list[int]) -> list[int]:
    return list(llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids)


def test_latent_handoff_equals_colocated_and_carries_48_values_a_token_and_layer(
    v3_path: str, smollm2_tokenizer: Any
) -> None:
    prompts = [ids(n, seed) for seed, n in enumerate((5, 23, 40, 9))]
    colocated = LLM.from_engine(engine(v3_path, smollm2_tokenizer))
    expected = [tokens(colocated, p) for p in prompts]
    prefill, decode = engine(v3_path, smollm2_tokenizer), engine(v3_path, smollm2_tokenizer)
    handed = disaggregated(prefill, decode, prompts, GREEDY)
    assert [handed[str(i)] for i in range(len(prompts))] == expected

    prefill.add_request("bytes", prompts[1], GREEDY, prefill_only=True)
    while prefill.has_unfinished_requests():
        prefill.step()
    kv = prefill.handoff.pop_prefilled("bytes").kv
    padded = -(-23 // BLOCK) * BLOCK
    # 3 layers of one latent each, float32: 3 * 48 * 4 = 576 bytes a token.
    assert kv.shape == (1, 3, padded // BLOCK, BLOCK, 1, LATENT)
    assert kv.numel() * kv.element_size() == padded * 3 * LATENT * 4


def test_second_request_with_a_shared_prefix_computes_only_its_new_tokens(
    v3_path: str, smollm2_tokenizer: Any
) -> None:
    shared, first_tail, second_tail = ids(40, 1), ids(7, 2), ids(11, 3)
    fresh = LLM.from_engine(engine(v3_path, smollm2_tokenizer))
    expected = tokens(fresh, shared + second_tail)
    llm = LLM.from_engine(engine(v3_path, smollm2_tokenizer))
    tokens(llm, shared + first_tail)
    before = llm.engine.stats()
    assert tokens(llm, shared + second_tail) == expected
    after = llm.engine.stats()
    # The 5 full blocks of the shared 40 tokens are reused; the 11 new tokens computed.
    assert after.prompt_tokens_cached - before.prompt_tokens_cached == 40
    assert after.prompt_tokens_computed - before.prompt_tokens_computed == 11


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_another_engine_loads_the_latent_prefix_from_a_store_tier(
    v3_path: str, smollm2_tokenizer: Any, tier: str, tmp_path: Path
) -> None:
    prompt = ids(45, 4)
    if tier == "host":
        config = BlockStoreConfig(host_bytes=16 << 20)
    else:
        config = BlockStoreConfig(host_bytes=0, disk_path=str(tmp_path), disk_bytes=16 << 20)
    store = BlockStore(config)
    first = LLM.from_engine(engine(v3_path, smollm2_tokenizer, store))
    expected = tokens(first, prompt)
    stored = (45 + GREEDY.max_tokens - 1) // BLOCK  # KV-complete blocks
    if tier == "disk":
        assert len(list(tmp_path.glob("*/*.kv"))) == stored
        store = BlockStore(config)  # another process's store over the same directory
    else:
        assert len(store.host) == stored
    second = LLM.from_engine(engine(v3_path, smollm2_tokenizer, store))
    assert tokens(second, prompt) == expected
    stats = second.engine.stats()
    assert stats.cached_tokens_by_tier == {tier: 40}
    assert stats.prompt_tokens_computed == 5
