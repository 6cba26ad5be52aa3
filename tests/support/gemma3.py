"""What the Gemma 3 270M tests share: the prompts its deployments are asked, and transformers'
greedy tokens for them.

tests/test_gemma3_270m.py checks these tokens against transformers (and the offline engine)
on the same weights each run; tests/test_gemma3_served.py asserts them token for token from
deployments, which then load no reference of their own. None of them is a near-tie: the
smallest gap between transformers' two best logits along them is 0.26."""

from __future__ import annotations

MODEL = "gemma3-270m"
NEW_TOKENS = 10

STORY = (
    " ".join(f"Day {i}: the baker sold {i * 7 % 23} loaves of rye." for i in range(90))
    + " On the last day, the baker"
)
"""1,309 tokens: past two of the 512-token sliding windows before the first new token, and
while it decodes position 799 leaves the window (its block of 16 with it). With the window
removed, transformers' greedy tokens are others."""
SERVED_TEXTS = ("The capital of France is", STORY)
SERVED_PROMPT_TOKENS = (6, 1309)
"""Each one's length with its <bos>."""
SERVED_TOKENS = (
    (506, 5279, 529, 506, 2891, 529, 7001, 236761, 1030, 563),
    (5463, 236743, 236770, 236771, 226449, 529, 91419, 236761, 6156, 236743),
)
SERVED_PIECES = (
    (" the", " capital", " of", " the", " country", " of", " France", ".", " It", " is"),
    (" sold", " ", "1", "0", " loaves", " of", " rye", ".", " Day", " "),
)
"""Each token decoded alone, as the API's logprobs name it."""

CHAT = [
    {"role": "system", "content": "Answer with one word."},
    {"role": "user", "content": "Name a color."},
]
CHAT_PROMPT_TOKENS = 19
"""In Gemma's turns, the system message heading the user's."""
CHAT_TOKENS = (7925, 607, 886, 3658, 236761, 108, 1567, 496, 2258, 236761)
CHAT_PIECES = ("Answer", " with", " one", " word", ".", "\n\n", "Name", " a", " color", ".")
"""The base model (not instruction-tuned) repeats the conversation back."""
