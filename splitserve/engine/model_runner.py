"""Builds a step's flat inputs, runs the model over the paged KV cache, returns logits."""

from __future__ import annotations

import math
import mmap
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from splitserve.engine.config import EngineConfig
from splitserve.engine.cuda_graphs import DecodeGraphs, window_groups
from splitserve.engine.kv_cache_spec import KVCacheGroup
from splitserve.engine.kv_groups import StepRows, pool_sizes, window_metadata
from splitserve.engine.layers.attention import AttentionMetadata, PrefillSegment
from splitserve.engine.layers.attention_backends import choose_backend, make_backend
from splitserve.engine.layers.batch_invariant_kernels import make_kernels_invariant
from splitserve.engine.layers.block_linear import interleave_blocks
from splitserve.engine.layers.cpu_gemm import prepack
from splitserve.engine.layers.expert_placement import GroupMember
from splitserve.engine.layers.fp8_kv import fp8_groups
from splitserve.engine.layers.native_decode import NativeDecode
from splitserve.engine.layers.projection_choice import choose_cpu_paths
from splitserve.engine.model_config import ModelConfig
from splitserve.engine.models.llama import LlamaForCausalLM
from splitserve.engine.models.registry import expert_parallel, model_class
from splitserve.engine.overlap import InflightStep
from splitserve.engine.request import Request, decodes
from splitserve.engine.sampler import greedy_tokens
from splitserve.engine.scheduler import ScheduledBatch
from splitserve.engine.vision.multimodal import step_embeddings, touches_images
from splitserve.engine.warm_up import decode_width, warm_up
from splitserve.engine.weight_format import convert_weights, load_checkpoint
from splitserve.kernels.dispatch import triton_available, use_kernels
from splitserve.kernels.fp8_quant import FP8

