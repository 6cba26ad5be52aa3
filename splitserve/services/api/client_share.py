"""Each client's share of the admission bound (``server.client_share`` of ``max_queue``), so
that one client (one API request of 256 prompts, or many requests at once) cannot fill the
queue for everyone. A client is its API key when keys are configured, else its address."""

from __future__ import annotations

import hashlib
from collections import Counter

from fastapi import Request

from splitserve.services.api.auth import presented_key
from splitserve.services.api.errors import APIError

RETRY_AFTER_S = 1


class ClientShares:
    """Engine requests each client holds now, against ``limit``."""

    def __init__(self, max_queue: int, share: float) -> None:
        self.limit = max(1, int(max_queue * share))
        self.held: Counter[str] = Counter()

    def take(self, client: str, count: int) -> None:
        """Hold count more for client; 429 (Retry-After) past its share."""
        if self.held[client] + count > self.limit:
            raise APIError(
                429,
                f"this client holds {self.held[client]} engine requests; {count} more would "
                f"pass its share of {self.limit} (server.client_share of max_queue)",
                "rate_limit_error",
                code="client_share_exceeded",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        self.held[client] += count

    def give_back(self, client: str, count: int) -> None:
        self.held[client] -= count
        if self.held[client] <= 0:
            del self.held[client]


def client_of(request: Request, keyed: bool) -> str:
    """keyed (API keys configured): a digest of the key presented; else the client address."""
    if keyed:
        return "key:" + hashlib.sha256(presented_key(request)).hexdigest()[:16]
    return "addr:" + (request.client.host if request.client else "")
