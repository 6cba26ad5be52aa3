"""Row-wise argmax of the logits in two launches, for greedy decoding.

A single program per row (torch's reduction at batch 1) walks a 128k vocabulary alone; here the
first launch splits each row into chunks, one program per chunk, and the second picks each row's
best chunk. Ties go to the lowest index, as in ``torch.argmax``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels import pdl


@triton.jit
def _chunk_argmax_kernel(
    x_ptr, val_ptr, idx_ptr, vocab, stride_x, num_chunks, CHUNK: tl.constexpr, PDL: tl.constexpr
):  # fmt: skip
    pdl.launch_dependents(PDL)
    pdl.wait(PDL)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + row * stride_x + cols, mask=cols < vocab, other=float("-inf"))
    x = x.to(tl.float32)
    best = tl.max(x, 0)
    index = tl.min(tl.where(x == best, cols, vocab), 0)
    tl.store(val_ptr + row * num_chunks + chunk, best)
    tl.store(idx_ptr + row * num_chunks + chunk, index)


@triton.jit
def _row_argmax_kernel(
    val_ptr, idx_ptr, out_ptr, vocab, num_chunks, PAD_C: tl.constexpr, PDL: tl.constexpr
):
    pdl.launch_dependents(PDL)
    pdl.wait(PDL)
    row = tl.program_id(0)
    c = tl.arange(0, PAD_C)
    mask = c < num_chunks
    vals = tl.load(val_ptr + row * num_chunks + c, mask=mask, other=float("-inf"))
    idx = tl.load(idx_ptr + row * num_chunks + c, mask=mask, other=vocab)
    best = tl.max(vals, 0)
    tl.store(out_ptr + row, tl.min(tl.where(vals == best, idx, vocab), 0).to(tl.int64))


def argmax_rows(logits: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """logits [B, V] (last dim contiguous) -> int64 [B], the first index of each row's max."""
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.long, device=logits.device)
    if rows == 0:
        return out
    assert logits.stride(1) == 1
    num_chunks = triton.cdiv(vocab, chunk)
    vals = torch.empty((rows, num_chunks), dtype=torch.float32, device=logits.device)
    idx = torch.empty((rows, num_chunks), dtype=torch.int32, device=logits.device)
    _chunk_argmax_kernel[(rows, num_chunks)](
        logits,
        vals,
        idx,
        vocab,
        logits.stride(0),
        num_chunks,
        CHUNK=chunk,
        **pdl.launch_kwargs(logits),
    )
    _row_argmax_kernel[(rows,)](
        vals,
        idx,
        out,
        vocab,
        num_chunks,
        PAD_C=triton.next_power_of_2(num_chunks),
        **pdl.launch_kwargs(logits),
    )
    return out
