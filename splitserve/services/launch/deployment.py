"""Deployment: Ray (started privately or joined) and one placement group and actor per worker
replica, placed as the config's pools ask (docs/deployment.md)."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from splitserve.config import DeployConfig, PoolConfig
from splitserve.services.sealing import Sealer

if TYPE_CHECKING:
    from splitserve.kvstore.rendezvous import StoreAddress

OBJECT_STORE_BYTES = 128 << 20
PROGRESS_S = 10.0
"""How often a replica waiting for room in the cluster says so in the log."""
MIN_BUNDLE_CPU = 0.01
NODE_HOST = "node"


class WorkerStartError(RuntimeError):
    """A worker could not load its engine or did not come up."""


@dataclass(frozen=True)
class Replica:
    """One worker actor and the placement group that holds its resources. group: the
    replica's id, which the ranks of an expert-parallel group share (else the worker's)."""

    worker_id: str
    pool: str
    actor: Any
    placement_group: Any
    group: str


class Deployment:
    """Ray, the worker actors and the API server's tokenizer: everything but the HTTP loop."""

    def __init__(self, config: DeployConfig) -> None:
        self.config = config
        self.replicas: dict[str, Replica] = {}
        self.workers: list[dict[str, Any]] = []
        self.tokenizer: Any = None
        self._next_index: dict[str, int] = {}
        self.generations: dict[str, int] = {}
        """Expert-parallel group -> its current start (a restart starts every rank anew)."""
        self._store: Any = None
        self._store_addr: StoreAddress | None = None
        self.sealer = Sealer()
        """This deployment's secret: every internal message is sealed with it."""

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
        """Start or join Ray. ray.init installs SIGINT/SIGTERM handlers of its own (a Python one
        that exits and a native one that aborts); the caller's are put back right after it."""
        import ray

        handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        if self.config.ray.address is not None:
            ray.init(address=self.config.ray.address, logging_level=logging.WARNING)
        else:
            pools = self.config.pools.values()
            needed = math.ceil(sum(p.num_cpus * p.replicas * p.expert_parallel for p in pools))
            # "local": always a new instance, never a cluster that `ray start` left running here.
            ray.init(
                address="local",
                num_cpus=self.config.ray.num_cpus or max(os.cpu_count() or 1, needed),
                resources=local_label_totals(self.config.pools),
                include_dashboard=False,
                object_store_memory=OBJECT_STORE_BYTES,
                logging_level=logging.WARNING,
            )
        for signum, handler in handlers.items():
            if handler is not None:
                signal.signal(signum, handler)

    def start_workers(self) -> None:
        """Every pool's configured replicas (after start_ray)."""
        config = self.config
        groups = any(p.expert_parallel > 1 for p in config.pools.values())
        if config.disaggregated or groups:  # the KV transport's and the groups' rendezvous
            from splitserve.kvstore.rendezvous import start_store

            self._store, self._store_addr = start_store(
                _driver_host(config.server.internal_host), self.sealer.store_key()
            )
        # Every pool's replicas are placed first and started together: their processes load
        # their engines side by side instead of one pool after the other.
        placed = [self._place(n) for n, p in config.pools.items() for _ in range(p.replicas)]
        self._start([replica for ranks in placed for replica in ranks])

    def add_replicas(self, counts: Mapping[str, int]) -> list[dict[str, Any]]:
        """Place and start ``counts[name]`` new replicas of each pool, all started together;
        returns (and keeps) their WorkerInfo dicts."""
        placed = [self._place(n) for n, count in counts.items() for _ in range(count)]
        return self._start([replica for ranks in placed for replica in ranks])

    def _start(self, started: list[Replica]) -> list[dict[str, Any]]:
        """Start placed replicas and wait for all of them; on a failure, remove them all."""
        import ray

        try:
            calls = [r.actor.start.remote(self.generations.get(r.group, 0)) for r in started]
            infos: list[dict[str, Any]] = ray.get(calls)
        except ray.exceptions.RayError as exc:
            for replica in started:
                self.remove_replica(replica.worker_id)
            raise WorkerStartError(f"a worker failed to start: {exc}") from exc
        for info in infos:
            print(f"splitserve worker {info['worker_id']} ({info['role']}) pid {info['pid']}")
        self.workers += infos
        return infos

    def _place(self, name: str) -> list[Replica]:
        """One replica of pool ``name`` in a placement group of its own (one bundle: its CPUs,
        GPUs and the pool's custom resources), so that removing it frees exactly its share.
        A replica of an ``expert_parallel: N`` pool is a group of N rank workers, one bundle
        each, in one placement group (ranks numbered node by node)."""
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        pool = self.config.pools[name]
        index = self._next_index.get(name, 0)
        self._next_index[name] = index + 1
        replica_id = f"{name}-{index}"
        bundle = pool.bundle() or {"CPU": MIN_BUNDLE_CPU}
        size = pool.expert_parallel
        # PACK: the ranks of a group fill a node before the next (its all-to-all stays local).
        group = placement_group([bundle] * size, strategy="PACK", name=f"ss-{replica_id}")
        placed = group.ready()

        def ready(seconds: float) -> bool:
            try:
                ray.get(placed, timeout=seconds)
            except ray.exceptions.GetTimeoutError:
                return False
            return True

        timeout_s = self.config.ray.placement_timeout_s
        what = f"{replica_id} ({size} x {bundle})" if size > 1 else f"{replica_id} ({bundle})"
        if not wait_placed(ready, timeout_s, what):
            remove_placement_group(group)
            raise WorkerStartError(
                f"pool {name}: no room for {what} in the Ray cluster after "
                f"{timeout_s:g} s (ray.placement_timeout_s)"
            )
        if size == 1:
            return [self._actor(name, replica_id, group, 0, None)]
        from splitserve.services.workers.spec import ExpertGroup

        return [
            self._actor(name, f"{replica_id}.{rank}", group, b, ExpertGroup(replica_id, rank, size))
            for rank, b in enumerate(bundles_by_node(_bundle_nodes(group)))
        ]

    def _actor(
        self, name: str, worker_id: str, group: Any, bundle: int, expert_group: Any
    ) -> Replica:
        """The worker actor of ``worker_id`` on bundle ``bundle`` of the placement group."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from splitserve.services.workers.roles import worker_class
        from splitserve.services.workers.spec import WorkerSpec

        pool = self.config.pools[name]
        caches = pool.role in ("prefill", "both")  # the engines that load and publish prefixes
        actor = (
            ray.remote(worker_class(pool.role))
            .options(
                name=f"splitserve-{worker_id}",
                max_restarts=self.config.ray.max_restarts,
                max_concurrency=2,  # start / stop beside wait_stopped (launch/supervisor.py)
                num_cpus=pool.num_cpus,
                num_gpus=pool.num_gpus,
                resources=dict(pool.resources),
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, bundle),
            )
            .remote(
                WorkerSpec(
                    worker_id=worker_id,
                    role=pool.role,
                    engine=_worker_engine_config(self.config, name),
                    bind_host=_bundle_host(self.config.server.internal_host, group, bundle),
                    threads=pool.num_threads or os.cpu_count() or 1,
                    transfer=self.config.transfer,
                    store=self._store_addr,
                    prefix_index=self.config.prefix_index if caches else None,
                    kv_store=self.config.kv_store if caches else None,
                    images=self.config.images,
                    sealer=self.sealer,
                    expert_group=expert_group,
                    max_body_bytes=self.config.server.max_body_bytes,
                )
            )
        )
        replica_id = expert_group.name if expert_group is not None else worker_id
        self.replicas[worker_id] = Replica(worker_id, name, actor, group, replica_id)
        return self.replicas[worker_id]

    def group_of(self, worker_id: str) -> list[str]:
        """The workers of ``worker_id``'s expert-parallel group in rank order (just itself
        for a replica of one worker)."""
        group = self.replicas[worker_id].group
        return [w for w, r in self.replicas.items() if r.group == group]

    def next_generation(self, worker_id: str) -> int:
        """Count a new start of ``worker_id``'s group; its ranks start with the number."""
        group = self.replicas[worker_id].group
        self.generations[group] = self.generations.get(group, 0) + 1
        return self.generations[group]

    def restarted(self, info: dict[str, Any]) -> None:
        """A replica's actor was restarted and started again: its new WorkerInfo."""
        others = [w for w in self.workers if w["worker_id"] != info["worker_id"]]
        self.workers = [*others, info]

    def remove_replica(self, worker_id: str) -> None:
        """Stop one worker, kill its actor and give its placement group back; for a rank of an
        expert-parallel group, the whole group (its ranks share the placement group)."""
        import ray
        from ray.util.placement_group import remove_placement_group

        group = self.replicas[worker_id].placement_group
        members = [self.replicas[w] for w in self.group_of(worker_id)]
        for replica in members:
            del self.replicas[replica.worker_id]
            with suppress(ray.exceptions.RayError):
                ray.get(replica.actor.stop.remote(), timeout=10)
            ray.kill(replica.actor)
        with suppress(Exception):
            remove_placement_group(group)
        gone = {r.worker_id for r in members}
        self.workers = [w for w in self.workers if w["worker_id"] not in gone]

    def stop(self) -> None:
        """Stop the workers, and Ray when this process started it (a joined cluster only loses
        this driver); safe to call after a partial start."""
        if not self.replicas and "ray" not in sys.modules:
            return
        import ray

        for worker_id in list(self.replicas):
            if worker_id in self.replicas:  # not gone with its group
                self.remove_replica(worker_id)
        # A joined cluster is left running, but this driver disconnects here too: left to
        # Ray's exit hook, its shutdown met the server's other threads at interpreter exit
        # and the process aborted (SIGABRT) after a clean stop.
        if ray.is_initialized():
            ray.shutdown()
        if self._store is not None:
            self._store.close()
            self._store = None


