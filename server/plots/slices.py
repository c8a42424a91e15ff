"""Slices of a patchset's signal coordinates: the points that share the values of the
coordinates off a plot's axes (``m_neutralino1 = 60 GeV``), ranked by how many points they
hold. Pure Python (no matplotlib): the exclusion plot draws one slice, and the service lists
them for the page to choose from.

>>> points = [[500, 200, 60], [600, 200, 60], [600, 300, 60], [700, 330, 200]]
>>> ranked_slices(points, [0, 1])
[((60.0,), 3), ((200.0,), 1)]
>>> describe(["m_sbottom", "m_neutralino2", "m_neutralino1"], [0, 1], (60.0,))
'm_neutralino1 = 60 GeV'
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence

#: a label of the patchset's metadata that names a mass (``m_sbottom``, ``m(N1)``)
_MASS_LABEL = re.compile(r"^m(_|\()")
#: a unit in square brackets at the end of a label: ``m_stop [GeV]``
_UNIT = re.compile(r"^(.*?)\s*\[\s*([^\[\]]+?)\s*\]\s*$")


def split_unit(label: str) -> tuple[str, str | None]:
    """A patchset label's name and unit: the unit it carries in square brackets
    (``m_stop [TeV]``), else GeV for a mass (a label starting ``m_`` or ``m(``, as HEPData's
    ``m_sbottom``), else none (``shape``, ``scale``).

    >>> split_unit("m_sbottom"), split_unit("m_stop [TeV]"), split_unit("scale")
    (('m_sbottom', 'GeV'), ('m_stop', 'TeV'), ('scale', None))
    """
    match = _UNIT.match(label)
    if match:
        return match.group(1), match.group(2)
    if _MASS_LABEL.match(label):
        return label, "GeV"
    return label, None


def axis_label(label: str) -> str:
    """A patchset label as an axis label, with its unit: ``m_sbottom [GeV]``."""
    name, unit = split_unit(label)
    return f"{name} [{unit}]" if unit else name


def value_text(label: str, value: float) -> str:
    """``m_neutralino1 = 60 GeV``."""
    name, unit = split_unit(label)
    return f"{name} = {value:g}{' ' + unit if unit else ''}"


def off_axes(dim: int, axes: Sequence[int]) -> list[int]:
    """The coordinates (of ``dim``) that are not plotted."""
    return [a for a in range(dim) if a not in axes]


def slice_key(point: Sequence[float], axes: Sequence[int]) -> tuple[float, ...]:
    """The values of ``point``'s coordinates off ``axes`` (rounded: 9 decimals)."""
    return tuple(round(float(point[a]), 9) for a in off_axes(len(point), axes))


def ranked_slices(
    points: Sequence[Sequence[float]], axes: Sequence[int]
) -> list[tuple[tuple[float, ...], int]]:
    """Each slice's key (:func:`slice_key`) and point count, the most populated first (ties:
    the lowest values first)."""
    counts = Counter(slice_key(point, axes) for point in points)
    return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))


def describe(labels: Sequence[str], axes: Sequence[int], key: Sequence[float]) -> str:
    """The slice ``key`` in words, with units: ``m_neutralino1 = 60 GeV``."""
    names = [labels[a] for a in off_axes(len(labels), axes)]
    return ", ".join(value_text(name, v) for name, v in zip(names, key, strict=True))
