"""Engine throughput: logpdf against pyhf's numpy backend, and the fit path eager vs compiled.

For every shared workspace (patched with one signal hypothesis): a batch of 4096 parameter
points near the suggested init, evaluated by pyhf numpy (built with ``batch_size=4096``), by
the engine eagerly and by the engine through ``torch.compile``; float64, plus float32 with
its deviation. Prints a markdown table (points per second and the ratio to pyhf).

``--fit`` measures the fit path instead, eager against compiled (``torch.compile`` of the
engine's ``expected_main`` and ``expected_main_jacobian``): for every shared workspace, one
model stacking the 24 patches of ``patchset.json``, and ``--rows`` conditional fits (24
patches x POI values). (a) ``inference.fit`` (no uncertainties): minimiser iterations per
second, counted from ``FitResults.iterations``; (b) the engine's per-iteration work alone, as
the objective calls it (``expected_main_jacobian`` + ``deviance`` on the same blocks of rows).
Medians of ``--repeats`` runs after a warm-up, one intra-op thread by default.

    python benchmarks/bench_engine.py [--device cpu|cuda] [--batch 4096] [--repeats 5]
    python benchmarks/bench_engine.py --fit [--rows 512] [--repeats 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyhf
import torch

from pyhf_gpu_server import inference
from pyhf_gpu_server.allocator import tune_cpu_allocator
from pyhf_gpu_server.engine import HistFactoryModel, KernelCache
from pyhf_gpu_server.inference.objective import TwiceNLL

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from workspaces import WORKSPACES_DIR as WORKSPACES
from workspaces import read_json

PATCH = "sig_s1_x1"


def timed_calls(
    run: Callable[[], object], repeats: int, synchronize: Callable[[], None]
) -> list[float]:
    """Seconds of ``repeats`` timed calls, after one warm-up call."""
    run()
    synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        synchronize()
        times.append(time.perf_counter() - start)
    return times


def best_seconds(run: Callable[[], object], repeats: int, synchronize: Callable[[], None]) -> float:
    """The fastest of ``repeats`` timed calls, after one warm-up call."""
    return min(timed_calls(run, repeats, synchronize))


def bench_workspace(folder: Path, batch: int, repeats: int, device: str) -> dict:
    workspace = pyhf.Workspace(read_json(folder / "BkgOnly.json"))
    patchset = pyhf.PatchSet(read_json(folder / "patchset.json"))
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


def median_seconds(
    run: Callable[[], object], repeats: int, synchronize: Callable[[], None]
) -> float:
    """The median of ``repeats`` timed calls, after one warm-up call."""
    return statistics.median(timed_calls(run, repeats, synchronize))


def _load() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def bench_fit_workspace(folder: Path, rows: int, repeats: int, device: str) -> dict:
    """Eager against compiled on the fit path of the 24-patch stack of ``folder``."""
    workspace = read_json(folder / "BkgOnly.json")
    patchset = read_json(folder / "patchset.json")
    eager = HistFactoryModel.from_patchset(workspace, patchset, device=device)
    compiled = HistFactoryModel.from_patchset(workspace, patchset, device=device)
    synchronize = torch.cuda.synchronize if eager.device.type == "cuda" else (lambda: None)
    load_before = _load()

    # rows: every patch at each of rows / E POI values (conditional fits), element-major
    n_poi = max(1, rows // eager.n_elements)
    poi_values = torch.linspace(0.0, 2.0, n_poi, dtype=eager.dtype, device=eager.device)
    element = torch.arange(eager.n_elements, device=eager.device).repeat_interleave(n_poi)
    poi = poi_values.repeat(eager.n_elements)
    fit_kwargs = {"element": element, "fixed_poi": poi, "uncertainties": False}

    def run(model: HistFactoryModel) -> tuple[object, float]:
        fit = inference.fit(model, **fit_kwargs)  # warm-up (compiled: every bucket it meets)
        timed = median_seconds(lambda: inference.fit(model, **fit_kwargs), repeats, synchronize)
        return fit, timed

    results = {"eager": run(eager)}
    kernels = KernelCache()
    compile_start = time.perf_counter()
    kernels.warm(compiled)
    compiled.enable_compile(kernels)
    inference.fit(compiled, **fit_kwargs)
    compile_seconds = time.perf_counter() - compile_start
    results["compiled"] = run(compiled)
    fit_eager, fit_compiled = results["eager"][0], results["compiled"][0]
    same = bool(torch.equal(fit_eager.iterations, fit_compiled.iterations))
    deviation = (fit_compiled.bestfit - fit_eager.bestfit).abs().max().item()

    # (b) the engine work of one derivative call, on the fit's blocks of rows, at the minima
    data = eager.observed.index_select(0, element)
    x = fit_eager.bestfit
    objective = TwiceNLL(eager, data, element, "gauss-newton")
    blocks = objective._blocks(x, torch.arange(x.shape[0], device=x.device))

    def engine_work(model: HistFactoryModel) -> None:
        for xb, rb in blocks:
            eb = element.index_select(0, rb)
            rates, _ = model.expected_main_jacobian(xb, eb)
            model.deviance(xb, data.index_select(0, rb), eb, rates)

    work = {
        label: median_seconds(lambda m=model: engine_work(m), 5 * repeats, synchronize)
        for label, model in (("eager", eager), ("compiled", compiled))
    }
    iterations = int(fit_eager.iterations.sum())
    return {
        "workspace": folder.name,
        "pars": eager.n_pars,
        "bins": eager.n_main,
        "rows": int(element.shape[0]),
        "loops": int(fit_eager.iterations.max()),
        "iterations": iterations,
        "same_iterations": same,
        "max_abs_dev": deviation,
        "fit_eager": results["eager"][1],
        "fit_compiled": results["compiled"][1],
        "work_eager": work["eager"],
        "work_compiled": work["compiled"],
        "compile_seconds": compile_seconds,
        "load": f"{load_before} -> {_load()}",
    }


def fit_markdown(rows: list[dict], device: str) -> str:
    lines = [
        f"Fit path, device `{device}` ({platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} thread(s), torch {torch.__version__}); 24-patch "
        f"patchset.json stack, conditional fits (24 patches x {rows[0]['rows'] // 24} POI values "
        "in [0, 2]), float64, `inference.fit(..., uncertainties=False)`. "
        "Iterations: per-row minimiser iterations summed over rows (equal eager and compiled); "
        "engine work: `expected_main_jacobian` + `deviance` on every row once, in the "
        "objective's blocks, at the minima. Medians after a warm-up; ratio = eager time / "
        "compiled time.",
        "",
        "| workspace | pars | bins | rows | iterations (max per row) | fit eager s | fit compiled s "
        "| iterations/s eager | iterations/s compiled (ratio) | engine work eager ms "
        "| engine work compiled ms (ratio) | compile + warm-up s | load avg (1/5/15 min) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        rate_e, rate_c = r["iterations"] / r["fit_eager"], r["iterations"] / r["fit_compiled"]
        check = "" if r["same_iterations"] else " (differ)"
        cells = [
            r["workspace"],
            f"{r['pars']}",
            f"{r['bins']}",
            f"{r['rows']}",
            f"{r['iterations']:,} ({r['loops']}){check}",
            f"{r['fit_eager']:.3f}",
            f"{r['fit_compiled']:.3f}",
            f"{rate_e:,.0f}",
            f"{rate_c:,.0f} ({r['fit_eager'] / r['fit_compiled']:.2f}x)",
            f"{1e3 * r['work_eager']:.2f}",
            f"{1e3 * r['work_compiled']:.2f} ({r['work_eager'] / r['work_compiled']:.2f}x)",
            f"{r['compile_seconds']:.0f}",
            r["load"],
        ]
        lines.append("| " + " | ".join(cells) + " |")
    deviation = max(r["max_abs_dev"] for r in rows)
    lines += ["", f"Largest |compiled - eager| best-fit parameter: {deviation:.1e}."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--fit", action="store_true", help="eager vs compiled on the fit path")
    parser.add_argument("--rows", type=int, default=512, help="--fit: rows (fits) per call")
    parser.add_argument("--threads", type=int, default=1, help="--fit: torch intra-op threads")
    parser.add_argument("workspaces", nargs="*", help="shared workspace names (default: all)")
    args = parser.parse_args()
    folders = sorted(p.parent for p in WORKSPACES.glob("*/reference.json"))
    if args.workspaces:
        folders = [f for f in folders if f.name in args.workspaces]
    tune_cpu_allocator()  # as pyhf-gpu-server's process: in-process times match it
    if args.fit:
        torch.set_num_threads(args.threads)
        rows = []
        for folder in folders:
            rows.append(bench_fit_workspace(folder, args.rows, args.repeats, args.device))
            print(rows[-1], flush=True)
        print(fit_markdown(rows, args.device))
        return
    rows = [bench_workspace(folder, args.batch, args.repeats, args.device) for folder in folders]
    print(markdown(rows, args.batch, args.device))


if __name__ == "__main__":
    main()
