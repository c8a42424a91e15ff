"""Shared test fixtures: the published workspaces (``workspaces.py``: in the repository under
``tests/data/workspaces``, or ``PYHF_GPU_SHARED_WORKSPACES``), and small models."""

from __future__ import annotations

from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest
from service_support import ServerProcess, running_server
from workspaces import ENV, REPO_ROOT, WORKSPACE_NAMES, WORKSPACES_DIR, read_json

from pyhf_gpu_server.allocator import tune_cpu_allocator

__all__ = ["REPO_ROOT", "WORKSPACES_DIR", "WORKSPACE_NAMES"]  # imported by test modules

tune_cpu_allocator()  # the test process allocates as the server's does (faster CPU fits)


@cache
def load_json(path: Path) -> dict:
    """A JSON file, read once per test session (callers must not mutate it); ``path`` may name
    ``x.json`` where only ``x.json.gz`` is on disk (``workspaces.read_json``)."""
    return read_json(path)


load_patchset = load_json  # a patchset file, gzip-compressed (``.gz``) or not


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
            f"no workspaces (*/reference.json) under {WORKSPACES_DIR}: the repository's copy "
            f"is tests/data/workspaces; {ENV}, where set, must name a folder of that layout"
        )
    items[:] = slow_modules_first(items)


def slow_modules_first(items: list[pytest.Item]) -> list[pytest.Item]:
    """The modules with a test marked ``slow`` first, each group in collection order.

    ``make test`` hands whole modules to its pytest-xdist workers in this order
    (``--dist loadfile --no-loadscope-reorder``): the long modules start first and the short
    ones fill the end, instead of one worker finishing a long module alone while the others
    wait (xdist's default order, by number of tests, put the long modules of few tests last).
    """
    slow = {item.module for item in items if item.get_closest_marker("slow") is not None}
    return sorted(items, key=lambda item: item.module not in slow)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A ``pyhf-gpu-server`` subprocess with its default settings for the module (a module
    that needs other settings defines its own ``server``)."""
    with running_server(tmp_path_factory.mktemp("server")) as started:
        yield started


@pytest.fixture(scope="module")
def client(server):
    """An httpx client for the module's ``server`` fixture (a real server subprocess)."""
    with server.client() as c:
        yield c
