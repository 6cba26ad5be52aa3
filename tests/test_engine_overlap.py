"""Overlapped decode steps (engine/overlap.py) give the same outputs as synchronous steps.

On CPU nothing runs asynchronously, but the whole bookkeeping does: tokens that stay on the
device and feed the next step, outputs read one step late, requests found finished after the
next step was launched, arrivals and aborts while a step is in flight, and the fallback to
synchronous steps when blocks run short.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from splitserve import LLM, SamplingParams
from splitserve.engine.request import RequestOutput

pytestmark = pytest.mark.slow

PROMPTS = [
    "The three primary colours are",
    "Write a haiku about rain:",
    "List five prime numbers:",
    "def fibonacci(n):",
    "Translate 'good morning' into French:",
    "Once upon a time, in a small village,",
]


def _params() -> list[SamplingParams]:
    """Different lengths, an EOS stop, a stop string and a stop token: requests finish at
    different steps while the others go on."""
    return [
        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0),
        SamplingParams(max_tokens=30, temperature=0, stop=["7"]),
        SamplingParams(max_tokens=9, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=33, temperature=0, stop_token_ids=[29]),
        SamplingParams(max_tokens=17, temperature=0, ignore_eos=True),
    ]


def _run(llm: LLM) -> dict[str, RequestOutput]:
    engine = llm.engine
    for i, (prompt, params) in enumerate(zip(PROMPTS, _params())):
        engine.add_request(str(i), prompt, params)
    done: dict[str, RequestOutput] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        steps += 1
        if steps == 6:  # a new request arrives while a decode step is in flight
            engine.add_request("late", "Name a famous bridge:", _params()[0])
        if steps == 9:  # and one is aborted
            engine.abort_request("1")
    return done


def _summary(outputs: dict[str, RequestOutput]) -> dict[str, tuple]:
    return {
        key: (o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason)
        for key, o in outputs.items()
    }


@pytest.fixture(scope="module")
def synchronous(make_llm: Callable[..., LLM]) -> dict[str, tuple]:
    return _summary(_run(make_llm(overlap_scheduling=False)))


def test_overlapped_steps_equal_synchronous_steps(
    make_llm: Callable[..., LLM], synchronous: dict[str, tuple]
) -> None:
    llm = make_llm(overlap_scheduling=True)
    assert llm.engine.runner.overlapped is not None
    overlapped = _summary(_run(llm))
    assert overlapped == synchronous
    assert llm.engine.num_overlapped_steps >= 20
    # Every step is timed by phase; overlapped steps wait for the tokens of the one before.
    phases = llm.engine.phases.seconds
    assert set(phases) == {"schedule", "forward", "wait", "outputs"}
    assert all(seconds > 0 for seconds in phases.values())
    assert llm.engine.num_steps > llm.engine.num_overlapped_steps
    assert "1" not in overlapped and "late" in overlapped
    assert {key: value[2] for key, value in overlapped.items()}["3"] == "length"
    # Every block is back once the last step in flight has been read.
    manager = llm.engine.block_manager
    assert manager.num_free_blocks == manager.num_blocks
    assert not llm.engine.has_unfinished_requests()


def test_overlap_with_too_few_blocks_falls_back_and_still_matches(
    make_llm: Callable[..., LLM], synchronous: dict[str, tuple]
) -> None:
    # 8 blocks of 16 tokens cannot hold all the sequences: steps preempt and recompute,
    # which only the synchronous path does.
    llm = make_llm(overlap_scheduling=True, num_kv_blocks=8)
    assert _summary(_run(llm)) == synchronous
    assert llm.engine.stats().num_preemptions > 0
    assert llm.engine.num_overlapped_steps > 0


def test_prefix_blocks_published_by_overlapped_steps_are_reused(
    make_llm: Callable[..., LLM],
) -> None:
    """Blocks completed by generated tokens get their hashes once those tokens are known: a
    prompt that repeats a whole generated sequence reuses its blocks and outputs the same."""
    llm = make_llm(overlap_scheduling=True)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    first = llm.generate(["Describe a lighthouse at night:"], params, use_tqdm=False)[0]
    sequence = first.prompt_token_ids + first.outputs[0].token_ids
    again = llm.generate([[*sequence, 13]], params, use_tqdm=False)[0]
    assert again.num_cached_tokens == (len(sequence) - 1) // 16 * 16
    fresh = make_llm(overlap_scheduling=False, enable_prefix_caching=False)
    reference = fresh.generate([[*sequence, 13]], params, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == reference.outputs[0].token_ids
