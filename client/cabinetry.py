"""cabinetry's inference, answered by the pyhf-gpu service: ``fit``, ``ranking``, ``scan``,
``limit`` and ``significance`` with cabinetry's arguments, returning cabinetry's own result
types (``cabinetry.fit.FitResults``, ``RankingResults``, ``ScanResults``, ``LimitResults``,
``SignificanceResults``), so that ``cabinetry.visualize`` and
``cabinetry.model_utils.prediction(model, fit_results=...)`` take them unchanged.

cabinetry runs MINUIT once per fit, in a Python loop (a ranking: four fits per parameter);
the service runs all of them in one batched call. Switching is one import::

    from pyhf_gpu_client import cabinetry as gpu_cabinetry

    model, data = cabinetry.model_utils.model_and_data(spec)
    fit_results = gpu_cabinetry.fit(model, data)          # was cabinetry.fit.fit
    cabinetry.visualize.pulls(fit_results)

How a model travels: a ``pyhf.Model`` keeps its specification (``model.spec``: channels and
the measurement's parameter settings); the service is sent a workspace rebuilt from it, the
observations taken from the main part of ``data`` and a measurement with the model's POI and
parameter settings (``init_pars``, ``par_bounds`` and ``fix_pars`` become that measurement's
``inits``, ``bounds`` and ``fixed``). Answers come back by parameter label and are put in the
model's parameter order (``model.config.par_names``, cabinetry's labels).

What the service does not do raises instead of being ignored: MINOS (``minos``), MINUIT's
settings (``strategy``, ``maxiter``, ``tolerance``, ``custom_fit``), cabinetry's own root
finder's step budget (``maxsteps``), auxiliary data other than the model's nominal ones, and
``fix_pars`` that fix only part of a parameter set (the service fixes whole sets, as a
workspace's measurement does).

This module imports cabinetry, pyhf and numpy (``pip install 'pyhf-gpu[cabinetry]'``); the
rest of the client does not need them.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import cabinetry
import numpy as np
import pyhf
from cabinetry.fit.results_containers import (
    FitResults,
    LimitResults,
    RankingResults,
    ScanResults,
    SignificanceResults,
)

from ._base import ClientBase
from .results import RankingResult

__all__ = [
    "LIMIT_RTOL",
    "MEASUREMENT",
    "SAME_MINIMUM",
    "fit",
    "limit",
    "ranking",
    "scan",
    "significance",
    "workspace_of",
]

#: the name of the one measurement of the workspace sent to the service
MEASUREMENT = "cabinetry"
#: relative width of the service's final brackets of an upper limit (its root search's rtol)
LIMIT_RTOL = 1e-4
#: ``ranking(fit_results=...)``: the given best fit must lie within this many of the
#: service's uncertainties of the service's best fit (the ranking is computed around the
#: service's own fit)
SAME_MINIMUM = 0.1
#: cabinetry's default lower end of the limit bracket (``cabinetry.fit.limit``)
BRACKET_LOW = 0.1
#: CLs points of the curve drawn by ``cabinetry.visualize.limit``, besides the six limits
LIMIT_CURVE_POINTS = 15
#: ``maxsteps`` of ``cabinetry.fit.limit``: its own root finder's budget
CABINETRY_MAXSTEPS = 100

ModelLike = Any  # pyhf.pdf.Model | pyhf.Workspace | Mapping[str, Any] (a workspace spec)


# ----------------------------------------------------------------------------- the request


@dataclass(frozen=True)
class _Problem:
    """What one call asks the service about: the ``pyhf.Model`` whose parameter order the
    answers take, the workspace sent, the envelope fields of every request
    (``modifier_settings``), and per parameter in the model's order the fits' start (the value
    of a fixed one), whether it is fixed and its ``(low, high)`` bounds."""

    model: Any
    workspace: dict[str, Any]
    options: dict[str, Any]
    init: np.ndarray
    fixed: np.ndarray
    bounds: np.ndarray
    poi_index: int

    @property
    def labels(self) -> list[str]:
        """cabinetry's parameter labels: ``model.config.par_names``."""
        return list(self.model.config.par_names)