def local_label_totals(pools: Mapping[str, PoolConfig]) -> dict[str, float]:
    """The node labels a private local Ray offers, so that one machine holds every pool.

    ray.init takes only whole quantities, while a pool may ask a fraction of a label per
    replica (`prefill_node: 0.001`: on a cluster, any number of its replicas fit on a node
    labelled with one unit). Each label's total is its replicas' whole demand rounded up to a
    whole number (to Ray's 0.0001 granularity first, so float error adds no unit).
    """
    demand: dict[str, float] = {}
    for pool in pools.values():
        for label, amount in pool.resources.items():
            demand[label] = demand.get(label, 0.0) + amount * pool.replicas * pool.expert_parallel
    return {label: float(math.ceil(round(total, 4))) for label, total in demand.items()}


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


def wait_placed(
    ready: Callable[[float], bool],
    timeout_s: float,
    what: str,
    progress_s: float = PROGRESS_S,
    clock: Callable[[], float] = time.monotonic,
) -> bool:
    """Wait up to ``timeout_s`` for a placement (``ready(seconds)``: True once placed, after
    waiting at most that long), saying every ``progress_s`` in the log what it waits for: on a
    cluster that is scaling up, nodes can take minutes to join."""
    start = clock()
    while True:
        left = timeout_s - (clock() - start)
        if left <= 0:
            return False
        if ready(min(progress_s, left)):
            return True
        waited = clock() - start
        if waited < timeout_s:
            print(
                f"splitserve: waiting for room for {what} in the Ray cluster: "
                f"{waited:.0f} s of {timeout_s:g} s",
                flush=True,
            )


def _bundle_nodes(group: Any) -> list[str]:
    """The node id of each bundle of a placed placement group."""
    from ray.util import placement_group_table

    nodes = placement_group_table(group)["bundles_to_node_id"]
    return [nodes[i] for i in range(len(nodes))]


def bundles_by_node(nodes: list[str]) -> list[int]:
    """Bundle indices in rank order: the bundles of one node together, nodes in the order of
    their first bundle, so that a group's consecutive ranks share a node (EPLB packs experts
    within nodes first: splitserve/eplb/)."""
    first = {node: nodes.index(node) for node in nodes}
    return sorted(range(len(nodes)), key=lambda i: (first[nodes[i]], i))


def _bundle_host(host: str, group: Any, bundle: int = 0) -> str:
    """Where a worker placed on bundle ``bundle`` of ``group`` binds: server.internal_host, or
    with "node" the address of the node that holds that bundle (workers on other nodes reach
    it)."""
    if host != NODE_HOST:
        return host
    import ray

    node_id = _bundle_nodes(group)[bundle]
    return next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id)


def _load_tokenizer(model: str) -> Any:
    from splitserve.engine.loader import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model(model))
