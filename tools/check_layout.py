"""Layout lint for the splitserve package: file length, and private names kept private.

For every .py file under the roots given (default: splitserve/):

- the file is at most MAX_LINES lines long;
- it imports no leading-underscore name (``from x import _name``, ``import x._y``);
- it uses no leading-underscore attribute (``obj._name``) that another checked module
  defines and this one does not. Types are not resolved, so an attribute is matched by name;
  ``self._name`` and ``cls._name`` are the object's own state and always allowed.

Dunder names (``__version__``) and ``from __future__`` are not private. Prints one
``path:line: message`` per violation and exits 1 if there is any, else 0.
Usage: python tools/check_layout.py [root ...]
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

MAX_LINES = 400
OWN = {"self", "cls"}


def is_private(name: str) -> bool:
    """A leading underscore and not a dunder (``__all__``, ``__init__`` are public)."""
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def defined_names(tree: ast.Module) -> set[str]:
    """Every name the module binds anywhere: functions, classes, variables, arguments,
    keyword arguments, import aliases, and attributes it assigns (``obj._x = ...``)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store | ast.Del):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store | ast.Del):
            names.add(node.attr)
        elif isinstance(node, ast.arg | ast.keyword) and node.arg is not None:
            names.add(node.arg)
        elif isinstance(node, ast.alias) and node.asname:
            names.add(node.asname)
    return names


def private_uses(tree: ast.Module, foreign: dict[str, str]) -> Iterator[tuple[int, str]]:
    """(line, message) for each private import, and each use of a private attribute in
    ``foreign`` (private name -> the other modules that define it) that this module does
    not define."""
    own = defined_names(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module != "__future__":
            module = "." * node.level + (node.module or "")
            for alias in node.names:
                if is_private(alias.name):
                    yield node.lineno, f"imports private name {alias.name} from {module}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if any(is_private(part) for part in alias.name.split(".")):
                    yield node.lineno, f"imports private module {alias.name}"
        elif (
            isinstance(node, ast.Attribute)
            and node.attr in foreign
            and node.attr not in own
            and not (isinstance(node.value, ast.Name) and node.value.id in OWN)
        ):
            yield node.lineno, f"uses {node.attr}, private to {foreign[node.attr]}"


def check(files: list[Path]) -> list[str]:
    """Every violation in these files, as ``path:line: message``, by path then line."""
    trees = {path: ast.parse(path.read_text(encoding="utf-8"), str(path)) for path in files}
    defining: dict[str, set[Path]] = {}
    for path, tree in trees.items():
        for name in filter(is_private, defined_names(tree)):
            defining.setdefault(name, set()).add(path)
    problems = []
    for path, tree in trees.items():
        num_lines = len(path.read_text(encoding="utf-8").splitlines())
        found = [(1, f"{num_lines} lines, more than {MAX_LINES}")] if num_lines > MAX_LINES else []
        foreign = {
            name: ", ".join(sorted(map(str, paths - {path})))
            for name, paths in defining.items()
            if paths - {path}
        }
        found += sorted(set(private_uses(tree, foreign)))
        problems += [f"{path}:{line}: {message}" for line, message in found]
    return problems


def main(argv: list[str]) -> int:
    roots = [Path(arg) for arg in argv] or [Path("splitserve")]
    files = sorted(
        {f for root in roots for f in ([root] if root.is_file() else root.rglob("*.py"))}
    )
    problems = check(files)
    for problem in problems:
        print(problem)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
