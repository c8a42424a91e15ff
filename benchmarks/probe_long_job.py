"""Long work on a large analysis as a job on a CPU server (a full ranking, or with ``--toys N``
a toy-based ``cls``): how its progress moves, how long it takes, and how long a small
``pyhf-gpu-client cls`` sent while it runs waits; this checkout's server and, side by side in
the same run, another checkout's (``--baseline DIR``: a folder holding a ``pyhf_gpu_server``
package).

The workspace is :func:`bench_shared_node.analysis` (shapesys and shapefactor per-bin
parameters besides shared systematics); the small request is stau's background-only
workspace with its first published signal patch.

    .venv/bin/python benchmarks/probe_long_job.py [--channels 10 --bins 40] [--toys 0] \\
        [--baseline /tmp/base] [--cls-after 5]

Prints one markdown table per server: the job's seconds, the times its progress changed,
and the small request's seconds.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from bench_shared_node import BIN, analysis, analysis_arguments, server, servers
from conftest import shared_workspace


def small_request(directory: Path) -> Path:
    """stau's background-only workspace and its first signal patch, as one workspace file."""
    import pyhf

    workspace, patchset, _ = shared_workspace("atlas-susy-2018-04-stau")
    name = patchset["patches"][0]["metadata"]["name"]
    applied = pyhf.PatchSet(patchset).apply(pyhf.Workspace(workspace), name)
    path = directory / "small.json"
    path.write_text(json.dumps(applied))
    return path


def probe(url: str, job: dict, small: Path, cls_after: float) -> dict:
    """Submit the job, poll its progress every 0.5 s, send the small ``cls`` once the job has
    run ``cls_after`` seconds."""
    timings: dict = {"changes": []}

    def small_cls() -> None:
        start = time.perf_counter()
        command = [BIN / "pyhf-gpu-client", "--server", url, "--job-after", "600", "cls"]
        subprocess.run([*command, str(small)], check=True, capture_output=True, timeout=900)
        timings["cls_s"] = time.perf_counter() - start

    with httpx.Client(base_url=url, timeout=60) as client:
        start = time.perf_counter()
        accepted = client.post("/jobs", json=job)
        accepted.raise_for_status()
        job_id = accepted.json()["id"]
        sender = None
        last = None
        while True:
            view = client.get(f"/jobs/{job_id}").json()
            now = time.perf_counter() - start
            progress = (view["progress"]["done"], view["progress"]["total"])
            if progress != last:
                timings["changes"].append((round(now, 1), *progress))
                last = progress
            if sender is None and view["status"] == "running" and now >= cls_after:
                sender = threading.Thread(target=small_cls)
                sender.start()
            if view["status"] in ("succeeded", "failed", "cancelled"):
                timings["status"] = view["status"]
                timings["job_s"] = now
                timings["result"] = view.get("result") or {}
                break
            time.sleep(0.5)
        if sender is not None:
            sender.join()
    return timings


def main() -> None:
    parser = analysis_arguments(__doc__.splitlines()[0], channels=10)
    parser.add_argument("--cls-after", type=float, default=5.0)
    parser.add_argument("--toys", type=int, default=0, help="a toy-based cls (0: a ranking)")
    args = parser.parse_args()
    job = {"operation": "ranking", "workspace": analysis(args.channels, args.bins)}
    if args.toys:
        job.update(operation="cls", calctype="toybased", ntoys=args.toys, seed=1)
    with tempfile.TemporaryDirectory() as tmp:
        small = small_request(Path(tmp))
        for label, package in servers(args).items():
            with server(package, Path(tmp) / label.replace(" ", "_")) as url:
                found = probe(url, job, small, args.cls_after)
            result = found["result"]
            done = (
                f"CLs_obs {result.get('CLs_obs')}"
                if args.toys
                else f"{len(result.get('labels', []))} parameters ranked"
            )
            print(
                f"\n**{label}**: {found['status']}, {done}, in {found['job_s']:.1f} s; the "
                f"small `cls` sent after {args.cls_after:g} s took "
                f"{found.get('cls_s', float('nan')):.1f} s\n"
            )
            print("| s | done | total |\n|---|---|---|")
            for when, done, total in found["changes"]:
                print(f"| {when} | {done} | {total} |")


if __name__ == "__main__":
    main()
