"""Extra start points for fits of kinked likelihoods: the global minimum, batched.

pyhf's ``code0`` histosys and ``code1`` normsys interpolations have a kink at ``alpha = 0``
(their slope jumps there). A likelihood built with them can have a local minimum on each side
of a kink, and a fit started at the kink (the init, ``alpha = 0``) rolls into whichever side its
first step picks: pyhf's ``2bin_2channel_coupledhistosys`` validation case has minima of
``-2 log L`` 30.285 at ``alpha = -0.19`` and 29.287 at ``alpha = 0.31``.

So after the first fit of every row, fits whose model has kinked parameters are started again
from ``S`` more points, all in one batched minimiser call, and each row keeps its lowest
minimum:

- per kinked parameter (the ``kink_starts`` nearest to their kink), the first minimum with
  that parameter moved to the other side of the kink (``-alpha``, at least ``kink_step`` away);
- ``spread`` points: the first minimum with every kinked parameter at ``+spread`` and at
  ``-spread``;
- the first minimum with the kinked parameters that sit on their kink (``|alpha| <
  on_kink``) pinned there: a minimum AT a kink (the objective rises on both sides) has no
  zero gradient, so Newton's criterion never holds there; with ``alpha`` pinned the other
  parameters converge, and the point counts as converged when the one-sided slopes of every
  pinned ``alpha`` both point uphill (:func:`kink_is_minimum`).

A model without kinked parameters (pyhf's default codes, ``code4p``/``code4``, are smooth) fits
once. Each row reports how many starts it ran and whether every start that converged reached
the same minimum (:class:`FitStatus`).

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
    "pin_kinks",
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
        on_kink: a kinked parameter closer than this to 0 sits on its kink.
        slope_tol: one-sided slopes (of ``-2 log L`` per unit ``alpha``) down to ``-slope_tol``
            still count as uphill.
        agree_twice_nll: two minima whose ``-2 log L`` differ by less are the same minimum.
    """

    kink_starts: int = 8
    kink_step: float = 0.5
    spread: float = 1.0
    on_kink: float = 1e-6
    slope_tol: float = 1e-6
    agree_twice_nll: float = 1e-6


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

    def grouped(self, groups: int) -> FitStatus:
        """``groups`` rows from consecutive equal blocks of these rows, each combined."""
        return FitStatus(
            self.converged.view(groups, -1).all(-1),
            self.starts.view(groups, -1).amax(-1),
            self.agreed.view(groups, -1).all(-1),
        )


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


def pin_kinks(
    x: Tensor, fixed: Tensor, kinked: Tensor, options: StartOptions
) -> tuple[Tensor, Tensor, Tensor]:
    """The first minima ``x [B, P]`` with the free kinked parameters that sit on their kink set
    to exactly 0, the fixed mask with them fixed, and the mask ``[B, P]`` of those pinned."""
    on_kink = x.index_select(1, kinked).abs() < options.on_kink
    pinned = torch.zeros_like(fixed).index_copy(1, kinked, on_kink).logical_and(fixed.logical_not())
    return torch.where(pinned, torch.zeros_like(x), x), fixed | pinned, pinned


def kink_is_minimum(objective, x: Tensor, pinned: Tensor, slope_tol: float) -> Tensor:
    """``[B]`` bool: at ``x``, every ``pinned`` parameter's one-sided slopes of ``objective``
    (a :class:`~pyhf_gpu_server.inference.minimize.BatchedObjective`) point uphill: the slope
    just right of the kink is ``>= 0`` and the slope just left of it ``<= 0``."""
    rows = torch.arange(x.shape[0], device=x.device)
    nudge = torch.finfo(x.dtype).tiny ** 0.5
    right = objective.derivatives(torch.where(pinned, nudge, x), rows)[1]
    left = objective.derivatives(torch.where(pinned, -nudge, x), rows)[1]
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
