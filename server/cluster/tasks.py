"""What travels between the API node and a worker, and the task a worker runs per batch.

A :class:`RemoteBatch` names its model by key and carries the model's recipe only where the
API node does not know the chosen worker to hold it; a worker without the model answers
:class:`ModelMissing` and the API node sends the batch again with the recipe. Everything
here is plain data (pickled by Dask) and :func:`run_batch` is pure by row: run twice, on any
worker (Dask re-runs the batches of a worker that died), it answers the same.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

from distributed import Event, get_worker

from pyhf_gpu_server.execution import (
    CallRow,
    EngineCall,
    ModelRecipe,
    is_out_of_memory,
    model_id,
)

from .plugin import models_of

STOP_CHECK_S = 0.5  # how often a running batch asks whether anybody still waits for it


@dataclass(frozen=True)
class RemoteBatch:
    """One engine call for a worker: the model's key (and recipe, when it must travel), the
    call, the rows, and the name of the Dask event that says nobody waits any more."""

    key: Hashable
    recipe: ModelRecipe | None
    call: EngineCall
    rows: tuple[CallRow, ...]
    stop_event: str


@dataclass(frozen=True)
class RemoteAnswer:
    """A worker's results for a batch, and how it computed them."""

    worker: str
    device: str
    model_id: str
    hit: bool
    build_s: float
    compute_s: float
    results: list[Any]  # the operation's row results


@dataclass(frozen=True)
class ModelMissing:
    """The worker does not hold the batch's model (evicted, or restarted) and got no recipe."""

    worker: str


def run_batch(batch: RemoteBatch) -> RemoteAnswer | ModelMissing:
    """On a worker: the batch's engine call on its warm model (built from the recipe on a
    miss), exactly as the in-process device thread runs it (:meth:`EngineCall.run`)."""
    worker = get_worker()
    models = models_of(worker)
    found = models.model(batch.key, batch.recipe)
    if found is None:
        return ModelMissing(worker.address)
    model, hit, build_s = found
    start = time.perf_counter()
    try:
        results = batch.call.run(model, batch.rows, models.memory, stop_checker(batch.stop_event))
    except Exception as exc:
        if is_out_of_memory(exc):
            models.release()
        raise
    return RemoteAnswer(
        worker.address,
        models.device,
        model_id(batch.key),
        hit,
        build_s,
        time.perf_counter() - start,
        results,
    )


def stop_checker(name: str, every_s: float = STOP_CHECK_S) -> Callable[[], bool]:
    """A ``stop()`` for the fits: true once the API node set the Dask event ``name`` (asked at
    most every ``every_s``: one round trip to the scheduler each time)."""
    state = {"asked": time.monotonic(), "stopped": False}

    def stop() -> bool:
        now = time.monotonic()
        if state["stopped"] or now - state["asked"] < every_s:
            return bool(state["stopped"])
        state["asked"] = now
        try:
            state["stopped"] = Event(name).is_set()
        except Exception:  # no answer from the scheduler: keep going
            return False
        return bool(state["stopped"])

    return stop


def describe_worker(dask_worker: Any) -> dict[str, Any]:
    """This worker's models and counts (run through ``Client.run`` for ``/info``)."""
    return models_of(dask_worker).describe()
