"""The client's result classes against the server's OpenAPI document (issue #38).

For every operation (``pyhf_gpu_client.tables.OPERATION_NAMES``) the 200 answer of
``POST /<name>`` is read from ``create_app(Settings()).openapi()``, its ``$ref``s resolved into
the components: one result, a list of them (over ``test_poi``) or a patchset's ``{patch: result
| list | error}``. Each result object is checked against the client class that
``pyhf_gpu_client.results.parse_result`` makes of it, in two ways:

* statically (:func:`class_problems`): every property of the schema's object, required or
  optional, is a field of the client's class (dataclass, or ``TypedDict`` for ``meta``), and
  every field the client reads from the JSON is a property of the schema; where both give a
  type they agree in kind (number -> float, integer -> int, string -> str, boolean -> bool,
  array -> list/tuple, object -> dict, a nested class or a ``TypedDict``); a schema that allows
  null needs an ``Optional`` field (or a float: the client reads null numbers as NaN); a
  property the server may leave out needs a field with a default. Nested objects (``meta`` and
  its ``flags``, ``goodness_of_fit``, ``poi``, the yields' channels and samples, a patch's error)
  are checked the same way, recursively.
* by parsing (:func:`parsed_problems`): an answer built from the schema (every property, no
  nulls; and every nullable value null, optional properties left out) is parsed in each shape
  the route declares; every field holds the value of its key, and ``extra`` (the keys the client
  does not know) stays empty.

The few client fields that are not the JSON key of their own name are listed in
:data:`RENAMED` and :data:`CLIENT_ONLY`, each with its reason. The last tests check the checker:
a field renamed or dropped on either side is reported.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, TypedDict, get_args, get_origin, get_type_hints, is_typeddict

import pytest

from pyhf_gpu_client import results, tables
from pyhf_gpu_client.results import ResultMeta, parse_result
from pyhf_gpu_server.service.app import create_app
from pyhf_gpu_server.service.settings import Settings

OPENAPI = create_app(Settings()).openapi()
SCHEMAS: dict[str, Any] = OPENAPI["components"]["schemas"]

#: client fields that hold a JSON value under another key, or a nested one: class -> field ->
#: the key's path in the answer
RENAMED: dict[str, dict[str, tuple[str, ...]]] = {
    # the attributes are snake_case; the answer keeps `pyhf cls`'s keys. test_poi is a copy of
    # meta.test_poi, at hand for the entries of a scan over test_poi
    "CLsResult": {
        "cls_obs": ("CLs_obs",),
        "cls_exp": ("CLs_exp",),
        "test_poi": ("meta", "test_poi"),
    },
    # a patch's error entry {"error": {"status", "detail"}}, flattened
    "PatchError": {"status": ("error", "status"), "detail": ("error", "detail")},
}
#: client fields that are no key of the answer, with their reason: (class or "*", field)
CLIENT_ONLY: dict[tuple[str, str], str] = {
    ("*", "extra"): "the keys of the answer the client does not know (none, as checked here)",
    ("SignificanceResult", "keys"): "the spellings the answer used for the four numbers "
    "(the client tolerates a few others), so that to_pyhf_json gives them back",
}

MISSING = object()
Problems = list[str]


# ------------------------------------------------------------------------------- schemas


def resolve(schema: Mapping[str, Any], schemas: Mapping[str, Any] = SCHEMAS) -> Mapping[str, Any]:
    """``schema`` with its ``$ref`` (to ``#/components/schemas/``) followed."""
    while "$ref" in schema:
        schema = schemas[schema["$ref"].rsplit("/", 1)[-1]]
    return schema


def alternatives(
    schema: Mapping[str, Any], schemas: Mapping[str, Any] = SCHEMAS
) -> tuple[list[Mapping[str, Any]], bool]:
    """The non-null alternatives of ``schema`` (resolved), and whether it allows null."""
    schema = resolve(schema, schemas)
    if "anyOf" not in schema and "oneOf" not in schema:
        if schema.get("type") == "null":
            return [], True
        return [schema], False
    found: list[Mapping[str, Any]] = []
    nullable = False
    for alt in schema.get("anyOf", schema.get("oneOf", [])):
        alts, null = alternatives(alt, schemas)
        found += alts
        nullable |= null
    return found, nullable


def schema_kind(schema: Mapping[str, Any]) -> str:
    """``number``, ``integer``, ``string``, ``boolean``, ``array``, ``object`` or ``any``."""
    if "type" in schema:
        return str(schema["type"])
    if "enum" in schema:
        values = {type(v) for v in schema["enum"]}
        return {str: "string", int: "integer", float: "number", bool: "boolean"}[values.pop()]
    if "properties" in schema or "additionalProperties" in schema:
        return "object"
    return "any"


def answer_shapes(operation: str, schemas: Mapping[str, Any] = SCHEMAS) -> dict[str, Any]:
    """The 200 answer of ``POST /<operation>``: its result objects (by component name), whether
    a list of them is an answer, and the same of a patchset's entry (errors apart)."""
    route = OPENAPI["paths"][f"/{operation}"]["post"]["responses"]["200"]
    top, _ = alternatives(route["content"]["application/json"]["schema"], schemas)

    def split(alts: list[Mapping[str, Any]]) -> tuple[dict[str, Any], bool, list[Any]]:
        singles: dict[str, Any] = {}
        listed, maps = False, []
        for alt in alts:
            if alt.get("type") == "array":
                items, _ = alternatives(alt["items"], schemas)
                singles.update((item["title"], item) for item in items)
                listed = True
            elif "properties" in alt:
                singles[alt["title"]] = alt
            else:
                maps.append(alt["additionalProperties"])
        return singles, listed, maps

    singles, listed, maps = split(top)
    assert len(maps) == 1, f"{operation}: one patchset form expected"
    entry, entry_listed, _ = split(alternatives(maps[0], schemas)[0])
    return {
        "results": singles,
        "listed": listed,
        "entry": entry,
        "entry_listed": entry_listed,
    }


# ---------------------------------------------------------------------------- the client


def hint_kind(hint: Any) -> str:
    """The JSON kind of a (non-None) type hint."""
    origin = get_origin(hint) or hint
    if hint is Any:
        return "any"
    if origin in (list, tuple) or (
        isinstance(origin, type) and issubclass(origin, Sequence) and origin is not str
    ):
        return "array"
    if origin in (dict, Mapping) or dataclasses.is_dataclass(hint) or is_typeddict(hint):
        return "object"
    return {float: "number", int: "integer", str: "string", bool: "boolean"}.get(hint, repr(hint))


def union_members(hint: Any) -> tuple[list[Any], bool]:
    """The non-None members of a hint, and whether None is one."""
    if get_origin(hint) in (typing.Union, types.UnionType):
        members = list(get_args(hint))
        return [m for m in members if m is not type(None)], type(None) in members
    return [hint], False


def field_names(cls: type) -> list[str]:
    if is_typeddict(cls):
        return list(get_type_hints(cls))
    return [f.name for f in dataclasses.fields(cls) if f.init]


def has_default(cls: type, name: str) -> bool:
    """Whether the field may be left out (a default, or an optional ``TypedDict`` key)."""
    if is_typeddict(cls):
        return name in cls.__optional_keys__
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    return f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING


def json_paths(cls: type) -> dict[str, tuple[str, ...]]:
    """The client fields read from the answer, each with its key's path."""
    renamed = RENAMED.get(cls.__name__, {})
    return {
        name: renamed.get(name, (name,))
        for name in field_names(cls)
        if ("*", name) not in CLIENT_ONLY and (cls.__name__, name) not in CLIENT_ONLY
    }


# ------------------------------------------------------------------------ static check


def lookup(
    schema: Mapping[str, Any], path: tuple[str, ...], schemas: Mapping[str, Any]
) -> tuple[Mapping[str, Any] | None, bool]:
    """The schema of the value at ``path`` (None if the object has no such key) and whether
    the server always sends it (required all the way down)."""
    required = True
    for key in path:
        objects = [alt for alt in alternatives(schema, schemas)[0] if "properties" in alt]
        if not objects or key not in objects[0]["properties"]:
            return None, False
        required &= key in objects[0].get("required", ())
        schema = objects[0]["properties"][key]
    return schema, required


def uncovered(schema: Mapping[str, Any], paths: list[tuple[str, ...]], schemas: Any) -> list[str]:
    """The keys (dotted paths) of ``schema``'s object that none of ``paths`` reads."""
    objects = [alt for alt in alternatives(schema, schemas)[0] if "properties" in alt]
    missing = []
    for key, sub in (objects[0]["properties"] if objects else {}).items():
        if (key,) in paths:
            continue
        deeper = [p[1:] for p in paths if len(p) > 1 and p[0] == key]
        if deeper:
            missing += [f"{key}.{k}" for k in uncovered(sub, deeper, schemas)]
        else:
            missing.append(key)
    return missing


def class_problems(
    schema: Mapping[str, Any], cls: type, where: str, schemas: Mapping[str, Any] = SCHEMAS
) -> Problems:
    """Where the client's ``cls`` and the server's object ``schema`` disagree."""
    title = resolve(schema, schemas).get("title", where)
    hints = get_type_hints(cls)
    paths = json_paths(cls)
    problems = [
        f"{where}: the server's {title} has '{key}', which no field of {cls.__name__} reads"
        for key in uncovered(schema, list(paths.values()), schemas)
    ]
    for name, path in paths.items():
        sub, required = lookup(schema, path, schemas)
        here = f"{where}.{name}"
        if sub is None:
            problems.append(f"{here}: reads '{'.'.join(path)}', which the server's {title} has not")
            continue
        if not required and not has_default(cls, name):
            problems.append(f"{here}: the server may leave it out, but the field has no default")
        problems += type_problems(sub, hints[name], here, schemas)
    return problems


def type_problems(
    schema: Mapping[str, Any], hint: Any, where: str, schemas: Mapping[str, Any] = SCHEMAS
) -> Problems:
    """Where a field's type and its value's schema disagree in kind (recursively)."""
    if hint is Any:
        return []
    alts, nullable = alternatives(schema, schemas)
    members, optional = union_members(hint)
    kinds = {schema_kind(alt) for alt in alts}
    if "any" in kinds:
        return []
    problems = []
    if nullable and not optional and [hint_kind(m) for m in members] != ["number"]:
        problems.append(f"{where}: the server may send null, the field is not Optional")
    for member in members:
        kind = hint_kind(member)
        matching = [alt for alt in alts if schema_kind(alt) == kind]
        if not matching and kind != "any":
            problems.append(f"{where}: the field holds {kind}, the server sends {sorted(kinds)}")
            continue
        for alt in matching:
            problems += _kind_problems(alt, member, kind, where, schemas)
    handled = {hint_kind(m) for m in members}
    if "any" not in handled:
        for kind in sorted(kinds - handled):
            problems.append(f"{where}: the server may send {kind}, the field holds {handled}")
    return problems


def _kind_problems(
    schema: Mapping[str, Any], hint: Any, kind: str, where: str, schemas: Mapping[str, Any]
) -> Problems:
    args = get_args(hint)
    if kind == "array":
        if "prefixItems" in schema:
            items = schema["prefixItems"]
            inner = (
                args if len(args) == len(items) and Ellipsis not in args else [args[0]] * len(items)
            )
            return [
                p
                for i, (item, arg) in enumerate(zip(items, inner, strict=True))
                for p in type_problems(item, arg, f"{where}[{i}]", schemas)
            ]
        return type_problems(
            schema.get("items", {}), args[0] if args else Any, f"{where}[]", schemas
        )
    if kind != "object":
        return []
    if dataclasses.is_dataclass(hint) or is_typeddict(hint):
        return class_problems(schema, hint, where, schemas)
    value = args[1] if len(args) == 2 else Any
    extra = schema.get("additionalProperties")
    if isinstance(extra, Mapping):
        return type_problems(extra, value, f"{where}{{}}", schemas)
    if value is not Any:  # a fixed object read as a map of one type
        return [f"{where}: the server sends an object of fixed keys, the field is {hint}"]
    return []  # a fixed object kept as the server's JSON (dict[str, Any]): read as it comes


# ------------------------------------------------------------------------- parse check


def example(schema: Mapping[str, Any], nulls: bool = False, schemas: Any = SCHEMAS) -> Any:
    """A value the schema allows: every property, no nulls; with ``nulls``, every nullable
    value null and the properties the server may leave out left out."""
    alts, nullable = alternatives(schema, schemas)
    if nullable and (nulls or not alts):
        return None
    alt = alts[0] if alts else {}
    if "enum" in alt:
        return alt["enum"][0]
    kind = schema_kind(alt)
    if kind == "array":
        if "prefixItems" in alt:
            return [example(item, nulls, schemas) for item in alt["prefixItems"]]
        return [example(alt.get("items", {}), nulls, schemas) for _ in range(2)]
    if kind == "object":
        if "properties" in alt:
            required = alt.get("required", ())
            return {
                k: example(v, nulls, schemas)
                for k, v in alt["properties"].items()
                if not nulls or k in required
            }
        extra = alt.get("additionalProperties")
        return {"one": example(extra, nulls, schemas)} if isinstance(extra, Mapping) else {}
    return {"number": 0.5, "integer": 3, "string": "text", "boolean": True}.get(kind, {"x": 1})


def _is_default(value: Any) -> bool:
    return value is None or value == {} or (isinstance(value, float) and math.isnan(value))


def same_problems(actual: Any, expected: Any, where: str) -> Problems:
    """Where a parsed value differs from the JSON value it was read from."""
    if expected is MISSING or expected is None:
        return [] if _is_default(actual) else [f"{where}: {actual!r} where the answer had null"]
    if dataclasses.is_dataclass(actual) and not isinstance(actual, type):
        return parsed_problems(actual, expected, where)
    if isinstance(expected, list):
        if not isinstance(actual, (list, tuple)) or len(actual) != len(expected):
            return [f"{where}: {actual!r} is not the answer's list {expected!r}"]
        return [
            p
            for i, (a, e) in enumerate(zip(actual, expected, strict=True))
            for p in same_problems(a, e, f"{where}[{i}]")
        ]
    if isinstance(expected, dict):
        if not isinstance(actual, Mapping) or set(actual) != set(expected):
            return [f"{where}: {actual!r} is not the answer's object {expected!r}"]
        return [p for k in expected for p in same_problems(actual[k], expected[k], f"{where}.{k}")]
    if type(actual) is not type(expected) and not (
        isinstance(expected, int) and type(actual) is float and not isinstance(expected, bool)
    ):
        return [f"{where}: {actual!r} ({type(actual).__name__}) read from {expected!r}"]
    return [] if actual == expected else [f"{where}: {actual!r} read from {expected!r}"]


def parsed_problems(parsed: Any, answer: Any, where: str) -> Problems:
    """Where a parsed result's fields are not the values of their keys in ``answer``, or
    keys of ``answer`` went to ``extra``."""
    problems = []
    for name, path in json_paths(type(parsed)).items():
        expected = answer
        for key in path:
            expected = expected.get(key, MISSING) if isinstance(expected, Mapping) else MISSING
        problems += same_problems(getattr(parsed, name), expected, f"{where}.{name}")
    if getattr(parsed, "extra", None):
        problems.append(f"{where}: keys the client does not know: {sorted(parsed.extra)}")
    return problems


# --------------------------------------------------------------------------------- tests


def client_class(operation: str, title: str) -> type:
    """The client's class of the server's result ``title`` (by name, case aside: the server's
    ``ClsResult`` is the client's ``CLsResult``) among the classes of ``operation``."""
    classes = (*results._CLASSES[operation], results.PatchError)
    found = [cls for cls in classes if cls.__name__.lower() == title.lower()]
    assert found, f"{operation}: no client class for the server's {title} among {classes}"
    return found[0]


def parsed(operation: str, answer: Any, where: str, problems: Problems) -> Any:
    """``parse_result(operation, answer)``; None (and a problem) where it raises."""
    try:
        return parse_result(operation, answer)
    except (KeyError, TypeError, ValueError) as error:
        problems.append(f"{where}: the client cannot parse it: {error!r}")
        return None


@pytest.mark.parametrize("operation", tables.OPERATION_NAMES)
def test_result_classes_match_the_schema(operation: str) -> None:
    """Every result object of the route against its client class, field by field."""
    shapes = answer_shapes(operation)
    assert shapes["entry"].keys() == {*shapes["results"], "PatchError"}, shapes["entry"]
    problems: Problems = []
    for title, schema in shapes["entry"].items():
        cls = client_class(operation, title)
        problems += class_problems(schema, cls, f"{operation}: {cls.__name__}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("operation", tables.OPERATION_NAMES)
@pytest.mark.parametrize("nulls", [False, True], ids=["values", "nulls"])
def test_answers_parse_field_for_field(operation: str, nulls: bool) -> None:
    """An answer of each declared shape (one, a list, ``{patch: ...}``) parses into fields
    holding the values of their keys, nothing left to ``extra``."""
    shapes = answer_shapes(operation)
    problems: Problems = []
    for title, schema in shapes["results"].items():
        answer = example(schema, nulls)
        where = f"{operation}: {title}"
        one = parsed(operation, answer, where, problems)
        if one is None:
            continue
        assert isinstance(one, client_class(operation, title)), (title, one)
        problems += parsed_problems(one, answer, where)
        if shapes["listed"]:
            listed = parse_result(operation, [answer, answer])
            assert isinstance(listed, list) and len(listed) == 2, listed
            problems += parsed_problems(listed[1], answer, f"{where} in a list")
        error = example(SCHEMAS["PatchError"], nulls)
        patchset: dict[str, Any] = {"p1": answer, "p2": error}
        if shapes["entry_listed"]:
            patchset["p3"] = [answer]
        patches = parse_result(operation, patchset)
        assert isinstance(patches, dict) and patches.keys() == patchset.keys(), patches
        problems += parsed_problems(patches["p1"], answer, f"{where} of a patch")
        problems += parsed_problems(patches["p2"], error, f"{where}: a patch's error")
        if shapes["entry_listed"]:
            problems += parsed_problems(patches["p3"][0], answer, f"{where} in a patch's list")
    assert not problems, "\n".join(problems)


def test_every_operation_has_a_route() -> None:
    assert set(results._CLASSES) == set(tables.OPERATION_NAMES)
    for operation in tables.OPERATION_NAMES:
        assert answer_shapes(operation)["results"], operation


# ------------------------------------------------------------- the checker finds drift


@dataclasses.dataclass
class UpperLimitWithoutLevel:
    """The client's UpperLimitResult with ``level`` dropped."""

    upper_limit_obs: float
    upper_limit_exp: list[float]
    meta: ResultMeta = dataclasses.field(default_factory=ResultMeta)
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class UpperLimitRenamed(UpperLimitWithoutLevel):
    """The client's UpperLimitResult with ``level`` renamed ``cl_level``."""

    cl_level: float = 0.05


#: the client's ResultMeta with ``patch`` dropped (the others as they are)
MetaWithoutPatch = TypedDict(
    "MetaWithoutPatch",
    {k: v for k, v in get_type_hints(ResultMeta).items() if k != "patch"},
    total=False,
)


@dataclasses.dataclass
class UpperLimitWrongKinds(UpperLimitWithoutLevel):
    """``level`` a string; ``meta`` without ``patch``."""

    level: str = "0.05"
    meta: MetaWithoutPatch = dataclasses.field(default_factory=MetaWithoutPatch)


def _renamed_in_schema(component: str, old: str, new: str | None) -> dict[str, Any]:
    """A copy of the components with ``component``'s property ``old`` renamed ``new`` (or
    dropped with ``None``)."""
    schemas = copy.deepcopy(SCHEMAS)
    target = schemas[component]
    value = target["properties"].pop(old)
    if new is not None:
        target["properties"][new] = value
    target["required"] = [
        new if r == old else r for r in target.get("required", []) if new or r != old
    ]
    return schemas


def test_the_check_reports_drift_on_either_side() -> None:
    schema = SCHEMAS["UpperLimitResult"]
    where = "upper-limit"
    assert class_problems(schema, results.UpperLimitResult, where) == []
    # the client drops a field, renames one, or changes a kind (also in nested meta)
    assert class_problems(schema, UpperLimitWithoutLevel, where) == [
        "upper-limit: the server's UpperLimitResult has 'level', which no field of "
        "UpperLimitWithoutLevel reads"
    ]
    renamed = class_problems(schema, UpperLimitRenamed, where)
    assert len(renamed) == 2 and "'level'" in renamed[0] and "cl_level" in renamed[1], renamed
    wrong = class_problems(schema, UpperLimitWrongKinds, where)
    assert any("meta" in p and "'patch'" in p for p in wrong), wrong
    assert any("level: the field holds string" in p for p in wrong), wrong
    # the server renames or drops a field (of a result, or of meta)
    for component, old, new in [
        ("UpperLimitResult", "upper_limit_exp", "upper_limit_expected"),
        ("UpperLimitResult", "level", None),
        ("ResultMeta", "converged", "fits_converged"),
    ]:
        schemas = _renamed_in_schema(component, old, new)
        problems = class_problems(
            schemas["UpperLimitResult"], results.UpperLimitResult, where, schemas
        )
        assert any(f"reads '{old}'" in p or f"'{old}'" in p for p in problems), problems
        if new is not None:
            assert any(f"'{new}'" in p for p in problems), problems
    # a nullable value the client cannot hold, and a value the parser does not read
    schemas = copy.deepcopy(SCHEMAS)
    schemas["ResultMeta"]["properties"]["device"] = {
        "anyOf": [{"type": "string"}, {"type": "null"}]
    }
    assert class_problems(schema, results.UpperLimitResult, where, schemas) == [
        "upper-limit.meta.device: the server may send null, the field is not Optional"
    ]
    answer = example(schema)
    parsed = results.UpperLimitResult.from_json({**answer, "level_new": 1.0})
    assert parsed_problems(parsed, answer, where) == [
        "upper-limit: keys the client does not know: ['level_new']"
    ]
