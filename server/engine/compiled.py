"""``torch.compile`` of the kernels a fit calls, cached per kernel, structure key and bucket.

Two kernels of :mod:`~pyhf_gpu_server.engine.kernel` are compiled: :func:`expected_main` (the
objective's values, ``expected_data``/``logpdf``/``deviance``) and
:func:`expected_main_jacobian` (the rates and their closed-form Jacobian: every derivative
call of the minimiser, once per iteration). What the fit does with them (the deviance's
Poisson and constraint terms, the gradient ``J^T r``, the curvature's Cholesky or Woodbury
solves in ``torch.linalg``) stays eager.

Each kernel is traced once per structure key, on a code object of its own, with static
shapes except two dynamic axes: the rows and the stack's elements (so stacks of any number of
patches of one structure share a graph). Rows are padded up to a power-of-two bucket so that
a stream of varying batch sizes meets a handful of shapes, for the shape-specialised back
ends (``mode="reduce-overhead"``: CUDA graphs, recorded once per bucket). A CUDA graph
overwrites its outputs on its next replay while a fit keeps the previous iteration's
Jacobian, so under those modes the rows are copied out. Eager
evaluation stays the fallback: under autograd or a ``torch.func`` transform (the exact
Hessian a fit's uncertainties take) the kernels run eagerly, and a model only uses them after
:meth:`HistFactoryModel.enable_compile <pyhf_gpu_server.engine.HistFactoryModel.enable_compile>`
(the service calls it once :meth:`KernelCache.warm` has compiled them).

A cache is an ordinary object owned by whoever serves models (the service keeps one);
nothing here is process-wide state.
"""

from __future__ import annotations

import logging
import threading
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from .kernel import MainTensors, expected_main, expected_main_jacobian

if TYPE_CHECKING:
    from .model import HistFactoryModel

log = logging.getLogger("pyhf_gpu_server.engine.compiled")

MainKernel = Callable[[torch.Tensor, torch.Tensor, MainTensors, str, str], torch.Tensor]
JacobianKernel = Callable[
    [torch.Tensor, torch.Tensor, MainTensors, str, str], tuple[torch.Tensor, torch.Tensor]
]

#: The compiled kernels by name: what :meth:`KernelCache.warm` compiles.
KERNELS: dict[str, Callable[..., Any]] = {
    "expected_main": expected_main,
    "expected_main_jacobian": expected_main_jacobian,
}
#: ``torch.compile`` modes whose CUDA back end records CUDA graphs (static shapes per bucket).
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def batch_bucket(rows: int, smallest: int = 2) -> int:
    """The power of two at or above ``rows`` (at least ``smallest``).

    >>> [batch_bucket(n) for n in (1, 2, 3, 100)]
    [2, 2, 4, 128]
    """
    return max(smallest, 1 << max(rows - 1, 0).bit_length())


