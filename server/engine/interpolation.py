"""Interpolation codes of pyhf, rewritten as basis functions times precomputed coefficients.

Every code pyhf offers for ``histosys`` (additive: code0, code2, code4p) is linear in a
small set of basis functions of the nuisance parameter ``alpha``::

    delta(alpha) = sum_k basis_k(alpha) * coefficient_k(lo, nom, hi)

so a whole model's histosys shift is one matrix product ``basis [B, K*J] @ C [K*J, Q]``
with ``C`` computed once at load. The ``normsys`` codes (multiplicative: code1, code4) are
evaluated in log space, ``log factor(alpha)``, so that many of them multiply by summation.

The formulas follow what ``pyhf.interpolators`` computes, boundaries included (pyhf's code2
is discontinuous at ``|alpha| = 1``, and so is ours).

Example:
    >>> import torch
    >>> coeffs = histosys_coefficients("code0", lo=[[8.0]], nom=[[10.0]], hi=[[13.0]])
    >>> alpha = torch.tensor([[0.5], [-1.0]], dtype=torch.float64)
    >>> basis = histosys_basis("code0", alpha)          # [B, K, J]
    >>> torch.einsum("bkj,kjq->bq", basis, torch.as_tensor(coeffs)).tolist()
    [[1.5], [-2.0]]
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from .errors import UnsupportedModelError

HISTOSYS_CODES = ("code0", "code2", "code4p")
NORMSYS_CODES = ("code1", "code4")
# codes whose factor has a kink (a jump of its first derivative) at alpha = 0: a likelihood
# built with them can have a minimum on each side of the kink (the fitter starts both sides)
KINKED_CODES = frozenset({"code0", "code1"})


def histosys_coefficients(code: str, lo, nom, hi) -> np.ndarray:
    """Coefficients ``[K, ...]`` of the basis functions of ``code`` for histograms ``lo, nom, hi``."""
    lo, nom, hi = (np.asarray(x, dtype=np.float64) for x in (lo, nom, hi))
    delta_up = hi - nom
    delta_dn = nom - lo
    if code == "code0":
        return np.stack([delta_up, delta_dn])
    if code == "code2":
        a = 0.5 * (hi + lo) - nom
        b = 0.5 * (hi - lo)
        return np.stack([a, b, b + 2 * a, b - 2 * a])
    if code == "code4p":
        s = 0.5 * (delta_up + delta_dn)
        a = 0.0625 * (delta_up - delta_dn)
        return np.stack([s, a, delta_up, delta_dn])
    raise UnsupportedModelError(
        f"histosys interpolation code {code!r} is not supported (supported: {HISTOSYS_CODES})"
    )


def histosys_basis(code: str, alpha: Tensor) -> Tensor:
    """Basis functions ``[B, K, J]`` of ``code`` at ``alpha [B, J]``, matching histosys_coefficients."""
    zero = torch.zeros_like(alpha)
    if code == "code0":
        positive = alpha > 0
        return torch.stack(
            [torch.where(positive, alpha, zero), torch.where(positive, zero, alpha)], 1
        )
    above = alpha > 1
    below = alpha < -1
    inside = torch.logical_not(above | below)
    if code == "code2":
        first, second, beyond = alpha * alpha, alpha, alpha - 1
    elif code == "code4p":
        a2 = alpha * alpha
        first, second, beyond = alpha, a2 * (a2 * (a2 * 3.0 - 10.0) + 15.0), alpha
    else:
        raise UnsupportedModelError(f"histosys interpolation code {code!r} is not supported")
    return torch.stack(
        [
            torch.where(inside, first, zero),
            torch.where(inside, second, zero),
            torch.where(above, beyond, zero),
            # code2: pyhf's vectorised code extrapolates (b - 2a) * alpha below -1, not
            # (b - 2a) * (alpha + 1) as its reference loop does: we follow what it computes
            torch.where(below, alpha, zero),
        ],
        1,
    )


def histosys_basis_derivative(code: str, alpha: Tensor) -> Tensor:
    """``d basis / d alpha`` ``[B, K, J]``, the companion of :func:`histosys_basis`."""
    zero, one = torch.zeros_like(alpha), torch.ones_like(alpha)
    if code == "code0":
        positive = alpha > 0
        return torch.stack([torch.where(positive, one, zero), torch.where(positive, zero, one)], 1)
    above = alpha > 1
    below = alpha < -1
    inside = torch.logical_not(above | below)
    if code == "code2":
        first = torch.where(inside, 2.0 * alpha, zero)
        second = torch.where(inside, one, zero)
    elif code == "code4p":
        a2 = alpha * alpha
        first = torch.where(inside, one, zero)
        second = torch.where(inside, alpha * (a2 * (a2 * 18.0 - 40.0) + 30.0), zero)
    else:
        raise UnsupportedModelError(f"histosys interpolation code {code!r} is not supported")
    return torch.stack(
        [first, second, torch.where(above, one, zero), torch.where(below, one, zero)], 1
    )


def histosys_basis_and_derivative(code: str, alpha: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`histosys_basis` and :func:`histosys_basis_derivative` at once; for code4p
    (pyhf's default) sharing their masks and powers: a third fewer operations."""
    if code != "code4p":
        return histosys_basis(code, alpha), histosys_basis_derivative(code, alpha)
    above = alpha > 1
    below = alpha < -1
    inside = torch.logical_not(above | below)
    regions = torch.stack([inside, inside, above, below], 1).to(alpha.dtype)
    inner = alpha.clamp(-1.0, 1.0)  # equals alpha where it counts
    a2 = inner * inner
    ones = torch.ones_like(alpha)
    basis = torch.stack([inner, a2 * (a2 * (a2 * 3.0 - 10.0) + 15.0), alpha, alpha], 1)
    slope = torch.stack([ones, inner * (a2 * (a2 * 18.0 - 40.0) + 30.0), ones, ones], 1)
    return basis * regions, slope * regions


