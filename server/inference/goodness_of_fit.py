"""Goodness of fit with a saturated model, batched over rows: cabinetry's ``goodness_of_fit``.

cabinetry (``fit._goodness_of_fit``) compares the best fit with a saturated model that
expects every main bin's observation exactly and keeps the constraint terms at their
maximum for the observed auxiliary data (Normal: ``theta = a``, Poisson: ``theta = a /
tau``); ``Delta(-2 ln L) = best_twice_nll - saturated_twice_nll`` is ``chi2``-distributed
with ``main bins - free unconstrained parameters`` degrees of freedom (cabinetry's
``unconstrained_parameter_count``: parameters without a constraint term that the model
does not fix; a shapefactor counts once per bin). The p-value is NaN where there are no
degrees of freedom left.

The saturated ``-2 ln L`` is the engine's
:meth:`~pyhf_gpu_server.engine.HistFactoryModel.saturated_twice_nll` and ``Delta(-2 ln L)``
its :meth:`~pyhf_gpu_server.engine.HistFactoryModel.deviance` at the best fit (evaluated
directly, without subtracting two large numbers). Everything stays on the model's device.

Example:
    >>> from pyhf_gpu_server.inference.examples import simple_model
    >>> from pyhf_gpu_server.inference import fit
    >>> model = simple_model([12.0, 11.0], [50.0, 52.0], [3.0, 7.0], data=[51.0, 48.0])
    >>> gof = goodness_of_fit(model, fit(model))
    >>> gof.ndof.tolist(), round(float(gof.p_value[0]), 4)
    ([1], 0.67)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .results import FitResults
from .rows import rows_of

__all__ = ["GoodnessOfFitResults", "goodness_of_fit", "unconstrained_parameter_count"]


@dataclass
class GoodnessOfFitResults:
    """Saturated-model goodness of fit of ``B`` rows.

    Attributes:
        p_value: ``[B]`` ``P(chi2_ndof >= delta_twice_nll)`` (NaN where ``ndof <= 0``).
        delta_twice_nll: ``[B]`` best-fit ``-2 ln L`` minus the saturated model's
            (cabinetry's ``2 * Delta NLL``).
        saturated_twice_nll: ``[B]`` the saturated model's ``-2 ln L``.
        ndof: ``[B]`` main bins minus free unconstrained parameters of the row's element.
        converged: ``[B]`` bool, the row's fit converged.
        element: ``[B]`` element index of each row.
    """

    p_value: Tensor
    delta_twice_nll: Tensor
    saturated_twice_nll: Tensor
    ndof: Tensor
    converged: Tensor
    element: Tensor

    def __len__(self) -> int:
        return self.p_value.shape[0]


def unconstrained_parameter_count(model) -> Tensor:
    """``[E]`` per element: its parameters without a constraint term that it does not fix
    (cabinetry's ``model_utils.unconstrained_parameter_count``; the parameters of other
    elements are fixed in its rows, so they do not count)."""
    unconstrained = torch.zeros(model.n_pars, dtype=torch.bool, device=model.device)
    unconstrained = unconstrained.index_fill(0, model.unconstrained, True)
    return (unconstrained & model.fixed.logical_not()).sum(dim=1)


def goodness_of_fit(
    model, fit: FitResults, data: Tensor | None = None, element=None
) -> GoodnessOfFitResults:
    """Saturated-model goodness of fit of the fits ``fit`` (cabinetry's
    ``fit(..., goodness_of_fit=True)``), per row.

    Args:
        model: a :class:`~pyhf_gpu_server.engine.HistFactoryModel`.
        fit: the rows' best fits (:func:`~pyhf_gpu_server.inference.mle.fit`).
        data: ``[B, N + A]`` the datasets fitted; None: the observations of each row's
            element.
        element: ``[B]`` element per row; None: ``fit.element``.

    Returns:
        :class:`GoodnessOfFitResults`.
    """
    r = rows_of(model, data, fit.element if element is None else element)
    data, element = r.data, r.element
    delta = model.deviance(fit.bestfit, data, element)
    saturated = model.saturated_twice_nll(data, element)
    ndof = model.n_main - unconstrained_parameter_count(model).index_select(0, element)
    dof = ndof.to(delta.dtype)
    p_value = torch.special.gammaincc(dof.clamp(min=1.0) / 2, delta.clamp(min=0.0) / 2)
    p_value = torch.where(ndof > 0, p_value, torch.full_like(p_value, torch.nan))
    return GoodnessOfFitResults(
        p_value=p_value,
        delta_twice_nll=delta,
        saturated_twice_nll=saturated,
        ndof=ndof,
        converged=fit.converged,
        element=element,
    )
