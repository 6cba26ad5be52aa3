"""The correctness oracle: greedy token ids equal to transformers, up to genuine near-ties."""

from __future__ import annotations

from typing import Any

import torch

from splitserve.engine.layers.attention import AttentionMetadata, PrefillSegment

NEAR_TIE = 1e-3


def hf_greedy(
    model: Any, prompts: list[list[int]], max_new_tokens: int, pad_id: int
) -> list[list[int]]:
    """Greedy continuations from transformers, one left-padded batch, cut after EOS."""
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=pad_id,
        )
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos])
    results = []
    for row in out[:, width:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos_ids), len(row))
        results.append(row[:cut])
    return results


def hf_continuation(model: Any, prompt: list[int], tokens: int) -> list[int]:
    """Greedy continuation of one unpadded prompt from transformers, EOS ignored."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def top2_gap(model: Any, context: list[int]) -> float:
    """Gap between the reference's two best logits after context (unpadded forward)."""
    with torch.no_grad():
        logits = model(torch.tensor([context])).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def assert_greedy_equal(model: Any, prompt: list[int], ours: list[int], ref: list[int]) -> bool:
    """Equal token ids, or a first difference where the reference itself is a near-tie.

    Returns True when the sequences are wholly equal.
    """
    for index, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            gap = top2_gap(model, prompt + ref[:index])
            assert gap < NEAR_TIE, (
                f"token {index} differs ({a} vs reference {b}) and the reference's top-2 "
                f"logit gap is {gap:.2e}, not a near-tie"
            )
            return False
    assert len(ours) == len(ref), f"lengths differ: {len(ours)} vs reference {len(ref)}"
    return True


PROMPT = [5, 900, 31, 7000, 12, 48, 2001, 17, 333, 90, 4, 1234, 77, 640, 9, 15000]


def prompt_logits(llm: Any) -> torch.Tensor:
    """Every position's logits for PROMPT, one prefill through an LLM's paged cache."""
    model, tokens = llm.engine.runner.model, len(PROMPT)
    block = llm.engine.config.block_size
    meta = AttentionMetadata(
        slot_mapping=torch.arange(tokens),
        num_decode_tokens=0,
        decode_block_tables=torch.zeros(0, 0, dtype=torch.long),
        decode_context_lens=torch.zeros(0, dtype=torch.long),
        prefills=[PrefillSegment(0, tokens, tokens, torch.arange(-(-tokens // block)))],
    )
    with torch.inference_mode():
        hidden = model(torch.tensor(PROMPT), torch.arange(tokens), meta)
        return model.compute_logits(hidden).float()
