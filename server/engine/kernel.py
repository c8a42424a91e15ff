"""The per-call path: pure tensor functions of a model's precomputed tensors.

Nothing here reads host memory, calls ``.item()`` or loops over bins; every function takes
the model's tensors explicitly (:class:`MainTensors`, :class:`ConstraintTensors`) so that
one ``torch.compile`` of them serves every model of the same structure. Indexing is spelled
with ``index_select``/``narrow``: they behave the same everywhere, FakeTensorMode included
(the device hygiene tests), where Python ``tensor[...]`` indexing of a cuda tensor fails.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple, overload

import torch
from torch import Tensor

from .interpolation import (
    histosys_basis,
    histosys_basis_and_derivative,
    histosys_basis_second_derivative,
    normsys_log_curvature,
    normsys_log_factor,
    normsys_log_factor_and_slope,
)

LOG_SQRT_2PI = math.log(math.sqrt(2.0 * math.pi))


class MainTensors(NamedTuple):
    """Main-model tensors over ``N`` bins, in two blocks of sample variants (see
    :mod:`~pyhf_gpu_server.engine.stacking`): ``U`` *common* variants that every element sums
    (``Q = U * N`` columns), and each element's *own* variants in ``S`` slots (``Q_s = S * N``
    columns), gathered per row so that a row's cost does not grow with the number of elements.
    Parameter index ``P`` in the multiplier indices means "times 1" (padding)."""

    bins: Tensor  # [N] 0..N-1
    membership: Tensor  # [E, U] how often element e sums common variant u
    nominal: Tensor  # [Q]
    histosys_params: Tensor  # [J_h] parameter index of each histosys parameter
    histosys_by_bin: Tensor  # [N, U, K * J_h]: by bin, so no product copies it
    normsys_param: Tensor  # [T] parameter index of each normsys entry
    normsys_column: Tensor  # [T] column of each normsys entry
    # a sample's normsys is one factor for all its bins: the distinct (parameter, coefficients)
    # of the entries are interpolated once, then gathered
    normsys_distinct_param: Tensor  # [T_d] parameter of each distinct normsys
    normsys_distinct: Tensor  # [T] each entry's distinct normsys
    normsys_coefficients: Tensor  # [19, T_d] (normsys_kernel_coefficients)
    multiplier_params: Tensor  # [M, Q] parameter indices
    own_nominal: Tensor  # [E, Q_s]
    own_histosys_params: Tensor  # [J_s]
    own_histosys_coefficients: Tensor  # [E, K * J_s, Q_s]
    own_normsys_param: Tensor  # [E, T_s]
    own_normsys_column: Tensor  # [E, T_s]
    own_normsys_coefficients: Tensor  # [19, E, T_s]
    own_multiplier_params: Tensor  # [E, M_s, Q_s]


class ConstraintTensors(NamedTuple):
    """Auxiliary-data tensors: one constrained parameter per auxiliary datum."""

    param: Tensor  # [A]
    is_poisson: Tensor  # [A] bool
    sigma: Tensor  # [E, A] Normal sigma (1 on Poisson slots)
    scale: Tensor  # [E, A] Poisson rate factor (1 on Normal slots)
    present: Tensor  # [E, A] bool: the element has this constraint term


class _Block(NamedTuple):
    """One block of variants as seen by ``B`` rows: the common block's index tensors have no
    row axis (every row alike, indexed all at once), the own block's are gathered by each
    row's element (a leading row axis)."""

    nominal: Tensor  # [B, Q]
    histosys_params: Tensor  # [J]
    histosys_coefficients: Tensor | None  # own: [B, K * J, Q]; common: None
    normsys_param: Tensor  # [T] or [B, T]
    normsys_column: Tensor  # [T] or [B, T]
    normsys_coefficients: Tensor  # [19, T_d] or [19, B, T]
    multiplier_params: Tensor  # [M, Q] or [B, M, Q]
    weight: Tensor | None  # [B, Q] element weights of the columns (None: all 1)
    histosys_by_bin: Tensor | None = None  # common: [N, U, K * J]; own: None
    normsys_distinct_param: Tensor | None = None  # common: [T_d]; own: None (all)
    normsys_distinct: Tensor | None = None  # common: [T] into T_d; own: None


