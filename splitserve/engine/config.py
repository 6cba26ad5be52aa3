"""The engine's own configuration: one frozen dataclass passed to every component."""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.engine.spec.config import SpeculativeConfig


@dataclass(frozen=True)
class EngineConfig:
    """One model replica on its device.

    model: a path to a GGUF file, a Hugging Face directory, or an alias such as
    ``smollm2-135m-instruct``. num_kv_blocks=None sizes the KV pool from kv_cache_bytes
    (CPU) or from gpu_memory_utilization (CUDA). cuda_graph_max_batch: decode steps up to this
    batch size (and up to max_num_seqs) replay CUDA graphs (0 disables; ignored on CPU).
    """

    model: str = "smollm2-135m-instruct"
    device: str = "cpu"
    dtype: str = "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_bytes: int = 1 << 30
    gpu_memory_utilization: float = 0.85
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    attention_backend: str = "torch"
    cuda_graph_max_batch: int = 512
    overlap_scheduling: bool | None = None
    """Prepare decode step N+1 while the device runs step N (engine/overlap.py); None: on
    CUDA only, where the host's work can hide behind the device's."""
    seed: int = 0
    speculative: SpeculativeConfig | None = None
    """Speculative decoding (engine/spec/, docs/speculative.md); None: off."""
    record_expert_load: bool = False
    expert_parallel_size: int = 1
    """MoE models: the experts are sharded over this many engine processes of one
    torch.distributed group, this one its rank (``engine/expert_parallel.py``)."""
    expert_slots: tuple[tuple[int, ...], ...] | None = None
    """An EPLB placement for them: each rank's logical experts (-1: empty slot); with
    ``expert_shares``, the fraction of its expert's rows each slot serves. None: contiguous."""
    expert_shares: tuple[tuple[float, ...], ...] | None = None
    """MoE models: keep each step's per-expert load (``engine/expert_load.py``)."""

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError("block_size must be a power of two")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be at least 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be at least 1")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("num_kv_blocks must be at least 1")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"unsupported dtype {self.dtype!r}")
