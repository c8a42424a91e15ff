"""Helpers for tests that talk HTTP to a real ``pyhf-gpu-server`` subprocess."""

from __future__ import annotations

import json
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

WORKSPACES = Path("/work/shared/workspaces")
SMALL = "atlas-susy-2018-31-sbottom-B"  # 60 parameters, 3 bins: the fast real workspace


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def load(name: str, file: str) -> dict[str, Any]:
    """A shared workspace file (``BkgOnly.json``, ``patchset.json``, ``reference.json``)."""
    return json.loads((WORKSPACES / name / file).read_text())


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
