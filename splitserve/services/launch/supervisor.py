"""Supervision of the worker actors: a worker whose process died is restarted by Ray and
joins its pool again, under its id, with its new addresses.

Each replica's actor is created with ``max_restarts`` (ray.max_restarts) and runs two calls at
a time: its ``start`` and a ``wait_stopped`` call that returns only when the worker is stopped
on purpose. The supervisor keeps one such call pending per replica; when the process dies
(killed, out of memory, a crash of native code), Ray fails the call within about a second.
Then the exchange hears that the worker stopped (its requests migrate, services/api/
migration.py), Ray restarts the actor in the same placement group, the supervisor calls
``start`` again (the engine loads anew) and hands the new endpoint to the exchange.

A worker that sent WorkerFailed (its loop gave up, services/workers/base.py) is alive but
useless: ``restart`` kills its process the same way, and the same path brings it back. A
replica removed by scaling is not restarted (the supervisor watches only current replicas).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from splitserve.services.api.worker_view import WorkerEndpoint
from splitserve.services.launch.deployment import Deployment

WATCH_POLL_S = 0.2
log = logging.getLogger("splitserve.supervisor")


class Supervisor:
    """stopped(worker_id, why): a worker's process died (called on the event loop);
    rejoin(endpoint): it runs again (called on the event loop)."""

    def __init__(
        self,
        deployment: Deployment,
        loop: asyncio.AbstractEventLoop,
        stopped: Callable[[str, str], None],
        rejoin: Callable[[WorkerEndpoint], None],
    ) -> None:
        self.deployment = deployment
        self._loop = loop
        self._stopped = stopped
        self._rejoin = rejoin
        self._watches: dict[str, Any] = {}
        self._restarting: set[str] = set()
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="supervisor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._halt.set()
        self._thread.join(timeout=10)

    def restart(self, worker_id: str) -> None:
        """Kill a worker's process so that Ray restarts it (a worker that sent WorkerFailed)."""
        import ray

        replica = self.deployment.replicas.get(worker_id)
        if replica is not None and worker_id not in self._restarting:
            log.warning("worker %s failed: restarting its process", worker_id)
            ray.kill(replica.actor, no_restart=False)

    def _watch(self) -> None:
        import ray

        while not self._halt.is_set():
            replicas = dict(self.deployment.replicas)
            for worker_id, replica in replicas.items():
                if worker_id not in self._watches and worker_id not in self._restarting:
                    self._watches[worker_id] = replica.actor.wait_stopped.remote()
            if not self._watches:
                self._halt.wait(WATCH_POLL_S)
                continue
            refs = {ref: worker_id for worker_id, ref in self._watches.items()}
            done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=WATCH_POLL_S)
            for ref in done:
                worker_id = refs[ref]
                del self._watches[worker_id]
                if worker_id in self._restarting:
                    continue  # killed by its group's restart, which starts it again
                if worker_id in self.deployment.replicas and self._died(ref):
                    members = self.deployment.group_of(worker_id)
                    self._restarting.update(members)
                    threading.Thread(
                        target=self._restart, args=(worker_id, members), daemon=True
                    ).start()

    @staticmethod
    def _died(ref: Any) -> bool:
        import ray

        try:
            ray.get(ref)
        except ray.exceptions.RayActorError:
            return True
        return False

    def _start_again(self, worker_id: str, generation: int) -> dict[str, Any]:
        """``start`` on the restarted actor. A call made while Ray is still restarting it
        fails (ActorUnavailableError, maybe after it ran): it is made again; ``start`` of a
        started worker returns its WorkerInfo without starting anything."""
        import ray

        deadline = time.monotonic() + self.deployment.config.ray.placement_timeout_s
        while True:
            actor = self.deployment.replicas[worker_id].actor
            try:
                info: dict[str, Any] = ray.get(actor.start.remote(generation))
                return info
            except ray.exceptions.ActorUnavailableError:
                if time.monotonic() > deadline or self._halt.wait(WATCH_POLL_S):
                    raise

    def _restart(self, worker_id: str, members: list[str]) -> None:
        """Tell the exchange, then start the restarted actor and hand its endpoint over. A rank
        of an expert-parallel group takes its whole group down and up again: the other ranks'
        processes are killed too (their collectives broke), and every rank starts with the
        group's next generation, in which they meet anew (services/workers/expert_group.py)."""
        import ray

        died = time.monotonic()
        generation = self.deployment.next_generation(worker_id) if len(members) > 1 else 0
        for member in members:
            why = "its process died" if member == worker_id else f"{worker_id} of its group died"
            self._loop.call_soon_threadsafe(self._stopped, member, why)
            if member != worker_id:
                with contextlib.suppress(KeyError, ray.exceptions.RayError):
                    ray.kill(self.deployment.replicas[member].actor, no_restart=False)
        try:
            with ThreadPoolExecutor(len(members)) as pool:  # a group's ranks start together
                infos = list(pool.map(lambda m: self._start_again(m, generation), members))
        except (KeyError, ray.exceptions.RayError):
            log.exception("worker %s did not come back (with %s)", worker_id, members)
            return
        finally:
            self._restarting.difference_update(members)
        seconds = time.monotonic() - died
        for info in infos:
            self.deployment.restarted(info)
            endpoint = WorkerEndpoint(
                info["worker_id"],
                info["request_addr"],
                info["output_addr"],
                info["role"],
                info["kv_addr"],
            )
            self._loop.call_soon_threadsafe(self._rejoin, endpoint)
            print(
                f"splitserve worker {info['worker_id']} restarted in {seconds:.1f} s, "
                f"pid {info['pid']}"
            )
