"""Batch-row helpers: turning user arguments into per-row tensors on the model's device.

Every inference function works on ``B`` rows; a row is one (element, dataset, POI value)
combination. These helpers build those row tensors with the model's device and dtype.

Example:
    >>> import torch
    >>> class M:  # the attributes a HistFactoryModel has
    ...     device, dtype, n_elements = torch.device("cpu"), torch.float64, 3
    >>> poi, element = rows_of(M(), [0.5, 1.0], None)
    >>> poi.tolist(), element.tolist()
    ([0.5, 1.0, 0.5, 1.0, 0.5, 1.0], [0, 0, 1, 1, 2, 2])
    >>> poi, element = rows_of(M(), torch.tensor([1.0, 2.0]), torch.tensor([2, 0]))
    >>> poi.tolist(), element.tolist()
    ([1.0, 2.0], [2, 0])
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from ..engine.model import HistFactoryModel

__all__ = ["as_float", "as_index", "grid", "rows_of", "unique_datasets"]


def as_float(model: HistFactoryModel, value: float | Sequence[float] | Tensor) -> Tensor:
    """``value`` as a floating tensor on ``model.device`` in ``model.dtype`` (at least 1-d)."""
    return torch.atleast_1d(torch.as_tensor(value, dtype=model.dtype, device=model.device))


def as_index(model: HistFactoryModel, value: int | Sequence[int] | Tensor) -> Tensor:
    """``value`` as a LongTensor on ``model.device`` (at least 1-d)."""
    return torch.atleast_1d(torch.as_tensor(value, dtype=torch.long, device=model.device))


def grid(model: HistFactoryModel, pois: Tensor, elements: Tensor) -> tuple[Tensor, Tensor]:
    """Every (element, POI) pair, element-major: ``([E*S] pois, [E*S] elements)``."""
    n_poi, n_el = pois.shape[0], elements.shape[0]
    return pois.repeat(n_el), elements.repeat_interleave(n_poi)


def rows_of(model: HistFactoryModel, test_poi, element) -> tuple[Tensor, Tensor]:
    """Per-row POI values and elements.

    ``element=None`` means every element of the model: a scalar or ``[S]`` ``test_poi`` then
    runs for each element (``E * S`` rows, element-major). With ``element`` given, the two
    are broadcast against each other row by row.
    """
    poi = as_float(model, test_poi)
    if element is None:
        return grid(model, poi, torch.arange(model.n_elements, device=model.device))
    element = as_index(model, element)
    poi, element = torch.broadcast_tensors(poi, element)
    return poi.contiguous(), element.contiguous()


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
