"""From a request body to a validated plan: parse, validate, resolve the model inputs.

* :func:`parse_json` reads a body safely (no NaN/Infinity, bounded nesting).
* :func:`envelope_from` turns a bare workspace + query options, or an envelope, into one dict.
* :func:`plan_request` validates it against the operation's request model and resolves the
  model inputs into a :class:`Plan`: one row per (element, tested POI) hypothesis.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

import numpy as np
import orjson
import pydantic
from pydantic import BaseModel

from pyhf_gpu_server.engine import schema
from pyhf_gpu_server.engine.errors import UnrepresentableValueError
from pyhf_gpu_server.inference.toys import ToySlice

from .elements import Background, Element, PatchSpec
from .errors import BadRequest, Unprocessable, pydantic_detail
from .operations import Operation
from .schemas import ModelSelection
from .workspace_store import WorkspaceStore, check_schema


# ---------------------------------------------------------------------------------------- parsing
def _reject_constant(name: str) -> Any:
    """json hook: NaN / Infinity are not numbers a likelihood can use."""
    raise ValueError(f"{name} is not allowed in the body: every number must be finite")


def _finite_float(text: str) -> float:
    """json hook: floats that overflow to infinity are rejected."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} is out of range: every number must be finite")
    return value


_SCALARS = frozenset({int, float, str, bool, type(None)})
_STEPS = np.zeros(256, dtype=np.int32)  # the nesting step of each byte: [ { up, ] } down
_STEPS[[ord("["), ord("{")]] = 1
_STEPS[[ord("]"), ord("}")]] = -1
_NOT_STRUCTURE = bytes(sorted(set(range(256)) - set(b'[]{}"')))  # the bytes a depth ignores
_DEPTH_CHUNK = 1 << 24  # bytes of body scanned at once (bounds the scan's arrays)


