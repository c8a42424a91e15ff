"""Upper limits on the POI (pyhf's ``infer.intervals.upper_limits``), batched over elements.

- With a ``scan``: every (element, scan point) hypothesis test runs as one batch, then each of
  the six CLs curves (observed, five expected bands) is interpolated at ``level`` exactly as
  pyhf's ``linear_grid_scan`` (``np.interp`` on the reversed curve); a curve the scan does
  not bracket gets the scan's end, as pyhf's, and ``outside_scan`` says so.
- Without: a batched root search on all six curves of every element at once (pyhf runs
  ``toms748`` per curve). Each iteration tests one new POI value per curve and element in
  a single calculator call; the unconditional and Asimov fits are reused from the first
  call, and each conditional fit starts at the minimum found at the nearest value tested
  before. Brackets use every tested value; the next value is the secant's root in
  ``Phi^-1(CLs)``, which is nearly linear in the POI asymptotically (bisection when it
  leaves the bracket). A bracket open above the POI's upper bound is widened by
  extrapolating (at most 4x, else doubling; pyhf doubles), and the fits go on beyond the
  bound, where pyhf raises ValueError: ``beyond_bounds`` says which curves went there (pyhf's
  condition: CLs at the upper bound above ``level``).

Example:
    >>> import torch
    >>> xp = torch.tensor([[0.01, 0.04, 0.2, 1.0]])  # CLs, reversed (increasing)
    >>> fp = torch.tensor([[3.0, 2.0, 1.0, 0.0]])    # scan, reversed
    >>> interp(torch.tensor([0.05]), xp, fp).tolist()
    [1.9375]
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .asymptotics import N_SIGMA, AsymptoticCalculator, normal_cdf
from .errors import InferenceError
from .hypotest import CalculatorSpec, HypotestKeywords, make_calculator, run_calculator
from .results import HypotestResults, UpperLimitResults, map_tensors
from .rows import as_float, rows_of
from .starts import FitStatus

if TYPE_CHECKING:
    from typing import Unpack

    from ..engine.model import HistFactoryModel

__all__ = ["interp", "linear_grid_scan", "toms748_like_scan", "upper_limit"]


def interp(x: Tensor, xp: Tensor, fp: Tensor) -> Tensor:
    """``np.interp(x[r], xp[r], fp[r])`` for every row ``r`` (``xp`` increasing per row)."""
    n = xp.shape[-1]
    j = torch.searchsorted(xp.contiguous(), x.unsqueeze(-1).contiguous(), right=True).squeeze(-1)
    j = j.clamp(1, n - 1).unsqueeze(-1)
    x0, x1, f0, f1 = (t.gather(-1, k).squeeze(-1) for t in (xp, fp) for k in (j - 1, j))
    inner = f0 + (x - x0) * (f1 - f0) / (x1 - x0)
    out = torch.where(x < xp[..., 0], fp[..., 0], inner)
    return torch.where(x >= xp[..., -1], fp[..., -1], out)


def _curves(res: HypotestResults) -> Tensor:
    """``[rows, 6]``: observed CLs then the five expected CLs bands."""
    return torch.cat([res.cls_obs.unsqueeze(-1), res.cls_exp], dim=-1)


def linear_grid_scan(
    model: HistFactoryModel,
    scan,
    spec: CalculatorSpec,
    data: Tensor | None = None,
    element=None,
    level: float = 0.05,
) -> tuple[UpperLimitResults, HypotestResults]:
    """Limits from hypothesis tests at every ``scan`` value (pyhf's ``linear_grid_scan``).

    Returns the limits of each requested row and the hypotest results of the distinct
    datasets (``[D * S]``, dataset-major).
    """
    scan = as_float(model, scan)
    S = scan.shape[0]
    datasets, elements, index = rows_of(model, data, element).datasets()
    calc = make_calculator(model, datasets, elements, spec)
    D = elements.shape[0]
    rows = torch.arange(D, device=model.device)
    res = run_calculator(calc, scan.repeat(D), rows.repeat_interleave(S))
    curves = _curves(res).view(D, S, 6).transpose(1, 2)  # [D, 6, S]
    xp = curves.flip(-1)
    fp = scan.flip(0).expand_as(xp)
    limits = interp(torch.full(xp.shape[:-1], level, dtype=xp.dtype, device=xp.device), xp, fp)
    outside = _outside(curves.select(-1, 0) < level, curves.select(-1, -1) > level)
    out = _limits(limits, level, elements, res.status.grouped(D), S, outside_scan=outside)
    return _per_row(out, index), res


def _limits(
    limits: Tensor, level: float, elements: Tensor, status: FitStatus, hypotests: int, **more
) -> UpperLimitResults:
    """The results of limits ``[R, 6]`` (observed, then expected) found with ``hypotests``
    tests per row; ``more``: the optional fields."""
    return UpperLimitResults(
        obs=limits[:, 0],
        exp=limits[:, 1:],
        level=level,
        element=elements,
        converged=status.converged,
        hypotests=torch.full_like(elements, hypotests),
        starts=status.starts,
        starts_agreed=status.agreed,
        **more,
    )


def _outside(below: Tensor, above: Tensor) -> Tensor:
    """``[R, 6]`` int8: 1 where ``above``, else -1 where ``below``, else 0."""
    one = torch.ones_like(above, dtype=torch.int8)
    return torch.where(above, one, torch.where(below, -one, torch.zeros_like(one)))


def _per_row(res: UpperLimitResults, index: Tensor) -> UpperLimitResults:
    """Limits of the distinct datasets mapped back onto the requested rows."""
    return map_tensors(res, lambda t: t[index])


def _brackets(mus: Tensor, values: Tensor, lo: Tensor, level: float) -> tuple[Tensor, Tensor]:
    """Per (row, curve): the tightest bracket ``[a, b]`` over all tested ``mus [R, T]`` with
    ``values [R, T, 6]`` (``a``: largest POI with CLs >= level, else ``lo``; ``b``: smallest
    POI with CLs < level, else +inf)."""
    above = values >= level
    m = mus.unsqueeze(-1).expand_as(values)
    a = torch.where(above, m, torch.full_like(m, -torch.inf)).amax(1)
    b = torch.where(above, torch.full_like(m, torch.inf), m).amin(1)
    return torch.where(torch.isinf(a), lo.unsqueeze(-1).expand_as(a), a), b


def _z(values: Tensor, level: float) -> Tensor:
    """``Phi^-1(CLs) - Phi^-1(level)``: nearly linear in the POI for asymptotic CLs."""
    target = torch.special.ndtri(torch.tensor(level, dtype=values.dtype, device=values.device))
    return torch.special.ndtri(values) - target


def _secant(mus: Tensor, values: Tensor, level: float) -> tuple[Tensor, Tensor]:
    """Per (row, curve): the root of the secant in ``Phi^-1(CLs)`` through the two tested
    points nearest the root (at distinct POI values), and the nearest point."""
    z = _z(values, level)  # [R, T, 6]
    m = mus.unsqueeze(-1).expand_as(z)
    distance = z.abs().nan_to_num(torch.inf)
    first = distance.argmin(1, keepdim=True)
    m1, z1 = m.gather(1, first).squeeze(1), z.gather(1, first).squeeze(1)
    distance = torch.where(m == m1.unsqueeze(1), torch.full_like(distance, torch.inf), distance)
    second = distance.argmin(1, keepdim=True)
    m2, z2 = m.gather(1, second).squeeze(1), z.gather(1, second).squeeze(1)
    return m1 - z1 * (m2 - m1) / (z2 - z1), m1


def _next_points(
    mus: Tensor, values: Tensor, a: Tensor, b: Tensor, level: float, rtol: float
) -> Tensor:
    """The next POI per (row, curve): the secant's root, kept inside the bracket (else
    bisection); while the bracket is open above, extrapolated up to four times the largest
    value below the root (else that value doubled). A root closer than ``rtol`` to the
    nearest tested point is moved ``rtol / 2`` beyond, so that the bracket closes instead of
    being approached from one side."""
    secant, nearest = _secant(mus, values, level)
    below = torch.clamp(torch.maximum(a, nearest), min=1e-3)
    top = torch.where(torch.isinf(b), 4 * below, b)
    usable = torch.isfinite(secant) & (secant > a) & (secant < top)
    fallback = torch.where(torch.isinf(b), 2 * below, 0.5 * (a + b))
    guess = torch.where(usable, secant, fallback)
    beyond = guess + torch.sign(guess - nearest) * 0.5 * rtol * guess.abs()
    close = (guess - nearest).abs() < rtol * guess.abs()
    return torch.where(close & (beyond > a) & (beyond < top), beyond, guess)


PROBES = (1.0, 0.3, 0.1, 0.03)  # first tested POI values, as fractions of the upper bound


def _asymptotic_guesses(probe: HypotestResults, mus: Tensor, muhat: Tensor, level: float) -> Tensor:
    """First guesses ``[R, 6]`` of the six limits from the probes ``mus [R, K]``.

    At the probe whose median expected CLs is nearest ``level`` (in log), the Asimov
    ``sqrt(q_A) = mu / sigma`` gives ``sigma``; the asymptotic formulas then give each band's
    limit, and the observed one shifted by ``muhat``.
    """
    median = probe.cls_exp[:, 2].view(mus.shape)
    tiny = torch.finfo(median.dtype).tiny
    distance = (torch.log(median.clamp(min=tiny)) - math.log(level)).abs()
    best = distance.nan_to_num(torch.inf).argmin(-1, keepdim=True)
    mu = mus.gather(1, best).squeeze(1)
    sqrtq_asimov = -torch.special.ndtri(0.5 * median.gather(1, best).squeeze(1))
    sigma = (mu / sqrtq_asimov).unsqueeze(-1)
    n = torch.tensor(N_SIGMA, dtype=mus.dtype, device=mus.device)
    expected = sigma * (-torch.special.ndtri(level * normal_cdf(-n)) - n)
    observed = expected[:, 2:3] + muhat.clamp(min=0).unsqueeze(-1)
    guesses = torch.cat([observed, expected], dim=-1)
    fallback = mu.unsqueeze(-1).expand_as(guesses)
    return torch.where(torch.isfinite(guesses) & (guesses > 0), guesses, fallback)


def _root(mus: Tensor, values: Tensor, a: Tensor, b: Tensor, level: float) -> Tensor:
    """Final limit: the secant's root, inside the bracket ``[a, b]`` (else its middle)."""
    root, _ = _secant(mus, values, level)
    inside = torch.isfinite(root) & (root >= a) & (root <= b)
    return torch.where(inside, root, 0.5 * (a + b))


