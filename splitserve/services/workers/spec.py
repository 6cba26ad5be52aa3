"""WorkerSpec: everything a worker actor starts from, as the typed config objects themselves.

The launcher (services/launch/) builds one per replica from the deployment's DeployConfig and
passes it to the actor's constructor; Ray carries it on its control plane. Requests and tokens
never travel this way: they go over the worker's ZMQ sockets as msgpack messages.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from splitserve.config import (
    ImagesConfig,
    KVStoreConfig,
    PrefixIndexConfig,
    ServerConfig,
    TransferConfig,
)
from splitserve.engine.config import EngineConfig
from splitserve.kvstore.rendezvous import StoreAddress
from splitserve.services.sealing import Sealer


@dataclass(frozen=True)
class ExpertGroup:
    """A worker's place in an expert-parallel group: rank ``rank`` of ``size``, the group
    named ``name`` (its replica's id) on the deployment's rendezvous store."""

    name: str
    rank: int
    size: int


@dataclass(frozen=True)
class WorkerSpec:
    """One worker replica.

    bind_host: where its sockets bind. threads: torch's CPU threads (0: all cores).
    store: the KV transport's rendezvous store (None for colocated deployments).
    prefix_index / kv_store: the KV cache system its engine publishes to (prefill and colocated
    workers; None leaves it out). images: the deployment's image limits (vision workers).
    sealer: the deployment's secret, which every message to and from the worker is sealed
    with (services/sealing.py) and its sockets' CurveZMQ keys come from (splitserve/curve.py);
    a spec built without one gets a random secret of its own.
    max_body_bytes: server.max_body_bytes, which bounds the messages it takes
    (services/workers/limits.py).
    expert_group: its rank in an expert-parallel group (None: a replica of its own).
    """

    worker_id: str
    role: str
    engine: EngineConfig
    bind_host: str = "127.0.0.1"
    threads: int = 0
    transfer: TransferConfig = field(default_factory=TransferConfig)
    store: StoreAddress | None = None
    prefix_index: PrefixIndexConfig | None = None
    kv_store: KVStoreConfig | None = None
    images: ImagesConfig = field(default_factory=ImagesConfig)
    sealer: Sealer = field(default_factory=Sealer)
    expert_group: ExpertGroup | None = None
    max_body_bytes: int = ServerConfig.max_body_bytes