def _own_code(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` with a code object of its own. Dynamo keeps compiled graphs, and counts
    recompilations against its limit, per code object: with one copy per structure key, a
    service meeting many structures does not exhaust one shared budget (past it Dynamo runs
    the function eagerly), and each structure's trace is a first trace (Inductor failed on
    some retraces of a shared one)."""
    copy = types.FunctionType(
        function.__code__.replace(),
        function.__globals__,
        function.__name__,
        function.__defaults__,
        function.__closure__,
    )
    copy.__kwdefaults__ = function.__kwdefaults__
    copy.__qualname__, copy.__doc__ = function.__qualname__, function.__doc__
    return copy


def _compile(function: Callable[..., Any], device: torch.device, mode: str | None) -> Any:
    """``torch.compile`` of ``function`` for ``device``: shapes static but for the axes
    :func:`_mark_dynamic` marks. On the CPU the generated code runs on one thread: with more,
    Inductor (torch 2.13) computed wrong Jacobian entries for some stacks."""
    if device.type != "cpu":
        return torch.compile(function, dynamic=False, mode=mode)
    options = {**torch._inductor.list_mode_options(mode or "default"), "cpp.threads": 1}
    return torch.compile(function, dynamic=False, options=options)


#: The axis over the stack's elements of each :class:`MainTensors` field that has one.
_ELEMENT_AXES = {
    "membership": 0,
    "own_nominal": 0,
    "own_histosys_coefficients": 0,
    "own_normsys_param": 0,
    "own_normsys_column": 0,
    "own_normsys_coefficients": 1,
    "own_multiplier_params": 0,
}


def _mark_dynamic(pars: torch.Tensor, element: torch.Tensor, main: MainTensors) -> None:
    """The two axes a kernel is traced as dynamic in: rows and elements."""
    torch._dynamo.maybe_mark_dynamic(pars, 0)
    torch._dynamo.maybe_mark_dynamic(element, 0)
    for name, axis in _ELEMENT_AXES.items():
        torch._dynamo.maybe_mark_dynamic(getattr(main, name), axis)


def _first_rows(out: Any, rows: int, copy: bool) -> Any:
    """The first ``rows`` rows of a kernel's tensor or tuple of tensors (copied if ``copy``)."""
    if isinstance(out, tuple):
        return tuple(_first_rows(t, rows, copy) for t in out)
    out = out.narrow(0, 0, rows)
    return out.clone() if copy else out


class KernelCache:
    """Compiled kernels keyed by (kernel, structure key, device, dtype).

    ``mode``: ``torch.compile``'s mode for every kernel (``"reduce-overhead"``: CUDA graphs
    per batch bucket on a CUDA model; ``None``: the default back end).
    """

    def __init__(self, mode: str | None = None) -> None:
        self.mode = mode
        self._kernels: dict[tuple[str, str, str, torch.dtype], Callable[..., Any]] = {}
        self._warm_buckets: set[tuple[str, str, str, torch.dtype, int]] = set()
        self._failed: set[tuple[str, str, str, torch.dtype]] = set()  # run eagerly
        self._lock = threading.Lock()

    def _key(self, model: HistFactoryModel) -> tuple[str, str, torch.dtype]:
        return (model.structure_key, str(model.device), model.dtype)

    def _kernel(self, name: str, model: HistFactoryModel) -> Callable[..., Any]:
        key = (name, *self._key(model))
        with self._lock:
            if key not in self._kernels:
                self._kernels[key] = _compile(_own_code(KERNELS[name]), model.device, self.mode)
            return self._kernels[key]

    def _padded(self, name: str, model: HistFactoryModel) -> Callable[..., Any]:
        """The compiled kernel ``name`` for ``model``'s structure, rows padded to a bucket."""
        kernel, eager = self._kernel(name, model), KERNELS[name]
        key = (name, *self._key(model))
        graphs = self.mode in CUDA_GRAPH_MODES and model.device.type == "cuda"

        def run(pars, element, main, histosys_code, normsys_code):
            args = (main, histosys_code, normsys_code)
            if (
                key in self._failed
                or pars.requires_grad
                or torch._C._are_functorch_transforms_active()
            ):  # autograd or torch.func (the exact Hessian of uncertainties) run eagerly
                return eager(pars, element, *args)
            rows = pars.shape[0]
            bucket = batch_bucket(rows)
            padded = pars, element
            if bucket != rows:
                pad = bucket - rows
                padded = (
                    torch.cat([pars, pars.narrow(0, rows - 1, 1).expand(pad, -1)]),
                    torch.cat([element, element.narrow(0, rows - 1, 1).expand(pad)]),
                )
            # contiguous rows: the graph is traced for them (an expanded row would retrace)
            padded = tuple(t.contiguous() for t in padded)
            _mark_dynamic(*padded, main)
            if graphs:  # each call is a new CUDA-graph generation; its outputs are copied out
                torch.compiler.cudagraph_mark_step_begin()
            try:
                out = kernel(*padded, *args)
            except torch._dynamo.exc.TorchDynamoException:
                result = eager(pars, element, *args)  # an error of the call raises here
                log.warning("compiling %s failed; it runs eagerly", name, exc_info=True)
                self._failed.add(key)
                return result
            self._warm_buckets.add((*key, bucket))
            return _first_rows(out, rows, copy=graphs)

        return run

    def expected_main(self, model: HistFactoryModel) -> MainKernel:
        """A drop-in for :func:`expected_main` that pads rows to a bucket and runs compiled."""
        return self._padded("expected_main", model)

    def expected_main_jacobian(self, model: HistFactoryModel) -> JacobianKernel:
        """A drop-in for :func:`expected_main_jacobian`, padded to a bucket and compiled."""
        return self._padded("expected_main_jacobian", model)

    def warm(self, model: HistFactoryModel, rows: int = 2) -> None:
        """Compile (outside any request) every kernel of ``model`` for ``rows`` rows.

        The batch is traced at the first bucket from ``rows`` on that equals no dimension of
        the model's tensors: a batch that happened to equal one (2 elements, 2 rows) would be
        traced with that equality as a guard, and the next batch would trace again.
        """
        sizes = {size for tensor in model.tensors().values() for size in tensor.shape}
        rows = batch_bucket(rows)
        while rows in sizes:
            rows *= 2
        pars = model.init.narrow(0, 0, 1).expand(rows, -1)
        element = model.element_index(None, rows)
        for name in KERNELS:
            run = self._padded(name, model)
            run(pars, element, model.main, model.histosys_code, model.normsys_code)
            if (name, *self._key(model)) in self._failed:
                raise RuntimeError(f"compiling {name} failed (see the log); it runs eagerly")

    def is_warm(self, model: HistFactoryModel, rows: int, kernel: str | None = None) -> bool:
        """Whether the bucket of ``rows`` has already run compiled for this model's structure:
        kernel ``kernel``, or (``None``) every kernel a fit calls."""
        names = KERNELS if kernel is None else (kernel,)
        bucket = batch_bucket(rows)
        return all((name, *self._key(model), bucket) in self._warm_buckets for name in names)
