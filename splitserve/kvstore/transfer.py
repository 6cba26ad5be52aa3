"""KV transport between workers: point-to-point channels over torch.distributed.

There is no fixed world of all workers. Each (sender, receiver) pair gets its own two-rank
process group, created on demand from a shared rendezvous store (kvstore/rendezvous.py, which
the service hosts) under a key naming the pair and a generation, so workers can come and go and
a broken channel is simply replaced by the next generation. The sender is rank 0, the
receiver rank 1.

Backends: ``nccl`` for CUDA tensors, ``gloo`` for CPU tensors, ``hccl`` for Ascend NPUs through
torch_npu (written to its documented API, untested here), ``auto`` picks by device.

Streams (CUDA): ``send`` and ``recv`` run on the calling thread's current stream, and NCCL queues
each one behind the work already on that stream. A thread that moves tensors for a worker's loop
therefore makes a ``TransferStream`` of its own current, so that a transfer never waits for the
compute the loop queued on its stream: the loop's tensors reach it through ``stream_mark``, and
the tensors it receives go back through ``use_on_current_stream``. Gloo on CPU has no streams,
and the NPU path has no side stream yet (its transfers run on the caller's current stream).
"""

from __future__ import annotations

import contextlib
import datetime
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from splitserve.kvstore.rendezvous import RendezvousClient, StoreAddress
from splitserve.kvstore.signed_store import SignedStore

SENDER, RECEIVER = 0, 1
POLL_S = 200e-6
"""The sleep between two completion checks of a device transfer (``KVTransport._poll``).

NOTE: every check takes the GIL, which the worker's loop thread gives up at each torch call and
then has to win back. On an H200 host (benchmarks/gpu/transfer_streams.py), a loop of eager
steps of 300 small kernels was not measurably slower beside one transfer polled every 20 µs
(12,500 checks a second), but its steps took 65% longer beside four at once (a decode worker
receiving from four prefill workers: 49,000 checks a second, 0.6 of a core); polled every
200 µs, four made them about 13% longer, one not measurably.
A prompt's KV takes milliseconds to move and is adopted only between decode steps, so seeing
its completion up to ~0.25 ms later delays nothing that matters."""


def pick_backend(backend: str, device: torch.device) -> str:
    if backend != "auto":
        return backend
    if device.type == "cuda":
        return "nccl"
    if device.type == "npu":
        return "hccl"
    return "gloo"


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """An FP8 tensor (an FP8 KV cache's blocks) as the uint8 view of its bytes: Gloo has no
    float8 types. Other tensors as they are."""
    fp8 = tensor.is_floating_point() and tensor.element_size() == 1
    return tensor.view(torch.uint8) if fp8 else tensor


class TransferError(RuntimeError):
    """A channel failed or timed out; the caller drops it and frees what it reserved."""


class TransferStream:
    """A CUDA stream of one transfer thread's own; off CUDA every method does nothing.

    On the loop thread's stream, a receive would start only after the decode step queued there
    (and its sender would wait for it), a send only after the prefill queued there."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    @contextlib.contextmanager
    def current(self) -> Iterator[None]:
        """Within the block, the calling thread's transfers and allocations use this stream."""
        if self.stream is None:
            yield
            return
        with torch.cuda.stream(self.stream):
            yield

    def wait(self, ready: torch.cuda.Event | None) -> None:
        """Queue what follows after the work that ``ready`` (``stream_mark``) marks."""
        if self.stream is not None and ready is not None:
            self.stream.wait_event(ready)

    def synchronize(self) -> None:
        """Block until its work is done: what it received is then complete for every stream."""
        if self.stream is not None:
            self.stream.synchronize()


def stream_mark(device: torch.device) -> torch.cuda.Event | None:
    """An event after the work queued so far on the calling thread's current stream (CUDA;
    None elsewhere): a transfer stream that waits for it sees the tensors that work wrote."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def use_on_current_stream(tensor: torch.Tensor) -> None:
    """A tensor allocated on a transfer stream is used on the calling thread's current stream
    from now on. The caching allocator gives a freed block back to the stream it was allocated
    on at once, so without this the transfer stream's next receive could reuse the memory while
    this stream's work still reads it."""
    if tensor.device.type == "cuda":
        tensor.record_stream(torch.cuda.current_stream(tensor.device))


@dataclass
class _Channel:
    """One (sender, receiver, generation) group, created once by whichever thread asks first."""

    lock: threading.Lock
    group: Any = None


