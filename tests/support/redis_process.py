"""A private `redis-server` on a free loopback port, stoppable and restartable, for tests."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import redis

from tests.support.server_process import free_port
from tests.support.wait import wait_for

START_TIMEOUT_S = 10.0


class RedisProcess:
    """redis-server without persistence: a restart starts empty, like a crashed cache."""

    def __init__(self, directory: Path, password: str | None = None) -> None:
        if shutil.which("redis-server") is None:
            pytest.skip("redis-server is not installed")
        self.directory = directory
        self.password = password
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> None:
        args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1"]
        args += ["--save", "", "--appendonly", "no", "--dir", str(self.directory)]
        if self.password:
            args += ["--requirepass", self.password]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url)
        wait_for(
            lambda: _answers(client),
            START_TIMEOUT_S,
            interval=0.02,
            message=f"redis-server on port {self.port} answering PING",
        )
        client.close()

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=10)
            self.process = None


def _answers(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False
