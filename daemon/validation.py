"""JSON Schema work for the catalog: checking tool schemas and validating call arguments.

Theory of operation: every exec tool declares an input JSON Schema. Two costs matter.

* ``check_schema`` (is the schema itself valid?) costs about 0.8 ms per Draft 2020-12
  schema, so a catalog of 1,000 sets would spend most of its load time on it.
  ``SchemaChecker`` caches each verdict by the SHA-256 of the schema's canonical JSON,
  so a reload of unchanged sets (or many sets sharing one schema) checks nothing again.
* Validating arguments needs a compiled validator. ``ArgumentValidators`` builds one per
  tool hash (the hash covers the schema) and keeps it until the cache is full.

Both caches are instances holding a dict and a lock; there is no module-level mutable
state, so the composition root decides their lifetime and tests get fresh ones.

The schema dialect is chosen by ``$schema`` and defaults to Draft 2020-12 (also for an
unknown ``$schema``). References resolve only against the bundled meta-schemas: nothing
is fetched from the network, so a remote ``$ref`` is reported as an argument error
rather than becoming a request the daemon makes on a tool author's behalf.

Why one module of this size: the plain fast path and the jsonschema fallback must agree
to the letter (hypothesis tests compare them); side by side, one reading shows both,
with the messages they share.
"""

from __future__ import annotations

import decimal
import functools
import hashlib
import itertools
import json
import re
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import orjson
import structlog
from toolsetd.protocol.errors import InternalError
from toolsetd.protocol.jsontext import JsonNumber, nesting_exceeds, strict_dumps
from toolsetd.protocol.jsontext import dumps as json_dumps
from toolsetd.protocol.params import MAX_ARGUMENT_DEPTH

from .install import UPGRADED, libraries_id
from .timelimit import TimeLimitExceeded, run_limited

if TYPE_CHECKING:
    from jsonschema.exceptions import ValidationError
    from jsonschema.protocols import Validator

    from .model import LoadedTool

# jsonschema (with referencing and the bundled meta-schemas) costs ~100 ms to import and
# is needed only for a schema the fast path cannot decide, or the first argument check of
# a call: it is imported on first use, never at start-up.

__all__ = [
    "TIME_LIMIT",
    "TIME_LIMIT_PER_MIB",
    "ArgumentValidators",
    "JsonschemaChanged",
    "SchemaChecker",
    "canonical_json",
    "dialect",
    "json_pointer",
    "off_loop",
    "stopped_message",
    "time_limit_for",
]

log = structlog.get_logger("toolsetd.validation")

#: Longest echo of a value (argument or enum) inside a message, in characters.
_ECHO_LIMIT = 80
#: Longest jsonschema message kept in a schema-check note, in characters.
_SCHEMA_MESSAGE_LIMIT = 300
#: Most argument errors reported for one call.
_MAX_ERRORS = 100
#: Schema verdicts ``SchemaChecker`` keeps (~100 bytes each): every distinct schema of a
#: catalog of tens of thousands of tools, and not every schema a long-lived daemon has
#: seen (each edit of one is a new content hash).
_MAX_VERDICTS = 65_536
#: The most seconds jsonschema may spend on one call's arguments: this, plus
#: ``TIME_LIMIT_PER_MIB`` for each MiB of them. Python's ``re`` backtracks: a ``pattern``
#: like ``^(a+)+$`` would otherwise hold the event loop for as long as a model's value
#: makes it (``uniqueItems`` is linear here, ``_unique_items``, but ``not``/``anyOf``
#: over many items are not cheap either). A real
#: schema's check of small arguments takes well under a millisecond, and jsonschema checks
#: ~4 MiB a second of a plain array of objects against ``$ref``/``anyOf`` schemas here
#: (2,000 items, 424 KB, in ~0.1 s): the allowance per MiB is four times that.
TIME_LIMIT = 0.1
TIME_LIMIT_PER_MIB = 1.0
#: Arguments of more values than this (members and items, on all levels), or of more
#: characters of strings (keys included), are checked in the check process
#: (``checkworker``, ``off_loop``): on the loop such a check takes a few milliseconds at
#: most, about what handing it over costs, unless a ``pattern`` backtracks, which the
#: alarm stops at ``TIME_LIMIT`` and a little.
_LOOP_VALUES = 4096
_LOOP_CHARS = 64 * 1024


def canonical_json(value: Any) -> bytes:
    """Serialise a JSON value canonically: sorted keys, no spaces, UTF-8, non-ASCII kept.

    Args:
        value: A JSON-compatible value with finite numbers only: orjson writes an infinite
            float as ``null``, so ``1e400`` and ``null`` would share a key (the manifest
            parser refuses a number a double cannot hold, so none reaches here).

    Returns:
        The UTF-8 bytes (lone surrogates from ``\\ud800`` escapes pass through).
    """
    try:
        # orjson writes the same compact, sorted, UTF-8 form about ten times faster.
        return strict_dumps(value, orjson.OPT_SORT_KEYS)
    except TypeError:
        # Lone surrogates (from \ud800 escapes) and integers beyond 64 bits.
        text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        return text.encode("utf-8", "surrogatepass")


def json_pointer(parts: Iterable[str | int]) -> str:
    """Build an RFC 6901 JSON Pointer (``""`` is the root; ``~`` and ``/`` escaped).

    Args:
        parts: Object keys and array indices from the root down.

    Returns:
        The pointer text.
    """
    return "".join("/" + str(part).replace("~", "~0").replace("/", "~1") for part in parts)


def _validator_class(schema: Mapping[str, Any]) -> type[Validator]:
    """Pick the validator class for ``schema``'s ``$schema`` (Draft 2020-12 by default)."""
    _patch_keywords()
    from jsonschema import Draft202012Validator
    from jsonschema.validators import validator_for

    declared = schema.get("$schema")
    if not isinstance(declared, str):
        # A non-string $schema is reported by check_schema; validator_for would crash on a
        # list or an object (unhashable).
        return Draft202012Validator
    # One that is no URI (an unclosed "[") is a draft's of none (``_lenient_normalize``).
    cls: type[Validator] = validator_for(schema, default=Draft202012Validator)
    return cls


#: The drafts by their meta-schema's URI as jsonschema keys it (``validator_for``: its
#: ``URIDict`` reads a ``$schema`` through ``urlsplit(...).geturl()``).
_DRAFTS = {
    "http://json-schema.org/draft-03/schema": 3,
    "http://json-schema.org/draft-04/schema": 4,
    "http://json-schema.org/draft-06/schema": 6,
    "http://json-schema.org/draft-07/schema": 7,
    "https://json-schema.org/draft/2019-09/schema": 2019,
}


def dialect(schema: Mapping[str, Any]) -> int:
    """The JSON Schema draft that checks ``schema`` (``_validator_class``: its ``$schema``;
    2020-12 by default): 3, 4, 6, 7, 2019 (2019-09) or 2020 (2020-12).

    Without jsonschema: a manifest's parse asks it for the MCP listing before the schema's
    check, which imports jsonschema only while it is the daemon's (``_OwnJsonschema``).
    """
    declared = schema.get("$schema")
    if not isinstance(declared, str):
        return 2020
    from urllib.parse import urlsplit  # loaded at start already (the socket path's)

    try:
        return _DRAFTS.get(urlsplit(declared).geturl(), 2020)
    except ValueError:  # no URI (an unclosed "[" for IPv6): jsonschema has no draft of it
        return 2020


