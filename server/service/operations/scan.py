"""``POST /scan``: profile-likelihood scans (``-2 delta ln L``) of one parameter over a grid,
or of two over a 2D grid (cabinetry's ``fit.scan``; without a grid its default, the best fit
+- 3 uncertainties per patch): one conditional fit per grid point, all points of every row and
their free fits in one batched call. A patch that lacks a scanned parameter (or has it fixed,
or the grid outside its bounds) answers its own error; the other patches their scans."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from pyhf_gpu_server import inference
from pyhf_gpu_server.engine import HistFactoryModel
from pyhf_gpu_server.engine.layout import ElementLayout
from pyhf_gpu_server.inference.scan import Scan2DResults, ScanResults, grid_problem

from ..schemas import (
    PatchError,
    ResultFlag,
    Scan2DAnswer,
    Scan2DResult,
    ScanAnswer,
    ScanOptions,
    ScanResult,
    result_flag,
)
from .base import EngineRows, Operation, RowResult, RowStatus


class Scan(Operation[ScanOptions]):
    """One row per element; the parameter defaults to the POI."""

    name = "scan"
    summary = "Profile-likelihood scan of one or two parameters over a grid"
    options_model = ScanOptions
    result_model = ScanResult

    def _response_model(self) -> Any:
        result = ScanResult | Scan2DResult
        return result | dict[str, result | PatchError]

    def row_cost(self, options: ScanOptions) -> float:
        return 2.0 + options.x.points * (1 if options.y is None else options.y.points)

    def element_problem(self, layout: ElementLayout, options: ScanOptions) -> str | None:
        """A scanned parameter this patch does not have free, or a grid outside its bounds."""
        problem = super().element_problem(layout, options)
        if problem is not None:
            return problem
        labels = layout.par_names
        for axis in (options.x, options.y):
            if axis is None:
                continue
            name = axis.parameter or layout.poi_name
            if name is None:
                return "the model has no POI: name the scanned parameter"
            if name not in labels:
                return f"parameter {name!r} is not in this model: it cannot be scanned"
            column = labels.index(name)
            if bool(layout.fixed[column]):
                return f"parameter {name!r} is fixed: it cannot be scanned"
            values = axis.grid()
            bounds = map(float, layout.bounds[column])
            problem = grid_problem(name, values, *bounds) if values else None
            if problem:
                return problem
        return None

    def run(
        self, model: HistFactoryModel, rows: EngineRows, options: ScanOptions
    ) -> list[RowResult]:
        x = options.x.parameter or model.poi_name
        if options.y is None:
            result = inference.scan(
                model,
                x,
                options.x.grid(),
                element=rows.element,
                options=rows.fit,
                steps=options.x.steps,
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
                steps=(options.x.steps, options.y.steps),
            )
        statuses = RowStatus.of(result, len(rows))
        flags = scan_flags(result.poi_bound, model.poi_name, len(rows))
        return [
            RowResult(scan_answer(result, i), s, flags=f)
            for i, (s, f) in enumerate(zip(statuses, flags, strict=True))
        ]


def scan_answer(result: ScanResults | Scan2DResults, i: int = 0) -> ScanAnswer | Scan2DAnswer:
    """Row ``i`` with cabinetry's scan field names (a 2D scan's per axis, its ``delta_nlls``
    ``[G_x][G_y]``)."""
    if isinstance(result, ScanResults):
        return ScanAnswer(
            name=result.name,
            bestfit=float(result.bestfit[i]),
            uncertainty=float(result.uncertainty[i]),
            parameter_values=result.parameter_values[i].tolist(),
            delta_nlls=result.delta_nlls[i].tolist(),
        )
    return Scan2DAnswer(
        names=list(result.names),
        bestfit=result.bestfit[i].tolist(),
        uncertainty=result.uncertainty[i].tolist(),
        correlation=float(result.correlation[i]),
        parameter_values=[v[i].tolist() for v in result.parameter_values],
        delta_nlls=result.delta_nlls[i].tolist(),
    )


def scan_flags(
    poi_bound: Tensor | None, poi: str | None, rows: int
) -> list[tuple[ResultFlag, ...]]:
    """Per row, ``poi_at_bound`` where the free fit's POI lies on its bound (``poi_bound``
    finite): the profile is measured from that bounded minimum."""
    if poi_bound is None:
        return [()] * rows
    return [
        ()
        if bound != bound  # NaN: inside its bounds
        else (
            result_flag(
                "poi_at_bound",
                f"the best fit of the POI {poi!r} lies on its bound {bound:g}: -2 delta ln L is "
                "measured from that bounded minimum, not from the unbounded likelihood's",
            ),
        )
        for bound in poi_bound.tolist()
    ]
