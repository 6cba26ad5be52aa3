"""A request resumed after k of its tokens (engine/resume.py: the prompt followed by those
tokens, ``resumed=k``) continues with exactly the tokens an undisturbed run samples after
them: greedy, seeded sampling (its generator advanced past k draws), under frequency and
presence penalties (the k tokens count as output), and under a JSON schema (its matcher fed the
k tokens); text its client had not been sent yet comes first."""

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
    "penalized": SamplingParams(
        temperature=0.0, max_tokens=16, ignore_eos=True, frequency_penalty=1.5, presence_penalty=1
    ),
    "json_schema": SamplingParams(
        temperature=0.0, max_tokens=24, structured_outputs=StructuredOutputsParams(json=SCHEMA)
    ),
}
# A prompt whose continuation repeats the first tokens unless they are penalized.
PROMPT_TEXT = {"penalized": "Count: 1, 2, 3, 4,"}


@pytest.mark.parametrize("case", list(CASES))
def test_a_resumed_request_continues_as_the_undisturbed_run(smollm2_llm: LLM, case: str) -> None:
    engine, params = smollm2_llm.engine, CASES[case]
    prompt = engine.tokenizer.encode(PROMPT_TEXT[case]) if case in PROMPT_TEXT else PROMPT
    undisturbed = generate(engine, prompt, params)
    assert len(undisturbed) > 6
    done = undisturbed[:5]
    assert params.max_tokens is not None
    rest = SamplingParams(**{**params.__dict__, "max_tokens": params.max_tokens - 5})
    assert generate(engine, prompt + done, rest, resumed=5) == undisturbed[5:]


def test_resumed_tokens_that_break_the_constraint_are_refused(smollm2_llm: LLM) -> None:
    params = CASES["json_schema"]
    not_json = smollm2_llm.engine.tokenizer.encode("hello")
    with pytest.raises(ValueError, match="breaks the request's constraint"):
        smollm2_llm.engine.add_request("bad", PROMPT + not_json, params, resumed=len(not_json))
    assert "bad" not in smollm2_llm.engine.requests


def stream(
    engine: LLMEngine, prompt: list[int], params: SamplingParams, **resume: int
) -> list[tuple[int, str, str | None]]:
    """(output tokens, visible text, finish reason) after every step that gave the request
    a token."""
    request_id = f"resume-{next(_ids)}"
    engine.add_request(request_id, prompt, params, **resume)
    seen = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id == request_id:
                out = output.outputs[0]
                seen.append((len(out.token_ids), out.text, out.finish_reason))
    return seen


def test_text_held_back_for_a_stop_string_comes_out_after_the_move(smollm2_llm: LLM) -> None:
    """The earlier run held back the start of what might be a stop string; the client had
    only the text before it. The resumed run sends that text first, and finds a stop string
    that begins before the move and ends after it."""
    engine = smollm2_llm.engine
    params = CASES["greedy"]
    tokens = generate(engine, PROMPT, params)
    done = tokens[:5]
    full = engine.tokenizer.decode(tokens, skip_special_tokens=True)
    cut = len(engine.tokenizer.decode(done, skip_special_tokens=True))
    stop = full[cut - 2 : cut + 3]
    assert len(stop) == 5 and full.find(stop) == cut - 2, (full, cut)
    stopping = SamplingParams(**{**params.__dict__, "stop": [stop]})

    undisturbed = stream(engine, PROMPT, stopping)
    assert undisturbed[-1][1:] == (full[: cut - 2], "stop")
    shown = next(text for count, text, _ in undisturbed if count == 5)
    assert len(shown) < cut  # held back: the client does not have all of the 5 tokens' text

    rest = SamplingParams(**{**stopping.__dict__, "max_tokens": 7})
    resumed = stream(engine, PROMPT + done, rest, resumed=5, resumed_chars=len(shown))
    assert shown + resumed[-1][1] == full[: cut - 2]
    assert resumed[-1][2] == "stop"
