"""``open_standard_streams`` (``daemon/exhaustion.py`` and its copy in ``client/command.py``).

Both packages need it before anything is opened and neither may import the other's
(style.md section 1; ``protocol`` does no I/O), so there are two copies: tested alike.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

#: A child that exits 0 only when it has descriptors 0 and 2.
_CHILD = "import os; os.fstat(0); os.fstat(2)"


@pytest.mark.parametrize("module", ["toolsetd.daemon.exhaustion", "toolsetd.client.command"])
def test_a_closed_standard_descriptor_is_dev_null_for_children_too(module: str) -> None:
    """``toolsetd 2>&- <&-``: the /dev/null put there came from ``os.open``, which is
    close-on-exec, so every child (the orphan guard, a tool not given its own stderr)
    started with descriptors 0 and 2 closed again, and the next file it opened took them."""
    code = (
        f"import subprocess, sys\nfrom {module} import open_standard_streams\n"
        "open_standard_streams()\n"
        f"sys.exit(subprocess.run([sys.executable, '-c', {_CHILD!r}]).returncode)\n"
    )
    r = subprocess.run(
        ["/bin/sh", "-c", 'exec "$@" <&- 2>&-', "sh", sys.executable, "-c", code],
        stdout=subprocess.PIPE, timeout=60, check=False,
    )
    assert r.returncode == 0


def _body(path: Path) -> list[str]:
    """``open_standard_streams``'s statements, without its docstring and imports."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    function = next(
        node for node in tree.body
        if isinstance(node, ast.FunctionDef) and node.name == "open_standard_streams"
    )
    return [
        ast.dump(statement)
        for statement in function.body
        if not isinstance(statement, (ast.Import, ast.ImportFrom))
        and not (isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant))
    ]


def test_the_two_copies_do_the_same() -> None:
    """One shared copy is not possible: ``protocol`` does no I/O, the client imports
    nothing of the daemon's (``toolsetd.daemon`` costs structlog at every start) and the
    daemon nothing of the client's. So the copies must not drift apart."""
    root = Path(__file__).resolve().parent.parent.parent
    assert _body(root / "daemon" / "exhaustion.py") == _body(root / "client" / "command.py")
