"""Pulling a prompt's cached prefix from another prefill worker over the KV transport.

The router names a peer in a Prefill (``PeerPrefix``) when another live prefill worker holds
more of the prompt's leading blocks, by the prefix index, than the chosen worker and its
node's store do. The chosen worker B then asks that peer A for the blocks it lacks:

```
B (requester)                                   A (peer)
  FetchBlocks(id, B, B's kv addr, hashes) --->  request socket, loop thread: gather_prefix
                                                (device cache first, then its block store)
  <--- PeerBlocks(id, A, generation, n, shape)  to B's kv address (ZMQ PUSH)
  <=== the n blocks as one tensor on channel (A, B, generation)
  stage them; start the prompt: the engine's prefix loader takes them (tier "remote") after
  B's own device cache and block store, registers them, and computes only the rest.
```

The index may be stale and the peer may have evicted blocks since: A sends the leading blocks
it still has (n may be fewer than asked, or 0). Anything else that goes wrong (a malformed or
mismatched answer, a broken channel, a peer that never answers) is a miss too, and the prompt
is computed in full; a request never fails for it. B waits at most ``PEER_WAIT_FRACTION`` of
``transfer.timeout_s``: the decode worker holds its reservation for ``timeout_s`` from Reserve,
which must still cover the compute and the handoff. An answer that comes later is still
received (into room for what was asked, channels.py), so that the channel stays in step; one
that comes more than ``timeout_s`` after the question is refused.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import zmq

from splitserve.kvstore.hashing import block_hashes
from splitserve.kvstore.store import BlockStore
from splitserve.kvstore.transfer import KVTransport
from splitserve.services import messages as msg
from splitserve.services.sealing import Sealer
from splitserve.services.workers.channels import TensorReceiver, push_socket
from splitserve.services.workers.slots import Slot

if TYPE_CHECKING:
    from splitserve.engine.llm_engine import LLMEngine

REMOTE_TIER = "remote"
"""The hit tier of blocks pulled from a peer (metrics, engine stats); not an index tier."""
PEER_WAIT_FRACTION = 0.25
MAX_FETCH_BLOCKS = 4096
"""A FetchBlocks asking for more is answered with at most this many blocks."""


class StagedBlocks:
    """The engine's block cache: the worker's block store, then blocks pulled from peers for
    the prompts about to start. Only the worker's loop thread uses it."""

    def __init__(self, store: BlockStore) -> None:
        self.store = store
        self._blocks: dict[int, torch.Tensor] = {}
        self._refs: Counter[int] = Counter()
        self._owned: dict[str, list[int]] = {}

    def put(self, block_hash: int, kv: torch.Tensor, traffic_class: str | None = None) -> None:
        self.store.put(block_hash, kv, traffic_class)

    def max_blocks(self, block_bytes: int) -> int | None:
        return self.store.max_blocks(block_bytes)

    def load_prefix(self, block_hashes: Sequence[int]) -> list[tuple[torch.Tensor, str]]:
        """The leading blocks found in the store or, failing that, among the staged ones."""
        found: list[tuple[torch.Tensor, str]] = []
        for block_hash in block_hashes:
            hit = self.store.get(block_hash)
            if hit is None:
                staged = self._blocks.get(block_hash)
                if staged is None:
                    break
                hit = (staged, REMOTE_TIER)
            found.append(hit)
        return found

    def stage(self, request_id: str, hashes: Sequence[int], kv: torch.Tensor) -> None:
        """Keep block i of kv [parts, layers, n, block, heads, dim] under hashes[i] till release."""
        self.release(request_id)
        self._owned[request_id] = list(hashes)
        for i, block_hash in enumerate(hashes):
            self._blocks[block_hash] = kv[:, :, i]
            self._refs[block_hash] += 1

    def release(self, request_id: str) -> None:
        """The prompt started and finished (or went away): its staged blocks are not needed."""
        for block_hash in self._owned.pop(request_id, []):
            self._refs[block_hash] -= 1
            if self._refs[block_hash] <= 0:
                del self._refs[block_hash]
                self._blocks.pop(block_hash, None)

    def __len__(self) -> int:
        return len(self._blocks)


def gather_prefix(
    engine: LLMEngine, store: BlockStore | None, hashes: Sequence[int]
) -> torch.Tensor | None:
    """The peer's side: the leading blocks of ``hashes`` held in the device cache or the block
    store, as one tensor [parts, layers, n, block, heads, dim]; None when not even the first is."""
    cached = engine.block_manager.cached
    sources: list[int | torch.Tensor] = []
    for block_hash in hashes[:MAX_FETCH_BLOCKS]:
        block_id = cached.get(block_hash)
        if block_id is not None:
            sources.append(block_id)
            continue
        hit = store.get(block_hash) if store is not None else None
        if hit is None:
            break
        sources.append(hit[0])
    if not sources:
        return None
    runner = engine.runner
    device_ids = [s for s in sources if isinstance(s, int)]
    device = iter(runner.gather_blocks(device_ids).unbind(2) if device_ids else ())
    blocks = [
        next(device) if isinstance(s, int) else s.to(runner.device, runner.kv_dtype)
        for s in sources
    ]
    return torch.stack(blocks, dim=2)


