"""The inference's own errors: a model or an option it cannot run on, and a stopped fit.

:class:`InferenceError` is the caller's input, not a fault (the service answers 422 with the
message); it derives from ``ValueError``, as pyhf raises for the same inputs.
:class:`FitStopped` is raised between two minimiser iterations when the caller's ``stop``
says nobody waits for the answer any more (a disconnected client, a timed-out request, a
cancelled job), so the device is free within one iteration.
"""


class InferenceError(ValueError):
    """A hypothesis test asked of a model or with options it cannot run on."""


class FitStopped(Exception):
    """The fit was stopped by its caller between two iterations (nobody waits for it)."""
