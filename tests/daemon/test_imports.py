"""What starting the daemon imports: nothing it does not use before its first call."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest


def _modules_after(code: str) -> dict[str, bool]:
    probe = (
        f"{code}\nimport json, sys\n"
        "print(json.dumps({m: m in sys.modules for m in "
        "('rich', 'jsonschema', 'jsonrpcserver', 'pydantic', 'toolsetd.daemon.mcp_session', "
        "'watchfiles')}))"
    )
    out = subprocess.run(  # a fresh interpreter is the point of the test
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    result: dict[str, bool] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def test_daemon_start_imports_no_rich_no_jsonschema_no_pydantic_no_mcp() -> None:
    """Importing the daemon (and configuring JSON logs) loads neither rich (which structlog
    would pull in) nor jsonschema, jsonrpcserver or pydantic (params are checked by
    ``protocol/params.py``), nor the MCP core (built when the first MCP host binds), nor
    watchfiles (imported when watching starts: ``--no-watch`` never loads it)."""
    loaded = _modules_after(
        "import toolsetd.daemon.app\n"
        "from toolsetd.daemon.logs import configure_logging\n"
        "configure_logging('json', 'info')\n"
    )
    assert not any(loaded.values()), loaded


def test_client_models_build_no_validator_at_import() -> None:
    """The models (for clients) build no pydantic validator until one is used."""
    loaded = _modules_after(
        "from toolsetd.protocol import models\n"
        "assert not models.InvokeParams.__pydantic_complete__\n"
    )
    assert loaded["pydantic"] is True


def test_console_logs_still_print_exceptions_without_rich() -> None:
    """The console format renders an exception as a plain traceback."""
    code = (
        "import toolsetd.daemon\n"
        "from toolsetd.daemon.logs import configure_logging\n"
        "import structlog\n"
        "configure_logging('console', 'info')\n"
        "try:\n    1 / 0\nexcept ZeroDivisionError:\n"
        "    structlog.get_logger('t').exception('boom')\n"
    )
    out = subprocess.run(  # a fresh interpreter is the point of the test
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert "boom" in out.stderr or "boom" in out.stdout
    assert "ZeroDivisionError" in out.stderr + out.stdout


def test_rich_stays_importable_after_the_daemon_package() -> None:
    """rich is hidden only while structlog is imported: anyone may import it afterwards."""
    if importlib.util.find_spec("rich") is None:
        pytest.skip("rich is not installed here (toolsetd does not depend on it)")
    loaded = _modules_after("import toolsetd.daemon\nimport rich\n")
    assert loaded["rich"] is True
