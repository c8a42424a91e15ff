"""``torch.compile`` of the main-model kernel, cached per structure key and batch bucket.

Rows are padded up to a power-of-two bucket so that a stream of varying batch sizes meets a
handful of shapes: the compiled graph (dynamic in the batch dimension) is traced once per
structure, and shape-specialised back ends (CUDA graphs) record once per bucket. Eager
evaluation stays the fallback: a model only uses a kernel after :meth:`KernelCache.warm`.

A cache is an ordinary object owned by whoever serves models (the service keeps one);
nothing here is process-wide state.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from .kernel import MainTensors, expected_main

if TYPE_CHECKING:
    from .model import HistFactoryModel

MainKernel = Callable[[torch.Tensor, torch.Tensor, MainTensors, str, str], torch.Tensor]


def batch_bucket(rows: int, smallest: int = 2) -> int:
    """The power of two at or above ``rows`` (at least ``smallest``).

    >>> [batch_bucket(n) for n in (1, 2, 3, 100)]
    [2, 2, 4, 128]
    """
    return max(smallest, 1 << max(rows - 1, 0).bit_length())


class KernelCache:
    """Compiled main-model kernels keyed by (structure key, device, dtype)."""

    def __init__(self, mode: str | None = None) -> None:
        self.mode = mode
        self._kernels: dict[tuple[str, str, torch.dtype], MainKernel] = {}
        self._warm_buckets: set[tuple[str, str, torch.dtype, int]] = set()
        self._lock = threading.Lock()

    def _key(self, model: HistFactoryModel) -> tuple[str, str, torch.dtype]:
        return (model.structure_key, str(model.device), model.dtype)

    def _kernel(self, model: HistFactoryModel) -> MainKernel:
        key = self._key(model)
        with self._lock:
            if key not in self._kernels:
                self._kernels[key] = torch.compile(expected_main, dynamic=True, mode=self.mode)
            return self._kernels[key]

    def expected_main(self, model: HistFactoryModel) -> MainKernel:
        """A drop-in for :func:`expected_main` that pads rows to a bucket and runs compiled."""
        kernel = self._kernel(model)
        key = self._key(model)

        def run(pars, element, main, histosys_code, normsys_code):
            rows = pars.shape[0]
            bucket = batch_bucket(rows)
            if bucket != rows:
                pad = bucket - rows
                pars = torch.cat([pars, pars.narrow(0, rows - 1, 1).expand(pad, -1)])
                element = torch.cat([element, element.narrow(0, rows - 1, 1).expand(pad)])
            self._warm_buckets.add((*key, bucket))
            return kernel(pars, element, main, histosys_code, normsys_code).narrow(0, 0, rows)

        return run

    def warm(self, model: HistFactoryModel, rows: int = 2) -> None:
        """Compile (outside any request) the kernel of ``model`` for ``rows`` rows."""
        run = self.expected_main(model)
        pars = model.init.narrow(0, 0, 1).expand(rows, -1)
        element = model.element_index(None, rows)
        run(pars, element, model.main, model.histosys_code, model.normsys_code)

    def is_warm(self, model: HistFactoryModel, rows: int) -> bool:
        """Whether the bucket of ``rows`` has already run compiled for this model's structure."""
        return (*self._key(model), batch_bucket(rows)) in self._warm_buckets
