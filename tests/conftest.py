"""Shared test fixtures: the published workspaces beside the checkout, and small models."""

from __future__ import annotations

import gzip
import json
import os
from functools import cache
from pathlib import Path

import pytest

from pyhf_gpu_server.allocator import tune_cpu_allocator

tune_cpu_allocator()  # the test process allocates as the server's does (faster CPU fits)

REPO_ROOT = Path(__file__).resolve().parents[1]
WORKSPACES_DIR = Path(
    os.environ.get("PYHF_GPU_SHARED_WORKSPACES", REPO_ROOT.parent / "shared" / "workspaces")
)
WORKSPACE_NAMES = sorted(p.parent.name for p in WORKSPACES_DIR.glob("*/reference.json"))


@cache
def load_json(path: Path) -> dict:
    """A JSON file, read once per test session (callers must not mutate it)."""
    return json.loads(Path(path).read_text())


@cache
def load_patchset(path: Path) -> dict:
    """A patchset file, gzip-compressed (``.gz``) or not, read once per test session."""
    path = Path(path)
    if path.suffix == ".gz":
        return json.loads(gzip.decompress(path.read_bytes()))
    return load_json(path)


def shared_workspace(name: str) -> tuple[dict, dict, dict]:
    """(background-only workspace, patchset, reference) of a shared analysis."""
    folder = WORKSPACES_DIR / name
    return (
        load_json(folder / "BkgOnly.json"),
        load_json(folder / "patchset.json"),
        load_json(folder / "reference.json"),
    )


def reference_patches(name: str) -> list[str]:
    """The patches of a shared analysis for which reference.json has pyhf's results."""
    return [r["patch"] for r in shared_workspace(name)[2]["reference"]["results"]]


@pytest.fixture(scope="session", params=WORKSPACE_NAMES)
def shared_name(request) -> str:
    return request.param


def pytest_collection_modifyitems(config, items):
    if not WORKSPACE_NAMES:
        raise pytest.UsageError(
            f"no shared workspaces under {WORKSPACES_DIR}; set PYHF_GPU_SHARED_WORKSPACES"
        )


@pytest.fixture(scope="module")
def client(server):
    """An httpx client for the module's ``server`` fixture (a real server subprocess)."""
    with server.client() as c:
        yield c
