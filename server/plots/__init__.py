"""Figures of the service's results, drawn with matplotlib's object API (no ``pyplot``, no
rcParams or style changes), as SVG or PNG bytes.

>>> from pyhf_gpu_server import plots
>>> png = plots.render("scan", {"name": "mu", "parameter_values": [0, 1, 2],
...                             "delta_nlls": [1.0, 0.0, 1.2]}, "png", dpi=50)
>>> png[:8] == b"\\x89PNG\\r\\n\\x1a\\n"
True

Kinds: :data:`KINDS`, described by :func:`kinds` (``pyhf_gpu_client.tables.PLOTS``); each
kind's options are in its drawing function's docstring: :func:`~.limits.brazil`,
:func:`~.limits.exclusion`, :func:`~.fit.pulls`, :func:`~.fit.correlation`,
:func:`~.fit.ranking`, :func:`~.yields.yields`, :func:`~.scan.scan`.
"""

from __future__ import annotations

from typing import Any

from .errors import PlotAbandonedError, PlotBusyError, PlotInputError, PlotsNotInstalledError

#: what drawing needs, imported on first use (matplotlib and mplhep: the ``plots`` extra), so
#: that a server installed without them starts, answers, and refuses plots with one message
_DRAWING = ("COMMON_OPTIONS", "FORMATS", "KINDS", "Kind", "figure", "kinds", "render")


def __getattr__(name: str) -> Any:
    if name not in _DRAWING:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        from . import _base, fit, limits, scan, yields  # noqa: F401  (each registers its kinds)
    except ImportError as exc:
        raise PlotsNotInstalledError(
            f"plots need matplotlib and mplhep ({exc.name} is not installed): "
            "pip install 'pyhf-gpu[plots]'"
        ) from None
    return getattr(_base, name)


__all__ = [
    "COMMON_OPTIONS",
    "FORMATS",
    "KINDS",
    "Kind",
    "PlotAbandonedError",
    "PlotBusyError",
    "PlotInputError",
    "PlotsNotInstalledError",
    "figure",
    "kinds",
    "render",
]
