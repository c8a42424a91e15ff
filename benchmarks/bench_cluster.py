"""Cluster mode benchmark: the same workloads in process, on 1 and on 2 Dask workers.

Starts a Dask scheduler, a ``pyhf-gpu-server --dask-scheduler`` API node and an in-process
server (all on 127.0.0.1, CPU, one torch thread each), then ``pyhf-gpu-worker`` processes
(single-threaded CPU workers): first one, then a second. Each setting is warmed (models built
on every worker) before it is timed. Workloads:

* the published 217-point sbottom patchset (``patchset.hepdata.json.gz``): one ``POST /cls``
  at mu = 1 (asymptotics), every point in one request;
* 10^4 toys: a toy-based CLs job (``--toy-pois`` POI values x ``--ntoys`` toys) for one point;
* the cluster hop: sequential one-row ``POST /cls`` of a small workspace, the median of
  ``compute_ms - worker_ms`` (what the batch spent outside the worker's engine call: Dask,
  pickling, the wait) and of the request latency, against the in-process server.

Prints a markdown table (stdout) for BENCHMARKS.md, with the load average before and after.

    .venv/bin/python benchmarks/bench_cluster.py            # about 5 minutes on 2 cores
    .venv/bin/python benchmarks/bench_cluster.py --ntoys 500 --repeats 1
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from service_support import WORKSPACES, ServerProcess, free_port, simple_workspace
from workspaces import read_json

ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


class Processes:
    """The scheduler and workers, each in its own process group."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.running: list[subprocess.Popen[bytes]] = []

    def spawn(self, name: str, command: list[str]) -> None:
        log = (self.directory / f"{name}.log").open("ab")
        self.running.append(
            subprocess.Popen(
                command,
                stdout=log,
                stderr=log,
                env={**os.environ, **ENV},
                start_new_session=True,
            )
        )

    def stop(self) -> None:
        for process in self.running:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in self.running:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)


def wait_for_workers(client: httpx.Client, count: int, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if len(client.get("/info").json()["cluster"]["workers"]) == count:
            return
        time.sleep(0.5)
    raise RuntimeError(f"{count} workers did not join in {timeout_s} s")


def timed(run: Callable[[], Any], repeats: int) -> float:
    """The least seconds of ``repeats`` runs (after the caller's warm-up): the machine is
    shared, the least is the run others disturbed least."""
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - start)
    return min(seconds)


