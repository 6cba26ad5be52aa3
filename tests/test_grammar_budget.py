"""Cost isolation of structured outputs on the real SmolLM2: a grammar whose every mask costs
more than the last (xgrammar tracks more parses with each token) has its masks filled ahead,
off the steps, so a plain request beside it keeps its solo latency; and it ends with a clear
error once its constraint work passes its budget."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch
import xgrammar as xgr

from splitserve import LLM, SamplingParams, StructuredOutputsParams
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.request import RequestOutput
from splitserve.engine.structured.matcher import SLOW_FILL_S, RequestGrammar

pytestmark = pytest.mark.slow

COSTLY = "root ::= (a | a a | a a a)*\na ::= [a-z]* | [a-z]+ [a-z]*"
"""Issue 48's grammar: each token's mask took longer, 5 s a token by the 80th."""
BUDGET_S = 0.25
LIMIT_S = 120
"""Its fills run at the lowest priority: on a busy machine 0.25 s of CPU can take a while."""


def costly(max_tokens: int = 100) -> SamplingParams:
    spec = StructuredOutputsParams(grammar=COSTLY)
    return SamplingParams(
        temperature=0, max_tokens=max_tokens, min_tokens=max_tokens, structured_outputs=spec
    )


PLAIN = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def run(
    engine: LLMEngine, requests: dict[str, tuple[str, SamplingParams]], limit_s: float
) -> dict[str, tuple[float, RequestOutput]]:
    """Each request's seconds to its last output, and that output; stops at limit_s."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    start = time.perf_counter()
    done: dict[str, tuple[float, RequestOutput]] = {}
    while engine.has_unfinished_requests() and time.perf_counter() - start < limit_s:
        for output in engine.step():
            if output.finished:
                done[output.request_id] = (time.perf_counter() - start, output)
    for request_id in requests:
        engine.abort_request(request_id)
    return done


def test_a_costly_grammar_leaves_its_neighbour_its_solo_latency_and_ends_with_an_error(
    make_llm: Callable[..., LLM],
) -> None:
    engine = make_llm(grammar_budget_s=BUDGET_S).engine
    plain = {"plain": ("Tell me about the sea.", PLAIN)}
    run(engine, plain, 60)  # warm: the prompt's blocks are cached for every run after
    solo, beside, ended = [], [], []
    for _ in range(2):  # the best of two of each: the machine is shared
        solo.append(run(engine, plain, 60)["plain"][0])
        both = run(engine, {"costly": ("Write some letters.", costly()), **plain}, LIMIT_S)
        beside.append(both["plain"][0])
        assert "costly" in both, f"the costly request ran past {LIMIT_S} s"
        ended.append(both["costly"][1].outputs[0])
    assert min(beside) <= 1.5 * min(solo), f"{beside} s beside the costly grammar, {solo} s solo"
    for completion in ended:
        tokens = len(completion.token_ids)
        assert completion.finish_reason == "error"
        assert 0 < tokens < 100
        assert completion.stop_reason == (
            f"the structured output constraint took more than its compute budget of 0.25 s "
            f"(CPU time computing which tokens it allows) after {tokens} tokens"
        )
        assert completion.text.isalpha() and completion.text.islower()  # the grammar's output


def test_masks_filled_ahead_are_the_masks_filled_in_the_step(make_llm: Callable[..., LLM]) -> None:
    engine = make_llm().engine
    compiled = engine.compile_grammar(StructuredOutputsParams(grammar=COSTLY))
    vocab = engine.model_config.vocab_size
    ahead, inline = RequestGrammar(compiled), RequestGrammar(compiled)
    tokens = engine.tokenizer.encode("abcdefghijklmnopqrstuvwxyz" * 3)
    bitmask, expected = (xgr.allocate_token_bitmask(1, vocab) for _ in range(2))

    def step(token: int) -> None:
        while not ahead.ready:
            time.sleep(0.001)
        ahead.fill(bitmask, 0)
        inline.matcher.fill_next_token_bitmask(expected, 0)
        assert torch.equal(bitmask, expected)
        assert ahead.accept(token) and inline.accept(token)
        ahead.fill_ahead()

    count = 0
    while not ahead.deferred and count < len(tokens):
        step(tokens[count])
        count += 1
    assert ahead.deferred, f"no fill over {SLOW_FILL_S} s in {len(tokens)} tokens"
    for token in tokens[count : count + 4]:
        step(token)
    assert ahead.spent_s > SLOW_FILL_S
