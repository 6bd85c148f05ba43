"""No private API of aiohttp, multidict or yarl in src/ (STYLE.md 14): a private name pins the
project to the releases that still have it, and users wait for the project to take a fix.

Read from the source, not run: every `_name` that these packages define (a function, class,
method, slot, or attribute they assign) is private to them. src/ may not import one, reach one
through any object (`response._cookies`, `super()._prepare_headers`), nor, in a class built on
one of their classes, touch or override a private name of that class (`self._keep_alive`,
`def _prepare_headers`): names of its own must not collide with them either.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import aiohttp
import multidict
import pytest
import yarl

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGES = ("aiohttp", "multidict", "yarl")


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _defined(tree: ast.AST) -> set[str]:
    """The private names a module's or class's code defines."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.add(node.value)  # `__slots__` entries (and harmless other strings)
    return {name for name in names if _private(name) and name.isidentifier()}


@cache
def _package_private() -> frozenset[str]:
    names: set[str] = set()
    for package in (aiohttp, multidict, yarl):
        root = Path(inspect.getfile(package)).parent
        for path in root.rglob("*.py*"):  # .py and the .pyi stubs of C extensions
            if path.suffix in (".py", ".pyi"):
                names |= _defined(ast.parse(path.read_text(encoding="utf-8")))
    return frozenset(names)


@cache
def _class_private(cls: type) -> frozenset[str]:
    """The private names of `cls` and its bases from these packages."""
    names: set[str] = set()
    for base in cls.__mro__:
        if base.__module__.partition(".")[0] not in PACKAGES:
            continue
        names |= {name for name in vars(base) if _private(name)}
        names |= {name for name in getattr(base, "__slots__", ()) if _private(name)}
        try:
            source = inspect.getsource(base)
        except (OSError, TypeError):
            continue  # a C class: its Python-visible names are in vars() above
        names |= _defined(ast.parse(source.strip() if source[0].isspace() else source))
    return frozenset(names)


def _modules() -> list[Path]:
    return sorted((SRC / "idemproxy").rglob("*.py"))


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")


def _ours(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def _import_findings(tree: ast.Module) -> Iterator[str]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] in PACKAGES and any(_private(part) for part in parts):
                    yield f"line {node.lineno}: import {alias.name}"
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            parts = node.module.split(".")
            if parts[0] not in PACKAGES:
                continue
            private = [a.name for a in node.names if _private(a.name)]
            if any(_private(part) for part in parts) or private:
                yield f"line {node.lineno}: from {node.module} import {', '.join(private)}"


def _access_findings(tree: ast.Module) -> Iterator[str]:
    private = _package_private()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and not _ours(node.value) and node.attr in private:
            yield f"line {node.lineno}: .{node.attr}"


def _subclass_findings(tree: ast.Module, module: object) -> Iterator[str]:
    for node in ast.walk(tree):
        if not isinstance(node, ast.ClassDef):
            continue
        cls = getattr(module, node.name, None)
        if not isinstance(cls, type):
            continue
        theirs = _class_private(cls)
        for inner in ast.walk(node):
            if isinstance(inner, ast.Attribute) and _ours(inner.value) and inner.attr in theirs:
                yield f"line {inner.lineno}: {node.name} uses {inner.attr}"
            elif isinstance(inner, ast.FunctionDef | ast.AsyncFunctionDef) and inner.name in theirs:
                yield f"line {inner.lineno}: {node.name} overrides {inner.name}"


@pytest.mark.parametrize("path", _modules(), ids=_module_name)
def test_src_uses_only_public_aiohttp_multidict_and_yarl_api(path: Path) -> None:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    findings = [*_import_findings(tree), *_access_findings(tree)]
    if any(isinstance(node, ast.ClassDef) for node in tree.body):
        findings += _subclass_findings(tree, importlib.import_module(_module_name(path)))
    assert not findings, f"{path.relative_to(SRC)}: private API of {'/'.join(PACKAGES)}"


def test_the_scan_finds_what_it_looks_for() -> None:
    """Each kind of finding on a sample, so that a scan that finds nothing means something."""
    sample = ast.parse(
        "from aiohttp.web_urldispatcher import _InfoDict\n"
        "import aiohttp._http_parser\n"
        "def f(response):\n"
        "    return response._cookies\n"
    )
    assert len(list(_import_findings(sample))) == 2
    assert list(_access_findings(sample)) == ["line 4: ._cookies"]
    overriding = ast.parse(
        "class Sent(web.StreamResponse):\n"
        "    async def _prepare_headers(self): ...\n"
        "    def sent(self):\n"
        "        self._eof_sent = True\n"
    )

    class Sent(aiohttp.web.StreamResponse):
        pass

    found = list(_subclass_findings(overriding, type("module", (), {"Sent": Sent})))
    assert found == ["line 2: Sent overrides _prepare_headers", "line 4: Sent uses _eof_sent"]