def toms748_like_scan(
    model: HistFactoryModel,
    spec: CalculatorSpec,
    data: Tensor | None = None,
    element=None,
    level: float = 0.05,
    rtol: float = 1e-4,
    atol: float = 2e-12,
    max_iter: int = 40,
) -> UpperLimitResults:
    """Batched root search of the observed and expected limits (pyhf's ``upper_limit(scan=None)``).

    A curve is done when its bracket is narrower than ``atol + rtol * b`` or a tested value
    hits ``Phi^-1(CLs) = Phi^-1(level)`` to ``rtol``.
    """
    datasets, elements, index = rows_of(model, data, element).datasets()
    calc = make_calculator(model, datasets, elements, spec)
    R = elements.shape[0]
    rows = torch.arange(R, device=model.device)
    if spec.fit.bounds is None:
        bounds = model.bounds[elements, model.poi_index]
    else:
        bounds = as_float(model, spec.fit.bounds)[model.poi_index].expand(R, 2)
    lo, hi = bounds[:, 0], bounds[:, 1]

    fractions = torch.tensor(PROBES, dtype=hi.dtype, device=hi.device)
    mus = lo.unsqueeze(-1) + (hi - lo).unsqueeze(-1) * fractions  # [R, T]; the first: hi
    first = run_calculator(calc, mus.flatten(), rows.repeat_interleave(len(PROBES)))
    values = _curves(first).view(R, len(PROBES), 6)  # [R, T, 6]
    # pyhf's toms748_scan doubles the upper end while any curve's CLs there is above the
    # level: a fit beyond the POI's upper bound, where pyhf raises ValueError. That
    # condition, exactly, per curve (the first probe is the bound):
    beyond = values[:, 0] > level
    status = first.status.grouped(R)
    assert isinstance(calc, AsymptoticCalculator)  # the root search is asymptotic
    assert calc.free_data is not None  # fitted by the first call
    points = _asymptotic_guesses(first, mus, calc.free_data.bestfit[:, model.poi_index], level)
    for _ in range(max_iter):
        res = run_calculator(calc, points.flatten(), rows.repeat_interleave(6))
        mus = torch.cat([mus, points], dim=1)
        values = torch.cat([values, _curves(res).view(R, 6, 6)], dim=1)
        status = FitStatus.combine([status, res.status.grouped(R)])
        a, b = _brackets(mus, values, lo, level)
        hit = _z(values, level).abs().nan_to_num(torch.inf).amin(1) <= rtol
        done = torch.isfinite(b) & (((b - a) <= atol + rtol * b.abs()) | hit)
        if bool(done.all()):
            break
        points = torch.where(done, b, _next_points(mus, values, a, b, level, rtol))
    a, b = _brackets(mus, values, lo, level)
    limits = _root(mus, values, a, b, level)  # inf where no bracket closed
    out = _limits(
        limits, level, elements, status, mus.shape[1], bounds=bounds, beyond_bounds=beyond
    )
    return _per_row(out, index)


