"""The first GPU call, prepared: the device's wheels and ``gpu_check.sh``, tested on the CPU.

A lent GPU machine has Python 3.12 and a CUDA torch but none of the server's other needs, and
reaches no registry; it is lent for minutes. What can be tested here is: the wheel folder
resolves (from PyPI, as a developer builds it) and installs offline into a clean target for
that Python, every requirement met by a carried wheel or the image; and the script runs end
to end, every step, in its CPU mode (smaller sizes), writing its one Markdown table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO_ROOT
from service_support import free_port


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_device_wheels_resolve_and_install_offline_into_a_clean_target(tmp_path: Path):
    folder = tmp_path / "whl"
    script = REPO_ROOT / "benchmarks" / "device_wheels.py"
    built = subprocess.run(
        [sys.executable, str(script), "--out", str(folder)],
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    names = {p.name.split("-")[0].lower() for p in folder.glob("*.whl")}
    for needed in ("pyhf_gpu", "fastapi", "uvicorn", "pydantic", "pydantic_core", "pyhf"):
        assert needed in names, names
    assert "torch" not in names and "numpy" not in names  # the image has them
    assert "PROBLEM" not in built.stdout
    checked = subprocess.run(
        [sys.executable, str(script), "--check", str(folder)], capture_output=True, text=True
    )
    assert checked.returncode == 0, checked.stdout[-2000:]
    (folder / next(p.name for p in folder.glob("pydantic_core-*.whl"))).unlink()
    broken = subprocess.run(
        [sys.executable, str(script), "--check", str(folder)], capture_output=True, text=True
    )
    assert broken.returncode == 1 and "pydantic-core" in broken.stdout, broken.stdout[-2000:]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_gpu_check_runs_every_step_end_to_end_on_the_cpu(tmp_path: Path):
    out = tmp_path / "out"
    # the script finds the workspaces itself: tests/data/workspaces, or PYHF_GPU_SHARED_WORKSPACES
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "PORT": str(free_port())}
    proc = subprocess.run(
        ["bash", str(REPO_ROOT / "benchmarks" / "gpu_check.sh"), "cpu"],
        capture_output=True,
        text=True,
        env=env,
        timeout=540,
    )
    table = (out / "gpu_check.md").read_text()
    assert proc.returncode == 0, table + proc.stderr[-2000:]
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    steps = {row.split("|")[1].strip(): row.split("|")[2].strip() for row in rows[1:8]}
    for step in (
        "parity",
        "published-sbottom-B-218",
        "published-stau-24",
        "generated-workspace",
        "generated-24-patches",
        "scaling",
        "variants",
    ):
        assert steps.get(step) == "0", (step, table)
    generated = json.loads((out / "generated.json").read_text())
    assert 0 < generated["CLs_obs"] <= 1
    assert len(json.loads((out / "generated-24.json").read_text())) == 24
    assert len(json.loads((out / "sbottom-B.json").read_text())) == 217  # 1 adds no signal
    assert "## scaling" in table and "Growth of our seconds per iteration" in table
    assert "## variants" in table and "float32" in table
