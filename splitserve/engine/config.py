"""The engine's own configuration: one frozen dataclass passed to every component."""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.engine.spec.config import SpeculativeConfig


@dataclass(frozen=True)
class EPLBConfig:
    """Expert-parallel load balancing while serving (engine/expert_rebalance.py): every
    ``interval_steps`` steps the group counts each MoE layer's expert load since the last
    rebalance, places ``redundant_experts`` extra copies of the hottest experts and packs
    the copies onto its ranks (splitserve/eplb/), and moves the weights between the ranks."""

    interval_steps: int = 1000
    redundant_experts: int = 0

    def __post_init__(self) -> None:
        if self.interval_steps < 1:
            raise ValueError("eplb.interval_steps must be at least 1")
        if self.redundant_experts < 0:
            raise ValueError("eplb.redundant_experts must be non-negative")


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
    cpu_weights: str = "auto"
    """CPU projection weights: "auto" keeps a GGUF file's quantized blocks where the native
    kernels read them (float32 otherwise, and always with ``dtype="float32"``); "bfloat16"
    holds every projection and the LM head in bfloat16 for oneDNN, the activations, attention
    and KV cache float32 (``engine/layers/bf16_linear.py``): faster at many rows, not the
    float32 oracle's arithmetic, so opt-in."""
    quantization: str | None = None
    """"fp8": the decoder layers' projections and routed experts hold e4m3 weights with one
    float32 scale per 128 x 128 block and multiply FP8 x FP8, the input quantized per token
    and 128-channel group (``engine/layers/fp8_linear.py``); a DeepSeek-format FP8
    checkpoint loads its blocks as they are, any other checkpoint (or ``shape:``) is quantized
    at load. None: the weights keep the checkpoint's values in ``dtype``."""
    kv_cache_dtype: str = "auto"
    """"fp8": the KV cache holds e4m3 values with one float32 scale per token and KV head,
    stored inside the block (``engine/layers/fp8_kv.py``), read by both attention backends
    (DeepSeek-V4's compressed caches do not take it yet); "auto": the model's dtype."""
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_bytes: int = 1 << 30
    gpu_memory_utilization: float = 0.85
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    hybrid_kv_cache: bool = True
    """Models with sliding-window layers (Gemma 3) keep those layers' KV in KV cache groups of
    their own that hold only the window (engine/hybrid_blocks.py); False: every layer keeps
    the whole context in one group."""
    window_replay_allowance: int | None = None
    """On a prefix hit with window groups, their KV is rebuilt by replaying the prefix's last
    window + this many tokens (bounded replay, close to but not equal to an uncached run);
    None replays the whole prefix (exact)."""
    attention_backend: str = "auto"
    """auto (triton on CUDA with Triton installed, else torch), torch or triton."""
    cuda_graph_max_batch: int = 512
    overlap_scheduling: bool | None = None
    """Prepare decode step N+1 while the device runs step N (engine/overlap.py); None: on
    CUDA only, where the host's work can hide behind the device's."""
    seed: int = 0
    speculative: SpeculativeConfig | None = None
    """Speculative decoding (engine/spec/, docs/speculative.md); None: off."""
    record_expert_load: bool = False
    """MoE models: keep each step's per-expert load (``engine/expert_load.py``)."""
    expert_load_dir: str | None = None
    """With ``record_expert_load``, a served worker writes the recorded load to this
    directory, ``<worker id>-g<generation>-<part>.json`` every 1024 steps and when it stops
    (the simulator's ``--trace-dir``); None: it is kept for ``LLMEngine.expert_load.take``."""
    expert_parallel_size: int = 1
    """MoE models: the experts are sharded over this many engine processes of one
    torch.distributed group, this one its rank (``engine/expert_parallel.py``)."""
    expert_slots: tuple[tuple[int, ...], ...] | None = None
    """An EPLB placement for them: each rank's logical experts (-1: empty slot); with
    ``expert_shares``, the fraction of its expert's rows each slot serves. None: contiguous."""
    expert_shares: tuple[tuple[float, ...], ...] | None = None
    eplb: EPLBConfig | None = None
    """Rebalance the experts of an expert-parallel group while serving (None: the placement
    stays as it started); it reads the load counters, so not with ``record_expert_load``."""
    deterministic: bool = False
    """Batch-invariant inference (``engine/layers/batch_invariant.py``): every row of a step is
    computed the same way whatever else shares the step, so a prompt's logprobs and tokens are
    the same bits alone or batched, chunked any way, with or without a prefix-cache hit, and
    speculative decoding keeps exactly the plain greedy tokens. On the CPU (float32) and on
    CUDA (the Triton kernels, ``engine/layers/batch_invariant_kernels.py``), for dense models
    attending over their whole context (Llama family, Qwen); slower (docs/engine.md)."""
    grammar_budget_s: float = 10.0
    """The CPU seconds a structured-output request's constraint work (token masks and
    accepts) may take in all; past it the request ends with finish_reason "error"
    (engine/structured/matcher.py)."""

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
        if self.cpu_weights not in ("auto", "bfloat16"):
            raise ValueError(f"cpu_weights must be 'auto' or 'bfloat16', not {self.cpu_weights!r}")
        if self.cpu_weights == "bfloat16" and (
            self.device != "cpu" or self.dtype not in ("auto", "float32")
        ):
            raise ValueError(
                "cpu_weights='bfloat16' is for device='cpu' with float32 activations "
                f"(dtype 'auto' or 'float32'), not device={self.device!r} dtype={self.dtype!r}"
            )
        if self.quantization not in (None, "fp8"):
            raise ValueError(f"quantization must be 'fp8' or None, not {self.quantization!r}")
        if self.quantization is not None and (
            self.expert_parallel_size > 1 or self.cpu_weights != "auto"
        ):
            raise ValueError(
                "quantization='fp8' is not built for expert_parallel_size > 1 or with "
                "cpu_weights='bfloat16'"
            )
        if self.kv_cache_dtype not in ("auto", "fp8"):
            raise ValueError(f"kv_cache_dtype must be 'auto' or 'fp8', not {self.kv_cache_dtype!r}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(
                f"attention_backend must be auto, torch or triton, not {self.attention_backend!r}"
            )
        if self.deterministic:
            self._check_deterministic()
        if self.window_replay_allowance is not None and self.window_replay_allowance < 0:
            raise ValueError("window_replay_allowance must be at least 0 (or None: exact)")
        if self.grammar_budget_s <= 0:
            raise ValueError("grammar_budget_s must be positive")
        if self.expert_load_dir is not None and not self.record_expert_load:
            raise ValueError("expert_load_dir needs record_expert_load")
        if self.eplb is not None and self.record_expert_load:
            raise ValueError("eplb and record_expert_load both read the expert load counters")

    def _check_deterministic(self) -> None:
        """What deterministic mode is built for: the CPU in float32 (the native kernels), CUDA
        on the Triton kernels without FP8."""
        if self.device == "cpu":
            if self.cpu_weights != "auto" or self.dtype not in ("auto", "float32"):
                raise ValueError(
                    "deterministic on device='cpu' is built in float32 with cpu_weights='auto' "
                    f"only so far, not dtype={self.dtype!r} cpu_weights={self.cpu_weights!r}"
                )
        elif not self.device.startswith("cuda"):
            raise ValueError(f"deterministic is built for cpu and cuda, not {self.device!r}")
        elif (
            self.attention_backend == "torch"
            or self.quantization is not None
            or self.kv_cache_dtype != "auto"
            or self.expert_parallel_size > 1
        ):
            raise ValueError(
                "deterministic on CUDA needs the Triton attention backend, no FP8 (weights or "
                "KV cache) and no expert parallelism, not "
                f"attention_backend={self.attention_backend!r} quantization="
                f"{self.quantization!r} kv_cache_dtype={self.kv_cache_dtype!r} "
                f"expert_parallel_size={self.expert_parallel_size}"
            )
