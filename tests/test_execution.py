"""The execution package: the call types and runners that the service and the cluster share,
importing neither (no import cycle between the server's packages)."""

from __future__ import annotations

import ast
import pickle
from pathlib import Path

import pytest

SERVER = Path(__file__).resolve().parents[1] / "server"


def _imports(package: str) -> dict[str, set[str]]:
    """Module (path under ``server/``) -> the ``pyhf_gpu_server`` modules it imports, relative
    imports resolved, every ``import`` counted (lazy and ``TYPE_CHECKING`` ones too)."""
    found: dict[str, set[str]] = {}
    for path in sorted((SERVER / package).rglob("*.py")):
        parts = ["pyhf_gpu_server", *path.relative_to(SERVER).with_suffix("").parts]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level:
                base = parts[: len(parts) - node.level]
                targets.add(".".join([*base, *filter(None, [node.module])]))
            elif isinstance(node, ast.ImportFrom):
                targets.add(node.module or "")
        found[str(path.relative_to(SERVER))] = {
            t for t in targets if t.startswith("pyhf_gpu_server.")
        }
    return found


def test_execution_imports_only_engine_and_inference() -> None:
    imported = _imports("execution")
    assert imported, "no module found"
    for module, targets in imported.items():
        packages = {t.split(".")[1] for t in targets}
        assert packages <= {"engine", "inference", "execution"}, (module, targets)


def test_cluster_takes_the_call_types_from_execution() -> None:
    internal = ("dispatch", "requests", "operations", "scheduler", "engine_shares")
    for module, targets in _imports("cluster").items():
        for target in targets:
            assert target.removeprefix("pyhf_gpu_server.service.") not in internal, (
                module,
                target,
            )


def test_an_engine_call_travels_with_its_operation_registry_by_reference() -> None:
    from pyhf_gpu_server.execution import EngineCall
    from pyhf_gpu_server.service.admission import FitPlan
    from pyhf_gpu_server.service.operations import operation_named
    from pyhf_gpu_server.service.schemas import ClsOptions

    call = EngineCall(
        "cls",
        ClsOptions(test_poi=1.0),
        ("d0",),
        8,
        FitPlan("auto", 0),
        4.0,
        operations=operation_named,
    )
    payload = pickle.dumps(call)
    assert b"operation_named" in payload and len(payload) < 4096
    again = pickle.loads(payload)
    assert again == call and again.engine_operation() is operation_named("cls")


def test_a_call_without_a_registry_uses_the_service_s() -> None:
    from pyhf_gpu_server.execution import EngineCall
    from pyhf_gpu_server.service import dispatch  # noqa: F401  (registers the service's)
    from pyhf_gpu_server.service.admission import FitPlan
    from pyhf_gpu_server.service.operations import operation_named
    from pyhf_gpu_server.service.schemas import FitOptions

    call = EngineCall("fit", FitOptions(), ("d0",), 8, FitPlan("auto", 0), 1.0)
    assert call.engine_operation() is operation_named("fit")
    with pytest.raises(KeyError):
        EngineCall("nothing", FitOptions(), (), 8, FitPlan("auto", 0), 1.0).engine_operation()


def test_no_import_cycle_between_the_server_s_packages() -> None:
    """The package graph (every import, lazy ones too) has no cycle: the composition root
    (``pyhf_gpu_server.cli``) hands the service the cluster's ``connect``; the service never
    imports the cluster."""
    edges: dict[str, set[str]] = {}
    for path in SERVER.iterdir():
        package = path.stem
        if path.name == "__pycache__" or (path.is_file() and path.suffix != ".py"):
            continue
        imported = _imports(package) if path.is_dir() else _imports_of_file(path)
        for targets in imported.values():
            for target in targets:
                other = target.split(".")[1]
                if other != package:
                    edges.setdefault(package, set()).add(other)
    assert "cluster" not in edges.get("service", set()), edges["service"]

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for step in edges.get(start, ()):
            if step == goal or (step not in seen and reaches(step, goal, seen | {step})):
                return True
        return False

    cycles = sorted(p for p in edges if reaches(p, p, {p}))
    assert not cycles, {p: sorted(edges[p]) for p in cycles}


def _imports_of_file(path: Path) -> dict[str, set[str]]:
    """:func:`_imports` of a module at the top of ``server/`` (``cli.py``)."""
    return {
        k: v
        for k, v in _imports(".").items()
        if k == path.name  # rglob from server/ itself: keep this file's entry
    }
