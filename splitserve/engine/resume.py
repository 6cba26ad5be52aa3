"""Resuming a request that migrated: an earlier run on another worker produced some output
tokens, streamed to the client, and then stopped (its worker died).

The new run's prompt is the original prompt followed by those tokens, and ``resumed`` says how
many of the prompt's last tokens they are. Sampling then goes on where the earlier run stopped:

- greedy: the next token is the argmax after the same tokens, as it was;
- a seeded request: its draws are seeded by (seed, output token index), the resumed tokens
  counted (engine/sampler.py), so it draws what that run would have drawn next;
- a constrained request: its grammar matcher is fed the resumed tokens, so that it is in the
  state the earlier run's matcher was in;
- text: the detokenizer replays the resumed tokens (IncrementalDetokenizer.replay) and drops
  the ``resumed_chars`` characters the client already has, so that what the earlier run held
  back (the possible start of a stop string) is sent next, and a stop string that spans the
  two runs is still found.

The caller (the API server) counts the resumed tokens against max_tokens and min_tokens.
"""

from __future__ import annotations

from splitserve.engine.request import Request


def resume(req: Request, resumed: int, shown_chars: int = 0) -> None:
    """Bring a new request's sampling state past its ``resumed`` output tokens, of whose text
    the client has ``shown_chars`` characters; ValueError if ``resumed`` is out of range or the
    tokens break its constraint."""
    if not 0 <= resumed < req.num_prompt_tokens:
        raise ValueError(f"resumed must be in [0, {req.num_prompt_tokens}), got {resumed}")
    if shown_chars < 0:
        raise ValueError(f"resumed_chars must be >= 0, got {shown_chars}")
    req.num_resumed, req.resumed_chars = resumed, shown_chars
    for token in req.prompt_token_ids[req.num_prompt_tokens - resumed :]:
        if req.grammar is not None and not req.grammar.accept(token):
            raise ValueError(f"resumed token {token} breaks the request's constraint")
