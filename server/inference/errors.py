"""The inference's own error: a model or an option it cannot run on.

It is the caller's input, not a fault (the service answers 422 with the message); it derives
from ``ValueError``, as pyhf raises for the same inputs.
"""


class InferenceError(ValueError):
    """A hypothesis test asked of a model or with options it cannot run on."""
