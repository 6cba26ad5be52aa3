"""The mixture-of-experts MLP: router, token permutation, grouped expert GEMMs, combine.

A step's T tokens each pick ``top_k`` experts (``route``); the T x top_k (token, expert) pairs
are sorted by expert (``permute``), so that each expert's rows are one contiguous run; the
gate|up GEMM of every expert runs as one grouped GEMM that gathers its rows straight from the
tokens, then SiLU-and-mul, then the grouped down GEMM; ``combine`` puts the rows back in
(token, slot) order and sums each token's top_k rows weighted by the router.

On CUDA (and under ``set_kernels_on_cpu``) the grouped GEMM is the Triton kernel of
``splitserve.kernels.grouped_gemm``; the CPU keeps the torch code below, one ``F.linear`` per
expert that has rows. Nothing here reads a tensor back to the host on the kernel path, so a
decode step of an MoE model is captured in a CUDA graph like a dense one.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.engine.layers.activation import silu_and_mul
from splitserve.engine.layers.expert_placement import ExpertParallel
from splitserve.engine.layers.linear import dense
from splitserve.engine.layers.norm import RMSNorm
from splitserve.engine.model_config import MoEConfig
from splitserve.kernels.dispatch import use_kernels
from splitserve.kernels.fp8_quant import BlockFp8

ExpertWeight = torch.Tensor | BlockFp8
"""A stack of experts' weights [E, N, K]: a tensor, or e4m3 blocks with their scales
(``EngineConfig.quantization="fp8"``, ``layers/fp8_linear.py``)."""


@dataclass(frozen=True)
class Routing:
    weights: torch.Tensor
    """[T, top_k] float32: each chosen expert's weight in the token's output."""
    experts: torch.Tensor
    """[T, top_k] int64: the chosen experts, most probable first."""


@dataclass(frozen=True)
class Permutation:
    """The (token, slot) pairs of a step sorted by expert (stable: token order within one)."""

    order: torch.Tensor
    """[T * top_k]: the flat (token * top_k + slot) index at each sorted position."""
    rows: torch.Tensor
    """[T * top_k]: the token each sorted position reads."""
    offsets: torch.Tensor
    """[E + 1]: expert e owns sorted positions [offsets[e], offsets[e + 1])."""

    @property
    def counts(self) -> torch.Tensor:
        """[E]: how many (token, slot) pairs went to each expert."""
        return self.offsets[1:] - self.offsets[:-1]


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> Routing:
    """Softmax over the experts in float32, the top_k most probable; with ``renormalize`` the
    chosen probabilities are rescaled to sum to one (as transformers' Mixtral and Qwen3-MoE).
    On the kernels, one launch (``splitserve.kernels.moe_route``)."""
    if logits.shape[0] and use_kernels(logits):
        from splitserve.kernels.moe_route import route as kernel

        return Routing(*kernel(logits, top_k, renormalize))
    probs = torch.softmax(logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(weights, experts)


def permute(experts: torch.Tensor, num_experts: int) -> Permutation:
    """On the kernels, a decode step's few pairs in one launch (``kernels/moe_route.py``)."""
    if experts.numel() and use_kernels(experts):
        from splitserve.kernels.moe_route import MAX_PERMUTE_PAIRS
        from splitserve.kernels.moe_route import permute as kernel

        if experts.numel() <= MAX_PERMUTE_PAIRS:
            return Permutation(*kernel(experts.contiguous(), num_experts))
    flat = experts.flatten()
    sorted_experts, order = torch.sort(flat, stable=True)
    bounds = torch.arange(num_experts + 1, device=flat.device, dtype=sorted_experts.dtype)
    offsets = torch.searchsorted(sorted_experts, bounds)
    return Permutation(order, order // experts.shape[1], offsets)


def combine(
    sorted_out: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, invariant: bool = False
) -> torch.Tensor:
    """[T * top_k, H] rows, row i that of flat (token, slot) ``order[i]`` -> [T, H]: each
    token's rows times their weights, summed in float32 over its slots, in slot order. On the
    kernels, a decode step's in one launch (``kernels/moe_route.py``); invariant
    (deterministic mode): every step's in one order (``ordered_combine``)."""
    if invariant and use_kernels(sorted_out):
        from splitserve.kernels.moe_route import ordered_combine

        return ordered_combine(sorted_out, order, weights)
    if sorted_out.shape[0] and use_kernels(sorted_out):
        from splitserve.kernels.moe_route import MAX_PERMUTE_PAIRS
        from splitserve.kernels.moe_route import combine as kernel

        if sorted_out.shape[0] <= MAX_PERMUTE_PAIRS:
            return kernel(sorted_out.contiguous(), order, weights)
    tokens, top_k = weights.shape
    unsorted = torch.empty_like(sorted_out).index_copy_(0, order, sorted_out)
    summed = (
        unsorted.view(tokens, top_k, sorted_out.shape[-1]).float() * weights.unsqueeze(-1)
    ).sum(dim=1)
    return summed.to(sorted_out.dtype)


def grouped_gemm(
    x: torch.Tensor,
    weight: ExpertWeight,
    offsets: torch.Tensor,
    rows: torch.Tensor | None = None,
    invariant: bool = False,
) -> torch.Tensor:
    """Row r of the result is x[rows[r]] (x[r] when rows is None) times weight[e].T for the
    expert e whose [offsets[e], offsets[e + 1]) holds r; weight: [E, N, K]. invariant
    (deterministic mode): the kernel's tiles fixed (``INVARIANT_TILES``)."""
    if isinstance(weight, BlockFp8):
        from splitserve.engine.layers.fp8_linear import fp8_grouped

        return fp8_grouped(x, weight, offsets, rows)
    if use_kernels(x):
        from splitserve.kernels.grouped_gemm import INVARIANT_TILES
        from splitserve.kernels.grouped_gemm import grouped_gemm as kernel

        return kernel(x, weight, offsets, rows, INVARIANT_TILES if invariant else None)
    gathered = x if rows is None else x[rows]
    out = torch.empty((gathered.shape[0], weight.shape[1]), dtype=x.dtype, device=x.device)
    bounds = offsets.tolist()
    for expert, (start, end) in enumerate(itertools.pairwise(bounds)):
        if end > start:
            out[start:end] = F.linear(gathered[start:end], weight[expert])
    return out


Activation = Callable[[torch.Tensor], torch.Tensor]
"""[rows, 2 * I] gate | up -> [rows, I] (SwiGLU's silu_and_mul, or V4's clipped one)."""


def experts_forward(
    x: torch.Tensor,
    w13: ExpertWeight,
    w2: ExpertWeight,
    routing: Routing,
    perm: Permutation,
    act: Activation = silu_and_mul,
    invariant: bool = False,
) -> torch.Tensor:
    """The routed SwiGLU experts of tokens x [T, H]: w13 [E, 2I, H] (gate | up), w2 [E, H, I];
    invariant: deterministic mode's fixed tiles and combine order."""
    gate_up = grouped_gemm(x, w13, perm.offsets, perm.rows, invariant)
    down = grouped_gemm(act(gate_up), w2, perm.offsets, invariant=invariant)
    return combine(down, perm.order, routing.weights, invariant)


def distributed_experts(
    ep: ExpertParallel,
    h: torch.Tensor,
    routing: Routing,
    w13: ExpertWeight,
    w2: ExpertWeight,
    act: Activation = silu_and_mul,
) -> torch.Tensor:
    """The routed experts of this rank's tokens h [T, H], computed on the ranks that hold them
    (``layers/expert_placement.py``); this rank's experts (w13, w2: its slots) serve whatever
    rows the others send."""
    top_k = routing.experts.shape[1]
    rank, slot = ep.destinations(routing.experts.flatten())
    order = torch.argsort(rank * ep.width + slot, stable=True)
    send = torch.bincount(rank, minlength=ep.size).tolist()
    recv = ep.counts(torch.tensor(send, device=h.device))
    rows = ep.exchange(h[order // top_k], send, recv)
    slots = ep.exchange(slot[order], send, recv)
    local = Routing(torch.ones((len(slots), 1), device=h.device), slots[:, None])
    out = experts_forward(rows, w13, w2, local, permute(local.experts, ep.width), act)
    return combine(ep.exchange(out, recv, send), order, routing.weights)


class SparseMoE(nn.Module):
    """A decoder layer's MoE MLP. Called like ``LlamaMLP``: (x, residual, norm) ->
    (MLP of norm(x + residual), x + residual).

    ``expert_load`` counts the (token, slot) pairs routed to each expert since it was last
    zeroed (the engine's load counter reads it after each step)."""

    def __init__(self, hidden_size: int, moe: MoEConfig, ep: ExpertParallel | None = None) -> None:
        super().__init__()
        self.moe, self.ep, self.hidden_size = moe, ep, hidden_size
        experts, inter = (moe.num_experts if ep is None else ep.width), moe.intermediate_size
        self.gate = nn.Linear(hidden_size, moe.num_experts, bias=False)
        self.w13 = nn.Parameter(torch.empty(experts, 2 * inter, hidden_size))
        self.w2 = nn.Parameter(torch.empty(experts, hidden_size, inter))
        # nn.Linear's default initialization, for random-weight shapes.
        nn.init.uniform_(self.w13, -1 / math.sqrt(hidden_size), 1 / math.sqrt(hidden_size))
        nn.init.uniform_(self.w2, -1 / math.sqrt(inter), 1 / math.sqrt(inter))
        self.expert_load: torch.Tensor
        self.register_buffer("expert_load", torch.zeros(moe.num_experts, dtype=torch.int64), False)
        self.invariant = False
        """Deterministic mode on the kernels (``batch_invariant_kernels.py``)."""

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            h, residual = norm(x), x
        else:
            h, residual = norm.add_and_norm(x, residual)
        return self.experts(h), residual

    def experts(self, h: torch.Tensor) -> torch.Tensor:
        """The MoE MLP of normed tokens h [T, H] (T may be 0 on an idle expert-parallel rank)."""
        logits = dense(h, self.gate) if h.shape[0] else h.new_empty((0, self.moe.num_experts))
        return self.routed_experts(h, self.route(logits))

    def routed_experts(self, h: torch.Tensor, routing: Routing) -> torch.Tensor:
        """The experts of ``routing``'s choice for h, on this rank or across the group."""
        perm = permute(routing.experts, self.moe.num_experts)
        self.expert_load += perm.counts
        w13, w2 = self.expert_weights()
        if self.ep is not None:
            return distributed_experts(self.ep, h, routing, w13, w2, self.act)
        return experts_forward(h, w13, w2, routing, perm, self.act, self.invariant)

    def expert_weights(self) -> tuple[ExpertWeight, ExpertWeight]:
        """w13 and w2, with their block scales where they are FP8 (``layers/fp8_linear.py``
        adds ``w13_scale_inv`` and ``w2_scale_inv``)."""
        scales = getattr(self, "w13_scale_inv", None), getattr(self, "w2_scale_inv", None)
        if scales[0] is None or scales[1] is None:
            return self.w13, self.w2
        return BlockFp8(self.w13, scales[0]), BlockFp8(self.w2, scales[1])

    def act(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The experts' activation (V4 clips it first)."""
        return silu_and_mul(gate_up)

    def route(self, logits: torch.Tensor) -> Routing:
        """The router's choice from its logits [T, E] (DeepSeekMoE overrides it)."""
        return route(logits, self.moe.top_k, self.moe.renormalize)

    def idle(self) -> None:
        """An expert-parallel rank with no tokens: its experts still serve the others'."""
        self.experts(self.w13.new_empty((0, self.hidden_size)))
