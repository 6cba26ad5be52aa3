"""Chaos run: streamed greedy requests against 2 prefill + 2 decode workers while a decode
worker and then a prefill worker are killed with SIGKILL; every request must complete with
the offline engine's greedy output, and both workers must be back in their pools. With one
worker of each (``replicas=1``) the requests wait for the restarted ones instead.

The test (tests/test_disagg_chaos.py) runs 120 requests of 8 tokens, `make chaos` 200 of 32, the
first 16 of either OPENING_TOKENS long:
``python -m tests.support.chaos --requests 200`` prints the measurements as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from splitserve.engine.llm import LLM
from splitserve.engine.sampling_params import SamplingParams
from tests.support.disagg import MODEL
from tests.support.server_process import ServerProcess, serve, worker_metric, worker_pids
from tests.support.wait import wait_for

TOPICS = ["rivers", "prime numbers", "the moon", "bread", "chess", "volcanoes", "tea", "owls"]
SERVER_SETTINGS = (
    "pools.prefill.replicas=2",
    "pools.decode.replicas=2",
    "transfer.timeout_s=10",
    "server.heartbeat_timeout_s=10",
    # Each computed prompt's KV waits this long before it is sent: a window in which a
    # killed prefill worker has requests before their handoff (tests only).
    "transfer.fault_send_delay_s=0.2",
)
RUNNING = "splitserve:num_requests_running"
OPENING_TOKENS = 64
"""The first request of each client decodes this many tokens, past any end of text: decode-0
then holds requests long enough for its running count (sent every 0.2 s) to show them, which
the decode kill waits for. With short requests alone a fast decode finished each one between
two counts, and once the wait ran out (120 s) with every request done."""
BACK_TIMEOUT_S = 120.0


def prompts(count: int) -> list[str]:
    """Distinct prompts (no two share more than a few leading tokens)."""
    return [f"{TOPICS[i % len(TOPICS)]} #{i}: tell me one short fact." for i in range(count)]


def reference(llm: LLM, texts: list[str], max_tokens: int, opening: int) -> list[str]:
    """The offline engine's greedy texts: the first ``opening`` prompts as Chaos sends them
    (OPENING_TOKENS, past any end of text), the rest with max_tokens."""
    long = SamplingParams(temperature=0.0, max_tokens=OPENING_TOKENS, ignore_eos=True)
    short = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outputs = llm.generate(texts[:opening], long, use_tqdm=False)
    outputs += llm.generate(texts[opening:], short, use_tqdm=False)
    return [out.outputs[0].text for out in outputs]


@dataclass
class Outcome:
    text: str = ""
    finish: str | None = None
    error: str | None = None
    start: float = 0.0
    end: float = 0.0


@dataclass
class Kill:
    worker: str
    pid: int
    at: float
    back_after_s: float = 0.0


@dataclass
class Chaos:
    """The clients (``concurrency`` threads streaming the prompts in order, the first
    ``concurrency`` of them OPENING_TOKENS long) and the kills."""

    server: ServerProcess
    texts: list[str]
    max_tokens: int
    concurrency: int
    replicas: int = 2
    """Of each pool: what its ready count comes back to after a kill."""
    victims: tuple[str, str] = ("decode-0", "prefill-0")
    """The decode worker killed first, then the prefill worker."""
    outcomes: list[Outcome] = field(default_factory=list)
    kills: list[Kill] = field(default_factory=list)

    def run(self) -> None:
        self.outcomes = [Outcome() for _ in self.texts]
        todo: queue.Queue[int] = queue.Queue()
        for index in range(len(self.texts)):
            todo.put(index)
        clients = [
            threading.Thread(target=self._client, args=(todo,)) for _ in range(self.concurrency)
        ]
        for client in clients:
            client.start()
        try:
            decode, prefill = self.victims
            self._kill_when(decode, lambda: self._running(decode) > 0)
            self._kill_when(prefill, lambda: self._done() >= len(self.texts) // 2)
            for kill in self.kills:
                self._wait_back(kill)
        finally:
            for client in clients:
                client.join(timeout=300)

    def _client(self, todo: queue.Queue[int]) -> None:
        while True:
            try:
                index = todo.get_nowait()
            except queue.Empty:
                return
            outcome = self.outcomes[index]
            outcome.start = time.monotonic()
            try:
                self._stream(self.texts[index], index < self.concurrency, outcome)
            except Exception as exc:  # recorded: the test asserts there are none
                outcome.error = repr(exc)
            outcome.end = time.monotonic()

    def _stream(self, prompt: str, opening: bool, outcome: Outcome) -> None:
        body: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": self.max_tokens}
        if opening:
            body |= {"max_tokens": OPENING_TOKENS, "ignore_eos": True}
        body |= {"temperature": 0, "stream": True}
        url = f"{self.server.url}/v1/completions"
        with httpx.stream("POST", url, json=body, timeout=120) as response:
            if response.status_code != 200:
                outcome.error = f"http {response.status_code}: {response.read()!r}"
                return
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: ") :])
                if "error" in event:
                    outcome.error = str(event["error"])
                    return
                choice = event["choices"][0]
                outcome.text += choice["text"]
                outcome.finish = choice["finish_reason"] or outcome.finish

    def _done(self) -> int:
        return sum(o.end > 0 for o in self.outcomes)

    def _running(self, worker: str) -> float:
        return worker_metric(self.server.url, RUNNING, worker)

    def _kill_when(self, worker: str, ready: Any) -> None:
        wait_for(ready, 120, interval=0.02, message=f"the moment to kill {worker}")
        pid = worker_pids(self.server)[worker]
        os.kill(pid, signal.SIGKILL)
        self.kills.append(Kill(worker, pid, time.monotonic()))

    def _wait_back(self, kill: Kill) -> None:
        """Until the worker runs again (a new process) and its pool counts it ready."""
        pool = kill.worker.rsplit("-", 1)[0]

        def back() -> bool:
            if worker_pids(self.server)[kill.worker] == kill.pid:
                return False
            pools = httpx.get(f"{self.server.url}/health").json()["pools"]
            return bool(pools[pool]["ready"] == self.replicas)

        wait_for(
            back,
            BACK_TIMEOUT_S,
            interval=0.1,
            message=lambda: f"{kill.worker} back in its pool: " + "".join(self.server.lines[-20:]),
        )
        kill.back_after_s = time.monotonic() - kill.at


def request_log(server: ServerProcess) -> list[dict[str, Any]]:
    """The server's structured request log lines (one per finished engine request)."""
    prefix = "splitserve request "
    return [json.loads(line[len(prefix) :]) for line in server.lines if line.startswith(prefix)]


