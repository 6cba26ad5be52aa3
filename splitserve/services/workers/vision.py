"""VisionWorker: encodes the images of requests and sends the embeddings to prefill workers.

A pool of its own (role ``vision``) that scales apart from prefill and decode. The API server
sends EncodeImages (image bytes it already checked, their content hashes, the chosen prefill
worker); the loop thread takes each image's embeddings from the encoder cache or runs the
encoder, then queues one [tokens, hidden] tensor per request for that prefill worker. A sender
thread per prefill worker announces it (EmbeddingsHeader on the worker's embeddings socket) and
sends it over the KV transport, so embeddings never pass through the API server and are never
pickled. An image that cannot be decoded fails its request with a 400; the worker keeps going.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
import zmq

from splitserve.engine.config import EngineConfig
from splitserve.engine.vision.image_inputs import DEFAULT_MAX_PIXELS, ImageError, decode_image
from splitserve.kvstore.transfer import TransferError
from splitserve.services import messages as msg
from splitserve.services.workers.base import (
    IDLE_POLL_MS,
    STATS_INTERVAL_S,
    WorkerInfo,
    open_transport,
)
from splitserve.services.workers.encoder_cache import EncoderCache

QUEUE_POLL_S = 0.1
DEFAULT_CACHE_BYTES = 64 << 20
logger = logging.getLogger("splitserve.vision")


@dataclass(frozen=True)
class _Encoded:
    """One request's embeddings on their way to its prefill worker."""

    request_id: str
    prefill_worker: str
    prefill_addr: str
    embeddings: torch.Tensor


