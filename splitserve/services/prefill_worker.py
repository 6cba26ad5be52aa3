"""PrefillWorker: computes prompts and sends their KV to the decode worker that reserved it.

The loop thread runs the engine with ``prefill_only`` requests. When a prompt is done, its
KV (already gathered into one contiguous tensor) and first token go to the queue of its
decode worker, which that peer's sender thread works through in order: a KvHeader message
to the decode worker's ZMQ socket, then the tensor over the KV transport. One thread per
peer keeps the sends on each channel in the order the headers announced them, and a decode
worker that stopped receiving holds up only its own transfers.

A prompt with images starts once both its Prefill message and its image embeddings (from a
vision worker, through the EmbeddingInbox on this worker's embeddings socket) are here.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass

import torch
import zmq

from splitserve.engine.kv_handoff import Prefilled
from splitserve.engine.multimodal import ImageInput
from splitserve.kvstore.transfer import KVTransport, StoreAddress, TransferError
from splitserve.services import messages as msg
from splitserve.services.embedding_inbox import EmbeddingInbox
from splitserve.services.image_waits import ImageWaits, split_embeddings
from splitserve.services.workers import EngineWorker, wire_position

QUEUE_POLL_S = 0.1
PENDING_POLL_MS = 2


@dataclass(frozen=True)
class _Route:
    decode_worker: str
    kv_addr: str


class PrefillWorker(EngineWorker):
    role = "prefill"

    def _setup(self) -> None:
        assert self.store is not None, "a prefill worker needs the rendezvous store"
        self.transport = KVTransport(
            self.worker_id,
            StoreAddress(self.store[0], int(self.store[1])),
            torch.device(self.config.device),
            self.transfer.get("backend", "auto"),
            self.transfer.get("timeout_s", 30.0),
        )
        self._routes: dict[str, _Route] = {}
        self._outboxes: dict[str, queue.Queue[Prefilled]] = {}
        self._embeddings_socket = self._ctx.socket(zmq.PULL)
        port = self._embeddings_socket.bind_to_random_port(f"tcp://{self.bind_host}")
        self.kv_addr = f"tcp://{self.bind_host}:{port}"
        self._poller.register(self._embeddings_socket, zmq.POLLIN)
        self.inbox = EmbeddingInbox(self.worker_id, self.transport, self._stop)
        self._awaiting = ImageWaits(float(self.transfer.get("timeout_s", 30.0)))

    def _handle(self, message: msg.Message) -> None:
        if isinstance(message, msg.Prefill):
            if message.images:
                self._awaiting.add_prefill(message)
            else:
                self._start(message, [])
        elif isinstance(message, msg.EmbeddingsHeader):
            self.inbox.on_header(message)
        elif isinstance(message, msg.AbortRequest):
            for request_id in message.request_ids:
                self._routes.pop(request_id, None)
                self._awaiting.discard(request_id)
            self._abort(message.request_ids)

    def _start(self, message: msg.Prefill, images: list[ImageInput]) -> None:
        try:
            self.engine.add_request(
                message.request_id,
                message.prompt_token_ids,
                message.params,
                prefill_only=True,
                traffic_class=message.traffic_class,
                images=images,
            )
        except ValueError as exc:
            self._errors.append(msg.RequestError(message.request_id, str(exc)))
            return
        self._routes[message.request_id] = _Route(message.decode_worker, message.decode_kv_addr)

    def _start_with_images(self) -> None:
        """Prompts whose image embeddings arrived start; failed or late ones are reported."""
        for arrived in self.inbox.collect():
            if arrived.error is not None:
                self._awaiting.discard(arrived.request_id)
                self._errors.append(msg.RequestError(arrived.request_id, arrived.error, 503))
            elif arrived.embeddings is not None:
                self._awaiting.add_embeddings(arrived.request_id, arrived.embeddings)
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
        return PENDING_POLL_MS if self._awaiting else super()._poll_ms()

    def _tick(self) -> None:
        self._start_with_images()
        for output in self._step():
            if output.finished and output.outputs[0].finish_reason == "prefilled":
                prefilled = self.engine.handoff.pop_prefilled(output.request_id)
                route = self._routes.pop(output.request_id, None)
                if route is not None:
                    _wait_for_device(prefilled.kv)
                    self._outbox(route).put(prefilled)
        self._send_outputs([])

    def _transfer_bytes(self) -> int:
        return self.transport.bytes_sent

    def _outbox(self, route: _Route) -> queue.Queue[Prefilled]:
        """The queue of route's decode worker; its sender thread starts with it."""
        if route.decode_worker not in self._outboxes:
            outbox: queue.Queue[Prefilled] = queue.Queue()
            self._outboxes[route.decode_worker] = outbox
            name = f"kv-send-{route.decode_worker}"
            threading.Thread(
                target=self._send_loop, args=(route, outbox), name=name, daemon=True
            ).start()
        return self._outboxes[route.decode_worker]

    def _send_loop(self, route: _Route, outbox: queue.Queue[Prefilled]) -> None:
        """A sender thread: owns one peer's header socket and channel generation."""
        socket = self._header_socket(route.kv_addr)
        generation = 0
        while not self._stop.is_set():
            try:
                prefilled = outbox.get(timeout=QUEUE_POLL_S)
            except queue.Empty:
                continue
            socket.send(msg.encode(self._header(prefilled, generation)))
            if not self._send_kv(route.decode_worker, generation, prefilled):
                generation += 1
        socket.close(linger=0)

    def _header_socket(self, addr: str) -> zmq.Socket:
        socket = self._ctx.socket(zmq.PUSH)
        socket.setsockopt(zmq.SNDHWM, 0)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(addr)
        return socket

    def _header(self, prefilled: Prefilled, generation: int) -> msg.KvHeader:
        kv, first = prefilled.kv, prefilled.first_token
        embeddings = prefilled.image_embeddings
        logprobs = None if prefilled.logprobs is None else wire_position(prefilled.logprobs, first)
        return msg.KvHeader(
            request_id=prefilled.request_id,
            sender=self.worker_id,
            generation=generation,
            first_token=first,
            logprobs=logprobs,
            shape=list(kv.shape),
            dtype=str(kv.dtype).removeprefix("torch."),
            embeddings_shape=None if embeddings is None else list(embeddings.shape),
        )

    def _send_kv(self, peer: str, generation: int, prefilled: Prefilled) -> bool:
        """Send one request's KV; on failure drop the channel and report the request."""
        delay = float(self.transfer.get("fault_send_delay_s", 0.0))
        if delay:
            time.sleep(delay)
        start = time.monotonic()
        try:
            self.transport.send(peer, generation, prefilled.kv)
            if prefilled.image_embeddings is not None:
                embeddings = prefilled.image_embeddings.to(prefilled.kv.dtype)
                self.transport.send(peer, generation, embeddings)
        except TransferError as exc:
            self.transport.drop(self.worker_id, peer, generation)
            error = f"KV transfer to {peer} failed: {exc}"
            self._async_errors.put(msg.RequestError(prefilled.request_id, error, 503))
            return False
        self._transfer_seconds.put(time.monotonic() - start)
        return True


def _wait_for_device(kv: torch.Tensor) -> None:
    """The gather ran on this thread's stream; the sender thread's send must see its result."""
    if kv.device.type == "cuda":
        torch.cuda.current_stream(kv.device).synchronize()
