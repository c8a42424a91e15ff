"""``POST /likelihood``: profile likelihoods at fixed POI values and free minima, on the
observed data, the background-only expectation or the Asimov data of a test statistic.

What a likelihood front end (spey's ``BackendBase``: ``negative_loglikelihood``,
``minimize_negative_loglikelihood`` and their Asimov twins) asks of a model, answered for
every (element, ``test_poi``) row in ONE batched engine call: the row's fit with the POI
fixed at ``test_poi`` and the element's free fit (POI within ``poi_bounds``), on ``data``
and, with ``asimov``, on its Asimov dataset as pyhf and spey build it (the fields of
:class:`LikelihoodOptions` say what each option means). A fixed POI value may lie outside the
POI's bounds (an upper-limit search tests far values): the fixed fits widen them to it.

Example:
    >>> op = Likelihood()
    >>> op.options_model(test_poi=[0.5, 2.0], asimov="qtilde").asimov, op.pois_field
    ('qtilde', 'test_poi')
    >>> op.options_model(poi_bounds=(3.0, 1.0))
    Traceback (most recent call last):
    ...
    pydantic_core._pydantic_core.ValidationError: 1 validation error for LikelihoodOptions
    ...
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Annotated, Any, Literal

import numpy as np
import torch
from pydantic import Field, model_validator
from torch import Tensor

from pyhf_gpu_server.engine import HistFactoryModel
from pyhf_gpu_server.engine.layout import ElementLayout
from pyhf_gpu_server.inference.mle import FitRequest, FitSpec, fit_requests, fit_rows
from pyhf_gpu_server.inference.results import FitResults

from ..schemas import MAX_POIS, FiniteFloat, ResultMeta, _Declared, _Strict
from .base import EngineRows, Operation, RowResult, RowStatus

ASIMOV_POI = {"q": 0.0, "qtilde": 0.0, "q0": 1.0}
MAX_VALUES = 1_000_000  # numbers in a given dataset or parameter point


class LikelihoodOptions(_Strict):
    """What to fit: the POI values of the fixed fits, the data, the Asimov data's test
    statistic, the free fits' POI bounds, and what else a row answers."""

    test_poi: (
        FiniteFloat | Annotated[list[FiniteFloat], Field(min_length=1, max_length=MAX_POIS)]
    ) = Field(1.0, description="POI value of the fixed fits; a list answers a list")
    data: (
        Literal["observed", "apriori"]
        | Annotated[list[FiniteFloat], Field(min_length=1, max_length=MAX_VALUES)]
    ) = Field(
        "observed",
        description="'observed'; 'apriori' (the nominal yields of the samples the POI does "
        "not scale, summed per bin, with the nominal auxiliary data: spey-pyhf's apriori "
        "data); or a dataset: the element's main bins then its auxiliary data, pyhf's order",
    )
    asimov: Literal["q", "qtilde", "q0"] | None = Field(
        None,
        description="also fit the Asimov data of this test statistic, built from `data`: the "
        "expected data at the conditional fit at POI 0 (q, qtilde) or 1 (q0)",
    )
    free_fit: bool = Field(True, description="also run the free fits (POI within poi_bounds)")
    poi_bounds: tuple[FiniteFloat, FiniteFloat] | None = Field(
        None, description="the POI's bounds [low, high] in the free fits (default: the model's)"
    )
    describe: bool = Field(
        False,
        description="add the model's parameters (names, init, bounds, fixed, POI index) and "
        "auxiliary-data constraints",
    )
    parameters: Annotated[list[FiniteFloat], Field(min_length=1, max_length=MAX_VALUES)] | None = (
        Field(
            None,
            description="a parameter point (pyhf's order): add the expected data (auxiliary "
            "data included) and -2 log L of `data` there",
        )
    )

    @model_validator(mode="after")
    def _ordered_bounds(self) -> LikelihoodOptions:
        """``poi_bounds`` low below high."""
        if self.poi_bounds is not None and not self.poi_bounds[0] < self.poi_bounds[1]:
            raise ValueError("'poi_bounds' must be [low, high] with low < high")
        return self


