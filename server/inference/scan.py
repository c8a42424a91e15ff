"""Profile-likelihood scans (cabinetry's ``fit.scan``), 1D and 2D, batched over rows.

At every grid point the scanned parameter(s) are fixed and the others fitted; the result is
``-2 Delta ln L = 2 (NLL(fixed) - NLL(global minimum))`` per row and point, the global
minimum being the row's free fit. Every conditional fit of every row and the ``B`` free fits
run as ONE batched :func:`~pyhf_gpu_server.inference.mle.fit_rows` call (the conditional fits
start at the model's init with the scanned parameters at the grid point, as cabinetry's);
then the exact Hessian at the free minima gives the scanned parameters' uncertainties.

The differences are taken between the fits' deviances (``-2 log L`` less its data-only
constant, the same for both fits of a row), which keeps their digits in float32 too. A grid
value outside the scanned parameter's bounds (say, a negative POI where the POI is bounded
at 0) is refused rather than moved onto the bound.

Example:
    >>> import pyhf, torch
    >>> from pyhf_gpu_server.engine import HistFactoryModel
    >>> spec = pyhf.simplemodels.uncorrelated_background([12.0, 11.0], [50.0, 52.0], [3.0, 7.0]).spec
    >>> ws = {**spec, "observations": [{"name": "singlechannel", "data": [62.0, 61.0]}],
    ...       "measurements": [{"name": "m", "config": {"poi": "mu", "parameters": []}}],
    ...       "version": "1.0.0"}
    >>> model = HistFactoryModel.from_workspace(ws)
    >>> res = scan(model, "mu", [0.0, 1.0, 2.0])
    >>> [round(v, 4) for v in res.delta_nlls[0].tolist()], round(res.bestfit[0].item(), 4)
    ([2.9556, 0.0127, 3.3366], 0.9365)
    >>> try:
    ...     scan(model, "mu", [-1.0, 1.0])
    ... except ValueError as error:
    ...     print(error)
    scan values of 'mu' must lie within its bounds [0.0, 10.0]: got -1.0 to 1.0
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .errors import InferenceError
from .mle import FitOptions, fit_rows, hessian_uncertainties, rows_data
from .ranking import host_elements
from .results import FittedRows
from .rows import as_float
from .starts import FitStatus

__all__ = ["Scan2DResults", "ScanResults", "scan", "scan2d"]


@dataclass
class ScanResults(FittedRows):
    """A 1D profile-likelihood scan of ``B`` rows over ``G`` values (cabinetry's
    ``ScanResults`` per row).

    Attributes:
        name: the scanned parameter's label.
        bestfit: ``[B]`` its free-fit value.
        uncertainty: ``[B]`` its free-fit (Hessian) uncertainty.
        parameter_values: ``[G]`` the scanned values.
        delta_nlls: ``[B, G]`` ``-2 Delta ln L`` at each value (negative only where a
            conditional fit found a lower minimum than the free fit: see ``converged``).
        element: ``[B]`` element of each row.
        points_converged: ``[B, G]`` bool, each conditional fit converged.
        converged: ``[B]`` bool, the free fit and every conditional fit of the row converged.
        starts: ``[B]`` the most start points any fit of the row ran.
        starts_agreed: ``[B]`` bool, in every fit of the row all converged starts agreed.
    """

    name: str
    bestfit: Tensor
    uncertainty: Tensor
    parameter_values: Tensor
    delta_nlls: Tensor
    element: Tensor
    points_converged: Tensor
    converged: Tensor
    starts: Tensor
    starts_agreed: Tensor

    def to_json(self, i: int = 0) -> dict:
        """Row ``i`` with cabinetry's field names, and the row's fit status."""
        return {
            "name": self.name,
            "bestfit": float(self.bestfit[i]),
            "uncertainty": float(self.uncertainty[i]),
            "parameter_values": self.parameter_values.tolist(),
            "delta_nlls": self.delta_nlls[i].tolist(),
            "converged": bool(self.converged[i]),
            "starts": int(self.starts[i]),
            "starts_agreed": bool(self.starts_agreed[i]),
        }


@dataclass
class Scan2DResults(FittedRows):
    """A 2D profile-likelihood scan of ``B`` rows over a ``G_x x G_y`` grid.

    Attributes:
        names: the two scanned parameters' labels ``(x, y)``.
        bestfit: ``[B, 2]`` their free-fit values.
        uncertainty: ``[B, 2]`` their free-fit (Hessian) uncertainties.
        correlation: ``[B]`` their free-fit correlation.
        parameter_values: ``([G_x], [G_y])`` the grid's axes.
        delta_nlls: ``[B, G_x, G_y]`` ``-2 Delta ln L`` at ``(x[i], y[j])``.
        element, points_converged (``[B, G_x, G_y]``), converged, starts, starts_agreed: as
            :class:`ScanResults`.
    """

    names: tuple[str, str]
    bestfit: Tensor
    uncertainty: Tensor
    correlation: Tensor
    parameter_values: tuple[Tensor, Tensor]
    delta_nlls: Tensor
    element: Tensor
    points_converged: Tensor
    converged: Tensor
    starts: Tensor
    starts_agreed: Tensor

    def to_json(self, i: int = 0) -> dict:
        """Row ``i``: cabinetry's scan fields, each per axis (``delta_nlls``: ``[G_x][G_y]``)."""
        return {
            "names": list(self.names),
            "bestfit": self.bestfit[i].tolist(),
            "uncertainty": self.uncertainty[i].tolist(),
            "correlation": float(self.correlation[i]),
            "parameter_values": [v.tolist() for v in self.parameter_values],
            "delta_nlls": self.delta_nlls[i].tolist(),
            "converged": bool(self.converged[i]),
            "starts": int(self.starts[i]),
            "starts_agreed": bool(self.starts_agreed[i]),
        }