def summary(chaos: Chaos) -> dict[str, Any]:
    """Recovery time per killed worker and the extra latency of migrated requests."""
    done = [entry for entry in request_log(chaos.server) if entry["status"] == "ok"]
    migrated = [e["e2e_s"] for e in done if ".m" in e["request_id"]]
    others = sorted(e["e2e_s"] for e in done if ".m" not in e["request_id"])
    median = others[len(others) // 2] if others else 0.0
    return {
        "requests": len(chaos.texts),
        "max_tokens": chaos.max_tokens,
        "concurrency": chaos.concurrency,
        "failed": sum(o.error is not None for o in chaos.outcomes),
        "back_after_s": {k.worker: round(k.back_after_s, 2) for k in chaos.kills},
        "migrated_requests": len(migrated),
        "e2e_median_s": round(median, 3),
        "migrated_e2e_mean_s": round(sum(migrated) / len(migrated), 3) if migrated else None,
        "migrated_e2e_max_s": round(max(migrated), 3) if migrated else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--log", default=None, help="write the server's output here")
    args = parser.parse_args()
    texts = prompts(args.requests)
    llm = LLM(MODEL, max_model_len=2048)
    expected = reference(llm, texts, args.max_tokens, args.concurrency)
    with serve(*SERVER_SETTINGS) as server:
        chaos = Chaos(server, texts, args.max_tokens, args.concurrency)
        try:
            chaos.run()
        finally:
            if args.log is not None:
                with open(args.log, "w") as log:
                    log.writelines(server.lines)
    result = summary(chaos)
    result["equal_to_offline"] = sum(o.text == e for o, e in zip(chaos.outcomes, expected))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
