"""Extra start points for fits of kinked likelihoods: the global minimum, batched.

pyhf's ``code0`` histosys and ``code1`` normsys interpolations have a kink at ``alpha = 0``
(their slope jumps there). A likelihood built with them can have a local minimum on each side
of a kink, and a fit started at the kink (the init, ``alpha = 0``) rolls into whichever side its
first step picks (as in pyhf's ``2bin_2channel_coupledhistosys`` validation case).

So after the first fit of every row, fits whose model has kinked parameters are started again
from ``S`` more points, all in one batched minimiser call, and each row keeps its lowest
minimum:

- per kinked parameter (the ``kink_starts`` nearest to their kink), the first minimum with
  that parameter moved to the other side of the kink (``-alpha``, at least ``kink_step`` away);
- ``spread`` points: the first minimum with every kinked parameter at ``+spread`` and at
  ``-spread``;
- the lowest of those minima, settled on its kinks (a minimum AT a kink has no zero
  gradient, so Newton's criterion never holds there): the kinked parameters near their kink
  (``|alpha| < on_kink``) are pinned to it and the rest refitted; then, a few rounds, those
  whose one-sided slopes show a way down (:func:`one_sided_slopes`) are released on that
  side (and, where the refit did not converge, free ones that came near their kink pinned)
  and the rest refitted again; the point counts as converged when the last refit did and
  every parameter still pinned has both slopes uphill (:func:`kink_is_minimum`).

Every fit, kinked model or not, starts the parameters whose every shift is even (``hi == lo``:
the model's ``symmetric_params``) off 0 (:func:`off_symmetric_points`): their likelihood is
stationary at 0 whatever the data, a saddle where it curves down there, which a fit started
on it (pyhf's init) never leaves and reports as a minimum.

A model without kinked parameters (pyhf's default codes, ``code4p``/``code4``, are smooth) fits
once, although smooth likelihoods can have several minima too (BENCHMARKS.md, "Several
minima of smooth published likelihoods"): one start lands in one of them, as pyhf's does. Each
row reports how many starts it ran and whether every start that converged reached the same
minimum (:class:`FitStatus`).

Example:
    >>> import torch
    >>> x = torch.tensor([[1.0, -0.2, 0.8]], dtype=torch.float64)
    >>> bounds = torch.tensor([[[0.0, 10.0], [-5.0, 5.0], [-5.0, 5.0]]], dtype=torch.float64)
    >>> kinked = torch.tensor([1, 2])
    >>> fixed = torch.zeros(1, 3, dtype=torch.bool)
    >>> starts = extra_starts(x, bounds, fixed, kinked, StartOptions())
    >>> starts.shape  # [B, S, P]: 2 kink flips + 2 spread points
    torch.Size([1, 4, 3])
    >>> starts[0].tolist()
    [[1.0, 0.5, 0.8], [1.0, -0.2, -0.8], [1.0, 1.0, 1.0], [1.0, -1.0, -1.0]]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = [
    "FitStatus",
    "StartOptions",
    "best_of_starts",
    "extra_starts",
    "kink_is_minimum",
    "off_symmetric_points",
    "one_sided_slopes",
    "pin_kinks",
    "release_downhill",
]


@dataclass(frozen=True)
class StartOptions:
    """Which extra start points kinked fits get.

    Attributes:
        kink_starts: per row, at most this many kinked parameters are restarted on the other
            side of their kink (those whose first minimum is nearest to the kink); ``0`` and
            ``spread = 0``: one start, as pyhf.
        kink_step: a restarted parameter lands at least this far on the other side.
        spread: also start with every kinked parameter at ``+spread`` and at ``-spread``
            (``0``: not).
        on_kink: a kinked parameter closer than this to 0 is pinned to its kink to settle;
            one settling per value, all in the same minimiser calls.
        settle_rounds: refits while settling: the pinned one, then each after releasing the
            pinned parameters with a way down (and, in rows whose refit did not converge,
            pinning the free kinked parameters that came near their kink).
        slope_tol: one-sided slopes (of ``-2 log L`` per unit ``alpha``) down to ``-slope_tol``
            still count as uphill.
        agree_twice_nll: two minima whose ``-2 log L`` differ by less are the same minimum.
        symmetric_offset: every fit (kinked model or not) starts the free parameters whose
            every rate shift is even about 0 (``hi == lo``, the model's ``symmetric_params``)
            at least this far from 0 (:func:`off_symmetric_points`).
    """

    kink_starts: int = 8
    kink_step: float = 0.5
    spread: float = 1.0
    on_kink: tuple[float, ...] = (0.02, 0.005)
    settle_rounds: int = 4
    slope_tol: float = 1e-6
    agree_twice_nll: float = 1e-6
    symmetric_offset: float = 0.1


class FitStatus(NamedTuple):
    """How the fit of each of ``B`` rows went.

    Attributes:
        converged: ``[B]`` bool, the kept minimum met the minimiser's criterion.
        starts: ``[B]`` start points fitted (1 for a smooth likelihood).
        agreed: ``[B]`` bool, every converged start reached the kept minimum.
    """

    converged: Tensor
    starts: Tensor
    agreed: Tensor

    @classmethod
    def one_start(cls, converged: Tensor) -> FitStatus:
        """The status of rows fitted from one start each (which agrees with itself)."""
        return cls(
            converged, torch.ones_like(converged, dtype=torch.long), torch.ones_like(converged)
        )

    @classmethod
    def combine(cls, statuses: list[FitStatus]) -> FitStatus:
        """The status of rows that ran several fits: all converged, the most starts any of
        them ran, all agreed."""
        first = statuses[0]
        converged, starts, agreed = first
        for status in statuses[1:]:
            converged = converged & status.converged
            starts = torch.maximum(starts, status.starts)
            agreed = agreed & status.agreed
        return cls(converged, starts, agreed)

    def combine_segments(self, sizes: list[int]) -> FitStatus:
        """One row from each run of consecutive rows of ``sizes`` (host ints), combined.

        >>> import torch
        >>> status = FitStatus(torch.tensor([True, False, True]), torch.tensor([1, 2, 1]),
        ...                    torch.tensor([True, True, True]))
        >>> [t.tolist() for t in status.combine_segments([2, 1])]
        [[False, True], [2, 1], [True, True]]
        """
        segment = self._segments(sizes)
        failed = self._failures(segment, len(sizes))
        disagreed = torch.zeros_like(failed).index_add(0, segment, (~self.agreed).long())
        starts = torch.zeros(len(sizes), dtype=self.starts.dtype, device=segment.device)
        starts = starts.scatter_reduce(0, segment, self.starts, "amax", include_self=False)
        return FitStatus(failed == 0, starts, disagreed == 0)

    def failures_per_segment(self, sizes: list[int]) -> Tensor:
        """``[len(sizes)]``: of each run of consecutive rows of ``sizes``, those that did not
        converge.

        >>> import torch
        >>> status = FitStatus(torch.tensor([False, False, True]), torch.ones(3), torch.ones(3))
        >>> status.failures_per_segment([2, 1]).tolist()
        [2, 0]
        """
        return self._failures(self._segments(sizes), len(sizes))

    def _failures(self, segment: Tensor, runs: int) -> Tensor:
        """Per run (``segment``: each row's), its rows that did not converge."""
        zeros = torch.zeros(runs, dtype=torch.long, device=self.converged.device)
        return zeros.index_add(0, segment, (~self.converged).long())

    def _segments(self, sizes: list[int]) -> Tensor:
        """The run (of ``sizes``) each row belongs to."""
        return torch.repeat_interleave(
            torch.arange(len(sizes), device=self.converged.device),
            torch.tensor(sizes, device=self.converged.device),
        )

    def index_copy(self, rows: Tensor, status: FitStatus) -> FitStatus:
        """These rows with rows ``rows`` replaced by ``status``'s, in order."""
        return FitStatus(
            *(whole.index_copy(0, rows, part) for whole, part in zip(self, status, strict=True))
        )

    def grouped(self, groups: int) -> FitStatus:
        """``groups`` rows from consecutive equal blocks of these rows, each combined."""
        return FitStatus(
            self.converged.view(groups, -1).all(-1),
            self.starts.view(groups, -1).amax(-1),
            self.agreed.view(groups, -1).all(-1),
        )


def off_symmetric_points(x: Tensor, symmetric: Tensor, fixed: Tensor, offset: float) -> Tensor:
    """Start points ``x [B, P]`` with the free ``symmetric [B, P]`` parameters closer than
    ``offset`` to 0 moved to ``offset`` on their side (``+`` at 0).

    A parameter whose every shift is even (``hi == lo``) has a zero derivative at 0 for any
    data: where the likelihood curves down in it there, 0 is a saddle, and a fit started on
    it stays on it (its Newton step in that parameter is 0) and reports the saddle as a
    converged minimum. Started off it, the fit goes down to the minimum on that side (by the
    symmetry, as low as the other side's), or back to 0 where 0 is the minimum.

    >>> import torch
    >>> x = torch.tensor([[0.0, 0.0, -0.02, 0.7]], dtype=torch.float64)
    >>> symmetric = torch.tensor([[True, False, True, True]])
    >>> off_symmetric_points(x, symmetric, torch.zeros_like(symmetric), 0.1).tolist()
    [[0.1, 0.0, -0.1, 0.7]]
    """
    near = symmetric & fixed.logical_not() & (x.abs() < offset)
    return torch.where(near, torch.copysign(torch.full_like(x, offset), x), x)


def extra_starts(
    x: Tensor, bounds: Tensor, fixed: Tensor, kinked: Tensor, options: StartOptions
) -> Tensor:
    """Extra start points ``[B, S, P]`` around the first minima ``x [B, P]`` (within
    ``bounds [B, P, 2]``, ``fixed [B, P]`` parameters left alone) for the kinked parameter
    columns ``kinked [K]``; ``S`` is the same for every row (no data-dependent shapes: it all
    stays on the device)."""
    B, P = x.shape
    alpha = x.index_select(1, kinked)  # [B, K]
    n_flip = min(options.kink_starts, kinked.shape[0])
    starts = []
    if n_flip:
        nearest = alpha.abs().topk(n_flip, dim=1, largest=False).indices  # [B, F]
        columns = kinked.index_select(0, nearest.flatten()).view_as(nearest)  # [B, F]
        near = alpha.gather(1, nearest)
        step = options.kink_step
        flipped = torch.where(
            near.abs() >= step, -near, torch.where(near >= 0, -step, step).to(near.dtype)
        )
        flips = x.unsqueeze(1).repeat(1, n_flip, 1)  # [B, F, P]
        flips.scatter_(2, columns.unsqueeze(-1), flipped.unsqueeze(-1))
        starts.append(flips)
    if options.spread:
        for value in (options.spread, -options.spread):
            starts.append(x.index_fill(1, kinked, value).unsqueeze(1))
    if not starts:
        return x.new_empty((B, 0, P))
    stacked = torch.cat(starts, dim=1)
    lo, hi = bounds.select(-1, 0).unsqueeze(1), bounds.select(-1, 1).unsqueeze(1)
    stacked = torch.minimum(torch.maximum(stacked, lo), hi)
    return torch.where(fixed.unsqueeze(1), x.unsqueeze(1), stacked)


def pin_kinks(x: Tensor, fixed: Tensor, kinked: Tensor, on_kink: Tensor) -> tuple[Tensor, Tensor]:
    """The minima ``x [B, P]`` with the free kinked parameters near their kink (``|alpha| <
    on_kink [B, 1]``) set to exactly 0, and the mask ``[B, P]`` of those pinned."""
    on_kink = x.index_select(1, kinked).abs() < on_kink
    pinned = torch.zeros_like(fixed).index_copy(1, kinked, on_kink).logical_and(fixed.logical_not())
    return torch.where(pinned, torch.zeros_like(x), x), pinned


def one_sided_slopes(objective, x: Tensor, pinned: Tensor) -> tuple[Tensor, Tensor]:
    """The slopes ``[B, P]`` of ``objective`` (a
    :class:`~pyhf_gpu_server.inference.minimize.BatchedObjective`) just right and just left of
    the kink of every ``pinned`` parameter of ``x`` (others: the plain gradient)."""
    rows = torch.arange(x.shape[0], device=x.device)
    nudge = torch.finfo(x.dtype).tiny ** 0.5
    right = objective.derivatives(torch.where(pinned, nudge, x), rows)[1]
    left = objective.derivatives(torch.where(pinned, -nudge, x), rows)[1]
    return right, left


def release_downhill(
    x: Tensor, pinned: Tensor, right: Tensor, left: Tensor, on_kink: Tensor, slope_tol: float
) -> tuple[Tensor, Tensor]:
    """The pinned parameters that are not at a minimum of their kink (a one-sided slope points
    downhill) moved ``2 on_kink [B, 1]`` down that side, and the mask of those still pinned."""
    down_right = pinned & (right < -slope_tol)
    down_left = pinned & (left > slope_tol) & down_right.logical_not()
    step = 2 * on_kink
    moved = torch.where(down_right, step, torch.where(down_left, -step, x))
    return moved, pinned & (down_right | down_left).logical_not()


def kink_is_minimum(right: Tensor, left: Tensor, pinned: Tensor, slope_tol: float) -> Tensor:
    """``[B]`` bool: every ``pinned`` parameter's one-sided slopes (``right``, ``left``, from
    :func:`one_sided_slopes`) point uphill: ``>= 0`` right of its kink, ``<= 0`` left of it."""
    uphill = (right >= -slope_tol) & (left <= slope_tol)
    return (uphill | pinned.logical_not()).all(-1)


def best_of_starts(
    fun: Tensor, converged: Tensor, agree_twice_nll: float
) -> tuple[Tensor, FitStatus]:
    """Per row, the start ``[B]`` to keep among ``fun [B, S]`` (``converged [B, S]``): the
    lowest converged one within ``agree_twice_nll`` of the lowest finite objective, else the
    lowest; and the row's :class:`FitStatus`."""
    finite = torch.where(torch.isfinite(fun), fun, torch.full_like(fun, torch.inf))
    lowest = finite.amin(1, keepdim=True)
    same = (finite - lowest).abs() <= agree_twice_nll
    good = same & converged
    best = torch.where(
        good.any(1), torch.where(good, finite, torch.inf).argmin(1), finite.argmin(1)
    )
    agreed = (same | converged.logical_not()).all(1)
    starts = torch.full_like(best, fun.shape[1])
    return best, FitStatus(converged.gather(1, best.unsqueeze(1)).squeeze(1), starts, agreed)
