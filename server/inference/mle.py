"""Maximum-likelihood fits of a batched model: every row of a batch in one minimiser loop.

:func:`fit` is pyhf's ``infer.mle.fit`` and :func:`fixed_poi_fit` its ``fixed_poi_fit``,
over ``B`` rows at once (each row: its own element, dataset and, optionally, a fixed POI
value). Start points, bounds and fixed parameters default to the model's (pyhf's
``suggested_init/bounds/fixed``); a fixed POI value replaces the start value and fixes the
POI, as pyhf does. A free fit also starts from the POI's background-only value: a POI started
far from its best fit can lead the nuisance parameters into a minimum of their own.

Example:
    >>> import torch
    >>> from pyhf_gpu_server.inference.examples import simple_model
    >>> model = simple_model([12.0, 11.0], [50.0, 52.0], [3.0, 7.0], data=[51.0, 48.0])
    >>> res = fit(model)
    >>> [round(v, 4) for v in res.bestfit[0].tolist()], round(res.best_twice_nll.item(), 4)
    ([0.0, 1.0031, 0.9627], 24.9839)
    >>> res.labels
    ['mu', 'uncorr_bkguncrt[0]', 'uncorr_bkguncrt[1]']
    >>> fixed = fixed_poi_fit(model, 1.0)
    >>> round(fixed.best_twice_nll.item(), 4), fixed.converged.tolist()
    (28.9222, [True])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .minimize import Follow, MinimizeOptions, MinimizeResult, follow_rows, minimize
from .objective import Curvature, TwiceNLL
from .results import FitResults, map_tensors
from .rows import as_float, row_bounds, rows_of
from .starts import (
    FitStatus,
    StartOptions,
    best_of_starts,
    extra_starts,
    kink_is_minimum,
    off_symmetric_points,
    one_sided_slopes,
    pin_kinks,
    release_downhill,
)

if TYPE_CHECKING:
    from ..engine.model import HistFactoryModel

__all__ = [
    "FitOptions",
    "FitRequest",
    "FitSpec",
    "fit",
    "fit_requests",
    "fit_rows",
    "fixed_poi_fit",
    "hessian_uncertainties",
]


@dataclass(frozen=True)
class FitOptions:
    """How fits are run.

    Attributes:
        curvature: the minimiser's curvature matrix (see
            :mod:`~pyhf_gpu_server.inference.objective`); ``"gauss-newton"`` is the fastest
            robust choice, ``"hessian"`` the exact one.
        minimize: :class:`~pyhf_gpu_server.inference.minimize.MinimizeOptions`.
        max_rows: rows per minimiser call at most (larger batches are split, for memory).
        starts: :class:`~pyhf_gpu_server.inference.starts.StartOptions`, the extra start
            points of fits whose model has kinked parameters; None: one start (pyhf's way).
        stop: asked between minimiser iterations; true stops the fit with
            :class:`~pyhf_gpu_server.inference.errors.FitStopped` (nobody waits for it).
    """

    curvature: Curvature = "gauss-newton"
    minimize: MinimizeOptions = field(default_factory=MinimizeOptions)
    starts: StartOptions | None = field(default_factory=StartOptions)
    max_rows: int = 8192
    stop: Callable[[], bool] | None = None


@dataclass(frozen=True)
class FitSpec:
    """How the fits of an inference call run, passed explicitly down its stages.

    Attributes:
        init, bounds, fixed: ``[P]``, ``[P, 2]``, ``[P]`` overrides of the model's suggested
            start points, bounds and fixed parameters (None: the model's, per element).
        options: :class:`FitOptions`.
        poi_floor: raise the POI's lower bound to this (``q~`` floors it at 0; None: no).
    """

    init: Tensor | None = None
    bounds: Tensor | None = None
    fixed: Tensor | None = None
    options: FitOptions = field(default_factory=FitOptions)
    poi_floor: float | None = None


@dataclass
class FitRequest:
    """A block of rows for :func:`fit_requests`: datasets ``[R, N + A]``, elements ``[R]``,
    POI values ``[R]`` (NaN: free POI) and optional start points ``[R, P]`` (warm starts;
    else, and in rows of NaN, the ``init`` given to :func:`fit_requests`, else the model's),
    optional bounds ``[R, P, 2]`` (else the ``bounds`` given, else the model's), and
    ``also_from``: the position of an earlier block (of as many rows, with no ``also_from``)
    whose rows' first minima these rows are fitted from a second time, in the same minimiser
    call (:func:`~.minimize.minimize`'s ``follows``), the lower minimum of the two starts
    kept (:meth:`~.results.FitResults.lower_of`): where a parameter has two minima, a start
    can lead to the higher one."""

    data: Tensor
    element: Tensor
    poi: Tensor
    init: Tensor | None = None
    bounds: Tensor | None = None
    also_from: int | None = None


def _start(
    model: HistFactoryModel,
    element: Tensor,
    poi: Tensor | None,
    init: Tensor | None,
    bounds: Tensor | None,
    fixed: Tensor | None,
    poi_floor: float | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Start points, bounds and fixed masks per row, with a fixed POI where ``poi`` is finite
    and the POI's lower bound raised to ``poi_floor`` if given."""
    B = element.shape[0]
    init = model.init.index_select(0, element) if init is None else as_float(model, init)
    init = init.expand(B, -1)
    bounds = row_bounds(model, element, bounds)
    fixed = (
        model.fixed.index_select(0, element) if fixed is None else fixed.to(model.device)
    ).expand(B, -1)
    if poi_floor is None and poi is None:
        return init.clone(), bounds, fixed.clone()
    # the POI's column, changed by where (no indexed assignment: FakeTensorMode's cuda has none)
    assert model.poi_index is not None, "a fixed or floored POI needs a POI"
    is_poi = torch.arange(init.shape[-1], device=init.device).eq(model.poi_index)
    if poi_floor is not None:
        low = torch.where(is_poi, bounds.select(-1, 0).clamp(min=poi_floor), bounds.select(-1, 0))
        bounds = torch.stack([low, bounds.select(-1, 1)], -1)
        init = torch.where(is_poi, torch.maximum(init, low), init)
    if poi is not None:
        pinned = is_poi & torch.isfinite(poi).unsqueeze(-1)
        init = torch.where(pinned, poi.unsqueeze(-1), init)
        fixed = fixed | pinned
    return init.clone(), bounds, fixed.clone()


def _minimize(
    model: HistFactoryModel,
    data,
    element,
    init,
    bounds,
    fixed,
    options: FitOptions,
    follows: Sequence[Follow] = (),
) -> MinimizeResult:
    """One minimiser run per chunk of ``options.max_rows`` rows, concatenated. Rows that
    follow others (``follows``, see :func:`~.minimize.minimize`) run in the same call as
    theirs when they fit in one chunk and the host looks; else in calls after them."""
    if follows and (init.shape[0] > options.max_rows or options.minimize.check_every == 0):
        return _minimize_after(model, data, element, init, bounds, fixed, options, follows)
    parts = []
    for start in range(0, init.shape[0], options.max_rows):
        length = min(options.max_rows, init.shape[0] - start)
        data_, element_, init_, bounds_, fixed_ = (
            t.narrow(0, start, length) for t in (data, element, init, bounds, fixed)
        )
        objective = TwiceNLL(
            model,
            data_,
            element_,
            options.curvature,
            solver=options.minimize.solver,
            secant_memory=options.minimize.secant_memory,
        )
        parts.append(
            minimize(
                objective,
                init_,
                bounds_,
                fixed_,
                options.minimize,
                options.stop,
                follows,
                barrier=objective.barrier,
            )
        )
    return parts[0] if len(parts) == 1 else _joined(*parts)


def _minimize_after(
    model: HistFactoryModel, data, element, init, bounds, fixed, options: FitOptions, follows
) -> MinimizeResult:
    """:func:`_minimize` of the rows that follow none, then of the others from their ends."""
    lead, after, parent = follow_rows(follows, init.shape[0], init.device)
    data_, element_, init_, bounds_, fixed_ = (
        t.index_select(0, lead) for t in (data, element, init, bounds, fixed)
    )
    first = _minimize(model, data_, element_, init_, bounds_, fixed_, options)
    position = torch.zeros(init.shape[0], dtype=torch.long, device=init.device)
    position = position.index_copy(0, lead, torch.arange(len(lead), device=init.device))
    start = first.x.index_select(0, position.index_select(0, parent))
    fixed_after = fixed.index_select(0, after)
    start = torch.where(fixed_after, init.index_select(0, after), start)
    second = _minimize(
        model,
        data.index_select(0, after),
        element.index_select(0, after),
        start,
        bounds.index_select(0, after),
        fixed_after,
        options,
    )
    return MinimizeResult(
        *(
            torch.empty((init.shape[0], *a.shape[1:]), dtype=a.dtype, device=a.device)
            .index_copy(0, lead, a)
            .index_copy(0, after, b)
            for a, b in zip(_columns(first), _columns(second), strict=True)
        )
    )


def _from_background_too(
    model: HistFactoryModel, data, element, init, bounds, fixed, options: FitOptions, n: int
) -> tuple[MinimizeResult, FitStatus]:
    """The fits of all rows from ``init``, the first ``n`` also (in the same minimiser call)
    from ``init`` with the POI at the background-only value 0 (clamped into its bounds); each
    of those keeps the lower minimum. Returns the minima and the status of the first ``n``
    rows' two starts. A POI started far from its best fit (an ``inits`` of 50 where the data
    say 0) can drag the nuisance parameters into a minimum of their own, far above the global
    one, which the background start reaches in a few iterations."""
    assert model.poi_index is not None
    B = init.shape[0]
    is_poi = torch.arange(init.shape[-1], device=init.device).eq(model.poi_index)
    data_n, element_n, init_n, bounds_n, fixed_n = (
        t.narrow(0, 0, n) for t in (data, element, init, bounds, fixed)
    )
    zero = torch.zeros_like(init_n).clamp(bounds_n.select(-1, 0), bounds_n.select(-1, 1))
    background = torch.where(is_poi & fixed_n.logical_not(), zero, init_n)
    both = _minimize(
        model,
        torch.cat([data, data_n]),
        torch.cat([element, element_n]),
        torch.cat([init, background]),
        torch.cat([bounds, bounds_n]),
        torch.cat([fixed, fixed_n]),
        options,
    )
    pair = map_tensors(
        both, lambda t: torch.stack([t.narrow(0, 0, n), t.narrow(0, B, n)], 1)
    )  # [n, 2, ...]
    best, status = best_of_starts(pair.fun, pair.converged, _agree(options))
    kept = map_tensors(
        pair,
        lambda t: t.flatten(0, 1).index_select(0, 2 * torch.arange(n, device=init.device) + best),
    )
    rest = map_tensors(both, lambda t: t.narrow(0, n, B - n))
    return _joined(kept, rest), status


def _agree(options: FitOptions) -> float:
    """Two minima closer than this in ``-2 log L`` are one."""
    return (options.starts or StartOptions()).agree_twice_nll


def _columns(result: MinimizeResult) -> list[Tensor]:
    """The per-row tensors of ``result``, in field order."""
    return [getattr(result, f.name) for f in fields(result)]


def _global_minima(
    model, data, element, bounds, fixed, first: MinimizeResult, options: FitOptions
) -> tuple[MinimizeResult, FitStatus]:
    """The first minima ``first``, or lower ones from extra starts where the model has
    kinked parameters (:mod:`~pyhf_gpu_server.inference.starts`), with each row's status:
    every row's extra starts in ONE minimiser call, then the lowest minimum of each row
    settled on its kinks (``settle_rounds`` more calls)."""
    B = first.x.shape[0]
    kinked = model.kinked_params
    if options.starts is None or not kinked.numel():
        return first, FitStatus.one_start(first.converged)
    starts = extra_starts(first.x, bounds, fixed, kinked, options.starts)  # [B, S, P]
    S = starts.shape[1]
    rows = torch.arange(B, device=first.x.device)
    row = rows.repeat_interleave(S)
    extra = _minimize(
        model,
        data.index_select(0, row),
        element.index_select(0, row),
        starts.flatten(0, 1),
        bounds.index_select(0, row),
        fixed.index_select(0, row),
        options,
    )
    tried = _joined(
        map_tensors(first, lambda t: t.unsqueeze(1)),
        map_tensors(extra, lambda t: t.unflatten(0, (B, S))),
        dim=1,
    )
    lowest = torch.where(torch.isfinite(tried.fun), tried.fun, torch.inf).argmin(1)
    seed = tried.x.flatten(0, 1).index_select(0, rows * (S + 1) + lowest)
    settled, K = _settle_kinks(model, data, element, bounds, fixed, seed, options)
    tried = _joined(tried, map_tensors(settled, lambda t: t.unflatten(0, (B, K))), dim=1)
    best, status = best_of_starts(tried.fun, tried.converged, options.starts.agree_twice_nll)
    flat = rows * (S + 1 + K) + best
    return map_tensors(tried, lambda t: t.flatten(0, 1).index_select(0, flat)), status


def _joined(*parts: MinimizeResult, dim: int = 0) -> MinimizeResult:
    """``parts`` concatenated along ``dim``: their rows one after another (0), or results
    shaped ``[B, k, ...]`` side by side, ``[B, sum k, ...]`` (1: a row's candidates)."""
    return MinimizeResult(*(torch.cat(c, dim) for c in zip(*map(_columns, parts), strict=True)))


def _settle_kinks(
    model, data, element, bounds, fixed, x, options: FitOptions
) -> tuple[MinimizeResult, int]:
    """Minima ``x [B, P]`` refitted with their kinked parameters near a kink pinned to it,
    then (``settle_rounds - 1`` times) again with those that have a way down released on that
    side; converged only where the parameters still pinned sit at a minimum of their kink.
    One settling per ``on_kink`` value (``K`` of them): ``[B * K]`` rows, row-major."""
    starts = options.starts
    assert starts is not None  # kinks are settled only with start options
    K = len(starts.on_kink)
    data, element, bounds, fixed, x = (
        t.repeat_interleave(K, 0) for t in (data, element, bounds, fixed, x)
    )
    per_setting = torch.cat([x.new_full((1,), value) for value in starts.on_kink])
    on_kink = per_setting.repeat(data.shape[0] // K).unsqueeze(1)
    kinked = model.kinked_params
    objective = TwiceNLL(model, data, element, options.curvature)
    start, pinned = pin_kinks(x, fixed, kinked, on_kink)
    settled = _minimize(model, data, element, start, bounds, fixed | pinned, options)
    right, left = one_sided_slopes(objective, settled.x, pinned)
    for _ in range(starts.settle_rounds - 1):
        start, pinned = release_downhill(settled.x, pinned, right, left, on_kink, starts.slope_tol)
        start, newly = pin_kinks(start, fixed | pinned, kinked, on_kink)
        newly = newly & settled.converged.logical_not().unsqueeze(1)
        start = torch.where(newly, torch.zeros_like(start), start)  # only stuck rows re-pin
        pinned = pinned | newly
        settled = _minimize(model, data, element, start, bounds, fixed | pinned, options)
        right, left = one_sided_slopes(objective, settled.x, pinned)
    settled.converged = settled.converged & kink_is_minimum(right, left, pinned, starts.slope_tol)
    return settled, K


def hessian_uncertainties(
    model: HistFactoryModel,
    data: Tensor,
    element: Tensor,
    x: Tensor,
    fixed: Tensor,
    options: FitOptions,
) -> tuple[Tensor, Tensor]:
    """Uncertainties ``[B, P]`` and correlations ``[B, P, P]`` from the exact Hessian of
    ``-2 log L`` at the minima ``x [B, P]`` (:meth:`TwiceNLL.covariance`), in chunks of
    ``options.max_rows`` rows."""
    uncertainties, correlations = [], []
    for start in range(0, x.shape[0], options.max_rows):
        n = min(options.max_rows, x.shape[0] - start)
        objective = TwiceNLL(
            model, data.narrow(0, start, n), element.narrow(0, start, n), options.curvature
        )
        rows = torch.arange(n, device=x.device)
        unc, corr, _ = objective.covariance(x.narrow(0, start, n), rows, fixed.narrow(0, start, n))
        uncertainties.append(unc)
        correlations.append(corr)
    return torch.cat(uncertainties), torch.cat(correlations)


def fit_rows(
    model: HistFactoryModel,
    data: Tensor,
    element: Tensor,
    poi: Tensor | None = None,
    *,
    init: Tensor | None = None,
    bounds: Tensor | None = None,
    fixed: Tensor | None = None,
    options: FitOptions | None = None,
    uncertainties: bool = False,
    poi_floor: float | None = None,
    follows: Sequence[Follow] = (),
    background_start: int = 0,
) -> FitResults:
    """Fit ``B`` rows (``data [B, N + A]``, ``element [B]``) in batched minimiser calls.

    ``poi [B]``: the fixed POI value per row, NaN for a free POI, so that conditional and
    unconditional fits share one call. ``poi_floor``: raise the POI's lower bound to it
    (``q~`` bounds the POI at 0). ``follows``: rows that start from others' first minima
    (:func:`~.minimize.minimize`). Rows are split in chunks of ``options.max_rows``. Where
    the model has kinked parameters, every row is fitted again from extra start points and
    keeps its lowest minimum (:mod:`~pyhf_gpu_server.inference.starts`).
    ``background_start`` (free fits, no ``poi``): the first this many rows also start with the
    POI at its background-only value (:func:`_from_background_too`), in the same minimiser
    call.
    """
    options = options or FitOptions()
    init, bounds, fixed = _start(model, element, poi, init, bounds, fixed, poi_floor)
    if options.starts is not None and model.has_symmetric_params:
        symmetric = model.symmetric_params.index_select(0, element)
        init = off_symmetric_points(init, symmetric, fixed, options.starts.symmetric_offset)
    B, P = init.shape
    n = background_start if poi is None and model.poi_index is not None else 0
    if n:
        assert not follows, "background starts are for free fits without follows"
        first, two = _from_background_too(model, data, element, init, bounds, fixed, options, n)
    else:
        first = _minimize(model, data, element, init, bounds, fixed, options, follows)
    result, status = _global_minima(model, data, element, bounds, fixed, first, options)
    if n:  # the first n rows' two first starts count, and agree, too
        more = torch.arange(B, device=init.device).lt(n)
        agreed = torch.cat([two.agreed, torch.ones_like(status.agreed.narrow(0, n, B - n))])
        status = FitStatus(status.converged, status.starts + more.long(), status.agreed & agreed)
    x = result.x
    if uncertainties:
        unc, corr = hessian_uncertainties(model, data, element, x, fixed, options)
    else:
        unc = torch.full_like(x, torch.nan)
        # a view of one NaN: B x P x P numbers would be held for nothing, at the memory peak
        corr = x.new_full((1, 1, 1), torch.nan).expand(B, P, P)
    return FitResults(
        bestfit=x,
        uncertainty=unc,
        corr_mat=corr,
        best_twice_nll=result.fun + model.saturated_twice_nll(data, element),
        deviance=result.fun,
        converged=status.converged,
        iterations=result.iterations,
        labels=list(model.par_names),
        element=element,
        starts=status.starts,
        starts_agreed=status.agreed,
    )


def fit(
    model: HistFactoryModel,
    data: Tensor | None = None,
    element=None,
    *,
    fixed_poi=None,
    init: Tensor | None = None,
    bounds: Tensor | None = None,
    fixed: Tensor | None = None,
    options: FitOptions | None = None,
    uncertainties: bool = True,
) -> FitResults:
    """Maximum-likelihood fits (pyhf's ``infer.mle.fit``), batched over rows. Free fits start
    from the init and from the POI at its background-only value 0; the lower minimum is kept
    (``starts`` 2, ``starts_agreed`` false where they differ).

    Args:
        model: a :class:`~pyhf_gpu_server.engine.HistFactoryModel`.
        data: ``[B, N + A]`` datasets; None for the observations of ``element``.
        element: ``[B]`` element per row; None: every element (no ``data``) or element 0.
        fixed_poi: None, a float, or ``[B]`` POI values to fix (NaN: free).
        init, bounds, fixed: ``[P]``/``[B, P]``, ``[P, 2]``/``[B, P, 2]``, ``[P]``/``[B, P]``
            overrides of the model's suggested values.
        options: :class:`FitOptions`.
        uncertainties: compute the exact Hessian at the minimum for ``uncertainty`` and
            ``corr_mat`` (else they are NaN).

    Returns:
        :class:`~pyhf_gpu_server.inference.results.FitResults`.
    """
    r = rows_of(model, data, element, fixed_poi)
    return fit_rows(
        model,
        r.data,
        r.element,
        r.poi,
        init=init,
        bounds=bounds,
        fixed=fixed,
        options=options,
        uncertainties=uncertainties,
        background_start=r.element.shape[0],
    )


def fixed_poi_fit(
    model: HistFactoryModel, poi_val, data: Tensor | None = None, element=None, **kwargs
) -> FitResults:
    """Fits with the POI fixed at ``poi_val`` (float or ``[B]``): pyhf's ``fixed_poi_fit``."""
    return fit(model, data, element, fixed_poi=poi_val, **kwargs)


def fit_requests(
    model: HistFactoryModel, requests: list[FitRequest], spec: FitSpec | None = None
) -> list[FitResults]:
    """Run several blocks of fits in one batched call, as ``spec`` says; one FitResults per
    block.

    >>> import torch
    >>> from pyhf_gpu_server.inference.examples import simple_model
    >>> model = simple_model([5.0], [10.0], [2.5], data=[12.0])
    >>> e = torch.zeros(1, dtype=torch.long)
    >>> free, pinned = fit_requests(model, [
    ...     FitRequest(model.observed, e, torch.full((1,), torch.nan, dtype=torch.float64)),
    ...     FitRequest(model.observed, e, torch.ones(1, dtype=torch.float64))])
    >>> bool(free.best_twice_nll <= pinned.best_twice_nll), pinned.bestfit[0, 0].item()
    (True, 1.0)
    """
    spec = spec or FitSpec()
    again = [(i, r.also_from) for i, r in enumerate(requests) if r.also_from is not None]
    requests = requests + [replace(requests[i], also_from=None) for i, _ in again]
    sizes = [r.element.shape[0] for r in requests]
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    init, bounds = spec.init, spec.bounds
    if any(r.init is not None for r in requests):
        starts = []
        for r in requests:
            start = _start(model, r.element, None, spec.init, None, None)[0]
            starts.append(start if r.init is None else torch.where(r.init.isnan(), start, r.init))
        init = torch.cat(starts)
    if any(r.bounds is not None for r in requests):
        bounds = torch.cat(
            [
                _start(model, r.element, None, None, spec.bounds, None)[1]
                if r.bounds is None
                else r.bounds
                for r in requests
            ]
        )
    n = len(requests) - len(again)
    follows = [Follow(offsets[n + j], offsets[k], sizes[i]) for j, (i, k) in enumerate(again)]
    merged = fit_rows(
        model,
        torch.cat([r.data for r in requests]),
        torch.cat([r.element for r in requests]),
        torch.cat([r.poi for r in requests]),
        init=init,
        bounds=bounds,
        fixed=spec.fixed,
        options=spec.options,
        poi_floor=spec.poi_floor,
        follows=follows,
    )
    fits = [
        merged.select(slice(offset, offset + size))
        for offset, size in zip(offsets, sizes, strict=True)
    ]
    agree = _agree(spec.options)
    for j, (i, _) in enumerate(again):
        fits[i] = fits[i].lower_of(fits[n + j], agree)
    return fits[:n]
