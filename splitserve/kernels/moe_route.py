"""The MoE router in one launch (softmax over the experts, the top_k, renormalization), and
a decode step's token permutation and its combine in one launch each.

torch runs the router as about six launches per layer (the float32 cast, softmax, a top-k that
gathers then sorts its candidates, the renormalizing sum and division): on an H200 at batch 1
they took about 17 us of a Qwen3-30B-A3B layer, more than its down-projection GEMM. Here one
program per token loads the token's logits, takes the softmax in float32, picks the top_k one
at a time (the highest probability, the lowest expert index among equal ones: most probable
first, as ``torch.topk`` returns them) and writes the weights, renormalized when asked.
The reference is the torch code of ``engine/layers/moe.py: route`` (the CPU path).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _route_kernel(
    logits_ptr, weights_ptr, experts_ptr, num_experts, stride_logits,
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, RENORMALIZE: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    index = tl.arange(0, E_PAD)
    real = index < num_experts
    logits = tl.load(logits_ptr + token * stride_logits + index, mask=real, other=float("-inf"))
    logits = logits.to(tl.float32)
    shifted = tl.exp(logits - tl.max(logits, 0))
    probs = shifted / tl.sum(shifted, 0)
    left = tl.where(real, probs, -1.0)
    slots = tl.arange(0, K_PAD)
    chosen_w = tl.zeros((K_PAD,), dtype=tl.float32)
    chosen_e = tl.zeros((K_PAD,), dtype=tl.int64)
    for k in tl.static_range(TOP_K):
        best = tl.max(left, 0)
        expert = tl.min(tl.where(left == best, index, E_PAD), 0)
        chosen_w = tl.where(slots == k, best, chosen_w)
        chosen_e = tl.where(slots == k, expert.to(tl.int64), chosen_e)
        left = tl.where(index == expert, -2.0, left)
    if RENORMALIZE:
        chosen_w = chosen_w / tl.sum(chosen_w, 0)
    keep = slots < TOP_K
    tl.store(weights_ptr + token * TOP_K + slots, chosen_w, mask=keep)
    tl.store(experts_ptr + token * TOP_K + slots, chosen_e, mask=keep)


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, top_k] float32, experts [T, top_k] int64)."""
    tokens, num_experts = logits.shape
    weights = torch.empty((tokens, top_k), dtype=torch.float32, device=logits.device)
    experts = torch.empty((tokens, top_k), dtype=torch.int64, device=logits.device)
    if tokens == 0:
        return weights, experts
    assert logits.stride(1) == 1, "the experts' dimension must be contiguous"
    _route_kernel[(tokens,)](
        logits, weights, experts, num_experts, logits.stride(0),
        TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k),
        E_PAD=triton.next_power_of_2(num_experts), RENORMALIZE=renormalize,
    )  # fmt: skip
    return weights, experts


MAX_PERMUTE_PAIRS = 128
"""``permute`` runs in one program up to this many (token, slot) pairs (a decode step of 16
tokens at top-8); larger steps take torch's sort, whose launches are then a small share."""


