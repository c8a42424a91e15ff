"""Load test: latency of small requests while large ones run, and the server's resident memory.

Starts a real ``pyhf-gpu-server`` subprocess on 127.0.0.1 (CPU unless ``--device`` says
otherwise; its own temporary data dir), uploads three published ATLAS backgrounds
(``tests/data/workspaces``) once, then drives it for ``--duration`` seconds with ``--clients``
concurrent loopback clients (httpx async), each sending its kind of request back to back:

* ``cls`` (most clients): ``POST /cls`` of one hypothesis, a random signal point of
  sbottom-B (60 parameters) by ``workspace_id`` + ``patches``, a random ``test_poi``;
* ``scan``: ``POST /cls`` of ``--scan-points`` ``test_poi`` values (0.1..3) on stau
  (119 parameters) + a random signal point;
* ``patchset``: ``POST /cls`` of a patchset of ``--patchset-size`` random PUBLISHED signal
  points (HEPData) on the sbottom-A background (each answered separately);
* ``job``: ``POST /jobs`` of a toy-based CLs (``--ntoys``) on sbottom-B, polled
  (``GET /jobs/{id}``, rows ``job-submit``, ``job-poll``) until finished, then submitted again;
  the ``job`` row times submission to completion (a job still queued or running at the
  deadline shows as ``unfinished at the end (queued|running)``).

Every HTTP call has a timeout (``--timeout``, above the server's 300 s request timeout, so a
slow answer shows as the server's 504 rather than a client timeout). A 429 or 503 with
``Retry-After`` is counted and honoured with a short sleep (at most ``MAX_BACKOFF_S``). After
the deadline no new request starts; those in flight finish (within their timeout). The
server's resident memory (``VmRSS``) is sampled every second from ``/proc``.

Prints (stdout) a markdown table per kind: requests, status codes, 5xx, 429, p50/p99 latency
(of 2xx answers), the memory after warm-up (``--warmup`` of the duration) against the end and
the maximum, the mean ``pyhf_gpu_batch_size`` over the run (from ``/metrics``) and the command
line. Exits 1 when any 5xx, transport error or failed job was seen, and then keeps the server's
log (its path and warning/error lines go to stderr). The server is started with
``tests/service_support.ServerProcess`` (``python -m pyhf_gpu_server.cli``, as the other
benchmarks do); ``--server-arg`` passes it more options. Run it on a quiet machine:

    .venv/bin/python benchmarks/bench_load.py                       # 300 s, 64 clients
    .venv/bin/python benchmarks/bench_load.py --duration 40 --clients 16   # a quick check
    .venv/bin/python benchmarks/bench_load.py --device cuda --server-arg=--max-batch-size=256
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shlex
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from bench_patchsets import WORKSPACES, read
from bench_service import percentile
from service_support import SMALL, ServerProcess, metric_value

SCAN = "atlas-susy-2018-04-stau"
PUBLISHED = "atlas-susy-2018-31-sbottom-A"
KINDS = ("cls", "scan", "patchset", "job-submit", "job-poll", "job")
MAX_BACKOFF_S = 1.0
FINISHED = ("succeeded", "failed", "cancelled")
UNFINISHED = "unfinished at the end"


@dataclass
class Stats:
    """One kind's answers: status (or error name) counts and the latencies of 2xx answers."""

    statuses: Counter[int | str] = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)

    def record(self, status: int | str, seconds: float) -> None:
        self.statuses[status] += 1
        if isinstance(status, int) and 200 <= status < 300:
            self.latencies.append(seconds)

    def server_errors(self) -> int:
        return sum(n for s, n in self.statuses.items() if isinstance(s, int) and s >= 500)

    def failures(self) -> int:
        """5xx answers, transport errors and failed jobs (not: < 500, jobs cut by the deadline)."""
        return sum(
            n
            for s, n in self.statuses.items()
            if (s >= 500 if isinstance(s, int) else not s.startswith(UNFINISHED))
        )


def patches(name: str, file: str) -> list[dict[str, Any]]:
    """The patches of a shared patchset."""
    return read(WORKSPACES / name / file)["patches"]


def job_status(view: dict[str, Any]) -> int | str:
    """200 for a job that succeeded, its error status if 5xx, else e.g. ``"failed 422"``."""
    if view["status"] == "succeeded":
        return 200
    status = (view.get("error") or {}).get("status")
    return status if isinstance(status, int) and status >= 500 else f"{view['status']} {status}"


