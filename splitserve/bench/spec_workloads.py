"""The prompts of `splitserve bench offline --speculative` (bench/speculative.py), by workload.

- ``copy``: repeat a passage of about 200 characters given in the prompt (drafts from the
  prompt are nearly always right);
- ``grounded``: repeat, copy from or rewrite a longer passage (many drafts right, some not);
- ``free``: open-ended requests (little to copy);
- ``mixed``: quote a sentence of the prompt, write freely about it, quote the next, ... (one
  request moves between quoted and free spans);
- ``random``: random token prompts, for random-weight shapes.
"""

from __future__ import annotations

import itertools

from splitserve.engine.llm import LLM

WORKLOADS = ("copy", "grounded", "free", "mixed", "random")

SHORT_PASSAGES = [
    "The lighthouse stood on a rocky island two miles from the harbour. Its lamp was lit "
    "every evening at sunset by a keeper who rowed out from the village in a small boat.",
    "Honey bees live in colonies of up to sixty thousand workers. Each worker visits about "
    "two thousand flowers a day and makes a twelfth of a teaspoon of honey in its life.",
    "The first railway across the continent was finished in 1869, when the last spike was "
    "driven at Promontory Summit. The journey from coast to coast then took about a week.",
    "Copper is a soft metal that conducts heat and electricity very well. It has been mined "
    "for more than ten thousand years and is still used in most of the world's wiring.",
]
PASSAGES = [
    "The Amazon rainforest covers much of the Amazon basin of South America. This basin "
    "encompasses seven million square kilometres, of which five and a half million square "
    "kilometres are covered by the rainforest. The region includes territory belonging to "
    "nine nations and 3,344 formally acknowledged indigenous territories.",
    "The Great Barrier Reef is the world's largest coral reef system, composed of over 2,900 "
    "individual reefs and 900 islands stretching for over 2,300 kilometres over an area of "
    "approximately 344,400 square kilometres. The reef is located in the Coral Sea, off the "
    "coast of Queensland, Australia.",
    "Photosynthesis is a process used by plants and other organisms to convert light energy "
    "into chemical energy that, through cellular respiration, can later be released to fuel "
    "the organism's activities. Some of this chemical energy is stored in carbohydrate "
    "molecules, such as sugars and starches, which are synthesized from carbon dioxide and water.",
]
COPY = "Repeat the following passage exactly:\n\n{}"
GROUNDED = [
    "Repeat the following passage exactly:\n\n{}",
    "Rewrite the following passage as a bulleted list, keeping its words:\n\n{}",
    "Copy every sentence of this passage that contains a number:\n\n{}",
]
FREE = [
    "Write a short story about a lighthouse keeper.",
    "Explain why the sky is blue to a child.",
    "Give me ten ideas for a birthday party.",
    "Describe your ideal weekend in detail.",
]
MIXED = (
    "Do four things in order. 1: repeat passage A exactly. 2: write a short poem about it. "
    "3: repeat passage B exactly. 4: write a short poem about it.\n\nPassage A: {}\n\n"
    "Passage B: {}"
)


def asks(workload: str) -> list[str]:
    """The user messages of a chat workload (cycled over the batch)."""
    if workload == "copy":
        return [COPY.format(p) for p in SHORT_PASSAGES]
    if workload == "grounded":
        return [a.format(p) for a, p in itertools.product(GROUNDED, PASSAGES)]
    if workload == "mixed":
        pairs = zip(SHORT_PASSAGES, SHORT_PASSAGES[1:] + SHORT_PASSAGES[:1])
        return [MIXED.format(a, b) for a, b in pairs]
    if workload == "free":
        return FREE
    raise ValueError(f"unknown workload {workload!r} (known: {WORKLOADS})")


def prompts(llm: LLM, workload: str, batch: int, input_len: int) -> list[list[int]]:
    """Token ids of ``batch`` prompts of the workload (``random``: input_len random ids)."""
    if workload == "random":
        import torch

        vocab = llm.engine.model_config.vocab_size
        generator = torch.Generator().manual_seed(batch)
        return torch.randint(100, vocab, (batch, input_len), generator=generator).tolist()
    chats = itertools.islice(itertools.cycle(asks(workload)), batch)
    return [llm.apply_chat_template([{"role": "user", "content": ask}]) for ask in chats]