class _RateFactors(NamedTuple):
    """A block's rate factors; ``multiplier_values`` and the slopes (``with_slopes``) are
    None only where the block has no modifier of their kind."""

    base: Tensor  # [B, Q] nominal + histosys shift
    normsys: Tensor  # [B, Q] product of normsys factors
    multipliers: Tensor  # [B, Q] product of plain multipliers
    multiplier_values: Tensor | None  # [B, M, Q] the multipliers themselves
    normsys_slope: Tensor | None = None  # [B, T] d log|factor| / d alpha per entry
    histosys_slope: Tensor | None = None  # [B, K, J] d basis / d alpha

    @property
    def rates(self) -> Tensor:
        """``[B, Q]``: every column's rate."""
        return self.base * self.normsys * self.multipliers


def _blocks(element: Tensor, main: MainTensors) -> tuple[_Block, _Block]:
    """The common and the own block for rows of ``element [B]``."""
    rows, n_main = element.shape[0], main.bins.shape[0]
    n_common = main.membership.shape[1]
    common = _Block(
        nominal=main.nominal.expand(rows, -1),
        histosys_params=main.histosys_params,
        histosys_coefficients=None,
        normsys_param=main.normsys_param,
        normsys_column=main.normsys_column,
        normsys_coefficients=main.normsys_coefficients,
        multiplier_params=main.multiplier_params,
        weight=main.membership.index_select(0, element).repeat_interleave(n_main, dim=1)
        if n_common
        else None,
        histosys_by_bin=main.histosys_by_bin,
        normsys_distinct_param=main.normsys_distinct_param,
        normsys_distinct=main.normsys_distinct,
    )
    own = _Block(
        nominal=main.own_nominal.index_select(0, element),
        histosys_params=main.own_histosys_params,
        histosys_coefficients=main.own_histosys_coefficients.index_select(0, element),
        normsys_param=main.own_normsys_param.index_select(0, element),
        normsys_column=main.own_normsys_column.index_select(0, element),
        normsys_coefficients=main.own_normsys_coefficients.index_select(1, element),
        multiplier_params=main.own_multiplier_params.index_select(0, element),
        weight=None,
    )
    return common, own


def _rate_factors(
    pars: Tensor, block: _Block, histosys_code: str, normsys_code: str, with_slopes: bool = False
) -> _RateFactors:
    """The factors of every column's rate (``with_slopes``: and the interpolations' slopes)."""
    base = block.nominal
    normsys = torch.ones_like(base)
    multipliers = torch.ones_like(base)
    values = slope = histosys_slope = None
    if block.histosys_params.shape[0]:
        alpha = pars.index_select(1, block.histosys_params)
        if with_slopes:
            basis, histosys_slope = histosys_basis_and_derivative(histosys_code, alpha)
        else:
            basis = histosys_basis(histosys_code, alpha)
        base = base + _histosys_shift(block, basis.reshape(pars.shape[0], -1))
    if block.normsys_column.shape[-1]:
        alpha = _normsys_alpha(pars, block)
        if with_slopes:
            log_abs, negative, slope = normsys_log_factor_and_slope(
                normsys_code, alpha, block.normsys_coefficients
            )
            slope = _normsys_entries(slope, block)
        else:
            log_abs, negative = normsys_log_factor(normsys_code, alpha, block.normsys_coefficients)
        log_abs, negative = _normsys_entries(log_abs, block), _normsys_entries(negative, block)
        total_log = _add_at(torch.zeros_like(base), block.normsys_column, log_abs)
        total_negative = _add_at(torch.zeros_like(base), block.normsys_column, negative)
        normsys = (1.0 - 2.0 * torch.remainder(total_negative, 2.0)) * torch.exp(total_log)
    if block.multiplier_params.shape[-2]:
        values = _multiplier_factors(pars, block)
        multipliers = values.prod(dim=1)
    return _RateFactors(base, normsys, multipliers, values, slope, histosys_slope)


def _normsys_alpha(pars: Tensor, block: _Block) -> Tensor:
    """``[B, T_d]``: the parameter of each distinct normsys (each entry's in the own block)."""
    if block.normsys_distinct_param is None:
        return _take(pars, block.normsys_param)
    return pars.index_select(1, block.normsys_distinct_param)


def _normsys_entries(values: Tensor, block: _Block) -> Tensor:
    """``[B, T]``: values of the distinct normsys ``[B, T_d]`` at each entry."""
    if block.normsys_distinct is None:
        return values
    return values.index_select(1, block.normsys_distinct)


