"""Elements on warm backgrounds: a patch costs what it changes, wherever it comes from.

A request names a *background* (a stored or inline workspace, a measurement, modifier
settings) and zero or more *patches*. :class:`ElementStore` keeps one warm
:class:`~pyhf_gpu_server.engine.translate.WorkspaceTranslator` per background and the
translated layout of every patch seen on it (LRU, bounded per background), so that signals
posted by different requests on one background are read once each and can share an engine
call. A patch that cannot be applied or tested is kept as its own error, not the request's.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from pyhf_gpu_server.engine.layout import ElementLayout
from pyhf_gpu_server.engine.translate import WorkspaceTranslator

from .errors import ServiceError, Unprocessable, translate

log = logging.getLogger("pyhf_gpu_server.service")

LIST_BYTES = 56  # an empty list object (CPython, 64-bit)
INT_BYTES = 36  # a number object and its pointer in a list


@dataclass(frozen=True)
class Background:
    """What every element of a request starts from."""

    workspace: dict[str, Any]
    workspace_digest: str
    measurement: str
    modifier_settings: dict[str, dict[str, str]] | None

    @property
    def key(self) -> tuple[str, str, str]:
        """Identifies the background (and so its translator) across requests."""
        settings = json.dumps(self.modifier_settings, sort_keys=True)
        return (self.workspace_digest, self.measurement, settings)


@dataclass(frozen=True)
class PatchSpec:
    """One element: the background with these JSON-patch operations applied."""

    name: str
    digest: str  # pyhf's digest of the operations ("" for the bare background)
    operations: tuple[dict[str, Any], ...]


@dataclass(frozen=True)
class Element:
    """A translated element, or why it cannot be tested."""

    patch: PatchSpec
    layout: ElementLayout | None
    error: ServiceError | None = None


class ElementStore:
    """Warm translators per background, translated elements per (background, patch); LRU."""

    def __init__(self, max_backgrounds: int = 8, max_elements: int = 4096) -> None:
        self.max_backgrounds = max_backgrounds
        self.max_elements = max_elements
        self._translators: OrderedDict[tuple, WorkspaceTranslator] = OrderedDict()
        self._elements: OrderedDict[tuple, Element] = OrderedDict()
        self._lock = threading.Lock()
        self.total_bytes = 0  # host bytes of the cached elements' layouts

    def elements(self, background: Background, patches: Sequence[PatchSpec]) -> list[Element]:
        """The element of each patch on ``background``; cached ones are not read again."""
        found: list[Element] = []
        for patch in patches:
            key = (background.key, patch.digest)
            with self._lock:
                element = self._elements.get(key)
                if element is not None:
                    self._elements.move_to_end(key)
            if element is None:
                element = self._translate(background, patch)
                with self._lock:
                    self._keep(key, element)
            elif element.patch.name != patch.name:
                element = Element(patch, _renamed(element.layout, patch.name), element.error)
            found.append(element)
        return found

    def _translate(self, background: Background, patch: PatchSpec) -> Element:
        translator = self._translator(background)
        try:
            layout = translator.element(list(patch.operations), patch.name)
        except Exception as exc:
            where = "workspace" if not patch.operations else f"workspace after patch {patch.name!r}"
            mapped = translate(exc, where)
            if mapped is None:  # schema-valid input the translator could not read: still input
                log.exception("could not translate %s", where)
                mapped = Unprocessable(f"could not read the {where}: {type(exc).__name__}: {exc}")
            return Element(patch, None, mapped)
        return Element(patch, layout)

    def _translator(self, background: Background) -> WorkspaceTranslator:
        key = background.key
        with self._lock:
            translator = self._translators.get(key)
            if translator is not None:
                self._translators.move_to_end(key)
                return translator
        translator = WorkspaceTranslator(
            background.workspace,
            measurement=background.measurement,
            modifier_settings=background.modifier_settings,
        )
        with self._lock:
            self._translators[key] = translator
            while len(self._translators) > self.max_backgrounds:
                evicted, _ = self._translators.popitem(last=False)
                for element_key in [k for k in self._elements if k[0] == evicted]:
                    self.total_bytes -= layout_bytes(self._elements.pop(element_key).layout)
        return translator

    def _keep(self, key: tuple, element: Element) -> None:
        """Cache ``element`` (under the lock), evicting the least recently used beyond the cap."""
        previous = self._elements.pop(key, None)
        if previous is not None:
            self.total_bytes -= layout_bytes(previous.layout)
        self._elements[key] = element
        self.total_bytes += layout_bytes(element.layout)
        while len(self._elements) > self.max_elements:
            _, evicted = self._elements.popitem(last=False)
            self.total_bytes -= layout_bytes(evicted.layout)


def layout_bytes(value: Any) -> int:
    """About the host bytes of a layout: its arrays, and its lists of index lists.

    Example:
        >>> import numpy as np
        >>> layout_bytes(np.zeros(4)), layout_bytes([[1, 2], [3]])  # 3 lists, 3 ints
        (32, 276)
    """
    if isinstance(value, np.ndarray):
        return value.nbytes
    if isinstance(value, list):
        return sum(layout_bytes(v) for v in value) + LIST_BYTES
    if isinstance(value, int | float):
        return INT_BYTES
    if dataclasses.is_dataclass(value):
        return sum(layout_bytes(getattr(value, f.name)) for f in dataclasses.fields(value))
    return 0


def _renamed(layout: ElementLayout | None, name: str) -> ElementLayout | None:
    """The same element under another patch name (identical patches in two patchsets)."""
    return None if layout is None else replace(layout, name=name)
