"""`splitserve bench offline --speculative METHOD`: decode with and without speculative
decoding on the same prompts, in one run, written as JSON.

Workloads: ``grounded`` (chat requests that repeat, copy or rewrite a given passage, where
n-grams of the answer occur in the prompt), ``free`` (open-ended chat requests, little to copy)
and ``random`` (random token prompts, for random-weight shapes). For each workload and batch
size both engines generate the same greedy tokens (checked: ``outputs_equal``); decode time
runs from the step that gave every request its first token to the end, best of ``--repeats``.
"""

from __future__ import annotations

import argparse
import itertools
import time
from pathlib import Path
from typing import Any

from splitserve.bench.report import emit, header
from splitserve.engine.llm import LLM
from splitserve.engine.sampling_params import SamplingParams

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


def run_speculative(args: argparse.Namespace) -> int:
    model = f"shape:{args.shape}" if args.shape else args.model
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    spec: dict[str, Any] = {
        "method": args.speculative,
        "num_speculative_tokens": args.num_speculative_tokens,
        "dynamic": not args.no_dynamic,
    }
    if args.speculative == "draft_model":
        spec["model"] = args.draft_model
        if args.draft_seed is not None:
            spec["draft_seed"] = args.draft_seed
    common = dict(
        model=model,
        device=args.device,
        dtype=args.dtype,
        attention_backend=args.attention_backend,
        max_model_len=2048,
        max_num_seqs=max(batch_sizes),
        gpu_memory_utilization=args.gpu_memory_utilization,
        overlap_scheduling=False if args.no_overlap else None,
    )
    plain, speculative = LLM(**common), LLM(**common, speculative_config=spec)
    result = header(vars(args) | {"model": model, "speculative_config": spec})
    rows = []
    for workload in args.spec_workloads.split(","):
        for batch in batch_sizes:
            prompts = _prompts(plain, workload, batch, args.input_len)
            rows.append(_compare(plain, speculative, prompts, args, workload))
            print(_line(rows[-1]), flush=True)
    result["speculative"] = rows
    out = Path(args.result_file or Path(args.result_dir) / f"cpu-spec-{args.speculative}.json")
    emit(result, out)
    return 0


def _prompts(llm: LLM, workload: str, batch: int, input_len: int) -> list[list[int]]:
    if workload == "random":
        import torch

        vocab = llm.engine.model_config.vocab_size
        generator = torch.Generator().manual_seed(batch)
        return torch.randint(100, vocab, (batch, input_len), generator=generator).tolist()
    if workload == "grounded":
        asks = [a.format(p) for a, p in itertools.product(GROUNDED, PASSAGES)]
    else:
        asks = FREE
    chats = itertools.islice(itertools.cycle(asks), batch)
    return [llm.apply_chat_template([{"role": "user", "content": ask}]) for ask in chats]


def _compare(
    plain: LLM, speculative: LLM, prompts: list[list[int]], args: argparse.Namespace, name: str
) -> dict[str, Any]:
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=args.ignore_eos)
    counters = speculative.engine.spec.counters if speculative.engine.spec else None
    best: dict[str, tuple[float, int, list[list[int]]]] = {}
    before = (counters.num_drafts, counters.num_accepted_tokens) if counters else (0, 0)
    for _ in range(args.repeats):
        for label, llm in (("plain", plain), ("speculative", speculative)):
            seconds, tokens, outputs = _decode(llm, prompts, params)
            if label not in best or seconds < best[label][0]:
                best[label] = (seconds, tokens, outputs)
    row: dict[str, Any] = {"workload": name, "batch": len(prompts)}
    for label, (seconds, tokens, _) in best.items():
        row[label] = {
            "decode_s": seconds,
            "decode_tokens": tokens,
            "tokens_per_s": tokens / seconds,
        }
    row["speedup_decode"] = row["speculative"]["tokens_per_s"] / row["plain"]["tokens_per_s"]
    row["outputs_equal"] = best["plain"][2] == best["speculative"][2]
    if counters is not None:
        drafts = counters.num_drafts - before[0]
        accepted = counters.num_accepted_tokens - before[1]
        row["verify_steps_per_request"] = drafts
        row["mean_acceptance_length"] = 1 + accepted / drafts if drafts else None
    return row


def _decode(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, int, Any]:
    """(seconds from every request's first token to the last token, tokens in that time,
    the outputs' token ids)."""
    engine = llm.engine
    ids = [f"b{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, params)
    counts: dict[str, int] = {}
    first_at, seen, done = 0.0, 0, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            counts[out.request_id] = len(out.outputs[0].token_ids)
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        if not first_at and len(counts) == len(ids):
            first_at, seen = time.perf_counter(), sum(counts.values())
    end = time.perf_counter()
    outputs = [done[i] for i in ids]
    return end - first_at, sum(len(o) for o in outputs) - seen, outputs


def _line(row: dict[str, Any]) -> str:
    return (
        f"{row['workload']:>9} batch {row['batch']:>3}: plain "
        f"{row['plain']['tokens_per_s']:.1f} tok/s, speculative "
        f"{row['speculative']['tokens_per_s']:.1f} tok/s, x{row['speedup_decode']:.2f}, "
        f"acceptance length {row.get('mean_acceptance_length')}, equal {row['outputs_equal']}"
    )
