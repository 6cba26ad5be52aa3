"""Prefill on one engine, decode on another: the KV handoff gives colocated outputs."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from splitserve import LLM, SamplingParams
from splitserve.engine.llm_engine import LLMEngine
from tests.support.handoff import disaggregated

pytestmark = pytest.mark.slow

PROMPTS = [f"Question {i}: name a colour and a number {'please ' * (i % 7)}" for i in range(12)]


@pytest.fixture(scope="module")
def engine_pair(make_llm: Callable[..., LLM]) -> tuple[LLMEngine, LLMEngine]:
    return make_llm().engine, make_llm().engine


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=24, temperature=0),
        SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=5),
        SamplingParams(max_tokens=1, temperature=0),
    ],
    ids=["greedy", "seeded", "one-token"],
)
def test_handoff_outputs_equal_colocated(
    engine_pair: tuple[LLMEngine, LLMEngine], smollm2_llm: LLM, params: SamplingParams
) -> None:
    colocated = smollm2_llm.generate(PROMPTS, params, use_tqdm=False)
    prefill, decode = engine_pair
    tokens = disaggregated(prefill, decode, PROMPTS, params)
    assert [tokens[str(i)] for i in range(len(PROMPTS))] == [
        o.outputs[0].token_ids for o in colocated
    ]


def test_handed_kv_has_layers_x_2_x_blocks_x_kv_heads_x_head_dim_elements(
    engine_pair: tuple[LLMEngine, LLMEngine],
) -> None:
    engine = engine_pair[0]
    ids = engine.tokenizer.encode("A prompt of some modest length, for counting bytes.")
    engine.add_request("r", ids, SamplingParams(max_tokens=4, temperature=0), prefill_only=True)
    while engine.has_unfinished_requests():
        engine.step()
    kv = engine.handoff.pop_prefilled("r").kv
    cfg = engine.model_config
    padded = -(-len(ids) // 16) * 16
    assert kv.numel() * kv.element_size() == cfg.num_layers * 2 * padded * cfg.num_kv_heads * (
        cfg.head_dim * 4
    )
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
