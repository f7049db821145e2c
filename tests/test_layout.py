"""The package's shape: no import circles (TYPE_CHECKING imports included — a circle there
is a circle in the design), and the window's pure modules touch no I/O."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "runloop_proxy"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        name = ".".join(rel.parts).removesuffix(".__init__")
        out[name] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (at any depth in the file)."""
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1])
                    target = f"{base}.{node.module}" if node.module else base
                else:
                    target = node.module or ""
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    if sub in modules:
                        graph[name].add(sub)
                    elif target in modules:
                        graph[name].add(target)
            elif isinstance(node, ast.Import):
                graph[name] |= {a.name for a in node.names if a.name in modules}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_package_has_no_import_circles() -> None:
    assert circles(import_graph()) == []


def test_the_circle_finder_finds_circles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_the_window_is_pure() -> None:
    """No clock, no Redis, no HTTP, no tiktoken in window/ (HOUSE_STYLE): it takes values."""
    graph = import_graph()
    for name, path in _modules().items():
        if not name.startswith("runloop_proxy.window."):
            continue
        text = path.read_text()
        for banned in ("import time", "import redis", "import httpx", "import aiohttp",
                       "import tiktoken", "from ..history", "from ..pipeline"):
            assert banned not in text, f"{name} has {banned!r}"
        assert not {m for m in graph[name] if m.startswith(("runloop_proxy.history",
                                                             "runloop_proxy.pipeline"))}


def test_no_wait_for_anywhere() -> None:
    """``asyncio.wait_for`` can swallow a cancellation that arrives as the awaited thing
    completes (Python 3.11): the write-behind flusher, waiting on a wake with it, then never
    stopped on SIGTERM while Redis refused its writes (red team). The package bounds its
    waits with ``asyncio.timeout`` instead, everywhere: a rule checked here, not case by case."""
    found = [f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"
             for path in PACKAGE.rglob("*.py")
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Attribute) and node.attr == "wait_for"]
    assert not found, found


def test_no_list_is_emptied_from_the_front() -> None:
    """``list.pop(0)`` moves every element after it: in a loop it is quadratic (a stream's
    held tool calls released one at a time took seconds at 160,000; a second red-team
    pass). Queues are deques, or are cut once; checked here for the whole package."""
    found = [f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"
             for path in PACKAGE.rglob("*.py")
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
             and node.func.attr == "pop" and node.args
             and isinstance(node.args[0], ast.Constant) and node.args[0].value == 0]
    assert not found, found