class Load:
    """The request bodies, the per-kind statistics and the client loops of one run."""

    def __init__(self, args: argparse.Namespace, ids: dict[str, str]) -> None:
        self.args = args
        self.ids = ids
        self.stats = {kind: Stats() for kind in KINDS}
        self.small_patches = [p["patch"] for p in patches(SMALL, "patchset.json")]
        self.scan_patches = [p["patch"] for p in patches(SCAN, "patchset.json")]
        self.published = read(WORKSPACES / PUBLISHED / "patchset.hepdata.json.gz")
        # as bench_patchsets: all but the one point that adds no signal (its own error entry)
        self.published_points = [p for p in self.published["patches"] if len(p["patch"]) > 1]
        step = 2.9 / max(1, args.scan_points - 1)
        self.scan_pois = [round(0.1 + step * i, 6) for i in range(args.scan_points)]

    def cls_body(self, rng: random.Random) -> dict[str, Any]:
        return {
            "workspace_id": self.ids[SMALL],
            "patches": [rng.choice(self.small_patches)],
            "test_poi": round(rng.uniform(0.5, 1.5), 6),
        }

    def scan_body(self, rng: random.Random) -> dict[str, Any]:
        return {
            "workspace_id": self.ids[SCAN],
            "patches": [rng.choice(self.scan_patches)],
            "test_poi": self.scan_pois,
        }

    def patchset_body(self, rng: random.Random) -> dict[str, Any]:
        points = rng.sample(self.published_points, self.args.patchset_size)
        return {
            "workspace_id": self.ids[PUBLISHED],
            "patchset": {**self.published, "patches": points},
        }

    def job_body(self, rng: random.Random) -> dict[str, Any]:
        return {
            "operation": "cls",
            **self.cls_body(rng),
            "test_poi": 1.0,
            "calctype": "toybased",
            "ntoys": self.args.ntoys,
            "seed": rng.randrange(2**32),
        }

    async def request(
        self, client: httpx.AsyncClient, kind: str, method: str, url: str, body: Any = None
    ) -> httpx.Response | None:
        """One timed call, recorded under ``kind``; None on a transport error or timeout."""
        start = time.perf_counter()
        try:
            response = await client.request(method, url, json=body)
        except httpx.TransportError as exc:
            self.stats[kind].record(type(exc).__name__, time.perf_counter() - start)
            await asyncio.sleep(MAX_BACKOFF_S)  # do not spin on a dead server
            return None
        self.stats[kind].record(response.status_code, time.perf_counter() - start)
        retry_after = response.headers.get("Retry-After")
        if response.status_code in (429, 503) and retry_after is not None:
            try:
                await asyncio.sleep(min(MAX_BACKOFF_S, max(0.0, float(retry_after))))
            except ValueError:  # an HTTP date: just back off
                await asyncio.sleep(MAX_BACKOFF_S)
        return response

    async def sync_client(
        self,
        client: httpx.AsyncClient,
        kind: str,
        body: Callable[[random.Random], dict[str, Any]],
        rng: random.Random,
        deadline: float,
    ) -> None:
        """``POST /cls`` back to back until the deadline."""
        while time.monotonic() < deadline:
            await self.request(client, kind, "POST", "/cls", body(rng))

    async def job_client(
        self, client: httpx.AsyncClient, rng: random.Random, deadline: float
    ) -> None:
        """Submit a toy job, poll it until it finishes, submit the next, until the deadline."""
        while time.monotonic() < deadline:
            start = time.perf_counter()
            response = await self.request(client, "job-submit", "POST", "/jobs", self.job_body(rng))
            if response is None or response.status_code != 202:
                continue
            job_id, status, view = response.json()["id"], "queued", {}
            while status not in FINISHED:
                if time.monotonic() >= deadline:  # still queued or running: say so
                    self.stats["job"].record(f"{UNFINISHED} ({status})", 0.0)
                    return
                await asyncio.sleep(self.args.poll)
                polled = await self.request(client, "job-poll", "GET", f"/jobs/{job_id}")
                if polled is not None and polled.status_code == 200:
                    view = polled.json()
                    status = view["status"]
            self.stats["job"].record(job_status(view), time.perf_counter() - start)

    async def run(self, url: str, deadline: float, counts: dict[str, int]) -> None:
        """All clients at once until ``deadline`` (each call within ``--timeout``)."""
        total = sum(counts.values())
        limits = httpx.Limits(max_connections=total, max_keepalive_connections=total)
        timeout = httpx.Timeout(self.args.timeout, connect=10.0)
        bodies = {"cls": self.cls_body, "scan": self.scan_body, "patchset": self.patchset_body}
        async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:
            tasks = []
            for kind, count in counts.items():
                for _ in range(count):
                    rng = random.Random(self.args.seed + len(tasks))
                    if kind == "job":
                        tasks.append(self.job_client(client, rng, deadline))
                    else:
                        tasks.append(self.sync_client(client, kind, bodies[kind], rng, deadline))
            await asyncio.gather(*tasks)


