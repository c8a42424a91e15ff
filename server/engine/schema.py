"""pyhf's JSON schemas, checked by compiled validators; pyhf's own errors when a check fails.

``pyhf.schema.validate`` builds a jsonschema validator on every call and walks the instance
in Python: 0.2-0.6 s for a published workspace. Here each schema of pyhf
(``pyhf/schemas/1.0.0``, ``$ref`` to ``defs.json`` resolved locally) is compiled once with
``fastjsonschema``. A valid instance costs only the compiled check; when it fails, pyhf's
validator runs on the instance, so :func:`validate` raises exactly pyhf's
:class:`~pyhf.exceptions.InvalidSpecification` (message, JSON path, schema name) and accepts
whatever pyhf accepts (pyhf also takes booleans as numbers and numpy arrays as arrays).
Tuples are arrays to the compiled check, not to pyhf: parsed JSON never holds them.

:func:`loads` reads JSON with orjson, which refuses ``NaN``, ``Infinity`` and numbers that
overflow to infinity by itself (it raises ``orjson.JSONDecodeError``, a ``ValueError`` and
``json.JSONDecodeError``), so every float it returns is finite.

Example:
    >>> try:
    ...     validate({"channels": []}, "model.json")
    ... except pyhf.exceptions.InvalidSpecification as error:
    ...     print(error.path, "|", error.parent.message)
    channels | [] should be non-empty
    >>> loads(b'{"data": [1.5, 2]}')
    {'data': [1.5, 2]}
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import fastjsonschema
import orjson
import pyhf

SCHEMA_VERSION = pyhf.schema.version
_SCHEMA_DIR = Path(pyhf.schema.path) / SCHEMA_VERSION
# The order of a modifier's anyOf branches does not change which modifiers are valid; the
# compiled check tries them in turn, so the common types go first.
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
def compiled(schema_name: str) -> Callable[[Any], Any]:
    """The compiled validator of pyhf's ``schema_name`` (e.g. ``"workspace.json"``)."""
    schemas = _schemas()
    return fastjsonschema.compile(
        schemas[_base_uri() + schema_name],
        handlers={"https": schemas.__getitem__},
        use_formats=False,
    )


def conforms(instance: Any, schema_name: str) -> bool:
    """Whether the compiled check passes (pyhf may still accept what it refuses)."""
    try:
        compiled(schema_name)(instance)
    except fastjsonschema.JsonSchemaException:
        return False
    return True


def validate(instance: Any, schema_name: str) -> None:
    """Raise pyhf's :class:`~pyhf.exceptions.InvalidSpecification` unless ``instance`` is
    valid in pyhf's ``schema_name``, as ``pyhf.schema.validate(instance, schema_name)``."""
    if not conforms(instance, schema_name):
        pyhf.schema.validate(instance, schema_name)


def loads(document: bytes | bytearray | memoryview | str) -> Any:
    """Parse JSON quickly; ``NaN``, ``Infinity`` and out-of-range numbers are refused.

    Unlike ``json.loads``: integers beyond 64 bits become floats, and unpaired surrogates
    (``"\\ud800"``) are refused.
    """
    return orjson.loads(document)
