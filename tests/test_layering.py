"""The import layering of style.md section 1, checked on the source's AST.

Imports go one way: ``daemon`` → ``protocol`` and ``client`` → ``protocol``. The protocol
package is pure (standard library, pydantic, orjson). The daemon never imports the client.
The client imports the daemon only from ``client/offline.py`` (the CLI's offline
commands reuse the pure manifest reader), plus the exceptions listed in
``_CLIENT_DAEMON_EXCEPTIONS``. No module spawns tasks outside anyio task groups
(``asyncio.create_task``/``gather``/``ensure_future``) or runs a shell (``os.system``).

Every file is parsed, not imported, so lazy imports inside functions count too.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parent.parent
_PACKAGES = {"protocol": "toolsetd.protocol", "daemon": "toolsetd.daemon", "client": "toolsetd.client"}

#: Third-party distributions the protocol package may import, besides the standard library.
_PROTOCOL_THIRD_PARTY = frozenset({"pydantic", "orjson"})

#: Client files allowed to import ``toolsetd.daemon``: file → the daemon modules it may
#: import (None: any). ``offline.py`` is the designed exception (style.md section 1).
_CLIENT_DAEMON_EXCEPTIONS: dict[str, frozenset[str] | None] = {
    "client/offline.py": None,
}

#: Calls that bypass structured concurrency or run a shell: (module, attribute).
_BANNED_CALLS = frozenset({
    ("asyncio", "create_task"),
    ("asyncio", "gather"),
    ("asyncio", "ensure_future"),
    ("os", "system"),
})


@dataclass(frozen=True)
class _Import:
    """One imported module, absolute, with where it was found."""

    module: str
    file: str
    line: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.module}"


def _sources(folder: str) -> list[Path]:
    return sorted((_ROOT / folder).rglob("*.py"))


def _rel(path: Path) -> str:
    return path.relative_to(_ROOT).as_posix()


def _package_of(path: Path) -> str:
    """The dotted package a source file lives in (``toolsetd.daemon`` for daemon/x.py)."""
    rel = path.relative_to(_ROOT)
    parts = [_PACKAGES[rel.parts[0]], *rel.parts[1:-1]]
    return ".".join(parts)


def _resolve(node: ast.ImportFrom, package: str) -> str:
    """The absolute module a ``from ... import`` names (relative ones made absolute)."""
    if not node.level:
        return node.module or ""
    base = package.split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def _imports(path: Path) -> Iterator[_Import]:
    """Every module a file imports, relative imports made absolute."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = _package_of(path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield _Import(alias.name, _rel(path), node.lineno)
        elif isinstance(node, ast.ImportFrom):
            module = _resolve(node, package)
            yield _Import(module, _rel(path), node.lineno)
            # ``from toolsetd import daemon`` / ``from toolsetd.daemon import runner``.
            for alias in node.names:
                yield _Import(f"{module}.{alias.name}", _rel(path), node.lineno)


def _all_imports(folder: str) -> list[_Import]:
    return [imp for path in _sources(folder) for imp in _imports(path)]


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


@pytest.mark.parametrize("folder", sorted(_PACKAGES))
def test_layering_finds_sources(folder: str) -> None:
    """Each code folder has Python files to check, so the other tests cannot pass vacuously."""
    assert len(_sources(folder)) >= 3


def test_layering_protocol_is_pure() -> None:
    """The protocol package imports only the standard library, pydantic, orjson and itself."""
    allowed_roots = set(sys.stdlib_module_names) | _PROTOCOL_THIRD_PARTY | {"__future__"}
    bad = [
        imp
        for imp in _all_imports("protocol")
        if not _under(imp.module, "toolsetd.protocol")
        and imp.module.split(".")[0] not in allowed_roots
    ]
    assert [str(b) for b in bad] == []


def test_layering_daemon_never_imports_client() -> None:
    """No daemon module imports ``toolsetd.client``."""
    bad = [str(imp) for imp in _all_imports("daemon") if _under(imp.module, "toolsetd.client")]
    assert bad == []


def test_layering_client_imports_daemon_only_from_offline() -> None:
    """The client imports ``toolsetd.daemon`` only from offline.py and the listed exceptions."""
    bad = []
    for imp in _all_imports("client"):
        if not _under(imp.module, "toolsetd.daemon"):
            continue
        if imp.file not in _CLIENT_DAEMON_EXCEPTIONS:
            bad.append(imp)
            continue
        allowed = _CLIENT_DAEMON_EXCEPTIONS[imp.file]
        # ``from toolsetd.daemon.model import X`` also yields ``toolsetd.daemon.model.X``.
        if allowed is not None and not any(_under(imp.module, m) for m in allowed):
            bad.append(imp)
    assert [str(b) for b in bad] == []


