"""Deterministic mode (``EngineConfig.deterministic``, engine/layers/batch_invariant.py) on the
real SmolLM2 with its default CPU weights (the GGUF file's blocks): a probe prompt's logprobs
are the same bits alone, in batches of prompts of mixed lengths, prefilled in chunks of two
sizes, with and without a prefix-cache hit, with n-gram drafts verified, preempted and
recomputed (twice, in the small pool), on one or two threads, and prefilled on one engine and
decoded on another; a seeded request at temperature 1 draws the same tokens. The default mode
is shown not to be invariant, and the kernels under both."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from splitserve import LLM, SamplingParams
from splitserve.engine.config import EngineConfig
from splitserve.engine.layers.attention_backends import make_backend
from splitserve.engine.layers.batch_invariant import make_batch_invariant
from splitserve.engine.layers.cpu_gemm import ROW_TILE, set_row_tiles, tiled_linear
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.models.registry import model_class
from splitserve.engine.request import CompletionOutput, RequestOutput
from splitserve.engine.shapes import shape_config
from splitserve.engine.spec.config import SpeculativeConfig
from splitserve.kernels.native.blocks import (
    ISAS,
    NAMES,
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_0,
    Q6_K,
    Q8_0,
    best_isa,
    block_matmul,
    interleave,
    native_available,
)
from tests.support.blocks import random_blocks
from tests.support.handoff import disaggregated

pytestmark = pytest.mark.skipif(not native_available(), reason="no C compiler here")

PASSAGE = (
    "The Amazon rainforest covers much of the Amazon basin of South America. This basin "
    "encompasses seven million square kilometres, of which five and a half million square "
    "kilometres are covered by the rainforest."
)
PROBE = f"Repeat the following passage exactly:\n\n{PASSAGE}"  # copied: n-gram drafts land
OTHERS = [
    "Hi",
    "Write a haiku about a heron on a quiet lake in autumn.",
    "List the planets of the solar system in order, with one fact about each: " * 3,
]
GREEDY = SamplingParams(max_tokens=8, temperature=0, logprobs=2, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=8, temperature=1.0, seed=11, logprobs=0, ignore_eos=True)


@pytest.fixture(scope="module")
def small_chunks(make_llm: Callable[..., LLM]) -> LLM:
    """Prompts prefilled 40 tokens a step at most."""
    return make_llm(deterministic=True, max_num_batched_tokens=40)


@pytest.fixture(scope="module")
def drafting(make_llm: Callable[..., LLM]) -> LLM:
    """Prompts prefilled whole, n-gram drafts verified in every decode step, and a KV pool
    that four of these prompts outgrow: the newest running request is preempted and
    recomputed."""
    spec = SpeculativeConfig("ngram", 4, dynamic=False)
    return make_llm(deterministic=True, speculative=spec, num_kv_blocks=16)


def _chat(llm: LLM, text: str) -> list[int]:
    return llm.apply_chat_template([{"role": "user", "content": text}])


def _run(llm: LLM, prompts: list[str], params: SamplingParams) -> list[RequestOutput]:
    return llm.generate([_chat(llm, p) for p in prompts], params, use_tqdm=False)


def _bits(out: CompletionOutput) -> list[tuple[int, list[tuple[int, float, int | None]]]]:
    """Each generated token with its logprob entries, exactly."""
    assert out.logprobs is not None
    return [
        (token, [(t, e.logprob, e.rank) for t, e in entries.items()])
        for token, entries in zip(out.token_ids, out.logprobs)
    ]


def test_a_probes_logprobs_are_the_same_bits_in_any_batch_chunking_cache_drafts_preemption(
    small_chunks: LLM, drafting: LLM
) -> None:
    alone = _run(small_chunks, [PROBE], GREEDY)[0]
    assert alone.num_cached_tokens == 0
    expected = _bits(alone.outputs[0])
    cached_among_others = _run(small_chunks, [*OTHERS, PROBE], GREEDY)[-1]
    assert cached_among_others.num_cached_tokens > 0
    preempted_last_of_four = _run(drafting, [*OTHERS, PROBE], GREEDY)[-1]
    assert preempted_last_of_four.num_cached_tokens == 0
    for out in (cached_among_others, preempted_last_of_four):
        assert _bits(out.outputs[0]) == expected
    stats = drafting.engine.stats()
    assert stats.spec_num_accepted_tokens > 0 and stats.num_preemptions > 0


def test_a_probes_logprobs_do_not_depend_on_the_thread_count(small_chunks: LLM) -> None:
    threads = torch.get_num_threads()
    try:
        runs = []
        for count in (1, 2):
            torch.set_num_threads(count)
            runs.append(_bits(_run(small_chunks, [OTHERS[2], PROBE], GREEDY)[1].outputs[0]))
    finally:
        torch.set_num_threads(threads)
    assert runs[0] == runs[1]


def test_a_seeded_probe_draws_the_same_tokens_alone_and_batched(
    small_chunks: LLM, drafting: LLM
) -> None:
    alone = _run(small_chunks, [PROBE], SEEDED)[0].outputs[0]
    batched = _run(drafting, [OTHERS[1], PROBE, OTHERS[0]], SEEDED)[1].outputs[0]
    assert _bits(batched) == _bits(alone)
    greedy = _run(small_chunks, [PROBE], GREEDY)[0].outputs[0]
    assert alone.token_ids != greedy.token_ids  # it did sample


def test_prefill_on_one_engine_and_decode_on_another_gives_the_same_bits(
    small_chunks: LLM, drafting: LLM
) -> None:
    colocated = _run(small_chunks, [PROBE, OTHERS[2]], GREEDY)[0].outputs[0]
    prompts = [_chat(small_chunks, p) for p in (OTHERS[1], PROBE)]
    outputs: dict[str, RequestOutput] = {}
    disaggregated(drafting.engine, small_chunks.engine, prompts, GREEDY, outputs)
    assert _bits(outputs["1"].outputs[0]) == _bits(colocated)


def test_float32_weights_give_a_probe_the_same_bits_alone_and_batched(
    smollm2_tokenizer: Any,
) -> None:
    """Random float32 weights of SmolLM2's shape: nn.Linear projections (row tiles)."""
    shape = "shape:smollm2-135m?layers=2"
    config = EngineConfig(shape, max_model_len=256, deterministic=True, max_num_batched_tokens=24)
    llm = LLM.from_engine(LLMEngine(config, tokenizer=smollm2_tokenizer))
    ids = [smollm2_tokenizer.encode(text) for text in (PASSAGE, *OTHERS)]
    alone = llm.generate(ids[:1], GREEDY, use_tqdm=False)[0].outputs[0]
    batched = llm.generate(ids[1:] + ids[:1], GREEDY, use_tqdm=False)[-1].outputs[0]
    assert _bits(batched) == _bits(alone)


