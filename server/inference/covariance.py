"""Uncertainties and correlations of a fit from the exact Hessian of ``-2 log L``.

``cov = inv(H / 2)`` over the free parameters (MINUIT's HESSE with ``errordef = 1`` on ``-2
log L``); fixed parameters get 0, a singular Hessian NaN. A free parameter along which ``-2 log
L`` has no curvature at the best fit (:func:`undetermined`: the data do not constrain it there,
e.g. a shapefactor of a bin without events on its bound 0), or along which with earlier ones
it is flat (:func:`dependent`: two normfactors of one sample, whose product alone is
measured), would make the whole Hessian singular or indefinite; the callers hold it at its best
fit, as a fixed one, so that the others' covariance is the one conditional on it (that of the
well-posed model with it fixed), and give it no uncertainty (NaN). Two forms, one answer:

- :func:`covariance` inverts a dense ``[B, P, P]`` Hessian.
- :class:`BlockHessian` keeps the structure of a model with per-bin parameters
  (:mod:`~pyhf_gpu_server.engine.sparsity`): a per-bin parameter meets only the shared
  parameters and the other per-bin parameters of its own bin, so ``H`` is a dense ``K x K``
  block over the ``K`` shared parameters, ``G x G`` blocks per bin, and their ``[N, G, K]``
  border. Its :meth:`~BlockHessian.covariance` eliminates the per-bin blocks: with ``A`` the
  block-diagonal part, ``C`` the border and ``S = H_KK - C^T A^-1 C`` the Schur complement,
  ``cov_KK = S^-1``, ``cov_MK = -A^-1 C S^-1`` and ``cov_MM = A^-1 + A^-1 C S^-1 C^T A^-1``:
  ``O(N G K^2 + K^3)`` for the shared block and the variances, ``O(M^2 K)`` for the whole
  matrix, where the dense inverse is ``O(P^3)`` (and the dense Hessian's assembly ``O(N P^2)``).

Example:
    >>> import torch
    >>> H = torch.tensor([[[8.0, 0.0], [0.0, 2.0]]], dtype=torch.float64)
    >>> unc, corr, _ = covariance(H, torch.tensor([[False, True]]))
    >>> unc.tolist(), corr.tolist()
    ([[0.5, 0.0]], [[[1.0, 0.0], [0.0, 0.0]]])
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ..engine.sparsity import BinBlocks

__all__ = [
    "BlockHessian",
    "checked_covariance",
    "conditional_uncertainties",
    "correlations",
    "covariance",
    "dependent",
    "undetermined",
]

#: a free parameter whose Hessian diagonal is at most this fraction of the row's largest has
#: no curvature: :func:`undetermined`
UNDETERMINED_RTOL = 1e-12
#: a free block of the Hessian (unit diagonal) whose smallest eigenvalue is below this has a
#: flat direction: :func:`dependent`
DEPENDENT_RTOL = 1e-9
#: at most this many flat directions per row are held (:func:`dependent`: two Cholesky
#: factorisations each, against the one inverse of :func:`covariance`)
DEPENDENT_ROUNDS = 1


def correlations(cov: Tensor) -> tuple[Tensor, Tensor]:
    """Uncertainties ``[B, P]`` and correlations ``[B, P, P]`` of covariances ``[B, P, P]``
    (0 where a variance is 0)."""
    unc = torch.sqrt(cov.diagonal(dim1=-2, dim2=-1))
    denom = unc.unsqueeze(2) * unc.unsqueeze(1)
    return unc, torch.where(denom > 0, cov / denom, torch.zeros_like(cov))


def undetermined(diagonal: Tensor, fixed: Tensor) -> Tensor:
    """``[B, P]`` bool: the free parameters without curvature, from the Hessian's diagonal
    ``[B, P]`` (at most :data:`UNDETERMINED_RTOL` of the row's largest).

    >>> undetermined(torch.tensor([[4.0, 0.0, 1e-3]]), torch.tensor([[False, False, False]]))
    tensor([[False,  True, False]])
    """
    scale = diagonal.abs().amax(-1, keepdim=True)
    return (diagonal <= UNDETERMINED_RTOL * scale) & fixed.logical_not()


def dependent(hessian: Tensor, held: Tensor, rounds: int = DEPENDENT_ROUNDS) -> Tensor:
    """``[B, K]`` bool: the columns of ``hessian [B, K, K]`` (not ``held [B, K]``) along which,
    with an earlier column, ``-2 log L`` is flat at the best fit (say, two normfactors of one
    sample: only their product is measured): in the unit-diagonal form ``U`` of the free block,
    positive semi-definite to within ``eps`` (:data:`DEPENDENT_RTOL`: ``U + eps I`` has a
    Cholesky factor), the column where the factorisation of ``U - eps I`` fails; one per round,
    up to ``rounds`` per row, each held for the next. A block with a clearly negative direction
    (a best fit on a bound where the likelihood curves down past it) holds nothing.

    >>> H = torch.tensor([[[2.0, 2.0, 0.0], [2.0, 2.0, 0.0], [0.0, 0.0, 3.0]]], dtype=torch.float64)
    >>> dependent(H, torch.zeros(1, 3, dtype=torch.bool)).tolist()
    [[False, True, False]]
    """
    K = hessian.shape[-1]
    found = torch.zeros_like(held)
    eye = torch.eye(K, dtype=hessian.dtype, device=hessian.device)
    columns = torch.arange(K, device=hessian.device)
    diagonal = hessian.diagonal(dim1=-2, dim2=-1)
    for _ in range(rounds):
        free = (held | found).logical_not().to(hessian.dtype)
        scale = torch.rsqrt(diagonal.abs().clamp(min=torch.finfo(hessian.dtype).tiny)) * free
        unit = hessian * (scale.unsqueeze(2) * scale.unsqueeze(1)) + torch.diag_embed(1 - free)
        _, info = torch.linalg.cholesky_ex(unit - DEPENDENT_RTOL * eye)
        _, negative = torch.linalg.cholesky_ex(unit + DEPENDENT_RTOL * eye)
        flat = (info > 0) & (negative == 0)
        found = found | (columns.eq((info - 1).unsqueeze(1)) & flat.unsqueeze(1))
    return found & held.logical_not()


def checked_covariance(
    unc: Tensor, corr: Tensor, cov: Tensor, held: Tensor, undetermined: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """The uncertainties, correlations and covariance of rows held at ``held [B, P]`` (fixed
    and undetermined), with NaN for the ``undetermined`` parameters' uncertainties and, in a
    row where some other free parameter's variance is not positive (a Hessian that is not
    positive definite: a minimum along no direction, or a singular one), NaN throughout."""
    free = held.logical_not()
    bad = ((torch.isfinite(unc) & (unc > 0)).logical_not() & free).any(-1)  # [B]
    nan = torch.full_like(unc, torch.nan)
    unc = torch.where(undetermined | bad.unsqueeze(1), nan, unc)
    bad = bad.view(-1, 1, 1)
    return unc, torch.where(bad, nan.unsqueeze(2), corr), torch.where(bad, nan.unsqueeze(2), cov)


def conditional_uncertainties(unc: Tensor) -> Tensor:
    """``unc [B, P]`` with the undetermined parameters' NaN as 0 (held at the best fit, as the
    others' covariance holds them) in rows where some uncertainty is finite; a row without
    any (no positive-definite Hessian) stays NaN."""
    some = torch.isfinite(unc).any(-1, keepdim=True)
    return torch.where(torch.isnan(unc) & some, torch.zeros_like(unc), unc)


def covariance(hessian: Tensor, fixed: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Uncertainties ``[B, P]``, correlations and covariance ``[B, P, P]`` from a dense Hessian
    ``[B, P, P]`` of ``-2 log L`` (see the module doc)."""
    free = fixed.logical_not().to(hessian.dtype)  # (``~`` and ``[:, None]`` of a device
    both = free.unsqueeze(2) * free.unsqueeze(1)  # tensor fail under FakeTensorMode)
    eye = torch.eye(hessian.shape[-1], dtype=hessian.dtype, device=hessian.device)
    inverse, info = torch.linalg.inv_ex(0.5 * hessian * both + eye * (1 - free).unsqueeze(1))
    cov = inverse * both
    cov = torch.where((info == 0).view(-1, 1, 1), cov, torch.full_like(cov, torch.nan))
    return (*correlations(cov), cov)


