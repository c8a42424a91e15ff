"""Profile-likelihood test statistics exactly as pyhf's ``infer.test_statistics``, batched.

The tensor functions take the twice-NLL minima of the conditional (POI fixed at ``mu``) and
unconditional fits and the unconditional best-fit POI ``muhat``, per row:

- ``t_mu = max(2 NLL(mu, theta_hat_hat) - 2 NLL(mu_hat, theta_hat), 0)``
- ``q_mu``: ``t_mu``, or 0 where ``muhat > mu`` (``q~_mu`` when the POI is bounded at 0)
- ``q_0``: ``t_0``, or 0 where ``muhat < 0``

:func:`compute` runs the two fits for ``B`` rows in one batched minimiser call.

Example:
    >>> import torch
    >>> fixed, free = torch.tensor([28.5, 25.0, 26.0]), torch.tensor([25.0, 25.5, 25.0])
    >>> qmu_like(torch.tensor([1.0, 1.0, 1.0]), torch.tensor([0.0, 0.2, 1.5]), fixed, free).tolist()
    [3.5, 0.0, 0.0]
    >>> q0_like(torch.tensor([0.3, -0.1, 0.5]), fixed, free).tolist()
    [3.5, 0.0, 1.0]
"""

from __future__ import annotations

from torch import Tensor

from .errors import InferenceError
from .mle import FitRequest, fit_requests
from .results import FitResults

__all__ = [
    "TEST_STATS",
    "check_test_stat",
    "compute",
    "from_deviances",
    "q0_like",
    "qmu_like",
    "test_statistic",
    "tmu_like",
]

TEST_STATS = ("q0", "q", "qtilde")


def check_test_stat(name: str) -> None:
    """Raise ``ValueError`` unless ``name`` is one of :data:`TEST_STATS`."""
    if name not in TEST_STATS:
        raise InferenceError(f"unknown test statistic {name!r}; expected one of {TEST_STATS}")


def tmu_like(fixed_twice_nll: Tensor, free_twice_nll: Tensor) -> Tensor:
    """``t_mu`` (``t~_mu`` with the POI bounded at 0): the clipped twice-NLL difference."""
    return (fixed_twice_nll - free_twice_nll).clamp(min=0.0)


def qmu_like(mu: Tensor, muhat: Tensor, fixed_twice_nll: Tensor, free_twice_nll: Tensor) -> Tensor:
    """``q_mu`` / ``q~_mu``: ``t_mu``, set to 0 where the best-fit POI exceeds ``mu``."""
    t = tmu_like(fixed_twice_nll, free_twice_nll)
    return t.masked_fill(muhat > mu, 0.0)


def q0_like(muhat: Tensor, fixed_twice_nll: Tensor, free_twice_nll: Tensor) -> Tensor:
    """``q_0``: ``t_0``, set to 0 where the best-fit POI is negative."""
    t = tmu_like(fixed_twice_nll, free_twice_nll)
    return t.masked_fill(muhat < 0, 0.0)


def test_statistic(
    name: str, mu: Tensor, fixed: FitResults, free: FitResults, poi_index: int
) -> Tensor:
    """The test statistic ``name`` (``"q0"``, ``"q"``, ``"qtilde"``) from the two fits' results
    (of the same datasets: their ``deviance`` differences are the ``-2 log L`` differences)."""
    return from_deviances(name, mu, free.bestfit[:, poi_index], fixed.deviance, free.deviance)


def from_deviances(
    name: str, mu: Tensor, muhat: Tensor, fixed_deviance: Tensor, free_deviance: Tensor
) -> Tensor:
    """The test statistic ``name`` from the fits' deviances and the best-fit POI ``muhat``."""
    if name == "q0":
        return q0_like(muhat, fixed_deviance, free_deviance)
    if name in ("q", "qtilde"):
        return qmu_like(mu, muhat, fixed_deviance, free_deviance)
    raise InferenceError(f"unknown test statistic {name!r}; expected one of {TEST_STATS}")


test_statistic.__test__ = False  # not a pytest test


def compute(
    name: str, model, mu: Tensor, data: Tensor, element: Tensor, **fit_kwargs
) -> tuple[Tensor, FitResults, FitResults]:
    """Test statistic ``[B]`` of ``B`` rows plus the (conditional, unconditional) fits.

    ``q0`` tests ``mu = 0`` whatever ``mu`` says (as pyhf). ``fit_kwargs`` go to
    :func:`~pyhf_gpu_server.inference.mle.fit_rows` (``bounds``, ``options``, ...).
    """
    tested = mu * 0.0 if name == "q0" else mu
    free_poi = mu * float("nan")
    fixed, free = fit_requests(
        model,
        [FitRequest(data, element, tested), FitRequest(data, element, free_poi)],
        **fit_kwargs,
    )
    return test_statistic(name, tested, fixed, free, model.poi_index), fixed, free
