"""Where the published ATLAS likelihoods of the tests and benchmarks are, and how to read them.

They ship in the repository, gzip-compressed, under ``tests/data/workspaces`` (its README says
what each file is and where it comes from). ``PYHF_GPU_SHARED_WORKSPACES`` names another folder
of the same layout to use instead (plain ``.json`` or ``.json.gz`` files), e.g.
``PYHF_GPU_SHARED_WORKSPACES=../shared/workspaces``.

Callers name files as published (``BkgOnly.json``, ``patchset.json``, ...): ``workspace_file``
gives the one on disk (``name`` or ``name.gz``) and ``read_json`` reads either. Benchmarks and
``docs/images/make_images.py`` import this module too (``tests/`` on ``sys.path``).
"""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path
from typing import Any

ENV = "PYHF_GPU_SHARED_WORKSPACES"
REPO_ROOT = Path(__file__).resolve().parents[1]
BUNDLED_DIR = REPO_ROOT / "tests" / "data" / "workspaces"
WORKSPACES_DIR = Path(os.environ.get(ENV) or BUNDLED_DIR).expanduser().resolve()


def workspace_file(path: Path | str, *parts: str) -> Path:
    """The file on disk for ``path`` (joined with ``parts``): itself where it exists, else
    itself with ``.gz`` appended where that exists, else ``path`` as given (so that a missing
    file fails where it is opened, naming the published name)."""
    path = Path(path, *parts)
    if path.exists() or path.suffix == ".gz":
        return path
    compressed = path.with_name(path.name + ".gz")
    return compressed if compressed.exists() else path


def read_json(path: Path | str, *parts: str) -> Any:
    """A JSON file, gzip-compressed or not (``workspace_file`` finds which)."""
    path = workspace_file(path, *parts)
    data = path.read_bytes()
    return json.loads(gzip.decompress(data) if path.suffix == ".gz" else data)


def analysis_names(directory: Path = WORKSPACES_DIR) -> list[str]:
    """The analysis folders of ``directory``: those with a ``reference.json`` (plain or gzip)."""
    return sorted({p.parent.name for p in directory.glob("*/reference.json*")})


WORKSPACE_NAMES = analysis_names()
