"""The per-call path: pure tensor functions of a model's precomputed tensors.

Nothing here reads host memory, calls ``.item()`` or loops over bins; every function takes
the model's tensors explicitly (:class:`MainTensors`, :class:`ConstraintTensors`) so that
one ``torch.compile`` of them serves every model of the same structure. Indexing is spelled
with ``index_select``/``narrow``: they behave the same everywhere, FakeTensorMode included
(the device hygiene tests), where Python ``tensor[...]`` indexing of a cuda tensor fails.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .interpolation import (
    histosys_basis,
    histosys_basis_derivative,
    normsys_log_factor,
    normsys_log_factor_and_slope,
)

LOG_SQRT_2PI = math.log(math.sqrt(2.0 * math.pi))


class MainTensors(NamedTuple):
    """Main-model tensors over ``U`` sample variants and ``N`` bins (``Q = U * N`` columns)."""

    nominal: torch.Tensor  # [Q]
    membership: torch.Tensor  # [E, U] 1 where element e sums variant u
    histosys_params: torch.Tensor  # [J_h] parameter index of each histosys parameter
    histosys_coefficients: torch.Tensor  # [K * J_h, Q]
    normsys_param: torch.Tensor  # [T] parameter index of each normsys entry
    normsys_column: torch.Tensor  # [T] column of each normsys entry
    normsys_coefficients: torch.Tensor  # [8, T]
    multiplier_params: torch.Tensor  # [M, Q] parameter indices; P means "times 1"


class ConstraintTensors(NamedTuple):
    """Auxiliary-data tensors: one constrained parameter per auxiliary datum."""

    param: torch.Tensor  # [A]
    is_poisson: torch.Tensor  # [A] bool
    sigma: torch.Tensor  # [E, A] Normal sigma (1 on Poisson slots)
    scale: torch.Tensor  # [E, A] Poisson rate factor (1 on Normal slots)


class _RateFactors(NamedTuple):
    base: torch.Tensor  # [B, Q] nominal + histosys shift
    normsys: torch.Tensor  # [B, Q] product of normsys factors
    multipliers: torch.Tensor  # [B, Q] product of plain multipliers
    normsys_slope: torch.Tensor | None = None  # [B, T] d log|factor| / d alpha per entry


def _rate_factors(
    pars: torch.Tensor,
    main: MainTensors,
    histosys_code: str,
    normsys_code: str,
    with_slopes: bool = False,
) -> _RateFactors:
    rows = pars.shape[0]
    base = main.nominal.expand(rows, -1)
    normsys = torch.ones_like(base)
    multipliers = torch.ones_like(base)
    slope = None
    if main.histosys_params.numel():
        basis = histosys_basis(histosys_code, pars.index_select(1, main.histosys_params))
        base = base + basis.reshape(rows, -1) @ main.histosys_coefficients
    if main.normsys_column.numel():
        alpha = pars.index_select(1, main.normsys_param)
        if with_slopes:
            log_abs, negative, slope = normsys_log_factor_and_slope(
                normsys_code, alpha, main.normsys_coefficients
            )
        else:
            log_abs, negative = normsys_log_factor(normsys_code, alpha, main.normsys_coefficients)
        total_log = torch.zeros_like(base).index_add(1, main.normsys_column, log_abs)
        total_negative = torch.zeros_like(base).index_add(1, main.normsys_column, negative)
        normsys = (1.0 - 2.0 * torch.remainder(total_negative, 2.0)) * torch.exp(total_log)
    if main.multiplier_params.numel():
        multipliers = _multiplier_factors(pars, main).prod(dim=1)
    return _RateFactors(base, normsys, multipliers, slope)


def _multiplier_factors(pars: torch.Tensor, main: MainTensors) -> torch.Tensor:
    """The parameter values ``[B, M, Q]`` multiplying each column (1 where none)."""
    extended = torch.cat([pars, torch.ones_like(pars.narrow(1, 0, 1))], dim=1)
    depth, columns = main.multiplier_params.shape
    flat = extended.index_select(1, main.multiplier_params.reshape(-1))
    return flat.reshape(pars.shape[0], depth, columns)


def main_rates(
    pars: torch.Tensor, main: MainTensors, histosys_code: str, normsys_code: str
) -> torch.Tensor:
    """Rates ``[B, Q]`` of every sample variant in every main bin at parameters ``[B, P]``."""
    factors = _rate_factors(pars, main, histosys_code, normsys_code)
    return factors.base * factors.normsys * factors.multipliers


def expected_main(
    pars: torch.Tensor,
    element: torch.Tensor,
    main: MainTensors,
    histosys_code: str,
    normsys_code: str,
) -> torch.Tensor:
    """Expected main data ``[B, N]``: each row sums the variants of its own element."""
    n_variants = main.membership.shape[1]
    rates = main_rates(pars, main, histosys_code, normsys_code)
    rates = rates.reshape(pars.shape[0], n_variants, -1)
    return torch.einsum("bu,bun->bn", main.membership.index_select(0, element), rates)


def expected_main_jacobian(
    pars: torch.Tensor,
    element: torch.Tensor,
    main: MainTensors,
    histosys_code: str,
    normsys_code: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Expected main data ``[B, N]`` and its Jacobian ``[B, N, P]``, in closed form.

    One forward pass per modifier kind, no autograd: the fit loop runs on any device, and
    under FakeTensorMode, with the same code.
    """
    rows, n_pars = pars.shape
    n_variants = main.membership.shape[1]
    n_columns = main.nominal.shape[0]
    n_main = n_columns // n_variants
    weights = main.membership.index_select(0, element)  # [B, U]
    factors = _rate_factors(pars, main, histosys_code, normsys_code, with_slopes=True)
    rates = factors.base * factors.normsys * factors.multipliers
    weighted = rates.reshape(rows, n_variants, n_main) * weights.unsqueeze(2)
    expected = weighted.sum(dim=1)
    column = torch.arange(n_columns, device=pars.device)
    column_bin = torch.remainder(column, n_main)
    column_weight = weights.repeat_interleave(n_main, dim=1)  # [B, Q]
    # flattened (bin, parameter) Jacobian with one spare parameter slot for "no parameter"
    width = n_pars + 1
    jacobian = torch.zeros(rows, n_main * width, dtype=pars.dtype, device=pars.device)

    if main.histosys_params.numel():
        n_histosys = main.histosys_params.shape[0]
        slope = histosys_basis_derivative(
            histosys_code, pars.index_select(1, main.histosys_params)
        )  # [B, K, J]
        scale = (factors.normsys * factors.multipliers * column_weight).reshape(
            rows, n_variants, n_main
        )
        # sum_u C[k, j, u, n] scale[b, u, n] as one product per bin, then sum_k slope[b, k, j]
        coefficients = main.histosys_coefficients.reshape(-1, n_variants, n_main)  # [K * J, U, N]
        scaled = scale.permute(2, 0, 1) @ coefficients.permute(2, 1, 0)  # [N, B, K * J]
        scaled = scaled.reshape(n_main, rows, -1, n_histosys)
        per_bin = (scaled * slope.unsqueeze(0)).sum(2).transpose(0, 1)  # [B, N, J]
        target = (
            torch.arange(n_main, device=pars.device).unsqueeze(1) * width
            + main.histosys_params.unsqueeze(0)
        ).reshape(-1)
        jacobian = jacobian.index_add(1, target, per_bin.reshape(rows, -1))
    if main.normsys_column.numel():
        contribution = factors.normsys_slope * (rates * column_weight).index_select(
            1, main.normsys_column
        )
        target = column_bin.index_select(0, main.normsys_column) * width + main.normsys_param
        jacobian = jacobian.index_add(1, target, contribution)
    if main.multiplier_params.numel():
        values = _multiplier_factors(pars, main)  # [B, M, Q]
        ones = torch.ones_like(values.narrow(1, 0, 1))
        before = torch.cumprod(torch.cat([ones, values], dim=1), dim=1).narrow(
            1, 0, values.shape[1]
        )
        after = torch.cumprod(torch.cat([ones, values.flip(1)], dim=1), dim=1)
        after = after.narrow(1, 0, values.shape[1]).flip(1)
        others = before * after  # product of the other multipliers of the column
        scale = (factors.base * factors.normsys * column_weight).unsqueeze(1)
        target = column_bin.unsqueeze(0) * width + main.multiplier_params  # [M, Q]
        jacobian = jacobian.index_add(1, target.reshape(-1), (others * scale).reshape(rows, -1))
    jacobian = jacobian.reshape(rows, n_main, width).narrow(2, 0, n_pars)
    return expected, jacobian


