"""Helpers for tests that talk HTTP to a real ``pyhf-gpu-server`` subprocess."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pyhf
from workspaces import WORKSPACES_DIR as WORKSPACES
from workspaces import read_json, workspace_file

__all__ = ["WORKSPACES", "workspace_file"]  # imported by test modules and benchmarks
SMALL = "atlas-susy-2018-31-sbottom-B"  # 60 parameters, 3 bins: the fast real workspace


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def load(name: str, file: str) -> dict[str, Any]:
    """A workspace file (``BkgOnly.json``, ``patchset.json``, ``reference.json``) of analysis
    ``name``, gzip-compressed on disk or not."""
    return read_json(WORKSPACES / name / file)


def simple_workspace(signal_counts: Sequence[float] = (5.0, 10.0)) -> dict[str, Any]:
    """A small valid workspace (pyhf.simplemodels.uncorrelated_background + data)."""
    bins = len(signal_counts)
    return {
        "channels": [
            {
                "name": "singlechannel",
                "samples": [
                    {
                        "name": "signal",
                        "data": list(signal_counts),
                        "modifiers": [{"name": "mu", "type": "normfactor", "data": None}],
                    },
                    {
                        "name": "background",
                        "data": [50.0 + i for i in range(bins)],
                        "modifiers": [
                            {
                                "name": "uncorr_bkguncrt",
                                "type": "shapesys",
                                "data": [5.0 + i for i in range(bins)],
                            }
                        ],
                    },
                ],
            }
        ],
        "observations": [{"name": "singlechannel", "data": [52.0 + i for i in range(bins)]}],
        "measurements": [{"name": "meas", "config": {"poi": "mu", "parameters": []}}],
        "version": "1.0.0",
    }


class ServerProcess:
    """A server subprocess on 127.0.0.1 with its own data dir; use :func:`running_server`."""

    def __init__(self, data_dir: Path, args: Sequence[str] = (), env: dict[str, str] | None = None):
        """Remember how to start it (call :meth:`start`)."""
        self.data_dir = data_dir
        self.args = list(args)
        self.env = {**os.environ, **(env or {})}
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = data_dir / f"server-{self.port}.log"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 60.0) -> ServerProcess:
        """Start and wait until /healthz answers."""
        command = [
            sys.executable,
            "-m",
            "pyhf_gpu_server.cli",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--data-dir",
            str(self.data_dir),
            "--device",
            "cpu",
            *self.args,
        ]
        log = self.log_path.open("ab")
        self.process = subprocess.Popen(command, stdout=log, stderr=log, env=self.env)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/healthz", timeout=1.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"server did not start in {timeout_s} s:\n{self.log()}")

    def log(self) -> str:
        """Everything the server wrote (JSON lines)."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def kill(self) -> None:
        """``kill -9``: no chance to clean up."""
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=30)

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM and wait (graceful shutdown); the exit code."""
        assert self.process is not None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def memory_mb(self, key: str = "VmRSS") -> float:
        """The process's resident memory (``VmRSS``) or its peak (``VmHWM``) in MiB."""
        assert self.process is not None
        status = Path(f"/proc/{self.process.pid}/status").read_text()
        line = next(line for line in status.splitlines() if line.startswith(f"{key}:"))
        return int(line.split()[1]) / 1024

    def client(self, token: str | None = None, timeout_s: float = 120.0) -> httpx.Client:
        """An httpx client for this server."""
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=timeout_s)


@contextmanager
def running_server(
    data_dir: Path, args: Sequence[str] = (), env: dict[str, str] | None = None
) -> Iterator[ServerProcess]:
    """A started server, stopped (SIGTERM) afterwards."""
    server = ServerProcess(data_dir, args, env).start()
    try:
        yield server
    finally:
        server.stop()


def metric_value(metrics_text: str, name: str, labels: str = "") -> float:
    """A sample's value from Prometheus text (``name{labels} value``); 0 if absent."""
    wanted = f"{name}{{{labels}}}" if labels else name
    for line in metrics_text.splitlines():
        if line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        if key == wanted:
            return float(value)
    return 0.0


