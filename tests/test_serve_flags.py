"""`splitserve serve MODEL [vLLM flags]` (issue 46): each flag lands on the deployment config;
a config file keeps the values it sets itself, --set wins over both; values the server does
not support are refused with a message that says so."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from splitserve.cli import build_parser, main
from splitserve.config import DeployConfig, load_config
from splitserve.services.launch.vllm_flags import flag_values


def configured(
    *argv: str, config: str | None = None, overrides: tuple[str, ...] = ()
) -> DeployConfig:
    args = build_parser(["serve", *argv]).parse_args(["serve", *argv])
    return load_config(config, overrides, flag_values(args))


def test_each_flag_lands_on_the_config() -> None:
    config = configured(
        "smollm2-135m-instruct",
        "--served-model-name", "smol",
        "--api-key", "k",
        "--max-model-len", "512",
        "--max-num-seqs", "8",
        "--dtype", "half",
        "--gpu-memory-utilization", "0.5",
        "--no-enable-prefix-caching",
        "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}',
        "--tool-call-parser", "mistral",
        "--reasoning-parser", "think",
        "--quantization", "fp8",
        "--kv-cache-dtype", "fp8",
    )  # fmt: skip
    assert config.model == "smollm2-135m-instruct"
    assert config.server.served_model_name == "smol" and config.server.api_keys == ("k",)
    assert (config.server.tool_call_parser, config.server.reasoning_parser) == ("mistral", "think")
    for pool in ("prefill", "decode"):
        engine = config.pools[pool].engine
        assert (engine.max_model_len, engine.max_num_seqs, engine.dtype) == (512, 8, "float16")
        assert engine.gpu_memory_utilization == 0.5 and not engine.enable_prefix_caching
        assert (engine.quantization, engine.kv_cache_dtype) == ("fp8", "fp8")
    speculative = config.pools["decode"].speculative
    assert speculative is not None and speculative.num_speculative_tokens == 3
    assert config.pools["prefill"].speculative is None


def test_deterministic_inference_lands_in_every_pool() -> None:
    config = configured("--enable-deterministic-inference")
    assert all(pool.engine.deterministic for pool in config.pools.values())
    assert not any(pool.engine.deterministic for pool in configured().pools.values())


def test_a_config_file_keeps_its_own_values_and_set_wins(tmp_path: Path) -> None:
    path = tmp_path / "deploy.yaml"
    path.write_text(
        "model: smollm2-135m-instruct\npools:\n  worker:\n    engine:\n      max_model_len: 256\n"
    )
    config = configured(
        "other-model", "--max-model-len", "512", "--max-num-seqs", "4", config=str(path)
    )
    engine = config.pools["worker"].engine
    assert (config.model, engine.max_model_len, engine.max_num_seqs) == (
        "smollm2-135m-instruct",
        256,
        4,
    )
    overridden = configured(
        "--max-model-len",
        "512",
        config=str(path),
        overrides=("pools.worker.engine.max_model_len=128",),
    )
    assert overridden.pools["worker"].engine.max_model_len == 128


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ("--kv-cache-dtype", "fp8_e5m2"),
            "--kv-cache-dtype fp8_e5m2: not supported; the KV cache is kept in the model's dtype "
            "(auto) or in e4m3 with scales (fp8)",
        ),
        (
            ("--quantization", "awq"),
            "--quantization awq: not supported; quantized weights are e4m3 blocks (fp8) or read "
            "from GGUF files (gguf)",
        ),
        (("--speculative-config", "[1]"), "--speculative-config must be a JSON object"),
    ],
)
def test_unsupported_values_are_refused_before_anything_starts(
    flags: tuple[str, ...], message: str, capsys: Any
) -> None:
    assert main(["serve", "smollm2-135m-instruct", *flags]) == 2
    assert capsys.readouterr().err == f"splitserve: config error: {message}\n"
