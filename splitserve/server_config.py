"""The deployment config's public HTTP front end: its address, keys, admission limits, timeouts
and how the model's output is read (splitserve/config.py holds the rest of the file)."""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.typed_config import require

TOOL_CALL_PARSERS = ("auto", "hermes", "deepseek_v3", "llama3_json", "mistral")
REASONING_PARSERS = ("auto", "think", "none")


@dataclass(frozen=True)
class ServerConfig:
    """The public HTTP front end and its admission limits."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: tuple[str, ...] = ()
    admin_keys: tuple[str, ...] = ()
    """Keys for /admin (scaling); without any, /admin answers only loopback clients."""
    max_body_bytes: int = 1 << 20
    max_header_bytes: int = 8192
    max_n: int = 8
    max_queue: int = 256
    internal_host: str = "127.0.0.1"
    log_level: str = "warning"
    heartbeat_timeout_s: float = 15.0
    grammar_timeout_s: float = 5.0
    """The longest a request's structured-output constraint may take to compile in the API
    server (half the engine's own bound, so what the API accepts compiles on a worker)."""
    migration_limit: int = 3
    """How often one request may move to another worker when the one it waits on stops
    (docs/disaggregation.md); past it, or with 0, the request fails with a 503."""
    body_timeout_s: float = 30.0
    """The longest a request body may take to arrive; past it the request is dropped (408)."""
    client_share: float = 0.5
    """The fraction of max_queue one client (API key, or address without keys) may hold at
    once: one request for more is a 400, a client past it gets 429 with Retry-After."""
    max_replicas: int = 64
    """The most replicas /admin/scale gives a pool."""
    request_timeout_s: float = 600.0
    """Every request's deadline from its admission: past it the API server ends it with a 504
    and frees what it holds on its workers (a lost worker or output never hangs a client)."""
    restart_wait_s: float = 30.0
    """How long a request waits for a worker to be restarted when every worker of a pool it
    needs stopped (one decode worker, say), before it fails with a 503; 0: at once."""
    served_model_name: str | None = None
    """The model's name in the API (None: ``model`` as written)."""
    tool_call_parser: str = "auto"
    """How tool calls of tool_choice auto are read from the output: hermes, deepseek_v3,
    llama3_json, mistral, or auto (the format the chat template renders)."""
    reasoning_parser: str = "auto"
    """``<think>...</think>`` read as reasoning: auto (when the chat template has it), think
    (always), none."""

    def __post_init__(self) -> None:
        require(0 <= self.port <= 65535, "server.port must be in [0, 65535]")
        require(self.max_body_bytes >= 1024, "server.max_body_bytes must be at least 1024")
        require(self.max_header_bytes >= 1024, "server.max_header_bytes must be at least 1024")
        require(self.max_n >= 1, "server.max_n must be at least 1")
        require(self.max_queue >= 1, "server.max_queue must be at least 1")
        require(all(self.api_keys), "server.api_keys must not contain empty keys")
        require(all(self.admin_keys), "server.admin_keys must not contain empty keys")
        require(self.heartbeat_timeout_s > 0, "server.heartbeat_timeout_s must be positive")
        require(self.grammar_timeout_s > 0, "server.grammar_timeout_s must be positive")
        require(self.migration_limit >= 0, "server.migration_limit must be non-negative")
        require(self.body_timeout_s > 0, "server.body_timeout_s must be positive")
        require(0 < self.client_share <= 1, "server.client_share must be in (0, 1]")
        require(self.max_replicas >= 1, "server.max_replicas must be at least 1")
        require(self.request_timeout_s > 0, "server.request_timeout_s must be positive")
        require(self.restart_wait_s >= 0, "server.restart_wait_s must be non-negative")
        require(
            self.tool_call_parser in TOOL_CALL_PARSERS,
            f"server.tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}",
        )
        require(
            self.reasoning_parser in REASONING_PARSERS,
            f"server.reasoning_parser must be one of {', '.join(REASONING_PARSERS)}",
        )