class FitPoint(_Declared):
    """One fit: ``-2 log L`` at its minimum, the parameters there (the element's own, pyhf's
    order) and whether it converged."""

    twice_nll: float | None
    parameters: list[float | None]
    converged: bool


class DataFits(_Declared):
    """The fits to one dataset: POI fixed at ``test_poi``, and free (``free_fit``)."""

    fixed: FitPoint
    free: FitPoint | None = None


class ModelDescription(_Declared):
    """The element's parameters and auxiliary-data constraints (``describe``)."""

    par_names: list[str]
    poi_index: int
    init: list[float]
    bounds: list[tuple[float, float]]
    fixed: list[bool]
    n_main: int
    aux_poisson: list[bool] = Field(description="per auxiliary datum: Poisson (else Normal)")
    aux_sigma: list[float] = Field(description="per auxiliary datum: the Normal's width")


class PointValue(_Declared):
    """The model at the given ``parameters``: expected data (main, then auxiliary) and
    ``-2 log L`` of the data there."""

    expected_data: list[float | None]
    twice_nll: float | None


class LikelihoodAnswer(_Declared):
    """Fits at one tested POI value on the data (and on its Asimov data)."""

    test_poi: float
    data: DataFits
    asimov: DataFits | None = None
    model: ModelDescription | None = None
    at_parameters: PointValue | None = None


class LikelihoodResult(LikelihoodAnswer):
    """Fits at one tested POI value on the data (and on its Asimov data), plus meta."""

    meta: ResultMeta


def _background_expectation(layout: ElementLayout) -> np.ndarray:
    """``[N]`` the nominal yields of the samples the POI does not scale, summed per bin: the
    background-only expectation spey-pyhf fits as ``apriori`` data (its background-only
    workspace's samples summed), whatever the parameters' inits."""
    poi = layout.poi_index
    total = np.zeros(layout.n_main)
    for sample in layout.samples:
        if not any(poi in factors for factors in sample.multipliers):
            total += sample.nominal
    return total


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _point(host: dict[str, Any], i: int, columns: list[int]) -> FitPoint:
    """Row ``i`` of fits copied to the host (:func:`_host`), over the element's ``columns``."""
    return FitPoint(
        twice_nll=_finite(host["nll"][i]),
        parameters=[_finite(host["x"][i][c]) for c in columns],
        converged=bool(host["converged"][i]),
    )


def _host(fits: FitResults) -> dict[str, Any]:
    """The per-row numbers of ``fits``, copied to the host once."""
    return {
        "nll": fits.best_twice_nll.tolist(),
        "x": fits.bestfit.tolist(),
        "converged": fits.converged.tolist(),
    }


