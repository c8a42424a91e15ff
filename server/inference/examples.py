"""The small models of the inference modules' docstring examples."""

from __future__ import annotations

from collections.abc import Sequence

import pyhf

from ..engine.model import HistFactoryModel

__all__ = ["simple_model"]


def simple_model(
    signal: Sequence[float],
    background: Sequence[float],
    uncertainty: Sequence[float],
    data: Sequence[float],
) -> HistFactoryModel:
    """pyhf's ``simplemodels.uncorrelated_background(signal, background, uncertainty)`` with
    the observations ``data`` and the POI ``mu``, as a :class:`HistFactoryModel`.

    >>> simple_model([5.0], [10.0], [2.5], data=[12.0]).par_names
    ['mu', 'uncorr_bkguncrt[0]']
    """
    spec = pyhf.simplemodels.uncorrelated_background(signal, background, uncertainty).spec
    return HistFactoryModel.from_workspace(
        {
            **spec,
            "observations": [{"name": "singlechannel", "data": list(data)}],
            "measurements": [{"name": "m", "config": {"poi": "mu", "parameters": []}}],
            "version": "1.0.0",
        }
    )
