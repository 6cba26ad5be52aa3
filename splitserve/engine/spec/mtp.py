"""The MTP drafter: DeepSeek-V3's multi-token-prediction layer or V4's MTP block proposes
the drafts.

At position i the MTP layer reads token i + 1 and the target's hidden state at i (V4: its
residual streams) and predicts token i + 2 (``models/deepseek_mtp.py``,
``models/deepseek_v4_mtp.py``); it keeps a cache of its own, in a ``ModelRunner`` and
``BlockManager`` of its own on the target's device. For each request it
keeps a shadow ``Request`` whose tokens are the target's shifted by one (its token at
position i is the target's i + 1) and the target hidden states of the positions it has not
computed yet, collected from every target step (``observe``).

Proposing for a request whose newest token sits at position e: the MTP computes positions up
to e - 1 from the target's hidden states (the last of them gives the first draft), then
each further draft from the one before and the MTP's own output hidden state, one position at
a time (chained). Positions below e - 1 keep their MTP cache for good (their tokens and target
hidden states are final); e - 1 is recomputed with the next target step's rows and the
chained positions are recomputed from the target's hidden states once it has verified them.

Drafts need the target hidden state of every position: a request adopted from a prefill
worker (the prompt's hidden states stayed there) gets none. The target's steps must run
eagerly: CUDA graphs and overlapped steps return no hidden states.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from splitserve.engine.block_manager import BlockManager
from splitserve.engine.config import EngineConfig
from splitserve.engine.loader import is_random_shape, resolve_model
from splitserve.engine.model_runner import ModelRunner, step_order
from splitserve.engine.models.deepseek_mtp import DeepseekMTP
from splitserve.engine.models.deepseek_v2 import DeepseekV2ForCausalLM as DeepseekV2
from splitserve.engine.models.deepseek_v4 import DeepseekV4ForCausalLM as DeepseekV4
from splitserve.engine.models.deepseek_v4_mtp import DeepseekV4MTP
from splitserve.engine.request import Request
from splitserve.engine.sampler import greedy_tokens
from splitserve.engine.scheduler import ScheduledBatch
from splitserve.engine.spec.draft_model import GREEDY
from splitserve.engine.spec.drafter import Drafter


@dataclass
class MTPState:
    """One request's MTP side: its shadow (computed tokens: the positions whose MTP cache is
    final) and the target hidden states of positions [done, done + len(pending))."""

    shadow: Request
    pending: torch.Tensor
    missed: bool = False
    """A target step's rows never reached the drafter: no more drafts for this request."""

    @property
    def done(self) -> int:
        return self.shadow.num_computed_tokens

    def add(self, start: int, rows: torch.Tensor) -> None:
        """Target hidden states of positions [start, start + len(rows)); pending positions
        from start on (rejected drafts') are replaced."""
        if start + len(rows) <= self.done:
            return
        keep = start - self.done
        if keep > len(self.pending):
            self.missed = True
        elif keep < 0:
            self.pending = rows[-keep:]
        else:
            self.pending = torch.cat([self.pending[:keep], rows])