class KVTransport:
    """This worker's channels to its peers; thread-safe, one process group per pair."""

    def __init__(
        self,
        worker_id: str,
        store: StoreAddress,
        device: torch.device,
        backend: str = "auto",
        timeout_s: float = 30.0,
        *,
        key: bytes,
    ) -> None:
        """key: the deployment's store key, which admits this transport to the rendezvous
        store (kvstore/rendezvous.py) and signs and checks every value it puts there
        (kvstore/signed_store.py)."""
        self.worker_id = worker_id
        self._key = key
        self.device = device
        self.backend = pick_backend(backend, device)
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._store_address = store
        # Fails early (here, not at the first transfer) when the rendezvous store is not there
        # or does not admit this key.
        self._connect_store().num_keys()
        self._groups: dict[tuple[str, str, int], _Channel] = {}
        self._lock = threading.Lock()
        self.bytes_sent = 0
        self.bytes_received = 0

    def send(self, peer: str, generation: int, tensor: torch.Tensor) -> None:
        """Send a contiguous tensor to peer (blocks until the peer has received it), after the
        work on the current stream (CUDA)."""
        group = self._group(self.worker_id, peer, generation, SENDER)
        staged = as_bytes(self._staged(tensor))
        self._wait(lambda: group.send([staged], RECEIVER, 0), peer)
        self.bytes_sent += tensor.numel() * tensor.element_size()

    def recv(self, peer: str, generation: int, out: torch.Tensor) -> None:
        """Receive into ``out`` (same shape and dtype as what the peer sends), after the work
        on the current stream (CUDA). On return the transfer is done; a device tensor staged
        through host memory (Gloo) may still be copying on the current stream."""
        group = self._group(peer, self.worker_id, generation, RECEIVER)
        staged = self.backend == "gloo" and out.device.type != "cpu"
        buffer = torch.empty(out.shape, dtype=out.dtype) if staged else out
        self._wait(lambda: group.recv([as_bytes(buffer)], SENDER, 0), peer)
        if buffer is not out:
            out.copy_(buffer)
        self.bytes_received += out.numel() * out.element_size()

    def drop(self, sender: str, receiver: str, generation: int) -> None:
        """Forget a broken channel; the next generation gets a fresh process group."""
        with self._lock:
            self._groups.pop((sender, receiver, generation), None)

    def _group(self, sender: str, receiver: str, generation: int, rank: int) -> Any:
        """The pair's process group, created on first use. Creating one waits for the other
        side to join, so only that channel's lock is held meanwhile: with one lock for all,
        two workers that each send to the other (prefill workers pulling prefixes from each
        other) would each wait, lock held, for a partner blocked on its own lock."""
        key = (sender, receiver, generation)
        with self._lock:
            channel = self._groups.setdefault(key, _Channel(threading.Lock()))
        with channel.lock:
            if channel.group is None:
                # A store connection of the channel's own: a client serializes its calls, so
                # two channels forming at once through one client deadlock (one waits for its
                # partner's key, lock held, while the other cannot publish its own) until the
                # timeout.
                store = self._connect_store()
                name = f"kv/{sender}->{receiver}/{generation}"
                try:
                    channel.group = self._new_group(SignedStore(store, self._key, name), rank)
                except RuntimeError as exc:
                    with self._lock:
                        if self._groups.get(key) is channel:
                            del self._groups[key]
                    raise TransferError(f"cannot connect {sender}->{receiver}: {exc}") from exc
            return channel.group

    def _connect_store(self) -> RendezvousClient:
        return RendezvousClient(self._store_address, self._key, self.timeout)

    def _new_group(self, store: Any, rank: int) -> Any:
        return new_group(self.backend, store, rank, 2, self.timeout)

    def _staged(self, tensor: torch.Tensor) -> torch.Tensor:
        """Gloo moves CPU tensors: stage device tensors through host memory."""
        if self.backend == "gloo" and tensor.device.type != "cpu":
            return tensor.cpu()
        return tensor

    def _wait(self, start: Callable[[], Any], peer: str) -> None:
        """Start a transfer and wait for it; TransferError if either fails (gloo raises at
        the start when the peer's connection is already closed: a peer that died)."""
        try:
            work = start()
            if self.backend != "gloo":
                self._poll(work, peer)
            work.wait(self.timeout)
        except RuntimeError as exc:
            raise TransferError(f"transfer with {peer} failed: {exc}") from exc

    def _poll(self, work: Any, peer: str) -> None:
        """Poll the device work's completion: NCCL's blocking wait with a timeout sleeps in
        1 ms steps, a millisecond lost per transfer. ``POLL_S`` says why not more often."""
        deadline = time.monotonic() + self.timeout.total_seconds()
        while not work.is_completed():
            if time.monotonic() > deadline:
                raise TransferError(f"transfer with {peer} timed out")
            time.sleep(POLL_S)


def new_group(backend: str, store: Any, rank: int, size: int, timeout: datetime.timedelta) -> Any:
    """A process group of ``size`` ranks over ``store`` (a scoped store: the group's own keys);
    blocks until every rank has joined or ``timeout`` has passed (RuntimeError)."""
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    if backend == "hccl":
        import torch_npu

        hccl = torch_npu._C._distributed_c10d.ProcessGroupHCCL
        options = hccl.Options()
        options._timeout = timeout
        return hccl(store, rank, size, options)
    raise ValueError(f"unknown KV transport backend {backend!r}")


def collective_group(
    address: StoreAddress,
    name: str,
    rank: int,
    size: int,
    device: torch.device,
    backend: str = "auto",
    timeout_s: float = 30.0,
    *,
    key: bytes,
) -> Any:
    """The process group ``name`` of ``size`` processes, formed through the rendezvous store
    at ``address`` when each of them calls this with its rank (an expert-parallel group:
    engine/layers/expert_placement.py). ``key`` signs the rendezvous values as KVTransport's
    do."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = RendezvousClient(address, key, timeout)
    try:
        scoped = SignedStore(store, key, name)
        return new_group(pick_backend(backend, device), scoped, rank, size, timeout)
    except RuntimeError as exc:
        raise TransferError(
            f"cannot form the group {name} as rank {rank} of {size}: {exc}"
        ) from exc
