"""Elements on warm backgrounds: a patch costs what it changes, wherever it comes from.

A request names a *background* (a stored or inline workspace, a measurement, modifier
settings) and zero or more *patches*. :class:`ElementStore` keeps one warm
:class:`~pyhf_gpu_server.engine.translate.WorkspaceTranslator` per background and the
translated layout of every patch seen on it (LRU, bounded per background), so that signals
posted by different requests on one background are read once each and can share an engine
call. A patch that cannot be applied or tested is kept as its own error, not the request's.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from pyhf_gpu_server.engine.layout import ElementLayout
from pyhf_gpu_server.engine.translate import WorkspaceTranslator

from .errors import ServiceError, Unprocessable, translate

if TYPE_CHECKING:
    from .local_workers import LocalWorkers

log = logging.getLogger("pyhf_gpu_server.service")

LIST_BYTES = 56  # an empty list object (CPython, 64-bit)
INT_BYTES = 36  # a number object and its pointer in a list
PARAMETER_SET_BYTES = 512  # a ParameterSet: its name, type and a few numbers


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
    digest: str  # the operations' id (requests.patch_digest; "" for the bare background)
    operations: tuple[dict[str, Any], ...]


@dataclass(frozen=True)
class Element:
    """A translated element, or why it cannot be tested."""

    patch: PatchSpec
    layout: ElementLayout | None
    error: ServiceError | None = None


@dataclass(eq=False, repr=False)
class ElementStore:
    """Warm translators per background, translated elements per (background, patch); LRU:
    ``max_backgrounds`` translators and ``max_elements`` elements. ``workers`` translate shares
    of a request's new patches when there are many; an element whose histosys arrays would take
    more than ``max_layout_bytes`` is refused (422)."""

    max_backgrounds: int = 8
    max_elements: int = 4096
    workers: LocalWorkers | None = None
    max_layout_bytes: int | None = None
    _translators: OrderedDict[tuple, WorkspaceTranslator] = field(
        init=False, default_factory=OrderedDict
    )
    _elements: OrderedDict[tuple, Element] = field(init=False, default_factory=OrderedDict)
    _lock: threading.Lock = field(init=False, default_factory=threading.Lock)
    total_bytes: int = field(init=False, default=0)  # host bytes of the cached elements' layouts

    def elements(self, background: Background, patches: Sequence[PatchSpec]) -> list[Element]:
        """The element of each patch on ``background``; cached ones are not read again, new
        ones are read once each (by the workers too, when there are many)."""
        found: list[Element | None] = []
        new: dict[str, PatchSpec] = {}  # by digest: a patch repeated under two names is read once
        for patch in patches:
            key = (background.key, patch.digest)
            with self._lock:
                element = self._elements.get(key)
                if element is not None:
                    self._elements.move_to_end(key)
            if element is None:
                new.setdefault(patch.digest, patch)
            found.append(element)
        read: dict[str, Element] = {}  # the new ones, by digest
        if new:
            translated = (
                self.workers.elements(
                    background, list(new.values()), lambda p: self.translate(background, p)
                )
                if self.workers is not None
                else [self.translate(background, patch) for patch in new.values()]
            )
            read = {element.patch.digest: element for element in translated}
            with self._lock:
                for digest, element in read.items():
                    self._keep((background.key, digest), element)
        known = [read[p.digest] if e is None else e for p, e in zip(patches, found, strict=True)]
        return [
            e if e.patch.name == p.name else Element(p, _renamed(e.layout, p.name), e.error)
            for p, e in zip(patches, known, strict=True)
        ]

    def translate(self, background: Background, patch: PatchSpec) -> Element:
        """``patch`` on ``background``, read now (not cached): its layout, or its error."""
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
            max_layout_bytes=self.max_layout_bytes,
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


def layout_bytes(layout: ElementLayout | None) -> int:
    """About the host bytes of a translated element: its arrays, its samples' arrays and
    per-bin index lists (by length), and a fixed size per parameter set; read in O(samples +
    parameter sets), not number by number.

    Example:
        >>> from pyhf_gpu_server.engine.translate import translate
        >>> import pyhf
        >>> spec = pyhf.simplemodels.uncorrelated_background([5.0], [10.0], [2.5]).spec
        >>> ws = {**spec, "observations": [{"name": "singlechannel", "data": [12.0]}],
        ...       "measurements": [{"name": "m", "config": {"poi": "mu", "parameters": []}}],
        ...       "version": "1.0.0"}
        >>> 0 < layout_bytes(translate(ws)) < 4096, layout_bytes(None)
        (True, 0)
    """
    if layout is None:
        return 0
    total = _array_bytes(layout) + PARAMETER_SET_BYTES * len(layout.parameters)
    total += INT_BYTES * (len(layout.histosys_params) + len(layout.normsys_params))
    for sample in layout.samples:
        total += _array_bytes(sample) + LIST_BYTES * (1 + len(sample.multipliers))
        total += INT_BYTES * sum(map(len, sample.multipliers))
    return total


def _array_bytes(obj: Any) -> int:
    """Bytes of the numpy arrays among ``obj``'s attributes."""
    return sum(v.nbytes for v in vars(obj).values() if isinstance(v, np.ndarray))


def _renamed(layout: ElementLayout | None, name: str) -> ElementLayout | None:
    """The same element under another patch name (identical patches in two patchsets)."""
    return None if layout is None else replace(layout, name=name)
