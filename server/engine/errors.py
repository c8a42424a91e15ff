"""Errors raised while building or combining engine models."""


class EngineError(Exception):
    """Base class of the engine's own errors."""


class UnsupportedModelError(EngineError):
    """The workspace uses something the engine does not implement (named in the message)."""


class IncompatibleModelsError(EngineError):
    """Models of different structure cannot be stacked into one batched model."""