def _model_and_data(model: ModelLike, data: Sequence[float] | None) -> tuple[Any, list[float]]:
    """A ``pyhf.Model`` and its data (main data then auxdata): a model and data, or a workspace
    and optionally data (default its observations), the model built by cabinetry's
    ``model_utils.model_and_data``."""
    if isinstance(model, pyhf.pdf.Model):
        if data is None:
            raise ValueError("data is needed with a pyhf.Model (main data followed by auxdata)")
        return model, [float(v) for v in np.asarray(data, dtype=float).ravel()]
    if isinstance(model, (pyhf.Workspace, Mapping)):
        built, observed = cabinetry.model_utils.model_and_data(dict(model))
        chosen = observed if data is None else data
        return built, [float(v) for v in np.asarray(chosen, dtype=float).ravel()]
    raise TypeError(
        "model must be a pyhf.Model, a pyhf.Workspace or a workspace dict, not "
        f"{type(model).__name__}"
    )


def _per_parameter(
    name: str,
    values: Sequence[Any] | None,
    default: list[Any],
    npars: int,
    convert: Callable[[Any], Any],
) -> list[Any]:
    """``values`` (or ``default``) ``convert``-ed, ``npars`` of them (ValueError otherwise)."""
    values = list(default if values is None else values)
    if len(values) != npars:
        raise ValueError(f"{name} has {len(values)} entries; the model has {npars} parameters")
    return [convert(v) for v in values]


def _bound(pair: Sequence[float]) -> list[float]:
    low, high = pair
    return [float(low), float(high)]


def _poi_of(model: Any, poi_name: str | None) -> int | None:
    """The POI's index: ``poi_name``'s (a parameter set of its own) or the model's."""
    if poi_name is None:
        return model.config.poi_index
    labels = list(model.config.par_names)
    if poi_name not in labels:
        raise ValueError(f"parameter {poi_name} not found in model")
    if poi_name not in model.config.par_order:
        raise ValueError(f"the POI must be a parameter set of its own, not {poi_name}")
    return labels.index(poi_name)


def _measurement_parameters(
    model: Any, init: list[float], bounds: list[list[float]], fixed: list[bool]
) -> list[dict[str, Any]]:
    """The measurement's parameter settings: the model's own (``model.spec["parameters"]``),
    with ``inits``, ``bounds`` and ``fixed`` of each parameter set whose settings differ from
    the model's suggestions. A set's ``fixed`` is one flag: fixing part of a set (other than
    the model's own choice) raises ValueError."""
    config = model.config
    entries = {p["name"]: dict(p) for p in model.spec.get("parameters", [])}
    default_init, default_fixed = config.suggested_init(), config.suggested_fixed()
    default_bounds = [list(b) for b in config.suggested_bounds()]
    for name in config.par_order:
        part = config.par_slice(name)
        entry = dict(entries.get(name, {"name": name}))
        if init[part] != default_init[part]:
            entry["inits"] = [float(v) for v in init[part]]
        if bounds[part] != default_bounds[part]:
            entry["bounds"] = [[float(lo), float(hi)] for lo, hi in bounds[part]]
        if fixed[part] != default_fixed[part]:
            if len(set(fixed[part])) > 1:
                raise ValueError(
                    f"fix_pars fixes part of the parameter set {name!r}; the service fixes "
                    "whole parameter sets (as a workspace's measurement does)"
                )
            entry["fixed"] = bool(fixed[part][0])
        if len(entry) > 1:
            entries[name] = entry
    return list(entries.values())


def _check_auxdata(model: Any, data: list[float]) -> None:
    """ValueError unless the data are main data and the model's nominal auxdata (the service
    builds the auxdata from the workspace)."""
    config = model.config
    expected = config.nmaindata + config.nauxdata
    if len(data) != expected:
        raise ValueError(
            f"data has {len(data)} entries; the model needs {expected} ({config.nmaindata} main "
            f"data followed by {config.nauxdata} auxdata)"
        )
    aux = np.asarray(data[config.nmaindata :], dtype=float)
    nominal = np.asarray(config.auxdata, dtype=float)
    if not np.allclose(aux, nominal, rtol=1e-12, atol=1e-12):
        raise ValueError(
            "the auxdata in data differ from the model's nominal auxdata; the service takes "
            "the auxdata of the workspace's measurement (give the model's own auxdata)"
        )


