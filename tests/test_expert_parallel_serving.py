"""Expert-parallel decode groups in the service: the tiny Mixtral, Qwen3-MoE and DeepSeek-V3
checkpoints served through one prefill worker and a decode pool of ``expert_parallel`` ranks
(Gloo on CPU). The served text equals the offline engine's, token for token, whose greedy token
ids equal transformers' (the near-tie rule of tests/support/reference.py). Every rank of the
group decodes requests of its own, so the ranks' lockstep (one of them idle at times) and the
prefill worker's KV handoff to each rank are exercised. (At EP = 1 a MoE model is served by a
plain decode worker, the path of every dense model in the other serving tests; its MoE layers
are the offline engine's, checked against transformers here in every case.)"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from splitserve import SamplingParams
from splitserve.cli import main as cli_main
from splitserve.eplb.traces import load_served, load_trace
from tests.support.reference import assert_greedy_equal, hf_greedy
from tests.support.server_process import ServerProcess, serve, worker_metric, worker_pids
from tests.support.tiny_models import tiny_deepseek_v3, tiny_llm, tiny_mixtral, tiny_qwen3_moe
from tests.support.wait import wait_for

pytestmark = pytest.mark.slow

MAX_TOKENS = 10
SMALL = (
    "pools.prefill.num_cpus=0.1",
    "pools.decode.num_cpus=0.1",
    "pools.prefill.engine.kv_cache_bytes=8388608",
    "pools.decode.engine.kv_cache_bytes=8388608",
    "router.policy=least_loaded",
)
"""Every deployment here: small CPU shares and KV pools, requests spread by load."""
BUILDERS = {"mixtral": tiny_mixtral, "qwen3_moe": tiny_qwen3_moe, "deepseek_v3": tiny_deepseek_v3}


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


@pytest.fixture(scope="module")
def offline(
    checkpoints: dict[str, tuple[Any, str, list[list[int]]]],
    prompts: list[list[int]],
    smollm2_tokenizer: Any,
) -> dict[str, list[Any]]:
    """family -> the offline engine's greedy outputs (one engine per family for the module)."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    outputs = {}
    for family, (_, path, _) in checkpoints.items():
        llm = tiny_llm(path, smollm2_tokenizer, max_model_len=512, block_size=16)
        outputs[family] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    return outputs


EPLB = "pools.decode.engine.eplb={interval_steps: 3, redundant_experts: 2}"
RECORD = "pools.decode.engine.record_expert_load=true"


@pytest.mark.parametrize(
    ("family", "ranks", "eplb"),
    [
        ("qwen3_moe", 4, False),  # records its expert load; Mixtral served at EP = 2: the next test
        ("deepseek_v3", 4, True),  # latent KV handed to each rank, shared experts on each
    ],
    ids=["qwen3_moe-ep4", "deepseek_v3-ep4-eplb"],
)
def test_moe_served_1p1d_with_an_expert_parallel_decode_group_equals_transformers(
    checkpoints: dict[str, tuple[Any, str, list[list[int]]]],
    offline: dict[str, list[Any]],
    prompts: list[list[int]],
    family: str,
    ranks: int,
    eplb: bool,
    tmp_path: Path,
) -> None:
    """With ``eplb``, the group rebalances its experts every 3 steps while it decodes (2
    redundant copies): the outputs do not change. The Qwen3-MoE group of 4 records its expert
    load to files (``expert_load_dir``) that the EPLB simulator reads."""
    model, path, reference = checkpoints[family]
    for prompt, output, ref in zip(prompts, offline[family], reference):
        assert_greedy_equal(model, prompt, output.token_ids, ref)
    trace_dir = tmp_path / "expert-load"
    record = family == "qwen3_moe" and ranks == 4
    recording = [RECORD, f"pools.decode.engine.expert_load_dir={trace_dir}"] if record else []
    with serve(
        f"model={path}",
        f"pools.decode.expert_parallel={ranks}",
        *SMALL,
        *([EPLB] if eplb else []),
        *recording,
    ) as server:
        texts = asyncio.run(_complete_all(server, path, prompts))
        decoders = _decode_workers(server)
        if ranks > 1:
            ready = 'splitserve:expert_group_ranks{group="decode-0",'
            assert _gauge(server, ready, 'state="ready"') == ranks
        if eplb:
            wait_for(lambda: _rebalanced(server, ranks), 10, message="every rank's rebalances")
    assert texts == [o.text for o in offline[family]]
    names = {"decode-0"} if ranks == 1 else {f"decode-0.{r}" for r in range(ranks)}
    assert decoders == names, f"requests decoded on {sorted(decoders)}, ranks {sorted(names)}"
    if record:
        _check_served_trace(trace_dir, names, model.config, len(prompts))


