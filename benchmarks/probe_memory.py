"""Hostile-but-fair memory probes of a server (#37), loopback only, each bounded in count and
time: small bodies whose models would take gigabytes, and patchsets whose patches each bring
their own modifiers. Prints a markdown table (docs/OPERATORS.md): per probe, the status, the
seconds to the answer and the server's peak resident memory (``/proc``, every 0.1 s), each on
a fresh server with its defaults, except the toy probe: 100000 toys on one POI of a generated
550-parameter, 300-bin analysis, with ``--max-fit-memory-mb 1024``, its client gone after 90 s
(the peak shows whether the fits' memory stays within that bound plus the model's).

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
from generate_large import workspace as analysis_workspace

#: the toy probe's server flags and client timeout
TOY_SERVER_ARGS = ("--max-fit-memory-mb", "1024")
TOY_TIMEOUT_S = 90.0


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


def probes() -> list[tuple[str, str, bytes, tuple[str, ...], float | None]]:
    """(name, route, gzip-compressed JSON body, server flags, client timeout or None)."""
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
    probes = [(name, route, body, (), None) for name, route, body in bodies]
    analysis = analysis_workspace(channels=12, bins=25, systematics=243, injected=1.0)
    toys = {"workspace": analysis, "test_poi": 1.0, "calctype": "toybased", "ntoys": 100_000}
    probes.append(
        (
            "100000 toys, 550-parameter analysis, --max-fit-memory-mb 1024",
            "/cls",
            toys,
            TOY_SERVER_ARGS,
            TOY_TIMEOUT_S,
        )
    )
    return [
        (name, route, gzip.compress(json.dumps(body).encode()), args, timeout)
        for name, route, body, args, timeout in probes
    ]


def run(name: str, route: str, body: bytes, args: tuple[str, ...], timeout_s: float) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        server = ServerProcess(Path(tmp), args).start()
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
    parser.add_argument("--only", default="", help="run the probes whose name contains this")
    args = parser.parse_args()
    print(f"pyhf {pyhf.__version__}; a fresh server per probe, its defaults\n")
    print("| probe | gzip body | status | seconds | server peak RSS | answer |")
    print("|---|---|---|---|---|---|")
    for name, route, body, server_args, timeout in probes():
        if args.only not in name:
            continue
        print(run(name, route, body, server_args, timeout or args.timeout_s), flush=True)


if __name__ == "__main__":
    main()
