"""The toy-based calculator of pyhf (``infer.calculators.ToyCalculator``), batched.

For each row (dataset, tested POI ``mu``), as pyhf:

1. conditional fits to the data at ``mu`` (signal hypothesis) and at 0 (background; 1 for
   ``q0``) give the parameters the toys are drawn from;
2. ``ntoys`` pseudo-datasets per hypothesis: Poisson main data at the expected rates, and
   auxiliary data drawn from each constraint (Normal around the parameter with its sigma,
   or Poisson with rate ``tau * gamma``). They are drawn in blocks of :data:`TOY_BLOCK`
   toys, block ``b`` of a row from its own ``torch.Generator`` on the device, seeded from
   ``(seed, the row's key, b)`` (:func:`toy_seed`): a row's toys do not depend on the rows
   it runs with, nor on how its toys are cut into slices (:class:`ToySlice`). So the service
   runs a row of many toys as slices, one engine call each, and joins their statistics
   (:func:`join_toy_stats`): a toy job gives the device back between slices, and gives the
   same numbers as the same request answered at once;
3. the test statistic of every toy: an unconditional fit, then a conditional fit where the
   statistic is not clipped to 0 by the best-fit POI, started at the unconditional minimum
   (pyhf runs both fits for every toy, from its init: the statistics are the same, found
   with fewer iterations).

The toy fits of all rows (slices) run as two batched minimisations (split into ``max_rows``
chunks). p-values are the fractions of toys at or above the observed statistic; the expected
band takes the background toys' own CLs values at pyhf's percentiles (linear interpolation).

Example:
    >>> import torch
    >>> sig = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    >>> bkg = torch.tensor([[0.0, 0.0, 0.5, 4.0]])
    >>> clsb, clb, cls = empirical_pvalues(torch.tensor([2.0]), sig, bkg)
    >>> clsb.tolist(), clb.tolist(), cls.tolist()
    ([0.5], [0.25], [2.0])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .mle import FitOptions, FitRequest, FitSpec, fit_requests
from .starts import FitStatus
from .test_statistics import TestStatistic

if TYPE_CHECKING:
    from ..engine.model import HistFactoryModel

__all__ = [
    "PERCENTILES",
    "TOY_BLOCK",
    "ToyCalculator",
    "ToySlice",
    "empirical_pvalues",
    "join_toy_stats",
    "sample_toys",
    "toy_seed",
]

# pyhf's percentiles of the -2..+2 sigma bands
PERCENTILES = (2.27501319, 15.86552539, 50.0, 84.13447461, 97.72498681)
# Toys drawn from one generator: the unit of a row's toy stream
TOY_BLOCK = 50
_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """One step of SplitMix64 (Steele, Lea and Flood 2014): a bijective 64-bit mix."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def toy_seed(seed: int, key: int, block: int) -> int:
    """The generator seed of toy block ``block`` of the row with key ``key`` (all 64-bit).

    >>> toy_seed(7, 0, 0) == toy_seed(7, 0, 0), toy_seed(7, 0, 0) == toy_seed(7, 0, 1)
    (True, False)
    >>> 0 <= toy_seed(2**64 - 1, 2**63, 3) < 2**64
    True
    """
    mixed = _splitmix64((seed & _MASK64) ^ _splitmix64(key & _MASK64))
    return _splitmix64(mixed ^ _splitmix64(block & _MASK64 ^ 0x5851F42D4C957F2D))


