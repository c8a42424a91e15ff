"""``POST /cls``: CLs of hypothesis tests, as ``pyhf cls`` prints them."""

from __future__ import annotations

from pyhf_gpu_server import inference
from pyhf_gpu_server.engine import HistFactoryModel
from pyhf_gpu_server.inference.results import HypotestResults

from ..schemas import ClsAnswer, ClsOptions, ClsResult, ResultFlag, result_flag
from .base import (
    EngineRows,
    Operation,
    RowResult,
    RowStatus,
    background_only_flags,
    hypotests,
    qtilde_bound_flags,
)


class Cls(Operation[ClsOptions]):
    """One row per (element, ``test_poi`` value); ``q~`` floors the POI at 0."""

    name = "cls"
    summary = "CLs of a hypothesis test, as `pyhf cls` prints it"
    options_model = ClsOptions
    result_model = ClsResult
    pois_field = "test_poi"

    def tested_values(self, options: ClsOptions) -> tuple[str, list[float]]:
        values = options.test_poi if isinstance(options.test_poi, list) else [options.test_poi]
        return "test_poi", values

    def floors_poi(self, options: ClsOptions) -> bool:
        return options.test_stat == "qtilde"

    def run(
        self, model: HistFactoryModel, rows: EngineRows, options: ClsOptions
    ) -> list[RowResult]:
        result = hypotests(model, rows.poi, rows, options, options.test_stat)
        statuses = RowStatus.of_hypotests(result)
        flags = background_only_flags(model, rows.element)
        if options.test_stat == "qtilde":
            bounds = qtilde_bound_flags(model, rows.element)
            flags = [f + b for f, b in zip(flags, bounds, strict=True)]
        flags = [f + u for f, u in zip(flags, unresolved(result), strict=True)]
        return [
            RowResult(answer, s, None if rows.toys is None else result.row(i), f)
            for i, (answer, s, f) in enumerate(
                zip(cls_answers(result), statuses, flags, strict=True)
            )
        ]

    def join(self, parts: list[RowResult]) -> RowResult:
        result = inference.join_toy_parts([part.part for part in parts])
        model_flags = tuple(f for f in parts[0].flags if f.kind != "p_value_unresolved")
        return RowResult(
            cls_answers(result)[0],
            RowStatus.of_hypotests(result)[0],
            flags=model_flags + unresolved(result)[0],
        )


def unresolved(result: HypotestResults) -> list[tuple[ResultFlag, ...]]:
    """Per row, ``p_value_unresolved`` where a toy-based ``CLs_obs`` is ``0 / 0``: the data
    less signal-like than every toy of both hypotheses (``CLsb = CLb = 0``, as for a deficit
    far below the background), which pyhf answers NaN."""
    if result.toys is None:
        return [()] * len(result)
    flags: list[tuple[ResultFlag, ...]] = []
    rows = zip(result.clb_obs.tolist(), result.toys.signal, result.toys.background, strict=True)
    for clb, signal, background in rows:
        detail = (
            f"CLs_obs is 0 / 0 (null): the data are less signal-like than every one of its "
            f"{len(signal)} toys at the tested POI and {len(background)} at the background "
            "hypothesis (CLsb = CLb = 0), as for a deficit far below the background; more toys "
            "(ntoys) or the asymptotic CLs resolve it"
        )
        flags.append((result_flag("p_value_unresolved", detail),) if clb == 0.0 else ())
    return flags


def cls_answers(result: HypotestResults) -> list[ClsAnswer]:
    """Each row exactly as ``pyhf cls`` prints it: ``CLs_obs``, ``CLs_exp`` (CLsb for q0)."""
    observed, expected = result.observed().tolist(), result.expected().tolist()
    return [ClsAnswer(CLs_obs=o, CLs_exp=e) for o, e in zip(observed, expected, strict=True)]
