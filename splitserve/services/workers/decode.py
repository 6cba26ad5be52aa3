"""DecodeWorker: reserves blocks for prompts prefilled elsewhere, receives their KV, decodes.

The loop thread owns the engine. A Reserve message reserves blocks (queued while none are
free) and is answered with Reserved. A KvHeader from a prefill worker is checked against the
room its reservation holds (services/workers/slots.py: the KV of the prompt's blocks, and the
embeddings of its images); the peer's receiver thread fills the buffers, and the loop thread
adopts them (scatter into the reserved blocks, first token, join the running batch) and
streams the first token like any other. A reservation whose KV has not arrived within
transfer.timeout_s, or whose transfer failed, is cancelled (blocks freed) and reported as a
RequestError (503).

A header that announces other than its reservation, or names a request never reserved here,
is refused: nothing is allocated for it, its channel is dropped, a reserved request fails.
The late KV of a reservation that ended without it (aborted, timed out) is still received for
``timeout_s`` more, into scratch room of the reserved size: the prefill worker may have sent
the header already, and dropping the channel would stall every send queued behind it.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from dataclasses import dataclass
from functools import partial

import zmq

from splitserve.engine.request import RequestOutput
from splitserve.engine.vision.multimodal import ImageInput
from splitserve.services import messages as msg
from splitserve.services.workers import limits
from splitserve.services.workers.base import open_transport
from splitserve.services.workers.channels import TensorReceiver
from splitserve.services.workers.engine_worker import EngineWorker, engine_position
from splitserve.services.workers.slots import Slot

PENDING_POLL_MS = 2


@dataclass(frozen=True)
class _Room:
    """What a reservation holds room for: the KV of its blocks and, for an image prompt, the
    embeddings [image tokens, hidden] that follow it. until: the KV's deadline while the
    reservation lasts; after it ended, until when its late KV is still received."""

    kv: Slot
    embeddings: Slot | None
    until: float


class DecodeWorker(EngineWorker):
    role = "decode"

    def _setup(self) -> None:
        self.timeout_s = self.spec.transfer.timeout_s
        self._headers, self.kv_addr = self._bind(zmq.PULL, limits.HEADER_BYTES)
        self.transport = open_transport(self.spec, self.kv_addr)
        self._poller.register(self._headers, zmq.POLLIN)
        self._waiting: collections.deque[msg.Reserve] = collections.deque()
        self._reserved: dict[str, _Room] = {}
        self._ended: dict[str, _Room] = {}
        self.receiver: TensorReceiver[msg.KvHeader] = TensorReceiver(
            self.transport.worker_id, self.transport, self._stop, self._thread_failed, "KV"
        )

    def _poll_ms(self) -> int:
        if self._busy():
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
                self._end(request_id)
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
                ids, params = request.prompt_token_ids, request.params
                resumed = request.resumed, request.resumed_chars
                req = self.engine.build_request(request.request_id, ids, params, images, *resumed)
                if not self.engine.handoff.reserve(req):
                    return
            except ValueError as exc:
                self._errors.append(msg.RequestError(request.request_id, str(exc)))
            else:
                self._reserved[request.request_id] = self._room(request)
                self._send(msg.Reserved(request.request_id))
                self._last_stats = 0.0
            self._waiting.popleft()

    def _on_header(self, header: msg.KvHeader) -> None:
        shapes = [header.shape]
        if header.embeddings_shape is not None:
            shapes.append(header.embeddings_shape)
        self.receiver.on_header(header, shapes, self._slots(header))

    def _room(self, request: msg.Reserve) -> _Room:
        runner = self.engine.runner
        image_tokens = sum(span.length for span in request.images)
        hidden = self.engine.model_config.hidden_size
        embeddings = Slot((image_tokens, hidden), runner.dtype) if image_tokens else None
        until = time.monotonic() + self.timeout_s
        kv = self.engine.handoff.transfer_shape(len(request.prompt_token_ids))
        return _Room(Slot(kv, runner.kv_dtype), embeddings, until)

    def _slots(self, header: msg.KvHeader) -> list[Slot] | None:
        """The room for the header's tensors: a reservation's KV lands in the buffer the
        engine gives for it; an ended reservation's in scratch room; None: refused."""
        request_id = header.request_id
        room = self._reserved.get(request_id)
        if room is not None:
            receive = partial(self.engine.handoff.receive_buffer, request_id)
            kv = dataclasses.replace(room.kv, allocate=receive)
        else:
            room = self._ended.pop(request_id, None)
            if room is None:
                return None
            kv = room.kv
        announces_embeddings = header.embeddings_shape is not None
        if announces_embeddings and room.embeddings is not None:
            return [kv, room.embeddings]
        return [kv]

    def _end(self, request_id: str) -> None:
        """The reservation is over without its KV; a header may still be on its way."""
        room = self._reserved.pop(request_id, None)
        if room is not None:
            until = time.monotonic() + self.timeout_s
            self._ended[request_id] = dataclasses.replace(room, until=until)

    def _tick(self) -> None:
        self._reserve_waiting()
        self.phases.lap("reserve")
        outputs = self._adopt_received()
        self._expire()
        self.phases.lap("adopt")
        outputs += self._step()
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
            try:
                adopted = self.engine.handoff.adopt(
                    header.request_id,
                    kv,
                    header.first_token,
                    logprobs,
                    next(iter(embeddings), None),
                )
                output = self.engine.admit_prefilled(*adopted)
            except Exception as exc:  # this request's KV or first token: it alone fails
                self._recover(exc, [header.request_id])
                continue
            self._sent[header.request_id] = (0, 0)
            outputs.append(output)
        return outputs

    def _expire(self) -> None:
        now = time.monotonic()
        for request_id, room in list(self._reserved.items()):
            if now > room.until:
                self._end(request_id)
                error = f"the KV of the prompt did not arrive within {self.timeout_s:g} s"
                self._fail(request_id, error)
        if self._ended:
            self._ended = {r: room for r, room in self._ended.items() if now <= room.until}

    def _fail(self, request_id: str, error: str) -> None:
        """Free the reservation and tell the API server."""
        self._reserved.pop(request_id, None)
        self.engine.handoff.cancel(request_id)
        self._errors.append(msg.RequestError(request_id, error, 503))
        self._last_stats = 0.0

    def _transfer_bytes(self) -> int:
        return self.transport.bytes_received
