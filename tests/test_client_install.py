"""The base install is the thin client: no torch, no pyhf, and the console script works."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, check=False, **kwargs)


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_base_install_is_thin(tmp_path):
    venv = tmp_path / "venv"
    made = _run([sys.executable, "-m", "venv", str(venv)])
    assert made.returncode == 0, made.stderr
    bindir = venv / ("Scripts" if os.name == "nt" else "bin")
    python = bindir / "python"
    # a copy of the tree keeps build artefacts (build/, egg-info) out of the shared checkout
    src = tmp_path / "src"
    copied = _run(
        ["git", "-C", str(ROOT), "ls-files", "-co", "--exclude-standard", "-z"],
    )
    assert copied.returncode == 0, copied.stderr
    for name in filter(None, copied.stdout.split("\0")):
        source = ROOT / name
        if source.is_file():
            target = src / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(source.read_bytes())
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    installed = _run(
        [str(python), "-m", "pip", "install", "--quiet", str(src)], env=env, timeout=420
    )
    assert installed.returncode == 0, installed.stdout + installed.stderr

    helped = _run([str(bindir / "pyhf-gpu-client"), "--help"])
    assert helped.returncode == 0, helped.stderr
    assert "cls" in helped.stdout and "fit" in helped.stdout

    probe = (
        "import sys, pyhf_gpu_client, pyhf_gpu_client.cli\n"
        "from pyhf_gpu_client import Client, AsyncClient\n"
        "bad = sorted(m for m in ('torch', 'pyhf', 'numpy', 'scipy') if m in sys.modules)\n"
        "print(pyhf_gpu_client.__version__, bad)\n"
        "assert not bad, bad\n"
    )
    imported = _run([str(python), "-c", probe], cwd=tmp_path)
    assert imported.returncode == 0, imported.stdout + imported.stderr
    for heavy in ("torch", "pyhf"):
        missing = _run([str(python), "-c", f"import {heavy}"], cwd=tmp_path)
        assert missing.returncode != 0, f"{heavy} was installed by the base install"