if TYPE_CHECKING:
    from splitserve.engine.structured.matcher import RequestGrammar

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(config: EngineConfig) -> torch.dtype:
    if config.dtype != "auto":
        return _DTYPES[config.dtype]
    return torch.bfloat16 if config.device.startswith("cuda") else torch.float32


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        weights_path: str | None,
        max_model_len: int,
        expert_group: GroupMember | None = None,
    ) -> None:
        """expert_group: this engine's place in an expert-parallel group its worker formed
        (engine/expert_parallel.py); None: the default torch.distributed group, if any."""
        self.config = config
        self.expert_group = expert_group
        self.model_config = model_config
        self.device = torch.device(config.device)
        self.dtype = resolve_dtype(config)
        self.fp8_kv = config.kv_cache_dtype == "fp8"
        self.kv_dtype = torch.uint8 if self.fp8_kv else self.dtype
        """The KV pool's dtype: the model's, or the bytes of e4m3 rows with their scales
        (fp8_kv.py), which the layers see as float8_e4m3fn and everything that moves
        blocks as bytes (torch indexes no float8 tensor on some versions)."""
        self.block_size = config.block_size
        native = self.device.type == "cpu" and not use_kernels(torch.empty(0))
        self.rows_as_decode = config.deterministic and native  # all rows (batch_invariant.py)
        self.max_blocks_per_seq = -(-max_model_len // config.block_size)
        self.model = self._build_model(weights_path)
        self.num_blocks = self._allocate_kv_cache()
        self.scratch_block = self.num_blocks
        self._copy_stream: torch.cuda.Stream | None = None
        self.warm_up_seconds = 0.0
        if self.device.type == "cuda":
            self.warm_up_seconds = warm_up(self, config.max_num_seqs, config.max_num_batched_tokens)
        self.graphs: DecodeGraphs | None = None
        # No graphs, no overlapped steps: expert parallelism (its exchange's row counts on the
        # host), a model not graph safe, window groups unless the model checked them in graphs.
        windowed = len(self.kv_groups) > 1 and not self.model.window_graphs
        eager = config.expert_parallel_size > 1 or not self.model.graph_safe or windowed
        windows = window_groups(self.kv_groups, self.block_size, self.window_blocks)
        if self.device.type == "cuda" and config.cuda_graph_max_batch > 0 and not eager:
            max_batch = min(config.cuda_graph_max_batch, config.max_num_seqs)
            spec = config.speculative
            rows = config.max_num_seqs * (1 + spec.num_speculative_tokens) if spec else 0
            verify_rows = min(config.cuda_graph_max_batch, rows)
            self.graphs = DecodeGraphs(self, max_batch, True, verify_rows, windows)
        overlap = config.overlap_scheduling and not eager
        if config.overlap_scheduling is None:
            overlap = self.device.type == "cuda" and not eager
        self.overlapped: DecodeGraphs | None = None
        """Where overlapped decode steps run: the graphs, or the same inputs run eagerly."""
        if overlap:
            seqs = config.max_num_seqs
            self.overlapped = self.graphs or DecodeGraphs(self, seqs, False, 0, windows)

    def _build_model(self, weights_path: str | None) -> LlamaForCausalLM:
        cfg = self.model_config
        windowed = cfg.local_attention is not None
        name = choose_backend(
            self.config.attention_backend, self.device.type, triton_available(), windowed
        )
        backend = make_backend(name, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        devices = [self.device] if self.device.type == "cuda" else []
        try:
            # Random weights (shape:) drawn from the config's seed: a draft model of the same
            # shape is the target itself (engine/spec/draft_model.py).
            loaded = nullcontext() if weights_path is None else _uninitialized_parameters()
            with torch.random.fork_rng(devices), torch.device(self.device), loaded:
                torch.manual_seed(self.config.seed)
                model = model_class(cfg)(
                    cfg, backend, **expert_parallel(self.config, cfg, self.expert_group)
                )
        finally:
            torch.set_default_dtype(previous)
        loaded_fp8 = weights_path is not None and load_checkpoint(self.config, model, weights_path)
        convert_weights(self.config, model, loaded_fp8)
        if self.device.type == "cpu":
            prepack(model)  # oneDNN layouts of the projections, before the first request
            interleave_blocks(model)
            choose_cpu_paths(model, invariant=self.rows_as_decode)
        if self.config.deterministic and not self.rows_as_decode:
            make_kernels_invariant(model)
        return model.eval()

    def kv_bytes_per_block(self) -> int:
        """Bytes of one group-0 block (what prefix caching stores and a peer sends)."""
        return self.kv_groups[0].spec.values_per_token() * self.block_size * self._element()

    def _element(self) -> int:
        return torch.empty((), dtype=self.kv_dtype).element_size()

    def _kv_groups(self) -> list[KVCacheGroup]:
        groups = self.model.kv_cache_groups()
        if len(groups) > 1 and not self.config.hybrid_kv_cache:
            layers = tuple(range(self.model_config.num_layers))
            groups = [KVCacheGroup(self.model.kv_cache_spec(), layers)]
        return fp8_groups(groups, self.model_config) if self.fp8_kv else groups

    def _allocate_kv_cache(self) -> int:
        """One paged tensor per KV cache group; returns group 0's block count."""
        self.kv_groups = self._kv_groups()
        num_blocks = self.config.num_kv_blocks
        budget = self.config.kv_cache_bytes
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * self.config.gpu_memory_utilization)
        cfg = self.config
        sizes = pool_sizes(
            self.kv_groups, budget, self.block_size, self._element(),
            cfg.max_num_seqs, cfg.max_num_batched_tokens, num_blocks,
            cfg.max_num_seqs * self.max_blocks_per_seq,
        )  # fmt: skip
        self.window_blocks = sizes[1:]
        # One block more than the block manager hands out: the scratch block of padded rows
        # (in a window group, its null block). Zeroed: masked attention over never-written
        # slots must not meet NaN bit patterns.
        self.kv_caches = [
            zeroed(g.spec.shape(n + 1, self.block_size), self.kv_dtype, self.device)
            for g, n in zip(self.kv_groups, sizes)
        ]
        self.kv_cache = self.kv_caches[0]
        layer_views = [c.view(FP8) if self.fp8_kv else c for c in self.kv_caches]
        if len(self.kv_groups) == 1:
            self.model.bind_kv_cache(layer_views[0])
        else:
            self.model.bind_kv_groups(layer_views, self.kv_groups)
        if self.device.type == "cpu":
            self.model.native_decode = NativeDecode.build(self.model)
        return sizes[0]

    def gather_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A contiguous copy of these blocks: [parts, layers, n, block, heads, dim]
        (``kv_cache_spec.py``: K and V, or one latent)."""
        return self.kv_cache[:, :, self._tensor(block_ids)].contiguous()

    def blocks_to_host(self, block_ids: list[int], out: torch.Tensor | None = None) -> HostBlocks:
        """A host copy of these blocks, one contiguous [parts, layers, block, heads, dim] per
        block ([n, ...] in all). On CUDA the copy runs on a stream of its own into pinned
        memory (``out[:n]`` when given: a staging slab of ``kv_block_shape``) and this returns
        at once; ``HostBlocks.wait`` waits for it to land."""
        kv = self.kv_cache[:, :, self._tensor(block_ids)].movedim(2, 0)
        if self.device.type != "cuda":
            return HostBlocks(kv.contiguous(), None)
        gathered = kv.contiguous()  # on the loop's stream: after the step that wrote the KV
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.device)
        stream = self._copy_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        if out is None:
            host = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
        else:
            host = out[: len(block_ids)]
        with torch.cuda.stream(stream):
            host.copy_(gathered, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        gathered.record_stream(stream)
        return HostBlocks(host, done)

    def kv_block_shape(self, num_blocks: int) -> tuple[int, ...]:
        """The shape of ``num_blocks`` blocks as ``blocks_to_host`` returns them."""
        kv, layers, blocks, block, heads, dim = self.kv_shape(num_blocks)
        return (blocks, kv, layers, block, heads, dim)

    def scatter_blocks(self, block_ids: list[int], kv: torch.Tensor) -> None:
        self.kv_cache[:, :, self._tensor(block_ids)] = kv.to(self.device, self.kv_dtype)

    def kv_shape(self, num_blocks: int) -> tuple[int, ...]:
        parts, layers, _, block, heads, dim = self.kv_cache.shape
        return (parts, layers, num_blocks, block, heads, dim)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[int]]:
        """Runs one step; returns logits of the requests that sample and their batch indices.
        A request with draft tokens has 1 + len(drafts) rows of logits, in position order."""
        if self.graphs is not None and self.graphs.fits(batch) and not _has_images(batch):
            return self.graphs.run(batch)
        image_segments: list[tuple[int, Request, int, int]] = []
        input_ids, positions, meta, sample_rows, sampled = self._prepare(batch, image_segments)
        image_embeds = step_embeddings(image_segments, self.device)
        hidden = self.model(input_ids, positions, meta, image_embeds)
        return self.model.compute_logits(hidden[sample_rows]), sampled

    @torch.inference_mode()
    def launch_decode(self, batch: ScheduledBatch, prev: InflightStep | None) -> InflightStep:
        """Start a decode step of plain greedy requests without waiting for it: the argmax
        stays on the device (inputs for the next step) and its copy to the host is queued."""
        assert self.overlapped is not None
        return InflightStep.start(batch, self.overlapped.run_greedy(batch, prev))

    @torch.inference_mode()
    def launch_logits(self, batch: ScheduledBatch, prev: InflightStep | None) -> torch.Tensor:
        """Start a decode step like ``launch_decode`` but stop at its logits, which a grammar
        masks (``launch_masked``) once the host knows the tokens of the step before."""
        assert self.overlapped is not None
        return self.overlapped.run(batch, prev)[0]

    @torch.inference_mode()
    def launch_masked(
        self,
        batch: ScheduledBatch,
        logits: torch.Tensor,
        grammars: Sequence[RequestGrammar | None],
    ) -> InflightStep:
        """The argmax of a launched step's logits under its requests' grammars, left on the
        device for the next step, its copy to the host queued."""
        from splitserve.engine.structured.matcher import apply_masks

        apply_masks(logits, grammars)
        return InflightStep.start(batch, greedy_tokens(logits))

    def _prepare(
        self, batch: ScheduledBatch, image_segments: list[tuple[int, Request, int, int]]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor, list[int]]:
        """The step's flat inputs; appends (row, request, start, end) of the segments that
        compute image positions to image_segments."""
        verifies = [_verifies(req, n) for req, n in zip(batch.requests, batch.num_new_tokens)]
        order = step_order(batch)
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillSegment] = []
        steps: list[StepRows] = []
        sample_rows: list[int] = []
        sampled: list[int] = []
        bs = self.block_size
        for i in order:
            req, num_new = batch.requests[i], batch.num_new_tokens[i]
            start, end = req.num_computed_tokens, req.num_computed_tokens + num_new
            row = len(ids)
            if req.images and touches_images(req, start, end):
                image_segments.append((row, req, start, end))
            drafts = req.draft_token_ids  # a verify step: every draft position is sampled
            tokens = req.all_token_ids + drafts if drafts else req.all_token_ids
            ids.extend(tokens[start:end])
            pos.extend(range(start, end))
            table = req.block_table
            slots.extend(self._slot(table, p, req.cached_until) for p in range(start, end))
            decode = num_new == 1 or verifies[i] or self.rows_as_decode  # a row each
            steps.append(StepRows(req, start, end, row, decode))
            if decode:
                decode_tables.extend(table[: -(-p // bs)] for p in range(start + 1, end + 1))
                decode_lens.extend(range(start + 1, end + 1))
            else:
                blocks = torch.tensor(table[: -(-end // bs)], dtype=torch.long)
                prefills.append(PrefillSegment(row, num_new, end, blocks.to(self.device)))
            if end == req.num_tokens + len(drafts):
                sample_rows.extend(range(row + num_new - 1 - len(drafts), row + num_new))
                sampled.append(i)
        width = max((len(t) for t in decode_tables), default=0)
        if self.device.type == "cuda" and decode_tables:
            width = decode_width(width, self.max_blocks_per_seq)  # few kernel variants
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots),
            num_decode_tokens=len(decode_lens),
            decode_block_tables=self._tensor([t + [0] * (width - len(t)) for t in decode_tables]),
            decode_context_lens=self._tensor(decode_lens),
            prefills=prefills,
            verify=any(verifies) or len(decode_lens) > len(steps),  # rows of one sequence
        )
        for index, group in enumerate(self.kv_groups[1:], start=1):
            assert group.window is not None
            meta.windows.append(
                window_metadata(steps, index, group.window, bs, self._tensor, meta.verify)
            )
        return self._tensor(ids), self._tensor(pos), meta, self._tensor(sample_rows), sampled

    def _slot(self, table: list[int], position: int, cached_until: int) -> int:
        """Where a position's group-0 K/V goes: a replayed position whose KV came from the
        prefix cache writes into the scratch block (engine/hybrid_blocks.py)."""
        block = (
            self.scratch_block if position < cached_until else table[position // self.block_size]
        )
        return block * self.block_size + position % self.block_size

    def _tensor(self, values: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long).to(self.device, non_blocking=True)


@dataclass
class HostBlocks:
    """Blocks copied to the host: ``tensor[i]`` is the i-th block once ``done`` has
    completed (None: the copy was synchronous)."""

    tensor: torch.Tensor
    done: torch.cuda.Event | None
    release: Callable[[], None] | None = None
    """Called once the blocks have been put into the store: hands a staging slab back."""

    def wait(self) -> None:
        if self.done is not None:
            self.done.synchronize()


def step_order(batch: ScheduledBatch) -> list[int]:
    """The batch's requests in the order of their rows in a step (each request's new tokens
    are consecutive rows): decode and verify rows first, then the prefill chunks."""
    reqs, news = batch.requests, batch.num_new_tokens
    return sorted(range(len(reqs)), key=lambda i: news[i] > 1 and not _verifies(reqs[i], news[i]))


def _verifies(req: Request, num_new: int) -> bool:
    """The request's step computes its last token and its drafts, nothing else (a verify
    step's decode rows, engine/spec/)."""
    return bool(req.draft_token_ids) and decodes(req, num_new)


