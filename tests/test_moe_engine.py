"""An MoE model in the engine: the per-step expert load that EPLB reads."""

from __future__ import annotations

import pytest

from splitserve import LLM, SamplingParams


def test_expert_load_is_recorded_per_step() -> None:
    llm = LLM(model="shape:tiny-mixtral", record_expert_load=True, block_size=8)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    llm.generate([[5, 6, 7, 8, 9]], params, use_tqdm=False)
    trace = llm.engine.expert_load.take()
    # One prefill step of 5 tokens, then 3 decode steps of 1; 2 MoE layers, top-2 of 8.
    assert trace.shape == (4, 2, 8)
    assert trace.sum(dim=2).tolist() == [[10, 10], [2, 2], [2, 2], [2, 2]]
    assert llm.engine.expert_load.take().shape == (0, 2, 8)


def test_recording_expert_load_needs_an_moe_model() -> None:
    with pytest.raises(ValueError, match="mixture-of-experts"):
        LLM(model="shape:tiny-llama", record_expert_load=True)