def workspace_of(
    model: Any,
    data: Sequence[float],
    *,
    poi_name: str | None = None,
    init_pars: Sequence[float] | None = None,
    fix_pars: Sequence[bool] | None = None,
    par_bounds: Sequence[Sequence[float]] | None = None,
) -> dict[str, Any]:
    """The workspace JSON the service is sent for ``model`` and ``data``: the model's
    channels, the main part of ``data`` as observations and one measurement
    (:data:`MEASUREMENT`) with the POI (``poi_name`` or the model's) and the parameter
    settings (the model's, changed by ``init_pars``, ``fix_pars`` and ``par_bounds``).

    Raises ValueError for data that are not main data plus the model's nominal auxdata, a
    model without a POI, and settings the measurement cannot say (see
    :func:`_measurement_parameters`).
    """
    return _problem(**locals()).workspace


def _problem(
    model: ModelLike,
    data: Sequence[float] | None,
    *,
    poi_name: str | None = None,
    init_pars: Sequence[float] | None = None,
    fix_pars: Sequence[bool] | None = None,
    par_bounds: Sequence[Sequence[float]] | None = None,
) -> _Problem:
    """The :class:`_Problem` of one call (see :func:`workspace_of`)."""
    model, data = _model_and_data(model, data)
    config = model.config
    _check_auxdata(model, data)
    npars = config.npars
    init = _per_parameter("init_pars", init_pars, config.suggested_init(), npars, float)
    fixed = _per_parameter("fix_pars", fix_pars, config.suggested_fixed(), npars, bool)
    bounds = _per_parameter("par_bounds", par_bounds, config.suggested_bounds(), npars, _bound)
    poi_index = _poi_of(model, poi_name)
    if poi_index is None:
        raise ValueError(
            "the model has no POI: the service answers about a POI (give poi_name, or build "
            "the model with one)"
        )
    main = np.asarray(data[: config.nmaindata], dtype=float)
    workspace = {
        "channels": model.spec["channels"],
        "observations": [
            {"name": channel, "data": main[config.channel_slices[channel]].tolist()}
            for channel in config.channels
        ],
        "measurements": [
            {
                "name": MEASUREMENT,
                "config": {
                    "poi": config.par_names[poi_index],
                    "parameters": _measurement_parameters(model, init, bounds, fixed),
                },
            }
        ],
        "version": "1.0.0",
    }
    settings = config.modifier_settings
    return _Problem(
        model=model,
        workspace=workspace,
        options={"modifier_settings": dict(settings)} if settings else {},
        init=np.asarray(init),
        fixed=np.asarray(fixed),
        bounds=np.asarray(bounds),
        poi_index=poi_index,
    )


def _refuse(**given: Any) -> None:
    """NotImplementedError for an option ``name=(value, default)`` the service does not have,
    set to anything but its default."""
    for name, (value, default) in given.items():
        if value != default:
            raise NotImplementedError(
                f"{name}={value!r}: the service runs its own minimiser and root search, not "
                f"MINUIT's; {name} has no meaning there (leave it at {default!r})"
            )


@contextmanager
def _asking(
    args: Mapping[str, Any], **refuse: tuple[Any, Any]
) -> Iterator[tuple[_Problem, ClientBase]]:
    """``(problem, client)`` of a public function's arguments ``args`` (its ``locals()``),
    once the options the service does not have are refused (``refuse``, then MINUIT's
    settings): ``client``, or a :class:`~pyhf_gpu_client.Client` of the usual settings
    (``$PYHF_GPU_SERVER``) closed afterwards."""
    _refuse(**refuse)
    _refuse(  # the MINUIT settings every cabinetry fit takes
        strategy=(args["strategy"], None),
        maxiter=(args["maxiter"], None),
        tolerance=(args["tolerance"], None),
        custom_fit=(args.get("custom_fit", False), False),
    )
    settings = {
        name: args.get(name) for name in ("poi_name", "init_pars", "fix_pars", "par_bounds")
    }
    problem = _problem(args["model"], args["data"], **settings)
    client = args["client"]
    if client is not None:
        yield problem, client
        return
    from ._client import Client

    with Client() as own:
        yield problem, own


