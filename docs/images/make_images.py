"""Make the images of README.md and docs/PLOTS.md from a real run: a server on the CPU, jobs on
the published ATLAS workspaces, each plot kind fetched from ``GET /jobs/{id}/plots/{kind}.png``,
and the web page screenshotted by headless chromium (selenium's ``save_screenshot``).

    .venv/bin/python docs/images/make_images.py      # from the repository root; about a minute

Reads the ATLAS workspaces the repository ships (``tests/data/workspaces``, or the folder
``PYHF_GPU_SHARED_WORKSPACES`` names: ``tests/workspaces.py``). Needs Debian's ``chromium``
and ``chromium-driver`` (``make browser``) and selenium (the test extra).
"""

from __future__ import annotations

import gzip
import io
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from PIL import Image

OUT = Path(__file__).resolve().parent
sys.path.insert(0, str(OUT.parents[1] / "tests"))
sys.path.insert(0, str(OUT.parents[1] / "benchmarks"))
import generate_large  # noqa: E402
from workspaces import WORKSPACES_DIR as WORKSPACES  # noqa: E402
from workspaces import read_json, workspace_file  # noqa: E402

SMALL = WORKSPACES / "atlas-susy-2018-31-sbottom-B"
PLANE = WORKSPACES / "atlas-susy-2018-31-sbottom-A"
SIGNAL = "sig_s1_x1"
DPI = 80
MAX_BYTES = 300_000


def read(path: Path) -> Any:
    return read_json(path)  # ``x.json`` may be ``x.json.gz`` on disk


def plane_patchset() -> dict[str, Any]:
    """Published signal points at m(χ̃⁰₁) = 60 GeV over m(b̃₁) 1000..1600, m(χ̃⁰₂) 250..1050."""
    published = read(PLANE / "patchset.hepdata.json.gz")
    published["patches"] = [
        p
        for p in published["patches"]
        if p["metadata"]["values"][2] == 60
        and 1000 <= p["metadata"]["values"][0] <= 1600
        and p["metadata"]["values"][1] in (250, 450, 650, 850, 1050)
    ]
    return published


def save_png(data: bytes, name: str) -> None:
    """Write ``name``.png, re-encoded with a palette when that is needed to stay small."""
    path = OUT / f"{name}.png"
    if len(data) > MAX_BYTES:
        image = Image.open(io.BytesIO(data)).convert("RGB").quantize(256)
        buffer = io.BytesIO()
        image.save(buffer, "PNG", optimize=True)
        data = buffer.getvalue()
    assert len(data) <= MAX_BYTES, (name, len(data))
    path.write_bytes(data)
    print(f"{path.relative_to(OUT.parents[1])}: {len(data) // 1000} kB")


def start_server(data_dir: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "pyhf_gpu_server.cli", "--port", str(port),
               "--data-dir", str(data_dir), "--device", "cpu", "--log-level", "warning"]  # fmt: skip
    process = subprocess.Popen(command)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(url + "/healthz").status_code == 200:
                return process, url
        except httpx.TransportError:
            time.sleep(0.1)
    raise RuntimeError("the server did not start")


#: a generated analysis of many bins (``benchmarks/generate_large.py``): the yields grid
LARGE = {"channels": 4, "bins": 20, "systematics": 20, "per_sample": 6, "backgrounds": 4}


