"""Pre- and post-fit yields with uncertainties, batched over rows: cabinetry's ``prediction``.

For every row (one element of the model and one dataset) :func:`yields` gives the expected
yields per channel, sample and bin, their totals over samples and over each channel's bins,
and the uncertainties of all of them as cabinetry's ``model_utils.yield_stdev`` computes
them: each parameter varied by ``+-1 sigma`` alone, the variations symmetrised,
``delta_i = (y(theta + sigma_i e_i) - y(theta - sigma_i e_i)) / 2``, and combined with the
correlation matrix, ``var(y) = sum_ij delta_i rho_ij delta_j``.

- pre-fit: cabinetry's Asimov parameters (:func:`asimov_parameters`), the widths of the
  constraint terms (:func:`prefit_uncertainties`) and no correlations;
- post-fit: the best fit, its Hessian uncertainties and correlations (``fit`` is run when
  not given).

The ``2 P + 1`` parameter points of every row are evaluated as one batch of the model's
per-sample rates (:meth:`~pyhf_gpu_server.engine.HistFactoryModel.sample_rates`), in chunks
of at most ``max_rows`` points; every tensor stays on the model's device.

Example:
    >>> from pyhf_gpu_server.inference.examples import simple_model
    >>> model = simple_model([5.0], [10.0], [2.5], data=[12.0])
    >>> res = yields(model)
    >>> res.samples[0], res.prefit.yields[0].tolist(), res.prefit.stdev[0].tolist()
    (['background', 'signal'], [[10.0], [5.0]], [[2.5], [0.0]])
    >>> res.prefit.total[0].tolist(), res.data[0].tolist()
    ([15.0], [12.0])
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .constraints import asimov_parameters, prefit_uncertainties
from .covariance import conditional_uncertainties
from .mle import FitOptions, fit_rows
from .results import FitResults
from .rows import Rows, rows_of

__all__ = [
    "YieldSet",
    "YieldsResults",
    "yield_prediction",
    "yields",
    "yields_of",
]


@dataclass
class YieldSet:
    """Yields and uncertainties of ``B`` rows at one parameter point per row.

    ``S``: the model's sample axis (a row's element's samples in pyhf's order, zero past its
    last one), ``N`` main bins, ``C`` channels (pyhf's order).

    Attributes:
        yields, stdev: ``[B, S, N]`` per sample and bin.
        total, total_stdev: ``[B, N]`` the sum over samples, per bin.
        channel_yields, channel_stdev: ``[B, S, C]`` per sample, summed over each channel's
            bins.
        channel_total, channel_total_stdev: ``[B, C]`` the sum over samples and bins.
        parameters, uncertainty: ``[B, P]`` the parameter point and the ``sigma`` it was
            varied by.
    """

    yields: Tensor
    stdev: Tensor
    total: Tensor
    total_stdev: Tensor
    channel_yields: Tensor
    channel_stdev: Tensor
    channel_total: Tensor
    channel_total_stdev: Tensor
    parameters: Tensor
    uncertainty: Tensor


@dataclass
class YieldsResults:
    """Pre- and post-fit yields of ``B`` rows (cabinetry's two ``ModelPrediction``s and the
    data of its yield tables).

    Attributes:
        prefit, postfit: :class:`YieldSet`.
        data: ``[B, N]`` observed main data; ``channel_data``: ``[B, C]`` its channel sums.
        converged: ``[B]`` bool, the post-fit's fit converged.
        element: ``[B]`` element index of each row.
        fit: the post-fit's :class:`~pyhf_gpu_server.inference.results.FitResults`.
        channels: ``[(name, bins)]`` in pyhf's order.
        samples: per element, its sample names (the ``S`` axis of its rows).
        element_names: the model's element names.
    """

    prefit: YieldSet
    postfit: YieldSet
    data: Tensor
    channel_data: Tensor
    converged: Tensor
    element: Tensor
    fit: FitResults
    channels: list[tuple[str, int]]
    samples: list[list[str]]
    element_names: list[str]

    def __len__(self) -> int:
        return self.element.shape[0]


def _bin_channel(model) -> Tensor:
    """``[N]`` the channel index of every main bin."""
    channels = model.elements[0].channels
    index = [c for c, (_, bins) in enumerate(channels) for _ in range(bins)]
    return torch.tensor(index, dtype=torch.long, device=model.device)


def _extended(rates: Tensor, bin_channel: Tensor, n_channels: int) -> Tensor:
    """``[R, S, N]`` -> ``[R, S + 1, N + C]``: the sum over samples appended as one more
    sample, the sums over each channel's bins as more bins (cabinetry's layout)."""
    rates = torch.cat([rates, rates.sum(dim=1, keepdim=True)], dim=1)
    sums = torch.zeros(*rates.shape[:2], n_channels, dtype=rates.dtype, device=rates.device)
    return torch.cat([rates, sums.index_add(2, bin_channel, rates)], dim=2)


def yield_prediction(
    model,
    parameters: Tensor,
    uncertainty: Tensor,
    corr_mat: Tensor,
    element: Tensor,
    *,
    max_rows: int = 8192,
) -> YieldSet:
    """Yields ``[B, S, N]`` at ``parameters [B, P]`` of rows of ``element [B]`` and their
    standard deviations as cabinetry's ``yield_stdev`` (``uncertainty [B, P]``, ``corr_mat
    [B, P, P]``): the central point and the ``2 P`` one-parameter variations of every row
    evaluated in batches of at most ``max_rows`` parameter points."""
    B, P = parameters.shape
    N, C = model.n_main, len(model.elements[0].channels)
    bin_channel = _bin_channel(model)
    points = 2 * P + 1
    chunk = max(1, max_rows // points)
    central, variance = [], []
    for start in range(0, B, chunk):
        length = min(chunk, B - start)
        pars, unc, corr, elem = (
            t.narrow(0, start, length) for t in (parameters, uncertainty, corr_mat, element)
        )
        shift = torch.diag_embed(unc)  # [b, P, P]: row i varies parameter i
        centre = pars.unsqueeze(1)
        varied = torch.cat([centre, centre + shift, centre - shift], dim=1)  # [b, 2P+1, P]
        rates = model.sample_rates(varied.flatten(0, 1), elem.repeat_interleave(points))
        rates = _extended(rates, bin_channel, C).unflatten(0, (length, points)).flatten(2)
        up, down = rates.narrow(1, 1, P), rates.narrow(1, 1 + P, P)
        sym = (up - down) / 2  # [b, P, K]
        central.append(rates.select(1, 0))
        variance.append((sym * (corr @ sym)).sum(dim=1))
    S = model.n_samples
    values = torch.cat(central).unflatten(1, (S + 1, N + C))
    stdev = torch.sqrt(torch.cat(variance)).unflatten(1, (S + 1, N + C))

    def part(t: Tensor, samples: bool, bins: bool) -> Tensor:
        t = t.narrow(1, 0, S) if samples else t.select(1, S)
        return t.narrow(-1, 0, N) if bins else t.narrow(-1, N, C)

    return YieldSet(
        yields=part(values, True, True),
        stdev=part(stdev, True, True),
        total=part(values, False, True),
        total_stdev=part(stdev, False, True),
        channel_yields=part(values, True, False),
        channel_stdev=part(stdev, True, False),
        channel_total=part(values, False, False),
        channel_total_stdev=part(stdev, False, False),
        parameters=parameters,
        uncertainty=uncertainty,
    )


def yields(
    model,
    data: Tensor | None = None,
    element=None,
    *,
    fit: FitResults | None = None,
    options: FitOptions | None = None,
) -> YieldsResults:
    """Pre- and post-fit yields with uncertainties per row (cabinetry's ``prediction``
    without and with fit results), and the observed data.

    Args:
        model: a :class:`~pyhf_gpu_server.engine.HistFactoryModel`.
        data: ``[B, N + A]`` datasets; None for the observations of each row's element.
        element: ``[B]`` element per row; None: the fit's rows if ``fit`` is given, else
            every element (no ``data``) or element 0.
        fit: the rows' fits with uncertainties and correlations (``fit(...,
            uncertainties=True)``); None: fitted here. A parameter without an uncertainty (NaN)
            counts as held at its best fit where others have one; a row without any gives NaN
            stdevs.
        options: :class:`~pyhf_gpu_server.inference.mle.FitOptions` of that fit (its
            ``max_rows`` also bounds the parameter points per evaluation).

    Returns:
        :class:`YieldsResults`.
    """
    if fit is not None and element is None:
        element = fit.element
    return yields_of(model, rows_of(model, data, element), fit, options)


def yields_of(
    model, rows: Rows, fit: FitResults | None = None, options: FitOptions | None = None
) -> YieldsResults:
    """:func:`yields` of ``rows`` (``fit``: theirs, else fitted here)."""
    options = options or FitOptions()
    data, element = rows.data, rows.element
    if fit is None:
        fit = fit_rows(
            model,
            data,
            element,
            options=options,
            uncertainties=True,
            background_start=element.shape[0],
        )
    B, P = fit.bestfit.shape
    eye = torch.eye(P, dtype=model.dtype, device=model.device).expand(B, P, P)
    prefit = yield_prediction(
        model,
        asimov_parameters(model).index_select(0, element),
        prefit_uncertainties(model).index_select(0, element),
        eye,
        element,
        max_rows=options.max_rows,
    )
    postfit = yield_prediction(  # undetermined parameters held at the best fit
        model,
        fit.bestfit,
        conditional_uncertainties(fit.uncertainty),
        fit.corr_mat,
        element,
        max_rows=options.max_rows,
    )
    main = data.narrow(1, 0, model.n_main)
    n_channels = len(model.elements[0].channels)
    channel_data = torch.zeros(B, n_channels, dtype=main.dtype, device=main.device)
    return YieldsResults(
        prefit=prefit,
        postfit=postfit,
        data=main,
        channel_data=channel_data.index_add(1, _bin_channel(model), main),
        converged=fit.converged,
        element=element,
        fit=fit,
        channels=list(model.elements[0].channels),
        samples=[model.sample_names(e) for e in range(model.n_elements)],
        element_names=list(model.element_names),
    )
