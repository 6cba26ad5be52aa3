"""Greedy token ids equal transformers on the same weights: SmolLM2 and tiny random models
(Llama, Qwen2, Mistral, Qwen3, and the MoE families Mixtral and Qwen3-MoE; Gemma 3 in
test_gemma3_engine.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from splitserve import LLM, SamplingParams
from tests.support.reference import assert_greedy_equal, hf_greedy
from tests.support.tiny_models import tiny_llm, tiny_mixtral, tiny_model, tiny_qwen3, tiny_qwen3_moe

RAW_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "1, 2, 3, 5, 8, 13,",
    "The three primary colors are",
    "Translate to French: Good morning, my friend.",
    "import numpy as np\nx = np.arange(10)\n",
    "Water boils at a temperature of",
    "A haiku about autumn leaves:\n",
    "Q: What is the largest planet in the solar system?\nA:",
]
CHATS = [
    "What is 12 times 7?",
    "Write a short poem about the moon.",
    "Explain what a hash table is in one sentence.",
    "List three fruits that are red.",
    "How do I reverse a list in Python?",
    "Who wrote Romeo and Juliet?",
    "Give me a tip for sleeping better.",
    "What does CPU stand for?",
    "Summarize the plot of Cinderella in two sentences.",
    "Why is the sky blue?",
]


@pytest.mark.slow
def test_smollm2_greedy_matches_transformers_for_20_prompts_in_one_batch(
    smollm2_llm: LLM, hf_smollm2: Any, make_llm: Callable[..., LLM]
) -> None:
    """The default mode passes the oracle. The opt-in bfloat16 weights (``cpu_weights``)
    change the arithmetic: their agreement with the same reference is measured, and must not
    fall below what docs/performance.md reports."""
    tok = smollm2_llm.tokenizer
    prompts = [tok.encode(p) for p in RAW_PROMPTS]
    prompts += [smollm2_llm.apply_chat_template([{"role": "user", "content": c}]) for c in CHATS]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0)
    outputs = smollm2_llm.generate(prompts, params)
    reference = hf_greedy(hf_smollm2, prompts, NEW_TOKENS, pad_id=0)
    equal = [
        assert_greedy_equal(hf_smollm2, prompt, output.outputs[0].token_ids, ref)
        for prompt, output, ref in zip(prompts, outputs, reference)
    ]
    assert sum(equal) >= 18, f"only {sum(equal)} of 20 sequences wholly equal"
    assert sum(len(o.outputs[0].token_ids) for o in outputs) > 20 * 16
    bf16 = make_llm(cpu_weights="bfloat16").generate(prompts, params)
    same, prefix = agreement([o.outputs[0].token_ids for o in bf16], reference)
    print(f"bfloat16 weights: {same} of 20 wholly equal, {prefix:.1%} of tokens before a change")
    assert same >= BF16_EQUAL and prefix >= BF16_PREFIX


NEW_TOKENS = 32
"""Each prompt's greedy tokens (the chats' to position 70 or so, their fifth block of 16). 64
took the test 19.1 s on the Xeon VM, 32 take 9.9 s, most of it transformers' batch (11.5 and
6.2 s); every sequence wholly equal there at either length."""
BF16_EQUAL, BF16_PREFIX = 4, 0.40
"""The floor of the bfloat16 weights' agreement. Measured at 64 tokens: 6 wholly equal and
49.1% of tokens before a change (2026-12-04, AMD EPYC), 8 and 58.6% on the Xeon VM (AVX-512
BF16); at 32 tokens there 11 and 72.0% (2026-12-05)."""


def agreement(ours: list[list[int]], reference: list[list[int]]) -> tuple[int, float]:
    """(sequences wholly equal, the fraction of reference tokens before the first change)."""
    same, before = 0, 0
    for a, b in zip(ours, reference):
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        same += a == b
        before += first
    return same, before / sum(len(b) for b in reference)


def _tiny_llama(tokenizer: Any, path: Path) -> tuple[Any, str]:
    return tiny_model(
        tokenizer,
        path,
        "llama",
        seed=0,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=8,
        rope_theta=50000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        tie_word_embeddings=False,
    )


def _tiny_qwen2(tokenizer: Any, path: Path) -> tuple[Any, str]:
    return tiny_model(tokenizer, path, "qwen2", seed=1, tie_word_embeddings=True)


def _tiny_mistral(tokenizer: Any, path: Path) -> tuple[Any, str]:
    return tiny_model(
        tokenizer, path, "mistral", seed=2, num_key_value_heads=1, sliding_window=None
    )


TINY_BUILDERS = {
    "llama": _tiny_llama,
    "qwen2": _tiny_qwen2,
    "mistral": _tiny_mistral,
    "mixtral": tiny_mixtral,
    "qwen3": tiny_qwen3,
    "qwen3_moe": tiny_qwen3_moe,
}


@pytest.mark.parametrize("family", sorted(TINY_BUILDERS))
def test_tiny_random_model_greedy_matches_transformers(
    family: str, smollm2_tokenizer: Any, tmp_path: Path
) -> None:
    hf_model, path = TINY_BUILDERS[family](smollm2_tokenizer, tmp_path / family)
    llm = tiny_llm(path, smollm2_tokenizer, max_model_len=512, block_size=8)
    generator = torch.Generator().manual_seed(7)
    prompts = [
        torch.randint(3, 40000, (n,), generator=generator).tolist() for n in (5, 17, 40, 90, 130)
    ]
    outputs = llm.generate(
        prompts, SamplingParams(max_tokens=48, temperature=0, ignore_eos=True), use_tqdm=False
    )
    reference = hf_greedy(hf_model, prompts, 48, pad_id=0, ignore_eos=True)
    equal = [
        assert_greedy_equal(hf_model, prompt, output.outputs[0].token_ids, ref)
        for prompt, output, ref in zip(prompts, outputs, reference, strict=True)
    ]
    assert all(equal), f"sequences wholly equal: {equal}"