def plots(client: httpx.Client) -> None:
    """One PNG per plot kind, from jobs on the published workspaces (the exclusion of a whole
    published patchset: its most populated slice), and the yields of a generated model."""
    small = client.post("/workspaces", json=read(SMALL / "BkgOnly.json")).json()["workspace_id"]
    plane = client.post("/workspaces", json=read(PLANE / "BkgOnly.json")).json()["workspace_id"]
    large = generate_large.workspace(mass=0.4, injected=4.0, seed=1, **LARGE)
    one = {
        "workspace_id": small,
        "patchset": read(SMALL / "patchset.json"),
        "patch_names": [SIGNAL],
    }
    jobs = {
        "brazil": ("cls", {**one, "test_poi": [0.4 * i for i in range(1, 26)]}),
        "exclusion": (
            "cls",
            {"workspace_id": plane, "patchset": read(PLANE / "patchset.hepdata.json.gz")},
        ),
        "fit": ("fit", one),
        "ranking": ("ranking", {**one, "top": 15}),
        "scan": ("scan", {**one, "x": {"range": [0.0, 6.0], "steps": 25}}),
        "scan-2d": (
            "scan",
            {
                **one,
                "x": {"range": [0.0, 6.0], "steps": 13},
                "y": {"parameter": "mu_ttbar", "range": [0.6, 1.4], "steps": 13},
            },
        ),
        "yields": ("yields", one),
        "yields-grid": ("yields", {"workspace": large}),
    }
    ids = {}
    for name, (operation, body) in jobs.items():
        response = client.post("/jobs", json={"operation": operation, **body})
        response.raise_for_status()
        ids[name] = response.json()["id"]
    for name, job_id in ids.items():
        while (view := client.get(f"/jobs/{job_id}").json())["status"] not in (
            "succeeded", "failed", "cancelled"
        ):  # fmt: skip
            time.sleep(0.5)
        assert view["status"] == "succeeded", (name, view["error"])
    wanted = [
        ("brazil", "brazil", {}),
        ("exclusion", "exclusion", {}),
        ("fit", "pulls", {"top": 30}),
        ("fit", "correlation", {}),
        ("ranking", "ranking", {}),
        ("scan", "scan", {}),
        ("scan-2d", "scan", {}),
        ("yields", "yields", {}),
        ("yields-grid", "yields", {}),
    ]
    label = {"label": "ATLAS Open Likelihoods", "rlabel": "13 TeV, 139 fb⁻¹"}
    for job, kind, options in wanted:
        params = {"dpi": DPI, **label, **options}
        response = client.get(f"/jobs/{ids[job]}/plots/{kind}.png", params=params)
        response.raise_for_status()
        save_png(response.content, f"plot-{job if job in ('scan-2d', 'yields-grid') else kind}")


def screenshots(url: str, scratch: Path) -> None:
    """The page after a CLs job of a published patchset (uploaded as .json.gz)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    patchset = scratch / "patchset.hepdata.subset.json.gz"
    patchset.write_bytes(gzip.compress(json.dumps(plane_patchset()).encode()))
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                     "--window-size=1280,1000", "--hide-scrollbars"):  # fmt: skip
        options.add_argument(argument)
    service = Service(executable_path=shutil.which("chromedriver"))
    driver = webdriver.Chrome(service=service, options=options)
    try:
        driver.get(url + "/")
        driver.find_element(By.ID, "workspace-file").send_keys(
            str(workspace_file(PLANE, "BkgOnly.json"))
        )
        driver.find_element(By.ID, "patchset-file").send_keys(str(patchset))
        driver.find_element(By.ID, "start-job").click()
        WebDriverWait(driver, 120).until(
            lambda d: d.execute_script(
                "const i = document.querySelector('#plots img');"
                "return i !== null && i.complete && i.naturalWidth > 0;"
            )
        )
        height = driver.execute_script("return document.documentElement.scrollHeight")
        driver.set_window_size(1280, min(height, 1900))
        save_png(driver.get_screenshot_as_png(), "web-page")
        link = driver.find_element(By.ID, "report-link").get_attribute("href")
        driver.set_window_size(1280, 1000)
        driver.get(link)
        WebDriverWait(driver, 60).until(
            lambda d: d.execute_script(
                "const i = document.querySelector('#plots img');"
                "return i !== null && i.complete && i.naturalWidth > 0;"
            )
        )
        save_png(driver.get_screenshot_as_png(), "web-report")
    finally:
        driver.quit()


def main() -> None:
    with tempfile.TemporaryDirectory() as scratch:
        process, url = start_server(Path(scratch) / "data")
        try:
            with httpx.Client(base_url=url, timeout=600) as client:
                plots(client)
            screenshots(url, Path(scratch))
        finally:
            process.terminate()
            process.wait(timeout=60)


if __name__ == "__main__":
    main()
