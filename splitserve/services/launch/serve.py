"""`splitserve serve`: read the config, start Ray and the workers, serve HTTP until stopped.

The process layout: this process runs the API server (uvicorn, tokenizer, chat templates);
every worker replica is a Ray actor in its own process with one engine (placed by
services/launch/deployment.py). Requests and tokens move over ZMQ as msgpack messages
(services/messages.py). SIGINT or SIGTERM stops uvicorn, the workers and, when this process
started it, Ray.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time
from typing import Any

from splitserve.config import ConfigError, DeployConfig, load_config
from splitserve.services.launch import vllm_flags
from splitserve.services.launch.deployment import Deployment, WorkerStartError

READY_TIMEOUT_S = 60.0
COMPILE_SETTLE_S = 5.0
"""How long an exit waits for grammar compiles still running (_leave_past_running_compiles)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    vllm_flags.add_arguments(parser)
    parser.add_argument("--config", default=None, help="deployment YAML (default: local.yaml)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field by its dotted path, e.g. server.port=9000",
    )
    parser.add_argument("--host", default=None, help="shorthand for --set server.host=HOST")
    parser.add_argument("--port", type=int, default=None, help="shorthand for server.port")
    parser.add_argument(
        "--address",
        default=None,
        help='join this Ray cluster ("auto": the one running on this node) instead of '
        "starting a private one; shorthand for --set ray.address=ADDRESS",
    )


def run(args: argparse.Namespace) -> int:
    overrides = list(args.overrides)
    if args.host is not None:
        overrides.append(f"server.host={args.host}")
    if args.port is not None:
        overrides.append(f"server.port={args.port}")
    if args.address is not None:
        overrides.append(f"ray.address={args.address}")
    try:
        config = load_config(args.config, overrides, vllm_flags.flag_values(args))
    except ConfigError as exc:
        print(f"splitserve: config error: {exc}", file=sys.stderr)
        return 2
    deployment = Deployment(config)
    previous = _interrupt_on_signals()
    try:
        deployment.start()
        asyncio.run(_serve(deployment))
    except KeyboardInterrupt:
        pass
    except WorkerStartError as exc:
        print(f"splitserve: {exc}", file=sys.stderr)
        return 1
    finally:
        deployment.stop()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    _leave_past_running_compiles()
    return 0


def _leave_past_running_compiles() -> None:
    """A constraint refused for its compile time goes on compiling in a thread (xgrammar cannot
    be interrupted); a normal exit would unwind that thread out of native code and abort. Wait
    a little for it, then leave without the interpreter's shutdown (everything is stopped)."""
    grammar = sys.modules.get("splitserve.engine.structured.grammar")
    if grammar is None:
        return
    left = grammar.settle_compiles(COMPILE_SETTLE_S)
    if left:
        print(f"splitserve: {left} grammar compile(s) still running; exiting without them")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


async def _serve(deployment: Deployment) -> None:
    import uvicorn

    from splitserve.engine.loader import resolve_model
    from splitserve.engine.vision.config import load_vision_config
    from splitserve.kvstore.index_backends import make_index
    from splitserve.router.prefix_lookup import PrefixLookup
    from splitserve.router.router import Router
    from splitserve.services.api.app import build_app
    from splitserve.services.api.exchange import RequestExchange
    from splitserve.services.api.serving import ServerState
    from splitserve.services.api.worker_pool import WorkerPool
    from splitserve.services.api.worker_view import WorkerEndpoint
    from splitserve.services.launch.scaling import Scaler
    from splitserve.services.launch.supervisor import Supervisor
    from splitserve.services.metrics import Metrics

    config = deployment.config
    _log_requests_to_stdout()
    metrics = Metrics(config.model)
    endpoints = [
        WorkerEndpoint(w["worker_id"], w["request_addr"], w["output_addr"], w["role"], w["kv_addr"])
        for w in deployment.workers
    ]
    decode_pool = next(n for n, p in config.pools.items() if p.role in ("decode", "both"))
    block_size = config.engine_config(decode_pool).block_size
    index = make_index(config.prefix_index.url, config.prefix_index.ttl_s)
    pool = WorkerPool(endpoints, metrics, deployment.sealer, config.server.heartbeat_timeout_s)
    client = RequestExchange(
        pool,
        config.server.max_queue,
        metrics,
        router=Router(config.router.policy, config.router.policy),
        block_size=block_size,
        prefix=PrefixLookup(index, block_size),
        migration_limit=config.server.migration_limit,
        request_timeout_s=config.server.request_timeout_s,
        restart_wait_s=config.server.restart_wait_s,
    )
    client.start()
    loop = asyncio.get_running_loop()
    supervisor = Supervisor(deployment, loop, client.worker_stopped, client.rejoin)
    client.on_worker_failed = supervisor.restart
    supervisor.start()
    state = ServerState(
        config,
        deployment.tokenizer,
        client,
        metrics,
        deployment.max_model_len,
        load_vision_config(resolve_model(config.model)),
    )
    server = uvicorn.Server(
        uvicorn.Config(
            build_app(state, Scaler(deployment, pool)),
            host=config.server.host,
            port=config.server.port,
            log_level=config.server.log_level,
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=5,
        )
    )
    serving = asyncio.create_task(server.serve())
    try:
        await _announce_when_ready(server, pool, serving, config)
        await serving
    finally:
        supervisor.stop()
        await client.close()


async def _announce_when_ready(
    server: Any, client: Any, serving: asyncio.Task[None], config: DeployConfig
) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not (server.started and client.ready):
        if serving.done():
            return
        if time.monotonic() > deadline:
            raise WorkerStartError("workers did not report in time")
        await asyncio.sleep(0.05)
    url = f"http://{config.server.host}:{config.server.port}"
    print(f"splitserve ready: {url} (model {config.model})", flush=True)


def _log_requests_to_stdout() -> None:
    """The structured request log (one JSON line per finished request) goes to stdout."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("splitserve request %(message)s"))
    logger = logging.getLogger("splitserve.requests")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def _interrupt_on_signals() -> dict[int, Any]:
    """Make SIGINT and SIGTERM raise KeyboardInterrupt, so one cleanup path handles both.

    uvicorn replaces these handlers while it serves and re-raises the signal after it has
    shut down, which lands here. Returns the handlers that were installed before.
    """

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    return {s: signal.signal(s, interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
