"""Large analysis likelihoods: how the cost grows with parameters and bins, side by side with
NextStat, and the HVTWZ-class workspace end to end (prints markdown for BENCHMARKS.md).

Workspaces from ``generate_large.py`` (seeded): ``channels x bins`` mass bins with a gamma
per bin, ``systematics`` shared normsys/histosys parameters, 7 backgrounds a region.

1. **Scaling** (in-process, this machine's threads): per size, our free fit (seconds, Newton
   iterations, seconds per iteration) and one asymptotic hypotest, with the solver ``"auto"``
   picks (block) and, where it fits in the time, the dense one; NextStat's ``from_pyhf`` +
   ``fit`` (its ``MaximumLikelihoodEstimator(max_iter=20000)``: with its default 1000
   iterations it stops unconverged on these likelihoods, and so does its ``hypotest``, which
   takes no iteration limit; tried and reported) in the peers' environment. The growth
   exponent: the slope of log(seconds per iteration) against log(bins) over the sizes.
2. **Commands**: a cold server, then ``pyhf-gpu-client cls WS.json`` and ``pyhf-gpu-client cls
   BKG.json --patchset PS.json`` (24 mass points), timed as a user runs them; the server's
   peak resident memory (``/proc``, sampled every 0.1 s).

    .venv/bin/python benchmarks/bench_large.py [--peer-python /tmp/bench-venv/bin/python]
        [--sizes tiny|small|large|all] [--skip-commands] [--device cuda --peer-python none]
        [--peer-up-to PARAMETERS] [--dense-up-to PARAMETERS]
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import generate_large
from bench_patchsets import client_command

from pyhf_gpu_server.engine import HistFactoryModel
from pyhf_gpu_server.inference.hypotest import hypotest
from pyhf_gpu_server.inference.minimize import MinimizeOptions
from pyhf_gpu_server.inference.mle import FitOptions, fit

# (channels, bins per channel, shared systematics): 200 to 5000 parameters, 100 to 5000 bins
SIZES = {
    "tiny": [(2, 25, 40), (4, 25, 80)],
    "small": [(4, 25, 80), (12, 25, 240), (40, 40, 500)],
    "large": [(20, 40, 400), (50, 60, 600), (50, 100, 600)],
    "all": [
        (4, 25, 80),
        (12, 25, 240),
        (20, 40, 400),
        (40, 40, 500),
        (50, 60, 600),
        (50, 100, 600),
    ],
}

PEER = r"""
import json, sys, time, nextstat
spec = sys.stdin.read()
out = {}
start = time.perf_counter()
model = nextstat.from_pyhf(spec)
out["from_pyhf"] = time.perf_counter() - start
start = time.perf_counter()
result = nextstat.MaximumLikelihoodEstimator(max_iter=20000).fit(model)
out["fit"] = time.perf_counter() - start
out["fit_converged"] = bool(result.converged)
out["fit_iterations"] = int(result.n_iter)
out["twice_nll"] = 2 * float(result.nll)
start = time.perf_counter()
try:
    out["cls"] = float(nextstat.hypotest(1.0, model))
except Exception as exc:
    out["hypotest_error"] = str(exc)[:120]
out["hypotest"] = time.perf_counter() - start
print(json.dumps(out))
"""


def peer(python: str, spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    try:
        proc = subprocess.run(
            [python, "-c", PEER],
            input=json.dumps(spec),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return {"timeout": timeout}
    if proc.returncode:
        return {"error": proc.stderr.strip().splitlines()[-1][:120]}
    return json.loads(proc.stdout)


def ours(spec: dict[str, Any], solver: str, device: str = "cpu") -> dict[str, Any]:
    options = FitOptions(minimize=MinimizeOptions(solver=solver))
    start = time.perf_counter()
    model = HistFactoryModel.from_workspace(spec, device=device)
    built = time.perf_counter() - start
    start = time.perf_counter()
    result = fit(model, options=options, uncertainties=False)
    iterations = int(result.iterations[0])  # a host copy: the clock stops after the fit
    seconds = time.perf_counter() - start
    start = time.perf_counter()
    test = hypotest(model, [1.0], options=options)
    cls = float(test.cls_obs[0])
    return {
        "build": built,
        "fit": seconds,
        "iterations": iterations,
        "per_iteration": seconds / max(iterations, 1),
        "twice_nll": float(result.best_twice_nll[0]),
        "converged": bool(result.converged[0]),
        "hypotest": time.perf_counter() - start,
        "cls": cls,
        "per_bin": model.bin_parameters.n_per_bin,
        "pars": model.n_pars,
        "bins": model.n_main,
    }


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of log(ys) against log(xs)."""
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly, strict=True)) / sum(
        (a - mx) ** 2 for a in lx
    )