def histosys_basis_second_derivative(code: str, alpha: Tensor) -> Tensor:
    """``d2 basis / d alpha2`` ``[B, K, J]`` (0 at the kinks and jumps of code0 and code2)."""
    zero = torch.zeros_like(alpha)
    if code == "code0":
        return torch.stack([zero, zero], 1)
    inside = alpha.abs() <= 1
    if code == "code2":
        first = torch.where(inside, torch.full_like(alpha, 2.0), zero)
        second = zero
    elif code == "code4p":
        a2 = alpha * alpha
        first = zero
        second = torch.where(inside, a2 * (a2 * 90.0 - 120.0) + 30.0, zero)
    else:
        raise UnsupportedModelError(f"histosys interpolation code {code!r} is not supported")
    return torch.stack([first, second, zero, zero], 1)


# d basis / d alpha at alpha = 0 (histosys_basis_derivative there; code0: left of its kink),
# in numpy: layouts are built without torch (and under FakeTensorMode, whose tensors have no
# values)
_HISTOSYS_SLOPES_AT_NOMINAL = {
    "code0": (0.0, 1.0),
    "code2": (0.0, 1.0, 0.0, 0.0),
    "code4p": (1.0, 0.0, 0.0, 0.0),
}


def histosys_slopes_at_nominal(code: str, coefficients: np.ndarray) -> np.ndarray:
    """``d delta / d alpha`` at ``alpha = 0`` ``[...]`` from coefficients ``[K, ...]`` (for the
    kinked code0, the slope left of the kink). Zero where ``hi == lo``: an even shift.

    >>> coefficients = histosys_coefficients("code4p", lo=[12.0, 8.0], nom=[10.0, 10.0], hi=[12.0, 13.0])
    >>> histosys_slopes_at_nominal("code4p", coefficients).tolist()
    [0.0, 2.5]
    >>> basis = histosys_basis_derivative("code4p", torch.zeros(1, 1, dtype=torch.float64))
    >>> torch.einsum("bkj,kq->bq", basis, torch.as_tensor(coefficients)).tolist()
    [[0.0, 2.5]]
    """
    coefficients = np.asarray(coefficients)
    slopes = _HISTOSYS_SLOPES_AT_NOMINAL[code]
    return sum(w * coefficients[k] for k, w in enumerate(slopes) if w)  # one term for each code