def _additional_properties_in_order(
    validator: Any, aP: Any, instance: Any, schema: Mapping[str, Any]
) -> Iterable[ValidationError]:
    """jsonschema's ``additionalProperties``, walking the members it checks against a
    schema in the instance's own order.

    jsonschema walks them through a set, whose order follows the string hash seed: under
    the meta-schema that is every member of a tool schema's ``properties``, so the first
    problem it yields (``SchemaChecker.problem``) was another one in another process, and a
    stored verdict named another problem than a fresh check.
    """
    from jsonschema import _keywords, _utils

    if validator.is_type(aP, "object") and validator.is_type(instance, "object"):
        for extra in dict.fromkeys(_utils.find_additional_properties(instance, schema)):
            yield from validator.descend(instance[extra], aP, path=extra)
        return
    original: Any = _keywords.additionalProperties  # typed as returning None: a generator
    yield from original(validator, aP, instance, schema)


#: Significant digits a number may have for ``multipleOf`` to be decided exactly (in
#: integers); beyond, jsonschema decides.
_MULTIPLE_OF_DIGITS = 1000


def _additional_items(
    validator: Any, aI: Any, instance: Any, schema: Mapping[str, Any]
) -> Iterable[ValidationError]:
    """jsonschema's ``additionalItems`` (drafts 3 to 2019-09), passed by beside a boolean
    ``items``, as beside any other schema there (drafts 6 to 2019-09 take ``true`` and
    ``false`` as schemas): it took the length of the boolean and raised ``TypeError``, so
    every call with an array there failed as an internal error."""
    from jsonschema import _legacy_keywords

    if isinstance(schema.get("items"), bool):
        return
    original: Any = _legacy_keywords.additionalItems  # typed as returning None: a generator
    yield from original(validator, aI, instance, schema)


def _lenient_normalize(normalize: Callable[[str], str]) -> Callable[[str], str]:
    """jsonschema's ``URIDict.normalize`` of the drafts by ``$schema`` (``urlsplit``), which
    raised ``ValueError`` on a ``$schema`` that is no URI (an unclosed "[": "Invalid IPv6
    URL"): ``validator_for`` asks it at the root and at every subschema that has one. Such
    a ``$schema`` is now kept as written, a draft's of none, as any other unknown one: the
    root is checked as 2020-12, a subschema by its parent's draft."""

    def lenient(uri: str) -> str:
        try:
            return normalize(uri)
        except ValueError:
            return uri

    return lenient


def _no_uri(exc: BaseException) -> bool:
    """Whether ``exc`` is a ``ValueError`` raised as ``urllib.parse`` split a text that is
    no URI, which referencing meets as it reads a ``$ref`` (``urljoin``, ``urldefrag``).
    Raised within it or below it: an unclosed "[" is ``urllib.parse``'s own error, and a
    bracketed host that is no address (``http://[::1x]/``) is ``ipaddress``'s, which
    ``urlsplit`` calls (only the last frame was looked at, and that one was still an
    internal error for every call)."""
    if not isinstance(exc, ValueError):
        return False
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_globals.get("__name__") == "urllib.parse":
            return True
        tb = tb.tb_next
    return False


def _evaluated_item_indexes(original: Any) -> Any:
    """jsonschema's ``find_evaluated_item_indexes_by_schema`` (2019-09's
    ``unevaluatedItems``), which took the length of a boolean ``items`` (``TypeError``,
    an internal error for every call with an array there): such an ``items`` is a schema
    of every item, so every item was evaluated."""

    def indexes(validator: Any, instance: Any, schema: Any) -> list[int]:
        if isinstance(schema, Mapping) and isinstance(schema.get("items"), bool):
            return list(range(len(instance)))
        found: list[int] = original(validator, instance, schema)
        return found

    return indexes


#: The 2019-09 keywords whose subschema evaluates every member it is applied to (the
#: annotation ``unevaluatedProperties`` reads), when it passes.
_APPLIED_TO_MEMBERS = ("additionalProperties", "unevaluatedProperties")


def _evaluated_property_keys(original: Any) -> Any:
    """jsonschema's ``find_evaluated_property_keys_by_schema`` of 2019-09 (its
    ``unevaluatedProperties``), with an ``additionalProperties`` or ``unevaluatedProperties``
    whose value is a schema evaluating each member that passes it, as 2019-09 says (Core
    9.3.2.3, 9.3.2.4) and as jsonschema's own 2020-12 finds (python-jsonschema/jsonschema
    pull 1351 mended that one only). It took such a schema for a ``properties`` map: a member
    named like one of its keywords (``"type"``) was evaluated, whatever its value, and any
    other was not, so ``"additionalProperties": {"type": "string"}`` beside
    ``"unevaluatedProperties": false`` refused every member it took, and
    ``"unevaluatedProperties": {"type": "string"}`` took ``{"type": 5}``. The MCP listing,
    2020-12, said otherwise."""

    def keys(validator: Any, instance: Any, schema: Any) -> list[str]:
        if not isinstance(schema, Mapping) or not any(
            isinstance(schema.get(k), Mapping) for k in _APPLIED_TO_MEMBERS
        ):
            found: list[str] = original(validator, instance, schema)
            return found
        applied = [schema[k] for k in _APPLIED_TO_MEMBERS if isinstance(schema.get(k), Mapping)]
        rest = {
            k: v
            for k, v in schema.items()
            if not isinstance(v, Mapping) or k not in _APPLIED_TO_MEMBERS
        }
        found = original(validator, instance, rest)
        for sub in applied:
            found += [
                key
                for key, value in instance.items()
                if next(iter(validator.descend(value, sub)), None) is None
            ]
        return found

    return keys


def _decimal(number: float) -> decimal.Decimal:
    """A JSON number as the decimal it was written as (a ``JsonNumber``'s own text; a plain
    float's shortest text, which is what a manifest or a client wrote for it)."""
    if isinstance(number, float):
        text = number.text if type(number) is JsonNumber else repr(number)
        try:
            return decimal.Decimal(text)
        except decimal.InvalidOperation:
            return _clamped(text)
    return decimal.Decimal(number)


def _clamped(text: str) -> decimal.Decimal:
    """A JSON number whose exponent is beyond a Decimal's (more than 18 digits, such as
    ``1e9999999999999999999``; valid JSON, kept as written): its sign and digits, with the
    exponent brought to the largest (or smallest) a Decimal takes. It stays on the same
    side of every number a schema holds (a double), and integral or not as written; two
    such numbers that differ only in their exponents compare equal."""
    mantissa, _, exponent = text.lower().partition("e")
    negative = mantissa.startswith("-")
    whole, _, fraction = mantissa.lstrip("-").partition(".")
    digits = (whole + fraction).lstrip("0")
    if not digits:
        return decimal.Decimal("-0" if negative else "0")
    # Nearer zero than any double, and not integral; or past any double, and integral.
    tiny = exponent.startswith("-")
    scale = decimal.MIN_ETINY if tiny else decimal.MAX_EMAX - (len(digits) - 1)
    return decimal.Decimal(f"{'-' if negative else ''}{digits}E{scale}")


