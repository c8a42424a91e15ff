"""pyhf's JSON schemas, checked by compiled validators; pyhf's own errors when a check fails.

``pyhf.schema.validate`` builds a jsonschema validator on every call and walks the instance
in Python. Here each schema of pyhf (``pyhf/schemas/1.0.0``, ``$ref`` to ``defs.json``
resolved locally) is compiled once by ``jsonschema-rs`` (BENCHMARKS.md). A valid instance
costs only the compiled check; when it fails, pyhf's validator runs on the instance, so
:func:`validate` raises exactly pyhf's :class:`~pyhf.exceptions.InvalidSpecification`
(message, JSON path, schema name) and accepts whatever pyhf accepts (pyhf also takes
booleans as numbers and numpy arrays as arrays).
Tuples are arrays to the compiled check, not to pyhf: parsed JSON never holds them.

:func:`loads` reads JSON with orjson, which refuses ``NaN``, ``Infinity`` and numbers that
overflow to infinity by itself (it raises ``orjson.JSONDecodeError``, a ``ValueError`` and
``json.JSONDecodeError``), so every float it returns is finite. Where the standard library
would read what orjson refused into a value no model can hold (an unpaired surrogate such as
``"\\ud800"``, a 400-digit integer), it raises
:class:`~pyhf_gpu_server.engine.errors.UnrepresentableValueError` naming the value's JSON path.

Example:
    >>> try:
    ...     validate({"channels": []}, "model.json")
    ... except pyhf.exceptions.InvalidSpecification as error:
    ...     print(error.path, "|", error.parent.message)
    channels | [] should be non-empty
    >>> loads(b'{"data": [1.5, 2]}')
    {'data': [1.5, 2]}
    >>> try:
    ...     loads('{"channels": [{"name": "\\\\ud800"}]}')
    ... except UnrepresentableValueError as error:
    ...     print(error)
    the text at /channels/0/name holds an unpaired UTF-16 surrogate ('\\ud800'): every text must be valid Unicode
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema_rs
import orjson
import pyhf

from .errors import UnrepresentableValueError

SCHEMA_VERSION = pyhf.schema.version
_SCHEMA_DIR = Path(pyhf.schema.path) / SCHEMA_VERSION
# The order of a modifier's anyOf branches does not change which modifiers are valid; a
# check that tries them in turn finds the common types first.
_MODIFIER_ORDER = (
    "histosys",
    "normsys",
    "staterror",
    "lumi",
    "normfactor",
    "shapesys",
    "shapefactor",
)


@cache
def _schemas() -> dict[str, dict[str, Any]]:
    """pyhf's schemas of this version by ``$id``, the modifier branches reordered."""
    schemas = {}
    for path in sorted(_SCHEMA_DIR.glob("*.json")):
        schema = json.loads(path.read_text())
        schemas[schema["$id"]] = schema
    defs = copy.deepcopy(schemas[f"{_base_uri()}defs.json"])
    branches = defs["definitions"]["sample"]["properties"]["modifiers"]["items"]["anyOf"]
    rank = {f"#/definitions/modifier/{t}": i for i, t in enumerate(_MODIFIER_ORDER)}
    branches.sort(key=lambda branch: rank.get(branch["$ref"], len(rank)))
    schemas[defs["$id"]] = defs
    return schemas


def _base_uri() -> str:
    return f"https://scikit-hep.org/pyhf/schemas/{SCHEMA_VERSION}/"


@cache
def compiled(schema_name: str) -> Callable[[Any], bool]:
    """The compiled check of pyhf's ``schema_name`` (e.g. ``"workspace.json"``): whether an
    instance is valid."""
    schemas = _schemas()
    uri = _base_uri() + schema_name
    registry = jsonschema_rs.Registry(list(schemas.items()))
    return jsonschema_rs.validator_for(schemas[uri], registry=registry, base_uri=uri).is_valid


def conforms(instance: Any, schema_name: str) -> bool:
    """Whether the compiled check passes (pyhf may still accept what it refuses, such as the
    numpy arrays the compiled check cannot read)."""
    try:
        return compiled(schema_name)(instance)
    except (ValueError, TypeError):  # "Unsupported type": not a JSON value
        return False


def validate(instance: Any, schema_name: str) -> None:
    """Raise pyhf's :class:`~pyhf.exceptions.InvalidSpecification` unless ``instance`` is
    valid in pyhf's ``schema_name``, as ``pyhf.schema.validate(instance, schema_name)``."""
    if not conforms(instance, schema_name):
        pyhf.schema.validate(instance, schema_name)


def loads(document: bytes | bytearray | memoryview | str) -> Any:
    """Parse JSON quickly; ``NaN``, ``Infinity`` and out-of-range numbers are refused.

    Unlike ``json.loads``: integers beyond 64 bits become floats, and unpaired surrogates
    (``"\\ud800"``) are refused; these and numbers beyond a 64-bit float raise
    :class:`UnrepresentableValueError` (naming the JSON path), the rest ``ValueError``.
    """
    try:
        return orjson.loads(document)
    except orjson.JSONDecodeError:
        problem = _unrepresentable_value(document)
        if problem is not None:
            raise UnrepresentableValueError(problem) from None
        raise


def _unrepresentable_value(document: bytes | bytearray | memoryview | str) -> str | None:
    """What in ``document``, as ``json.loads`` reads it, no model can hold, and where; None
    if it holds nothing such (or ``json.loads`` refuses it too)."""
    try:
        parsed = json.loads(
            bytes(document) if isinstance(document, memoryview) else document,
            parse_constant=_refuse_constant,
        )
    except (ValueError, RecursionError):
        return None
    for path, value in _values(parsed):
        where = path or "(top level)"
        if isinstance(value, str) and not _is_unicode(value):
            return (
                f"the text at {where} holds an unpaired UTF-16 surrogate "
                f"({value[:40]!a}): every text must be valid Unicode"
            )
        if isinstance(value, (int, float)) and not _is_double(value):
            return (
                f"the number at {where} is out of range: every number must be finite as a "
                "64-bit float"
            )
    return None


def _refuse_constant(name: str) -> Any:
    """json hook: ``NaN`` and ``Infinity`` are left to the caller's explanation."""
    raise ValueError(name)


def _values(node: Any) -> Iterator[tuple[str, Any]]:
    """Every value and object key of a parsed JSON document with its JSON pointer, in
    document order (a key comes with the pointer of its value)."""
    stack = [("", node)]
    while stack:
        path, value = stack.pop()
        yield path, value
        if isinstance(value, dict):
            items = [(f"{path}/{_token(key)}", key, child) for key, child in value.items()]
            for child_path, key, _ in items:
                yield child_path, key
            stack.extend((child_path, child) for child_path, _, child in reversed(items))
        elif isinstance(value, list):
            stack.extend((f"{path}/{i}", value[i]) for i in reversed(range(len(value))))


def _token(key: str) -> str:
    """An object key as a JSON pointer token (RFC 6901), unpaired surrogates escaped."""
    token = key.replace("~", "~0").replace("/", "~1")
    return token.encode("utf-8", "backslashreplace").decode("utf-8")


def _is_unicode(text: str) -> bool:
    """Whether ``text`` can be written as UTF-8 (has no unpaired surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _is_double(number: int | float) -> bool:
    """Whether ``number`` is a finite 64-bit float."""
    try:
        return math.isfinite(float(number))
    except OverflowError:
        return False
