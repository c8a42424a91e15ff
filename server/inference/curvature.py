"""The minimiser's curvature matrices, and how damped Newton steps are solved from them.

Every iteration of :func:`~pyhf_gpu_server.inference.minimize.minimize` solves, per row and
per damping ``lambda_k``, ``(C + lambda_k |diag C|) p = -g`` on the movable parameters, where
``C`` is the row's curvature: the objective's Gauss-Newton matrix ``H`` plus, when the
objective gives the rate Jacobian ``J`` and residuals ``r``, the second-order term ``S``
learnt by Dennis, Gay and Welsch's secant update (NL2SOL). Three representations:

- :class:`DenseCurvature`: ``H`` and ``S`` as ``[R, P, P]`` matrices, steps by Cholesky
  factorisation: ``O(P^3)`` per row. Any objective (an exact Hessian included).
- :class:`LowRankCurvature`: ``H = diag(d) + J^T diag(w) J`` as the objective gives it (``d``:
  the constraint terms' curvature), and ``S`` as its last ``m`` secant pairs, so that
  ``C = diag(E) + U U^T - V V^T`` with ``r = N + 2m + F`` columns (``F``: the parameters whose
  ``d`` may vanish, see below). Steps by the Woodbury identity and one Schur complement:
  ``O(P r^2)`` per row, and no ``P x P`` matrix in memory: the cheaper one for the many
  constrained nuisance parameters and few bins of many HistFactory likelihoods.
- :class:`BlockCurvature`: the per-bin parameters (one bin each) eliminated bin by bin, then
  a dense Cholesky of the shared parameters' Schur complement.

The low-rank solve: with ``B = diag(E) + U U^T`` (positive definite as ``E > 0``),
``C = B - V V^T`` is positive definite exactly when the Schur complement ``I - V^T B^-1 V``
is (Haynsworth's inertia additivity), so one Cholesky factorisation of that ``[r-, r-]``
matrix both tests definiteness, as the dense Cholesky does, and gives the step
``p = B^-1 b + B^-1 V (I - V^T B^-1 V)^-1 V^T B^-1 b``. ``E`` must be positive: a parameter
without a constraint term (``d = 0``: a normfactor, or a Poisson-constrained gamma whose
auxiliary count may be 0) gets ``E = d + s`` and the column ``sqrt(s) e_j`` in ``V``, which
takes ``s`` back out exactly.

Example:
    >>> import torch
    >>> J = torch.tensor([[[1.0, 2.0, 0.0]]], dtype=torch.float64)  # one bin, three parameters
    >>> d = torch.tensor([[0.0, 1.0, 4.0]], dtype=torch.float64)  # parameter 0 unconstrained
    >>> w = torch.tensor([[3.0]], dtype=torch.float64)
    >>> low = LowRankCurvature(d, J, w, None, flat=torch.tensor([0]), memory=0)
    >>> dense = DenseCurvature(torch.diag_embed(d) + 3.0 * J.mT @ J)
    >>> g = torch.tensor([[1.0, -1.0, 2.0]], dtype=torch.float64)
    >>> movable = torch.ones(1, 3, dtype=torch.bool)
    >>> lams = torch.tensor([[0.0], [0.1]], dtype=torch.float64)
    >>> (p_low, ok_low), (p_dense, ok_dense) = low.steps(g, movable, lams), dense.steps(g, movable, lams)
    >>> torch.allclose(p_low, p_dense), ok_low.tolist() == ok_dense.tolist() == [[True], [True]]
    (True, True)
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Literal, NamedTuple

import torch
from torch import Tensor

if TYPE_CHECKING:
    from ..engine.sparsity import BinBlocks

__all__ = [
    "BLOCK_WITHOUT_PAIRS_SAVING",
    "CPU_BLOCK_ROWS",
    "SECANT_SHARE",
    "SOLVERS",
    "BlockCurvature",
    "DenseCurvature",
    "Derivatives",
    "LowRankCurvature",
    "Solver",
    "block_memory",
    "choose_solver",
    "curvature_of",
    "solve_costs",
]

# Rows per block for the CPU: a block's intermediates stay in cache, so per row a block runs
# faster than thousands of rows at once (BENCHMARKS.md, "Figures behind defaults").
CPU_BLOCK_ROWS = 256
#: the share of a step's solve that :class:`BlockCurvature`'s secant columns may add
#: (:func:`block_memory`)
SECANT_SHARE = 0.25
#: how much cheaper than the dense solve a block solve without secant pairs must be to be
#: chosen (:func:`choose_solver`): without them the curvature is Gauss-Newton's alone, which
#: crawls where the residuals are large (a conditional fit far from the data), so on a model
#: small enough for the dense solve to cost little, the dense one with its secant term wins
BLOCK_WITHOUT_PAIRS_SAVING = 8


class Derivatives(NamedTuple):
    """What an objective's ``derivatives`` returns (a plain ``(f, g, H)`` tuple works too).

    Either a dense curvature ``H [R, P, P]``, or (``H = None``) the low-rank pieces of
    ``H = diag(diagonal) + J^T diag(weight) J``: ``diagonal [R, P]`` (non-negative),
    ``weight [R, N]`` (non-negative) and ``flat [F]``, the parameters whose ``diagonal`` may
    be zero. For an objective ``sum_i phi_i(lambda_i(x))`` with a Gauss-Newton ``H``, ``J [R,
    N, P]`` (the Jacobian of the ``lambda_i``) and ``r [R, N]`` (the ``phi_i'``) let the
    minimiser learn the missing ``sum_i r_i Hess(lambda_i)`` by secant updates.

    With ``blocks`` (the model's per-bin parameters, :mod:`~pyhf_gpu_server.engine.sparsity`)
    the Jacobian comes in two parts: ``J [R, N, K]`` over the shared parameters and
    ``bin_jacobian [R, M]``, each per-bin parameter's derivative of its one bin; the
    minimiser then solves its steps by :class:`BlockCurvature`.
    """

    f: Tensor
    g: Tensor
    H: Tensor | None
    J: Tensor | None = None
    r: Tensor | None = None
    weight: Tensor | None = None
    diagonal: Tensor | None = None
    flat: Tensor | None = None
    bin_jacobian: Tensor | None = None
    blocks: BinBlocks | None = None


def _secant_pair(
    Ss: Tensor, step: Tensor, y: Tensor, y_sharp: Tensor, accept: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """The NL2SOL update ``S <- tau S + a y^T + y a^T`` from ``Ss = S step``: ``(tau, a,
    valid)``. ``step``: ``x_new - x_old``; ``y``: the gradient change; ``y_sharp = (J_new -
    J_old)^T r_new``, what ``S`` should explain (``S_new step = y_sharp``). Rows not
    ``valid`` (not accepted, or ``y.step`` not positive) keep their ``S``: ``tau = 1, a = 0``.
    """
    sSs = torch.linalg.vecdot(step, Ss)
    sy_sharp = torch.linalg.vecdot(step, y_sharp)
    tau = torch.where(sSs.abs() > 0, (sy_sharp.abs() / sSs.abs()).clamp(max=1.0), 1.0)
    v = y_sharp - Ss * tau.unsqueeze(-1)
    ys = torch.linalg.vecdot(y, step)
    valid = accept & (ys > 1e-12 * y.norm(dim=-1) * step.norm(dim=-1))
    ys = torch.where(valid, ys, 1.0)
    a = v / ys.unsqueeze(-1) - 0.5 * (torch.linalg.vecdot(step, v) / ys**2).unsqueeze(-1) * y
    a = torch.where(valid.unsqueeze(-1), a, 0.0)
    return torch.where(valid, tau, 1.0), a, valid


def _masked_scale(diag: Tensor, m: Tensor) -> Tensor:
    """Marquardt's damping scale ``|diag C|`` on the movable parameters (``m`` as 0/1), kept
    away from zero."""
    return torch.clamp(diag.abs(), min=1e-10 * (1 + diag.abs().amax(-1, keepdim=True))) * m


@dataclass
class DenseCurvature:
    """``C = H + S`` as ``[R, P, P]`` matrices; ``J``/``r`` (the last accepted rate Jacobian
    and residuals) are kept for the secant update when ``S`` is learnt."""

    H: Tensor
    S: Tensor | None = None
    J: Tensor | None = None
    r: Tensor | None = None

    def matrix(self) -> Tensor:
        return self.H if self.S is None else self.H + self.S

    def steps(self, g: Tensor, movable: Tensor, lams: Tensor) -> tuple[Tensor, Tensor]:
        """Steps ``p [K, R, P]`` solving ``(C + lam_k |diag C|) p = -g`` on the movable
        parameters for dampings ``lams [K, R]``, and ``ok [K, R]``: false where the damped
        matrix is not positive definite (or not finite). Rows and columns of non-movable
        parameters are replaced by the identity, so their step is zero."""
        C = self.matrix()
        m = movable.to(C.dtype)
        finite = torch.isfinite(C.sum((-2, -1)) + g.sum(-1))  # other rows are flagged, not fixed
        Cm = C * (m.unsqueeze(2) * m.unsqueeze(1))
        scale = _masked_scale(Cm.diagonal(dim1=-2, dim2=-1), m)
        A = Cm.unsqueeze(0).repeat(lams.shape[0], 1, 1, 1)  # [K, R, P, P]
        A.diagonal(dim1=-2, dim2=-1).add_(lams.unsqueeze(-1) * scale + (1 - m))
        L, info = torch.linalg.cholesky_ex(A)
        rhs = torch.nan_to_num(-g * m).unsqueeze(-1).expand(lams.shape[0], -1, -1, 1)
        p = torch.cholesky_solve(rhs, L).squeeze(-1)
        ok = (info == 0) & finite & torch.isfinite(p.sum(-1))
        return torch.where(ok.unsqueeze(-1), p * m, 0.0), ok

    def gauss_newton(self) -> Tensor:
        """The objective's own curvature ``H [R, P, P]``, without the secant term."""
        return self.H

    def adopt(self, new: Derivatives, accept: Tensor, step: Tensor, y: Tensor) -> None:
        """Take the curvature of ``new`` on the accepted rows (``step``, ``y``: their change
        of parameters and gradient), updating ``S``."""
        a2 = accept.view(-1, 1, 1)
        if self.S is not None:  # learnt S: J and r kept, and the objective gives them
            assert self.J is not None and self.r is not None
            assert new.J is not None and new.r is not None
            y_sharp = torch.einsum("rnp,rn->rp", new.J - self.J, new.r)
            Ss = torch.einsum("rpq,rq->rp", self.S, step)
            tau, a, valid = _secant_pair(Ss, step, y, y_sharp, accept)
            y = torch.where(valid.unsqueeze(-1), y, 0.0)  # a rejected trial's may be NaN
            self.S = self.S.mul_(tau.view(-1, 1, 1)).baddbmm_(
                torch.stack([a, y], -1), torch.stack([y, a], -2)
            )
            self.J = torch.where(a2, new.J, self.J)
            self.r = torch.where(accept.unsqueeze(-1), new.r, self.r)
        self.H = torch.where(a2, _dense(new), self.H)

    def select(self, keep: Tensor) -> DenseCurvature:
        optional = (None if v is None else v[keep] for v in (self.S, self.J, self.r))
        return DenseCurvature(self.H[keep], *optional)

    def cat(self, more) -> DenseCurvature:
        """This curvature's rows, then ``more``'s (rows that start later)."""
        S, J, r = (_cat(v, w) for v, w in ((self.S, more.S), (self.J, more.J), (self.r, more.r)))
        return DenseCurvature(torch.cat([self.H, more.H]), S, J, r)

    exact_step = True  # the exact curvature's Newton step may be tried (see minimize)


def _capacitance_step(gram: Tensor, n_u: int, n_v: int) -> tuple[Tensor, Tensor]:
    """The ``r x r`` part of a Woodbury solve of ``(B0 + U U^T - V V^T) p = b``.

    ``gram [K, R, r + 1, r + 1]``: ``[U V b]^T B0^-1 [U V b]`` (``n_u`` columns ``U``, ``n_v``
    columns ``V``, then ``b``). Returns ``t [K, R, r, 1]`` with ``p = B0^-1 (b + [U V] t)``,
    and ``ok [K, R]``: whether ``B0 + U U^T - V V^T`` is positive definite given that ``B0``
    is (Haynsworth's inertia additivity: ``I + U^T B0^-1 U`` always is, then the Schur
    complement ``I - V^T B^-1 V`` with ``B = B0 + U U^T`` decides).
    """
    dtype, device = gram.dtype, gram.device
    G_uu = gram.narrow(-2, 0, n_u).narrow(-1, 0, n_u)
    G_uv = gram.narrow(-2, 0, n_u).narrow(-1, n_u, n_v)
    G_vv = gram.narrow(-2, n_u, n_v).narrow(-1, n_u, n_v)
    h_u = gram.narrow(-2, 0, n_u).narrow(-1, n_u + n_v, 1)
    h_v = gram.narrow(-2, n_u, n_v).narrow(-1, n_u + n_v, 1)
    eye_u = torch.eye(n_u, dtype=dtype, device=device)
    L_u, info_u = torch.linalg.cholesky_ex(eye_u + G_uu)  # B = B0 + U U^T, by Woodbury
    ok = info_u == 0
    if not n_v:
        return -torch.cholesky_solve(h_u, L_u), ok
    X = torch.cholesky_solve(torch.cat([G_uv, h_u], -1), L_u)  # (I + G_uu)^-1 [G_uv h_u]
    eye_v = torch.eye(n_v, dtype=dtype, device=device)
    schur = eye_v - G_vv + G_uv.mT @ X.narrow(-1, 0, n_v)  # I - V^T B^-1 V
    L_v, info_v = torch.linalg.cholesky_ex(schur)  # C is positive definite iff this is
    y = torch.cholesky_solve(h_v - G_uv.mT @ X.narrow(-1, n_v, 1), L_v)
    z = torch.cholesky_solve(h_u + G_uv @ y, L_u)
    return torch.cat([-z, y], -2), ok & (info_v == 0)


@dataclass
class _SecantMemory:
    """The NL2SOL secant term ``S = sum_k c_k (a_k y_k^T + y_k a_k^T)`` of the last
    ``memory`` pairs ``(a_k, y_k)`` (``pairs_a``, ``pairs_y`` ``[R, m, P]``, weights ``c [R,
    m]``), shared by the curvatures that never hold ``S`` as a ``P x P`` matrix (their
    keyword fields)."""

    memory: int = field(default=8, kw_only=True)
    pairs_a: Tensor | None = field(default=None, kw_only=True)
    pairs_y: Tensor | None = field(default=None, kw_only=True)
    c: Tensor | None = field(default=None, kw_only=True)
    slot: int = field(default=0, kw_only=True)

    def _pairs(self) -> tuple[Tensor, Tensor, Tensor]:
        """``(pairs_a, pairs_y, c)``, set since ``__post_init__``."""
        assert self.pairs_a is not None and self.pairs_y is not None and self.c is not None
        return self.pairs_a, self.pairs_y, self.c

    def _init_pairs(self, d: Tensor, r: Tensor | None) -> None:
        if r is None:
            self.memory = 0
        if self.pairs_a is None:
            R, P = d.shape
            self.pairs_a = d.new_zeros(R, self.memory, P)
            self.pairs_y = d.new_zeros(R, self.memory, P)
            self.c = d.new_zeros(R, self.memory)

    def _secant_columns(self) -> tuple[Tensor, Tensor]:
        """``S = U U^T - V V^T``: ``U, V [R, m, P]``, from each pair scaled to equal norms
        (``a y^T + y a^T = (b a)(y / b)^T + ...``) so that neither column cancels."""
        a, y, c = self._pairs()
        a_norm, y_norm = a.norm(dim=-1, keepdim=True), y.norm(dim=-1, keepdim=True)
        ratio = torch.where(a_norm > 0, y_norm / a_norm.clamp(min=1e-300), 1.0)
        beta = ratio.sqrt()
        a, y = a * beta, y / beta
        weight = (0.5 * c).sqrt().unsqueeze(-1)
        return (a + y) * weight, (a - y) * weight

    def _secant_times(self, x: Tensor) -> Tensor:
        """``S x`` ``[R, P]`` for ``x [R, P]``."""
        pairs_a, pairs_y, c = self._pairs()
        x = x.unsqueeze(-1)
        ya = (pairs_y @ x).squeeze(-1) * c  # [R, m]
        ay = (pairs_a @ x).squeeze(-1) * c
        return (ya.unsqueeze(1) @ pairs_a + ay.unsqueeze(1) @ pairs_y).squeeze(1)

    def _secant_diagonal(self) -> Tensor:
        """``diag S`` ``[R, P]``."""
        pairs_a, pairs_y, c = self._pairs()
        return 2.0 * (c.unsqueeze(1) @ (pairs_a * pairs_y)).squeeze(1)

    def _learn(self, y_sharp: Tensor, accept: Tensor, step: Tensor, y: Tensor) -> None:
        """The NL2SOL update from an accepted ``step``: the newest pair replaces the oldest."""
        tau, a, valid = _secant_pair(self._secant_times(step), step, y, y_sharp, accept)
        pairs_a, pairs_y, c = self._pairs()
        slot = torch.arange(self.memory, device=step.device) == self.slot
        write = valid.view(-1, 1, 1) & slot.view(1, -1, 1)  # [R, m, 1]
        self.pairs_a = torch.where(write, a.unsqueeze(1), pairs_a)
        self.pairs_y = torch.where(write, y.unsqueeze(1), pairs_y)
        self.c = torch.where(write.squeeze(-1), torch.ones_like(c), c * tau.unsqueeze(-1))
        self.slot = (self.slot + 1) % self.memory

    def _map_rows(self, take):
        """The curvature of the rows ``take`` picks from every per-row tensor."""
        return type(self)(
            **{
                k: take(v) if isinstance(v, Tensor) and k not in self._not_per_row else v
                for k, v in zip(_names(self), _values(self), strict=True)
            }
        )

    def select(self, keep: Tensor):
        return self._map_rows(lambda v: v[keep])

    def cat(self, more):
        """This curvature's rows, then ``more``'s (rows that start later)."""
        return type(self)(
            **{
                k: torch.cat([v, w]) if isinstance(v, Tensor) and k not in self._not_per_row else v
                for k, v, w in zip(_names(self), _values(self), _values(more), strict=True)
            }
        )


@dataclass
class LowRankCurvature(_SecantMemory):
    """``C = diag(d) + J^T diag(w) J + sum_k c_k (a_k y_k^T + y_k a_k^T)`` with the last
    ``memory`` secant pairs ``(a_k, y_k)`` (``[R, m, P]`` each, weights ``c [R, m]``); no
    secant term when ``r`` is None or ``memory`` is 0. ``flat [F]``: the parameters whose
    ``d`` may be zero (kept as their one-hot rows ``[F, P]``). Columns are stored ``[R,
    columns, P]``, parameters innermost, so that scaling them by a per-parameter diagonal
    runs over contiguous memory."""

    d: Tensor
    J: Tensor
    w: Tensor
    r: Tensor | None
    flat: Tensor

    _not_per_row = ("flat",)
    exact_step = True  # the exact curvature's Newton step may be tried (see minimize)

    def __post_init__(self) -> None:
        if self.flat.dim() == 1:  # indices [F] -> their one-hot rows [F, P], built once
            columns = torch.arange(self.d.shape[-1], device=self.d.device)
            self.flat = (self.flat.unsqueeze(1) == columns.unsqueeze(0)).to(self.d.dtype)
        self._init_pairs(self.d, self.r)

    def gauss_newton(self) -> Tensor:
        """``H = diag(d) + J^T diag(w) J`` ``[R, P, P]``, without the secant term."""
        return torch.diag_embed(self.d) + (self.J * self.w.unsqueeze(-1)).mT @ self.J

    def diagonal(self) -> Tensor:
        """``diag C`` ``[R, P]``."""
        gauss_newton = (self.w.unsqueeze(1) @ (self.J * self.J)).squeeze(1)
        return self.d + gauss_newton + self._secant_diagonal()

    def steps(self, g: Tensor, movable: Tensor, lams: Tensor) -> tuple[Tensor, Tensor]:
        """As :meth:`DenseCurvature.steps`, by Woodbury and a Schur complement; on the CPU in
        blocks of :data:`CPU_BLOCK_ROWS` rows (their columns then stay in cache)."""
        rows = g.shape[0]
        if self.d.device.type != "cpu" or rows <= CPU_BLOCK_ROWS:
            return self._steps(g, movable, lams)
        parts = [
            self._rows(start, min(CPU_BLOCK_ROWS, rows - start))._steps(
                g.narrow(0, start, length := min(CPU_BLOCK_ROWS, rows - start)),
                movable.narrow(0, start, length),
                lams.narrow(1, start, length),
            )
            for start in range(0, rows, CPU_BLOCK_ROWS)
        ]
        return torch.cat([p for p, _ in parts], 1), torch.cat([ok for _, ok in parts], 1)

    def _rows(self, start: int, length: int) -> LowRankCurvature:
        """The rows ``start .. start + length`` (views)."""
        return self._map_rows(lambda v: v.narrow(0, start, length))

    def _steps(self, g: Tensor, movable: Tensor, lams: Tensor) -> tuple[Tensor, Tensor]:
        """:meth:`steps` on all rows at once.

        Everything ``P``-sized is two batched products per damping: the Gram matrix
        ``W E^-1 [W b]^T`` of the columns ``W = [U V]`` and the right-hand side ``b``, then
        ``p = E^-1 (b + W^T t)``; the rest is ``r x r`` algebra.
        """
        dtype = self.d.dtype
        m = movable.to(dtype)
        scale = _masked_scale(self.diagonal() * m, m)
        shift = scale * self.flat.sum(0)  # the flat parameters' E gets |diag C| ...
        secant_u, secant_v = self._secant_columns()
        b = torch.nan_to_num(-g * m)
        Wb = torch.cat(
            [
                self.J * self.w.clamp(min=0).sqrt().unsqueeze(-1),
                secant_u,
                secant_v,
                self.flat * shift.sqrt().unsqueeze(1),  # ... and is taken out here
                b.unsqueeze(1),
            ],
            1,
        ) * m.unsqueeze(1)  # [R, r + 1, P]: C = diag(E) + U U^T - V V^T with [U V] = W
        n_u = self.J.shape[1] + self.memory
        n_v = Wb.shape[1] - 1 - n_u
        E = (self.d.unsqueeze(0) + lams.unsqueeze(-1) * scale + shift) * m + (1 - m)  # [K, R, P]
        E_inv = E.reciprocal()
        gram = torch.stack(
            [(Wb * e.unsqueeze(1)) @ Wb.mT for e in E_inv.unbind(0)]
        )  # [K, R, r+1, r+1]
        t, ok = _capacitance_step(gram, n_u, n_v)
        W = Wb.narrow(1, 0, n_u + n_v)
        p = (t.squeeze(-1).transpose(0, 1) @ W).transpose(0, 1)  # [K, R, P], W not copied K times
        p = (b + p) * E_inv * m
        ok = ok & torch.isfinite(gram.sum((-2, -1)) + p.sum(-1))
        return torch.where(ok.unsqueeze(-1), p, 0.0), ok

    def adopt(self, new: Derivatives, accept: Tensor, step: Tensor, y: Tensor) -> None:
        """As :meth:`DenseCurvature.adopt`; the newest secant pair replaces the oldest."""
        a1, a2 = accept.unsqueeze(-1), accept.view(-1, 1, 1)
        assert new.J is not None and new.weight is not None and new.diagonal is not None
        if self.memory:  # a secant term: r kept, and the objective gives it
            assert new.r is not None and self.r is not None
            self._learn((new.r.unsqueeze(1) @ (new.J - self.J)).squeeze(1), accept, step, y)
            self.r = torch.where(a1, new.r, self.r)
        self.J = torch.where(a2, new.J, self.J)
        self.w = torch.where(a1, new.weight, self.w)
        self.d = torch.where(a1, new.diagonal, self.d)


@dataclass
class BlockCurvature(_SecantMemory):
    """``C = diag(d) + J^T diag(w) J + S`` for a Jacobian whose per-bin columns have one
    entry each (:mod:`~pyhf_gpu_server.engine.sparsity`): ``J [R, N, K]`` over the ``K``
    shared parameters, ``jb [R, M]`` the per-bin parameters' derivatives of their own bins,
    ``S`` the last ``memory`` secant pairs (as :class:`LowRankCurvature`'s).

    Steps by block elimination: per bin, the per-bin parameters' block ``A_n = diag(E_n) +
    w_n u_n u_n^T`` (``G x G``, ``G`` the most per-bin parameters a bin has, usually 1) is
    factorised; eliminating them leaves the shared block's Schur complement ``diag(E_s) +
    J^T diag(w') J`` with ``w'_n = w_n - w_n^2 u_n^T A_n^-1 u_n``, a dense ``K x K`` Cholesky;
    the secant term is added by Woodbury (:func:`_capacitance_step`) on ``2 m`` columns. Per
    row and damping ``O(N K^2 + K^3 + N G^3)``: the per-bin parameters cost linearly. ``C`` is
    positive definite exactly when every ``A_n``, the Schur complement and the capacitance
    matrix are (Haynsworth), so ``ok`` means what the dense Cholesky's does.
    """

    d: Tensor
    J: Tensor
    jb: Tensor
    w: Tensor
    r: Tensor | None
    blocks: BinBlocks

    _not_per_row = ()
    # the exact curvature's Newton step would be a dense P x P factorisation (and its
    # second-order term a dense P x P assembly): not tried on models this solver serves
    exact_step = False

    def __post_init__(self) -> None:
        self._init_pairs(self.d, self.r)

    def _join(self, shared: Tensor, per_bin: Tensor) -> Tensor:
        """``[..., P]`` (on the last axis) from its shared and per-bin parts."""
        blocks = self.blocks
        out = shared.new_zeros(*shared.shape[:-1], self.d.shape[-1])
        dim = out.dim() - 1
        return out.index_copy(dim, blocks.shared, shared).index_copy(dim, blocks.params, per_bin)

    def _by_bin(self, per_bin: Tensor, pad: float) -> Tensor:
        """``[..., M]`` per-bin values as ``[..., N, G]`` by bin (``pad`` in empty slots)."""
        slots = self.blocks.slots
        padded = torch.cat([per_bin, torch.full_like(per_bin.narrow(-1, 0, 1), pad)], -1)
        return padded.index_select(-1, slots.flatten()).unflatten(-1, slots.shape)

    def jacobian(self) -> Tensor:
        """The whole rate Jacobian ``[R, N, P]`` (structural zeros included)."""
        R, N, _ = self.J.shape
        per_bin = self.J.new_zeros(R, N, self.blocks.params.shape[0])
        per_bin = per_bin.index_put(
            (
                torch.arange(R, device=self.J.device).unsqueeze(1),
                self.blocks.bins.unsqueeze(0),
                torch.arange(per_bin.shape[-1], device=self.J.device).unsqueeze(0),
            ),
            self.jb,
        )
        return self._join(self.J, per_bin)

    def gauss_newton(self) -> Tensor:
        """``H = diag(d) + J^T diag(w) J`` ``[R, P, P]``, without the secant term."""
        J = self.jacobian()
        return torch.diag_embed(self.d) + (J * self.w.unsqueeze(-1)).mT @ J

    def diagonal(self) -> Tensor:
        """``diag C`` ``[R, P]``."""
        shared = (self.w.unsqueeze(1) @ (self.J * self.J)).squeeze(1)
        per_bin = self.w.index_select(1, self.blocks.bins) * self.jb * self.jb
        return self.d + self._join(shared, per_bin) + self._secant_diagonal()

    def steps(self, g: Tensor, movable: Tensor, lams: Tensor) -> tuple[Tensor, Tensor]:
        """As :meth:`DenseCurvature.steps`, by block elimination (see the class doc)."""
        blocks, dtype = self.blocks, self.d.dtype
        K_d, R = lams.shape
        N, G = blocks.slots.shape
        m = movable.to(dtype)
        scale = _masked_scale(self.diagonal() * m, m)
        E = (self.d.unsqueeze(0) + lams.unsqueeze(-1) * scale) * m + (1 - m)  # [K, R, P]
        J, m_s = self.J, m.index_select(1, blocks.shared)  # [R, N, K_s]: held columns are
        w = self.w.clamp(min=0)  # masked in the Schur complement and its right-hand sides
        u = self._by_bin(self.jb * m.index_select(1, blocks.params), 0.0)  # [R, N, G]
        E_bin = self._by_bin(E.index_select(2, blocks.params), 1.0)  # [K, R, N, G]
        u_outer = w.view(1, R, N, 1, 1) * (u.unsqueeze(-1) * u.unsqueeze(-2))
        L_bin, info_bin = torch.linalg.cholesky_ex(torch.diag_embed(E_bin) + u_outer)
        u_solved = torch.cholesky_solve(u.unsqueeze(-1).expand(K_d, -1, -1, -1, -1), L_bin)
        eliminated = w - w * w * (u.unsqueeze(-1) * u_solved).sum((-2, -1))  # w' [K, R, N]
        schur = torch.stack(  # J^T diag(w') J [K, R, K_s, K_s], one damping's J at a time
            [(J * e.unsqueeze(-1)).mT @ J for e in eliminated.clamp(min=0).unbind(0)]
        )
        schur = schur * (m_s.unsqueeze(-1) * m_s.unsqueeze(-2))
        schur.diagonal(dim1=-2, dim2=-1).add_(E.index_select(2, blocks.shared))
        L_s, info_s = torch.linalg.cholesky_ex(schur)

        def solve(X: Tensor) -> Tensor:
            """``C0^-1 X`` for ``X [K, R, P, c]``, ``C0`` without the secant term."""
            c = X.shape[-1]
            x_bin = self._by_bin(X.index_select(2, blocks.params).mT, 0.0)  # [K, R, c, N, G]
            z = torch.cholesky_solve(x_bin.permute(0, 1, 3, 4, 2), L_bin)  # [K, R, N, G, c]
            q = w.view(1, R, N, 1) * (u.unsqueeze(-1) * z).sum(-2)  # [K, R, N, c]
            rhs = (X.index_select(2, blocks.shared) - J.mT @ q) * m_s.unsqueeze(-1)
            p_s = torch.cholesky_solve(rhs, L_s)
            v = w.view(1, R, N, 1) * (J @ p_s)  # [K, R, N, c]
            p_bin = (z - u_solved * v.unsqueeze(-2)).reshape(K_d, R, N * G, c)
            p_bin = p_bin.index_select(2, blocks.position)  # [K, R, M, c]
            return self._join(p_s.mT, p_bin.mT).mT

        b = torch.nan_to_num(-g * m)
        ok = (info_bin == 0).all(-1) & (info_s == 0)
        if self.memory:
            secant_u, secant_v = self._secant_columns()
            Wb = torch.cat([secant_u, secant_v, b.unsqueeze(1)], 1) * m.unsqueeze(1)
            X = solve(Wb.mT.unsqueeze(0).expand(K_d, -1, -1, -1))  # [K, R, P, 2m + 1]
            gram = Wb.unsqueeze(0) @ X
            t, ok_secant = _capacitance_step(gram, self.memory, self.memory)
            p = X.narrow(-1, 2 * self.memory, 1) + X.narrow(-1, 0, 2 * self.memory) @ t
            ok = ok & ok_secant & torch.isfinite(gram.sum((-2, -1)))
        else:
            p = solve(b.unsqueeze(-1).unsqueeze(0).expand(K_d, -1, -1, -1))
        p = p.squeeze(-1) * m
        ok = ok & torch.isfinite(p.sum(-1) + g.sum(-1))
        return torch.where(ok.unsqueeze(-1), p, 0.0), ok

    def adopt(self, new: Derivatives, accept: Tensor, step: Tensor, y: Tensor) -> None:
        """As :meth:`DenseCurvature.adopt`; the newest secant pair replaces the oldest."""
        a1, a2 = accept.unsqueeze(-1), accept.view(-1, 1, 1)
        assert new.J is not None and new.bin_jacobian is not None
        assert new.weight is not None and new.diagonal is not None
        if self.memory:  # a secant term: r kept, and the objective gives it
            assert new.r is not None and self.r is not None
            shared = (new.r.unsqueeze(1) @ (new.J - self.J)).squeeze(1)
            per_bin = new.r.index_select(1, self.blocks.bins) * (new.bin_jacobian - self.jb)
            self._learn(self._join(shared, per_bin), accept, step, y)
            self.r = torch.where(a1, new.r, self.r)
        self.J = torch.where(a2, new.J, self.J)
        self.jb = torch.where(a1, new.bin_jacobian, self.jb)
        self.w = torch.where(a1, new.weight, self.w)
        self.d = torch.where(a1, new.diagonal, self.d)


def _cat(a: Tensor | None, b: Tensor | None) -> Tensor | None:
    return None if a is None or b is None else torch.cat([a, b])


def _names(obj) -> list[str]:
    return [f.name for f in fields(obj)]


def _values(obj) -> list:
    return [getattr(obj, name) for name in _names(obj)]


def _dense(d: Derivatives) -> Tensor:
    """``H [R, P, P]`` of derivatives, building it from the low-rank pieces if need be."""
    if d.H is not None:
        return d.H
    assert d.diagonal is not None and d.weight is not None and d.J is not None
    return torch.diag_embed(d.diagonal) + torch.einsum("rn,rnp,rnq->rpq", d.weight, d.J, d.J)


Solver = Literal["auto", "dense", "low-rank", "block"]
SOLVERS: tuple[str, ...] = ("auto", "dense", "low-rank", "block")


def solve_costs(
    n_main: int, n_pars: int, n_per_bin: int, n_flat: int, memory: int
) -> dict[str, float]:
    """Floating-point operations per row and damping of each solver's step (leading terms):
    dense ``N P^2 + P^3 / 3`` (the curvature's assembly and Cholesky), low-rank ``P r^2 +
    r^3 / 3`` (``r = N + 2 memory + F``), block ``N K^2 + K^3 / 3 + 2 (2 memory + 1) (N K +
    K^2)`` (``K = P - M`` shared parameters; the secant columns' solves)."""
    P, N = n_pars, n_main
    rank = N + 2 * memory + n_flat
    K = P - n_per_bin
    return {
        "dense": N * P * P + P**3 / 3,
        "low-rank": P * rank * rank + rank**3 / 3,
        "block": N * K * K + K**3 / 3 + 2 * (2 * memory + 1) * (N * K + K * K),
    }


def block_memory(n_main: int, n_pars: int, n_per_bin: int, memory: int) -> int:
    """The secant pairs :class:`BlockCurvature` keeps: ``memory`` where their ``2 memory``
    columns' solves add at most :data:`SECANT_SHARE` to a step's (:func:`solve_costs`), else
    0 (the Gauss-Newton curvature alone). With few shared parameters a step is mostly the
    per-bin eliminations, which the columns multiply, and the secant term does not save as
    many iterations as it costs (BENCHMARKS.md, "Figures behind defaults").

    >>> block_memory(1600, 2107, 1600, 8)  # 507 shared parameters: the Schur complement dominates
    8
    >>> block_memory(800, 2047, 2000, 8)  # 47 shared parameters
    0
    """
    with_pairs = solve_costs(n_main, n_pars, n_per_bin, 0, memory)["block"]
    without = solve_costs(n_main, n_pars, n_per_bin, 0, 0)["block"]
    return memory if with_pairs <= (1 + SECANT_SHARE) * without else 0


def choose_solver(
    n_main: int, n_pars: int, n_per_bin: int, n_flat: int, memory: int, solver: Solver = "auto"
) -> str:
    """The solver a model's steps use: ``solver`` unless ``"auto"``; then low-rank when its
    rank ``N + 2 memory + F`` is at most half the parameter count (its ``O(P r^2)`` solve then
    beats the dense ``O(P^3)`` one; BENCHMARKS.md, "Figures behind defaults"), else block
    when the model has per-bin parameters and :func:`solve_costs` puts it (with the pairs
    :func:`block_memory` keeps) at under half the dense cost (without pairs: under
    1 / :data:`BLOCK_WITHOUT_PAIRS_SAVING` of it), else dense.

    >>> choose_solver(5, 124, 5, 3, 8)  # a published SUSY likelihood: few bins
    'low-rank'
    >>> choose_solver(1600, 2107, 1600, 5, 8)  # an analysis: a gamma per bin
    'block'
    >>> choose_solver(6, 10, 4, 0, 8)  # a small model with a staterror
    'dense'
    >>> choose_solver(40, 60, 0, 2, 8)
    'dense'
    """
    if solver != "auto":
        return solver
    if 2 * (n_main + 2 * memory + n_flat) <= n_pars:
        return "low-rank"
    dense = solve_costs(n_main, n_pars, n_per_bin, n_flat, memory)["dense"]
    pairs = block_memory(n_main, n_pars, n_per_bin, memory)
    saving = 2 if pairs else BLOCK_WITHOUT_PAIRS_SAVING
    if (
        n_per_bin
        and saving * solve_costs(n_main, n_pars, n_per_bin, n_flat, pairs)["block"] < dense
    ):
        return "block"
    return "dense"


def curvature_of(
    d: Derivatives, secant: bool, solver: Solver, memory: int
) -> DenseCurvature | LowRankCurvature | BlockCurvature:
    """The curvature for the first derivatives ``d`` of a minimisation.

    Derivatives in block form (``d.blocks``: the objective chose it, see
    :func:`choose_solver`) give a :class:`BlockCurvature`; otherwise ``solver``:
    ``"dense"``, ``"low-rank"`` (needs ``H = None`` and its pieces) or ``"auto"``
    (:func:`choose_solver` on the pieces' sizes).
    """
    secant = secant and d.J is not None and d.r is not None
    if d.blocks is not None:
        assert d.diagonal is not None and d.J is not None
        assert d.bin_jacobian is not None and d.weight is not None
        (N, K), M = d.J.shape[1:], d.bin_jacobian.shape[1]
        memory = block_memory(N, K + M, M, memory)
        r = d.r if secant and memory else None
        return BlockCurvature(d.diagonal, d.J, d.bin_jacobian, d.weight, r, d.blocks, memory=memory)
    if d.H is None and solver != "dense":  # the low-rank pieces are given
        assert d.J is not None and d.flat is not None
        assert d.diagonal is not None and d.weight is not None
        N, P = d.J.shape[1:]
        pick = choose_solver(N, P, 0, d.flat.shape[0], memory * secant, solver)
        if pick == "low-rank":
            return LowRankCurvature(
                d.diagonal, d.J, d.weight, d.r if secant else None, d.flat, memory=memory
            )
    H = _dense(d)
    if not secant:
        return DenseCurvature(H)
    return DenseCurvature(H, torch.zeros_like(H), d.J, d.r)
