"""``POST /yields``: pre- and post-fit yields per channel, sample and bin with their
uncertainties, and the data (cabinetry's ``model_utils.prediction`` and ``yield_stdev``)."""

from __future__ import annotations

from pyhf_gpu_server import inference
from pyhf_gpu_server.engine import HistFactoryModel

from ..schemas import YieldsOptions, YieldsResult
from .base import EngineRows, Operation, RowResult, RowStatus


class Yields(Operation[YieldsOptions]):
    """One row per element: its fit, then every parameter variation's yields in one batch."""

    name = "yields"
    summary = "Pre- and post-fit yields per channel, sample and bin, with uncertainties"
    options_model = YieldsOptions
    result_model = YieldsResult

    def row_cost(self, options: YieldsOptions) -> float:
        return 3.0  # the fit, its Hessian, the variations

    def run(
        self, model: HistFactoryModel, rows: EngineRows, options: YieldsOptions
    ) -> list[RowResult]:
        result = inference.yields(model, element=rows.element, options=rows.fit)
        statuses = RowStatus.of(result, len(rows))
        payloads = [result.to_json(i) for i in range(len(rows))]
        return [
            RowResult({"prefit": p["prefit"], "postfit": p["postfit"]}, s)
            for p, s in zip(payloads, statuses, strict=True)
        ]
