"""PrefillWorker: computes prompts and sends their KV to the decode worker that reserved it.

The loop thread runs the engine with ``prefill_only`` requests. When a prompt is done, its
KV (already gathered into one contiguous tensor) and first token go to the queue of its
decode worker, which that peer's sender thread works through in order: a KvHeader message
to the decode worker's ZMQ socket, then the tensor over the KV transport. One thread per
peer keeps the sends on each channel in the order the headers announced them, and a decode
worker that stopped receiving holds up only its own transfers.

A prompt with images starts once both its Prefill message and its image embeddings (from a
vision worker, through the EmbeddingInbox on this worker's embeddings socket) are here. A
Prefill that names a peer starts once that peer's blocks are here or missed; this worker also
serves other prefill workers' FetchBlocks through the same sender threads
(services/workers/peer_blocks.py).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import zmq

from splitserve.engine.kv_handoff import Prefilled
from splitserve.engine.vision.multimodal import ImageInput
from splitserve.kvstore.transfer import TransferError
from splitserve.services import messages as msg
from splitserve.services.workers.base import EngineWorker, open_transport, wire_position
from splitserve.services.workers.channels import EmbeddingInbox
from splitserve.services.workers.image_waits import ImageWaits, split_embeddings
from splitserve.services.workers.peer_blocks import PeerFetches, gather_prefix, peer_header

QUEUE_POLL_S = 0.1
PENDING_POLL_MS = 2


@dataclass(frozen=True)
class _Route:
    decode_worker: str
    kv_addr: str


@dataclass(frozen=True)
class _Outgoing:
    """One announced send to a peer: a header naming the channel generation, then tensors."""

    request_id: str
    header: Callable[[int], msg.Message]
    tensors: list[torch.Tensor]
    fails_request: bool
    """A broken KV handoff fails the request; a broken peer-block send only makes the
    requester compute the prefix itself."""


class PrefillWorker(EngineWorker):
    role = "prefill"

    def _setup(self) -> None:
        self.transport = open_transport(
            self.worker_id, self.store, self.config.device, self.transfer
        )
        self._routes: dict[str, _Route] = {}
        self._outboxes: dict[str, queue.Queue[_Outgoing]] = {}
        self._embeddings_socket = self._ctx.socket(zmq.PULL)
        port = self._embeddings_socket.bind_to_random_port(f"tcp://{self.bind_host}")
        self.kv_addr = f"tcp://{self.bind_host}:{port}"
        self._poller.register(self._embeddings_socket, zmq.POLLIN)
        self.inbox = EmbeddingInbox(self.worker_id, self.transport, self._stop)
        self._awaiting = ImageWaits(float(self.transfer.get("timeout_s", 30.0)))
        self.staged = self.cache.blocks if self.cache is not None else None
        self.fetches = (
            PeerFetches(
                self.worker_id,
                self.kv_addr,
                self._ctx,
                self.transport,
                self.staged,
                self.engine,
                self._stop,
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
            self.inbox.on_header(message)
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
        if kv is not None:
            _wait_for_device(kv)
        header = peer_header(message.request_id, self.worker_id, kv)
        outgoing = _Outgoing(message.request_id, header, [] if kv is None else [kv], False)
        self._outbox(message.requester, message.reply_addr).put(outgoing)

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
                    _wait_for_device(prefilled.kv)
                    outbox = self._outbox(route.decode_worker, route.kv_addr)
                    outbox.put(self._handoff(prefilled))
        self._send_outputs([])

    def _transfer_bytes(self) -> int:
        return self.transport.bytes_sent

    def _handoff(self, prefilled: Prefilled) -> _Outgoing:
        """The KV (and image embeddings) of a computed prompt, for its decode worker."""
        tensors = [prefilled.kv]
        if prefilled.image_embeddings is not None:
            tensors.append(prefilled.image_embeddings.to(prefilled.kv.dtype))
        header = partial(self._header, prefilled)
        return _Outgoing(prefilled.request_id, header, tensors, True)

    def _outbox(self, peer: str, addr: str) -> queue.Queue[_Outgoing]:
        """The queue of a peer (a decode worker, or a prefill worker that asked for blocks)
        whose headers go to addr; its sender thread starts with it."""
        if peer not in self._outboxes:
            outbox: queue.Queue[_Outgoing] = queue.Queue()
            self._outboxes[peer] = outbox
            args = (peer, addr, outbox)
            name = f"kv-send-{peer}"
            threading.Thread(target=self._send_loop, args=args, name=name, daemon=True).start()
        return self._outboxes[peer]

    def _send_loop(self, peer: str, addr: str, outbox: queue.Queue[_Outgoing]) -> None:
        """A sender thread: owns one peer's header socket and channel generation."""
        socket = self._header_socket(addr)
        generation = 0
        while not self._stop.is_set():
            try:
                outgoing = outbox.get(timeout=QUEUE_POLL_S)
            except queue.Empty:
                continue
            socket.send(msg.encode(outgoing.header(generation)))
            if not self._send_tensors(peer, generation, outgoing):
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

    def _send_tensors(self, peer: str, generation: int, outgoing: _Outgoing) -> bool:
        """Send one announced set of tensors; on failure drop the channel (and report the
        request when the failure fails it)."""
        if not outgoing.tensors:
            return True
        delay = float(self.transfer.get("fault_send_delay_s", 0.0))
        if delay:
            time.sleep(delay)
        start = time.monotonic()
        try:
            for tensor in outgoing.tensors:
                self.transport.send(peer, generation, tensor)
        except TransferError as exc:
            self.transport.drop(self.worker_id, peer, generation)
            if outgoing.fails_request:
                error = f"KV transfer to {peer} failed: {exc}"
                self._async_errors.put(msg.RequestError(outgoing.request_id, error, 503))
            return False
        self._transfer_seconds.put(time.monotonic() - start)
        return True


def _wait_for_device(kv: torch.Tensor) -> None:
    """The gather ran on this thread's stream; the sender thread's send must see its result."""
    if kv.device.type == "cuda":
        torch.cuda.current_stream(kv.device).synchronize()
