"""JSON text for ``toolsetctl``'s output, every number as the daemon wrote it.

Theory of operation: the reader (``blocking.read_json``) keeps a number with a fraction or
an exponent as a ``WrittenNumber``, a float that carries its text (``offline`` reads files
into ``protocol.jsontext.JsonNumber``, the same idea). json's encoders write any float as
``float.__repr__``: right for ``0.5`` or ``-0.0``, wrong for ``1.50`` (``1.5``), ``1E+2``
(``100.0``), ``1e400`` (``Infinity``, which is no JSON) and an integer past Python's digit
limit (its text kept so by the reader; as a float it is ``Infinity`` too).

Compact output (``jsonl``, the ``Input schema`` field) is json's C encoder's: ``dumps``
first walks the value (one pass over the containers, nothing copied) for a number
whose text is not its ``float.__repr__``. Most documents have none and go to
``json.dumps`` as they are. A document that has one is copied (only the containers on the
way to such a number) with the number replaced by a marker string, a random token and an
index (``"t3f9c...-0"``); the copy goes to ``json.dumps`` all the same, and each quoted
marker in its text is replaced by the number's text. A string stands where the number
stands, so indentation and separators are what they would be. The token is unpredictable,
and the text is checked to hold it exactly once per marker (a string holding it would
count too); should it not, another token is drawn.

With ``indent`` (``--format json``) json takes its Python encoder whatever the value, so
``dumps`` takes it too, in one pass, with a float writer that writes the text: through
json's private ``_make_iterencode``, unchanged since Python 2.7. A Python without it
gets the walk and the markers, the same text.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator

TYPE_CHECKING = False  # not typing's: importing typing is a share of the start-up
if TYPE_CHECKING:
    from typing import Any

__all__ = ["dumps", "rewritten"]


def rewritten(number: float) -> str | None:
    """The text to print for ``number`` when json's ``float.__repr__`` would change it
    (``1.50``, ``1E+2``, ``1e400``), else None (a float without ``text``, or ``0.5``)."""
    text = getattr(number, "text", None)
    if isinstance(text, str) and text != float.__repr__(number):
        return text
    return None


def _needs_texts(value: Any) -> bool:
    """Whether some number in ``value`` prints otherwise than json would print it."""
    stack: list[Iterable[Any]] = [(value,)]
    pop, push = stack.pop, stack.append
    while stack:
        for item in pop():
            kind = type(item)  # by type first: the common leaves, then plain containers
            if kind is str or kind is int or kind is bool or item is None or kind is float:
                continue
            if kind is dict or isinstance(item, dict):
                push(item.values())
            elif kind is list or isinstance(item, list | tuple):
                push(item)
            elif isinstance(item, float) and rewritten(item) is not None:
                return True
    return False


def _marked(value: Any, mark: Callable[[str], str]) -> Any:
    """``value`` with each number ``rewritten`` says json would change replaced by
    ``mark(text)``: only the containers on the way to one are copied, the rest shared."""
    holder: list[Any] = [value]
    # Each container with its link: (the parent's link, its key there), None for holder.
    found: list[tuple[Any, Any, str]] = []
    stack: list[tuple[Any, Any]] = [(holder, None)]
    pop, push = stack.pop, stack.append
    while stack:
        container, link = pop()
        items = container.items() if isinstance(container, dict) else enumerate(container)
        for key, item in items:
            kind = type(item)
            if kind is str or kind is int or kind is bool or item is None or kind is float:
                continue
            if isinstance(item, dict | list | tuple):
                push((item, (link, key)))
            elif isinstance(item, float) and (text := rewritten(item)) is not None:
                found.append((link, key, text))
    copies = {id(holder)}
    for link, key, text in found:
        keys = [key]
        while link is not None:
            link, step = link
            keys.append(step)
        node: Any = holder
        for step in reversed(keys[1:]):
            child = node[step]
            if id(child) not in copies:  # the original: copy it, once on this path
                child = dict(child) if isinstance(child, dict) else list(child)
                copies.add(id(child))
                node[step] = child
            node = child
        node[key] = mark(text)
    return holder[0]


def _tokens() -> Iterator[str]:
    """Marker tokens nobody can predict: no string a daemon or a tool set sends holds one."""
    while True:
        yield "t" + os.urandom(12).hex()


def _encode_marked(value: Any, token: str, options: dict[str, Any]) -> str | None:
    """``json.dumps`` of ``value`` with each number ``rewritten`` would change as its text,
    through markers made of ``token``; None when the text holds ``token`` elsewhere too."""
    texts: list[str] = []

    def mark(text: str) -> str:
        texts.append(text)
        return f"{token}-{len(texts) - 1}"

    encoded = json.dumps(_marked(value, mark), ensure_ascii=False, **options)
    if encoded.count(token) != len(texts):  # a string holds the token: markers ambiguous
        return None
    head, *parts = encoded.split(f'"{token}-')
    out = [head]
    for part in parts:  # each begins with the marker's index and its closing quote
        index, _, rest = part.partition('"')
        out += (texts[int(index)], rest)
    return "".join(out)


def _dumps_marked(value: Any, tokens: Iterator[str], options: dict[str, Any]) -> str:
    """``_encode_marked`` with the first of ``tokens`` that no string of ``value`` holds."""
    for token in tokens:
        text = _encode_marked(value, token, options)
        if text is not None:
            return text
    raise AssertionError("the tokens ran out")  # _tokens never ends


class _IndentEncoder(json.JSONEncoder):
    """``json.JSONEncoder`` whose float writer writes a number as its text: json's own
    Python form (the one it takes for any value with ``indent``), its float writer ours."""

    def iterencode(self, o: Any, _one_shot: bool = False) -> Any:
        def floatstr(number: float) -> str:
            text = getattr(number, "text", None)  # a WrittenNumber, or jsontext's JsonNumber
            if isinstance(text, str):
                return text
            if number - number == 0:  # finite
                return float.__repr__(number)
            return "NaN" if number != number else "Infinity" if number > 0 else "-Infinity"

        encoder = (
            json.encoder.encode_basestring_ascii
            if self.ensure_ascii
            else json.encoder.encode_basestring
        )
        return json.encoder._make_iterencode(  # type: ignore[attr-defined]  # private, stable
            {} if self.check_circular else None,
            self.default,
            encoder,
            self.indent,
            floatstr,
            self.key_separator,
            self.item_separator,
            self.sort_keys,
            self.skipkeys,
            _one_shot,
        )(o, 0)


def dumps(value: Any, **options: Any) -> str:
    """``json.dumps(value, ensure_ascii=False, **options)``, every number the daemon sent
    as it wrote it (``1.50``, ``1e4``, ``1e2000000``: ``blocking.WrittenNumber``), as the
    daemon echoes arguments: bounded by what the caller wrote, and the same value.

    Args:
        value: The JSON value (dicts, lists, tuples, strings, numbers, booleans, None).
        **options: ``json.dumps`` options (``indent``, ``separators``).

    Returns:
        The JSON text.
    """
    if options.get("indent") is not None and hasattr(json.encoder, "_make_iterencode"):
        # json takes its Python encoder for this anyway: one pass, with our float writer,
        # costs what json.dumps does (a walk first added about a sixth, measured).
        return json.dumps(value, ensure_ascii=False, cls=_IndentEncoder, **options)
    if not _needs_texts(value):
        return json.dumps(value, ensure_ascii=False, **options)
    return _dumps_marked(value, _tokens(), options)