def _host_values(values) -> list[float]:
    """The grid values on the host, to check them against the bounds before any fit (one
    copy when they come as a device tensor)."""
    if isinstance(values, Tensor):
        return [float(v) for v in values.reshape(-1).tolist()]
    if isinstance(values, Sequence):
        return [float(v) for v in values]
    return [float(values)]


def _column(model, name: str) -> int:
    if name not in model.par_names:
        raise InferenceError(f"parameter {name!r} is not in the model")
    return model.par_names.index(name)


def _check(model, names, columns, axes, elements, bounds) -> None:
    """Every scanned parameter is a free parameter of every row's element, and its grid lies
    within its bounds in every row; :class:`InferenceError` naming it otherwise."""
    host_bounds = (
        model.stack.bounds[elements].tolist()
        if bounds is None
        else torch.as_tensor(bounds).expand(len(elements), model.n_pars, 2).tolist()
    )
    for name, column, values in zip(names, columns, axes, strict=True):
        if not values:
            raise InferenceError(f"no scan values given for {name!r}")
        for row, e in enumerate(elements):
            if column not in model.element_columns(e):
                raise InferenceError(
                    f"parameter {name!r} is not a parameter of element "
                    f"{model.element_names[e]!r}: it cannot be scanned there"
                )
            if bool(model.stack.fixed[e, column]):
                raise InferenceError(f"parameter {name!r} is fixed: it cannot be scanned")
            lo, hi = host_bounds[row][column]
            if min(values) < lo or max(values) > hi:
                raise InferenceError(
                    f"scan values of {name!r} must lie within its bounds [{lo}, {hi}]: "
                    f"got {min(values)} to {max(values)}"
                )


def _profile(
    model, names, axes, data, element, bounds, options
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, FitStatus, Tensor]:
    """The free fits and the conditional fits at every grid point (the Cartesian product of
    ``axes``, first axis slowest) of ``B`` rows, in one batched call.

    Returns ``(bestfit [B, P], unc [B, P], corr [B, P, P], deviance [B, G], converged [B, G],
    status [B], element [B])``: the free fits with their uncertainties and correlations, the
    conditional fits' ``-2 Delta ln L`` and convergence."""
    options = options or FitOptions()
    columns = [_column(model, n) for n in names]
    if len(set(columns)) != len(columns):
        raise InferenceError("a 2D scan needs two different parameters")
    host_axes = [_host_values(v) for v in axes]
    rows, element_rows = rows_data(model, data, element)
    B, P = element_rows.shape[0], model.n_pars
    elements = host_elements(model, element, data, B)
    _check(model, names, columns, host_axes, elements, bounds)
    grid = torch.cartesian_prod(*[as_float(model, v) for v in axes])  # [G, k] (or [G])
    grid = grid.reshape(-1, len(columns))
    G = grid.shape[0]
    box = (
        model.bounds.index_select(0, element_rows)
        if bounds is None
        else as_float(model, bounds).expand(B, -1, -1)
    )
    init = model.init.index_select(0, element_rows)
    fixed = model.fixed.index_select(0, element_rows)
    index = torch.tensor(columns, dtype=torch.long, device=model.device)
    cond_init = init.repeat_interleave(G, 0).index_copy(1, index, grid.repeat(B, 1))
    pin = torch.zeros(P, dtype=torch.bool, device=model.device).index_fill(0, index, True)
    cond_fixed = fixed.repeat_interleave(G, 0) | pin
    every = fit_rows(
        model,
        torch.cat([rows, rows.repeat_interleave(G, 0)]),
        torch.cat([element_rows, element_rows.repeat_interleave(G, 0)]),
        init=torch.cat([init, cond_init]),
        bounds=torch.cat([box, box.repeat_interleave(G, 0)]),
        fixed=torch.cat([fixed, cond_fixed]),
        options=options,
    )
    # the free rows first, then the conditional ones (``narrow``: FakeTensorMode refuses
    # slicing, so FitResults.select is not used)
    bestfit = every.bestfit.narrow(0, 0, B)
    free_status = FitStatus(*(t.narrow(0, 0, B) for t in every.status))
    cond_status = FitStatus(*(t.narrow(0, B, B * G) for t in every.status))
    unc, corr = hessian_uncertainties(model, rows, element_rows, bestfit, fixed, options)
    deviance = every.deviance.narrow(0, B, B * G).view(B, G) - every.deviance.narrow(
        0, 0, B
    ).unsqueeze(1)
    status = FitStatus.combine([free_status, cond_status.grouped(B)])
    return bestfit, unc, corr, deviance, cond_status.converged.view(B, G), status, element_rows


