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


def _imports(path: Path) -> Iterator[_Import]:
    """Every module a file imports, relative imports made absolute."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = _package_of(path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield _Import(alias.name, _rel(path), node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
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