class BlockHessian(NamedTuple):
    """The exact Hessian of ``-2 log L`` in the block form of a model's per-bin parameters
    (see the module doc); slots of a bin past its per-bin parameters are zero."""

    shared: Tensor  # [B, K, K] among the shared parameters
    cross: Tensor  # [B, N, G, K] each bin's per-bin parameters against the shared ones
    per_bin: Tensor  # [B, N, G, G] among each bin's per-bin parameters
    blocks: BinBlocks

    def dense(self) -> Tensor:
        """The whole Hessian ``[B, P, P]`` (structural zeros included)."""
        B, N, G, K = self.cross.shape
        by_bin = self.shared.new_zeros(B, N * G, N * G)
        _bin_diagonal(by_bin, N, G).copy_(self.per_bin.permute(0, 2, 3, 1))
        return _whole(self.blocks, self.shared, self.cross.reshape(B, N * G, K), by_bin)

    def diagonal(self) -> Tensor:
        """The Hessian's diagonal ``[B, P]``, in parameter order."""
        B, N, G, K = self.cross.shape
        per_bin = self.per_bin.diagonal(dim1=-2, dim2=-1).reshape(B, N * G)
        per_bin = per_bin.index_select(1, self.blocks.position)
        shared = self.shared.diagonal(dim1=-2, dim2=-1)
        out = shared.new_zeros(B, K + per_bin.shape[1])
        return out.index_copy(1, self.blocks.shared, shared).index_copy(
            1, self.blocks.params, per_bin
        )

    def covariance(self, fixed: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """As :func:`covariance` of :meth:`dense`, by block elimination (see the module doc)."""
        B, N, G, K = self.cross.shape
        blocks, dtype = self.blocks, self.shared.dtype
        free = fixed.logical_not().to(dtype)
        free_shared = free.index_select(1, blocks.shared)  # [B, K]
        pad = free.new_zeros(B, 1)  # empty slots are "fixed": identity rows
        free_bin = torch.cat([free.index_select(1, blocks.params), pad], 1)
        free_bin = free_bin.index_select(1, blocks.slots.flatten()).view(B, N, G)
        A = 0.5 * self.per_bin * (free_bin.unsqueeze(-1) * free_bin.unsqueeze(-2))
        A = A + torch.diag_embed(1 - free_bin)
        C = 0.5 * self.cross * (free_bin.unsqueeze(-1) * free_shared.view(B, 1, 1, K))
        D = 0.5 * self.shared * (free_shared.unsqueeze(-1) * free_shared.unsqueeze(-2))
        D = D + torch.diag_embed(1 - free_shared)
        A_inv, info_bin = torch.linalg.inv_ex(A)  # [B, N, G, G]
        A_inv = A_inv * (free_bin.unsqueeze(-1) * free_bin.unsqueeze(-2))
        Y = (A_inv @ C).reshape(B, N * G, K)  # A^-1 C
        S_inv, info = torch.linalg.inv_ex(D - C.reshape(B, N * G, K).mT @ Y)
        S_inv = S_inv * (free_shared.unsqueeze(-1) * free_shared.unsqueeze(-2))
        YS = Y @ S_inv  # -cov_MK, by slot [B, N G, K]
        by_bin = YS @ Y.mT  # A^-1 C S^-1 C^T A^-1 [B, N G, N G]
        _bin_diagonal(by_bin, N, G).add_(A_inv.permute(0, 2, 3, 1))
        cov = _whole(blocks, S_inv, -YS, by_bin)
        ok = (info == 0) & (info_bin == 0).all(-1)
        cov = torch.where(ok.view(-1, 1, 1), cov, torch.full_like(cov, torch.nan))
        return (*correlations(cov), cov)


def _bin_diagonal(by_bin: Tensor, N: int, G: int) -> Tensor:
    """The view ``[B, G, G, N]`` of each bin's ``G x G`` block of ``by_bin [B, N G, N G]``."""
    return by_bin.view(by_bin.shape[0], N, G, N, G).diagonal(dim1=1, dim2=3)


def _whole(blocks: BinBlocks, shared: Tensor, cross: Tensor, by_bin: Tensor) -> Tensor:
    """``[B, P, P]`` in parameter order from its shared block ``[B, K, K]``, the border
    ``[B, N G, K]`` and the per-bin part ``[B, N G, N G]`` by slot (empty slots dropped)."""
    position = blocks.position
    cross = cross.index_select(1, position)  # [B, M, K]
    per_bin = by_bin.index_select(1, position).index_select(2, position)  # [B, M, M]
    whole = torch.cat([torch.cat([shared, cross.mT], 2), torch.cat([cross, per_bin], 2)], 1)
    index = torch.cat([blocks.shared, blocks.params])  # whole's order: shared, then per-bin
    order = torch.empty_like(index).index_copy(
        0, index, torch.arange(index.shape[0], device=index.device)
    )
    return whole.index_select(1, order).index_select(2, order)