class RssSampler(threading.Thread):
    """The server's VmRSS (MiB) every ``period`` seconds, as (seconds since start, MiB)."""

    def __init__(self, pid: int, period: float = 1.0) -> None:
        super().__init__(daemon=True)
        self.path = Path(f"/proc/{pid}/status")
        self.period = period
        self.samples: list[tuple[float, float]] = []
        self.stopped = threading.Event()
        self.start_time = time.monotonic()

    def run(self) -> None:
        while not self.stopped.is_set():
            try:
                lines = self.path.read_text().splitlines()
            except OSError:  # the process is gone
                return
            kib = next(int(line.split()[1]) for line in lines if line.startswith("VmRSS:"))
            self.samples.append((time.monotonic() - self.start_time, kib / 1024))
            self.stopped.wait(self.period)

    def summary(self, warmup_s: float) -> str:
        """RSS after warm-up against the end and the maximum."""
        if not self.samples:
            return "Server RSS: no samples"
        warm_t, warm = min(self.samples, key=lambda s: abs(s[0] - warmup_s))
        end_t, end = self.samples[-1]
        peak_t, peak = max(self.samples, key=lambda s: s[1])
        after = [mib for t, mib in self.samples if t >= warm_t]
        return (
            f"Server RSS (VmRSS, {len(self.samples)} samples, 1 s apart): {warm:.1f} MiB after "
            f"warm-up (t={warm_t:.0f} s), {end:.1f} MiB at the end (t={end_t:.0f} s), "
            f"{end - warm:+.1f} MiB after warm-up; max {peak:.1f} MiB (t={peak_t:.0f} s), "
            f"min after warm-up {min(after):.1f} MiB; at start {self.samples[0][1]:.1f} MiB."
        )


