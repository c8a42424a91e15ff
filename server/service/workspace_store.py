"""Workspace checks and the store of uploaded workspaces (files under ``--data-dir``).

A workspace's id is pyhf's digest, ``pyhf.utils.digest(workspace)`` (sha256 of its sorted JSON).
A directory that cannot be written does not stop the server: storing answers 503 naming the
problem, and ``/readyz`` reports it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyhf

from pyhf_gpu_server.engine import schema
from pyhf_gpu_server.engine.translate import unmatched_observations

from .errors import (
    InsufficientStorage,
    NotFound,
    Unavailable,
    Unprocessable,
    describe_invalid_specification,
)
from .jobstore import writable_problem

log = logging.getLogger("pyhf_gpu_server.service")

# per-bin modifier data that must have one entry per bin of its channel
_PER_BIN_MODIFIERS = {
    "shapesys": ("data",),
    "staterror": ("data",),
    "histosys": ("lo_data", "hi_data"),
}


def check_schema(document: Any, schema_name: str, what: str) -> None:
    """A 422 naming pyhf's message and JSON path unless ``document`` (the ``what``) is valid
    in pyhf's ``schema_name``."""
    try:
        schema.validate(document, schema_name)
    except pyhf.exceptions.InvalidSpecification as exc:
        raise Unprocessable(describe_invalid_specification(exc, what)) from None


def validate_workspace(spec: Any) -> None:
    """Raise :class:`Unprocessable` (422) unless ``spec`` is a usable HistFactory workspace.

    Checks pyhf's JSON schema (pyhf's message and JSON path), then what the schema leaves open:
    observations for every channel, equal bin counts, non-negative observed counts. An
    observation of a channel the workspace does not have is no error: pyhf ignores it, and
    so does the engine, saying so (``unmatched_observations``: logged here, and each result's
    ``meta.ignored_observations``).
    """
    if not isinstance(spec, dict) or "channels" not in spec:
        raise Unprocessable("the workspace is not a HistFactory workspace: it has no 'channels'")
    check_schema(spec, "workspace.json", "workspace")
    problems = list(_content_problems(spec))
    if problems:
        raise Unprocessable("invalid workspace: " + "; ".join(problems[:20]))
    for notice in unmatched_observations(spec):
        log.info(f"workspace {pyhf.utils.digest(spec)[:12]}: {notice}")


def _content_problems(spec: dict[str, Any]) -> Iterator[str]:
    """Bin-count mismatches, missing observations, negative counts."""
    observed = {obs["name"]: (i, obs["data"]) for i, obs in enumerate(spec["observations"])}
    for c, channel in enumerate(spec["channels"]):
        name = channel["name"]
        nbins = len(channel["samples"][0]["data"]) if channel["samples"] else 0
        for s, sample in enumerate(channel["samples"]):
            where = f"channels[{c}].samples[{s}]"
            if len(sample["data"]) != nbins:
                yield f"{where}.data has {len(sample['data'])} bins, channel {name!r} has {nbins}"
            for m, modifier in enumerate(sample["modifiers"]):
                for key in _PER_BIN_MODIFIERS.get(modifier["type"], ()):
                    values = modifier["data"][key] if key != "data" else modifier["data"]
                    if len(values) != nbins:
                        yield (
                            f"{where}.modifiers[{m}] ({modifier['name']!r}) {key} has "
                            f"{len(values)} bins, channel {name!r} has {nbins}"
                        )
        if name not in observed:
            yield f"channel {name!r} has no entry in 'observations'"
            continue
        o, data = observed[name]
        if len(data) != nbins:
            yield f"observations[{o}].data has {len(data)} bins, channel {name!r} has {nbins}"
        negative = [i for i, value in enumerate(data) if value < 0]
        if negative:
            yield (
                f"the observations of channel {name!r} have negative counts at "
                f"/observations/{o}/data/{negative[0]} (bins {negative[:10]})"
            )


RECENT_USE_S = 60.0  # workspaces used this recently are never evicted to make room


