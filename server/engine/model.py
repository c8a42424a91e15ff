"""A device-resident, batched HistFactory likelihood.

:class:`HistFactoryModel` holds every number of one or more stacked pyhf models as tensors on
one device and evaluates ``expected_data`` and ``logpdf`` for ``B`` rows at once, each row
with its own parameter point, dataset and element (patch) of the stack.

The main-model rates are computed over *sample variants*: the distinct samples over all
stacked elements (a patchset that only adds a signal sample shares every background sample
between its elements). For a flattened column ``q = (variant, bin)``::

    rate[b, q] = (nominal[q] + histosys_basis(alpha_b) @ C[:, q])
                 * exp(sum of normsys log-factors on q)
                 * prod(parameters multiplying q)

and a row's expected main data is the sum of the rates of its element's variants.

Example:
    >>> import pyhf, torch
    >>> ws = pyhf.Workspace(pyhf.simplemodels.uncorrelated_background(
    ...     [5.0], [10.0], [2.5]).spec | {"observations": [{"name": "singlechannel", "data": [12.0]}],
    ...     "measurements": [{"name": "m", "config": {"poi": "mu", "parameters": []}}], "version": "1.0.0"})
    >>> model = HistFactoryModel.from_workspace(ws)
    >>> model.expected_data(model.init).tolist()
    [[15.0, 16.0]]
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, Protocol, TypeVar, overload

import numpy as np
import pyhf
import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor

from . import schema
from .errors import IncompatibleModelsError
from .interpolation import normsys_kernel_coefficients
from .kernel import (
    ConstraintTensors,
    JacobianColumns,
    MainTensors,
    RatesCurvature,
    constraint_deviance,
    constraint_logpdf,
    constraint_saturated,
    expected_aux,
    expected_main,
    expected_main_gradient,
    expected_main_jacobian,
    main_rates_curvature,
    poisson_deviance,
    poisson_logpdf,
    poisson_saturated,
    variant_rates,
)
from .layout import ElementLayout
from .sparsity import BinBlocks, bin_parameters, slot_positions
from .stacking import StackLayout
from .translate import WorkspaceTranslator

_P = ParamSpec("_P")
_R = TypeVar("_R")

if TYPE_CHECKING:
    from .compiled import KernelCache, MainKernel

    class _Stack(Protocol):
        """What ``HistFactoryModel.stack`` is: on the class, the classmethod that stacks
        models; on an instance, the instance attribute that shadows it, the model's
        :class:`StackLayout`."""

        @overload
        def __get__(
            self, obj: None, owner: type[HistFactoryModel]
        ) -> Callable[[Sequence[HistFactoryModel]], HistFactoryModel]: ...
        @overload
        def __get__(self, obj: HistFactoryModel, owner: type[HistFactoryModel]) -> StackLayout: ...
        def __set__(self, obj: HistFactoryModel, value: StackLayout) -> None: ...


DeviceLike = str | torch.device


def _operations(patch: Any) -> list[dict[str, Any]]:
    """The JSON-patch operations of a patch: a list, a pyhf Patch, or ``{"patch": [...]}``."""
    if hasattr(patch, "patch"):
        return list(patch.patch)
    if isinstance(patch, dict):
        return list(patch["patch"])
    return list(patch)


def _patchset_operations(patchset: Any) -> dict[str, list[dict[str, Any]]]:
    """Patch name -> operations of a pyhf PatchSet or its JSON (validated by pyhf's schema)."""
    if not hasattr(patchset, "patches"):
        schema.validate(patchset, "patchset.json")
        return {p["metadata"]["name"]: p["patch"] for p in patchset["patches"]}
    return {p.name: list(p.patch) for p in patchset.patches}


class HistFactoryModel:
    """One or more stacked HistFactory models as tensors on one device.

    Build it with :meth:`from_workspace`, :meth:`from_patchset` or :meth:`stack`. All
    tensors are on ``device`` in ``dtype``; nothing is shared with other instances and no
    process-wide backend state is read or written.
    """

    def __init__(
        self,
        elements: Sequence[ElementLayout],
        device: DeviceLike = "cpu",
        dtype: torch.dtype = torch.float64,
    ) -> None:
        stack = StackLayout(elements)
        self.device = torch.device(device)
        self.dtype = dtype
        self.elements = stack.elements
        self.stack = stack
        self.structure_key = stack.structure_key
        first = stack.elements[0]
        self.histosys_code = first.histosys_code
        self.normsys_code = first.normsys_code
        self.par_names: list[str] = stack.par_names
        self.poi_index: int | None = stack.poi_index
        self.poi_name: str | None = stack.poi_name
        self.element_names = [e.name for e in stack.elements]
        self.n_elements = stack.n_elements
        self.n_pars = stack.n_pars
        self.n_main = stack.n_main
        self.n_aux = stack.n_aux
        self.n_variants = stack.n_variants
        self._expected_main: MainKernel = expected_main
        self._build_tensors()

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_workspace(
        cls,
        workspace: dict | pyhf.Workspace,
        *,
        measurement: str | None = None,
        patches: Iterable[Any] = (),
        modifier_settings: dict | None = None,
        device: DeviceLike = "cpu",
        dtype: torch.dtype = torch.float64,
        name: str | None = None,
    ) -> HistFactoryModel:
        """A one-element model of ``workspace`` (after ``patches``) for ``measurement``.

        The element is called ``name``, by default after the patches (``"nominal"`` if none).
        """
        translator = WorkspaceTranslator(
            dict(workspace), measurement=measurement, modifier_settings=modifier_settings
        )
        patches = list(patches)
        if name is None:
            name = "+".join(getattr(p, "name", "patch") for p in patches) or "nominal"
        operations = [op for patch in patches for op in _operations(patch)]
        return cls([translator.element(operations, name)], device, dtype)

    @classmethod
    def from_patchset(
        cls,
        workspace: dict | pyhf.Workspace,
        patchset: dict | pyhf.PatchSet,
        *,
        patch_names: Sequence[str] | None = None,
        measurement: str | None = None,
        modifier_settings: dict | None = None,
        device: DeviceLike = "cpu",
        dtype: torch.dtype = torch.float64,
    ) -> HistFactoryModel:
        """One stacked model with an element per patch of ``patchset`` (all, or ``patch_names``)."""
        translator = WorkspaceTranslator(
            dict(workspace), measurement=measurement, modifier_settings=modifier_settings
        )
        operations = _patchset_operations(patchset)
        names = list(patch_names) if patch_names is not None else list(operations)
        return cls([translator.element(operations[n], n) for n in names], device, dtype)

    @classmethod
    def _stack_models(cls, models: Sequence[HistFactoryModel]) -> HistFactoryModel:
        """Stack models (stackable elements, one device and dtype) into one batched model."""
        devices = {(m.device, m.dtype) for m in models}
        if len(devices) != 1:
            raise IncompatibleModelsError("models on different devices or dtypes cannot be stacked")
        device, dtype = devices.pop()
        return cls([e for m in models for e in m.elements], device, dtype)

    # HistFactoryModel.stack(models) stacks models; an instance's stack is its StackLayout
    if TYPE_CHECKING:
        stack: _Stack
    else:
        stack = _stack_models

    def to(
        self, device: DeviceLike | None = None, dtype: torch.dtype | None = None
    ) -> HistFactoryModel:
        """The same model on another device and/or dtype (a new instance)."""
        return type(self)(self.elements, device or self.device, dtype or self.dtype)

    def _tensor(self, array: Any, dtype: torch.dtype | None = None) -> Tensor:
        """``array`` as a tensor on the model's device: copied from host memory once, at build
        time; under FakeTensorMode (the device hygiene tests), where no host tensor may meet
        a fake one, made by a factory call on the device from Python numbers."""
        array = np.asarray(array)
        dtype = dtype or self.dtype
        if self._fake_device:
            tensor = torch.tensor(array.tolist(), dtype=dtype, device=self.device)
            return tensor.reshape(array.shape)
        return torch.from_numpy(np.ascontiguousarray(array)).to(device=self.device, dtype=dtype)

    def _build_tensors(self) -> None:
        stack, long = self.stack, torch.long
        self._fake_device = isinstance(torch.empty(0, device=self.device), FakeTensor)
        common, own = stack.common, stack.own
        distinct_param, distinct, distinct_coefficients = _distinct_normsys(
            common.normsys_param[0], common.normsys_coefficients[:, 0]
        )
        self.main = MainTensors(
            bins=self._tensor(np.arange(self.n_main), long),
            membership=self._tensor(stack.membership),
            nominal=self._tensor(common.nominal[0]),
            histosys_params=self._tensor(common.histosys_params, long),
            histosys_by_bin=self._tensor(
                common.histosys[0]
                .reshape(common.histosys.shape[1], stack.n_common, self.n_main)
                .transpose(2, 1, 0)  # [K * J, U, N] -> [N, U, K * J]
            ),
            normsys_param=self._tensor(common.normsys_param[0], long),
            normsys_column=self._tensor(common.normsys_column[0], long),
            normsys_distinct_param=self._tensor(distinct_param, long),
            normsys_distinct=self._tensor(distinct, long),
            normsys_coefficients=self._tensor(normsys_kernel_coefficients(distinct_coefficients)),
            multiplier_params=self._tensor(common.multiplier_params[0], long),
            own_nominal=self._tensor(own.nominal),
            own_histosys_params=self._tensor(own.histosys_params, long),
            own_histosys_coefficients=self._tensor(own.histosys),
            own_normsys_param=self._tensor(own.normsys_param, long),
            own_normsys_column=self._tensor(own.normsys_column, long),
            own_normsys_coefficients=self._tensor(
                normsys_kernel_coefficients(own.normsys_coefficients)
            ),
            own_multiplier_params=self._tensor(own.multiplier_params, long),
        )
        self.constraint = ConstraintTensors(
            param=self._tensor(stack.aux_param, long),
            is_poisson=self._tensor(stack.aux_is_poisson, torch.bool),
            sigma=self._tensor(stack.aux_sigma),
            scale=self._tensor(stack.aux_scale),
            present=self._tensor(stack.aux_present, torch.bool),
        )
        aux_param, poisson = stack.aux_param, stack.aux_is_poisson
        # parameters without a constraint term, and those with a Poisson one (their
        # curvature vanishes with a zero auxiliary count): the fitter's low-rank solver
        self.unconstrained = self._tensor(np.setdiff1d(np.arange(self.n_pars), aux_param), long)
        self.poisson_constrained = self._tensor(np.unique(aux_param[poisson]), long)
        # parameters with a kinked interpolation (code0 histosys, code1 normsys): the fitter
        # starts their fits on both sides of the kink
        self.kinked_params = self._tensor(stack.kinked_params, long)
        # [E, P] parameters whose every rate shift is even about 0 (hi == lo): the fitter
        # does not start them at 0, a stationary point of theirs whatever the data
        self.symmetric_params = self._tensor(stack.symmetric_params, torch.bool)
        self.has_symmetric_params = bool(stack.symmetric_params.any())  # known on the host
        # a free parameter without constraint scales only rates the POI scales too: the
        # asymptotic calculator's free fits do not start at POI = 0 alone (host bool)
        self.has_poi_gated_params = stack.poi_gated
        # parameters that multiply one bin each: the block solver eliminates them
        self.bin_parameters = bin_parameters(stack)
        self._jacobian_columns: JacobianColumns | None = None
        self._bin_blocks: BinBlocks | None = None
        self.init = self._tensor(stack.init)
        self.bounds = self._tensor(stack.bounds)
        self.fixed = self._tensor(stack.fixed, torch.bool)
        self.observed = self._tensor(stack.observed)

    def element_columns(self, element: int) -> list[int]:
        """The model's parameter columns of ``element``'s own parameters, in its pyhf order."""
        return self.stack.columns[element].tolist()

    # ------------------------------------------------------------------ evaluation
    def tensors(self) -> dict[str, Tensor]:
        """Every tensor the model holds, by name (all on ``self.device``, in ``self.dtype``
        for floating point)."""
        found = {k: v for k, v in vars(self).items() if isinstance(v, Tensor)}
        found.update({f"main.{k}": v for k, v in self.main._asdict().items()})
        found.update({f"constraint.{k}": v for k, v in self.constraint._asdict().items()})
        return found

    def element_index(self, element: Tensor | None, rows: int) -> Tensor:
        """``element`` as a LongTensor ``[rows]`` on the device (element 0 for every row if None)."""
        if element is None:
            return torch.zeros(rows, dtype=torch.long, device=self.device)
        return element

    def expected_data(
        self, pars: Tensor, element: Tensor | None = None, include_auxdata: bool = True
    ) -> Tensor:
        """Expected main (and auxiliary) data ``[B, N (+ A)]`` for parameters ``[B, P]``."""
        element = self.element_index(element, pars.shape[0])
        main = self._main_rates(pars, element, None)
        if not include_auxdata:
            return main
        return torch.cat([main, expected_aux(pars, element, self.constraint)], dim=1)

    def _kernel(
        self,
        kernel: Callable[Concatenate[Tensor, Tensor, MainTensors, str, str, _P], _R],
        pars: Tensor,
        element: Tensor,
        *args: _P.args,
        **kwargs: _P.kwargs,
    ) -> _R:
        """``kernel`` (of :mod:`.kernel`, or compiled) on the model's main tensors and codes."""
        main, histosys, normsys = self.main, self.histosys_code, self.normsys_code
        return kernel(pars, element, main, histosys, normsys, *args, **kwargs)

    def _main_rates(self, pars: Tensor, element: Tensor, rates: Tensor | None) -> Tensor:
        return self._kernel(self._expected_main, pars, element) if rates is None else rates

    def logpdf(self, pars: Tensor, data: Tensor, element: Tensor | None = None) -> Tensor:
        """``log L`` per row ``[B]`` of data ``[B, N + A]`` at parameters ``[B, P]``, as pyhf."""
        element = self.element_index(element, pars.shape[0])
        main_data = data.narrow(1, 0, self.n_main)
        aux_data = data.narrow(1, self.n_main, self.n_aux)
        main = poisson_logpdf(main_data, self._main_rates(pars, element, None)).sum(dim=1)
        return main + constraint_logpdf(pars, aux_data, element, self.constraint)

    def twice_nll(self, pars: Tensor, data: Tensor, element: Tensor | None = None) -> Tensor:
        """``-2 log L`` per row ``[B]``."""
        return -2.0 * self.logpdf(pars, data, element)

    def deviance(
        self, pars: Tensor, data: Tensor, element: Tensor | None = None, rates: Tensor | None = None
    ) -> Tensor:
        """``-2 log L`` minus :meth:`saturated_twice_nll` (a function of the data alone), per
        row ``[B]``: Poisson deviances of the main bins and of Poisson constraints, squared
        pulls of Normal constraints. Every term is non-negative and small near a good fit, so
        a minimiser comparing values of order 1 instead of a ``-2 log L`` of order 100 loses
        no digits (float32 keeps ~7 of them). ``rates``: the expected main data at ``pars`` if
        already at hand (from :meth:`expected_main_jacobian`), so that they are not computed
        twice.
        """
        element = self.element_index(element, pars.shape[0])
        rates = self._main_rates(pars, element, rates)
        main = poisson_deviance(data.narrow(1, 0, self.n_main), rates).sum(dim=1)
        aux = data.narrow(1, self.n_main, self.n_aux)
        return main + constraint_deviance(pars, aux, element, self.constraint)

    def saturated_twice_nll(self, data: Tensor, element: Tensor | None = None) -> Tensor:
        """``twice_nll - deviance`` ``[B]``: ``-2 log L`` of data ``[B, N + A]`` with every
        expectation equal to its observation (Normal constraints: their normalisation)."""
        element = self.element_index(element, data.shape[0])
        main = poisson_saturated(data.narrow(1, 0, self.n_main)).sum(dim=1)
        aux = data.narrow(1, self.n_main, self.n_aux)
        return main + constraint_saturated(aux, element, self.constraint)

    def expected_main_jacobian(
        self, pars: Tensor, element: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """Expected main data ``[B, N]`` and its closed-form Jacobian ``[B, N, P]``."""
        element = self.element_index(element, pars.shape[0])
        return self._kernel(expected_main_jacobian, pars, element)

    def jacobian_columns(self) -> JacobianColumns:
        """Where the block Jacobian puts each parameter (:mod:`.sparsity`), on the device (built
        on first use)."""
        if self._jacobian_columns is None:
            structure, P = self.bin_parameters, self.n_pars
            shared = np.full(P + 1, structure.n_shared, dtype=np.int64)
            shared[structure.shared] = np.arange(structure.n_shared)
            per_bin = np.full(P + 1, structure.n_per_bin, dtype=np.int64)
            per_bin[structure.params] = np.arange(structure.n_per_bin)
            width = structure.slots.shape[1]
            slot = np.full(P + 1, width, dtype=np.int64)
            slot[structure.params] = slot_positions(structure) % width
            self._jacobian_columns = JacobianColumns(
                self._tensor(shared, torch.long),
                self._tensor(per_bin, torch.long),
                structure.n_shared,
                structure.n_per_bin,
                self._tensor(slot, torch.long),
                width,
            )
        return self._jacobian_columns

    def bin_blocks(self) -> BinBlocks:
        """:attr:`bin_parameters` as index tensors on the device (built on first use)."""
        if self._bin_blocks is None:
            structure, long = self.bin_parameters, torch.long
            self._bin_blocks = BinBlocks(
                shared=self._tensor(structure.shared, long),
                params=self._tensor(structure.params, long),
                bins=self._tensor(structure.bins, long),
                slots=self._tensor(structure.slots, long),
                position=self._tensor(slot_positions(structure), long),
            )
        return self._bin_blocks

    def expected_main_block_jacobian(
        self, pars: Tensor, element: Tensor | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Expected main data ``[B, N]`` and its Jacobian in the two parts of
        :attr:`bin_parameters`: ``[B, N, K]`` over the shared parameters and ``[B, M]``, each
        per-bin parameter's derivative of its own bin (no structural zeros built). Eager."""
        element = self.element_index(element, pars.shape[0])
        return self._kernel(expected_main_jacobian, pars, element, self.jacobian_columns())

    def expected_main_gradient(
        self, pars: Tensor, element: Tensor, residual: Callable[[Tensor], Tensor]
    ) -> tuple[Tensor, Tensor]:
        """Expected main data ``[B, N]`` and ``sum_n r_n d(expected bin n) / d pars`` ``[B,
        P]`` for ``r = residual(expected)``, the Jacobian never built
        (:func:`~.kernel.expected_main_gradient`). Eager."""
        return self._kernel(expected_main_gradient, pars, element, residual)

    def main_rates_curvature(
        self, pars: Tensor, element: Tensor, bin_weights: Tensor, block: bool = False
    ) -> Tensor | RatesCurvature:
        """``sum_n w_n d2(expected bin n) / d pars2`` ``[B, P, P]`` for bin weights ``w [B,
        N]``, in closed form (the second-order term Gauss-Newton drops); ``block``: in the
        block form of :meth:`jacobian_columns` (:class:`~.kernel.RatesCurvature`)."""
        columns = self.jacobian_columns() if block else None
        return self._kernel(main_rates_curvature, pars, element, bin_weights, columns)

    # ------------------------------------------------------------------ per sample
    @property
    def n_samples(self) -> int:
        """The most samples any element has: the sample axis of :meth:`sample_rates`."""
        return max(len(e.samples) for e in self.elements)

    def sample_names(self, element: int) -> list[str]:
        """``element``'s samples in pyhf's order (``config.samples``): :meth:`sample_rates`'
        sample axis for its rows (padded with zero rates up to :attr:`n_samples`)."""
        return [s.name for s in self.elements[element].samples]

    def sample_rates(self, pars: Tensor, element: Tensor | None = None) -> Tensor:
        """Expected main rates per sample ``[B, S, N]`` for parameters ``[B, P]`` (pyhf's
        ``main_model.expected_data(pars, return_by_sample=True)`` per row): sample ``s`` of a
        row is the ``s``-th of its element's :meth:`sample_names`, zeros past its last one.
        Summed over ``S`` it is ``expected_data(pars, element, include_auxdata=False)``.
        Eager (never the compiled kernels); everything stays on the device."""
        element = self.element_index(element, pars.shape[0])
        rates = self._kernel(variant_rates, pars, element)
        padded = torch.cat([rates, torch.zeros_like(rates.narrow(1, 0, 1))], dim=1)
        index = self._sample_variant_index.index_select(0, element)  # [B, S]
        index = index.unsqueeze(2).expand(-1, -1, self.n_main)
        return padded.gather(1, index)

    @cached_property
    def _sample_variant_index(self) -> Tensor:
        """``[E, S]``: per element and sample, its position on :func:`variant_rates`' variant
        axis (the padding position ``U + S_own`` past the element's last sample), as the
        stack laid it out (:attr:`StackLayout.sample_variant`); on the device on first use."""
        return self._tensor(self.stack.sample_variant, torch.long)

    def enable_compile(self, kernels: KernelCache) -> None:
        """Evaluate the main model through ``kernels`` (compiled per structure and batch
        bucket): the rates behind ``expected_data``, ``logpdf`` and ``deviance``, and
        :meth:`expected_main_jacobian`, the minimiser's derivative call (this instance's
        attribute from now on, in place of the eager method)."""
        self._expected_main = kernels.expected_main(self)
        # an instance attribute in place of the method (mypy: a method cannot be reassigned)
        self.expected_main_jacobian = self._compiled_jacobian(  # type: ignore[method-assign]
            kernels.expected_main_jacobian(self)
        )

    def _compiled_jacobian(self, kernel: Any) -> Any:
        """:meth:`expected_main_jacobian` evaluated by ``kernel`` (the same signature)."""

        def expected_main_jacobian(
            pars: Tensor, element: Tensor | None = None
        ) -> tuple[Tensor, Tensor]:
            return self._kernel(kernel, pars, self.element_index(element, pars.shape[0]))

        expected_main_jacobian.__doc__ = HistFactoryModel.expected_main_jacobian.__doc__
        return expected_main_jacobian

    def __repr__(self) -> str:
        return (
            f"HistFactoryModel(elements={self.n_elements}, pars={self.n_pars}, bins={self.n_main}, "
            f"aux={self.n_aux}, device={self.device}, dtype={self.dtype})"
        )


def _distinct_normsys(
    param: np.ndarray, coefficients: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The distinct (parameter, coefficients) among normsys entries ``param [T]``,
    ``coefficients [8, T]``: their parameters ``[T_d]``, each entry's index into them ``[T]``
    and their coefficients ``[8, T_d]`` (a sample's normsys repeats on each of its bins).

    >>> p, d, c = _distinct_normsys(np.array([3, 3, 5]), np.array([[0.1, 0.1, 0.2]] * 8))
    >>> p.tolist(), d.tolist(), c.shape
    ([3, 5], [0, 0, 1], (8, 2))
    """
    if param.shape[0] == 0:
        return param, param, coefficients
    keys = np.concatenate([param[None].astype(np.float64), coefficients]).T  # [T, 9]
    unique, distinct = np.unique(keys, axis=0, return_inverse=True)
    return unique[:, 0].astype(np.int64), distinct.reshape(-1), unique[:, 1:].T