def _has_images(batch: ScheduledBatch) -> bool:
    """Decode graphs embed token ids only: a step computing an image position runs eagerly."""
    return any(
        req.images and touches_images(req, req.num_computed_tokens, req.num_computed_tokens + n)
        for req, n in zip(batch.requests, batch.num_new_tokens)
    )


_RANDOM_INITS = ("uniform_", "normal_", "kaiming_uniform_", "kaiming_normal_", "trunc_normal_")


@contextmanager
def _uninitialized_parameters() -> Iterator[None]:
    """Modules built inside keep their parameters as allocated, without the random draws of
    their default init (about a second for SmolLM2 on a CPU): a checkpoint then overwrites
    every parameter, and load_weights raises for any it does not fill."""
    saved = {name: getattr(nn.init, name) for name in _RANDOM_INITS}
    for name in _RANDOM_INITS:
        setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, init in saved.items():
            setattr(nn.init, name, init)


LAZY_ZERO_BYTES = 64 << 20


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor. On the CPU, one of at least LAZY_ZERO_BYTES lies in an anonymous memory
    map, whose pages the kernel zeroes as they are first touched: a KV pool costs nothing
    until its blocks are written, where ``torch.zeros`` wrote all of it at start (a 1 GiB pool
    0.34 s on an idle 2-core VM, up to 2.6 s under the suite's load, in every worker start)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or nbytes < LAZY_ZERO_BYTES:
        return torch.zeros(shape, dtype=dtype, device=device)
    private = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS  # plain process memory, not shared
    return torch.frombuffer(mmap.mmap(-1, nbytes, flags=private), dtype=dtype).view(shape)
