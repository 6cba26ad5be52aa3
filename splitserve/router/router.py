"""The router: a plan (which prefill worker, which decode worker) for each request.

It lives in the API server process for now. Colocated deployments have one pool of `both`
workers, chosen like decode workers; disaggregated ones pick a prefill worker and a decode
worker. Workers whose heartbeat stopped are skipped while any healthy one is left.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from splitserve.router.policy import Candidate, Policy, RequestInfo, make_policy


@dataclass(frozen=True)
class Plan:
    """Indices of the chosen workers in their candidate lists; prefill is None if colocated."""

    prefill: int | None
    decode: int


class Router:
    def __init__(self, prefill_policy: str = "round_robin", decode_policy: str = "least_loaded"):
        self.prefill_policy: Policy = make_policy(prefill_policy)
        self.decode_policy: Policy = make_policy(decode_policy)

    def plan(
        self,
        request: RequestInfo,
        decode: Sequence[Candidate],
        prefill: Sequence[Candidate] = (),
    ) -> Plan:
        prefill_index = (
            _choose(self.prefill_policy.choose_prefill, prefill, request) if prefill else None
        )
        return Plan(prefill_index, _choose(self.decode_policy.choose_decode, decode, request))


def _choose(
    choose: Callable[[Sequence[Candidate], RequestInfo], int],
    candidates: Sequence[Candidate],
    request: RequestInfo,
) -> int:
    healthy = [i for i, c in enumerate(candidates) if c.healthy]
    if not healthy or len(healthy) == len(candidates):
        return choose(candidates, request)
    return healthy[choose([candidates[i] for i in healthy], request)]
