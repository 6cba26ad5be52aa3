"""The model over its paged KV cache, as the helpers below the model runner see it.

The warm-up (engine/warm_up.py) and the decode graphs (engine/cuda_graphs.py) run steps of
the runner's model on the runner's cache; the runner hands itself to them as this Protocol,
so that they depend on these few attributes and not on the runner's module.
"""

from __future__ import annotations

from typing import Protocol

import torch

from splitserve.engine.models.llama import LlamaForCausalLM


class PagedModel(Protocol):
    model: LlamaForCausalLM
    device: torch.device
    block_size: int
    max_blocks_per_seq: int
    """The width of a full block table: the context length in blocks."""
    scratch_block: int
    """A KV block the block manager never hands out: padded rows read and write it."""
    window_blocks: list[int]
    """Each sliding-window KV cache group's pool size, which is also its null block (the
    group's scratch block); empty with one group (engine/kv_groups.py)."""
