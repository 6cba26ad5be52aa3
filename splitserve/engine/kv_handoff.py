"""Prefill/decode handoff inside one engine: export a prefilled request's KV, or reserve
blocks for a request prefilled elsewhere and adopt it once its KV has arrived.

The engine stays transport-agnostic: workers move the tensors (kvstore/transfer.py). This
class keeps the KV side (the reservations, the prefilled KV waiting to be sent) with the
engine's block manager and model runner; the engine keeps the requests' lifecycle: a worker
builds a request with ``LLMEngine.build_request`` before ``reserve``, and hands what ``adopt``
returns to ``LLMEngine.admit_prefilled``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from splitserve.engine.block_manager import BlockManager
from splitserve.engine.hybrid_blocks import HybridBlockManager
from splitserve.engine.model_runner import ModelRunner
from splitserve.engine.request import Logprob, Request
from splitserve.engine.sampler import SampleResult
from splitserve.engine.vision.multimodal import ImageInput


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

    def __init__(self, block_manager: BlockManager, runner: ModelRunner) -> None:
        self.block_manager = block_manager
        self.runner = runner
        self.prefilled: dict[str, Prefilled] = {}
        self.reserved: dict[str, Request] = {}

    # Prefill side.
    def hold(self, req: Request, result: SampleResult) -> None:
        """A prefill_only request sampled its first token: copy its KV out before the engine
        frees its blocks, and keep it until ``pop_prefilled``."""
        num_blocks = self.block_manager.blocks_needed(req.num_prompt_tokens)
        kv = self.runner.gather_blocks(req.block_table[:num_blocks])
        if req.window_tables:
            kv = self._with_windows(kv, req)
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
    def reserve(self, req: Request) -> bool:
        """Reserve blocks for a request whose prompt is prefilled elsewhere (built by
        ``LLMEngine.build_request``, not queued); False when none are free now."""
        manager = self.block_manager
        if isinstance(manager, HybridBlockManager):
            reserved = manager.reserve_adopted(req)
        else:
            reserved = manager.allocate_slots(req, req.num_prompt_tokens)
        if not reserved:
            return False
        self.reserved[req.request_id] = req
        return True

    def receive_buffer(self, request_id: str) -> torch.Tensor:
        req = self.reserved[request_id]
        shape = self.transfer_shape(req.num_prompt_tokens)
        return torch.empty(shape, dtype=self.runner.kv_dtype, device=self.runner.device)

    def transfer_shape(self, num_tokens: int) -> tuple[int, ...]:
        """The shape of the KV a prompt of ``num_tokens`` tokens hands over: group 0's blocks
        ([parts, layers, blocks, ...]), or with window groups every group's blocks flattened
        into one row (group 0's, then each window group's window)."""
        shape = self.runner.kv_shape(self.block_manager.blocks_needed(num_tokens))
        if not self.runner.window_blocks:
            return shape
        sizes = [math.prod(shape)] + [math.prod(s) for s in self._window_shapes(num_tokens)]
        return (sum(sizes),)

    def _window_shapes(self, num_tokens: int) -> list[tuple[int, ...]]:
        """The shape of each window group's part of a handoff of ``num_tokens`` tokens."""
        first, end = self._window_span(num_tokens)
        shapes: list[tuple[int, ...]] = []
        for cache in self.runner.kv_caches[1:]:
            parts, layers, _, block, heads, dim = cache.shape
            shapes.append((parts, layers, end - first, block, heads, dim))
        return shapes

    def _window_span(self, num_tokens: int) -> tuple[int, int]:
        """The block indices [first, end) of the window groups that a handoff carries."""
        manager = self.block_manager
        assert isinstance(manager, HybridBlockManager)
        first = manager.adopted_window_from(num_tokens) // manager.block_size
        return first, manager.blocks_needed(num_tokens)

    def _with_windows(self, kv: torch.Tensor, req: Request) -> torch.Tensor:
        first, end = self._window_span(req.num_prompt_tokens)
        parts = [kv.flatten()]
        for cache, table in zip(self.runner.kv_caches[1:], req.window_tables):
            ids = torch.tensor(table[first:end], device=cache.device)
            parts.append(cache[:, :, ids].flatten())
        return torch.cat(parts)

    def adopt(
        self,
        request_id: str,
        kv: torch.Tensor,
        first_token: int,
        logprobs: dict[int, Logprob] | None = None,
        image_embeddings: torch.Tensor | None = None,
    ) -> tuple[Request, SampleResult]:
        """Write the received KV into the reserved blocks; returns the request and its first
        token, for ``LLMEngine.admit_prefilled`` to continue decoding it here.

        image_embeddings: the prompt's images' embeddings (Prefilled.image_embeddings)."""
        req = self.reserved.pop(request_id)
        lengths = [image.span.length for image in req.images]
        if image_embeddings is not None and image_embeddings.shape[0] == sum(lengths):
            for image, part in zip(req.images, image_embeddings.split(lengths)):
                image.embeddings = part
        if req.window_tables:
            kv = self._scatter_windows(kv, req)
        num_blocks = kv.shape[2]
        self.runner.scatter_blocks(req.block_table[:num_blocks], kv)
        req.num_computed_tokens = req.num_prompt_tokens
        self.block_manager.commit(req)
        logprob = None if logprobs is None else logprobs[first_token].logprob
        return req, SampleResult(first_token, logprob, logprobs)

    def _scatter_windows(self, flat: torch.Tensor, req: Request) -> torch.Tensor:
        """Write a flat handoff's window parts into req's window blocks; returns its group-0
        part shaped as blocks."""
        num_tokens = req.num_prompt_tokens
        shape = self.runner.kv_shape(self.block_manager.blocks_needed(num_tokens))
        shapes = self._window_shapes(num_tokens)
        pieces = flat.split([math.prod(shape)] + [math.prod(s) for s in shapes])
        first, end = self._window_span(num_tokens)
        for cache, table, piece, part in zip(
            self.runner.kv_caches[1:], req.window_tables, pieces[1:], shapes
        ):
            ids = torch.tensor(table[first:end], device=cache.device)
            cache[:, :, ids] = piece.view(part).to(cache.device, cache.dtype)
        return pieces[0].view(shape)

    def cancel(self, request_id: str) -> None:
        """Drop a reservation (transfer failed or timed out) and free its blocks."""
        req = self.reserved.pop(request_id, None)
        if req is not None:
            self.block_manager.free(req)
            self.block_manager.forget(request_id)
        self.prefilled.pop(request_id, None)


def _joined_embeddings(images: list[ImageInput]) -> torch.Tensor | None:
    if not images or any(image.embeddings is None for image in images):
        return None
    return torch.cat([image.embeddings for image in images]).contiguous()  # type: ignore[misc]
