"""CLs hypothesis tests (pyhf's ``infer.hypotest``) for many rows at once.

A row is one (element, dataset, tested POI value). The rows of one call, e.g. a scan over
``test_poi`` values, or every patch of a patchset, or both, share their batched fits: see
:mod:`~pyhf_gpu_server.inference.asymptotics` and :mod:`~pyhf_gpu_server.inference.toys`.

Example:
    >>> from pyhf_gpu_server.inference.examples import simple_model
    >>> model = simple_model([12.0, 11.0], [50.0, 52.0], [3.0, 7.0], data=[51.0, 48.0])
    >>> res = hypotest(model, [1.0, 2.0])
    >>> [round(v, 6) for v in res.cls_obs.tolist()]
    [0.052516, 0.000227]
    >>> [round(v, 6) for v in res.expected()[0].tolist()]
    [0.002606, 0.013821, 0.064455, 0.235261, 0.573042]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, TypedDict

from torch import Tensor

from .asymptotics import AsymptoticCalculator
from .errors import InferenceError
from .mle import FitOptions, FitSpec
from .results import HypotestResults
from .rows import Rows, rows_of
from .test_statistics import TestStatistic, get_test_stat
from .toys import (
    ToyCalculator,
    ToySlice,
    ToyStats,
    expected_toy_pvalues,
    join_toy_stats,
    toy_pvalues,
)

if TYPE_CHECKING:
    from typing import Unpack

    from ..engine.model import HistFactoryModel

__all__ = [
    "CalculatorKeywords",
    "CalculatorSpec",
    "HypotestKeywords",
    "hypotest",
    "hypotest_of",
    "join_toy_parts",
    "make_calculator",
    "run_calculator",
]

CalcType = Literal["asymptotics", "toybased"]


class CalculatorKeywords(TypedDict, total=False):
    """pyhf's keyword arguments of a hypothesis test but its ``test_stat``, which
    :meth:`CalculatorSpec.of` reads (its defaults)."""

    calctype: CalcType
    calc_base_dist: str
    ntoys: int
    seed: int | None
    init: Tensor | None
    bounds: Tensor | None
    fixed: Tensor | None
    options: FitOptions | None


class HypotestKeywords(CalculatorKeywords, total=False):
    """pyhf's keyword arguments of a hypothesis test (:meth:`CalculatorSpec.of`)."""

    test_stat: str


@dataclass(frozen=True)
class CalculatorSpec:
    """How hypotheses are tested, passed explicitly to every stage: the test statistic, the
    fits (:class:`~.mle.FitSpec`, its POI floor the statistic's), asymptotic formulae or
    toys and their numbers."""

    stat: TestStatistic
    fit: FitSpec
    calctype: CalcType = "asymptotics"
    calc_base_dist: str = "normal"
    ntoys: int = 2000
    seed: int | None = None

    @classmethod
    def of(
        cls,
        test_stat: str = "qtilde",
        calctype: CalcType = "asymptotics",
        *,
        calc_base_dist: str = "normal",
        ntoys: int = 2000,
        seed: int | None = None,
        init: Tensor | None = None,
        bounds: Tensor | None = None,
        fixed: Tensor | None = None,
        options: FitOptions | None = None,
    ) -> CalculatorSpec:
        """The spec of pyhf's keyword arguments (``InferenceError`` for an unknown
        ``test_stat`` or ``calctype``).

        Args:
            test_stat: ``"qtilde"`` (default), ``"q"`` or ``"q0"``.
            calctype: ``"asymptotics"`` or ``"toybased"``.
            calc_base_dist: asymptotics only, ``"normal"`` or ``"clipped_normal"``.
            ntoys, seed: toys only: toys per hypothesis, and the seed of every row's toys.
            init, bounds, fixed: ``[P]``-shaped overrides of the model's suggested values.
            options: :class:`~pyhf_gpu_server.inference.mle.FitOptions` of the fits.
        """
        stat = get_test_stat(test_stat)
        if calctype not in ("asymptotics", "toybased"):
            raise InferenceError(
                f"unknown calctype {calctype!r}; expected 'asymptotics' or 'toybased'"
            )
        fit = FitSpec(init, bounds, fixed, options or FitOptions(), stat.poi_floor)
        return cls(stat, fit, calctype, calc_base_dist, ntoys, seed)


def _check_model(model: HistFactoryModel) -> None:
    if model.poi_index is None:
        raise InferenceError("No POI is defined. A POI is required to run a hypothesis test.")
    if bool(model.fixed[:, model.poi_index].any()):
        raise InferenceError(
            f"the POI {model.poi_name!r} is fixed in the measurement; hypothesis tests need it "
            "free (profile-likelihood-ratio inference is impossible)"
        )


def make_calculator(
    model: HistFactoryModel,
    datasets: Tensor,
    elements: Tensor,
    spec: CalculatorSpec | None = None,
) -> AsymptoticCalculator | ToyCalculator:
    """The calculator (asymptotic or toy-based) for ``datasets`` (default spec: pyhf's
    defaults, ``q~`` asymptotics)."""
    spec = spec or CalculatorSpec.of()
    _check_model(model)
    if spec.calctype == "asymptotics":
        return AsymptoticCalculator(
            model, datasets, elements, spec.stat, spec.fit, spec.calc_base_dist
        )
    seed = 0 if spec.seed is None else spec.seed
    return ToyCalculator(model, datasets, elements, spec.stat, spec.fit, spec.ntoys, seed)