def _histosys_shift(block: _Block, basis: Tensor) -> Tensor:
    """``[B, Q]``: every column's histosys shift for the basis values ``[B, K * J]``."""
    if block.histosys_by_bin is None:  # own: per row
        assert block.histosys_coefficients is not None
        return (basis.unsqueeze(1) @ block.histosys_coefficients).squeeze(1)
    n_main, n_variants, width = block.histosys_by_bin.shape
    shift = block.histosys_by_bin.reshape(n_main * n_variants, width) @ basis.mT  # [N U, B]
    return shift.reshape(n_main, n_variants, -1).permute(2, 1, 0).reshape(basis.shape[0], -1)


def _take(values: Tensor, index: Tensor) -> Tensor:
    """``values [B, X]`` at ``index`` ``[I]`` (every row alike) or ``[B, I]``: ``[B, I]``."""
    if index.dim() == 1:
        return values.index_select(1, index)
    return values.gather(1, index)


def _add_at(target: Tensor, index: Tensor, values: Tensor, inplace: bool = False) -> Tensor:
    """``target [B, X]`` with ``values [B, I]`` added at ``index`` ``[I]`` or ``[B, I]``;
    ``inplace``: into ``target`` itself (an accumulator the caller made, so that a row's
    ``[N, P]`` Jacobian is not held twice while it is assembled)."""
    if index.dim() == 1:
        return (target.index_add_ if inplace else target.index_add)(1, index, values)
    return (target.scatter_add_ if inplace else target.scatter_add)(1, index, values)


def _multiplier_factors(pars: Tensor, block: _Block) -> Tensor:
    """The parameter values ``[B, M, Q]`` multiplying each column (1 where none)."""
    extended = torch.cat([pars, torch.ones_like(pars.narrow(1, 0, 1))], dim=1)
    depth, columns = block.multiplier_params.shape[-2:]
    index = block.multiplier_params.flatten(-2)
    return _take(extended, index).reshape(pars.shape[0], depth, columns)


def _summed(rates: Tensor, block: _Block, n_main: int) -> Tensor:
    """``[B, N]``: the block's column rates summed over its variants, with their weights."""
    if block.weight is not None:
        rates = rates * block.weight
    return rates.reshape(rates.shape[0], -1, n_main).sum(dim=1)


def expected_main(
    pars: Tensor, element: Tensor, main: MainTensors, histosys_code: str, normsys_code: str
) -> Tensor:
    """Expected main data ``[B, N]``: each row sums the variants of its own element."""
    n_main = main.bins.shape[0]
    expected = torch.zeros(pars.shape[0], n_main, dtype=pars.dtype, device=pars.device)
    for block in _blocks(element, main):
        if block.nominal.shape[1]:
            f = _rate_factors(pars, block, histosys_code, normsys_code)
            expected = expected + _summed(f.rates, block, n_main)
    return expected


def variant_rates(
    pars: Tensor, element: Tensor, main: MainTensors, histosys_code: str, normsys_code: str
) -> Tensor:
    """Rates ``[B, U + S, N]`` of every sample variant a row can see, unsummed: the ``U``
    common variants (without their membership counts), then the row's element's ``S`` own
    slots (zeros in empty slots). :func:`expected_main` is their weighted sum."""
    rows, n_main = pars.shape[0], main.bins.shape[0]
    parts = [torch.zeros(rows, 0, n_main, dtype=pars.dtype, device=pars.device)]
    for block in _blocks(element, main):
        if block.nominal.shape[1]:
            f = _rate_factors(pars, block, histosys_code, normsys_code)
            parts.append(f.rates.reshape(rows, -1, n_main))
    return torch.cat(parts, dim=1)


class JacobianColumns(NamedTuple):
    """Where :func:`expected_main_jacobian` puts each parameter's derivatives (see
    :mod:`~pyhf_gpu_server.engine.sparsity`): a shared parameter's column of the dense
    ``[B, N, K]`` Jacobian, or a per-bin parameter's entry of ``[B, M]`` (its one bin's
    derivative). Index ``P`` (the "times 1" padding) maps past both."""

    shared: Tensor  # [P + 1] column among the K shared parameters (K: not shared)
    per_bin: Tensor  # [P + 1] position among the M per-bin parameters (M: not per-bin)
    n_shared: int  # K
    n_per_bin: int  # M
    slot: Tensor  # [P + 1] a per-bin parameter's slot among its bin's G (G: not per-bin)
    slot_width: int  # G, the most per-bin parameters a bin has


