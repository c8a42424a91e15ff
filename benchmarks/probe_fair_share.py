"""A toy job among many interactive clients (#37), loopback only, bounded in time: does the
device go round? A fresh server with its defaults gets a large toy job (``--rows`` hypotheses
x ``--ntoys`` toys on the published stau likelihood), then

1. one small ``/cls`` sent 1 s after the job started: its wait;
2. ``--clients`` threads sending published stau ``/cls`` requests (asymptotic, one patch each)
   back to back for ``--seconds``: answered, 5xx, latencies, and the job's progress;
3. the server's resident memory sampled from ``/proc`` every 0.1 s: at the start, its peak,
   and at the end;

and the job is cancelled at the end. Prints a markdown table (docs/OPERATORS.md).

    .venv/bin/python benchmarks/probe_fair_share.py [--clients 64] [--seconds 120]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from service_support import ServerProcess, simple_workspace
from workspaces import WORKSPACES_DIR, read_json

STAU = WORKSPACES_DIR / "atlas-susy-2018-04-stau"


def rss_gib(pid: int) -> float:
    """Resident memory of ``pid`` in GiB (``/proc``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 2**20
    return 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--ntoys", type=int, default=2000)
    args = parser.parse_args()

    background = read_json(STAU, "BkgOnly.json")
    patches = read_json(STAU, "patchset.json")["patches"]
    job = {
        "operation": "cls",
        "workspace": background,
        "patches": [patches[0]],
        "test_poi": [0.5 * (i + 1) for i in range(args.rows)],
        "calctype": "toybased",
        "ntoys": args.ntoys,
        "seed": 1,
    }
    small = {"workspace": simple_workspace((4.0, 8.0)), "test_poi": 1.0}
    server = ServerProcess(Path(tempfile.mkdtemp(prefix="probe-fair-share-"))).start()
    assert server.process is not None
    pid = server.process.pid
    samples: list[float] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            samples.append(rss_gib(pid))
            time.sleep(0.1)

    threading.Thread(target=sample, daemon=True).start()
    try:
        with server.client(timeout_s=args.seconds + 60) as client:
            upload = client.post("/workspaces", json=background)
            workspace_id = upload.json()["workspace_id"]
            client.post("/cls", json=small)
            for patch in patches[:4]:  # warm: the clients' models are built before the job
                client.post("/cls", json={"workspace_id": workspace_id, "patches": [patch]})
            idle = rss_gib(pid)
            job_id = client.post("/jobs", json=job).json()["id"]
            time.sleep(1.0)
            sent = time.monotonic()
            first_status = client.post("/cls", json=small).status_code
            first_wait = time.monotonic() - sent

            latencies: list[float] = []
            statuses: list[int] = []
            lock = threading.Lock()
            until = time.monotonic() + args.seconds

            def hammer(k: int) -> None:
                body = {"workspace_id": workspace_id, "patches": [patches[k % len(patches)]]}
                with server.client(timeout_s=args.seconds + 60) as own:
                    while time.monotonic() < until:
                        start = time.monotonic()
                        try:
                            status = own.post("/cls", json=body).status_code
                        except httpx.HTTPError:
                            status = 0
                        with lock:
                            latencies.append(time.monotonic() - start)
                            statuses.append(status)

            threads = [threading.Thread(target=hammer, args=(k,)) for k in range(args.clients)]
            progress_start = client.get(f"/jobs/{job_id}").json()["progress"]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            progress_end = client.get(f"/jobs/{job_id}").json()["progress"]
            client.delete(f"/jobs/{job_id}")
            end = rss_gib(pid)
    finally:
        stop.set()
        server.stop()

    ok = sum(s == 200 for s in statuses)
    errors = sum(s >= 500 or s == 0 for s in statuses)
    quantiles = statistics.quantiles(latencies, n=100) if len(latencies) > 1 else [0.0] * 99
    print(f"| job | {args.rows} hypotheses x {args.ntoys} toys, stau (119 parameters) |")
    print("|---|---|")
    print(f"| a small `/cls` 1 s after the job started | {first_status} in {first_wait:.2f} s |")
    print(
        f"| {args.clients} clients for {args.seconds:.0f} s | {len(statuses)} requests, {ok} "
        f"answered 200, {errors} 5xx or lost |"
    )
    print(
        f"| their latency | median {statistics.median(latencies):.2f} s, p99 "
        f"{quantiles[98]:.2f} s, max {max(latencies):.2f} s |"
    )
    print(
        f"| the job meanwhile | progress {progress_start['done']} -> {progress_end['done']} of "
        f"{progress_end['total']} slices of 50 toys |"
    )
    print(f"| server RSS | idle {idle:.2f} GiB, peak {max(samples):.2f} GiB, end {end:.2f} GiB |")


if __name__ == "__main__":
    main()