@pytest.mark.skipif(best_isa() == 0, reason="the portable products are invariant by design")
def test_the_default_mode_gives_a_batched_probe_other_logprobs(smollm2_llm: LLM) -> None:
    alone = _run(smollm2_llm, [PROBE], GREEDY)[0].outputs[0]
    batched = _run(smollm2_llm, [*OTHERS, PROBE], GREEDY)[-1].outputs[0]
    assert _bits(batched) != _bits(alone)


def _last_row(
    x: torch.Tensor, m: int, qtype: int, isa: str, invariant: bool, seed: int = 0
) -> torch.Tensor:
    """Row 0 of x as the last of m rows through random blocks of qtype."""
    blocks = random_blocks(qtype, 40, x.shape[1], seed=qtype + seed)
    il = interleave(blocks, qtype)
    xs = torch.cat((x[1:m], x[:1]))
    return block_matmul(xs, blocks, qtype, isa, interleaved=il, invariant=invariant)[-1]


@pytest.mark.parametrize("isa", ISAS)
def test_invariant_block_products_give_a_row_the_same_bits_at_any_row_count(isa: str) -> None:
    x = torch.randn(17, 512, generator=torch.Generator().manual_seed(3))
    varied = []
    for qtype in (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K):
        alone = _last_row(x, 1, qtype, isa, True)
        for m in range(2, 18):
            assert torch.equal(_last_row(x, m, qtype, isa, True), alone), f"{NAMES[qtype]} {m}"
        default = _last_row(x, 1, qtype, isa, False)
        if any(not torch.equal(_last_row(x, m, qtype, isa, False), default) for m in (2, 8, 9)):
            varied.append(qtype)
    if ISAS.index(isa) > 0 and best_isa() > 0:  # the default passes vary where they vectorize
        assert varied


def test_row_tiled_float32_projections_give_a_row_the_same_bits_at_any_row_count() -> None:
    layer = nn.Linear(1536, 576, bias=False)
    set_row_tiles(layer)
    x = torch.randn(2 * ROW_TILE + 3, 1536, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        alone = tiled_linear(x[:1], layer)[0]
        for m in (2, 3, 4, ROW_TILE, ROW_TILE + 1, 2 * ROW_TILE + 3):
            assert torch.equal(tiled_linear(torch.cat((x[1:m], x[:1])), layer)[-1], alone)
        assert torch.allclose(tiled_linear(x, layer), layer(x), rtol=1e-5, atol=1e-5)


def test_deterministic_mode_refuses_what_it_does_not_cover() -> None:
    with pytest.raises(ValueError, match="device='cpu' is built in float32"):
        EngineConfig(deterministic=True, device="cpu", dtype="bfloat16")
    with pytest.raises(ValueError, match="no FP8"):
        EngineConfig(deterministic=True, device="cuda", kv_cache_dtype="fp8")
    EngineConfig(deterministic=True, device="cuda")  # on the Triton kernels
    cfg = shape_config("smollm2-135m?layers=1")
    backend = make_backend("torch", cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    model = model_class(cfg)(cfg, backend)
    attn = model.layers[0].self_attn
    attn.backend = attn.backend.configured(None, sliding_window=128)  # torch's SDPA
    with pytest.raises(ValueError, match="whole context"):
        make_batch_invariant(model)
