"""`splitserve bench serve` end to end, against a stub OpenAI-compatible streaming server.

The stub is a test double for the harness only: it streams TOKENS text events ``DELAY_S``
apart, reports usage, and answers HTTP 500 to any prompt containing "fail".
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from tests.support.wait import wait_for

REPO = Path(__file__).resolve().parents[1]
TOKENS = 5
DELAY_S = 0.02
PROMPT_TOKENS = 7


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def _stub_app(bodies: list[dict[str, Any]]) -> FastAPI:
    app = FastAPI()

    async def stream(chat: bool) -> AsyncIterator[str]:
        if chat:  # a role-only first event, as OpenAI sends: not a token
            yield _event({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
        for i in range(TOKENS):
            await asyncio.sleep(DELAY_S)  # the pacing the harness's TTFT and ITL must measure
            choice = {"index": 0, "delta": {"content": f"t{i} "}} if chat else {"text": f"t{i} "}
            yield _event({"choices": [choice]})
        usage = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": TOKENS}
        yield _event({"choices": [], "usage": usage})
        yield "data: [DONE]\n\n"

    async def handle(request: Request, chat: bool) -> Any:
        body = await request.json()
        bodies.append(body)
        if "fail" in json.dumps(body.get("messages") or body.get("prompt")):
            return JSONResponse({"error": {"message": "stub failure"}}, status_code=500)
        return StreamingResponse(stream(chat), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        return await handle(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await handle(request, chat=False)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "stub-model", "object": "model"}]}

    return app


@pytest.fixture(scope="module")
def stub() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """The stub on a free loopback port, in a thread; yields its URL and the bodies it got."""
    bodies: list[dict[str, Any]] = []
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(_stub_app(bodies), log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_for(lambda: server.started, 10, interval=0.02, message="the stub server started")
    yield f"http://127.0.0.1:{port}", bodies
    server.should_exit = True
    thread.join(timeout=5)
    sock.close()


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "splitserve.bench.serve", "--disable-tqdm", *args]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60)


def test_chat_run_counts_http_500_as_failed_and_writes_vllm_keys(stub, tmp_path: Path) -> None:
    url, bodies = stub
    prompts = tmp_path / "prompts.jsonl"
    lines = ["hello", "please fail", "good day", "fail again", "ok", "fine"]
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in lines))
    result_file = tmp_path / "result.json"
    bodies.clear()
    done = bench(
        "--base-url", url, "--model", "stub-model", "--endpoint", "chat",
        "--dataset", "file", "--dataset-path", str(prompts), "--output-len", "16",
        "--num-prompts", "6", "--request-rate", "inf", "--max-concurrency", "2",
        "--ignore-eos", "--slo-ttft-ms", "10000", "--slo-tpot-ms", "10000",
        "--result-file", str(result_file), "--save-detailed",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "Successful requests" in done.stdout and "HTTP 500" in done.stdout
    result = json.loads(result_file.read_text())
    assert (result["completed"], result["failed"]) == (4, 2)
    assert result["errors"] == {'HTTP 500: {"error":{"message":"stub failure"}}': 2}
    for key in (
        "request_throughput", "output_throughput", "total_token_throughput",
        "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms",
        "mean_itl_ms", "p99_itl_ms", "mean_e2el_ms", "p99_e2el_ms",
    ):  # fmt: skip
        assert isinstance(result[key], float), key
    assert result["total_output_tokens"] == 4 * TOKENS
    assert result["total_input_tokens"] == 4 * PROMPT_TOKENS
    assert result["goodput"] == pytest.approx(result["request_throughput"])
    assert result["median_ttft_ms"] >= DELAY_S * 1000
    assert result["median_itl_ms"] >= DELAY_S * 1000 * 0.9
    assert result["config"]["max_concurrency"] == 2 and result["config"]["request_rate"] == "inf"
    assert result["git_commit"] is None or len(result["git_commit"]) == 40
    assert [len(itls) for itls in result["details"]["itls"]].count(TOKENS - 1) == 4
    assert len(bodies) == 6
    assert all(b["stream"] and b["stream_options"] == {"include_usage": True} for b in bodies)
    assert all(b["ignore_eos"] is True and b["max_tokens"] == 16 for b in bodies)
    assert {b["messages"][0]["content"] for b in bodies} == set(lines)


def test_sweep_runs_each_rate_and_plots(stub, tmp_path: Path) -> None:
    url, bodies = stub
    result_file = tmp_path / "sweep.json"
    bodies.clear()
    done = bench(
        "--base-url", url, "--dataset", "random", "--random-input-len", "8",
        "--random-output-len", "4", "--num-prompts", "4", "--sweep-rates", "50,200",
        "--seed", "1", "--result-file", str(result_file),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(result_file.read_text())
    assert result["model_id"] == "stub-model"  # from /v1/models
    assert [run["request_rate"] for run in result["runs"]] == [50.0, 200.0]
    assert all((run["completed"], run["failed"]) == (4, 0) for run in result["runs"])
    assert result_file.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    assert len(bodies) == 8 and all(len(b["prompt"].split()) == 8 for b in bodies)
    assert all(b["max_tokens"] == 4 and "ignore_eos" not in b for b in bodies)


def test_all_failed_run_exits_nonzero(tmp_path: Path) -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens here: every request is refused
    result_file = tmp_path / "refused.json"
    done = bench(
        "--base-url", f"http://127.0.0.1:{port}", "--model", "m", "--num-prompts", "3",
        "--random-input-len", "4", "--random-output-len", "2", "--result-file", str(result_file),
    )  # fmt: skip
    assert done.returncode == 1
    result = json.loads(result_file.read_text())
    assert (result["completed"], result["failed"]) == (0, 3)
    assert all(message.startswith("ConnectError") for message in result["errors"])


def test_bad_dataset_line_exits_2_with_its_line_number(tmp_path: Path) -> None:
    prompts = tmp_path / "bad.jsonl"
    prompts.write_text('{"prompt": "ok"}\n{"text": "no prompt"}\n')
    done = bench("--model", "m", "--dataset", "file", "--dataset-path", str(prompts))
    assert done.returncode == 2
    assert "line 2" in done.stderr
