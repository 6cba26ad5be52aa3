"""A random-weight shape served end to end by a real `splitserve serve` (the default 1P1D
deployment), `shape:tiny-deepseek-v4`: its completions equal the offline engine's (the handoff
of V4's KV cache groups, a prefix hit replayed on the prefill worker); completions through the
official openai client with token-id and numeric-text prompts; `splitserve bench serve` with
the shape's tokenizer, its shared-prefix and multi-turn datasets included. One deployment: a
second (`shape:tiny-llama`) cost the suite about 15 s."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from splitserve import LLM, SamplingParams
from splitserve.engine.loader import NumericTokenizer, load_tokenizer
from tests.support.server_process import REPO, ServerProcess, serve

MODEL = "shape:tiny-deepseek-v4"
VOCAB = 512


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with serve(f"model={MODEL}") as process:
        yield process


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api, api_key="unused", max_retries=0)


def test_numeric_tokenizer_has_what_the_server_and_load_generator_ask_for() -> None:
    tokenizer = load_tokenizer(MODEL)
    assert isinstance(tokenizer, NumericTokenizer)
    assert len(tokenizer) == VOCAB
    assert tokenizer.all_special_ids == []
    assert tokenizer.chat_template is not None  # roles and markers write no ids
    chat = [{"role": "system", "content": "5 17"}, {"role": "user", "content": "300"}]
    assert tokenizer.apply_chat_template(chat, add_generation_prompt=True) == [5, 17, 300]
    assert tokenizer.apply_chat_template(chat, tokenize=False) == " 5 17 300"
    assert tokenizer.eos_token_id is None
    assert tokenizer.encode("5 17 300", add_special_tokens=False) == [5, 17, 300]
    assert tokenizer.decode([5, 17, 300]) == " 5 17 300"
    assert tokenizer.encode(tokenizer.decode([0, 511, 42])) == [0, 511, 42]


@pytest.mark.slow
def test_shape_model_completes_token_id_and_numeric_text_prompts_alike(
    client: openai.OpenAI,
) -> None:
    by_ids = client.completions.create(
        model=MODEL, prompt=[5, 17, 300], max_tokens=6, temperature=0
    )
    by_text = client.completions.create(model=MODEL, prompt="5 17 300", max_tokens=6, temperature=0)
    for out in (by_ids, by_text):
        assert out.choices[0].finish_reason == "length"
        assert out.usage is not None
        assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (3, 6)
    tokens = [int(word) for word in by_ids.choices[0].text.split()]
    assert len(tokens) == 6 and all(0 <= t < VOCAB for t in tokens)
    assert by_ids.choices[0].text == "".join(f" {t}" for t in tokens)
    with pytest.raises(openai.BadRequestError) as error:  # prose: not a 500
        client.completions.create(model=MODEL, prompt="5 and 17", max_tokens=6)
    assert error.value.status_code == 400
    assert "whitespace-separated integers" in str(error.value)
    assert by_text.choices[0].text == by_ids.choices[0].text


@pytest.mark.slow
def test_bench_serve_completes_every_request_against_a_shape_model(
    server: ServerProcess, tmp_path: Path
) -> None:
    result = tmp_path / "serve.json"
    command = [sys.executable, "-m", "splitserve.cli", "bench", "serve"]
    command += ["--base-url", server.url, "--tokenizer", MODEL, "--num-prompts", "6"]
    command += ["--random-input-len", "16", "--random-output-len", "8", "--ignore-eos"]
    command += ["--result-file", str(result), "--disable-tqdm"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    record = json.loads(result.read_text())
    assert record["model_id"] == MODEL
    assert (record["completed"], record["failed"]) == (6, 0)
    assert record["total_input_tokens"] == 6 * 16
    assert record["total_output_tokens"] == 6 * 8


@pytest.mark.slow
@pytest.mark.parametrize(
    ("dataset", "endpoint", "prompts", "input_tokens"),
    [
        # 2 system prompts of 24 ids, each with 2 users' questions of 4: 4 prompts of 28.
        (["shared-prefix", "--shared-prefix-num-prefixes", "2", "--shared-prefix-users", "2",
          "--shared-prefix-system-len", "24", "--shared-prefix-question-len", "4"], "chat", 4, 112),
        # 2 conversations of 2 turns of 6 ids (system, user), the reply 3: 12 then 21 ids.
        (["multi-turn", "--multi-turn-conversations", "2", "--multi-turn-turns", "2",
          "--multi-turn-turn-len", "6"], "completions", 4, 2 * 12 + 2 * 21),
    ],
)  # fmt: skip
def test_bench_serve_runs_the_prefix_datasets_against_a_shape_model(
    server: ServerProcess,
    tmp_path: Path,
    dataset: list[str],
    endpoint: str,
    prompts: int,
    input_tokens: int,
) -> None:
    result = tmp_path / "serve.json"
    command = [sys.executable, "-m", "splitserve.cli", "bench", "serve", "--dataset", *dataset]
    command += ["--base-url", server.url, "--tokenizer", MODEL, "--endpoint", endpoint]
    command += ["--num-prompts", str(prompts), "--output-len", "3", "--ignore-eos"]
    command += ["--result-file", str(result), "--disable-tqdm"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    record = json.loads(result.read_text())
    assert (record["completed"], record["failed"]) == (prompts, 0)
    assert record["total_input_tokens"] == input_tokens
    assert record["total_output_tokens"] == prompts * 3


@pytest.mark.slow
def test_deepseek_v4_served_1p1d_completes_as_offline(client: openai.OpenAI) -> None:
    """A prompt of 3 tokens and one of 100 (12 windows, 25 CSA and 12 HCA entries), then the
    second again with 20 more (a prefix hit on the prefill worker, the window replayed): the
    decode worker goes on from the handed-over entries and window rows as one engine does."""
    long = [(7 * i) % 500 + 3 for i in range(100)]
    prompts = [[5, 17, 300], long, long + list(range(40, 60))]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    offline = [o.outputs[0].text for o in LLM(model=MODEL).generate(prompts, params, False)]
    served = [
        client.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0)
        .choices[0]
        .text
        for p in prompts
    ]
    assert served == offline
