"""``POST /fit``: maximum-likelihood fits, as ``pyhf fit --value`` prints them, with
uncertainties and correlations, and optionally the goodness of fit."""

from __future__ import annotations

from pyhf_gpu_server import inference
from pyhf_gpu_server.engine import HistFactoryModel

from ..schemas import FitOptions, FitResult
from .base import EngineRows, Operation, RowResult, RowStatus

GOODNESS_OF_FIT_KEYS = ("p_value", "delta_twice_nll", "ndof")


class Fit(Operation[FitOptions]):
    """One row per element; each answers over its element's own parameters."""

    name = "fit"
    summary = (
        "Maximum-likelihood fit, as `pyhf fit --value` prints it, with uncertainties and corr_mat"
    )
    options_model = FitOptions
    result_model = FitResult

    def row_cost(self, options: FitOptions) -> float:
        return 2.0  # the fit and its Hessian

    def run(
        self, model: HistFactoryModel, rows: EngineRows, options: FitOptions
    ) -> list[RowResult]:
        fitted = inference.fit(model, element=rows.element, options=rows.fit)
        statuses = RowStatus.of(fitted, len(rows))
        payloads = [
            fitted.select(slice(i, i + 1)).restrict(rows.columns[i]).to_json(0)
            for i in range(len(rows))
        ]
        if options.goodness_of_fit:
            gof = inference.goodness_of_fit(model, fitted, element=rows.element)
            for i, payload in enumerate(payloads):
                found = gof.to_json(i)
                payload["goodness_of_fit"] = {k: found[k] for k in GOODNESS_OF_FIT_KEYS}
        return [RowResult(p, s) for p, s in zip(payloads, statuses, strict=True)]