# ------------------------------------------------------------------------ answers by label


def _in_model_order(model: Any, grouped: Mapping[str, Sequence[float]]) -> np.ndarray:
    """``{parameter set: [values]}`` (``mle_parameters``) as one array in the model's order."""
    out = np.full(model.config.npars, np.nan)
    for name in model.config.par_order:
        if name not in grouped:
            raise ValueError(f"the service answered no value for the parameter set {name!r}")
        out[model.config.par_slice(name)] = grouped[name]
    return out


def _service_positions(model: Any, grouped: Mapping[str, Sequence[float]]) -> np.ndarray:
    """For each parameter in the model's order, its position in the service's flat order
    (the sets of ``grouped`` in their order, as its ``corr_mat`` rows are)."""
    offsets = dict(zip(grouped, np.cumsum([0, *map(len, grouped.values())]), strict=False))
    positions = np.empty(model.config.npars, dtype=int)
    for name in model.config.par_order:
        part = model.config.par_slice(name)
        positions[part] = offsets[name] + np.arange(part.stop - part.start)
    return positions


def _fit_results(problem: _Problem, answer: Any, goodness_of_fit: bool) -> FitResults:
    """cabinetry's FitResults of the service's fit answer (a ``FitResult``)."""
    model = problem.model
    positions = _service_positions(model, answer.mle_parameters)
    corr = np.asarray(answer.corr_mat, dtype=float)[np.ix_(positions, positions)]
    gof = -1.0
    if goodness_of_fit:
        if answer.goodness_of_fit is None:
            raise ValueError("the service answered no goodness of fit")
        gof = answer.goodness_of_fit.p_value
    return FitResults(
        bestfit=_in_model_order(model, answer.mle_parameters),
        uncertainty=_in_model_order(model, answer.uncertainties or {}),
        labels=problem.labels,
        corr_mat=corr,
        best_twice_nll=float(answer.twice_nll),
        goodness_of_fit=gof,
        minos_uncertainty={},
    )


# ------------------------------------------------------------------------------- the API


def fit(
    model: ModelLike,
    data: Sequence[float] | None = None,
    *,
    minos: str | Sequence[str] | None = None,
    goodness_of_fit: bool = False,
    init_pars: Sequence[float] | None = None,
    fix_pars: Sequence[bool] | None = None,
    par_bounds: Sequence[Sequence[float]] | None = None,
    strategy: Literal[0, 1, 2] | None = None,
    maxiter: int | None = None,
    tolerance: float | None = None,
    custom_fit: bool = False,
    client: ClientBase | None = None,
) -> FitResults:
    """Maximum-likelihood fit, as ``cabinetry.fit.fit`` (``POST /fit``).

    Args:
        model: a ``pyhf.Model`` (then ``data`` is needed), a ``pyhf.Workspace`` or a
            workspace dict (``data`` defaults to its observations).
        data: main data followed by the model's nominal auxdata.
        minos: not available (MINOS is MINUIT's): anything but None raises
            NotImplementedError.
        goodness_of_fit: add the saturated-model goodness-of-fit p-value (cabinetry's).
        init_pars, fix_pars, par_bounds: per parameter, as cabinetry's; sent as the
            measurement's ``inits``, ``fixed`` and ``bounds``.
        strategy, maxiter, tolerance, custom_fit: MINUIT's settings; anything but their
            defaults raises NotImplementedError.
        client: the :class:`~pyhf_gpu_client.Client` to ask (default: one of the usual
            settings, ``$PYHF_GPU_SERVER``).

    Returns:
        cabinetry's ``FitResults`` in the model's parameter order (``minos_uncertainty`` empty,
        ``goodness_of_fit`` -1 unless asked for).
    """
    with _asking(locals(), minos=(minos, None)) as (problem, service):
        answer = service.fit(problem.workspace, goodness_of_fit=goodness_of_fit, **problem.options)
    return _fit_results(problem, answer, goodness_of_fit)


