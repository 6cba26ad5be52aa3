"""One streaming request to an OpenAI-compatible endpoint, timed token by token.

Each server-sent event that carries text counts as one token arrival (servers that pack
several tokens in one event make fewer, longer inter-token gaps). The output token count
comes from the final ``usage`` event when the server sends one, else from the text events.
"""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from splitserve.bench.datasets import BenchRequest
from splitserve.bench.text import Endpoint, TextSource

PATHS: dict[Endpoint, str] = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


@dataclass(frozen=True)
class EndpointConfig:
    """Where and how requests are sent."""

    base_url: str
    model: str
    endpoint: Endpoint
    ignore_eos: bool = False
    temperature: float = 0.0
    api_key: str | None = None
    timeout_s: float = 600.0

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + PATHS[self.endpoint]

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass(frozen=True)
class RequestResult:
    """What one request measured; times in seconds, ``start`` relative to the benchmark start."""

    success: bool
    start: float = 0.0
    ttft: float = 0.0
    itls: tuple[float, ...] = ()
    e2el: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int | None = None
    error: str = ""


@dataclass
class _Stream:
    """Mutable state while one response streams in."""

    start: float
    arrivals: list[float] = field(default_factory=list)
    usage: dict[str, Any] = field(default_factory=dict)
    error: str = ""


def first_model(base_url: str, api_key: str | None) -> str:
    """The first model the server lists at ``/v1/models``."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, trust_env=False)
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise ValueError(f"{base_url} lists no models; pass --model")
    return str(models[0]["id"])


def request_body(config: EndpointConfig, source: TextSource, req: BenchRequest) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": config.model,
        "max_tokens": req.output_len,
        "temperature": config.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if config.endpoint == "chat":
        body["messages"] = [{"role": m.role, "content": m.content} for m in req.messages]
    else:
        body["prompt"] = source.render(req.messages)
    if config.ignore_eos:
        body["ignore_eos"] = True
    return body


async def send(
    client: httpx.AsyncClient, config: EndpointConfig, body: dict[str, Any], t0: float
) -> RequestResult:
    """Send one request and time it; every failure is returned as a result, never raised."""
    state = _Stream(start=time.perf_counter())
    try:
        async with client.stream(
            "POST", config.url, json=body, headers=config.headers, timeout=config.timeout_s
        ) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                state.error = f"HTTP {response.status_code}: {text[:300]}"
            else:
                await _read_events(response, state)
    except Exception as exc:  # any failure is this request's result, shown with its message
        state.error = f"{type(exc).__name__}: {exc}"
    return _result(state, time.perf_counter(), t0)


async def _read_events(response: httpx.Response, state: _Stream) -> None:
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            return
        event = json.loads(data)
        if "error" in event:
            state.error = f"stream error: {json.dumps(event['error'])[:300]}"
            return
        if event.get("usage"):
            state.usage = event["usage"]
        if _event_text(event):
            state.arrivals.append(time.perf_counter())


def _event_text(event: dict[str, Any]) -> str:
    choices = event.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    delta = choice.get("delta") or {}
    return str(choice.get("text") or delta.get("content") or delta.get("reasoning_content") or "")


def _result(state: _Stream, end: float, t0: float) -> RequestResult:
    start = state.start - t0
    if not state.error and not state.arrivals:
        state.error = "no tokens received"
    if state.error:
        return RequestResult(success=False, start=start, e2el=end - state.start, error=state.error)
    itls = tuple(b - a for a, b in itertools.pairwise(state.arrivals))
    return RequestResult(
        success=True,
        start=start,
        ttft=state.arrivals[0] - state.start,
        itls=itls,
        e2el=end - state.start,
        output_tokens=int(state.usage.get("completion_tokens", len(state.arrivals))),
        prompt_tokens=state.usage.get("prompt_tokens"),
    )
