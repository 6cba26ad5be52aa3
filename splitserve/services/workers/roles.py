"""Which worker class runs a pool's role: the factory sits above the classes (each derives
from base.py's ``Worker``)."""

from __future__ import annotations

from splitserve.services.workers.base import Worker
from splitserve.services.workers.decode import DecodeWorker
from splitserve.services.workers.engine_worker import EngineWorker
from splitserve.services.workers.prefill import PrefillWorker
from splitserve.services.workers.vision import VisionWorker

ROLES: dict[str, type[Worker]] = {
    "both": EngineWorker,
    "prefill": PrefillWorker,
    "decode": DecodeWorker,
    "vision": VisionWorker,
}


def worker_class(role: str) -> type[Worker]:
    """The worker class that runs ``role``."""
    if role not in ROLES:
        raise ValueError(f"worker role {role!r} is not supported")
    return ROLES[role]
