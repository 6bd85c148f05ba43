"""The import graph of `src/idemproxy` (the README's Layout) has no circle and keeps its floors.

Every import counts: at module level, under `TYPE_CHECKING` and inside functions, since each is
a dependency a reader has to follow. Three checks:

* no circle between modules;
* no circle between the members of any one folder: its subfolders and its single files (within
  `proxy/`: `server/`, `jobs/`, `upstream/`, `background/`, `context.py`, `handler.py`, ...);
* the layer rules in `RULES`, one line each.

A failure names each offending import as file:line.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import idemproxy

PACKAGE = "idemproxy"
ROOT = Path(idemproxy.__file__).resolve().parent


@dataclass(frozen=True)
class Import:
    source: str  # the importing module, dotted
    target: str  # the imported module, dotted
    where: str  # file:line of the import statement

    def __str__(self) -> str:
        return f"{self.where}: {self.source} -> {self.target}"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(ROOT.rglob("*.py"))}


MODULES = all_modules()


def resolve(name: str) -> str | None:
    """The module of ours that `name` (a module or a name inside one) denotes, if any."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def imported_names(node: ast.Import | ast.ImportFrom, module: str, package: bool) -> Iterator[str]:
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield alias.name
        return
    base = node.module or ""
    if node.level:
        parent = module if package else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            parent = parent.rpartition(".")[0]
        base = f"{parent}.{base}" if base else parent
    for alias in node.names:
        # `from package import module` imports that module; `from module import name`, module.
        yield f"{base}.{alias.name}"


def imports_in(text: str, module: str, filename: str, *, package: bool = False) -> Iterator[Import]:
    """The imports of ours in one module's source, wherever they stand in it."""
    for node in ast.walk(ast.parse(text, filename=filename)):
        if not isinstance(node, ast.Import | ast.ImportFrom):
            continue
        for name in imported_names(node, module, package):
            target = resolve(name)
            if target is not None and target not in (module, PACKAGE):
                yield Import(module, target, f"{filename}:{node.lineno}")


def imports_of(module: str, path: Path) -> Iterator[Import]:
    text = path.read_text(encoding="utf-8")
    filename = str(path.relative_to(ROOT.parent.parent))
    return imports_in(text, module, filename, package=path.name == "__init__.py")


IMPORTS = list(
    dict.fromkeys(edge for module, path in MODULES.items() for edge in imports_of(module, path))
)


def find_cycle(edges: Iterable[tuple[str, str, Import]]) -> list[Import] | None:
    """One circle in the graph, as the imports that close it, or None."""
    graph: dict[str, list[tuple[str, Import]]] = {}
    for source, target, edge in edges:
        graph.setdefault(source, []).append((target, edge))
    on_path: dict[str, int] = {}  # node -> where it enters `path`
    done: set[str] = set()
    path: list[Import] = []

    def visit(node: str) -> list[Import] | None:
        on_path[node] = len(path)
        for target, edge in graph.get(node, []):
            if target in on_path:
                return [*path[on_path[target] :], edge]
            if target in done:
                continue
            path.append(edge)
            cycle = visit(target)
            if cycle is not None:
                return cycle
            path.pop()
        del on_path[node]
        done.add(node)
        return None

    for node in sorted(graph):
        if node not in done:
            cycle = visit(node)
            if cycle is not None:
                return cycle
    return None


def describe(imports: list[Import]) -> str:
    return "\n".join(f"  {edge}" for edge in imports)


def test_no_import_cycle_between_modules() -> None:
    cycle = find_cycle((edge.source, edge.target, edge) for edge in IMPORTS)
    if cycle is not None:
        pytest.fail("import circle:\n" + describe(cycle), pytrace=False)


def packages() -> list[str]:
    return sorted(name for name, path in MODULES.items() if path.name == "__init__.py")


def member(package: str, module: str) -> str | None:
    """The direct member of `package` (a subfolder or a single file) that holds `module`."""
    prefix = package + "."
    if not module.startswith(prefix):
        return None
    return module[len(prefix) :].partition(".")[0]


@pytest.mark.parametrize("package", packages())
def test_no_cycle_between_the_members_of_a_folder(package: str) -> None:
    edges = []
    for edge in IMPORTS:
        source, target = member(package, edge.source), member(package, edge.target)
        if source is not None and target is not None and source != target:
            edges.append((source, target, edge))
    cycle = find_cycle(edges)
    if cycle is not None:
        pytest.fail(f"circle between the members of {package}:\n" + describe(cycle), pytrace=False)


@dataclass(frozen=True)
class Rule:
    """Modules under `source` import nothing under `forbidden`, or only what is under `only`."""

    source: str
    forbidden: tuple[str, ...] = ()
    only: tuple[str, ...] | None = None
    exempt: tuple[str, ...] = ()

    def broken_by(self, edge: Import) -> bool:
        if not within(edge.source, self.source) or any(within(edge.source, e) for e in self.exempt):
            return False
        if self.only is not None and not any(within(edge.target, o) for o in self.only):
            return True
        return any(within(edge.target, f) for f in self.forbidden)


def within(module: str, prefix: str) -> bool:
    name = f"{PACKAGE}.{prefix}" if prefix else PACKAGE
    return module == name or module.startswith(name + ".")


