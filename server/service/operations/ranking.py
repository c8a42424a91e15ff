"""``POST /ranking``: nuisance-parameter impacts on the POI, pulls and constraints (cabinetry's
``fit.ranking``): all ``4 x P`` refits of every row in one batched call. A patch that lacks a
named parameter answers its own error; the other patches their rankings."""

from __future__ import annotations

from pyhf_gpu_server import inference
from pyhf_gpu_server.engine import HistFactoryModel
from pyhf_gpu_server.engine.layout import ElementLayout
from pyhf_gpu_server.inference.ranking import RankingResults

from ..schemas import RankingOptions, RankingResult, result_flag
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
        flags = ranking_flags(result)
        return [
            RowResult({k: v for k, v in p.items() if k not in STATUS_KEYS}, s, flags=f)
            for p, s, f in zip(payloads, statuses, flags, strict=True)
        ]


def ranking_flags(result: RankingResults) -> list[tuple[dict[str, str], ...]]:
    """Per row, ``poi_at_bound`` where the free fit's POI, or some refit's, lies on a bound
    of the POI: the impacts pushing it past the bound are 0 or truncated there."""
    poi = result.poi_name
    out: list[tuple[dict[str, str], ...]] = []
    for bound, held, refits in zip(
        result.poi_bound.tolist(),
        result.refits_at_bound.tolist(),
        result.refits.tolist(),
        strict=True,
    ):
        counted = f"{held} of its {refits} refits ended on a bound"
        if bound == bound:  # not NaN: the best fit is on its bound
            detail = (
                f"the best fit of the POI {poi!r} lies on its bound {bound:g}: the refits cannot "
                f"move it past, so the impacts that would are 0 or truncated ({counted})"
            )
        elif held:
            detail = f"the POI {poi!r} is held at a bound in some refits ({counted}): those "
            detail += "impacts are truncated there"
        else:
            out.append(())
            continue
        out.append((result_flag("poi_at_bound", detail),))
    return out
