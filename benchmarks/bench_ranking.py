"""Ranking and 2D-scan benchmark: this package against cabinetry, pyhf and NextStat.

Workloads, on the 119-parameter stau workspace (``BkgOnly.json`` + the first patch of its
patchset, unless ``--patch``):

(r) the full nuisance-parameter ranking: ours (the free fit with Hessian, then every
    conditional fit, 4 per parameter, in one batched call) against cabinetry's serial
    ``fit.ranking`` (MINUIT, its default tolerance) and NextStat's ``ranking`` (2 post-fit
    fits per constrained parameter: a smaller job, said so in the table);
(s) a 20 x 20 profile-likelihood scan over (POI, the top-ranked nuisance parameter): ours
    (``scan2d``: 400 + 1 fits in one call) against a loop of pyhf fits (numpy, scipy, pyhf's
    defaults) with both parameters fixed.

cabinetry's ranking and the pyhf loop take far longer than we do: they are timed on a subset
(``--cabinetry-pars`` parameters, restricted as in ``tests/test_inference_ranking.py``;
``--pyhf-points`` grid points) and extrapolated per parameter / per point, marked ``~``. Ours:
one warm-up call, then the median of up to five calls within 3 s (``bench_inference.timed``).
Model construction is never timed. The impacts and scan values of the peers are compared
with ours on what they computed.

Usage::

    python benchmarks/bench_ranking.py
    python benchmarks/bench_ranking.py --device cuda --no-peers
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from bench_inference import WORKSPACES, load, timed
from peers import THREAD_VARIABLES, run_peer
from service_support import running_server
from workspaces import workspace_file

from pyhf_gpu_server.allocator import tune_cpu_allocator
from pyhf_gpu_server.engine import HistFactoryModel
from pyhf_gpu_server.inference import ranking, scan2d

STAU = "atlas-susy-2018-04-stau"
IMPACTS = ("prefit_up", "prefit_down", "postfit_up", "postfit_down")

NEXTSTAT = r"""
import gzip, json, sys, time
import pyhf, nextstat
cfg = json.loads(sys.stdin.read())
def read(path):  # gzip-compressed (.gz) or not
    raw = open(path, "rb").read()
    return json.loads(gzip.decompress(raw) if path.endswith(".gz") else raw)
