"""The plot errors, importable without matplotlib (the ``plots`` extra): the service catches
them whether or not drawing is installed."""

from __future__ import annotations


class PlotInputError(ValueError):
    """A result that does not fit its plot kind, or an unknown kind, format or option."""


class PlotBusyError(RuntimeError):
    """Other figures were being drawn for ``RENDER_WAIT_S``: this one gave up waiting
    (every wait has a bound; a client that went away is not waited for past it)."""


class PlotAbandonedError(RuntimeError):
    """Nobody waits for the figure any more (its client went away): not drawn, or not
    written, and the drawing lock given to the next render."""


class PlotsNotInstalledError(RuntimeError):
    """matplotlib or mplhep is missing: the server was installed without the ``plots`` extra."""
