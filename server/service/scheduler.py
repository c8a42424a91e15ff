"""The batching queue: compatible work from every request and job becomes one engine call.

Callers :meth:`Scheduler.submit` a :class:`WorkItem`: a batch key (same model, operation and
options), a context (the model and options the runner needs) and rows (hypotheses). The
dispatcher takes the oldest pending item, waits up to ``max_batch_delay`` for more rows with the
same key (until ``max_batch_size`` rows are there, or none arrived for ``batch_gap``), and
runs the rows as ONE call of the runner on the device thread (a single worker that owns the
device). Each caller gets its own rows' results back. An item larger than ``max_batch_size``
runs in several chunks, with progress reported after each.

Callers announce interactive work on its way: requests being read and checked, whose batch
group is not known yet (:meth:`Scheduler.arriving`), then work being prepared
(:meth:`Scheduler.preparing`: a request whose patches are being translated) by its batch
group, what items whose rows may share a call have in common before their rows exist (the
background, operation and options). While such work is under way, an interactive batch
waits for it (arriving work, or prepared work of its group), up to ``prepare_wait`` after
its oldest item was queued: those rows would otherwise wait for the whole engine call, which
lasts as long as its slowest fit however few rows it has, and run in a second one.

Two lanes: ``interactive`` (HTTP requests) is always served before ``jobs`` (asynchronous jobs,
not delayed for batching), and jobs run in chunks sized by time: as many rows as fit in
``job_chunk_s`` at the measured seconds per unit of row cost of their batch key (each item says
what a row costs, e.g. the fits of a toy slice; a key not yet measured runs one row first, its
time unknown until then), at least one row and at most ``max_batch_size``. So a large
patchset or toy job (whose rows are slices of toys) delays an interactive request by at most
one such chunk. Jobs are not starved by a steady stream of requests either: once the jobs
lane has waited ``JOB_SHARE_ROUNDS`` chunk lengths since it last ran, its next chunk goes
before the interactive lane (jobs keep at least a fifth of a busy device).

A device out-of-memory error splits the batch in halves and retries; a single row that still
does not fit fails with 503.

``max_in_flight`` batches run at once (each on its own executor thread): 1 in process (one
device), the number of live workers in cluster mode (:mod:`pyhf_gpu_server.cluster`), where a
batch's engine call runs on a Dask worker. The next batch is picked whenever one finishes, by
the same rules (interactive first, job chunks, fair share).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Hashable, Iterator, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar

from pyhf_gpu_server.execution import is_out_of_memory

from .errors import QueueFull, Unavailable
from .metrics import Metrics

log = logging.getLogger("pyhf_gpu_server.service.scheduler")

Lane = Literal["interactive", "jobs"]
LANES: tuple[Lane, ...] = ("interactive", "jobs")
WorkT = TypeVar("WorkT")  # what an item brings (the service's WorkContext)
BatchT = TypeVar("BatchT")  # what an engine call runs with (the service's BatchContext)
RowT = TypeVar("RowT")  # one hypothesis (the service's Row)
ValueT = TypeVar("ValueT")  # one row's answer (the service's ComputedRow)
# (context, rows, stop) -> one value per row; ``stop()`` turns true once nobody waits for
# any of the rows (their callers disconnected, timed out or cancelled): the runner may give up
Runner = Callable[[BatchT, Sequence[RowT], Callable[[], bool]], list[ValueT]]
# contexts of a batch's items -> (context to run with, indices of the items it serves)
Combiner = Callable[[Sequence[WorkT]], Awaitable[list[tuple[BatchT, list[int]]]]]
ProgressCallback = Callable[[int, int], None]
# How many ``job_chunk_s`` the jobs lane may wait behind interactive work before it runs a chunk
JOB_SHARE_ROUNDS = 4


@dataclass(frozen=True)
class RowOutcome(Generic[ValueT]):
    """One row's result and the engine call that produced it (``call``: its number)."""

    value: ValueT
    batch_rows: int
    compute_s: float
    call: int = 0