# pyhf's closed-form inverse of the code4 system for alpha0 = 1 (pyhf.interpolators.code4)
_CODE4_A_INVERSE = np.array(
    [
        [15.0 / 16, -15.0 / 16, -7.0 / 16, -7.0 / 16, 1.0 / 16, -1.0 / 16],
        [3.0 / 2, 3.0 / 2, -9.0 / 16, 9.0 / 16, 1.0 / 16, 1.0 / 16],
        [-5.0 / 8, 5.0 / 8, 5.0 / 8, 5.0 / 8, -1.0 / 8, 1.0 / 8],
        [3.0 / -2, 3.0 / -2, -7.0 / -8, 7.0 / -8, -1.0 / 8, -1.0 / 8],
        [3.0 / 16, -3.0 / 16, -3.0 / 16, -3.0 / 16, 1.0 / 16, -1.0 / 16],
        [1.0 / 2, 1.0 / 2, -5.0 / 16, 5.0 / 16, 1.0 / 16, 1.0 / 16],
    ]
)


def normsys_coefficients(code: str, lo, hi) -> np.ndarray:
    """Coefficients ``[8, T]`` of the normsys factor for relative variations ``lo, hi``.

    Rows: ``log(hi)``, ``log(lo)``, then (code4 only) the six polynomial coefficients used
    for ``|alpha| < 1``. Non-positive variations have no logarithm and are refused.
    """
    lo = np.asarray(lo, dtype=np.float64)
    hi = np.asarray(hi, dtype=np.float64)
    if code not in NORMSYS_CODES:
        raise UnsupportedModelError(
            f"normsys interpolation code {code!r} is not supported (supported: {NORMSYS_CODES})"
        )
    if np.any(lo <= 0) or np.any(hi <= 0):
        raise UnsupportedModelError(
            "normsys with a non-positive 'hi' or 'lo' factor is not supported"
        )
    log_hi, log_lo = np.log(hi), np.log(lo)
    poly = np.zeros((6, *hi.shape))
    if code == "code4":
        b = np.stack([hi - 1, lo - 1, log_hi * hi, -log_lo * lo, log_hi**2 * hi, log_lo**2 * lo])
        poly = np.einsum("rc,c...->r...", _CODE4_A_INVERSE, b)
    return np.concatenate([log_hi[None], log_lo[None], poly])


def normsys_kernel_coefficients(coefficients: np.ndarray) -> np.ndarray:
    """The kernel's normsys coefficients ``[19, ...]`` from :func:`normsys_coefficients`'
    ``[8, ...]``: those rows, then the polynomial's derivative ``i c_i`` (i = 1..6) and second
    derivative ``i (i - 1) c_i`` (i = 2..6), computed once so that each evaluation is a chain
    of fused multiply-adds over rows of one :meth:`Tensor.unbind`.

    >>> normsys_kernel_coefficients(normsys_coefficients("code4", lo=[0.9], hi=[1.2])).shape
    (19, 1)
    """
    coefficients = np.asarray(coefficients)
    poly = coefficients[2:8]
    degree = np.arange(1, 7, dtype=np.float64).reshape(-1, *([1] * (poly.ndim - 1)))
    return np.concatenate([coefficients, degree * poly, (degree * (degree - 1) * poly)[1:]])


def normsys_log_factor(code: str, alpha: Tensor, coefficients: Tensor) -> tuple[Tensor, Tensor]:
    """``log |factor|`` and ``factor < 0`` (as 0/1) at ``alpha [B, T]``, coefficients ``[19,
    T]`` (:func:`normsys_kernel_coefficients`).

    Extreme variations (``lo = 0.01, hi = 40`` occur in published workspaces) can drive the
    code4 polynomial below zero; pyhf multiplies such factors as they are, so the sign is
    carried separately to multiply exactly as pyhf does.
    """
    log_abs, negative, _ = _normsys(code, alpha, coefficients.unbind(0), with_slope=False)
    return log_abs, negative


