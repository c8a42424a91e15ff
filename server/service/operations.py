"""From a request body to pyhf-shaped JSON: parse, validate, plan rows, build/run, assemble.

* :func:`parse_json` reads a body safely (no NaN/Infinity, bounded nesting).
* :func:`envelope_from` turns a bare workspace + query options, or an envelope, into one dict.
* :func:`plan_request` validates it and resolves the model inputs into a :class:`Plan`: one row
  per (element, test_poi) hypothesis.
* :class:`Operations` translates the elements (:mod:`.elements`, build thread), stacks them
  into warm models (the model cache), queues their rows (the scheduler, which joins rows of
  many requests on one background: :meth:`Operations.combine`) and assembles the answer;
  :func:`run_rows` is the one engine call per batch, on the device thread.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import pydantic
import pyhf
import torch

from pyhf_gpu_server import inference
from pyhf_gpu_server.engine import HistFactoryModel, schema
from pyhf_gpu_server.engine.errors import UnrepresentableValueError
from pyhf_gpu_server.engine.layout import ElementLayout
from pyhf_gpu_server.engine.stacking import partition, split_reason
from pyhf_gpu_server.inference.minimize import MinimizeOptions
from pyhf_gpu_server.inference.mle import FitOptions
from pyhf_gpu_server.inference.results import group_parameters

from .admission import FitLimits, FitMemory, FitPlan, ModelShape
from .elements import Background, Element, ElementStore, PatchSpec
from .errors import BadRequest, ServiceError, Unprocessable, pydantic_detail, translate
from .models_cache import CachedModel, ModelCache
from .scheduler import Lane, RowOutcome, Scheduler, WorkItem
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


_SCALARS = frozenset({int, float, str, bool, type(None)})


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
    if isinstance(document, (dict, list)) and _exceeds_depth(document, max_depth):
        raise Unprocessable(f"the JSON is nested deeper than {max_depth} levels")
    return document


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
        listed = name == "scan" or (name == "test_poi" and len(values) > 1)
        value: Any = values if listed else values[-1]
        envelope.setdefault(name, value)
    return envelope


# ----------------------------------------------------------------------------------------- plans
@dataclass(frozen=True)
class Row:
    """One hypothesis: an element (by its patch digest) and, for CLs, the tested POI."""

    element: str
    poi: float | None = None


@dataclass(frozen=True)
class Plan:
    """A validated request: its background, one patch per element, options, and how to shape
    the answer (``named``: ``{patch_name: result}``)."""

    operation: str
    background: Background
    patches: tuple[PatchSpec, ...]
    named: bool
    options: dict[str, Any]
    pois: tuple[float, ...] | None
    poi_list: bool

    def rows(self, patches: Sequence[PatchSpec]) -> list[Row]:
        """Elements x POIs, element-major."""
        if self.pois is None:
            return [Row(p.digest) for p in patches]
        return [Row(p.digest, poi) for p in patches for poi in self.pois]

    @property
    def n_rows(self) -> int:
        """Hypotheses in the whole request."""
        return len(self.patches) * len(self.pois or (None,))

    @property
    def row_cost(self) -> float:
        """About how many fits one row takes (sizes the chunks of jobs by time): four for an
        asymptotic test (free and conditional, data and Asimov), three per toy (the free fit
        of each signal and background toy, the conditional fit of about half), four per point
        of an upper-limit scan (about a dozen when the limit is searched for)."""
        toys = 3 * self.options["ntoys"] if self.options.get("calctype") == "toybased" else 0
        if self.operation == "fit":
            return 2.0  # the fit and its Hessian
        if self.operation == "upper-limit":
            return 4.0 * len(self.options.get("scan") or range(12))
        return 4.0 + toys

    def tested_outside_bounds(self, layout: ElementLayout) -> str | None:
        """Why this plan's POI values (``test_poi``, an upper-limit ``scan``) cannot be tested
        on ``layout``: a value outside the POI's bounds (raised to 0 by ``q~``, which every
        upper limit uses), where pyhf refuses to start a fit; None if all are inside."""
        values = self.pois if self.operation == "cls" else self.options.get("scan")
        if not values or layout.poi_index is None:
            return None
        lo, hi = (float(v) for v in layout.bounds[layout.poi_index])
        floored = self.options.get("test_stat", "qtilde") == "qtilde" and lo < 0.0
        if floored:
            lo = 0.0
        outside = [v for v in values if not lo <= v <= hi]
        if not outside:
            return None
        field = "test_poi" if self.operation == "cls" else "scan"
        why = " (q~, test_stat 'qtilde', bounds the POI below at 0)" if floored else ""
        return (
            f"{field} value {outside[0]!r} lies outside the bounds [{lo!r}, {hi!r}] of the POI "
            f"{layout.poi_name!r}{why}; pyhf refuses to start a fit there: test values inside "
            "the bounds, or widen them in the measurement's parameters"
        )

    def checked(self, element: Element) -> Element:
        """``element``, or its error if this plan's POI values cannot be tested on it."""
        problem = None if element.layout is None else self.tested_outside_bounds(element.layout)
        if problem is None:
            return element
        return replace(element, layout=None, error=Unprocessable(problem))

    def batch_key(self, stack_key: str) -> tuple[Any, ...]:
        """Rows with equal keys may share an engine call: the same background, stackable
        elements (channels, bins, POI, interpolation codes), operation and options, whatever
        their patches and requests.

        Toy-based tests batch only within one request: their toys are drawn per call, so a
        request gives the same numbers alone or in company.
        """
        options = tuple(sorted((k, _hashable(v)) for k, v in self.options.items()))
        private = uuid.uuid4().hex if self.options.get("calctype") == "toybased" else None
        return (self.background.key, stack_key, self.operation, options, private)


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
    background, patches, named = resolve_source(request, store, persist)
    options = request.model_dump(exclude=set(ModelSelection.model_fields) | {"test_poi"})
    test_poi = getattr(request, "test_poi", None)
    if test_poi is None:
        return Plan(operation, background, patches, named, options, None, False)
    is_list = isinstance(test_poi, list)
    pois = tuple(test_poi) if is_list else (float(test_poi),)
    return Plan(operation, background, patches, named, options, pois, is_list)