@dataclass(eq=False)
class WorkItem(Generic[WorkT, RowT, ValueT]):
    """Rows with one batch key, submitted by one caller; ``future`` resolves to their outcomes."""

    key: Hashable
    context: WorkT
    rows: Sequence[RowT]
    lane: Lane
    future: asyncio.Future[list[RowOutcome[ValueT]]]
    on_progress: ProgressCallback | None = None
    row_cost: float = 1.0  # what one row costs, in about fits (sizes the chunks of jobs)
    group: Hashable | None = None  # its batch group (see Scheduler.preparing); None: its own
    enqueued_at: float = field(default_factory=time.monotonic)
    started_at: float | None = None
    taken: int = 0
    done: int = 0
    outcomes: list[RowOutcome[ValueT] | None] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        """Whether the caller has its answer (or gave up)."""
        return self.future.done()

    @property
    def remaining(self) -> int:
        """Rows not yet handed to the device."""
        return len(self.rows) - self.taken


@dataclass(frozen=True)
class _Slice:
    """Rows ``start:stop`` of one item, as part of a batch."""

    item: WorkItem
    start: int
    stop: int


class Scheduler(Generic[WorkT, BatchT, RowT, ValueT]):
    """Collects rows into batches and runs them, one batch at a time, on the device executor."""

    def __init__(
        self,
        runner: Runner[BatchT, RowT, ValueT],
        executor: Executor,
        metrics: Metrics,
        *,
        max_batch_size: int,
        max_batch_delay_s: float,
        max_pending: int,
        batch_gap_s: float = 0.005,
        prepare_wait_s: float = 0.0,
        job_chunk_s: float = 2.0,
        release_memory: Callable[[], None] = lambda: None,
        max_in_flight: int | Callable[[], int] = 1,
        combine: Combiner[WorkT, BatchT] | None = None,
    ) -> None:
        """``runner(context, rows, stop) -> results`` is called on ``executor`` (one thread
        per batch in flight: ``max_in_flight``, a number or read before each batch);
        ``combine`` picks the contexts a batch's items run with (None: the first item's)."""
        self._runner = runner
        self.combine: Combiner[WorkT, BatchT] = combine or _first_context
        self._executor = executor
        self._metrics = metrics
        self.max_batch_size = max_batch_size
        self.max_batch_delay_s = max_batch_delay_s
        self.batch_gap_s = batch_gap_s
        self.prepare_wait_s = prepare_wait_s
        self._preparing: Counter[tuple[Lane, Hashable]] = Counter()
        self._arriving = 0
        self.max_pending = max_pending
        self.job_chunk_s = job_chunk_s
        self._seconds_per_cost: dict[Hashable, float] = {}
        self._jobs_served_at = time.monotonic()  # when the jobs lane last ran (or was empty)
        self._release_memory = release_memory
        self._lanes: dict[Lane, deque[WorkItem]] = {lane: deque() for lane in LANES}
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._max_in_flight = max_in_flight
        self._running: dict[asyncio.Task[None], list[_Slice]] = {}
        self.batches_run = 0
        self._calls = itertools.count(1)

    # ------------------------------------------------------------------ public
    def start(self) -> None:
        """Start the dispatcher on the running event loop."""
        self._task = asyncio.get_running_loop().create_task(self._dispatch(), name="scheduler")

    async def stop(self) -> None:
        """Stop dispatching; callers still waiting get 503 (jobs resume at the next start)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        running = dict(self._running)
        for task in running:
            task.cancel()
        if running:
            await asyncio.gather(*running, return_exceptions=True)
        items = [part.item for batch in running.values() for part in batch]
        for lane in LANES:
            items.extend(self._lanes[lane])
            self._lanes[lane].clear()
        for item in items:
            self._fail(item, Unavailable("the server is shutting down; retry shortly"))
        self._update_depth()

    def submit(
        self,
        key: Hashable,
        context: WorkT,
        rows: Sequence[RowT],
        lane: Lane = "interactive",
        on_progress: ProgressCallback | None = None,
        row_cost: float = 1.0,
        group: Hashable | None = None,
        first_of_request: bool = True,
    ) -> WorkItem:
        """Queue ``rows`` (each costing ``row_cost``, about fits; of batch ``group``, see
        :meth:`preparing`); await ``item.future`` for their outcomes (in order).

        Raises :class:`QueueFull` (429) when ``max_pending`` interactive items are waiting
        and this is a request's first item (a request's further items, its other stacked
        models, are part of what was admitted with it).
        """
        waiting = len(self._lanes["interactive"])
        if lane == "interactive" and first_of_request and waiting >= self.max_pending:
            raise QueueFull(
                f"{waiting} work items (requests' stacked models) are waiting for the device "
                f"(--max-queue {self.max_pending}); retry later or submit a job"
            )
        future: asyncio.Future[list[RowOutcome]] = asyncio.get_running_loop().create_future()
        item = WorkItem(key, context, rows, lane, future, on_progress, row_cost, group)
        item.outcomes = [None] * len(rows)
        if not rows:
            future.set_result([])
            return item
        self._lanes[lane].append(item)
        self._update_depth()
        self._wakeup.set()
        return item

    @contextlib.contextmanager
    def preparing(self, group: Hashable | None, lane: Lane = "interactive") -> Iterator[None]:
        """Announce, for the duration of the block, work of batch ``group`` being prepared in
        ``lane`` (its items are submitted within the block): batches of that group wait for
        it, up to ``prepare_wait_s`` (``group`` None announces nothing)."""
        if group is None:
            yield
            return
        self._preparing[lane, group] += 1
        try:
            yield
        finally:
            self._preparing[lane, group] -= 1
            if not self._preparing[lane, group]:
                del self._preparing[lane, group]
            self._wakeup.set()

    @contextlib.contextmanager
    def arriving(self) -> Iterator[None]:
        """Announce, for the duration of the block, an interactive request being read and
        checked (its batch group not known yet; the block ends once its own
        :meth:`preparing` has begun): interactive batches wait for it, up to
        ``prepare_wait_s``."""
        self._arriving += 1
        try:
            yield
        finally:
            self._arriving -= 1
            self._wakeup.set()

    def cancel(self, item: WorkItem) -> None:
        """Drop the item's rows not yet run (its current chunk still finishes)."""
        if not item.future.done():
            item.future.cancel()
        self._wakeup.set()

    def pending_rows(self, lane: Lane) -> int:
        """Rows of ``lane`` not yet handed to the device."""
        return sum(item.remaining for item in self._lanes[lane] if not item.finished)

    @property
    def max_in_flight(self) -> int:
        """How many batches may run at once now (at least one)."""
        value = self._max_in_flight
        return max(1, value() if callable(value) else value)

    @property
    def in_flight(self) -> int:
        """Batches running now."""
        return len(self._running)

    @property
    def saturated(self) -> bool:
        """Whether the interactive lane is full (new requests would get 429)."""
        return len(self._lanes["interactive"]) >= self.max_pending

    # ------------------------------------------------------------------ dispatching
    async def _dispatch(self) -> None:
        """Forever: once fewer than ``max_in_flight`` batches run, pick the oldest item
        (interactive first), fill a batch, start it."""
        while True:
            if len(self._running) >= self.max_in_flight:
                await asyncio.wait(list(self._running), return_when=asyncio.FIRST_COMPLETED)
                continue
            head = self._head()
            if head is None:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            if head.lane == "interactive":
                await self._fill(head)
            batch = self._take(head.key, head.lane)
            if batch:
                task = asyncio.get_running_loop().create_task(self._run(batch), name="batch")
                self._running[task] = batch
                task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[None]) -> None:
        """A batch is over: its slot is free; a job chunk's end restarts the jobs lane's
        clock (a chunk that ran longer than the overdue span, a row of many toys, does not
        make the next one overdue at once: interactive work goes first again)."""
        batch = self._running.pop(task, None)
        if batch and batch[0].item.lane == "jobs":
            self._jobs_served_at = time.monotonic()
        if not task.cancelled() and task.exception() is not None:
            log.error("a batch failed unexpectedly", exc_info=task.exception())
        self._wakeup.set()

    def _head(self) -> WorkItem | None:
        """The oldest live item of the highest-priority lane (dropping finished ones), or the
        jobs lane's when it has waited ``JOB_SHARE_ROUNDS`` chunks behind interactive work."""
        heads = {lane: self._live_head(lane) for lane in LANES}
        now = time.monotonic()
        if heads["jobs"] is None:
            self._jobs_served_at = now
        overdue = now - self._jobs_served_at > JOB_SHARE_ROUNDS * self.job_chunk_s
        if heads["jobs"] is not None and (heads["interactive"] is None or overdue):
            self._jobs_served_at = now
            return heads["jobs"]
        if heads["interactive"] is None:
            self._update_depth()
        return heads["interactive"]

    def _live_head(self, lane: Lane) -> WorkItem | None:
        """The oldest item of ``lane`` still waiting for rows to run."""
        queue = self._lanes[lane]
        while queue and (queue[0].finished or queue[0].remaining == 0):
            queue.popleft()
        return queue[0] if queue else None

    async def _fill(self, head: WorkItem) -> None:
        """Wait until ``max_batch_size`` rows share ``head``'s key, its delay is over, or no
        rows with its key arrived for ``batch_gap_s`` (a lone request, however many rows it
        brings, does not wait out a long delay set to gather concurrent clients); while
        interactive requests are arriving or work of ``head``'s group is being prepared, until
        that work is in or ``prepare_wait_s`` after ``head`` was queued."""
        deadline = head.enqueued_at + self.max_batch_delay_s
        patience = head.enqueued_at + max(self.prepare_wait_s, self.max_batch_delay_s)
        rows = self._rows_with(head.key, head.lane)
        quiet_until = time.monotonic() + self.batch_gap_s
        while rows < self.max_batch_size:
            end = min(deadline, quiet_until)
            if self._coming(head):
                end = max(end, patience)
            remaining = end - time.monotonic()
            if remaining <= 0:
                return
            self._wakeup.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), remaining)
            arrived = self._rows_with(head.key, head.lane)
            if arrived != rows:
                rows, quiet_until = arrived, time.monotonic() + self.batch_gap_s

    def _coming(self, head: WorkItem) -> bool:
        """Whether rows that may join ``head``'s batch are on their way: interactive requests
        arriving, or work of its group being prepared."""
        if head.lane == "interactive" and self._arriving:
            return True
        return head.group is not None and bool(self._preparing[head.lane, head.group])

    def _rows_with(self, key: Hashable, lane: Lane) -> int:
        """Pending rows with batch key ``key`` in ``lane``."""
        return sum(i.remaining for i in self._lanes[lane] if i.key == key and not i.finished)

    def _take(self, key: Hashable, lane: Lane) -> list[_Slice]:
        """Up to ``max_batch_size`` pending rows with ``key``, oldest items first; for jobs,
        only as many as fit in ``job_chunk_s`` (at least one); with several batches in flight,
        rows that need several batches anyway are split evenly over the slots
        (:meth:`_spread`)."""
        batch: list[_Slice] = []
        room = self.max_batch_size
        budget = math.inf
        if lane == "jobs":  # a key not yet measured: one row (its first chunk measures it)
            known = self._seconds_per_cost.get(key)
            budget = 0.0 if known is None else self.job_chunk_s / known
        items = [i for i in self._lanes[lane] if i.key == key and not i.finished and i.remaining]
        if items:
            per_batch = room if budget == math.inf else int(budget // items[0].row_cost)
            room = self._spread(sum(len(i.rows) for i in items), min(room, max(per_batch, 1)))
        for item in items:
            if room == 0:
                break
            affordable = item.remaining if budget == math.inf else int(budget // item.row_cost)
            count = min(room, item.remaining, max(affordable, 0 if batch else 1))
            if count == 0:
                break
            batch.append(_Slice(item, item.taken, item.taken + count))
            item.taken += count
            room -= count
            budget -= count * item.row_cost
        self._lanes[lane] = deque(i for i in self._lanes[lane] if i.remaining and not i.finished)
        self._update_depth()
        return batch

    def _spread(self, rows: int, room: int) -> int:
        """Rows per batch for items of ``rows`` rows in all, at most ``room``: ``room`` in
        process; with ``max_in_flight`` slots, rows that need several batches are cut into a
        multiple of the slots, of equal size (217 rows, 64 a batch, 2 workers: 4 batches of 55,
        not 64+64+64+25, whose last round would leave a worker idle)."""
        slots = self.max_in_flight
        if slots <= 1 or rows <= room:
            return room
        batches = math.ceil(math.ceil(rows / room) / slots) * slots
        return max(1, math.ceil(rows / batches))

    def _learn(self, key: Hashable, cost: float, seconds: float) -> None:
        """Fold an engine call's measured seconds per unit of cost into ``key``'s estimate."""
        measured = seconds / max(cost, 1e-9)
        known = self._seconds_per_cost.get(key)
        self._seconds_per_cost[key] = measured if known is None else 0.5 * (known + measured)

    async def _run(self, batch: list[_Slice]) -> None:
        """Run one batch on the device thread and hand each item its rows' outcomes.

        :attr:`combine` picks the context (model) the items' rows run with: usually one for
        all of them (one engine call), more where their models cannot be joined."""
        now = time.monotonic()
        for part in batch:
            if part.item.started_at is None:
                part.item.started_at = now
        try:
            groups = await self.combine([part.item.context for part in batch])
        except Exception as exc:
            for part in batch:
                self._fail(part.item, exc)
            return
        for context, members in groups:
            await self._run_group(context, [batch[i] for i in members])

    async def _run_group(self, context: BatchT, batch: list[_Slice]) -> None:
        """One engine call for the rows of ``batch`` with ``context``."""
        rows = [row for part in batch for row in part.item.rows[part.start : part.stop]]
        loop = asyncio.get_running_loop()
        items = [part.item for part in batch]

        def nobody_waits() -> bool:  # read on the device thread: futures only ever get done
            return all(item.future.done() for item in items)

        started = time.perf_counter()
        try:
            outcomes = await loop.run_in_executor(
                self._executor, self._execute, context, rows, nobody_waits
            )
        except Exception as exc:
            for part in batch:
                self._fail(part.item, exc)
            return
        finally:
            self.batches_run += 1
        cost = sum((p.stop - p.start) * p.item.row_cost for p in batch)
        self._learn(batch[0].item.key, cost, time.perf_counter() - started)
        offsets = itertools.accumulate((p.stop - p.start for p in batch), initial=0)
        for part, offset in zip(batch, offsets, strict=False):
            self._deliver(part, outcomes[offset : offset + part.stop - part.start])

    def _execute(
        self, context: BatchT, rows: Sequence[RowT], stop: Callable[[], bool]
    ) -> list[RowOutcome[ValueT]]:
        """On the device thread: one engine call; on out-of-memory, halves (recursively)."""
        self._metrics.batch_size.observe(len(rows))
        start = time.perf_counter()
        try:
            values = self._runner(context, rows, stop)
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
            self._release_memory()
            if len(rows) == 1:
                raise Unavailable(
                    "the device ran out of memory for a single hypothesis; "
                    "try float32, a smaller model, or another device",
                    transient=False,
                ) from None
            self._metrics.oom_splits.inc()
            log.warning("device out of memory; splitting the batch", extra={"rows": len(rows)})
            half = len(rows) // 2
            return self._execute(context, rows[:half], stop) + self._execute(
                context, rows[half:], stop
            )
        seconds = time.perf_counter() - start
        self._metrics.batch_seconds.observe(seconds)
        call = next(self._calls)
        return [RowOutcome(value, len(rows), seconds, call) for value in values]

    def _deliver(self, part: _Slice, outcomes: list[RowOutcome]) -> None:
        """Store a slice's outcomes; report progress; resolve the item when all rows are in."""
        item = part.item
        if item.finished:
            return
        item.outcomes[part.start : part.stop] = outcomes
        item.done += len(outcomes)
        if item.on_progress is not None:
            try:
                item.on_progress(item.done, len(item.rows))
            except Exception:  # a progress report must never stop the dispatcher
                log.exception("progress callback failed")
        if item.done == len(item.rows):
            item.future.set_result([o for o in item.outcomes if o is not None])

    def _fail(self, item: WorkItem, exc: BaseException) -> None:
        """Resolve ``item`` with ``exc`` (unless it already has an answer)."""
        if not item.future.done():
            item.future.set_exception(exc)

    def _update_depth(self) -> None:
        """Publish the pending rows per lane."""
        for lane in LANES:
            self._metrics.queue_depth.labels(lane).set(self.pending_rows(lane))


async def _first_context(contexts: Sequence[Any]) -> list[tuple[Any, list[int]]]:
    """Every item of a batch runs with the first item's context (items of one batch key
    share their model unless a combiner says otherwise)."""
    return [(contexts[0], list(range(len(contexts))))]
