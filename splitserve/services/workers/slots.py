"""What a receiving worker has room for, and the one check of every tensor header against it.

A header (KvHeader, EmbeddingsHeader, PeerBlocks) announces tensors that will follow on the
KV transport. The receiver allocates only after ``accept`` has found each announced tensor
within a ``Slot`` the worker reserved for that request: the dtype from ``DTYPES`` (and the
reserved one), the rank and every dimension within the slot's shape, and so never more bytes
than reserved. A claimed size is never allocated just because a header claims it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""The dtypes a header may announce."""


class Refused(ValueError):
    """A header that announces what was not reserved for it."""


@dataclass(frozen=True)
class Slot:
    """Room reserved for one announced tensor.

    shape: the largest accepted; every dimension must equal it except ``free`` (if not None),
    which may be anything from 1 to ``shape[free]``. dtype: the one accepted (None: any of
    ``DTYPES``). allocate: where the reserved memory comes from (None: a new tensor of the
    announced shape, on the transport's device).
    """

    shape: tuple[int, ...]
    dtype: torch.dtype | None
    free: int | None = None
    allocate: Callable[[], torch.Tensor] | None = None

    def fits(self, shape: Sequence[int]) -> bool:
        if len(shape) != len(self.shape):
            return False
        return all(
            size == limit or (i == self.free and 1 <= size <= limit)
            for i, (size, limit) in enumerate(zip(shape, self.shape))
        )


def accept(
    dtype: str, shapes: Sequence[Sequence[int]], slots: Sequence[Slot] | None, device: torch.device
) -> list[torch.Tensor]:
    """The buffers that a header announcing ``shapes`` of ``dtype`` is received into.

    Refused when nothing was reserved for it (slots None), or it announces a dtype outside
    ``DTYPES`` or other than reserved, another number of tensors, or a shape that does not
    fit its slot (so never more bytes than reserved). Nothing is allocated before every
    check has passed.
    """
    if slots is None:
        raise Refused("nothing is reserved for it here")
    torch_dtype = DTYPES.get(dtype)
    if torch_dtype is None:
        raise Refused(f"dtype {dtype!r} is not one of {sorted(DTYPES)}")
    if len(shapes) != len(slots):
        raise Refused(f"{len(shapes)} tensors announced, {len(slots)} reserved")
    for shape, slot in zip(shapes, slots):
        if slot.dtype is not None and torch_dtype != slot.dtype:
            raise Refused(f"dtype {dtype} announced, {slot.dtype} reserved")
        if not slot.fits(shape):
            raise Refused(f"shape {list(shape)} announced, {list(slot.shape)} reserved")
    return [
        slot.allocate()
        if slot.allocate is not None
        else torch.empty(list(shape), dtype=torch_dtype, device=device)
        for shape, slot in zip(shapes, slots)
    ]
