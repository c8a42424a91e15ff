"""JSON Patch (RFC 6902) applied without copying the untouched parts of a document.

``jsonpatch.apply_patch(document, operations)`` deep-copies the whole document first: for a
1 MB workspace that is most of the cost of a signal patch. :func:`apply_patch` gives an equal
result but copies only the containers on the paths that the operations change (shallow copies,
from the root down to the changed container); everything else is shared with ``document``,
which is never modified. The operations themselves are jsonpatch's own, so the semantics and
the exceptions (``jsonpatch.JsonPatchException`` subclasses, ``jsonpointer.JsonPointerException``)
are exactly jsonpatch's. The document is read as a JSON tree: a container that a
Python-built document holds in two places (parsed JSON never does) is copied where a path
changes it, where jsonpatch's deep copy would keep both places one object and change both.

Example:
    >>> background = {"channels": [{"name": "SR", "samples": [{"name": "bkg"}]}], "version": "1"}
    >>> patched = apply_patch(
    ...     background, [{"op": "add", "path": "/channels/0/samples/-", "value": {"name": "sig"}}]
    ... )
    >>> [s["name"] for s in patched["channels"][0]["samples"]]
    ['bkg', 'sig']
    >>> len(background["channels"][0]["samples"])  # untouched
    1
    >>> patched["channels"][0]["samples"][0] is background["channels"][0]["samples"][0]
    True
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import jsonpatch
from jsonpointer import JsonPointer

_ARRAY_INDEX = re.compile("0|[1-9][0-9]*")  # RFC 6901 array index, as jsonpointer reads it


class _CopyOnWrite:
    """Shallow-copies containers along pointer paths, each at most once per patch."""

    def __init__(self) -> None:
        self._own: dict[int, Any] = {}  # id -> container created here (kept alive)

    def own(self, container: Any) -> Any:
        """``container`` itself if created here, else a shallow copy that is."""
        if self._own.get(id(container)) is container:
            return container
        copied = dict(container) if isinstance(container, dict) else list(container)
        self._own[id(copied)] = copied
        return copied

    def prepare(self, document: Any, parts: list[str]) -> Any:
        """The document with every container from the root to the one at ``parts`` owned
        here; stops silently where the path does not resolve (the operation then raises)."""
        if not isinstance(document, (dict, list)):
            return document
        document = self.own(document)
        container = document
        for part in parts:
            if isinstance(container, dict):
                if part not in container:
                    break
                key: Any = part
            elif (index := _index(part)) is not None and index < len(container):
                key = index
            else:
                break
            child = container[key]
            if not isinstance(child, (dict, list)):
                break
            child = self.own(child)
            container[key] = child
            container = child
        return document


def _index(part: str) -> int | None:
    """``part`` as an array index, or None."""
    return int(part) if _ARRAY_INDEX.fullmatch(part) else None


def _move_targets(operation: jsonpatch.MoveOperation) -> list[list[str]]:
    """Container paths a move changes: the source's parent, the target's parent and, when the
    removal shifts the array the target path runs through, the target's parent after the shift."""
    source = JsonPointer(operation.operation["from"]).parts
    target = operation.pointer.parts
    paths = [source[:-1], target[:-1]]
    depth = len(source) - 1
    if source and len(target) > depth + 1 and target[:depth] == source[:depth]:
        removed, passed = _index(source[depth]), _index(target[depth])
        if removed is not None and passed is not None and passed >= removed:
            paths.append([*target[:depth], str(passed + 1), *target[depth + 1 : -1]])
    return paths


@dataclass(eq=False)
class _Uncopied:
    """An operation's ``value`` that jsonpatch's deep copy leaves as it is: the patched
    document may share it, as any container is copied before it is changed."""

    value: Any

    def __deepcopy__(self, memo: dict) -> Any:
        return self.value


def apply_patch(document: Any, operations: Any) -> Any:
    """``jsonpatch.apply_patch(document, operations)``, sharing what the patch leaves alone
    (with ``document`` and with the operations' values)."""
    patch = jsonpatch.JsonPatch(operations)
    copies = _CopyOnWrite()
    for spec in patch:
        if spec["op"] in ("add", "replace") and "value" in spec:
            spec = {**spec, "value": _Uncopied(spec["value"])}
        operation = patch.operations[spec["op"]](spec, pointer_cls=patch.pointer_cls)
        if isinstance(operation, jsonpatch.MoveOperation) and "from" in spec:
            targets = _move_targets(operation) if isinstance(spec["from"], str) else []
        elif isinstance(operation, jsonpatch.TestOperation):
            targets = []
        else:
            targets = [operation.pointer.parts[:-1]]
        for parts in targets:
            document = copies.prepare(document, parts)
        document = operation.apply(document)
    return document
