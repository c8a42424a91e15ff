"""``POST /scan``: profile-likelihood scans (``-2 delta ln L``) of one parameter over a grid,
or of two over a 2D grid (cabinetry's ``fit.scan``): one conditional fit per grid point, all
points of every row and their free fits in one batched call."""

from __future__ import annotations

from typing import Any

from pyhf_gpu_server import inference
from pyhf_gpu_server.engine import HistFactoryModel

from ..schemas import PatchError, Scan2DResult, ScanOptions, ScanResult
from .base import EngineRows, Operation, RowResult, RowStatus
from .ranking import STATUS_KEYS


class Scan(Operation[ScanOptions]):
    """One row per element; the parameter defaults to the POI."""

    name = "scan"
    summary = "Profile-likelihood scan of one or two parameters over a grid"
    options_model = ScanOptions
    result_model = ScanResult

    def _answer_model(self) -> Any:
        result = ScanResult | Scan2DResult
        return result | dict[str, result | PatchError]

    def row_cost(self, options: ScanOptions) -> float:
        points = len(options.x.grid()) * (1 if options.y is None else len(options.y.grid()))
        return 2.0 + points

    def run(
        self, model: HistFactoryModel, rows: EngineRows, options: ScanOptions
    ) -> list[RowResult]:
        x = options.x.parameter or model.poi_name
        if options.y is None:
            result = inference.scan(
                model, x, options.x.grid(), element=rows.element, options=rows.fit
            )
        else:
            y = options.y.parameter or model.poi_name
            result = inference.scan2d(
                model,
                (x, y),
                options.x.grid(),
                options.y.grid(),
                element=rows.element,
                options=rows.fit,
            )
        statuses = RowStatus.of(result, len(rows))
        return [
            RowResult({k: v for k, v in result.to_json(i).items() if k not in STATUS_KEYS}, s)
            for i, s in enumerate(statuses)
        ]
