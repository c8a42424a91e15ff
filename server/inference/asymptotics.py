"""The asymptotic calculator of pyhf (``infer.calculators.AsymptoticCalculator``), batched.

For each row (dataset, tested POI value ``mu``) pyhf runs, one by one: the unconditional
and conditional fits to the data, the conditional fit at ``asimov_mu`` (0 for ``q``/``q~``,
1 for ``q0``) that makes the Asimov dataset, and the two fits to the Asimov data. Here:

- fits that depend only on the dataset (unconditional fit, Asimov fit, unconditional fit to
  the Asimov data) run once per distinct dataset, not once per row;
- the first call of :meth:`AsymptoticCalculator.teststatistic` runs the Asimov fit first,
  then the free and conditional fits to the data and to the Asimov data in one batched
  minimiser call, both free fits started at the Asimov fit's minimum (the Asimov data's free
  minimum is that point; the data's is never above it), and where a free parameter without
  constraint scales only what the POI scales (the model's ``has_poi_gated_params``: flat at
  POI = 0, where a fit can stay) from the model's init too, the lower kept; later calls (new
  ``mu`` values, e.g. while root-finding an upper limit) run their conditional fits in one
  call, each starting at the minimum of the conditional fit at the nearest POI value tested
  before on its dataset (pyhf starts every fit at the model's init; the minima are the
  same);
- the first call's conditional fits to the Asimov data run again, in the same minimiser
  call, from the conditional minima on the data at the same POI values as each is found
  (the lower minimum kept, the starts' agreement reported), where a nuisance parameter has
  two minima.

The p-values follow pyhf's ``AsymptoticTestStatDistribution`` (``normal`` or
``clipped_normal`` base distribution) and ``expected_pvalues`` (n_sigma = 2, 1, 0, -1, -2).

Example:
    >>> import torch
    >>> clsb, clb, cls = pvalues(torch.tensor([0.5]), torch.tensor([1.5]))
    >>> [round(v, 6) for v in (clsb.item(), clb.item(), cls.item())]
    [0.02275, 0.308538, 0.073735]
    >>> [round(v, 4) for v in expected_pvalues(torch.tensor([1.5]))[2][0].tolist()]
    [0.0102, 0.0391, 0.1336, 0.3667, 0.7076]
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .errors import InferenceError
from .mle import FitOptions, FitRequest, FitSpec, fit_requests
from .results import FitResults
from .starts import FitStatus
from .test_statistics import TestStatistic

if TYPE_CHECKING:
    from ..engine.model import HistFactoryModel

__all__ = [
    "N_SIGMA",
    "AsymptoticCalculator",
    "expected_pvalues",
    "normal_cdf",
    "pvalues",
]

N_SIGMA = (2.0, 1.0, 0.0, -1.0, -2.0)


# Twice-NLL differences below this are the minimiser's noise, not a test statistic: at
# test_poi = 0 with the POI bounded at 0, q and q_A are exactly 0 and a noise-level q > q_A = 0
# would send q~'s (q - q_A) / (2 sqrt(q_A)) to infinity and CLs to 0 / 0.
FIT_NOISE_TWICE_NLL = 1e-9


def _sqrt_above_fit_noise(q: Tensor) -> Tensor:
    return torch.sqrt(torch.where(q < FIT_NOISE_TWICE_NLL, torch.zeros_like(q), q))


def normal_cdf(x: Tensor) -> Tensor:
    """The unit normal's ``Phi(x)`` to full relative precision in both tails, as scipy's
    ``ndtr`` (pyhf's p-values): ``torch.special.ndtr`` (torch 2.13 on the CPU) loses its
    relative precision below ``x = -5`` and returns 0 from ``x = -8.3`` (p = 1e-16), which
    made CLs and p0 exactly 0 there and a significance above 8 sigma infinite."""
    return 0.5 * torch.special.erfc(x * -math.sqrt(0.5))


def _tail(value: Tensor, shift: Tensor | float, cutoff: Tensor | float) -> Tensor:
    """Right-tail p-value of a unit normal shifted by ``shift`` (NaN below ``cutoff``)."""
    p = normal_cdf(-(value - shift))
    return torch.where(value >= cutoff, p, torch.full_like(p, torch.nan))


def pvalues(
    teststat: Tensor, sqrtq_asimov: Tensor, calc_base_dist: str = "normal"
) -> tuple[Tensor, Tensor, Tensor]:
    """``(CLsb, CLb, CLs)`` of the observed asymptotic test statistic, per row."""
    cutoff = _cutoff(sqrtq_asimov, calc_base_dist)
    clsb = _tail(teststat, -sqrtq_asimov, cutoff)
    clb = _tail(teststat, 0.0, cutoff)
    return clsb, clb, clsb / clb


def expected_pvalues(
    sqrtq_asimov: Tensor, calc_base_dist: str = "normal"
) -> tuple[Tensor, Tensor, Tensor]:
    """``(CLsb, CLb, CLs)``, each ``[B, 5]``, at the background-only expected test
    statistics for n_sigma = 2, 1, 0, -1, -2 (pyhf's order)."""
    cutoff = _cutoff(sqrtq_asimov, calc_base_dist).unsqueeze(-1)
    n = torch.tensor(N_SIGMA, dtype=sqrtq_asimov.dtype, device=sqrtq_asimov.device)
    expected = torch.where(n > cutoff, n, cutoff)  # bkg-only distribution: shift 0
    clsb = _tail(expected, -sqrtq_asimov.unsqueeze(-1), cutoff)
    clb = _tail(expected, 0.0, cutoff)
    return clsb, clb, clsb / clb


def _cutoff(sqrtq_asimov: Tensor, calc_base_dist: str) -> Tensor:
    if calc_base_dist == "normal":
        return torch.full_like(sqrtq_asimov, -torch.inf)
    if calc_base_dist == "clipped_normal":
        return -sqrtq_asimov
    raise InferenceError(f"unknown base distribution for asymptotics {calc_base_dist!r}")


@dataclass
class AsymptoticStats:
    """What one :meth:`AsymptoticCalculator.teststatistic` call yields, per row."""

    teststat: Tensor
    sqrtq_asimov: Tensor
    fits: dict[str, FitStatus]


@dataclass(eq=False)
class AsymptoticCalculator:
    """Asymptotic CLs for many (dataset, mu) rows of one model.

    Args:
        model: a :class:`~pyhf_gpu_server.engine.HistFactoryModel`.
        data: ``[D, N + A]`` distinct datasets (see
            :func:`~pyhf_gpu_server.inference.rows.unique_datasets`).
        element: ``[D]`` element of each dataset.
        stat: the test statistic (:func:`~.test_statistics.get_test_stat`).
        spec: how the fits run (:class:`~.mle.FitSpec`).
        calc_base_dist: ``"normal"`` or ``"clipped_normal"`` (pyhf's option).
    """

    model: HistFactoryModel
    data: Tensor
    element: Tensor
    stat: TestStatistic
    spec: FitSpec
    calc_base_dist: str = "normal"
    free_data: FitResults | None = field(default=None, init=False)
    free_asimov: FitResults | None = field(default=None, init=False)
    asimov_fit: FitResults | None = field(default=None, init=False)
    asimov_data: Tensor | None = field(default=None, init=False)
    # every conditional fit so far: (tested POI [H], dataset index [H], data fit minima
    # [H, P], Asimov fit minima [H, P]), the warm starts of later calls
    conditional_minima: tuple[Tensor, ...] | None = field(default=None, init=False)

    @property
    def options(self) -> FitOptions:
        return self.spec.options

    def _warm_starts(self, tested: Tensor, index: Tensor) -> tuple[Tensor, Tensor]:
        """Start points ``[M, P]`` of new conditional fits to the data and to the Asimov data:
        the minima found before on the same dataset at the nearest tested POI value; NaN
        rows (the default start) for the data, the Asimov fit's minimum for the Asimov data,
        where there is none."""
        # after the first call: its fits are remembered, the Asimov fit done
        assert self.conditional_minima is not None and self.asimov_fit is not None
        mus, datasets, data_minima, asimov_minima = self.conditional_minima
        distance = (tested.unsqueeze(1) - mus.unsqueeze(0)).abs()
        distance = torch.where(index.unsqueeze(1) == datasets, distance, torch.inf)
        gap, nearest = distance.min(1)
        known = torch.isfinite(gap).unsqueeze(-1)
        data_start = torch.where(known, data_minima[nearest], torch.nan)
        asimov_start = torch.where(known, asimov_minima[nearest], self.asimov_fit.bestfit[index])
        return data_start, asimov_start

    def _remember(self, tested: Tensor, index: Tensor, data: FitResults, asimov: FitResults):
        new: tuple[Tensor, ...] = (tested, index, data.bestfit, asimov.bestfit)
        if self.conditional_minima is not None:
            pairs = zip(self.conditional_minima, new, strict=True)
            new = tuple(torch.cat([before, now]) for before, now in pairs)
        self.conditional_minima = new

    def teststatistic(self, mu: Tensor, index: Tensor) -> AsymptoticStats:
        """Asymptotic test statistics ``[M]`` for POI values ``mu [M]`` on datasets ``index [M]``."""
        model, stat, tested = self.model, self.stat, self.stat.tested(mu)
        data, element = self.data[index], self.element[index]
        if self.free_data is None:
            D = self.element.shape[0]
            nan = torch.full((D,), torch.nan, dtype=model.dtype, device=model.device)
            asimov_poi = torch.full((D,), stat.asimov_mu, dtype=model.dtype, device=model.device)
            # The Asimov fit first, then every other fit in one call (see the module
            # docstring), so that the slowest fits, conditional at the tested POI, run side
            # by side
            (self.asimov_fit,) = fit_requests(
                model, [FitRequest(self.data, self.element, asimov_poi)], self.spec
            )
            self.asimov_data = model.expected_data(self.asimov_fit.bestfit, self.element)
            requests = [
                FitRequest(self.data, self.element, nan, self.asimov_fit.bestfit),
                FitRequest(data, element, tested),
                FitRequest(self.asimov_data, self.element, nan, self.asimov_fit.bestfit),
                FitRequest(
                    self.asimov_data[index],
                    element,
                    tested,
                    self.asimov_fit.bestfit[index],
                    also_from=None if self.options.starts is None else 1,
                ),
            ]
            gated = model.has_poi_gated_params and self.options.starts is not None
            if gated:  # the free fit to the data from the model's init too, the lower kept
                requests.append(FitRequest(self.data, self.element, nan))
            fitted = fit_requests(model, requests, self.spec)
            self.free_data, fixed_data, self.free_asimov, fixed_asimov = fitted[:4]
            if gated:
                self.free_data = self.free_data.lower_of(fitted[4])
        else:
            assert self.asimov_data is not None  # made by the first call
            data_start, asimov_start = self._warm_starts(tested, index)
            fixed_data, fixed_asimov = fit_requests(
                model,
                [
                    FitRequest(data, element, tested, data_start),
                    FitRequest(self.asimov_data[index], element, tested, asimov_start),
                ],
                self.spec,
            )
        self._remember(tested, index, fixed_data, fixed_asimov)
        assert self.free_data is not None and self.free_asimov is not None
        assert self.asimov_fit is not None
        assert model.poi_index is not None  # hypotests need a POI
        free_data, free_asimov = self.free_data.select(index), self.free_asimov.select(index)
        q = stat.of_fits(tested, fixed_data, free_data, model.poi_index)
        q_asimov = stat.of_fits(tested, fixed_asimov, free_asimov, model.poi_index)
        sqrtq, sqrtq_asimov = _sqrt_above_fit_noise(q), _sqrt_above_fit_noise(q_asimov)
        fits = {
            "free_data": free_data.status,
            "fixed_data": fixed_data.status,
            "asimov": self.asimov_fit.select(index).status,
            "free_asimov": free_asimov.status,
            "fixed_asimov": fixed_asimov.status,
        }
        teststat = stat.asymptotic(sqrtq, sqrtq_asimov)
        return AsymptoticStats(teststat, sqrtq_asimov, fits)

    def pvalues(self, stats: AsymptoticStats) -> tuple[Tensor, Tensor, Tensor]:
        """Observed ``(CLsb, CLb, CLs)`` ``[M]``."""
        return pvalues(stats.teststat, stats.sqrtq_asimov, self.calc_base_dist)

    def expected_pvalues(self, stats: AsymptoticStats) -> tuple[Tensor, Tensor, Tensor]:
        """Expected ``(CLsb, CLb, CLs)``, each ``[M, 5]`` in pyhf's band order."""
        return expected_pvalues(stats.sqrtq_asimov, self.calc_base_dist)
