"""The API's edges against a real server (issue 48): stop_token_ids is honoured (it was
accepted and ignored), best_of is strict, and one completions call cannot fill the admission
bound, with the official openai client."""

from __future__ import annotations

import openai
import pytest

from splitserve import LLM, SamplingParams
from tests.support.server_process import ServerProcess

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def client(default_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=default_server.api, api_key="none", max_retries=0)


def test_stop_token_ids_end_the_output_at_that_token(
    client: openai.OpenAI, smollm2_llm: LLM
) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ids = smollm2_llm.generate(PROMPT, greedy, use_tqdm=False)[0].outputs[0].token_ids
    cut = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])
    out = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=8,
        temperature=0,
        extra_body={"stop_token_ids": [ids[cut]], "ignore_eos": True},
    )
    assert out.choices[0].finish_reason == "stop"
    assert out.usage is not None and out.usage.completion_tokens == cut + 1


def test_best_of_true_is_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=MODEL, prompt="a", max_tokens=1, best_of=True)
    assert raised.value.response.json()["error"]["param"] == "best_of"


def test_one_call_cannot_fill_the_admission_bound(client: openai.OpenAI) -> None:
    """256 prompts filled max_queue (256) and everyone else got 503 while they ran."""
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=MODEL, prompt=["a"] * 256, max_tokens=1)
    assert raised.value.response.json()["error"]["message"] == (
        "prompt: 256 prompt(s) x n=1 make 256 engine requests, more than the 128 this server "
        "admits at once for one client (server.client_share)"
    )
