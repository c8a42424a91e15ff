"""``POST /upper-limit``: observed and expected upper limits on the POI."""

from __future__ import annotations

import torch

from pyhf_gpu_server import inference
from pyhf_gpu_server.engine import HistFactoryModel

from ..schemas import UpperLimitOptions, UpperLimitResult
from .base import EngineRows, Operation, RowResult, RowStatus

SEARCH_HYPOTESTS = 12  # about how many POI values a limit search without a scan tests


class UpperLimit(Operation[UpperLimitOptions]):
    """One row per element: a scan of given POI values, or a search for the limit (q~)."""

    name = "upper-limit"
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
        return [RowResult(result.to_json(i), s) for i, s in enumerate(statuses)]