def _compare(number: float, bound: float) -> int:
    """-1, 0 or 1 as ``number`` is below, at or above ``bound``, by the numbers as written.

    A ``JsonNumber`` reads as the nearest double (``1e-400`` as 0.0, ``1.0000000000000000001``
    as 1.0), so comparing doubles refused ``1e-400`` under ``exclusiveMinimum: 0`` and let
    ``1.0000000000000000001`` pass ``maximum: 1``. Decimal comparison is exact, whatever
    the precision; two integers compare as they are.
    """
    if type(number) is int and type(bound) is int:
        return (number > bound) - (number < bound)
    a, b = _decimal(number), _decimal(bound)
    return (a > b) - (a < b)


def _integral(number: float) -> bool:
    """Whether a float has no fractional part as written (``1e400`` has none; it reads as
    infinity; ``1.0000000000000000001`` has one, though it reads as 1.0)."""
    if type(number) is not JsonNumber:
        return number.is_integer()
    exact = _decimal(number)
    # Exact whatever the digits (no context precision applies), and fast on millions of them.
    return exact.is_finite() and exact == exact.to_integral_value()


def _is_integer_type(_checker: Any, instance: Any) -> bool:
    """jsonschema's ``integer`` type (Draft 6 and later) for the numbers as written."""
    if isinstance(instance, bool):
        return False
    return isinstance(instance, int) or (isinstance(instance, float) and _integral(instance))


def _equal(one: Any, two: Any) -> bool:
    """JSON equality (jsonschema's ``equal``) with numbers compared as written
    (``_compare``): ``1`` and ``1.0`` are equal, ``1`` and ``1.0000000000000000001`` are not,
    and ``true`` is not ``1``."""
    if one is two:
        return True
    if isinstance(one, str) or isinstance(two, str):
        return bool(one == two)
    if isinstance(one, list | tuple) and isinstance(two, list | tuple):
        return len(one) == len(two) and all(_equal(a, b) for a, b in zip(one, two, strict=True))
    if isinstance(one, Mapping) and isinstance(two, Mapping):
        return len(one) == len(two) and all(k in two and _equal(v, two[k]) for k, v in one.items())
    if isinstance(one, bool) or isinstance(two, bool):
        return False  # two different booleans, or a boolean and a number
    if isinstance(one, int | float) and isinstance(two, int | float):
        return _compare(one, two) == 0
    return bool(one == two)


def _identity(value: Any) -> Any:
    """A hashable key equal for two values exactly when ``_equal`` holds."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return (type(value).__name__, value)
    if isinstance(value, int | float):
        return _decimal(value)  # equal values hash alike (Decimal's hash is its value's)
    if isinstance(value, list | tuple):
        return ("array", tuple(_identity(item) for item in value))
    if isinstance(value, Mapping):
        return ("object", frozenset((key, _identity(item)) for key, item in value.items()))
    return ("other", repr(value))  # pragma: no cover - arguments come from JSON


def _enum(
    validator: Any, enums: Any, instance: Any, schema: Mapping[str, Any]
) -> Iterable[ValidationError]:
    """jsonschema's ``enum`` with ``_equal``."""
    from jsonschema.exceptions import ValidationError

    if all(not _equal(each, instance) for each in enums):
        yield ValidationError(f"{instance!r} is not one of {enums!r}")


def _const(
    validator: Any, const: Any, instance: Any, schema: Mapping[str, Any]
) -> Iterable[ValidationError]:
    """jsonschema's ``const`` with ``_equal``."""
    from jsonschema.exceptions import ValidationError

    if not _equal(instance, const):
        yield ValidationError(f"{const!r} was expected")


def _unique_items(
    validator: Any, unique: Any, instance: Any, schema: Mapping[str, Any]
) -> Iterable[ValidationError]:
    """jsonschema's ``uniqueItems`` with ``_equal``, in one pass over hashable keys."""
    from jsonschema.exceptions import ValidationError

    if (
        unique
        and validator.is_type(instance, "array")
        and len({_identity(item) for item in instance}) != len(instance)
    ):
        yield ValidationError(f"{instance!r} has non-unique elements")


#: What each bound keyword lets pass, as a test of ``_compare(value, bound)``: for the
#: jsonschema keywords (``_bound``) and the fast check (``_satisfies``) alike.
_BOUND_HOLDS: Mapping[str, Callable[[int], bool]] = {
    "minimum": lambda c: c >= 0,
    "maximum": lambda c: c <= 0,
    "exclusiveMinimum": lambda c: c > 0,
    "exclusiveMaximum": lambda c: c < 0,
}


def _bound(
    keyword: str, words: str, which: str
) -> Callable[[Any, Any, Any, Mapping[str, Any]], Iterable[ValidationError]]:
    """A ``minimum``-like keyword deciding on the numbers as written (``_compare``)."""
    holds = _BOUND_HOLDS[keyword]

    def check(
        validator: Any, bound: Any, instance: Any, schema: Mapping[str, Any]
    ) -> Iterable[ValidationError]:
        from jsonschema.exceptions import ValidationError

        if validator.is_type(instance, "number") and not holds(_compare(instance, bound)):
            yield ValidationError(f"{instance!r} is {words} the {which} of {bound!r}")

    return check


def _legacy_bound(
    sign: int, which: str
) -> Callable[[Any, Any, Any, Mapping[str, Any]], Iterable[ValidationError]]:
    """Draft 3 and 4's ``minimum`` (``sign`` -1) or ``maximum`` (1), whose boolean
    ``exclusiveMinimum``/``exclusiveMaximum`` sits beside it, on the numbers as written."""
    exclusive = "exclusiveMinimum" if sign < 0 else "exclusiveMaximum"
    beyond = "less than" if sign < 0 else "greater than"

    def check(
        validator: Any, bound: Any, instance: Any, schema: Mapping[str, Any]
    ) -> Iterable[ValidationError]:
        from jsonschema.exceptions import ValidationError

        if not validator.is_type(instance, "number"):
            return
        side = _compare(instance, bound) * sign
        if schema.get(exclusive, False):
            if side >= 0:
                yield ValidationError(
                    f"{instance!r} is {beyond} or equal to the {which} of {bound!r}"
                )
        elif side > 0:
            yield ValidationError(f"{instance!r} is {beyond} the {which} of {bound!r}")

    return check


def _multiple(number: float, step: float) -> bool | None:
    """Whether ``number`` is an integer multiple of ``step``, exactly, by the numbers as
    written (None: too many digits, or not finite, to decide here).

    With ``number`` = m·10^e and ``step`` = n·10^f (m, n integers): when e >= f, the
    quotient is an integer when n divides m·10^(e-f), which ``pow`` reduces modulo n
    whatever the exponent; when e < f, when n·10^(f-e) divides m, which a nonzero m of
    fewer than f-e digits cannot be.
    """
    a, b = _decimal(number), _decimal(step)
    if not (a.is_finite() and b.is_finite()) or b.is_zero():
        return None
    if a.is_zero():
        return True
    # The digit count before building the tuple: a 16 MiB number is not expanded.
    if (type(number) is JsonNumber and len(number.text) > 2 * _MULTIPLE_OF_DIGITS) or (
        type(step) is JsonNumber and len(step.text) > 2 * _MULTIPLE_OF_DIGITS
    ):
        return None
    _, a_digits, a_exponent = a.as_tuple()
    _, b_digits, b_exponent = b.as_tuple()
    if len(a_digits) > _MULTIPLE_OF_DIGITS or len(b_digits) > _MULTIPLE_OF_DIGITS:
        return None
    assert isinstance(a_exponent, int)  # finite
    assert isinstance(b_exponent, int)
    m = int("".join(map(str, a_digits)))
    n = int("".join(map(str, b_digits)))
    if a_exponent >= b_exponent:
        return m * pow(10, a_exponent - b_exponent, n) % n == 0
    shift = b_exponent - a_exponent
    return shift < len(a_digits) and m % (n * 10**shift) == 0


