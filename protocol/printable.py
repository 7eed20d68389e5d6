"""Text a terminal shows but cannot act on (pure: ``re`` only).

``toolsetctl`` prints names, descriptions, paths and messages from tool sets nobody has to
have reviewed, and the daemon's console log (``--log-format console``) prints values a
client chose (request ids, workspace paths, tool names); both go through ``printable``.
"""

from __future__ import annotations

import re

__all__ = ["BIDI_AND_BREAKS", "escaped", "inert_json", "inert_line", "printable"]

# What a terminal would act on rather than show: the C0 controls (ESC starts CSI, OSC and
# DCS sequences: clear the screen, set the title, write the clipboard with OSC 52, hyperlinks
# with OSC 8; CR and BS overwrite what was printed), DEL, the C1 controls (U+009B is a CSI of
# its own for terminals that take 8-bit controls), the bidirectional overrides, embeddings
# and isolates (they reorder what is shown: "Trojan Source"), the line and paragraph
# separators, and lone surrogates (no character: they cannot even be encoded).
BIDI_AND_BREAKS = "\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff"
_UNSAFE = re.compile(f"[\x00-\x1f\x7f-\x9f{BIDI_AND_BREAKS}]")


def escaped(match: re.Match[str]) -> str:
    """The matched character as its Python escape (``\\x1b``, ``\\x9b``, ``\\u202e``, ``\\n``)."""
    return repr(match.group())[1:-1]


def printable(text: str) -> str:
    """``text`` as one line a terminal shows but cannot act on.

    Every control character, bidirectional control, line separator and lone surrogate is
    written as its Python escape (``\\x1b``, ``\\u202e``, ``\\n``); the rest is unchanged, so
    applying it twice is applying it once. A ``tools.json`` in a cloned repository, or a
    client's request id in the daemon's console log, must not be able to clear the screen,
    retitle the window, write the clipboard or forge lines of the output.
    """
    return _UNSAFE.sub(escaped, text)


# What a CI runner reads in a job's output as a command to itself rather than as output
# (stdout and stderr alike, line by line): GitHub Actions' workflow commands, ``::name::``
# at the start of a line after white space (``::add-mask::``, ``::set-output``,
# ``::stop-commands::``), and, anywhere in a line, its older ``##[name]`` form, Azure
# Pipelines' ``##vso[`` (``task.setvariable``, ``task.prependpath``) and TeamCity's
# ``##teamcity[``. Of each, the one ``#`` or ``:`` that makes it a command is escaped.
_BRACKET_COMMAND = re.compile(r"#(?=#[A-Za-z]{0,16}\[)")
_LEADING_COMMAND = re.compile(r"^(\s*):(?=:)")


def inert_line(line: str) -> str:
    """One line of ``printable`` text as a CI runner logs it and does not obey it.

    ``##[``, ``##vso[`` (and ``##<letters>[``) anywhere become ``\\x23#[``, ``\\x23#vso[``,
    and a ``::`` that starts the line (after white space) becomes ``\\x3a:``, in the
    escapes of ``printable``; the rest is unchanged, and applying it twice is applying it
    once. A ``tools.json`` in a pull request's checkout must not mask, set a step's
    output, or prepend to ``PATH`` through ``toolsetctl list`` or ``validate``.
    """
    line = _BRACKET_COMMAND.sub(r"\\x23", line)
    return _LEADING_COMMAND.sub(r"\1\\x3a", line, count=1) if "::" in line else line


def inert_json(text: str) -> str:
    """JSON text with no ``##[``-form command for a CI runner: ``#`` is only ever inside a
    string there, so each such ``#`` written ``\\u0023`` is the same value. (No line of
    JSON text starts with ``::``: each starts with a bracket, a quote, a digit or a letter.)
    """
    return _BRACKET_COMMAND.sub(r"\\u0023", text)
