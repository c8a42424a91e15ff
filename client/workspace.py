"""Reading workspaces, patches and patchsets, and their content-addressed ids (no pyhf needed)."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Union

from .exceptions import WorkspaceError
from .results import result_metas

__all__ = [
    "JSONFile",
    "JSONSource",
    "WorkspaceId",
    "digest",
    "load_json",
    "load_patches",
    "observation_notices",
    "read_json_file",
    "to_jsonable",
]

#: anything the client accepts as a workspace / patchset / patch: a mapping (a dict or a
#: ``pyhf.Workspace``/``pyhf.PatchSet``-like object), a path, ``"-"`` for stdin, a text stream,
#: or JSON text/bytes; as a workspace also a :class:`WorkspaceId` (one the server holds).
JSONSource = Union[Mapping[str, Any], str, "os.PathLike[str]", IO[str], IO[bytes], bytes]


class WorkspaceId(str):
    """The id of a workspace the server holds, as :meth:`Client.upload_workspace` returns it.

    Pass it wherever a workspace goes: the request names the workspace by id, and the client
    neither reads, hashes nor uploads it again (a reinterpretation tool posting thousands of
    signal patches on one background pays for its background once). A plain string is a
    path or JSON text; ``WorkspaceId("...")`` names an id of your own. A server that no
    longer holds the workspace answers 404 (:class:`NotFoundError`): upload it again.

    >>> wid = WorkspaceId("e7d3")
    >>> wid == "e7d3", isinstance(wid, str)
    (True, True)
    """

    __slots__ = ()


def digest(obj: Any, algorithm: str = "sha256") -> str:
    """The id pyhf gives a JSON object (``pyhf.utils.digest``), without importing pyhf.

    ``hashlib.<algorithm>(json.dumps(obj, sort_keys=True, ensure_ascii=False).encode("utf8"))``;
    equal to the ``digests`` a pyhf ``PatchSet`` records for its background workspace.
    """
    try:  # numpy values, a pyhf.PatchSet: converted where the encoder meets them
        text = json.dumps(obj, sort_keys=True, ensure_ascii=False, default=to_jsonable)
    except (TypeError, ValueError) as exc:
        raise WorkspaceError(f"object is not JSON-serialisable: {exc}") from exc
    try:
        hasher = hashlib.new(algorithm)
    except ValueError as exc:
        raise ValueError(f"{algorithm} is not provided by hashlib") from exc
    hasher.update(text.encode("utf8"))
    return hasher.hexdigest()


_JSON_SCALARS = (str, int, float, bool, type(None))


def to_jsonable(obj: Any) -> Any:
    """Plain ``dict``/``list`` copies of mappings and sequences (e.g. a ``pyhf.Workspace``).

    Objects with a ``patch`` list and ``metadata`` (a ``pyhf.patchset.Patch``) or with
    ``patches`` (a ``pyhf.PatchSet``) are turned into their JSON form as well.
    """
    kind = type(obj)  # plain JSON types first: the abstract-class checks cost ~10x as much
    if kind in _JSON_SCALARS:
        return obj
    if kind is dict or (kind is not list and isinstance(obj, Mapping)):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (str, bytes, int, float, bool)):
        return obj
    if kind is list or isinstance(obj, Sequence):
        return [to_jsonable(v) for v in obj]
    if hasattr(obj, "tolist"):  # numpy scalars/arrays, if a caller built the spec with numpy
        return obj.tolist()
    # pyhf.PatchSet / pyhf.patchset.Patch are not mappings; rebuild their JSON form
    if hasattr(obj, "patches") and hasattr(obj, "metadata"):
        return {
            "metadata": to_jsonable(obj.metadata),
            "patches": [to_jsonable(p) for p in obj.patches],
            "version": getattr(obj, "version", "1.0.0"),
        }
    if hasattr(obj, "patch") and hasattr(obj, "metadata"):
        return {"metadata": to_jsonable(obj.metadata), "patch": to_jsonable(obj.patch)}
    raise TypeError(f"cannot convert {type(obj).__name__} to JSON")


def load_json(source: JSONSource, what: str = "workspace") -> Any:
    """Read JSON from a mapping, a path (``"-"`` is stdin; gzip-compressed files too), a
    text/binary stream or JSON text.

    Raises:
        WorkspaceError: the file is missing or the content is not JSON.
    """
    if isinstance(source, Mapping) or hasattr(source, "patches"):
        try:
            return to_jsonable(source)
        except TypeError as exc:
            raise WorkspaceError(f"{what}: {exc}") from exc
    if isinstance(source, bytes):
        return _parse(source.decode("utf-8"), what, "<bytes>")
    if hasattr(source, "read"):
        text = source.read()
        if isinstance(text, bytes):
            text = text.decode("utf-8")
        return _parse(text, what, getattr(source, "name", "<stream>"))
    if isinstance(source, (str, os.PathLike)):
        if source == "-":
            return _parse(sys.stdin.read(), what, "<stdin>")
        if _is_text_source(source):
            return _parse(source, what, "<string>")  # type: ignore[arg-type]
        # HEPData ships patchsets gzip-compressed (.json.gz): read them as they come
        return read_json_file(source, what).parsed()
    raise WorkspaceError(f"cannot read a {what} from {type(source).__name__}")


@dataclass(frozen=True, eq=False)
class JSONFile:
    """A JSON file as read from disk, to be sent as it is: not parsed, not written again.

    A published patchset is megabytes of JSON: parsing, writing and compressing it again is
    most of what the client spends on a command, and the server parses and checks it anyway.
    ``text`` is the JSON (UTF-8); ``compressed`` the file's own gzip bytes when it came
    gzip-compressed (HEPData's ``.json.gz``): they go into a gzip request body as they are,
    as a member of it (a gzip stream may hold several, RFC 1952). Where the server finds the
    body's JSON malformed, :meth:`parsed` says what is wrong in the file.
    """

    what: str
    name: str
    text: bytes
    compressed: bytes | None = None

    def parsed(self) -> Any:
        """The file's JSON (:class:`WorkspaceError` naming the file if it is not JSON)."""
        return _parse(self.text, self.what, self.name)  # UTF-8, checked when read


def read_json_file(source: JSONSource, what: str) -> JSONFile | Any:
    """A :class:`JSONFile` of ``source`` when it is a file's path; else :func:`load_json`.

    The file is read whole and decompressed (its gzip checksum checked) and must be UTF-8;
    whether it is JSON is left to whoever reads it.

    Raises:
        WorkspaceError: the file is missing, unreadable, corrupt gzip or not UTF-8.
    """
    if not isinstance(source, (str, os.PathLike)) or _is_text_source(source):
        return load_json(source, what)
    name = os.fspath(source)
    try:
        raw = Path(name).read_bytes()
        gzipped = raw[:2] == b"\x1f\x8b"
        text = gzip.decompress(raw) if gzipped else raw
        text.decode("utf-8")
    except FileNotFoundError as exc:
        raise WorkspaceError(f"{what} file not found: {name}") from exc
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise WorkspaceError(f"cannot read {what} file {name}: {exc}") from exc
    return JSONFile(what, name, text, raw if gzipped else None)


def _is_text_source(source: str | os.PathLike[str]) -> bool:
    """Whether a string names stdin or is JSON text itself rather than a path."""
    return isinstance(source, str) and (source == "-" or source.lstrip().startswith(("{", "[")))


def _parse(text: str | bytes, what: str, name: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise WorkspaceError(f"{what} {name} is not valid JSON: {exc}") from exc


def load_patches(patches: Sequence[JSONSource] | None) -> list[Any]:
    """Load a list of jsonpatches (each a list of operations, or a path to one)."""
    # a list is sent as it is: the encoder converts what is not JSON
    return [p if isinstance(p, list) else load_json(p, "patch") for p in patches or ()]


def observation_notices(result: Any) -> list[str]:
    """The server's notices of ignored observations in a parsed result (one, a list, or a
    ``{patch: ...}`` dict): an entry of ``observations`` naming a channel the workspace (after
    its patches) does not have is ignored, as pyhf ignores it, and each result says so in
    ``meta.ignored_observations``. Each notice once, naming its patch or counting its patches.

    >>> class R:
    ...     meta = {"ignored_observations": ["observations[1] names channel 'VR', ..."]}
    >>> observation_notices([R(), R()])
    ["observations[1] names channel 'VR', ..."]
    >>> observation_notices({"p1": R(), "p2": R()})
    ["observations[1] names channel 'VR', ... (in 2 patches)"]
    """
    found: dict[str, list[str]] = {}
    for meta, names in result_metas(result):
        for notice in meta.get("ignored_observations") or ():
            patches = found.setdefault(notice, [])
            if names and str(names[-1]) not in patches:
                patches.append(str(names[-1]))
    return [
        notice
        + (f" (in patch {patches[0]!r})" if len(patches) == 1 else "")
        + (f" (in {len(patches)} patches)" if len(patches) > 1 else "")
        for notice, patches in found.items()
    ]
