"""Two engines driven by hand as a prefill and a decode worker would drive them."""

from __future__ import annotations

from collections.abc import Sequence

from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.request import RequestOutput
from splitserve.engine.sampling_params import SamplingParams


def disaggregated(
    prefill: LLMEngine,
    decode: LLMEngine,
    prompts: Sequence[str | list[int]],
    params: SamplingParams | Sequence[SamplingParams],
    outputs: dict[str, RequestOutput] | None = None,
) -> dict[str, list[int]]:
    """Drive both engines by hand, moving each prompt's KV as soon as it is prefilled.
    params: one for every prompt, or one per prompt. outputs: receives each request's last
    output (its logprobs)."""
    outputs = {} if outputs is None else outputs
    free_before = decode.block_manager.num_free_blocks
    each = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    for index, (prompt, params) in enumerate(zip(prompts, each, strict=True)):
        ids = prefill.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        assert decode.handoff.reserve(decode.build_request(str(index), ids, params))
        prefill.add_request(str(index), ids, params, prefill_only=True)
    tokens: dict[str, list[int]] = {}
    while prefill.has_unfinished_requests() or decode.has_unfinished_requests():
        for output in prefill.step():
            handed = prefill.handoff.pop_prefilled(output.request_id)
            buffer = decode.handoff.receive_buffer(output.request_id)
            assert buffer.shape == handed.kv.shape
            buffer.copy_(handed.kv)
            adopted = decode.handoff.adopt(
                output.request_id, buffer, handed.first_token, handed.logprobs
            )
            first = decode.admit_prefilled(*adopted)
            tokens[first.request_id] = first.outputs[0].token_ids
            outputs[first.request_id] = first
        for output in decode.step():
            tokens[output.request_id] = output.outputs[0].token_ids
            outputs[output.request_id] = output
    assert decode.block_manager.num_free_blocks == free_before
    assert prefill.block_manager.num_free_blocks == prefill.block_manager.num_blocks
    return tokens
