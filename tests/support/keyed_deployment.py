"""The keyed deployment that test_api_errors and test_api_responses_messages share (conftest.py
``keyed_server``): SmolLM2 in one prefill and one decode worker, started as `vllm serve` would
be (a served model name, an API key, a 1,024-token context, 16 sequences, prefix caching), with
a second API key and the small admission limits that the error tests reach (2 engine requests
at once, each client all of them, n up to 4, bodies up to 16 KiB)."""

from __future__ import annotations

MODEL = "smol"
KEY = "sk-test"
OTHER_KEY = "key-two"
MAX_MODEL_LEN = 1024
MAX_QUEUE = 2
FLAGS = (
    "smollm2-135m-instruct",
    *("--served-model-name", MODEL, "--api-key", KEY),
    *("--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "16", "--enable-prefix-caching"),
)
SETTINGS = (
    f"server.api_keys=[{KEY}, {OTHER_KEY}]",
    f"server.max_queue={MAX_QUEUE}",
    "server.client_share=1.0",
    "server.max_n=4",
    "server.max_body_bytes=16384",
)
