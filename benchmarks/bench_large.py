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
    .venv/bin/python benchmarks/bench_large.py --analyses [--peer-up-to 200]

3. **Analyses** (``--analyses``, in-process): our fit with Hessian uncertainties and our
   ranking against NextStat's ``fit`` and ``ranking``, with the POI's uncertainty and the
   post-fit impacts side by side.
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
from peers import run_peer

from pyhf_gpu_server.engine import HistFactoryModel
from pyhf_gpu_server.inference.hypotest import hypotest
from pyhf_gpu_server.inference.minimize import MinimizeOptions
from pyhf_gpu_server.inference.mle import FitOptions, fit
from pyhf_gpu_server.inference.ranking import ranking
from pyhf_gpu_server.service.operations.ranking import ranking_answer

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


def peer(python: str, spec: dict[str, Any], timeout: float, script: str = PEER) -> dict[str, Any]:
    try:
        proc = run_peer(python, script, spec, timeout=timeout)
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


PEER_ANALYSES = r"""
import json, sys, time, nextstat
spec = sys.stdin.read()
model = nextstat.from_pyhf(spec)
start = time.perf_counter()
result = nextstat.MaximumLikelihoodEstimator(max_iter=20000).fit(model)
out = {"fit": time.perf_counter() - start, "converged": bool(result.converged)}
out["poi_uncertainty"] = float(result.uncertainties[model.poi_index()])
start = time.perf_counter()
ranked = nextstat.ranking(model)
out["ranking"] = time.perf_counter() - start
out["impacts"] = {r["name"]: [r["delta_mu_up"], r["delta_mu_down"]] for r in ranked}
print(json.dumps(out))
"""

# (channels, bins per channel, shared systematics) of the uncertainty and ranking table, with
# a signal injected 8 times into the observations (the POI's best fit off its bound, where
# impacts are not all 0)
ANALYSES = [(4, 25, 80), (12, 25, 240), (40, 40, 500)]
INJECTED = 8.0


def pyhf_impacts(spec: dict[str, Any], names: list[str], ranked) -> dict[str, list[float]]:
    """pyhf's post-fit impacts of ``names``, each refitted with scipy at tolerance 1e-12
    (the parameter fixed at our best fit +- our post-fit sigma): the reference of the table."""
    import pyhf

    pyhf.set_backend("numpy", pyhf.optimize.scipy_optimizer(tolerance=1e-12))
    workspace = pyhf.Workspace(spec)
    model = workspace.model()
    data = workspace.data(model)
    k = model.config.poi_index
    best = pyhf.infer.mle.fit(data, model)
    out = {}
    for name in names:
        column = ranked.labels.index(name)
        theta = float(ranked.bestfit[0, column])
        sigma = float(ranked.uncertainty[0, column])
        index = model.config.par_order.index(name.split("[")[0])
        index = model.config.par_slice(model.config.par_order[index]).start + (
            int(name.split("[")[1].rstrip("]")) if "[" in name else 0
        )
        impacts = []
        for value in (theta + sigma, theta - sigma):
            init = list(best)
            init[index] = value
            fixed = list(model.config.suggested_fixed())
            fixed[index] = True
            refit = pyhf.infer.mle.fit(data, model, init_pars=init, fixed_params=fixed)
            impacts.append(float(refit[k] - best[k]))
        out[name] = impacts
    return out


def analyses(peer_python: str | None, peer_up_to: int, rank_all_up_to: int) -> str:
    """Our fit with Hessian uncertainties and ranking (every parameter up to
    ``rank_all_up_to`` parameters, else the first 20 shared systematics), NextStat's ``fit``
    (uncertainties included) and ``ranking`` (every parameter) where the model has at most
    ``peer_up_to`` parameters; the post-fit impacts of our three largest-impact parameters
    against pyhf's tight refits (:func:`pyhf_impacts`), where ranked all and at most
    ``peer_up_to`` parameters (pyhf's numpy fits of more take minutes each)."""
    rows = [
        "| parameters | bins | ours: fit + uncertainties | NextStat: fit | ours: ranking "
        "(ranked) | NextStat: ranking | ranking ratio | POI sigma, ours / NextStat | "
        "top-3 post-fit impacts: max diff. to pyhf's refits, ours / NextStat's |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for channels, bins, systematics in ANALYSES:
        spec = generate_large.workspace(
            channels=channels, bins=bins, systematics=systematics, injected=INJECTED
        )
        model = HistFactoryModel.from_workspace(spec)
        start = time.perf_counter()
        result = fit(model)
        sigma = float(result.uncertainty[0, model.poi_index])
        fit_seconds = time.perf_counter() - start
        names = None
        if model.n_pars > rank_all_up_to:
            names = [p for p in model.par_names if p.startswith("syst_")][:20]
        start = time.perf_counter()
        ranked = ranking(model, parameters=names)
        ranked.postfit_up.sum().item()
        rank_seconds = time.perf_counter() - start
        row = ranking_answer(ranked).model_dump()
        pairs = zip(row["postfit_up"], row["postfit_down"], strict=True)
        ours_impacts = dict(zip(row["labels"], pairs, strict=True))
        count = len(ranked.columns[0])
        check = "-"
        reference = {}
        if names is None and model.n_pars <= peer_up_to:
            reference = pyhf_impacts(spec, row["labels"][:3], ranked)
            check = f"{_largest_difference(ours_impacts, reference):.1e}"
        peer_fit = peer_rank = ratio = sigmas = "-"
        if peer_python and model.n_pars <= peer_up_to:
            other = peer(peer_python, spec, 900, PEER_ANALYSES)
            if "fit" in other:
                peer_fit = f"{other['fit']:.2f}"
                peer_rank = f"{other['ranking']:.1f}"
                ratio = f"{other['ranking'] / rank_seconds:.0f}x"
                sigmas = f"{sigma:.5f} / {other['poi_uncertainty']:.5f}"
                if reference:
                    check += f" / {_largest_difference(other['impacts'], reference):.1e}"
            else:
                peer_fit = peer_rank = str(other)[:40]
        rows.append(
            f"| {model.n_pars} | {model.n_main} | {fit_seconds:.2f} | {peer_fit} | "
            f"{rank_seconds:.1f} ({count}) | {peer_rank} | {ratio} | {sigmas} | {check} |"
        )
        print(rows[-1], file=sys.stderr, flush=True)  # progress: a row as soon as it is done
    return "\n".join(rows)


def _largest_difference(impacts: dict, reference: dict[str, list[float]]) -> float:
    """The largest |impact - reference| over the reference's parameters (up and down)."""
    return max(
        abs(a - b)
        for name, pair in reference.items()
        for a, b in zip(impacts.get(name, [math.nan] * 2), pair, strict=True)
    )


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
    parser.add_argument("--analyses", action="store_true", help="uncertainties and ranking")
    parser.add_argument("--rank-all-up-to", type=int, default=600, help="parameters")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    peer_python = args.peer_python if Path(args.peer_python).exists() else None
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.device}\n")
    if args.analyses:
        print(analyses(peer_python, args.peer_up_to, args.rank_all_up_to))
        return
    print(scaling(SIZES[args.sizes], peer_python, args.dense_up_to, args.device, args.peer_up_to))
    if not args.skip_commands:
        print()
        print(commands())


if __name__ == "__main__":
    main()
