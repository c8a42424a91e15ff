"""The rows of an inference call: per-row datasets, elements and POI values on the model's
device.

Every inference function works on ``B`` rows; a row is one (element, dataset, POI value)
combination. :func:`rows_of` decodes pyhf-shaped arguments (``data``: None or datasets;
``element``: None, an int, a sequence or a LongTensor; a POI value or values) once into a
:class:`Rows`, which the inference functions take.

Example:
    >>> import torch
    >>> class M:  # the attributes a HistFactoryModel has
    ...     device, dtype, n_elements = torch.device("cpu"), torch.float64, 3
    ...     observed = torch.arange(6.0, dtype=torch.float64).view(3, 2)
    >>> r = rows_of(M(), poi=[0.5, 1.0], grid=True)
    >>> r.poi.tolist(), r.element.tolist(), r.host_elements()
    ([0.5, 1.0, 0.5, 1.0, 0.5, 1.0], [0, 0, 1, 1, 2, 2], [0, 0, 1, 1, 2, 2])
    >>> r = rows_of(M(), element=torch.tensor([2, 0]), poi=torch.tensor([1.0, 2.0]))
    >>> r.data.tolist(), r.element.tolist(), r.poi.tolist()
    ([[4.0, 5.0], [0.0, 1.0]], [2, 0], [1.0, 2.0])
    >>> r = rows_of(M(), torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    >>> r.element.tolist(), r.poi, r.host_elements()
    ([0, 0], None, [0, 0])
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from ..engine.model import HistFactoryModel

__all__ = ["Rows", "as_float", "as_index", "row_bounds", "rows_of", "unique_datasets"]


def as_float(model: HistFactoryModel, value: float | Sequence[float] | Tensor) -> Tensor:
    """``value`` as a floating tensor on ``model.device`` in ``model.dtype`` (at least 1-d)."""
    return torch.atleast_1d(torch.as_tensor(value, dtype=model.dtype, device=model.device))


def as_index(model: HistFactoryModel, value: int | Sequence[int] | Tensor) -> Tensor:
    """``value`` as a LongTensor on ``model.device`` (at least 1-d); a LongTensor already
    there as it is (FakeTensorMode refuses even a no-op move)."""
    if isinstance(value, Tensor) and value.dtype == torch.long and _on(model.device, value):
        return torch.atleast_1d(value)
    return torch.atleast_1d(torch.as_tensor(value, dtype=torch.long, device=model.device))


def row_bounds(model: HistFactoryModel, element: Tensor, bounds: Tensor | None = None) -> Tensor:
    """``[B, P, 2]`` bounds of the rows of ``element [B]``: ``bounds`` (``[P, 2]`` or
    ``[B, P, 2]``), or the model's suggested ones of each row's element."""
    if bounds is None:
        return model.bounds.index_select(0, element)
    return as_float(model, bounds).expand(element.shape[0], -1, -1)


@dataclass(frozen=True)
class Rows:
    """The ``B`` rows of an inference call, made by :func:`rows_of`.

    Attributes:
        data: ``[B, N + A]`` each row's dataset.
        element: ``[B]`` LongTensor, each row's element.
        poi: ``[B]`` each row's POI value (tested, or fixed; NaN: free); None: none given.
        host_element: ``[B]`` the elements on the host where the arguments gave them without
            a device copy (None: :meth:`host_elements` copies them).
    """

    data: Tensor
    element: Tensor
    poi: Tensor | None = None
    host_element: tuple[int, ...] | None = None

    def __len__(self) -> int:
        return self.element.shape[0]

    def host_elements(self) -> list[int]:
        """Each row's element on the host: which parameters a row has decides the fits it
        runs (one device copy unless the arguments gave them)."""
        if self.host_element is not None:
            return list(self.host_element)
        return [int(e) for e in self.element.tolist()]

    def datasets(self) -> tuple[Tensor, Tensor, Tensor]:
        """The distinct datasets ``[D, N + A]``, their elements ``[D]`` and each row's index
        among them ``[B]`` (:func:`unique_datasets`)."""
        return unique_datasets(self.data, self.element)


def rows_of(
    model: HistFactoryModel,
    data: Tensor | None = None,
    element: int | Sequence[int] | Tensor | None = None,
    poi: float | Sequence[float] | Tensor | None = None,
    *,
    grid: bool = False,
) -> Rows:
    """The rows of pyhf-shaped arguments, decoded once.

    Args:
        model: the model (its device, dtype, elements and observations).
        data: None: the observations of each row's element; else ``[B, N + A]`` (or one
            ``[N + A]``) datasets.
        element: the element of each row; None: every element without ``data``, element 0
            for every dataset with it.
        poi: None, or a value or ``[S]`` values broadcast against the rows (a single row
            repeated for each value).
        grid: with neither ``element`` nor ``data``: every ``poi`` value on every element,
            ``E * S`` rows, element-major (the rows of a hypothesis test; a fit's fixed POI
            values are per element instead).
    """
    if element is None:
        index = torch.arange(model.n_elements, device=model.device) if data is None else None
        host: list[int] | None = list(range(model.n_elements)) if data is None else None
    else:
        index = as_index(model, element)
        host = _host_values(element)
    if data is None:
        assert index is not None
        datasets = model.observed.index_select(0, index)
    else:
        datasets = torch.atleast_2d(as_float(model, data))
        if index is None:
            index = torch.zeros(datasets.shape[0], dtype=torch.long, device=model.device)
            host = [0]
        datasets, wide = torch.broadcast_tensors(datasets, index.unsqueeze(-1))
        datasets, index = datasets.contiguous(), wide[:, 0].contiguous()
    values = None
    if poi is not None:
        values = as_float(model, poi)
        if grid and element is None and data is None:
            S = values.shape[0]
            values, index = values.repeat(model.n_elements), index.repeat_interleave(S)
            datasets = model.observed.index_select(0, index)
            host = [e for e in range(model.n_elements) for _ in range(S)]
        else:
            values, index = (t.contiguous() for t in torch.broadcast_tensors(values, index))
            if datasets.shape[0] != index.shape[0]:
                datasets = datasets.expand(index.shape[0], -1)
    B = index.shape[0]
    if host is not None and len(host) == 1:
        host = host * B
    return Rows(datasets, index, values, None if host is None else tuple(host))


def _on(device: torch.device, tensor: Tensor) -> bool:
    """``tensor`` is on ``device`` (``"cuda"``: any of its indices)."""
    place = tensor.device
    return place.type == device.type and device.index in (None, place.index)


def _host_values(element: int | Sequence[int] | Tensor) -> list[int] | None:
    """The elements an ``element`` argument names, where it holds them on the host (an int or
    a sequence); None for a tensor or an array (:meth:`Rows.host_elements` copies them)."""
    if isinstance(element, int):
        return [element]
    if isinstance(element, Sequence):
        return [int(e) for e in element]
    return None


def unique_datasets(data: Tensor, element: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The distinct (element, dataset) pairs of ``B`` rows and each row's index among them.

    Fits that depend only on the dataset (unconditional fits, Asimov data) then run once per
    distinct dataset instead of once per row.

    >>> import torch
    >>> d = torch.tensor([[1.0, 2.0], [1.0, 2.0], [3.0, 4.0]])
    >>> data, element, index = unique_datasets(d, torch.tensor([0, 0, 0]))
    >>> data.tolist(), element.tolist(), index.tolist()
    ([[1.0, 2.0], [3.0, 4.0]], [0, 0], [0, 0, 1])
    """
    keyed = torch.cat([element.unsqueeze(-1).to(data.dtype), data], dim=1)
    unique, index = torch.unique(keyed, dim=0, return_inverse=True)
    return unique[:, 1:].contiguous(), unique[:, 0].round().long(), index
