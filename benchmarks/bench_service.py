"""Service benchmark: throughput and p50/p99 latency of POST /cls for 1, 8 and 64 concurrent
clients, with batching on (--max-batch-size 64) and off (--max-batch-size 1).

Starts a real server subprocess per setting on 127.0.0.1 (CPU unless --device says otherwise),
warms the model, then every client sends requests back to back, each a different test_poi of
one patched shared workspace. Prints a markdown table (stdout) for BENCHMARKS.md.

    .venv/bin/python benchmarks/bench_service.py                  # a few minutes on 2 cores
    .venv/bin/python benchmarks/bench_service.py --requests 256 --device cuda
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from service_support import SMALL, ServerProcess, load, metric_value

CONCURRENCY = (1, 8, 64)


def percentile(values: list[float], q: float) -> float:
    """The ``q``-quantile (0..1) of ``values``, nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


async def run_clients(
    url: str, body: dict[str, Any], clients: int, requests: int
) -> tuple[float, list[float]]:
    """``requests`` POST /cls spread over ``clients`` concurrent clients: (seconds, latencies)."""
    latencies: list[float] = []
    counter = iter(range(requests))
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:

        async def one_client() -> None:
            for i in counter:
                start = time.perf_counter()
                response = await client.post("/cls", json={**body, "test_poi": 0.5 + 0.01 * i})
                response.raise_for_status()
                latencies.append(time.perf_counter() - start)

        start = time.perf_counter()
        await asyncio.gather(*(one_client() for _ in range(clients)))
        return time.perf_counter() - start, latencies


def bench_setting(
    batch_size: int, args: argparse.Namespace, data_dir: Path
) -> list[dict[str, Any]]:
    """Every concurrency level against one server with ``--max-batch-size batch_size``."""
    server_args = [
        *("--device", args.device),
        *("--max-batch-size", str(batch_size)),
        *("--max-batch-delay-ms", str(args.delay_ms)),
    ]
    server = ServerProcess(data_dir, server_args).start()
    rows = []
    try:
        with server.client() as client:
            workspace_id = client.post("/workspaces", json=load(args.workspace, "BkgOnly.json"))
            patchset = load(args.workspace, "patchset.json")
            patch = next(p for p in patchset["patches"] if p["metadata"]["name"] == args.patch)
            body = {"workspace_id": workspace_id.json()["workspace_id"], "patches": [patch]}
            for _ in range(3):  # build and warm the model
                client.post("/cls", json=body).raise_for_status()
            for clients in CONCURRENCY:
                requests = max(clients, args.requests)
                before = metric_value(client.get("/metrics").text, "pyhf_gpu_batch_size_count")
                seconds, latencies = asyncio.run(run_clients(server.url, body, clients, requests))
                after = metric_value(client.get("/metrics").text, "pyhf_gpu_batch_size_count")
                rows.append(
                    {
                        "batching": "on" if batch_size > 1 else "off",
                        "clients": clients,
                        "requests": requests,
                        "throughput": requests / seconds,
                        "p50_ms": 1000 * statistics.median(latencies),
                        "p99_ms": 1000 * percentile(latencies, 0.99),
                        "engine_calls": int(after - before),
                    }
                )
                print(f"  {rows[-1]}", file=sys.stderr)
    finally:
        server.stop()
    return rows


def markdown(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    """The results as a markdown table."""
    lines = [
        f"POST /cls on `{args.workspace}` + `{args.patch}` (qtilde, asymptotics), device "
        f"{args.device}, one distinct test_poi per request; batching on = --max-batch-size "
        f"{args.batch_size} --max-batch-delay-ms {args.delay_ms:g}, off = --max-batch-size 1.",
        "",
        "| batching | clients | requests | throughput (req/s) | p50 (ms) | p99 (ms) | engine calls |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['batching']} | {r['clients']} | {r['requests']} | {r['throughput']:.2f} | "
            f"{r['p50_ms']:.1f} | {r['p99_ms']:.1f} | {r['engine_calls']} |"
        )
    return "\n".join(lines)


def main() -> None:
    """Run both settings and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32, help="requests per level (>= clients)")
    parser.add_argument("--workspace", default=SMALL, help="folder under tests/data/workspaces")
    parser.add_argument("--patch", default="sig_s1_x1")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--delay-ms", type=float, default=5.0)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-service-") as tmp:
        for batch_size in (args.batch_size, 1):
            print(f"max_batch_size={batch_size}", file=sys.stderr)
            rows += bench_setting(batch_size, args, Path(tmp))
    print(markdown(rows, args))


if __name__ == "__main__":
    main()
