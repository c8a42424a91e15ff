"""Hostile-but-fair memory probes of a server (#37), loopback only, each bounded in count and
time: small bodies whose models would take gigabytes, and patchsets whose patches each bring
their own modifiers. Prints a markdown table (docs/OPERATORS.md): per probe, the status, the
seconds to the answer and the server's peak resident memory (``/proc``, every 0.1 s), each on
a fresh server with its defaults.

    .venv/bin/python benchmarks/probe_memory.py [--timeout-s 300]
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pyhf

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from service_support import (
    ServerProcess,
    own_histosys_channels_workspace,
    simple_workspace,
    unique_normfactor_patchset,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_patchsets import _peak_rss


def unique_histosys_patchset(background: dict[str, Any], patches: int) -> dict[str, Any]:
    """Every patch adds a uniquely named histosys to the background sample."""
    patchset = unique_normfactor_patchset(background, patches)
    data = background["channels"][0]["samples"][1]["data"]
    for k, patch in enumerate(patchset["patches"]):
        patch["patch"][0]["value"] = {
            "name": f"extra_{k}",
            "type": "histosys",
            "data": {"hi_data": [x * 1.1 for x in data], "lo_data": [x * 0.9 for x in data]},
        }
    return patchset


def probes() -> list[tuple[str, str, bytes]]:
    """(name, route, gzip-compressed JSON body)."""
    background = simple_workspace()
    bodies = [
        (
            "300 one-bin channels, own sample and histosys each",
            "/cls",
            {"workspace": own_histosys_channels_workspace(300)},
        ),
        (
            "1000 one-bin channels, own sample and histosys each",
            "/cls",
            {"workspace": own_histosys_channels_workspace(1000)},
        ),
        (
            "6000 patches, a unique normfactor each",
            "/cls",
            {"workspace": background, "patchset": unique_normfactor_patchset(background, 6000)},
        ),
        (
            "3000 patches, a unique histosys each",
            "/cls",
            {"workspace": background, "patchset": unique_histosys_patchset(background, 3000)},
        ),
    ]
    return [(name, route, gzip.compress(json.dumps(body).encode())) for name, route, body in bodies]


def run(name: str, route: str, body: bytes, timeout_s: float) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        server = ServerProcess(Path(tmp)).start()
        stop, found = threading.Event(), []
        watcher = threading.Thread(target=_peak_rss, args=(server.process.pid, stop, found))
        watcher.start()
        try:
            start = time.perf_counter()
            try:
                response = httpx.post(
                    server.url + route,
                    content=body,
                    headers={"Content-Encoding": "gzip", "Content-Type": "application/json"},
                    timeout=timeout_s,
                )
                status = str(response.status_code)
                detail = response.json().get("detail", "") if response.status_code != 200 else ""
                if response.status_code == 200:
                    answers = response.json()
                    points = answers.values() if isinstance(answers, dict) else answers
                    models = {p["meta"]["model_id"] for p in points if "meta" in p}
                    detail = f"{len(points)} points from {len(models)} models"
            except httpx.TimeoutException:
                status, detail = "no answer", f"timed out after {timeout_s:.0f} s"
            seconds = time.perf_counter() - start
        finally:
            stop.set()
            watcher.join()
            server.stop()
    peak = max(found, default=0) / 2**30
    return (
        f"| {name} | {len(body) / 1024:.0f} kB | {status} | {seconds:.2f} | {peak:.2f} GiB | "
        f"{str(detail)[:160]} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--timeout-s", type=float, default=300.0)
    args = parser.parse_args()
    print(f"pyhf {pyhf.__version__}; a fresh server per probe, its defaults\n")
    print("| probe | gzip body | status | seconds | server peak RSS | answer |")
    print("|---|---|---|---|---|---|")
    for name, route, body in probes():
        print(run(name, route, body, args.timeout_s), flush=True)


if __name__ == "__main__":
    main()
