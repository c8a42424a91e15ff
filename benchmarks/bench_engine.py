"""logpdf throughput of the engine against pyhf's numpy backend, side by side in one run.

For every shared workspace (patched with one signal hypothesis): a batch of 4096 parameter
points near the suggested init, evaluated by pyhf numpy (built with ``batch_size=4096``), by
the engine eagerly and by the engine through ``torch.compile``; float64, plus float32 with
its deviation. Prints a markdown table (points per second and the ratio to pyhf).

    python benchmarks/bench_engine.py [--device cpu|cuda] [--batch 4096] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyhf
import torch

from pyhf_gpu_server.engine import HistFactoryModel, KernelCache

WORKSPACES = Path(__file__).resolve().parents[2] / "shared" / "workspaces"
PATCH = "sig_s1_x1"


def best_seconds(run: Callable[[], object], repeats: int, synchronize: Callable[[], None]) -> float:
    """The fastest of ``repeats`` timed calls, after one warm-up call."""
    run()
    synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        synchronize()
        times.append(time.perf_counter() - start)
    return min(times)


def bench_workspace(folder: Path, batch: int, repeats: int, device: str) -> dict:
    workspace = pyhf.Workspace(json.loads((folder / "BkgOnly.json").read_text()))
    patchset = pyhf.PatchSet(json.loads((folder / "patchset.json").read_text()))
    patched = patchset.apply(workspace, PATCH)
    reference = patched.model(batch_size=batch)
    engine = HistFactoryModel.from_workspace(patched, device=device)
    synchronize = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)

    rng = np.random.default_rng(0)
    init = np.asarray(reference.config.suggested_init())
    bounds = np.asarray(reference.config.suggested_bounds())
    points = rng.uniform(
        init + 0.1 * (bounds[:, 0] - init), init + 0.1 * (bounds[:, 1] - init), (batch, len(init))
    )
    data = np.tile(patched.data(reference), (batch, 1))

    pyhf_seconds = best_seconds(lambda: reference.logpdf(points, data), repeats, lambda: None)
    expected = reference.logpdf(points, data)

    pars = torch.tensor(points, device=engine.device)
    batch_data = torch.tensor(data, device=engine.device)
    eager_seconds = best_seconds(lambda: engine.logpdf(pars, batch_data), repeats, synchronize)
    eager_error = np.max(np.abs(engine.logpdf(pars, batch_data).cpu().numpy() / expected - 1))

    kernels = KernelCache()
    compile_start = time.perf_counter()
    kernels.warm(engine, rows=batch)
    compile_seconds = time.perf_counter() - compile_start
    engine.enable_compile(kernels)
    compiled_seconds = best_seconds(lambda: engine.logpdf(pars, batch_data), repeats, synchronize)

    engine32 = engine.to(dtype=torch.float32)
    pars32, data32 = pars.float(), batch_data.float()
    float32_seconds = best_seconds(lambda: engine32.logpdf(pars32, data32), repeats, synchronize)
    float32_error = np.max(
        np.abs(engine32.logpdf(pars32, data32).double().cpu().numpy() / expected - 1)
    )
    return {
        "workspace": folder.name,
        "pars": engine.n_pars,
        "bins": engine.n_main,
        "pyhf": pyhf_seconds,
        "eager": eager_seconds,
        "compiled": compiled_seconds,
        "compile_seconds": compile_seconds,
        "float32": float32_seconds,
        "eager_error": eager_error,
        "float32_error": float32_error,
    }


def _rate_and_ratio(batch: int, reference_seconds: float, seconds: float) -> str:
    return f"{batch / seconds:,.0f} ({reference_seconds / seconds:.1f}x)"


def markdown(rows: list[dict], batch: int, device: str) -> str:
    lines = [
        f"logpdf of {batch} parameter points, device `{device}` ({platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}, pyhf {pyhf.__version__}); "
        "points per second, ratio = pyhf numpy time / engine time.",
        "",
        "| workspace | pars | bins | pyhf numpy | engine eager (ratio) | engine compiled (ratio) | compile s | float32 eager (ratio) | max rel. dev. f64 / f32 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [f"{r['workspace']}", f"{r['pars']}", f"{r['bins']}", f"{batch / r['pyhf']:,.0f}"]
        cells += [_rate_and_ratio(batch, r["pyhf"], r[key]) for key in ("eager", "compiled")]
        cells += [f"{r['compile_seconds']:.0f}", _rate_and_ratio(batch, r["pyhf"], r["float32"])]
        cells += [f"{r['eager_error']:.1e} / {r['float32_error']:.1e}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    folders = sorted(p.parent for p in WORKSPACES.glob("*/reference.json"))
    rows = [bench_workspace(folder, args.batch, args.repeats, args.device) for folder in folders]
    print(markdown(rows, args.batch, args.device))


if __name__ == "__main__":
    main()