class WorkspaceStore:
    """Validated workspaces by digest: uploaded ones on disk, recent ones also in memory.

    Stored workspaces expire ``ttl_s`` after their last use (a file's mtime is its last use)
    and take at most ``quota_bytes`` of disk, the least recently used going first; neither
    removes a workspace that ``in_use()`` (queued or running jobs) still needs.

    With callers (auth with named tokens), a stored workspace belongs to the callers that
    stored it (``<digest>.owners``, one name a line): another caller's ``get`` answers 404 as
    an unknown id does, and ``quota_bytes`` is each caller's own, so that one caller's
    uploads only ever make room among its own. A workspace stored without a caller (auth
    off) has no owners file and is everyone's.
    """

    def __init__(
        self,
        directory: Path,
        memory_items: int = 16,
        *,
        ttl_s: float | None = None,
        quota_bytes: int | None = None,
        in_use: Callable[[], set[str]] = set,
    ) -> None:
        """Keep files in ``directory`` and up to ``memory_items`` parsed workspaces in memory."""
        self.directory = directory
        self.ttl_s = ttl_s
        self.quota_bytes = quota_bytes
        self.in_use = in_use
        problem = self.writable_problem()
        if problem is not None:
            log.warning(f"{problem}: uploads and jobs with a workspace answer 503")
        self._memory: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._memory_items = memory_items
        self._lock = threading.Lock()

    def writable_problem(self) -> str | None:
        """Why workspaces cannot be stored (tried for real), or ``None``."""
        problem = writable_problem(self.directory)
        return None if problem is None else f"the workspace store {problem}"

    def admit(self, spec: dict[str, Any], persist: bool, owner: str | None = None) -> str:
        """Validate ``spec`` (once per digest), keep it, write it to disk if ``persist`` (as
        ``owner``'s, where there are callers); its id."""
        digest = pyhf.utils.digest(spec)
        with self._lock:
            known = digest in self._memory
        if not known and not self._path(digest).exists():
            validate_workspace(spec)
        if persist and (not self._path(digest).exists() or not self._owns(digest, owner)):
            text = json.dumps(spec)  # one string: its size, then the file
            self._make_room(len(text), owner)
            if not self._path(digest).exists():
                self._write(digest, text)
            if owner is not None:
                self._add_owner(digest, owner)
        if persist:
            self._touch(digest)
        self._remember(digest, spec)
        return digest

    def get(self, digest: str, caller: str | None = None) -> dict[str, Any]:
        """The workspace with id ``digest``; :class:`NotFound` (404) if it was never uploaded,
        or (``caller`` given) is not ``caller``'s."""
        path = self._path(digest)
        if not path.exists() or not self._owns(digest, caller):
            raise NotFound(
                f"workspace {digest!r} is not stored here; upload it with POST /workspaces"
            )
        self._touch(digest)
        with self._lock:
            if digest in self._memory:
                self._memory.move_to_end(digest)
                return self._memory[digest]
        spec = json.loads(path.read_text())
        self._remember(digest, spec)
        return spec

    def expire(self) -> int:
        """Delete the stored workspaces unused for ``ttl_s`` that no job needs; how many."""
        if self.ttl_s is None:
            return 0
        cutoff = time.time() - self.ttl_s
        needed = self.in_use()
        old = [(d, p) for d, p, used, _ in self._stored() if used < cutoff and d not in needed]
        for digest, path in old:
            self._forget(digest, path)
        return len(old)

    def owners(self, digest: str) -> set[str] | None:
        """The callers a stored workspace belongs to; ``None``: everyone's (stored without a
        caller)."""
        try:
            text = self._owners_path(digest).read_text()
        except FileNotFoundError:
            return None
        return {line for line in text.splitlines() if line}

    def _owns(self, digest: str, caller: str | None) -> bool:
        """Whether ``caller`` may use stored workspace ``digest`` (``None``: no check)."""
        if caller is None:
            return True
        owners = self.owners(digest)
        return owners is None or caller in owners

    def _add_owner(self, digest: str, owner: str) -> None:
        with self._lock:
            owners = self.owners(digest) or set()
            if owner not in owners:
                self._write_owners(digest, owners | {owner})

    def _drop_owner(self, digest: str, path: Path, owner: str) -> None:
        """``owner``'s claim on a workspace removed; the file too once nobody owns it."""
        with self._lock:
            owners = (self.owners(digest) or set()) - {owner}
            if owners:
                self._write_owners(digest, owners)
                return
        self._forget(digest, path)

    def _write_owners(self, digest: str, owners: set[str]) -> None:
        self._owners_path(digest).write_text("".join(f"{o}\n" for o in sorted(owners)))

    def _owners_path(self, digest: str) -> Path:
        return self.directory / f"{digest}.owners"

    def _make_room(self, size: int, owner: str | None = None) -> None:
        """Delete least recently used workspaces (no job needs) until ``size`` more bytes fit
        the quota (``owner``'s own quota among their own workspaces, where there are
        callers); :class:`InsufficientStorage` (507) if they cannot."""
        if self.quota_bytes is None:
            return
        stored = sorted(self._stored(), key=lambda entry: entry[2])
        if owner is not None:
            stored = [e for e in stored if owner in (self.owners(e[0]) or ())]
        total = sum(entry[3] for entry in stored)
        needed = self.in_use()
        recent = time.time() - RECENT_USE_S  # just stored for a job not yet in the job store
        evictable = [e for e in stored if e[0] not in needed and e[2] < recent]
        if total - sum(e[3] for e in evictable) + size > self.quota_bytes:
            whose = "the workspace store" if owner is None else f"caller {owner!r}'s share"
            raise InsufficientStorage(
                f"{whose} is full: {size} more bytes do not fit its {self.quota_bytes} bytes "
                "(--workspace-quota-mb) beside the workspaces queued or running jobs need and "
                "those used in the last minute; retry later"
            )
        for digest, path, _, bytes_ in evictable:
            if total + size <= self.quota_bytes:
                return
            if owner is None:
                self._forget(digest, path)
            else:
                self._drop_owner(digest, path, owner)
            total -= bytes_

    def _stored(self) -> list[tuple[str, Path, float, int]]:
        """Every stored workspace: (digest, path, last use, bytes)."""
        entries = []
        for path in self.directory.glob("*.json"):
            with contextlib.suppress(OSError):  # removed meanwhile
                stat = path.stat()
                entries.append((path.stem, path, stat.st_mtime, stat.st_size))
        return entries

    def _forget(self, digest: str, path: Path) -> None:
        with contextlib.suppress(OSError):
            path.unlink()
        with contextlib.suppress(OSError):
            self._owners_path(digest).unlink()
        with self._lock:
            self._memory.pop(digest, None)
        log.info("workspace removed", extra={"workspace_id": digest})

    def _touch(self, digest: str) -> None:
        """Mark the stored workspace as used now (its mtime)."""
        with contextlib.suppress(OSError):
            os.utime(self._path(digest))

    def size_of(self, digest: str) -> int:
        """Bytes of the stored file."""
        return self._path(digest).stat().st_size

    def _remember(self, digest: str, spec: dict[str, Any]) -> None:
        """Put ``spec`` in the in-memory LRU."""
        with self._lock:
            self._memory[digest] = spec
            self._memory.move_to_end(digest)
            while len(self._memory) > self._memory_items:
                self._memory.popitem(last=False)

    def _path(self, digest: str) -> Path:
        """Where workspace ``digest`` is stored."""
        return self.directory / f"{digest}.json"

    def _write(self, digest: str, text: str) -> None:
        """Write ``text`` atomically (temporary file, fsync, rename); 503 if the directory
        refuses."""
        target = self._path(digest)
        tmp = target.with_suffix(f".tmp{threading.get_ident()}")
        try:
            with tmp.open("w") as handle:
                handle.write(text)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, target)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            raise Unavailable(
                f"cannot store the workspace: the workspace store {self.directory} is not "
                f"writable ({exc.strerror or exc}); the server's operator must fix --data-dir",
                60,
            ) from None


def summarize(digest: str, spec: dict[str, Any], size: int) -> dict[str, Any]:
    """The public description of a stored workspace (WorkspaceInfo)."""
    return {
        "workspace_id": digest,
        "digest": {"sha256": digest},
        "measurements": [m["name"] for m in spec.get("measurements", [])],
        "channels": [c["name"] for c in spec.get("channels", [])],
        "bytes": size,
    }
