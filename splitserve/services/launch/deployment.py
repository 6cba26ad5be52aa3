"""`splitserve serve`: read the config, start Ray and the workers, serve HTTP until stopped.

The process layout: this process runs the API server (uvicorn, tokenizer, chat templates);
every worker replica is a Ray actor in its own process with one engine. Requests and tokens
move over ZMQ as msgpack messages (services/messages.py). SIGINT or SIGTERM stops uvicorn,
the workers and, when this process started it, Ray.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

from splitserve.config import ConfigError, DeployConfig, load_config

READY_TIMEOUT_S = 60.0
OBJECT_STORE_BYTES = 128 << 20
PLACEMENT_TIMEOUT_S = 60.0
MIN_BUNDLE_CPU = 0.01
NODE_HOST = "node"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, help="deployment YAML (default: local.yaml)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field by its dotted path, e.g. server.port=9000",
    )
    parser.add_argument("--host", default=None, help="shorthand for --set server.host=HOST")
    parser.add_argument("--port", type=int, default=None, help="shorthand for server.port")
    parser.add_argument(
        "--address",
        default=None,
        help='join this Ray cluster ("auto": the one running on this node) instead of '
        "starting a private one; shorthand for --set ray.address=ADDRESS",
    )


def run(args: argparse.Namespace) -> int:
    overrides = list(args.overrides)
    if args.host is not None:
        overrides.append(f"server.host={args.host}")
    if args.port is not None:
        overrides.append(f"server.port={args.port}")
    if args.address is not None:
        overrides.append(f"ray.address={args.address}")
    try:
        config = load_config(args.config, overrides)
    except ConfigError as exc:
        print(f"splitserve: config error: {exc}", file=sys.stderr)
        return 2
    deployment = Deployment(config)
    previous = _interrupt_on_signals()
    try:
        deployment.start()
        asyncio.run(_serve(deployment))
    except KeyboardInterrupt:
        pass
    except WorkerStartError as exc:
        print(f"splitserve: {exc}", file=sys.stderr)
        return 1
    finally:
        deployment.stop()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return 0


class WorkerStartError(RuntimeError):
    """A worker could not load its engine or did not come up."""


@dataclass(frozen=True)
class Replica:
    """One worker actor and the placement group that holds its resources."""

    worker_id: str
    pool: str
    actor: Any
    placement_group: Any


class Deployment:
    """Ray, the worker actors and the API server's tokenizer: everything but the HTTP loop."""

    def __init__(self, config: DeployConfig) -> None:
        self.config = config
        self.replicas: dict[str, Replica] = {}
        self.workers: list[dict[str, Any]] = []
        self.tokenizer: Any = None
        self._next_index: dict[str, int] = {}
        self._owns_ray = False
        self._store: Any = None
        self._store_addr: list[Any] | None = None

    @property
    def max_model_len(self) -> int:
        return min(info["max_model_len"] for info in self.workers if info["role"] != "vision")

    def start(self) -> None:
        with ThreadPoolExecutor(1) as pool:
            tokenizer = pool.submit(_load_tokenizer, self.config.model)
            self.start_ray()
            self.start_workers()
            self.tokenizer = tokenizer.result()

    def start_ray(self) -> None:
        """Start or join Ray. ray.init installs SIGTERM handlers of its own (a Python one that
        exits and a native one that aborts), so ours are put back right after it."""
        import ray

        if self.config.ray.address is not None:
            ray.init(address=self.config.ray.address, logging_level=logging.WARNING)
            _interrupt_on_signals()
            return
        needed = sum(p.num_cpus * p.replicas for p in self.config.pools.values())
        num_cpus = self.config.ray.num_cpus or max(os.cpu_count() or 1, int(needed + 0.999))
        ray.init(
            num_cpus=num_cpus,
            resources=self._pool_resources(),
            include_dashboard=False,
            object_store_memory=OBJECT_STORE_BYTES,
            logging_level=logging.WARNING,
        )
        self._owns_ray = True
        _interrupt_on_signals()

    def _pool_resources(self) -> dict[str, float]:
        """A private local Ray offers the pools' node labels itself, so one machine fits all."""
        total: dict[str, float] = {}
        for pool in self.config.pools.values():
            for key, value in pool.resources.items():
                total[key] = total.get(key, 0.0) + value * pool.replicas
        return total

    def start_workers(self) -> None:
        """Every pool's configured replicas (after start_ray)."""
        config = self.config
        if config.disaggregated:
            from splitserve.kvstore.transfer import start_store

            self._store, address = start_store(_driver_host(config.server.internal_host))
            self._store_addr = [address.host, address.port]
        for name, pool in config.pools.items():
            self.add_replicas(name, pool.replicas)

    def add_replicas(self, name: str, count: int) -> list[dict[str, Any]]:
        """Place and start ``count`` new replicas of pool ``name``; returns (and keeps) their
        WorkerInfo dicts."""
        import ray

        started = [self._place(name) for _ in range(count)]
        try:
            infos: list[dict[str, Any]] = ray.get([r.actor.start.remote() for r in started])
        except ray.exceptions.RayError as exc:
            for replica in started:
                self.remove_replica(replica.worker_id)
            raise WorkerStartError(f"a worker failed to start: {exc}") from exc
        for info in infos:
            print(f"splitserve worker {info['worker_id']} ({info['role']}) pid {info['pid']}")
        self.workers += infos
        return infos

    def _place(self, name: str) -> Replica:
        """One replica of pool ``name`` in a placement group of its own (one bundle: its CPUs,
        GPUs and the pool's custom resources), so that removing it frees exactly its share."""

        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from splitserve.services.workers.base import worker_class

        pool = self.config.pools[name]
        index = self._next_index.get(name, 0)
        self._next_index[name] = index + 1
        worker_id = f"{name}-{index}"
        bundle = pool.bundle() or {"CPU": MIN_BUNDLE_CPU}
        group = placement_group([bundle], strategy="PACK", name=f"ss-{worker_id}")
        try:
            ray.get(group.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError as exc:
            remove_placement_group(group)
            raise WorkerStartError(
                f"pool {name}: no room for {worker_id} ({bundle}) in the Ray cluster"
            ) from exc
        actor = (
            ray.remote(worker_class(pool.role))
            .options(
                name=f"splitserve-{worker_id}",
                num_cpus=pool.num_cpus,
                num_gpus=pool.num_gpus,
                resources=dict(pool.resources),
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, 0),
            )
            .remote(
                worker_id,
                dataclasses.asdict(_worker_engine_config(self.config, name)),
                _bundle_host(self.config.server.internal_host, group),
                pool.num_threads or os.cpu_count() or 1,
                dataclasses.asdict(self.config.transfer),
                self._store_addr,
                {
                    "prefix_index": dataclasses.asdict(self.config.prefix_index),
                    "kv_store": dataclasses.asdict(self.config.kv_store),
                    "images": dataclasses.asdict(self.config.images),
                },
            )
        )
        self.replicas[worker_id] = Replica(worker_id, name, actor, group)
        return self.replicas[worker_id]

    def remove_replica(self, worker_id: str) -> None:
        """Stop one worker, kill its actor and give its placement group back."""
        import ray
        from ray.util.placement_group import remove_placement_group

        replica = self.replicas.pop(worker_id)
        with suppress(ray.exceptions.RayError):
            ray.get(replica.actor.stop.remote(), timeout=10)
        ray.kill(replica.actor)
        with suppress(Exception):
            remove_placement_group(replica.placement_group)
        self.workers = [w for w in self.workers if w["worker_id"] != worker_id]

    def stop(self) -> None:
        """Stop the workers and Ray; safe to call after a partial start."""
        if not self.replicas and not self._owns_ray:
            return
        import ray

        for worker_id in list(self.replicas):
            self.remove_replica(worker_id)
        if self._owns_ray:
            ray.shutdown()
            self._owns_ray = False
        self._store = None