def wait_for_job(client: httpx.Client, job_id: str, timeout_s: float = 120.0) -> dict[str, Any]:
    """Poll until the job is finished; its final view."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        view = client.get(f"/jobs/{job_id}").json()
        if view["status"] in ("succeeded", "failed", "cancelled"):
            return view
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} did not finish in {timeout_s} s: {view}")


# one torch thread everywhere: the same arithmetic in process and on the workers, and two
# single-threaded workers on a 2-core machine
CLUSTER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


class Cluster:
    """A Dask scheduler and ``pyhf-gpu-worker`` subprocesses on 127.0.0.1."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.port = free_port()
        self.address = f"tcp://127.0.0.1:{self.port}"
        self.processes: dict[str, subprocess.Popen[bytes]] = {}

    def _spawn(self, name: str, command: list[str]) -> subprocess.Popen[bytes]:
        log = (self.directory / f"{name}.log").open("ab")
        process = subprocess.Popen(
            command,
            stdout=log,
            stderr=log,
            env={**os.environ, **CLUSTER_ENV},
            start_new_session=True,  # its own process group: killed as one
        )
        self.processes[name] = process
        return process

    def start_scheduler(self) -> None:
        self._spawn(
            "scheduler",
            [
                sys.executable,
                "-m",
                "distributed.cli.dask_scheduler",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--no-dashboard",
            ],
        )

    def start_worker(self, name: str) -> None:
        self._spawn(
            name,
            [
                sys.executable,
                "-m",
                "pyhf_gpu_server.cluster.worker",
                self.address,
                "--device",
                "cpu",
                "--name",
                name,
                "--no-nanny",
                "--torch-threads",
                "1",
            ],
        )

    def kill(self, name: str) -> None:
        """``kill -9`` of a process (its whole group): a node that dies."""
        process = self.processes[name]
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)

    def log(self, name: str) -> str:
        return (self.directory / f"{name}.log").read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in self.processes.values():
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()

    def wait_joined(self, client: httpx.Client, names: Sequence[str]) -> None:
        """Until the server behind ``client`` is ready with the workers ``names`` (bounded)."""
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            ready = client.get("/readyz")
            found = client.get("/info").json()["cluster"]["workers"]
            if ready.status_code == 200 and len(found) == len(names):
                return
            for name in names:
                if self.processes[name].poll() is not None:
                    raise AssertionError(f"worker {name} exited:\n{self.log(name)}")
            time.sleep(0.5)
        logs = "\n".join(self.log(name) for name in names)
        raise AssertionError(f"workers did not join:\n{logs}")


@contextmanager
def running_cluster_server(
    directory: Path, args: Sequence[str] = (), workers: int = 2
) -> Iterator[ServerProcess]:
    """A Dask scheduler, ``workers`` single-threaded ``pyhf-gpu-worker`` processes and a
    server in cluster mode (``--dask-scheduler``), ready (its workers joined)."""
    cluster = Cluster(directory)
    cluster.start_scheduler()
    try:
        cluster_args = [*args, "--dask-scheduler", cluster.address]
        with running_server(directory, cluster_args, CLUSTER_ENV) as server:
            names = [f"w{i + 1}" for i in range(workers)]
            for name in names:
                cluster.start_worker(name)
            with server.client() as client:
                cluster.wait_joined(client, names)
            yield server
    finally:
        cluster.stop()


def own_histosys_channels_workspace(channels: int) -> dict:
    """``channels`` one-bin channels, each with its own sample carrying its own histosys (and
    the POI): a ~60 kB body for 300 channels whose layout, each sample over every histosys
    parameter and bin of the model, grows with the cube of the channels (#37)."""
    return {
        "channels": [
            {
                "name": f"c{c}",
                "samples": [
                    {
                        "name": f"s{c}",
                        "data": [5.0],
                        "modifiers": [
                            {"name": "mu", "type": "normfactor", "data": None},
                            {
                                "name": f"h{c}",
                                "type": "histosys",
                                "data": {"hi_data": [6.0], "lo_data": [4.0]},
                            },
                        ],
                    }
                ],
            }
            for c in range(channels)
        ],
        "observations": [{"name": f"c{c}", "data": [5.0]} for c in range(channels)],
        "measurements": [{"name": "m", "config": {"poi": "mu", "parameters": []}}],
        "version": "1.0.0",
    }


def patchset_of(
    background: dict, patches: Sequence[tuple[str, list]], description: str = "test patches"
) -> dict:
    """A patchset on ``background`` of the ``(name, JSON Patch operations)`` pairs, the
    k-th with the value ``k``."""
    return {
        "metadata": {
            "description": description,
            "digests": {"sha256": pyhf.utils.digest(background)},
            "labels": ["k"],
            "references": {"hepdata": "ins1234567"},
        },
        "patches": [
            {"metadata": {"name": name, "values": [k]}, "patch": operations}
            for k, (name, operations) in enumerate(patches)
        ],
        "version": "1.0.0",
    }


def unique_normfactor_patchset(background: dict, patches: int) -> dict:
    """A patchset on ``background`` (``simple_workspace``) whose every patch adds a uniquely
    named normfactor to the background sample: stacked whole, a model with the union of them
    all."""
    path = "/channels/0/samples/1/modifiers/-"
    extra = ({"name": f"extra_{k}", "type": "normfactor", "data": None} for k in range(patches))
    added = [(f"p{k}", [{"op": "add", "path": path, "value": v}]) for k, v in enumerate(extra)]
    return patchset_of(background, added, "unique modifiers")
