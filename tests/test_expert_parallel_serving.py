"""Expert-parallel decode groups in the service: the tiny Mixtral and Qwen3-MoE checkpoints served
through one prefill worker and a decode pool of ``expert_parallel`` ranks (Gloo on CPU). The
served text equals the offline engine's, token for token, whose greedy token ids equal
transformers' (the near-tie rule of tests/support/reference.py). Every rank of the group
decodes requests of its own, so the ranks' lockstep (one of them idle at times) and the prefill
worker's KV handoff to each rank are exercised."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from splitserve import LLM, SamplingParams
from tests.support.reference import assert_greedy_equal, hf_greedy
from tests.support.server_process import ServerProcess, serve
from tests.support.tiny_models import tiny_mixtral, tiny_qwen3_moe

pytestmark = pytest.mark.slow

MAX_TOKENS = 10
BUILDERS = {"mixtral": tiny_mixtral, "qwen3_moe": tiny_qwen3_moe}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(11)
    lengths = [3, 17, 5, 29, 8, 12, 40, 6]
    return [torch.randint(100, 40000, (n,), generator=generator).tolist() for n in lengths]


@pytest.fixture(scope="module")
def checkpoints(
    smollm2_tokenizer: Any, tmp_path_factory: pytest.TempPathFactory, prompts: list[list[int]]
) -> dict[str, tuple[Any, str, list[list[int]]]]:
    """family -> (the transformers model, its directory, its greedy continuations)."""
    root = tmp_path_factory.mktemp("moe")
    built = {}
    for family, builder in BUILDERS.items():
        model, path = builder(smollm2_tokenizer, Path(root) / family)
        built[family] = (model, path, hf_greedy(model, prompts, MAX_TOKENS, pad_id=0))
    return built


@pytest.mark.parametrize(
    ("family", "ranks"), [("mixtral", 1), ("mixtral", 2), ("qwen3_moe", 2), ("qwen3_moe", 4)]
)
def test_moe_served_1p1d_with_an_expert_parallel_decode_group_equals_transformers(
    checkpoints: dict[str, tuple[Any, str, list[list[int]]]],
    prompts: list[list[int]],
    family: str,
    ranks: int,
) -> None:
    model, path, reference = checkpoints[family]
    llm = LLM(model=path, max_model_len=512, block_size=16)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    offline = llm.generate(prompts, params, use_tqdm=False)
    for prompt, output, ref in zip(prompts, offline, reference):
        assert_greedy_equal(model, prompt, output.outputs[0].token_ids, ref)
    with serve(
        f"model={path}",
        f"pools.decode.expert_parallel={ranks}",
        "pools.prefill.num_cpus=0.1",
        "pools.decode.num_cpus=0.1",
        "pools.prefill.engine.kv_cache_bytes=8388608",
        "pools.decode.engine.kv_cache_bytes=8388608",
        "router.policy=least_loaded",
    ) as server:
        texts = asyncio.run(_complete_all(server, path, prompts))
        decoders = _decode_workers(server)
    assert texts == [o.outputs[0].text for o in offline]
    names = {"decode-0"} if ranks == 1 else {f"decode-0.{r}" for r in range(ranks)}
    assert decoders == names, f"requests decoded on {sorted(decoders)}, ranks {sorted(names)}"


async def _complete_all(server: ServerProcess, model: str, prompts: list[list[int]]) -> list[str]:
    """Every prompt at once, greedy: the completions' texts."""
    client = openai.AsyncOpenAI(base_url=server.api, api_key="unused", max_retries=0)

    async def one(prompt: list[int]) -> str:
        response = await client.completions.create(
            model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
        )
        return response.choices[0].text

    return list(await asyncio.gather(*(one(p) for p in prompts)))


def _decode_workers(server: ServerProcess) -> set[str]:
    """The decode worker of each request, from the server's request log lines."""
    prefix = "splitserve request "
    lines = [line for line in server.lines if line.startswith(prefix)]
    return {json.loads(line[len(prefix) :])["decode_worker"] for line in lines}