def _worker_engine_config(config: DeployConfig, pool: str) -> Any:
    """The pool's EngineConfig; a model path relative to this directory becomes absolute,
    since workers may start in another one (the API keeps the configured name)."""
    engine = config.engine_config(pool)
    if os.path.exists(engine.model):
        engine = dataclasses.replace(engine, model=os.path.abspath(engine.model))
    return engine


def _driver_host(host: str) -> str:
    """server.internal_host, where "node" means this node's address in the Ray cluster."""
    import ray

    return ray.util.get_node_ip_address() if host == NODE_HOST else host


def _bundle_host(host: str, group: Any) -> str:
    """Where a worker placed in ``group`` binds: server.internal_host, or with "node" the
    address of the node that holds the group's bundle (workers on other nodes reach it)."""
    if host != NODE_HOST:
        return host
    import ray
    from ray.util import placement_group_table

    node_id = placement_group_table(group)["bundles_to_node_id"][0]
    return next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id)


def _load_tokenizer(model: str) -> Any:
    from splitserve.engine.loader import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model(model))


async def _serve(deployment: Deployment) -> None:
    import uvicorn

    from splitserve.engine.loader import resolve_model
    from splitserve.engine.vision.config import load_vision_config
    from splitserve.kvstore.index import make_index
    from splitserve.router.prefix_lookup import PrefixLookup
    from splitserve.router.router import Router
    from splitserve.services.api.app import build_app
    from splitserve.services.api.client import WorkerClient
    from splitserve.services.api.serving import ServerState
    from splitserve.services.api.worker_view import WorkerEndpoint
    from splitserve.services.launch.scaling import Scaler
    from splitserve.services.metrics import Metrics

    config = deployment.config
    _log_requests_to_stdout()
    metrics = Metrics(config.model)
    endpoints = [
        WorkerEndpoint(w["worker_id"], w["request_addr"], w["output_addr"], w["role"], w["kv_addr"])
        for w in deployment.workers
    ]
    decode_pool = next(n for n, p in config.pools.items() if p.role in ("decode", "both"))
    block_size = config.pools[decode_pool].engine.block_size
    index = make_index(config.prefix_index.url, config.prefix_index.ttl_s)
    client = WorkerClient(
        endpoints,
        config.server.max_queue,
        metrics,
        router=Router(config.router.policy, config.router.policy),
        block_size=block_size,
        heartbeat_timeout_s=config.server.heartbeat_timeout_s,
        prefix=PrefixLookup(index, block_size),
    )
    client.start()
    state = ServerState(
        config,
        deployment.tokenizer,
        client,
        metrics,
        deployment.max_model_len,
        load_vision_config(resolve_model(config.model)),
    )
    server = uvicorn.Server(
        uvicorn.Config(
            build_app(state, Scaler(deployment, client)),
            host=config.server.host,
            port=config.server.port,
            log_level=config.server.log_level,
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=5,
        )
    )
    serving = asyncio.create_task(server.serve())
    try:
        await _announce_when_ready(server, client, serving, config)
        await serving
    finally:
        await client.close()


async def _announce_when_ready(
    server: Any, client: Any, serving: asyncio.Task[None], config: DeployConfig
) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not (server.started and client.ready):
        if serving.done():
            return
        if time.monotonic() > deadline:
            raise WorkerStartError("workers did not report in time")
        await asyncio.sleep(0.05)
    url = f"http://{config.server.host}:{config.server.port}"
    print(f"splitserve ready: {url} (model {config.model})", flush=True)


def _log_requests_to_stdout() -> None:
    """The structured request log (one JSON line per finished request) goes to stdout."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("splitserve request %(message)s"))
    logger = logging.getLogger("splitserve.requests")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def _interrupt_on_signals() -> dict[int, Any]:
    """Make SIGINT and SIGTERM raise KeyboardInterrupt, so one cleanup path handles both.

    uvicorn replaces these handlers while it serves and re-raises the signal after it has
    shut down, which lands here. Returns the handlers that were installed before.
    """

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    return {s: signal.signal(s, interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