def _multiple_of_exactly(
    validator: Any, dB: Any, instance: Any, schema: Mapping[str, Any]
) -> Iterable[ValidationError]:
    """jsonschema's ``multipleOf``, decided in decimal when a float is involved.

    jsonschema divides binary floats, so ``19.99`` is no multiple of ``0.01`` there
    (``1998.9999999999998``), and ``1e400`` (infinity as a double) no multiple of 2. JSON
    numbers are decimal, and the codec keeps their text: ``_multiple`` decides on the
    numbers as written, in integers. A number of more than ``_MULTIPLE_OF_DIGITS``
    significant digits is left to jsonschema (which refuses what it cannot divide: see
    ``errors_for``).
    """
    from jsonschema import _keywords
    from jsonschema.exceptions import ValidationError

    exact = None
    if (
        validator.is_type(instance, "number")
        and isinstance(dB, int | float)
        and (isinstance(dB, float) or isinstance(instance, float))
    ):
        exact = _multiple(instance, dB)
    if exact is None:
        original: Any = _keywords.multipleOf  # typed as returning None: a generator
        yield from original(validator, dB, instance, schema)
    elif not exact:
        yield ValidationError(f"{instance!r} is not a multiple of {dB}")


@functools.cache
def _patch_keywords() -> None:
    """Replace jsonschema keywords, and Draft 6+'s ``integer`` type, in every draft's
    validator class of this process (once, before the first validator is made):

    * a ``$schema`` that is no URI is a draft's of none (``_lenient_normalize``): jsonschema
      raised ``ValueError`` on it;
    * ``additionalItems`` is passed by beside a boolean ``items`` (``_additional_items``),
      and 2019-09's ``unevaluatedItems`` takes one as evaluating every item
      (``_evaluated_item_indexes``): both raised ``TypeError`` on it;
    * 2019-09's ``unevaluatedProperties`` takes each member that passes a schema-valued
      ``additionalProperties`` or ``unevaluatedProperties`` as evaluated, and no other
      (``_evaluated_property_keys``);
    * ``additionalProperties`` walks members in the instance's order
      (``_additional_properties_in_order``). A set's order follows the string hash seed,
      so without it the first problem found in a schema (``SchemaChecker.problem``), or in
      a call's arguments, was another one in another process, and a stored verdict named
      another problem than a fresh check;
    * ``multipleOf`` (and draft 3's ``divisibleBy``) is exact for decimal numbers
      (``_multiple_of_exactly``);
    * the bounds (``_bound``, and draft 3 and 4's ``_legacy_bound``), ``integer``
      (``_is_integer_type``), ``enum``, ``const`` and ``uniqueItems`` (``_equal``) decide on
      the numbers as written, not on the doubles they read as.

    A validator class made with ``jsonschema.validators.extend`` would not do: the
    meta-schema's parts declare their ``$schema``, and jsonschema checks each part with the
    class registered for it.
    """
    from jsonschema import _keywords, _legacy_keywords, _types, validators

    replacements: list[tuple[str, Any, Any]] = [
        ("additionalProperties", _keywords.additionalProperties, _additional_properties_in_order),
        ("multipleOf", _keywords.multipleOf, _multiple_of_exactly),
        ("divisibleBy", _keywords.multipleOf, _multiple_of_exactly),
        ("minimum", _keywords.minimum, _bound("minimum", "less than", "minimum")),
        ("maximum", _keywords.maximum, _bound("maximum", "greater than", "maximum")),
        (
            "exclusiveMinimum",
            _keywords.exclusiveMinimum,
            _bound("exclusiveMinimum", "less than or equal to", "minimum"),
        ),
        (
            "exclusiveMaximum",
            _keywords.exclusiveMaximum,
            _bound("exclusiveMaximum", "greater than or equal to", "maximum"),
        ),
        ("enum", _keywords.enum, _enum),
        ("const", _keywords.const, _const),
        ("uniqueItems", _keywords.uniqueItems, _unique_items),
        ("additionalItems", _legacy_keywords.additionalItems, _additional_items),
        ("minimum", _legacy_keywords.minimum_draft3_draft4, _legacy_bound(-1, "minimum")),
        ("maximum", _legacy_keywords.maximum_draft3_draft4, _legacy_bound(1, "maximum")),
    ]
    drafts: Any = validators._META_SCHEMAS  # type: ignore[attr-defined]  # a URIDict
    drafts.normalize = _lenient_normalize(drafts.normalize)
    # Called by name from 2019-09's ``unevaluatedItems``, and by itself as it recurses.
    _legacy_keywords.find_evaluated_item_indexes_by_schema = _evaluated_item_indexes(
        _legacy_keywords.find_evaluated_item_indexes_by_schema
    )
    # Called by name from 2019-09's ``unevaluatedProperties``, and by itself as it recurses.
    _legacy_keywords.find_evaluated_property_keys_by_schema = _evaluated_property_keys(
        _legacy_keywords.find_evaluated_property_keys_by_schema
    )
    for cls in (
        validators.Draft3Validator,
        validators.Draft4Validator,
        validators.Draft6Validator,
        validators.Draft7Validator,
        validators.Draft201909Validator,
        validators.Draft202012Validator,
    ):
        for keyword, original, replacement in replacements:
            if cls.VALIDATORS.get(keyword) is original:
                cls.VALIDATORS[keyword] = replacement
        # Draft 6 and later count a number with no fractional part as an integer; Draft 3
        # and 4 count integer literals only (and keep their own checker).
        if cls.TYPE_CHECKER is _types.draft6_type_checker:
            checker: Any = cls
            checker.TYPE_CHECKER = _types.draft6_type_checker.redefine("integer", _is_integer_type)


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _echo(value: Any) -> str:
    """Render a value as short JSON for a message, never verbatim when huge (every number
    as written, inside arrays and objects too: the checks decide on that, not on the
    double it reads as). Rendering stops once the message has what it shows."""
    text = ""
    for piece in _json_pieces(value):
        text += piece
        if len(text) > _ECHO_LIMIT:
            break
    return _clip(text, _ECHO_LIMIT)


def _json_pieces(value: Any) -> Iterable[str]:
    """``json.dumps(value, ensure_ascii=False)`` in pieces, a ``JsonNumber`` as its text."""
    if type(value) is JsonNumber:
        yield value.text
    elif isinstance(value, dict):
        yield "{"
        for index, (key, item) in enumerate(value.items()):
            yield ", " if index else ""
            yield _json_leaf(key)
            yield ": "
            yield from _json_pieces(item)
        yield "}"
    elif isinstance(value, list):
        yield "["
        for index, item in enumerate(value):
            yield ", " if index else ""
            yield from _json_pieces(item)
        yield "]"
    else:
        yield _json_leaf(value)


