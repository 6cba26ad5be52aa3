"""tools/check_layout.py: the layout lint that `make lint` and `make test` run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

CHECKER = Path(__file__).resolve().parents[1] / "tools" / "check_layout.py"

ENGINE = """from __future__ import annotations

__version__ = "1"
_LIMIT = 4


class Engine:
    def __init__(self) -> None:
        self._queue: list[int] = []

    def _step(self) -> int:
        return len(self._queue) + _LIMIT
"""

WORKER = """from __future__ import annotations

from pkg.engine import _LIMIT, Engine, __version__


class Worker:
    def __init__(self) -> None:
        self._engine = Engine()

    def run(self) -> int:
        return self._engine._step() + _LIMIT + len(self._engine._queue)
"""

CLEAN = """from __future__ import annotations

from pkg.engine import Engine, __version__


class Loop(Engine):
    def _step(self) -> int:
        return len(self._queue) + len(__version__)
"""


def _check(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(CHECKER), str(root)], capture_output=True, text=True, timeout=60
    )


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "pkg"
    root.mkdir(parents=True)
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_private_imports_and_foreign_private_attributes_are_reported_by_file_and_line(
    tmp_path: Path,
) -> None:
    root = _package(tmp_path, {"engine.py": ENGINE, "worker.py": WORKER})
    result = _check(root)
    assert result.returncode == 1
    assert result.stdout.splitlines() == [
        f"{root}/worker.py:3: imports private name _LIMIT from pkg.engine",
        f"{root}/worker.py:11: uses _queue, private to {root}/engine.py",
        f"{root}/worker.py:11: uses _step, private to {root}/engine.py",
    ]


def test_own_privates_dunders_future_and_inherited_self_attributes_pass(tmp_path: Path) -> None:
    root = _package(tmp_path, {"engine.py": ENGINE, "loop.py": CLEAN})
    result = _check(root)
    assert (result.returncode, result.stdout) == (0, "")


def test_a_file_over_400_lines_is_reported_at_line_1(tmp_path: Path) -> None:
    long = "\n".join(f"x{i} = {i}" for i in range(401)) + "\n"
    root = _package(tmp_path, {"long.py": long, "short.py": long.replace("x400 = 400\n", "")})
    result = _check(root)
    assert result.returncode == 1
    assert result.stdout.splitlines() == [f"{root}/long.py:1: 401 lines, more than 400"]


CYCLE = {
    "runner.py": "from __future__ import annotations\n\nimport pkg.layers.moe\n",
    "layers/moe.py": (
        "from __future__ import annotations\n\nfrom typing import TYPE_CHECKING\n\n"
        "if TYPE_CHECKING:\n    from ..engine import Engine\n"
    ),
    "engine.py": "from __future__ import annotations\n\nfrom pkg.runner import Runner\n",
}


def test_an_import_cycle_through_a_type_checking_import_is_reported_with_its_circle(
    tmp_path: Path,
) -> None:
    root = _package(tmp_path, CYCLE)
    result = _check(root)
    assert result.returncode == 1
    assert result.stdout.splitlines() == [
        f"{root}/layers/moe.py:6: import cycle: pkg.engine -> pkg.runner -> pkg.layers.moe "
        "-> pkg.engine"
    ]


def test_without_the_cycle_or_with_a_deliberate_lazy_import_the_package_passes(
    tmp_path: Path,
) -> None:
    lazy = "def engine() -> object:\n    from pkg.engine import Engine  # lazy: optional\n"
    one_way = {**CYCLE, "layers/moe.py": "from __future__ import annotations\n"}
    for files in (one_way, {**CYCLE, "layers/moe.py": lazy}):
        result = _check(_package(tmp_path / str(len(files["layers/moe.py"])), files))
        assert (result.returncode, result.stdout) == (0, "")


def test_an_unmarked_function_level_import_closes_a_cycle(tmp_path: Path) -> None:
    lazy = "def engine() -> object:\n    from pkg.engine import Engine\n    return Engine\n"
    root = _package(tmp_path, {**CYCLE, "layers/moe.py": lazy})
    result = _check(root)
    assert result.returncode == 1
    assert result.stdout.splitlines() == [
        f"{root}/layers/moe.py:2: import cycle: pkg.engine -> pkg.runner -> pkg.layers.moe "
        "-> pkg.engine"
    ]
