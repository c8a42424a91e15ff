"""Result containers of the inference API, batched over rows: tensors on the model's device,
never JSON (each service operation makes its answer model from them).

Example:
    >>> import torch
    >>> r = HypotestResults(
    ...     poi=torch.tensor([1.0]), element=torch.tensor([0]), test_stat="qtilde",
    ...     cls_obs=torch.tensor([0.25]), cls_exp=torch.tensor([[0.125, 0.25, 0.375, 0.5, 0.625]]),
    ...     clsb_obs=torch.tensor([0.1]), clb_obs=torch.tensor([0.4]),
    ...     clsb_exp=torch.zeros(1, 5), clb_exp=torch.ones(1, 5),
    ...     teststat=torch.tensor([1.0]),
    ...     fits={"free_data": FitStatus(torch.tensor([True]), torch.tensor([3]), torch.tensor([False]))})
    >>> r.observed().tolist(), r.expected().tolist()
    ([0.25], [[0.125, 0.25, 0.375, 0.5, 0.625]])
    >>> r.converged.tolist(), r.non_converged(), r.starts.tolist(), r.starts_agreed.tolist()
    ([True], [], [3], [False])
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import Tensor

from .starts import FitStatus
from .test_statistics import get_test_stat

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

    from .toys import ToyStats

__all__ = [
    "FitResults",
    "FittedRows",
    "HypotestResults",
    "SignificanceResults",
    "UpperLimitResults",
    "map_tensors",
]

R = TypeVar("R", bound="DataclassInstance")


def map_tensors(result: R, change: Callable[[Tensor], Tensor]) -> R:
    """``result`` (a dataclass) with ``change`` applied to each of its tensor fields."""
    values = {f.name: getattr(result, f.name) for f in fields(result)}
    return replace(result, **{k: change(v) for k, v in values.items() if isinstance(v, Tensor)})


class FittedRows:
    """What every batched fit result answers from its ``bestfit [B, ...]`` and its per-row
    ``converged``, ``starts`` and ``starts_agreed``: its rows and their :class:`FitStatus`."""

    # what the subclasses (dataclasses) hold
    bestfit: Tensor
    converged: Tensor
    starts: Tensor
    starts_agreed: Tensor

    def __len__(self) -> int:
        return self.bestfit.shape[0]

    @property
    def status(self) -> FitStatus:
        """Convergence, start points and their agreement per row."""
        return FitStatus(self.converged, self.starts, self.starts_agreed)


@dataclass
class FitResults(FittedRows):
    """Maximum-likelihood fits of ``B`` rows (cabinetry's FitResults, batched).

    Attributes:
        bestfit: ``[B, P]`` best-fit parameters.
        uncertainty: ``[B, P]`` ``sqrt(diag(inv(Hessian of the NLL)))`` (0 for fixed
            parameters; NaN where the Hessian is not invertible, or not computed).
        corr_mat: ``[B, P, P]`` correlation matrix (0 rows/columns for fixed parameters).
        best_twice_nll: ``[B]`` ``-2 log L`` at the minimum.
        deviance: ``[B]`` ``best_twice_nll`` less its data-only constant (the engine's
            ``deviance``): test statistics subtract these, which in float32 keeps the digits
            that subtracting two ``-2 log L`` of order 100 would lose.
        converged: ``[B]`` bool; a failed fit is never reported as converged.
        iterations: ``[B]`` minimiser iterations.
        labels: parameter names (pyhf's ``par_names``).
        element: ``[B]`` element index of each row.
        starts: ``[B]`` start points fitted (more than 1 where the model has kinked
            parameters, see :mod:`~pyhf_gpu_server.inference.starts`).
        starts_agreed: ``[B]`` bool, every converged start reached the kept minimum.
    """

    bestfit: Tensor
    uncertainty: Tensor
    corr_mat: Tensor
    best_twice_nll: Tensor
    deviance: Tensor
    converged: Tensor
    iterations: Tensor
    labels: list[str]
    element: Tensor
    starts: Tensor
    starts_agreed: Tensor

    def select(self, index: Tensor | slice) -> FitResults:
        """The rows ``index`` (a slice of step 1 or an index tensor) as a new FitResults."""

        def rows(t: Tensor) -> Tensor:
            if isinstance(index, slice):  # narrow: FakeTensorMode's cuda has no basic indexing
                start, stop, _ = index.indices(t.shape[0])
                return t.narrow(0, start, stop - start)
            return t[index]

        return map_tensors(self, rows)

    def lower_of(self, other: FitResults, agree_twice_nll: float = 1e-6) -> FitResults:
        """Per row, the fit of ``self`` or ``other`` (the same rows fitted from other starts)
        whose ``-2 log L`` is lower, a converged one before one that is not: the starts of
        both counted, and agreed where both agreed and both converged ones reached minima
        within ``agree_twice_nll``."""
        ours, theirs = self.best_twice_nll, other.best_twice_nll
        # > and logical_not, not ~: FakeTensorMode's simulated cuda has no kernel for bitwise_not
        take = (other.converged > self.converged) | (
            (other.converged == self.converged) & (theirs < ours)
        )
        both = self.converged & other.converged
        close = (ours - theirs).abs() <= agree_twice_nll
        agreed = self.starts_agreed & other.starts_agreed & (torch.logical_not(both) | close)

        def pick(a: Tensor, b: Tensor) -> Tensor:
            return torch.where(take.reshape(-1, *[1] * (a.dim() - 1)), b, a)

        names = ("bestfit", "uncertainty", "corr_mat", "best_twice_nll", "deviance", "converged")
        picked: dict[str, Any] = {k: pick(getattr(self, k), getattr(other, k)) for k in names}
        return replace(
            self,
            **picked,
            iterations=self.iterations + other.iterations,
            starts=self.starts + other.starts,
            starts_agreed=agreed,
        )

    def restrict(self, columns: list[int]) -> FitResults:
        """The same fits over the parameters ``columns`` only, in that order (a stacked
        element's own parameters: the others are held fixed in its rows)."""
        index = torch.tensor(columns, dtype=torch.long, device=self.bestfit.device)
        return replace(
            self,
            bestfit=self.bestfit.index_select(1, index),
            uncertainty=self.uncertainty.index_select(1, index),
            corr_mat=self.corr_mat.index_select(1, index).index_select(2, index),
            labels=[self.labels[c] for c in columns],
        )


@dataclass
class HypotestResults:
    """CLs hypothesis tests of ``B`` rows (row: one element and one tested POI value).

    ``*_exp`` tensors are ``[B, 5]`` in pyhf's order (expected -2, -1, 0, +1, +2 sigma
    bands of CLs, i.e. ascending). ``fits`` maps each fit of the test (e.g.
    ``"free_data"``, ``"fixed_asimov"``) to its per-row
    :class:`~pyhf_gpu_server.inference.starts.FitStatus`; ``status`` combines them.
    ``teststat`` is pyhf's observed test statistic; ``sqrtq_asimov`` (asymptotic tests only)
    ``sqrt(q_A)``, that of the Asimov data (pyhf's second ``return_test_statistics`` value).
    """

    poi: Tensor
    element: Tensor
    test_stat: str
    cls_obs: Tensor
    cls_exp: Tensor
    clsb_obs: Tensor
    clb_obs: Tensor
    clsb_exp: Tensor
    clb_exp: Tensor
    teststat: Tensor
    sqrtq_asimov: Tensor | None = None
    fits: dict[str, FitStatus] = field(default_factory=dict)
    toys: ToyStats | None = None  # toy-based: the statistics, to join a row's slices

    def __len__(self) -> int:
        return self.cls_obs.shape[0]

    def row(self, i: int) -> HypotestResults:
        """Row ``i`` alone, on the host (picklable; what a slice of a toy row leaves until
        its other slices are in)."""

        def one(t: Tensor) -> Tensor:
            return t[i : i + 1].cpu()

        return replace(
            map_tensors(self, one),
            fits={name: FitStatus(*(one(t) for t in s)) for name, s in self.fits.items()},
            toys=None if self.toys is None else self.toys.row(i),
        )

    @property
    def status(self) -> FitStatus:
        """Every fit behind each row, combined (:meth:`FitStatus.combine`)."""
        if not self.fits:
            return FitStatus.one_start(torch.ones_like(self.cls_obs, dtype=torch.bool))
        return FitStatus.combine(list(self.fits.values()))

    @property
    def converged(self) -> Tensor:
        """``[B]`` bool: every fit behind the row converged."""
        return self.status.converged

    @property
    def starts(self) -> Tensor:
        """``[B]`` the most start points any fit behind the row ran."""
        return self.status.starts

    @property
    def starts_agreed(self) -> Tensor:
        """``[B]`` bool: in every fit behind the row, all converged starts agreed."""
        return self.status.agreed

    def non_converged(self) -> list[tuple[int, list[str]]]:
        """``[(row, [names of its failed fits])]`` for every row with a failed fit."""
        names = list(self.fits)
        if not names:
            return []
        table = torch.stack([self.fits[n].converged for n in names], 1).cpu()
        return [
            (row, [n for n, ok in zip(names, flags, strict=True) if not ok])
            for row, flags in enumerate(table.tolist())
            if not all(flags)
        ]

    def observed(self) -> Tensor:
        """pyhf's first return value: CLs, or CLsb (= p0) for ``q0``."""
        return self.clsb_obs if get_test_stat(self.test_stat).discovery else self.cls_obs

    def expected(self) -> Tensor:
        """pyhf's expected set ``[B, 5]``: CLs bands, or CLsb bands for ``q0``."""
        return self.clsb_exp if get_test_stat(self.test_stat).discovery else self.cls_exp


@dataclass
class UpperLimitResults:
    """Upper limits of ``B`` elements at confidence level ``1 - level``.

    Attributes:
        obs: ``[B]`` observed limit on the POI (``inf`` where a root search found CLs above
            ``level`` at every value it tested: a POI without effect).
        exp: ``[B, 5]`` expected limits (pyhf's order: -2, -1, 0, +1, +2 sigma).
        level: the CLs level (0.05 for 95% CL).
        element: ``[B]`` element index of each row.
        converged: ``[B]`` bool: every fit of the row converged.
        hypotests: the number of tested POI values per row.
        starts: ``[B]`` the most start points any fit of the row ran.
        starts_agreed: ``[B]`` bool, in every fit of the row all converged starts agreed.
        bounds: ``[B, 2]`` the POI's bounds the root search started from (None: a scan).
        beyond_bounds: ``[B, 6]`` bool per curve (observed, then the five expected): its
            CLs at the POI's upper bound is above ``level``, the limit lies past the bound
            (where pyhf's ``upper_limit`` raises ValueError) (None: a scan).
        outside_scan: ``[B, 6]`` int8 per curve: 1 where its CLs at the scan's last value
            is above ``level``, -1 where at its first it is below: the limit is the scan's
            end, not bracketed by it; 0 elsewhere (None: a root search).
    """

    obs: Tensor
    exp: Tensor
    level: float
    element: Tensor
    converged: Tensor
    hypotests: Tensor
    starts: Tensor
    starts_agreed: Tensor
    bounds: Tensor | None = None
    beyond_bounds: Tensor | None = None
    outside_scan: Tensor | None = None


@dataclass
class SignificanceResults:
    """Discovery significance (``q0``) of ``B`` elements.

    ``p0_exp``/``z_exp`` are the median expected (Asimov at ``mu = 1``);
    ``p0_exp_set`` is the ``[B, 5]`` band in pyhf's order. ``converged``, ``starts``,
    ``starts_agreed``: as :class:`HypotestResults`'.
    """

    p0_obs: Tensor
    p0_exp: Tensor
    z_obs: Tensor
    z_exp: Tensor
    p0_exp_set: Tensor
    element: Tensor
    converged: Tensor
    starts: Tensor
    starts_agreed: Tensor
