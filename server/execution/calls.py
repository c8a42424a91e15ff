"""What one engine call is made of, wherever it runs (device thread, local worker, Dask worker).

Plain, picklable data: a model's :class:`ModelRecipe`, the :class:`EngineCall` on it, the
:class:`BatchContext` a runner gets and the :class:`ComputedRow` it answers per row. The
service's own types (its rows, fit memory, warm models, operations) are seen here only through
the small protocols below, so this package imports nothing of :mod:`pyhf_gpu_server.service`:
the service and the cluster both import it, and neither through the other.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Hashable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from pydantic import BaseModel
from torch import Tensor

from pyhf_gpu_server.engine import HistFactoryModel
from pyhf_gpu_server.engine.layout import ElementLayout
from pyhf_gpu_server.inference.curvature import Solver
from pyhf_gpu_server.inference.minimize import MinimizeOptions
from pyhf_gpu_server.inference.mle import FitOptions
from pyhf_gpu_server.inference.toys import ToySlice


# ------------------------------------------------------------------ what the service brings
class CallRow(Protocol):
    """One row of a call (the service's ``requests.Row``): its element (patch digest), tested
    POI value, its part of the hypothesis' work, and for a toy-based test the toys it draws."""

    @property
    def element(self) -> str: ...

    @property
    def poi(self) -> float | None: ...

    @property
    def part(self) -> tuple[int, int] | None: ...

    def toy_slice(self, ntoys: int) -> ToySlice: ...


class FitPlanLike(Protocol):
    """How a model's fits run (the service's ``admission.FitPlan``)."""

    @property
    def solver(self) -> Solver: ...

    @property
    def bytes_per_row(self) -> int: ...


class CallMemory(Protocol):
    """Where a call's fits are counted while they run (the service's ``admission.FitMemory``)."""

    def holding(
        self, rows: float, fit: Any, max_rows: int, besides: int = 0
    ) -> AbstractContextManager[None]: ...


class EngineOperation(Protocol):
    """One kind of question as an engine call sees it (the service's ``operations.Operation``):
    whether rows carry a tested POI, how many toys a row draws, and the one batched call."""

    @property
    def pois_field(self) -> str | None: ...

    def toys(self, options: Any) -> int: ...

    def run(self, model: HistFactoryModel, rows: Any, options: Any) -> list[Any]: ...


class WarmModel(Protocol):
    """A model warm in this process (the service's ``models_cache.CachedModel``)."""

    @property
    def model(self) -> Any: ...

    @property
    def model_id(self) -> str: ...

    @property
    def hit(self) -> bool: ...

    @property
    def build_s(self) -> float: ...


OperationLookup = Callable[[str], EngineOperation]
_operations: OperationLookup | None = None


def use_operations(lookup: OperationLookup) -> None:
    """The operation registry of calls that do not carry their own (``EngineCall.operations``
    None): set once by the service (:mod:`pyhf_gpu_server.service.dispatch`)."""
    global _operations
    _operations = lookup


def model_id(key: Hashable) -> str:
    """A short stable id for a model key (shown in results' meta and /info)."""
    return hashlib.sha256(repr(key).encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------- the call types
@dataclass(frozen=True)
class EngineRows:
    """The rows of one engine call, on the model's device: each row's element (index into
    the stacked model), tested POI value (operations with ``pois``) and the element's own
    parameter columns; and how the fits run (memory bound, solver, stop predicate)."""

    element: Tensor
    poi: Tensor | None
    columns: list[list[int]]
    fit: FitOptions
    toys: list[ToySlice] | None = None  # toy-based: the toys each row draws
    parts: list[tuple[int, int] | None] | None = None  # each row's part of its hypothesis

    def __len__(self) -> int:
        return self.element.shape[0]


@dataclass(frozen=True)
class ModelRecipe:
    """What a warm model is built from, wherever it is built: its key (background, patch
    digests, dtype) and its elements' layouts (numpy arrays: picklable, sent to a cluster
    worker or a local worker once)."""

    key: tuple[Any, ...]
    layouts: tuple[ElementLayout, ...]
    dtype: str

    @property
    def model_id(self) -> str:
        """The short id of :attr:`key` (results' meta, /info)."""
        return model_id(self.key)

    def share(self, digests: Sequence[str]) -> ModelRecipe:
        """The recipe of the model stacking only the elements ``digests`` (some of this one's,
        whose digests its key holds)."""
        *background, all_digests, dtype = self.key
        index = {digest: i for i, digest in enumerate(all_digests)}
        layouts = tuple(self.layouts[index[digest]] for digest in digests)
        return ModelRecipe((*background, tuple(digests), dtype), layouts, self.dtype)

    def build(self, device: str) -> HistFactoryModel:
        """The stacked model on ``device``."""
        return HistFactoryModel(list(self.layouts), device=device, dtype=getattr(torch, self.dtype))


@dataclass(frozen=True)
class EngineCall:
    """What one engine call runs besides its model and rows: the operation (by name) with its
    options, the model's elements (by patch digest) and how its fits run. Picklable: it
    travels to a local or cluster worker with the rows; ``operations``, the registry the name
    is looked up in, travels as a reference to a module-level function (None: the one given
    to :func:`use_operations`)."""

    operation: str
    options: BaseModel
    digests: tuple[str, ...]
    max_rows: int  # rows one minimiser call may fit (--max-fit-memory-mb)
    fit_plan: FitPlanLike  # the solver its fits use and what a row holds
    row_cost: float  # about how many fits a row runs (Plan.row_cost)
    # toy-based: rows one operation run takes, and the bytes each row's drawn toys hold
    toy_rows: int | None = None
    toy_row_bytes: int = 0
    operations: OperationLookup | None = None

    def engine_operation(self) -> EngineOperation:
        """The operation this call runs."""
        lookup = self.operations or _operations
        if lookup is None:
            raise RuntimeError("no operation registry: call execution.use_operations first")
        return lookup(self.operation)

    def engine_rows(
        self, model: HistFactoryModel, rows: Sequence[CallRow], stop: Callable[[], bool] | None
    ) -> EngineRows:
        """``rows`` as tensors on the model's device, with how their fits run."""
        operation = self.engine_operation()
        index = {digest: i for i, digest in enumerate(self.digests)}
        elements = [index[row.element] for row in rows]
        poi = None
        if operation.pois_field is not None:
            poi = torch.tensor([r.poi for r in rows], dtype=model.dtype, device=model.device)
        fit = FitOptions(
            minimize=MinimizeOptions(solver=self.fit_plan.solver),
            max_rows=self.max_rows,
            stop=stop,
        )
        ntoys = operation.toys(self.options)
        return EngineRows(
            torch.tensor(elements, dtype=torch.long, device=model.device),
            poi,
            [model.element_columns(e) for e in elements],
            fit,
            [row.toy_slice(ntoys) for row in rows] if ntoys else None,
            [row.part for row in rows],
        )

    def run(
        self,
        model: HistFactoryModel,
        rows: Sequence[CallRow],
        memory: CallMemory,
        stop: Callable[[], bool] | None = None,
    ) -> list[Any]:
        """ONE batched inference call for ``rows`` (the operation's ``run``: one result per
        row), its fits counted in ``memory``; they give up (``FitStopped``) between two
        iterations once ``stop()`` is true (nobody waits for the answer).

        It runs in ``torch.inference_mode`` (as does the kernels' warm-up, so the compiled
        ones are traced in the mode they run in): no autograd bookkeeping. The fits'
        derivatives are closed-form or ``torch.func`` transforms, which run in it.

        A toy-based call runs its rows ``toy_rows`` at a time, one after the other: a run
        holds every toy it draws at once, besides its fits (``FitLimits.toy_call``)."""
        size = self.toy_rows or max(len(rows), 1)
        results: list[Any] = []
        for start in range(0, len(rows), size):
            group = rows[start : start + size]
            toys = len(group) * self.toy_row_bytes
            with (
                memory.holding(len(group) * self.row_cost, self.fit_plan, self.max_rows, toys),
                torch.inference_mode(),
            ):
                engine_rows = self.engine_rows(model, group, stop)
                results += self.engine_operation().run(model, engine_rows, self.options)
        return results


@dataclass(frozen=True)
class BatchContext:
    """What a batch runs with: the engine call, the recipe of its stacked model and, in
    process, that model warm from the cache (None in cluster mode: the worker holds it)."""

    call: EngineCall
    recipe: ModelRecipe
    cached: WarmModel | None
    memory: CallMemory  # where the call's fits are counted while they run (in process)


@dataclass(frozen=True)
class ComputedRow:
    """One row's answer (the operation's row result) and the warm model it ran on (the same
    fields in process and from a worker, which also says who it is, its device and its own
    compute time)."""

    result: Any
    model_id: str
    hit: bool
    build_s: float
    device: str | None = None
    worker: str | None = None
    worker_s: float | None = None