def _check_served_trace(trace_dir: Path, ranks: set[str], config: Any, requests: int) -> None:
    """Each rank wrote its expert load when the server stopped, the same number of steps; in
    the group's sum every decoded token was routed to top-k experts in every MoE layer, and
    the simulator reads the directory."""
    assert {p.name for p in trace_dir.iterdir()} == {f"{r}-g0-0000.json" for r in ranks}
    # An idle rank's pass counts as a step too: every rank recorded the group's steps.
    assert len({len(load_trace(p)) for p in trace_dir.iterdir()}) == 1
    trace = load_served(trace_dir)
    moe_layers = config.num_hidden_layers - len(config.mlp_only_layers)
    assert trace.shape[1:] == (moe_layers, config.num_experts)
    per_layer = trace.sum(dim=(0, 2))
    assert len(set(per_layer.tolist())) == 1, per_layer  # every token in every layer
    tokens = int(per_layer[0]) // config.num_experts_per_tok
    assert int(per_layer[0]) % config.num_experts_per_tok == 0
    # The decode ranks step each request from its first token on: at most MAX_TOKENS - 1
    # decode steps each, at least one for some request.
    assert 0 < tokens <= requests * (MAX_TOKENS - 1), tokens
    out = trace_dir / "simulated.json"
    bench = ["bench", "eplb", "--trace-dir", str(trace_dir), "--ranks", "2", "4"]
    assert cli_main([*bench, "--redundant", "0", "--interval", "4", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["trace"]["kind"] == "served"


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
    return {json.loads(line)["decode_worker"] for line in _request_lines(server)}


def test_a_killed_rank_takes_its_group_out_its_requests_migrate_and_the_group_comes_back(
    checkpoints: dict[str, tuple[Any, str, list[list[int]]]],
    offline: dict[str, list[Any]],
    prompts: list[list[int]],
    smollm2_tokenizer: Any,
) -> None:
    """Two decode groups of 2 ranks. SIGKILL one rank while every group streams: the requests
    of both its ranks continue on the other group (migration) with the text of an
    uninterrupted run; the group is restarted whole (both ranks, a new generation) and
    decodes again."""
    _, path, _ = checkpoints["mixtral"]
    params = SamplingParams(max_tokens=LONG_TOKENS, temperature=0, ignore_eos=True)
    llm = tiny_llm(path, smollm2_tokenizer, max_model_len=512, block_size=16)
    expected = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    expected_short = [o.text for o in offline["mixtral"]]
    with serve(
        f"model={path}", "pools.decode.replicas=2", "pools.decode.expert_parallel=2", *SMALL
    ) as server:
        pid = worker_pids(server)["decode-0.1"]
        # Every rank has taken a handoff once, so that no rank's first transfer is slow
        # enough for the others' requests to finish before the kill.
        asyncio.run(_complete_all(server, path, prompts))
        texts = asyncio.run(_stream_all_killing(server, path, prompts, pid))
        assert texts == expected
        migrated = _migrations(server)
        assert set(migrated) == {"decode-0.0", "decode-0.1"}, migrated
        # The group left the pool whole before its requests moved: each moved once, to decode-1.
        moved = [json.loads(line) for line in _request_lines(server) if ".m" in line]
        assert {m["request_id"].rsplit(".", 1)[1] for m in moved} == {"m1"}, moved
        assert {m["decode_worker"] for m in moved} <= {"decode-1.0", "decode-1.1"}, moved
        assert sum(migrated.values()) == len(moved), (migrated, moved)
        wait_for(
            lambda: _restarted(server) >= {"decode-0.0", "decode-0.1"},
            60,
            message="both ranks of decode-0 restarted",
        )
        wait_for(lambda: _ready(server), 30, message="every worker back in the pool")
        before = len(_request_lines(server))
        again = asyncio.run(_complete_all(server, path, prompts))
        decoders = {json.loads(line)["decode_worker"] for line in _request_lines(server)[before:]}
    assert again == expected_short
    assert {"decode-0.0", "decode-0.1"} <= decoders, f"decoded on {sorted(decoders)}"


LONG_TOKENS = 400
"""Long enough that every stream is still running when the rank dies: at 120 tokens eight
streams took 1.3 s in all, and on a loaded machine all had finished before the kill landed
(nothing to migrate; 1 run in 5)."""


async def _stream_all_killing(
    server: ServerProcess, model: str, prompts: list[list[int]], pid: int
) -> list[str]:
    """Stream every prompt at once; once each has streamed a few tokens, SIGKILL ``pid``."""
    client = openai.AsyncOpenAI(base_url=server.api, api_key="unused", max_retries=0)
    started = [asyncio.Event() for _ in prompts]

    async def one(i: int) -> str:
        stream = await client.completions.create(
            model=model,
            prompt=prompts[i],
            max_tokens=LONG_TOKENS,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        text = []
        async for chunk in stream:
            text.append(chunk.choices[0].text if chunk.choices else "")
            if len(text) >= 3:
                started[i].set()
        return "".join(text)

    async def kill() -> None:
        await asyncio.gather(*(e.wait() for e in started))
        assert not any(t.done() for t in streams), "a request finished before the kill"
        os.kill(pid, signal.SIGKILL)

    streams = [asyncio.ensure_future(one(i)) for i in range(len(prompts))]
    *texts, _ = await asyncio.gather(*streams, kill())
    return list(texts)


def _request_lines(server: ServerProcess) -> list[str]:
    prefix = "splitserve request "
    return [line[len(prefix) :] for line in server.lines if line.startswith(prefix)]


def _restarted(server: ServerProcess) -> set[str]:
    return {line.split()[2] for line in server.lines if " restarted in " in line}


def _migrations(server: ServerProcess) -> dict[str, float]:
    """Worker left -> requests that migrated off it (request_migrations_total)."""
    moved: dict[str, float] = {}
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        if line.startswith("splitserve:request_migrations_total{"):
            worker = line.split('worker="', 1)[1].split('"', 1)[0]
            moved[worker] = moved.get(worker, 0.0) + float(line.rsplit(" ", 1)[1])
    return {w: n for w, n in moved.items() if n > 0}


def _rebalanced(server: ServerProcess, ranks: int) -> bool:
    """Every rank of decode-0 reports the same rebalances, at least two."""
    name = "splitserve:eplb_rebalances_total"
    counts = {worker_metric(server.url, name, f"decode-0.{r}") for r in range(ranks)}
    return len(counts) == 1 and min(counts) >= 2


def _gauge(server: ServerProcess, prefix: str, label: str) -> float:
    """The value of the /metrics series that starts with ``prefix`` and has ``label``."""
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        if line.startswith(prefix) and label in line:
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(prefix + label)


def _ready(server: ServerProcess) -> bool:
    return bool(httpx.get(f"{server.url}/health").status_code == 200)
