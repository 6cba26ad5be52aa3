"""One model replica: requests in, one scheduler step at a time, outputs out. No HTTP, Ray or
sockets here; workers wrap this class and the offline ``LLM`` drives it."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from splitserve.engine.admission import check_prompt, context_length
from splitserve.engine.block_cache import BlockCache, CacheEvents
from splitserve.engine.block_manager import BlockManager
from splitserve.engine.config import EngineConfig
from splitserve.engine.detokenizer import IncrementalDetokenizer
from splitserve.engine.expert_load import ExpertLoadRecorder
from splitserve.engine.expert_rebalance import live_rebalancer
from splitserve.engine.hybrid_blocks import HybridBlockManager
from splitserve.engine.kv_handoff import KVHandoff
from splitserve.engine.loader import (
    eos_token_ids,
    is_random_shape,
    load_model_config,
    load_tokenizer,
    resolve_model,
)
from splitserve.engine.model_runner import ModelRunner
from splitserve.engine.overlap import InflightStep, can_continue, is_decode_batch
from splitserve.engine.phases import PhaseTimer
from splitserve.engine.prefix_cache import PrefixCache
from splitserve.engine.request import Request, RequestOutput
from splitserve.engine.resume import resume
from splitserve.engine.sampler import Sampler, SampleResult
from splitserve.engine.sampling_params import SamplingParams, StructuredOutputsParams
from splitserve.engine.scheduler import ScheduledBatch, Scheduler
from splitserve.engine.spec.speculator import Speculator, build_speculator
from splitserve.engine.stats import EngineStats, engine_stats
from splitserve.engine.structured.constraints import Constraints
from splitserve.engine.vision.config import load_vision_config
from splitserve.engine.vision.multimodal import ImageInput, check_images
from splitserve.engine.warm_up import time_decode_rows
from splitserve.kvstore.hashing import hash_root

if TYPE_CHECKING:
    from xgrammar import CompiledGrammar

    from splitserve.engine.layers.expert_placement import GroupMember

log = logging.getLogger(__name__)


class LLMEngine:
    """block_store / cache_events: optional links of the device prefix cache to a slower
    block store and to an index of cached blocks (engine/prefix_cache.py)."""

    def __init__(
        self,
        config: EngineConfig,
        tokenizer: Any = None,
        block_store: BlockCache | None = None,
        cache_events: CacheEvents | None = None,
        expert_group: GroupMember | None = None,
    ) -> None:
        self.config = config
        self.model_name = config.model
        path = resolve_model(config.model)
        self.model_config = load_model_config(path)
        vision = load_vision_config(path)
        self.image_token_id = vision.image_token_id if vision is not None else None
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(path)
        self.eos_token_ids = eos_token_ids(self.tokenizer)
        self.max_model_len = context_length(
            config, self.model_config.max_position_embeddings, self.model_config.sliding_window
        )
        weights = None if is_random_shape(path) else path
        self.runner = ModelRunner(
            config, self.model_config, weights, self.max_model_len, expert_group
        )
        dtype = str(self.runner.dtype).removeprefix("torch.")
        tag = "" if config.cpu_weights == "auto" else f"+{config.cpu_weights}-weights"
        if config.quantization is not None:
            tag += f"+{config.quantization}-weights"
        if config.kv_cache_dtype != "auto":  # its rows' layout too: blocks of another don't fit
            tag += f"+{config.kv_cache_dtype}-kv{self.runner.kv_groups[0].spec.scale_values}"
        if len(self.runner.kv_groups) > 1:
            tag += "+window-groups"  # a block holds the global layers only
            if config.window_replay_allowance is not None:
                # Blocks computed after a bounded replay are close to, not equal to, an
                # uncached run's: a deployment replaying exactly never reads them.
                tag += "+bounded-replay"
        root = hash_root(config.model, dtype + tag, config.block_size)
        self.block_manager = block_manager(config, self.runner, root)
        self.scheduler = Scheduler(config, self.block_manager)
        self.prefix_cache = (
            PrefixCache(self.block_manager, self.runner, block_store, cache_events)
            if config.enable_prefix_caching and (block_store or cache_events)
            else None
        )
        self.sampler = Sampler(config.seed)
        self.spec = build_speculator(config, self.runner, self.max_model_len)
        native = getattr(self.runner.model, "native_decode", None)
        if self.spec is not None and native is not None:
            self.spec.max_rows = native.max_rows - 1
        if self.spec is not None and self.spec.config.dynamic:
            self._measure_steps(self.spec)
        self.expert_load = ExpertLoadRecorder(self.runner.model, config.record_expert_load)
        self.eplb = live_rebalancer(self.runner.model, config.eplb)
        self.handoff = KVHandoff(self.block_manager, self.runner)
        self.requests: dict[str, Request] = {}
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.prompt_tokens_computed = 0
        self.generation_tokens = 0
        self._inflight: InflightStep | None = None
        eos, budget = self.eos_token_ids, config.grammar_budget_s
        self.constraints = Constraints(self.tokenizer, self.model_config.vocab_size, eos, budget)
        self.num_overlapped_steps = 0
        self.num_steps = 0
        self.phases = PhaseTimer()
        """Seconds of ``step`` by phase: schedule, forward (launch; with a synchronous step
        also the device time up to the sampled tokens), wait (for an overlapped step's tokens),
        outputs (append, detokenize, stop checks)."""
        overlapped = self.runner.overlapped
        self._overlap_batch = overlapped.max_batch if overlapped is not None else 0

    def _measure_steps(self, spec: Speculator) -> None:
        """Time the device's decode step by rows, up to the most a verify step may have: the
        curve dynamic speculation plans with (engine/spec/dynamic.py)."""
        config = self.config
        rows = config.max_num_seqs * (1 + spec.config.num_speculative_tokens)
        rows = min(rows, config.max_num_batched_tokens, spec.max_rows or rows)
        spec.measure(time_decode_rows(self.runner, rows), self.runner.overlapped is not None)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        prefill_only: bool = False,
        traffic_class: str | None = None,
        images: list[ImageInput] | None = None,
        resumed: int = 0,
        resumed_chars: int = 0,
    ) -> None:
        """Queue a request; ValueError if it can never be served.

        prefill_only: compute the prompt and sample the first token, then hand the KV over
        (``pop_prefilled``) instead of decoding here. traffic_class: the retention class under
        which its blocks are kept in the block store (None: the store's default).
        images: the prompt's images with their embeddings (a vision-language model only).
        resumed: the prompt's last tokens that are output of an earlier run, of whose text the
        client has resumed_chars characters (engine/resume.py)."""
        req = self.build_request(request_id, prompt, params, images, resumed, resumed_chars)
        req.prefill_only = prefill_only
        req.traffic_class = traffic_class
        self._register(req)
        self.scheduler.add(req)

    def build_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        images: list[ImageInput] | None = None,
        resumed: int = 0,
        resumed_chars: int = 0,
    ) -> Request:
        """A validated request for this engine, not queued yet; ValueError if it can never be
        served or its id is in use. resumed, resumed_chars: engine/resume.py."""
        if request_id in self.requests or request_id in self.handoff.reserved:
            raise ValueError(f"request id {request_id!r} is already in use")
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        vocab, blocks = self.model_config.vocab_size, self.block_manager
        check_prompt(token_ids, params, vocab, self.max_model_len, blocks)
        images = sorted(images or [], key=lambda i: i.span.offset)
        check_images(token_ids, images, self.image_token_id, self.model_config.hidden_size)
        req = Request(request_id, token_ids, params, text, self.eos_token_ids, images)
        if params.structured_outputs is not None:
            req.grammar = self.constraints.matcher(params.structured_outputs)
        resume(req, resumed, resumed_chars)
        return req

    def compile_grammar(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        """The constraint compiled against this engine's vocabulary (structured/constraints.py)."""
        return self.constraints.compile(spec)

    def _register(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.detokenizers[req.request_id] = IncrementalDetokenizer.for_request(self.tokenizer, req)

    def admit_prefilled(self, req: Request, first: SampleResult) -> RequestOutput:
        """Decode here a request whose prompt KV is already in its committed blocks and whose
        first token was sampled on another engine (engine/kv_handoff.py)."""
        self._register(req)
        self.append_token(req, first)
        if not req.is_finished:
            req.admitted = True
            self.scheduler.add(req)
        return self.output(req)

    def abort_request(self, request_id: str) -> None:
        self.handoff.cancel(request_id)
        req = self.requests.pop(request_id, None)
        self.detokenizers.pop(request_id, None)
        if req is not None:
            self.scheduler.finish(req)
            if self.spec is not None:
                self.spec.release(req)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight is not None

    def step(self) -> list[RequestOutput]:
        """One scheduler step; returns the outputs of the requests that got a token.

        With overlapped scheduling (engine/overlap.py) a decode step is launched and the
        outputs returned are those of the step launched before it."""
        phases = self.phases
        phases.start()
        inflight, max_batch = self._inflight, self._overlap_batch
        spec, running = self.spec, self.scheduler.running
        if inflight is not None and (
            not can_continue(self.scheduler, inflight, max_batch)
            or (spec is not None and any(spec.limits(running)))
        ):
            self._inflight = None
            phases.lap("schedule")
            return self._read(inflight)
        if spec is not None and inflight is None:
            spec.propose(running)
        batch = self.scheduler.schedule()
        phases.lap("schedule")
        if batch.is_empty:
            if spec is not None:
                spec.idle()
            self.constraints.wait_for_masks(self.scheduler.running)
            return []
        self.num_steps += 1
        self.expert_load.mark_step()
        if max_batch and is_decode_batch(batch, max_batch):
            if spec is not None:
                spec.overlapped(batch.requests)
            return self._overlap(batch, inflight)
        assert inflight is None, "a synchronous step while a decode step is in flight"
        logits, sampled = self.runner.run(batch)
        results = (
            [] if spec is not None else self.sampler(logits, [batch.requests[i] for i in sampled])
        )
        phases.lap("forward")
        self._advance(batch)
        drawn = (
            spec.verify(batch, sampled, logits, self.sampler, self.block_manager)
            if spec is not None  # draft positions are sampled one by one: engine/spec/
            else [(i, result, False) for i, result in enumerate(results)]
        )
        outputs = self._outputs(batch, sampled, drawn)
        if self.prefix_cache is not None:
            self.prefix_cache.flush()
        phases.lap("outputs")
        return outputs

    def _outputs(
        self,
        batch: ScheduledBatch,
        sampled: list[int],
        drawn: Iterable[tuple[int, SampleResult, bool]],
    ) -> list[RequestOutput]:
        """Append each token drawn: (its request's index in ``sampled``, the token, whether
        it matched the request's draft, in which case the request draws its next position)."""
        outputs: dict[int, RequestOutput] = {}
        for i, result, matched in drawn:
            req = batch.requests[sampled[i]]
            if req.prefill_only:
                outputs[i] = self.hand_over(req, result)
                continue
            self.append_token(req, result)
            if not matched or req.is_finished:
                outputs[i] = self.output(req)
        return [outputs[i] for i in sorted(outputs)]

    def _overlap(self, batch: ScheduledBatch, inflight: InflightStep | None) -> list[RequestOutput]:
        """Launch a decode step, then read the step launched before it. With grammars in the
        batch the step's argmax waits for that read: the masks need the tokens it appends."""
        constrained = any(req.grammar is not None for req in batch.requests)
        if constrained:
            logits = self.runner.launch_logits(batch, inflight)
        else:
            self._inflight = self.runner.launch_decode(batch, inflight)
        self.num_overlapped_steps += 1
        for req in batch.requests:
            req.num_computed_tokens += 1
            req.num_pending += 1
        self.phases.lap("forward")
        outputs = self._read(inflight) if inflight is not None else []
        if constrained:
            # A request that finished in the read keeps its row unmasked; its token is dropped.
            grammars = [None if req.is_finished else req.grammar for req in batch.requests]
            self._inflight = self.runner.launch_masked(batch, logits, grammars)
            self.phases.lap("mask")
        return outputs

    def hand_over(self, req: Request, result: SampleResult) -> RequestOutput:
        """A prefill_only request sampled its first token: its KV is copied out for the
        decode side (``handoff.pop_prefilled``) and it leaves this engine."""
        self.handoff.hold(req, result)
        req.output_token_ids.append(result.token_id)
        req.finish("prefilled")
        self.scheduler.finish(req)
        self.requests.pop(req.request_id, None)
        self.detokenizers.pop(req.request_id, None)
        return req.to_output()

    def _read(self, step: InflightStep) -> list[RequestOutput]:
        """The outputs of an overlapped step, once its tokens have reached the host."""
        outputs = []
        token_ids = step.token_ids()
        self.phases.lap("wait")
        for req, token in zip(step.batch.requests, token_ids):
            if req.is_finished or self.requests.get(req.request_id) is not req:
                continue  # it finished in the step before, or was aborted: drop the token
            req.num_pending -= 1
            self.append_token(req, SampleResult(token), commit=True)
            outputs.append(self.output(req))
        if self.prefix_cache is not None:
            self.prefix_cache.flush()
        self.phases.lap("outputs")
        return outputs

    def _advance(self, batch: ScheduledBatch) -> None:
        for req, num_new in zip(batch.requests, batch.num_new_tokens):
            if req.num_computed_tokens < req.num_prompt_tokens:
                self.prompt_tokens_computed += min(
                    num_new, req.num_prompt_tokens - req.num_computed_tokens
                )
            req.num_computed_tokens += num_new
            self.block_manager.commit(req)

    def append_token(self, req: Request, result: SampleResult, commit: bool = False) -> None:
        """Append a sampled token and check the stop conditions. commit: publish the blocks
        this token completes (an overlapped step computed their KV before the token was known
        here)."""
        token, params = result.token_id, req.params
        req.output_token_ids.append(token)
        if commit:
            self.block_manager.commit(req)
        self.generation_tokens += 1
        if result.logprobs is not None and result.logprob is not None:
            for token_id, entry in result.logprobs.items():
                entry.decoded_token = self.tokenizer.decode([token_id])
            req.output_logprobs.append(result.logprobs)
            req.cumulative_logprob += result.logprob
        detok = self.detokenizers[req.request_id]
        past_min = req.num_output_tokens > params.min_tokens
        stop_string = detok.add(token, check_stop=past_min or not params.min_tokens)
        grammar_done = req.grammar is not None and self.constraints.advance(req, token)
        if req.grammar is not None and req.grammar.over_budget:
            req.finish("error", req.grammar.budget_message())
        elif grammar_done or (token in self.eos_token_ids and not params.ignore_eos):
            req.finish("stop")
        elif token in params.stop_token_ids:
            req.finish("stop", token)
        elif stop_string is not None:
            req.finish("stop", stop_string)
        elif (
            req.num_output_tokens == params.max_tokens
            or req.num_prompt_tokens + req.num_output_tokens >= self.max_model_len
        ):
            req.finish("length")
        if req.is_finished:
            if stop_string is None:
                detok.flush()
            self.scheduler.finish(req)
            if self.spec is not None:
                self.spec.release(req)
        elif req.grammar is not None:
            req.grammar.fill_ahead()

    def output(self, req: Request) -> RequestOutput:
        detok = self.detokenizers[req.request_id]
        req.output_text = detok.visible_text(req.is_finished)
        output = req.to_output()
        if req.is_finished:
            del self.requests[req.request_id]
            del self.detokenizers[req.request_id]
        return output

    def stats(self) -> EngineStats:
        counters = self.spec.counters if self.spec is not None else None
        tokens = self.prompt_tokens_computed, self.generation_tokens
        return engine_stats(self.scheduler, self.block_manager, *tokens, counters)


def block_manager(config: EngineConfig, runner: ModelRunner, root: int) -> BlockManager:
    """The block manager of the runner's KV cache groups: with sliding-window groups, one
    that gives each its own table (engine/hybrid_blocks.py)."""
    args = (runner.num_blocks, config.block_size, config.enable_prefix_caching, root)
    entry_tokens = runner.kv_groups[0].spec.entry_tokens
    if len(runner.kv_groups) == 1:
        return BlockManager(*args, entry_tokens)
    windows = [(n, g.window or 0) for n, g in zip(runner.window_blocks, runner.kv_groups[1:])]
    return HybridBlockManager(*args, windows, config.window_replay_allowance, entry_tokens)
