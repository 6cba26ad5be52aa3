"""DecodeWorker: reserves blocks for prompts prefilled elsewhere, receives their KV, decodes.

The loop thread owns the engine. A Reserve message reserves blocks (queued while none are
free) and is answered with Reserved. A KvHeader from a prefill worker gets a receive buffer
from the loop thread and goes to that peer's receiver thread, which runs the transport's
recv and hands the filled buffer back; the loop thread then adopts it (scatter into the
reserved blocks, first token, join the running batch) and streams the first token like any
other. A reservation whose KV has not arrived within transfer.timeout_s, or whose transfer
failed, is cancelled (blocks freed) and reported to the API server as a RequestError.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from dataclasses import dataclass

import torch
import zmq

from splitserve.engine.request import RequestOutput
from splitserve.engine.vision.multimodal import ImageInput
from splitserve.kvstore.transfer import TransferError
from splitserve.services import messages as msg
from splitserve.services.workers.base import EngineWorker, engine_position, open_transport

QUEUE_POLL_S = 0.1
PENDING_POLL_MS = 2


@dataclass(frozen=True)
class _Received:
    """A receiver thread's result: the header, the buffer and the error if it failed."""

    header: msg.KvHeader
    buffer: torch.Tensor
    error: str | None
    seconds: float
    embeddings: torch.Tensor | None = None


class DecodeWorker(EngineWorker):
    role = "decode"

    def _setup(self) -> None:
        self.transport = open_transport(
            self.worker_id, self.store, self.config.device, self.transfer
        )
        self.timeout_s = self.transport.timeout.total_seconds()
        self._headers = self._ctx.socket(zmq.PULL)
        port = self._headers.bind_to_random_port(f"tcp://{self.bind_host}")
        self.kv_addr = f"tcp://{self.bind_host}:{port}"
        self._poller.register(self._headers, zmq.POLLIN)
        self._waiting: collections.deque[msg.Reserve] = collections.deque()
        self._deadlines: dict[str, float] = {}
        self._peers: dict[str, queue.Queue[tuple[msg.KvHeader, torch.Tensor]]] = {}
        self._received: queue.Queue[_Received] = queue.Queue()

    def _poll_ms(self) -> int:
        if self.engine.has_unfinished_requests():
            return 0
        return PENDING_POLL_MS if self._deadlines or self._waiting else super()._poll_ms()

    def _handle(self, message: msg.Message) -> None:
        if isinstance(message, msg.Reserve):
            self._waiting.append(message)
            self._reserve_waiting()
        elif isinstance(message, msg.KvHeader):
            self._on_header(message)
        elif isinstance(message, msg.AbortRequest):
            aborted = set(message.request_ids)
            self._waiting = collections.deque(
                r for r in self._waiting if r.request_id not in aborted
            )
            for request_id in message.request_ids:
                self._deadlines.pop(request_id, None)
            self._abort(message.request_ids)

    def _reserve_waiting(self) -> None:
        """Reserve in arrival order until one does not fit yet."""
        while self._waiting:
            request = self._waiting[0]
            try:
                images = [ImageInput(span) for span in request.images]
                if not self.engine.handoff.reserve(
                    request.request_id, request.prompt_token_ids, request.params, images
                ):
                    return
            except ValueError as exc:
                self._errors.append(msg.RequestError(request.request_id, str(exc)))
            else:
                self._deadlines[request.request_id] = time.monotonic() + self.timeout_s
                self._send(msg.Reserved(request.request_id))
                self._last_stats = 0.0
            self._waiting.popleft()

    def _on_header(self, header: msg.KvHeader) -> None:
        """Pick the buffer the KV lands in; a request no longer reserved still drains it."""
        buffer = None
        if header.request_id in self._deadlines:
            buffer = self.engine.handoff.receive_buffer(header.request_id)
            if list(buffer.shape) != header.shape or _dtype_name(buffer) != header.dtype:
                self._fail(header.request_id, f"KV shape mismatch: {header.shape} sent")
                buffer = None
        if buffer is None:
            dtype = getattr(torch, header.dtype)
            buffer = torch.empty(header.shape, dtype=dtype, device=self.transport.device)
        self._peer_queue(header.sender).put((header, buffer))

    def _peer_queue(self, peer: str) -> queue.Queue[tuple[msg.KvHeader, torch.Tensor]]:
        if peer not in self._peers:
            self._peers[peer] = queue.Queue()
            thread = threading.Thread(
                target=self._receive_loop, args=(peer,), name=f"kv-recv-{peer}", daemon=True
            )
            thread.start()
        return self._peers[peer]

    def _receive_loop(self, peer: str) -> None:
        """A receiver thread: the transport's recv for one sending peer, in header order."""
        inbox = self._peers[peer]
        while not self._stop.is_set():
            try:
                header, buffer = inbox.get(timeout=QUEUE_POLL_S)
            except queue.Empty:
                continue
            start = time.monotonic()
            error = None
            embeddings = None
            try:
                self.transport.recv(peer, header.generation, buffer)
                if header.embeddings_shape is not None:
                    embeddings = self._receive_embeddings(peer, header, buffer.dtype)
            except TransferError as exc:
                self.transport.drop(peer, self.worker_id, header.generation)
                error = f"KV transfer from {peer} failed: {exc}"
            seconds = time.monotonic() - start
            self._received.put(_Received(header, buffer, error, seconds, embeddings))

    def _receive_embeddings(
        self, peer: str, header: msg.KvHeader, dtype: torch.dtype
    ) -> torch.Tensor:
        """An image prompt's embeddings follow its KV (kept for a recompute after preemption)."""
        shape = header.embeddings_shape or []
        if len(shape) != 2 or min(shape) < 1:
            raise TransferError(f"malformed embeddings shape {shape}")
        embeddings = torch.empty(shape, dtype=dtype, device=self.transport.device)
        self.transport.recv(peer, header.generation, embeddings)
        return embeddings

    def _tick(self) -> None:
        self._reserve_waiting()
        outputs = self._adopt_received()
        self._expire()
        if self.engine.has_unfinished_requests():
            outputs += self.engine.step()
        self._send_outputs(outputs)

    def _adopt_received(self) -> list[RequestOutput]:
        outputs = []
        while not self._received.empty():
            item = self._received.get_nowait()
            header = item.header
            if self._deadlines.pop(header.request_id, None) is None:
                continue
            if item.error is not None:
                self._fail(header.request_id, item.error)
                continue
            self._transfer_seconds.put(item.seconds)
            logprobs = None if header.logprobs is None else engine_position(header.logprobs)
            output = self.engine.handoff.adopt(
                header.request_id, item.buffer, header.first_token, logprobs, item.embeddings
            )
            self._sent[header.request_id] = (0, 0)
            outputs.append(output)
        return outputs

    def _expire(self) -> None:
        now = time.monotonic()
        for request_id, deadline in list(self._deadlines.items()):
            if now > deadline:
                error = f"the KV of the prompt did not arrive within {self.timeout_s:g} s"
                self._fail(request_id, error)

    def _fail(self, request_id: str, error: str) -> None:
        """Free the reservation and tell the API server."""
        self._deadlines.pop(request_id, None)
        self.engine.handoff.cancel(request_id)
        self._errors.append(msg.RequestError(request_id, error, 503))
        self._last_stats = 0.0

    def _transfer_bytes(self) -> int:
        return self.transport.bytes_received


def _dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")