def resolve_source(
    request: ModelSelection, store: WorkspaceStore, persist: bool
) -> tuple[Background, tuple[PatchSpec, ...], bool]:
    """The background of a request, its elements' patches, and whether they are named (a
    patchset). Inline ``patches`` are applied together: one element."""
    if request.workspace is not None:
        digest = store.admit(request.workspace, persist)
        spec = request.workspace
    else:
        digest = request.workspace_id or ""
        spec = store.get(digest)
    background = Background(
        spec, digest, _measurement(spec, request.measurement), request.modifier_settings
    )
    if request.patchset is not None:
        patchset = _load_patchset(request.patchset, digest)
        names = _patch_names(patchset, request.patch_names)
        patches = tuple(
            PatchSpec(name, pyhf.utils.digest(patchset[name]), tuple(patchset[name]))
            for name in names
        )
        return background, patches, True
    operations = [
        op for i, p in enumerate(request.patches) for op in _patch_operations(p, f"patches[{i}]")
    ]
    name = "patch" if operations else "nominal"
    digest = pyhf.utils.digest(operations) if operations else ""
    return background, (PatchSpec(name, digest, tuple(operations)),), False


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
        schema.validate(operations, "jsonpatch.json")
    except pyhf.exceptions.InvalidSpecification as exc:
        raise translate(exc, where) from None
    return operations


def _load_patchset(spec: dict[str, Any], workspace_digest: str) -> dict[str, list]:
    """The operations of each patch of a validated patchset made for this workspace
    (pyhf's schema and digest checks, as ``pyhf.PatchSet`` and its ``verify``)."""
    try:
        schema.validate(spec, "patchset.json")
    except pyhf.exceptions.InvalidSpecification as exc:
        raise translate(exc, "patchset") from None
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


# -------------------------------------------------------------------------- batches and device
@dataclass(frozen=True)
class WorkContext:
    """What one work item (the rows of one group of stackable elements of one request) brings
    to a batch: its elements, by patch digest, and the operation with its options."""

    background_key: tuple[str, ...]
    operation: str
    options: dict[str, Any]
    elements: tuple[Element, ...]
    row_cost: float


@dataclass(frozen=True)
class BatchContext:
    """What an engine call needs besides its rows: a warm model stacking the rows' elements
    (identified by patch digest), and the operation with its options."""

    operation: str
    options: dict[str, Any]
    cached: CachedModel
    digests: tuple[str, ...]
    max_rows: int  # rows one minimiser call may fit (--max-fit-memory-mb)
    fit_plan: FitPlan  # the solver its fits use and what a row holds
    row_cost: float  # about how many fits a row runs (Plan.row_cost)
    memory: FitMemory  # where the call's fits are counted while they run

    def element_of(self, rows: Sequence[Row]) -> list[int]:
        """The model's element index of each row."""
        index = {digest: i for i, digest in enumerate(self.digests)}
        return [index[row.element] for row in rows]


