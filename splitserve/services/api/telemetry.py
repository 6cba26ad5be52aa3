"""Per-request metrics and the structured request log, from what the worker client sees.

The client (client.py) reports each request's tokens, its finish or its failure; this turns
them into the Prometheus series of services/metrics.py (labelled by the worker that did the
work: TTFT and prefill time by the prompt's worker, the rest by the decode worker) and one
JSON line per finished engine request on the `splitserve.requests` logger.
"""

from __future__ import annotations

import json
import logging
import time

from splitserve.services import messages as msg
from splitserve.services.api.worker_view import Tracked, WorkerState
from splitserve.services.metrics import Metrics

request_log = logging.getLogger("splitserve.requests")


class RequestTelemetry:
    def __init__(self, metrics: Metrics, workers: list[WorkerState]) -> None:
        """workers: the client's own list (indexed by Tracked.worker / prefill), not a copy."""
        self.metrics = metrics
        self.workers = workers

    def tokens(self, tracked: Tracked, count: int) -> bool:
        """Tokens arrived for a request; True when they are its first (its prompt is done)."""
        if not count:
            return False
        first = not tracked.first_token
        m, now = self.metrics, time.monotonic()
        decode = self.workers[tracked.worker]
        key = m.labels(decode.pool, decode.endpoint.worker_id)
        m.generation_tokens.labels(*key).inc(count)
        if tracked.first_token:
            gap = (now - tracked.last_token_at) / count
            for _ in range(count):
                m.inter_token_latency.labels(*key).observe(gap)
        else:
            tracked.first_token = True
            tracked.first_token_at = now
            prompt = self.workers[tracked.prompt_worker]
            prompt_key = m.labels(prompt.pool, prompt.endpoint.worker_id)
            m.time_to_first_token.labels(*prompt_key).observe(now - tracked.start)
            m.request_prefill_time.labels(*prompt_key).observe(now - tracked.sent)
        tracked.num_tokens += count
        tracked.last_token_at = now
        return first

    def finished(self, delta: msg.TokenDelta, tracked: Tracked) -> None:
        m, now = self.metrics, time.monotonic()
        decode = self.workers[tracked.worker]
        key = m.labels(decode.pool, decode.endpoint.worker_id)
        prompt = self.workers[tracked.prompt_worker]
        prompt_key = m.labels(prompt.pool, prompt.endpoint.worker_id)
        m.prompt_tokens.labels(*prompt_key).inc(delta.num_prompt_tokens)
        m.request_success.labels(*key, delta.finish_reason).inc()
        m.e2e_request_latency.labels(*key).observe(now - tracked.start)
        decode_time = now - tracked.first_token_at if tracked.first_token else 0.0
        m.request_decode_time.labels(*key).observe(decode_time)
        if tracked.num_tokens > 1:
            per_token = decode_time / (tracked.num_tokens - 1)
            m.request_time_per_output_token.labels(*key).observe(per_token)
        self._log(delta.request_id, tracked, "ok", delta.finish_reason, delta.num_prompt_tokens)

    def failed(self, request_id: str, tracked: Tracked, reason: str) -> None:
        decode = self.workers[tracked.worker]
        key = self.metrics.labels(decode.pool, decode.endpoint.worker_id)
        self.metrics.request_failure.labels(*key, reason).inc()
        self._log(request_id, tracked, "error", reason, None)

    def _log(
        self,
        request_id: str,
        tracked: Tracked,
        status: str,
        reason: str | None,
        prompt_tokens: int | None,
    ) -> None:
        """One JSON line per finished engine request on the `splitserve.requests` logger."""
        now = time.monotonic()
        prefill = None if tracked.prefill is None else self.workers[tracked.prefill]
        line = {
            "request_id": request_id,
            "prefill_worker": prefill.endpoint.worker_id if prefill else None,
            "decode_worker": self.workers[tracked.worker].endpoint.worker_id,
            "ttft_s": round(tracked.first_token_at - tracked.start, 6)
            if tracked.first_token
            else None,
            "e2e_s": round(now - tracked.start, 6),
            "prompt_tokens": prompt_tokens,
            "generation_tokens": tracked.num_tokens,
            "status": status,
            "finish_reason": reason,
        }
        request_log.info(json.dumps(line))
