"""DeepSeek-V4 against transformers on a tiny random checkpoint (tests/support/tiny_models.py:
a sliding, two CSA and an HCA layer, a window of 8, entries of 4 and 8 tokens, 2
hyper-connection streams, hash and top-k MoE): its modules, the logits of a whole prompt
many windows and entries long, and greedy tokens offline, chunked, and with a reused prefix."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.engine.config import EngineConfig
from splitserve.engine.layers.attention import AttentionMetadata, PrefillSegment
from splitserve.engine.llm_engine import LLMEngine
from tests.support.handoff import disaggregated
from tests.support.reference import assert_greedy_equal, hf_continuation
from tests.support.tiny_models import tiny_deepseek_v4

NEW = 20
GREEDY = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
BLOCK = 8
PROMPTS = ((5, 0), (61, 1), (90, 2))
"""(length, seed): 90 + 20 tokens span 14 windows, 27 CSA and 13 HCA entries."""


@pytest.fixture(scope="module")
def v4(smollm2_tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, str]:
    return tiny_deepseek_v4(smollm2_tokenizer, tmp_path_factory.mktemp("v4") / "v4")


@pytest.fixture(scope="module")
def llm(v4: tuple[Any, str]) -> LLM:
    return LLM(model=v4[1], max_model_len=512, block_size=BLOCK)


@pytest.fixture(scope="module")
def references(v4: tuple[Any, str]) -> dict[tuple[int, int], list[int]]:
    """transformers' greedy continuation of each of PROMPTS (computed once: its generate
    is the slow part of these tests)."""
    return {key: hf_continuation(v4[0], ids(*key), NEW) for key in PROMPTS}


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 40000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_matches_transformers(
    model: Any, llm: LLM, references: dict[tuple[int, int], list[int]]
) -> None:
    prompts = [ids(*key) for key in PROMPTS]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    equal = [
        assert_greedy_equal(model, p, o.outputs[0].token_ids, references[key])
        for key, p, o in zip(PROMPTS, prompts, outputs)
    ]
    assert all(equal), f"sequences wholly equal: {equal}"


def test_modules_equal_transformers(v4: tuple[Any, str], llm: LLM) -> None:
    """Hyper-connections, both compressors' entries, the indexer's choice and the MoE layers
    (hash and top-k) on the same inputs as transformers' modules."""
    hf, ours = v4[0].model, llm.engine.runner.model
    torch.manual_seed(0)
    tokens, hidden = 40, 64
    x = torch.randn(tokens, hidden)
    positions = torch.arange(tokens)
    with torch.no_grad():
        streams = torch.randn(tokens, 2, hidden)
        post, comb, collapsed = ours.layers[1].attn_hc(streams)
        want = hf.layers[1].attn_hc(streams[None])
        for got, ref in zip((post, comb, collapsed), want):
            torch.testing.assert_close(got, ref[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours.hc_head(streams), hf.hc_head(streams[None])[0])
        attn, indexer = hf.layers[1].self_attn, ours.layers[1].self_attn.indexer
        q_residual = attn.q_a_norm(attn.q_a_proj(x))
        for index in (1, 2):  # CSA, HCA
            compressor = ours.layers[index].self_attn.compressor
            windows = torch.arange(tokens // compressor.rate)
            got = compressor.pool(compressor.project(x), windows)
            ref = hf.layers[index].self_attn.compressor(
                x[None], q_residual[None], positions[None], None, 0
            )
            torch.testing.assert_close(got, ref[0][0, 0], rtol=1e-5, atol=1e-5)
        keys = indexer.compressor.pool(indexer.compressor.project(x), torch.arange(tokens // 4))
        chosen = indexer.select(x, q_residual, positions, keys)
        picks = attn.compressor.indexer(x[None], q_residual[None], positions[None], None, 0)[0]
        expected = torch.zeros_like(chosen)
        for row, pick in enumerate(picks.tolist()):
            expected[row, [p for p in pick if p >= 0]] = True
        assert torch.equal(chosen, expected) and chosen.sum(dim=1).max() == 3
        token_ids = torch.tensor(ids(tokens, 1))
        for index in (0, 1):  # hash, top-k
            got = ours.layers[index].mlp.experts_of(x, token_ids)
            ref = hf.layers[index].mlp(x[None], token_ids[None])[0]
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_whole_prompt_logits_equal_transformers(v4: tuple[Any, str], llm: LLM) -> None:
    """One prefill of 100 tokens (12 windows, 25 CSA entries, 12 HCA entries) through the
    paged cache: every position's logits as transformers'."""
    runner = llm.engine.runner
    prompt = torch.tensor(ids(100, 2))
    blocks = -(-100 // BLOCK)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(100),
        num_decode_tokens=0,
        decode_block_tables=torch.zeros(0, 0, dtype=torch.long),
        decode_context_lens=torch.zeros(0, dtype=torch.long),
        prefills=[PrefillSegment(0, 100, 100, torch.arange(blocks))],
    )
    with torch.inference_mode():
        hidden = runner.model(prompt, torch.arange(100), meta)
        logits = runner.model.compute_logits(hidden)
        expected = v4[0](prompt[None]).logits[0]
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


def test_greedy_tokens_equal_transformers(
    v4: tuple[Any, str], llm: LLM, references: dict[tuple[int, int], list[int]]
) -> None:
    assert_matches_transformers(v4[0], llm, references)


def test_chunked_prefill_beside_decodes_equals_transformers(
    v4: tuple[Any, str], references: dict[tuple[int, int], list[int]]
) -> None:
    """Prompts prefilled in 23-token chunks beside decoding ones: a chunk's windows and
    entries read the earlier chunks' rows from the cache, a chunk closes windows that began
    in the chunk before."""
    llm = LLM(model=v4[1], max_model_len=512, block_size=BLOCK, max_num_batched_tokens=23)
    assert_matches_transformers(v4[0], llm, references)


def test_reused_prefix_gives_the_uncached_tokens(
    v4: tuple[Any, str], references: dict[tuple[int, int], list[int]]
) -> None:
    """A prompt whose first 40 tokens another prompt computed computes only its other 21:
    the cached rows hold every layer's keys, compressor rows and entries of the prefix."""
    prompt = ids(*PROMPTS[1])
    llm = LLM(model=v4[1], max_model_len=512, block_size=BLOCK)
    llm.generate([prompt[:40] + ids(7, 4)], GREEDY, use_tqdm=False)
    before = llm.engine.stats()
    out = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    after = llm.engine.stats()
    assert after.prompt_tokens_cached - before.prompt_tokens_cached == 40
    assert after.prompt_tokens_computed - before.prompt_tokens_computed == 21
    assert assert_greedy_equal(v4[0], prompt, out, references[PROMPTS[1]])


def test_prefill_and_decode_engines_equal_transformers(
    v4: tuple[Any, str], smollm2_tokenizer: Any, references: dict[tuple[int, int], list[int]]
) -> None:
    """1P1D offline: the handoff carries each prompt's rows (keys, compressor rows, entries)
    and the decode engine goes on from them."""

    def engine() -> LLMEngine:
        config = EngineConfig(model=v4[1], max_model_len=512, block_size=BLOCK)
        return LLMEngine(config, smollm2_tokenizer)

    prompts = [ids(*key) for key in PROMPTS]
    handed = disaggregated(engine(), engine(), prompts, GREEDY)
    for index, key in enumerate(PROMPTS):
        assert assert_greedy_equal(v4[0], prompts[index], handed[str(index)], references[key])


def test_cache_row_is_the_widest_layers(llm: LLM) -> None:
    """A CSA layer's row: its key (32), compressor kv | gate (2 x 64), entry (32), indexer
    kv | gate (2 x 32), indexer key (16): 272 values a token, every one of the 4 layers."""
    runner = llm.engine.runner
    assert runner.model.kv_cache_spec().values_per_token() == 4 * 272
    assert runner.kv_shape(3) == (1, 4, 3, BLOCK, 1, 272)


def test_random_weight_shapes_generate_and_take_their_first_layers() -> None:
    """shape:deepseek-v4-flash is transformers' default DeepseekV4Config (V4-Flash's published
    sizes); its first layers keep their kinds and hash layers. At one layer it is still 7.5 B
    parameters (256 experts of 3 x 2048 x 4096), no CPU test's: the tiny shape generates."""
    from transformers import DeepseekV4Config

    from splitserve.engine.model_config import ModelConfig
    from splitserve.engine.shapes import shape_config

    published = ModelConfig.from_hf(DeepseekV4Config().to_dict())
    assert shape_config("deepseek-v4-flash") == published
    flash = shape_config("deepseek-v4-flash?layers=4")
    assert flash == ModelConfig.from_hf(DeepseekV4Config(num_hidden_layers=4).to_dict())
    assert flash.v4 is not None and flash.moe is not None
    assert (flash.num_layers, flash.v4.layer_kinds) == (4, ("hca", "hca", "hca", "csa"))
    assert flash.moe.hash_layers == (0, 1, 2)
    llm = LLM(model="shape:tiny-deepseek-v4", block_size=BLOCK, num_kv_blocks=32)
    out = llm.generate([list(range(5, 40))], GREEDY, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == NEW
