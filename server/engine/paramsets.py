"""pyhf's parameter sets from modifier requirements and the measurement's parameter settings.

The same rules as ``pyhf.pdf._finalize_parameters_specs`` and
``pyhf.parameters.reduce_paramsets_requirements``, with pyhf's exceptions and messages: the
requirements of one name must agree on every property, a measurement setting replaces the
default (with the same number of values) and may only set what the modifier type uses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pyhf.exceptions import InvalidModel, InvalidNameReuse

from .errors import UnsupportedModelError

_KEYS = (
    "paramset_type",
    "n_parameters",
    "is_scalar",
    "inits",
    "bounds",
    "auxdata",
    "factors",
    "sigmas",
    "fixed",
)
_UNDEFINED = "undefined"  # pyhf's marker of a property the modifier type does not have
_CONSTRAINTS = {
    "unconstrained": None,
    "constrained_by_normal": "normal",
    "constrained_by_poisson": "poisson",
}


@dataclass(frozen=True)
class Paramset:
    """One parameter set as pyhf builds it (``config.param_set(name)``)."""

    name: str
    n_parameters: int
    is_scalar: bool
    constraint: str | None  # "normal", "poisson" or None
    inits: list[float]
    bounds: list[Any]  # [n][2]
    fixed: list[bool]
    auxdata: list[float]  # empty when unconstrained
    sigmas: list[float] | None  # Normal widths, where given
    factors: list[float] | None  # Poisson rate factors


def user_configs(parameters: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The measurement's parameter settings by name; a name given twice is pyhf's error."""
    configs: dict[str, dict[str, Any]] = {}
    for parameter in parameters:
        if parameter["name"] in configs:
            raise InvalidModel(
                f"Multiple parameter configurations for {parameter['name']} were found."
            )
        configs[parameter["name"]] = parameter
    return configs


def reduce_requirements(
    name: str, requirements: list[dict[str, Any]], config: dict[str, Any]
) -> dict[str, Any]:
    """One name's requirements (one per modifier type) merged, with the user's settings."""
    combined: dict[str, Any] = {}
    for key in _KEYS:
        values = set()
        for requirement in requirements:
            values.add(requirement.get(key, _UNDEFINED))
        if len(values) != 1:
            raise InvalidNameReuse(
                f"Multiple values for '{key}' ({list(values)}) were found for {name}. "
                "Use unique modifier names when constructing the pdf."
            )
        default = values.pop()
        value = config.get(key, default)
        if value == _UNDEFINED:
            continue
        if isinstance(value, tuple):
            value = list(value)
        elif isinstance(value, list) and default and len(value) != len(default):
            raise InvalidModel(
                f"Incorrect number of values ({len(value)}) for {key} were configured by you, "
                f"expected {len(default)}."
            )
        elif value and default == _UNDEFINED:
            raise InvalidModel(f"{name} does not use the {key} attribute.")
        combined[key] = value
    return combined


def build_paramset(name: str, combined: dict[str, Any]) -> Paramset:
    """The parameter set of merged requirements.

    pyhf fails with a ``TypeError`` where a lumi parameter lacks ``inits``, ``bounds`` or
    ``auxdata`` in the measurement, and builds inconsistent sizes where these have not one
    value: both are refused here, as :class:`~pyhf.exceptions.InvalidModel` and
    :class:`UnsupportedModelError`.
    """
    n = combined["n_parameters"]
    constraint = _CONSTRAINTS[combined["paramset_type"]]
    required = ("inits", "bounds", "auxdata") if constraint else ("inits", "bounds")
    missing = [key for key in required if combined.get(key) is None]
    if missing:
        raise InvalidModel(
            f"The parameter '{name}' needs {missing} in the measurement's parameter settings."
        )
    fixed = combined["fixed"]
    paramset = Paramset(
        name=name,
        n_parameters=n,
        is_scalar=combined["is_scalar"],
        constraint=constraint,
        inits=combined["inits"],
        bounds=combined["bounds"],
        fixed=[fixed] * n if isinstance(fixed, bool) else list(fixed),
        auxdata=combined["auxdata"] if constraint else [],
        sigmas=(combined.get("sigmas") or None) if constraint == "normal" else None,
        factors=combined["factors"] if constraint == "poisson" else None,
    )
    sized = {"inits": paramset.inits, "bounds": paramset.bounds, "auxdata": paramset.auxdata}
    if paramset.sigmas is not None:
        sized["sigmas"] = paramset.sigmas
    if not constraint:
        del sized["auxdata"]
    for key, values in sized.items():
        if len(values) != n:
            raise UnsupportedModelError(
                "auxiliary data layout does not match pyhf's"
                if key == "auxdata"
                else f"parameter {name!r}: {len(values)} {key} for {n} parameter(s)"
            )
    return paramset


def setting_problem(paramset: Paramset) -> tuple[str, int, str] | None:
    """The first component of ``paramset`` whose bounds are not a [low, high] pair with
    low < high, or whose init lies outside them: ``("bounds" or "inits", component, what is
    wrong)``; None if there is none. pyhf builds such parameters; its fits then start outside
    the bounds or fail on them."""
    for component, (pair, init) in enumerate(zip(paramset.bounds, paramset.inits, strict=True)):
        bound = list(pair)
        if len(bound) != 2:
            return "bounds", component, f"bounds {bound} are not a [low, high] pair"
        low, high = bound
        if not low < high:
            shape = "inverted (low above high)" if low > high else "zero-width (low equals high)"
            return "bounds", component, f"bounds {bound} are {shape}; low must be below high"
        if not low <= init <= high:
            return "inits", component, f"init {init} lies outside its bounds {bound}"
    return None