def workloads(args: argparse.Namespace) -> dict[str, Any]:
    folder = WORKSPACES / args.workspace
    background = read_json(folder / "BkgOnly.json")
    patchset = json.loads(gzip.decompress((folder / "patchset.hepdata.json.gz").read_bytes()))
    point = patchset["patches"][len(patchset["patches"]) // 2]["patch"]
    return {"background": background, "patchset": patchset, "point": point}


def bench(client: httpx.Client, data: dict[str, Any], args: argparse.Namespace) -> dict[str, float]:
    """Seconds of each workload against one server (warmed first), and the hop numbers."""
    workspace_id = client.post("/workspaces", json=data["background"]).json()["workspace_id"]
    patchset_body = {"workspace_id": workspace_id, "patchset": data["patchset"], "test_poi": 1.0}
    pois = [round(0.5 + 0.25 * i, 2) for i in range(args.toy_pois)]
    toys_body = {
        "operation": "cls",
        "workspace_id": workspace_id,
        "patches": [data["point"]],
        "test_poi": pois,
        "calctype": "toybased",
        "ntoys": args.ntoys,
        "seed": 1,
    }

    def patchset() -> None:
        answer = client.post("/cls", json=patchset_body)
        answer.raise_for_status()
        assert len(answer.json()) == len(data["patchset"]["patches"])

    def toys() -> None:
        job = client.post("/jobs", json=toys_body).json()["id"]
        while (view := client.get(f"/jobs/{job}").json())["status"] in ("queued", "running"):
            time.sleep(0.05)
        assert view["status"] == "succeeded", view

    patchset()  # warm: translation, the stacked model on every worker
    toys_body_small = {**toys_body, "ntoys": 10}
    client.post("/cls", json={k: v for k, v in toys_body_small.items() if k != "operation"})
    found = {"patchset_s": timed(patchset, args.repeats), "toys_s": timed(toys, args.repeats)}
    small = {"workspace": simple_workspace(), "test_poi": 1.0}
    latencies, hops = [], []
    for i in range(args.hops + 5):
        start = time.perf_counter()
        meta = client.post("/cls", json=small).json()["meta"]
        if i >= 5:  # the first ones build the model
            latencies.append(time.perf_counter() - start)
            timings = meta["timings"]
            hops.append(timings["compute_ms"] - timings.get("worker_ms", timings["compute_ms"]))
    found["latency_ms"] = statistics.median(latencies) * 1000
    found["hop_ms"] = statistics.median(hops)
    return found


def markdown(
    results: dict[str, dict[str, float]], args: argparse.Namespace, loads: list[str]
) -> str:
    local, one, two = results["in process"], results["1 worker"], results["2 workers"]
    n = len(
        json.loads(
            gzip.decompress((WORKSPACES / args.workspace / "patchset.hepdata.json.gz").read_bytes())
        )["patches"]
    )
    lines = [
        f"Load average before / after: {loads[0]} / {loads[1]} (2 cores).",
        "",
        "| workload | in process | 1 worker | 2 workers | 2 workers / 1 worker |",
        "|---|---|---|---|---|",
        f"| {n}-point patchset, one POST /cls (s) | {local['patchset_s']:.2f} | "
        f"{one['patchset_s']:.2f} | {two['patchset_s']:.2f} | "
        f"{one['patchset_s'] / two['patchset_s']:.2f}x |",
        f"| {args.toy_pois * args.ntoys} toys ({args.toy_pois} POIs x {args.ntoys}), a job (s) | "
        f"{local['toys_s']:.2f} | {one['toys_s']:.2f} | {two['toys_s']:.2f} | "
        f"{one['toys_s'] / two['toys_s']:.2f}x |",
        f"| one-row POST /cls latency, median (ms) | {local['latency_ms']:.1f} | "
        f"{one['latency_ms']:.1f} | {two['latency_ms']:.1f} | |",
        f"| cluster hop per batch: compute_ms - worker_ms, median (ms) | 0 | "
        f"{one['hop_ms']:.1f} | {two['hop_ms']:.1f} | |",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workspace", default="atlas-susy-2018-31-sbottom-A")
    parser.add_argument("--ntoys", type=int, default=1000)
    parser.add_argument("--toy-pois", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hops", type=int, default=30)
    args = parser.parse_args()
    data = workloads(args)
    loads = [" ".join(f"{x:.2f}" for x in os.getloadavg())]
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        processes = Processes(root)
        address = f"tcp://127.0.0.1:{free_port()}"
        host, port = address.removeprefix("tcp://").split(":")
        scheduler = [sys.executable, "-m", "distributed.cli.dask_scheduler"]
        processes.spawn("scheduler", [*scheduler, "--host", host, "--port", port, "--no-dashboard"])
        worker = [
            sys.executable,
            "-m",
            "pyhf_gpu_server.cluster.worker",
            address,
            "--device",
            "cpu",
            "--no-nanny",
            "--torch-threads",
            "1",
        ]
        (root / "api").mkdir()
        (root / "local").mkdir()
        api = ServerProcess(root / "api", ["--dask-scheduler", address], ENV)
        local = ServerProcess(root / "local", [], ENV)
        try:
            api.start(timeout_s=120)
            local.start(timeout_s=120)
            with api.client(timeout_s=1800) as client, local.client(timeout_s=1800) as direct:
                print("in process", file=sys.stderr)
                results["in process"] = bench(direct, data, args)
                local.stop()
                for count in (1, 2):
                    processes.spawn(f"w{count}", [*worker, "--name", f"w{count}"])
                    wait_for_workers(client, count)
                    label = "1 worker" if count == 1 else "2 workers"
                    print(label, file=sys.stderr)
                    results[label] = bench(client, data, args)
                    print(f"  {results[label]}", file=sys.stderr)
                info = client.get("/info").json()["cluster"]
                print(json.dumps(info, indent=1)[:3000], file=sys.stderr)
        finally:
            api.stop()
            local.stop()
            processes.stop()
    loads.append(" ".join(f"{x:.2f}" for x in os.getloadavg()))
    print(markdown(results, args, loads))


if __name__ == "__main__":
    main()
