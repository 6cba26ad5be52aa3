"""What an engine can serve: its context length, and the checks a prompt passes before it
becomes a request (a ValueError names what is wrong)."""

from __future__ import annotations

from splitserve.engine.block_manager import BlockManager
from splitserve.engine.config import EngineConfig
from splitserve.engine.sampling_params import SamplingParams


def context_length(config: EngineConfig, max_positions: int, window: int | None) -> int:
    """The engine's max_model_len: the model's positions (or its sliding window), at most
    the config's."""
    limit = min(max_positions, window) if window else max_positions
    return min(config.max_model_len, limit) if config.max_model_len else limit


def check_prompt(
    token_ids: list[int],
    params: SamplingParams,
    vocab: int,
    max_model_len: int,
    blocks: BlockManager,
) -> None:
    if not token_ids:
        raise ValueError("the prompt is empty")
    if min(token_ids) < 0 or max(token_ids) >= vocab:
        raise ValueError(f"prompt token ids must be in [0, {vocab})")
    total = len(token_ids) + (params.max_tokens or 1)
    if total > max_model_len:
        raise ValueError(
            f"the prompt ({len(token_ids)} tokens) plus max_tokens ({params.max_tokens}) "
            f"exceeds the context length of {max_model_len} tokens"
        )
    if blocks.blocks_needed(total) > blocks.num_blocks:
        raise ValueError("the request needs more KV blocks than this worker has")
