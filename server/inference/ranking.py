"""Nuisance-parameter ranking (cabinetry's ``fit.ranking``), batched over rows and parameters.

For every row (an element of the model and its dataset) the free fit gives the best fit
``theta_hat`` and, from the exact Hessian, the post-fit uncertainties ``sigma_post``; the
pre-fit uncertainties ``sigma_pre`` are the widths of the constraint terms
(:func:`~pyhf_gpu_server.inference.constraints.prefit_uncertainties`, cabinetry's).

Then, for every ranked parameter of the row (each free, non-POI parameter of the row's own
element, or a named subset), the POI is refitted with that parameter fixed at
``theta_hat +/- sigma_pre`` and at ``theta_hat +/- sigma_post``; the impacts are those
refits' POI less the best-fit POI. All these conditional fits, over every row and every
parameter, run batched: each starts at the minimum of its row's quadratic approximation at
the best fit, takes chord Newton steps with the free fit's inverse Hessian
(:mod:`~pyhf_gpu_server.inference.chord`), and the few that do not converge there finish in
ONE :func:`~pyhf_gpu_server.inference.mle.fit_rows` call. As cabinetry, a parameter with
``sigma_pre = 0`` gets pre-fit impacts 0 without a fit. A fixed value outside the parameter's
bounds (say, a post-fit ``theta_hat - sigma_post`` below 0 for a poorly constrained gamma) is
moved onto the bound, as MINUIT moves it (pyhf, and so cabinetry's ranking, refuses such a
start point with a ValueError).

Example:
    >>> from pyhf_gpu_server.inference.examples import simple_model
    >>> res = ranking(simple_model([12.0, 11.0], [50.0, 52.0], [3.0, 7.0], data=[62.0, 61.0]))
    >>> order = res.order(0)  # by impact, as cabinetry's plot sorts
    >>> [res.labels[c] for c in order], [round(res.postfit_up[0, c].item(), 4) for c in order]
    (['uncorr_bkguncrt[1]', 'uncorr_bkguncrt[0]'], [-0.2464, -0.1665])
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..engine.layout import ElementLayout
from .chord import chord_conditional_fits, held_at_bounds
from .constraints import constraint_centres, prefit_uncertainties
from .covariance import conditional_uncertainties
from .errors import InferenceError
from .minimize import BOUND_TOL
from .mle import FitOptions, fit_rows, hessian_uncertainties
from .objective import TwiceNLL
from .results import FittedRows
from .rows import Rows, row_bounds, rows_of
from .starts import FitStatus

__all__ = [
    "RankingResults",
    "impact_key",
    "parameter_columns",
    "poi_on_bound",
    "ranked_parameters",
    "ranking",
    "ranking_of",
]

_INDEXED = re.compile(r"^(.*)\[(\d+)\]$")

#: the four conditional fits of a ranked parameter, in cabinetry's order
IMPACTS = ("prefit_up", "prefit_down", "postfit_up", "postfit_down")

#: a row's part of its ranked parameters, ``(k, n)``: the ``k``-th of ``n`` parts, dealt
#: (every ``n``-th ranked parameter from the ``k``-th, so that each part holds its share of
#: the costly refits, of the shared systematics); None: all of them
Part = tuple[int, int] | None


def dealt(ranked: Sequence[int], part: Part) -> list[int]:
    """The part ``part`` of ``ranked`` (all of it for None).

    >>> dealt(range(7), (1, 3)), dealt(range(7), (0, 3)), dealt(range(3), None)
    ([1, 4], [0, 3, 6], [0, 1, 2])
    """
    return list(ranked) if part is None else list(ranked[part[0] :: part[1]])


def impact_key(postfit_up: float, postfit_down: float) -> float:
    """The sort key of a ranked parameter, largest ``max(|postfit_up|, |postfit_down|)``
    first, NaN last (cabinetry's ranking plot's order)."""
    impact = max(abs(postfit_up), abs(postfit_down))
    return -impact if impact == impact else float("inf")


def _names(label: str, name: str) -> bool:
    """Whether ``name`` names the parameter ``label``: the label itself (``"gamma[0]"``) or
    its parameter set (``"gamma"``)."""
    return label == name or ((m := _INDEXED.match(label)) is not None and m.group(1) == name)


def ranked_parameters(layout: ElementLayout, parameters: Sequence[str] | None = None) -> list[int]:
    """The parameters (indices into ``layout.par_names``) a ranking of the element ``layout``
    refits, in the ranking's order: its free parameters but the POI, in pyhf's order, or of
    those the ones ``parameters`` names (labels or parameter-set names), in their order; a
    :class:`Part` is a slice of these.

    >>> from pyhf_gpu_server.inference.examples import simple_model
    >>> layout = simple_model([12.0, 11.0], [50.0, 52.0], [3.0, 7.0], data=[62.0, 61.0]).elements[0]
    >>> ranked_parameters(layout), ranked_parameters(layout, ["uncorr_bkguncrt[1]"])
    ([1, 2], [2])
    """
    free = [j for j in range(layout.n_pars) if j != layout.poi_index and not layout.fixed[j]]
    if parameters is None:
        return free
    labels = layout.par_names
    named = [j for name in parameters for j in free if _names(labels[j], name)]
    return list(dict.fromkeys(named))


@dataclass
class RankingResults(FittedRows):
    """The ranking of ``B`` rows, over the model's ``P`` parameter columns.

    Every ``[B, P]`` tensor is indexed by the model's columns (``labels``, pyhf's
    ``par_names``); ``columns[i]`` lists the columns ranked in row ``i`` (a free, non-POI
    parameter of its element, in pyhf's order), and the impacts of the other columns are NaN.

    Attributes:
        labels: the model's parameter labels.
        poi_name: the POI, whose impacts these are.
        element: ``[B]`` element of each row.
        columns: per row, the ranked columns.
        bestfit: ``[B, P]`` free-fit parameters.
        uncertainty: ``[B, P]`` post-fit uncertainties (Hessian; 0 for fixed parameters).
        prefit_uncertainty: ``[B, P]`` pre-fit uncertainties (:func:`prefit_uncertainties`).
        prefit_up, prefit_down, postfit_up, postfit_down: ``[B, P]`` impacts: the POI of the
            refit with the parameter fixed at ``bestfit +/- prefit_uncertainty`` (``+/-
            uncertainty``) less the best-fit POI; 0 where the uncertainty is 0, NaN where it
            is not finite or the column is not ranked.
        pull: ``[B, P]`` ``(bestfit - centre) / prefit_uncertainty``, with ``centre`` the
            constraint term's auxiliary datum (rescaled by ``tau`` for Poisson terms); NaN
            where the pre-fit uncertainty is 0.
        constraint: ``[B, P]`` ``uncertainty / prefit_uncertainty``, NaN where that is 0.
        fits_converged: ``[B, P]`` bool, every conditional fit of the column converged
            (True where none ran).
        converged: ``[B]`` bool, the free fit and every conditional fit of the row converged.
        starts: ``[B]`` the most start points any fit of the row ran.
        starts_agreed: ``[B]`` bool, in every fit of the row all converged starts agreed.
        poi_bound: ``[B]`` the bound on which the free fit's POI sits (:func:`poi_on_bound`),
            NaN where it sits on neither: refits cannot move it past, so the impacts that
            would are 0 (cabinetry's too).
        refits_at_bound: ``[B]`` how many of the row's refits ended with the POI on a bound
            (their impacts truncated there), of ``refits`` ``[B]``.
    """

    labels: list[str]
    poi_name: str
    element: Tensor
    columns: list[list[int]]
    bestfit: Tensor
    uncertainty: Tensor
    prefit_uncertainty: Tensor
    prefit_up: Tensor
    prefit_down: Tensor
    postfit_up: Tensor
    postfit_down: Tensor
    pull: Tensor
    constraint: Tensor
    fits_converged: Tensor
    converged: Tensor
    starts: Tensor
    starts_agreed: Tensor
    poi_bound: Tensor | None = None
    refits_at_bound: Tensor | None = None
    refits: Tensor | None = None

    @property
    def poi_index(self) -> int:
        return self.labels.index(self.poi_name)

    def order(self, i: int = 0) -> list[int]:
        """Row ``i``'s ranked columns by decreasing ``max(|postfit_up|, |postfit_down|)``, as
        cabinetry's ranking plot sorts them (ties and NaN impacts last, in pyhf's order)."""
        up, down = self.postfit_up[i].tolist(), self.postfit_down[i].tolist()
        # stable: ties keep pyhf's order
        return sorted(self.columns[i], key=lambda c: impact_key(up[c], down[c]))


#: a POI within this fraction of its bounds' width (plus the minimiser's ``BOUND_TOL``) of
#: a bound sits on it
POI_BOUND_RTOL = 1e-9


def poi_on_bound(poi: Tensor, bounds: Tensor, bound_tol: float = 0.0) -> Tensor:
    """``[N]``: the bound (``bounds [N, 2]``, the POI's) on which each of the POI values
    ``poi [N]`` sits, within :data:`POI_BOUND_RTOL` of the bounds' width plus ``bound_tol``;
    NaN where it sits on neither.

    >>> poi_on_bound(torch.tensor([0.0, 3.0, 10.0]), torch.tensor([[0.0, 10.0]] * 3)).tolist()
    [0.0, nan, 10.0]
    """
    lo, hi = bounds.select(-1, 0), bounds.select(-1, 1)
    tol = bound_tol + POI_BOUND_RTOL * (hi - lo)
    nan = torch.full_like(poi, torch.nan)
    return torch.where(poi <= lo + tol, lo, torch.where(poi >= hi - tol, hi, nan))


def parameter_columns(model, names: Sequence[str]) -> list[int]:
    """Columns of ``names``: labels of ``model.par_names`` (``"gamma[0]"``), or the names of
    whole parameter sets (``"gamma"``: all its columns); :class:`InferenceError` naming any
    the model does not have."""
    columns: list[int] = []
    for name in names:
        found = [c for c, label in enumerate(model.par_names) if _names(label, name)]
        if not found:
            raise InferenceError(f"parameter {name!r} is not in the model")
        columns.extend(c for c in found if c not in columns)
    return columns


def _ranked_columns(
    model, elements: list[int], parameters: Sequence[str] | None, parts: Sequence[Part] | None
) -> list[list[int]]:
    """Per row: the model's columns of its element's :func:`ranked_parameters`, of those only
    its part (:data:`Part`)."""
    out = []
    for b, e in enumerate(elements):
        own = model.element_columns(e)
        ranked = [own[j] for j in ranked_parameters(model.elements[e], parameters)]
        part = None if parts is None else parts[b]
        out.append(dealt(ranked, part))
    return out


def _has_prefit(model, elements: list[int]) -> list[set[int]]:
    """Per row: the columns with a constraint term in its element (host-side structure)."""
    stack = model.stack
    out = []
    for e in elements:
        present = stack.aux_present[e]
        out.append({int(c) for c, p in zip(stack.aux_param.tolist(), present, strict=True) if p})
    return out


def ranking(
    model,
    data: Tensor | None = None,
    element=None,
    *,
    parameters: Sequence[str] | None = None,
    bounds: Tensor | None = None,
    options: FitOptions | None = None,
    parts: Sequence[Part] | None = None,
) -> RankingResults:
    """Impacts of the nuisance parameters on the POI, for ``B`` rows at once.

    Args:
        model: a :class:`~pyhf_gpu_server.engine.HistFactoryModel` with a POI.
        data: ``[B, N + A]`` datasets; None for the observations of ``element``.
        element: the element of each row (an int, a sequence, or a LongTensor ``[B]``); None:
            every element (no ``data``) or element 0.
        parameters: rank only these (labels such as ``"gamma[0]"``, or parameter-set names);
            None: every free non-POI parameter of each row's element. A named parameter that
            a row's element does not have free is not ranked in that row.
        bounds: ``[P, 2]`` or ``[B, P, 2]`` parameter bounds (default: the model's).
        options: :class:`~pyhf_gpu_server.inference.mle.FitOptions`.
        parts: per row, ``(k, n)``: rank only the ``k``-th of ``n`` dealt parts of its
            ranked parameters (:func:`dealt`, of its pyhf order or that of ``parameters``),
            or None: all. The ranking of one row cut in parts is the parts' rankings
            together (:func:`ranked_parameters` lists them from the element's layout).

    Returns:
        :class:`RankingResults`.

    Raises:
        InferenceError: (a ``ValueError``) the model has no POI, a named parameter is not in
            the model or is the POI.
    """
    return ranking_of(
        model,
        rows_of(model, data, element),
        parameters=parameters,
        bounds=bounds,
        options=options,
        parts=parts,
    )


def ranking_of(
    model,
    rows: Rows,
    *,
    parameters: Sequence[str] | None = None,
    bounds: Tensor | None = None,
    options: FitOptions | None = None,
    parts: Sequence[Part] | None = None,
) -> RankingResults:
    """:func:`ranking` of ``rows``."""
    if model.poi_index is None:
        raise InferenceError("the model has no POI: no impacts to rank")
    options = options or FitOptions()
    if parameters is not None and model.poi_index in parameter_columns(model, parameters):
        raise InferenceError(f"the POI {model.poi_name!r} cannot be ranked against itself")
    elements = rows.host_elements()
    data, element = rows.data, rows.element
    B, P, k = element.shape[0], model.n_pars, model.poi_index
    bounds = row_bounds(model, element, bounds)
    free = fit_rows(model, data, element, bounds=bounds, options=options, background_start=B)
    fixed_rows = model.fixed.index_select(0, element)
    postfit, corr = hessian_uncertainties(model, data, element, free.bestfit, fixed_rows, options)
    held = conditional_uncertainties(postfit)  # undetermined parameters held: 0
    covariance = corr * held.unsqueeze(2) * held.unsqueeze(1)  # 2 H^-1
    prefit = prefit_uncertainties(model).index_select(0, element)

    # the conditional fits: per row, per ranked column, the pre-fit pair (where the column
    # has a constraint term) and the post-fit pair; structure known on the host
    columns = _ranked_columns(model, elements, parameters, parts)
    constrained = _has_prefit(model, elements)
    fit_row: list[int] = []
    fit_col: list[int] = []
    fit_kind: list[int] = []
    fits_per_row: list[int] = []
    for b, (cols, has) in enumerate(zip(columns, constrained, strict=True)):
        before = len(fit_row)
        for col in cols:
            for which in (0, 1, 2, 3) if col in has else (2, 3):
                fit_row.append(b)
                fit_col.append(col)
                fit_kind.append(which)
        fits_per_row.append(len(fit_row) - before)
    impacts = torch.full((B * P * 4,), torch.nan, dtype=model.dtype, device=model.device)
    fits_ok = torch.ones(B * P, dtype=torch.long, device=model.device)
    status = free.status
    poi_bounds = bounds.select(1, k)  # [B, 2]
    poi_bound = poi_on_bound(free.bestfit.select(1, k), poi_bounds, BOUND_TOL)
    refits_at_bound = torch.zeros(B, dtype=torch.long, device=model.device)
    if fit_row:
        r = torch.tensor(fit_row, dtype=torch.long, device=model.device)
        c = torch.tensor(fit_col, dtype=torch.long, device=model.device).unsqueeze(1)
        kind = torch.tensor(fit_kind, dtype=torch.long, device=model.device)
        sign = 1.0 - 2.0 * (kind % 2).to(model.dtype)
        base = free.bestfit.index_select(0, r)
        sigma = torch.where(
            kind < 2,
            prefit.index_select(0, r).gather(1, c).squeeze(1),
            postfit.index_select(0, r).gather(1, c).squeeze(1),
        )
        theta = base.gather(1, c).squeeze(1)
        box = bounds.index_select(0, r)
        lo = box.select(-1, 0).gather(1, c).squeeze(1)
        hi = box.select(-1, 1).gather(1, c).squeeze(1)
        value = torch.minimum(torch.maximum(theta + sign * sigma, lo), hi)
        value = torch.where(torch.isfinite(value), value, theta)
        pin = torch.zeros_like(base, dtype=torch.bool).scatter(1, c, True)
        cond, cond_status = _conditional_fits(
            model,
            data.index_select(0, r),
            element.index_select(0, r),
            base,
            value.unsqueeze(1),
            box,
            fixed_rows.index_select(0, r) | pin,
            c,
            0.5 * covariance,
            held_at_bounds(free.bestfit, bounds, fixed_rows, BOUND_TOL),
            fits_per_row,
            options,
        )
        impact = cond.select(1, k) - free.bestfit.select(1, k).index_select(0, r)
        impact = torch.where(sigma == 0, torch.zeros_like(impact), impact)
        impact = torch.where(torch.isfinite(sigma), impact, torch.full_like(impact, torch.nan))
        flat = r * P + c.squeeze(1)
        impacts = impacts.index_copy(0, flat * 4 + kind, impact)
        fits_ok = fits_ok.scatter_reduce(0, flat, cond_status.converged.long(), reduce="amin")
        status = _combine_per_row(status, cond_status, r)
        held = poi_on_bound(cond.select(1, k), poi_bounds.index_select(0, r), BOUND_TOL).isfinite()
        refits_at_bound = refits_at_bound.index_add(0, r, (held & (sigma != 0)).long())
    impacts = impacts.view(B, P, 4)
    ranked = torch.zeros(B * P, dtype=torch.bool, device=model.device)
    ranked_flat = [b * P + c for b, cols in enumerate(columns) for c in cols]
    if ranked_flat:
        index = torch.tensor(ranked_flat, dtype=torch.long, device=model.device)
        ranked = ranked.index_fill(0, index, True)
    # ranked columns without a constraint term: pre-fit impacts 0 (cabinetry skips the fits)
    unconstrained = ranked.view(B, P) & (prefit == 0)
    impacts = torch.where(
        unconstrained.unsqueeze(-1) & (torch.arange(4, device=model.device) < 2),
        torch.zeros_like(impacts),
        impacts,
    )
    centre = constraint_centres(model, data, element)
    defined = prefit > 0
    safe = torch.where(defined, prefit, torch.ones_like(prefit))
    nan = torch.full_like(prefit, torch.nan)
    return RankingResults(
        labels=list(model.par_names),
        poi_name=model.poi_name,
        element=element,
        columns=columns,
        bestfit=free.bestfit,
        uncertainty=postfit,
        prefit_uncertainty=prefit,
        prefit_up=impacts.select(2, 0),
        prefit_down=impacts.select(2, 1),
        postfit_up=impacts.select(2, 2),
        postfit_down=impacts.select(2, 3),
        pull=torch.where(defined, (free.bestfit - centre) / safe, nan),
        constraint=torch.where(defined, postfit / safe, nan),
        fits_converged=fits_ok.view(B, P).bool(),
        converged=status.converged,
        starts=status.starts,
        starts_agreed=status.agreed,
        poi_bound=poi_bound,
        refits_at_bound=refits_at_bound,
        refits=torch.tensor(fits_per_row, dtype=torch.long, device=model.device),
    )


def _conditional_fits(
    model,
    rows: Tensor,
    element: Tensor,
    best: Tensor,
    values: Tensor,
    bounds: Tensor,
    fixed: Tensor,
    pinned: Tensor,
    inverse_hessian: Tensor,
    held: Tensor,
    fits_per_row: list[int],
    options: FitOptions,
) -> tuple[Tensor, FitStatus]:
    """The minima ``[F, P]`` of ``F`` conditional fits (``fixed`` includes the ``pinned``
    column of each, ``[F, 1]``, at ``values``) and their status. Chord steps from the
    quadratic approximation at the free fits' minima ``best``
    (:func:`~pyhf_gpu_server.inference.chord.chord_conditional_fits`) take most of them to
    their minimum; the minimiser finishes the others. A model with kinked parameters (for its
    extra starts) or symmetric ones (chord steps keep those on their saddle at 0), or options
    without host looks, send every fit through
    :func:`~pyhf_gpu_server.inference.mle.fit_rows`, from the points reached."""
    objective = TwiceNLL(model, rows, element, options.curvature)
    # without host looks (``check_every=0``: a CUDA graph, FakeTensorMode) every fit goes on
    shrink = options.minimize.check_every != 0
    x, settled = chord_conditional_fits(
        objective,
        best,
        values,
        inverse_hessian,
        held,
        fits_per_row,
        pinned,
        bounds,
        options.minimize.tol,
        shrink=shrink,
    )
    F = x.shape[0]
    status = FitStatus.one_start(settled)
    special_starts = model.kinked_params.numel() > 0 or model.has_symmetric_params
    everyone = not shrink or (options.starts is not None and special_starts)
    rest = torch.arange(F, device=x.device) if everyone else settled.logical_not().nonzero()
    rest = rest.view(-1)
    if rest.numel():
        fits = fit_rows(
            model,
            rows.index_select(0, rest),
            element.index_select(0, rest),
            init=x.index_select(0, rest),
            bounds=bounds.index_select(0, rest),
            fixed=fixed.index_select(0, rest),
            options=options,
        )
        x = x.index_copy(0, rest, fits.bestfit)
        status = status.index_copy(rest, fits.status)
    return x, status


def _combine_per_row(status: FitStatus, extra: FitStatus, row: Tensor) -> FitStatus:
    """``status`` of ``B`` rows combined with that of fits ``extra`` belonging to rows
    ``row``: all converged, the most starts, all agreed (:meth:`FitStatus.combine`)."""
    converged = status.converged.long().scatter_reduce(
        0, row, extra.converged.long(), reduce="amin"
    )
    starts = status.starts.scatter_reduce(0, row, extra.starts.to(status.starts.dtype), "amax")
    agreed = status.agreed.long().scatter_reduce(0, row, extra.agreed.long(), reduce="amin")
    return FitStatus(converged.bool(), starts, agreed.bool())
