"""The drafter interface: who proposes the tokens that the target model verifies.

A drafter sees requests between steps, when every token but the last has KV in the target, and
proposes up to ``limits[i]`` tokens to follow each request's last token. The target then scores
all of them in one step (engine/spec/speculator.py) and keeps the longest prefix its own
sampling agrees with; ``release`` is called when a request leaves the engine.

Drafters built: ``NgramDrafter`` (prompt lookup, engine/spec/ngram.py), ``DraftModelDrafter``
(a smaller model with its own paged KV, engine/spec/draft_model.py) and ``MTPDrafter`` (the
target's multi-token-prediction layer, engine/spec/mtp.py), which proposes from the target's
hidden states: ``observe`` hands it every target step.
Drafts are deterministic (a lookup, an argmax): the verifier relies on that to keep a sampled
request's distribution exact (a point-mass draft distribution, engine/spec/speculator.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from splitserve.engine.request import Request
from splitserve.engine.scheduler import ScheduledBatch


class Drafter(ABC):
    @abstractmethod
    def propose(self, reqs: list[Request], limits: list[int]) -> list[list[int]]:
        """Draft tokens after each request's tokens (``all_token_ids``): at most limits[i]
        for reqs[i], fewer or none where the drafter has nothing to offer."""

    @abstractmethod
    def passes(self, limits: list[int]) -> int:
        """Drafting rounds that proposing with these limits costs (engine/spec/dynamic.py)."""

    def observe(self, batch: ScheduledBatch) -> None:  # noqa: B027 (a hook, mostly unused)
        """A target step has run on batch (its requests' computed tokens counted, before
        verification): a drafter that reads the target's state takes it here."""

    @abstractmethod
    def release(self, req: Request) -> None:
        """req left the engine (finished or aborted): drop what is kept for it."""
