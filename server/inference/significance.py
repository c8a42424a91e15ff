"""Discovery significance from ``q0`` (pyhf's ``hypotest(0.0, ..., test_stat="q0")``), batched.

``p0`` is the observed CLsb of the ``q0`` test (the probability of a background-only
fluctuation at least as signal-like as the data), ``Z = Phi^-1(1 - p0)``. The expected
values are, asymptotically, from pyhf's Asimov dataset at ``mu = 1``; with
``calctype="toybased"``, the percentiles of p0 over toys drawn at ``mu = 1`` (pyhf's
``ToyCalculator``, each row's toys from ``seed``: :mod:`~pyhf_gpu_server.inference.toys`).

Example:
    >>> from pyhf_gpu_server.inference.examples import simple_model
    >>> res = significance(simple_model([12.0, 11.0], [50.0, 52.0], [3.0, 7.0], data=[60.0, 62.0]))
    >>> round(res.z_obs.item(), 4), round(res.z_exp.item(), 4)
    (1.5741, 1.8289)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .hypotest import CalculatorKeywords, hypotest
from .results import HypotestResults, SignificanceResults

if TYPE_CHECKING:
    from typing import Unpack

    from ..engine.model import HistFactoryModel

__all__ = ["significance", "significance_of", "z_from_p"]


def z_from_p(p: Tensor) -> Tensor:
    """One-sided significance ``Z = Phi^-1(1 - p)`` (computed as ``-Phi^-1(p)``; at
    ``p = 0.5``, ``0.0`` rather than ``-0.0``).

    >>> p = torch.tensor([0.5, 0.025, 1e-300], dtype=torch.float64)
    >>> [round(z, 4) for z in z_from_p(p).tolist()]
    [0.0, 1.96, 37.0471]
    """
    return 0.0 - torch.special.ndtri(p)


def significance(
    model: HistFactoryModel,
    element=None,
    *,
    data: Tensor | None = None,
    **keywords: Unpack[CalculatorKeywords],
) -> SignificanceResults:
    """Observed and expected discovery p-values and significances per element (or dataset):
    pyhf's ``hypotest(0.0, ..., test_stat="q0")``; the options as
    :func:`~pyhf_gpu_server.inference.hypotest.hypotest`'s."""
    res = hypotest(model, 0.0, element, data=data, test_stat="q0", **keywords)
    return significance_of(res)


def significance_of(res: HypotestResults) -> SignificanceResults:
    """The significances of ``q0`` tests (:func:`~.hypotest.hypotest` at 0 with
    ``test_stat="q0"``). Asymptotically ``p0 = Phi(-sqrt(q0))``, so ``Z = sqrt(q0)``: where
    ``p0`` is below the smallest double (0: ``Z`` above 37.5), ``Z`` is taken from the test
    statistics themselves (``sqrt(q0)`` observed, ``sqrt(q0_A)`` expected).

    >>> from pyhf_gpu_server.inference.examples import simple_model
    >>> res = significance(simple_model([30.0], [10.0], [0.1], data=[400.0]))
    >>> res.p0_obs.item(), round(res.z_obs.item(), 2), round(res.z_exp.item(), 2)
    (0.0, 46.18, 7.11)
    """
    p0_obs, p0_set = res.clsb_obs, res.clsb_exp
    p0_exp = p0_set[:, 2]
    z_obs, z_exp = z_from_p(p0_obs), z_from_p(p0_exp)
    if res.sqrtq_asimov is not None:  # asymptotic: teststat = sqrt(q0) - sqrt(q0_A)
        z_obs = torch.where(p0_obs == 0, res.teststat + res.sqrtq_asimov, z_obs)
        z_exp = torch.where(p0_exp == 0, res.sqrtq_asimov, z_exp)
    return SignificanceResults(
        p0_obs=p0_obs,
        p0_exp=p0_exp,
        z_obs=z_obs,
        z_exp=z_exp,
        p0_exp_set=p0_set,
        element=res.element,
        converged=res.converged,
        starts=res.starts,
        starts_agreed=res.starts_agreed,
    )