def client_counts(args: argparse.Namespace) -> dict[str, int]:
    """How many clients of each kind (the rest of ``--clients`` send small ``cls``)."""
    counts = {
        "scan": args.scan_clients if args.scan_clients is not None else max(1, args.clients // 8),
        "patchset": (
            args.patchset_clients
            if args.patchset_clients is not None
            else max(1, args.clients // 16)
        ),
        "job": args.job_clients if args.job_clients is not None else 1 + (args.clients >= 32),
    }
    counts = {"cls": args.clients - sum(counts.values()), **counts}
    if counts["cls"] < 1:
        raise SystemExit(f"--clients {args.clients} leaves no cls client: {counts}")
    return counts


def wait_ready(client: httpx.Client, timeout_s: float = 60.0) -> None:
    """Until ``/readyz`` answers 200."""
    deadline = time.monotonic() + timeout_s
    while (response := client.get("/readyz")).status_code != 200:
        if time.monotonic() > deadline:
            raise RuntimeError(f"/readyz still {response.status_code}: {response.text}")
        time.sleep(0.2)


def batch_metrics(text: str) -> tuple[float, float]:
    """(engine calls, hypotheses) so far, from ``pyhf_gpu_batch_size``."""
    return (
        metric_value(text, "pyhf_gpu_batch_size_count"),
        metric_value(text, "pyhf_gpu_batch_size_sum"),
    )


def markdown(load: Load, counts: dict[str, int], seconds: float) -> str:
    """The table, per kind."""
    args = load.args
    lines = [
        f"Loopback load, device {args.device}, {args.clients} clients for {seconds:.0f} s "
        f"(cls {counts['cls']}, scan {counts['scan']} x {args.scan_points} POIs, patchset "
        f"{counts['patchset']} x {args.patchset_size} published points, toy jobs "
        f"{counts['job']} x {args.ntoys} toys); latencies of 2xx answers.",
        "",
        "| kind | requests | req/s | statuses | 5xx | 429 | p50 (ms) | p99 (ms) |",
        "|---|---:|---:|---|---:|---:|---:|---:|",
    ]
    for kind, stats in load.stats.items():
        total = sum(stats.statuses.values())
        if not total:
            continue
        codes = ", ".join(f"{s}: {n}" for s, n in sorted(stats.statuses.items(), key=str))
        lat = stats.latencies
        p50 = f"{1000 * statistics.median(lat):.0f}" if lat else "-"
        p99 = f"{1000 * percentile(lat, 0.99):.0f}" if lat else "-"
        lines.append(
            f"| {kind} | {total} | {total / seconds:.2f} | {codes} | {stats.server_errors()} | "
            f"{stats.statuses[429]} | {p50} | {p99} |"
        )
    return "\n".join(lines)


def warm_and_load(
    server: ServerProcess, args: argparse.Namespace, counts: dict[str, int]
) -> tuple[Load, float, RssSampler, tuple[float, float]]:
    """Upload, build the models, load: (the load, its seconds, the RSS, engine calls, rows)."""
    with server.client(timeout_s=args.timeout) as client:
        wait_ready(client)
        ids = {}
        for name in (SMALL, SCAN, PUBLISHED):
            response = client.post("/workspaces", json=read(WORKSPACES / name / "BkgOnly.json"))
            response.raise_for_status()
            ids[name] = response.json()["workspace_id"]
        load = Load(args, ids)
        rng = random.Random(args.seed)
        for body in (load.cls_body(rng), load.scan_body(rng), load.patchset_body(rng)):
            client.post("/cls", json=body).raise_for_status()  # build the models
        before = batch_metrics(client.get("/metrics").text)
        print(f"warm; load with {counts} for {args.duration:g} s", file=sys.stderr)

        sampler = RssSampler(server.process.pid)
        sampler.start()
        start = time.monotonic()
        try:
            asyncio.run(load.run(server.url, start + args.duration, counts))
        finally:
            sampler.stopped.set()
            sampler.join()
        seconds = time.monotonic() - start
        after = batch_metrics(client.get("/metrics").text)
    return load, seconds, sampler, (after[0] - before[0], after[1] - before[1])


def main() -> int:
    """Start the server, upload, warm, load, report; 1 when anything failed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=300.0, help="seconds of load")
    parser.add_argument("--clients", type=int, default=64, help="concurrent clients in all")
    parser.add_argument("--scan-clients", type=int, help="default: clients // 8 (>= 1)")
    parser.add_argument("--patchset-clients", type=int, help="default: clients // 16 (>= 1)")
    parser.add_argument("--job-clients", type=int, help="default: 2 from 32 clients, else 1")
    parser.add_argument("--scan-points", type=int, default=20, help="test_poi values per scan")
    parser.add_argument("--patchset-size", type=int, default=8, help="points per patchset")
    parser.add_argument("--ntoys", type=int, default=200, help="toys per job")
    parser.add_argument("--poll", type=float, default=0.5, help="seconds between job polls")
    parser.add_argument("--timeout", type=float, default=330.0, help="seconds per HTTP call")
    parser.add_argument("--warmup", type=float, default=0.2, help="fraction of the duration")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--server-arg", action="append", default=[], help="extra server option (repeatable)"
    )
    args = parser.parse_args()
    counts = client_counts(args)

    data_dir = Path(tempfile.mkdtemp(prefix="bench-load-"))
    server = ServerProcess(data_dir, ["--device", args.device, *args.server_arg])
    failures = 1  # until the load has run
    try:
        server.start()
        load, seconds, sampler, (calls, rows) = warm_and_load(server, args, counts)
        failures = sum(stats.failures() for stats in load.stats.values())
    finally:
        if server.process is not None:
            server.stop()
        if failures:
            problems = [line for line in server.log().splitlines() if '"level": "info"' not in line]
            print(*problems[-20:], f"server log kept: {server.log_path}", sep="\n", file=sys.stderr)
        else:
            shutil.rmtree(data_dir)

    print(markdown(load, counts, seconds))
    print()
    print(sampler.summary(args.warmup * args.duration))
    print(
        f"Engine calls during the load: {calls:.0f}, mean pyhf_gpu_batch_size "
        f"{rows / calls if calls else float('nan'):.2f} hypotheses per call."
    )
    print(f"Command: `{shlex.join([Path(sys.executable).name, *sys.argv])}`")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
