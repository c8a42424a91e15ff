"""Batched, bounded, damped Newton minimiser that runs entirely on the objective's device.

A batch of ``B`` independent minimisations (each row: its own start point, box bounds and
fixed-parameter mask) is advanced in one loop. Every iteration:

1. has the value, gradient and curvature matrix of every still-running row at its current
   point (:meth:`BatchedObjective.derivatives`),
2. freezes the fixed parameters and the parameters held at a bound by their gradient
   (projected Newton: the active set of the box constraints), or, until the row moves, by
   their last step (a parameter on its bound whose gradient points inside but whose step,
   its correlated neighbours' moves included, points out: its row solves again without it
   instead of raising the damping for a bent step),
3. solves ``(H + lambda D) p = -g`` for the damping ``lambda`` of the row and for
   ``lambda = 0`` (pure Newton, whose decrement tests convergence; ``D = |diag H|`` is
   Marquardt's scaling). For a Gauss-Newton curvature, ``H`` includes a second-order term
   learnt by secant updates (NL2SOL's), for superlinear convergence. The solve is dense
   (Cholesky), low-rank (Woodbury) or by blocks of per-bin parameters
   (:mod:`~pyhf_gpu_server.inference.curvature`),
4. takes the derivatives at the projected trial point ``clip(x + p, lo, hi)`` of the damped
   step (a parameter with a barrier at its lower bound, such as a Poisson constraint's
   ``gamma``, kept a tenth of its distance from it), and keeps it if it lowers the objective
   (Levenberg-Marquardt), else raises the damping. (``trials="grid"`` instead evaluates the
   objective at several candidates and step lengths and keeps the best; the tail of a call
   runs so, see :class:`MinimizeOptions`.) Either way the damping follows the row's own
   step: a quarter after a success, 256 times after a failure.

A row has converged when its Newton decrement ``-g.p`` (twice the decrease a quadratic model
predicts) falls below ``tol`` with a positive-definite reduced Hessian (the model's, or where
that is not positive definite and the grid computed it, the exact one), or, where the
curvature is singular (parameters the likelihood does not tell apart), when the damped step's
decrement bounds the decrement at damping :data:`TRUSTED_DAMPING` below ``tol``; it then
stops moving.
A row whose damping explodes without progress, whose objective is not finite, or that runs
out of iterations is reported as not converged. The host looks at the flags only every
``check_every`` iterations, to drop finished rows from the working set.

Example:
    >>> import torch
    >>> class Quadratic:
    ...     # f(x) = sum((x - 3)^2) per row, exact curvature
    ...     def value(self, x, rows):
    ...         return ((x - 3.0) ** 2).sum(-1)
    ...     def derivatives(self, x, rows):
    ...         eye = torch.eye(x.shape[-1], dtype=x.dtype).expand(x.shape[0], -1, -1)
    ...         return self.value(x, rows), 2 * (x - 3.0), 2 * eye
    >>> x0 = torch.zeros(2, 2, dtype=torch.float64)
    >>> bounds = torch.tensor([[0.0, 10.0], [0.0, 2.0]], dtype=torch.float64).expand(2, 2, 2)
    >>> fixed = torch.tensor([[False, False], [True, False]])
    >>> res = minimize(Quadratic(), x0, bounds, fixed)  # to a Newton decrement below 1e-10
    >>> res.x.round(decimals=5).tolist(), res.converged.tolist()
    ([[3.0, 2.0], [0.0, 2.0]], [True, True])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Literal, NamedTuple, Protocol, TypeGuard

import torch
from torch import Tensor

from .curvature import (
    BlockCurvature,
    DenseCurvature,
    Derivatives,
    LowRankCurvature,
    Solver,
    curvature_of,
)
from .errors import FitStopped

__all__ = [
    "BatchedObjective",
    "Derivatives",
    "MinimizeOptions",
    "MinimizeResult",
    "SecondOrderObjective",
    "decrement_tolerance",
    "minimize",
]

#: the starting Levenberg-Marquardt ``lambda`` (relative to ``|diag H|``)
DAMPING = 1e-3
#: a row whose ``lambda`` grows past this without an accepted step stops
MAX_DAMPING = 1e12
#: the damping at which a singular curvature's step certifies convergence (``_iterate``)
TRUSTED_DAMPING = 1e-3
#: distance to a bound under which a parameter counts as sitting on it
BOUND_TOL = 1e-12
#: the share of its distance to its lower bound that a step leaves a parameter with a barrier
#: there (``minimize``'s ``barrier``)
BARRIER_KEEP = 0.1
#: ``"grid"`` trials: the damped candidates, as multiples of ``lambda``, and the fractions of
#: each candidate step tried too (a line search on a grid; values only, no extra
#: factorisation); pure Newton's step, whose decrement tests convergence, is always a
#: candidate
GRID_DAMPING_FACTORS = (1.0,)
GRID_STEP_LENGTHS = (1.0, 0.5)
#: iterations before the tail (``tail_rows``) may start: a fit that converges sooner (most do)
#: never pays for the grid's extra trial points and factorisations
TAIL_AFTER = 20
#: the tail's damped candidates (multiples of ``lambda``) and step lengths (fractions and
#: multiples of each candidate step)
TAIL_DAMPING_FACTORS = (0.125, 1.0, 8.0)
TAIL_STEP_LENGTHS = (3.0, 1.5, 0.6)


class BatchedObjective(Protocol):
    """A batch of independent scalar objectives, one per row.

    ``rows`` (LongTensor ``[R]``) says which rows of the full batch the ``R`` points ``x [R, P]``
    belong to (the minimiser shrinks its working set as rows finish, and evaluates several
    trial points per row at once by repeating a row index).
    """

    def value(self, x: Tensor, rows: Tensor) -> Tensor:
        """Objective ``[R]`` at ``x [R, P]``."""
        ...

    def derivatives(self, x: Tensor, rows: Tensor) -> Derivatives | tuple[Tensor, Tensor, Tensor]:
        """Value ``[R]``, gradient ``[R, P]`` and a symmetric curvature matrix ``[R, P, P]``, or
        its low-rank pieces (see :class:`~pyhf_gpu_server.inference.curvature.Derivatives`).

        Optionally also ``rounding_scale(rows) -> [R]``: the size of the terms a row's value
        is summed from, which its rounding errors scale with (:func:`decrement_tolerance`).
        """
        ...


class SecondOrderObjective(BatchedObjective, Protocol):
    """An objective ``sum_i phi_i(lambda_i(x))`` whose Gauss-Newton curvature (with ``J`` and
    ``r``, see :class:`Derivatives`) misses ``sum_i r_i Hess(lambda_i)``, and that gives it."""

    def second_order(self, x: Tensor, rows: Tensor, r: Tensor) -> Tensor:
        """``sum_i r_i Hess(lambda_i)`` ``[R, P, P]`` at ``x [R, P]`` for residuals ``r``."""
        ...


def _has_second_order(objective: BatchedObjective) -> TypeGuard[SecondOrderObjective]:
    return hasattr(objective, "second_order")


@dataclass(frozen=True)
class MinimizeOptions:
    """Knobs of :func:`minimize`; the defaults suit twice negative log-likelihoods.

    Attributes:
        max_iter: Newton iterations per row at most.
        tol: convergence when the Newton decrement ``-g.p`` is below this (objective units).
        check_every: iterations between two host-side looks at the convergence flags, to
            drop finished rows; ``0`` never looks: a fixed budget of ``max_iter`` iterations
            with no host synchronisation (converged rows stop moving), as a CUDA graph or
            FakeTensorMode needs. ``None``: every iteration on the CPU, every 4th elsewhere.
        trials: ``"damped"``: one trial point per iteration, the damped step, with its
            derivatives (they are the next iteration's when it is accepted); ``"grid"``: the
            objective at every candidate (pure Newton and :data:`GRID_DAMPING_FACTORS`)
            times every :data:`GRID_STEP_LENGTHS`, the best one kept: fewer iterations,
            each dearer (BENCHMARKS.md, "Figures behind defaults").
        secant: learn the second-order term missing from a Gauss-Newton curvature by secant
            updates (when the objective provides ``J`` and ``r``, see :class:`Derivatives`).
        solver: how steps are solved from the curvature (see
            :mod:`~pyhf_gpu_server.inference.curvature`): ``"dense"`` (Cholesky),
            ``"low-rank"`` (Woodbury, for objectives that give the low-rank pieces),
            ``"block"`` (the per-bin parameters eliminated, for objectives that give their
            Jacobian in block form) or ``"auto"`` (``choose_solver``).
        secant_memory: secant pairs the curvature keeps (the block solver's: this many or
            none, :func:`~pyhf_gpu_server.inference.curvature.block_memory`).
        tail_rows: once at most this many rows still run after :data:`TAIL_AFTER`
            iterations (and the host looks, see ``check_every``), iterate with ``"grid"``
            trials over :data:`TAIL_DAMPING_FACTORS` x :data:`TAIL_STEP_LENGTHS`: an
            iteration of a few rows costs its dispatch, not its arithmetic, and the slow
            fits that set the length of a call need fewer iterations so. ``0``: never.
        tail_after_all: iterations after which the tail starts however many rows still run
            (only the hard fits are left by then).
        exact_newton_after: with ``"grid"`` trials (the tail's too), from this iteration on
            also try the Newton step of the exact curvature where it is positive definite,
            when the objective gives the second-order term its Gauss-Newton curvature drops
            (:class:`SecondOrderObjective`): a fit that creeps on the Gauss-Newton model
            where the likelihood is convex ends in a few iterations. ``None``: never.
    """

    max_iter: int = 200
    tol: float = 1e-10
    check_every: int | None = None
    trials: Literal["damped", "grid"] = "damped"
    secant: bool = True
    solver: Solver = "auto"
    secant_memory: int = 8
    tail_rows: int = 16
    tail_after_all: int = 60
    exact_newton_after: int | None = 30


class Follow(NamedTuple):
    """Rows ``start .. start + length`` of a batch start from the end points of rows ``lead ..
    lead + length`` (rows that follow none), in order (see :func:`minimize`)."""

    start: int
    lead: int
    length: int


def follow_rows(follows: Sequence[Follow], B: int, device) -> tuple[Tensor, Tensor, Tensor]:
    """The rows of a batch of ``B`` that follow none, those that follow, and the row each of
    those follows, as index tensors on ``device`` (built on the host: no data-dependent
    shape on the device).

    >>> [t.tolist() for t in follow_rows([Follow(4, 1, 2)], 6, "cpu")]
    [[0, 1, 2, 3], [4, 5], [1, 2]]
    """
    if not follows:
        none = torch.zeros(0, dtype=torch.long, device=device)
        return torch.arange(B, device=device), none, none
    after = [f.start + i for f in follows for i in range(f.length)]
    lead = sorted(set(range(B)) - set(after))
    parent = [f.lead + i for f in follows for i in range(f.length)]
    lead_, after_, parent_ = (
        torch.tensor(t, dtype=torch.long, device=device) for t in (lead, after, parent)
    )
    return lead_, after_, parent_


class _Candidates(NamedTuple):
    """The trial steps of an iteration: the candidates' damping factors ``[K]`` (pure
    Newton's 0 first) and step lengths as device tensors, and the index of the candidate
    damped by the row's own ``lambda``."""

    factors: Tensor
    lengths: Tensor
    own: int


def _candidates(
    trials: Literal["damped", "grid"],
    device: torch.device,
    dtype: torch.dtype,
    damping_factors: tuple[float, ...] = GRID_DAMPING_FACTORS,
    step_lengths: tuple[float, ...] = GRID_STEP_LENGTHS,
) -> _Candidates:
    """The candidates of ``trials`` (``"grid"``: ``damping_factors`` x ``step_lengths``)."""
    grid = trials == "grid"
    factors = damping_factors if grid else (1.0,)
    lengths = step_lengths if grid else (1.0,)
    own = factors.index(1.0) if 1.0 in factors else len(factors) - 1
    return _Candidates(
        torch.tensor((0.0, *factors), dtype=dtype, device=device),
        torch.tensor(lengths, dtype=dtype, device=device),
        own + 1,
    )


@dataclass
class MinimizeResult:
    """Per row: the minimum found and how the minimisation went.

    Attributes:
        x: ``[B, P]`` parameters at the minimum (fixed ones at their fixed values).
        fun: ``[B]`` objective at ``x``.
        converged: ``[B]`` bool; ``False`` for every row that did not meet the criterion.
        iterations: ``[B]`` Newton iterations used.
        decrement: ``[B]`` the last Newton decrement (the predicted remaining decrease x 2).
    """

    x: Tensor
    fun: Tensor
    converged: Tensor
    iterations: Tensor
    decrement: Tensor


@dataclass
class _State:
    """Working set of still-running rows (indices ``rows`` into the full batch)."""

    rows: Tensor
    x: Tensor
    f: Tensor
    g: Tensor
    curvature: DenseCurvature | LowRankCurvature | BlockCurvature
    lam: Tensor
    iterations: Tensor
    decrement: Tensor
    converged: Tensor
    failed: Tensor
    scale: Tensor  # [R] the objective's rounding scale (decrement_tolerance)
    held: Tensor  # [R, P] held at their bound until the row moves (see _iterate)

    def select(self, keep: Tensor) -> _State:
        """The sub-state of the rows where ``keep`` (bool ``[R]``) is true."""
        fields = {k: getattr(self, k) for k in self.__dataclass_fields__}
        return _State(
            **{k: v.select(keep) if k == "curvature" else v[keep] for k, v in fields.items()}
        )

    def ended(self, max_iter: int) -> Tensor:
        """``[R]`` rows that stand still: converged, failed or out of iterations."""
        return self.converged | self.failed | (self.iterations >= max_iter)

    def cat(self, more: _State) -> _State:
        """This state's rows, then ``more``'s."""
        tensors = [k for k in self.__dataclass_fields__ if k != "curvature"]
        return _State(
            curvature=self.curvature.cat(more.curvature),
            **{k: torch.cat([getattr(self, k), getattr(more, k)]) for k in tensors},
        )


def decrement_tolerance(f: Tensor, tol: float, scale: Tensor | float = 0.0) -> Tensor:
    """The Newton decrement ``-g.p`` under which a row has converged: ``tol``, or where that
    is more, what rounding leaves of ``f``: 64 units in the last place of ``|f|``, plus one of
    ``scale``, the size of the terms ``f`` is summed from (:class:`BatchedObjective` may give
    ``rounding_scale``): no step can show a smaller decrease than their rounding errors.
    Either side of 0: a decrement below minus this is an uphill step, which a positive
    definite curvature cannot give, so no certificate.

    >>> f = torch.tensor([1881.0, 2.0], dtype=torch.float64)
    >>> decrement_tolerance(f, 1e-10, torch.tensor([5.7e7, 40.0], dtype=torch.float64))
    tensor([1.2683e-08, 1.0000e-10], dtype=torch.float64)
    """
    return torch.clamp(torch.finfo(f.dtype).eps * (64 * (1 + f.abs()) + scale), min=tol)


def _as_derivatives(result: Derivatives | tuple) -> Derivatives:
    return result if isinstance(result, Derivatives) else Derivatives(*result)


def _movable(
    x: Tensor, g: Tensor, lo: Tensor, hi: Tensor, free: Tensor, bound_tol: float
) -> Tensor:
    """Free parameters that are not held at a bound by their gradient (projected Newton)."""
    at_lo = (x <= lo + bound_tol) & (g > 0)
    at_hi = (x >= hi - bound_tol) & (g < 0)
    return free & torch.logical_not(at_lo | at_hi)


#: a batch's rows: their bounds, free parameters and barriers (None: no barrier in the batch)
_Box = tuple[Tensor, Tensor, Tensor, Tensor | None]


def _trial_points(
    x: Tensor, steps: Tensor, lo: Tensor, hi: Tensor, barrier: Tensor | None
) -> Tensor:
    """``x + steps`` projected on the box, a parameter with a ``barrier`` at its lower bound
    kept :data:`BARRIER_KEEP` of its distance from it (``steps`` ``[..., R, P]``)."""
    trial = torch.minimum(torch.maximum(x + steps, lo), hi)
    if barrier is None:
        return trial
    return torch.where(barrier, torch.maximum(trial, lo + BARRIER_KEEP * (x - lo)), trial)


def _iterate(
    objective: BatchedObjective,
    s: _State,
    bounds: _Box,
    options: MinimizeOptions,
    constants: _Candidates,
    exact: bool = False,
) -> _State:
    """One damped-Newton iteration of every running row of ``s`` (in place on ``s``);
    ``bounds``: the rows' ``(lo, hi, free, barrier)``; ``constants``: the candidate steps
    (:func:`_candidates`); ``exact``: the grid also tries the exact curvature's Newton step
    (see ``exact_newton_after``)."""
    lo, hi, free, barrier = bounds
    factors, alphas, own_candidate = constants
    running = torch.logical_not(s.ended(options.max_iter))
    movable = _movable(s.x, s.g, lo, hi, free, BOUND_TOL) & torch.logical_not(s.held)
    lams = factors.unsqueeze(1) * s.lam.unsqueeze(0)  # [K, R]
    steps, ok = s.curvature.steps(s.g, movable, lams)
    # a parameter on its bound whose gradient points inside, but whose step (the others'
    # moves included: strong correlations) points out: the projected trial would bend the
    # step and fail, raising the damping for nothing. It is held on its bound, and the row
    # solves again next iteration without it (projected Newton's active set, one solve per
    # iteration, no host look); a row that moves releases what it held (BENCHMARKS.md,
    # "Figures behind defaults").
    own_step = steps.select(0, own_candidate)
    outward = movable & (
        ((s.x <= lo + BOUND_TOL) & (own_step < 0)) | ((s.x >= hi - BOUND_TOL) & (own_step > 0))
    )
    # the decrement that certifies convergence: pure Newton's, or where the curvature is
    # singular an upper bound of the decrement at damping 1e-3 from the step at the row's
    # own damping: g (H + l D)^-1 g falls with l at most as 1 / l, so its value at l times
    # max(1, l / 1e-3) bounds it at 1e-3 (a row whose damping rose past 1e-3 at its minimum,
    # where no step can lower f, converges instead of failing)
    above = torch.clamp(lams / TRUSTED_DAMPING, min=1.0)
    decrements = torch.where(ok, -(s.g * steps).sum(-1) * above, torch.inf)
    newton_trusted = ok.select(0, 0)
    own = decrements.select(0, own_candidate)
    s.decrement = torch.where(newton_trusted, decrements.select(0, 0), own)
    unit = None  # the grid's steps tried at their full length only: the exact Newton step
    grid = options.trials == "grid"
    exact = exact and s.curvature.exact_step and s.curvature.r is not None
    if grid and exact and _has_second_order(objective):
        unit = _exact_newton_step(objective, s, movable)
        # where the model's curvature gives no certificate (not positive definite at lambda
        # = 0), the exact one does: a row at its minimum would only raise its damping until
        # it fails
        certified = unit[1].select(0, 0) & torch.logical_not(newton_trusted)
        exact_decrement = -(s.g * unit[0].select(0, 0)).sum(-1)
        s.decrement = torch.where(certified, exact_decrement, s.decrement)
    # |decrement|: a row whose step goes uphill goes on, to a minimum or to failing
    tolerance = decrement_tolerance(s.f, options.tol, s.scale)
    newly_converged = running & (s.decrement.abs() <= tolerance)
    moving = running & torch.logical_not(newly_converged)
    redo = moving & outward.any(-1)

    if options.trials == "damped":
        x_new = _trial_points(s.x, steps.select(0, -1), lo, hi, barrier)
        d = _as_derivatives(objective.derivatives(x_new, s.rows))
        trial_ok = ok.select(0, -1) & torch.isfinite(d.f)
        f_new = torch.where(trial_ok, d.f, torch.inf)
    else:
        x_new, f_new = _best_trial(objective, s, steps, ok, alphas, bounds, unit)
    # the damped trial is that bent step; the grid's best trial may still be taken
    bent = redo if options.trials == "damped" else torch.zeros_like(redo)
    accept = moving & (f_new < s.f) & torch.logical_not(bent)

    x_old = s.x
    s.x = torch.where(accept.unsqueeze(-1), x_new, s.x)
    # whichever trial won, the damping follows the row's own step: a quarter after a
    # success, x256 after a failure (a damping that follows the winning candidate stays
    # high, which weakens a singular curvature's convergence test); kept where the row
    # solves again with a parameter held
    s.lam = torch.where(
        accept, torch.clamp(s.lam / 4, min=1e-15), torch.where(redo, s.lam, s.lam * 256)
    )
    s.held = torch.where(accept.unsqueeze(-1), False, s.held | (outward & redo.unsqueeze(-1)))
    s.iterations = s.iterations + moving.long()
    s.converged = s.converged | newly_converged
    stalled = moving & torch.logical_not(accept) & (s.lam > MAX_DAMPING)
    s.failed = s.failed | stalled
    if options.trials != "damped":
        d = _as_derivatives(objective.derivatives(s.x, s.rows))
    _adopt(s, d, accept, s.x - x_old)
    return s


def _first_state(
    objective: BatchedObjective, x: Tensor, rows: Tensor, options: MinimizeOptions
) -> _State:
    """The state of ``rows`` starting at ``x``: their derivatives there, their first damping."""
    d = _as_derivatives(objective.derivatives(x, rows))
    R = rows.shape[0]
    return _State(
        rows=rows,
        x=x,
        f=d.f,
        g=d.g,
        curvature=curvature_of(d, options.secant, options.solver, options.secant_memory),
        lam=torch.full((R,), DAMPING, dtype=x.dtype, device=x.device),
        iterations=torch.zeros(R, dtype=torch.long, device=x.device),
        decrement=torch.full((R,), torch.inf, dtype=x.dtype, device=x.device),
        converged=torch.zeros(R, dtype=torch.bool, device=x.device),
        failed=torch.logical_not(torch.isfinite(d.f)),
        scale=objective.rounding_scale(rows)
        if hasattr(objective, "rounding_scale")
        else torch.zeros_like(d.f),
        held=torch.zeros_like(x, dtype=torch.bool),
    )


def _start_followers(
    objective: BatchedObjective,
    s: _State,
    waiting: Tensor,
    parent: Tensor,
    x0: Tensor,
    lo: Tensor,
    hi: Tensor,
    options: MinimizeOptions,
) -> tuple[_State, Tensor, Tensor]:
    """``s`` with the rows of ``waiting`` (following the rows ``parent``) whose row to follow
    has ended added, started from its point (their free parameters, clipped to their
    bounds); and the rows still waiting, with their parents. A row to follow is still in
    ``s`` when it ends: rows are dropped after this look."""
    position = torch.full_like(x0[:, 0], -1, dtype=torch.long)
    position[s.rows] = torch.arange(s.rows.shape[0], device=x0.device)
    lead = position.index_select(0, parent)
    ended = s.ended(options.max_iter).index_select(0, lead.clamp(min=0)) & (lead >= 0)
    if not bool(ended.any()):
        return s, waiting, parent
    rows, lead, wait = waiting[ended], lead[ended], torch.logical_not(ended)
    x = s.x.index_select(0, lead)
    lo_, hi_, start = (t.index_select(0, rows) for t in (lo, hi, x0))
    x = torch.where(lo_ == hi_, start, torch.minimum(torch.maximum(x, lo_), hi_))
    return s.cat(_first_state(objective, x, rows, options)), waiting[wait], parent[wait]


def _exact_newton_step(
    objective: SecondOrderObjective, s: _State, movable: Tensor
) -> tuple[Tensor, Tensor]:
    """The Newton step ``[1, R, P]`` of the exact curvature (the objective's Gauss-Newton
    matrix plus its second-order term) on the movable parameters, and where it is usable
    ``[1, R]``: positive definite and finite."""
    r = s.curvature.r
    assert r is not None  # tried only where the curvature keeps the residuals
    second_order = objective.second_order(s.x, s.rows, r)
    exact = DenseCurvature(s.curvature.gauss_newton() + second_order)
    return exact.steps(s.g, movable, torch.zeros_like(s.lam).unsqueeze(0))


def _best_trial(
    objective: BatchedObjective,
    s: _State,
    steps: Tensor,
    ok: Tensor,
    alphas: Tensor,
    bounds: _Box,
    unit: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """The ``"grid"`` trials: every candidate step ``[K, R, P]`` at every step length, and
    the ``unit`` steps (with their ``ok``) as they are, values only. Per row: the best trial
    point and its value."""
    n_alpha = alphas.shape[0]
    steps = (alphas.view(1, -1, 1, 1) * steps.unsqueeze(1)).flatten(0, 1)  # [K * S, R, P]
    ok = ok.repeat_interleave(n_alpha, dim=0)
    if unit is not None:
        steps, ok = torch.cat([steps, unit[0]]), torch.cat([ok, unit[1]])
    K, R, P = steps.shape
    lo, hi, _, barrier = bounds
    trial = _trial_points(s.x, steps, lo, hi, barrier)
    f_trial = objective.value(trial.reshape(K * R, P), s.rows.repeat(K)).reshape(K, R)
    f_trial = torch.where(
        ok & torch.isfinite(f_trial), f_trial, torch.full_like(f_trial, torch.inf)
    )
    best_f, best_k = f_trial.min(0)
    x_best = trial.gather(0, best_k.view(1, R, 1).expand(1, R, P)).squeeze(0)
    return x_best, best_f


def _adopt(s: _State, d: Derivatives, accept: Tensor, step: Tensor) -> None:
    """Take the new derivatives on the accepted rows (the curvature's secant term learns
    from the step)."""
    s.curvature.adopt(d, accept, step, d.g - s.g)
    s.f = torch.where(accept, d.f, s.f)
    s.g = torch.where(accept.unsqueeze(-1), d.g, s.g)


def minimize(
    objective: BatchedObjective,
    init: Tensor,
    bounds: Tensor,
    fixed: Tensor | None = None,
    options: MinimizeOptions | None = None,
    stop: Callable[[], bool] | None = None,
    follows: Sequence[Follow] = (),
    barrier: Tensor | None = None,
) -> MinimizeResult:
    """Minimise ``B`` independent objectives at once; every tensor stays on ``init.device``.

    Args:
        objective: the batched objective (:class:`BatchedObjective`).
        init: ``[B, P]`` start points; fixed parameters stay at their value here.
        bounds: ``[B, P, 2]`` (or broadcastable ``[P, 2]``) box bounds ``[lo, hi]``.
        fixed: ``[B, P]`` bool (or ``[P]``); ``None`` means nothing fixed.
        options: :class:`MinimizeOptions`.
        stop: a host-side predicate (no device sync) asked before every iteration; when it
            answers true the call raises :class:`~pyhf_gpu_server.inference.errors.FitStopped`.
        follows: blocks of rows (:class:`Follow`) that start, their free parameters, from
            the end points of other rows when the host sees each end (the others start at
            once from ``init``): a second fit of a minimum runs in the same call as the fit
            that finds it. Needs host looks (``check_every`` not 0).
        barrier: ``[B, P]`` bool (or ``[P]``): parameters near whose lower bound the
            objective rises without bound where its curvature does not show it (a Poisson
            constraint with a positive count: ``-2 n log(gamma)``). A step takes them at most
            ``1 - BARRIER_KEEP`` of the way there: Newton's step on such a term from above
            overshoots past the bound, and from just above the bound regains only a factor
            of 2 an iteration.

    Returns:
        :class:`MinimizeResult` with one entry per row.

    Example:
        >>> import torch
        >>> class Rosenbrock:
        ...     def value(self, x, rows):
        ...         return (1 - x[:, 0]) ** 2 + 100 * (x[:, 1] - x[:, 0] ** 2) ** 2
        ...     def derivatives(self, x, rows):
        ...         f = lambda z: self.value(z, rows).sum()
        ...         H = torch.func.vmap(torch.func.hessian(lambda z: f(z[None])))(x)
        ...         return self.value(x, rows), torch.func.grad(f)(x), H
        >>> x0 = torch.tensor([[-1.2, 1.0], [2.0, 2.0]], dtype=torch.float64)
        >>> box = torch.tensor([[-5.0, 5.0], [-5.0, 5.0]], dtype=torch.float64)
        >>> res = minimize(Rosenbrock(), x0, box)
        >>> [round(v, 4) for v in res.x.flatten().tolist()], res.converged.all().item()
        ([1.0, 1.0, 1.0, 1.0], True)
    """
    options = options or MinimizeOptions()
    B, P = init.shape
    device, dtype = init.device, init.dtype
    bounds = bounds.to(device=device, dtype=dtype).expand(B, P, 2)
    free = (
        torch.ones(B, P, dtype=torch.bool, device=device)
        if fixed is None
        else torch.logical_not(fixed.to(device))
    )
    free = free.expand(B, P)
    lower, upper = bounds.select(-1, 0), bounds.select(-1, 1)
    x0 = torch.where(free, torch.minimum(torch.maximum(init, lower), upper), init)
    lo = torch.where(free, lower, x0)  # a fixed parameter may sit outside its bounds
    hi = torch.where(free, upper, x0)
    if barrier is not None:
        barrier = free & barrier.to(device)
    rows, waiting, parent = follow_rows(follows, B, device)
    s = _first_state(objective, x0.index_select(0, rows), rows, options)
    out = MinimizeResult(
        x=x0.clone(),
        fun=torch.full((B,), torch.nan, dtype=dtype, device=device).index_copy(0, rows, s.f),
        converged=torch.zeros(B, dtype=torch.bool, device=device),
        iterations=torch.zeros(B, dtype=torch.long, device=device),
        decrement=torch.full((B,), torch.inf, dtype=dtype, device=device),
    )

    def flush(st: _State) -> None:
        out.x.index_copy_(0, st.rows, st.x)
        out.fun.index_copy_(0, st.rows, st.f)
        out.converged.index_copy_(0, st.rows, st.converged & torch.logical_not(st.failed))
        out.iterations.index_copy_(0, st.rows, st.iterations)
        out.decrement.index_copy_(0, st.rows, st.decrement)

    check_every = options.check_every
    if check_every is None:
        check_every = 1 if device.type == "cpu" else 4
    if follows and not check_every:
        raise ValueError("rows that follow others start at a host look: check_every must not be 0")
    step_options = options
    constants = _candidates(options.trials, device, dtype)
    # a follower starts by the time its row runs out of iterations, and has as many
    last = 2 * options.max_iter if follows else options.max_iter
    for it in range(1, last + 1):
        if stop is not None and stop():
            raise FitStopped(f"stopped by its caller after {it - 1} iterations")
        sel = s.rows
        exact = options.exact_newton_after is not None and it > options.exact_newton_after
        box = (
            lo.index_select(0, sel),
            hi.index_select(0, sel),
            free.index_select(0, sel),
            None if barrier is None else barrier.index_select(0, sel),
        )
        s = _iterate(
            objective,
            s,
            box,
            step_options,
            constants,
            exact,
        )
        if check_every and (it % check_every == 0 or it in (options.max_iter, last)):
            if waiting.numel():
                s, waiting, parent = _start_followers(
                    objective, s, waiting, parent, x0, lo, hi, options
                )
            finished = s.ended(options.max_iter)
            done = int(finished.sum())
            if done == finished.numel():
                break
            # finished rows stand still; dropping them (a copy of the state) pays from 1/8 on
            if 8 * done >= finished.numel():
                flush(s.select(finished))
                s = s.select(torch.logical_not(finished))
            few = finished.numel() - done <= options.tail_rows
            late = options.tail_rows > 0 and it >= options.tail_after_all
            if step_options is options and it >= TAIL_AFTER and (few or late):
                step_options = replace(options, trials="grid")
                constants = _candidates(
                    "grid", device, dtype, TAIL_DAMPING_FACTORS, TAIL_STEP_LENGTHS
                )
    flush(s)
    return out
