"""The plot tables, declared once: which plot kinds each operation's answer has, the image
formats and their media types, and the plot options a query string carries, by type.

The client owns them (the lower layer, no dependencies); the server imports them
(``pyhf_gpu_server.service.plotting``, ``pyhf_gpu_server.plots``), so the two cannot differ.

Example:
    >>> PLOT_KINDS["fit"]
    ('pulls', 'correlation')
    >>> PLOT_MEDIA_TYPES["svg"], OPTION_TYPE["top"]
    ('image/svg+xml', 'int')
"""

from __future__ import annotations

__all__ = ["OPTION_TYPE", "PLOT_FORMATS", "PLOT_KINDS", "PLOT_MEDIA_TYPES", "PLOT_OPTION_TYPES"]

#: the plot kinds that suit each operation's answer (``brazil`` needs a list of ``test_poi``,
#: ``exclusion`` a patchset: the server narrows ``cls`` by its request, and its
#: ``GET /jobs/{id}/plots`` has the final word)
PLOT_KINDS: dict[str, tuple[str, ...]] = {
    "cls": ("brazil", "exclusion"),
    "upper-limit": ("brazil",),
    "fit": ("pulls", "correlation"),
    "ranking": ("ranking",),
    "scan": ("scan",),
    "yields": ("yields",),
    "significance": (),
    "likelihood": (),
}

#: the image formats, and the media type each is served as
PLOT_MEDIA_TYPES: dict[str, str] = {"svg": "image/svg+xml", "png": "image/png"}
PLOT_FORMATS: tuple[str, ...] = tuple(PLOT_MEDIA_TYPES)

#: The plot options a query string carries (``?top=20&label=ATLAS%20Internal``), by type.
#: Lists are repeated parameters or one comma-separated value. A renderer option not named
#: here is one only a JSON plot spec carries (``plotting.JSON_OPTIONS`` on the server).
PLOT_OPTION_TYPES: dict[str, tuple[str, ...]] = {
    "int": ("top", "max_channels", "columns"),
    "float": ("threshold", "level", "dpi", "test_poi", "ymax"),
    "bool": ("log_y", "show_points", "annotate"),
    "str": (
        "label",
        "rlabel",
        "title",
        "xlabel",
        "ylabel",
        "poi_label",
        "stage",
        "patch",
        "poi",
        "measurement",
    ),
    "strs": ("channels", "parameters", "labels"),
    "ints": ("axes",),
    "floats": ("figsize", "slice"),
}
#: each query option's type
OPTION_TYPE: dict[str, str] = {
    name: kind for kind, names in PLOT_OPTION_TYPES.items() for name in names
}
