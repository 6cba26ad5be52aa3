"""A real DecodeWorker started in-process (its loop, ZMQ sockets and a gloo KVTransport,
without Ray), the test as its prefill worker "prefill-0" sending through the real
TensorSender, and the colocated engine that gives the KV to send and the tokens to expect."""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import zmq

from splitserve.config import TransferConfig
from splitserve.engine.config import EngineConfig
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.request import SamplingParams
from splitserve.kvstore.rendezvous import StoreAddress, start_store
from splitserve.kvstore.transfer import KVTransport
from splitserve.services import messages as msg
from splitserve.services.sealing import Sealer
from splitserve.services.workers.channels import Outgoing, TensorSender
from splitserve.services.workers.decode import DecodeWorker
from splitserve.services.workers.spec import WorkerSpec
from tests.support.worker_sockets import ApiEnd

_ids = itertools.count()


class PrefillEnd:
    """The test as prefill worker "prefill-0". delay_s: how long the sender holds a request's
    tensors back after its header (transfer.fault_send_delay_s)."""

    def __init__(
        self,
        store: StoreAddress,
        kv_addr: str,
        timeout_s: float,
        sealer: Sealer,
        delay_s: float = 0.0,
    ) -> None:
        self.ctx = zmq.Context()
        self.stop = threading.Event()
        self.errors: queue.Queue[msg.RequestError] = queue.Queue()
        self.thread_failures: list[str] = []
        self.generations: list[int] = []
        """The channel generation of each header sent, in order."""
        transport = KVTransport(
            "prefill-0", store, torch.device("cpu"), "gloo", timeout_s, key=sealer.store_key()
        )
        self.sender = TensorSender(
            "prefill-0",
            transport,
            self.ctx,
            sealer,
            self.stop,
            self.errors,
            self.thread_failures.append,
            delay_s=delay_s,
        )
        self.kv_addr = kv_addr

    def send(
        self,
        request_id: str,
        kv: torch.Tensor,
        first: int,
        shape: list[int] | None = None,
        dtype: str = "float32",
    ) -> None:
        """Announce ``shape`` (default: kv's) and ``dtype`` for request_id, then send kv."""
        announced = list(kv.shape) if shape is None else shape

        def header(generation: int) -> msg.KvHeader:
            self.generations.append(generation)
            return msg.KvHeader(request_id, "prefill-0", generation, first, None, announced, dtype)

        self.sender.send("decode-0", self.kv_addr, Outgoing(request_id, header, [kv], "KV"))

    def close(self) -> None:
        self.stop.set()
        self.ctx.destroy(linger=0)


@contextmanager
def decode_cluster(
    model: str, engine: dict[str, Any], timeout_s: float, delay_s: float = 0.0
) -> Iterator[tuple[DecodeWorker, ApiEnd, PrefillEnd]]:
    """Worker "decode-0" on ``model`` with the test as its API server and its prefill worker."""
    sealer = Sealer()
    server, address = start_store("127.0.0.1", sealer.store_key())
    spec = WorkerSpec(
        "decode-0",
        "decode",
        EngineConfig(model, **engine),
        threads=0,  # leave this process's torch thread count alone
        transfer=TransferConfig(backend="gloo", timeout_s=timeout_s),
        store=address,
        sealer=sealer,
    )
    worker = DecodeWorker(spec)
    info = worker.start()
    api = ApiEnd(info, spec.sealer)
    prefill = PrefillEnd(address, info["kv_addr"], timeout_s, spec.sealer, delay_s)
    try:
        yield worker, api, prefill
    finally:
        prefill.close()
        api.close()
        worker.stop()
        server.close()


def prompt(seed: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 5000 + 100 for i in range(40)]


def prefilled(
    engine: LLMEngine, ids: list[int], params: SamplingParams
) -> tuple[torch.Tensor, int]:
    """The prompt's KV and first token, as a prefill worker hands them over."""
    request_id = f"ref-{next(_ids)}"
    engine.add_request(request_id, ids, params, prefill_only=True)
    while engine.has_unfinished_requests():
        engine.step()
    done = engine.handoff.pop_prefilled(request_id)
    return done.kv.clone(), done.first_token


def colocated(engine: LLMEngine, ids: list[int], params: SamplingParams) -> list[int]:
    """The tokens the colocated engine writes for the prompt."""
    request_id = f"ref-{next(_ids)}"
    engine.add_request(request_id, ids, params)
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens = list(output.outputs[0].token_ids)
    return tokens


def reserve(
    api: ApiEnd, request_id: str, ids: list[int], params: SamplingParams, timeout_s: float
) -> None:
    api.send(msg.Reserve(request_id, ids, params, "prefill-0"))
    api.wait(f"Reserved {request_id}", lambda: api.reserved(request_id), timeout_s)