def scan(
    model,
    parameter: str,
    values,
    data: Tensor | None = None,
    element=None,
    options: FitOptions | None = None,
    *,
    bounds: Tensor | None = None,
) -> ScanResults:
    """A profile-likelihood scan of ``parameter`` over ``values`` for ``B`` rows at once.

    Args:
        model: a :class:`~pyhf_gpu_server.engine.HistFactoryModel`.
        parameter: a label of ``model.par_names`` (``"gamma[0]"`` for a component).
        values: ``[G]`` grid values (a sequence, or a tensor: one copy to the host to check
            them against the bounds).
        data: ``[B, N + A]`` datasets; None for the observations of ``element``.
        element: the element of each row; None: every element (no ``data``) or element 0.
        options: :class:`~pyhf_gpu_server.inference.mle.FitOptions`.
        bounds: ``[P, 2]`` or ``[B, P, 2]`` parameter bounds (default: the model's).

    Raises:
        InferenceError: (a ``ValueError``) ``parameter`` is not in the model, is fixed (or
            not a parameter) in a row's element, or a value lies outside its bounds.
    """
    bestfit, unc, _, delta, ok, status, element_rows = _profile(
        model, [parameter], [values], data, element, bounds, options
    )
    k = model.par_names.index(parameter)
    return ScanResults(
        name=parameter,
        bestfit=bestfit.select(1, k),
        uncertainty=unc.select(1, k),
        parameter_values=as_float(model, values).reshape(-1),
        delta_nlls=delta,
        element=element_rows,
        points_converged=ok,
        converged=status.converged,
        starts=status.starts,
        starts_agreed=status.agreed,
    )


def scan2d(
    model,
    parameters: tuple[str, str],
    values_x,
    values_y,
    data: Tensor | None = None,
    element=None,
    options: FitOptions | None = None,
    *,
    bounds: Tensor | None = None,
) -> Scan2DResults:
    """A 2D profile-likelihood scan of ``parameters = (x, y)`` over the grid ``values_x [G_x]
    x values_y [G_y]``: all ``G_x * G_y`` conditional fits of every row and the free fits in
    one batched call. Arguments and errors as :func:`scan`."""
    if len(parameters) != 2:
        raise InferenceError("a 2D scan needs exactly two parameters")
    names = (parameters[0], parameters[1])
    bestfit, unc, corr, delta, ok, status, element_rows = _profile(
        model, list(names), [values_x, values_y], data, element, bounds, options
    )
    kx, ky = (model.par_names.index(n) for n in names)
    vx = as_float(model, values_x).reshape(-1)
    vy = as_float(model, values_y).reshape(-1)
    B, Gx, Gy = delta.shape[0], vx.shape[0], vy.shape[0]
    return Scan2DResults(
        names=names,
        bestfit=torch.stack([bestfit.select(1, kx), bestfit.select(1, ky)], 1),
        uncertainty=torch.stack([unc.select(1, kx), unc.select(1, ky)], 1),
        correlation=corr.select(1, kx).select(1, ky),
        parameter_values=(vx, vy),
        delta_nlls=delta.view(B, Gx, Gy),
        element=element_rows,
        points_converged=ok.view(B, Gx, Gy),
        converged=status.converged,
        starts=status.starts,
        starts_agreed=status.agreed,
    )
