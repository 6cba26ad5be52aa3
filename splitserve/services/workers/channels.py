"""The one way tensors move between workers: a header message on the receiving worker's ZMQ
socket, then the tensors it announces on the KV transport (kvstore/transfer.py), in order.

- ``TensorSender``: one thread per receiving peer owns that peer's header socket and channel
  generation. A send that fails drops the channel and bumps the generation, so the next
  header opens a fresh process group; the request is reported failed when its send says so.
- ``TensorReceiver``: one thread per sending peer runs the transport's recv in header order
  (the order the sender used) and queues the results for the worker's loop thread, which
  takes them between its steps (``collect``), each header's tensors only once all arrived.
  Every header passes the one check (services/workers/slots.py: ``accept``) against the room
  its receiving worker reserved for it. A refused header allocates nothing; its channel
  generation is dropped in order (the sender still sends, so the channel would be out of
  step), which makes the sender's send fail.

On CUDA each of these threads sends or receives on a stream of its own (kvstore/transfer.py:
``TransferStream``), so a transfer is never queued behind the loop thread's compute: a send
waits only for the work that wrote its tensors (an event recorded when the loop queued it), and
a receive for nothing. Receive buffers are allocated on the receiving thread's stream; the
thread waits (on the host, off the loop thread) for the transfer to complete before it hands
them over, and ``collect`` marks them used on the loop thread's stream from then on.

Users: prefill -> decode (KvHeader: the prompt's KV, then image embeddings), vision -> prefill
(EmbeddingsHeader), prefill -> prefill (PeerBlocks, services/workers/peer_blocks.py).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch
import zmq

from splitserve import curve
from splitserve.kvstore.transfer import (
    KVTransport,
    TransferError,
    TransferStream,
    stream_mark,
    use_on_current_stream,
)
from splitserve.services import messages as msg
from splitserve.services.sealing import Sealer
from splitserve.services.workers.slots import Refused, Slot, accept

QUEUE_POLL_S = 0.1
logger = logging.getLogger("splitserve.worker")


H = TypeVar("H", msg.KvHeader, msg.EmbeddingsHeader, msg.PeerBlocks)


@dataclass(frozen=True)
class Received(Generic[H]):
    """A header's tensors as received, in the order announced, or why they were not."""

    header: H
    tensors: list[torch.Tensor]
    error: str | None
    seconds: float = 0.0


@dataclass(frozen=True)
class _Pending(Generic[H]):
    header: H
    buffers: list[torch.Tensor]
    refusal: str | None


@dataclass(frozen=True)
class _Peer(Generic[H]):
    """A sending peer's receiver thread: its headers in order, and its stream."""

    inbox: queue.Queue[_Pending[H]]
    stream: TransferStream


class TensorReceiver(Generic[H]):
    """The receiving end of one kind of header. ``what`` names the tensors in errors;
    ``failed`` is told when a receiver thread stops on an unexpected error."""

    def __init__(
        self,
        worker_id: str,
        transport: KVTransport,
        stop: threading.Event,
        failed: Callable[[str], None],
        what: str,
    ) -> None:
        self.worker_id = worker_id
        self.transport = transport
        self.what = what
        self._stop = stop
        self._failed = failed
        self._peers: dict[str, _Peer[H]] = {}
        self._results: queue.Queue[Received[H]] = queue.Queue()

    def on_header(
        self, header: H, shapes: Sequence[Sequence[int]], slots: Sequence[Slot] | None
    ) -> None:
        """Check the header against the slots reserved for it and queue its receive, or its
        refusal (loop thread); either way its result comes out of ``collect``."""
        peer = self._peer(header.sender)
        try:
            with peer.stream.current():
                buffers = accept(header.dtype, shapes, slots, self.transport.device)
            pending = _Pending(header, buffers, None)
        except Refused as exc:
            refusal = f"{self.what} for {header.request_id} from {header.sender} refused: {exc}"
            pending = _Pending(header, [], refusal)
        peer.inbox.put(pending)

    def collect(self) -> list[Received[H]]:
        """Everything received (or failed) since the last call (loop thread), complete."""
        results = []
        while not self._results.empty():
            result = self._results.get_nowait()
            for tensor in result.tensors:
                use_on_current_stream(tensor)
            results.append(result)
        return results

    def _peer(self, peer: str) -> _Peer[H]:
        if peer not in self._peers:
            self._peers[peer] = _Peer(queue.Queue(), TransferStream(self.transport.device))
            body = _guarded(self._receive_loop, self._stop, self._failed, peer)
            threading.Thread(target=body, name=f"recv-{peer}", daemon=True).start()
        return self._peers[peer]

    def _receive_loop(self, peer: str) -> None:
        channel = self._peers[peer]
        while not self._stop.is_set():
            try:
                pending = channel.inbox.get(timeout=QUEUE_POLL_S)
            except queue.Empty:
                continue
            self._results.put(self._receive(peer, pending, channel.stream))

    def _receive(self, peer: str, pending: _Pending[H], stream: TransferStream) -> Received[H]:
        header = pending.header
        if pending.refusal is not None:
            # The sender sends anyway: with nothing received, this generation is out of step.
            self.transport.drop(peer, self.worker_id, header.generation)
            return Received(header, [], pending.refusal)
        start = time.monotonic()
        try:
            with stream.current():
                for buffer in pending.buffers:
                    self.transport.recv(peer, header.generation, buffer)
            stream.synchronize()
        except TransferError as exc:
            self.transport.drop(peer, self.worker_id, header.generation)
            return Received(header, [], f"{self.what} from {peer} did not arrive: {exc}")
        return Received(header, pending.buffers, None, time.monotonic() - start)


