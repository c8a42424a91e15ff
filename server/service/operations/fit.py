"""``POST /fit``: maximum-likelihood fits, as ``pyhf fit --value`` prints them, with
uncertainties and correlations, and optionally the goodness of fit."""

from __future__ import annotations

import re

from pyhf_gpu_server import inference
from pyhf_gpu_server.engine import HistFactoryModel
from pyhf_gpu_server.inference.goodness_of_fit import GoodnessOfFitResults
from pyhf_gpu_server.inference.results import FitResults

from ..schemas import FitAnswer, FitOptions, FitResult, GoodnessOfFit
from .base import EngineRows, Operation, RowResult, RowStatus, uncertainty_flags

_INDEXED = re.compile(r"^(.*)\[(\d+)\]$")


class Fit(Operation[FitOptions]):
    """One row per element; each answers over its element's own parameters."""

    name = "fit"
    summary = (
        "Maximum-likelihood fit, as `pyhf fit --value` prints it, with uncertainties and corr_mat"
    )
    options_model = FitOptions
    result_model = FitResult

    def row_cost(self, options: FitOptions) -> float:
        return 3.0  # the fit from two starts, and its Hessian

    def run(
        self, model: HistFactoryModel, rows: EngineRows, options: FitOptions
    ) -> list[RowResult]:
        fitted = inference.fit(model, element=rows.element, options=rows.fit)
        statuses = RowStatus.of(fitted, len(rows))
        gof = None
        if options.goodness_of_fit:
            gof = inference.goodness_of_fit(model, fitted, element=rows.element)
        out = []
        for i, status in enumerate(statuses):
            own = fitted.select(slice(i, i + 1)).restrict(rows.columns[i])
            flags = uncertainty_flags(own.labels, own.uncertainty[0].tolist())
            out.append(RowResult(fit_answer(own, gof, i), status, flags=flags))
        return out


def group_parameters(labels: list[str], values: list[float]) -> dict[str, list[float | None]]:
    """pyhf's ``{parameter set: [values]}`` from expanded labels such as ``"gamma[0]"``.

    >>> group_parameters(["mu", "gamma[0]", "gamma[1]"], [1.0, 0.9, 1.1])
    {'mu': [1.0], 'gamma': [0.9, 1.1]}
    """
    grouped: dict[str, list[float | None]] = {}
    for label, value in zip(labels, values, strict=True):
        match = _INDEXED.match(label)
        grouped.setdefault(match.group(1) if match else label, []).append(value)
    return grouped


def fit_answer(
    fitted: FitResults, gof: GoodnessOfFitResults | None = None, row: int = 0
) -> FitAnswer:
    """``fitted``'s first row as pyhf's fit output (``mle_parameters``, ``twice_nll``) plus
    uncertainties (grouped like the parameters) and the correlation matrix; with ``gof``, its
    row ``row``'s goodness of fit (``p_value`` None where it is NaN)."""
    answer = FitAnswer(
        mle_parameters=group_parameters(fitted.labels, fitted.bestfit[0].tolist()),
        twice_nll=float(fitted.best_twice_nll[0]),
        uncertainties=group_parameters(fitted.labels, fitted.uncertainty[0].tolist()),
        corr_mat=fitted.corr_mat[0].tolist(),
    )
    if gof is not None:
        answer.goodness_of_fit = goodness_answer(gof, row)
    return answer


def goodness_answer(gof: GoodnessOfFitResults, row: int = 0) -> GoodnessOfFit:
    """Row ``row``'s goodness of fit (``p_value`` None where it is NaN: ``ndof <= 0``)."""
    p_value = float(gof.p_value[row])
    return GoodnessOfFit(
        p_value=None if p_value != p_value else p_value,
        delta_twice_nll=float(gof.delta_twice_nll[row]),
        ndof=int(gof.ndof[row]),
    )