class Likelihood(Operation[LikelihoodOptions]):
    """One row per (element, ``test_poi`` value); the free fits and the Asimov data run
    once per element of the batch."""

    name = "likelihood"
    summary = (
        "Profile -2 log L at fixed POI values and free minima, on observed, background-only "
        "or Asimov data (a likelihood backend's questions, e.g. spey's)"
    )
    options_model = LikelihoodOptions
    result_model = LikelihoodResult
    pois_field = "test_poi"

    def row_cost(self, options: LikelihoodOptions) -> float:
        asimov = options.asimov is not None
        return (1.0 + options.free_fit) * (1.0 + asimov) + 2.0 * asimov

    def element_problem(self, layout: ElementLayout, options: LikelihoodOptions) -> str | None:
        """No POI; a dataset or parameter point of the wrong length, or negative main counts.
        (A fixed POI value outside the POI's bounds is no problem: the fit widens them.)"""
        if layout.poi_index is None:
            return "the model has no POI (the measurement's 'poi'): nothing to fix or profile"
        if isinstance(options.data, list):
            want = layout.n_main + len(layout.aux_param)
            if len(options.data) != want:
                return (
                    f"'data' has {len(options.data)} values; this model takes {want}: "
                    f"{layout.n_main} main bins, then {want - layout.n_main} auxiliary data"
                )
            if min(options.data[: layout.n_main]) < 0.0:
                return "'data' has negative counts in main bins: a Poisson count is >= 0"
        if options.parameters is not None and len(options.parameters) != layout.n_pars:
            return (
                f"'parameters' has {len(options.parameters)} values; this model has "
                f"{layout.n_pars} parameters (pyhf's par_order)"
            )
        return None

    def run(
        self, model: HistFactoryModel, rows: EngineRows, options: LikelihoodOptions
    ) -> list[RowResult]:
        element, poi, k = rows.element, rows.poi, model.poi_index
        assert poi is not None, "pois_field 'test_poi': every row tests a POI value"
        elements, index = torch.unique(element, return_inverse=True)
        data = self._datasets(model, elements, options)
        nan = torch.full_like(data[:, 0], torch.nan)
        init = model.init.index_select(0, elements)
        free_bounds = model.bounds.index_select(0, elements).clone()
        if options.poi_bounds is not None:
            free_bounds[:, k, 0], free_bounds[:, k, 1] = options.poi_bounds
        requests: dict[str, FitRequest] = {}

        def widened(of: Tensor, value: Tensor) -> Tensor:
            """The bounds of the elements ``of``, the POI's widened to the fixed ``value``."""
            bounds = model.bounds.index_select(0, of).clone()
            bounds[:, k, 0] = torch.minimum(bounds[:, k, 0], value)
            bounds[:, k, 1] = torch.maximum(bounds[:, k, 1], value)
            return bounds

        def fixed_request(dataset: Tensor, start: Tensor, also_from: int | None = None):
            """Rows with the POI fixed at the tested value."""
            bounds = widened(element, poi)
            return FitRequest(dataset[index], element, poi, start[index], bounds, also_from)

        if options.free_fit:
            requests["free_data"] = FitRequest(data, elements, nan, init, free_bounds)
        requests["fixed_data"] = fixed_request(data, init)
        if options.asimov is not None:
            mu = torch.full_like(nan, ASIMOV_POI[options.asimov])
            asimov_fit = fit_rows(
                model, data, elements, mu, init=init, bounds=widened(elements, mu), options=rows.fit
            )
            asimov = model.expected_data(asimov_fit.bestfit, elements)
            if options.free_fit:
                requests["free_asimov"] = FitRequest(
                    asimov, elements, nan, asimov_fit.bestfit, free_bounds
                )
            # from the conditional minimum on the data at the same POI too, the lower kept
            also_from = list(requests).index("fixed_data")
            requests["fixed_asimov"] = fixed_request(asimov, asimov_fit.bestfit, also_from)
        fitted = fit_requests(model, list(requests.values()), FitSpec(options=rows.fit))
        fits = dict(zip(requests, fitted, strict=True))
        return self._results(model, rows, options, fits, index, elements, data)

    @staticmethod
    def _datasets(model: HistFactoryModel, elements: Tensor, options: LikelihoodOptions) -> Tensor:
        """``[U, N + A]`` the chosen dataset of each element (the stack's auxiliary slots)."""
        observed = model.observed.index_select(0, elements)
        if options.data == "observed":
            return observed
        n_main = model.n_main
        if options.data == "apriori":
            data = observed.clone()
            for row, e in enumerate(elements.tolist()):
                expected = _background_expectation(model.elements[e])
                data[row, :n_main] = torch.as_tensor(
                    expected, dtype=model.dtype, device=model.device
                )
            return data
        given = torch.as_tensor(options.data, dtype=model.dtype, device=model.device)
        data = observed.clone()
        data[:, :n_main] = given[:n_main]
        for row, e in enumerate(elements.tolist()):
            slots = torch.as_tensor(model.stack.aux_slots[e], device=model.device)
            data[row, n_main + slots] = given[n_main:]
        return data

    def _results(
        self,
        model: HistFactoryModel,
        rows: EngineRows,
        options: LikelihoodOptions,
        fits: dict[str, FitResults],
        index: Tensor,
        elements: Tensor,
        data: Tensor,
    ) -> list[RowResult]:
        """Each row's payload: its fits (the free ones its element's), and what it asked."""
        host = {name: _host(f) for name, f in fits.items()}
        assert rows.poi is not None, "pois_field 'test_poi': every row tests a POI value"
        unique_of_row, pois, element_of = index.tolist(), rows.poi.tolist(), elements.tolist()
        described = {e: self._describe(model, e) for e in element_of} if options.describe else {}
        at = {}
        if options.parameters is not None:
            at = self._at_parameters(model, elements, data, rows, unique_of_row, options)
        statuses = RowStatus.of(self._status(fits, index), len(rows))
        results = []
        for i, status in enumerate(statuses):
            u, columns = unique_of_row[i], rows.columns[i]
            found = {}
            for prefix in ("data", "asimov"):
                if f"fixed_{prefix}" in fits:
                    found[prefix] = DataFits(fixed=_point(host[f"fixed_{prefix}"], i, columns))
                    if options.free_fit:
                        found[prefix].free = _point(host[f"free_{prefix}"], u, columns)
            answer = LikelihoodAnswer(test_poi=pois[i], data=found["data"])
            if "asimov" in found:
                answer.asimov = found["asimov"]
            if options.describe:
                answer.model = described[element_of[u]]
            if options.parameters is not None:
                answer.at_parameters = at[u]
            results.append(RowResult(answer, status))
        return results

    @staticmethod
    def _status(fits: dict[str, FitResults], index: Tensor) -> SimpleNamespace:
        """Per row: every fit behind it converged, the fixed fit's starts, all starts agreed
        (the free fits' rows are the elements': ``index`` maps rows to them)."""
        per_row = [f.select(index) if name.startswith("free") else f for name, f in fits.items()]
        return SimpleNamespace(
            converged=torch.stack([f.converged for f in per_row]).all(0),
            starts=fits["fixed_data"].starts,
            starts_agreed=torch.stack([f.starts_agreed for f in per_row]).all(0),
        )

    @staticmethod
    def _describe(model: HistFactoryModel, e: int) -> ModelDescription:
        """Element ``e``'s parameters and auxiliary-data constraints (pyhf's order)."""
        layout = model.elements[e]
        return ModelDescription(
            par_names=layout.par_names,
            poi_index=layout.poi_index,
            init=layout.init.tolist(),
            bounds=[tuple(b) for b in layout.bounds.tolist()],
            fixed=layout.fixed.tolist(),
            n_main=layout.n_main,
            aux_poisson=layout.aux_is_poisson.tolist(),
            aux_sigma=layout.aux_sigma.tolist(),
        )

    @staticmethod
    def _at_parameters(
        model: HistFactoryModel,
        elements: Tensor,
        data: Tensor,
        rows: EngineRows,
        unique_of_row: list[int],
        options: LikelihoodOptions,
    ) -> dict[int, PointValue]:
        """Per element: the expected data and ``-2 log L`` of its data at ``parameters``."""
        pars = model.init.index_select(0, elements).clone()
        first_row = {u: i for i, u in reversed(list(enumerate(unique_of_row)))}
        given = torch.as_tensor(options.parameters, dtype=model.dtype, device=model.device)
        for u in range(elements.shape[0]):
            pars[u, rows.columns[first_row[u]]] = given
        expected = model.expected_data(pars, elements)
        twice_nll = (-2.0 * model.logpdf(pars, data, elements)).tolist()
        out = {}
        for u, e in enumerate(elements.tolist()):
            slots = model.stack.aux_slots[e]
            values = expected[u, : model.n_main].tolist()
            values += expected[u, model.n_main :][torch.as_tensor(slots)].tolist()
            out[u] = PointValue(
                expected_data=[_finite(v) for v in values], twice_nll=_finite(twice_nll[u])
            )
        return out