class RatesCurvature(NamedTuple):
    """:func:`main_rates_curvature` in the block form of :class:`JacobianColumns`: nothing
    structurally zero built (two per-bin parameters of different bins never meet)."""

    shared: Tensor  # [B, K, K] over the shared parameters
    cross: Tensor  # [B, N, G, K] per bin and slot, against the shared parameters
    per_bin: Tensor  # [B, N, G, G] per bin, among its slots


@overload
def expected_main_jacobian(
    pars: Tensor,
    element: Tensor,
    main: MainTensors,
    histosys_code: str,
    normsys_code: str,
    columns: None = None,
) -> tuple[Tensor, Tensor]: ...


@overload
def expected_main_jacobian(
    pars: Tensor,
    element: Tensor,
    main: MainTensors,
    histosys_code: str,
    normsys_code: str,
    columns: JacobianColumns,
) -> tuple[Tensor, Tensor, Tensor]: ...


def expected_main_jacobian(
    pars: Tensor,
    element: Tensor,
    main: MainTensors,
    histosys_code: str,
    normsys_code: str,
    columns: JacobianColumns | None = None,
) -> tuple[Tensor, Tensor] | tuple[Tensor, Tensor, Tensor]:
    """Expected main data ``[B, N]`` and its Jacobian ``[B, N, P]``, in closed form.

    One forward pass per modifier kind, no autograd: the fit loop runs on any device, and
    under FakeTensorMode, with the same code. With ``columns``, the Jacobian comes in two
    parts and nothing structurally zero is built: ``[B, N, K]`` over the shared parameters
    and ``[B, M]``, each per-bin parameter's derivative of its own bin (a triple).
    """
    rows, n_pars = pars.shape
    n_main = main.bins.shape[0]
    # flattened (bin, parameter) with one spare slot for "no parameter" (or a per-bin one)
    if columns is None:
        shared, per_bin, width, bin_jacobian = None, None, n_pars + 1, None
    else:
        shared, per_bin, width = columns.shared, columns.per_bin, columns.n_shared + 1
        bin_jacobian = pars.new_zeros(rows, columns.n_per_bin + 1)
    expected = torch.zeros(rows, n_main, dtype=pars.dtype, device=pars.device)
    jacobian = torch.zeros(rows, n_main * width, dtype=pars.dtype, device=pars.device)
    for block in _blocks(element, main):
        n_columns = block.nominal.shape[1]
        if not n_columns:
            continue
        factors = _rate_factors(pars, block, histosys_code, normsys_code, with_slopes=True)
        rates = factors.rates
        expected = expected + _summed(rates, block, n_main)
        weight = block.weight if block.weight is not None else torch.ones_like(rates)
        column_bin = main.bins.repeat(n_columns // n_main)  # [Q]
        if block.histosys_params.shape[0]:
            assert factors.histosys_slope is not None
            scale = factors.normsys * factors.multipliers * weight
            per_bin_shift = _histosys_per_bin(block, scale, factors.histosys_slope, n_main)
            target = main.bins.unsqueeze(1) * width + _remap(
                shared, block.histosys_params
            ).unsqueeze(0)
            jacobian.index_add_(1, target.flatten(), per_bin_shift.reshape(rows, -1))
        if block.normsys_column.shape[-1]:
            assert factors.normsys_slope is not None
            weighted = _take(rates * weight, block.normsys_column)
            target = _remap(column_bin, block.normsys_column) * width + _remap(
                shared, block.normsys_param
            )
            _add_at(jacobian, target, factors.normsys_slope * weighted, inplace=True)
        if block.multiplier_params.shape[-2]:
            assert factors.multiplier_values is not None
            others = _others(factors.multiplier_values)
            scale = (factors.base * factors.normsys * weight).unsqueeze(1)
            values = (others * scale).reshape(rows, -1)
            params = block.multiplier_params  # [M, Q] or [B, M, Q]
            target = column_bin * width + _remap(shared, params)
            _add_at(jacobian, target.flatten(-2), values, inplace=True)
            if bin_jacobian is not None:
                _add_at(bin_jacobian, _remap(per_bin, params).flatten(-2), values, inplace=True)
    jacobian = jacobian.reshape(rows, n_main, width).narrow(2, 0, width - 1)
    if bin_jacobian is None or columns is None:
        return expected, jacobian
    return expected, jacobian, bin_jacobian.narrow(1, 0, columns.n_per_bin)


def expected_main_gradient(
    pars: Tensor,
    element: Tensor,
    main: MainTensors,
    histosys_code: str,
    normsys_code: str,
    residual: Callable[[Tensor], Tensor],
) -> tuple[Tensor, Tensor]:
    """Expected main data ``[B, N]`` and ``sum_n r_n d(expected bin n) / d pars`` ``[B, P]``
    for ``r = residual(expected)`` ``[B, N]``: a vector-Jacobian product in closed form, the
    Jacobian ``[B, N, P]`` never built (each block's factors computed once, contracted with
    ``r`` once every block's rates are summed). What steps that need no curvature cost.
    """
    rows, n_pars = pars.shape
    n_main = main.bins.shape[0]
    expected = pars.new_zeros(rows, n_main)
    parts = []
    for block in _blocks(element, main):
        if block.nominal.shape[1]:
            factors = _rate_factors(pars, block, histosys_code, normsys_code, with_slopes=True)
            rates = factors.rates
            expected = expected + _summed(rates, block, n_main)
            parts.append((block, factors, rates))
    r = residual(expected)
    gradient = pars.new_zeros(rows, n_pars + 1)  # the spare slot of the "times 1" padding
    for block, factors, rates in parts:
        r_column = r.repeat(1, block.nominal.shape[1] // n_main)  # column u N + n: bin n
        if block.weight is not None:
            r_column = r_column * block.weight
        if block.histosys_params.shape[0]:
            scale = factors.normsys * factors.multipliers * r_column
            if block.histosys_by_bin is None:  # own: [B, K J, Q]
                assert block.histosys_coefficients is not None
                contracted = (block.histosys_coefficients @ scale.unsqueeze(-1)).squeeze(-1)
            else:  # common: [N, U, K J]
                N, U, width = block.histosys_by_bin.shape
                by_bin = scale.reshape(rows, U, N).transpose(1, 2).reshape(rows, N * U)
                contracted = by_bin @ block.histosys_by_bin.reshape(N * U, width)
            n_params = block.histosys_params.shape[0]
            slope = factors.histosys_slope  # [B, K, J]
            assert slope is not None
            per_param = (contracted.reshape(rows, -1, n_params) * slope).sum(1)
            gradient = gradient.index_add(1, block.histosys_params, per_param)
        if block.normsys_column.shape[-1]:
            weighted = _take(rates * r_column, block.normsys_column)
            assert factors.normsys_slope is not None
            gradient = _add_at(gradient, block.normsys_param, factors.normsys_slope * weighted)
        if block.multiplier_params.shape[-2]:
            scale = (factors.base * factors.normsys * r_column).unsqueeze(1)
            assert factors.multiplier_values is not None
            values = (_others(factors.multiplier_values) * scale).reshape(rows, -1)
            gradient = _add_at(gradient, block.multiplier_params.flatten(-2), values)
    return expected, gradient.narrow(1, 0, n_pars)


def _remap(table: Tensor | None, index: Tensor) -> Tensor:
    """``table`` at every entry of ``index`` (any shape); ``index`` itself without a table."""
    if table is None:
        return index
    return table.index_select(0, index.reshape(-1)).reshape(index.shape)


def main_rates_curvature(
    pars: Tensor,
    element: Tensor,
    main: MainTensors,
    histosys_code: str,
    normsys_code: str,
    bin_weights: Tensor,
    columns: JacobianColumns | None = None,
) -> Tensor | RatesCurvature:
    """``sum_n w_n d2(expected bin n) / d pars2`` ``[B, P, P]`` for bin weights ``[B, N]``:
    the second-order term of a Hessian that Gauss-Newton drops, in closed form. With
    ``columns``, in block form (:class:`RatesCurvature`): a per-bin parameter ``p`` is a
    multiplier only (``v_p = s_p = 0``), so it meets a shared ``k`` in ``sum_q w t_p (b s_k +
    v_k)`` and the multipliers' pairs, and another per-bin parameter of its bin in the pairs.

    Each column's rate is ``b f``: ``b`` the histosys-shifted nominal, ``f = g m`` the product
    of its normsys factors ``g`` and its multipliers ``m``. With ``v = grad b``, ``s = grad
    log|g|`` and ``t = g grad m`` (products of the other multipliers: no division, a
    multiplier may be 0), ``d2(b f) = diag(b'' f) + v df^T + df v^T + b d2f`` where ``df = f s
    + t`` and ``d2f = f (s s^T + diag(s')) + t s^T + s t^T + g d2m``, ``d2m`` the products of
    all multipliers but two: a few batched products over the columns, no autograd.
    """
    rows, n_pars = pars.shape
    n_main = main.bins.shape[0]
    # the spare slot of the "times 1" multiplier padding (and, in block form, of the per-bin
    # parameters among the shared, of the others among a bin's slots)
    if columns is None:
        shared, slot_of, width = None, None, n_pars + 1
    else:
        shared, slot_of, width = columns.shared, columns.slot, columns.n_shared + 1
        slots = columns.slot_width + 1
        cross = pars.new_zeros(rows, n_main, slots, width)
        cross_pairs = pars.new_zeros(rows, n_main * slots * width)
        bin_pairs = pars.new_zeros(rows, n_main * slots * slots)
    symmetric = pars.new_zeros(rows, width, width)
    half = pars.new_zeros(rows, width, width)  # the rest is half + half^T
    diagonal = pars.new_zeros(rows, width)
    pairs = pars.new_zeros(rows, width * width)
    for block in _blocks(element, main):
        n_columns = block.nominal.shape[1]
        if not n_columns:
            continue
        factors = _rate_factors(pars, block, histosys_code, normsys_code, with_slopes=True)
        column_bin = main.bins.repeat(n_columns // main.bins.shape[0])  # [Q]
        weight = bin_weights.index_select(1, column_bin)
        if block.weight is not None:
            weight = weight * block.weight
        factor = factors.normsys * factors.multipliers  # [B, Q]
        slope = pars.new_zeros(rows, n_columns * width)  # s, flattened [B, Q * width]
        slope_change = pars.new_zeros(rows, n_columns * width)  # diag(s')
        if block.normsys_column.shape[-1]:
            alpha = _normsys_alpha(pars, block)
            target = block.normsys_column * width + _remap(shared, block.normsys_param)
            assert factors.normsys_slope is not None
            slope = _add_at(slope, target, factors.normsys_slope)
            second = normsys_log_curvature(normsys_code, alpha, block.normsys_coefficients)
            second = _normsys_entries(second, block)
            slope_change = _add_at(slope_change, target, second)
        slope = slope.reshape(rows, n_columns, width)
        slope_change = slope_change.reshape(rows, n_columns, width)
        factor_slope = factor.unsqueeze(-1) * slope  # f s, then df
        weighted_base = weight * factors.base  # w b
        per_bin_t = None  # block form: t of the per-bin parameters by slot [B, Q, G + 1]
        if block.multiplier_params.shape[-2]:
            values = factors.multiplier_values  # [B, M, Q]
            assert values is not None
            column = torch.arange(n_columns, device=pars.device)
            params = block.multiplier_params  # [M, Q] or [B, M, Q]
            others = (factors.normsys.unsqueeze(1) * _others(values)).reshape(rows, -1)
            t = _add_at(
                pars.new_zeros(rows, n_columns * width),
                (column * width + _remap(shared, params)).flatten(-2),
                others,
            )
            t = t.reshape(rows, n_columns, width)
            if slot_of is not None:
                per_bin_t = _add_at(
                    pars.new_zeros(rows, n_columns * slots),
                    (column * slots + _remap(slot_of, params)).flatten(-2),
                    others,
                ).reshape(rows, n_columns, slots)
            factor_slope = factor_slope + t
            half = half.baddbmm((weighted_base.unsqueeze(-1) * t).mT, slope)  # sum_q w b t s^T
            depth = values.shape[1]
            if depth > 1:
                # all multipliers but slots i != j of each column, times w b g
                slot = torch.arange(depth, device=pars.device)
                dropped = (slot.view(-1, 1, 1) == slot.view(1, 1, -1)) | (
                    slot.view(1, -1, 1) == slot.view(1, 1, -1)
                )  # [i, j, k]: k is i or j
                kept = torch.where(
                    dropped.unsqueeze(0).unsqueeze(-1),
                    torch.ones_like(values).unsqueeze(1).unsqueeze(1),
                    values.unsqueeze(1).unsqueeze(1),
                ).prod(3)  # [B, i, j, Q]
                distinct = (slot.view(-1, 1) != slot.view(1, -1)).unsqueeze(-1)
                kept = torch.where(distinct, kept, torch.zeros_like(kept))
                scale = (weighted_base * factors.normsys).unsqueeze(1).unsqueeze(1)
                kept = (scale * kept).reshape(rows, -1)
                first, second = params.unsqueeze(-2), params.unsqueeze(-3)  # [.., i, j, Q]
                target = _remap(shared, first) * width + _remap(shared, second)
                pairs = _add_at(pairs, target.flatten(-3), kept)
                if slot_of is not None:  # (per-bin, shared) and (per-bin, per-bin) pairs
                    by_bin = column_bin * slots + _remap(slot_of, first)
                    target = by_bin * width + _remap(shared, second)
                    cross_pairs = _add_at(cross_pairs, target.flatten(-3), kept)
                    target = by_bin * slots + _remap(slot_of, second)
                    bin_pairs = _add_at(bin_pairs, target.flatten(-3), kept)
        if block.histosys_params.shape[0]:
            alpha = pars.index_select(1, block.histosys_params)
            n_params = alpha.shape[1]
            if block.histosys_by_bin is None:  # own: [B, K, J, Q]
                coefficients = block.histosys_coefficients
                assert coefficients is not None
                coefficients = coefficients.reshape(rows, -1, n_params, n_columns)
                pattern = "bkj,bkjq->bqj"
            else:  # common: [N, U, K, J]
                coefficients = block.histosys_by_bin
                coefficients = coefficients.reshape(*coefficients.shape[:2], -1, n_params)
                pattern = "bkj,nukj->bunj"
            slope_by_column = torch.einsum(pattern, factors.histosys_slope, coefficients)
            histosys_params = _remap(shared, block.histosys_params)
            base_slope = pars.new_zeros(rows, n_columns, width).index_add(
                2, histosys_params, slope_by_column.reshape(rows, n_columns, -1)
            )  # v
            second = histosys_basis_second_derivative(histosys_code, alpha)
            base_second = torch.einsum(pattern, second, coefficients)
            base_second = base_second.reshape(rows, n_columns, -1)  # [B, Q, J]
            diagonal = diagonal.index_add(
                1, histosys_params, ((weight * factor).unsqueeze(-1) * base_second).sum(1)
            )
            half = half.baddbmm(
                (weight.unsqueeze(-1) * base_slope).mT, factor_slope
            )  # sum_q w v df^T
        else:
            base_slope = None
        product = (weighted_base * factor).unsqueeze(-1)  # w b f
        symmetric = symmetric.baddbmm((product * slope).mT, slope)
        diagonal = diagonal + (product * slope_change).sum(1)
        if per_bin_t is not None:  # sum_q w t_p (b s + v), per bin: q = u N + n
            toward = factors.base.unsqueeze(-1) * slope
            if base_slope is not None:
                toward = toward + base_slope
            toward = (weight.unsqueeze(-1) * toward).reshape(rows, -1, n_main, width)
            per_bin_t = per_bin_t.reshape(rows, -1, n_main, slots)
            cross = cross + torch.einsum("bung,bunk->bngk", per_bin_t, toward)
    curvature = symmetric + pairs.view(rows, width, width) + half + half.mT
    curvature.diagonal(dim1=1, dim2=2).add_(diagonal)
    if columns is None:
        return curvature.narrow(1, 0, n_pars).narrow(2, 0, n_pars)
    n_shared, n_slots = columns.n_shared, columns.slot_width
    cross = cross + cross_pairs.view(rows, n_main, slots, width)
    return RatesCurvature(
        shared=curvature.narrow(1, 0, n_shared).narrow(2, 0, n_shared),
        cross=cross.narrow(2, 0, n_slots).narrow(3, 0, n_shared),
        per_bin=bin_pairs.view(rows, n_main, slots, slots)
        .narrow(2, 0, n_slots)
        .narrow(3, 0, n_slots),
    )


def _others(values: Tensor) -> Tensor:
    """``[B, M, Q]``: for each multiplier of a column, the product of the column's others
    (no division: a multiplier may be 0)."""
    if values.shape[1] <= 2:  # the other one, or none (times 1)
        return values.flip(1) if values.shape[1] == 2 else torch.ones_like(values)
    ones = torch.ones_like(values.narrow(1, 0, 1))
    before = torch.cumprod(torch.cat([ones, values], dim=1), dim=1).narrow(1, 0, values.shape[1])
    after = torch.cumprod(torch.cat([ones, values.flip(1)], dim=1), dim=1)
    return before * after.narrow(1, 0, values.shape[1]).flip(1)


def _histosys_per_bin(block: _Block, scale: Tensor, slope: Tensor, n_main: int) -> Tensor:
    """``[B, N, J]``: d(expected bin n) / d(alpha_j) through the histosys shifts of the block;
    ``scale [B, Q]``: what multiplies each column's shifted nominal."""
    rows = scale.shape[0]
    n_variants = scale.shape[1] // n_main
    scale = scale.reshape(rows, n_variants, n_main)
    n_params = block.histosys_params.shape[0]
    if block.histosys_by_bin is not None:  # common: per bin, sum_u scale[b, u, n] C[n, u, kj]
        scaled = scale.permute(2, 0, 1) @ block.histosys_by_bin  # [N, B, K * J]
        scaled = scaled.reshape(n_main, rows, -1, n_params)  # [N, B, K, J]
        return (scaled * slope.unsqueeze(0)).sum(dim=2).transpose(0, 1)  # [B, N, J]
    # own: per row
    assert block.histosys_coefficients is not None
    coefficients = block.histosys_coefficients.reshape(rows, -1, n_variants, n_main)
    scaled = (coefficients * scale.unsqueeze(1)).sum(dim=2)  # [B, K * J, N]
    scaled = scaled.reshape(rows, -1, n_params, n_main)  # [B, K, J, N]
    return (scaled * slope.unsqueeze(3)).sum(dim=1).transpose(1, 2)  # [B, N, J]


def expected_aux(pars: Tensor, element: Tensor, constraint: ConstraintTensors) -> Tensor:
    """Expected auxiliary data ``[B, A]``: the parameter (times tau for Poisson constraints)."""
    return pars.index_select(1, constraint.param) * constraint.scale.index_select(0, element)


def poisson_logpdf(observed: Tensor, rate: Tensor) -> Tensor:
    """Continuous Poisson ``log p(n | lambda)`` as pyhf: ``xlogy(n, lam) - lam - lgamma(n + 1)``."""
    return torch.xlogy(observed, rate) - rate - torch.lgamma(observed + 1)


def poisson_deviance(observed: Tensor, rate: Tensor) -> Tensor:
    """``-2 log p(n | lambda)`` minus its value at ``lambda = n``: ``2 (lambda - n - n log(lambda
    / n))`` (``2 lambda`` for ``n = 0``). Non-negative and small near a good fit, so that sums of
    many terms keep their precision, in float32 too."""
    positive = observed > 0
    ratio = torch.where(positive, rate / torch.where(positive, observed, 1.0), 1.0)
    return 2.0 * (rate - observed - torch.where(positive, observed * torch.log(ratio), 0.0))


def poisson_saturated(observed: Tensor) -> Tensor:
    """``-2 log p(n | lambda = n)``, what :func:`poisson_deviance` leaves out."""
    return 2.0 * (observed - torch.xlogy(observed, observed) + torch.lgamma(observed + 1))


def constraint_deviance(
    pars: Tensor, aux_data: Tensor, element: Tensor, constraint: ConstraintTensors
) -> Tensor:
    """``-2 x`` :func:`constraint_logpdf` minus :func:`constraint_saturated`, per row ``[B]``:
    squared pulls for Normal constraints, Poisson deviances for Poisson ones."""
    pull, _, rate = _constraint_terms(pars, aux_data, element, constraint)
    poisson = poisson_deviance(aux_data, rate)
    return _present(torch.where(constraint.is_poisson, poisson, pull**2), element, constraint)


def constraint_saturated(
    aux_data: Tensor, element: Tensor, constraint: ConstraintTensors
) -> Tensor:
    """The data-only part of ``-2 x`` :func:`constraint_logpdf`, per row ``[B]``."""
    sigma = constraint.sigma.index_select(0, element)
    normal = 2.0 * (torch.log(sigma) + LOG_SQRT_2PI)
    terms = torch.where(constraint.is_poisson, poisson_saturated(aux_data), normal)
    return _present(terms, element, constraint)


def constraint_logpdf(
    pars: Tensor, aux_data: Tensor, element: Tensor, constraint: ConstraintTensors
) -> Tensor:
    """Sum of the Normal and Poisson constraint terms per row ``[B]``."""
    pull, sigma, rate = _constraint_terms(pars, aux_data, element, constraint)
    normal = -0.5 * pull**2 - torch.log(sigma) - LOG_SQRT_2PI
    poisson = poisson_logpdf(aux_data, rate)
    return _present(torch.where(constraint.is_poisson, poisson, normal), element, constraint)


def _present(terms: Tensor, element: Tensor, constraint: ConstraintTensors) -> Tensor:
    """Per row ``[B]``: the sum of the constraint terms ``[B, A]`` its element has."""
    present = constraint.present.index_select(0, element)
    return torch.where(present, terms, 0.0).sum(dim=1)


def _constraint_terms(
    pars: Tensor, aux_data: Tensor, element: Tensor, constraint: ConstraintTensors
) -> tuple[Tensor, Tensor, Tensor]:
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