def ranking(
    model: ModelLike,
    data: Sequence[float] | None = None,
    *,
    fit_results: FitResults | None = None,
    poi_name: str | None = None,
    init_pars: Sequence[float] | None = None,
    fix_pars: Sequence[bool] | None = None,
    par_bounds: Sequence[Sequence[float]] | None = None,
    strategy: Literal[0, 1, 2] | None = None,
    maxiter: int | None = None,
    tolerance: float | None = None,
    custom_fit: bool = False,
    client: ClientBase | None = None,
) -> RankingResults:
    """Impacts of every parameter on the POI, as ``cabinetry.fit.ranking`` (``POST /ranking``:
    all refits in one call).

    The impacts are the POI's shifts when a parameter is fixed at its best fit plus/minus its
    pre-fit and post-fit uncertainties; fixed parameters have impact 0 (as cabinetry's), and
    so do unconstrained ones pre-fit. ``fit_results`` (cabinetry's, or :func:`fit`'s) is
    checked, not used: the service ranks around its own fit, and a ``fit_results`` whose best
    fit lies further than :data:`SAME_MINIMUM` uncertainties from it raises ValueError (it is
    another minimum, or another model's). Other arguments as :func:`fit`; ``poi_name``
    replaces the model's POI.

    Returns:
        cabinetry's ``RankingResults``, parameters in the model's order without the POI.
    """
    with _asking(locals()) as (problem, service):
        answer = service.ranking(problem.workspace, **problem.options)
    if not isinstance(answer, RankingResult):
        raise ValueError(f"unexpected ranking answer: {answer!r:.200}")
    results = _ranking_results(problem, answer)
    if fit_results is not None:
        _check_same_minimum(problem, answer, fit_results)
    return results


def _ranking_results(problem: _Problem, answer: RankingResult) -> RankingResults:
    """cabinetry's RankingResults of the service's ranking, in the model's order: the
    parameters it did not rank (fixed ones) at their fixed value with zero impacts."""
    ranked = {label: i for i, label in enumerate(answer.labels)}
    columns = {name: np.zeros(len(problem.labels) - 1) for name in _IMPACT_FIELDS}
    bestfit: list[float] = []
    uncertainty: list[float] = []
    labels: list[str] = []
    for k, label in enumerate(problem.labels):
        if k == problem.poi_index:
            continue
        row = len(labels)
        labels.append(label)
        if label not in ranked:
            if not problem.fixed[k]:
                raise ValueError(f"the service did not rank the free parameter {label!r}")
            bestfit.append(problem.init[k])
            uncertainty.append(0.0)
            continue
        i = ranked[label]
        bestfit.append(answer.bestfit[i])
        uncertainty.append(answer.uncertainty[i])
        for name in _IMPACT_FIELDS:
            width = (answer.prefit_uncertainty if name.startswith("pre") else answer.uncertainty)[i]
            # no refit where the shift is zero (unconstrained parameters pre-fit): as cabinetry
            columns[name][row] = 0.0 if width == 0 else getattr(answer, name)[i]
    return RankingResults(
        bestfit=np.asarray(bestfit),
        uncertainty=np.asarray(uncertainty),
        labels=labels,
        **columns,
    )


_IMPACT_FIELDS = ("prefit_up", "prefit_down", "postfit_up", "postfit_down")


def _check_same_minimum(problem: _Problem, answer: RankingResult, given: FitResults) -> None:
    """ValueError unless ``given`` has the model's labels and, for every ranked parameter and
    the POI, a best fit within :data:`SAME_MINIMUM` of the service's uncertainties of the
    service's best fit."""
    if list(given.labels) != problem.labels:
        raise ValueError("fit_results has other parameter labels than the model")
    ours = {
        label: (b, u)
        for label, b, u in zip(answer.labels, answer.bestfit, answer.uncertainty, strict=True)
    }
    ours[answer.poi.name] = (answer.poi.bestfit, answer.poi.uncertainty)
    far = [
        f"{label} ({given.bestfit[k]:.6g} vs {ours[label][0]:.6g})"
        for k, label in enumerate(problem.labels)
        if label in ours
        and abs(given.bestfit[k] - ours[label][0]) > SAME_MINIMUM * ours[label][1] + 1e-9
    ]
    if far:
        raise ValueError(
            "fit_results is not the service's best fit, around which it ranks (more than "
            f"{SAME_MINIMUM} uncertainties apart): {', '.join(far[:5])}"
            + (f" and {len(far) - 5} more" if len(far) > 5 else "")
        )