class VisionWorker:
    """Constructor arguments as for EngineWorker (plain values; services/launch/deployment.py);
    ``kv["images"]`` holds the deployment's ImagesConfig as a dict."""

    role = "vision"

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
        images = (kv or {}).get("images", {})
        self.max_pixels = int(images.get("max_pixels", DEFAULT_MAX_PIXELS))
        self.cache = EncoderCache(int(images.get("encoder_cache_bytes", DEFAULT_CACHE_BYTES)))
        self.images_encoded = 0
        self.cache_hits = 0
        self._jobs: collections.deque[msg.EncodeImages] = collections.deque()
        self._encode_seconds: list[float] = []
        self._errors: list[msg.RequestError] = []
        self._async_errors: queue.Queue[msg.RequestError] = queue.Queue()
        self._outboxes: dict[str, queue.Queue[_Encoded]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_stats = 0.0

    def start(self) -> dict[str, Any]:
        """Load the encoder, bind the sockets, start the loop; returns WorkerInfo as a dict."""
        from splitserve.engine.loader import resolve_model
        from splitserve.engine.model_runner import resolve_dtype
        from splitserve.engine.vision.encoder import VisionEncoder

        if self.threads > 0:
            torch.set_num_threads(self.threads)
        path = resolve_model(self.config.model)
        self.encoder = VisionEncoder(path, self.config.device, resolve_dtype(self.config))
        self.transport = open_transport(
            self.worker_id, self.store, self.config.device, self.transfer
        )
        self._ctx = zmq.Context()
        self._requests = self._ctx.socket(zmq.PULL)
        self._outputs = self._ctx.socket(zmq.PUSH)
        self._outputs.setsockopt(zmq.SNDHWM, 0)
        self._outputs.setsockopt(zmq.LINGER, 0)
        request_port = self._requests.bind_to_random_port(f"tcp://{self.bind_host}")
        output_port = self._outputs.bind_to_random_port(f"tcp://{self.bind_host}")
        self._thread = threading.Thread(target=self._loop, name="vision-loop", daemon=True)
        self._thread.start()
        return WorkerInfo(
            worker_id=self.worker_id,
            role=self.role,
            model_name=self.config.model,
            max_model_len=0,
            request_addr=f"tcp://{self.bind_host}:{request_port}",
            output_addr=f"tcp://{self.bind_host}:{output_port}",
            kv_addr="",
            pid=os.getpid(),
        ).to_dict()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._ctx.destroy(linger=0)

    def _loop(self) -> None:
        while not self._stop.is_set():
            timeout = 0 if self._jobs else IDLE_POLL_MS
            if self._requests.poll(timeout):
                self._drain()
            if self._jobs:
                self._run(self._jobs.popleft())
            self._send_errors()
            self._maybe_send_stats()

    def _drain(self) -> None:
        while True:
            try:
                data = self._requests.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            message = msg.decode(data)
            if isinstance(message, msg.EncodeImages):
                self._jobs.append(message)
            elif isinstance(message, msg.AbortRequest):
                aborted = set(message.request_ids)
                self._jobs = collections.deque(j for j in self._jobs if j.request_id not in aborted)

    def _run(self, job: msg.EncodeImages) -> None:
        """Embeddings of one request's images, or its error; never raises."""
        try:
            embeddings = self._embeddings(job.images)
        except ImageError as exc:
            self._errors.append(msg.RequestError(job.request_id, str(exc), 400))
            return
        except Exception as exc:
            logger.exception("encoding the images of %s failed", job.request_id)
            error = f"the vision encoder failed: {type(exc).__name__}"
            self._errors.append(msg.RequestError(job.request_id, error, 500))
            return
        encoded = _Encoded(job.request_id, job.prefill_worker, job.prefill_addr, embeddings)
        self._outbox(job.prefill_worker, job.prefill_addr).put(encoded)

    def _embeddings(self, images: list[msg.ImageData]) -> torch.Tensor:
        """Cached images are taken from the cache; the others are encoded in one batch."""
        found = {i.image_hash: self.cache.get(i.image_hash) for i in images}
        missing = {i.image_hash: i.data for i in images if found[i.image_hash] is None}
        self.cache_hits += len(images) - len(missing)
        if missing:
            pictures = [decode_image(data, self.max_pixels) for data in missing.values()]
            start = time.monotonic()
            outputs = self.encoder.encode(pictures)
            self._encode_seconds.append(time.monotonic() - start)
            self.images_encoded += len(pictures)
            for image_hash, embeddings in zip(missing, outputs):
                found[image_hash] = embeddings.contiguous()
                self.cache.put(image_hash, found[image_hash])  # type: ignore[arg-type]
        return torch.cat([found[i.image_hash] for i in images])  # type: ignore[misc]

    def _outbox(self, peer: str, addr: str) -> queue.Queue[_Encoded]:
        if peer not in self._outboxes:
            outbox: queue.Queue[_Encoded] = queue.Queue()
            self._outboxes[peer] = outbox
            threading.Thread(
                target=self._send_loop,
                args=(peer, addr, outbox),
                name=f"emb-send-{peer}",
                daemon=True,
            ).start()
        return self._outboxes[peer]

    def _send_loop(self, peer: str, addr: str, outbox: queue.Queue[_Encoded]) -> None:
        """A sender thread: owns one prefill worker's header socket and channel generation."""
        socket = self._ctx.socket(zmq.PUSH)
        socket.setsockopt(zmq.SNDHWM, 0)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(addr)
        generation = 0
        while not self._stop.is_set():
            try:
                item = outbox.get(timeout=QUEUE_POLL_S)
            except queue.Empty:
                continue
            tensor = item.embeddings
            header = msg.EmbeddingsHeader(
                item.request_id,
                self.worker_id,
                generation,
                list(tensor.shape),
                str(tensor.dtype).removeprefix("torch."),
            )
            socket.send(msg.encode(header))
            try:
                self.transport.send(peer, generation, tensor)
            except TransferError as exc:
                self.transport.drop(self.worker_id, peer, generation)
                generation += 1
                error = f"sending image embeddings to {peer} failed: {exc}"
                self._async_errors.put(msg.RequestError(item.request_id, error, 503))
        socket.close(linger=0)

    def _send_errors(self) -> None:
        while not self._async_errors.empty():
            self._errors.append(self._async_errors.get_nowait())
        if self._errors:
            batch = msg.OutputBatch(deltas=[], errors=self._errors)
            self._errors = []
            self._send(batch)

    def _maybe_send_stats(self) -> None:
        now = time.monotonic()
        if now - self._last_stats < STATS_INTERVAL_S:
            return
        self._last_stats = now
        seconds, self._encode_seconds = self._encode_seconds, []
        stats = msg.WorkerStats(
            worker_id=self.worker_id,
            num_running=len(self._jobs),
            num_waiting=0,
            num_free_blocks=0,
            num_total_blocks=0,
            kv_usage=0.0,
            prompt_tokens_computed=0,
            prompt_tokens_cached=0,
            images_encoded=self.images_encoded,
            encoder_cache_hits=self.cache_hits,
            encode_seconds=seconds,
        )
        self._send(stats)

    def _send(self, message: msg.Message) -> None:
        """Never blocks: with no API server connected (not yet, or gone while shutting down)
        the message is dropped, so the loop always sees the stop event."""
        with contextlib.suppress(zmq.Again):
            self._outputs.send(msg.encode(message), zmq.NOBLOCK)
