"""Bounded replay of the sliding-window layers against exact replay and against no cache, on
Gemma 3 270M's real weights (engine/hybrid_blocks.py), and one long request's window.

Each conversation is a user turn of natural text (the standard library's documentation) of
1k-8k tokens, a model turn, and a follow-up question. One engine runs each conversation's
second turn uncached (mode ``none``: its TTFT, and the reference continuation: 32 greedy
tokens and their next-token distributions); its prefix cache writes the history's blocks, and
only those, through to a shared store. Every bounded mode runs the second turn on an engine of
its own that loads the history from that store, so each meets the same cached prefix; the
exact mode, whose blocks are not shared with bounded ones (hash root), runs the history
itself first, on the first ``--exact-ttft`` conversations:

- ``exact``: group 0 from the cache, the window layers' KV rebuilt from the whole prefix (its
  tokens must equal the reference's);
- ``bounded-A``: the window layers' KV rebuilt from the prefix's last window + A tokens.

TTFT is the reused turn's, one request at a time. Quality is taken teacher-forced along the
reference continuation: its next-token distributions against each bounded mode's on the same
tokens (top-1 agreement, mean KL(reference || bounded)), and the share of conversations whose
32 greedy tokens all stay the reference's. The uncached run is the exact mode's output
(tests/test_hybrid_kv_cache.py checks that exact replay equals it token for token).

    python -m benchmarks.cpu.window_replay --out results.json [--conversations 50]
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import math
import platform
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from splitserve.bench.report import git_commit
from splitserve.engine.config import EngineConfig
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.loader import load_tokenizer, resolve_model
from splitserve.engine.sampling_params import SamplingParams

MODEL = "gemma3-270m"
ANSWER = "I have read it."
FOLLOW_UP, CONTINUATION = "What does the text above say next?", 32
MODULES = (
    "argparse",
    "asyncio",
    "collections",
    "concurrent.futures",
    "contextlib",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "email",
    "enum",
    "functools",
    "http.client",
    "inspect",
    "itertools",
    "json",
    "logging",
    "pathlib",
    "pickle",
    "re",
    "shutil",
    "socket",
    "sqlite3",
    "string",
    "subprocess",
    "tarfile",
    "threading",
    "typing",
    "unittest",
    "urllib.request",
    "xml.etree.ElementTree",
    "zipfile",
)


class HistoryStore:
    """Blocks by hash (``engine.block_cache.BlockCache``) that keeps the first ``room`` puts
    it is given (a conversation's history) and serves them; it takes nothing else."""

    def __init__(self) -> None:
        self.blocks: dict[int, torch.Tensor] = {}
        self.room = 0

    def put(self, block_hash: int, kv: torch.Tensor, traffic_class: str | None = None) -> None:
        if self.room > 0:
            self.blocks[block_hash] = kv.clone()
            self.room -= 1

    def max_blocks(self, block_bytes: int) -> int | None:
        return None

    def load_prefix(self, block_hashes: Sequence[int]) -> list[tuple[torch.Tensor, str]]:
        found = []
        for block_hash in block_hashes:
            if block_hash not in self.blocks:
                break
            found.append((self.blocks[block_hash], "host"))
        return found


def corpus_text() -> str:
    parts = []
    for name in MODULES:
        module = importlib.import_module(name)
        for _, member in inspect.getmembers(module):
            doc = inspect.getdoc(member)
            if doc and len(doc) > 200:
                parts.append(doc)
    return "\n\n".join(dict.fromkeys(parts))


def make_engine(
    cache: bool,
    allowance: int | None = None,
    store: HistoryStore | None = None,
    hybrid: bool = True,
) -> LLMEngine:
    config = EngineConfig(
        model=MODEL, max_model_len=9216, max_num_batched_tokens=2048, max_num_seqs=4,
        kv_cache_bytes=1 << 30, enable_prefix_caching=cache,
        window_replay_allowance=allowance, hybrid_kv_cache=hybrid,
    )  # fmt: skip
    return LLMEngine(config, block_store=store)


def run(engine: LLMEngine, ids: list[int], max_tokens: int) -> tuple[float, list[int], int]:
    """(seconds to the first token, the greedy tokens, prompt tokens found cached)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request("r", ids, params)
    ttft, tokens, cached = None, [], 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens, cached = output.outputs[0].token_ids, output.num_cached_tokens
            if ttft is None and tokens:
                ttft = time.perf_counter() - start
    assert ttft is not None
    return ttft, list(tokens), cached


class Recorder:
    """Keeps what a model returns while on: its hidden rows and its logits."""

    def __init__(self, engine: LLMEngine) -> None:
        model = engine.runner.model
        self.model = model
        self.hidden: list[torch.Tensor] = []
        self.logits: list[torch.Tensor] = []
        forward, compute = model.forward, model.compute_logits

        def keep_hidden(*args: Any, **kwargs: Any) -> torch.Tensor:
            out = forward(*args, **kwargs)
            self.hidden.append(out.clone())
            return out

        def keep_logits(hidden: torch.Tensor) -> torch.Tensor:
            out = compute(hidden)
            self.logits.append(out.clone())
            return out

        model.forward, model.compute_logits = keep_hidden, keep_logits

    def clear(self) -> None:
        self.hidden, self.logits = [], []


@dataclass
class Conversation:
    turn2: list[int]
    history: int


def conversations(tokenizer: Any, count: int, low: int, high: int) -> list[Conversation]:
    words = tokenizer.encode(corpus_text(), add_special_tokens=False)
    out = []
    for i in range(count):
        length = round(low * (high / low) ** (i / max(count - 1, 1)))
        offset = (i * 7919) % max(len(words) - length, 1)
        user = tokenizer.decode(words[offset : offset + length])
        history = tokenizer.encode(
            f"<start_of_turn>user\n{user}<end_of_turn>\n<start_of_turn>model\n{ANSWER}"
        )
        tail = f"<end_of_turn>\n<start_of_turn>user\n{FOLLOW_UP}<end_of_turn>\n"
        tail += "<start_of_turn>model\n"
        out.append(Conversation(history + tokenizer.encode(tail, add_special_tokens=False),
                                len(history)))  # fmt: skip
    return out


def quality(reference: torch.Tensor, bounded: torch.Tensor, tokens: list[int]) -> dict[str, Any]:
    """Next-token distributions [n, vocab] of the exact mode and a bounded one on the same
    tokens (the exact mode's greedy ones)."""
    ref, got = reference.log_softmax(-1), bounded.log_softmax(-1)
    kl = (ref.exp() * (ref - got)).sum(-1)
    top1 = (ref.argmax(-1) == got.argmax(-1)).float()
    return {
        "top1_agreement": top1.mean().item(),
        "mean_kl": kl.mean().item(),
        "greedy_identical": bool((got.argmax(-1) == torch.tensor(tokens)).all()),
    }


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def median(values: list[float]) -> float:
        ordered = sorted(values)
        return ordered[len(ordered) // 2]

    out: dict[str, Any] = {"median_ttft_ms": median([r["ttft_s"] * 1000 for r in rows])}
    out["mean_prefill_tokens"] = sum(r["computed"] for r in rows) / len(rows)
    out["conversations"] = len(rows)
    if "equal" in rows[0]:
        out["equal_to_uncached_share"] = sum(r["equal"] for r in rows) / len(rows)
    if "top1_agreement" in rows[0]:
        out["top1_agreement"] = sum(r["top1_agreement"] for r in rows) / len(rows)
        out["mean_kl"] = sum(r["mean_kl"] for r in rows) / len(rows)
        out["greedy_identical_share"] = sum(r["greedy_identical"] for r in rows) / len(rows)
    return out


def replay_modes(
    convs: list[Conversation], allowances: list[int], exact_ttft: int
) -> tuple[dict[str, list[dict[str, Any]]], int]:
    """Per mode, a row per conversation; and the bytes the store keeps per cached token."""
    results: dict[str, list[dict[str, Any]]] = {}
    store = HistoryStore()
    # A bounded deployment's blocks (hash root "+bounded-replay"); it never meets a cached
    # prefix here, so it computes every turn whole.
    reference = make_engine(True, allowances[0], store)
    block = reference.config.block_size
    stored = reference.runner.kv_bytes_per_block() // block
    recorder = Recorder(reference)
    continuations, references = [], []
    for conv in convs:
        recorder.clear()
        store.room = conv.history // block
        ttft, tokens, _ = run(reference, conv.turn2, CONTINUATION)
        continuations.append(tokens)
        references.append(torch.cat(recorder.logits)[:CONTINUATION])
        results.setdefault("none", []).append({"ttft_s": ttft, "computed": len(conv.turn2)})
    del reference, recorder
    exact = make_engine(True, None)  # an exact deployment keeps blocks of its own
    for conv, tokens in zip(convs[:exact_ttft], continuations):
        run(exact, conv.turn2[: conv.history], 1)
        ttft, got, cached = run(exact, conv.turn2, CONTINUATION)
        row = {"ttft_s": ttft, "computed": len(conv.turn2) - cached, "equal": got == tokens}
        results.setdefault("exact", []).append(row)
    del exact
    for allowance in allowances:
        timed, forced = make_engine(True, allowance, store), make_engine(True, allowance, store)
        recorder = Recorder(forced)
        for conv, tokens, ref in zip(convs, continuations, references):
            ttft, _, cached = run(timed, conv.turn2, 1)
            recorder.clear()
            run(forced, conv.turn2 + tokens[:-1], 1)
            rows = torch.cat(recorder.hidden)[-CONTINUATION:]
            with torch.inference_mode():
                logits = recorder.model.compute_logits(rows).float()
            row = {"ttft_s": ttft, "computed": len(conv.turn2) - cached}
            row.update(quality(ref, logits, tokens))
            results.setdefault(f"bounded-{allowance}", []).append(row)
        del timed, forced, recorder
    return results, stored


def long_request(length: int) -> dict[str, Any]:
    """One ``length``-token prompt, 32 tokens: the window layers' blocks held at most, and
    the tokens against the full-cache run."""
    hybrid = make_engine(False)
    words = hybrid.tokenizer.encode(corpus_text(), add_special_tokens=False)[:length]
    params = SamplingParams(max_tokens=CONTINUATION, temperature=0, ignore_eos=True)
    hybrid.add_request("long", words, params)
    held, tokens, global_blocks = 0, [], 0
    null = hybrid.runner.window_blocks[0]
    while hybrid.has_unfinished_requests():
        req = hybrid.requests["long"]
        for output in hybrid.step():
            tokens = output.outputs[0].token_ids
        if req.window_tables:  # (freed once it finished)
            held = max(held, sum(b != null for b in req.window_tables[0]))
        global_blocks = max(global_blocks, len(req.block_table))
    block = hybrid.config.block_size
    group = hybrid.runner.kv_groups[1]
    del hybrid
    full = make_engine(False, hybrid=False)
    _, plain, _ = run(full, words, CONTINUATION)
    return {
        "prompt_tokens": length, "window": group.window, "block_size": block,
        "local_layers": len(group.layers), "window_blocks_held_max": held,
        "window_tokens_held_max": held * block, "global_blocks_held": global_blocks,
        "equal_to_full_cache": list(tokens) == plain,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--conversations", type=int, default=50)
    parser.add_argument("--min-prefix", type=int, default=1024)
    parser.add_argument("--max-prefix", type=int, default=8192)
    parser.add_argument("--allowances", default="0,16,64")
    parser.add_argument("--exact-ttft", type=int, default=10)
    parser.add_argument("--long", type=int, default=8192, help="the long request's tokens")
    args = parser.parse_args()
    tokenizer = load_tokenizer(resolve_model(MODEL))
    convs = conversations(tokenizer, args.conversations, args.min_prefix, args.max_prefix)
    allowances = [int(a) for a in args.allowances.split(",")]
    results, stored = replay_modes(convs, allowances, args.exact_ttft)
    probe = make_engine(False, hybrid=False)
    every_layer = probe.runner.kv_bytes_per_block() // probe.config.block_size
    del probe
    record = {
        "benchmark": "window_replay", "model": MODEL, "commit": git_commit(),
        "machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
        "conversations": len(convs), "history_tokens": [c.history for c in convs],
        "stored_bytes_per_cached_token": stored, "full_cache_bytes_per_token": every_layer,
        "modes": {mode: summarize(rows) for mode, rows in results.items()},
        "per_conversation": results, "long_request": long_request(args.long),
    }  # fmt: skip
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    print(f"{'mode':<12}{'TTFT ms':>10}{'computed':>10}{'top1':>8}{'KL':>10}{'same':>7}")
    for mode, s in record["modes"].items():
        q = [s.get(k, math.nan) for k in ("top1_agreement", "mean_kl", "greedy_identical_share")]
        print(
            f"{mode:<12}{s['median_ttft_ms']:>10.1f}{s['mean_prefill_tokens']:>10.0f}"
            f"{q[0]:>8.3f}{q[1]:>10.2e}{q[2]:>7.2f}"
        )
    print(f"stored bytes per cached token {stored} (every layer: {every_layer})")
    print(json.dumps(record["long_request"]))


if __name__ == "__main__":
    main()
