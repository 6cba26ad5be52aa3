"""Layout lint for the splitserve package: file length, private names kept private, and no
import cycle.

For every .py file under the roots given (default: splitserve/):

- the file is at most MAX_LINES lines long;
- it imports no leading-underscore name (``from x import _name``, ``import x._y``);
- it uses no leading-underscore attribute (``obj._name``) that another checked module
  defines and this one does not. Types are not resolved, so an attribute is matched by name;
  ``self._name`` and ``cls._name`` are the object's own state and always allowed.

Dunder names (``__version__``) and ``from __future__`` are not private.

And across the modules under a root (``root/a/b.py`` is the module ``root.a.b``): no import
cycle. Every import of another checked module is an edge: at module level, under
``if TYPE_CHECKING:`` (a type-only cycle still ties the modules together), and inside a
function. The one exception is a deliberate lazy import: a function-level import with a
``# lazy: <why>`` comment on one of its lines (to keep an optional backend such as Triton
optional) is not an edge. Each knot of modules is reported once, at the import that closes
its shortest circle.

Prints one ``path:line: message`` per violation and exits 1 if there is any, else 0.
Usage: python tools/check_layout.py [root ...]
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

MAX_LINES = 400
OWN = {"self", "cls"}
LAZY_MARK = "# lazy:"


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


def module_name(path: Path, root: Path) -> str:
    """``root/a/b.py`` -> ``root.a.b``; ``root/a/__init__.py`` -> ``root.a``; a root inside
    packages (``splitserve/engine``) is named from the outermost one (``splitserve.engine``)."""
    top = root.resolve()
    while (top.parent / "__init__.py").exists():
        top = top.parent
    parts = [*path.resolve().relative_to(top.parent).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(
    tree: ast.Module, name: str, is_package: bool, lines: list[str]
) -> Iterator[tuple[int, str]]:
    """(line, dotted target) of each import in the module that counts as an edge: all but
    the function-level ones marked ``# lazy:``. A target may be a module or a name in one."""
    package = name.split(".") if is_package else name.split(".")[:-1]
    deliberate = {
        id(node)
        for function in ast.walk(tree)
        if isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef)
        for node in ast.walk(function)
        if isinstance(node, ast.Import | ast.ImportFrom)
        and any(LAZY_MARK in line for line in lines[node.lineno - 1 : node.end_lineno])
    }
    for node in ast.walk(tree):
        if id(node) in deliberate:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package[: len(package) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}"


def import_cycles(
    trees: dict[Path, ast.Module], names: dict[Path, str]
) -> list[tuple[Path, int, str]]:
    """(path, line, message) for each import cycle among the modules."""
    modules = {name: path for path, name in names.items()}
    edges: dict[str, dict[str, int]] = {}
    for path, tree in trees.items():
        lines = path.read_text(encoding="utf-8").splitlines()
        found = edges.setdefault(names[path], {})
        for line, target in imported_modules(tree, names[path], path.name == "__init__.py", lines):
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != names[path]:
                found.setdefault(target, line)
    problems = []
    for component in strongly_connected(edges):
        circle = shortest_cycle(component[0], edges, set(component))
        first, closing = circle[-2], circle[-1]
        message = "import cycle: " + " -> ".join(circle)
        if len(component) > len(circle) - 1:
            message += f" ({len(component)} modules in one knot: {', '.join(component)})"
        problems.append((modules[first], edges[first][closing], message))
    return problems


def strongly_connected(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module, each sorted
    (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    work.append((target, iter(sorted(edges.get(target, {})))))
                elif target in stack:
                    low[node] = min(low[node], index[target])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return sorted(components)


def shortest_cycle(start: str, edges: dict[str, dict[str, int]], within: set[str]) -> list[str]:
    """The shortest path start -> ... -> start inside ``within`` (breadth first)."""
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for target in sorted(edges.get(node, {})):
                if target == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [*reversed(path), start]
                if target in within and target not in previous:
                    previous[target] = node
                    following.append(target)
        frontier = following
    raise ValueError(f"{start} is on no cycle")


def check(files: list[Path], roots: dict[Path, Path] | None = None) -> list[str]:
    """Every violation in these files, as ``path:line: message``, by path then line.
    roots: each file's root, for import cycles (none are looked for without it)."""
    trees = {path: ast.parse(path.read_text(encoding="utf-8"), str(path)) for path in files}
    defining: dict[str, set[Path]] = {}
    for path, tree in trees.items():
        for name in filter(is_private, defined_names(tree)):
            defining.setdefault(name, set()).add(path)
    names = {path: module_name(path, root) for path, root in (roots or {}).items()}
    cycles = import_cycles({path: trees[path] for path in names}, names)
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
        found += [(line, message) for where, line, message in cycles if where == path]
        problems += [f"{path}:{line}: {message}" for line, message in sorted(found)]
    return problems


def main(argv: list[str]) -> int:
    roots = [Path(arg) for arg in argv] or [Path("splitserve")]
    owner = {f: root for root in roots if root.is_dir() for f in root.rglob("*.py")}
    files = sorted({*owner, *(root for root in roots if root.is_file())})
    problems = check(files, owner)
    for problem in problems:
        print(problem)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
