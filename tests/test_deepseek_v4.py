"""DeepSeek-V4 against transformers on a tiny random checkpoint (tests/support/tiny_models.py:
a sliding, two CSA and an HCA layer, a window of 8, entries of 4 and 8 tokens, 2
hyper-connection streams, hash and top-k MoE): its modules, the logits of a whole prompt
many windows and entries long, and greedy tokens offline, chunked, and with a reused prefix."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.engine.block_manager import BlockManager
from splitserve.engine.config import EngineConfig
from splitserve.engine.kv_cache_spec import KVCacheSpec
from splitserve.engine.layers import v4_decode
from splitserve.engine.layers.attention import AttentionMetadata, PrefillSegment
from splitserve.engine.layers.v4_cache import cache_groups
from splitserve.engine.layers.v4_prefill import Indexer, pick
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.request import Request
from splitserve.kvstore.store import BlockStore, BlockStoreConfig
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
        index_q, weights = indexer.queries(x, q_residual, positions)
        chooser = Indexer(index_q, weights, keys, indexer.topk)
        seen = ((positions + 1) // 4)[:, None]
        chosen = pick(chooser, 0, tokens, keys.shape[0], seen).sort(dim=1).values
        picks = attn.compressor.indexer(x[None], q_residual[None], positions[None], None, 0)[0]
        assert torch.equal(chosen, picks.sort(dim=1).values) and (chosen >= 0).sum(1).max() == 3
        token_ids = torch.tensor(ids(tokens, 1))
        for index in (0, 1):  # hash, top-k
            got = ours.layers[index].mlp.experts_of(x, token_ids)
            ref = hf.layers[index].mlp(x[None], token_ids[None])[0]
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("score_bytes", [None, 1], ids=["whole", "row-by-row"])
def test_whole_prompt_logits_equal_transformers(
    v4: tuple[Any, str], llm: LLM, score_bytes: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One prefill of 100 tokens (12 windows, 25 CSA entries, 12 HCA entries) through the
    paged cache (the first 13 blocks of every group): every position's logits as
    transformers', with the attention and indexer scores at once and in passes of one row
    (how a long prefill keeps them within v4_decode.SCORE_BYTES)."""
    if score_bytes is not None:
        monkeypatch.setattr(v4_decode, "SCORE_BYTES", score_bytes)
    runner = llm.engine.runner
    prompt = torch.tensor(ids(100, 2))
    blocks = -(-100 // BLOCK)

    def meta() -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=torch.arange(100),
            num_decode_tokens=0,
            decode_block_tables=torch.zeros(0, 0, dtype=torch.long),
            decode_context_lens=torch.zeros(0, dtype=torch.long),
            prefills=[PrefillSegment(0, 100, 100, torch.arange(blocks))],
        )

    step = meta()
    step.windows = [meta() for _ in runner.kv_groups[1:]]
    with torch.inference_mode():
        hidden = runner.model(prompt, torch.arange(100), step)
        logits = runner.model.compute_logits(hidden)
        expected = v4[0](prompt[None]).logits[0]
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


def test_greedy_tokens_equal_transformers(
    v4: tuple[Any, str], llm: LLM, references: dict[tuple[int, int], list[int]]
) -> None:
    assert_matches_transformers(v4[0], llm, references)


@pytest.mark.parametrize("hybrid", [True, False], ids=["groups", "one-group"])
def test_chunked_prefill_beside_decodes_equals_transformers(
    v4: tuple[Any, str], references: dict[tuple[int, int], list[int]], hybrid: bool
) -> None:
    """Prompts prefilled in 23-token chunks beside decoding ones: a chunk's windows and
    entries read the earlier chunks' keys, state rows and entries from the cache, a chunk
    closes windows that began in the chunk before; in the cache groups, and in the one group
    of ``hybrid_kv_cache: false`` (the MTP drafter's layout)."""
    llm = LLM(
        model=v4[1], max_model_len=512, block_size=BLOCK, max_num_batched_tokens=23,
        hybrid_kv_cache=hybrid,
    )  # fmt: skip
    assert len(llm.engine.runner.kv_groups) == (4 if hybrid else 1)
    assert_matches_transformers(v4[0], llm, references)


