"""Start a real `splitserve serve` process on a free loopback port, for end-to-end tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.support import ray_head
from tests.support.ports import free_port
from tests.support.wait import wait_for

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 180.0


@dataclass
class ServerProcess:
    url: str
    process: subprocess.Popen[str]
    lines: list[str] = field(default_factory=list)
    reader: threading.Thread | None = None

    @property
    def api(self) -> str:
        return f"{self.url}/v1"


def metric(url: str, name: str) -> float:
    """The sum of a metric's series from /metrics (KeyError when it has none)."""
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in httpx.get(f"{url}/metrics").text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    ]
    if not values:
        raise KeyError(name)
    return sum(values)


def worker_metric(url: str, name: str, worker: str) -> float:
    """The value of a per-worker metric series (0.0 while the worker has not reported it)."""
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + "{") and f'worker="{worker}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def worker_pids(server: ServerProcess) -> dict[str, int]:
    """Worker id -> process id, from the lines the launcher prints at start."""
    pids = {}
    for line in server.lines:
        if line.startswith("splitserve worker "):
            words = line.split()
            pids[words[2]] = int(words[-1])
    return pids


@contextmanager
def serve(
    *overrides: str,
    config: str | None = None,
    private_ray: bool = False,
    flags: Sequence[str] = (),
) -> Iterator[ServerProcess]:
    """Run `splitserve serve [FLAGS] [--config FILE] --set ...` until the block ends, then
    SIGTERM it (exit code 0). flags: what `vllm serve` takes (a model first, then flags).
    The deployment joins the session's Ray head (tests/support/ray_head.py) unless
    ``private_ray``: then it starts its own, as `make serve` does."""
    env: dict[str, str] = {}
    if not private_ray:
        overrides = (f"ray.address={ray_head.address()}", *overrides)
        env = ray_head.CLIENT_ENV
    server = _start_ready(overrides, config, env, flags)
    try:
        yield server
    except BaseException:
        _stop(server.process)
        _drain(server)
        # The test failed inside the block: the server's last lines go to the test's output.
        print("".join(server.lines[-80:]), flush=True)
        raise
    finally:
        _stop(server.process)
        _drain(server)
    code = server.process.returncode
    assert code == 0, f"exit code {code}:\n" + "".join(server.lines[-60:])


def _start_ready(
    overrides: tuple[str, ...],
    config: str | None,
    env: dict[str, str],
    flags: Sequence[str],
    attempts: int = 3,
) -> ServerProcess:
    """Start the server on a free port; a port taken between probe and bind is retried. A
    server that is not ready in time is stopped, not left running after the test."""
    for attempt in range(attempts):
        server = _start(free_port(), overrides, config, env, flags)
        try:
            _wait_ready(server)
            return server
        except BaseException:
            _stop(server.process)
            taken = any("address already in use" in line for line in server.lines)
            if not taken or attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def _start(
    port: int,
    overrides: tuple[str, ...],
    config: str | None,
    extra_env: dict[str, str],
    flags: Sequence[str],
) -> ServerProcess:
    command = [sys.executable, "-m", "splitserve.cli", "serve", *flags, "--port", str(port)]
    if config is not None:
        command += ["--config", config]
    for item in overrides:
        command += ["--set", item]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **extra_env}
    process = subprocess.Popen(
        command,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    server = ServerProcess(f"http://127.0.0.1:{port}", process)
    server.reader = threading.Thread(target=_pump, args=(process, server.lines), daemon=True)
    server.reader.start()
    return server


def _pump(process: subprocess.Popen[str], lines: list[str]) -> None:
    assert process.stdout is not None
    for line in process.stdout:
        lines.append(line)


def _drain(server: ServerProcess, timeout: float = 30.0) -> None:
    """Wait until every line the server wrote before it exited is in `server.lines`."""
    if server.reader is not None:
        server.reader.join(timeout=timeout)


def _wait_ready(server: ServerProcess) -> None:
    expected = f"splitserve ready: {server.url} (model "

    def ready() -> bool:
        if server.process.poll() is not None:
            raise RuntimeError("server exited:\n" + "".join(server.lines[-30:]))
        if not any(line.startswith(expected) for line in server.lines):
            return False
        return httpx.get(f"{server.url}/health").status_code == 200

    wait_for(
        ready,
        START_TIMEOUT_S,
        interval=0.2,
        message=lambda: f"{server.url} ready:\n" + "".join(server.lines[-30:]),
    )


def stop(server: ServerProcess) -> None:
    """SIGTERM the server now and wait for it, before its ``serve`` block ends (which then
    finds it stopped and checks its exit code as ever)."""
    _stop(server.process)


def _stop(process: subprocess.Popen[str]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
