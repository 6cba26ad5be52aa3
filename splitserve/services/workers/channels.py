"""A prefill worker's receiving end for image embeddings from vision workers (and, with
``ndim=6``, for prefix blocks from peer prefill workers: services/workers/peer_blocks.py).

An EmbeddingsHeader (PeerBlocks) arrives on the worker's embeddings socket (read by the loop
thread); the tensor follows on the KV transport from that sender. One receiver thread per vision
worker runs the transport's recv in header order (the order the sender used) and hands the
filled buffer back to the loop thread through ``collect``.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass

import torch

from splitserve.kvstore.transfer import KVTransport, TransferError
from splitserve.services import messages as msg

QUEUE_POLL_S = 0.1
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MAX_ELEMENTS = 1 << 28
"""A header announcing more than this (1 GiB of float32) is refused, not allocated."""


@dataclass(frozen=True)
class Arrived:
    """A request's embeddings (all its images, in prompt order), or why they did not come."""

    request_id: str
    embeddings: torch.Tensor | None
    error: str | None


Header = msg.EmbeddingsHeader | msg.PeerBlocks


class EmbeddingInbox:
    """ndim: the rank a header's shape must have (embeddings [tokens, hidden]: 2)."""

    def __init__(
        self, worker_id: str, transport: KVTransport, stop: threading.Event, ndim: int = 2
    ) -> None:
        self.worker_id = worker_id
        self.transport = transport
        self.ndim = ndim
        self._stop = stop
        self._peers: dict[str, queue.Queue[tuple[Header, torch.Tensor]]] = {}
        self._arrived: queue.Queue[Arrived] = queue.Queue()

    def on_header(self, header: Header) -> None:
        """Queue the receive of the announced tensor (loop thread)."""
        dtype = DTYPES.get(header.dtype)
        numel = 1
        for size in header.shape:
            numel *= max(size, 0)
        if dtype is None or len(header.shape) != self.ndim or numel > MAX_ELEMENTS:
            # The sender will still send: receive into nothing useful is impossible, so the
            # channel is dropped (the sender's next request opens a new generation).
            self.transport.drop(header.sender, self.worker_id, header.generation)
            error = f"malformed {type(header).__name__} from {header.sender}"
            self._arrived.put(Arrived(header.request_id, None, error))
            return
        buffer = torch.empty(header.shape, dtype=dtype, device=self.transport.device)
        self._peer_queue(header.sender).put((header, buffer))

    def collect(self) -> list[Arrived]:
        """Everything that arrived (or failed) since the last call (loop thread)."""
        arrived = []
        while not self._arrived.empty():
            arrived.append(self._arrived.get_nowait())
        return arrived

    def _peer_queue(self, peer: str) -> queue.Queue[tuple[Header, torch.Tensor]]:
        if peer not in self._peers:
            self._peers[peer] = queue.Queue()
            threading.Thread(
                target=self._receive_loop, args=(peer,), name=f"emb-recv-{peer}", daemon=True
            ).start()
        return self._peers[peer]

    def _receive_loop(self, peer: str) -> None:
        inbox = self._peers[peer]
        while not self._stop.is_set():
            try:
                header, buffer = inbox.get(timeout=QUEUE_POLL_S)
            except queue.Empty:
                continue
            try:
                self.transport.recv(peer, header.generation, buffer)
            except TransferError as exc:
                self.transport.drop(peer, self.worker_id, header.generation)
                error = f"image embeddings from {peer} did not arrive: {exc}"
                self._arrived.put(Arrived(header.request_id, None, error))
                continue
            self._arrived.put(Arrived(header.request_id, buffer, None))
