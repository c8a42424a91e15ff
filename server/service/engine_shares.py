"""An engine call's elements shared between the device thread and idle local workers (CPU).

On a CPU device a fit iteration is mostly torch's per-operation dispatch from Python, which
one process cannot spread over two cores: intra-op threads help only the largest tensors, and
two Python threads take turns on the GIL. :class:`EngineShares`, the scheduler's runner in
process when the server has local workers that take engine shares (:mod:`.local_workers`,
``fork(..., engine=True)``), splits a batch's elements (or a lone element's rows) into shares:
one for each idle worker, one for the device thread. A worker fits its share's rows on its own
warm model of those elements (built from their layouts, which travel once per model and
worker), the device thread fits its share on the batch's model, one intra-op thread each
(:func:`intra_op_threads`). A row's fits depend on its own element's data only, so its answer
is the same (to rounding, as any two stacks holding the element) wherever it is fitted.

A toy row's draws follow its own hypothesis and slice (:mod:`~pyhf_gpu_server.inference.toys`),
so the slices of toy rows are shared as other rows are. Not shared: batches of one row, and
any batch while every worker is busy (translating, or fitting another batch). A worker
that fails on its share, or dies, or does not answer within its bound costs time only: the
device thread fits that share too (the worker is given up after a death or a stall). Once
nobody waits for the rows, the worker's fits stop between two iterations (its stop flag).
"""

from __future__ import annotations

import logging
import pickle
import select
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, Any, cast

import torch

from pyhf_gpu_server.inference.errors import FitStopped

from . import warmup
from .admission import FitMemory
from .dispatch import BatchContext, ComputedRow, run_rows
from .local_workers import MISSING
from .models_cache import CacheEntry, WarmModels, host_memory_releaser, memory_releaser, model_bytes
from .operations import RowResult
from .requests import Row

if TYPE_CHECKING:
    from .local_workers import LocalWorkers, _Worker

log = logging.getLogger("pyhf_gpu_server.service")

MIN_UNITS = 2  # a batch of fewer units (elements, or rows of one) stays on the device thread
#: the bound on a worker's answer once the device thread's own share is done: this, plus
#: ``WAIT_FACTOR`` times what that share took (the shares are alike, element for element)
WAIT_S = 30.0
WAIT_FACTOR = 4.0
RECEIVE_S = 10.0  # the bound on reading an answer that has begun to arrive
POLL_S = 0.1  # how often a waiting device thread asks whether anybody still waits
STOP_WAIT_S = 5.0  # the bound on a told-to-stop worker's last answer
KEPT_MODELS = 8  # warm models a worker keeps (LRU), and at most these bytes of them
KEPT_MODEL_BYTES = 2 * 2**30
KEPT_MODEL_KEYS = 64  # model keys the server remembers having sent a worker


@contextmanager
def intra_op_threads(count: int) -> Iterator[None]:
    """The calling thread's torch intra-op threads set to ``count`` while the block runs.

    OpenMP's thread count is per calling thread: the device thread's own fits run on one core
    while a worker process fits on the other (a second OpenMP thread of the device thread
    spins against the workers, and against any other process on a shared node)."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class EngineShares:
    """The scheduler's runner (in process, CPU): :func:`~.dispatch.run_rows`, with the
    batch's elements shared with the idle local workers."""

    def __init__(self, workers: LocalWorkers) -> None:
        self.workers = workers

    def __call__(
        self, context: BatchContext, rows: Sequence[Row], stop: Callable[[], bool] | None = None
    ) -> list[ComputedRow]:
        """ONE engine call's answers for ``rows``, in their order: the rows shared with the
        idle workers, the rest fitted here on one intra-op thread (:func:`intra_op_threads`)."""
        with intra_op_threads(1):
            units = _units(context, rows)
            helpers = self.workers.idle(len(units) - 1) if len(units) >= MIN_UNITS else []
            if not helpers:
                return run_rows(context, rows, stop)
            asked: list[_Share] = []
            try:
                parts = len(helpers) + 1
                shares = [sorted(i for u in units[k::parts] for i in u) for k in range(parts)]
                own = shares[0]
                for worker, indices in zip(helpers, shares[1:], strict=True):
                    share = _Share(worker, indices, context, [rows[i] for i in indices])
                    if self._ask(share):
                        asked.append(share)
                    else:
                        own += indices
                shared = bool(asked)
                computed: list[ComputedRow | None] = [None] * len(rows)
                start = time.monotonic()
                mine = run_rows(context, [rows[i] for i in own], stop)
                for i, row in zip(own, mine, strict=True):
                    computed[i] = row
                deadline = time.monotonic() + WAIT_S + WAIT_FACTOR * (time.monotonic() - start)
                while asked:
                    outcome = self._answer(asked[0], deadline, stop)
                    share = asked.pop(0)
                    found = None if outcome is None else share.computed(outcome)
                    if found is None:  # the worker failed on it: fitted here
                        found = run_rows(context, share.rows, stop)
                    for i, row in zip(share.indices, found, strict=True):
                        computed[i] = row
            finally:
                for share in asked:  # not answered (we raised): told to stop, its answer read
                    self._abandon(share)
                self.workers.release(helpers)
            self.workers.shared_batches += shared
            return cast(list[ComputedRow], computed)  # every index is in exactly one share

    def _ask(self, share: _Share) -> bool:
        """Send ``share`` to its worker (its model's layouts unless the worker holds it);
        whether it went."""
        worker = share.worker
        worker.stop_flag.value = 0
        try:
            worker.send(share.message(share.key not in worker.models))
        except (OSError, TypeError, ValueError, pickle.PicklingError) as exc:  # timeouts too
            self.workers.give_up(worker, f"could not send it work: {type(exc).__name__}: {exc}")
            return False
        if len(worker.models) >= KEPT_MODEL_KEYS:  # sent again when next needed
            worker.models.clear()
        worker.models.add(share.key)
        return True

    def _answer(self, share: _Share, deadline: float, stop: Callable[[], bool] | None) -> Any:
        """The worker's outcome of ``share`` (None: it gave none, fit them here);
        ``FitStopped`` once nobody waits (the caller then tells the worker to stop)."""
        worker = share.worker
        try:
            while True:
                if stop is not None and stop():
                    raise FitStopped("nobody waits for this batch any more")
                if time.monotonic() >= deadline:
                    raise TimeoutError("no answer in time")
                if not _readable(worker, POLL_S):
                    continue
                answer = worker.receive(time.monotonic() + RECEIVE_S)
                if answer != MISSING:
                    return pickle.loads(answer)
                worker.send(share.message(True))  # it let the model go: once more, with it
        except (OSError, EOFError, TimeoutError, pickle.UnpicklingError) as exc:
            self.workers.give_up(worker, f"no answer: {type(exc).__name__}: {exc}")
            return None

    def _abandon(self, share: _Share) -> None:
        """Stop the worker's fits of ``share`` and read (drop) its answer; a worker that does
        not answer within :data:`STOP_WAIT_S` is given up."""
        worker = share.worker
        if worker.broken:
            return
        worker.stop_flag.value = 1
        try:
            if not _readable(worker, STOP_WAIT_S):
                raise TimeoutError("no answer in time")
            worker.receive(time.monotonic() + RECEIVE_S)
        except (OSError, EOFError, TimeoutError) as exc:
            self.workers.give_up(worker, f"did not stop: {type(exc).__name__}: {exc}")


