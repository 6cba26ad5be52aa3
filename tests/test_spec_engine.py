"""Speculative decoding on tiny random models: greedy output token for token what it is without
speculation (n-gram and draft model, k = 1..8, mixed batches and batch 1, chunked prefill,
preemption, overlapped steps, the prefill -> decode handoff), a draft equal to the target
accepting every draft, seeded sampling drawing the same tokens, and a chi-square test of the
sampled distribution at drafted positions."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.engine.config import EngineConfig
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.spec.config import SpeculativeConfig
from tests.support.handoff import disaggregated
from tests.support.tiny_models import tiny_model

LOOPING = dict(tie_word_embeddings=True, initializer_range=0.1)
"""Small weights: greedy output falls into repeats, so n-gram drafts are often right."""


@pytest.fixture(scope="module")
def models(smollm2_tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The target, and a draft that is the target with noise on its last layer."""
    root = tmp_path_factory.mktemp("spec")
    hf_model, target = tiny_model(smollm2_tokenizer, root / "target", **LOOPING)
    with torch.no_grad():
        for param in hf_model.model.layers[1].parameters():
            param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(3)) * 0.02)
    hf_model.save_pretrained(root / "draft", safe_serialization=True)
    smollm2_tokenizer.save_pretrained(root / "draft")
    return {"target": target, "draft": str(root / "draft")}


def _llm(tokenizer: Any, model: str, **overrides: Any) -> LLM:
    overrides.setdefault("num_kv_blocks", 128)
    config = EngineConfig(model=model, max_model_len=512, block_size=8, **overrides)
    return LLM.from_engine(LLMEngine(config, tokenizer=tokenizer))


PROMPTS = [
    torch.randint(3, 40000, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    for n in (5, 17, 40, 90, 130)
]
PARAMS = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (48, 31, 40, 7, 44)]


