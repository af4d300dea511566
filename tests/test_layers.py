"""The import graph follows the layers: each package imports only the packages below it (the table in
docs/architecture.md), ``stride.kernels`` imports nothing else of ``stride``, no module takes another package's private
names, and no modules import each other in a circle. Read from the source with ``ast``; nothing is imported."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# package -> the packages it may import (besides itself). "stride" is the base: env, params, config.
# "stride.kernels" is the leaf below everything (the configuration checks a --quantize group against its torch-free
# policy module).
ALLOWED: dict[str, set[str]] = {
    "stride.kernels": set(),
    "stride": {"stride.kernels"},
    "stride.ipc": {"stride"},
    "stride.model": {"stride"},
    "stride.planner": {"stride", "stride.model"},
    "stride.grammar": {"stride"},
    "stride.sched": {"stride", "stride.ipc", "stride.grammar", "stride.tokenizer"},
    "stride.sim": {"stride", "stride.ipc", "stride.planner", "stride.sched"},
    "stride.tokenizer": {"stride", "stride.ipc", "stride.model", "stride.grammar"},
    "stride.workers": {"stride", "stride.ipc", "stride.model", "stride.planner", "stride.sim", "stride.kernels"},
    "stride.diagnose": {"stride", "stride.model", "stride.tokenizer", "stride.workers", "stride.kernels"},
    "stride.frontend": {"stride", "stride.ipc"},
    "stride.client": {"stride", "stride.ipc"},
    "stride.launch": {"stride", "stride.ipc", "stride.model", "stride.planner", "stride.grammar", "stride.sched",
                      "stride.sim",
                      "stride.tokenizer", "stride.workers", "stride.frontend", "stride.client", "stride.diagnose",
                      "stride.kernels"},
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_of(module: str) -> str:
    """The layer a module belongs to: ``stride.sched.scheduler`` -> ``stride.sched``; ``stride.config`` and
    the other modules at the root of ``stride`` -> ``stride``, except ``__main__`` (the command line)."""
    parts = module.split(".")
    if module == "stride.__main__":
        return "stride.launch"
    if len(parts) >= 2 and f"stride.{parts[1]}" in ALLOWED:
        return f"stride.{parts[1]}"
    return "stride"


def imports_of(tree: ast.AST) -> Iterator[tuple[str, list[str]]]:
    """``(module imported, names taken from it)`` for every import statement at any depth, those under
    ``if TYPE_CHECKING:`` too: a type named from another module is a dependency on it."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, []
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module, [a.name for a in node.names]


def source_modules(root: Path = ROOT) -> dict[str, ast.AST]:
    files = [*root.joinpath("stride").rglob("*.py")]
    return {module_name(p): ast.parse(p.read_text(), str(p)) for p in files}


def _ours(module: str) -> bool:
    return module == "stride" or module.startswith("stride.")


def violations(modules: dict[str, ast.AST]) -> list[str]:
    """Every import against the layers or of another package's private name."""
    found = []
    for name, tree in modules.items():
        here = package_of(name)
        for target, names in imports_of(tree):
            if not _ours(target):
                continue
            there = package_of(target)
            if there != here and there not in ALLOWED[here]:
                found.append(f"{name} imports {target} ({here} may not import {there})")
            if there != here:
                private = [n for n in names if n.startswith("_")]
                private += [p for p in target.split(".") if p.startswith("_") and p != "__main__"]
                if private:
                    found.append(f"{name} imports private {private} of {target}")
    return found


def cycles(modules: dict[str, ast.AST]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan), over imports at any depth."""
    graph: dict[str, set[str]] = {}
    for name, tree in modules.items():
        deps = set()
        for target, names in imports_of(tree):
            for candidate in [target, *(f"{target}.{n}" for n in names)]:
                if candidate in modules and candidate != name:
                    deps.add(candidate)
        graph[name] = deps
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


def test_every_package_has_a_layer() -> None:
    for name in source_modules():
        assert package_of(name) in ALLOWED, name


def test_imports_point_down_the_layers() -> None:
    assert violations(source_modules()) == []


def test_no_import_circles() -> None:
    assert cycles(source_modules()) == []


@pytest.mark.parametrize("importer, line, why", [
    ("stride.sched.scheduler", "from stride.workers.runner import ModelRunner", "stride.sched may not import"),
    ("stride.kernels.rmsnorm", "from stride import env", "stride.kernels may not import"),
    ("stride.frontend.app", "from stride.kernels.sizes import next_pow2", "stride.frontend may not import"),
    ("stride.workers.runner", "from stride.sched.scheduler import _free", "private"),
])
def test_the_checks_catch_a_planted_import(importer: str, line: str, why: str) -> None:
    """Negative control: one planted import of each kind fails the check."""
    modules = source_modules()
    planted = dict(modules)
    planted[importer] = ast.parse(line)
    assert any(why in v for v in violations(planted)), violations(planted)


def test_the_cycle_check_catches_a_planted_circle() -> None:
    modules = source_modules()
    planted = dict(modules)
    planted["stride.ipc.codec"] = ast.parse("from stride.ipc.messages import TO_WORKER")  # messages imports codec
    assert ["stride.ipc.codec", "stride.ipc.messages"] in [g[:2] for g in cycles(planted)] or any(
        {"stride.ipc.codec", "stride.ipc.messages"} <= set(g) for g in cycles(planted))