class _Share:
    """One worker's share of a batch: its rows (and their indices in the batch), the model
    of its elements and the engine call on it."""

    def __init__(
        self, worker: _Worker, indices: list[int], context: BatchContext, rows: list[Row]
    ) -> None:
        self.worker = worker
        self.indices = indices
        self.rows = rows
        self.context = context
        digests = tuple(dict.fromkeys(row.element for row in rows))
        self.recipe = context.recipe.share(digests)
        self.call = replace(context.call, digests=digests)

    @property
    def key(self) -> tuple[Any, ...]:
        return self.recipe.key

    def message(self, with_recipe: bool) -> bytes:
        """The share as the worker reads it (the recipe only with ``with_recipe``)."""
        recipe = self.recipe if with_recipe else None
        return pickle.dumps(("engine", self.key, recipe, self.call, tuple(self.rows)), protocol=5)

    def computed(self, outcome: Any) -> list[ComputedRow] | None:
        """The worker's ``outcome`` as the batch's rows (None: it failed on them)."""
        if isinstance(outcome, tuple) and outcome[0] == "stopped":
            raise FitStopped("nobody waits for this batch any more")
        if not (isinstance(outcome, tuple) and outcome[0] == "ok"):
            log.warning("a local worker failed on an engine share: %.300s", outcome)
            return None
        _, results, worker_s = outcome
        if len(results) != len(self.rows):
            log.warning("a local worker answered %d rows of %d", len(results), len(self.rows))
            return None
        cached = self.context.cached
        assert cached is not None  # in process: the batch's model is warm
        meta = (cached.model_id, cached.hit, cached.build_s, None, self.worker.name, worker_s)
        return [ComputedRow(result, *meta) for result in results]


def _units(context: BatchContext, rows: Sequence[Row]) -> list[list[int]]:
    """The indices of ``rows`` in the units shares are made of, in order: each element's
    rows (kept together: fewer models to build), or with one element each row; none when
    the batch cannot be shared (not in process)."""
    if context.cached is None:
        return []
    groups: dict[str, list[int]] = {}
    for i, row in enumerate(rows):
        groups.setdefault(row.element, []).append(i)
    return list(groups.values()) if len(groups) > 1 else [[i] for i in range(len(rows))]


def _readable(worker: _Worker, timeout_s: float) -> bool:
    """Whether the worker's answer has begun to arrive, waiting up to ``timeout_s``."""
    readable, _, _ = select.select([worker.channel], [], [], timeout_s)
    return bool(readable)


# -------------------------------------------------------------------------------- the worker
def worker_models() -> WarmModels:
    """In a worker, once: one intra-op thread, torch's first kernels and fits paid, and the
    LRU of the models it fits shares on."""
    torch.set_num_threads(1)
    warmup.infer(warmup.build("cpu", torch.float64))
    return WarmModels(KEPT_MODELS, KEPT_MODEL_BYTES)


def answer(models: WarmModels, message: tuple, stop_flag: Any) -> bytes:
    """In a worker: the pickled outcome of one share, ``("ok", results, seconds)``,
    ``("stopped", why)`` or ``("failed", why)``; or :data:`MISSING` (the model is not held
    here and its recipe did not come)."""
    try:
        key, recipe, call, rows = message
        entry = models.lookup(key)
        if entry is None:
            if recipe is None:
                return MISSING
            start = time.perf_counter()
            model = recipe.build("cpu")
            entry = CacheEntry(model, model_bytes(model), time.perf_counter() - start)
            if models.insert(key, entry):
                memory_releaser("cpu")()
        start = time.perf_counter()
        memory = FitMemory(release=host_memory_releaser("cpu"))
        results: list[RowResult] = call.run(entry.model, rows, memory, lambda: stop_flag.value != 0)
        return pickle.dumps(("ok", results, time.perf_counter() - start), protocol=5)
    except FitStopped as exc:
        return pickle.dumps(("stopped", str(exc)))
    except Exception as exc:  # the server fits the share itself (and meets the error there)
        return pickle.dumps(("failed", f"{type(exc).__name__}: {exc}"))
