"""Token selection: penalties, temperature, top-k / top-p / min-p, seeds and logprobs.

A seeded request's draw for its output token i comes from a generator seeded with (seed, i)
alone (``token_generator``), so its tokens do not depend on what else shares its batch, its
place in it, a preemption, the worker that draws (a decode worker continuing what a prefill
worker began, a resumed request) or drafts rejected before. A request with structured outputs
has the tokens its grammar forbids masked first. Logprobs are those of the model distribution
after that mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from splitserve.engine.request import Logprob, Request
from splitserve.kernels.dispatch import use_kernels


@dataclass
class SampleResult:
    token_id: int
    logprob: float | None = None
    logprobs: dict[int, Logprob] | None = None


class Sampler:
    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator()
        self.generator.manual_seed(seed)

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, reqs: list[Request]) -> list[SampleResult]:
        """logits: [len(reqs), vocab] float32 on any device (masked in place where a
        request's grammar forbids tokens)."""
        if any(r.grammar is not None for r in reqs):
            from splitserve.engine.structured.matcher import apply_masks

            apply_masks(logits, [r.grammar for r in reqs])
        if all(plain_greedy(r) for r in reqs):
            return [SampleResult(t) for t in greedy_tokens(logits).tolist()]
        logits = logits.float().cpu()
        raw = logits
        if any(r.params.logprobs is not None for r in reqs):
            raw = torch.log_softmax(logits, dim=-1)
        logits = logits.clone()
        for row, req in enumerate(reqs):
            apply_penalties(logits[row], req)
        tokens = [self._pick(logits[row], req) for row, req in enumerate(reqs)]
        return [_result(raw[row], tok, req) for row, (tok, req) in enumerate(zip(tokens, reqs))]

    def _pick(self, logits: torch.Tensor, req: Request) -> int:
        params = req.params
        if params.greedy:
            return int(torch.argmax(logits))
        logits = logits / params.temperature
        logits = filter_top_k_top_p_min_p(logits, params.top_k, params.top_p, params.min_p)
        probs = torch.softmax(logits, dim=-1)
        generator = self.generator
        if params.seed is not None:  # its output so far, an earlier run's included (resume.py)
            generator = token_generator(params.seed, req.num_resumed + req.num_output_tokens)
        noise = _noise(probs.shape[-1], generator)
        return int(torch.argmax(probs / noise))


_MASK64 = (1 << 64) - 1


def _splitmix64(z: int) -> int:
    """SplitMix64's finalizer: a 64-bit integer to a well-mixed one."""
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def token_generator(seed: int, index: int) -> torch.Generator:
    """The generator of a seeded request's draw for its output token ``index``: seeded from
    (seed, index) alone. Unseeded requests draw from the sampler's shared generator."""
    return torch.Generator().manual_seed(_splitmix64(_splitmix64(seed) ^ index))


def _noise(size: int, generator: torch.Generator) -> torch.Tensor:
    """The one random draw per sampled token: exponential noise over the vocabulary, so that
    argmax(probs / noise) is a sample from probs (the exponential race)."""
    return torch.empty(size, dtype=torch.float32).exponential_(generator=generator)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax: the two-launch Triton kernel on the GPU (kernels/argmax.py)."""
    if use_kernels(logits):
        from splitserve.kernels.argmax import argmax_rows

        return argmax_rows(logits)
    return logits.argmax(dim=-1)


def plain_greedy(req: Request) -> bool:
    """The next token is the argmax of the raw logits: nothing to apply, nothing to report."""
    p = req.params
    return (
        p.greedy
        and p.logprobs is None
        and p.repetition_penalty == 1.0
        and not p.frequency_penalty
        and not p.presence_penalty
        and req.num_output_tokens >= p.min_tokens
    )


def apply_penalties(logits: torch.Tensor, req: Request) -> None:
    """In place on one row: repetition, frequency and presence penalties, min_tokens."""
    params = req.params
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(req.all_token_ids)), dtype=torch.long)
        values = logits[seen]
        penalty = params.repetition_penalty
        logits[seen] = torch.where(values > 0, values / penalty, values * penalty)
    if params.frequency_penalty or params.presence_penalty:
        # The request's output so far, an earlier run's included (a resumed request: resume.py).
        generated = req.all_token_ids[req.num_prompt_tokens - req.num_resumed :]
        if generated:
            counts = torch.bincount(
                torch.tensor(generated, dtype=torch.long), minlength=logits.shape[0]
            )[: logits.shape[0]].float()
            frequency, presence = params.frequency_penalty, params.presence_penalty
            logits -= frequency * counts + presence * (counts > 0).float()
    if req.num_output_tokens < params.min_tokens:
        banned = set(params.stop_token_ids)
        if not params.ignore_eos:
            banned.update(req.eos_token_ids)
        if banned:
            logits[torch.tensor(sorted(banned), dtype=torch.long)] = float("-inf")


def filter_top_k_top_p_min_p(
    logits: torch.Tensor, top_k: int, top_p: float, min_p: float
) -> torch.Tensor:
    """One row of temperature-scaled logits -> the same with excluded tokens at -inf."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop_sorted = cumulative - torch.softmax(sorted_logits, dim=-1) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
    return logits


def _result(raw: torch.Tensor, token: int, req: Request) -> SampleResult:
    top_n = req.params.logprobs
    if top_n is None:
        return SampleResult(token)
    chosen = float(raw[token])
    entries = {token: Logprob(chosen, int((raw > raw[token]).sum()) + 1)}
    if top_n:
        values, indices = torch.topk(raw, top_n)
        for rank, (value, index) in enumerate(zip(values.tolist(), indices.tolist()), start=1):
            entries.setdefault(index, Logprob(value, rank))
    return SampleResult(token, chosen, entries)
