"""cabinetry against ``pyhf_gpu_client.cabinetry`` (the same calls answered by the service):
a fit and a ranking of one published workspace, one run each, from a cold server.

Workload: ATLAS-SUSY-2018-31 region A (66 parameters) with the generated signal ``sig_s1_x1``
(``--analysis``, ``--patch``). Timed, wall clock:

- cabinetry: ``fit.fit(model, data)`` then ``fit.ranking(model, data, fit_results=...)``
  (MINUIT, pyhf's numpy backend, cabinetry's defaults). Its ranking runs 4 fits per
  parameter one after the other; with ``--cabinetry-pars N`` it ranks N parameters spread over
  the model (restricted as ``tests/test_client_cabinetry.py`` restricts it) and its time is
  extrapolated to all of them, marked ``~``.
- the adapter: ``gpu_cabinetry.fit`` then ``gpu_cabinetry.ranking(..., fit_results=...)``
  against a server started for the run (``--device``; not timed: its start); the fit is the
  server's first request (its model is built then), the ranking the second.

Both return cabinetry's result types; the largest post-fit impacts that cabinetry computed
are compared with ours (``max rel diff``).

Usage::

    python benchmarks/bench_cabinetry.py                       # full cabinetry ranking
    python benchmarks/bench_cabinetry.py --cabinetry-pars 8    # extrapolated
    python benchmarks/bench_cabinetry.py --device cuda
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import cabinetry
import pyhf
import pytest
from service_support import load, running_server
from test_client_cabinetry import cabinetry_ranking

from pyhf_gpu_client import Client
from pyhf_gpu_client import cabinetry as gpu_cabinetry


def spread(labels: list[str], n: int) -> list[str]:
    """``n`` labels evenly spread over ``labels`` (all of them if ``n`` is 0 or too many)."""
    if n <= 0 or n >= len(labels):
        return list(labels)
    return [labels[int(i)] for i in np.linspace(0, len(labels) - 1, n)]


def run_cabinetry(model, data, pars: int) -> dict:
    """cabinetry's fit and (restricted) ranking: seconds and results."""
    start = time.perf_counter()
    fitted = cabinetry.fit.fit(model, data)
    fit_s = time.perf_counter() - start
    poi = model.config.poi_name
    fixed = model.config.suggested_fixed()
    free = [
        label for k, label in enumerate(model.config.par_names) if label != poi and not fixed[k]
    ]
    chosen = spread(free, pars)
    start = time.perf_counter()
    if len(chosen) == len(free):
        ranked = cabinetry.fit.ranking(model, data, fit_results=fitted)
    else:
        with pytest.MonkeyPatch.context() as patch:
            ranked = cabinetry_ranking(model, data, fitted, chosen, patch, tolerance=None)
    ranking_s = (time.perf_counter() - start) * len(free) / len(chosen)
    return {
        "fit_s": fit_s,
        "fit": fitted,
        "ranking_s": ranking_s,
        "extrapolated": len(chosen) < len(free),
        "ranked": chosen,
        "ranking": ranked,
    }


def run_adapter(model, data, device: str) -> dict:
    """The adapter's fit and ranking against a fresh server: seconds and results."""
    with (
        tempfile.TemporaryDirectory() as folder,
        running_server(Path(folder), args=["--device", device]) as server,
        Client(server.url, timeout=3600) as client,
    ):
        start = time.perf_counter()
        fitted = gpu_cabinetry.fit(model, data, client=client)
        fit_s = time.perf_counter() - start
        start = time.perf_counter()
        ranked = gpu_cabinetry.ranking(model, data, fit_results=fitted, client=client)
        ranking_s = time.perf_counter() - start
    return {"fit_s": fit_s, "fit": fitted, "ranking_s": ranking_s, "ranking": ranked}


def largest_difference(ours, theirs, labels: list[str], top: int = 5) -> tuple[float, str]:
    """Max relative difference of the post-fit impacts of the ``top`` largest (by ours) of
    ``labels``, and a line naming where it is."""
    impact = np.maximum(np.abs(ours.postfit_up), np.abs(ours.postfit_down))
    mine = [k for k in np.argsort(-impact) if ours.labels[k] in labels][:top]
    worst, where = 0.0, ""
    for k in mine:
        j = theirs.labels.index(ours.labels[k])
        for field in ("postfit_up", "postfit_down"):
            a, b = getattr(ours, field)[k], getattr(theirs, field)[j]
            gap = abs(a - b) / max(abs(b), 1e-3)
            if gap > worst:
                worst, where = gap, f"{ours.labels[k]} {field}: ours {a:.5g}, cabinetry's {b:.5g}"
    return worst, where


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--analysis", default="atlas-susy-2018-31-sbottom-A")
    parser.add_argument("--patch", default="sig_s1_x1")
    parser.add_argument("--device", default="cpu", help="the server's --device")
    parser.add_argument(
        "--cabinetry-pars",
        type=int,
        default=0,
        help="parameters cabinetry ranks (0: all), its time extrapolated to all",
    )
    args = parser.parse_args()

    workspace = pyhf.PatchSet(load(args.analysis, "patchset.json")).apply(
        pyhf.Workspace(load(args.analysis, "BkgOnly.json")), args.patch
    )
    model, data = cabinetry.model_utils.model_and_data(dict(workspace))
    ours = run_adapter(model, data, args.device)
    theirs = run_cabinetry(model, data, args.cabinetry_pars)
    mark = "~" if theirs["extrapolated"] else ""
    print(
        f"{args.analysis} + {args.patch}: {model.config.npars} parameters; server --device "
        f"{args.device}, cold; one run each"
    )
    print(f"{'':24}{'cabinetry (s)':>16}{'adapter (s)':>14}{'ratio':>10}")
    for name, key in (("fit", "fit_s"), ("ranking (after the fit)", "ranking_s")):
        mine, minuit = ours[key], theirs[key]
        tilde = mark if key == "ranking_s" else ""
        print(f"{name:24}{tilde + f'{minuit:.2f}':>16}{mine:>14.2f}{minuit / mine:>9.1f}x")
    poi = model.config.poi_index
    mine, minuit = ours["fit"], theirs["fit"]
    print(
        f"POI best fit: cabinetry {minuit.bestfit[poi]:.5g} (-2 ln L {minuit.best_twice_nll:.6f}), "
        f"adapter {mine.bestfit[poi]:.5g} (-2 ln L {mine.best_twice_nll:.6f}); impacts are "
        "shifts from each one's own"
    )
    worst, where = largest_difference(ours["ranking"], theirs["ranking"], theirs["ranked"])
    print(
        f"cabinetry ranked {len(theirs['ranked'])} parameters; max rel diff of the largest 5 "
        f"post-fit impacts among them: {worst:.2e} ({where})"
    )


if __name__ == "__main__":
    main()