def _json_leaf(value: Any) -> str:
    if isinstance(value, str) and len(value) > _ECHO_LIMIT:
        value = value[: _ECHO_LIMIT + 1]  # all a message shows of it, however long
    try:
        return json.dumps(value, ensure_ascii=False, default=str)
    except (TypeError, ValueError):  # pragma: no cover - arguments come from JSON
        return repr(value)


def _name(name: Any) -> str:
    """Quote a property name for a message, as jsonschema and the examples do."""
    return "'" + _clip(str(name), _ECHO_LIMIT) + "'"


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__  # pragma: no cover - arguments come from JSON


# -- the fast path of check_schema ------------------------------------------------------
#
# Validating a schema against the Draft 2020-12 meta-schema costs ~0.85 ms (the
# meta-schema's $dynamicRef resolution dominates), which is most of a cold load of many
# sets. Most tool schemas use a handful of keywords whose meta-schema rules are simple,
# so _plainly_valid decides those exactly: True means the meta-schema accepts the schema.
# Anything else (another keyword, $schema, $ref, pattern, a float where an integer is
# due) returns False and goes to jsonschema, which also words every error we show.

_JSON_TYPES = frozenset({"array", "boolean", "integer", "null", "number", "object", "string"})
_TEXT_KEYWORDS = frozenset({"title", "description", "$comment", "format"})
_ANY_KEYWORDS = frozenset({"default", "const"})
_BOOL_KEYWORDS = frozenset({"deprecated", "readOnly", "writeOnly", "uniqueItems"})
_COUNT_KEYWORDS = frozenset(
    {
        "minLength",
        "maxLength",
        "minItems",
        "maxItems",
        "minProperties",
        "maxProperties",
    }
)
_NUMBER_KEYWORDS = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"})
_SUBSCHEMA_KEYWORDS = frozenset({"additionalProperties", "items", "not", "propertyNames"})
_SCHEMA_LIST_KEYWORDS = frozenset({"anyOf", "oneOf", "allOf"})
_FAST_PATH_DEPTH = 32


def _plainly_valid(schema: Any, depth: int = 0) -> bool:
    """Whether ``schema`` is certainly a valid Draft 2020-12 schema (False: ask jsonschema)."""
    if isinstance(schema, bool):
        return True
    if not isinstance(schema, dict) or depth > _FAST_PATH_DEPTH:
        return False
    for key, value in schema.items():
        if key in _TEXT_KEYWORDS:
            ok = isinstance(value, str)
        elif key in _ANY_KEYWORDS:
            ok = True
        elif key in _BOOL_KEYWORDS:
            ok = isinstance(value, bool)
        elif key in _COUNT_KEYWORDS:
            ok = type(value) is int and value >= 0
        elif key in _NUMBER_KEYWORDS:
            ok = type(value) in (int, float)
        elif key == "multipleOf":
            ok = type(value) in (int, float) and value > 0
        elif key == "type":
            ok = (isinstance(value, str) and value in _JSON_TYPES) or (
                isinstance(value, list)
                and len(value) > 0
                and all(isinstance(t, str) and t in _JSON_TYPES for t in value)
                and len(set(value)) == len(value)
            )
        elif key in ("enum", "examples"):
            ok = isinstance(value, list)
        elif key == "required":
            ok = (
                isinstance(value, list)
                and all(isinstance(name, str) for name in value)
                and len(set(value)) == len(value)
            )
        elif key == "properties":
            ok = isinstance(value, dict) and all(
                _plainly_valid(sub, depth + 1) for sub in value.values()
            )
        elif key in _SUBSCHEMA_KEYWORDS:
            ok = _plainly_valid(value, depth + 1)
        elif key in _SCHEMA_LIST_KEYWORDS:
            ok = (
                isinstance(value, list)
                and len(value) > 0
                and all(_plainly_valid(sub, depth + 1) for sub in value)
            )
        else:
            ok = False
        if not ok:
            return False
    return True


class JsonschemaChanged(InternalError):
    """jsonschema is still to be imported, and other versions of it (or of its companions)
    are installed than at the daemon's start: toolsetd was upgraded, or removed, under it
    (``_OwnJsonschema``). A call gets it as is; a set's parse, as a note (not cached)."""

    MESSAGE = (
        "toolsetd was upgraded (or removed) under this daemon, which loads jsonschema at its "
        "first check of a schema: restart it"
    )


class _OwnJsonschema:
    """Before jsonschema's first import in a daemon started warm (its set cache made the
    start parse nothing, so it imported none): whether what is installed now is what it
    started with (``install.libraries_id``). Another jsonschema checked with its own
    rules, and the keywords ``_patch_keywords`` replaces are its private names; a removed
    one raised ``ImportError``, an internal error at every call and reload. What cannot be
    read now (out of descriptors, say) is not judged.

    Looked at again at each check until jsonschema is imported (~0.6 ms, only while it is
    still to be, and so only while the libraries differ after the first look): a reinstall
    of the same versions (their files gone a moment) is refused only for that moment.
    """

    def __init__(self, libraries: str | None) -> None:
        """``libraries``: ``install.libraries_id()`` at the daemon's start; None: not
        looked at."""
        self._libraries = libraries
        self._said = False

    def check(self) -> None:
        """Raises:
        JsonschemaChanged: Other versions are installed now (said once).
        """
        if self._libraries is None or "jsonschema" in sys.modules:
            return
        try:
            same = libraries_id() == self._libraries
        except OSError:
            return
        if same:
            return
        if not self._said:
            self._said = True
            log.warning("schema_code_upgraded", error=UPGRADED)
        raise JsonschemaChanged


