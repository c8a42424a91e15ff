"""``POST /significance``: discovery p-values and significances (``q0``)."""

from __future__ import annotations

from pyhf_gpu_server import inference
from pyhf_gpu_server.engine import HistFactoryModel
from pyhf_gpu_server.inference.results import SignificanceResults

from ..schemas import SignificanceAnswer, SignificanceOptions, SignificanceResult
from .base import EngineRows, Operation, RowResult, RowStatus, hypotests


class Significance(Operation[SignificanceOptions]):
    """One row per element; asymptotic or toy-based."""

    name = "significance"
    summary = "Discovery significance (p0 and Z), observed and expected; asymptotic or toy-based"
    options_model = SignificanceOptions
    result_model = SignificanceResult

    def run(
        self, model: HistFactoryModel, rows: EngineRows, options: SignificanceOptions
    ) -> list[RowResult]:
        tests = hypotests(model, 0.0, rows, options, "q0")
        result = inference.significance_of(tests)
        statuses = RowStatus.of_hypotests(tests)
        return [
            RowResult(answer, s, None if rows.toys is None else tests.row(i))
            for i, (answer, s) in enumerate(
                zip(significance_answers(result), statuses, strict=True)
            )
        ]

    def join(self, parts: list[RowResult]) -> RowResult:
        tests = inference.join_toy_parts([p.part for p in parts])
        result = inference.significance_of(tests)
        return RowResult(significance_answers(result)[0], RowStatus.of_hypotests(tests)[0])


def significance_answers(result: SignificanceResults) -> list[SignificanceAnswer]:
    """Each row's p-values and significances."""
    columns = (result.p0_obs, result.p0_exp, result.z_obs, result.z_exp, result.p0_exp_set)
    return [
        SignificanceAnswer(p0_obs=p0, p0_exp=p0_exp, z_obs=z, z_exp=z_exp, p0_exp_set=band)
        for p0, p0_exp, z, z_exp, band in zip(*(t.tolist() for t in columns), strict=True)
    ]
