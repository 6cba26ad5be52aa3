"""What the API server sends for one engine request, kept to send it again if the request
migrates (migration.py); a tracked request holds it (worker_view.py: ``Tracked``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from splitserve.engine.sampling_params import SamplingParams
from splitserve.services.api.images import PromptImages


@dataclass(frozen=True)
class Submission:
    """What the exchange sends for one engine request, kept to send it again."""

    prompt_ids: list[int]
    params: SamplingParams
    traffic_class: str | None = None
    images: PromptImages | None = None
    resumed: int = 0
    """The prompt's last tokens that are output of an earlier attempt."""
    resumed_chars: int = 0
    """Of those tokens' text, the characters the client already has."""

    def resumed_after(self, tokens: list[int], chars: int) -> Submission:
        """This (original) request continued after ``tokens``, the output already streamed
        (``chars`` characters of their text): they are appended to the prompt and counted
        against max_tokens and min_tokens; the text they still owe the client comes first."""
        if not tokens:
            return self
        done, params = len(tokens), self.params
        max_tokens = None if params.max_tokens is None else params.max_tokens - done
        min_tokens = max(0, params.min_tokens - done)
        params = dataclasses.replace(params, max_tokens=max_tokens, min_tokens=min_tokens)
        prompt = self.prompt_ids + tokens
        return Submission(prompt, params, self.traffic_class, self.images, done, chars)