def _exceeds_depth(document: Any, limit: int) -> bool:
    """Whether ``document`` nests lists/objects deeper than ``limit``."""
    stack: list[tuple[Any, int]] = [(document, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        children = node.values() if isinstance(node, dict) else node
        if set(map(type, children)) <= _SCALARS:  # numbers and names only (bin contents)
            continue
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


def text_depth(body: bytes) -> int | None:
    """How deep the JSON text ``body`` (valid JSON) nests lists and objects, read off its
    bytes: the brackets outside strings, once all other bytes are dropped (a few array passes
    over what is left, instead of a Python walk over every list and object); None when it
    holds a backslash, whose escapes could hide where a string ends.

    Example:
        >>> text_depth(b'{"a": [[1], {"b": "]]}"}]}'), text_depth(b'["\\\\""]')
        (3, None)
    """
    if b"\\" in body:
        return None
    deepest, depth, in_string = 0, 0, 0
    for start in range(0, len(body), _DEPTH_CHUNK):
        # two adjacent quotes hold no bracket between them, so dropping them leaves every
        # bracket as much inside or outside a string as it was: most strings go at once
        marks = body[start : start + _DEPTH_CHUNK].translate(None, _NOT_STRUCTURE)
        marks = marks.replace(b'""', b"")
        if not marks:
            continue
        raw = np.frombuffer(marks, dtype=np.uint8)
        quotes = np.cumsum(raw == ord('"'), dtype=np.int64) + in_string
        steps = _STEPS[raw]
        steps[(quotes & 1).astype(bool)] = 0  # inside a string (a quote's own byte: no step)
        levels = np.cumsum(steps, dtype=np.int64) + depth
        deepest = max(deepest, int(levels.max()))
        depth, in_string = int(levels[-1]), int(quotes[-1]) & 1
    return deepest


def parse_json(body: bytes, max_depth: int) -> Any:
    """The JSON document in ``body``: 400 if malformed, 422 if non-finite or nested too deep.

    orjson reads it (a published workspace in milliseconds); when it refuses the body, the
    standard library's parser reads it again to say what is wrong, and where.
    """
    if not body.strip():
        raise BadRequest("the request body is empty; send a JSON workspace or request envelope")
    try:
        document = schema.loads(body)
    except UnrepresentableValueError as exc:  # a lone surrogate, a number out of float range
        raise Unprocessable(f"{type(exc).__name__}: {exc}") from None
    except ValueError:
        document = _parse_to_explain(body, max_depth)
    if isinstance(document, (dict, list)) and _too_deep(body, document, max_depth):
        raise Unprocessable(f"the JSON is nested deeper than {max_depth} levels")
    return document


def _too_deep(body: bytes, document: Any, limit: int) -> bool:
    """Whether the parsed ``body`` nests deeper than ``limit`` (its bytes when they tell)."""
    depth = text_depth(body)
    return _exceeds_depth(document, limit) if depth is None else depth > limit


def _parse_to_explain(body: bytes, max_depth: int) -> Any:
    """The standard library's reading of a body orjson refused: its error as a 400 or 422."""
    try:
        return json.loads(body, parse_constant=_reject_constant, parse_float=_finite_float)
    except RecursionError:
        raise Unprocessable(f"the JSON is nested deeper than {max_depth} levels") from None
    except json.JSONDecodeError as exc:
        raise BadRequest(f"malformed JSON: {exc}") from None
    except UnicodeDecodeError as exc:
        raise BadRequest(f"the body is not UTF-8 text: {exc}") from None
    except ValueError as exc:
        raise Unprocessable(str(exc)) from None


def envelope_from(
    document: Any, query: Mapping[str, list[str]], operation: Operation
) -> dict[str, Any]:
    """One request envelope from a body (bare workspace or envelope) and query options.

    Query options (``test_poi``, ``test_stat``, ``calctype``, ``ntoys``, ``measurement``, ...,
    named like pyhf's CLI options) fill in what the body does not give.
    """
    if not isinstance(document, dict):
        raise Unprocessable(
            f"the body is a JSON {type(document).__name__}; expected an object: a HistFactory "
            "workspace or a request envelope with 'workspace' or 'workspace_id'"
        )
    if "workspace" in document or "workspace_id" in document:
        envelope = dict(document)
    elif "channels" in document:
        envelope = {"workspace": document}
    else:
        raise Unprocessable(
            "the body is neither a HistFactory workspace (it has no 'channels') nor a request "
            f"envelope (it has no 'workspace' or 'workspace_id'); its keys: {sorted(document)[:10]}"
        )
    fields = operation.options_model.model_fields
    allowed = set(fields) | {"measurement"}
    for raw_name, values in query.items():
        name = raw_name.replace("-", "_")
        if name not in allowed:
            raise Unprocessable(
                f"unknown query parameter {raw_name!r} for {operation.name}; known: "
                f"{sorted(allowed)}"
            )
        listed = len(values) > 1 or (name in fields and _list_only(fields[name], values))
        value: Any = values if listed else values[-1]
        envelope.setdefault(name, value)
    return envelope


def _list_only(field: pydantic.fields.FieldInfo, values: list[str]) -> bool:
    """Whether an option takes the query's one value only as a list (an upper-limit
    ``scan``), not as itself (a ``test_poi`` number, a ``test_stat`` name)."""
    if field.annotation is None:  # no type: takes neither (as TypeAdapter(None) would say)
        return False
    adapter = pydantic.TypeAdapter(field.annotation)
    for candidate, verdict in ((values[-1], False), (values, True)):
        try:
            adapter.validate_python(candidate)
        except pydantic.ValidationError:
            continue
        return verdict
    return False


# ----------------------------------------------------------------------------------------- plans
@dataclass(frozen=True)
class Row:
    """One hypothesis, or a part of its work: an element (by its patch digest), for CLs the
    tested POI, and ``part``, the slice ``first .. stop - 1`` of the hypothesis' work it does
    (:meth:`Operation.parts <.operations.Operation.parts>`: the toys a toy-based test draws,
    the parameters a ranking refits). The parts' results are joined into the hypothesis'
    answer: a row never holds the device for all of a long hypothesis at once."""

    element: str
    poi: float | None = None
    part: tuple[int, int] | None = None

    @property
    def hypothesis(self) -> tuple[str, float | None]:
        """What its parts have in common (the hypothesis it answers)."""
        return self.element, self.poi

    def toy_slice(self, ntoys: int) -> ToySlice:
        """Its toys, of the hypothesis' ``ntoys``, as the inference layer draws them: the
        stream keyed by its hypothesis (the same toys whatever rows or requests it runs
        with, however it is sliced)."""
        if self.part is None:
            raise ValueError("a row without a part draws no toys")
        digest = hashlib.blake2b(repr(self.hypothesis).encode(), digest_size=8).digest()
        return ToySlice(int.from_bytes(digest, "little"), *self.part, ntoys)


@dataclass(frozen=True)
class Plan:
    """A validated request: its operation and options, its background, one patch per element,
    the tested POI values (operations with ``pois_field``) and how to shape the answer
    (``named``: ``{patch_name: result}``; ``poi_list``: a list over the POI values)."""

    operation: Operation
    options: BaseModel
    background: Background
    patches: tuple[PatchSpec, ...]
    named: bool
    pois: tuple[float, ...] | None
    poi_list: bool

    def rows(self, elements: Sequence[Element]) -> list[Row]:
        """Elements x POIs, element-major; a hypothesis whose operation cuts its work in
        parts (:meth:`Operation.parts <.operations.Operation.parts>`) as consecutive rows, one
        a part."""
        rows = []
        for element in elements:
            parts: Sequence[tuple[int, int] | None] = self.operation.parts(
                self.options, element.layout
            ) or [None]
            for poi in self.pois or (None,):
                rows += [Row(element.patch.digest, poi, part) for part in parts]
        return rows

    @property
    def n_rows(self) -> int:
        """Hypotheses in the whole request."""
        return len(self.patches) * len(self.pois or (None,))

    @property
    def n_work_rows(self) -> int:
        """Rows the scheduler runs for the whole request (what progress counts), as far as
        known before its patches are read: its hypotheses times their parts (toy slices, or
        ranked parameters named in the options; the dispatcher says the count once the
        patches are read)."""
        return self.n_rows * len(self.operation.parts(self.options, None) or [None])

    @property
    def row_cost(self) -> float:
        """About how many fits one row (or toy slice) takes (sizes the chunks of jobs by
        time)."""
        return self.operation.row_cost(self.options)

    @property
    def toys(self) -> int:
        """Toys in the whole request (both hypotheses counted once, as pyhf's ``ntoys``)."""
        return self.operation.toys(self.options) * self.n_rows

    def checked(self, element: Element) -> Element:
        """``element``, or its error if this plan's operation cannot be answered on it."""
        problem = (
            None
            if element.layout is None
            else self.operation.element_problem(element.layout, self.options)
        )
        if problem is None:
            return element
        return replace(element, layout=None, error=Unprocessable(problem))

    @cached_property
    def batch_group(self) -> tuple[Any, ...]:
        """What the rows of requests that may share an engine call have in common before
        their patches are read: the background, operation and options (the tested POI values
        aside: they are the rows'). Toy-based rows too: a row's toys follow from the seed
        and its hypothesis (:meth:`Row.toy_slice`), so a request gives the same numbers alone
        or in company."""
        pois = {self.operation.pois_field} if self.operation.pois_field else set()
        options = self.options.model_dump_json(exclude=pois)
        return (self.background.key, self.operation.name, options)

    def batch_key(self, stack_key: str) -> tuple[Any, ...]:
        """Rows with equal keys share an engine call: the same :attr:`batch_group` and
        stackable elements (channels, bins, POI, interpolation codes), whatever their patches
        and requests."""
        return (self.batch_group, stack_key)


def plan_request(
    operation: Operation,
    envelope: dict[str, Any],
    store: WorkspaceStore,
    persist: bool = False,
    caller: str | None = None,
) -> Plan:
    """Validate ``envelope`` for ``operation`` and resolve its model inputs (4xx on bad input).

    With ``persist``, an inline workspace is also stored on disk (jobs refer to it by id), as
    ``caller``'s; a ``workspace_id`` must be ``caller``'s (404 otherwise; ``None``: no check).
    """
    try:
        request = operation.request_model.model_validate(envelope)
    except pydantic.ValidationError as exc:
        raise Unprocessable(pydantic_detail(exc)) from None
    background, patches, named = resolve_source(request, store, persist, caller)
    options = operation.options_of(request)
    if operation.pois_field is None:
        return Plan(operation, options, background, patches, named, None, False)
    tested = getattr(options, operation.pois_field)
    is_list = isinstance(tested, list)
    pois = tuple(float(v) for v in tested) if is_list else (float(tested),)
    return Plan(operation, options, background, patches, named, pois, is_list)


def resolve_source(
    request: ModelSelection, store: WorkspaceStore, persist: bool, caller: str | None = None
) -> tuple[Background, tuple[PatchSpec, ...], bool]:
    """The background of a request (a stored one: ``caller``'s), its elements' patches, and
    whether they are named (a patchset). Inline ``patches`` are applied together: one
    element."""
    if request.workspace is not None:
        digest = store.admit(request.workspace, persist, caller)
        spec = request.workspace
    else:
        digest = request.workspace_id or ""
        spec = store.get(digest, caller)
    background = Background(
        spec, digest, _measurement(spec, request.measurement), request.modifier_settings
    )
    if request.patchset is not None:
        patchset = _load_patchset(request.patchset, digest)
        names = _patch_names(patchset, request.patch_names)
        patches = tuple(
            PatchSpec(name, patch_digest(patchset[name]), tuple(patchset[name])) for name in names
        )
        return background, patches, True
    operations = [
        op for i, p in enumerate(request.patches) for op in _patch_operations(p, f"patches[{i}]")
    ]
    name = "patch" if operations else "nominal"
    digest = patch_digest(operations) if operations else ""
    return background, (PatchSpec(name, digest, tuple(operations)),), False


def patch_digest(operations: list[dict[str, Any]]) -> str:
    """The id of a patch's operations on its background: sha256 of their JSON, keys sorted
    (orjson, not ``pyhf.utils.digest``'s ``json.dumps``: patches are named by this id only
    inside the server, so its spelling need not be pyhf's).

    Example:
        >>> patch_digest([{"op": "remove", "path": "/channels/1"}]) == patch_digest(
        ...     [{"path": "/channels/1", "op": "remove"}])
        True
    """
    return hashlib.sha256(orjson.dumps(operations, option=orjson.OPT_SORT_KEYS)).hexdigest()


def _measurement(spec: dict[str, Any], name: str | None) -> str:
    """The measurement's name (default: the first); 422 naming the choices if unknown."""
    names = [m["name"] for m in spec["measurements"]]
    if name is None:
        return names[0]
    if name not in names:
        raise Unprocessable(f"measurement {name!r} is not in the workspace; it has {names}")
    return name


def _patch_operations(patch: list[dict[str, Any]] | dict[str, Any], where: str) -> list:
    """The JSON-patch operations of a patch (a list, or a pyhf Patch ``{metadata, patch}``)."""
    operations = patch.get("patch") if isinstance(patch, dict) else patch
    if not isinstance(operations, list):
        raise Unprocessable(f"{where} is neither a JSON patch (a list) nor {{'patch': [...]}}")
    check_schema(operations, "jsonpatch.json", where)
    return operations


def _load_patchset(spec: dict[str, Any], workspace_digest: str) -> dict[str, list]:
    """The operations of each patch of a validated patchset made for this workspace
    (pyhf's schema and digest checks, as ``pyhf.PatchSet`` and its ``verify``)."""
    check_schema(spec, "patchset.json", "patchset")
    expected = spec["metadata"]["digests"].get("sha256")
    if expected is not None and expected != workspace_digest:
        raise Unprocessable(
            f"the patchset was made for workspace sha256 {expected}, not this one "
            f"({workspace_digest}); pyhf's PatchSet.verify would refuse it"
        )
    patches: dict[str, list] = {}
    values: set[tuple] = set()
    labels = spec["metadata"]["labels"]
    for patch in spec["patches"]:  # pyhf.PatchSet's checks, in its words
        name, value = patch["metadata"]["name"], tuple(patch["metadata"]["values"])
        if name in patches:
            raise Unprocessable(f"InvalidPatchSet: Multiple patches were defined by name {name!r}.")
        if value in values:
            raise Unprocessable(
                f"InvalidPatchSet: Multiple patches were defined by values {list(value)}."
            )
        if len(value) != len(labels):
            raise Unprocessable(
                f"InvalidPatchSet: Incompatible number of values ({len(value)}) for patch "
                f"{name!r} in patchset. Expected {len(labels)}."
            )
        patches[name] = patch["patch"]
        values.add(value)
    return patches


def _patch_names(patchset: dict[str, list], wanted: list[str] | None) -> tuple[str, ...]:
    """The selected patch names (default: all), each checked to exist."""
    available = list(patchset)
    if wanted is None:
        return tuple(available)
    unknown = [name for name in wanted if name not in available]
    if unknown:
        raise Unprocessable(
            f"patch names {unknown[:10]} are not in the patchset; it has {available[:30]}"
        )
    if not wanted:
        raise Unprocessable("'patch_names' is empty")
    return tuple(wanted)
