"""Plot options of the sans-IO core (:mod:`pyhf_gpu_client.protocol`): a plot's format from a
file name, ``KEY=VALUE`` renderer options typed as the renderer takes them, a job plot's query
and the image of an answer."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from . import tables
from .exceptions import ServerError
from .tables import PLOT_FORMATS, PLOT_MEDIA_TYPES


def plot_format(path: Any) -> str:
    """``png`` or ``svg`` from a file name's suffix (``ValueError`` for any other)."""
    suffix = str(path).rpartition(".")[2].lower() if "." in str(path) else ""
    if suffix not in PLOT_FORMATS:
        shown = f".{suffix}" if suffix else "none"
        raise ValueError(
            f"the plot format is the file's suffix, .png or .svg (not {shown}): {str(path)!r}"
        )
    return suffix


def check_plot_format(fmt: str) -> str:
    """``fmt`` lower-cased when it is ``png`` or ``svg``, else ``ValueError``."""
    value = str(fmt).lower().lstrip(".")
    if value not in PLOT_FORMATS:
        raise ValueError(f"plot format {fmt!r}; one of {', '.join(PLOT_FORMATS)}")
    return value


def plot_option(text: str, kind: str | None = None) -> tuple[str, Any]:
    """``KEY=VALUE`` -> ``(key, typed value)`` for a plot option (``-`` in KEY read as ``_``)
    of plot ``kind`` (where kinds type an option differently: ``test_poi``).

    The renderer's options get its types (``top=5`` an int, ``log_y=true`` a bool,
    ``channels=SR,CR`` a list, ``figsize=6,4`` numbers); other keys a JSON value, else the text.

    >>> plot_option("top=5"), plot_option("channels=SR,CR"), plot_option("label=ATLAS Internal")
    (('top', 5), ('channels', ['SR', 'CR']), ('label', 'ATLAS Internal'))
    """
    key, sep, raw = str(text).partition("=")
    name = key.strip().replace("-", "_")
    if not sep or not name:
        raise ValueError(f"a plot option is KEY=VALUE, not {text!r}")
    of = tables.option_type(name, kind)
    value = raw.strip()
    if of is not None and of != "json":
        try:
            return name, tables.read_option(of, [value])
        except ValueError:
            what = tables.TYPE_WORDS[of] + (" (a comma list)" if of.endswith("s") else "")
            raise ValueError(f"plot option {name!r} must be {what}, not {value!r}") from None
    try:
        return name, json.loads(value)
    except ValueError:
        return name, raw


def plot_params(options: Mapping[str, Any]) -> dict[str, Any]:
    """The query parameters of a job plot (lists repeated, booleans ``true``/``false``)."""
    params: dict[str, Any] = {}
    for name, value in options.items():
        if value is None:
            continue
        if isinstance(value, Mapping) or (
            isinstance(value, (list, tuple)) and any(isinstance(v, (Mapping, list)) for v in value)
        ):
            raise ValueError(
                f"plot option {name!r}: a query takes a value or a list, not {value!r}"
            )
        params[name] = list(value) if isinstance(value, tuple) else value
    return params


def image_of(response: Any, fmt: str) -> bytes:
    """The image bytes of a plot answer (a ``ServerError`` when it is not the image asked for)."""
    media = response.headers.get("content-type", "").split(";")[0].strip().lower()
    if media != PLOT_MEDIA_TYPES[fmt]:
        raise ServerError(
            response.status_code,
            f"the server answered {media or 'without a content type'}, not the {fmt} image "
            "asked for (a server that draws no plots?)",
        )
    return response.content
