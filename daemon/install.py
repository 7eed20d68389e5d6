"""Which code is installed: what tells a daemon that toolsetd was upgraded under it.

Theory of operation
-------------------
Operators upgrade toolsetd in place while its daemon runs (``pip install -U`` into the
venv, a ``git pull`` in an editable checkout, a distro package replacing the files), or
remove the venv. The running daemon keeps the code it imported; what it starts or imports
from disk later is the new code, or none. Three things are taken from disk after the start:

* the **check process** (``checkworker``), started at the first large check and again
  after one ends. Run from other code, it checked a call's arguments with other rules, or
  answered in another shape (every large call then failed as an internal error);
* the **MCP face**'s modules (``mcp_socket``, ``mcp_session``, ``mcp_mapping``), imported
  at the first ``mcp.bind``: other code, mixed into the old daemon's;
* **jsonschema**, imported at the first check that needs it when the set cache made the
  start parse nothing: another version checked the calls, and judged the sets changed
  since, with its own rules.

``code_id`` names the code a process would run: ``sources_id``, a hash of the source of
every module of ``toolsetd.daemon`` and ``toolsetd.protocol`` as the files hold it now
(its compiled file, in an install of compiled files only; no file an import does not
load, such as an editor's lock ``.#app.py``: ``_module_files``) and the version of
Python; ``libraries_id``, the versions of the distributions whose code decides a check's
verdict and jsonschema's import loads (``_DISTRIBUTIONS``, ``FORMAT_DISTRIBUTIONS``); and
orjson's (``_WIRE``). The daemon takes them once, at its start (2.5-3.5 ms here); a check
process takes its own ``code_id`` at its start and sends it first (``checkworker``), and
the daemon uses the process only if the two are equal; the MCP modules are imported only
while ``sources_id`` is unchanged (they load no library anew), and jsonschema only while
``libraries_id`` is (``validation``: a call's check, a set's parse); both are looked at
again each time until the import, so that a moment's change (a reinstall's files gone) is
refused only for that moment. Equal source is equal code, whatever the files' times: a
reinstall of the same version is no upgrade.

An install as one zip archive (a zipapp, shiv, pex) is not supported: its package folders
cannot be listed, so ``sources_id`` hashes them as unreadable, the same for any archive,
and an archive replaced under the daemon goes untold (the set cache's fingerprint cannot
be taken either, and the check process, ``python -m``, does not find the package).
"""

from __future__ import annotations

import errno
import functools
import hashlib
import importlib.util
import os
import sys

__all__ = [
    "FORMAT_DISTRIBUTIONS",
    "UPGRADED",
    "at_start",
    "code_id",
    "installed_version",
    "interpreter_flags",
    "libraries_id",
    "sources_id",
]

#: What a daemon says when the code on disk is not the code it runs.
UPGRADED = "toolsetd was upgraded (or removed) under this daemon: restart it"

#: The optional packages jsonschema takes its ``format`` checks from, installed or not.
FORMAT_DISTRIBUTIONS = (
    "fqdn",
    "idna",
    "isoduration",
    "jsonpointer",
    "rfc3339_validator",
    "rfc3986_validator",
    "rfc3987",
    "rfc3987_syntax",
    "uri_template",
    "webcolors",
)
#: The distributions whose code decides a check's verdict, and jsonschema's first import
#: loads (and ``FORMAT_DISTRIBUTIONS``), by import name: jsonschema, its meta-schemas and
#: resolver, and the resolver's own libraries, attrs (``attr`` and ``attrs``) and rpds,
#: which nothing else in the daemon loads first. Not pydantic: neither the daemon nor the
#: check process imports it (only ``toolsetd.protocol.models``, the client's), nor the
#: libraries the daemon loads whole at its start (anyio, structlog, h11 with the HTTP
#: endpoint on, watchfiles with the watch on), which it does not load anew.
_DISTRIBUTIONS = {
    "jsonschema": "jsonschema",
    "jsonschema_specifications": "jsonschema_specifications",
    "referencing": "referencing",
    "attrs": "attrs",
    "rpds": "rpds_py",
}
_FORMATS = tuple((name, name) for name in FORMAT_DISTRIBUTIONS)
#: What else decides a check process's wire: orjson, the encoding of the request and the
#: answer (the daemon's own is loaded at its start, and never anew).
_WIRE = "orjson"


@functools.cache
def at_start() -> tuple[str, str, str]:
    """``libraries_id()``, ``sources_id()`` and ``code_id()`` as they were first asked for:
    by ``python -m toolsetd.daemon`` (and the ``toolsetd`` script) before it loads the
    daemon's modules. Taken once they were loaded (and the config read), an upgrade that
    landed in between (a socket-activated start during ``pip install -U``) was the code
    the daemon took for its own, and its check process judged by the new rules; taken
    before, any change after it is one the daemon tells.

    Raises:
        OSError: As ``code_id`` (then nothing is kept: the next call looks again).
    """
    libraries, sources = libraries_id(), sources_id()
    return libraries, sources, code_id(libraries, sources)


def libraries_id() -> str:
    """A short hash of the installed versions of the distributions whose code decides a
    check and jsonschema's import loads (``_DISTRIBUTIONS``, ``FORMAT_DISTRIBUTIONS``),
    read without importing them.

    A daemon started with its set cache warm has not imported jsonschema yet: it does at
    the first check that needs it (``validation.ArgumentValidators``), from disk.
    """
    h = hashlib.sha256()
    listings: dict[str, list[str]] = {}  # they are usually installed side by side
    for name, distribution in (*_DISTRIBUTIONS.items(), *_FORMATS):
        found = installed_version(name, listings, strict=True, distribution=distribution)
        h.update(b"\x00" + found.encode(errors="surrogateescape"))
    return h.hexdigest()[:16]


