"""The KV handoff off the loop's stream, on one CUDA GPU (gloo staged through host memory).

1. Ordering: a TensorSender -> TensorReceiver transfer (services/workers/channels.py, each
   thread on its own TransferStream) while the loop thread's stream runs a busy kernel of
   ``--busy-s`` queued after the tensor was written: when does the receiver hand the tensor
   over, and is the busy kernel still running then? Beside it, in the same run, the same
   transfer with both threads on the default stream (how channels.py ran before streams).
2. Poll period: a loop thread runs steps of ``--ops`` small torch operations (each releases
   and retakes the GIL, as an eager decode step's launches do) and a device sync, while one
   or four threads (transfers in flight) poll as KVTransport._poll does (a completion check,
   the clock, a sleep of the period). The median step time by setting, beside no poller,
   the checks per second actually reached and the CPU time the pollers took.

    python -m benchmarks.gpu.transfer_streams   # prints a table; JSON to $OUT
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import queue
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import zmq

from splitserve.kvstore.transfer import KVTransport, start_store
from splitserve.services import messages as msg
from splitserve.services.sealing import Sealer
from splitserve.services.workers.channels import (
    Outgoing,
    TensorReceiver,
    TensorSender,
    peer_name,
)
from splitserve.services.workers.slots import Slot

POLLERS = [(None, 0), (20e-6, 1), (20e-6, 4), (200e-6, 1), (200e-6, 4), (1e-3, 1)]
"""(poll period, polling threads: one per transfer in flight)."""
SHAPE = (2, 24, 16, 16, 8, 128)
"""48 MiB of float32 KV: two dozen layers of 16 blocks."""


def main() -> int:
    args = _parse()
    if not torch.cuda.is_available():
        print("gpu_transfer_streams needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    report: dict[str, Any] = {
        "commit": os.environ.get("SPLITSERVE_GIT_COMMIT", "unknown"),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "ordering": _ordering(device, args.busy_s),
        "poll": _poll_cost(device, args.ops, args.seconds, args.rounds),
    }
    print(json.dumps(report, indent=2))
    out = Path(os.environ.get("OUT", "."), "gpu_transfer_streams.json")
    out.write_text(json.dumps(report, indent=2))
    return 0 if report["ordering"]["side_streams"]["equal"] else 1


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--busy-s", type=float, default=1.0)
    parser.add_argument("--ops", type=int, default=300)
    parser.add_argument("--seconds", type=float, default=1.5)
    parser.add_argument("--rounds", type=int, default=5)
    return parser.parse_args()


def _sleep_cycles(device: torch.device, seconds: float) -> int:
    """The cycles of ``torch.cuda._sleep`` that keep a stream busy for about ``seconds``."""
    torch.cuda.synchronize(device)
    start = time.monotonic()
    torch.cuda._sleep(100_000_000)
    torch.cuda.synchronize(device)
    return int(100_000_000 / (time.monotonic() - start) * seconds)


def _ordering(device: torch.device, busy_s: float) -> dict[str, Any]:
    server, address = start_store("127.0.0.1")
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    addr = f"tcp://127.0.0.1:{inbox.bind_to_random_port('tcp://127.0.0.1')}"
    sending = KVTransport("p", address, device, "gloo", 60.0)
    # Named as a worker names itself (the sender's channels are to "d" at addr).
    receiving = KVTransport(peer_name("d", addr), address, device, "gloo", 60.0)
    stop = threading.Event()
    errors: queue.Queue[msg.RequestError] = queue.Queue()
    sealer = Sealer()
    sender = TensorSender("p", sending, ctx, sealer, stop, errors, print)
    receiver: TensorReceiver[msg.KvHeader] = TensorReceiver(
        receiving.worker_id, receiving, stop, print, "KV"
    )
    busy = _sleep_cycles(device, busy_s)
    try:
        for run in range(2):  # the channel and the allocator warm up; then the run
            side = _through_channels(device, sender, receiver, inbox, addr, busy, run, sealer)
            default = _on_default_stream(device, sending, receiving, busy)
    finally:
        stop.set()
        ctx.destroy(linger=0)
        del server
    return {"busy_s": busy_s, "mib": _mib(), "side_streams": side, "default_stream": default}


def _through_channels(
    device: torch.device,
    sender: TensorSender,
    receiver: TensorReceiver[msg.KvHeader],
    inbox: zmq.Socket,
    addr: str,
    busy: int,
    run: int,
    sealer: Sealer,
) -> dict[str, Any]:
    kv = torch.randn(SHAPE, device=device)

    def header(generation: int) -> msg.KvHeader:
        return msg.KvHeader(f"r{run}", "p", generation, 0, None, list(SHAPE), "float32")

    start = time.monotonic()
    sender.send("d", addr, Outgoing(f"r{run}", header, [kv], "KV"))
    torch.cuda._sleep(busy)  # the loop's next step, queued after the KV was written
    announced = sealer.unseal(inbox.recv())
    assert isinstance(announced, msg.KvHeader)
    receiver.on_header(announced, [announced.shape], [Slot(tuple(SHAPE), torch.float32)])
    while not (results := receiver.collect()):
        time.sleep(1e-4)
    arrived = time.monotonic() - start
    still_busy = not torch.cuda.current_stream(device).query()
    torch.cuda.synchronize(device)
    (result,) = results
    equal = result.error is None and torch.equal(result.tensors[0], kv)
    return {"arrived_s": arrived, "loop_stream_busy_then": still_busy, "equal": equal}


def _on_default_stream(
    device: torch.device, sending: KVTransport, receiving: KVTransport, busy: int
) -> dict[str, Any]:
    """The same transfer with the sending and receiving threads on the default stream."""
    kv = torch.randn(SHAPE, device=device)
    out = torch.empty(SHAPE, device=device)
    start = time.monotonic()
    torch.cuda._sleep(busy)
    threads = [
        threading.Thread(target=sending.send, args=(receiving.worker_id, 7, kv)),
        threading.Thread(target=receiving.recv, args=("p", 7, out)),
    ]
    for thread in threads:
        thread.start()
    threads[1].join()
    torch.cuda.current_stream(device).synchronize()
    arrived = time.monotonic() - start
    threads[0].join()
    return {"arrived_s": arrived, "equal": torch.equal(out, kv)}


def _mib() -> float:
    return torch.Size(SHAPE).numel() * 4 / (1 << 20)


def _poll_cost(device: torch.device, ops: int, seconds: float, rounds: int) -> list[Any]:
    x = torch.ones(1, 64, device=device)
    _steps(x, ops, 0.5)
    runs: dict[tuple[float | None, int], list[tuple[float, float, float]]] = {}
    for _ in range(rounds):  # interleaved, so that a drift of the machine hits every setting
        for setting in POLLERS:
            runs.setdefault(setting, []).append(_with_pollers(x, ops, seconds, *setting))
    base = statistics.median(step for step, _, _ in runs[(None, 0)])
    rows = []
    for (period, count), results in runs.items():
        step = statistics.median(r[0] for r in results)
        rows.append(
            {
                "period_us": None if period is None else period * 1e6,
                "pollers": count,
                "step_ms": step * 1e3,
                "step_ms_runs": [r[0] * 1e3 for r in results],
                "slowdown_pct": (step / base - 1) * 100,
                "polls_per_s": statistics.median(r[1] for r in results),
                "poller_cpu_pct": statistics.median(r[2] for r in results) * 100,
            }
        )
    return rows


def _with_pollers(
    x: torch.Tensor, ops: int, seconds: float, period: float | None, count: int
) -> tuple[float, float, float]:
    """(step seconds, checks per second of all pollers, their CPU seconds per second)."""
    stop = threading.Event()
    checks = [0] * count
    cpu = [0.0] * count
    event = torch.cuda.Event()
    event.record()

    def poll(index: int) -> None:
        start = time.thread_time()
        while not stop.is_set():
            event.query()
            time.monotonic()
            time.sleep(period or 0)
            checks[index] += 1
        cpu[index] = time.thread_time() - start

    threads = [threading.Thread(target=poll, args=(i,), daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()
    start = time.monotonic()
    step_s = _steps(x, ops, seconds)
    elapsed = time.monotonic() - start
    stop.set()
    for thread in threads:
        thread.join()
    return step_s, sum(checks) / elapsed, sum(cpu) / elapsed


def _steps(x: torch.Tensor, ops: int, seconds: float) -> float:
    """Mean seconds of a step of ``ops`` small operations and a sync, run for ``seconds``."""
    steps, start = 0, time.monotonic()
    while time.monotonic() - start < seconds:
        y = x
        for _ in range(ops):
            y = y * 1.0001
        y.sum().item()
        steps += 1
    return (time.monotonic() - start) / steps


if __name__ == "__main__":
    sys.exit(main())
