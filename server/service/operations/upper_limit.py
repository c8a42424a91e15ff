"""``POST /upper-limit``: observed and expected upper limits on the POI."""

from __future__ import annotations

import math

import torch

from pyhf_gpu_client import tables
from pyhf_gpu_server import inference
from pyhf_gpu_server.engine import HistFactoryModel
from pyhf_gpu_server.inference.results import UpperLimitResults

from ..schemas import (
    ResultFlag,
    UpperLimitAnswer,
    UpperLimitOptions,
    UpperLimitResult,
    result_flag,
)
from .base import (
    EngineRows,
    Operation,
    RowResult,
    RowStatus,
    background_only_flags,
    qtilde_bound_flags,
)

SEARCH_HYPOTESTS = 12  # about how many POI values a limit search without a scan tests


class UpperLimit(Operation[UpperLimitOptions]):
    """One row per element: a scan of given POI values, or a search for the limit (q~)."""

    name = tables.UPPER_LIMIT
    summary = "Observed and expected upper limits on the POI"
    options_model = UpperLimitOptions
    result_model = UpperLimitResult

    def tested_values(self, options: UpperLimitOptions) -> tuple[str, list[float]] | None:
        return None if options.scan is None else ("scan", options.scan)

    def floors_poi(self, options: UpperLimitOptions) -> bool:
        return True  # every upper limit uses q~

    def row_cost(self, options: UpperLimitOptions) -> float:
        return 4.0 * len(options.scan or range(SEARCH_HYPOTESTS))

    def run(
        self, model: HistFactoryModel, rows: EngineRows, options: UpperLimitOptions
    ) -> list[RowResult]:
        scan = None
        if options.scan is not None:
            scan = torch.tensor(options.scan, dtype=model.dtype, device=model.device)
        result = inference.upper_limit(
            model, element=rows.element, scan=scan, level=options.level, options=rows.fit
        )
        statuses = RowStatus.of(result, len(rows))
        flags = [
            background + bound + limits
            for background, bound, limits in zip(
                background_only_flags(model, rows.element),
                qtilde_bound_flags(model, rows.element),
                limit_flags(result, model.poi_name, options.scan),
                strict=True,
            )
        ]
        return [
            RowResult(answer, s, flags=f)
            for answer, s, f in zip(limit_answers(result), statuses, flags, strict=True)
        ]


def limit_answers(result: UpperLimitResults) -> list[UpperLimitAnswer]:
    """Each row's observed and expected limits, at its level."""
    return [
        UpperLimitAnswer(upper_limit_obs=obs, upper_limit_exp=exp, level=result.level)
        for obs, exp in zip(result.obs.tolist(), result.exp.tolist(), strict=True)
    ]


CURVES = (
    "observed",
    "expected -2 sigma",
    "expected -1 sigma",
    "expected median",
    "expected +1 sigma",
    "expected +2 sigma",
)


def limit_flags(
    result: UpperLimitResults, poi: str, scan: list[float] | None
) -> list[tuple[ResultFlag, ...]]:
    """Per row, the ``meta.flags`` of its limits: those past the POI's upper bound (root
    search; pyhf raises ValueError there) and those a ``scan`` does not bracket (answered as
    the scan's end)."""
    level = result.level
    limits = torch.cat([result.obs.unsqueeze(-1), result.exp], dim=-1).tolist()
    out: list[tuple[ResultFlag, ...]] = []
    if scan is None:
        for values, beyond, (_, hi) in zip(
            limits, result.beyond_bounds.tolist(), result.bounds.tolist(), strict=True
        ):
            past = [c for c in range(6) if beyond[c]]
            found = [f"{CURVES[c]} {values[c]:.4g}" for c in past if math.isfinite(values[c])]
            lost = [CURVES[c] for c in past if not math.isfinite(values[c])]
            why = (
                f"CLs at the bound above the level {level:g}, where pyhf's upper_limit raises "
                "ValueError"
            )
            said = []
            if found:
                said.append(f"{', '.join(found)} ({why}; found here by fits beyond the bound)")
            if lost:
                said.append(
                    f"none found for {', '.join(lost)} (null): CLs stays above the level at "
                    "every value tested, as where the POI does not change the expected counts"
                    + ("" if found else f" ({why})")
                )
            detail = f"limits past the upper bound {hi:g} of the POI {poi!r}: {'; '.join(said)}"
            out.append((result_flag("limit_beyond_bounds", detail),) if past else ())
        return out
    for sides in result.outside_scan.tolist():
        flags = []
        for sign, end, at, cls_is in (
            (1, "last", scan[-1], "above"),
            (-1, "first", scan[0], "below"),
        ):
            which = [CURVES[c] for c in range(6) if sides[c] == sign]
            if which:
                detail = (
                    f"limits not bracketed by the scan, answered as its {end} value {at:g}: "
                    f"{', '.join(which)} (CLs at {at:g} {cls_is} the level {level:g}; pyhf "
                    "answers the same without a word: extend the scan)"
                )
                flags.append(result_flag("limit_outside_scan", detail))
        out.append(tuple(flags))
    return out
