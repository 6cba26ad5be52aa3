"""Deployment config: one YAML file describes the whole service.

The file is read into frozen dataclasses; ``--set dotted.key=value`` overrides any field
before validation (values are parsed as YAML, so ``9000`` is an int and ``[a, b]`` a list).
Unknown keys and wrongly typed values are errors that name the offending dotted path.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from splitserve.engine.config import EngineConfig
from splitserve.engine.spec.config import SpeculativeConfig
from splitserve.server_config import ServerConfig
from splitserve.typed_config import ConfigError, build, expand, is_set, require, set_dotted

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "local.yaml"
ROLES = ("both", "prefill", "decode", "vision")
POOL_NAME = re.compile(r"[A-Za-z0-9_-]+")
TRANSFER_BACKENDS = ("auto", "gloo", "nccl", "hccl")
ROUTER_POLICIES = ("cache_aware", "least_loaded", "round_robin")
DAY_S = 24 * 3600.0
# A pool's engine runs the deployment's model on the pool's device: its YAML cannot set them.
ENGINE_SET_ELSEWHERE = {
    "model": "the deployment's `model`",
    "device": "the pool's `device`",
    "speculative": "the pool's `speculative`",
    "expert_parallel_size": "the pool's `expert_parallel`",
}


@dataclass(frozen=True)
class PoolConfig:
    """A set of identical workers. role: which stages of a request its workers run.

    engine: every EngineConfig field but model, device and speculative, which DeployConfig
    fills in from the deployment's model and this pool's device and speculative section (so
    ``engine`` is the complete config a replica's engine starts from).
    """

    role: str = "both"
    replicas: int = 1
    device: str = "cpu"
    devices: int = 1
    num_cpus: float = 1.0
    num_threads: int = 0
    resources: Mapping[str, float] = field(default_factory=dict)
    engine: EngineConfig = field(
        default_factory=EngineConfig, metadata={"set_elsewhere": ENGINE_SET_ELSEWHERE}
    )
    speculative: SpeculativeConfig | None = None
    """Speculative decoding of a decode or colocated pool (vLLM's speculative_config keys)."""
    expert_parallel: int = 1
    """Decode or colocated pools of a mixture-of-experts model: each replica is a group of
    this many rank workers, one engine each with its own requests and KV, the experts sharded
    over them (engine/expert_parallel.py); every rank is a decode slot of the router."""

    def __post_init__(self) -> None:
        require(self.role in ROLES, f"role {self.role!r} is not supported (supported: {ROLES})")
        require(
            self.speculative is None or self.role in ("both", "decode"),
            f"speculative decoding runs on decode and colocated pools, not {self.role!r} ones",
        )
        require(self.replicas >= 1, "replicas must be at least 1")
        require(self.expert_parallel >= 1, "expert_parallel must be at least 1")
        require(
            self.expert_parallel == 1 or self.role in ("both", "decode"),
            f"expert_parallel groups run decode and colocated pools, not {self.role!r} ones",
        )
        require(
            self.expert_parallel == 1 or self.speculative is None,
            "speculative decoding does not run in expert_parallel groups",
        )
        require(
            not self.engine.record_expert_load or self.engine.expert_load_dir is not None,
            "a served record_expert_load needs engine.expert_load_dir (where its workers write "
            "the load; nothing else takes it)",
        )
        require(self.devices >= 1, "devices must be at least 1")
        require(self.num_cpus >= 0, "num_cpus must be non-negative")
        require(self.num_threads >= 0, "num_threads must be non-negative (0 = all cores)")
        require(all(v >= 0 for v in self.resources.values()), "resources must be non-negative")

    @property
    def num_gpus(self) -> int:
        """Accelerators reserved per replica (the engine runs on the first)."""
        return self.devices if self.device.split(":")[0] in ("cuda", "npu") else 0

    def bundle(self) -> dict[str, float]:
        """One replica's Ray placement-group bundle: CPUs, GPUs and the pool's node labels."""
        bundle = {"CPU": self.num_cpus, **self.resources}
        if self.num_gpus:
            bundle["GPU"] = float(self.num_gpus)
        return {k: v for k, v in bundle.items() if v > 0}


@dataclass(frozen=True)
class TransferConfig:
    """KV transport between prefill and decode workers.

    timeout_s bounds a channel's setup and each transfer, and how long a decode worker keeps
    blocks reserved for KV that has not arrived. fault_send_delay_s is for tests only: the
    prefill worker waits that long between announcing a transfer and sending the KV.
    """

    backend: str = "auto"
    timeout_s: float = 30.0
    fault_send_delay_s: float = 0.0

    def __post_init__(self) -> None:
        require(
            self.backend in TRANSFER_BACKENDS,
            f"transfer.backend {self.backend!r} is not one of {TRANSFER_BACKENDS}",
        )
        require(self.timeout_s > 0, "transfer.timeout_s must be positive")
        require(self.fault_send_delay_s >= 0, "transfer.fault_send_delay_s must be >= 0")


@dataclass(frozen=True)
class PrefixIndexConfig:
    """Where the prefix index lives: ``memory://`` (the API server's memory; workers send it
    their events) or ``redis://[:password@]host:port/db`` / ``rediss://`` (TLS)."""

    url: str = "memory://"
    ttl_s: float = 7 * DAY_S
    publish_interval_s: float = 0.5

    def __post_init__(self) -> None:
        scheme = self.url.split("://", 1)[0] if "://" in self.url else ""
        require(
            scheme in ("memory", "redis", "rediss", "unix"),
            f"prefix_index.url {self.url!r}: expected memory://, redis:// or rediss://",
        )
        require(self.ttl_s > 0, "prefix_index.ttl_s must be positive")
        require(self.publish_interval_s > 0, "prefix_index.publish_interval_s must be positive")


@dataclass(frozen=True)
class KVStoreConfig:
    """Each prefill (or colocated) worker's block store: a host tier of its own and, with
    disk_path, a disk tier in that directory, shared by the workers of a node.

    retention: traffic class -> TTL seconds; a request's class is its x-traffic-class header
    or default_class."""

    host_bytes: int = 256 << 20
    disk_path: str | None = None
    disk_bytes: int = 4 << 30
    retention: Mapping[str, float] = field(
        default_factory=lambda: {"agent": 3 * DAY_S, "chat": 7 * DAY_S}
    )
    default_class: str = "chat"

    def __post_init__(self) -> None:
        require(self.host_bytes >= 0, "kv_store.host_bytes must be >= 0")
        require(self.disk_bytes >= 0, "kv_store.disk_bytes must be >= 0")
        require(all(t > 0 for t in self.retention.values()), "kv_store.retention: TTLs must be > 0")
        require(
            self.default_class in self.retention,
            f"kv_store.default_class {self.default_class!r} has no kv_store.retention entry",
        )


@dataclass(frozen=True)
class RouterConfig:
    """policy: cache_aware (prefill by uncached tokens and queue; decode by free KV),
    least_loaded or round_robin."""

    policy: str = "cache_aware"

    def __post_init__(self) -> None:
        require(
            self.policy in ROUTER_POLICIES,
            f"router.policy {self.policy!r} is not one of {ROUTER_POLICIES}",
        )


@dataclass(frozen=True)
class ImagesConfig:
    """Image inputs of chat requests (docs/vision.md).

    max_bytes / max_pixels / max_per_request: larger or more images get a 400.
    allowed_hosts: hosts whose http(s) image URLs the API server may fetch; empty (the
    default) refuses every remote URL, so the server cannot be made to request anything.
    encoder_cache_bytes: each vision worker's cache of embeddings by image content hash.
    """

    max_bytes: int = 5 << 20
    max_pixels: int = 4_000_000
    max_per_request: int = 4
    allowed_hosts: tuple[str, ...] = ()
    fetch_timeout_s: float = 5.0
    encoder_cache_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        require(self.max_bytes >= 1, "images.max_bytes must be at least 1")
        require(self.max_pixels >= 1, "images.max_pixels must be at least 1")
        require(self.max_per_request >= 0, "images.max_per_request must be >= 0")
        require(self.fetch_timeout_s > 0, "images.fetch_timeout_s must be positive")
        require(self.encoder_cache_bytes >= 0, "images.encoder_cache_bytes must be >= 0")


@dataclass(frozen=True)
class RayConfig:
    """address=None starts a private local Ray; otherwise join that cluster ("auto" works)."""

    address: str | None = None
    num_cpus: int | None = None
    placement_timeout_s: float = 60.0
    """How long a replica may wait for room in the cluster (an autoscaling cluster adding
    nodes needs minutes), saying so every 10 s in the log."""
    max_restarts: int = 10
    """How often Ray restarts a worker whose process died (-1: without limit)."""

    def __post_init__(self) -> None:
        require(self.placement_timeout_s > 0, "ray.placement_timeout_s must be positive")
        require(self.max_restarts >= -1, "ray.max_restarts must be -1 or more")


@dataclass(frozen=True)
class DeployConfig:
    model: str = "smollm2-135m-instruct"
    server: ServerConfig = field(default_factory=ServerConfig)
    pools: Mapping[str, PoolConfig] = field(default_factory=lambda: {"worker": PoolConfig()})
    ray: RayConfig = field(default_factory=RayConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    prefix_index: PrefixIndexConfig = field(default_factory=PrefixIndexConfig)
    kv_store: KVStoreConfig = field(default_factory=KVStoreConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    images: ImagesConfig = field(default_factory=ImagesConfig)

    def __post_init__(self) -> None:
        require(bool(self.model), "model must not be empty")
        require(len(self.pools) >= 1, "pools must define at least one pool")
        _check_roles([p.role for p in self.pools.values()])
        for name in self.pools:  # worker ids are <pool>-<index>[.<rank>] (services/api/)
            require(bool(POOL_NAME.fullmatch(name)), f"pool name {name!r}: letters, digits, _ only")
        # Frozen: the completed pools go in the way dataclasses' own __init__ sets fields.
        object.__setattr__(
            self, "pools", {name: self._complete(p) for name, p in self.pools.items()}
        )

    def _complete(self, pool: PoolConfig) -> PoolConfig:
        """``pool`` with its engine's model and device set from the deployment and the pool."""
        engine = dataclasses.replace(
            pool.engine,
            model=self.model,
            device=pool.device,
            speculative=pool.speculative,
            expert_parallel_size=pool.expert_parallel,
        )
        return dataclasses.replace(pool, engine=engine)

    @property
    def disaggregated(self) -> bool:
        """True for a prefill pool plus a decode pool, False for colocated (`both`) pools."""
        return any(p.role != "both" for p in self.pools.values())

    def engine_config(self, pool: str) -> EngineConfig:
        """The EngineConfig for one replica of ``pool``."""
        return self.pools[pool].engine


def load_config(
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
    flags: Mapping[str, Any] | None = None,
) -> DeployConfig:
    """Read ``path`` (default configs/local.yaml), apply ``key=value`` overrides, validate.
    flags: dotted key -> value of the command line's vLLM-style flags (``pools.*.``: every
    pool; a speculative section only decode and colocated ones); a config file given as
    ``path`` keeps the values it sets itself. The overrides win over both."""
    raw = _read_yaml(Path(path) if path is not None else DEFAULT_CONFIG, path is None)
    if flags and not raw.get("pools"):
        raw["pools"] = {"worker": {}}
    for key, value in (flags or {}).items():
        for dotted in expand(raw, key):
            speculative_ok = _role(raw, dotted) in ("both", "decode")
            if (path is None or not is_set(raw, dotted)) and (
                not dotted.endswith(".speculative") or speculative_ok
            ):
                set_dotted(raw, dotted, value)
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} is not of the form dotted.key=value")
        set_dotted(raw, key.strip(), yaml.safe_load(value))
    return build(DeployConfig, raw, "")


def _role(raw: dict[str, Any], dotted: str) -> Any:
    pool = raw["pools"].get(dotted.split(".")[1]) if dotted.startswith("pools.") else None
    return pool.get("role", "both") if isinstance(pool, dict) else "both"


def _read_yaml(path: Path, is_default: bool) -> dict[str, Any]:
    if is_default and not path.exists():
        return {}
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"config {path} is not valid YAML: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config {path} must be a mapping at the top level")
    return data


def _check_roles(roles: list[str]) -> None:
    if all(r == "both" for r in roles):
        return
    require(
        sorted(roles) in (["decode", "prefill"], ["decode", "prefill", "vision"]),
        "a disaggregated deployment has exactly one prefill pool and one decode pool, at most "
        f"one vision pool and no `both` pool (got roles {sorted(roles)}); a colocated one has "
        "only `both` pools",
    )