@dataclass(frozen=True)
class RowResult:
    """One row's answer from the device: its pyhf JSON, fit status (converged, start points
    fitted, whether they agreed), and the model it ran on."""

    payload: dict[str, Any]
    converged: bool | None
    starts: int | None
    starts_agreed: bool | None
    model: CachedModel


def run_rows(
    context: BatchContext, rows: Sequence[Row], stop: Callable[[], bool] | None = None
) -> list[RowResult]:
    """ONE batched inference call for ``rows``; its fits give up (``FitStopped``) between two
    iterations once ``stop()`` is true (nobody waits for the answer)."""
    rows_in_flight = len(rows) * context.row_cost
    with context.memory.holding(rows_in_flight, context.fit_plan, context.max_rows):
        return _run_rows(context, rows, stop)


def _run_rows(
    context: BatchContext, rows: Sequence[Row], stop: Callable[[], bool] | None
) -> list[RowResult]:
    model = context.cached.model
    element = torch.tensor(context.element_of(rows), dtype=torch.long, device=model.device)
    options = context.options
    fitting = FitOptions(
        minimize=MinimizeOptions(solver=context.fit_plan.solver),
        max_rows=context.max_rows,
        stop=stop,
    )
    if context.operation == "cls":
        test_poi = torch.tensor([r.poi for r in rows], dtype=model.dtype, device=model.device)
        result = inference.hypotest(model, test_poi, element=element, options=fitting, **options)
        payloads = [result.to_pyhf_json(i) for i in range(len(rows))]
    elif context.operation == "fit":
        result = inference.fit(model, element=element, options=fitting)
        columns = [model.element_columns(e) for e in element.tolist()]
        payloads = [_fit_json(result, i, columns[i]) for i in range(len(rows))]
    elif context.operation == "upper-limit":
        scan = options["scan"]
        scan_tensor = (
            None if scan is None else torch.tensor(scan, dtype=model.dtype, device=model.device)
        )
        result = inference.upper_limit(
            model, element=element, scan=scan_tensor, level=options["level"], options=fitting
        )
        payloads = [result.to_json(i) for i in range(len(rows))]
    else:
        result = inference.significance(model, element=element, options=fitting, **options)
        payloads = [result.to_json(i) for i in range(len(rows))]
    statuses = _fit_statuses(result, len(payloads))
    return [
        RowResult(p, *status, model=context.cached)
        for p, status in zip(payloads, statuses, strict=True)
    ]


def _fit_statuses(result: Any, rows: int) -> list[tuple[bool | None, int | None, bool | None]]:
    """Per row: ``converged``, ``starts`` and ``starts_agreed``, where the result has them
    (copied to the host once per result, not once per row)."""
    columns = []
    for name in ("converged", "starts", "starts_agreed"):
        value = getattr(result, name, None)
        columns.append([None] * rows if value is None else value.tolist())
    return list(zip(*columns, strict=True))