@dataclass(frozen=True)
class ToySlice:
    """Toys ``first .. stop - 1`` of the ``total`` toys (of each hypothesis) of the row whose
    toy stream is ``key`` (``total`` 0: ``stop``). The stream is drawn in blocks of
    :data:`TOY_BLOCK`, each whole from its own generator: a slice within a block draws the
    block and keeps its share, so its toys are the same however the row is cut.

    >>> [(s.first, s.stop) for s in ToySlice.cut(0, 120)]
    [(0, 50), (50, 100), (100, 120)]
    >>> ToySlice(0, 45, 60, total=70).blocks()  # (block, toys it draws, kept from .. to)
    [(0, 50, 45, 50), (1, 20, 0, 10)]
    """

    key: int
    first: int
    stop: int
    total: int = 0

    def __post_init__(self) -> None:
        if not self.total:
            object.__setattr__(self, "total", self.stop)
        if not 0 <= self.first < self.stop <= self.total:
            raise ValueError(
                f"a toy slice holds toys of its row: {self.first}..{self.stop} of {self.total}"
            )

    @property
    def ntoys(self) -> int:
        return self.stop - self.first

    def blocks(self) -> list[tuple[int, int, int, int]]:
        """``(block, drawn, lo, hi)`` of the blocks it draws from: the block's toys (all of
        the row's in it) and the range it keeps."""
        first_block, last_block = self.first // TOY_BLOCK, (self.stop - 1) // TOY_BLOCK
        return [
            (
                block,
                min(TOY_BLOCK, self.total - block * TOY_BLOCK),
                max(self.first - block * TOY_BLOCK, 0),
                min(self.stop - block * TOY_BLOCK, TOY_BLOCK),
            )
            for block in range(first_block, last_block + 1)
        ]

    @classmethod
    def cut(cls, key: int, ntoys: int, size: int = TOY_BLOCK) -> list[ToySlice]:
        """The ``ntoys`` toys of row ``key`` as slices of ``size`` toys (the last one
        shorter)."""
        return [cls(key, first, min(first + size, ntoys), ntoys) for first in range(0, ntoys, size)]


def sample_toys(
    model, pars: Tensor, element: Tensor, ntoys: int, generator: torch.Generator
) -> Tensor:
    """``[R, ntoys, N + A]`` pseudo-data drawn at parameters ``pars [R, P]`` as pyhf's
    ``model.make_pdf(pars).sample((ntoys,))``: Poisson main bins, Normal or Poisson aux data."""
    return draw_toys(model, model.expected_data(pars, element), element, ntoys, generator)


def draw_toys(
    model, expected: Tensor, element: Tensor, ntoys: int, generator: torch.Generator
) -> Tensor:
    """``[R, ntoys, N + A]`` pseudo-data around the expected data ``[R, N + A]`` of rows of
    ``element [R]`` (:func:`sample_toys`, the expected data given)."""
    rates = expected.unsqueeze(1).expand(-1, ntoys, -1)
    n_main = model.n_main
    main = torch.poisson(rates[..., :n_main].clamp(min=0).contiguous(), generator=generator)
    aux_mean = rates[..., n_main:]
    is_poisson = model.constraint.is_poisson
    noise = torch.randn(
        aux_mean.shape, generator=generator, dtype=expected.dtype, device=expected.device
    )
    normal = aux_mean + model.constraint.sigma[element].unsqueeze(1) * noise
    poisson_rate = torch.where(is_poisson, aux_mean, torch.zeros_like(aux_mean)).clamp(min=0)
    poisson = torch.poisson(poisson_rate.contiguous(), generator=generator)
    aux = torch.where(is_poisson, poisson, normal)
    return torch.cat([main, aux], dim=-1)


def _fraction_at_or_above(samples_sorted: Tensor, values: Tensor) -> Tensor:
    """Per row: the fraction of ``samples_sorted [R, T]`` (ascending) ``>= values [R, K]``."""
    below = torch.searchsorted(samples_sorted, values.contiguous(), side="left")
    return 1.0 - below.to(values.dtype) / samples_sorted.shape[-1]


