"""A draft model: a smaller model of the target's tokenizer, with a paged KV cache of its own.

The drafter runs its own ``ModelRunner`` and ``BlockManager`` on the target's device, inside
the same engine (so the same worker). For each request it keeps a shadow ``Request`` whose
tokens are the target's plus the drafts it last proposed, and whose computed tokens are the
ones with KV in the draft cache. When it next proposes, the shadow is rebuilt from the
target's tokens: its KV is kept up to the first token that differs (a rejected draft) and its
tail blocks past that go back (``BlockManager.trim``, the same rollback as the target's).
It then computes the tokens it has not seen (at least the target's newest) and decodes its
drafts greedily, all requests batched in each of those steps.
"""

from __future__ import annotations

import dataclasses

from splitserve.engine.block_manager import BlockManager
from splitserve.engine.config import EngineConfig
from splitserve.engine.loader import is_random_shape, load_model_config, resolve_model
from splitserve.engine.model_runner import ModelRunner
from splitserve.engine.request import Request
from splitserve.engine.sampler import greedy_tokens
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.scheduler import ScheduledBatch
from splitserve.engine.spec.drafter import Drafter

GREEDY = SamplingParams(temperature=0.0)


class DraftModelDrafter(Drafter):
    def __init__(self, config: EngineConfig, vocab_size: int, max_model_len: int) -> None:
        spec = config.speculative
        assert spec is not None and spec.model is not None
        path = resolve_model(spec.model)
        model_config = load_model_config(path)
        if model_config.vocab_size != vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({model_config.vocab_size}) is not the "
                f"target's ({vocab_size}): it needs the same tokenizer"
            )
        draft = dataclasses.replace(
            config,
            model=spec.model,
            num_kv_blocks=None,
            kv_cache_bytes=spec.draft_kv_cache_bytes,
            enable_prefix_caching=False,
            overlap_scheduling=False,
            speculative=None,
            hybrid_kv_cache=False,  # its shadows have one block table
            seed=config.seed if spec.draft_seed is None else spec.draft_seed,
        )
        self.max_model_len = min(max_model_len, model_config.max_position_embeddings)
        weights = None if is_random_shape(path) else path
        self.runner = ModelRunner(draft, model_config, weights, self.max_model_len)
        self.blocks = BlockManager(self.runner.num_blocks, draft.block_size, False, 0)
        self.shadows: dict[str, Request] = {}

    def propose(self, reqs: list[Request], limits: list[int]) -> list[list[int]]:
        batch = ScheduledBatch()
        for req, k in zip(reqs, limits):
            shadow = self._shadow(req, k)
            if shadow is not None:
                batch.add(shadow, shadow.num_tokens - shadow.num_computed_tokens)
        wanted = {r.request_id: k for r, k in zip(reqs, limits)}
        while not batch.is_empty:
            batch = self._step(batch, wanted)
        return [self._drafts(req) for req in reqs]

    def passes(self, limits: list[int]) -> int:
        return max(limits, default=0)

    def release(self, req: Request) -> None:
        shadow = self.shadows.pop(req.request_id, None)
        if shadow is not None:
            self.blocks.free(shadow)

    def _step(self, batch: ScheduledBatch, wanted: dict[str, int]) -> ScheduledBatch:
        """One draft-model step over the batch; the requests that want another draft."""
        logits, sampled = self.runner.run(batch)
        tokens = greedy_tokens(logits).tolist()
        following = ScheduledBatch()
        for index, token in zip(sampled, tokens):
            shadow = batch.requests[index]
            shadow.num_computed_tokens += batch.num_new_tokens[index]
            shadow.output_token_ids.append(token)
            if shadow.num_output_tokens < wanted[shadow.request_id]:
                following.add(shadow, 1)
        return following

    def _shadow(self, req: Request, k: int) -> Request | None:
        """req's shadow with its KV rolled back to the target's tokens and blocks for k
        drafts; None (and the request's draft KV freed) where the draft cache has no room."""
        tokens = req.all_token_ids
        shadow = Request(req.request_id, tokens, GREEDY)
        old = self.shadows.get(req.request_id)
        if old is not None:
            shadow.block_table = old.block_table
            shadow.num_computed_tokens = min(_valid(old, tokens), len(tokens) - 1)
            self.blocks.trim(shadow, shadow.num_computed_tokens)
        self.shadows[req.request_id] = shadow
        needed = len(tokens) + k - 1 - shadow.num_computed_tokens
        if len(tokens) + k > self.max_model_len or not self.blocks.allocate_slots(shadow, needed):
            self.release(req)
            return None
        return shadow

    def _drafts(self, req: Request) -> list[int]:
        shadow = self.shadows.get(req.request_id)
        return list(shadow.output_token_ids) if shadow is not None else []


def _valid(old: Request, tokens: list[int]) -> int:
    """Tokens of the old shadow with KV that are still the target's: its prompt (the target's
    tokens then) and the drafts that the target kept."""
    valid = old.num_prompt_tokens
    for draft, token in zip(old.output_token_ids, tokens[valid:]):
        if draft != token:
            break
        valid += 1
    return min(valid, old.num_computed_tokens)