def _fit_json(fitted: Any, i: int, columns: list[int]) -> dict[str, Any]:
    """`pyhf fit --value` JSON plus uncertainties (grouped like the parameters) and corr_mat,
    over the element's own parameters (a stacked element holds the others fixed)."""
    own = fitted.select(slice(i, i + 1)).restrict(columns)
    return {
        **own.to_pyhf_json(0),
        "uncertainties": group_parameters(own.labels, own.uncertainty[0].tolist()),
        "corr_mat": own.corr_mat[0].tolist(),
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
    per_element = [  # an untestable patch answers one error entry, whatever the POI list
        chunk if plan.poi_list and "error" not in chunk[0] else chunk[0]
        for chunk in _chunks(results, len(plan.pois or (0,)))
    ]
    if not plan.named:
        return per_element[0]
    return dict(zip((p.name for p in plan.patches), per_element, strict=True))


def patch_error(error: ServiceError) -> dict[str, Any]:
    """The answer of a patch that could not be tested, in place of its result."""
    return {"error": {"status": error.status_code, "detail": error.detail}}


@dataclass
class _Submission:
    """One group of stackable elements of a request, queued as one work item."""

    elements: list[Element]
    rows: list[Row]
    item: WorkItem
    split_reason: str | None


class Operations:
    """Runs plans: elements from the warm backgrounds (build thread), rows through the
    scheduler, whose batches join the rows of every request on one background into one
    stacked model (:meth:`combine`, the model cache), JSON back."""

    def __init__(
        self,
        cache: ModelCache,
        scheduler: Scheduler,
        elements: ElementStore,
        build_executor: Executor,
        device: str,
        dtype: torch.dtype,
        limits: FitLimits | None = None,
        fit_memory: FitMemory | None = None,
    ) -> None:
        """Serve models on ``device`` in ``dtype``; translate and build on ``build_executor``;
        refuse models and split engine calls by ``limits`` (none: no bound)."""
        self.limits = limits
        self.fit_memory = fit_memory or FitMemory()
        self.cache = cache
        self.scheduler = scheduler
        self.elements = elements
        self.build_executor = build_executor
        self.device = device
        self.dtype = dtype
        self.dtype_name = str(dtype).removeprefix("torch.")

    async def run(
        self,
        plan: Plan,
        lane: Lane = "interactive",
        on_progress: Callable[[int, int], None] | None = None,
    ) -> Any:
        """The pyhf-shaped answer of ``plan`` (library errors become 4xx :class:`ServiceError`).

        Patches of a patchset that cannot be tested answer their own error; the request fails
        only when none can."""
        self.admit(plan)
        start = time.perf_counter()
        submissions: list[_Submission] = []
        try:
            elements = await asyncio.get_running_loop().run_in_executor(
                self.build_executor, self.elements.elements, plan.background, plan.patches
            )
            elements = [self._admitted(plan.checked(e)) for e in elements]
            translate_s = time.perf_counter() - start
            valid = [e for e in elements if e.layout is not None]
            if not valid:
                if not plan.named:
                    raise elements[0].error
                raise Unprocessable(
                    "no patch can be tested: "
                    + "; ".join(f"{e.patch.name}: {e.error.detail}" for e in elements[:10])
                )
            groups = [[valid[i] for i in group] for group in partition([e.layout for e in valid])]
            rows = [plan.rows([e.patch for e in members]) for members in groups]
            progress = _Progress(sum(len(r) for r in rows), on_progress)
            for members, group_rows in zip(groups, rows, strict=True):
                context = WorkContext(
                    plan.background.key, plan.operation, plan.options, tuple(members), plan.row_cost
                )
                key = plan.batch_key(members[0].layout.stack_key)
                item = self.scheduler.submit(
                    key, context, group_rows, lane, progress.callback(), plan.row_cost
                )
                reason = None
                if members is not groups[0]:
                    reason = split_reason(groups[0][0].layout, members[0].layout)
                submissions.append(_Submission(members, group_rows, item, reason))
            try:
                outcomes = await asyncio.gather(*(s.item.future for s in submissions))
            except BaseException:
                for submission in submissions:
                    self.scheduler.cancel(submission.item)
                raise
        except Exception as exc:
            raise (translate(exc) or exc) from None
        timings = {
            "translate_ms": round(translate_s * 1000, 3),
            "total_ms": round((time.perf_counter() - start) * 1000, 3),
        }
        by_element: dict[str, list[dict[str, Any]]] = {}
        for submission, found in zip(submissions, outcomes, strict=True):
            for row, outcome in zip(submission.rows, found, strict=True):
                meta = self._meta(plan, row, outcome, submission, timings)
                by_element.setdefault(row.element, []).append(
                    finite_json({**outcome.value.payload, "meta": meta})
                )
        results = []
        per_element = len(plan.pois or (None,))
        for element in elements:
            if element.layout is None:
                results.extend([patch_error(element.error)] * per_element)
            else:
                results.extend(by_element[element.patch.digest][:per_element])
                del by_element[element.patch.digest][:per_element]
        return assemble(plan, results)

    def admit(self, plan: Plan) -> None:
        """422 before any work when the plan asks for more than the limits allow in all."""
        if self.limits is None or plan.options.get("calctype") != "toybased":
            return
        refusal = self.limits.toys_refusal(plan.options["ntoys"], plan.n_rows)
        if refusal is not None:
            raise Unprocessable(refusal)

    def _admitted(self, element: Element) -> Element:
        """``element``, or its 422 if its model can never be fitted within the limits."""
        if element.layout is None or self.limits is None:
            return element
        refusal = self.limits.refusal(layout_shape(element.layout))
        if refusal is None:
            return element
        return replace(element, layout=None, error=Unprocessable(refusal))

    def _meta(
        self,
        plan: Plan,
        row: Row,
        outcome: RowOutcome,
        submission: _Submission,
        timings: dict[str, float],
    ) -> dict[str, Any]:
        """How one row was computed: device, model, cache, batch, fit status, timings."""
        result: RowResult = outcome.value
        item = submission.item
        queued = (item.started_at or item.enqueued_at) - item.enqueued_at
        meta: dict[str, Any] = {
            "device": self.device,
            "dtype": self.dtype_name,
            "model_id": result.model.model_id,
            "cache": "hit" if result.model.hit else "miss",
            "batch_rows": outcome.batch_rows,
            "converged": result.converged,
            "starts": result.starts,
            "starts_agreed": result.starts_agreed,
            "timings": {
                **timings,
                "build_ms": round(result.model.build_s * 1000, 3),
                "queue_ms": round(queued * 1000, 3),
                "compute_ms": round(outcome.compute_s * 1000, 3),
            },
        }
        if row.poi is not None:
            meta["test_poi"] = row.poi
        if plan.named:
            meta["patch"] = next(
                e.patch.name for e in submission.elements if e.patch.digest == row.element
            )
        if submission.split_reason is not None:
            meta["stacked_apart"] = submission.split_reason
        return meta

    async def combine(
        self, contexts: Sequence[WorkContext]
    ) -> list[tuple[BatchContext, list[int]]]:
        """The models for the work items of one batch (``contexts``, one per item): one stack
        of all their elements, so that distinct signals from many requests run in one engine
        call; items whose elements do not stack with the rest get their own. Answers
        (context, indices of the items it serves); models come warm from the cache or are
        built on the build thread."""
        if len(contexts) == 1:  # one request's group: stackable already (partitioned in run)
            return [(await self._batch(contexts[0], contexts[0].elements), [0])]
        elements: dict[str, Element] = {}
        for context in contexts:
            for element in context.elements:
                elements.setdefault(element.patch.digest, element)
        digests = list(elements)
        groups = [
            [digests[i] for i in group]
            for group in partition([e.layout for e in elements.values()])
        ]
        served: dict[int, list[int]] = {}
        alone: list[int] = []
        for index, context in enumerate(contexts):
            own = {e.patch.digest for e in context.elements}
            group = next((g for g, members in enumerate(groups) if own <= set(members)), None)
            if group is None:
                alone.append(index)
            else:
                served.setdefault(group, []).append(index)
        first = contexts[0]
        answer = []
        for group, items in served.items():
            answer.append((await self._batch(first, [elements[d] for d in groups[group]]), items))
        for index in alone:
            answer.append((await self._batch(first, list(contexts[index].elements)), [index]))
        return answer

    async def _batch(self, context: WorkContext, elements: Sequence[Element]) -> BatchContext:
        """The batch context of a warm model stacking ``elements``."""
        digests = tuple(e.patch.digest for e in elements)
        key = (*context.background_key, digests, self.device, self.dtype_name)
        layouts = [e.layout for e in elements]
        build = partial(HistFactoryModel, layouts, device=self.device, dtype=self.dtype)
        cached = await self.cache.get(key, build)
        model = cached.model
        max_rows = FitOptions().max_rows  # also bounds the time of one iteration (stop checks)
        shape = model_shape(model)
        fit_plan = FitPlan("auto", 0) if self.limits is None else self.limits.fit_plan(shape)
        if self.limits is not None:
            max_rows = min(max_rows, self.limits.rows_per_call(fit_plan))
        return BatchContext(
            context.operation,
            context.options,
            cached,
            digests,
            max_rows,
            fit_plan,
            context.row_cost,
            self.fit_memory,
        )


def layout_shape(layout: ElementLayout) -> ModelShape:
    """The sizes of one element's model that admission looks at."""
    constrained = set(layout.aux_param.tolist())
    poisson = set(layout.aux_param[layout.aux_is_poisson].tolist())
    return ModelShape(
        layout.n_pars,
        layout.n_main,
        len(layout.aux_param),
        layout.n_pars - len(constrained) + len(poisson),
    )


def model_shape(model: HistFactoryModel) -> ModelShape:
    """The sizes of a (stacked) model that admission looks at."""
    n_flat = model.unconstrained.numel() + model.poisson_constrained.numel()
    return ModelShape(model.n_pars, model.n_main, model.n_aux, n_flat)


class _Progress:
    """Rows done over all the work items of one request, reported as one count."""

    def __init__(self, total: int, report: Callable[[int, int], None] | None) -> None:
        self.total = total
        self.report = report
        self.done: dict[int, int] = {}

    def callback(self) -> Callable[[int, int], None] | None:
        """The progress callback of the next work item."""
        if self.report is None:
            return None
        slot = len(self.done)
        self.done[slot] = 0

        def update(done: int, _total: int) -> None:
            self.done[slot] = done
            self.report(sum(self.done.values()), self.total)

        return update
