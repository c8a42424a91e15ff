"""A CPU server on a node it shares: the client's ``cls`` of a large analysis, idle and while a
``pyhf cls`` of the same workspace runs beside it, for this checkout's server and, side by
side in the same run, another checkout's (``--baseline DIR``: a folder holding a
``pyhf_gpu_server`` package, e.g. a link to an older worktree's ``server/``).

The workspace: :func:`generate_large.workspace` with its per-bin ``staterror`` replaced by
``shapesys`` on two backgrounds of every channel (Poisson-constrained, two per-bin parameters
a bin) and a ``shapefactor`` (free per-bin parameters) on a third background in every other
channel, as data-driven backgrounds and precision analyses have them.

    .venv/bin/python benchmarks/bench_shared_node.py [--channels 20 --bins 40] \\
        [--baseline /tmp/base] [--rounds 2]

Prints one markdown table (seconds of each command, start to exit).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from generate_large import workspace as large_workspace
from service_support import free_port

BIN = Path(sys.executable).parent


def analysis(channels: int, bins: int, seed: int = 3) -> dict:
    """The generated analysis with shapesys and shapefactor modifiers (see the module)."""
    spec = large_workspace(
        channels=channels, bins=bins, systematics=40, per_sample=8, backgrounds=4, seed=seed
    )
    rng = np.random.default_rng(seed + 2)
    for c, channel in enumerate(spec["channels"]):
        for k, sample in enumerate(channel["samples"]):
            sample["modifiers"] = [m for m in sample["modifiers"] if m["type"] != "staterror"]
            if k < 2 and sample["name"] != "signal":
                rates = np.asarray(sample["data"], float)
                sigma = rates * rng.uniform(0.03, 0.3, size=rates.shape)
                name = f"shapesys_{channel['name']}_{k}"
                sample["modifiers"].append({"name": name, "type": "shapesys", "data": list(sigma)})
        if c % 2 == 0 and len(channel["samples"]) > 3:
            factor = {"name": f"sf_{channel['name']}", "type": "shapefactor", "data": None}
            channel["samples"][2]["modifiers"].append(factor)
    return spec


@contextlib.contextmanager
def server(package: str | None, data_dir: Path) -> Iterator[str]:
    """A CPU server of ``package``'s code (``None``: this checkout's) on a free port."""
    port = free_port()
    env = {**os.environ}
    if package:
        env["PYTHONPATH"] = package
    command = [sys.executable, "-m", "pyhf_gpu_server.cli", "--port", str(port)]
    command += ["--data-dir", str(data_dir), "--device", "cpu"]
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            ok = subprocess.run(
                [BIN / "pyhf-gpu-client", "--server", url, "health"], capture_output=True
            )
            if ok.returncode == 0:
                break
            time.sleep(0.1)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=60)


def command_seconds(url: str, path: Path) -> float:
    """One ``pyhf-gpu-client cls`` of ``path``, start to exit (no job: ``--job-after 600``)."""
    start = time.perf_counter()
    client = [BIN / "pyhf-gpu-client", "--server", url, "--job-after", "600", "cls", str(path)]
    subprocess.run(client, check=True, capture_output=True, timeout=600)
    return time.perf_counter() - start


def analysis_arguments(description: str, channels: int) -> argparse.ArgumentParser:
    """The options of a benchmark on :func:`analysis` comparing servers: its size and the
    baseline's folder."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--channels", type=int, default=channels)
    parser.add_argument("--bins", type=int, default=40)
    parser.add_argument("--baseline", help="a folder holding another pyhf_gpu_server package")
    return parser


def servers(args: argparse.Namespace) -> dict[str, str | None]:
    """The servers to compare: this checkout's (None) and the ``--baseline``'s, by label."""
    return {"this checkout": None, **({"baseline": args.baseline} if args.baseline else {})}


def main() -> None:
    parser = analysis_arguments(__doc__.splitlines()[0], channels=20)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    codes = servers(args)
    rows: dict[str, dict[str, list[float]]] = {c: {"idle": [], "beside pyhf": []} for c in codes}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "analysis.json"
        spec = analysis(args.channels, args.bins)
        path.write_text(json.dumps(spec))
        for r in range(args.rounds):
            for name, package in codes.items():
                with server(package, Path(tmp) / f"data-{r}-{len(rows[name]['idle'])}") as url:
                    rows[name]["idle"] += [command_seconds(url, path) for _ in range(2)]
                    pyhf = subprocess.Popen(
                        [BIN / "pyhf", "cls", str(path)],
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                    )
                    try:
                        time.sleep(5)
                        rows[name]["beside pyhf"] += [command_seconds(url, path) for _ in range(2)]
                    finally:
                        pyhf.kill()
                        pyhf.wait()
    print(
        f"`pyhf-gpu-client cls` of a {args.channels} x {args.bins}-bin analysis (shapesys, "
        f"shapefactor), {os.cpu_count()} cores, {args.rounds} round(s): seconds, min-max\n"
    )
    print("| code | idle | beside one `pyhf cls` |\n|---|---|---|")
    for name, times in rows.items():
        cells = [f"{min(v):.2f}-{max(v):.2f}" for v in times.values()]
        print(f"| {name} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
