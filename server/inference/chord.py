"""Conditional fits started next to an unconditional minimum, refined by chord Newton steps.

A ranking refits its POI with one parameter pinned a standard deviation or so away from the
best fit, hundreds of times per row. Near that best fit ``theta_hat`` the exact Hessian ``H``
of ``-2 log L``, already computed there for the uncertainties, describes every one of these
conditional fits: with the columns ``C`` pinned, the Newton step of the other parameters is
``p = -(H^-1 - H^-1_{:C} (H^-1_{CC})^-1 H^-1_{C:}) g`` (the inverse of ``H`` with the rows and
columns ``C`` removed, by the Schur complement; it has no ``C`` component). A chord method
takes these steps with ``H`` held fixed: per iteration one gradient and one product with the
row's ``H^-1``, shared by all of the row's fits, instead of the minimiser's ``P x P`` (or
low-rank) solves with a Gauss-Newton curvature that has to learn its second-order term.

Chord steps alone converge linearly, at the rate at which ``H`` changes between
``theta_hat`` and the conditional minimum; the BFGS updates of the steps taken so far, applied
around the chord's inverse (L-BFGS's two-loop recursion), make that superlinear.
:func:`chord_conditional_fits` starts each fit at the minimum of the quadratic approximation
at ``theta_hat``, takes steps while they lower the objective, and stops each fit once its
Newton decrement ``-g.p`` is below ``tol`` (converged) or its step does not lower the
objective (a bound in the way, curvature that changed too much). Parameters that the
unconditional minimum holds on a bound (a POI at 0) stay there: ``H^-1`` is restricted to the
others the same way, and the fit has converged only if their gradient still points out of
the box. The caller gives the fits that did not converge (few, on published rankings) to
the minimiser, from the points reached.

Example:
    >>> import torch
    >>> class Quartic:  # f(x) = x0^2 + x1^2 + x0 x1 + 0.1 x1^4 per row
    ...     def gradient(self, x, rows):
    ...         f = (x**2).sum(-1) + x[:, 0] * x[:, 1] + 0.1 * x[:, 1] ** 4
    ...         g0 = 2 * x[:, 0] + x[:, 1]
    ...         g1 = 2 * x[:, 1] + x[:, 0] + 0.4 * x[:, 1] ** 3
    ...         return f, torch.stack([g0, g1], -1)
    >>> hessian = torch.tensor([[[2.0, 1.0], [1.0, 2.0]]], dtype=torch.float64)  # at the minimum 0
    >>> best = torch.zeros(1, 2, dtype=torch.float64)
    >>> box = torch.tensor([[-5.0, 5.0], [-5.0, 5.0]], dtype=torch.float64).expand(1, 2, 2)
    >>> held = torch.zeros(1, 2, dtype=torch.bool)
    >>> x, converged = chord_conditional_fits(  # x1 pinned at 0.5
    ...     Quartic(), best, torch.tensor([[0.5]], dtype=torch.float64), torch.inverse(hessian),
    ...     held, [1], torch.tensor([[1]]), box, tol=1e-14)
    >>> round(x[0, 0].item(), 6), x[0, 1].item(), converged.tolist()  # x0 = -x1 / 2
    (-0.25, 0.5, [True])
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .minimize import decrement_tolerance

__all__ = ["chord_conditional_fits", "held_at_bounds", "restricted_inverse"]


def held_at_bounds(x: Tensor, bounds: Tensor, fixed: Tensor, tol: float) -> Tensor:
    """``[B, P]`` bool: the free parameters of minima ``x [B, P]`` that sit on a bound
    (within ``tol``; at a converged minimum, their gradient points out of the box)."""
    lo, hi = bounds.select(-1, 0), bounds.select(-1, 1)
    return ((x <= lo + tol) | (x >= hi - tol)) & torch.logical_not(fixed)


def restricted_inverse(inverse: Tensor, held: Tensor) -> Tensor:
    """The inverse ``[B, P, P]`` of each Hessian restricted to the parameters not ``held``
    (zero rows and columns for those), from the whole inverse by the Schur complement:
    ``H^-1 - H^-1_{:A} (H^-1_{AA})^-1 H^-1_{A:}`` for the held set ``A`` (a held parameter
    the inverse already holds, its row and column 0, is left out of ``A``; NaN where
    ``H^-1_{AA}`` is singular)."""
    held = held & (inverse.diagonal(dim1=-2, dim2=-1) != 0)
    m = held.to(inverse.dtype)
    on_held = inverse * m.unsqueeze(1)  # H^-1 M
    schur = on_held * m.unsqueeze(2) + torch.diag_embed(1 - m)  # M H^-1 M + (I - M)
    solved, info = torch.linalg.solve_ex(schur, on_held.mT)
    solved = torch.where((info == 0).view(-1, 1, 1), solved, torch.full_like(solved, torch.nan))
    restricted = inverse - on_held @ solved
    free = torch.logical_not(held)
    keep = free.unsqueeze(2) & free.unsqueeze(1)
    return torch.where(keep, restricted, torch.zeros_like(restricted))


def chord_conditional_fits(
    objective,
    best: Tensor,
    values: Tensor,
    inverse: Tensor,
    held: Tensor,
    fits_per_row: Sequence[int],
    pinned: Tensor,
    bounds: Tensor,
    tol: float,
    max_iter: int = 12,
    shrink: bool = True,
) -> tuple[Tensor, Tensor]:
    """``F`` conditional fits near their rows' unconditional minima, by chord steps.

    Each fit starts at the minimum of its row's quadratic approximation with its columns
    ``pinned`` at ``values`` (the best fit moved along the restricted inverse Hessian's
    columns), then takes quasi-Newton steps (see the module doc).

    Args:
        objective: gives ``gradient(x, fits)``, the value ``[R]`` and gradient ``[R, P]`` at
            ``x [R, P]`` of the fits ``fits`` (a
            :class:`~pyhf_gpu_server.inference.objective.TwiceNLL` over the ``F`` fits).
        best: ``[F, P]`` the unconditional minimum of each fit's row.
        values: ``[F, k]`` the values the fit pins its columns at.
        inverse: ``[B, P, P]`` the inverse Hessian at each row's unconditional minimum (zero
            rows and columns for its fixed parameters); not finite: no chord steps.
        held: ``[B, P]`` bool, parameters each row's minimum holds on a bound
            (:func:`held_at_bounds`): they stay there, and a fit has converged only if
            their gradient still points out of the box.
        fits_per_row: how many of the ``F`` fits belong to each of the ``B`` rows, in order.
        pinned: ``[F, k]`` the columns each fit pins.
        bounds: ``[F, P, 2]``.
        tol: the Newton decrement under which a fit has converged (at least 64 machine
            epsilons of the objective, as the minimiser's criterion).
        max_iter: steps per fit at most.
        shrink: the host looks at the flags every step, to drop finished fits and stop when
            none is left; False: ``max_iter`` steps of every fit, finished ones standing still,
            and no host synchronisation (as a CUDA graph or FakeTensorMode needs).

    Returns:
        ``[F, P]`` the points reached (start points for the minimiser where not converged),
        and ``[F]`` bool: the fits that converged there.
    """
    F, P = best.shape
    device = best.device
    counts = list(fits_per_row)
    row = torch.repeat_interleave(
        torch.arange(len(counts), device=device),
        torch.tensor(counts, dtype=torch.long, device=device),
        output_size=F,
    )
    whole_diagonal = inverse.diagonal(dim1=-2, dim2=-1).index_select(0, row)
    inverse = restricted_inverse(inverse, held)
    held = held.index_select(0, row).scatter(1, pinned, False)
    # H^-1 restricted to each fit's free columns: H^-1 q - W^T (H^-1_CC)^-1 W q
    flat = inverse.reshape(-1, P)
    columns = flat.index_select(0, (row.unsqueeze(1) * P + pinned).flatten()).view(F, -1, P)
    block = columns.gather(2, pinned.unsqueeze(1).expand(-1, pinned.shape[1], -1))
    block_inverse, info = torch.linalg.inv_ex(block)
    usable = (info == 0) & torch.isfinite(columns).flatten(1).all(-1)
    usable = usable & torch.isfinite(inverse).flatten(1).all(-1).index_select(0, row)
    # the coordinates that move: free in the row's Hessian, not held, not pinned
    moving = (inverse.diagonal(dim1=-2, dim2=-1) > 0).index_select(0, row)
    moving = (moving & torch.logical_not(held)).scatter(1, pinned, False).to(best.dtype)
    lo, hi = bounds.select(-1, 0), bounds.select(-1, 1)
    # the start: the quadratic approximation's minimum with the pinned columns at ``values``
    shift = values - best.gather(1, pinned)
    response = (columns.mT @ (block_inverse @ shift.unsqueeze(-1))).squeeze(-1)
    x = torch.where(usable.unsqueeze(1) & torch.isfinite(response), best + response, best)
    x = torch.minimum(torch.maximum(x, lo), hi).scatter(1, pinned, values)
    at_lo = held & ((x - lo).abs() <= (hi - x).abs())
    converged = torch.zeros(F, dtype=torch.bool, device=device)

    # the working set (ascending fit indices, so grouped by row) and its state
    fits = torch.arange(F, device=device)
    if shrink:
        fits = usable.nonzero().squeeze(1)
        if not fits.numel():
            return x, converged
    point = x.index_select(0, fits)
    f, g = objective.gradient(point, fits)
    everyone = torch.arange(F, device=device)
    scale = (  # the objective's rounding scale per fit (decrement_tolerance)
        objective.rounding_scale(everyone)
        if hasattr(objective, "rounding_scale")
        else torch.zeros(F, dtype=x.dtype, device=device)
    )
    outward = _outward(g, held, at_lo, fits)
    g = g * moving.index_select(0, fits)
    work = _WorkingSet(fits, point, f, g, outward, usable.index_select(0, fits))

    for _ in range(max_iter):
        fits, point, f, g = work.fits, work.point, work.f, work.g
        counts = list(fits_per_row) if not shrink else work.counts(row, len(fits_per_row))
        # the BFGS updates of the steps so far, applied around the chord's inverse (L-BFGS's
        # two-loop recursion): the chord's linear convergence becomes superlinear
        q = g
        alphas = []
        for s_k, y_k, rho_k in reversed(work.pairs):
            a = rho_k * (s_k * q).sum(-1)
            q = q - a.unsqueeze(1) * y_k
            alphas.append(a)
        products = [
            part @ inverse.select(0, b) for b, part in enumerate(q.split(counts)) if part.shape[0]
        ]
        w = columns.index_select(0, fits)
        schur = w.mT @ (block_inverse.index_select(0, fits) @ (w @ q.unsqueeze(-1)))
        r = torch.cat(products) - schur.squeeze(-1)
        for (s_k, y_k, rho_k), a in zip(work.pairs, reversed(alphas), strict=True):
            b = rho_k * (y_k * r).sum(-1)
            r = r + (a - b).unsqueeze(1) * s_k
        step = -r * moving.index_select(0, fits) * work.active.unsqueeze(1)
        decrement = -(g * step).sum(-1)
        tol_f = decrement_tolerance(f, tol, scale.index_select(0, fits))
        stop = work.active & (decrement <= tol_f)  # converged, or an uphill step (no certificate)
        # a held parameter whose gradient turned inward could still lower the objective:
        # by ``g_j^2 (H^-1)_jj`` alone, which must be within the tolerance too
        inward = (work.outward.clamp(max=0) ** 2 * whole_diagonal.index_select(0, fits)).amax(-1)
        converged = converged.index_copy(
            0,
            fits,
            converged.index_select(0, fits) | (stop & (decrement >= -tol_f) & (inward <= tol_f)),
        )
        work.active = work.active & torch.logical_not(stop)
        if shrink:  # the fits that stop here take no trial step
            x = x.index_copy(0, fits, point)
            keep = work.active.nonzero().squeeze(1)
            if not keep.numel():
                return x, converged
            work.keep(keep)
            step, decrement = step.index_select(0, keep), decrement.index_select(0, keep)
            fits, point, f, g = work.fits, work.point, work.f, work.g
        trial = torch.minimum(
            torch.maximum(point + step, lo.index_select(0, fits)), hi.index_select(0, fits)
        )
        f_trial, g_trial = objective.gradient(trial, fits)
        outward_trial = _outward(g_trial, held, at_lo, fits)
        g_trial = g_trial * moving.index_select(0, fits)
        better = work.active & torch.isfinite(f_trial) & (f_trial <= f) & (decrement > 0)
        s_k, y_k = trial - point, g_trial - g
        sy = (s_k * y_k).sum(-1)
        ok = better & (sy > 1e-12 * s_k.norm(dim=-1) * y_k.norm(dim=-1))
        one = torch.ones_like(sy)
        work.pairs.append((s_k, y_k, torch.where(ok, one / torch.where(ok, sy, one), 0 * one)))
        work.point = torch.where(better.unsqueeze(1), trial, point)
        work.f = torch.where(better, f_trial, f)
        work.g = torch.where(better.unsqueeze(1), g_trial, g)
        work.outward = torch.where(better.unsqueeze(1), outward_trial, work.outward)
        work.active = better
        if shrink:
            x = x.index_copy(0, fits, work.point)
            keep = better.nonzero().squeeze(1)
            if not keep.numel():
                return x, converged
            work.keep(keep)
    return x.index_copy(0, work.fits, work.point), converged


@dataclass
class _WorkingSet:
    """The fits still stepping (``fits``, ascending) and their state: point, value,
    gradient on the moving coordinates, the held coordinates' outward gradient, whether each
    is active (without host looks, finished fits stay in the set, inactive), and the step
    pairs so far."""

    fits: Tensor
    point: Tensor
    f: Tensor
    g: Tensor
    outward: Tensor
    active: Tensor
    pairs: list[tuple[Tensor, Tensor, Tensor]] = field(default_factory=list)

    def keep(self, index: Tensor) -> None:
        """Only the members at ``index``."""
        for name in ("fits", "point", "f", "g", "active", "outward"):
            setattr(self, name, getattr(self, name).index_select(0, index))
        self.pairs = [
            (a.index_select(0, index), b.index_select(0, index), c.index_select(0, index))
            for a, b, c in self.pairs
        ]

    def counts(self, row: Tensor, rows: int) -> list[int]:
        """How many members belong to each of ``rows`` rows (a host look)."""
        return torch.bincount(row.index_select(0, self.fits), minlength=rows).tolist()


def _outward(g: Tensor, held: Tensor, at_lo: Tensor, fits: Tensor) -> Tensor:
    """``[R, P]`` the gradient of the held parameters of ``fits``, signed so that positive
    points out of the box (up at a lower bound, down at an upper one); 0 elsewhere."""
    held, at_lo = held.index_select(0, fits), at_lo.index_select(0, fits)
    return torch.where(held, torch.where(at_lo, g, -g), torch.zeros_like(g))
