"""The correctness oracle: greedy token ids equal to transformers, up to genuine near-ties."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from splitserve.engine.layers.attention import AttentionMetadata, PrefillSegment

NEAR_TIE = 1e-3


def load_gguf_tensors(model: Any, path: str, arch: Any, processor: Any) -> list[str]:
    """A GGUF file's tensors into a transformers model as transformers' own GGUF loading puts
    them (its reader walks the whole vocabulary, for minutes on the 2-core VM): llama.cpp's
    names mapped by gguf's name table, dequantized by gguf to float32, changed by transformers'
    tensor processor for the family. Returns the model's parameters that the file lacks."""
    from gguf import get_tensor_name_map
    from gguf.quants import dequantize

    from splitserve.engine.gguf_file import read_gguf

    table = get_tensor_name_map(arch, model.config.num_hidden_layers)
    names = {}  # llama.cpp's name -> transformers', as transformers maps them at load
    for hf_name in model.state_dict():
        module, suffix = hf_name.rsplit(".", 1)
        gguf_name = table.get_name(module)
        if gguf_name is not None:
            names[f"{gguf_name}.{suffix}"] = hf_name
    state = {}
    for tensor in read_gguf(path).tensors:
        array = dequantize(tensor.data, tensor.tensor_type).reshape(tuple(reversed(tensor.shape)))
        weights = processor.process(array, tensor.name).weights
        writable = np.require(weights.astype("float32", copy=False), requirements="W")
        state[names[tensor.name]] = torch.from_numpy(writable)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert unexpected == []
    return list(missing)


def hf_greedy(
    model: Any,
    prompts: list[list[int]],
    max_new_tokens: int,
    pad_id: int,
    eos_ids: list[int] | None = None,
    ignore_eos: bool = False,
) -> list[list[int]]:
    """Greedy continuations from transformers, one left-padded batch, cut after EOS (the
    model's generation config's, or ``eos_ids``), or ``max_new_tokens`` each past any EOS."""
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    ends = model.generation_config.eos_token_id if eos_ids is None else eos_ids
    end_set = set() if ignore_eos else set(ends if isinstance(ends, list) else [ends])
    eos = {"eos_token_id": None} if ignore_eos else {"eos_token_id": ends}
    with torch.no_grad():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=pad_id,
            **eos,
        )
    results = []
    for row in out[:, width:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in end_set), len(row))
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