def scaling(
    sizes, peer_python: str | None, dense_up_to: int, device: str = "cpu", peer_up_to: int = 10**9
) -> str:
    lines = [
        "| channels x bins | parameters (per-bin) | ours: fit s (iterations) | ours: s/iteration "
        "| ours: hypotest s | dense: s/iteration | NextStat: fit s (iterations) | NextStat: "
        "hypotest | fit ratio | CLs ours / NextStat |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    rows = []
    for channels, bins, systematics in sizes:
        spec = generate_large.workspace(channels=channels, bins=bins, systematics=systematics)
        mine = ours(spec, "auto", device)
        dense = ours(spec, "dense", device) if mine["pars"] <= dense_up_to else None
        run_peer = peer_python and mine["pars"] <= peer_up_to
        them = peer(peer_python, spec, 1800) if run_peer else {}
        rows.append(mine)
        ratio = f"{them['fit'] / mine['fit']:.0f}x" if "fit" in them else "-"
        peer_fit = (
            f"{them['fit']:.2f} ({them['fit_iterations']})"
            if "fit" in them
            else (str(them)[:40] if them else "-")
        )
        peer_test = (
            f"{them['hypotest']:.2f} s" if "cls" in them else them.get("hypotest_error", "-")[:50]
        )
        cls_peer = f"{them['cls']:.6g}" if "cls" in them else "-"
        lines.append(
            f"| {channels} x {bins} | {mine['pars']} ({mine['per_bin']}) | {mine['fit']:.2f} "
            f"({mine['iterations']}) | {mine['per_iteration'] * 1e3:.1f} ms | "
            f"{mine['hypotest']:.2f} | "
            + (f"{dense['per_iteration'] * 1e3:.1f} ms" if dense else "-")
            + f" | {peer_fit} | {peer_test} | {ratio} | {mine['cls']:.6g} / {cls_peer} |"
        )
        print("progress:", lines[-1], file=sys.stderr, flush=True)
    if len(rows) > 1:
        exponent = slope([r["bins"] for r in rows], [r["per_iteration"] for r in rows])
        lines.append("")
        lines.append(f"Growth of our seconds per iteration with bins: exponent {exponent:.2f}.")
    return "\n".join(lines)


def commands() -> str:
    shape = dict(channels=40, bins=40, systematics=500)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        whole, background = folder / "ws.json", folder / "bkg.json"
        patchset = folder / "patchset.json"
        whole.write_text(json.dumps(generate_large.workspace(**shape)))
        bkg = generate_large.background_only(**shape)
        background.write_text(json.dumps(bkg))
        patchset.write_text(json.dumps(generate_large.patchset(bkg, 24)))
        single = client_command([whole])
        many = client_command([background, "--patchset", patchset])
    return "\n".join(
        [
            "| command (cold server, 40 x 40 bins, 2107 parameters) | seconds | server peak RSS |",
            "|---|---|---|",
            f"| `pyhf-gpu-client cls ws.json` | {single['seconds']:.2f} | "
            f"{single['rss'] / 2**30:.2f} GiB |",
            f"| `pyhf-gpu-client cls bkg.json --patchset ps.json` (24 points) | "
            f"{many['seconds']:.2f} | {many['rss'] / 2**30:.2f} GiB |",
            "",
            f"CLs_obs of ws.json: {single['results']['CLs_obs']:.10g}",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peer-python", default="/tmp/bench-venv/bin/python", help="or none")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--sizes", choices=sorted(SIZES), default="small")
    parser.add_argument("--dense-up-to", type=int, default=2200, help="parameters")
    parser.add_argument("--peer-up-to", type=int, default=2200, help="parameters")
    parser.add_argument("--skip-commands", action="store_true")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    peer_python = args.peer_python if Path(args.peer_python).exists() else None
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.device}\n")
    print(scaling(SIZES[args.sizes], peer_python, args.dense_up_to, args.device, args.peer_up_to))
    if not args.skip_commands:
        print()
        print(commands())


if __name__ == "__main__":
    main()
