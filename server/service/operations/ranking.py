"""``POST /ranking``: nuisance-parameter impacts on the POI, pulls and constraints (cabinetry's
``fit.ranking``): all ``4 x P`` refits of every row in one batched call."""

from __future__ import annotations

from pyhf_gpu_server import inference
from pyhf_gpu_server.engine import HistFactoryModel

from ..schemas import RankingOptions, RankingResult
from .base import EngineRows, Operation, RowResult, RowStatus

STATUS_KEYS = ("converged", "starts", "starts_agreed")  # in meta, not the payload


class Ranking(Operation[RankingOptions]):
    """One row per element: the free fit, then the POI refit at each ranked parameter's best
    fit plus/minus its pre- and post-fit uncertainty."""

    name = "ranking"
    summary = "Impacts of the nuisance parameters on the POI (pre- and post-fit), with pulls"
    options_model = RankingOptions
    result_model = RankingResult

    def row_cost(self, options: RankingOptions) -> float:
        ranked = 100 if options.parameters is None else len(options.parameters)
        return 2.0 + 4.0 * ranked

    def run(
        self, model: HistFactoryModel, rows: EngineRows, options: RankingOptions
    ) -> list[RowResult]:
        result = inference.ranking(
            model, element=rows.element, parameters=options.parameters, options=rows.fit
        )
        statuses = RowStatus.of(result, len(rows))
        payloads = [result.to_json(i, top=options.top) for i in range(len(rows))]
        return [
            RowResult({k: v for k, v in p.items() if k not in STATUS_KEYS}, s)
            for p, s in zip(payloads, statuses, strict=True)
        ]
