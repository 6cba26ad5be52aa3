"""PrefillWorker: computes prompts and sends their KV to the decode worker that reserved it.

The loop thread runs the engine with ``prefill_only`` requests. When a prompt is done, its
KV (already gathered into one contiguous tensor) and first token go to the TensorSender
(services/workers/channels.py), whose thread for that decode worker sends a KvHeader to the
decode worker's ZMQ socket, then the tensor over the KV transport, in order; a decode worker
that stopped receiving holds up only its own transfers.

A prompt with images starts once both its Prefill message and its image embeddings (from a
vision worker: an EmbeddingsHeader on this worker's embeddings socket, received into room
for at most max_model_len rows of the model's hidden size) are here. A Prefill that names a
peer starts once that peer's blocks are here or missed; this worker also serves other prefill
workers' FetchBlocks through the same sender (services/workers/peer_blocks.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import zmq

from splitserve.engine.kv_handoff import Prefilled
from splitserve.engine.vision.multimodal import ImageInput
from splitserve.services import messages as msg
from splitserve.services.workers import limits
from splitserve.services.workers.base import open_transport
from splitserve.services.workers.channels import Outgoing, TensorReceiver, TensorSender
from splitserve.services.workers.engine_worker import EngineWorker, wire_position
from splitserve.services.workers.image_waits import ImageWaits, split_embeddings
from splitserve.services.workers.peer_blocks import PeerFetches, gather_prefix, peer_header
from splitserve.services.workers.slots import Slot

PENDING_POLL_MS = 2


@dataclass(frozen=True)
class _Route:
    decode_worker: str
    kv_addr: str


class PrefillWorker(EngineWorker):
    role = "prefill"

    def _setup(self) -> None:
        self._embeddings_socket, self.kv_addr = self._bind(zmq.PULL, limits.HEADER_BYTES)
        self.transport = open_transport(self.spec, self.kv_addr)
        self._routes: dict[str, _Route] = {}
        self.sender = TensorSender(
            self.transport.worker_id,
            self.transport,
            self._ctx,
            self.sealer,
            self._stop,
            self._async_errors,
            self._thread_failed,
            self._transfer_seconds.put,
            self.spec.transfer.fault_send_delay_s,
        )
        self._poller.register(self._embeddings_socket, zmq.POLLIN)
        self.embeddings: TensorReceiver[msg.EmbeddingsHeader] = TensorReceiver(
            self.transport.worker_id,
            self.transport,
            self._stop,
            self._thread_failed,
            "image embeddings",
        )
        rows, hidden = self.engine.max_model_len, self.engine.model_config.hidden_size
        self._embeddings_slot = Slot((rows, hidden), None, free=0)
        self._awaiting = ImageWaits(self.spec.transfer.timeout_s)
        self.staged = self.cache.blocks if self.cache is not None else None
        self.fetches = (
            PeerFetches(
                self.worker_id,
                self.kv_addr,
                self._ctx,
                self.sealer,
                self.transport,
                self.staged,
                self.engine,
                self._stop,
                self._thread_failed,
            )
            if self.staged is not None
            else None
        )

    def _handle(self, message: msg.Message) -> None:
        if isinstance(message, msg.Prefill):
            if message.images:
                self._awaiting.add_prefill(message)
            elif self.fetches is None or not self.fetches.request(message):
                self._start(message, [])
        elif isinstance(message, msg.EmbeddingsHeader):
            self.embeddings.on_header(message, [message.shape], [self._embeddings_slot])
        elif isinstance(message, msg.FetchBlocks):
            self._serve_blocks(message)
        elif isinstance(message, msg.PeerBlocks) and self.fetches is not None:
            self.fetches.on_header(message)
        elif isinstance(message, msg.AbortRequest):
            for request_id in message.request_ids:
                self._routes.pop(request_id, None)
                self._awaiting.discard(request_id)
                self._done(request_id)
            self._abort(message.request_ids)

    def _held(self) -> list[str]:
        fetching = self.fetches.waiting() if self.fetches is not None else []
        return list(self._routes) + self._awaiting.prefills() + fetching + super()._held()

    def _start(self, message: msg.Prefill, images: list[ImageInput]) -> None:
        try:
            self.engine.add_request(
                message.request_id,
                message.prompt_token_ids,
                message.params,
                prefill_only=True,
                traffic_class=message.traffic_class,
                images=images,
                resumed=message.resumed,
            )
        except ValueError as exc:
            self._done(message.request_id)
            self._errors.append(msg.RequestError(message.request_id, str(exc)))
            return
        self._routes[message.request_id] = _Route(message.decode_worker, message.decode_kv_addr)

    def _done(self, request_id: str) -> None:
        """The prompt no longer waits for, or needs, blocks pulled from a peer."""
        if self.fetches is not None:
            self.fetches.discard(request_id)

    def _serve_blocks(self, message: msg.FetchBlocks) -> None:
        """Another prefill worker's FetchBlocks: the leading blocks held here, or none."""
        store = self.staged.store if self.staged is not None else None
        kv = gather_prefix(self.engine, store, message.block_hashes)
        header = peer_header(message.request_id, self.transport.worker_id, kv)
        outgoing = Outgoing(message.request_id, header, [] if kv is None else [kv], None)
        self.sender.send(message.requester, message.reply_addr, outgoing)

    def _start_with_images(self) -> None:
        """Prompts whose image embeddings arrived start; failed or late ones are reported."""
        for arrived in self.embeddings.collect():
            request_id = arrived.header.request_id
            if arrived.error is not None:
                self._awaiting.discard(request_id)
                self._errors.append(msg.RequestError(request_id, arrived.error, 503))
            else:
                self._awaiting.add_embeddings(request_id, arrived.tensors[0])
        for message, embeddings in self._awaiting.ready():
            try:
                images = split_embeddings(message.images, embeddings)
            except ValueError as exc:
                self._errors.append(msg.RequestError(message.request_id, str(exc)))
                continue
            self._start(message, images)
        for request_id in self._awaiting.expired():
            error = "the image embeddings did not arrive in time"
            self._errors.append(msg.RequestError(request_id, error, 503))

    def _poll_ms(self) -> int:
        waiting = self._awaiting or self.fetches
        return PENDING_POLL_MS if waiting else super()._poll_ms()

    def _tick(self) -> None:
        self._start_with_images()
        if self.fetches is not None:
            for message in self.fetches.ready():
                self._start(message, [])
        for output in self._step():
            if output.finished and output.outputs[0].finish_reason == "prefilled":
                self._done(output.request_id)
                prefilled = self.engine.handoff.pop_prefilled(output.request_id)
                route = self._routes.pop(output.request_id, None)
                if route is not None:
                    self.sender.send(route.decode_worker, route.kv_addr, self._handoff(prefilled))
        self.phases.lap("handoff")
        self._send_outputs([])

    def _transfer_bytes(self) -> int:
        return self.transport.bytes_sent

    def _handoff(self, prefilled: Prefilled) -> Outgoing:
        """The KV (and image embeddings) of a computed prompt, for its decode worker."""
        tensors = [prefilled.kv]
        if prefilled.image_embeddings is not None:
            tensors.append(prefilled.image_embeddings.to(prefilled.kv.dtype))
        return Outgoing(prefilled.request_id, partial(self._header, prefilled), tensors, "KV")

    def _header(self, prefilled: Prefilled, generation: int) -> msg.KvHeader:
        kv, first = prefilled.kv, prefilled.first_token
        embeddings = prefilled.image_embeddings
        logprobs = None if prefilled.logprobs is None else wire_position(prefilled.logprobs, first)
        return msg.KvHeader(
            request_id=prefilled.request_id,
            sender=self.transport.worker_id,
            generation=generation,
            first_token=first,
            logprobs=logprobs,
            shape=list(kv.shape),
            dtype=str(kv.dtype).removeprefix("torch."),
            embeddings_shape=None if embeddings is None else list(embeddings.shape),
        )
