"""One Ray head for the test session's deployments, which join it (`ray.address`) instead of
each starting a private Ray.

A private Ray costs every `splitserve serve` about 4.7 s on the 2-core VM (GCS, raylet and
their agents started and stopped again); joining a running head costs about 1.3 s. The head
is started on first use with `ray start --head --block` in a temporary folder of its own, and
killed when the test process exits: its process group first, then any process whose command
line names that folder (Ray's GCS server and workers leave the group).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from tests.support.ports import free_port
from tests.support.wait import wait_for

START_TIMEOUT_S = 90.0
# Room for every replica a test asks for: the head's CPUs are a count for placement only.
NUM_CPUS = 64
# The head runs without token authentication, and so must every process that joins it. Set
# explicitly: ray.init of a private Ray (a test's, in the test process) leaves
# RAY_AUTH_MODE=token in os.environ, and a deployment started after it inherited that and
# could create no actor on this head ("Actor creation cancelled").
CLIENT_ENV = {"RAY_AUTH_MODE": "disabled"}


class RayHead:
    def __init__(self) -> None:
        # Ray's sockets live under the folder: a short path keeps them within 107 bytes.
        self.folder = Path(tempfile.mkdtemp(prefix="ssray-", dir="/tmp"))
        port = free_port()
        self.address = f"127.0.0.1:{port}"
        self.lines: list[str] = []
        ray = Path(sys.executable).with_name("ray")
        command = [
            str(ray), "start", "--head", "--block", f"--port={port}",
            f"--num-cpus={NUM_CPUS}", "--num-gpus=0", "--include-dashboard=false",
            "--disable-usage-stats", f"--temp-dir={self.folder}",
        ]  # fmt: skip
        env = {**os.environ, **CLIENT_ENV}
        self.process = subprocess.Popen(
            command,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        threading.Thread(target=self._pump, daemon=True).start()
        try:
            wait_for(
                self._started,
                START_TIMEOUT_S,
                interval=0.2,
                message=lambda: "ray start --head:\n" + "".join(self.lines[-30:]),
            )
        except BaseException:
            self.stop()
            raise

    def _pump(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line)

    def _started(self) -> bool:
        if self.process.poll() is not None:
            raise RuntimeError("ray start exited:\n" + "".join(self.lines[-30:]))
        return any("Ray runtime started" in line for line in self.lines)

    def stop(self) -> None:
        """SIGKILL: nothing of a test cluster needs to be kept (`ray start --block` took more
        than 30 s to act on SIGTERM)."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        for pid in _processes_naming(str(self.folder)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.folder, ignore_errors=True)


_head: RayHead | None = None
_lock = threading.Lock()


def address() -> str:
    """The shared head's address, started on the first call."""
    global _head
    with _lock:
        if _head is None:
            _head = RayHead()
            atexit.register(_head.stop)
        return _head.address


def stop() -> None:
    """Stop the shared head now (tests/conftest.py: after the last module that joins it); a
    later ``address()`` starts another."""
    global _head
    with _lock:
        if _head is not None:
            _head.stop()
            atexit.unregister(_head.stop)
            _head = None


def _processes_naming(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.append(int(entry.name))
    return found
