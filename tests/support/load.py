"""A small streaming load against a real server, for the deployment and observability tests."""

from __future__ import annotations

import json
import threading
from typing import Any

import httpx

from tests.support.wait import wait_for

MODEL = "smollm2-135m-instruct"
SHARED_PREFIX = "You are a careful assistant who answers in one short line. " * 3


class Load:
    """``concurrency`` threads that each stream one completion of ``max_tokens`` tokens
    after another until stopped; failures are recorded, not raised."""

    def __init__(self, url: str, concurrency: int = 8, max_tokens: int = 12) -> None:
        self.url = url
        self.max_tokens = max_tokens
        self.stop = threading.Event()
        self.finished: list[str] = []
        self.failures: list[str] = []
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(concurrency)]

    def __enter__(self) -> Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=120)

    def _run(self, i: int) -> None:
        prompt = f"{SHARED_PREFIX} Count to {i}:"
        body = {
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": self.max_tokens,
            "ignore_eos": True,
            "stream": True,
        }
        while not self.stop.is_set():
            try:
                self.finished.append(self._one(body))
            except Exception as exc:  # every failure is recorded, none may happen
                self.failures.append(repr(exc))

    def _one(self, body: dict[str, Any]) -> str:
        reason = None
        with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=120) as r:
            if r.status_code != 200:
                return f"http {r.status_code}: {r.read()!r}"
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    raise RuntimeError(event["error"])
                reason = event["choices"][0]["finish_reason"] or reason
        if reason != "length":
            raise RuntimeError(f"stream ended with finish_reason {reason}")
        return reason

    def wait_finished(self, count: int, timeout: float = 120.0) -> None:
        """Until ``count`` more streams have finished than now."""
        target = len(self.finished) + count
        wait_for(
            lambda: len(self.finished) >= target,
            timeout,
            interval=0.1,
            message=lambda: (
                f"{target} finished streams, the load stalled at "
                f"{len(self.finished)} (failures: {self.failures[-3:]})"
            ),
        )