@dataclass(frozen=True)
class _Fetch:
    prefill: msg.Prefill
    block_hashes: list[int]
    deadline: float


@dataclass(frozen=True)
class _Asked:
    blocks: int
    until: float
    """When an answer is no longer expected (its header is refused after that)."""


class PeerFetches:
    """The requester's side: prompts that wait for a peer's blocks (loop thread), received
    by a receiver thread per peer in the order of their headers. ``failed``: told when a
    receiver thread stops on an unexpected error (base.Worker)."""

    def __init__(
        self,
        worker_id: str,
        reply_addr: str,
        ctx: zmq.Context,
        sealer: Sealer,
        transport: KVTransport,
        staged: StagedBlocks,
        engine: LLMEngine,
        stop: threading.Event,
        failed: Callable[[str], None],
    ) -> None:
        self.worker_id = worker_id
        self.reply_addr = reply_addr
        self.staged = staged
        self.engine = engine
        self.timeout_s = transport.timeout.total_seconds()
        self.wait_s = self.timeout_s * PEER_WAIT_FRACTION
        self.receiver: TensorReceiver[msg.PeerBlocks] = TensorReceiver(
            transport.worker_id, transport, stop, failed, "prefix blocks"
        )
        self._ctx = ctx
        self._sealer = sealer
        self._sockets: dict[str, zmq.Socket] = {}
        self._waiting: dict[str, _Fetch] = {}
        self._asked: dict[str, _Asked] = {}
        self._missed: list[str] = []

    def __bool__(self) -> bool:
        return bool(self._waiting)

    def request(self, prefill: msg.Prefill) -> bool:
        """Ask prefill's peer for the prompt's blocks that this device cache lacks; False when
        there is nothing to ask for (the prompt starts now)."""
        peer = prefill.peer
        if peer is None or prefill.images or peer.worker_id == self.worker_id:
            return False
        block_size = self.engine.block_manager.block_size
        usable = (len(prefill.prompt_token_ids) - 1) // block_size
        root = self.engine.block_manager.root
        hashes = block_hashes(prefill.prompt_token_ids, block_size, root)[
            : min(peer.blocks, usable)
        ]
        cached = self.engine.block_manager.cached
        start = 0
        while start < len(hashes) and hashes[start] in cached:
            start += 1
        wanted = hashes[start:]
        if not wanted:
            return False
        ask = msg.FetchBlocks(prefill.request_id, self.worker_id, self.reply_addr, wanted)
        self._socket(peer.request_addr).send(self._sealer.seal(ask))
        now = time.monotonic()
        self._waiting[prefill.request_id] = _Fetch(prefill, wanted, now + self.wait_s)
        self._asked[prefill.request_id] = _Asked(len(wanted), now + self.timeout_s)
        return True

    def on_header(self, header: msg.PeerBlocks) -> None:
        """A peer's answer: nothing follows for 0 blocks; otherwise the tensor is received,
        at most the blocks asked for in this engine's layout and dtype, even for a prompt that
        stopped waiting, so that the channel stays in step."""
        asked = self._asked.pop(header.request_id, None)
        if header.blocks == 0:
            if header.request_id in self._waiting:
                self._missed.append(header.request_id)
            return
        slots = None
        if asked is not None:
            runner = self.engine.runner
            slots = [Slot(runner.kv_shape(asked.blocks), runner.kv_dtype, free=2)]
        self.receiver.on_header(header, [header.shape], slots)

    def ready(self) -> list[msg.Prefill]:
        """The prompts that may start: their blocks are staged, or their peer missed."""
        done: list[tuple[str, torch.Tensor | None]] = [(r, None) for r in self._missed]
        self._missed = []
        done += [
            (r.header.request_id, next(iter(r.tensors), None)) for r in self.receiver.collect()
        ]
        now = time.monotonic()
        done += [(r, None) for r, fetch in self._waiting.items() if now > fetch.deadline]
        self._asked = {r: asked for r, asked in self._asked.items() if now <= asked.until}
        started = []
        for request_id, kv in done:
            fetch = self._waiting.pop(request_id, None)
            if fetch is None:
                continue
            if kv is not None:
                self.staged.stage(request_id, fetch.block_hashes[: kv.shape[2]], kv)
            started.append(fetch.prefill)
        return started

    def waiting(self) -> list[str]:
        """The prompts that wait for their peer's blocks."""
        return list(self._waiting)

    def discard(self, request_id: str) -> None:
        """The prompt is done or aborted: forget its wait and its staged blocks."""
        self._waiting.pop(request_id, None)
        self.staged.release(request_id)

    def _socket(self, addr: str) -> zmq.Socket:
        if addr not in self._sockets:
            self._sockets[addr] = push_socket(self._ctx, addr, self._sealer)
        return self._sockets[addr]


def peer_header(
    request_id: str, sender: str, kv: torch.Tensor | None
) -> Callable[[int], msg.PeerBlocks]:
    """The PeerBlocks that announces kv (None: no blocks) on a channel generation."""

    def header(generation: int) -> msg.PeerBlocks:
        if kv is None:
            return msg.PeerBlocks(request_id, sender, generation, 0, [], "")
        dtype = str(kv.dtype).removeprefix("torch.")
        return msg.PeerBlocks(request_id, sender, generation, kv.shape[2], list(kv.shape), dtype)

    return header
