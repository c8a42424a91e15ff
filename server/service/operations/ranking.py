"""``POST /ranking``: nuisance-parameter impacts on the POI, pulls and constraints (cabinetry's
``fit.ranking``): the ``4 x P`` refits of every row in one batched call, a large model's
parameters dealt into parts of at most :data:`RANK_BLOCK` (a row each, joined into its
answer: progress moves evenly and the device serves others between them). A patch that lacks a named parameter answers its
own error; the other patches their rankings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

from pyhf_gpu_server import inference
from pyhf_gpu_server.engine import HistFactoryModel
from pyhf_gpu_server.engine.layout import ElementLayout
from pyhf_gpu_server.inference.ranking import IMPACTS, RankingResults, impact_key, ranked_parameters

from ..schemas import (
    PoiEstimate,
    RankingAnswer,
    RankingOptions,
    RankingResult,
    ResultFlag,
    result_flag,
)
from .base import EngineRows, Operation, RowResult, RowStatus, uncertainty_flags

#: the per-parameter columns of a ranking answer, in its order
RANKED = ("bestfit", "uncertainty", "prefit_uncertainty", *IMPACTS, "pull", "constraint")

#: ranked parameters a row refits at most (4 fits each, after its free fit): a hypothesis
#: with more is cut in parts of this many
RANK_BLOCK = 256


@dataclass(frozen=True)
class RankingPart:
    """What joining a part's answer into its hypothesis' needs besides it (host numbers):
    the free fit's POI bound (NaN: on none), the part's refits ending on a bound, its refits,
    and the options' ``top``."""

    poi_bound: float
    held: int
    refits: int
    top: int | None
    part: tuple[int, int]  # (k, n): the k-th of n dealt parts (inference.ranking.Part)


class Ranking(Operation[RankingOptions]):
    """One row per element (or per part of its ranked parameters): the free fit, then the
    POI refit at each ranked parameter's best fit plus/minus its pre- and post-fit
    uncertainty."""

    name = "ranking"
    summary = "Impacts of the nuisance parameters on the POI (pre- and post-fit), with pulls"
    options_model = RankingOptions
    result_model = RankingResult

    def row_cost(self, options: RankingOptions) -> float:
        ranked = 100 if options.parameters is None else len(options.parameters)
        return 3.0 + 4.0 * min(ranked, RANK_BLOCK)

    def parts(
        self, options: RankingOptions, layout: ElementLayout | None
    ) -> list[tuple[int, int]] | None:
        """The ranked parameters (counted by
        :func:`~pyhf_gpu_server.inference.ranking.ranked_parameters`), when there are more
        than :data:`RANK_BLOCK`, dealt into parts of at most that many
        (:data:`~pyhf_gpu_server.inference.ranking.Part`)."""
        if layout is not None:
            count = len(ranked_parameters(layout, options.parameters))
        elif options.parameters is not None:
            count = len(options.parameters)
        else:
            return None
        if count <= RANK_BLOCK:
            return None
        n = -(-count // RANK_BLOCK)
        return [(k, n) for k in range(n)]

    def long_parts(self, options: RankingOptions, layout: ElementLayout) -> bool:
        """Always: a part is about a thousand fits of a large model."""
        return True

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
        parts = rows.parts or [None] * len(rows)
        result = inference.ranking(
            model,
            element=rows.element,
            parameters=options.parameters,
            options=rows.fit,
            parts=parts,
        )
        statuses = RowStatus.of(result, len(rows))
        counts = zip(
            result.poi_bound.tolist(),
            result.refits_at_bound.tolist(),
            result.refits.tolist(),
            strict=True,
        )
        out = []
        for i, (status, part, (bound, held, refits)) in enumerate(
            zip(statuses, parts, counts, strict=True)
        ):
            if part is None:
                flags = ranking_flag(result.poi_name, bound, held, refits)
                columns = [*result.columns[i], result.poi_index]
                uncertainty = result.uncertainty[i].tolist()
                flags += uncertainty_flags(
                    [result.labels[c] for c in columns], [uncertainty[c] for c in columns]
                )
                out.append(RowResult(ranking_answer(result, i, options.top), status, flags=flags))
            else:  # every parameter of the part: the join sorts them all and keeps the top
                joining = RankingPart(bound, held, refits, options.top, part)
                out.append(RowResult(ranking_answer(result, i, sort=False), status, joining))
        return out

    def join(self, parts: list[RowResult]) -> RowResult:
        """The parts' parameters together, sorted as :meth:`RankingResults.order` sorts
        them (ties in pyhf's order: a dealt part's ``j``-th parameter is the ``k + j n``-th);
        the free fit's POI and flag from the first part (each part fits it alike)."""
        answers = [p.answer for p in parts]
        joining = [p.part for p in parts]
        first = cast(RankingAnswer, answers[0])
        columns = {
            name: [v for answer in answers for v in getattr(answer, name)]
            for name in ("labels", *RANKED, "fits_converged")
        }
        up, down = columns["postfit_up"], columns["postfit_down"]
        ranked = [
            j.part[0] + i * j.part[1]
            for answer, j in zip(answers, joining, strict=True)
            for i in range(len(cast(RankingAnswer, answer).labels))
        ]
        order = sorted(range(len(up)), key=lambda c: (impact_key(up[c], down[c]), ranked[c]))
        order = order[: joining[0].top]
        held = sum(j.held for j in joining)
        refits = sum(j.refits for j in joining)
        flags = ranking_flag(first.poi.name, joining[0].poi_bound, held, refits)
        flags += uncertainty_flags(
            [*columns["labels"], first.poi.name], [*columns["uncertainty"], first.poi.uncertainty]
        )
        return RowResult(
            RankingAnswer(
                **{name: [values[c] for c in order] for name, values in columns.items()},
                poi=first.poi,
            ),
            RowStatus.joined([p.status for p in parts]),
            flags=flags,
        )


def ranking_answer(
    result: RankingResults, i: int = 0, top: int | None = None, *, sort: bool = True
) -> RankingAnswer:
    """Row ``i`` with cabinetry's ``RankingResults`` field names (``bestfit``,
    ``uncertainty``, ``labels``, ``prefit_up``, ``prefit_down``, ``postfit_up``,
    ``postfit_down``), plus ``prefit_uncertainty``, ``pull``, ``constraint`` and
    ``fits_converged`` per parameter, sorted by :meth:`RankingResults.order` (cabinetry's
    ``ranking`` itself keeps pyhf's order; its plot sorts so; ``sort`` False: in the row's
    ranked order, as a part is joined), the ``top`` first only if given; and the POI's best
    fit."""
    order = (result.order(i) if sort else result.columns[i])[:top]
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


def ranking_flag(poi: str, bound: float, held: int, refits: int) -> tuple[ResultFlag, ...]:
    """``poi_at_bound`` where the free fit's POI (on ``bound``; NaN: on none), or some of a
    row's ``refits`` (``held`` of them), lies on a bound of the POI ``poi``: the impacts
    pushing it past the bound are 0 or truncated there."""
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
        return ()
    return (result_flag("poi_at_bound", detail),)
