"""Prefill/decode handoff inside one engine: export a prefilled request's KV, or reserve
blocks for a request prefilled elsewhere and adopt it once its KV has arrived.

The engine stays transport-agnostic: workers move the tensors (kvstore/transfer.py). This
class keeps the KV side (the reservations, the prefilled KV waiting to be sent); the engine
keeps the requests' lifecycle, through its public ``build_request`` and ``admit_prefilled``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from splitserve.engine.request import Logprob, Request, RequestOutput
from splitserve.engine.sampler import SampleResult
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.vision.multimodal import ImageInput

if TYPE_CHECKING:
    from splitserve.engine.llm_engine import LLMEngine


@dataclass
class Prefilled:
    """What a prefill worker hands over: the prompt's KV blocks and the first token."""

    request_id: str
    prompt_token_ids: list[int]
    kv: torch.Tensor
    first_token: int
    logprobs: dict[int, Logprob] | None
    num_cached_tokens: int
    image_embeddings: torch.Tensor | None = None
    """All images' embeddings in prompt order (None without images): the decode worker
    keeps them, so that it can recompute the prompt if it ever has to preempt it."""


class KVHandoff:
    """Prefill side: ``hold`` (called by the engine's step), ``pop_prefilled``. Decode side:
    ``reserve``, ``receive_buffer``, ``adopt``, or ``cancel`` if the transfer fails."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.prefilled: dict[str, Prefilled] = {}
        self.reserved: dict[str, Request] = {}

    # Prefill side.
    def hold(self, req: Request, result: SampleResult) -> None:
        """A prefill_only request sampled its first token: copy its KV out before the engine
        frees its blocks, and keep it until ``pop_prefilled``."""
        num_blocks = self.engine.block_manager.blocks_needed(req.num_prompt_tokens)
        kv = self.engine.runner.gather_blocks(req.block_table[:num_blocks])
        self.prefilled[req.request_id] = Prefilled(
            req.request_id,
            req.prompt_token_ids,
            kv,
            result.token_id,
            result.logprobs,
            req.num_cached_tokens,
            _joined_embeddings(req.images),
        )

    def pop_prefilled(self, request_id: str) -> Prefilled:
        return self.prefilled.pop(request_id)

    # Decode side.
    def reserve(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        images: list[ImageInput] | None = None,
        resumed: int = 0,
        resumed_chars: int = 0,
    ) -> bool:
        """Reserve blocks for a prompt prefilled elsewhere; False when none are free now.

        images: the prompt's images, for image-aware block hashes of the adopted KV.
        resumed, resumed_chars: output tokens of an earlier run at the prompt's end, and the
        characters of their text the client has (LLMEngine.build_request)."""
        ids = prompt_token_ids
        req = self.engine.build_request(request_id, ids, params, images, resumed, resumed_chars)
        if not self.engine.block_manager.allocate_slots(req, req.num_prompt_tokens):
            return False
        self.reserved[request_id] = req
        return True

    def receive_buffer(self, request_id: str) -> torch.Tensor:
        req = self.reserved[request_id]
        num_blocks = self.engine.block_manager.blocks_needed(req.num_prompt_tokens)
        runner = self.engine.runner
        return torch.empty(runner.kv_shape(num_blocks), dtype=runner.dtype, device=runner.device)

    def adopt(
        self,
        request_id: str,
        kv: torch.Tensor,
        first_token: int,
        logprobs: dict[int, Logprob] | None = None,
        image_embeddings: torch.Tensor | None = None,
    ) -> RequestOutput:
        """Write the received KV into the reserved blocks and continue decoding here.

        image_embeddings: the prompt's images' embeddings (Prefilled.image_embeddings)."""
        engine = self.engine
        req = self.reserved.pop(request_id)
        lengths = [image.span.length for image in req.images]
        if image_embeddings is not None and image_embeddings.shape[0] == sum(lengths):
            for image, part in zip(req.images, image_embeddings.split(lengths)):
                image.embeddings = part
        num_blocks = kv.shape[2]
        engine.runner.scatter_blocks(req.block_table[:num_blocks], kv)
        req.num_computed_tokens = req.num_prompt_tokens
        engine.block_manager.commit(req)
        logprob = None if logprobs is None else logprobs[first_token].logprob
        return engine.admit_prefilled(req, SampleResult(first_token, logprob, logprobs))

    def cancel(self, request_id: str) -> None:
        """Drop a reservation (transfer failed or timed out) and free its blocks."""
        req = self.reserved.pop(request_id, None)
        if req is not None:
            self.engine.block_manager.free(req)
            self.engine.block_manager.forget(request_id)
        self.prefilled.pop(request_id, None)


def _joined_embeddings(images: list[ImageInput]) -> torch.Tensor | None:
    if not images or any(image.embeddings is None for image in images):
        return None
    return torch.cat([image.embeddings for image in images]).contiguous()  # type: ignore[misc]
