"""Deterministic mode end to end (issue 45; part of benchmarks/gpu/deterministic.sh): a probe
prompt's every generated token has the same logprob bits, and a seeded temperature-1 request
the same tokens, whatever shares its batch and however its prompt is computed.

One engine at a time (each freed before the next), all ``deterministic=True`` with CUDA graphs
and overlapped scheduling as configured by default:

- ``chunks``: prompts prefilled up to ``--chunk`` tokens a step, prefix caching on. The probe
  alone first (nothing cached: the reference), then at the middle of batches of 1 to
  ``--max-others`` other prompts of mixed lengths (its prefix now cached, its remainder chunked
  beside other prompts' chunks and decode rows; batches over the graphs' largest run eagerly);
- ``disaggregated`` (1P1D): the probe among 7 others prefilled 64 tokens a step on one
  engine, its KV handed to another that decodes it (greedy and seeded);
- ``small_chunks_ngram``: prompts prefilled 64 tokens a step, no prefix caching, and n-gram
  speculative decoding (k = 4): the greedy tokens and logprobs must be plain decoding's, the
  verify steps' k + 1 rows reducing as one-row steps do. n-gram drafts only where the output
  repeats the context: the drafting counters are in the report (no drafts, no verification);
- ``draft_model``: the target as its own draft (the same shape and seed): every draft accepted,
  every decode step a verify step of k + 1 rows; greedy, alone and batched.

Prints one JSON object (also to $OUT/deterministic-engine-<shape>.json); exit status 1 when a
check fails. ``--device cpu --model shape:tiny-llama`` runs through the Triton interpreter (a
smoke test of this script; slow, so there keep ``--max-others`` small).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

Bits = list[tuple[int, list[tuple[int, float]]]]
T = TypeVar("T")


def bits(out: Any) -> Bits:
    """Each generated token with its logprob entries, exactly."""
    completion = out.outputs[0]
    return [
        (token, sorted((t, e.logprob) for t, e in entries.items()))
        for token, entries in zip(completion.token_ids, completion.logprobs)
    ]


def with_engines(args: argparse.Namespace, work: Callable[..., T], *overrides: dict[str, Any]) -> T:
    """work(one deterministic LLM of args' model per overrides), the LLMs freed afterwards
    (their weights and KV pools given back to the device before the next are built)."""
    from splitserve.engine.llm import LLM

    settings: dict[str, Any] = dict(
        device=args.device, dtype=args.dtype, deterministic=True, max_model_len=args.max_model_len,
        max_num_seqs=args.max_others + 1, gpu_memory_utilization=args.gpu_memory_utilization,
    )  # fmt: skip
    if args.device == "cpu":
        settings.update(attention_backend="triton", num_kv_blocks=256)
    llms = [LLM(args.model, **(settings | o)) for o in overrides]
    try:
        return work(*llms)
    finally:
        del llms
        gc.collect()
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()


def disaggregated(prefill: Any, decode: Any, prompts: list[list[int]], params: Any) -> list[Any]:
    """Each prompt prefilled on one engine, its KV handed to the other, which decodes it (as a
    prefill and a decode worker do, tests/support/handoff.py); the final outputs in order."""
    for index, prompt in enumerate(prompts):
        assert decode.handoff.reserve(decode.build_request(str(index), prompt, params))
        prefill.add_request(str(index), prompt, params, prefill_only=True)
    outputs: dict[str, Any] = {}
    while prefill.has_unfinished_requests() or decode.has_unfinished_requests():
        for output in prefill.step():
            handed = prefill.handoff.pop_prefilled(output.request_id)
            buffer = decode.handoff.receive_buffer(output.request_id)
            buffer.copy_(handed.kv)
            adopted = decode.handoff.adopt(
                output.request_id, buffer, handed.first_token, handed.logprobs
            )
            outputs[output.request_id] = decode.admit_prefilled(*adopted)
        for output in decode.step():
            outputs[output.request_id] = output
    return [outputs[str(index)] for index in range(len(prompts))]


def prompts(args: argparse.Namespace, vocab: int) -> tuple[list[int], list[list[int]]]:
    """The probe and the other prompts (mixed lengths, 4 to --max-other-len tokens)."""
    gen = torch.Generator().manual_seed(0)
    probe = torch.randint(10, vocab, (args.probe_len,), generator=gen).tolist()
    lengths = torch.randint(4, args.max_other_len + 1, (args.max_others,), generator=gen)
    others = [torch.randint(10, vocab, (int(n),), generator=gen).tolist() for n in lengths]
    return probe, others


def batch_sizes(most: int) -> list[int]:
    return sorted({n for n in (1, 7, 63, most) if n <= most})


def probe_runs(
    llm: Any, probe: list[int], others: list[list[int]], sizes: list[int], params: Any
) -> list[tuple[int, Any]]:
    """(others, the probe's output) with the probe in the middle of each batch."""
    runs = []
    for n in sizes:
        batch = [*others[: n // 2], probe, *others[n // 2 : n]]
        runs.append((n, llm.generate(batch, params, use_tqdm=False)[n // 2]))
    return runs


def check(args: argparse.Namespace) -> dict[str, Any]:
    from splitserve.engine.sampling_params import SamplingParams

    greedy = SamplingParams(max_tokens=args.output_len, temperature=0, logprobs=1, ignore_eos=True)
    seeded = SamplingParams(
        max_tokens=args.output_len, temperature=1.0, seed=11, logprobs=0, ignore_eos=True
    )
    sizes = batch_sizes(args.max_others)
    report: dict[str, Any] = {}
    start = time.perf_counter()

    def chunks(llm: Any) -> tuple[list[int], list[list[int]], Bits, Bits]:
        probe, others = prompts(args, llm.engine.model_config.vocab_size)
        alone = llm.generate([probe], greedy, use_tqdm=False)[0]
        reference = bits(alone)
        seeded_alone = bits(llm.generate([probe], seeded, use_tqdm=False)[0])
        greedy_runs = probe_runs(llm, probe, others, sizes, greedy)
        seeded_runs = probe_runs(llm, probe, others, sizes, seeded)
        report["chunks"] = {
            "chunk": args.chunk,
            "alone_cached_tokens": alone.num_cached_tokens,
            "greedy": [
                {"others": n, "cached_tokens": o.num_cached_tokens, "equal": bits(o) == reference}
                for n, o in greedy_runs
            ],
            "seeded": [{"others": n, "equal": bits(o) == seeded_alone} for n, o in seeded_runs],
            "seconds": time.perf_counter() - start,
        }
        return probe, others, reference, seeded_alone

    probe, others, reference, seeded_alone = with_engines(
        args, chunks, {"max_num_batched_tokens": args.chunk}
    )

    def handoff(prefill: Any, decode: Any) -> dict[str, Any]:
        begin = time.perf_counter()
        batch = [*others[:3], probe, *others[3:7]]
        greedy_out = disaggregated(prefill.engine, decode.engine, batch, greedy)[3]
        seeded_out = disaggregated(prefill.engine, decode.engine, batch, seeded)[3]
        return {
            "greedy": [{"others": len(batch) - 1, "equal": bits(greedy_out) == reference}],
            "seeded": [{"others": len(batch) - 1, "equal": bits(seeded_out) == seeded_alone}],
            "seconds": time.perf_counter() - begin,
        }

    # 1P1D: prefilled 64 tokens a step on one engine, decoded on another. These engines and
    # the ones below see at most 8 prompts: 16 sequences (fewer shapes to warm up, capture).
    no_cache = {"enable_prefix_caching": False, "max_num_seqs": 16}
    report["disaggregated"] = with_engines(
        args, handoff, no_cache | {"max_num_batched_tokens": 64}, no_cache
    )

    def speculative(llm: Any, with_seeds: bool) -> dict[str, Any]:
        begin = time.perf_counter()
        runs = [(0, llm.generate([probe], greedy, use_tqdm=False)[0])]
        runs += probe_runs(llm, probe, others, sizes[:2], greedy)
        part: dict[str, Any] = {
            "greedy": [{"others": n, "equal": bits(o) == reference} for n, o in runs]
        }
        if with_seeds:
            seeded_runs = probe_runs(llm, probe, others, sizes[:2], seeded)
            part["seeded"] = [
                {"others": n, "equal": bits(o) == seeded_alone} for n, o in seeded_runs
            ]
        return part | spec_counters(llm) | {"seconds": time.perf_counter() - begin}

    ngram = {"method": "ngram", "num_speculative_tokens": 4, "dynamic": False}
    report["small_chunks_ngram"] = with_engines(
        args, lambda llm: speculative(llm, True),
        no_cache | {"max_num_batched_tokens": 64, "speculative_config": ngram},
    )  # fmt: skip
    report["small_chunks_ngram"]["chunk"] = 64
    if args.draft_model:
        # The target's shape and seed as its own draft: every draft is accepted, so every
        # decode step verifies k + 1 rows.
        draft = {"method": "draft_model", "model": args.model, "num_speculative_tokens": 4,
                 "dynamic": False}  # fmt: skip
        report["draft_model"] = with_engines(
            args,
            lambda llm: speculative(llm, False),
            {"speculative_config": draft, "max_num_seqs": 16},
        )
    report["probe_tokens"] = [token for token, _ in reference]
    return report


def spec_counters(llm: Any) -> dict[str, int]:
    stats = llm.engine.stats()
    return {
        "drafts": stats.spec_num_drafts,
        "draft_tokens": stats.spec_num_draft_tokens,
        "accepted_tokens": stats.spec_num_accepted_tokens,
    }


def all_equal(report: dict[str, Any]) -> bool:
    cases = [
        case
        for part in ("chunks", "disaggregated", "small_chunks_ngram", "draft_model")
        for kind in ("greedy", "seeded")
        for case in report.get(part, {}).get(kind, [])
    ]
    return all(case["equal"] for case in cases)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="shape:llama3-8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--probe-len", type=int, default=500)
    parser.add_argument("--max-others", type=int, default=255)
    parser.add_argument("--max-other-len", type=int, default=1000)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--chunk", type=int, default=2048, help="max_num_batched_tokens")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument(
        "--no-draft-model", dest="draft_model", action="store_false",
        help="skip the draft-model check (a second copy of the weights)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before a kernel module is imported
        from splitserve.kernels.dispatch import set_kernels_on_cpu

        set_kernels_on_cpu(True)
    started = time.perf_counter()
    report = check(args)
    report["ok"] = all_equal(report)
    report.update(
        args=vars(args),
        device=torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        commit=os.environ.get("SPLITSERVE_GIT_COMMIT"),
        seconds=time.perf_counter() - started,
    )
    text = json.dumps(report, indent=1)
    print(text)
    if os.environ.get("OUT"):
        name = args.model.removeprefix("shape:").replace("?", "-").replace("=", "")
        Path(os.environ["OUT"], f"deterministic-engine-{name}.json").write_text(text)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
