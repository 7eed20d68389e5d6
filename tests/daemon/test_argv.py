"""Argv rendering and executable resolution (reference host section 3, steps 1 and 2)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from toolsetd.daemon.argv import ArgvError, build_argv, render_flags, resolve_executable

from tests.daemon.conftest import make_tool

FLAGS = (("name", "--name"), ("count", "-n"), ("verbose", "--verbose"), ("tags", "--tag"))


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        ({"name": "x y"}, ["--name", "x y"]),
        ({"count": 3}, ["-n", "3"]),
        ({"count": -7}, ["-n", "-7"]),
        ({"count": 1.5}, ["-n", "1.5"]),
        ({"count": 2**70}, ["-n", str(2**70)]),
        ({"verbose": True}, ["--verbose", "true"]),
        ({"verbose": False}, ["--verbose", "false"]),
        ({"tags": ["a", "b"]}, ["--tag", "a", "--tag", "b"]),
        ({"tags": []}, []),
        ({}, []),
        ({"other": 1}, []),
        # Manifest order, not argument order.
        ({"tags": ["t"], "name": "n", "count": 0}, ["--name", "n", "-n", "0", "--tag", "t"]),
        ({"name": ""}, ["--name", ""]),
        ({"name": "é✓"}, ["--name", "é✓"]),
    ],
)
def test_render_flags_values(arguments: dict[str, Any], expected: list[str]) -> None:
    """Each value kind renders as the reference host does, booleans as true/false."""
    assert render_flags(FLAGS, arguments) == expected


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"tags": ["a", 1]}, "Argument for '--tag' arrays must contain strings."),
        ({"tags": [None]}, "Argument for '--tag' arrays must contain strings."),
        ({"name": None}, "Argument for '--name' must be a string, number, boolean, or string array."),
        ({"name": {"a": 1}}, "Argument for '--name' must be a string, number, boolean, or string array."),
        ([1, 2], "Arguments must be a JSON object."),
        ("text", "Arguments must be a JSON object."),
        (None, "Arguments must be a JSON object."),
    ],
)
def test_render_flags_errors(arguments: Any, message: str) -> None:
    """Unsupported values fail with the reference host's exact messages."""
    with pytest.raises(ArgvError) as info:
        render_flags(FLAGS, arguments)
    assert info.value.message == message


def test_render_flags_empty_map_accepts_any_arguments() -> None:
    """Without an argv map the arguments need not be an object."""
    assert render_flags((), [1, 2]) == []


def test_resolve_executable_bare_name_in_set_dir(tmp_path: Path) -> None:
    """A bare name that exists in the set directory runs from there."""
    (tmp_path / "tool").write_text("")
    assert resolve_executable("tool", tmp_path) == str(tmp_path / "tool")


def test_resolve_executable_bare_name_on_path(tmp_path: Path) -> None:
    """A bare name not in the set directory is left for the PATH search."""
    assert resolve_executable("sh", tmp_path) == "sh"
    (tmp_path / "dir").mkdir()
    assert resolve_executable("dir", tmp_path) == "dir"


@pytest.mark.parametrize("target", ["gone", "tool"], ids=["dangling", "loop"])
def test_resolve_executable_bare_name_of_a_link_to_nowhere_is_not_searched(
    tmp_path: Path, target: str
) -> None:
    """A bare name that is a link leading nowhere in the set directory still names that
    file (.NET's File.Exists counts it; the start then fails), never a program of the same
    name on PATH."""
    (tmp_path / "sh").symlink_to(target if target == "gone" else "sh")
    assert resolve_executable("sh", tmp_path) == str(tmp_path / "sh")


def test_resolve_executable_absolute_path_as_get_full_path_writes_it(tmp_path: Path) -> None:
    """An absolute path runs as .NET's GetFullPath writes it: ``..`` applied lexically, so
    through a folder that does not exist; repeated separators collapsed; a trailing one kept."""
    assert resolve_executable(f"{tmp_path}/missing/../../bin/sh", tmp_path) == str(
        tmp_path.parent / "bin" / "sh"
    )
    assert resolve_executable("//usr//bin/./env", tmp_path) == "/usr/bin/env"
    assert resolve_executable("/usr/bin/env/", tmp_path) == "/usr/bin/env/"


def test_resolve_executable_relative_inside(tmp_path: Path) -> None:
    """A relative path with a separator resolves against the set directory."""
    assert resolve_executable("bin/../bin/run", tmp_path) == str(tmp_path / "bin" / "run")
    assert resolve_executable("./run", tmp_path) == str(tmp_path / "run")


@pytest.mark.parametrize("name", ["./", "sub/..", "./.", "x/../"])
def test_resolve_executable_the_set_directory_itself_is_inside(tmp_path: Path, name: str) -> None:
    """The set directory itself counts as inside, as the reference host's ``IsInside`` has
    it (equal paths, or the directory with a trailing separator): such a command fails to
    start (a folder is not a program), it is not "outside the tool set directory"."""
    assert resolve_executable(name, tmp_path).rstrip("/") == str(tmp_path)
    assert resolve_executable(f"../{tmp_path.name}", tmp_path).rstrip("/") == str(tmp_path)


@pytest.mark.parametrize("name", ["../x", "bin/../../x", "./.."])
def test_resolve_executable_relative_escaping(tmp_path: Path, name: str) -> None:
    """A relative path leaving the set directory is refused."""
    with pytest.raises(ArgvError) as info:
        resolve_executable(name, tmp_path)
    assert info.value.message == "Executable path must stay inside the tool set directory."


def test_resolve_executable_absolute_and_invalid(tmp_path: Path) -> None:
    """An absolute path is used as given; a NUL byte is not a valid path."""
    assert resolve_executable("/bin/sh", tmp_path) == "/bin/sh"
    with pytest.raises(ArgvError) as info:
        resolve_executable("a\0b", tmp_path)
    assert info.value.message == "Executable path is not valid."


def test_build_argv_composes_prefix_suffix_flags(tmp_path: Path) -> None:
    """argv = set command + tool command + flags, argv[0] resolved."""
    (tmp_path / "acme").write_text("")
    loaded = make_tool(
        tmp_path, command=("acme", "--x"), tool_command=("sub",), argv=(("q", "--q"),)
    )
    assert build_argv(loaded, {"q": "v"}) == [str(tmp_path / "acme"), "--x", "sub", "--q", "v"]


def test_build_argv_requires_command(tmp_path: Path) -> None:
    """An empty command fails before anything else."""
    loaded = make_tool(tmp_path, argv=(("q", "--q"),))
    with pytest.raises(ArgvError) as info:
        build_argv(loaded, "not an object")
    assert info.value.message == "exec requires a command array."


def test_build_argv_render_error_before_executable_error(tmp_path: Path) -> None:
    """Rendering errors come before executable errors (step 1 before step 2)."""
    loaded = make_tool(tmp_path, command=("../x",), argv=(("q", "--q"),))
    with pytest.raises(ArgvError) as info:
        build_argv(loaded, {"q": None})
    assert "must be a string" in info.value.message
    with pytest.raises(ArgvError) as info:
        build_argv(loaded, {})
    assert info.value.message == "Executable path must stay inside the tool set directory."
    assert os.path.isdir(tmp_path)
