"""``POST /significance``: discovery p-values and significances (``q0``)."""

from __future__ import annotations

from pyhf_gpu_server import inference
from pyhf_gpu_server.engine import HistFactoryModel

from ..schemas import SignificanceOptions, SignificanceResult
from .base import EngineRows, Operation, RowResult, RowStatus


class Significance(Operation[SignificanceOptions]):
    """One row per element; asymptotic or toy-based."""

    name = "significance"
    summary = "Discovery significance (p0 and Z), observed and expected; asymptotic or toy-based"
    options_model = SignificanceOptions
    result_model = SignificanceResult

    def run(
        self, model: HistFactoryModel, rows: EngineRows, options: SignificanceOptions
    ) -> list[RowResult]:
        tests = inference.hypotest(
            model,
            0.0,
            rows.element,
            test_stat="q0",
            options=rows.fit,
            calctype=options.calctype,
            ntoys=options.ntoys,
            seed=options.seed,
            toys=rows.toys,
        )
        result = inference.significance_of(tests)
        statuses = RowStatus.of(result, len(rows))
        return [
            RowResult(result.to_json(i), s, None if rows.toys is None else tests.row(i))
            for i, s in enumerate(statuses)
        ]

    def join(self, parts: list[RowResult]) -> RowResult:
        result = inference.significance_of(inference.join_toy_parts([p.part for p in parts]))
        return RowResult(result.to_json(0), RowStatus.of(result, 1)[0])
