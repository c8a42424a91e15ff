"""The scheduler's runner in cluster mode: each engine batch on a Dask worker.

:class:`ClusterRunner` is a :class:`~pyhf_gpu_server.execution.Runner`, called like
:func:`~pyhf_gpu_server.execution.run_rows` on one of the scheduler's executor threads
(``max_in_flight`` of them: one per live worker). It picks the worker
(:class:`~.placement.Placement`), submits :func:`~.tasks.run_batch` there with
``allow_other_workers`` and a ``GPU`` resource (with no worker known, unplaced: where the
scheduler puts it), and blocks until the answer; a worker that dies mid-batch costs nothing
but time (Dask runs the task again elsewhere). While it
waits it watches ``stop()``: once nobody waits for the rows, the batch is cancelled and a
running one told to stop through a Dask event.

A scheduler that goes away fails the batches in flight with 503 (Dask cancels their futures;
a job runs them again, :mod:`pyhf_gpu_server.service.jobrunner`). Dask's client reconnects to
a scheduler back within its timeout; past it, the client closes for good, and the runner's
watcher connects a new one once the scheduler answers again (meanwhile batches answer 503).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from distributed import Client, Event
from distributed.client import ClosedClientError, FutureCancelledError
from distributed.scheduler import KilledWorker
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pyhf_gpu_server.execution import BatchContext, CallRow, ComputedRow
from pyhf_gpu_server.inference.errors import FitStopped
from pyhf_gpu_server.service.errors import Unavailable
from pyhf_gpu_server.service.metrics import Metrics

from .placement import Placement
from .tasks import ModelMissing, RemoteAnswer, RemoteBatch, describe_worker, run_batch

log = logging.getLogger("pyhf_gpu_server.cluster")

WORKERS_TTL_S = 1.0  # how long the list of live workers is reused
STALE_S = 15.0  # a list of workers older than this: the scheduler does not answer
POLL_S = 0.2  # how often a waiting batch looks at stop()
STOP_EVENT_TTL_S = 120.0  # a stopped batch's event is cleared after this
MAX_RESENDS = 3  # ModelMissing answers before a batch gives up
RECONNECT_TIMEOUT_S = 5.0  # one attempt of the watcher to connect a new client


class ClusterRunner:
    """Runs batches on the GPU workers (``GPU`` resource) of one Dask scheduler."""

    def __init__(
        self,
        client: Client,
        address: str,
        metrics: Metrics,
        reconnect: Callable[[], Client] | None = None,
    ) -> None:
        """Run batches through ``client`` (of the scheduler at ``address``); ``reconnect``
        makes a new client once Dask has closed this one (None: never)."""
        self.client = client
        self.address = address
        self._reconnect = reconnect
        self._reconnect_error: str | None = None
        self.placement = Placement()
        self._lock = threading.Lock()
        self._workers: dict[str, dict[str, Any]] = {}
        self._workers_at = -float("inf")
        self._problem: str | None = None
        self._stopped: deque[tuple[float, str]] = deque()
        self.snapshot: dict[str, Any] = {"scheduler": address, "workers": []}
        self.warm_models: list[dict[str, Any]] = []
        self._closed = threading.Event()
        self._watcher = threading.Thread(
            target=self._watch, name="pyhf-gpu-cluster-watch", daemon=True
        )
        self.recipes_sent = 0  # batches that carried their model's recipe
        self.models_resent = 0  # of those, sent again after a worker answered ModelMissing
        self._metrics = metrics
        metrics.registry.register(_ClusterCollector(self))

    @classmethod
    def connect(cls, address: str, metrics: Metrics, timeout_s: float = 30.0) -> ClusterRunner:
        """A runner on a client of the scheduler at ``address`` (``OSError`` when it does not
        answer within ``timeout_s``). Blocks: call it off the event loop."""

        def client(timeout: float) -> Client:
            return Client(address, timeout=timeout, set_as_default=False, name="pyhf-gpu-api")

        runner = cls(client(timeout_s), address, metrics, partial(client, RECONNECT_TIMEOUT_S))
        runner.workers(max_age_s=0)
        runner._watcher.start()
        return runner

    def close(self) -> None:
        """Disconnect (the workers keep their models for the next API node)."""
        self._closed.set()
        self.client.close()

    def _watch(self) -> None:
        """Keep the list of live workers fresh (read on the event loop: never asked there)
        and the client connected."""
        while not self._closed.wait(WORKERS_TTL_S):
            self.reconnect_if_closed()
            self.workers(max_age_s=WORKERS_TTL_S / 2)

    def reconnect_if_closed(self) -> bool:
        """A new client in place of one Dask closed (it gives up reconnecting to a scheduler
        gone longer than its timeout); whether one was made. Blocks up to
        :data:`RECONNECT_TIMEOUT_S` while the scheduler does not answer."""
        if self._reconnect is None or self.client.status not in ("closing", "closed"):
            return False
        try:
            client = self._reconnect()
        except (OSError, TimeoutError) as exc:
            self._reconnect_error = f"{type(exc).__name__}: {exc}"
            return False
        self._reconnect_error = None
        if self._closed.is_set():  # the runner closed meanwhile
            client.close()
            return False
        old, self.client = self.client, client
        old.close()
        log.info("reconnected to the Dask scheduler", extra={"scheduler": self.address})
        return True

    # ----------------------------------------------------------------------------- workers
    def workers(self, max_age_s: float = WORKERS_TTL_S) -> dict[str, dict[str, Any]]:
        """The live workers with a ``GPU`` resource, by address (asked at most every
        ``max_age_s``; none while the scheduler does not answer)."""
        with self._lock:
            if time.monotonic() - self._workers_at < max_age_s:
                return self._workers
        try:
            if self.client.status != "running":
                raise ConnectionError(self._disconnected())
            # the scheduler's own answer: Client.scheduler_info returns a cache that its
            # periodic refresh (workers left out) may overwrite before it returns
            info = self.client.sync(self.client.scheduler.identity, n_workers=-1)["workers"]
            problem = None
        except Exception as exc:  # the scheduler is gone: no workers until it answers again
            info, problem = {}, f"{type(exc).__name__}: {exc}"
        found = {
            address: worker
            for address, worker in info.items()
            if (worker.get("resources") or {}).get("GPU", 0) >= 1
        }
        with self._lock:
            self._workers, self._workers_at, self._problem = found, time.monotonic(), problem
        return found

    def _disconnected(self) -> str:
        """Why the client cannot ask the scheduler now."""
        reason = f"the client is {self.client.status}"
        if self._reconnect_error is not None:
            reason += f"; connecting a new one failed: {self._reconnect_error}"
        return reason

    def max_in_flight(self) -> int:
        """Batches to run at once: one per live worker (as last seen: never blocks)."""
        return len(self._workers)

    def problems(self) -> list[str]:
        """Why the cluster cannot run batches now (``/readyz``; from what the watcher saw
        last, so a scheduler that hangs cannot hang the probe)."""
        with self._lock:
            workers, problem = self._workers, self._problem
            age = time.monotonic() - self._workers_at
        if problem is not None:
            return [f"the Dask scheduler {self.address} does not answer: {problem}"]
        if age > STALE_S:
            return [f"the Dask scheduler {self.address} has not answered for {age:.0f} s"]
        if not workers:
            return [f"no Dask worker with a GPU resource is connected to {self.address}"]
        return []

    def describe(self) -> dict[str, Any]:
        """The scheduler, each live worker's device, warm models and counts (asks every
        worker: call it off the event loop); kept as :attr:`snapshot` for ``/metrics``."""
        workers = self.workers()
        details: dict[str, Any] = {}
        if workers:
            try:
                details = self.client.run(describe_worker, workers=list(workers), on_error="return")
            except Exception as exc:
                log.warning("the workers could not be asked", extra={"error": str(exc)})
        rows, warm = [], []
        for address, worker in sorted(workers.items()):
            found = details.get(address)
            found = found if isinstance(found, dict) else {}
            warm.extend(found.get("warm", []))
            rows.append(
                {
                    "address": address,
                    "name": str(worker.get("name", address)),
                    "device": found.get("device"),
                    "device_name": found.get("device_name"),
                    "in_flight": self.placement.in_flight.get(address, 0),
                    "batches": self.placement.batches.get(address, 0),
                    "models": found.get("models", []),
                    "model_count": found.get("model_count", 0),
                    "cache_hits": found.get("cache_hits", 0),
                    "cache_misses": found.get("cache_misses", 0),
                    "cache_bytes": found.get("cache_bytes", 0),
                }
            )
        self.warm_models = warm  # every worker's warm models, as /info lists a server's
        self.snapshot = {
            "scheduler": self.address,
            "workers": rows,
            "recipes_sent": self.recipes_sent,
            "models_resent": self.models_resent,
        }
        return self.snapshot

    # ----------------------------------------------------------------------------- batches
    def __call__(
        self, context: BatchContext, rows: Sequence[CallRow], stop: Callable[[], bool]
    ) -> list[ComputedRow]:
        """ONE engine call for ``rows`` on a worker (blocks this thread until it answers)."""
        self._clear_old_stop_events()
        recipe = context.recipe
        must_send = False
        for _ in range(MAX_RESENDS + 1):
            worker, send = self.placement.choose(recipe.key, recipe.model_id, self.workers())
            send = send or must_send
            batch = RemoteBatch(
                recipe.key,
                recipe if send else None,
                context.call,
                tuple(rows),
                f"pyhf-gpu-stop-{uuid.uuid4().hex}",
            )
            if send:
                with self._lock:
                    self.recipes_sent += 1
            try:
                answer = self._submit(batch, worker, stop)
            finally:
                self.placement.release(worker)
            if isinstance(answer, ModelMissing):
                self.placement.lost(answer.worker, recipe.key)
                with self._lock:
                    self.models_resent += 1
                must_send = True
                continue
            self.placement.holding(answer.worker, recipe.key)
            (self._metrics.cache_hits if answer.hit else self._metrics.cache_misses).inc()
            return [
                ComputedRow(
                    result,
                    answer.model_id,
                    answer.hit,
                    answer.build_s,
                    answer.device,
                    answer.worker,
                    answer.compute_s,
                )
                for result in answer.results
            ]
        raise Unavailable("the workers keep losing this batch's model; retry shortly")

    def _submit(
        self, batch: RemoteBatch, worker: str | None, stop: Callable[[], bool]
    ) -> RemoteAnswer | ModelMissing:
        """Run ``batch`` (on ``worker`` if it can; with no worker known, as the scheduler
        places it) and wait for its answer, watching ``stop``."""
        # Dask refuses allow_other_workers without workers (a ValueError)
        placed = {} if worker is None else {"workers": [worker], "allow_other_workers": True}
        if self.client.status != "running":  # reconnecting: its futures would wait or be lost
            raise Unavailable(
                f"the Dask scheduler {self.address} does not answer ({self._disconnected()}); "
                "retry shortly"
            )
        try:
            future = self.client.submit(
                run_batch,
                batch,
                key=f"pyhf-gpu-batch-{batch.stop_event.rpartition('-')[2]}",
                resources={"GPU": 1},
                pure=False,
                **placed,
            )
        except ClosedClientError as exc:  # the scheduler is gone (the watcher reconnects)
            raise Unavailable(
                f"the Dask scheduler {self.address} does not answer; retry shortly"
            ) from exc
        done = threading.Event()
        future.add_done_callback(lambda _: done.set())
        try:
            while not done.wait(POLL_S):
                if stop():
                    self._stop(batch.stop_event)
                    future.cancel()
                    raise FitStopped("nobody waits for this batch any more")
            return future.result()
        except (KilledWorker, FutureCancelledError) as exc:
            raise Unavailable(f"the Dask workers could not run this batch ({exc}); retry") from exc
        finally:
            future.release()

    def _stop(self, name: str) -> None:
        """Tell a running batch to stop (its fits ask the event every few iterations)."""
        try:
            Event(name, client=self.client).set()
            self._stopped.append((time.monotonic(), name))
        except Exception:
            log.warning("could not signal a batch to stop", exc_info=True)

    def _clear_old_stop_events(self) -> None:
        """Forget the events of batches stopped long ago (the scheduler keeps set ones)."""
        while self._stopped and time.monotonic() - self._stopped[0][0] > STOP_EVENT_TTL_S:
            _, name = self._stopped.popleft()
            try:
                Event(name, client=self.client).clear()
            except Exception:
                return


_WORKER_FAMILIES = {  # snapshot key -> metric type, name and help of a per-worker family
    "model_count": (GaugeMetricFamily, "worker_models", "warm models per worker"),
    "in_flight": (
        GaugeMetricFamily,
        "worker_batches_in_flight",
        "batches this API node runs on each worker now",
    ),
    "cache_hits": (CounterMetricFamily, "worker_cache_hits", "warm model cache hits per worker"),
    "cache_misses": (CounterMetricFamily, "worker_cache_misses", "models built per worker"),
    "batches": (
        CounterMetricFamily,
        "worker_batches",
        "batches each worker answered this API node",
    ),
}


class _ClusterCollector:
    """``/metrics``: the cluster as of the last :meth:`ClusterRunner.describe`."""

    def __init__(self, runner: ClusterRunner) -> None:
        self.runner = runner

    def describe(self) -> list[Any]:
        return []  # nothing to check at registration (collect() reads a snapshot)

    def collect(self) -> Any:
        workers = self.runner.snapshot["workers"]
        live = GaugeMetricFamily(
            "pyhf_gpu_cluster_workers", "live Dask workers with a GPU resource"
        )
        live.add_metric([], len(workers))
        sent = CounterMetricFamily(
            "pyhf_gpu_cluster_recipes_sent", "batches that carried their model's recipe"
        )
        sent.add_metric([], self.runner.recipes_sent)
        resent = CounterMetricFamily(
            "pyhf_gpu_cluster_models_resent",
            "batches sent again with their recipe after a worker no longer held the model",
        )
        resent.add_metric([], self.runner.models_resent)
        families = {
            key: kind(f"pyhf_gpu_cluster_{name}", text, labels=["worker", "device"])
            for key, (kind, name, text) in _WORKER_FAMILIES.items()
        }
        for worker in workers:
            labels = [worker["address"], worker["device"] or "unknown"]
            for key, family in families.items():
                family.add_metric(labels, worker[key])
        yield from (live, sent, resent)
        yield from families.values()
