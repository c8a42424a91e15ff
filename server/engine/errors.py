"""Errors raised while reading workspaces and building or combining engine models."""


class EngineError(Exception):
    """Base class of the engine's own errors."""


class UnsupportedModelError(EngineError):
    """The workspace uses something the engine does not implement (named in the message)."""


class IncompatibleModelsError(EngineError):
    """Models of different structure cannot be stacked into one batched model."""


class InvalidWorkspaceError(EngineError):
    """A workspace that pyhf's schema admits but that makes no usable model (bounds that are
    no interval, an init outside its bounds); the message names the JSON path."""


class DuplicateNameError(InvalidWorkspaceError):
    """A name that must be unique is used twice: a channel, a sample within its channel, a
    modifier's name and type on one sample, a measurement, an observation."""


class UnrepresentableValueError(EngineError):
    """A JSON value no model can hold, named by its JSON path: a string with an unpaired UTF-16
    surrogate (no UTF-8 text can carry it) or a number beyond the range of a 64-bit float."""


class ModelTooLargeError(EngineError):
    """A model whose arrays, estimated from its structure before they are built, would take
    more memory than the bound it is read under (the message gives the figure and why)."""
