"""N-gram prompt lookup: the tokens that followed the last occurrence of the sequence's suffix.

For n from prompt_lookup_max down to prompt_lookup_min, the last n tokens are looked up in
the sequence before them (prompt and output); at the latest earlier match, the tokens that
followed it are the draft. Text that copies from its input (rewriting, extraction, code edits)
repeats long n-grams, so drafts are often right; elsewhere a lookup finds nothing and costs
nothing but the search.
"""

from __future__ import annotations

import numpy as np

from splitserve.engine.request import Request
from splitserve.engine.spec.drafter import Drafter


class NgramDrafter(Drafter):
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, reqs: list[Request], limits: list[int]) -> list[list[int]]:
        return [
            lookup(req.all_token_ids, self.min_n, self.max_n, k) if k else []
            for req, k in zip(reqs, limits)
        ]

    def passes(self, limits: list[int]) -> int:
        return int(any(limits))

    def release(self, req: Request) -> None:
        """Nothing is kept between steps: each lookup reads the request's tokens."""


def lookup(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest suffix of
    ``tokens`` (of min_n..max_n tokens) found before it; [] if none is found."""
    seq = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_n, len(seq) - 1), min_n - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], n)
        hits = np.flatnonzero((windows == seq[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return [int(t) for t in seq[start : start + k]]
    return []