def scan(
    model: ModelLike,
    data: Sequence[float] | None,
    par_name: str,
    *,
    par_range: Sequence[float] | None = None,
    n_steps: int = 11,
    init_pars: Sequence[float] | None = None,
    fix_pars: Sequence[bool] | None = None,
    par_bounds: Sequence[Sequence[float]] | None = None,
    strategy: Literal[0, 1, 2] | None = None,
    maxiter: int | None = None,
    tolerance: float | None = None,
    custom_fit: bool = False,
    client: ClientBase | None = None,
) -> ScanResults:
    """Profile-likelihood scan of ``par_name`` (a label, e.g. ``"staterror_SR[0]"``), as
    ``cabinetry.fit.scan`` (``POST /scan``): ``n_steps`` points over ``par_range``, by default
    the best fit +- 2 uncertainties (cabinetry's), there clipped to the parameter's bounds
    (where cabinetry's fits raise). Other arguments as :func:`fit`.

    Returns:
        cabinetry's ``ScanResults``: ``-2 delta ln L`` against the free fit's minimum.
    """
    if n_steps < 2:
        raise ValueError(f"n_steps must be at least 2, not {n_steps}")
    with _asking(locals()) as (problem, service):
        if par_name not in problem.labels:
            raise ValueError(f"parameter {par_name} not found in model")
        index = problem.labels.index(par_name)
        if par_range is None:
            best = _fit_results(problem, service.fit(problem.workspace, **problem.options), False)
            centre, width = best.bestfit[index], best.uncertainty[index]
            low, high = problem.bounds[index]
            par_range = (max(centre - 2 * width, low), min(centre + 2 * width, high))
        if len(par_range) != 2 or not par_range[0] < par_range[1]:
            raise ValueError(f"par_range must be (low, high) with low < high, not {par_range}")
        answer = service.scan(
            problem.workspace,
            parameter=par_name,
            range=[float(par_range[0]), float(par_range[1])],
            steps=int(n_steps),
            **problem.options,
        )
    return ScanResults(
        name=par_name,
        bestfit=float(answer.bestfit),
        uncertainty=float(answer.uncertainty),
        parameter_values=np.asarray(answer.parameter_values, dtype=float),
        delta_nlls=np.asarray(answer.delta_nlls, dtype=float),
    )


