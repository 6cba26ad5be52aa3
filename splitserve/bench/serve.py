"""`splitserve bench serve`: load-test any OpenAI-compatible endpoint.

Builds the requests of a dataset, releases them at a Poisson rate (or a sweep of rates),
prints a summary table per rate and writes a JSON record with vLLM's key names, the
flags and the git commit. Exit status 1 when no request completed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import httpx

from splitserve.bench import datasets
from splitserve.bench.client import EndpointConfig, first_model, request_body
from splitserve.bench.datasets import BenchRequest
from splitserve.bench.load import LoadConfig, run_load
from splitserve.bench.metrics import SLO, summarize
from splitserve.bench.report import details, format_table, header
from splitserve.bench.text import TextSource, load_tokenizer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    target = parser.add_argument_group("target")
    target.add_argument("--base-url", default="http://127.0.0.1:8000")
    target.add_argument("--model", help="model name to send (default: first of /v1/models)")
    target.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    target.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    target.add_argument("--tokenizer", help="alias, GGUF file or HF dir; counts prompt tokens")
    target.add_argument("--timeout", type=float, default=600.0, help="per request (s)")
    _add_dataset_arguments(parser.add_argument_group("dataset"))
    load = parser.add_argument_group("load")
    load.add_argument("--num-prompts", type=int, default=100)
    load.add_argument("--request-rate", type=float, default=float("inf"), help="req/s, Poisson")
    load.add_argument("--sweep-rates", type=_rates, help="comma-separated rates, e.g. 1,2,4")
    load.add_argument("--max-concurrency", type=int)
    load.add_argument("--ignore-eos", action="store_true")
    load.add_argument("--temperature", type=float, default=0.0)
    load.add_argument("--seed", type=int, default=0)
    out = parser.add_argument_group("results")
    out.add_argument("--slo-ttft-ms", type=float, help="goodput: TTFT objective (ms)")
    out.add_argument("--slo-tpot-ms", type=float, help="goodput: TPOT objective (ms)")
    out.add_argument("--metric-percentiles", type=_rates, default=[90.0, 99.0])
    out.add_argument("--result-file", type=Path)
    out.add_argument("--save-detailed", action="store_true", help="per-request values in JSON")
    out.add_argument("--plot-file", type=Path, help="sweep plot PNG (default: beside results)")
    out.add_argument("--disable-tqdm", action="store_true")


def _add_dataset_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--dataset", choices=["random", "shared-prefix", "multi-turn", "file"], default="random"
    )
    group.add_argument("--random-input-len", type=int, default=1024)
    group.add_argument("--random-output-len", type=int, default=128)
    group.add_argument("--random-range-ratio", type=float, default=0.0)
    group.add_argument("--shared-prefix-num-prefixes", type=int, default=4)
    group.add_argument("--shared-prefix-users", type=int, default=8, help="users per prefix")
    group.add_argument("--shared-prefix-system-len", type=int, default=512)
    group.add_argument("--shared-prefix-question-len", type=int, default=64)
    group.add_argument("--multi-turn-conversations", type=int, default=8)
    group.add_argument("--multi-turn-turns", type=int, default=4)
    group.add_argument("--multi-turn-turn-len", type=int, default=128, help="per user turn")
    group.add_argument("--dataset-path", type=Path, help="JSONL for --dataset file")
    group.add_argument(
        "--output-len", type=int, default=128, help="shared-prefix, multi-turn, file"
    )


def _rates(text: str) -> list[float]:
    try:
        return [float(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a list of numbers: {text!r}") from exc


def build_dataset(args: argparse.Namespace, source: TextSource, seed: int) -> list[BenchRequest]:
    if args.dataset == "random":
        return datasets.random_dataset(
            source,
            args.num_prompts,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            seed,
        )
    if args.dataset == "shared-prefix":
        return datasets.shared_prefix_dataset(
            source,
            args.shared_prefix_num_prefixes,
            args.shared_prefix_users,
            args.shared_prefix_system_len,
            args.shared_prefix_question_len,
            args.output_len,
            seed,
        )
    if args.dataset == "multi-turn":
        return datasets.multi_turn_dataset(
            source,
            args.multi_turn_conversations,
            args.multi_turn_turns,
            args.multi_turn_turn_len,
            args.output_len,
            seed,
        )
    if args.dataset_path is None:
        raise ValueError("--dataset file needs --dataset-path")
    return datasets.file_dataset(args.dataset_path, args.output_len)


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except (ValueError, OSError, httpx.HTTPError) as exc:
        print(f"splitserve bench serve: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    if args.num_prompts < 1 or (args.max_concurrency is not None and args.max_concurrency < 1):
        raise ValueError("--num-prompts and --max-concurrency must be at least 1")
    source = TextSource(load_tokenizer(args.tokenizer) if args.tokenizer else None)
    model = args.model or first_model(args.base_url, args.api_key)
    endpoint = EndpointConfig(
        args.base_url, model, args.endpoint, args.ignore_eos, args.temperature, args.api_key,
        args.timeout,
    )  # fmt: skip
    runs = []
    for k, rate in enumerate(args.sweep_rates or [args.request_rate]):
        # Each rate of a sweep draws its own prompts, so that one rate's prompts are not
        # served from the prefix cache that the previous rate filled.
        record = _run_rate(args, endpoint, source, rate, args.seed + k)
        print(format_table(record, f"Serving benchmark, rate {rate:g}/s"))
        runs.append(record)
    _write(args, {**vars(args), "model": model}, runs)
    return 0 if any(run["completed"] for run in runs) else 1


def _run_rate(
    args: argparse.Namespace, endpoint: EndpointConfig, source: TextSource, rate: float, seed: int
) -> dict[str, Any]:
    requests = datasets.take(build_dataset(args, source, seed), args.num_prompts)
    bodies = [request_body(endpoint, source, r) for r in requests]
    prompt_lens = [source.prompt_len(r.messages, endpoint.endpoint) for r in requests]
    load = LoadConfig(rate, args.max_concurrency, seed, not args.disable_tqdm)
    outcome = asyncio.run(run_load(endpoint, bodies, prompt_lens, load))
    slo = SLO(args.slo_ttft_ms, args.slo_tpot_ms)
    record: dict[str, Any] = {"request_rate": rate, "max_concurrency": args.max_concurrency}
    record.update(summarize(outcome.results, outcome.duration, slo, args.metric_percentiles))
    if args.save_detailed:
        record["details"] = details(outcome.results)
    return record


def _write(args: argparse.Namespace, config: dict[str, Any], runs: list[dict[str, Any]]) -> None:
    config = {k: _jsonable(v) for k, v in config.items() if not k.startswith("_")}
    if args.sweep_rates:
        plot_path = args.plot_file or (args.result_file or Path("sweep.json")).with_suffix(".png")
        from splitserve.bench.plot import plot_sweep

        plot_sweep(runs, plot_path, f"{config['model']} ({args.dataset})")
        print(f"plot: {plot_path}")
    if args.result_file is None:
        return
    runs = [{**run, "request_rate": _jsonable(run["request_rate"])} for run in runs]
    record = header(config)
    if args.sweep_rates:
        record["runs"] = runs
    else:
        record.update(runs[0])
    args.result_file.parent.mkdir(parents=True, exist_ok=True)
    args.result_file.write_text(json.dumps(record, indent=2) + "\n")
    print(f"results: {args.result_file}")


def _jsonable(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, float) and value == float("inf"):
        return "inf"
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="splitserve bench serve", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
