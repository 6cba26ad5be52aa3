"""Gemma 3 270M on its real weights (the embedded ``gemma3-270m``, Q4_K_M GGUF): greedy
tokens equal to transformers' Gemma3ForCausalLM on the same weights, a prompt longer than two
of its 512-token windows among them; the tokens its served tests assert
(tests/support/gemma3.py); its chat format; the alias.

transformers reads this GGUF itself (``gguf_file=``), in about two minutes on the 2-core VM
(most of it its reader walking the 262k-token vocabulary), so the reference here is its model
built from google/gemma-3-270m's published config, the tensors renamed by gguf's name table
and changed by transformers' Gemma tensor processor, dequantized by gguf, as transformers'
own GGUF loading does.
"""

from __future__ import annotations

from typing import Any

import pytest

from splitserve import LLM, SamplingParams
from splitserve.engine.loader import eos_token_ids, resolve_model
from tests.support.gemma3 import (
    CHAT,
    CHAT_PIECES,
    CHAT_PROMPT_TOKENS,
    CHAT_TOKENS,
    NEW_TOKENS,
    SERVED_PIECES,
    SERVED_PROMPT_TOKENS,
    SERVED_TEXTS,
    SERVED_TOKENS,
    STORY,
)
from tests.support.reference import assert_greedy_equal, hf_greedy, load_gguf_tensors

PUBLISHED_CONFIG = dict(
    vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
    num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
    max_position_embeddings=32768, rms_norm_eps=1e-6, query_pre_attn_scalar=256,
    rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, tie_word_embeddings=True,
)  # fmt: skip
"""google/gemma-3-270m's config.json (its layer types: the default, every 6th global)."""
TEXTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
]


def reference_model(path: str) -> Any:
    """transformers' Gemma3ForCausalLM on the file's tensors, dequantized to float32."""
    from gguf import MODEL_ARCH
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    from transformers.initialization import no_init_weights
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS

    with no_init_weights():
        model = Gemma3ForCausalLM(Gemma3TextConfig(**PUBLISHED_CONFIG)).eval()
    processor = TENSOR_PROCESSORS["gemma3"]()
    missing = load_gguf_tensors(model, path, MODEL_ARCH.GEMMA3, processor)
    assert missing == ["lm_head.weight"]  # tied to the embeddings
    model.tie_weights()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model


@pytest.fixture(scope="module")
def gemma() -> LLM:
    return LLM(model="gemma3-270m", max_model_len=2048)


@pytest.mark.slow
def test_gemma3_270m_greedy_matches_transformers_past_its_window(gemma: LLM) -> None:
    """The served tests' prompts are among them (the first of TEXTS, STORY and the chat):
    there the tokens are transformers' and ours exactly, each decoded as listed."""
    tok = gemma.tokenizer
    prompts = [tok.encode(text) for text in (*TEXTS, STORY)]
    prompts.append(gemma.apply_chat_template(CHAT))
    served = [0, len(TEXTS), len(TEXTS) + 1]
    assert (TEXTS[0], STORY) == SERVED_TEXTS
    assert [len(prompts[i]) for i in served] == [*SERVED_PROMPT_TOKENS, CHAT_PROMPT_TOKENS]
    outputs = gemma.generate(prompts, SamplingParams(max_tokens=12, temperature=0))
    hf = reference_model(resolve_model("gemma3-270m"))
    story = len(TEXTS)  # alone: the short prompts in one left-padded batch, not padded to it
    short = [p for i, p in enumerate(prompts) if i != story]
    refs = hf_greedy(hf, short, 12, pad_id=0, eos_ids=[1, 106])
    refs[story:story] = hf_greedy(hf, [prompts[story]], 12, pad_id=0, eos_ids=[1, 106])
    equal = [
        assert_greedy_equal(hf, prompt, output.outputs[0].token_ids, ref)
        for prompt, output, ref in zip(prompts, outputs, refs, strict=True)
    ]
    print(f"sequences wholly equal: {equal}")
    assert sum(equal) >= len(prompts) - 1, f"sequences wholly equal: {equal}"
    expected = [*SERVED_TOKENS, CHAT_TOKENS]
    assert [tuple(refs[i][:NEW_TOKENS]) for i in served] == expected
    assert [tuple(outputs[i].outputs[0].token_ids[:NEW_TOKENS]) for i in served] == expected
    pieces = [tuple(tok.decode([t]) for t in tokens) for tokens in expected]
    assert pieces == [*SERVED_PIECES, CHAT_PIECES]


def test_gemma3_270m_chats_in_gemma_turns_ending_at_end_of_turn(gemma: LLM) -> None:
    tok = gemma.tokenizer
    assert eos_token_ids(tok) == (1, 106)  # <eos>, <end_of_turn>
    messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another?"},
    ]
    text = tok.decode(gemma.apply_chat_template(messages))
    assert text == (
        "<bos><start_of_turn>user\nAnswer briefly.\n\nName a color.<end_of_turn>\n"
        "<start_of_turn>model\nBlue.<end_of_turn>\n<start_of_turn>user\nAnother?<end_of_turn>\n"
        "<start_of_turn>model\n"
    )


@pytest.mark.slow
def test_gemma3_270m_native_stack_equals_its_modules_exactly(gemma: LLM) -> None:
    """Decode steps run the whole stack in one native call (windows, q/k norms, post-norms,
    GeGLU): the same tokens and logprobs as the modules making those calls one by one, on a
    prompt past its 512-token window beside a short one."""
    model = gemma.engine.runner.model
    fast = model.native_decode
    assert fast is not None
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=2, ignore_eos=True)
    past_window = STORY[: STORY.index("Day 42:")]  # 604 tokens

    def run() -> list[tuple[list[int], list[float]]]:
        outs = [o.outputs[0] for o in gemma.generate([past_window, TEXTS[0]], params)]
        steps = [[e.logprob for step in o.logprobs or [] for e in step.values()] for o in outs]
        return [(o.token_ids, lp) for o, lp in zip(outs, steps, strict=True)]

    with_stack = run()
    model.native_decode = None
    try:
        with_modules = run()
    finally:
        model.native_decode = fast
    assert with_stack == with_modules
