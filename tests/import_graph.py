"""No import circles in the product (issue 53): which product module imports which, read from
the source with `ast`, and the circles among them.

Every import of a `torch_multinode` module counts, absolute or relative, at the top of a module
or inside a function or class: a lazy import that dodges a circle at import time is still a
circle in the design. Only imports under `if TYPE_CHECKING:` do not count (they never run).
`from torch_multinode.x import y` is an import of the module `x.y` when there is one, else of `x`.

`python -m tests.import_graph` prints each circle as one line, `a.py -> b.py -> a.py` (every
file of a circle in it, each arrow an import), and exits 1 if there is any; else it prints a
one-line summary and exits 0.
"""

from __future__ import annotations

import ast
import sys
from collections import deque
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "torch_multinode"
ROOMS = ("cluster", "launch", "training", "netcheck", "provision", "sim", "bench")


def product_modules(root: Path = REPO, rooms: tuple[str, ...] = ROOMS) -> dict[str, Path]:
    """Each product module's full dotted name (`torch_multinode.cluster.inventory`) and its file:
    every .py file under the rooms, and the package's own under `torch_multinode/`."""
    found = {}
    for top in (*rooms, PACKAGE):
        for path in sorted((root / top).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join(parts) if parts[0] == PACKAGE else ".".join((PACKAGE, *parts))
            found[name] = path
    return found


def _type_checking(test: ast.expr) -> bool:
    """`TYPE_CHECKING` or `typing.TYPE_CHECKING`."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(node: ast.AST):
    """Every import statement under `node`, in functions and classes too, except in the body of
    an `if TYPE_CHECKING:` (its `else:` runs, so it counts)."""
    if isinstance(node, ast.Import | ast.ImportFrom):
        yield node
        return
    if isinstance(node, ast.If) and _type_checking(node.test):
        children = node.orelse
    else:
        children = list(ast.iter_child_nodes(node))
    for child in children:
        yield from _import_nodes(child)


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """The module that importing `name` loads: `name` itself, else its nearest parent that is a
    product module (None for anything outside the product)."""
    parts = name.split(".")
    while parts:
        if ".".join(parts) in modules:
            return ".".join(parts)
        parts.pop()
    return None


def _base(module: str, is_package: bool, level: int) -> str:
    """The package that a relative import of `level` dots in `module` starts from."""
    parts = module.split(".")
    if not is_package:
        parts = parts[:-1]
    return ".".join(parts[: len(parts) - (level - 1)]) if level > 1 else ".".join(parts)


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The product modules that the module `module` (its file: `path`) imports."""
    found = set()
    for node in _import_nodes(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            if node.level:
                start = _base(module, path.name == "__init__.py", node.level)
                source = f"{start}.{node.module}" if node.module else start
            else:
                source = node.module or ""
            # `from package import module` imports the module; `from module import name`, it.
            names = [
                f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
                for alias in node.names
            ]
        found |= {
            target
            for name in names
            if (name == PACKAGE or name.startswith(PACKAGE + "."))
            and (target := _known(name, modules))
        }
    return found - {module}  # `from torch_multinode.x import name` in x itself: no circle


def import_graph(root: Path = REPO, rooms: tuple[str, ...] = ROOMS) -> dict[str, set[str]]:
    """Each product module and the product modules it imports."""
    modules = product_modules(root, rooms)
    return {module: imports_of(module, path, modules) for module, path in modules.items()}


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of `graph`, iteratively (no recursion limit): the
    components of more than one module, and single modules that import themselves."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is not None:
                if target not in graph:
                    continue
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph[node]:
                    components.append(sorted(component))
    return sorted(components)


def _path(graph: dict[str, set[str]], members: set[str], start: str, goals: set[str]) -> list[str]:
    """The shortest import path from `start` to one of `goals` inside `members` (start excluded)."""
    came_from: dict[str, str | None] = {start: None}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for target in sorted(graph[node] & members):
            if target in came_from:
                continue
            came_from[target] = node
            if target in goals:
                path = [target]
                while (previous := came_from[path[-1]]) != start:
                    path.append(previous)
                return path[::-1]
            queue.append(target)
    raise AssertionError(f"{goals} cannot be reached from {start}")  # not a component then


def circle_walk(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A closed walk along imports through every module of a component, from its first module
    and back: each step the shortest way to the nearest module not yet on it."""
    members = set(component)
    walk, left = [component[0]], members - {component[0]}
    while left:
        step = _path(graph, members, walk[-1], left)
        walk += step
        left -= set(step)
    return walk + _path(graph, members, walk[-1], {component[0]})


def find_circles(root: Path = REPO, rooms: tuple[str, ...] = ROOMS) -> list[str]:
    """Each import circle of the product as one line of files, `a.py -> b.py -> a.py`."""
    modules = product_modules(root, rooms)
    graph = {module: imports_of(module, path, modules) for module, path in modules.items()}
    return [
        " -> ".join(modules[module].relative_to(root).as_posix() for module in walk)
        for walk in (circle_walk(graph, component) for component in strongly_connected(graph))
    ]


def main(root: Path = REPO, rooms: tuple[str, ...] = ROOMS) -> int:
    """Print the product's import circles and return 1, or a one-line summary and 0."""
    circles = find_circles(root, rooms)
    if circles:
        print(f"{len(circles)} import circle(s) in the product (tests/import_graph.py):")
        for circle in circles:
            print(f"  {circle}")
        return 1
    graph = import_graph(root, rooms)
    edges = sum(len(targets) for targets in graph.values())
    print(f"{len(graph)} modules, {edges} imports, no circles")
    return 0


if __name__ == "__main__":
    sys.exit(main())