def test_exact_replay_of_a_reused_prefix_equals_the_uncached_run(
    v4: tuple[Any, str], references: dict[tuple[int, int], list[int]]
) -> None:
    """A prompt whose first 44 tokens another prompt computed, in blocks of 4: the hit keeps
    whole HCA entries (40 tokens), and the exact mode replays the whole prefix over the cached
    entries, writing none of them: the uncached run's tokens (transformers')."""
    prompt = ids(*PROMPTS[1])
    llm = LLM(model=v4[1], max_model_len=512, block_size=4)
    llm.generate([prompt[:44] + ids(7, 4)], GREEDY, use_tqdm=False)
    runner, manager = llm.engine.runner, llm.engine.block_manager
    assert manager.granule == 2 and len(manager.cached) == 16  # 67 tokens computed: 16 blocks
    look = Request("look", prompt, GREEDY)
    assert BlockManager.cached_prefix_tokens(manager, look) == 40  # 11 blocks match
    manager.forget("look")
    table = list(manager.cached.values())
    before = runner.gather_blocks(table).clone()
    second = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert second.num_cached_tokens == 0  # exact: every position computed again
    assert torch.equal(runner.gather_blocks(table), before)
    plain = LLM(model=v4[1], max_model_len=512, block_size=4, enable_prefix_caching=False)
    uncached = plain.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert second.outputs[0].token_ids == uncached
    assert assert_greedy_equal(v4[0], prompt, uncached, references[PROMPTS[1]])


def test_bounded_replay_computes_the_window_and_allowance_of_a_whole_entries_hit(
    v4: tuple[Any, str], smollm2_tokenizer: Any
) -> None:
    """The same hit with an allowance of 4: the 40 cached tokens (not 44: the HCA entry of
    tokens 40 .. 47 is not the new prompt's) less the window (8) and allowance are kept, the
    other 33 computed; the cached entries are not written. Then the prompt's own 56 tokens
    (14 blocks of its 15, whole entries) are cached, on this engine's device and through the
    block store's host tier on a second engine: both replay from 44 to the same tokens."""
    prompt = ids(*PROMPTS[1])
    store = BlockStore(BlockStoreConfig(host_bytes=1 << 20))

    def engine() -> LLM:
        config = EngineConfig(
            model=v4[1], max_model_len=512, block_size=4, window_replay_allowance=4
        )
        return LLM.from_engine(LLMEngine(config, smollm2_tokenizer, store))

    llm = engine()
    llm.generate([prompt[:44] + ids(7, 4)], GREEDY, use_tqdm=False)
    runner, manager = llm.engine.runner, llm.engine.block_manager
    table = list(manager.cached.values())
    before = runner.gather_blocks(table).clone()
    computed = llm.engine.prompt_tokens_computed
    second = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert second.num_cached_tokens == 28
    assert llm.engine.prompt_tokens_computed - computed == 33
    assert manager.last_hit_tokens == {"device": 28}
    assert torch.equal(runner.gather_blocks(table), before)
    assert len(second.outputs[0].token_ids) == NEW
    other = engine()
    from_host = other.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert other.engine.block_manager.last_hit_tokens == {"host": 44}
    from_device = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert manager.last_hit_tokens == {"device": 44}
    assert from_host == from_device


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


def test_entries_in_group_0_and_keys_and_state_freed_behind_what_a_step_reads(
    llm: LLM,
) -> None:
    """Group 0: both CSA layers' entry | indexer key (32 + 16 over 4 tokens) and the HCA
    layer's entry (32 over 8) a token; group 1 every layer's key (32) for the window of 8;
    then the state rows: CSA's compressors' kv | gate (2 x 64 + 2 x 32), 8 tokens back (two
    windows of 4), HCA's (2 x 32), 8 back. At the first decode after a 90-token prefill
    group 0 holds 12 blocks, every other group the 2 blocks of positions 80 .. 95 (the step
    reads 83 .. 90)."""
    engine = llm.engine
    assert [(g.spec, g.layers, g.window) for g in engine.runner.kv_groups] == [
        (KVCacheSpec(1, 1, 1, 12 + 4 + 12, 8), (1, 2, 3), None),
        (KVCacheSpec(1, 4, 1, 32), (0, 1, 2, 3), 8),
        (KVCacheSpec(1, 2, 1, 128 + 64), (1, 3), 8),
        (KVCacheSpec(1, 1, 1, 64), (2,), 8),
    ]
    engine.add_request("long", ids(90, 5), GREEDY)
    engine.step()
    engine.step()
    req = engine.requests["long"]
    assert len(req.block_table) == 12
    assert engine.block_manager.window_blocks_in_use() == [2, 2, 2]
    engine.abort_request("long")


def test_v4_flash_bytes_a_token_from_its_specs() -> None:
    """In bfloat16: 6,584 bytes a token grow with the context (20 CSA layers' 160 values and
    23 HCA layers' 4); every layer's key (43 x 512) is kept 128 tokens back, the CSA layers'
    compressor state (2,048 + 512 each) 8, the HCA layers' (1,024 each) 128."""
    from splitserve.engine.shapes import shape_config

    flash = shape_config("deepseek-v4-flash").v4
    assert flash is not None
    groups = cache_groups(flash)
    assert [g.spec.values_per_token() * 2 for g in groups] == [6584, 44032, 102400, 47104]
    assert [g.window for g in groups] == [None, 128, 8, 128]


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
