"""``POST /ranking``: nuisance-parameter impacts on the POI, pulls and constraints (cabinetry's
``fit.ranking``): all ``4 x P`` refits of every row in one batched call. A patch that lacks a
named parameter answers its own error; the other patches their rankings."""

from __future__ import annotations

from pyhf_gpu_server import inference
from pyhf_gpu_server.engine import HistFactoryModel
from pyhf_gpu_server.engine.layout import ElementLayout
from pyhf_gpu_server.inference.ranking import IMPACTS, RankingResults

from ..schemas import (
    PoiEstimate,
    RankingAnswer,
    RankingOptions,
    RankingResult,
    ResultFlag,
    result_flag,
)
from .base import EngineRows, Operation, RowResult, RowStatus

#: the per-parameter columns of a ranking answer, in its order
RANKED = ("bestfit", "uncertainty", "prefit_uncertainty", *IMPACTS, "pull", "constraint")


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
        flags = ranking_flags(result)
        return [
            RowResult(ranking_answer(result, i, options.top), s, flags=f)
            for i, (s, f) in enumerate(zip(statuses, flags, strict=True))
        ]


def ranking_answer(result: RankingResults, i: int = 0, top: int | None = None) -> RankingAnswer:
    """Row ``i`` with cabinetry's ``RankingResults`` field names (``bestfit``,
    ``uncertainty``, ``labels``, ``prefit_up``, ``prefit_down``, ``postfit_up``,
    ``postfit_down``), plus ``prefit_uncertainty``, ``pull``, ``constraint`` and
    ``fits_converged`` per parameter, sorted by :meth:`RankingResults.order` (cabinetry's
    ``ranking`` itself keeps pyhf's order; its plot sorts so), the ``top`` first only if
    given; and the POI's best fit."""
    order = result.order(i)[:top]
    columns = {}
    for name in RANKED:
        row = getattr(result, name)[i].tolist()
        columns[name] = [row[c] for c in order]
    converged = result.fits_converged[i].tolist()
    k = result.poi_index
    return RankingAnswer(
        labels=[result.labels[c] for c in order],
        **columns,
        fits_converged=[bool(converged[c]) for c in order],
        poi=PoiEstimate(
            name=result.poi_name,
            bestfit=float(result.bestfit[i, k]),
            uncertainty=float(result.uncertainty[i, k]),
        ),
    )


def ranking_flags(result: RankingResults) -> list[tuple[ResultFlag, ...]]:
    """Per row, ``poi_at_bound`` where the free fit's POI, or some refit's, lies on a bound
    of the POI: the impacts pushing it past the bound are 0 or truncated there."""
    poi = result.poi_name
    out: list[tuple[ResultFlag, ...]] = []
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
