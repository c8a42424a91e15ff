"""What a model's constraint terms say about its parameters before any fit, as cabinetry
reads them (``model_utils.asimov_parameters``, ``prefit_uncertainties``): shared by the
ranking (pre-fit impacts, pulls) and the pre-fit yields.

Example:
    >>> from pyhf_gpu_server.inference.examples import simple_model
    >>> model = simple_model([5.0], [10.0], [2.5], data=[12.0])
    >>> [round(v, 4) for v in prefit_uncertainties(model)[0].tolist()]  # mu, gamma (shapesys)
    [0.0, 0.25]
    >>> asimov_parameters(model)[0].tolist()
    [1.0, 1.0]
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from ..engine.model import HistFactoryModel

__all__ = ["asimov_parameters", "constraint_centres", "prefit_uncertainties"]


def prefit_uncertainties(model: HistFactoryModel) -> Tensor:
    """cabinetry's ``prefit_uncertainties`` per element ``[E, P]``: the width of each
    parameter's constraint term (Normal: sigma; Poisson: ``1 / sqrt(tau)``), 0 for
    unconstrained and fixed parameters (and for parameters an element does not have)."""
    c = model.constraint
    width = torch.where(c.is_poisson, torch.rsqrt(c.scale), c.sigma)  # [E, A]
    width = torch.where(c.present, width, torch.zeros_like(width))
    full = torch.zeros(model.n_elements, model.n_pars, dtype=model.dtype, device=model.device)
    full = full.index_copy(1, c.param, width)
    return torch.where(model.fixed, torch.zeros_like(full), full)


def asimov_parameters(model: HistFactoryModel) -> Tensor:
    """cabinetry's ``asimov_parameters`` per element ``[E, P]``: unconstrained parameters at
    their start value, constrained histosys and normsys at 0, other constrained ones
    (staterror, lumi, shapesys) at 1."""
    constraint, mtype = _columns(model)
    constrained = _mask(model, [c is not None for c in constraint])
    at_zero = _mask(model, [t in ("histosys", "normsys") for t in mtype])
    ones = torch.ones(model.n_pars, dtype=model.dtype, device=model.device)
    nominal = torch.where(at_zero, torch.zeros_like(ones), ones)
    return torch.where(constrained, nominal, model.init)


def constraint_centres(model: HistFactoryModel, data: Tensor, element: Tensor) -> Tensor:
    """``[B, P]`` the value each constrained parameter's term is centred on for the datasets
    ``data [B, N + A]`` (its auxiliary datum, divided by ``tau`` for Poisson terms); the
    model's start value for the others."""
    c = model.constraint
    aux = data.narrow(1, model.n_main, model.n_aux)
    scale = c.scale.index_select(0, element)
    centre = torch.where(c.is_poisson, aux / scale, aux)
    return model.init.index_select(0, element).index_copy(1, c.param, centre)


def _columns(model: HistFactoryModel) -> tuple[list, list]:
    """Per parameter column of the model: its constraint (None, "normal", "poisson") and
    modifier type (host metadata of the stack's parameter sets)."""
    constraint, mtype = [], []
    for parset in model.stack.parameters:
        constraint += [parset.constraint] * parset.n_parameters
        mtype += [parset.modifier_type] * parset.n_parameters
    return constraint, mtype


def _mask(model, values: list[bool]) -> Tensor:
    return torch.tensor(values, dtype=torch.bool, device=model.device)
