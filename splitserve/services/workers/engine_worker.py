"""EngineWorker: a worker of role ``both`` (prefill and decode in one engine), and the base of
``PrefillWorker`` and ``DecodeWorker``.

Its round: an engine step, then the token deltas of the step (and errors) to the API server.
With a KV cache system configured (``spec.prefix_index`` and ``spec.kv_store``), prefill and
colocated engines load prefixes from their block store and publish what they hold
(services/workers/worker_cache.py).
"""

from __future__ import annotations

import logging
import os
import queue
import time
from pathlib import Path
from typing import Any

from splitserve.engine.request import Logprob, RequestOutput
from splitserve.eplb.traces import save_trace
from splitserve.services import messages as msg
from splitserve.services.workers.base import Worker
from splitserve.services.workers.expert_group import Lockstep, join_group
from splitserve.services.workers.grammar_waits import GrammarWaits
from splitserve.services.workers.spec import WorkerSpec
from splitserve.services.workers.worker_cache import WorkerCache

logger = logging.getLogger("splitserve.worker")

GRAMMAR_POLL_MS = 5
"""How often an idle worker looks for a finished grammar compile."""
TRACE_PART_STEPS = 1024
"""Steps of recorded expert load per file (``EngineConfig.expert_load_dir``)."""


class EngineWorker(Worker):
    role = "both"

    def __init__(self, spec: WorkerSpec) -> None:
        super().__init__(spec)
        self.cache: WorkerCache | None = None
        self._sent: dict[str, tuple[int, int]] = {}
        """Requests whose tokens this worker streams: (text length, tokens) sent so far."""
        self._prefill_rate = 0.0
        self._transfer_seconds: queue.Queue[float] = queue.Queue()
        self.lockstep: Lockstep | None = None
        """Set for a rank of an expert-parallel group (services/workers/expert_group.py)."""
        self._trace_parts = 0

    def _load(self) -> None:
        from splitserve.engine.llm_engine import LLMEngine
        from splitserve.engine.loader import load_tokenizer, resolve_model

        spec = self.spec
        tokenizer = load_tokenizer(resolve_model(spec.engine.model), light=True)
        member = join_group(spec, self.generation) if spec.expert_group is not None else None
        if spec.prefix_index is not None and spec.kv_store is not None:
            self.cache = WorkerCache(
                self.worker_id,
                spec.prefix_index,
                spec.kv_store,
                lambda: list(self.engine.block_manager.cached),
            )
            self.engine = LLMEngine(
                spec.engine,
                tokenizer,
                block_store=self.cache.blocks,
                cache_events=self.cache.events,
                expert_group=member,
            )
        else:
            self.engine = LLMEngine(spec.engine, tokenizer, expert_group=member)
        if spec.expert_group is not None:
            self.lockstep = Lockstep(self.engine, spec.expert_group.name, self._stop)
        self.grammars = GrammarWaits(self.engine.compile_grammar)
        self.model_name = self.engine.model_name
        self.max_model_len = self.engine.max_model_len
        warm_up = self.engine.runner.warm_up_seconds
        if warm_up:
            print(f"worker {self.worker_id}: kernels warmed up in {warm_up:.1f} s", flush=True)

    def _steps_in_lockstep(self) -> bool:
        return self.lockstep is not None

    def _leave(self) -> None:
        if self.lockstep is not None:
            self.lockstep.leave()

    def stop(self) -> None:
        super().stop()
        self.grammars.close()
        if self.cache is not None:
            self.cache.close()
        loop_ended = self._thread is None or not self._thread.is_alive()
        if loop_ended and hasattr(self, "engine"):
            self._write_expert_load(0)  # the rest, now that no step runs

    def _round(self) -> None:
        super()._round()
        if self.cache is not None:
            for update in self.cache.tick():
                self._send(update)
        self._write_expert_load(TRACE_PART_STEPS)

    def _write_expert_load(self, at_least: int) -> None:
        """The recorded expert load to ``expert_load_dir`` once ``at_least`` steps are held
        (0: whatever is held, when the worker stops). Written to a temporary name and renamed,
        never over an earlier file (a restarted worker numbers on); a failed write is logged
        and loses those steps, never the worker's requests."""
        directory = self.spec.engine.expert_load_dir
        if directory is None or self.engine.expert_load.recorded < max(at_least, 1):
            return
        steps = self.engine.expert_load.take()
        prefix = Path(directory) / f"{self.worker_id}-g{self.generation}"
        try:
            while (path := Path(f"{prefix}-{self._trace_parts:04d}.json")).exists():
                self._trace_parts += 1
            partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
            save_trace(steps, partial)
            os.replace(partial, path)
        except OSError:
            logger.exception("worker %s: %d steps of expert load lost", self.worker_id, len(steps))
            return
        self._trace_parts += 1
        logger.info("worker %s: %d steps of expert load to %s", self.worker_id, len(steps), path)

    def _busy(self) -> bool:
        """Work for the next round: this engine's requests, or its group's."""
        group_busy = self.lockstep is not None and self.lockstep.busy
        return group_busy or self.engine.has_unfinished_requests()

    def _poll_ms(self) -> int:
        if self._busy():
            return 0
        return GRAMMAR_POLL_MS if self.grammars.held() else super()._poll_ms()

    def _defer(self, message: msg.Message) -> bool:
        """A request with a constraint not compiled yet waits for it (grammar_waits.py)."""
        if isinstance(message, msg.AbortRequest):
            self.grammars.discard(message.request_ids)
            return False
        return self.grammars.hold(message)

    def _drain(self, timeout_ms: int) -> None:
        super()._drain(timeout_ms)
        for request_id, message, error in self.grammars.ready():
            if error is None:
                self._handle(message)
            else:
                self._errors.append(msg.RequestError(request_id, str(error)))

    def _handle(self, message: msg.Message) -> None:
        if isinstance(message, msg.GenerateRequest):
            try:
                self.engine.add_request(
                    message.request_id,
                    message.prompt_token_ids,
                    message.params,
                    traffic_class=message.traffic_class,
                    resumed=message.resumed,
                    resumed_chars=message.resumed_chars,
                )
            except ValueError as exc:
                self._errors.append(msg.RequestError(message.request_id, str(exc)))
                return
            self._sent[message.request_id] = (0, 0)
        elif isinstance(message, msg.AbortRequest):
            self._abort(message.request_ids)

    def _abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.engine.abort_request(request_id)
            self._sent.pop(request_id, None)
        self._last_stats = 0.0

    def _held(self) -> list[str]:
        return self.grammars.held() + list(self._sent)

    def _failed_round(self) -> list[str]:
        """A round that raised failed the requests in the engine (its step touched them)."""
        return list(self.engine.requests)

    def _tick(self) -> None:
        self._send_outputs(self._step())

    def _step(self) -> list[RequestOutput]:
        """One engine step (if there is work), measuring the prompt throughput. A rank of an
        expert-parallel group steps whenever any rank of the group has work."""
        if self.lockstep is not None:
            if not self.lockstep.any_busy():
                return []
        elif not self.engine.has_unfinished_requests():
            return []
        computed, start = self.engine.prompt_tokens_computed, time.monotonic()
        self.phases.lap("worker")
        outputs = self.lockstep.step() if self.lockstep is not None else self.engine.step()
        self.phases.start()  # the engine timed its step itself (engine.phases)
        tokens = self.engine.prompt_tokens_computed - computed
        if tokens:
            rate = tokens / max(time.monotonic() - start, 1e-6)
            old = self._prefill_rate
            self._prefill_rate = rate if not old else 0.7 * old + 0.3 * rate
        return outputs

    def _send_outputs(self, outputs: list[RequestOutput]) -> None:
        self._send_batch([d for d in (self._delta(o) for o in outputs) if d is not None])
        self.phases.lap("send")

    def _delta(self, output: RequestOutput) -> msg.TokenDelta | None:
        if output.request_id not in self._sent:
            return None
        text_len, num_tokens = self._sent[output.request_id]
        completion = output.outputs[0]
        if output.finished:
            del self._sent[output.request_id]
            self._last_stats = 0.0
        else:
            self._sent[output.request_id] = (len(completion.text), len(completion.token_ids))
        return msg.TokenDelta(
            request_id=output.request_id,
            text=completion.text[text_len:],
            token_ids=list(completion.token_ids[num_tokens:]),
            logprobs=_wire_logprobs(completion.logprobs, completion.token_ids, num_tokens),
            finish_reason=completion.finish_reason if output.finished else None,
            stop_reason=completion.stop_reason if output.finished else None,
            num_prompt_tokens=len(output.prompt_token_ids),
            num_cached_tokens=output.num_cached_tokens,
        )

    def _transfer_bytes(self) -> int:
        return 0

    def _stats(self) -> msg.WorkerStats:
        seconds = []
        while not self._transfer_seconds.empty():
            seconds.append(self._transfer_seconds.get_nowait())
        eplb = self.engine.eplb
        return msg.WorkerStats(
            **vars(self.engine.stats()),
            worker_id=self.worker_id,
            kv_transfer_bytes=self._transfer_bytes(),
            kv_transfer_seconds=seconds,
            prefill_tokens_per_s=self._prefill_rate,
            node_id=self.cache.node_id if self.cache is not None else "",
            loop_phases=self._loop_phases(),
            loop_steps=self.engine.num_steps,
            hash_root=self.engine.block_manager.root,
            eplb_rebalances=eplb.rebalances if eplb is not None else 0,
            eplb_imbalance=eplb.imbalance if eplb is not None else 0.0,
        )

    def _loop_phases(self) -> list[msg.PhaseSeconds]:
        timed = [*self.phases.seconds.items(), *self.engine.phases.seconds.items()]
        return [msg.PhaseSeconds(phase, seconds) for phase, seconds in timed]


def _wire_logprobs(
    logprobs: list[dict[int, Any]] | None, token_ids: list[int], start: int
) -> list[list[msg.TokenLogprob]] | None:
    """The new positions' logprobs, the sampled token first, then by rank."""
    if logprobs is None:
        return None
    return [
        wire_position(logprobs[position], token_ids[position])
        for position in range(start, len(logprobs))
    ]


def wire_position(position: dict[int, Logprob], sampled: int) -> list[msg.TokenLogprob]:
    """One position's logprobs as messages, the sampled token first, then by rank."""
    entries = sorted(position.items(), key=lambda kv: (kv[0] != sampled, kv[1].rank))
    return [msg.TokenLogprob(t, float(lp.logprob), lp.rank, lp.decoded_token) for t, lp in entries]


def engine_position(entries: list[msg.TokenLogprob]) -> dict[int, Logprob]:
    """The inverse of wire_position."""
    return {e.token_id: Logprob(e.logprob, e.rank, e.decoded_token) for e in entries}