def code_id(libraries: str | None = None, sources: str | None = None) -> str:
    """A short hash of the code a process started now would run (see the module docstring).

    ``libraries``, ``sources``: ``libraries_id()``, ``sources_id()``, if just taken.

    Raises:
        OSError: A file or folder could not be read for want of a resource (out of
            descriptors, say): what is installed cannot be told now (``libraries_id``).
    """
    h = hashlib.sha256((sources if sources is not None else sources_id()).encode())
    h.update(b"\x00" + (libraries if libraries is not None else libraries_id()).encode())
    h.update(b"\x00" + installed_version(_WIRE, {}, strict=True).encode(errors="surrogateescape"))
    return h.hexdigest()[:16]


def sources_id() -> str:
    """A short hash of toolsetd's own code as installed now, and the version of Python:
    ``code_id`` but the libraries. What a daemon's first ``mcp.bind`` looks at: the MCP
    modules load none of those libraries anew (a format package installed beside the
    daemon is nothing to them).

    Reads the files as they are now; a package folder or file that is gone (the venv
    removed), or that may not be read, hashes as such (``_unread``), so it differs from
    any install that can be read.

    Raises:
        OSError: As ``code_id``.
    """
    import toolsetd.protocol

    h = hashlib.sha256(sys.version.encode())
    for folders in ([os.path.dirname(__file__)], toolsetd.protocol.__path__):
        for folder in folders:
            try:
                names = _module_files(os.listdir(folder))
            except OSError as exc:
                h.update(f"\x00{folder} {_unread(exc)}".encode(errors="surrogateescape"))
                continue
            for name in names:
                try:
                    with open(os.path.join(folder, name), "rb") as source:
                        data = source.read()
                except OSError as exc:
                    data = _unread(exc).encode()
                h.update(b"\x00%s %d\x00" % (name.encode(errors="surrogateescape"), len(data)))
                h.update(data)
    return h.hexdigest()[:16]


def _module_files(names: list[str]) -> list[str]:
    """The files among a package folder's ``names`` that an import can load: a module's
    source, or its compiled file where there is no source (an install of compiled files
    only). Not what an editor or a tool leaves beside them, which no import loads and which
    comes and goes with no upgrade: a name that is no identifier (Emacs's lock of a
    modified buffer, ``.#app.py``; a hidden copy, ``.app.py``), nor a compiled file beside
    its source (``compileall -b``: the source is what is loaded)."""
    sources = {name for name in names if name.endswith(".py") and name[:-3].isidentifier()}
    compiled = {
        name
        for name in names
        if name.endswith(".pyc") and name[:-4].isidentifier() and name[:-1] not in sources
    }
    return sorted(sources | compiled)


def interpreter_flags() -> list[str]:
    """The daemon's own interpreter flags that decide where imports are found, for the
    Python processes it starts (the check process, the watch process): they must find the
    modules and libraries the daemon does (a daemon run by ``python -I`` or ``-E``, a
    unit's hardening, or ``-s``, a distro's script line). Without them, a check process
    found a library on a ``PYTHONPATH`` or in a user's site that the daemon does not see,
    greeted with another ``code_id`` and was never used, nothing upgraded; a watch process
    imported such a watchfiles (another tool's, an older one) and failed each watch, the
    daemon left on its poll."""
    flags = sys.flags
    return [
        flag
        for flag, on in (
            ("-I", flags.isolated),
            ("-E", flags.ignore_environment),
            ("-s", flags.no_user_site),
            ("-S", flags.no_site),
        )
        if on
    ]


def installed_version(
    package: str,
    listings: dict[str, list[str]],
    strict: bool = False,
    distribution: str | None = None,
) -> str:
    """What identifies the installed version of a top-level package, without importing it.

    The name of its ``<distribution>-<version>.dist-info`` (or ``.egg-info``) folder beside
    it; failing that, the path, size and mtime of its ``__init__`` (an unusual install:
    the mtime changes at a reinstall of the same version).

    Args:
        package: The import name.
        listings: Folder listings made so far, by folder.
        strict: Raise what a folder that cannot be read for want of a resource raised
            (out of descriptors, say), rather than answer its path: what is installed
            cannot be told now (``_unread``).
        distribution: The distribution's normalised name, where it is not ``package``
            (``rpds_py`` for ``rpds``).
    """
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    if spec is None or spec.origin is None:
        return package + " missing"
    site = os.path.dirname(spec.origin)  # a module's folder; a package's parent folder
    if os.path.basename(spec.origin).startswith("__init__."):
        site = os.path.dirname(site)
    try:
        if site not in listings:
            listings[site] = os.listdir(site)
        found = sorted(
            name
            for name in listings[site]
            if name.startswith((distribution or package) + "-")
            and name.endswith((".dist-info", ".egg-info"))
        )
        if found:
            return " ".join(found)
        st = os.stat(spec.origin)
    except OSError as exc:
        if strict:
            _unread(exc)
        return spec.origin
    return f"{spec.origin} {st.st_size} {st.st_mtime_ns}"


#: What a file or folder that cannot be read now, but may be later, fails with: out of
#: descriptors, memory or processes' resources, or interrupted.
_TRANSIENT = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EAGAIN, errno.EINTR})


def _unread(exc: OSError) -> str:
    """What stands for a file or folder that could not be read: its error's name, the same
    each time (gone, or not to be read: the venv removed, a folder of another user's).

    Raises:
        OSError: ``exc``, when it is for want of a resource (``_TRANSIENT``): nothing can
            be told from it.
    """
    if exc.errno in _TRANSIENT:
        raise exc
    return errno.errorcode.get(exc.errno or 0, "unreadable")