def normsys_log_factor_and_slope(
    code: str, alpha: Tensor, coefficients: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`normsys_log_factor` and ``d log|factor| / d alpha``, sharing the polynomial."""
    log_abs, negative, slope = _normsys(code, alpha, coefficients.unbind(0), with_slope=True)
    assert slope is not None
    return log_abs, negative, slope


def _normsys(
    code: str, alpha: Tensor, rows: tuple[Tensor, ...], with_slope: bool
) -> tuple[Tensor, Tensor, Tensor | None]:
    # Written with clamps and fused multiply-adds rather than masks and torch.where: on the
    # CPU a where over [B, T] costs as much as six multiply-adds.
    log_hi, minus_log_lo = rows[0], rows[1].neg()
    if code == "code1":  # alpha log(hi) above 0, -alpha log(lo) below
        log_abs = torch.addcmul(alpha.clamp(min=0.0) * log_hi, alpha.clamp(max=0.0), minus_log_lo)
        slope = torch.where(alpha > 0, log_hi, minus_log_lo) if with_slope else None
        return log_abs, torch.zeros_like(alpha), slope
    # code4: exponential outside |alpha| < 1, a 6th-order polynomial inside. The polynomial is
    # evaluated at the clamped alpha (the branch not taken never produces NaN gradients), where
    # at +-1 it equals hi or lo (> 0, so only the inside can be negative); beyond, the
    # exponential continues log|factor| linearly: log(hi) + (alpha - 1) log(hi) = alpha log(hi).
    inner_alpha = alpha.clamp(-1.0, 1.0)
    inner = _horner(rows[2:8], inner_alpha).mul_(inner_alpha).add_(1.0)
    beyond = alpha - inner_alpha  # > 0 above 1, < 0 below -1, else 0
    log_abs = torch.addcmul(inner.abs().log_(), beyond.clamp(min=0.0), log_hi)
    log_abs = log_abs.addcmul_(beyond.clamp(max=0.0), minus_log_lo)
    negative = (inner < 0).to(alpha.dtype)
    slope = None
    if with_slope:
        # the polynomial matches the exponential's value and slope at +-1, so its log-slope
        # at the clamped alpha is also the slope beyond: log(hi) above 1, -log(lo) below -1
        # (to the precision of the polynomial's coefficients, ~1e-11 for lo = 0.01, hi = 40)
        slope = _horner(rows[8:14], inner_alpha).div_(inner)
    return log_abs, negative, slope


def normsys_log_curvature(code: str, alpha: Tensor, coefficients: Tensor) -> Tensor:
    """``d2 log|factor| / d alpha2`` ``[B, T]``: 0 where the log-factor is linear (code1, and
    code4 beyond ``|alpha| = 1``), ``f''/f - (f'/f)^2`` on the code4 polynomial."""
    if code == "code1":
        return torch.zeros_like(alpha)
    rows = coefficients.unbind(0)
    inner_alpha = alpha.clamp(-1.0, 1.0)
    factor = _horner(rows[2:8], inner_alpha).mul_(inner_alpha).add_(1.0)
    slope = _horner(rows[8:14], inner_alpha) / factor
    curvature = _horner(rows[14:19], inner_alpha) / factor - slope**2
    return torch.where(alpha == inner_alpha, curvature, 0.0)


def _horner(rows: tuple[Tensor, ...], alpha: Tensor) -> Tensor:
    """``rows[0] + rows[1] alpha + ... + rows[-1] alpha^(n - 1)``: one fused multiply-add per
    degree."""
    poly = torch.addcmul(rows[-2], rows[-1], alpha)
    for row in reversed(rows[:-2]):
        poly = torch.addcmul(row, poly, alpha)
    return poly
