"""The one way an engine call is run: a :class:`Runner`, chosen once at start-up.

The scheduler hands each batch to its runner, on one of its executor threads, and gets one
:class:`~.calls.ComputedRow` per row back. Implementations:

- :func:`run_rows`: in process, on the device thread, on the batch's warm model;
- ``EngineShares`` (:mod:`pyhf_gpu_server.service.engine_shares`): the same on a CPU device,
  the batch's elements shared with idle local worker processes;
- ``ClusterRunner`` (:mod:`pyhf_gpu_server.cluster.runner`): on a Dask worker.
"""

from __future__ import annotations

import platform
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol, TypeVar

import torch

from .calls import BatchContext, CallRow, ComputedRow

RowT_contra = TypeVar("RowT_contra", bound=CallRow, contravariant=True)


class Runner(Protocol[RowT_contra]):
    """Runs ONE engine call: ``rows`` with ``context`` (its model and call), blocking the
    calling thread; one answer per row, in order. ``stop()`` turns true once nobody waits for
    any of the rows: the runner may give up (``FitStopped``)."""

    def __call__(
        self, context: BatchContext, rows: Sequence[RowT_contra], stop: Callable[[], bool]
    ) -> list[ComputedRow]: ...


def run_rows(
    context: BatchContext, rows: Sequence[CallRow], stop: Callable[[], bool] | None = None
) -> list[ComputedRow]:
    """ONE batched inference call for ``rows`` on the in-process warm model (device thread)."""
    cached = context.cached
    if cached is None:
        raise RuntimeError("run_rows needs a warm model (in-process mode)")
    results = context.call.run(cached.model, rows, context.memory, stop)
    return [ComputedRow(r, cached.model_id, cached.hit, cached.build_s) for r in results]


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is torch's device out-of-memory error (either spelling)."""
    oom_type = getattr(torch, "OutOfMemoryError", None)
    if oom_type is not None and isinstance(exc, oom_type):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


def check_device(device: str) -> str:
    """``device`` (a concrete torch device), once it is there: ``ValueError`` if it names CUDA
    and torch has none, or not that many devices."""
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"--device {device}: torch.cuda.is_available() is False")
        index = torch.device(device).index or 0
        if index >= torch.cuda.device_count():
            raise ValueError(f"--device {device}: only {torch.cuda.device_count()} CUDA devices")
    return device


def device_name(device: str) -> str:
    """A human name of the device (the GPU model, or the CPU)."""
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    return platform.processor() or platform.machine() or "cpu"