def empirical_pvalues(
    teststat: Tensor, signal: Tensor, background: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """``(CLsb, CLb, CLs)`` of ``teststat [R]`` against toy statistics ``[R, T]`` (pyhf's
    ``EmpiricalDistribution.pvalue``: fraction of toys ``>=`` the value)."""
    sig_sorted, _ = signal.sort(-1)
    bkg_sorted, _ = background.sort(-1)
    clsb = _fraction_at_or_above(sig_sorted, teststat.unsqueeze(-1)).squeeze(-1)
    clb = _fraction_at_or_above(bkg_sorted, teststat.unsqueeze(-1)).squeeze(-1)
    return clsb, clb, clsb / clb


def expected_empirical_pvalues(signal: Tensor, background: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """pyhf's ``ToyCalculator.expected_pvalues``: ``(CLsb, CLb, CLs)`` at every background toy,
    then each one's percentiles ``[R, 5]``."""
    sig_sorted, _ = signal.sort(-1)
    bkg_sorted, _ = background.sort(-1)
    clsb = _fraction_at_or_above(sig_sorted, background)
    clb = _fraction_at_or_above(bkg_sorted, background)
    q = torch.tensor(PERCENTILES, dtype=signal.dtype, device=signal.device) / 100
    clsb_q, clb_q, cls_q = (
        torch.quantile(v, q, dim=-1).T.contiguous() for v in (clsb, clb, clsb / clb)
    )
    return clsb_q, clb_q, cls_q


@dataclass
class ToyStats:
    """One :meth:`ToyCalculator.teststatistic` call of ``M`` rows: observed statistic
    ``[M]``, each row's toy statistics per hypothesis (``signal[r]``, ``background[r]``:
    ``[T_r]``, its slice's toys), how the fits went, and ``unconverged [M]``: per row, its toys
    (of both hypotheses) whose fits did not all converge."""

    teststat: Tensor
    signal: list[Tensor]
    background: list[Tensor]
    fits: dict[str, FitStatus]
    unconverged: Tensor

    def row(self, i: int) -> ToyStats:
        """Row ``i`` alone, on the host (what the service keeps of a slice until the
        row's other slices are in)."""
        return ToyStats(
            self.teststat[i : i + 1].cpu(),
            [self.signal[i].cpu()],
            [self.background[i].cpu()],
            {name: FitStatus(*(t[i : i + 1].cpu() for t in s)) for name, s in self.fits.items()},
            self.unconverged[i : i + 1].cpu(),
        )

    def by_size(self) -> list[tuple[Tensor, Tensor, Tensor]]:
        """``(rows, signal [R, T], background [R, T])`` for each toy count ``T`` the rows
        hold (one group when every row holds its whole toys)."""
        groups: dict[int, list[int]] = {}
        for r, toys in enumerate(self.signal):
            groups.setdefault(toys.shape[0], []).append(r)
        return [
            (
                torch.tensor(rows, device=self.teststat.device),
                torch.stack([self.signal[r] for r in rows]),
                torch.stack([self.background[r] for r in rows]),
            )
            for rows in groups.values()
        ]


def join_toy_stats(parts: list[ToyStats]) -> ToyStats:
    """The statistics of one row from those of its slices (each a one-row :class:`ToyStats`,
    in the order of their toys): the observed statistic of the first, the toys joined, the
    fits of all combined.

    >>> def one(v):
    ...     toys, failed = torch.tensor(v), torch.tensor([len(v) - 1])
    ...     return ToyStats(torch.tensor([1.0]), [toys], [toys], {}, failed)
    >>> joined = join_toy_stats([one([0.5, 2.0]), one([3.0])])
    >>> joined.signal[0].tolist(), joined.teststat.tolist(), joined.unconverged.tolist()
    ([0.5, 2.0, 3.0], [1.0], [1])
    """
    first = parts[0]
    fits = {name: FitStatus.combine([part.fits[name] for part in parts]) for name in first.fits}
    return ToyStats(
        first.teststat,
        [torch.cat([part.signal[0] for part in parts])],
        [torch.cat([part.background[0] for part in parts])],
        fits,
        torch.stack([part.unconverged for part in parts]).sum(0),
    )


@dataclass(eq=False)
class ToyCalculator:
    """Toy-based CLs for many (dataset, mu) rows of one model, reproducible from ``seed``.

    Args:
        model: a :class:`~pyhf_gpu_server.engine.HistFactoryModel`.
        data, element: ``[D, N + A]`` distinct datasets and their elements ``[D]``.
        stat: the test statistic (:func:`~.test_statistics.get_test_stat`).
        spec: how the fits run (:class:`~.mle.FitSpec`).
        ntoys: toys per hypothesis (signal and background each).
        seed: seeds every row's toy stream (:func:`toy_seed`).
    """

    model: HistFactoryModel
    data: Tensor
    element: Tensor
    stat: TestStatistic
    spec: FitSpec
    ntoys: int
    seed: int

    @property
    def options(self) -> FitOptions:
        return self.spec.options

    def teststatistic(
        self, mu: Tensor, index: Tensor, slices: list[ToySlice] | None = None
    ) -> ToyStats:
        """Observed and toy test statistics for POI values ``mu [M]`` on datasets
        ``index [M]``; row ``r`` draws the toys ``slices[r]`` (default: all ``ntoys`` toys
        of the stream keyed by its position ``r``). Rows of one key are slices of one
        hypothesis (the same ``mu`` and dataset): its observed fits run once."""
        model, stat = self.model, self.stat
        if slices is None:
            slices = [ToySlice(r, 0, self.ntoys) for r in range(mu.shape[0])]
        first_of: dict[int, int] = {}
        for r, toy_slice in enumerate(slices):
            first_of.setdefault(toy_slice.key, r)
        hypotheses = list(first_of.values())
        position = {key: i for i, key in enumerate(first_of)}
        of_row = [position[s.key] for s in slices]
        if len(hypotheses) < len(slices):
            mu, index = mu[hypotheses], index[hypotheses]
        tested = stat.tested(mu)
        bkg_mu = torch.full_like(mu, stat.asimov_mu)
        data, element = self.data[index], self.element[index]
        free_poi = torch.full_like(mu, torch.nan)
        signal_fit, bkg_fit, fixed_obs, free_obs = fit_requests(
            model,
            [
                FitRequest(data, element, mu),
                FitRequest(data, element, bkg_mu),
                FitRequest(data, element, tested),
                FitRequest(data, element, free_poi),
            ],
            self.spec,
        )
        assert model.poi_index is not None  # hypotests need a POI
        observed = stat.of_fits(tested, fixed_obs, free_obs, model.poi_index)
        observed_fits = {
            "signal_fit": signal_fit.status,
            "background_fit": bkg_fit.status,
            "fixed_data": fixed_obs.status,
            "free_data": free_obs.status,
        }
        if len(hypotheses) < len(slices):  # back to one entry per row
            rows = torch.tensor(of_row, device=mu.device)
            tested, element, observed = tested[rows], element[rows], observed[rows]
            observed_fits = {
                name: FitStatus(*(t[rows] for t in status))
                for name, status in observed_fits.items()
            }
            signal_pars, bkg_pars = signal_fit.bestfit[rows], bkg_fit.bestfit[rows]
        else:
            signal_pars, bkg_pars = signal_fit.bestfit, bkg_fit.bestfit

        toys = self._draw(signal_pars, bkg_pars, element, slices)
        # rows (row, hypothesis) of the toys: [signal of row 0, background of row 0, ...]
        sizes = [toy_slice.ntoys for toy_slice in slices for _ in range(2)]
        per_row = [2 * toy_slice.ntoys for toy_slice in slices]
        repeats = torch.tensor(per_row, device=mu.device)
        toy_element = element.repeat_interleave(repeats)
        toy_mu = tested.repeat_interleave(repeats)
        stats, toys_status = self._toy_statistics(toys, toy_element, toy_mu)
        fits = {**observed_fits, "toys": FitStatus.combine_segments(toys_status, per_row)}
        unconverged = toys_status.failures_per_segment(per_row)
        pieces = stats.split(sizes)
        return ToyStats(observed, list(pieces[0::2]), list(pieces[1::2]), fits, unconverged)

    def _draw(
        self, signal_pars: Tensor, bkg_pars: Tensor, element: Tensor, slices: list[ToySlice]
    ) -> Tensor:
        """The toys of every row's slice, ``[sum 2 T_r, N + A]``: per row its signal toys
        then its background toys; block ``b`` of both from one generator seeded
        ``toy_seed(seed, key, b)``."""
        model = self.model
        expected = model.expected_data(torch.cat([signal_pars, bkg_pars]), element.repeat(2))
        rows = signal_pars.shape[0]
        drawn = []
        for r, toy_slice in enumerate(slices):
            signal: list[Tensor] = []
            background: list[Tensor] = []
            for block, count, lo, hi in toy_slice.blocks():
                generator = torch.Generator(device=model.device)
                generator.manual_seed(toy_seed(self.seed, toy_slice.key, block))
                for target, at in ((signal, r), (background, rows + r)):
                    target.append(
                        draw_toys(
                            model, expected[at : at + 1], element[r : r + 1], count, generator
                        )[0, lo:hi]
                    )
            drawn.extend([*signal, *background])
        return torch.cat(drawn)

    def _toy_statistics(
        self, toys: Tensor, element: Tensor, tested: Tensor
    ) -> tuple[Tensor, FitStatus]:
        """Test statistics ``[M]`` of the toys and how their fits went.

        The unconditional fits run first; the conditional fits only where the statistic is
        not clipped to 0 by the best-fit POI (``muhat > mu`` for ``q``/``q~``, ``muhat < 0``
        for ``q0``: about half the signal toys), each starting at its unconditional minimum.
        """
        model = self.model
        free = fit_requests(
            model,
            [FitRequest(toys, element, torch.full_like(tested, torch.nan))],
            self.spec,
        )[0]
        muhat = free.bestfit[:, model.poi_index]
        needed = ~self.stat.clipped(tested, muhat)
        fixed_deviance, fixed_status = free.deviance, free.status
        rows = needed.nonzero().squeeze(-1)
        if rows.numel():
            fixed = fit_requests(
                model,
                [FitRequest(toys[rows], element[rows], tested[rows], free.bestfit[rows])],
                self.spec,
            )[0]
            fixed_deviance = fixed_deviance.index_copy(0, rows, fixed.deviance)
            fixed_status = free.status.index_copy(rows, fixed.status)
        stats = self.stat.from_deviances(tested, muhat, fixed_deviance, free.deviance)
        return stats, FitStatus.combine([free.status, fixed_status])

    def pvalues(self, stats: ToyStats) -> tuple[Tensor, Tensor, Tensor]:
        """Observed ``(CLsb, CLb, CLs)`` ``[M]``, each row against its own toys."""
        return toy_pvalues(stats)

    def expected_pvalues(self, stats: ToyStats) -> tuple[Tensor, Tensor, Tensor]:
        """Expected ``(CLsb, CLb, CLs)``, each ``[M, 5]`` (ascending percentiles, pyhf's order)."""
        return expected_toy_pvalues(stats)


def toy_pvalues(stats: ToyStats) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`empirical_pvalues` of every row of ``stats`` against its own toys."""
    out = [torch.empty_like(stats.teststat) for _ in range(3)]
    for rows, signal, background in stats.by_size():
        for target, value in zip(
            out, empirical_pvalues(stats.teststat[rows], signal, background), strict=True
        ):
            target[rows] = value
    return out[0], out[1], out[2]


def expected_toy_pvalues(stats: ToyStats) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`expected_empirical_pvalues` of every row of ``stats``, ``[M, 5]`` each."""
    shape = (stats.teststat.shape[0], len(PERCENTILES))
    out = [stats.teststat.new_empty(shape) for _ in range(3)]
    for rows, signal, background in stats.by_size():
        for target, value in zip(out, expected_empirical_pvalues(signal, background), strict=True):
            target[rows] = value
    return out[0], out[1], out[2]