def hypotest(
    model: HistFactoryModel,
    test_poi,
    element=None,
    *,
    data: Tensor | None = None,
    toys: list[ToySlice] | None = None,
    **keywords: Unpack[HypotestKeywords],
) -> HypotestResults:
    """CLs tests of ``B`` rows, each an (element, dataset, tested POI) triple.

    Args:
        model: a :class:`~pyhf_gpu_server.engine.HistFactoryModel`.
        test_poi: float, ``[S]`` or ``[B]`` tested POI values.
        element: None (every element, times every ``test_poi``) or ``[B]`` element indices.
        data: None (observations) or ``[B, N + A]`` datasets.
        toys: toys only, the :class:`~.toys.ToySlice` each row draws (default: all ``ntoys``
            toys of the stream keyed by the row's position): the rows' p-values from those
            toys, the statistics kept in ``toys`` to be joined (:func:`join_toy_parts`).
        keywords: pyhf's (:class:`HypotestKeywords`): ``test_stat``, ``calctype``,
            ``calc_base_dist``, ``ntoys``, ``seed``, ``init``, ``bounds``, ``fixed``, and the
            fits' ``options``; see :meth:`CalculatorSpec.of`.

    Returns:
        :class:`~pyhf_gpu_server.inference.results.HypotestResults` (``observed()`` and
        ``expected()`` are pyhf's ``CLs_obs`` and ``CLs_exp``; for ``q0``, ``p0`` = CLsb).
    """
    spec = CalculatorSpec.of(**keywords)
    return hypotest_of(model, rows_of(model, data, element, test_poi, grid=True), spec, toys)


def hypotest_of(
    model: HistFactoryModel,
    rows: Rows,
    spec: CalculatorSpec,
    toys: list[ToySlice] | None = None,
) -> HypotestResults:
    """:func:`hypotest` of ``rows`` (their POI values tested) as ``spec`` says."""
    poi = rows.poi
    assert poi is not None  # the tested POI values
    datasets, elements, index = rows.datasets()
    calc = make_calculator(model, datasets, elements, spec)
    if toys is not None:
        if not isinstance(calc, ToyCalculator):
            raise InferenceError("toy slices are given, but calctype is not 'toybased'")
        if len(toys) != poi.shape[0]:
            raise InferenceError(f"{len(toys)} toy slices for {poi.shape[0]} rows")
    return run_calculator(calc, poi, index, toys)


def run_calculator(
    calc, poi: Tensor, index: Tensor, slices: list[ToySlice] | None = None
) -> HypotestResults:
    """Observed and expected p-values of rows ``(poi [B], dataset index [B])`` from ``calc``
    (a toy calculator's rows drawing ``slices``)."""
    if slices is None:
        stats = calc.teststatistic(poi, index)
    else:
        stats = calc.teststatistic(poi, index, slices)
    observed, expected = calc.pvalues(stats), calc.expected_pvalues(stats)
    return _results(poi, calc.element[index], calc.stat.name, stats, observed, expected)


def _results(
    poi: Tensor, element: Tensor, test_stat: str, stats, observed, expected
) -> HypotestResults:
    clsb, clb, cls = observed
    clsb_exp, clb_exp, cls_exp = expected
    return HypotestResults(
        poi=poi,
        element=element,
        test_stat=test_stat,
        cls_obs=cls,
        cls_exp=cls_exp,
        clsb_obs=clsb,
        clb_obs=clb,
        clsb_exp=clsb_exp,
        clb_exp=clb_exp,
        teststat=stats.teststat,
        sqrtq_asimov=None if isinstance(stats, ToyStats) else stats.sqrtq_asimov,
        fits=stats.fits,
        toys=stats if isinstance(stats, ToyStats) else None,
    )


def join_toy_parts(parts: list[HypotestResults]) -> HypotestResults:
    """One row's toy-based result from its slices' (one-row results of
    :func:`hypotest` with ``toys``, in the order of their toys): the p-values of all its
    toys, as one call drawing them all would give.

    Example:
        >>> from pyhf_gpu_server.inference.examples import simple_model
        >>> model = simple_model([5.0], [10.0], [2.0], data=[12.0])
        >>> whole = hypotest(model, 1.0, calctype="toybased", ntoys=120, seed=3)
        >>> slices = [hypotest(model, 1.0, calctype="toybased", ntoys=120, seed=3, toys=[s])
        ...           for s in ToySlice.cut(0, 120)]
        >>> join_toy_parts(slices).cls_exp.tolist() == whole.cls_exp.tolist()
        True
    """
    first = parts[0]
    if any(part.toys is None or len(part) != 1 for part in parts):
        raise InferenceError("only one-row toy-based results are joined")
    stats = join_toy_stats([part.toys for part in parts if part.toys is not None])  # all
    observed, expected = toy_pvalues(stats), expected_toy_pvalues(stats)
    return _results(first.poi, first.element, first.test_stat, stats, observed, expected)
