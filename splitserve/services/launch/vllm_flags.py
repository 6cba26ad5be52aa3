"""`splitserve serve MODEL [flags]`: the model as a positional argument and the flags people
type for `vllm serve`, each mapped onto the deployment config (config.py ``load_config``'s
``flags``: a config file given with --config keeps the values it sets itself). A value this
server does not support is an error that says so, never ignored."""

from __future__ import annotations

import argparse
import json
from typing import Any

from splitserve.server_config import REASONING_PARSERS, TOOL_CALL_PARSERS
from splitserve.typed_config import ConfigError

DTYPES = {
    "auto": "auto",
    "half": "float16",
    "float16": "float16",
    "bfloat16": "bfloat16",
    "float": "float32",
    "float32": "float32",
}
ENGINE_FLAGS = {
    "max_model_len": "max_model_len",
    "gpu_memory_utilization": "gpu_memory_utilization",
    "max_num_seqs": "max_num_seqs",
    "enable_prefix_caching": "enable_prefix_caching",
}
"""argparse destination -> EngineConfig field, set in every pool."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        nargs="?",
        default=None,
        help="model: an alias (smollm2-135m-instruct), a GGUF file or a Hugging Face directory",
    )
    vllm = parser.add_argument_group("vLLM-style flags (a --config file's own values win)")
    vllm.add_argument("--api-key", default=None, help="the API key clients must present")
    vllm.add_argument("--served-model-name", default=None, help="the model's name in the API")
    vllm.add_argument("--max-model-len", type=int, default=None)
    vllm.add_argument("--gpu-memory-utilization", type=float, default=None)
    vllm.add_argument("--dtype", choices=sorted(DTYPES), default=None)
    vllm.add_argument("--max-num-seqs", type=int, default=None)
    vllm.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None
    )
    vllm.add_argument("--device", choices=("cpu", "cuda"), default=None, help="every pool's device")
    vllm.add_argument("--speculative-config", default=None, metavar="JSON")
    vllm.add_argument("--kv-cache-dtype", default=None, help="auto (the model's dtype) or fp8")
    vllm.add_argument(
        "--quantization", default=None, help="fp8 (e4m3 blocks), or gguf (a GGUF file's own)"
    )
    vllm.add_argument(
        "--enable-deterministic-inference",
        action="store_true",
        help="SGLang's flag: batch-invariant inference in every pool (engine.deterministic)",
    )
    vllm.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None)
    vllm.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None)
    vllm.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="accepted as vLLM has it: tool_choice auto is always served",
    )


def flag_values(args: argparse.Namespace) -> dict[str, Any]:
    """The config keys the flags set (ConfigError for a value that is not supported)."""
    values: dict[str, Any] = {}
    if args.model is not None:
        values["model"] = args.model
    if args.api_key is not None:
        values["server.api_keys"] = [args.api_key]
    for flag in ("served_model_name", "tool_call_parser", "reasoning_parser"):
        if getattr(args, flag) is not None:
            values[f"server.{flag}"] = getattr(args, flag)
    for flag, name in ENGINE_FLAGS.items():
        if getattr(args, flag) is not None:
            values[f"pools.*.engine.{name}"] = getattr(args, flag)
    if args.dtype is not None:
        values["pools.*.engine.dtype"] = DTYPES[args.dtype]
    if args.enable_deterministic_inference:
        values["pools.*.engine.deterministic"] = True
    if args.device is not None:
        values["pools.*.device"] = args.device
    if args.speculative_config is not None:
        values["pools.*.speculative"] = _speculative(args.speculative_config)
    if args.kv_cache_dtype not in (None, "auto", "fp8"):
        raise ConfigError(
            f"--kv-cache-dtype {args.kv_cache_dtype}: not supported; the KV cache is kept in "
            "the model's dtype (auto) or in e4m3 with scales (fp8)"
        )
    if args.kv_cache_dtype == "fp8":
        values["pools.*.engine.kv_cache_dtype"] = "fp8"
    if args.quantization not in (None, "gguf", "fp8"):
        raise ConfigError(
            f"--quantization {args.quantization}: not supported; quantized weights are e4m3 "
            "blocks (fp8) or read from GGUF files (gguf)"
        )
    if args.quantization == "fp8":
        values["pools.*.engine.quantization"] = "fp8"
    return values


def _speculative(text: str) -> dict[str, Any]:
    """vLLM's --speculative-config JSON: a ``model`` without a ``method`` is a draft model."""
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--speculative-config is not JSON: {exc}") from None
    if not isinstance(spec, dict):
        raise ConfigError("--speculative-config must be a JSON object")
    if "model" in spec and "method" not in spec:
        spec["method"] = "draft_model"
    return spec
