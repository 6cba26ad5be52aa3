"""Bounded replay on DeepSeek-V4 (docs/models.md, "The cache"): a prefix hit restores the
compressed entries and rebuilds every layer's window rows by replaying the prefix's last
``reach + allowance`` tokens; against the uncached run on the same tokens.

Each prompt is a history of random token ids and a tail. One engine without a prefix cache
gives the reference: the greedy continuation, and the next-token distributions along it
(teacher-forced: the prompt and the continuation as one prefill, every row's logits). Each
mode's engine first computes the history alone (its cache then holds the history's entries),
then the same teacher-forced prefill, whose distributions are compared with the reference's:
top-1 agreement, mean KL(reference || mode), the share of prompts whose continuation stays
the reference's greedy one, and the prompt tokens computed (the prefill the hit saved).

The default model is a random-weight shape (no trained V4 is small enough for a CPU); a
checkpoint directory can be given instead.

    python -m benchmarks.cpu.v4_replay --out results.json [--allowances 0,4,12]
"""

from __future__ import annotations

import argparse
import json
import platform
from typing import Any

import torch

from splitserve.bench.report import git_commit
from splitserve.engine.config import EngineConfig
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.sampling_params import SamplingParams


def make_engine(model: str, block_size: int, cache: bool, allowance: int | None) -> LLMEngine:
    config = EngineConfig(
        model=model, max_model_len=2048, block_size=block_size, max_num_seqs=4,
        enable_prefix_caching=cache, window_replay_allowance=allowance,
    )  # fmt: skip
    return LLMEngine(config)


def run(engine: LLMEngine, ids: list[int], max_tokens: int) -> tuple[list[int], int]:
    """(the greedy tokens, the prompt tokens found cached)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    engine.add_request("r", ids, params)
    tokens: list[int] = []
    cached = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens, cached = list(output.outputs[0].token_ids), output.num_cached_tokens
    return tokens, cached


def forced_logits(engine: LLMEngine, ids: list[int], rows: int) -> tuple[torch.Tensor, int]:
    """The logits of the last ``rows`` positions of one prefill of ``ids`` (in one chunk),
    and the prompt tokens found cached."""
    model = engine.runner.model
    hidden: list[torch.Tensor] = []
    hook = model.register_forward_hook(lambda module, args, out: hidden.append(out.clone()))
    try:
        _, cached = run(engine, ids, 1)
    finally:
        hook.remove()
    with torch.inference_mode():
        return model.compute_logits(hidden[0][-rows:]).float(), cached


def quality(reference: torch.Tensor, got: torch.Tensor, tokens: list[int]) -> dict[str, Any]:
    ref, log = reference.log_softmax(-1), got.log_softmax(-1)
    return {
        "top1_agreement": (ref.argmax(-1) == log.argmax(-1)).float().mean().item(),
        "mean_kl": (ref.exp() * (ref - log)).sum(-1).mean().item(),
        "greedy_identical": bool((log.argmax(-1) == torch.tensor(tokens)).all()),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default="shape:tiny-deepseek-v4")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--history", type=int, default=200)
    parser.add_argument("--tail", type=int, default=16)
    parser.add_argument("--continuation", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=8)
    parser.add_argument("--allowances", default="0,4,12")
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(3, 500, (args.history + args.tail,), generator=generator).tolist()
        for _ in range(args.prompts)
    ]
    reference = make_engine(args.model, args.block_size, False, None)
    continuations, references = [], []
    for ids in prompts:
        tokens, _ = run(reference, ids, args.continuation)
        logits, _ = forced_logits(reference, ids + tokens[:-1], args.continuation)
        continuations.append(tokens)
        references.append(logits)
    modes: dict[str, int | None] = {"exact": None}
    modes |= {f"bounded-{a}": int(a) for a in args.allowances.split(",")}
    results: dict[str, Any] = {}
    for name, allowance in modes.items():
        engine = make_engine(args.model, args.block_size, True, allowance)
        rows = []
        for ids, tokens, ref in zip(prompts, continuations, references):
            run(engine, ids[: args.history], 1)
            forced = ids + tokens[:-1]
            logits, cached = forced_logits(engine, forced, args.continuation)
            rows.append({"computed": len(forced) - cached, **quality(ref, logits, tokens)})
        results[name] = {
            "top1_agreement": sum(r["top1_agreement"] for r in rows) / len(rows),
            "mean_kl": sum(r["mean_kl"] for r in rows) / len(rows),
            "greedy_identical_share": sum(r["greedy_identical"] for r in rows) / len(rows),
            "mean_prompt_tokens_computed": sum(r["computed"] for r in rows) / len(rows),
            "prompt_tokens": args.history + args.tail + args.continuation - 1,
        }
        del engine
    report = {
        "config": vars(args),
        "commit": git_commit(),
        "machine": platform.machine(),
        "results": results,
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