# Lowest floors first. `only`: all a folder may import; `forbidden`: what it must never reach.
RULES = {
    "the core is pure: it imports only itself, errors and constants": Rule(
        "core", only=("core", "errors", "constants")
    ),
    "settings are data: config imports only errors, constants and the Host grammar": Rule(
        "config",
        only=(
            "config",
            "errors",
            "constants",
            "redact",
            "http.headers",  # the Host grammar, which `forward_host` is checked against
        ),
    ),
    "so are the quotas' settings": Rule("config.quotas", only=("config.quotas", "config.units")),
    "so are the upstream leg's settings": Rule(
        "config.upstream",
        only=(
            "config.upstream",
            "errors",
            "constants",
            "config.units",
            "config.secret_files",
            "redact",
        ),
    ),
    "and the key sources' and webhooks' settings": Rule(
        "config.keys",
        only=("config.keys", "config.upstream", "errors", "constants", "config.units"),
    ),
    "a request's identity comes from the request and the settings alone": Rule(
        "identity",
        only=("identity", "config", "errors", "constants", "randomness", "secret_files"),
    ),
    "wire helpers know no proxy and no store": Rule("http", forbidden=("proxy", "store")),
    "the store serves the proxy, the admin listener and the operator tools": Rule(
        "store", forbidden=("proxy", "admin", "ops")
    ),
    "the server side knows no governed jobs": Rule("proxy.server", forbidden=("proxy.jobs",)),
    "the upstream client knows no governed jobs": Rule("proxy.upstream", forbidden=("proxy.jobs",)),
    "follow-up work knows no governed jobs": Rule("proxy.background", forbidden=("proxy.jobs",)),
    "the server side knows no upstream client": Rule("proxy.server", forbidden=("proxy.upstream",)),
    "the upstream client knows no server side": Rule("proxy.upstream", forbidden=("proxy.server",)),
    "only the entry points import the command line and the process start-up": Rule(
        "", forbidden=("cli",), exempt=("__main__", "cli")
    ),
}


def broken(rule: Rule) -> list[Import]:
    return [edge for edge in IMPORTS if rule.broken_by(edge)]


@pytest.mark.parametrize("rule", RULES, ids=list(RULES))
def test_layer_rule(rule: str) -> None:
    offending = broken(RULES[rule])
    if offending:
        pytest.fail(f"{rule}:\n" + describe(offending), pytrace=False)


def test_every_kind_of_import_is_read() -> None:
    text = """
from typing import TYPE_CHECKING
import idemproxy.errors
from idemproxy import constants as c
from idemproxy.http.headers import hop_by_hop, strip
from . import deadline
from .problems import problem_response
if TYPE_CHECKING:
    from idemproxy.config.settings import Settings
def later() -> None:
    from idemproxy.store.base import Store
"""
    edges = list(imports_in(text, "idemproxy.http.example", "example.py"))
    assert [(edge.target, edge.where) for edge in edges] == [
        ("idemproxy.errors", "example.py:3"),
        ("idemproxy.constants", "example.py:4"),
        ("idemproxy.http.headers", "example.py:5"),
        ("idemproxy.http.headers", "example.py:5"),
        ("idemproxy.http.deadline", "example.py:6"),
        ("idemproxy.http.problems", "example.py:7"),
        ("idemproxy.config.settings", "example.py:9"),
        ("idemproxy.store.base", "example.py:11"),
    ]
    assert RULES["wire helpers know no proxy and no store"].broken_by(edges[-1])


def test_a_circle_is_found_with_its_imports() -> None:
    a_b, b_c, c_a, c_d = (
        Import("a", "b", "a.py:1"),
        Import("b", "c", "b.py:2"),
        Import("c", "a", "c.py:3"),
        Import("c", "d", "c.py:4"),
    )
    assert find_cycle((e.source, e.target, e) for e in (c_d, a_b, b_c, c_a)) == [a_b, b_c, c_a]
    assert find_cycle((e.source, e.target, e) for e in (c_d, a_b, b_c)) is None
    assert member("idemproxy.proxy", "idemproxy.proxy.server.connection") == "server"
    assert member("idemproxy.proxy", "idemproxy.store.base") is None


def test_the_rules_say_what_they_mean() -> None:
    core = RULES["the core is pure: it imports only itself, errors and constants"]
    assert core.broken_by(Import("idemproxy.core.types", "idemproxy.proxy.app", "x.py:1"))
    assert not core.broken_by(Import("idemproxy.core.decision", "idemproxy.core.machine", "x:1"))
    assert not core.broken_by(Import("idemproxy.core.types", "idemproxy.errors", "x.py:1"))
    entry = RULES["only the entry points import the command line and the process start-up"]
    assert entry.broken_by(Import("idemproxy.workers.supervisor", "idemproxy.cli.serve", "x.py:1"))
    assert not entry.broken_by(Import("idemproxy.cli.main", "idemproxy.cli.serve", "x.py:1"))
    assert not entry.broken_by(Import("idemproxy.cli.ops", "idemproxy.ops.view", "x.py:1"))


def test_the_graph_is_read() -> None:
    """The checks above see this repository's imports: an empty graph would pass them all."""
    edges = {(edge.source, edge.target) for edge in IMPORTS}
    assert ("idemproxy.proxy.app", "idemproxy.proxy.handler") in edges
    assert ("idemproxy.__main__", "idemproxy.cli.main") in edges
    assert ("idemproxy.cli.main", "idemproxy.cli.serve") in edges  # inside a function
