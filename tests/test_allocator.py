"""The process-level settings the server and the workers apply at start-up: glibc's malloc
thresholds, and one thread for numpy's and scipy's BLAS."""

from __future__ import annotations

import ctypes
import doctest
import platform
import subprocess
import sys

import pytest

from pyhf_gpu_server import allocator


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
    reason="mallopt is glibc's",
)
def test_applies_on_glibc_in_a_fresh_process():
    code = "from pyhf_gpu_server.allocator import tune_cpu_allocator; print(tune_cpu_allocator())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"


def test_declines_without_glibc(monkeypatch):
    monkeypatch.setattr(allocator.sys, "platform", "darwin")
    assert allocator.tune_cpu_allocator() is False
    monkeypatch.setattr(allocator.sys, "platform", "linux")

    def no_libc(*args, **kwargs):
        raise OSError("no libc here")

    monkeypatch.setattr(ctypes, "CDLL", no_libc)
    assert allocator.tune_cpu_allocator() is False


def test_the_server_entry_point_applies_it(monkeypatch, tmp_path):
    """``pyhf-gpu-server`` tunes the allocator before it serves (uvicorn stubbed out)."""
    from pyhf_gpu_server import cli

    calls = []
    monkeypatch.setattr(cli, "tune_cpu_allocator", lambda: calls.append("tuned") or True)
    monkeypatch.setattr(cli, "limit_blas_threads", lambda: calls.append("blas") or {})
    monkeypatch.setattr(cli.uvicorn, "run", lambda *a, **k: calls.append("served"))
    monkeypatch.setattr(cli.gc, "set_threshold", lambda *a: None)
    assert cli.main(["--device", "cpu", "--data-dir", str(tmp_path)]) == 0
    assert calls == ["tuned", "blas", "served"]


def test_blas_gets_one_thread_in_a_fresh_process():
    """numpy's and scipy's OpenBLAS, loaded by the server's imports, each keep one thread."""
    code = (
        "import pyhf_gpu_server.cli\n"
        "from threadpoolctl import threadpool_info\n"
        "from pyhf_gpu_server.blas import limit_blas_threads\n"
        "before = limit_blas_threads()\n"
        "after = {i['filepath']: i['num_threads'] for i in threadpool_info()}\n"
        "print(len(before), sorted(set(after[path] for path in before)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    libraries, threads = out.stdout.split(maxsplit=1)
    assert int(libraries) >= 1 and threads.strip() == "[1]"


def test_docstring_examples():
    failures, attempted = doctest.testmod(allocator, optionflags=doctest.ELLIPSIS)
    assert attempted > 0 and failures == 0