def expected_aux(
    pars: torch.Tensor, element: torch.Tensor, constraint: ConstraintTensors
) -> torch.Tensor:
    """Expected auxiliary data ``[B, A]``: the parameter (times tau for Poisson constraints)."""
    return pars.index_select(1, constraint.param) * constraint.scale.index_select(0, element)


def poisson_logpdf(observed: torch.Tensor, rate: torch.Tensor) -> torch.Tensor:
    """Continuous Poisson ``log p(n | lambda)`` as pyhf: ``xlogy(n, lam) - lam - lgamma(n + 1)``."""
    return torch.xlogy(observed, rate) - rate - torch.lgamma(observed + 1)


def poisson_deviance(observed: torch.Tensor, rate: torch.Tensor) -> torch.Tensor:
    """``-2 log p(n | lambda)`` minus its value at ``lambda = n``: ``2 (lambda - n - n log(lambda
    / n))`` (``2 lambda`` for ``n = 0``). Non-negative and small near a good fit, so that sums of
    many terms keep their precision, in float32 too."""
    positive = observed > 0
    ratio = torch.where(positive, rate / torch.where(positive, observed, 1.0), 1.0)
    return 2.0 * (rate - observed - torch.where(positive, observed * torch.log(ratio), 0.0))


def poisson_saturated(observed: torch.Tensor) -> torch.Tensor:
    """``-2 log p(n | lambda = n)``, what :func:`poisson_deviance` leaves out."""
    return 2.0 * (observed - torch.xlogy(observed, observed) + torch.lgamma(observed + 1))


