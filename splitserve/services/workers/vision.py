"""VisionWorker: encodes the images of requests and sends the embeddings to prefill workers.

A pool of its own (role ``vision``) that scales apart from prefill and decode. The API server
sends EncodeImages (image bytes it already checked, their content hashes, the chosen prefill
worker); the loop thread takes each image's embeddings from the encoder cache or runs the
encoder, then hands one [tokens, hidden] tensor per request to the TensorSender
(services/workers/channels.py), whose thread for that prefill worker announces it (an
EmbeddingsHeader on the worker's embeddings socket) and sends it over the KV transport, so
embeddings never pass through the API server and are never pickled. An image that cannot be
decoded fails its request with a 400; the worker keeps going. No engine runs here.
"""

from __future__ import annotations

import collections
import logging
import time
from functools import partial

import torch

from splitserve.engine.vision.image_inputs import ImageError, decode_image
from splitserve.services import messages as msg
from splitserve.services.workers import limits
from splitserve.services.workers.base import Worker, open_transport
from splitserve.services.workers.channels import Outgoing, TensorSender
from splitserve.services.workers.encoder_cache import EncoderCache
from splitserve.services.workers.spec import WorkerSpec

logger = logging.getLogger("splitserve.vision")


class VisionWorker(Worker):
    role = "vision"

    def __init__(self, spec: WorkerSpec) -> None:
        super().__init__(spec)
        self.cache = EncoderCache(spec.images.encoder_cache_bytes)
        self.images_encoded = 0
        self.cache_hits = 0
        self._jobs: collections.deque[msg.EncodeImages] = collections.deque()
        self._encode_seconds: list[float] = []

    def _load(self) -> None:
        from splitserve.engine.loader import resolve_model
        from splitserve.engine.model_runner import resolve_dtype
        from splitserve.engine.vision.encoder import VisionEncoder

        config = self.spec.engine
        self.encoder = VisionEncoder(
            resolve_model(config.model), config.device, resolve_dtype(config)
        )

    def _request_bytes(self) -> int:
        return limits.image_request_bytes(self.spec.images)

    def _setup(self) -> None:
        transport = open_transport(self.spec, self.request_addr)
        self.sender = TensorSender(
            transport.worker_id,
            transport,
            self._ctx,
            self.sealer,
            self._stop,
            self._async_errors,
            self._thread_failed,
        )

    def _poll_ms(self) -> int:
        return 0 if self._jobs else super()._poll_ms()

    def _handle(self, message: msg.Message) -> None:
        if isinstance(message, msg.EncodeImages):
            self._jobs.append(message)
        elif isinstance(message, msg.AbortRequest):
            aborted = set(message.request_ids)
            self._jobs = collections.deque(j for j in self._jobs if j.request_id not in aborted)

    def _held(self) -> list[str]:
        return [job.request_id for job in self._jobs]

    def _tick(self) -> None:
        if self._jobs:
            self._run(self._jobs[0])
            self._jobs.popleft()
        self._send_batch([])

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
        header = partial(self._header, job.request_id, embeddings)
        outgoing = Outgoing(job.request_id, header, [embeddings], "image embeddings")
        self.sender.send(job.prefill_worker, job.prefill_addr, outgoing)

    def _header(
        self, request_id: str, embeddings: torch.Tensor, generation: int
    ) -> msg.EmbeddingsHeader:
        dtype = str(embeddings.dtype).removeprefix("torch.")
        return msg.EmbeddingsHeader(
            request_id, self.sender.worker_id, generation, list(embeddings.shape), dtype
        )

    def _embeddings(self, images: list[msg.ImageData]) -> torch.Tensor:
        """Cached images are taken from the cache; the others are encoded in one batch."""
        found = {i.image_hash: self.cache.get(i.image_hash) for i in images}
        missing = {i.image_hash: i.data for i in images if found[i.image_hash] is None}
        self.cache_hits += len(images) - len(missing)
        if missing:
            max_pixels = self.spec.images.max_pixels
            pictures = [decode_image(data, max_pixels) for data in missing.values()]
            start = time.monotonic()
            outputs = self.encoder.encode(pictures)
            self._encode_seconds.append(time.monotonic() - start)
            self.images_encoded += len(pictures)
            for image_hash, embeddings in zip(missing, outputs):
                found[image_hash] = embeddings.contiguous()
                self.cache.put(image_hash, found[image_hash])  # type: ignore[arg-type]
        return torch.cat([found[i.image_hash] for i in images])  # type: ignore[misc]

    def _stats(self) -> msg.WorkerStats:
        seconds, self._encode_seconds = self._encode_seconds, []
        return msg.WorkerStats(
            worker_id=self.worker_id,
            num_running=len(self._jobs),
            images_encoded=self.images_encoded,
            encoder_cache_hits=self.cache_hits,
            encode_seconds=seconds,
        )