@triton.jit
def _permute_kernel(
    experts_ptr, order_ptr, rows_ptr, offsets_ptr, pairs, num_experts,
    TOP_K: tl.constexpr, P_PAD: tl.constexpr, E_PAD: tl.constexpr,
):  # fmt: skip
    p = tl.arange(0, P_PAD)
    real = p < pairs
    expert = tl.load(experts_ptr + p, mask=real, other=num_experts)
    # A stable sort by expert: a pair's position is the number of pairs before it in
    # (expert, index) order.
    mine, theirs = expert[:, None], expert[None, :]
    ahead = (theirs < mine) | ((theirs == mine) & (p[None, :] < p[:, None]))
    position = tl.sum((ahead & real[None, :]).to(tl.int32), 1)
    tl.store(order_ptr + position, p.to(tl.int64), mask=real)
    tl.store(rows_ptr + position, (p // TOP_K).to(tl.int64), mask=real)
    # offsets[x]: the pairs routed to experts below x, for x = 0 .. E.
    bound = tl.arange(0, E_PAD)
    below = (expert[None, :] < bound[:, None]) & real[None, :]
    tl.store(offsets_ptr + bound, tl.sum(below.to(tl.int64), 1), mask=bound <= num_experts)


def permute(
    experts: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """experts [T, top_k] -> (order, rows, offsets) of ``engine/layers/moe.py: permute``, for
    at most MAX_PERMUTE_PAIRS pairs."""
    tokens, top_k = experts.shape
    pairs = tokens * top_k
    assert 0 < pairs <= MAX_PERMUTE_PAIRS and experts.is_contiguous()
    order = torch.empty(pairs, dtype=torch.int64, device=experts.device)
    rows = torch.empty_like(order)
    offsets = torch.empty(num_experts + 1, dtype=torch.int64, device=experts.device)
    _permute_kernel[(1,)](
        experts, order, rows, offsets, pairs, num_experts,
        TOP_K=top_k, P_PAD=triton.next_power_of_2(pairs),
        E_PAD=triton.next_power_of_2(num_experts + 1),
    )  # fmt: skip
    return order, rows, offsets


@triton.jit
def _combine_kernel(
    rows_ptr, order_ptr, weights_ptr, out_ptr, pairs, hidden,
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, P_PAD: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0)
    p = tl.arange(0, P_PAD)
    order = tl.load(order_ptr + p, mask=p < pairs, other=-1)
    slots = tl.arange(0, K_PAD)
    real = slots < TOP_K
    # Where each of the token's (token, slot) pairs sits among the sorted rows.
    match = order[None, :] == (token * TOP_K + slots)[:, None]
    position = tl.sum(tl.where(match, p[None, :], 0), 1).to(tl.int64)
    weight = tl.load(weights_ptr + token * TOP_K + slots, mask=real, other=0.0)
    for h0 in range(0, hidden, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        mask = real[:, None] & (h < hidden)[None, :]
        rows = tl.load(rows_ptr + position[:, None] * hidden + h[None, :], mask=mask, other=0.0)
        summed = tl.sum(rows.to(tl.float32) * weight[:, None], 0)
        tl.store(out_ptr + token.to(tl.int64) * hidden + h, summed, mask=h < hidden)


def combine(sorted_out: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``engine/layers/moe.py: combine`` in one launch, for at most MAX_PERMUTE_PAIRS rows:
    each token's rows (found through ``order``) times their weights, summed in float32."""
    tokens, top_k = weights.shape
    pairs, hidden = sorted_out.shape
    assert 0 < pairs <= MAX_PERMUTE_PAIRS and sorted_out.is_contiguous()
    out = torch.empty((tokens, hidden), dtype=sorted_out.dtype, device=sorted_out.device)
    _combine_kernel[(tokens,)](
        sorted_out, order, weights.contiguous(), out, pairs, hidden,
        TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), P_PAD=triton.next_power_of_2(pairs),
        BLOCK_H=min(1024, triton.next_power_of_2(hidden)),
    )  # fmt: skip
    return out


@triton.jit
def _ordered_combine_kernel(
    rows_ptr, weights_ptr, out_ptr, hidden, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = h < hidden
    acc = tl.zeros((BLOCK_H,), tl.float32)
    for slot in tl.static_range(TOP_K):
        weight = tl.load(weights_ptr + token * TOP_K + slot)
        row = tl.load(rows_ptr + (token * TOP_K + slot) * hidden + h, mask=mask, other=0.0)
        acc += row.to(tl.float32) * weight
    tl.store(out_ptr + token * hidden + h, acc.to(out_ptr.dtype.element_ty), mask=mask)


def ordered_combine(
    sorted_out: torch.Tensor, order: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """``combine`` for any number of rows with each token's slots added one after the other,
    in slot order, in float32 (deterministic mode: the same additions at any batch, where
    ``combine``'s reduction tree and torch's past MAX_PERMUTE_PAIRS differ)."""
    tokens, top_k = weights.shape
    hidden = sorted_out.shape[1]
    unsorted = torch.empty_like(sorted_out).index_copy_(0, order, sorted_out)
    out = torch.empty((tokens, hidden), dtype=sorted_out.dtype, device=sorted_out.device)
    if tokens:
        block = min(1024, triton.next_power_of_2(hidden))
        _ordered_combine_kernel[(tokens, triton.cdiv(hidden, block))](
            unsorted, weights.float().contiguous(), out, hidden, TOP_K=top_k, BLOCK_H=block
        )
    return out
