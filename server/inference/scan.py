"""Profile-likelihood scans (cabinetry's ``fit.scan``), 1D and 2D, batched over rows.

At every grid point the scanned parameter(s) are fixed and the others fitted; the result is
``-2 Delta ln L = 2 (NLL(fixed) - NLL(global minimum))`` per row and point, the global
minimum being the row's free fit. Every conditional fit of every row and the ``B`` free fits
run as ONE batched :func:`~pyhf_gpu_server.inference.mle.fit_rows` call (the conditional fits
start at the model's init with the scanned parameters at the grid point, as cabinetry's; the
free fits also from the background-only POI, as :func:`~.mle.fit`'s);
then the exact Hessian at the free minima gives the scanned parameters' uncertainties. An
axis given no values gets cabinetry's default grid, per row: ``steps`` points over the best
fit plus/minus :data:`AUTO_SIGMAS` uncertainties (within the bounds); then the free fits and
their Hessians run first, and the conditional fits in a second batched call.

The differences are taken between the fits' deviances (``-2 log L`` less its data-only
constant, the same for both fits of a row), which keeps their digits in float32 too. A grid
value outside the scanned parameter's bounds (say, a negative POI where the POI is bounded
at 0) is refused rather than moved onto the bound.

Example:
    >>> import torch
    >>> from pyhf_gpu_server.inference.examples import simple_model
    >>> model = simple_model([12.0, 11.0], [50.0, 52.0], [3.0, 7.0], data=[62.0, 61.0])
    >>> res = scan(model, "mu", [0.0, 1.0, 2.0])
    >>> [round(v, 4) for v in res.delta_nlls[0].tolist()], round(res.bestfit[0].item(), 4)
    ([2.9556, 0.0127, 3.3366], 0.9365)
    >>> auto = scan(model, "mu", steps=3)  # best fit +- 3 sigma, cabinetry's default
    >>> [round(v, 3) for v in auto.parameter_values[0].tolist()]
    [0.0, 1.312, 2.624]
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
from .minimize import BOUND_TOL
from .mle import FitOptions, fit_rows, hessian_uncertainties
from .ranking import poi_on_bound
from .results import FittedRows
from .rows import Rows, as_float, row_bounds, rows_of
from .starts import FitStatus

__all__ = ["AUTO_SIGMAS", "Scan2DResults", "ScanResults", "grid_problem", "scan", "scan2d"]

#: an automatic grid spans the best fit plus/minus this many uncertainties (cabinetry's)
AUTO_SIGMAS = 3.0


@dataclass
class ScanResults(FittedRows):
    """A 1D profile-likelihood scan of ``B`` rows over ``G`` values (cabinetry's
    ``ScanResults`` per row).

    Attributes:
        name: the scanned parameter's label.
        bestfit: ``[B]`` its free-fit value.
        uncertainty: ``[B]`` its free-fit (Hessian) uncertainty.
        parameter_values: ``[B, G]`` the scanned values of each row (the same in every row
            unless the grid was automatic).
        delta_nlls: ``[B, G]`` ``-2 Delta ln L`` at each value (negative only where a
            conditional fit found a lower minimum than the free fit: see ``converged``).
        element: ``[B]`` element of each row.
        points_converged: ``[B, G]`` bool, each conditional fit converged.
        converged: ``[B]`` bool, the free fit and every conditional fit of the row converged.
        starts: ``[B]`` the most start points any fit of the row ran.
        starts_agreed: ``[B]`` bool, in every fit of the row all converged starts agreed.
        poi_bound: ``[B]`` the bound on which the free fit's POI sits
            (:func:`~pyhf_gpu_server.inference.ranking.poi_on_bound`: the profile is the
            bounded one's there), NaN where on neither; None: the model has no POI.
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
    poi_bound: Tensor | None = None


@dataclass
class Scan2DResults(FittedRows):
    """A 2D profile-likelihood scan of ``B`` rows over a ``G_x x G_y`` grid.

    Attributes:
        names: the two scanned parameters' labels ``(x, y)``.
        bestfit: ``[B, 2]`` their free-fit values.
        uncertainty: ``[B, 2]`` their free-fit (Hessian) uncertainties.
        correlation: ``[B]`` their free-fit correlation.
        parameter_values: ``([B, G_x], [B, G_y])`` each row's grid axes.
        delta_nlls: ``[B, G_x, G_y]`` ``-2 Delta ln L`` at ``(x[i], y[j])``.
        element, points_converged (``[B, G_x, G_y]``), converged, starts, starts_agreed,
            poi_bound: as :class:`ScanResults`.
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
    poi_bound: Tensor | None = None


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


def grid_problem(name: str, values: Sequence[float], lo: float, hi: float) -> str | None:
    """Why the grid ``values`` of ``name`` cannot be scanned within its bounds, or None."""
    if min(values) < lo or max(values) > hi:
        return (
            f"scan values of {name!r} must lie within its bounds [{lo}, {hi}]: "
            f"got {min(values)} to {max(values)}"
        )
    return None


def _check(model, names, columns, axes, elements, bounds) -> None:
    """Every scanned parameter is a free parameter of every row's element, and its given grid
    lies within its bounds in every row; :class:`InferenceError` naming it otherwise."""
    host_bounds = (
        model.stack.bounds[elements].tolist()
        if bounds is None
        else torch.as_tensor(bounds).expand(len(elements), model.n_pars, 2).tolist()
    )
    for name, column, values in zip(names, columns, axes, strict=True):
        if values is not None and not values:
            raise InferenceError(f"no scan values given for {name!r}")
        for row, e in enumerate(elements):
            if column not in model.element_columns(e):
                raise InferenceError(
                    f"parameter {name!r} is not a parameter of element "
                    f"{model.element_names[e]!r}: it cannot be scanned there"
                )
            if bool(model.stack.fixed[e, column]):
                raise InferenceError(f"parameter {name!r} is fixed: it cannot be scanned")
            problem = values and grid_problem(name, values, *host_bounds[row][column])
            if problem:
                raise InferenceError(problem)


def _profile(
    model, names, axes, steps, rows: Rows, bounds, options
) -> tuple[Tensor, Tensor, Tensor, list[Tensor], Tensor, Tensor, FitStatus, Tensor, Tensor | None]:
    """The free fits and the conditional fits at every grid point (the Cartesian product of
    ``axes``, first axis slowest) of ``B`` rows: one batched call, or two where an axis is
    None (automatic: its ``steps`` points over each row's best fit +- :data:`AUTO_SIGMAS`
    uncertainties, within the bounds).

    Returns ``(bestfit [B, P], unc [B, P], corr [B, P, P], axes [[B, G_k]], deviance [B, G],
    converged [B, G], status [B], element [B], poi_bound [B] or None)``: the free fits with
    their uncertainties and correlations, each row's grid axes, the conditional fits' ``-2
    Delta ln L`` and convergence, and the bound the free fit's POI sits on (NaN: neither; None:
    no POI)."""
    options = options or FitOptions()
    columns = [_column(model, n) for n in names]
    if len(set(columns)) != len(columns):
        raise InferenceError("a 2D scan needs two different parameters")
    host_axes = [None if v is None else _host_values(v) for v in axes]
    elements = rows.host_elements()
    data, element_rows = rows.data, rows.element
    B, P = element_rows.shape[0], model.n_pars
    _check(model, names, columns, host_axes, elements, bounds)
    box = row_bounds(model, element_rows, bounds)
    init = model.init.index_select(0, element_rows)
    fixed = model.fixed.index_select(0, element_rows)
    automatic = any(v is None for v in axes)
    free = None
    if automatic:
        free = fit_rows(
            model,
            data,
            element_rows,
            init=init,
            bounds=box,
            fixed=fixed,
            options=options,
            background_start=B,
        )
        unc, corr = hessian_uncertainties(model, data, element_rows, free.bestfit, fixed, options)
    row_axes = []
    for v, c, n in zip(axes, columns, steps, strict=True):
        if v is not None:
            row_axes.append(as_float(model, v).reshape(1, -1).expand(B, -1))
        else:
            assert free is not None  # an automatic axis: the free fit ran above
            row_axes.append(_automatic_axis(free.bestfit, unc, box, c, n))
    grid = _row_grid(row_axes)  # [B, G, k]
    G = grid.shape[1]
    index = torch.tensor(columns, dtype=torch.long, device=model.device)
    cond_init = init.repeat_interleave(G, 0).index_copy(1, index, grid.reshape(B * G, -1))
    pin = torch.zeros(P, dtype=torch.bool, device=model.device).index_fill(0, index, True)
    cond_fixed = fixed.repeat_interleave(G, 0) | pin
    cond_rows = (data.repeat_interleave(G, 0), element_rows.repeat_interleave(G, 0))
    if free is None:  # the free and the conditional fits in one call, the free rows first
        every = fit_rows(
            model,
            torch.cat([data, cond_rows[0]]),
            torch.cat([element_rows, cond_rows[1]]),
            init=torch.cat([init, cond_init]),
            bounds=torch.cat([box, box.repeat_interleave(G, 0)]),
            fixed=torch.cat([fixed, cond_fixed]),
            options=options,
            background_start=B,
        )
        # ``narrow``: FakeTensorMode refuses slicing, so FitResults.select is not used
        bestfit = every.bestfit.narrow(0, 0, B)
        free_status = FitStatus(*(t.narrow(0, 0, B) for t in every.status))
        cond_status = FitStatus(*(t.narrow(0, B, B * G) for t in every.status))
        free_deviance = every.deviance.narrow(0, 0, B)
        cond_deviance = every.deviance.narrow(0, B, B * G)
        unc, corr = hessian_uncertainties(model, data, element_rows, bestfit, fixed, options)
    else:
        cond = fit_rows(
            model,
            *cond_rows,
            init=cond_init,
            bounds=box.repeat_interleave(G, 0),
            fixed=cond_fixed,
            options=options,
        )
        bestfit, free_status, free_deviance = free.bestfit, free.status, free.deviance
        cond_status, cond_deviance = cond.status, cond.deviance
    deviance = cond_deviance.view(B, G) - free_deviance.unsqueeze(1)
    status = FitStatus.combine([free_status, cond_status.grouped(B)])
    converged = cond_status.converged.view(B, G)
    k = model.poi_index
    poi_bound = None
    if k is not None:
        poi_bound = poi_on_bound(bestfit.select(1, k), box.select(1, k), BOUND_TOL)
    return bestfit, unc, corr, row_axes, deviance, converged, status, element_rows, poi_bound


def _automatic_axis(bestfit: Tensor, unc: Tensor, box: Tensor, column: int, steps: int) -> Tensor:
    """``[B, steps]`` points over each row's best fit +- :data:`AUTO_SIGMAS` uncertainties of
    ``column``, clipped to its bounds (cabinetry's default grid); where the uncertainty is not
    finite, the bounds themselves."""
    centre, sigma = bestfit.select(1, column), unc.select(1, column)
    lo, hi = box.select(-1, 0).select(1, column), box.select(-1, 1).select(1, column)
    ok = torch.isfinite(sigma) & (sigma > 0)
    low = torch.where(ok, torch.maximum(centre - AUTO_SIGMAS * sigma, lo), lo)
    high = torch.where(ok, torch.minimum(centre + AUTO_SIGMAS * sigma, hi), hi)
    fraction = torch.linspace(0.0, 1.0, steps, dtype=bestfit.dtype, device=bestfit.device)
    return low.unsqueeze(1) + (high - low).unsqueeze(1) * fraction


def _row_grid(axes: list[Tensor]) -> Tensor:
    """``[B, G, k]``: per row, the Cartesian product of its axes ``[B, G_k]`` (first axis
    slowest)."""
    if len(axes) == 1:
        return axes[0].unsqueeze(-1)
    x, y = axes
    B, Gx, Gy = x.shape[0], x.shape[1], y.shape[1]
    xs = x.unsqueeze(2).expand(B, Gx, Gy)
    ys = y.unsqueeze(1).expand(B, Gx, Gy)
    return torch.stack([xs, ys], -1).reshape(B, Gx * Gy, 2)


def scan(
    model,
    parameter: str,
    values=None,
    data: Tensor | None = None,
    element=None,
    options: FitOptions | None = None,
    *,
    bounds: Tensor | None = None,
    steps: int = 11,
) -> ScanResults:
    """A profile-likelihood scan of ``parameter`` over ``values`` for ``B`` rows at once.

    Args:
        model: a :class:`~pyhf_gpu_server.engine.HistFactoryModel`.
        parameter: a label of ``model.par_names`` (``"gamma[0]"`` for a component).
        values: ``[G]`` grid values (a sequence, or a tensor: one copy to the host to check
            them against the bounds); None: per row, ``steps`` points over the best fit +-
            :data:`AUTO_SIGMAS` uncertainties, within the bounds (cabinetry's default).
        data: ``[B, N + A]`` datasets; None for the observations of ``element``.
        element: the element of each row; None: every element (no ``data``) or element 0.
        options: :class:`~pyhf_gpu_server.inference.mle.FitOptions`.
        bounds: ``[P, 2]`` or ``[B, P, 2]`` parameter bounds (default: the model's).
        steps: points of an automatic grid.

    Raises:
        InferenceError: (a ``ValueError``) ``parameter`` is not in the model, is fixed (or
            not a parameter) in a row's element, or a value lies outside its bounds.
    """
    bestfit, unc, _, (grid,), delta, ok, status, element_rows, poi_bound = _profile(
        model, [parameter], [values], [steps], rows_of(model, data, element), bounds, options
    )
    k = model.par_names.index(parameter)
    return ScanResults(
        name=parameter,
        bestfit=bestfit.select(1, k),
        uncertainty=unc.select(1, k),
        parameter_values=grid,
        delta_nlls=delta,
        element=element_rows,
        points_converged=ok,
        converged=status.converged,
        starts=status.starts,
        starts_agreed=status.agreed,
        poi_bound=poi_bound,
    )


def scan2d(
    model,
    parameters: tuple[str, str],
    values_x=None,
    values_y=None,
    data: Tensor | None = None,
    element=None,
    options: FitOptions | None = None,
    *,
    bounds: Tensor | None = None,
    steps: tuple[int, int] = (11, 11),
) -> Scan2DResults:
    """A 2D profile-likelihood scan of ``parameters = (x, y)`` over the grid ``values_x [G_x]
    x values_y [G_y]``: all ``G_x * G_y`` conditional fits of every row and the free fits in
    one batched call. Arguments and errors as :func:`scan` (``steps``: of each automatic
    axis)."""
    if len(parameters) != 2:
        raise InferenceError("a 2D scan needs exactly two parameters")
    names = (parameters[0], parameters[1])
    bestfit, unc, corr, (vx, vy), delta, ok, status, element_rows, poi_bound = _profile(
        model,
        list(names),
        [values_x, values_y],
        list(steps),
        rows_of(model, data, element),
        bounds,
        options,
    )
    kx, ky = (model.par_names.index(n) for n in names)
    B, Gx, Gy = delta.shape[0], vx.shape[1], vy.shape[1]
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
        poi_bound=poi_bound,
    )
