"""Running plans: translated elements, stacked warm models, batched rows, answers.

:class:`Dispatcher` translates a plan's elements (:mod:`.elements`, build thread), queues
their rows (the scheduler, which joins rows of many requests on one background into one
stacked model: :class:`BatchModels`, its combiner, with the model cache) and assembles the
answer. The engine call per batch is the scheduler's runner's
(:class:`pyhf_gpu_server.execution.Runner`), through the operation's
:meth:`~.operations.Operation.run`; the call types live in :mod:`pyhf_gpu_server.execution`
(re-exported here).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field, replace
from functools import cached_property, partial
from typing import Any

import torch
from pydantic import BaseModel

from pyhf_gpu_server.engine import HistFactoryModel
from pyhf_gpu_server.engine.layout import ElementLayout
from pyhf_gpu_server.engine.sparsity import layout_per_bin_count
from pyhf_gpu_server.engine.stacking import partition, split_reason
from pyhf_gpu_server.engine.translate import ignored_observations
from pyhf_gpu_server.execution import (
    BatchContext,
    ComputedRow,
    EngineCall,
    ModelRecipe,
    run_rows,
    use_operations,
)
from pyhf_gpu_server.inference.mle import FitOptions
from pyhf_gpu_server.inference.toys import TOY_BLOCK

from .admission import (
    FitLimits,
    FitMemory,
    FitPlan,
    ModelShape,
    assembly_numbers,
    likelihood_refusal,
    toy_bytes,
)
from .elements import Element, ElementStore
from .errors import ServiceError, Unprocessable, translate
from .models_cache import ModelCache
from .operations import Operation, operation_named
from .requests import Plan, Row
from .scheduler import Lane, RowOutcome, Scheduler, WorkItem
from .schemas import ResultMeta

__all__ = [  # the call types, from pyhf_gpu_server.execution, as this module has long named them
    "BatchContext",
    "ComputedRow",
    "EngineCall",
    "ModelRecipe",
    "run_rows",
]

# an engine call names its operation; calls that carry no registry of their own (tests, local
# workers' shares of the Dispatcher's calls carry one) look it up in the service's
use_operations(operation_named)


# -------------------------------------------------------------------------- batches and device
@dataclass(frozen=True)
class WorkContext:
    """What one work item (the rows of one group of stackable elements of one request) brings
    to a batch: its elements, by patch digest, and the operation with its options."""

    background_key: tuple[str, ...]
    operation: Operation
    options: BaseModel
    elements: tuple[Element, ...]
    row_cost: float


# ------------------------------------------------------------------------------------ answers
def joined(
    operation: Operation, rows: Sequence[Row], outcomes: Sequence[RowOutcome[ComputedRow]]
) -> Iterator[tuple[Row, RowOutcome[ComputedRow]]]:
    """Each hypothesis with its outcome: the parts of one (consecutive rows) joined by
    ``operation`` (:meth:`~.operations.Operation.join`), computed in the engine calls that
    ran them (``batch_rows``: the most rows of any; ``compute_s``: all of them)."""
    groups: list[list[tuple[Row, RowOutcome[ComputedRow]]]] = []
    for row, outcome in zip(rows, outcomes, strict=True):
        # a new hypothesis, or the first part of one tested again (a POI value given twice)
        starts = not groups or row.part is None or row.part[0] == 0
        if starts or row.hypothesis != groups[-1][0][0].hypothesis:
            groups.append([])
        groups[-1].append((row, outcome))
    for pairs in groups:
        row, first = pairs[0]
        if row.part is None:
            yield pairs[0]
            continue
        parts = [outcome for _, outcome in pairs]
        calls = {outcome.call: outcome for outcome in parts}
        result = operation.join([outcome.value.result for outcome in parts])
        yield (
            Row(*row.hypothesis),
            RowOutcome(
                replace(first.value, result=result),
                max(outcome.batch_rows for outcome in parts),
                sum(outcome.compute_s for outcome in calls.values()),
                first.call,
            ),
        )


def _ignored_observations(plan: Plan, elements: Sequence[Element]) -> dict[str, list[str]]:
    """Patch digest -> the notices of its element's observations that name a channel the
    element does not have (ignored, as pyhf ignores them), where it has any."""
    found = {}
    for element in elements:
        if element.layout is not None:
            channels = [name for name, _ in element.layout.channels]
            operations = element.patch.operations
            notices = ignored_observations(plan.background.workspace, operations, channels)
            if notices:
                found[element.patch.digest] = notices
    return found


def finite_json(value: Any) -> Any:
    """``value`` as JSON, with NaN/inf floats as ``null`` (JSON has no such numbers); a
    pydantic model as its fields that were set, in their order (``model_dump(exclude_unset=
    True)``, in the same one pass).

    >>> finite_json({"a": [1.0, float("nan")], "b": ResultMeta.model_construct(dtype="f")})
    {'a': [1.0, None], 'b': {'dtype': 'f'}}
    """
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, BaseModel):
        given = value.model_fields_set
        return {k: finite_json(getattr(value, k)) for k in type(value).model_fields if k in given}
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


def _error_of(element: Element) -> ServiceError:
    """Why ``element`` (one without a layout) cannot be tested."""
    if element.error is None:
        return Unprocessable(f"patch {element.patch.name!r} could not be translated")
    return element.error


def patch_error(error: ServiceError) -> dict[str, Any]:
    """The answer of a patch that could not be tested, in place of its result."""
    return {"error": {"status": error.status_code, "detail": error.detail}}


ServiceScheduler = Scheduler[WorkContext, BatchContext, Row, ComputedRow]


@dataclass
class _Submission:
    """One group of stackable elements of a request, queued as one work item."""

    elements: list[Element]
    rows: list[Row]
    item: WorkItem[WorkContext, Row, ComputedRow]
    split_reason: str | None

    @cached_property
    def names(self) -> dict[str, str]:
        """Patch digest -> patch name, of its elements."""
        return {e.patch.digest: e.patch.name for e in self.elements}


class BatchModels:
    """The scheduler's combiner: the models (batch contexts) a batch's work items run with,
    joined into one stacked model where they stack, warm from the model ``cache`` (built on
    ``build_executor`` on a miss) on ``device`` in ``dtype``; engine calls split by ``limits``
    (none: no bound). Without a ``cache`` (cluster mode) no model is built here: batches carry
    their model's recipe and the scheduler's runner hands them to the workers."""

    def __init__(
        self,
        cache: ModelCache | None,
        build_executor: Executor,
        device: str,
        dtype: torch.dtype,
        limits: FitLimits | None = None,
        fit_memory: FitMemory | None = None,
    ) -> None:
        self.cache = cache
        self.build_executor = build_executor
        self.device = device
        self.dtype = dtype
        self.dtype_name = str(dtype).removeprefix("torch.")
        self.limits = limits
        self.fit_memory = fit_memory or FitMemory()

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
        budget = None if self.limits is None else self.limits.stack_budget
        groups = [
            [digests[i] for i in group]
            for group in partition([e.layout for e in elements.values()], budget)
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
        """The batch context of a model stacking ``elements``: warm from the cache (built on
        the build thread on a miss), or in cluster mode its recipe only."""
        digests = tuple(e.patch.digest for e in elements)
        layouts = tuple(e.layout for e in elements)
        recipe = ModelRecipe(
            (*context.background_key, digests, self.dtype_name), layouts, self.dtype_name
        )
        cached = None
        if self.cache is None:
            shape = stack_shape(layouts)
        else:
            key = (*context.background_key, digests, self.device, self.dtype_name)
            cached = await self.cache.get(key, partial(recipe.build, self.device))
            shape = model_shape(cached.model)
        max_rows = FitOptions().max_rows  # also bounds the time of one iteration (stop checks)
        fit_plan = FitPlan("auto", 0) if self.limits is None else self.limits.fit_plan(shape)
        toy_rows, toy_row_bytes = None, 0
        if self.limits is not None:
            max_rows = min(max_rows, self.limits.rows_per_call(fit_plan))
            toys = 2 * min(context.operation.toys(context.options), TOY_BLOCK)  # signal, bkg
            if toys:
                toy_rows, fit_rows = self.limits.toy_call(fit_plan, shape, toys)
                toy_row_bytes = toys * toy_bytes(shape)
                max_rows = min(max_rows, fit_rows)
        call = EngineCall(
            context.operation.name,
            context.options,
            digests,
            max_rows,
            fit_plan,
            context.row_cost,
            toy_rows,
            toy_row_bytes,
            operations=operation_named,
        )
        return BatchContext(call, recipe, cached, self.fit_memory)


class Dispatcher:
    """Runs plans: elements from the warm backgrounds (build thread), rows through the
    scheduler, whose batches join the rows of every request on one background into one
    stacked model (its combiner, :class:`BatchModels`), JSON back."""

    def __init__(
        self, models: BatchModels, scheduler: ServiceScheduler, elements: ElementStore
    ) -> None:
        """Serve the models of ``models`` (its device, dtype, limits, fit memory: the
        scheduler's combiner); translate on its build executor."""
        self.models = models
        self.limits = models.limits
        self.fit_memory = models.fit_memory
        self.cache = models.cache
        self.scheduler = scheduler
        self.elements = elements
        self.build_executor = models.build_executor
        self.device = models.device
        self.dtype = models.dtype
        self.dtype_name = models.dtype_name

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
        try:
            elements, submissions, translate_s = await self._submit(plan, lane, on_progress)
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
        ignored = _ignored_observations(plan, elements)
        for submission, found in zip(submissions, outcomes, strict=True):
            for row, outcome in joined(plan.operation, submission.rows, found):
                meta = self._meta(plan, row, outcome, submission, timings)
                if row.element in ignored:
                    meta.ignored_observations = ignored[row.element]
                answer = outcome.value.result.answer
                by_element.setdefault(row.element, []).append(  # JSON here, at the edge
                    {**finite_json(answer), "meta": finite_json(meta)}
                )
        results = []
        per_element = len(plan.pois or (None,))
        for element in elements:
            if element.layout is None:
                results.extend([patch_error(_error_of(element))] * per_element)
            else:
                results.extend(by_element[element.patch.digest][:per_element])
                del by_element[element.patch.digest][:per_element]
        return assemble(plan, results)

    async def _submit(
        self, plan: Plan, lane: Lane, on_progress: Callable[[int, int], None] | None
    ) -> tuple[list[Element], list[_Submission], float]:
        """Translate the plan's patches (build thread) and queue their rows, one item per
        stackable group: the elements, the submissions, the seconds translating took. Batches
        of the plan's group queued meanwhile wait for these rows (:meth:`Scheduler.preparing`).
        """
        start = time.perf_counter()
        with self.scheduler.preparing(plan.batch_group, lane):
            elements = await asyncio.get_running_loop().run_in_executor(
                self.build_executor, self.elements.elements, plan.background, plan.patches
            )
            elements = [self._admitted(plan.checked(e)) for e in elements]
            translate_s = time.perf_counter() - start
            valid = [e for e in elements if e.layout is not None]
            if not valid:
                if not plan.named:
                    raise _error_of(elements[0])
                raise Unprocessable(
                    "no patch can be tested: "
                    + "; ".join(f"{e.patch.name}: {_error_of(e).detail}" for e in elements[:10])
                )
            budget = None if self.limits is None else self.limits.stack_budget
            layouts = [e.layout for e in valid]
            groups = [[valid[i] for i in group] for group in partition(layouts, budget)]
            rows = [plan.rows(members) for members in groups]
            progress = _Progress(sum(len(r) for r in rows), on_progress)
            progress.start()
            submissions: list[_Submission] = []
            for members, group_rows in zip(groups, rows, strict=True):
                context = WorkContext(
                    plan.background.key, plan.operation, plan.options, tuple(members), plan.row_cost
                )
                cut = any(r.part is not None for r in group_rows) and plan.operation.long_parts(
                    plan.options, members[0].layout
                )
                item = self.scheduler.submit(
                    plan.batch_key(members[0].layout.stack_key),
                    context,
                    group_rows,
                    "jobs" if cut else lane,
                    progress.callback(),
                    plan.row_cost,
                    plan.batch_group,
                    first_of_request=not submissions,
                )
                reason = None
                if members is not groups[0]:
                    reason = split_reason(groups[0][0].layout, members[0].layout)
                submissions.append(_Submission(members, group_rows, item, reason))
        return elements, submissions, translate_s

    def admit(self, plan: Plan) -> None:
        """422 before any work when the plan asks for more than the limits allow in all."""
        if self.limits is None or not plan.toys:
            return
        refusal = self.limits.toys_refusal(plan.operation.toys(plan.options), plan.n_rows)
        if refusal is not None:
            raise Unprocessable(refusal)

    def _admitted(self, element: Element) -> Element:
        """``element``, or its 422 if its model can never be fitted within the limits."""
        if element.layout is None:
            return element
        refusal = likelihood_refusal(element.layout)
        if refusal is None and self.limits is not None:
            shape = layout_shape(element.layout)
            refusal = self.limits.refusal(shape)
            if refusal is not None and shape.solver != "low-rank":
                # the block solver may fit it: its per-bin parameters counted only now (a walk
                # over the layout's bins, kept off the path of the models that fit anyway)
                shape = replace(shape, n_per_bin=layout_per_bin_count(element.layout))
                refusal = self.limits.refusal(shape)
        if refusal is None:
            return element
        return replace(element, layout=None, error=Unprocessable(refusal))

    def _meta(
        self,
        plan: Plan,
        row: Row,
        outcome: RowOutcome[ComputedRow],
        submission: _Submission,
        timings: dict[str, float],
    ) -> ResultMeta:
        """How one row was computed: device, model, cache, batch, fit status, timings."""
        computed: ComputedRow = outcome.value
        status = computed.result.status
        item = submission.item
        queued = (item.started_at or item.enqueued_at) - item.enqueued_at
        meta = ResultMeta(
            device=computed.device or self.device,
            dtype=self.dtype_name,
            model_id=computed.model_id,
            cache="hit" if computed.hit else "miss",
            batch_rows=outcome.batch_rows,
            converged=status.converged,
            starts=status.starts,
            starts_agreed=status.starts_agreed,
            flags=[*status.flags(), *computed.result.flags],
            timings={
                **timings,
                "build_ms": round(computed.build_s * 1000, 3),
                "queue_ms": round(queued * 1000, 3),
                "compute_ms": round(outcome.compute_s * 1000, 3),
            },
        )
        if computed.worker is not None:
            meta.worker = computed.worker
        if computed.worker_s is not None:
            meta.timings["worker_ms"] = round(computed.worker_s * 1000, 3)
        if row.poi is not None:
            meta.test_poi = row.poi
        if plan.named:
            meta.patch = submission.names[row.element]
        if submission.split_reason is not None:
            meta.stacked_apart = submission.split_reason
        return meta

    async def combine(
        self, contexts: Sequence[WorkContext]
    ) -> list[tuple[BatchContext, list[int]]]:
        """:meth:`BatchModels.combine` (the scheduler's combiner)."""
        return await self.models.combine(contexts)


def layout_shape(layout: ElementLayout) -> ModelShape:
    """The sizes of one element's model that admission looks at (its per-bin parameters not
    counted: see ``Dispatcher._admitted``)."""
    constrained = set(layout.aux_param.tolist())
    poisson = set(layout.aux_param[layout.aux_is_poisson].tolist())
    return ModelShape(
        layout.n_pars,
        layout.n_main,
        len(layout.aux_param),
        layout.n_pars - len(constrained) + len(poisson),
        n_assembly=_layouts_assembly([layout], len(layout.histosys_params), common=True),
    )


def _layouts_assembly(layouts: Sequence[ElementLayout], n_histosys: int, common: bool) -> int:
    """:func:`~.admission.assembly_numbers` of ``layouts`` stacked, without stacking them:
    exact for one layout (``common``: all its samples in the common block); for several, a
    bound (at most the smallest element's samples are common to all, at most the largest's
    are one row's own), as :func:`stack_shape` has no stack to count."""
    n_main = layouts[0].n_main
    n_basis = layouts[0].samples[0].histosys.shape[0] if layouts[0].samples else 0
    width = n_basis * n_histosys
    samples = [len(layout.samples) for layout in layouts]
    entries = [sum(len(s.normsys_param) for s in layout.samples) for layout in layouts]
    depth = max(
        (max(map(len, s.multipliers), default=0) for layout in layouts for s in layout.samples),
        default=0,
    )
    if common:
        return assembly_numbers(n_main, samples[0] * n_main, width, n_histosys, entries[0], depth)
    shared = assembly_numbers(n_main, min(samples) * n_main, width, n_histosys, min(entries), depth)
    own = assembly_numbers(
        n_main, max(samples) * n_main, width, n_histosys, max(entries), depth, True
    )
    return shared + own


def stack_shape(layouts: Sequence[ElementLayout]) -> ModelShape:
    """:func:`model_shape` of the model stacking ``layouts``, without building it (cluster
    mode): parameters united by name, one auxiliary datum per constrained parameter, Poisson
    or not as the first element constraining it says (as :class:`StackLayout` does)."""
    sizes: dict[str, int] = {}
    poisson: dict[tuple[str, int], bool] = {}
    for layout in layouts:
        labels = [(p.name, i) for p in layout.parameters for i in range(p.n_parameters)]
        for parset in layout.parameters:
            sizes.setdefault(parset.name, parset.n_parameters)
        for column, is_poisson in zip(
            layout.aux_param.tolist(), layout.aux_is_poisson.tolist(), strict=True
        ):
            poisson.setdefault(labels[column], is_poisson)
    n_pars = sum(sizes.values())
    n_flat = n_pars - len(poisson) + sum(poisson.values())
    n_per_bin = layout_per_bin_count(list(layouts))
    histosys: set[str] = set()  # histosys parameters united by name, as the stack does
    for layout in layouts:
        names = [p.name for p in layout.parameters for _ in range(p.n_parameters)]
        histosys.update(names[i] for i in layout.histosys_params)
    n_assembly = _layouts_assembly(layouts, len(histosys), common=len(layouts) == 1)
    return ModelShape(n_pars, layouts[0].n_main, len(poisson), n_flat, n_per_bin, n_assembly)


def model_shape(model: HistFactoryModel) -> ModelShape:
    """The sizes of a (stacked) model that admission looks at."""
    n_flat = model.unconstrained.numel() + model.poisson_constrained.numel()
    n_per_bin = model.bin_parameters.n_per_bin
    main, n_main = model.main, model.n_main
    n_assembly = assembly_numbers(
        n_main,
        main.nominal.shape[-1],
        main.histosys_by_bin.shape[-1],
        main.histosys_params.shape[0],
        main.normsys_column.shape[-1],
        main.multiplier_params.shape[-2],
    )
    own = main.own_nominal.shape[-1]
    if own:
        n_assembly += assembly_numbers(
            n_main,
            own,
            main.own_histosys_coefficients.shape[1],
            main.own_histosys_params.shape[0],
            main.own_normsys_column.shape[-1],
            main.own_multiplier_params.shape[-2],
            per_column_histosys=True,
        )
    return ModelShape(model.n_pars, model.n_main, model.n_aux, n_flat, n_per_bin, n_assembly)


@dataclass
class _Progress:
    """Rows done over all the work items of one request, reported as one count."""

    total: int
    report: Callable[[int, int], None] | None
    done: dict[int, int] = field(default_factory=dict)

    def start(self) -> None:
        """Report no row done of the request's rows, as counted once its patches are read."""
        if self.report is not None:
            self.report(0, self.total)

    def callback(self) -> Callable[[int, int], None] | None:
        """The progress callback of the next work item."""
        report = self.report
        if report is None:
            return None
        slot = len(self.done)
        self.done[slot] = 0

        def update(done: int, _total: int) -> None:
            self.done[slot] = done
            report(sum(self.done.values()), self.total)

        return update
