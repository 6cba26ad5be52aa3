"""Per-request metrics and the structured request log, from what the request exchange sees.

The exchange (exchange.py) reports each request's tokens, its finish or its failure; this turns
them into the Prometheus series of services/metrics.py (labelled by the worker that did the
work: TTFT and prefill time by the prompt's worker, the rest by the decode worker) and one
JSON line per finished engine request on the `splitserve.requests` logger.
"""

from __future__ import annotations

import json
import logging
import time

from splitserve.services import messages as msg
from splitserve.services.api.worker_view import Tracked
from splitserve.services.metrics import Metrics

request_log = logging.getLogger("splitserve.requests")


class RequestTelemetry:
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def tokens(self, tracked: Tracked, count: int) -> bool:
        """Tokens arrived for a request; True when they are its first (its prompt is done)."""
        if not count:
            return False
        first = not tracked.first_token
        m, now = self.metrics, time.monotonic()
        decode = tracked.worker
        key = m.labels(decode.pool, decode.worker_id)
        m.generation_tokens.labels(*key).inc(count)
        if tracked.first_token:
            gap = (now - tracked.last_token_at) / count
            for _ in range(count):
                m.inter_token_latency.labels(*key).observe(gap)
        else:
            tracked.first_token = True
            tracked.first_token_at = now
            prompt = tracked.prompt_worker
            prompt_key = m.labels(prompt.pool, prompt.worker_id)
            m.time_to_first_token.labels(*prompt_key).observe(now - tracked.start)
            m.request_prefill_time.labels(*prompt_key).observe(now - tracked.sent)
        tracked.num_tokens += count
        tracked.last_token_at = now
        return first

    def finished(self, delta: msg.TokenDelta, tracked: Tracked) -> None:
        m, now = self.metrics, time.monotonic()
        decode, prompt = tracked.worker, tracked.prompt_worker
        key = m.labels(decode.pool, decode.worker_id)
        prompt_key = m.labels(prompt.pool, prompt.worker_id)
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
        decode = tracked.worker
        key = self.metrics.labels(decode.pool, decode.worker_id)
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
        prefill = tracked.prefill
        line = {
            "request_id": request_id,
            "prefill_worker": prefill.worker_id if prefill else None,
            "decode_worker": tracked.worker.worker_id,
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
