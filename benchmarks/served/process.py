"""A `splitserve serve` process for benchmarks, and the per-phase loop timing read from it.

Server starts the command as a user would, on a free port, and records how long it took to
say ready. The workers report how their loop's time splits into phases (WorkerStats
phase_seconds, exposed as splitserve:worker_loop_seconds_total{phase=...} with the number of
loop iterations that stepped the engine in splitserve:worker_loop_steps_total); phase_table
turns two readings into milliseconds per engine step, per pool and phase.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = 900.0
PHASE_METRIC = "splitserve:worker_loop_seconds_total"
STEPS_METRIC = "splitserve:worker_loop_steps_total"


class Server:
    def __init__(self, serve_args: list[str]) -> None:
        self.serve_args = serve_args
        self.lines: list[str] = []
        self.ready_s = 0.0
        self.url = ""
        self.model = ""
        self.client: httpx.Client | None = None

    def __enter__(self) -> Server:
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        command = [sys.executable, "-m", "splitserve.cli", "serve", "--port", str(port)]
        start = time.monotonic()
        self.process = subprocess.Popen(
            [*command, *self.serve_args],
            cwd=REPO,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        threading.Thread(target=self._pump, daemon=True).start()
        self._wait_ready()
        self.ready_s = time.monotonic() - start
        self.model = httpx.get(f"{self.url}/v1/models").json()["data"][0]["id"]
        # One client for the probes, as a user's would be: a new httpx client per request
        # spends about 30 ms building its TLS context, which the probe used to time too.
        self.client = httpx.Client(timeout=600)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.client is not None:
            self.client.close()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()

    def timed_completion(self, index: int, prompt_len: int, max_tokens: int) -> float:
        """Seconds for one non-streamed completion of a random token-id prompt."""
        rng = random.Random(index)
        prompt = [rng.randrange(100, 30000) for _ in range(prompt_len)]
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
        }
        start = time.perf_counter()
        assert self.client is not None
        response = self.client.post(f"{self.url}/v1/completions", json=body)
        response.raise_for_status()
        return time.perf_counter() - start

    def _pump(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line)
            print(f"   | {line}", end="", flush=True)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError("server exited:\n" + "".join(self.lines[-30:]))
            if any(line.startswith("splitserve ready: ") for line in self.lines):
                return
            time.sleep(0.2)
        raise TimeoutError("server not ready:\n" + "".join(self.lines[-30:]))


def set_args(items: list[str]) -> list[str]:
    """``--set`` arguments of `splitserve serve` for ``key=value`` items."""
    return [arg for item in items for arg in ("--set", item)]


def phase_totals(url: str) -> dict[tuple[str, str], float]:
    """(pool, phase) -> seconds summed over the pool's workers; phase "steps" counts steps."""
    totals: dict[tuple[str, str], float] = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        for metric, phase in ((PHASE_METRIC, None), (STEPS_METRIC, "steps")):
            if line.startswith(metric + "{"):
                labels = _labels(line)
                key = (labels.get("pool", ""), phase or labels.get("phase", ""))
                totals[key] = totals.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return totals


def phase_table(
    before: dict[tuple[str, str], float], after: dict[tuple[str, str], float]
) -> dict[str, dict[str, float]]:
    """pool -> {phase: ms per engine step, "steps": steps taken} between two readings."""
    table: dict[str, dict[str, float]] = {}
    for pool in sorted({pool for pool, _ in after}):
        steps = after.get((pool, "steps"), 0.0) - before.get((pool, "steps"), 0.0)
        row: dict[str, float] = {"steps": steps}
        for (p, phase), value in after.items():
            if p == pool and phase != "steps" and steps > 0:
                row[phase] = 1000.0 * (value - before.get((p, phase), 0.0)) / steps
        table[pool] = row
    return table


def _labels(line: str) -> dict[str, str]:
    inner = line[line.index("{") + 1 : line.rindex("}")]
    pairs = (item.split("=", 1) for item in inner.split(",") if "=" in item)
    return {key: value.strip('"') for key, value in pairs}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def describe(record: dict[str, Any]) -> str:
    """One line per pool: ms per step by phase."""
    lines = []
    for pool, row in record.items():
        phases = ", ".join(f"{k} {v:.2f}" for k, v in row.items() if k != "steps")
        lines.append(f"{pool}: {row['steps']:.0f} steps; ms/step {phases}")
    return "\n".join(lines)
