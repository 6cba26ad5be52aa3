"""Live scaling of the worker pools: new replicas join, removed ones drain first.

The API server process owns the Ray driver and the router, so it is the one that scales:
``Scaler.scale`` starts new actors (placement as at start, services/launch/deployment.py) and adds
them to the router once placed, and removes the newest replicas of a shrinking pool by
draining them (no new requests; the ones they hold finish) before their actors are killed.
No request in flight fails because of a scale.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any

from splitserve.config import DeployConfig
from splitserve.services.api.admin import ScaleError, ScaleFailed
from splitserve.services.api.worker_pool import WorkerPool
from splitserve.services.api.worker_view import WorkerEndpoint
from splitserve.services.launch.deployment import Deployment, WorkerStartError

READY_TIMEOUT_S = 120.0
READY_POLL_S = 0.1


class Scaler:
    """The admin routes' PoolScaler (services/api/admin.py) for a Ray deployment."""

    def __init__(self, deployment: Deployment, client: WorkerPool) -> None:
        self.deployment = deployment
        self.client = client
        self._lock = asyncio.Lock()

    @property
    def config(self) -> DeployConfig:
        return self.deployment.config

    def pools(self) -> dict[str, dict[str, Any]]:
        """Per pool: its role and the ids of the workers that take requests."""
        return {
            name: {"role": pool.role, "workers": self.client.worker_ids(name)}
            for name, pool in self.config.pools.items()
        }

    def resolve(self, replicas: Mapping[str, int]) -> dict[str, int]:
        """Pool name -> replicas; a key may be a pool's name or its role (prefill, decode)."""
        by_role = {pool.role: name for name, pool in self.config.pools.items()}
        targets: dict[str, int] = {}
        for key, count in replicas.items():
            name = key if key in self.config.pools else by_role.get(key)
            if name is None:
                raise ScaleError(f"no pool or role named {key!r} (pools: {list(self.pools())})")
            if self.config.pools[name].expert_parallel > 1:
                raise ScaleError(f"{key}: live scaling of expert_parallel pools is not built")
            if not isinstance(count, int) or isinstance(count, bool) or count < 1:
                raise ScaleError(f"{key}: replicas must be an integer >= 1, got {count!r}")
            targets[name] = count
        return targets

    async def scale(self, replicas: Mapping[str, int]) -> dict[str, dict[str, Any]]:
        """Bring each named pool to its number of replicas; returns the pools afterwards."""
        targets = self.resolve(replicas)
        async with self._lock:
            current = {name: self.client.worker_ids(name) for name in targets}
            # The new replicas of every growing pool start side by side, as at deployment.
            growth = {n: t - len(current[n]) for n, t in targets.items() if t > len(current[n])}
            if growth:
                await self._grow(growth)
            for name, target in targets.items():
                for worker_id in reversed(current[name][target:]):
                    await self.client.drain(worker_id)
                    await asyncio.to_thread(self.deployment.remove_replica, worker_id)
        return self.pools()

    async def _grow(self, counts: Mapping[str, int]) -> None:
        try:
            infos = await asyncio.to_thread(self.deployment.add_replicas, counts)
        except WorkerStartError as exc:
            raise ScaleFailed(str(exc)) from exc
        for w in infos:
            endpoint = WorkerEndpoint(
                w["worker_id"], w["request_addr"], w["output_addr"], w["role"], w["kv_addr"]
            )
            self.client.add_worker(endpoint)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not self.client.ready and time.monotonic() < deadline:
            await asyncio.sleep(READY_POLL_S)