def limit(
    model: ModelLike,
    data: Sequence[float] | None = None,
    *,
    bracket: Sequence[float] | None = None,
    poi_tolerance: float = 0.01,
    maxsteps: int = CABINETRY_MAXSTEPS,
    confidence_level: float = 0.95,
    poi_name: str | None = None,
    init_pars: Sequence[float] | None = None,
    fix_pars: Sequence[bool] | None = None,
    par_bounds: Sequence[Sequence[float]] | None = None,
    strategy: Literal[0, 1, 2] | None = None,
    maxiter: int | None = None,
    tolerance: float | None = None,
    client: ClientBase | None = None,
) -> LimitResults:
    """Observed and expected upper limits on the POI (q~, CLs), as ``cabinetry.fit.limit``:
    the limits from ``POST /upper-limit`` (solved to :data:`LIMIT_RTOL` relative), the CLs
    curve that ``cabinetry.visualize.limit`` draws from one ``POST /cls`` over
    :data:`LIMIT_CURVE_POINTS` POI values from the bracket's low end (0.1 by default, as
    cabinetry's) to 1.2 times the largest limit, plus the six limits themselves.

    Args:
        bracket: cabinetry's starting bracket; as there, the observed limit must lie within
            it (ValueError otherwise) and its ends must differ.
        poi_tolerance: the precision asked for; a tolerance finer than the service's
            (:data:`LIMIT_RTOL` times the limit) is warned about.
        maxsteps: the step budget of cabinetry's own root finder, which the service does not
            run: anything but 100 raises NotImplementedError.
        confidence_level: the limits' CL (0.95: CLs = 0.05).
        Others: as :func:`ranking`.

    Returns:
        cabinetry's ``LimitResults`` (the CLs points sorted by POI value).
    """
    if not 0.0 < confidence_level < 1.0:
        raise ValueError(f"confidence_level must lie in (0, 1), not {confidence_level}")
    if poi_tolerance <= 0:
        raise ValueError(f"poi_tolerance must be positive, not {poi_tolerance}")
    if bracket is not None and (len(bracket) != 2 or bracket[0] == bracket[1]):
        raise ValueError(f"the two bracket values must not be the same: {bracket}")
    with _asking(locals(), maxsteps=(maxsteps, CABINETRY_MAXSTEPS)) as (problem, service):
        limits = service.upper_limit(
            problem.workspace, level=1.0 - confidence_level, **problem.options
        )
        observed, expected = float(limits.upper_limit_obs), list(limits.upper_limit_exp)
        if bracket is not None and not min(bracket) <= observed <= max(bracket):
            raise ValueError(
                f"the observed limit {observed:.4g} lies outside the bracket {tuple(bracket)}: "
                "CLs at its ends do not bracket the target (cabinetry raises the same)"
            )
        points = _limit_curve_points(
            [observed, *expected], bracket, problem.bounds[problem.poi_index][1]
        )
        curve = service.cls(problem.workspace, test_poi=points, **problem.options)
    finest = LIMIT_RTOL * max(v for v in [observed, *expected] if math.isfinite(v))
    if poi_tolerance < finest:
        warnings.warn(
            f"poi_tolerance={poi_tolerance:g} is finer than the service's limits "
            f"({LIMIT_RTOL:g} relative, {finest:.2g} here)",
            stacklevel=2,
        )
    return LimitResults(
        observed_limit=observed,
        expected_limit=np.asarray(expected, dtype=float),
        observed_CLs=np.asarray([r.cls_obs for r in curve], dtype=float),
        expected_CLs=np.asarray([r.cls_exp for r in curve], dtype=float),
        poi_values=np.asarray(points, dtype=float),
        confidence_level=confidence_level,
    )


def _limit_curve_points(
    limits: list[float], bracket: Sequence[float] | None, upper: float
) -> list[float]:
    """The POI values of the CLs curve: evenly spaced from the bracket's low end (cabinetry's
    0.1 by default, lower when a limit lies below it) to 1.2 times the largest limit, and the
    limits themselves; increasing, positive, none past the POI's ``upper`` bound (the service
    tests no POI value there: a limit past it has the curve end at the bound)."""
    found = [v for v in limits if math.isfinite(v) and 0 < v <= upper]
    if not found:
        raise ValueError(f"the service found no limit within the POI's bounds: {limits}")
    low = min(bracket) if bracket is not None else BRACKET_LOW
    low = min(low, 0.5 * min(found))
    high = upper if any(v > upper for v in limits) else min(1.2 * max(found), upper)
    grid = np.linspace(max(low, 1e-9), high, LIMIT_CURVE_POINTS)
    return sorted({float(v) for v in [*grid, *found]})


def significance(
    model: ModelLike,
    data: Sequence[float] | None = None,
    *,
    poi_name: str | None = None,
    init_pars: Sequence[float] | None = None,
    fix_pars: Sequence[bool] | None = None,
    par_bounds: Sequence[Sequence[float]] | None = None,
    strategy: Literal[0, 1, 2] | None = None,
    maxiter: int | None = None,
    tolerance: float | None = None,
    client: ClientBase | None = None,
) -> SignificanceResults:
    """Discovery p-value and significance (q0, asymptotic), observed and expected, as
    ``cabinetry.fit.significance`` (``POST /significance``). Arguments as :func:`ranking`.

    Returns:
        cabinetry's ``SignificanceResults``.
    """
    with _asking(locals()) as (problem, service):
        answer = service.significance(problem.workspace, **problem.options)
    return SignificanceResults(
        observed_p_value=float(answer.p0_obs),
        observed_significance=float(answer.z_obs),
        expected_p_value=float(answer.p0_exp),
        expected_significance=float(answer.z_exp),
    )