def upper_limit(
    model: HistFactoryModel,
    element=None,
    *,
    data: Tensor | None = None,
    scan=None,
    level: float = 0.05,
    rtol: float = 1e-4,
    **keywords: Unpack[HypotestKeywords],
) -> UpperLimitResults:
    """Observed and expected upper limits at CL ``1 - level`` per element (or dataset).

    Args:
        model: a :class:`~pyhf_gpu_server.engine.HistFactoryModel`.
        element: None (every element) or ``[B]`` element indices.
        data: None (observations) or ``[B, N + A]`` datasets.
        scan: POI values to test and interpolate (pyhf's ``scan=``); None: root search.
        level: the CLs level (0.05: 95% CL).
        rtol: relative width of the final brackets (root search); pyhf's and NextStat's
            default.
        keywords: the hypothesis tests' (:func:`~pyhf_gpu_server.inference.hypotest.hypotest`:
            ``test_stat``, ``calctype``, ``ntoys``, ``seed``, ``init``, ``bounds``,
            ``fixed``, ``options``...); the root search needs ``calctype="asymptotics"``
            (toys are noisy: give a ``scan`` for them).

    Returns:
        :class:`~pyhf_gpu_server.inference.results.UpperLimitResults`.
    """
    spec = CalculatorSpec.of(**keywords)
    if scan is not None:
        return linear_grid_scan(model, scan, spec, data, element, level)[0]
    if spec.calctype != "asymptotics":
        raise InferenceError("the root search needs calctype='asymptotics'; pass a scan for toys")
    return toms748_like_scan(model, spec, data, element, level, rtol=rtol)