def constraint_deviance(
    pars: torch.Tensor, aux_data: torch.Tensor, element: torch.Tensor, constraint: ConstraintTensors
) -> torch.Tensor:
    """``-2 x`` :func:`constraint_logpdf` minus :func:`constraint_saturated`, per row ``[B]``:
    squared pulls for Normal constraints, Poisson deviances for Poisson ones."""
    pull, _, rate = _constraint_terms(pars, aux_data, element, constraint)
    poisson = poisson_deviance(aux_data, rate)
    return torch.where(constraint.is_poisson, poisson, pull**2).sum(dim=1)


def constraint_saturated(
    aux_data: torch.Tensor, element: torch.Tensor, constraint: ConstraintTensors
) -> torch.Tensor:
    """The data-only part of ``-2 x`` :func:`constraint_logpdf`, per row ``[B]``."""
    sigma = constraint.sigma.index_select(0, element)
    normal = 2.0 * (torch.log(sigma) + LOG_SQRT_2PI)
    return torch.where(constraint.is_poisson, poisson_saturated(aux_data), normal).sum(dim=1)


def constraint_logpdf(
    pars: torch.Tensor, aux_data: torch.Tensor, element: torch.Tensor, constraint: ConstraintTensors
) -> torch.Tensor:
    """Sum of the Normal and Poisson constraint terms per row ``[B]``."""
    pull, sigma, rate = _constraint_terms(pars, aux_data, element, constraint)
    normal = -0.5 * pull**2 - torch.log(sigma) - LOG_SQRT_2PI
    poisson = poisson_logpdf(aux_data, rate)
    return torch.where(constraint.is_poisson, poisson, normal).sum(dim=1)


def _constraint_terms(
    pars: torch.Tensor, aux_data: torch.Tensor, element: torch.Tensor, constraint: ConstraintTensors
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per auxiliary datum ``[B, A]``: the Normal pull ``(a - theta) / sigma``, the sigma, and
    the Poisson rate ``tau theta``. The Poisson term is evaluated on every slot and kept on
    Poisson slots only, so the Normal slots get a harmless rate (1): no NaN reaches a gradient
    through torch.where."""
    means = pars.index_select(1, constraint.param)
    sigma = constraint.sigma.index_select(0, element)
    rate = torch.where(
        constraint.is_poisson, means * constraint.scale.index_select(0, element), 1.0
    )
    return (aux_data - means) / sigma, sigma, rate