ws, ps = read(cfg["workspace"]), read(cfg["patchset"])
w = pyhf.PatchSet(ps).apply(pyhf.Workspace(ws), cfg["patch"])
model = nextstat.from_pyhf(json.dumps(dict(w)))
start = time.perf_counter()
entries = nextstat.ranking(model)
print(json.dumps({"s": time.perf_counter() - start, "entries": entries}))
"""


def pyhf_model(workspace: dict, patchset: dict, patch: str):
    import pyhf

    pyhf.set_backend("numpy")
    ws = pyhf.PatchSet(patchset).apply(pyhf.Workspace(workspace), patch)
    model = ws.model()
    return model, ws.data(model)


def cabinetry_ranking(model, data, labels: list[str]) -> tuple[float, float, dict]:
    """cabinetry's ``fit.ranking`` (default tolerance) on ``labels`` only: (seconds of its
    nominal fit, seconds of the ranking loop, impacts by label)."""
    import cabinetry

    start = time.perf_counter()
    nominal = cabinetry.fit.fit(model, data)
    fit_s = time.perf_counter() - start
    keep = np.isin(model.config.par_names, labels)
    prefit = cabinetry.model_utils.prefit_uncertainties(model)
    original = cabinetry.model_utils.prefit_uncertainties
    cabinetry.model_utils.prefit_uncertainties = lambda _: np.where(keep, prefit, 0.0)
    try:
        subset = nominal._replace(uncertainty=np.where(keep, nominal.uncertainty, 0.0))
        start = time.perf_counter()
        res = cabinetry.fit.ranking(model, data, fit_results=subset)
        loop_s = time.perf_counter() - start
    finally:
        cabinetry.model_utils.prefit_uncertainties = original
    impacts = {
        lab: [float(getattr(res, f)[res.labels.index(lab)]) for f in IMPACTS] for lab in labels
    }
    return fit_s, loop_s, impacts


def pyhf_scan_points(model, data, names, points) -> tuple[float, float, list[float]]:
    """pyhf's free fit and fixed fits at ``points``: (free seconds, seconds per point,
    -2 Delta ln L per point)."""
    import pyhf

    start = time.perf_counter()
    best = float(pyhf.infer.mle.fit(data, model, return_fitted_val=True)[1])
    free_s = time.perf_counter() - start
    index = [model.config.par_names.index(n) for n in names]
    values, start = [], time.perf_counter()
    for point in points:
        init, fixed = model.config.suggested_init(), model.config.suggested_fixed()
        for i, v in zip(index, point, strict=True):
            init[i], fixed[i] = v, True
        fitted = pyhf.infer.mle.fit(
            data, model, init_pars=init, fixed_params=fixed, return_fitted_val=True
        )[1]
        values.append(float(fitted) - best)
    return free_s, (time.perf_counter() - start) / len(points), values


def nextstat_ranking(python: str, patch: str, threads: int) -> dict | None:
    cfg = {
        "workspace": str(workspace_file(WORKSPACES, STAU, "BkgOnly.json")),
        "patchset": str(workspace_file(WORKSPACES, STAU, "patchset.json")),
        "patch": patch,
    }
    try:
        proc = run_peer(python, NEXTSTAT, cfg, threads, timeout=1800)
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (OSError, IndexError, json.JSONDecodeError, subprocess.TimeoutExpired) as exc:
        print(f"NextStat failed: {exc}", flush=True)
        return None


def through_the_service(workspace: dict, entry: dict, bodies: dict[str, dict]) -> dict[str, float]:
    """Seconds of each ``POST /<route>`` with ``bodies[route]`` through a real server on
    127.0.0.1 (the path users run: HTTP, translation, batching, JSON), the second of two calls
    (the first builds the warm model)."""
    seconds = {}
    with (
        tempfile.TemporaryDirectory() as data_dir,
        running_server(Path(data_dir)) as server,
        server.client(timeout_s=900) as client,
    ):
        uploaded = client.post("/workspaces", json=workspace).json()["workspace_id"]
        for route, options in bodies.items():
            body = {"workspace_id": uploaded, "patches": [entry["patch"]], **options}
            for _ in range(2):
                start = time.perf_counter()
                response = client.post(route, json=body)
                seconds[route] = time.perf_counter() - start
                if response.status_code != 200:
                    raise SystemExit(f"{route}: {response.status_code} {response.text[:500]}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default=os.environ.get("PYHF_GPU_TEST_DEVICE", "cpu"))
    parser.add_argument("--patch", default=None, help="patch name (default: the first)")
    parser.add_argument("--cabinetry-pars", type=int, default=3)
    parser.add_argument("--pyhf-points", type=int, default=6)
    parser.add_argument("--grid", type=int, default=20)
    parser.add_argument("--no-peers", action="store_true")
    parser.add_argument("--peer-python", default="/tmp/bench-venv/bin/python")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="-", help="markdown file to write ('-': stdout only)")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    tune_cpu_allocator()  # as pyhf-gpu-server's process: in-process times match it
    for variable in THREAD_VARIABLES:
        os.environ[variable] = str(args.threads)
    workspace, patchset = load(STAU)
    patch = args.patch or patchset["patches"][0]["metadata"]["name"]
    entry = next(p for p in patchset["patches"] if p["metadata"]["name"] == patch)
    model = HistFactoryModel.from_workspace(workspace, patches=[entry["patch"]], device=device)
    rows: list[tuple[str, str, str, str]] = []
    notes: list[str] = []

    # ---------------------------------------------------------------- ranking
    ours_s, ours = timed(lambda: ranking(model), device)
    ranked = len(ours.columns[0])
    order = ours.order(0)
    n_fits = sum(4 if ours.prefit_uncertainty[0, c] > 0 else 2 for c in ours.columns[0])
    rows.append(
        (
            f"full ranking ({ranked} parameters, {n_fits} + 1 fits)",
            f"{ours_s:.3f}",
            "",
            f"converged {bool(ours.converged.all())}",
        )
    )
    top = order[0]
    if not args.no_peers:
        pm, data = pyhf_model(workspace, patchset, patch)
        labels = [ours.labels[c] for c in order[: args.cabinetry_pars]]
        fit_s, loop_s, theirs = cabinetry_ranking(pm, data, labels)
        extrapolated = fit_s + loop_s / len(labels) * ranked
        diffs = [
            abs(getattr(ours, f)[0, ours.labels.index(lab)].item() - v)
            for lab, values in theirs.items()
            for f, v in zip(IMPACTS, values, strict=True)
        ]
        rows.append(
            (
                "cabinetry `fit.ranking` (serial MINUIT)",
                f"~{extrapolated:.1f}",
                f"{extrapolated / ours_s:.0f}x",
                f"timed on {len(labels)} of {ranked} parameters ({loop_s:.1f} s) + nominal fit "
                f"({fit_s:.1f} s), extrapolated; max |impact difference| {max(diffs):.1e} "
                "(its default tolerance, its own nominal fit)",
            )
        )
        found = nextstat_ranking(args.peer_python, patch, args.threads)
        if found is None:
            rows.append(("NextStat `ranking`", "failed", "", "see the log"))
        else:
            entries = {e["name"]: e for e in found["entries"]}
            common = [c for c in ours.columns[0] if ours.labels[c] in entries]
            impact = max(
                abs(ours.postfit_up[0, c].item() - entries[ours.labels[c]]["delta_mu_up"])
                for c in common
            )
            pull = max(
                abs(ours.pull[0, c].item() - entries[ours.labels[c]]["pull"]) for c in common
            )
            rows.append(
                (
                    "NextStat `ranking` (Rust, serial)",
                    f"{found['s']:.3f}",
                    f"{found['s'] / ours_s:.1f}x",
                    f"{len(entries)} parameters x 2 post-fit fits (no pre-fit impacts); max "
                    f"|post-fit up impact difference| {impact:.1e}, |pull difference| {pull:.1e}",
                )
            )

    # ---------------------------------------------------------------- 2D scan
    names = (model.poi_name, ours.labels[top])
    k = model.par_names.index(names[0])
    lo, hi = model.bounds[0, k].tolist()
    xs = torch.linspace(lo, hi, args.grid, dtype=model.dtype).tolist()
    ys = torch.linspace(-2.0, 2.0, args.grid, dtype=model.dtype).tolist()
    scan_s, grid = timed(lambda: scan2d(model, names, xs, ys), device)
    n_points = args.grid * args.grid
    rows.append(
        (
            f"2D scan {args.grid}x{args.grid} ({names[0]}, {names[1]}; {n_points} + 1 fits)",
            f"{scan_s:.3f}",
            "",
            f"converged {bool(grid.converged.all())}",
        )
    )
    if not args.no_peers:
        rng = np.random.default_rng(1)
        picks = rng.choice(n_points, size=args.pyhf_points, replace=False)
        points = [(xs[p // args.grid], ys[p % args.grid]) for p in picks]
        free_s, per_point, values = pyhf_scan_points(pm, data, names, points)
        extrapolated = free_s + per_point * n_points
        diff = max(
            abs(grid.delta_nlls[0, p // args.grid, p % args.grid].item() - v)
            for p, v in zip(picks, values, strict=True)
        )
        rows.append(
            (
                "pyhf loop of fixed fits (numpy, scipy)",
                f"~{extrapolated:.1f}",
                f"{extrapolated / scan_s:.0f}x",
                f"timed on {len(points)} of {n_points} points ({per_point:.2f} s each) + free fit, "
                f"extrapolated; max |-2 Delta ln L difference| {diff:.1e} "
                "(pyhf's default tolerance)",
            )
        )
        notes.append("NextStat has no 2D scan (its `profile_scan` scans the POI only).")

    served = through_the_service(
        workspace,
        entry,
        {
            "/ranking": {},
            "/scan": {
                "x": {"parameter": names[0], "values": xs},
                "y": {"parameter": names[1], "values": ys},
            },
        },
    )
    rows.append(
        (
            "through the service: `POST /ranking` (warm model)",
            f"{served['/ranking']:.3f}",
            "",
            "HTTP on 127.0.0.1, translation, batching, JSON: the path users run",
        )
    )
    rows.append(
        (
            f"through the service: `POST /scan` {args.grid}x{args.grid} (warm model)",
            f"{served['/scan']:.3f}",
            "",
            "",
        )
    )
    load_avg = ", ".join(f"{v:.2f}" for v in os.getloadavg())
    head = (
        f"stau ({model.n_pars} parameters), patch `{patch}`, device `{device}`, "
        f"{args.threads} thread(s), load average {load_avg}. Times in seconds; ratio = peer "
        "time / ours; `~`: extrapolated from a timed subset."
    )
    table = "\n".join(
        [
            head,
            "",
            "| workload | seconds | ratio | notes |",
            "|---|---|---|---|",
            *(f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows),
            "",
            *notes,
        ]
    )
    print(table)
    if args.out != "-":
        Path(args.out).write_text("# Ranking and scan benchmark\n\n" + table + "\n")


if __name__ == "__main__":
    main()
