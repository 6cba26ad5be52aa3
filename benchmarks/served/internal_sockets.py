"""Cost of CurveZMQ on the internal sockets: sealed messages through a PUSH/PULL pair over TCP
on loopback, as a worker sends its outputs to the API server, with and without CURVE (same
keys, same gate as the service: splitserve/curve.py), in one process, alternating runs.

Messages: an OutputBatch of 32 one-token deltas (one decode step of 32 running requests, about
1.5 KB) and a GenerateRequest with a 2,048-token prompt (about 6 KB).

    .venv/bin/python -m benchmarks.served.internal_sockets [--seconds 2] [--out F]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from typing import Any

import zmq

from splitserve import curve
from splitserve.engine.sampling_params import SamplingParams
from splitserve.services import messages as msg
from splitserve.services.sealing import Sealer

SEALER = Sealer()


def output_batch() -> msg.Message:
    deltas = [
        msg.TokenDelta(f"cmpl-{i:032x}-0", " word", [1000 + i], None, None, None, 200, 0)
        for i in range(32)
    ]
    return msg.OutputBatch(deltas, [])


def generate_request() -> msg.Message:
    return msg.GenerateRequest("cmpl-0", list(range(1000, 3048)), SamplingParams(max_tokens=64))


def pair(secure: bool) -> tuple[zmq.Context, zmq.Socket, zmq.Socket, Callable[[], None]]:
    ctx = zmq.Context()
    keys = SEALER.curve_keys()
    gate = curve.Gate(ctx, keys) if secure else None
    push = ctx.socket(zmq.PUSH)
    pull = ctx.socket(zmq.PULL)
    if secure:
        curve.server(push, keys)
        curve.client(pull, keys)
    port = push.bind_to_random_port("tcp://127.0.0.1")
    pull.connect(f"tcp://127.0.0.1:{port}")
    push.send(SEALER.seal(msg.AbortRequest(["warm"])))
    pull.recv()

    def close() -> None:
        if gate is not None:
            gate.stop()
        ctx.destroy(linger=0)

    return ctx, push, pull, close


def rate(secure: bool, message: msg.Message, seconds: float) -> float:
    """Messages a second, sealed on one side and checked and decoded on the other, with at
    most 64 in flight (one thread: the cost of both ends on one core)."""
    _, push, pull, close = pair(secure)
    done = 0
    start = time.perf_counter()
    try:
        while time.perf_counter() - start < seconds:
            for _ in range(64):
                push.send(SEALER.seal(message))
            for _ in range(64):
                SEALER.unseal(pull.recv())
            done += 64
        return done / (time.perf_counter() - start)
    finally:
        close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    result: dict[str, Any] = {
        "commit": subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
        "machine": platform.processor() or platform.machine(),
        "seconds_per_run": args.seconds,
    }
    for name, message in (
        ("output_batch_32", output_batch()),
        ("generate_2048", generate_request()),
    ):
        runs: dict[str, list[float]] = {"plain": [], "curve": []}
        for _ in range(args.repeats):
            for secure in (False, True):
                runs["curve" if secure else "plain"].append(rate(secure, message, args.seconds))
        plain, secure_rate = statistics.median(runs["plain"]), statistics.median(runs["curve"])
        size = len(SEALER.seal(message))
        result[name] = {
            "bytes": size,
            "plain_msgs_per_s": round(plain),
            "curve_msgs_per_s": round(secure_rate),
            "curve_us_per_msg_extra": round(1e6 / secure_rate - 1e6 / plain, 2),
        }
    print(json.dumps(result))
    if args.out is not None:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