@dataclass(frozen=True)
class Outgoing:
    """One send to a peer: the header for a channel generation, then its tensors.

    what: named in the request's 503 when the send fails; None when a failure does not fail
    the request (a peer-block answer: the asking worker then computes the prefix itself).
    """

    request_id: str
    header: Callable[[int], msg.Message]
    tensors: list[torch.Tensor]
    what: str | None


@dataclass(frozen=True)
class _Queued:
    outgoing: Outgoing
    ready: torch.cuda.Event | None
    """After the work that wrote the tensors, on the loop thread's stream (CUDA)."""


class TensorSender:
    """The sending end: ``send`` queues (loop thread); each peer's thread sends in order.

    sealer: the deployment's, which every header is sealed with. errors: where failed
    requests go. timed: told each successful send's seconds.
    delay_s: a pause between a header and its tensors (transfer.fault_send_delay_s, tests).
    """

    def __init__(
        self,
        worker_id: str,
        transport: KVTransport,
        ctx: zmq.Context,
        sealer: Sealer,
        stop: threading.Event,
        errors: queue.Queue[msg.RequestError],
        failed: Callable[[str], None],
        timed: Callable[[float], None] | None = None,
        delay_s: float = 0.0,
    ) -> None:
        self.worker_id = worker_id
        self.transport = transport
        self._ctx = ctx
        self._sealer = sealer
        self._stop = stop
        self._errors = errors
        self._failed = failed
        self._timed = timed
        self._delay_s = delay_s
        self._outboxes: dict[str, queue.Queue[_Queued]] = {}

    def send(self, peer: str, addr: str, outgoing: Outgoing) -> None:
        """Queue a send to worker ``peer``, whose header socket is at ``addr``, of tensors that
        the work queued so far on this thread's stream wrote (the send waits for it, not the
        loop). A restarted peer has a new ``addr``, so it gets a channel of its own."""
        name = peer_name(peer, addr)
        if name not in self._outboxes:
            self._outboxes[name] = queue.Queue()
            body = _guarded(self._send_loop, self._stop, self._failed, peer, addr)
            threading.Thread(target=body, name=f"send-{peer}", daemon=True).start()
        self._outboxes[name].put(_Queued(outgoing, stream_mark(self.transport.device)))

    def _send_loop(self, peer: str, addr: str) -> None:
        outbox = self._outboxes[peer_name(peer, addr)]
        stream = TransferStream(self.transport.device)
        socket = push_socket(self._ctx, addr, self._sealer)
        generation = 0
        try:
            while not self._stop.is_set():
                try:
                    queued = outbox.get(timeout=QUEUE_POLL_S)
                except queue.Empty:
                    continue
                outgoing = queued.outgoing
                socket.send(self._sealer.seal(outgoing.header(generation)))
                if not outgoing.tensors:
                    continue
                stream.wait(queued.ready)
                with stream.current():
                    sent = self._send_tensors(peer, addr, generation, outgoing)
                if not sent:
                    generation += 1
        finally:
            socket.close(linger=0)

    def _send_tensors(self, peer: str, addr: str, generation: int, outgoing: Outgoing) -> bool:
        if self._delay_s:
            time.sleep(self._delay_s)
        start = time.monotonic()
        name = peer_name(peer, addr)
        try:
            for tensor in outgoing.tensors:
                self.transport.send(name, generation, tensor)
        except TransferError as exc:
            self.transport.drop(self.worker_id, name, generation)
            if outgoing.what is not None:
                error = f"sending {outgoing.what} to {peer} failed: {exc}"
                self._errors.put(msg.RequestError(outgoing.request_id, error, 503))
            return False
        if self._timed is not None:
            self._timed(time.monotonic() - start)
        return True


def peer_name(worker_id: str, addr: str) -> str:
    """A worker's name on the KV transport: its id and the address where it takes tensor
    headers (for a worker that takes none, its request address). The address is new each time
    the worker's process starts, so the channels of a restarted worker never meet its
    predecessor's (their rendezvous keys, a receiver thread still waiting on the dead one)."""
    return f"{worker_id}@{addr}"


def push_socket(ctx: zmq.Context, addr: str, sealer: Sealer) -> zmq.Socket:
    """A PUSH socket to a peer of the deployment (CurveZMQ with ``sealer``'s keys) that never
    blocks on a full queue and drops on close."""
    socket = curve.client(ctx.socket(zmq.PUSH), sealer.curve_keys())
    socket.setsockopt(zmq.SNDHWM, 0)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(addr)
    return socket


def _guarded(
    body: Callable[..., None],
    stop: threading.Event,
    failed: Callable[[str], None],
    *args: str,
) -> Callable[[], None]:
    """A thread body that logs an unexpected error and tells ``failed`` (the worker then
    fails its requests) instead of dying silently; after stop, its sockets are gone."""

    def run() -> None:
        try:
            body(*args)
        except Exception as exc:
            if stop.is_set():
                return
            logger.exception("thread %s stopped", threading.current_thread().name)
            failed(f"thread {threading.current_thread().name}: {type(exc).__name__}: {exc}")

    return run
