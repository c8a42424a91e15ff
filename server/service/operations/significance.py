"""``POST /significance``: discovery p-values and significances (``q0``)."""

from __future__ import annotations

import statistics

import torch

from pyhf_gpu_server import inference
from pyhf_gpu_server.engine import HistFactoryModel
from pyhf_gpu_server.inference.results import HypotestResults, SignificanceResults

from ..schemas import (
    ResultFlag,
    SignificanceAnswer,
    SignificanceOptions,
    SignificanceResult,
    result_flag,
)
from .base import EngineRows, Operation, RowResult, RowStatus, background_only_flags, hypotests


class Significance(Operation[SignificanceOptions]):
    """One row per element; asymptotic or toy-based."""

    name = "significance"
    summary = "Discovery significance (p0 and Z), observed and expected; asymptotic or toy-based"
    options_model = SignificanceOptions
    result_model = SignificanceResult

    def run(
        self, model: HistFactoryModel, rows: EngineRows, options: SignificanceOptions
    ) -> list[RowResult]:
        tests = hypotests(model, 0.0, rows, options, "q0")
        result = inference.significance_of(tests)
        statuses = RowStatus.of_hypotests(tests)
        flags = [
            b + u
            for b, u in zip(
                background_only_flags(model, rows.element), unresolved(tests, result), strict=True
            )
        ]
        return [
            RowResult(answer, s, None if rows.toys is None else tests.row(i), f)
            for i, (answer, s, f) in enumerate(
                zip(significance_answers(result), statuses, flags, strict=True)
            )
        ]

    def join(self, parts: list[RowResult]) -> RowResult:
        tests = inference.join_toy_parts([p.part for p in parts])
        result = inference.significance_of(tests)
        answer, status = significance_answers(result)[0], RowStatus.of_hypotests(tests)[0]
        model_flags = tuple(f for f in parts[0].flags if f.kind != "p_value_unresolved")
        return RowResult(answer, status, flags=model_flags + unresolved(tests, result)[0])


AS_SIGNAL_LIKE_AS = {"obs": "the data", "exp": "the median toy at mu = 1"}


def unresolved(tests: HypotestResults, result: SignificanceResults) -> list[tuple[ResultFlag, ...]]:
    """Per row, ``p_value_unresolved`` where ``p0_obs`` or ``p0_exp`` is 0 and its ``Z`` not
    known: with toys, none of the ``N`` toys at ``mu = 0`` is as signal-like as the data (or
    as the median toy at ``mu = 1``), so ``p0 < 1 / N``; asymptotically (where ``Z`` is
    ``sqrt(q0)`` beyond the smallest double's ``p0``), only where that is not finite."""
    p0 = torch.stack([result.p0_obs, result.p0_exp], -1).tolist()
    z = torch.stack([result.z_obs, result.z_exp], -1).isfinite().tolist()
    toys = [None] * len(p0) if tests.toys is None else [len(t) for t in tests.toys.signal]
    flags: list[tuple[ResultFlag, ...]] = []
    for (obs, exp), (z_obs, z_exp), n in zip(p0, z, toys, strict=True):
        zero = [
            k
            for k, p, known in (("obs", obs, z_obs), ("exp", exp, z_exp))
            if p == 0.0 and not known
        ]
        if not zero:
            flags.append(())
            continue
        names = " and ".join(f"p0_{k}" for k in zero) + (" are 0" if len(zero) == 2 else " is 0")
        nulls = " and ".join(f"z_{k}" for k in zero) + " null"
        if n is None:
            detail = f"{names} and sqrt(q0) not finite: Z unbounded ({nulls})"
        else:
            than = " or ".join(AS_SIGNAL_LIKE_AS[k] for k in zero)
            z_bound = -statistics.NormalDist().inv_cdf(1 / n)
            detail = (
                f"{names}: none of its {n} toys at mu = 0 is as signal-like as {than}, so "
                f"p0 < {1 / n:.3g} and Z > {z_bound:.3g} ({nulls}); more toys (ntoys) resolve it"
            )
        flags.append((result_flag("p_value_unresolved", detail),))
    return flags


def significance_answers(result: SignificanceResults) -> list[SignificanceAnswer]:
    """Each row's p-values and significances."""
    columns = (result.p0_obs, result.p0_exp, result.z_obs, result.z_exp, result.p0_exp_set)
    return [
        SignificanceAnswer(p0_obs=p0, p0_exp=p0_exp, z_obs=z, z_exp=z_exp, p0_exp_set=band)
        for p0, p0_exp, z, z_exp, band in zip(*(t.tolist() for t in columns), strict=True)
    ]
