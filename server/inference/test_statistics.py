"""Profile-likelihood test statistics exactly as pyhf's ``infer.test_statistics``, batched,
as ONE object per statistic chosen by name (pyhf's ``infer.utils.get_test_stat``).

The statistics come from the twice-NLL minima of the conditional (POI fixed at ``mu``) and
unconditional fits and the unconditional best-fit POI ``muhat``, per row:

- ``t_mu = max(2 NLL(mu, theta_hat_hat) - 2 NLL(mu_hat, theta_hat), 0)``
- ``q_mu``: ``t_mu``, or 0 where ``muhat > mu`` (``q~_mu`` when the POI is bounded at 0)
- ``q_0``: ``t_0``, or 0 where ``muhat < 0``: a discovery test, which tests ``mu = 0``
  whatever ``mu`` says, against the background-plus-signal (``mu = 1``) Asimov data and toys

Example:
    >>> import torch
    >>> fixed, free = torch.tensor([28.5, 25.0, 26.0]), torch.tensor([25.0, 25.5, 25.0])
    >>> q = get_test_stat("q")
    >>> q.from_deviances(torch.ones(3), torch.tensor([0.0, 0.2, 1.5]), fixed, free).tolist()
    [3.5, 0.0, 0.0]
    >>> q0 = get_test_stat("q0")
    >>> q0.from_deviances(torch.ones(3), torch.tensor([0.3, -0.1, 0.5]), fixed, free).tolist()
    [3.5, 0.0, 1.0]
    >>> q0.tested(torch.tensor([2.0])).tolist(), q0.asimov_mu, get_test_stat("qtilde").poi_floor
    ([0.0], 1.0, 0.0)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .errors import InferenceError

if TYPE_CHECKING:
    from .results import FitResults

__all__ = ["TEST_STATS", "TestStatistic", "get_test_stat"]


@dataclass(frozen=True)
class TestStatistic:
    """One profile-likelihood test statistic and everything that follows from its choice.

    Attributes:
        name: ``"q0"``, ``"q"`` or ``"qtilde"``.
        discovery: ``q0``: tests ``mu = 0``; its Asimov data and background toys are at
            ``mu = 1``; pyhf reports CLsb (= p0) in place of CLs.
        poi_floor: ``q~`` bounds the POI below at 0 in every fit (None: the model's bound).
        quadratic: ``q~``'s asymptotic form beyond ``sqrt(q_A)``.
    """

    __test__ = False  # not a pytest test class

    name: str
    discovery: bool = False
    poi_floor: float | None = None
    quadratic: bool = False

    @property
    def asimov_mu(self) -> float:
        """The POI value of pyhf's Asimov dataset (and of the background toys): 1 for
        ``q0``, else 0."""
        return 1.0 if self.discovery else 0.0

    def tested(self, mu: Tensor) -> Tensor:
        """The POI values actually tested for requested ``mu`` (``q0``: 0 everywhere)."""
        return torch.zeros_like(mu) if self.discovery else mu

    def clipped(self, tested: Tensor, muhat: Tensor) -> Tensor:
        """Rows whose statistic is 0 by the best-fit POI alone (no conditional fit needed):
        ``muhat < 0`` for ``q0``, ``muhat > mu`` for ``q``/``q~``."""
        return muhat < 0 if self.discovery else muhat > tested

    def from_deviances(
        self, tested: Tensor, muhat: Tensor, fixed_deviance: Tensor, free_deviance: Tensor
    ) -> Tensor:
        """The statistic from the fits' deviances and the best-fit POI ``muhat``."""
        t = (fixed_deviance - free_deviance).clamp(min=0.0)
        return t.masked_fill(self.clipped(tested, muhat), 0.0)

    def of_fits(
        self, tested: Tensor, fixed: FitResults, free: FitResults, poi_index: int
    ) -> Tensor:
        """The statistic from the conditional and unconditional fits of the same datasets
        (their ``deviance`` differences are the ``-2 log L`` differences)."""
        return self.from_deviances(
            tested, free.bestfit[:, poi_index], fixed.deviance, free.deviance
        )

    def asymptotic(self, sqrtq: Tensor, sqrtq_asimov: Tensor) -> Tensor:
        """pyhf's asymptotic test statistic from ``sqrt(q)`` and ``sqrt(q_A)``: ``sqrt(q) -
        sqrt(q_A)``; for ``q~`` where ``sqrt(q) > sqrt(q_A)``, ``(q - q_A) / (2 sqrt(q_A))``."""
        linear = sqrtq - sqrtq_asimov
        if not self.quadratic:
            return linear
        quadratic = (sqrtq**2 - sqrtq_asimov**2) / (2 * sqrtq_asimov)
        return torch.where(sqrtq <= sqrtq_asimov, linear, quadratic)


_STATISTICS = {
    "q0": TestStatistic("q0", discovery=True),
    "q": TestStatistic("q"),
    "qtilde": TestStatistic("qtilde", poi_floor=0.0, quadratic=True),
}
TEST_STATS = tuple(_STATISTICS)


def get_test_stat(name: str) -> TestStatistic:
    """The test statistic called ``name``; :class:`InferenceError` naming the choices if none."""
    try:
        return _STATISTICS[name]
    except (KeyError, TypeError):
        raise InferenceError(
            f"unknown test statistic {name!r}; expected one of {TEST_STATS}"
        ) from None