class MTPDrafter(Drafter):
    def __init__(self, config: EngineConfig, target: ModelRunner, max_model_len: int) -> None:
        spec = config.speculative
        assert spec is not None
        model_config = target.model_config
        model = target.model
        if model_config.mtp_layers < 1 or not isinstance(model, DeepseekV2 | DeepseekV4):
            raise ValueError("speculative method mtp needs a model with an MTP layer")
        if target.graphs is not None or target.overlapped is not None:
            raise ValueError(
                "speculative method mtp reads the target's hidden states, which CUDA graphs "
                "and overlapped steps do not return: set cuda_graph_max_batch=0 and "
                "overlap_scheduling=false"
            )
        model.keep_hidden_states = True
        self.target = model
        draft = dataclasses.replace(
            config,
            num_kv_blocks=None,
            kv_cache_bytes=spec.draft_kv_cache_bytes,
            enable_prefix_caching=False,
            hybrid_kv_cache=False,  # one block table (self.blocks)
            overlap_scheduling=False,
            cuda_graph_max_batch=0,
            speculative=None,
            expert_parallel_size=1,
            expert_slots=None,
            expert_shares=None,
            eplb=None,
            record_expert_load=False,
        )
        path = resolve_model(config.model)
        mtp_config = dataclasses.replace(model_config, architecture=model.mtp_architecture)
        weights = None if is_random_shape(path) else path
        self.runner = ModelRunner(draft, mtp_config, weights, max_model_len)
        assert isinstance(self.runner.model, DeepseekMTP | DeepseekV4MTP)
        self.mtp = self.runner.model
        self.max_model_len = max_model_len
        self.blocks = BlockManager(self.runner.num_blocks, draft.block_size, False, 0)
        self.states: dict[str, MTPState] = {}

    def observe(self, batch: ScheduledBatch) -> None:
        """Keeps the target hidden states of the step just run (its requests' computed
        tokens already counted) for the positions the MTP has not computed."""
        hidden, row = self.target.hidden_states, 0
        for i in step_order(batch):
            req, num_new = batch.requests[i], batch.num_new_tokens[i]
            state = self.states.get(req.request_id)
            if state is None:
                state = MTPState(Request(req.request_id, [], GREEDY), hidden[:0])
                self.states[req.request_id] = state
            state.add(req.num_computed_tokens - num_new, hidden[row : row + num_new])
            row += num_new

    def propose(self, reqs: list[Request], limits: list[int]) -> list[list[int]]:
        batch, previous = ScheduledBatch(), []
        for req, k in zip(reqs, limits):
            state = self._prepare(req, k)
            if state is not None:
                batch.add(state.shadow, len(state.pending))
                previous.append(state.pending)
        proposed = list(batch.requests)
        wanted = {r.request_id: k for r, k in zip(reqs, limits)}
        while not batch.is_empty:
            batch, previous = self._step(batch, previous, wanted)
        drafts = {shadow.request_id: list(shadow.output_token_ids) for shadow in proposed}
        for req in reqs:
            if req.request_id in drafts:
                self._settle(req, self.states[req.request_id])
        return [drafts.get(req.request_id, []) for req in reqs]

    def passes(self, limits: list[int]) -> int:
        return max(limits, default=0)

    def release(self, req: Request) -> None:
        state = self.states.pop(req.request_id, None)
        if state is not None:
            self.blocks.free(state.shadow)

    def _prepare(self, req: Request, k: int) -> MTPState | None:
        """req's state with its shadow rolled back to its final positions and blocks for the
        positions to compute (up to e - 1 from target hidden states, then k - 1 chained);
        None where the MTP cannot draft (rows missed, no room)."""
        state = self.states.get(req.request_id)
        newest = req.num_tokens - 1
        if state is None or state.missed or state.done + len(state.pending) < newest:
            return None
        if state.done >= newest:
            return None
        state.pending = state.pending[: newest - state.done]
        shadow = Request(req.request_id, req.all_token_ids[1:], GREEDY)
        shadow.block_table = state.shadow.block_table
        shadow.num_computed_tokens = state.done
        self.blocks.trim(shadow, shadow.num_computed_tokens)
        state.shadow = shadow
        needed = newest + k - 1 - state.done
        if newest + k > self.max_model_len or not self.blocks.allocate_slots(shadow, needed):
            self.release(req)
            return None
        return state

    def _settle(self, req: Request, state: MTPState) -> None:
        """After proposing: positions below e - 1 keep their cache for good; e - 1 (the first
        draft's) is recomputed with the next rows, its target hidden state kept."""
        state.shadow.num_computed_tokens = req.num_tokens - 2
        state.pending = state.pending[-1:]

    def _step(
        self, batch: ScheduledBatch, previous: list[torch.Tensor], wanted: dict[str, int]
    ) -> tuple[ScheduledBatch, list[torch.Tensor]]:
        """One MTP step; the requests that want another draft, with their hidden states."""
        order = step_order(batch)
        self.mtp.previous_hidden = torch.cat([previous[i] for i in order])
        logits, sampled = self.runner.run(batch)
        tokens = greedy_tokens(logits).tolist()
        ends, row = {}, 0
        for i in order:
            row += batch.num_new_tokens[i]
            ends[i] = row
        following, hidden = ScheduledBatch(), []
        for index, token in zip(sampled, tokens):
            shadow = batch.requests[index]
            shadow.num_computed_tokens += batch.num_new_tokens[index]
            shadow.output_token_ids.append(token)
            if shadow.num_output_tokens < wanted[shadow.request_id]:
                following.add(shadow, 1)
                hidden.append(self.mtp.hidden_states[ends[index] - 1 : ends[index]])
        return following, hidden