def _banned(path: Path) -> Iterator[str]:
    """Banned calls (``asyncio.gather(...)``) and banned names imported directly."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and (node.func.value.id, node.func.attr) in _BANNED_CALLS
        ):
            yield f"{_rel(path)}:{node.lineno}: {node.func.value.id}.{node.func.attr}()"
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                if (node.module, alias.name) in _BANNED_CALLS:
                    yield f"{_rel(path)}:{node.lineno}: from {node.module} import {alias.name}"


def test_layering_no_unstructured_tasks_or_shell() -> None:
    """No module calls asyncio.create_task/gather/ensure_future or os.system."""
    bad = [hit for folder in sorted(_PACKAGES) for path in _sources(folder) for hit in _banned(path)]
    assert bad == []


def _absolute_sibling_imports(path: Path) -> Iterator[str]:
    """``from toolsetd.<own package>.x import y`` inside that package (one style: relative)."""
    own = _PACKAGES[path.relative_to(_ROOT).parts[0]]
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and not node.level and node.module:
            if _under(node.module, own):
                yield f"{_rel(path)}:{node.lineno}: from {node.module} import ..."
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if _under(alias.name, own):
                    yield f"{_rel(path)}:{node.lineno}: import {alias.name}"


def test_layering_one_import_style_inside_a_package() -> None:
    """A module imports its own package's modules relatively; other packages absolutely."""
    bad = [
        hit
        for folder in sorted(_PACKAGES)
        for path in _sources(folder)
        for hit in _absolute_sibling_imports(path)
    ]
    assert bad == []


def _module_name(path: Path) -> str:
    stem = path.stem
    package = _package_of(path)
    return package if stem == "__init__" else f"{package}.{stem}"


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_time_imports(path: Path, known: set[str]) -> set[str]:
    """The project modules a file imports when it is imported: outside functions and
    ``if TYPE_CHECKING:`` (in any block the import itself runs: try, with, a class body)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = _package_of(path)
    found: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue  # runs when called: a lazy import, no import-time edge
            if isinstance(node, ast.If) and _is_type_checking(node):
                visit(node.orelse)  # ``else:`` of TYPE_CHECKING runs at import time
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names if alias.name in known)
            elif isinstance(node, ast.ImportFrom):
                module = _resolve(node, package)
                for alias in node.names:
                    if f"{module}.{alias.name}" in known:
                        found.add(f"{module}.{alias.name}")
                    elif module in known:
                        found.add(module)
            else:
                # Every other statement's blocks run at import time: if/else, try (its
                # else and finally too), with, for, while, match, a class body.
                for name in ("body", "orelse", "finalbody"):
                    visit(getattr(node, name, None) or [])
                for block in (*getattr(node, "handlers", ()), *getattr(node, "cases", ())):
                    visit(block.body)

    visit(tree.body)
    return found


def test_layering_no_import_cycles() -> None:
    """No chain of import-time imports between the project's modules leads back to its start."""
    paths = {_module_name(p): p for folder in sorted(_PACKAGES) for p in _sources(folder)}
    known = set(paths)
    graph = {name: _import_time_imports(path, known) - {name} for name, path in paths.items()}
    # A package's __init__ importing its own submodules is how a package re-exports: the
    # submodules importing a sibling never runs __init__ again, so that edge is no cycle.
    for name in graph:
        graph[name] = {m for m in graph[name] if not (name in _PACKAGES.values() and _under(m, name))}
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def walk(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                walk(nxt)
        stack.pop()
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            walk(name)
    assert [" -> ".join(c) for c in cycles] == []


#: The faces: they translate shapes and call the service, nothing below it. The native
#: wire (methods, and the connection, dispatch and server that carry it) and MCP (the
#: session, its mapping, and its transports: the socket binding, Streamable HTTP).
_FACES = (
    "daemon/methods.py", "daemon/connection.py", "daemon/dispatch.py", "daemon/server.py",
    "daemon/mcp_session.py", "daemon/mcp_socket.py", "daemon/mcp_mapping.py",
    "daemon/mcphttp.py", "daemon/httpserver.py",
)
#: What only the service core may reach: lookup, validation, classification, the run.
_CORE_ONLY = frozenset({
    "toolsetd.daemon.policy", "toolsetd.daemon.paths", "toolsetd.daemon.validation",
    "toolsetd.daemon.registry", "toolsetd.daemon.argv",
})


def _calls(path: Path) -> Iterator[tuple[str, int]]:
    """Every called name or attribute in a file: ``classify(...)`` and ``x.run(...)``."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name):
                yield func.id, node.lineno
            elif isinstance(func, ast.Attribute):
                yield func.attr, node.lineno


def test_layering_faces_reach_the_core_only_through_the_service() -> None:
    """No face imports the policy, the paths, the validators, the registry or argv."""
    bad = [
        str(imp)
        for face in _FACES
        for imp in _imports(_ROOT / face)
        if any(_under(imp.module, core) for core in _CORE_ONLY)
    ]
    assert bad == []


def test_layering_one_invoke_and_policy_path() -> None:
    """Only the service classifies a call, checks its schema, enforces and runs it."""
    owners: dict[str, set[str]] = {}
    for path in _sources("daemon"):
        for name, _ in _calls(path):
            if name in {"classify", "errors", "_enforce", "run"}:
                owners.setdefault(name, set()).add(_rel(path))
    assert owners["_enforce"] == {"daemon/service.py"}
    # ``classify`` is defined in policy.py; the service is its one caller.
    assert owners["classify"] - {"daemon/policy.py"} == {"daemon/service.py"}
    # ``Runner.run`` and ``ArgumentValidators.errors``: called by the service alone.
    assert "daemon/service.py" in owners["run"]
    assert not owners["run"] & set(_FACES)
    assert not owners["errors"] & set(_FACES)
    # The runner's event bookkeeping has one implementation: the service's.
    bookkeepers = [
        _rel(path) for path in _sources("daemon") if "started_sent" in path.read_text()
    ]
    assert bookkeepers == ["daemon/service.py"]
