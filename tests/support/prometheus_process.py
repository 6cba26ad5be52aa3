"""Run a real Prometheus server (Debian's `prometheus` binary) that scrapes one target."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from tests.support.server_process import free_port
from tests.support.wait import wait_for

START_TIMEOUT_S = 60.0


def prometheus_binary() -> str | None:
    return shutil.which("prometheus")


@contextmanager
def prometheus(target: str, interval: str = "1s") -> Iterator[str]:
    """Prometheus scraping ``target`` (host:port) every ``interval``; yields its base URL."""
    binary = prometheus_binary()
    assert binary is not None, "prometheus is not installed (make install installs it)"
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "prometheus.yml"
        config.write_text(
            f"global: {{scrape_interval: {interval}, evaluation_interval: {interval}}}\n"
            "scrape_configs:\n"
            f"  - job_name: splitserve\n    static_configs: [{{targets: ['{target}']}}]\n"
        )
        url = f"http://127.0.0.1:{free_port()}"
        command = [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp}/data",
            f"--web.listen-address={url.removeprefix('http://')}",
        ]
        log = (Path(tmp) / "prometheus.log").open("w")
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            _wait_ready(url, process, Path(tmp) / "prometheus.log")
            yield url
        finally:
            process.terminate()
            process.wait(timeout=30)
            log.close()


def query(url: str, expr: str) -> list[dict[str, Any]]:
    """An instant query's result vector (raises on a PromQL error)."""
    response = httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=30)
    body = response.json()
    assert body["status"] == "success", f"{expr}: {body}"
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


def _wait_ready(url: str, process: subprocess.Popen[bytes], log: Path) -> None:
    def ready() -> bool:
        if process.poll() is not None:
            raise RuntimeError("prometheus exited:\n" + log.read_text()[-3000:])
        try:
            return httpx.get(f"{url}/-/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(
        ready,
        START_TIMEOUT_S,
        interval=0.2,
        message=lambda: f"prometheus ready at {url}:\n" + log.read_text()[-3000:],
    )
