"""`splitserve bench offline`: engine prefill / decode throughput with MBU and MFU, beside
its peers on the same model and token ids (transformers `generate`, and with ``--peer
compiled`` a torch.compile'd static-cache decoder), in one run, written as JSON."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from splitserve.bench.roofline import Ceilings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--shape", default=None, help="random weights of a shape: llama3-8b, ...")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument(
        "--cpu-weights",
        default="auto",
        choices=["auto", "bfloat16"],
        help="CPU projection weights: the GGUF blocks (auto) or bfloat16 for oneDNN (opt-in)",
    )
    parser.add_argument(
        "--deterministic",
        action="store_true",
        help="batch-invariant inference (EngineConfig.deterministic, docs/engine.md)",
    )
    parser.add_argument(
        "--quantization", default=None, choices=["fp8"], help="FP8 weights (e4m3 blocks)"
    )
    parser.add_argument(
        "--kv-cache-dtype", default="auto", choices=["auto", "fp8"], help="FP8 KV cache"
    )
    parser.add_argument("--batch-sizes", default="1,32")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--prefill-len", type=int, default=0, help="also time one long prefill")
    parser.add_argument("--attention-backend", choices=("auto", "torch", "triton"), default="auto")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.4)
    parser.add_argument("--no-cuda-graphs", action="store_true")
    parser.add_argument(
        "--no-overlap", action="store_true", help="synchronous decode steps (the baseline)"
    )
    parser.add_argument(
        "--decode-path",
        default="fused",
        choices=["fused", "gemv", "separate"],
        help="batch-1 projections: GEMV with norm and SiLU fused, GEMV alone, or cuBLAS",
    )
    parser.add_argument(
        "--gemv-max-mb",
        type=int,
        default=None,
        help="largest weight (MB) that takes the batch-1 GEMV (default: the engine's)",
    )
    parser.add_argument(
        "--no-onednn",
        action="store_true",
        help="CPU projections through F.linear (MKL) instead of oneDNN (the A/B baseline)",
    )
    parser.add_argument(
        "--no-native",
        action="store_true",
        help="CPU norm, SiLU and decode attention through torch instead of the native kernels "
        "(with --dtype float32: the engine before the native kernels)",
    )
    parser.add_argument(
        "--no-pdl",
        action="store_true",
        help="launch the decode kernels without programmatic dependent launch (A/B baseline)",
    )
    parser.add_argument("--no-baseline", action="store_true", help="skip transformers")
    parser.add_argument(
        "--peer",
        action="append",
        choices=["compiled"],
        default=[],
        help="also run a peer: compiled (static KV cache, torch.compile reduce-overhead)",
    )
    parser.add_argument("--seed", type=int, default=0)
    spec = parser.add_argument_group("speculative decoding (bench/speculative.py)")
    spec.add_argument("--speculative", choices=["ngram", "draft_model"], default=None)
    spec.add_argument("--spec-ks", default="2,4,8", help="fixed k runs; dynamic: the largest")
    spec.add_argument("--draft-model", default=None, help="the draft_model method's draft")
    spec.add_argument(
        "--draft-seed", type=int, default=None, help="seed of a shape: draft (another: rejected)"
    )
    spec.add_argument("--prompt-lookup-max", type=int, default=None, help="ngram: longest n")
    spec.add_argument(
        "--spec-workloads", default="copy,grounded,free,mixed", help="and random (shapes)"
    )
    spec.add_argument("--repeats", type=int, default=3, help="median of this many runs")
    spec.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--result-dir", default="benchmarks/results")
    parser.add_argument("--result-file", default=None)


def run(args: argparse.Namespace) -> int:
    if args.speculative:
        from splitserve.bench.speculative import run_speculative

        return run_speculative(args)
    result = benchmark(args)
    path = _result_path(args, result)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(format_table(result))
    print(f"wrote {path}")
    return 0


def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from splitserve.bench.compiled_peer import compiled_throughput, load_compiled_peer
    from splitserve.bench.engine_run import engine_throughput
    from splitserve.bench.hf_baseline import hf_throughput, load_hf_model
    from splitserve.bench.report import header
    from splitserve.bench.roofline import measure_ceilings, reference_ceilings
    from splitserve.engine.llm import LLM
    from splitserve.engine.loader import resolve_model
    from splitserve.kernels.dispatch import set_decode_path

    set_decode_path(args.decode_path)
    if args.no_onednn:
        from splitserve.engine.layers.cpu_gemm import set_onednn_enabled

        set_onednn_enabled(False)
    if args.no_native:
        from splitserve.kernels.native.decode import set_native_enabled

        set_native_enabled(False)
    if args.no_pdl:
        from splitserve.kernels.pdl import set_pdl_enabled

        set_pdl_enabled(False)
    if args.gemv_max_mb is not None:
        from splitserve.engine.layers import linear

        linear.GEMV_MAX_BYTES = args.gemv_max_mb << 20
    model = f"shape:{args.shape}" if args.shape else args.model
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    longest = max(args.input_len + args.output_len, args.prefill_len + 1)
    llm = LLM(
        model=model,
        device=args.device,
        dtype=args.dtype,
        cpu_weights=args.cpu_weights,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        attention_backend=args.attention_backend,
        max_model_len=longest + 16,
        max_num_seqs=max(batch_sizes),
        max_num_batched_tokens=max(args.prefill_len, 2048),
        gpu_memory_utilization=args.gpu_memory_utilization,
        cuda_graph_max_batch=0 if args.no_cuda_graphs else max(batch_sizes),
        overlap_scheduling=False if args.no_overlap else None,
        deterministic=args.deterministic,
    )
    runner = llm.engine.runner
    ceilings = measure_ceilings(runner.device, runner.dtype)
    result = header(vars(args) | {"model": model})
    result["device_name"] = _device_name(runner.device)
    result["dtype"] = str(runner.dtype).removeprefix("torch.")
    result["cpu_weights"] = args.cpu_weights
    result["ceilings"] = _ceilings_json(ceilings)
    reference = reference_ceilings(result["device_name"], runner.dtype)
    result["reference_ceilings"] = None if reference is None else _ceilings_json(reference)
    generator = torch.Generator().manual_seed(args.seed)
    vocab = llm.engine.model_config.vocab_size
    hf = (
        None
        if args.no_baseline
        else load_hf_model(resolve_model(model), runner.device, runner.dtype)
    )
    compiled = (
        load_compiled_peer(resolve_model(model), runner.device, runner.dtype, args.seed)
        if "compiled" in args.peer
        else None
    )
    rows = []
    for batch in batch_sizes:
        prompts = torch.randint(100, vocab, (batch, args.input_len), generator=generator).tolist()
        row: dict[str, Any] = {
            "batch": batch,
            "input_len": args.input_len,
            "output_len": args.output_len,
        }
        ours = engine_throughput(llm, prompts, args.output_len, ceilings, reference)
        row["splitserve"] = ours
        if hf is not None:
            row["transformers"] = hf_throughput(hf, prompts, args.output_len, runner.device)
            row["speedup_decode"] = (
                ours["decode_tokens_per_s"] / row["transformers"]["decode_tokens_per_s"]
            )
        if compiled is not None:
            row["compiled"] = compiled_throughput(compiled, prompts, args.output_len)
            row["speedup_decode_vs_compiled"] = (
                ours["decode_tokens_per_s"] / row["compiled"]["decode_tokens_per_s"]
            )
        rows.append(row)
    result["decode"] = rows
    if args.prefill_len:
        prompt = torch.randint(100, vocab, (1, args.prefill_len), generator=generator).tolist()
        result["prefill"] = engine_throughput(llm, prompt, 1, ceilings, reference)
    return result


def _ceilings_json(ceilings: Ceilings) -> dict[str, float]:
    return {
        "bandwidth_gb_per_s": ceilings.bandwidth_bytes_per_s / 1e9,
        "matmul_tflops": ceilings.matmul_flops_per_s / 1e12,
    }


def _device_name(device: Any) -> str:
    import platform

    import torch

    if device.type == "cuda":
        return str(torch.cuda.get_device_name(device))
    return f"{platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"


def _result_path(args: argparse.Namespace, result: dict[str, Any]) -> Path:
    if args.result_file:
        return Path(args.result_file)
    tag = "cpu" if args.device == "cpu" else "gpu"
    name = (args.shape or args.model).replace("/", "_")
    return Path(args.result_dir) / f"{tag}-offline-{name}.json"


def format_table(result: dict[str, Any]) -> str:
    nan = float("nan")
    head = (
        f"device {result['device_name']}  dtype {result['dtype']}  "
        f"bw {result['ceilings']['bandwidth_gb_per_s']:.1f} GB/s  "
        f"matmul {result['ceilings']['matmul_tflops']:.2f} TFLOP/s"
    )
    reference = result.get("reference_ceilings")
    if reference is not None:
        head += (
            f"  (reference {reference['bandwidth_gb_per_s']:.0f} GB/s, "
            f"{reference['matmul_tflops']:.0f} TFLOP/s)"
        )
    lines = [
        head,
        f"{'batch':>5} {'steps':>5} {'splitserve tok/s':>17} {'MBU':>6} {'MBU ref':>7} "
        f"{'transformers tok/s':>19} {'x':>6} {'compiled tok/s':>15} {'x':>6}",
    ]
    for row in result["decode"]:
        ours = row["splitserve"]
        base = row.get("transformers", {}).get("decode_tokens_per_s", nan)
        compiled = row.get("compiled", {}).get("decode_tokens_per_s", nan)
        lines.append(
            f"{row['batch']:>5} {ours['decode_steps']:>5} {ours['decode_tokens_per_s']:>17.1f} "
            f"{ours['mbu_decode']:>6.1%} {ours.get('mbu_decode_reference', nan):>7.1%} "
            f"{base:>19.1f} {row.get('speedup_decode', nan):>6.2f} "
            f"{compiled:>15.1f} {row.get('speedup_decode_vs_compiled', nan):>6.2f}"
        )
    if "prefill" in result:
        p = result["prefill"]
        line = f"prefill {p['prefill_tokens_per_s']:.0f} tok/s  MFU {p['mfu_prefill']:.1%}"
        if "mfu_prefill_reference" in p:
            line += f" (reference {p['mfu_prefill_reference']:.1%})"
        lines.append(line)
    return "\n".join(lines)
