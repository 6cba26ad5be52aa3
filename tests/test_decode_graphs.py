"""The padded fixed-shape decode path of CUDA graphs, run eagerly on CPU, changes no token."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from splitserve import LLM, SamplingParams
from splitserve.engine.cuda_graphs import DecodeGraphs, bucket_sizes

PROMPTS = ["Once upon a time", "The recipe needs", "Rust or Go? " * 5, "1 2 3", "Dear Sir,"]


def test_bucket_sizes_cover_every_batch_up_to_the_maximum() -> None:
    assert bucket_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert bucket_sizes(20) == [1, 2, 4, 8, 16, 20]


@pytest.mark.slow
def test_padded_decode_path_gives_the_same_tokens(
    make_llm: Callable[..., LLM], smollm2_llm: LLM
) -> None:
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    expected = smollm2_llm.generate(PROMPTS, params, use_tqdm=False)
    llm = make_llm(max_model_len=256, num_kv_blocks=64)
    runner = llm.engine.runner
    runner.graphs = DecodeGraphs(runner, 8, capture=False)
    calls = []
    original = runner.graphs.run
    runner.graphs.run = lambda batch: calls.append(len(batch.requests)) or original(batch)  # type: ignore[method-assign]
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in expected]
    assert calls and max(calls) == 5
    assert llm.engine.stats().num_free_blocks == 64
