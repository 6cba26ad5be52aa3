"""Workers: one engine each, driven by messages from the API server.

``EngineWorker`` is a plain class so that it can be tested without Ray; the launcher turns it
(or ``PrefillWorker`` / ``DecodeWorker``, services/workers/prefill.py and decode_worker.py)
into a Ray actor. Its loop runs in a thread of the actor process: drain the input sockets,
do one round of work (an engine step), push the token deltas back, and report stats a few
times a second. Only the loop thread touches the engine, which is not thread-safe.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
import zmq

from splitserve.engine.config import EngineConfig
from splitserve.engine.request import Logprob, RequestOutput
from splitserve.kvstore.transfer import KVTransport, StoreAddress
from splitserve.services import messages as msg
from splitserve.services.workers.worker_cache import WorkerCache

STATS_INTERVAL_S = 0.2
IDLE_POLL_MS = 50


@dataclass(frozen=True)
class WorkerInfo:
    """What the API server needs to know about a started worker (plain values only).

    kv_addr: where a decode worker receives KV headers ("" for other roles).
    """

    worker_id: str
    role: str
    model_name: str
    max_model_len: int
    request_addr: str
    output_addr: str
    kv_addr: str
    pid: int

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class EngineWorker:
    """A worker of role ``both``: prefill and decode in one engine.

    Constructor arguments are plain values (engine_config and transfer are dicts, store is
    the rendezvous store's [host, port]) so that only plain values cross Ray's control plane;
    requests and tokens travel as msgpack messages over the ZMQ sockets it binds.
    """

    role = "both"

    def __init__(
        self,
        worker_id: str,
        engine_config: dict[str, Any],
        bind_host: str,
        threads: int,
        transfer: dict[str, Any] | None = None,
        store: list[Any] | None = None,
        kv: dict[str, Any] | None = None,
    ) -> None:
        self.worker_id = worker_id
        self.config = EngineConfig(**engine_config)
        self.bind_host = bind_host
        self.threads = threads
        self.transfer = transfer or {}
        self.store = store
        self.kv = kv
        self.cache: WorkerCache | None = None
        self._prefill_rate = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._sent: dict[str, tuple[int, int]] = {}
        self._errors: list[msg.RequestError] = []
        self._async_errors: queue.Queue[msg.RequestError] = queue.Queue()
        self._transfer_seconds: queue.Queue[float] = queue.Queue()
        self._last_stats = 0.0
        self.kv_addr = ""

    def start(self) -> dict[str, Any]:
        """Load the engine, bind the sockets, start the loop; returns WorkerInfo as a dict."""
        import torch

        from splitserve.engine.llm_engine import LLMEngine

        if self.threads > 0:
            torch.set_num_threads(self.threads)
        if self.kv is not None and self.role != "decode":
            self.cache = WorkerCache(
                self.worker_id, self.kv, lambda: list(self.engine.block_manager.cached)
            )
            self.engine = LLMEngine(
                self.config, block_store=self.cache.blocks, cache_events=self.cache.events
            )
        else:
            self.engine = LLMEngine(self.config)
        self._ctx = zmq.Context()
        self._requests = self._ctx.socket(zmq.PULL)
        self._outputs = self._ctx.socket(zmq.PUSH)
        self._outputs.setsockopt(zmq.SNDHWM, 0)
        self._outputs.setsockopt(zmq.LINGER, 0)
        request_port = self._requests.bind_to_random_port(f"tcp://{self.bind_host}")
        output_port = self._outputs.bind_to_random_port(f"tcp://{self.bind_host}")
        self._poller = zmq.Poller()
        self._poller.register(self._requests, zmq.POLLIN)
        self._setup()
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self._thread.start()
        return WorkerInfo(
            worker_id=self.worker_id,
            role=self.role,
            model_name=self.engine.model_name,
            max_model_len=self.engine.max_model_len,
            request_addr=f"tcp://{self.bind_host}:{request_port}",
            output_addr=f"tcp://{self.bind_host}:{output_port}",
            kv_addr=self.kv_addr,
            pid=os.getpid(),
        ).to_dict()

    def stop(self) -> None:
        """Stop the loop and close the sockets (requests in flight are dropped)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._ctx.destroy(linger=0)
        if self.cache is not None:
            self.cache.close()

    def _setup(self) -> None:
        """Role-specific sockets and threads, created before the loop starts."""

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._drain(self._poll_ms())
            self._tick()
            if self.cache is not None:
                for update in self.cache.tick():
                    self._send(update)
            self._maybe_send_stats()

    def _poll_ms(self) -> int:
        return 0 if self.engine.has_unfinished_requests() else IDLE_POLL_MS

    def _drain(self, timeout_ms: int) -> None:
        for socket, _ in self._poller.poll(timeout_ms):
            while True:
                try:
                    data = socket.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    message = msg.decode(data)
                except ValueError:
                    continue  # not a message of ours (peers write here too): dropped
                self._handle(message)

    def _handle(self, message: msg.Message) -> None:
        if isinstance(message, msg.GenerateRequest):
            try:
                self.engine.add_request(
                    message.request_id,
                    message.prompt_token_ids,
                    message.params,
                    traffic_class=message.traffic_class,
                )
            except ValueError as exc:
                self._errors.append(msg.RequestError(message.request_id, str(exc)))
                return
            self._sent[message.request_id] = (0, 0)
        elif isinstance(message, msg.AbortRequest):
            self._abort(message.request_ids)

    def _abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.engine.abort_request(request_id)
            self._sent.pop(request_id, None)
        self._last_stats = 0.0

    def _tick(self) -> None:
        """One round of work: an engine step, then the outputs and errors it produced."""
        self._send_outputs(self._step())

    def _step(self) -> list[RequestOutput]:
        """One engine step (if there is work), measuring the prompt throughput."""
        if not self.engine.has_unfinished_requests():
            return []
        computed, start = self.engine.prompt_tokens_computed, time.monotonic()
        outputs = self.engine.step()
        tokens = self.engine.prompt_tokens_computed - computed
        if tokens:
            rate = tokens / max(time.monotonic() - start, 1e-6)
            old = self._prefill_rate
            self._prefill_rate = rate if not old else 0.7 * old + 0.3 * rate
        return outputs

    def _send_outputs(self, outputs: list[RequestOutput]) -> None:
        while not self._async_errors.empty():
            self._errors.append(self._async_errors.get_nowait())
        deltas = [d for d in (self._delta(o) for o in outputs) if d is not None]
        if deltas or self._errors:
            batch = msg.OutputBatch(deltas=deltas, errors=self._errors)
            self._errors = []
            self._send(batch)

    def _send(self, message: msg.Message) -> None:
        """To the API server. The queue is unbounded, so this only fails when no API server
        is connected (it stopped, or dropped this worker): then the message has nobody to go
        to, and blocking here would hang the engine loop and its shutdown."""
        with contextlib.suppress(zmq.Again):
            self._outputs.send(msg.encode(message), zmq.NOBLOCK)

    def _delta(self, output: RequestOutput) -> msg.TokenDelta | None:
        if output.request_id not in self._sent:
            return None
        text_len, num_tokens = self._sent[output.request_id]
        completion = output.outputs[0]
        if output.finished:
            del self._sent[output.request_id]
            self._last_stats = 0.0
        else:
            self._sent[output.request_id] = (len(completion.text), len(completion.token_ids))
        return msg.TokenDelta(
            request_id=output.request_id,
            text=completion.text[text_len:],
            token_ids=list(completion.token_ids[num_tokens:]),
            logprobs=_wire_logprobs(completion.logprobs, completion.token_ids, num_tokens),
            finish_reason=completion.finish_reason if output.finished else None,
            stop_reason=completion.stop_reason if output.finished else None,
            num_prompt_tokens=len(output.prompt_token_ids),
            num_cached_tokens=output.num_cached_tokens,
        )

    def _transfer_bytes(self) -> int:
        return 0

    def _maybe_send_stats(self) -> None:
        now = time.monotonic()
        if now - self._last_stats < STATS_INTERVAL_S:
            return
        self._last_stats = now
        seconds = []
        while not self._transfer_seconds.empty():
            seconds.append(self._transfer_seconds.get_nowait())
        s = self.engine.stats()
        stats = msg.WorkerStats(
            worker_id=self.worker_id,
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            num_free_blocks=s.num_free_blocks,
            num_total_blocks=s.num_total_blocks,
            kv_usage=float(s.kv_usage),
            prompt_tokens_computed=s.prompt_tokens_computed,
            prompt_tokens_cached=s.prompt_tokens_cached,
            kv_transfer_bytes=self._transfer_bytes(),
            kv_transfer_seconds=seconds,
            cached_host_tokens=(s.cached_tokens_by_tier or {}).get("host", 0),
            cached_disk_tokens=(s.cached_tokens_by_tier or {}).get("disk", 0),
            cached_remote_tokens=(s.cached_tokens_by_tier or {}).get("remote", 0),
            queued_tokens=s.queued_prompt_tokens,
            prefill_tokens_per_s=self._prefill_rate,
            node_id=self.cache.node_id if self.cache is not None else "",
        )
        self._send(stats)


def open_transport(
    worker_id: str, store: list[Any] | None, device: str, transfer: dict[str, Any]
) -> KVTransport:
    """A worker's KV transport, from the rendezvous store address and the transfer config
    its actor was given (services/launch/deployment.py)."""
    assert store is not None, f"worker {worker_id} needs the rendezvous store"
    return KVTransport(
        worker_id,
        StoreAddress(store[0], int(store[1])),
        torch.device(device),
        transfer.get("backend", "auto"),
        float(transfer.get("timeout_s", 30.0)),
    )


def worker_class(role: str) -> type[EngineWorker]:
    """The worker class that runs ``role``."""
    if role == "both":
        return EngineWorker
    if role == "prefill":
        from splitserve.services.workers.prefill import PrefillWorker

        return PrefillWorker
    if role == "decode":
        from splitserve.services.workers.decode import DecodeWorker

        return DecodeWorker
    if role == "vision":
        from splitserve.services.workers.vision import VisionWorker

        return VisionWorker  # type: ignore[return-value]
    raise ValueError(f"worker role {role!r} is not supported")


def _wire_logprobs(
    logprobs: list[dict[int, Any]] | None, token_ids: list[int], start: int
) -> list[list[msg.TokenLogprob]] | None:
    """The new positions' logprobs, the sampled token first, then by rank."""
    if logprobs is None:
        return None
    return [
        wire_position(logprobs[position], token_ids[position])
        for position in range(start, len(logprobs))
    ]


def wire_position(position: dict[int, Logprob], sampled: int) -> list[msg.TokenLogprob]:
    """One position's logprobs as messages, the sampled token first, then by rank."""
    entries = sorted(position.items(), key=lambda kv: (kv[0] != sampled, kv[1].rank))
    return [msg.TokenLogprob(t, float(lp.logprob), lp.rank, lp.decoded_token) for t, lp in entries]


def engine_position(entries: list[msg.TokenLogprob]) -> dict[int, Logprob]:
    """The inverse of wire_position."""
    return {e.token_id: Logprob(e.logprob, e.rank, e.decoded_token) for e in entries}
