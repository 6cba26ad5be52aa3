"""The load itself: Poisson arrivals, a concurrency cap, a progress bar, all results kept."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from tqdm import tqdm

from splitserve.bench.client import EndpointConfig, RequestResult, send


@dataclass(frozen=True)
class LoadConfig:
    """How requests are released: ``rate`` per second (inf = all at once), at most
    ``max_concurrency`` in flight (None = no cap)."""

    rate: float
    max_concurrency: int | None = None
    seed: int = 0
    progress: bool = True


@dataclass(frozen=True)
class LoadResult:
    results: list[RequestResult]
    duration: float


def send_times(n: int, rate: float, seed: int) -> list[float]:
    """Offsets in seconds at which the n requests are released.

    A Poisson process: exponential gaps with mean 1/rate from a seeded RNG, the first at 0.
    An infinite rate releases everything at once.
    """
    if rate <= 0:
        raise ValueError("--request-rate must be positive")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    times, t = [], 0.0
    for _ in range(n):
        times.append(t)
        t += rng.expovariate(rate)
    return times


async def run_load(
    endpoint: EndpointConfig,
    bodies: Sequence[dict[str, Any]],
    prompt_lens: Sequence[int | None],
    load: LoadConfig,
) -> LoadResult:
    """Send every body on its schedule and wait for all of them.

    A prompt length counted by the client's tokenizer replaces the server's usage count.
    """
    offsets = send_times(len(bodies), load.rate, load.seed)
    gate = asyncio.Semaphore(load.max_concurrency or len(bodies) or 1)
    limits = httpx.Limits(max_connections=load.max_concurrency, max_keepalive_connections=None)
    bar = tqdm(total=len(bodies), disable=not load.progress, unit="req")
    # trust_env=False: measure the server, never a proxy picked up from the environment.
    async with httpx.AsyncClient(limits=limits, trust_env=False) as client:
        t0 = time.perf_counter()

        async def one(i: int) -> RequestResult:
            await asyncio.sleep(max(0.0, t0 + offsets[i] - time.perf_counter()))
            async with gate:
                result = await send(client, endpoint, bodies[i], t0)
            bar.update(1)
            if prompt_lens[i] is not None:
                result = dataclasses.replace(result, prompt_tokens=prompt_lens[i])
            return result

        results = await asyncio.gather(*(one(i) for i in range(len(bodies))))
        duration = time.perf_counter() - t0
    bar.close()
    return LoadResult(list(results), duration)