class SchemaChecker:
    """Checks tool input schemas against their meta-schema, caching by content hash.

    At most ``max_verdicts`` verdicts are kept; past that the oldest quarter is forgotten
    (a schema still in use is checked again at the next build that meets it).

    Attributes:
        checks: How many schemas were actually checked (cache misses).
    """

    def __init__(self, max_verdicts: int = _MAX_VERDICTS, libraries: str | None = None) -> None:
        """Create an empty cache.

        ``libraries``: the daemon's ``install.libraries_id()`` at its start, as for
        ``ArgumentValidators``: jsonschema is imported only while those are installed.
        """
        self._own_jsonschema = _OwnJsonschema(libraries)
        self._verdicts: dict[bytes, str | None] = {}
        self._max_verdicts = max_verdicts
        self._lock = threading.Lock()
        self.checks = 0

    def problem(self, schema: Mapping[str, Any]) -> str | None:
        """Return why ``schema`` is not a valid JSON Schema, or None when it is.

        Args:
            schema: The tool's ``schema`` object.

        Returns:
            None, or ``"<jsonschema message> (at <JSON Pointer into the schema>)"``.

        Raises:
            JsonschemaChanged: The check needs jsonschema, which is still to be imported,
                and toolsetd was upgraded under the daemon (``_OwnJsonschema``).
        """
        key = hashlib.sha256(canonical_json(schema)).digest()
        with self._lock:
            if key in self._verdicts:
                return self._verdicts[key]
        if "jsonschema" not in sys.modules and not _plainly_valid(schema):
            self._own_jsonschema.check()
        verdict = self._check(schema)
        with self._lock:
            self.checks += 1
            verdicts = self._verdicts
            if len(verdicts) >= self._max_verdicts:
                for old in list(itertools.islice(verdicts, max(1, len(verdicts) // 4))):
                    del verdicts[old]
            verdicts[key] = verdict
        return verdict

    @staticmethod
    def _check(schema: Mapping[str, Any]) -> str | None:
        if _plainly_valid(schema):
            return None
        cls = _validator_class(schema)
        meta = cls(cls.META_SCHEMA, format_checker=cls.FORMAT_CHECKER)
        try:
            # The first problem found, in the schema's order: the same in every process
            # (``_patch_keywords``), and found without looking for the others (a schema of
            # 40,000 bad properties: 5 ms, where all of them took 9 s).
            error = next(iter(meta.iter_errors(schema)), None)
        except RecursionError:
            return "the schema is nested too deeply (at the schema root)"
        if error is None:
            return None
        pointer = json_pointer(error.absolute_path) or "the schema root"
        return f"{_clip(error.message, _SCHEMA_MESSAGE_LIMIT)} (at {pointer})"

    @staticmethod
    def problems(schema: Mapping[str, Any], limit: int = _MAX_ERRORS) -> list[str]:
        """Return every reason ``schema`` is not a valid JSON Schema (``validate`` uses it).

        Uncached: the catalog needs only the first problem (``problem``); an operator
        checking one set wants them all.

        Args:
            schema: The tool's ``schema`` object.
            limit: The most problems returned.

        Returns:
            ``"<jsonschema message> (at <JSON Pointer into the schema>)"`` each, in the
            order they are found walking the meta-schema over the schema (its members in
            their own order), the first the one ``problem`` reports; empty when valid.
        """
        if _plainly_valid(schema):
            return []
        cls = _validator_class(schema)
        meta = cls(cls.META_SCHEMA, format_checker=cls.FORMAT_CHECKER)
        try:
            # In the order ``problem`` finds them, so the first is the one the daemon
            # reports; and no more than asked for are looked for.
            errors = list(itertools.islice(meta.iter_errors(schema), limit))
        except RecursionError:
            return ["the schema is nested too deeply (at the schema root)"]
        out = []
        for error in errors:
            pointer = json_pointer(error.absolute_path) or "the schema root"
            out.append(f"{_clip(error.message, _SCHEMA_MESSAGE_LIMIT)} (at {pointer})")
        return out


# -- the fast path of argument validation -------------------------------------------
#
# jsonschema's iter_errors costs ~20 µs even for ``{}`` against a plain object schema,
# on every call. For schemas made only of the keywords below (Draft 2020-12, no $schema,
# no references), _satisfies decides exactly whether an instance is valid; only a
# failing instance (or another schema) goes to jsonschema, which words the errors.
# Semantics follow jsonschema's: booleans are not numbers, 1.0 is an integer, numeric
# bounds and lengths apply only to their own types, ``format`` is an annotation.

_VALUE_TYPES: Mapping[str, Callable[[Any], bool]] = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "integer": lambda v: _is_integer_type(None, v),
}
_ANNOTATIONS = frozenset(
    {
        "title",
        "description",
        "$comment",
        "default",
        "examples",
        "deprecated",
        "readOnly",
        "writeOnly",
        "format",
    }
)
_CHECKED = frozenset(
    {
        "type",
        "properties",
        "required",
        "additionalProperties",
        "items",
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "minLength",
        "maxLength",
        "minItems",
        "maxItems",
        "minProperties",
        "maxProperties",
    }
)


def _plain_subset(schema: Any, depth: int = 0) -> bool:
    """Whether ``_satisfies`` decides ``schema`` exactly (it is also a valid schema)."""
    if isinstance(schema, bool):
        return True
    if not isinstance(schema, dict) or depth > _FAST_PATH_DEPTH or not _plainly_valid(schema):
        return False
    for key, value in schema.items():
        if key in _ANNOTATIONS:
            continue
        if key not in _CHECKED:
            return False
        if key == "properties" and not all(_plain_subset(sub, depth + 1) for sub in value.values()):
            return False
        if key in ("additionalProperties", "items") and not _plain_subset(value, depth + 1):
            return False
    return True


def _satisfies(schema: Any, value: Any) -> bool:
    """Whether ``value`` is valid under a schema of the plain subset (see above)."""
    if schema is True or schema is False:
        return schema
    kind = schema.get("type")
    if kind is not None:
        if isinstance(kind, str):
            if not _VALUE_TYPES[kind](value):
                return False
        elif not any(_VALUE_TYPES[k](value) for k in kind):
            return False
    if isinstance(value, dict):
        properties = schema.get("properties", _EMPTY)
        extra = schema.get("additionalProperties", True)
        for name, item in value.items():
            sub = properties.get(name)
            if sub is not None:
                if not _satisfies(sub, item):
                    return False
            elif extra is not True and not _satisfies(extra, item):
                return False
        required = schema.get("required")
        if required is not None and any(name not in value for name in required):
            return False
        lo, hi = schema.get("minProperties"), schema.get("maxProperties")
        if (lo is not None and len(value) < lo) or (hi is not None and len(value) > hi):
            return False
    elif isinstance(value, str):
        lo, hi = schema.get("minLength"), schema.get("maxLength")
        if (lo is not None and len(value) < lo) or (hi is not None and len(value) > hi):
            return False
    elif isinstance(value, list):
        items = schema.get("items", True)
        if items is not True and not all(_satisfies(items, item) for item in value):
            return False
        lo, hi = schema.get("minItems"), schema.get("maxItems")
        if (lo is not None and len(value) < lo) or (hi is not None and len(value) > hi):
            return False
    elif isinstance(value, int | float) and not isinstance(value, bool):
        for key, holds in _BOUND_HOLDS.items():
            bound = schema.get(key)
            if bound is not None and not holds(_compare(value, bound)):
                return False
    return True


def off_loop(arguments: Any) -> bool:
    """Whether checking ``arguments`` belongs in the check process, not on the event loop.

    True for more than ``_LOOP_VALUES`` members and items on all levels, or more than
    ``_LOOP_CHARS`` characters of strings (keys included). It looks at no more than that:
    the cost is bounded whatever the size.
    """
    if type(arguments) is str:
        return len(arguments) > _LOOP_CHARS
    kind = type(arguments)
    if kind is not dict and kind is not list:
        return False
    count = chars = 0
    stack = [arguments]
    pop = stack.pop
    push = stack.append
    while stack:
        item = pop()
        if type(item) is dict:
            for key in item:
                chars += len(key)
            children: Any = item.values()
        else:
            children = item
        count += len(children)
        if count > _LOOP_VALUES:
            return True
        for child in children:
            kind = type(child)
            if kind is str:
                chars += len(child)
            elif kind is dict or kind is list:
                push(child)
        if chars > _LOOP_CHARS:
            return True
    return False


_EMPTY: Mapping[str, Any] = {}


class ArgumentValidators:
    """Compiled argument validators, one per tool hash, shared by concurrent calls.

    A tool whose schema is in the plain subset (``_plain_subset``) is checked by
    ``_satisfies`` first; jsonschema is asked only when that says the arguments fail
    (for the messages) or for any other schema.
    """

    def __init__(
        self,
        max_entries: int = 4096,
        time_limit: float = TIME_LIMIT,
        libraries: str | None = None,
        *,
        cpu_time: bool = False,
    ) -> None:
        """Create an empty cache.

        Args:
            max_entries: How many compiled validators to keep; the oldest goes first.
            time_limit: The most seconds one call's check may run before the allowance
                for its size (``TIME_LIMIT_PER_MIB``); see ``timelimit``.
            cpu_time: Count the process's CPU seconds, not wall ones (the check process,
                whose verdict must not depend on the machine's load; ``run_limited``).
            libraries: The daemon's ``install.libraries_id()``, taken at its start:
                jsonschema, imported at the first check that needs it (not at start: a
                warm set cache parses nothing), is imported only while the versions
                installed are those (``_OwnJsonschema``). None: not looked at (the check
                process, whose code the daemon knows by ``install.code_id``).
        """
        self._time_limit = time_limit
        self._cpu_time = cpu_time
        self._own_jsonschema = _OwnJsonschema(libraries)
        self._validators: dict[str, Validator] = {}
        self._plain: dict[str, bool] = {}
        self._lock = threading.Lock()
        self._max_entries = max_entries
        self.compiled = 0

    @property
    def time_limit(self) -> float:
        """The seconds a check may run before the allowance for its size."""
        return self._time_limit

    def _validator(self, key: str, schema: Mapping[str, Any]) -> Validator:
        with self._lock:
            found = self._validators.get(key)
        if found is not None:
            return found
        self._own_jsonschema.check()
        cls = _validator_class(schema)
        import jsonschema_specifications  # type: ignore[import-untyped]  # it ships no py.typed

        validator = cls(schema, registry=jsonschema_specifications.REGISTRY)
        with self._lock:
            self.compiled += 1
            while len(self._validators) >= self._max_entries:
                del self._validators[next(iter(self._validators))]
            self._validators[key] = validator
        return validator

    def _is_plain(self, key: str, schema: Mapping[str, Any]) -> bool:
        """Whether the schema is in the plain subset (``_plain_subset``), cached by key."""
        plain = self._plain.get(key)
        if plain is None:
            plain = _plain_subset(schema)
            with self._lock:
                if len(self._plain) >= self._max_entries:
                    self._plain.clear()
                self._plain[key] = plain
        return plain

    def errors(self, loaded: LoadedTool, arguments: Any) -> list[dict[str, str]]:
        """List every way ``arguments`` fails the tool's input schema (``errors_for``)."""
        return self.errors_for(loaded.hash, loaded.tool.schema, arguments)

    def errors_for(
        self, key: str, schema: Mapping[str, Any], arguments: Any, size: int | None = None
    ) -> list[dict[str, str]]:
        """List every way ``arguments`` fails ``schema``.

        Args:
            key: What the schema's compiled validator is cached under (the tool's hash,
                which covers its schema).
            schema: The tool's input schema.
            arguments: The decoded argument value.
            size: The arguments' length as compact JSON, if already known.

        Returns:
            ``{"path", "message"}`` dicts sorted by path then message (empty when valid).
            ``path`` is a JSON Pointer into the arguments (``""`` is the root); at most
            100 errors are reported.
        """
        plain = self._is_plain(key, schema)
        try:
            if plain and _satisfies(schema, arguments):
                return []
        except RecursionError:
            pass  # jsonschema below says so in its words
        validator = self._validator(key, schema)  # built (jsonschema imported) before the limit
        found: set[tuple[str, str]] = set()

        def check() -> None:
            for error in validator.iter_errors(arguments):
                found.update(_describe(error))
                if len(found) >= _MAX_ERRORS:
                    break

        # The arguments' size as compact JSON (what a client sent, about), written by the
        # wire's own encoder: numbers as written, wide integers and all.
        if size is None:
            size = len(json_dumps(arguments))
        limit = time_limit_for(self._time_limit, size)
        cpu = self._cpu_time
        started = _clock(cpu)
        try:
            run_limited(limit, check, cpu=cpu)
        except TimeLimitExceeded:
            found.add(("", stopped_message(limit, self._time_limit, schema)))
        except RecursionError:
            try:
                # The probe is part of the check: it has what is left of the limit (with
                # a whole one of its own, a check ran up to twice its limit).
                loops = not nesting_exceeds(arguments, MAX_ARGUMENT_DEPTH) and (
                    not nesting_exceeds(arguments, _SHALLOW)
                    or _loops(validator, _cut(arguments, _SHALLOW), limit, started, cpu=cpu)
                )
            except TimeLimitExceeded:
                return [{"path": "", "message": stopped_message(limit, self._time_limit, schema)}]
            if loops:
                # Shallow arguments, or the same ones cut to a shallow depth, exhaust it:
                # the schema does, before it checks anything below.
                return [{"path": "", "message": _SCHEMA_LOOP}]
            return [{"path": "", "message": "the arguments are nested too deeply to validate"}]
        except OverflowError:
            # A number past the double range (1e999, or an integer of 309 digits or more,
            # both valid JSON and kept as written) divided by a fractional multipleOf: the
            # check cannot be made, so the call does not pass it. Errors found so far stay.
            found.add(
                (
                    "",
                    "a number in the arguments is too large to check against the schema's "
                    "multipleOf (beyond ±1.8e308); send a smaller number",
                )
            )
        except Exception as exc:
            import referencing.exceptions  # loaded by jsonschema already; bound only here

            if isinstance(exc, referencing.exceptions.Unresolvable):
                reason = _clip(str(exc), _SCHEMA_MESSAGE_LIMIT)
            elif _no_uri(exc):  # resolves to nothing, as an unresolvable one
                reason = f"a $ref or $id in it is no URI ({_clip(str(exc), _SCHEMA_MESSAGE_LIMIT)})"
            else:
                raise
            return [{"path": "", "message": f"the tool's input schema cannot be used: {reason}"}]
        return [{"path": p, "message": m} for p, m in sorted(found)[:_MAX_ERRORS]]


#: The error of a schema whose check never ends on shallow arguments: a ``$ref`` that
#: leads back to itself before checking anything (``{"$ref": "#"}``), or a chain of
#: ``$ref`` too long to follow. It passes the meta-schema, and no call can pass it.
_SCHEMA_LOOP = (
    "the tool's input schema cannot be checked to its end on these arguments (a $ref "
    "that leads back to itself before checking anything, or a chain of $ref or nested "
    "keywords too long to follow); ask the set's author to fix the schema"
)


#: The nesting of arguments too shallow to exhaust the check of any sensible schema (one
#: that recurses through them, a tree, with a few keywords on the way to each level can be
#: exhausted by the 64 levels the wire takes, but not by this many).
_SHALLOW = 16


def _cut(value: Any, depth: int) -> Any:
    """``value`` with every object or array nested deeper than ``depth`` emptied."""
    if not isinstance(value, (dict, list)):
        return value
    if depth <= 1:
        return type(value)()
    if isinstance(value, dict):
        return {k: _cut(v, depth - 1) for k, v in value.items()}
    return [_cut(v, depth - 1) for v in value]


def _loops(validator: Any, probe: Any, limit: float, started: float, *, cpu: bool) -> bool:
    """Whether checking ``probe`` (shallow arguments) still exhausts the recursion, within
    what is left of the check's ``limit`` seconds, which began at ``started``
    (``time.monotonic``, or ``time.process_time`` when ``cpu`` counts CPU seconds).

    Arguments that exhaust it may do so by their depth alone, as a schema that recurses
    through them lets them: only when shallow ones do too is the schema the cause.

    Raises:
        TimeLimitExceeded: The check's time ran out before the probe ended.
    """

    def check() -> None:
        for _ in validator.iter_errors(probe):
            pass

    left = limit - (_clock(cpu) - started) if limit > 0 else 0.0  # 0: no limit
    if limit > 0 and left <= 0:
        raise TimeLimitExceeded
    try:
        run_limited(left, check, cpu=cpu)
    except RecursionError:
        return True
    except TimeLimitExceeded:
        raise
    except Exception:  # any other end: the schema does not loop
        return False
    return False


def _clock(cpu: bool) -> float:
    """The seconds a check's time limit counts: the process's CPU time, or wall time."""
    return time.process_time() if cpu else time.monotonic()


def time_limit_for(base: float, size: int) -> float:
    """The seconds a check of arguments of ``size`` bytes (compact JSON) may run."""
    return base + TIME_LIMIT_PER_MIB * size / (1 << 20)


def stopped_message(limit: float, base: float, schema: Mapping[str, Any]) -> str:
    """The error of a check stopped at its time limit, naming the likely cause."""
    text = canonical_json(schema)
    why = (
        "a pattern in the schema may backtrack on these values"
        if b'"pattern' in text
        else "the schema costs more than that on arguments like these"
    )
    return (
        f"checking the arguments against the tool's input schema was stopped after "
        f"{limit:.2g} s ({base:g} s, plus {TIME_LIMIT_PER_MIB:g} s per MiB of arguments): "
        f"{why}; send smaller "
        "values, or ask the set's author to simplify the schema"
    )


def _describe(error: ValidationError) -> list[tuple[str, str]]:
    """Turn one jsonschema error into ``(pointer, message)`` pairs a model can act on."""
    path = json_pointer(error.absolute_path)
    keyword = error.validator
    value: Any = error.validator_value
    instance = error.instance
    schema = error.schema if isinstance(error.schema, Mapping) else {}

    def at(detail: str, where: str = path) -> tuple[str, str]:
        return where, f"{where}: {detail}" if where else detail

    if keyword == "required" and isinstance(value, bool) and error.absolute_path:
        # Draft 3: ``"required": true`` sits in the property's own schema; jsonschema puts
        # the property's name last in the path, and the object is the instance.
        *parent, name = error.absolute_path
        return [at(f"required property {_name(name)} is missing", json_pointer(parent))]
    if keyword == "required" and isinstance(instance, dict):
        return [
            at(f"required property {_name(name)} is missing")
            for name in value
            if name not in instance
        ]
    if keyword == "additionalProperties" and isinstance(instance, dict):
        known = schema.get("properties", {})
        patterns = list(schema.get("patternProperties", {}))
        extras = [
            name
            for name in instance
            if name not in known and not any(re.search(p, name) for p in patterns)
        ]
        return [at(f"property {_name(name)} is not allowed") for name in extras] or [
            at(_clip(error.message, _SCHEMA_MESSAGE_LIMIT))
        ]
    if keyword == "dependentRequired" and isinstance(instance, dict):
        return [
            at(f"required property {_name(dep)} is missing (needed when {_name(name)} is present)")
            for name, deps in value.items()
            if name in instance
            for dep in deps
            if dep not in instance
        ]
    return [at(_detail(error, keyword, value, instance))]


def _types_text(value: Any) -> str:
    """A ``type`` keyword's value as words; draft 3 lets its list hold schemas too."""
    if isinstance(value, str):
        return value
    return " or ".join(
        item if isinstance(item, str) else f"a value matching {_echo(item)}" for item in value
    )


#: The longest integer (in digits) a message suggests sending instead of a number with a
#: fraction or exponent.
_SUGGESTED_DIGITS = 20


def _not_integral(kinds: Any, instance: Any) -> str:
    """Why a number with no fractional part fails ``"type": "integer"`` (else ""), which only
    a schema of draft 3 or 4 makes it do: those drafts count a number written with a fraction
    or an exponent (``1.0``, ``1e2``) as no integer. An MCP host cannot be told so (its
    listing is 2020-12, where ``1.0`` is an integer, and a JavaScript host sends ``1``
    anyway): the message says what to send."""
    names = [kinds] if isinstance(kinds, str) else kinds
    if "integer" not in names or not isinstance(instance, float) or not _integral(instance):
        return ""
    text = (
        f" {_echo(instance)}, which the tool's schema counts as no integer: its $schema names "
        "JSON Schema draft 3 or 4, where an integer is written without a fraction or exponent"
    )
    whole = _decimal(instance)
    if whole.adjusted() < _SUGGESTED_DIGITS:
        text += f"; send {int(whole)}"
    return text


def _detail(error: ValidationError, keyword: Any, value: Any, instance: Any) -> str:
    """The message text for keywords that describe the value itself."""
    got = f"got {_json_type(instance)}"
    if keyword in ("minimum", "maximum") and isinstance(error.schema, Mapping):
        # Draft 3 and 4: ``exclusiveMinimum: true`` beside ``minimum`` makes it exclusive.
        exclusive = "exclusiveMinimum" if keyword == "minimum" else "exclusiveMaximum"
        if error.schema.get(exclusive) is True:
            keyword = exclusive
    simple: dict[str, Callable[[], str]] = {
        "type": lambda: f"expected {_types_text(value)}, {got}{_not_integral(value, instance)}",
        "enum": lambda: f"expected one of {_echo(value)}, got {_echo(instance)}",
        "const": lambda: f"expected {_echo(value)}, got {_echo(instance)}",
        "minimum": lambda: f"expected a number >= {value}, got {_echo(instance)}",
        "maximum": lambda: f"expected a number <= {value}, got {_echo(instance)}",
        "exclusiveMinimum": lambda: f"expected a number > {value}, got {_echo(instance)}",
        "exclusiveMaximum": lambda: f"expected a number < {value}, got {_echo(instance)}",
        "multipleOf": lambda: f"expected a multiple of {value}, got {_echo(instance)}",
        "minLength": lambda: f"expected at least {value} characters, got {len(instance)}",
        "maxLength": lambda: f"expected at most {value} characters, got {len(instance)}",
        "minItems": lambda: f"expected at least {value} items, got {len(instance)}",
        "maxItems": lambda: f"expected at most {value} items, got {len(instance)}",
        "minProperties": lambda: f"expected at least {value} properties, got {len(instance)}",
        "maxProperties": lambda: f"expected at most {value} properties, got {len(instance)}",
        "uniqueItems": lambda: "expected unique items, got duplicates",
        "pattern": lambda: f"expected a string matching {_echo(value)}, got {_echo(instance)}",
        "not": lambda: f"the value {_echo(instance)} matches a schema it must not match",
        "contains": lambda: "expected at least one item matching the 'contains' schema",
    }
    if keyword in simple:
        return simple[keyword]()
    if keyword in ("anyOf", "oneOf"):
        if not error.context:
            return (
                f"the value {_echo(instance)} matches more than one alternative; "
                f"{keyword} needs exactly one"
            )
        from jsonschema.exceptions import best_match

        closest = best_match(error.context)
        inner = _detail(closest, closest.validator, closest.validator_value, closest.instance)
        where = json_pointer(closest.relative_path)
        hint = f"{where}: {inner}" if where else inner
        return f"matches none of the allowed alternatives ({keyword}); closest: {hint}"
    if keyword is None:  # a `false` schema
        return "no value is allowed here"
    return _clip(error.message, _SCHEMA_MESSAGE_LIMIT)
