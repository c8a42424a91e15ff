"""From a request body to pyhf-shaped JSON: parse, validate, plan rows, build/run, assemble.

* :func:`parse_json` reads a body safely (no NaN/Infinity, bounded nesting).
* :func:`envelope_from` turns a bare workspace + query options, or an envelope, into one dict.
* :func:`plan_request` validates it and resolves the model inputs into a :class:`Plan`: one row
  per (element, test_poi) hypothesis.
* :func:`build_model` runs on the build thread, :func:`run_rows` on the device thread.
* :class:`Operations` ties the model cache and the scheduler together and assembles the answer.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import pydantic
import pyhf
import torch

from pyhf_gpu_server import inference
from pyhf_gpu_server.engine import HistFactoryModel
from pyhf_gpu_server.inference.results import group_parameters

from .errors import BadRequest, Unprocessable, pydantic_detail, translate
from .models_cache import CachedModel, ModelCache
from .scheduler import Lane, RowOutcome, Scheduler
from .schemas import OPTION_MODELS, REQUEST_MODELS, ModelSelection
from .workspace_store import WorkspaceStore


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


def _exceeds_depth(document: Any, limit: int) -> bool:
    """Whether ``document`` nests lists/objects deeper than ``limit``."""
    stack: list[tuple[Any, int]] = [(document, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node
        if depth > limit:
            return True
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


def parse_json(body: bytes, max_depth: int) -> Any:
    """The JSON document in ``body``: 400 if malformed, 422 if non-finite or nested too deep."""
    if not body.strip():
        raise BadRequest("the request body is empty; send a JSON workspace or request envelope")
    try:
        document = json.loads(body, parse_constant=_reject_constant, parse_float=_finite_float)
    except RecursionError:
        raise Unprocessable(f"the JSON is nested deeper than {max_depth} levels") from None
    except json.JSONDecodeError as exc:
        raise BadRequest(f"malformed JSON: {exc}") from None
    except UnicodeDecodeError as exc:
        raise BadRequest(f"the body is not UTF-8 text: {exc}") from None
    except ValueError as exc:
        raise Unprocessable(str(exc)) from None
    if isinstance(document, (dict, list)) and _exceeds_depth(document, max_depth):
        raise Unprocessable(f"the JSON is nested deeper than {max_depth} levels")
    return document


def envelope_from(document: Any, query: Mapping[str, list[str]], operation: str) -> dict[str, Any]:
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
    allowed = set(OPTION_MODELS[operation].model_fields) | {"measurement"}
    for raw_name, values in query.items():
        name = raw_name.replace("-", "_")
        if name not in allowed:
            raise Unprocessable(
                f"unknown query parameter {raw_name!r} for {operation}; known: {sorted(allowed)}"
            )
        value: Any = values if name == "test_poi" and len(values) > 1 else values[-1]
        envelope.setdefault(name, value)
    return envelope


# ----------------------------------------------------------------------------------------- plans
@dataclass(frozen=True)
class ModelSource:
    """Everything an engine model is built from, and the digests that identify it."""

    workspace: dict[str, Any]
    workspace_digest: str
    measurement: str
    patches: tuple[list[dict[str, Any]], ...]
    patchset: pyhf.PatchSet | None
    element_names: tuple[str, ...] | None
    patch_digests: tuple[str, ...]
    modifier_settings: dict[str, dict[str, str]] | None

    def key(self, device: str, dtype: str) -> tuple[Any, ...]:
        """The warm-cache key of this model on ``device`` in ``dtype``."""
        settings = json.dumps(self.modifier_settings, sort_keys=True)
        return (
            self.workspace_digest,
            self.measurement,
            self.element_names,
            self.patch_digests,
            settings,
            device,
            dtype,
        )


@dataclass(frozen=True)
class Row:
    """One hypothesis: an element of the model (a patch) and, for CLs, the tested POI."""

    element: int
    poi: float | None = None


@dataclass(frozen=True)
class Plan:
    """A validated request: its model, options and rows, and how to shape the answer."""

    operation: str
    source: ModelSource
    options: dict[str, Any]
    pois: tuple[float, ...] | None
    poi_list: bool

    @property
    def rows(self) -> list[Row]:
        """Elements x POIs, element-major."""
        elements = range(len(self.source.element_names or ("nominal",)))
        if self.pois is None:
            return [Row(e) for e in elements]
        return [Row(e, poi) for e in elements for poi in self.pois]

    def batch_key(self, model_key: tuple[Any, ...]) -> tuple[Any, ...]:
        """Rows with equal keys may share an engine call.

        Toy-based tests batch only within one request: their toys are drawn per call, so a
        request gives the same numbers alone or in company.
        """
        options = tuple(sorted((k, _hashable(v)) for k, v in self.options.items()))
        private = uuid.uuid4().hex if self.options.get("calctype") == "toybased" else None
        return (model_key, self.operation, options, private)


def _hashable(value: Any) -> Any:
    """Lists (e.g. an upper-limit scan) as tuples."""
    return tuple(value) if isinstance(value, list) else value


def plan_request(
    operation: str, envelope: dict[str, Any], store: WorkspaceStore, persist: bool = False
) -> Plan:
    """Validate ``envelope`` for ``operation`` and resolve its model inputs (4xx on bad input).

    With ``persist``, an inline workspace is also stored on disk (jobs refer to it by id).
    """
    try:
        request = REQUEST_MODELS[operation].model_validate(envelope)
    except pydantic.ValidationError as exc:
        raise Unprocessable(pydantic_detail(exc)) from None
    source = resolve_source(request, store, persist)
    options = request.model_dump(exclude=set(ModelSelection.model_fields) | {"test_poi"})
    test_poi = getattr(request, "test_poi", None)
    if test_poi is None:
        return Plan(operation, source, options, None, False)
    is_list = isinstance(test_poi, list)
    pois = tuple(test_poi) if is_list else (float(test_poi),)
    return Plan(operation, source, options, pois, is_list)


def resolve_source(request: ModelSelection, store: WorkspaceStore, persist: bool) -> ModelSource:
    """Load/validate the workspace, measurement, patches and patchset of a request."""
    if request.workspace is not None:
        digest = store.admit(request.workspace, persist)
        spec = request.workspace
    else:
        digest = request.workspace_id or ""
        spec = store.get(digest)
    measurement = _measurement(spec, request.measurement)
    patches = tuple(_patch_operations(p, f"patches[{i}]") for i, p in enumerate(request.patches))
    patchset, names = None, None
    if request.patchset is not None:
        patchset = _load_patchset(request.patchset, digest)
        names = _patch_names(patchset, request.patch_names)
        digests = tuple(pyhf.utils.digest(patchset[name].patch) for name in names)
    else:
        digests = tuple(pyhf.utils.digest(p) for p in patches)
    return ModelSource(
        spec, digest, measurement, patches, patchset, names, digests, request.modifier_settings
    )


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
    try:
        pyhf.schema.validate(operations, "jsonpatch.json")
    except pyhf.exceptions.InvalidSpecification as exc:
        raise translate(exc, where) from None
    return operations


def _load_patchset(spec: dict[str, Any], workspace_digest: str) -> pyhf.PatchSet:
    """A validated pyhf PatchSet made for this workspace (pyhf's digest check)."""
    try:
        patchset = pyhf.PatchSet(spec)
    except Exception as exc:
        raise (translate(exc, "patchset") or Unprocessable(f"invalid patchset: {exc}")) from None
    expected = patchset.digests.get("sha256")
    if expected is not None and expected != workspace_digest:
        raise Unprocessable(
            f"the patchset was made for workspace sha256 {expected}, not this one "
            f"({workspace_digest}); pyhf's PatchSet.verify would refuse it"
        )
    return patchset


def _patch_names(patchset: pyhf.PatchSet, wanted: list[str] | None) -> tuple[str, ...]:
    """The selected patch names (default: all), each checked to exist."""
    available = [p.name for p in patchset.patches]
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


# -------------------------------------------------------------------------- build and device
@dataclass(frozen=True)
class BatchContext:
    """What the device thread needs besides the rows: the model and the options."""

    model: HistFactoryModel
    operation: str
    options: dict[str, Any]


def build_model(source: ModelSource, device: str, dtype: torch.dtype) -> HistFactoryModel:
    """The engine model of ``source`` (runs on the build thread)."""
    common: dict[str, Any] = {
        "measurement": source.measurement,
        "modifier_settings": source.modifier_settings,
        "device": device,
        "dtype": dtype,
    }
    if source.patchset is not None:
        return HistFactoryModel.from_patchset(
            source.workspace,
            source.patchset,
            patch_names=list(source.element_names or ()),
            **common,
        )
    return HistFactoryModel.from_workspace(source.workspace, patches=source.patches, **common)


def run_rows(
    context: BatchContext, rows: Sequence[Row]
) -> list[tuple[dict[str, Any], bool | None]]:
    """ONE batched inference call for ``rows``; per row its pyhf JSON and fit status."""
    model = context.model
    element = torch.tensor([r.element for r in rows], dtype=torch.long, device=model.device)
    options = context.options
    if context.operation == "cls":
        test_poi = torch.tensor([r.poi for r in rows], dtype=model.dtype, device=model.device)
        result = inference.hypotest(model, test_poi, element=element, **options)
        return [(result.to_pyhf_json(i), _flag(result, i)) for i in range(len(rows))]
    if context.operation == "fit":
        fitted = inference.fit(model, element=element)
        return [(_fit_json(fitted, i), _flag(fitted, i)) for i in range(len(rows))]
    if context.operation == "upper-limit":
        scan = options["scan"]
        scan_tensor = (
            None if scan is None else torch.tensor(scan, dtype=model.dtype, device=model.device)
        )
        limits = inference.upper_limit(
            model, element=element, scan=scan_tensor, level=options["level"]
        )
        return [(limits.to_json(i), _flag(limits, i)) for i in range(len(rows))]
    found = inference.significance(model, element=element)
    return [(found.to_json(i), _flag(found, i)) for i in range(len(rows))]


def _flag(result: Any, i: int) -> bool | None:
    """Row ``i``'s ``converged`` flag, when the result has one."""
    converged = getattr(result, "converged", None)
    return None if converged is None else bool(converged[i])


def _fit_json(fitted: Any, i: int) -> dict[str, Any]:
    """`pyhf fit --value` JSON plus uncertainties (grouped like the parameters) and corr_mat."""
    return {
        **fitted.to_pyhf_json(i),
        "uncertainties": group_parameters(fitted.labels, fitted.uncertainty[i].tolist()),
        "corr_mat": fitted.corr_mat[i].tolist(),
    }


# ------------------------------------------------------------------------------------ answers
def finite_json(value: Any) -> Any:
    """``value`` with NaN/inf floats as ``null`` (JSON has no such numbers)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(v) for v in value]
    return value


def _chunks(values: list[Any], size: int) -> Iterator[list[Any]]:
    """``values`` in consecutive chunks of ``size``."""
    for start in range(0, len(values), size):
        yield values[start : start + size]


def assemble(plan: Plan, results: list[dict[str, Any]]) -> Any:
    """Shape row results: one result, a list over test_poi, and/or a dict by patch name."""
    per_element = [
        chunk if plan.poi_list else chunk[0] for chunk in _chunks(results, len(plan.pois or (0,)))
    ]
    if plan.source.element_names is None:
        return per_element[0]
    return dict(zip(plan.source.element_names, per_element, strict=True))


class Operations:
    """Runs plans: warm model from the cache, rows through the scheduler, JSON back."""

    def __init__(
        self,
        cache: ModelCache,
        scheduler: Scheduler,
        device: str,
        dtype: torch.dtype,
    ) -> None:
        """Serve models on ``device`` in ``dtype``."""
        self.cache = cache
        self.scheduler = scheduler
        self.device = device
        self.dtype = dtype
        self.dtype_name = str(dtype).removeprefix("torch.")

    async def run(
        self,
        plan: Plan,
        lane: Lane = "interactive",
        on_progress: Callable[[int, int], None] | None = None,
    ) -> Any:
        """The pyhf-shaped answer of ``plan`` (library errors become 4xx :class:`ServiceError`)."""
        start = time.perf_counter()
        model_key = plan.source.key(self.device, self.dtype_name)
        build = partial(build_model, plan.source, self.device, self.dtype)
        try:
            cached = await self.cache.get(model_key, build)
            context = BatchContext(cached.model, plan.operation, plan.options)
            rows = plan.rows
            item = self.scheduler.submit(
                plan.batch_key(model_key), context, rows, lane, on_progress
            )
            try:
                outcomes = await item.future
            except asyncio.CancelledError:
                self.scheduler.cancel(item)
                raise
        except Exception as exc:
            raise (translate(exc) or exc) from None
        timings = {
            "build_ms": round(cached.build_s * 1000, 3),
            "queue_ms": round(((item.started_at or item.enqueued_at) - item.enqueued_at) * 1000, 3),
            "total_ms": round((time.perf_counter() - start) * 1000, 3),
        }
        results = [
            finite_json(
                {**outcome.value[0], "meta": self._meta(plan, row, outcome, cached, timings)}
            )
            for row, outcome in zip(rows, outcomes, strict=True)
        ]
        return assemble(plan, results)

    def _meta(
        self,
        plan: Plan,
        row: Row,
        outcome: RowOutcome,
        cached: CachedModel,
        timings: dict[str, float],
    ) -> dict[str, Any]:
        """How one row was computed: device, model, cache, batch, fit status, timings."""
        meta: dict[str, Any] = {
            "device": self.device,
            "dtype": self.dtype_name,
            "model_id": cached.model_id,
            "cache": "hit" if cached.hit else "miss",
            "batch_rows": outcome.batch_rows,
            "converged": outcome.value[1],
            "timings": {**timings, "compute_ms": round(outcome.compute_s * 1000, 3)},
        }
        if row.poi is not None:
            meta["test_poi"] = row.poi
        if plan.source.element_names is not None:
            meta["patch"] = plan.source.element_names[row.element]
        return meta
