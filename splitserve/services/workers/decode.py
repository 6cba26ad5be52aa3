"""DecodeWorker: reserves blocks for prompts prefilled elsewhere, receives their KV, decodes.

The loop thread owns the engine. A Reserve message reserves blocks (queued while none are
free) and is answered with Reserved. A KvHeader from a prefill worker is checked against its
reservation (services/workers/channels.py: the reserved KV buffer, and the embeddings of the
prompt's images); the peer's receiver thread fills the buffers, and the loop thread adopts
them (scatter into the reserved blocks, first token, join the running batch) and streams the
first token like any other. A header for a request not reserved here, or that announces other
than what was reserved, is refused: nothing is allocated for it, its channel is dropped and a
reserved request fails. A reservation whose KV has not arrived within transfer.timeout_s, or
whose transfer failed, is cancelled (blocks freed) and reported as a RequestError (503).
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass

import zmq

from splitserve.engine.request import RequestOutput
from splitserve.engine.vision.multimodal import ImageInput
from splitserve.services import messages as msg
from splitserve.services.workers.base import open_transport
from splitserve.services.workers.channels import TensorReceiver
from splitserve.services.workers.engine_worker import EngineWorker, engine_position
from splitserve.services.workers.slots import Slot

PENDING_POLL_MS = 2


@dataclass(frozen=True)
class _Reservation:
    deadline: float
    image_tokens: int
    """The prompt's image tokens: the rows of the embeddings that follow its KV (0: none)."""


class DecodeWorker(EngineWorker):
    role = "decode"

    def _setup(self) -> None:
        self.transport = open_transport(self.spec)
        self.timeout_s = self.spec.transfer.timeout_s
        self._headers = self._ctx.socket(zmq.PULL)
        port = self._headers.bind_to_random_port(f"tcp://{self.spec.bind_host}")
        self.kv_addr = f"tcp://{self.spec.bind_host}:{port}"
        self._poller.register(self._headers, zmq.POLLIN)
        self._waiting: collections.deque[msg.Reserve] = collections.deque()
        self._reserved: dict[str, _Reservation] = {}
        self.receiver: TensorReceiver[msg.KvHeader] = TensorReceiver(
            self.worker_id, self.transport, self._stop, self._thread_failed, "KV"
        )

    def _poll_ms(self) -> int:
        if self.engine.has_unfinished_requests():
            return 0
        return PENDING_POLL_MS if self._reserved or self._waiting else super()._poll_ms()

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
                self._reserved.pop(request_id, None)
            self._abort(message.request_ids)

    def _held(self) -> list[str]:
        waiting = [r.request_id for r in self._waiting]
        return waiting + list(self._reserved) + super()._held()

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
                image_tokens = sum(span.length for span in request.images)
                deadline = time.monotonic() + self.timeout_s
                self._reserved[request.request_id] = _Reservation(deadline, image_tokens)
                self._send(msg.Reserved(request.request_id))
                self._last_stats = 0.0
            self._waiting.popleft()

    def _on_header(self, header: msg.KvHeader) -> None:
        shapes = [header.shape]
        if header.embeddings_shape is not None:
            shapes.append(header.embeddings_shape)
        self.receiver.on_header(header, shapes, self._slots(header))

    def _slots(self, header: msg.KvHeader) -> list[Slot] | None:
        """What the reservation holds room for: its KV buffer and, when the header announces
        them, the embeddings of its images ([image tokens, hidden], the KV's dtype)."""
        reservation = self._reserved.get(header.request_id)
        if reservation is None:
            return None
        kv = self.engine.handoff.receive_buffer(header.request_id)
        slots = [Slot.of(kv)]
        if header.embeddings_shape is not None and reservation.image_tokens:
            hidden = self.engine.model_config.hidden_size
            slots.append(Slot((reservation.image_tokens, hidden), kv.dtype))
        return slots

    def _tick(self) -> None:
        self._reserve_waiting()
        outputs = self._adopt_received()
        self._expire()
        if self.engine.has_unfinished_requests():
            outputs += self.engine.step()
        self._send_outputs(outputs)

    def _adopt_received(self) -> list[RequestOutput]:
        outputs = []
        for item in self.receiver.collect():
            header = item.header
            if self._reserved.pop(header.request_id, None) is None:
                continue
            if item.error is not None:
                self._fail(header.request_id, item.error)
                continue
            self._transfer_seconds.put(item.seconds)
            kv, *embeddings = item.tensors
            logprobs = None if header.logprobs is None else engine_position(header.logprobs)
            output = self.engine.handoff.adopt(
                header.request_id, kv, header.first_token, logprobs, next(iter(embeddings), None)
            )
            self._sent[header.request_id] = (0, 0)
            outputs.append(output)
        return outputs

    def _expire(self) -> None:
        now = time.monotonic()
        for request_id, reservation in list(self._reserved.items()):
            if now > reservation.deadline:
                error = f"the KV of the prompt did not arrive within {self.timeout_s:g} s"
                self._fail(request_id, error)

    def _fail(self, request_id: str, error: str) -> None:
        """Free the reservation and tell the API server."""
        self._reserved.pop(request_id, None)
        self.engine.handoff.cancel(request_id)
        self._errors.append(msg.RequestError(request_id, error, 503))
        self._last_stats = 0.0

    def _transfer_bytes(self) -> int:
        return self.transport.bytes_received
