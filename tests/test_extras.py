"""A server installed with the ``server`` extra alone (no matplotlib or mplhep: ``plots``; no
dask or distributed: ``cluster``) starts and answers; a plot asked of it is a 501 that names
the extra to install. Run in a fresh process whose imports of those packages fail, as they
would where they are not installed."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(180)

SCRIPT = r"""
import importlib.abc, json, sys, tempfile

class Missing(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("matplotlib", "mplhep", "distributed", "dask"):
            raise ImportError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, Missing())
from fastapi.testclient import TestClient
from pyhf_gpu_server.service.app import create_app
from pyhf_gpu_server.service.settings import Settings

sample = lambda name, data, mods: {"name": name, "data": data, "modifiers": mods}
mu = {"name": "mu", "type": "normfactor", "data": None}
workspace = {
    "channels": [{"name": "c", "samples": [sample("s", [5.0], [mu]), sample("b", [50.0], [])]}],
    "observations": [{"name": "c", "data": [52.0]}],
    "measurements": [{"name": "m", "config": {"poi": "mu", "parameters": []}}],
    "version": "1.0.0",
}
body = {"workspace": workspace, "test_poi": [0.5, 1.0]}
out = {}
with TestClient(create_app(Settings(data_dir=tempfile.mkdtemp(), device="cpu"))) as client:
    answer = client.post("/cls", json=body)
    out["cls"] = [answer.status_code, answer.json()]
    plot = client.post("/cls", json={**body, "plot": {"kind": "brazil", "format": "svg"}})
    out["plot"] = [plot.status_code, plot.json()]
out["loaded"] = sorted(
    m for m in sys.modules if m.split(".")[0] in ("matplotlib", "mplhep", "distributed", "dask")
)
print(json.dumps(out))
"""


def test_the_server_extra_alone_answers_and_names_the_plots_extra():
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=150
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    status, answer = out["cls"]
    assert status == 200 and len(answer) == 2 and 0 < answer[0]["CLs_obs"] < 1, answer
    status, refused = out["plot"]
    assert status == 501, refused
    assert "pyhf-gpu[plots]" in refused["detail"] and "matplotlib" in refused["detail"]
    assert out["loaded"] == []
