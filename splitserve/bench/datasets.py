"""Request generators for `splitserve bench serve`.

Every dataset is a list of :class:`BenchRequest`: chat messages plus the number of tokens to
ask for. The client renders them for the chat or the completions endpoint. A dataset shorter
than ``--num-prompts`` is cycled through in order (:func:`take`).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from splitserve.bench.text import Message, TextSource


@dataclass(frozen=True)
class BenchRequest:
    """One request of the load: the prompt as chat messages and the tokens to generate."""

    messages: tuple[Message, ...]
    output_len: int


def take(requests: list[BenchRequest], num_prompts: int) -> list[BenchRequest]:
    """The first ``num_prompts`` requests, cycling through ``requests`` when it is shorter."""
    if not requests:
        raise ValueError("the dataset has no requests")
    return [requests[i % len(requests)] for i in range(num_prompts)]


def sample_len(rng: random.Random, length: int, range_ratio: float) -> int:
    """A length drawn uniformly from [length * (1 - r), length * (1 + r)], at least 1."""
    low = max(1, math.floor(length * (1.0 - range_ratio)))
    high = max(low, math.ceil(length * (1.0 + range_ratio)))
    return rng.randint(low, high)


def random_dataset(
    source: TextSource,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    seed: int,
) -> list[BenchRequest]:
    """Prompts of random tokens (or words, without a tokenizer) of sampled lengths."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError("--random-range-ratio must be in [0, 1)")
    rng = random.Random(seed)
    requests = []
    for _ in range(num_prompts):
        n_in = sample_len(rng, input_len, range_ratio)
        n_out = sample_len(rng, output_len, range_ratio)
        text = source.text(rng, n_in)
        requests.append(BenchRequest((Message("user", text),), n_out))
    return requests


def shared_prefix_dataset(
    source: TextSource,
    num_prefixes: int,
    users: int,
    system_len: int,
    question_len: int,
    output_len: int,
    seed: int,
) -> list[BenchRequest]:
    """``num_prefixes`` system prompts, each shared by ``users`` different questions.

    Ordered user-major (user 0 of every prefix, then user 1, ...) so that every group is
    active from the start, as when many users share a few system prompts.
    """
    rng = random.Random(seed)
    systems = [source.text(rng, system_len) for _ in range(num_prefixes)]
    requests = []
    for _ in range(users):
        for system in systems:
            messages = (Message("system", system), Message("user", source.text(rng, question_len)))
            requests.append(BenchRequest(messages, output_len))
    return requests


def multi_turn_dataset(
    source: TextSource,
    conversations: int,
    turns: int,
    turn_len: int,
    output_len: int,
    seed: int,
) -> list[BenchRequest]:
    """Conversations whose context grows each turn, like an agent's loop.

    Turn t of a conversation carries the system prompt, the t earlier user messages and
    assistant replies (synthetic, ``output_len`` long) and a new user message. Requests are
    ordered turn-major, so each turn's prefix was sent before it.
    """
    rng = random.Random(seed)
    histories: list[tuple[Message, ...]] = [
        (Message("system", source.text(rng, turn_len)),) for _ in range(conversations)
    ]
    requests = []
    for _ in range(turns):
        for c, history in enumerate(histories):
            messages = (*history, Message("user", source.text(rng, turn_len)))
            requests.append(BenchRequest(messages, output_len))
            histories[c] = (*messages, Message("assistant", source.text(rng, output_len)))
    return requests


def file_dataset(path: Path, output_len: int) -> list[BenchRequest]:
    """A JSONL file of ``{"prompt": str}`` or ``{"messages": [{"role", "content"}]}`` lines.

    A line may set its own ``"max_tokens"``; otherwise ``output_len`` is used.
    """
    requests = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if line.strip():
            requests.append(_parse_line(line, number, output_len))
    return requests


def _parse_line(line: str, number: int, output_len: int) -> BenchRequest:
    try:
        record = json.loads(line)
        messages = _record_messages(record)
        max_tokens = int(record.get("max_tokens", output_len))
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise ValueError(f"line {number}: {exc}") from exc
    return BenchRequest(messages, max_tokens)


def _record_messages(record: dict[str, Any]) -> tuple[Message, ...]:
    if "prompt" in record:
        if not isinstance(record["prompt"], str):
            raise TypeError('"prompt" must be a string')
        return (Message("user", record["prompt"]),)
    if "messages" in record:
        return tuple(Message(str(m["role"]), str(m["content"])) for m in record["messages"])
    raise KeyError('each line needs "prompt" or "messages"')
