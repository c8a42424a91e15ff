"""``POST /ranking``: nuisance-parameter impacts on the POI, pulls and constraints (cabinetry's
``fit.ranking``): all ``4 x P`` refits of every row in one batched call. A patch that lacks a
named parameter answers its own error; the other patches their rankings."""

from __future__ import annotations

from pyhf_gpu_server import inference
from pyhf_gpu_server.engine import HistFactoryModel
from pyhf_gpu_server.engine.layout import ElementLayout

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

    def element_problem(self, layout: ElementLayout, options: RankingOptions) -> str | None:
        """No POI, or a named parameter this patch does not have (or that is its POI)."""
        if layout.poi_name is None:
            return "the model has no POI: no impacts to rank"
        known = set(layout.par_names) | {parset.name for parset in layout.parameters}
        for name in options.parameters or ():
            if name not in known:
                return f"parameter {name!r} is not in this model: it cannot be ranked"
            if name in (layout.poi_name, layout.par_names[layout.poi_index]):
                return f"the POI {layout.poi_name!r} cannot be ranked against itself"
        return None

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
