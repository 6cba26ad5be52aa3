"""A request resumed after k of its tokens (engine/resume.py: the prompt followed by those
tokens, ``resumed=k``) continues with exactly the tokens an undisturbed run samples after
them: greedy, seeded sampling (its generator advanced past k draws), and under a JSON schema
(its matcher fed the k tokens)."""

from __future__ import annotations

import itertools

import pytest

from splitserve.engine.llm import LLM
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.sampling_params import SamplingParams, StructuredOutputsParams

PROMPT = [1, 504, 3458, 314, 253, 1167, 2115, 30, 2]
_ids = itertools.count()


def generate(
    engine: LLMEngine, prompt: list[int], params: SamplingParams, resumed: int = 0
) -> list[int]:
    request_id = f"resume-{next(_ids)}"
    engine.add_request(request_id, prompt, params, resumed=resumed)
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id == request_id and output.finished:
                return list(output.outputs[0].token_ids)
    raise AssertionError("the request did not finish")


SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
CASES = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
    "seeded": SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True),
    "json_schema": SamplingParams(
        temperature=0.0, max_tokens=24, structured_outputs=StructuredOutputsParams(json=SCHEMA)
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_resumed_request_continues_as_the_undisturbed_run(smollm2_llm: LLM, case: str) -> None:
    engine, params = smollm2_llm.engine, CASES[case]
    undisturbed = generate(engine, PROMPT, params)
    assert len(undisturbed) > 6
    done = undisturbed[:5]
    assert params.max_tokens is not None
    rest = SamplingParams(**{**params.__dict__, "max_tokens": params.max_tokens - 5})
    assert generate(engine, PROMPT + done, rest, resumed=5) == undisturbed[5:]


def test_resumed_tokens_that_break_the_constraint_are_refused(smollm2_llm: LLM) -> None:
    params = CASES["json_schema"]
    not_json = smollm2_llm.engine.tokenizer.encode("hello")
    with pytest.raises(ValueError, match="breaks the request's constraint"):
        smollm2_llm.engine.add_request("bad", PROMPT + not_json, params, resumed=len(not_json))
    assert "bad" not in smollm2_llm.engine.requests