def _tokens(llm: LLM, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    outputs = llm.generate(prompts, PARAMS[: len(prompts)], use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def reference(smollm2_tokenizer: Any, models: dict[str, str]) -> list[list[int]]:
    return _tokens(_llm(smollm2_tokenizer, models["target"]))


def _spec(method: str, k: int, models: dict[str, str], **extra: Any) -> SpeculativeConfig:
    draft = models["draft"] if method == "draft_model" else None
    return SpeculativeConfig(method, k, draft, dynamic=False, draft_kv_cache_bytes=1 << 20, **extra)


@pytest.mark.parametrize("k", range(1, 9))
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_output_is_unchanged_by_speculation(
    method: str, k: int, smollm2_tokenizer: Any, models: dict[str, str], reference: Any
) -> None:
    extra = {"prompt_lookup_min": 1} if method == "ngram" else {}
    llm = _llm(smollm2_tokenizer, models["target"], speculative=_spec(method, k, models, **extra))
    assert _tokens(llm) == reference
    assert _tokens(llm, PROMPTS[:1]) == reference[:1]  # batch 1
    stats = llm.engine.stats()
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    assert sum(stats.spec_accepted_per_pos) == stats.spec_num_accepted_tokens
    assert stats.spec_accepted_per_pos == sorted(stats.spec_accepted_per_pos, reverse=True)
    assert stats.num_free_blocks == stats.num_total_blocks


def test_a_draft_equal_to_the_target_has_every_draft_accepted(
    smollm2_tokenizer: Any, models: dict[str, str], reference: Any
) -> None:
    spec = SpeculativeConfig("draft_model", 4, models["target"], dynamic=False)
    llm = _llm(smollm2_tokenizer, models["target"], speculative=spec)
    assert _tokens(llm) == reference
    stats = llm.engine.stats()
    assert stats.spec_num_draft_tokens > 100
    assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens
    assert stats.spec_accepted_per_pos[0] == stats.spec_num_drafts


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_chunked_prefill_and_preemption_keep_greedy_output(
    method: str, smollm2_tokenizer: Any, models: dict[str, str], reference: Any
) -> None:
    spec = _spec(method, 4, models, prompt_lookup_min=1)
    small = dict(max_num_batched_tokens=16, num_kv_blocks=24, enable_prefix_caching=False)
    llm = _llm(smollm2_tokenizer, models["target"], speculative=spec, **small)
    assert _tokens(llm) == reference
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0
    assert stats.spec_num_accepted_tokens > 0
    assert stats.num_free_blocks == 24


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_dynamic_speculation_with_overlapped_steps_keeps_greedy_output(
    method: str, smollm2_tokenizer: Any, models: dict[str, str], reference: Any
) -> None:
    spec = SpeculativeConfig(method, 4, models["draft"] if method == "draft_model" else None)
    llm = _llm(smollm2_tokenizer, models["target"], speculative=spec, overlap_scheduling=True)
    assert _tokens(llm) == reference


def test_handoff_to_a_speculating_decode_engine_equals_colocated(
    smollm2_tokenizer: Any, models: dict[str, str], reference: Any
) -> None:
    prefill = _llm(smollm2_tokenizer, models["target"]).engine
    spec = _spec("draft_model", 3, models)
    decode = _llm(smollm2_tokenizer, models["target"], speculative=spec).engine
    tokens = disaggregated(prefill, decode, PROMPTS, PARAMS)
    assert [tokens[str(i)] for i in range(len(PROMPTS))] == reference
    assert decode.stats().spec_num_accepted_tokens > 0


def _sampled(llm: LLM, prompt: list[int], seeds: range, top_k: int = 4) -> list[list[int]]:
    params = [
        SamplingParams(max_tokens=3, temperature=2.0, top_k=top_k, seed=s, ignore_eos=True)
        for s in seeds
    ]
    outputs = llm.generate([prompt] * len(params), params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def test_seeded_sampling_draws_the_same_tokens_with_speculation(
    smollm2_tokenizer: Any, models: dict[str, str]
) -> None:
    plain = _llm(smollm2_tokenizer, models["target"], num_kv_blocks=512)
    spec = SpeculativeConfig("draft_model", 2, models["target"], dynamic=False)
    speculative = _llm(smollm2_tokenizer, models["target"], speculative=spec, num_kv_blocks=512)
    assert _sampled(speculative, PROMPTS[1], range(40)) == _sampled(plain, PROMPTS[1], range(40))
    stats = speculative.engine.stats()
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens


CHI2_DF2_P001 = 13.82
"""The chi-square statistic that 2 degrees of freedom exceed with probability 0.001."""


def test_sampling_at_drafted_positions_has_the_target_distribution(
    smollm2_tokenizer: Any, models: dict[str, str]
) -> None:
    """Drafts are the target's own argmax (a draft model equal to the target): the token after
    the first one is drafted every time, kept when the draw agrees and replaced otherwise.
    Its frequencies, given the most frequent first token, fit the exact top-3 distribution at
    temperature 2."""
    spec = SpeculativeConfig("draft_model", 2, models["target"], dynamic=False)
    llm = _llm(
        smollm2_tokenizer,
        models["target"],
        speculative=spec,
        max_num_seqs=200,
        num_kv_blocks=1024,
    )
    samples = _sampled(llm, PROMPTS[1], range(1000, 1600), top_k=3)
    first = Counter(s[0] for s in samples).most_common(1)[0][0]
    seconds = Counter(s[1] for s in samples if s[0] == first)
    exact = (
        llm.generate(
            [PROMPTS[1] + [first]],
            SamplingParams(max_tokens=1, temperature=0, logprobs=3),
            use_tqdm=False,
        )[0]
        .outputs[0]
        .logprobs
    )
    assert exact is not None
    weights = {t: math.exp(lp.logprob / 2.0) for t, lp in exact[0].items() if lp.rank <= 3}
    total, n = sum(weights.values()), sum(seconds.values())
    chi2 = sum((seconds[t] - n * w / total) ** 2 / (n * w / total) for t, w in weights.items())
    assert set(seconds) <= set(weights)
    assert n > 150
    assert chi2 < CHI2_DF2_P001
    stats = llm.engine.stats()
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
