"""The twice negative log-likelihood of a batched HistFactory model as a minimiser objective.

:class:`TwiceNLL` binds a model, one dataset per row and one element per row, and gives
:func:`~pyhf_gpu_server.inference.minimize.minimize` the value, the gradient and a curvature
matrix of ``-2 log L`` for any subset of its rows. Three curvature choices:

- ``"hessian"``: the exact Hessian, in closed form (see :meth:`TwiceNLL.hessian`).
- ``"gauss-newton"``: the Jacobian of the main-bin rates (the engine's closed form, no
  autograd) gives ``J^T diag(2 n / lambda^2) J`` plus the exact
  curvature of the constraint terms. It drops the rates' own second derivatives, so it is
  exact for rates linear in the parameters and always positive semi-definite.
- ``"fisher"``: as ``"gauss-newton"`` with the expected weights ``2 / lambda`` (Fisher
  scoring).

The last two also take the gradient from that Jacobian (``J^T 2 (1 - n / lambda)``), so a
derivative call costs about one forward pass per modifier kind, and runs wherever the engine
does, FakeTensorMode included.

Example:
    >>> import torch
    >>> from pyhf_gpu_server.inference.examples import simple_model
    >>> model = simple_model([5.0], [10.0], [2.5], data=[12.0])
    >>> nll = TwiceNLL(model, model.observed, torch.zeros(1, dtype=torch.long), "hessian")
    >>> f, g, H, *_ = nll.derivatives(model.init, torch.arange(1))
    >>> constant = model.saturated_twice_nll(model.observed)  # f leaves it out
    >>> round(f.item(), 6), round((f + constant).item(), 6), H.shape
    (0.644555, 9.602105, torch.Size([1, 2, 2]))
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch
from torch import Tensor

from .covariance import BlockHessian, checked_covariance, covariance, dependent, undetermined
from .curvature import CPU_BLOCK_ROWS, Derivatives, Solver, choose_solver
from .errors import InferenceError

if TYPE_CHECKING:
    from ..engine.sparsity import BinBlocks

__all__ = ["CURVATURES", "Curvature", "TwiceNLL"]

Curvature = Literal["hessian", "gauss-newton", "fisher"]
CURVATURES: tuple[str, ...] = ("hessian", "gauss-newton", "fisher")


class TwiceNLL:
    """``-2 log L`` of ``model`` with one dataset and element per row.

    Args:
        model: a :class:`~pyhf_gpu_server.engine.HistFactoryModel` (any device and dtype).
        data: ``[B, N + A]`` observations plus auxiliary data, one row per minimisation.
        element: ``[B]`` LongTensor, the model element (patch) of each row.
        curvature: ``"hessian"``, ``"gauss-newton"`` or ``"fisher"`` (see the module doc).
        block_rows: evaluate at most this many rows per engine call (``None``: all at once).
            The default: :data:`~pyhf_gpu_server.inference.curvature.CPU_BLOCK_ROWS` on the
            CPU (cache-sized blocks, of equal size), unlimited elsewhere.
        solver: the minimiser's solver (``MinimizeOptions.solver``); where it is (or
            ``"auto"`` picks, :func:`~pyhf_gpu_server.inference.curvature.choose_solver`)
            ``"block"``, the Jacobian-based curvatures come in block form: the shared
            parameters' Jacobian and the per-bin parameters' one entry each, nothing
            structurally zero built.
        secant_memory: the minimiser's secant pairs (``MinimizeOptions.secant_memory``),
            for that choice.
    """

    def __init__(
        self,
        model,
        data: Tensor,
        element: Tensor,
        curvature: Curvature = "hessian",
        block_rows: int | Literal["auto"] | None = "auto",
        solver: Solver = "auto",
        secant_memory: int = 8,
    ):
        if curvature not in CURVATURES:
            raise InferenceError(f"curvature must be one of {CURVATURES}, not {curvature!r}")
        self.model = model
        self.data = data
        self.element = element
        self.curvature = curvature
        self.flat = torch.cat([model.unconstrained, model.poisson_constrained])
        # [B, P] the parameters of a Poisson constraint term with a positive auxiliary count:
        # -2 n log(gamma) rises without bound towards their lower bound (minimize's barrier);
        # None where the model has no Poisson constraint terms
        self.barrier: Tensor | None = None
        if model.poisson_constrained.numel():
            constraint = model.constraint
            aux = data.narrow(1, model.n_main, model.n_aux)
            present = constraint.present.index_select(0, element)
            counted = constraint.is_poisson & present & (aux > 0)
            counts = torch.zeros(data.shape[0], model.n_pars, dtype=torch.int32, device=data.device)
            self.barrier = counts.index_add_(1, constraint.param, counted.to(torch.int32)) > 0
        if block_rows == "auto":
            block_rows = CPU_BLOCK_ROWS if model.device.type == "cpu" else None
        self.block_rows = block_rows
        self._rounding_scale: Tensor | None = None
        self.blocks: BinBlocks | None = None
        if curvature != "hessian":
            structure = model.bin_parameters
            pick = choose_solver(
                model.n_main,
                model.n_pars,
                structure.n_per_bin,
                int(self.flat.shape[0]),
                secant_memory * (curvature == "gauss-newton"),
                solver,
            )
            if pick == "block" and structure.n_per_bin:
                self.blocks = model.bin_blocks()

    def _blocks(self, x: Tensor, rows: Tensor) -> list[tuple[Tensor, Tensor]]:
        total = x.shape[0]
        if self.block_rows is None or total <= self.block_rows:
            return [(x, rows)]
        blocks = -(-total // self.block_rows)
        size = -(-total // blocks)  # blocks of equal size: no small remainder
        return list(zip(x.split(size), rows.split(size), strict=True))

    def rounding_scale(self, rows: Tensor) -> Tensor:
        """``[R]``: the size of the terms a row's ``-2 log L`` deviance is summed from, the main
        counts and the Poisson constraints' auxiliary counts (each term's rounding error is
        ~eps times its count); the minimiser's convergence test is relative to it
        (:func:`~pyhf_gpu_server.inference.minimize.decrement_tolerance`)."""
        if self._rounding_scale is None:
            model = self.model
            main = self.data.narrow(1, 0, model.n_main).abs().sum(1)
            aux = self.data.narrow(1, model.n_main, model.n_aux).abs()
            poisson = torch.where(model.constraint.is_poisson, aux, 0.0).sum(1)
            self._rounding_scale = main + poisson
        return self._rounding_scale.index_select(0, rows)

    def value(self, x: Tensor, rows: Tensor) -> Tensor:
        """``-2 log L`` ``[R]`` at ``x [R, P]`` for the rows ``rows`` of the batch, less its
        data-only constant (the engine's ``deviance``: values near a minimum are of order 1,
        so float32 fits keep their digits); gradients and curvatures are ``-2 log L``'s."""
        return torch.cat(
            [
                self.model.deviance(
                    xb, self.data.index_select(0, rb), self.element.index_select(0, rb)
                )
                for xb, rb in self._blocks(x, rows)
            ]
        )

    def derivatives(self, x: Tensor, rows: Tensor) -> Derivatives:
        """Value ``[R]``, gradient ``[R, P]`` and curvature at ``x``: the exact Hessian ``[R, P,
        P]``, or for ``"gauss-newton"``/``"fisher"`` its low-rank pieces (see
        :class:`~pyhf_gpu_server.inference.curvature.Derivatives`)."""
        compute = self._exact if self.curvature == "hessian" else self._jacobian_based
        parts = [compute(xb, rb) for xb, rb in self._blocks(x, rows)]
        if len(parts) == 1:
            return parts[0]
        return Derivatives._make(
            (
                None
                if field[0] is None
                else field[0]
                if name in ("flat", "blocks")
                else torch.cat(field)
                for name, field in zip(Derivatives._fields, zip(*parts, strict=True), strict=True)
            )
        )

    def gradient(self, x: Tensor, rows: Tensor) -> tuple[Tensor, Tensor]:
        """Value ``[R]`` and gradient ``[R, P]`` only: ``J^T r`` as a vector-Jacobian product
        (:meth:`~pyhf_gpu_server.engine.HistFactoryModel.expected_main_gradient`), no
        Jacobian, no curvature (what chord steps need)."""
        parts = [self._value_and_gradient(xb, rb) for xb, rb in self._blocks(x, rows)]
        f, g = zip(*parts, strict=True)
        return torch.cat(f), torch.cat(g)

    def _value_and_gradient(self, x: Tensor, rows: Tensor) -> tuple[Tensor, Tensor]:
        data, element = self.data.index_select(0, rows), self.element.index_select(0, rows)
        rates, g = self.model.expected_main_gradient(
            x, element, lambda rates: self._residual(data, rates)[1]
        )
        g = self._with_constraints(g, x, data, element)[0]
        return self.model.deviance(x, data, element, rates), g

    def hessian(self, x: Tensor, rows: Tensor) -> Tensor:
        """The exact Hessian ``[R, P, P]`` of ``-2 log L``."""
        H = self._exact(x, rows).H
        assert H is not None  # exact derivatives carry the dense Hessian
        return H

    def covariance(self, x: Tensor, rows: Tensor, fixed: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Uncertainties ``[R, P]``, correlations and covariance ``[R, P, P]`` at minima ``x``
        from the exact Hessian (``fixed [R, P]`` get 0): by block elimination where the model
        has per-bin parameters (:class:`~.covariance.BlockHessian`), else dense. Parameters
        without curvature there (:func:`~.covariance.undetermined`), or along which with
        another it is flat (:func:`~.covariance.dependent`; among the shared ones where the
        model has per-bin parameters), are held at ``x`` for the others' and get the
        uncertainty NaN; a row whose Hessian is still not positive definite gets NaN
        throughout."""
        if self.model.bin_parameters.n_per_bin:
            block = self.block_hessian(x, rows)
            held = undetermined(block.diagonal(), fixed)
            shared = block.blocks.shared  # flat directions among the shared parameters
            flat = dependent(block.shared, (fixed | held).index_select(1, shared))
            held = held.index_copy(1, shared, held.index_select(1, shared) | flat)
            unc, corr, cov = block.covariance(fixed | held)
        else:
            hessian = self.hessian(x, rows)
            held = undetermined(hessian.diagonal(dim1=-2, dim2=-1), fixed)
            held = held | dependent(hessian, fixed | held)
            unc, corr, cov = covariance(hessian, fixed | held)
        return checked_covariance(unc, corr, cov, fixed | held, held)

    def block_hessian(self, x: Tensor, rows: Tensor) -> BlockHessian:
        """The exact Hessian of ``-2 log L`` in the block form of the model's per-bin
        parameters (:class:`~.covariance.BlockHessian`): the Jacobian's blocks give ``J^T W
        J``, :meth:`~pyhf_gpu_server.engine.HistFactoryModel.main_rates_curvature` the
        second-order term; nothing structurally zero is built."""
        parts = [self._block_exact(xb, rb) for xb, rb in self._blocks(x, rows)]
        if len(parts) == 1:
            return parts[0]
        return BlockHessian(
            torch.cat([part.shared for part in parts]),
            torch.cat([part.cross for part in parts]),
            torch.cat([part.per_bin for part in parts]),
            parts[0].blocks,
        )

    def _block_exact(self, x: Tensor, rows: Tensor) -> BlockHessian:
        model, blocks = self.model, self.model.bin_blocks()
        data, element = self.data.index_select(0, rows), self.element.index_select(0, rows)
        rates, J, bin_jacobian = model.expected_main_block_jacobian(x, element)
        ratio, residual = self._residual(data, rates)
        diagonal = self._with_constraints(torch.zeros_like(x), x, data, element)[1]
        second = model.main_rates_curvature(x, element, residual, block=True)
        w = self._weight(ratio, rates)
        shared = (J * w.unsqueeze(-1)).mT @ J + second.shared
        shared.diagonal(dim1=-2, dim2=-1).add_(diagonal.index_select(1, blocks.shared))
        R, N = J.shape[:2]
        pad = x.new_zeros(R, 1)
        u = torch.cat([bin_jacobian, pad], 1).index_select(1, blocks.slots.flatten())
        u = u.view(R, N, -1)  # [R, N, G] each slot's derivative of its bin (0: empty)
        wu = w.unsqueeze(-1) * u
        cross = wu.unsqueeze(-1) * J.unsqueeze(2) + second.cross
        per_bin = wu.unsqueeze(-1) * u.unsqueeze(-2) + second.per_bin
        constraint = torch.cat([diagonal.index_select(1, blocks.params), pad], 1)
        constraint = constraint.index_select(1, blocks.slots.flatten()).view(R, N, -1)
        per_bin = per_bin + torch.diag_embed(constraint)
        return BlockHessian(0.5 * (shared + shared.mT), cross, 0.5 * (per_bin + per_bin.mT), blocks)

    def _exact(self, x: Tensor, rows: Tensor) -> Derivatives:
        """Exact derivatives, all in closed form: the Gauss-Newton matrix, the rates' own
        second derivatives weighted by the residuals (:meth:`second_order`) and the
        constraint terms' diagonal (equal to ``torch.func``'s, and cheaper: BENCHMARKS.md)."""
        data, element = self.data.index_select(0, rows), self.element.index_select(0, rows)
        g, rates, J, ratio, residual, diagonal = self._gradient(x, data, element)
        gauss_newton = (J * self._weight(ratio, rates).unsqueeze(-1)).mT @ J
        H = gauss_newton + self.model.main_rates_curvature(x, element, residual)
        H.diagonal(dim1=-2, dim2=-1).add_(diagonal)
        return Derivatives(self.model.deviance(x, data, element, rates), g, 0.5 * (H + H.mT))

    def _gradient(
        self, x: Tensor, data: Tensor, element: Tensor
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        """The closed-form gradient ``[R, P]`` of ``-2 log L`` (``J^T r`` plus the constraint
        terms'), with what it is made of: the rates ``[R, N]``, their Jacobian ``[R, N, P]``,
        ``n / lambda`` and ``r`` ``[R, N]``, and the constraint terms' curvature ``[R, P]``."""
        rates, J = self.model.expected_main_jacobian(x, element)
        ratio, residual = self._residual(data, rates)
        g, diagonal = self._with_constraints(
            torch.einsum("rn,rnp->rp", residual, J), x, data, element
        )
        return g, rates, J, ratio, residual, diagonal

    def _jacobian_based(self, x: Tensor, rows: Tensor) -> Derivatives:
        data, element = self.data.index_select(0, rows), self.element.index_select(0, rows)
        if self.blocks is None:
            g, rates, J, ratio, residual, diagonal = self._gradient(x, data, element)
            bin_jacobian = None
        else:
            g, rates, J, bin_jacobian, ratio, residual, diagonal = self._block_gradient(
                x, data, element
            )
        if self.curvature == "fisher":  # the expected weight 2 / lambda (0 at a zero rate)
            weight = torch.where(rates > 0, 2.0 / rates, 0.0)
        else:
            weight = self._weight(ratio, rates)
        f = self.model.deviance(x, data, element, rates)
        secant = residual if self.curvature == "gauss-newton" else None  # secant terms
        return Derivatives(
            f, g, None, J, secant, weight, diagonal, self.flat, bin_jacobian, self.blocks
        )

    def _block_gradient(
        self, x: Tensor, data: Tensor, element: Tensor
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        """:meth:`_gradient` from the Jacobian in block form: the gradient, the rates, the
        shared parameters' Jacobian ``[R, N, K]`` and the per-bin ones' ``[R, M]``, ``n /
        lambda``, ``r`` and the constraint terms' curvature."""
        model, blocks = self.model, self.blocks
        assert blocks is not None  # the curvature's block form
        rates, J, bin_jacobian = model.expected_main_block_jacobian(x, element)
        ratio, residual = self._residual(data, rates)
        g = torch.zeros_like(x)
        g = g.index_copy(1, blocks.shared, (residual.unsqueeze(1) @ J).squeeze(1))
        g = g.index_copy(1, blocks.params, residual.index_select(1, blocks.bins) * bin_jacobian)
        g, diagonal = self._with_constraints(g, x, data, element)
        return g, rates, J, bin_jacobian, ratio, residual, diagonal

    def _residual(self, data: Tensor, rates: Tensor) -> tuple[Tensor, Tensor]:
        """``n / lambda`` (with 0 / 0 = 0: an empty bin with zero rate, as pyhf's xlogy) and
        ``r = d(-2 log L) / d lambda`` ``[R, N]``."""
        observed_main = data.narrow(1, 0, self.model.n_main)
        ratio = torch.where(observed_main > 0, observed_main / rates, 0.0)
        return ratio, 2.0 * (1.0 - ratio)

    @staticmethod
    def _weight(ratio: Tensor, rates: Tensor) -> Tensor:
        """``d2(-2 log L) / d lambda2 = 2 n / lambda^2`` ``[R, N]`` from ``ratio = n / lambda``:
        0 in a bin with no events, also where its rate is 0 and ``-2 log L = 2 lambda`` is
        linear (not ``0 / 0``: a fit whose shapefactor or POI empties such a bin would get a
        NaN curvature there and fail)."""
        return torch.where(ratio > 0, 2.0 * ratio / rates, 0.0)

    def _with_constraints(
        self, g: Tensor, x: Tensor, data: Tensor, element: Tensor
    ) -> tuple[Tensor, Tensor]:
        """The gradient ``g`` of the main terms plus the constraint terms', and the constraint
        terms' curvature ``[R, P]``."""
        model = self.model
        aux = data.narrow(1, model.n_main, model.n_aux)
        cg, ch = self._constraint_derivatives(x, aux, element)
        g = g.index_add(1, model.constraint.param, cg)
        diagonal = torch.zeros_like(g).index_add(1, model.constraint.param, ch)
        return g, diagonal

    def second_order(self, x: Tensor, rows: Tensor, r: Tensor) -> Tensor:
        """``sum_n r_n Hess(lambda_n)`` ``[R, P, P]`` of the main-bin rates at ``x`` for the
        residuals ``r [R, N]`` of :meth:`derivatives` (what ``"gauss-newton"`` drops), in
        closed form (:func:`~pyhf_gpu_server.engine.kernel.main_rates_curvature`)."""
        return self.model.main_rates_curvature(x, self.element.index_select(0, rows), r)

    def _constraint_derivatives(
        self, x: Tensor, aux: Tensor, element: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Exact first and second derivatives ``[R, A]`` of the constraint terms of ``-2 log L``
        with respect to each auxiliary datum's parameter."""
        constraint = self.model.constraint
        theta = x.index_select(1, constraint.param)
        sigma = constraint.sigma.index_select(0, element)
        scale = constraint.scale.index_select(0, element)
        normal_h = 2.0 / sigma**2
        normal_g = (theta - aux) * normal_h
        poisson_g = 2.0 * (scale - aux / theta)
        poisson_h = 2.0 * aux / theta**2
        present = constraint.present.index_select(0, element)
        g = torch.where(present, torch.where(constraint.is_poisson, poisson_g, normal_g), 0.0)
        h = torch.where(constraint.is_poisson, poisson_h, normal_h.expand_as(theta))
        return g, torch.where(present, h, 0.0)
