"""Writes ``pyhf_cls_sbottom_published.json``: pyhf's ``pyhf cls`` of every published sbottom
signal point (ATLAS-SUSY-2018-31, HEPData ins1748602; regions A: 217 points, B: 218).

Each point's workspace is made as ``pyhf patchset apply BkgOnly.json patchset.hepdata.json
--name <point> --output-file p.json`` makes it (``pyhf.PatchSet(...).apply(Workspace(bkg),
name)``, written as JSON and read back), and its CLs as ``pyhf cls p.json`` computes it with
its defaults: numpy backend, scipy optimizer (SLSQP, default options), normsys code4 and
histosys code4p, ``hypotest(1.0, ws.data(model), model, test_stat="qtilde",
calctype="asymptotics", return_expected_set=True)``: ``CLs_obs`` and ``CLs_exp`` of each point
(``null`` where pyhf prints ``NaN``). A point pyhf refuses (one whose patch only removes a
channel leaves no POI) is recorded with pyhf's error instead.

Audit (``multistart``): pyhf's fits do not always reach the minimum of its own likelihood
(SLSQP stops early at its default tolerance, or stays above a lower minimum), and at some
points that moves its CLs by more than 1e-4. Where this repository's engine (CPU, float64, in
this process: the numbers the server gives) differs from pyhf's answer by more than 1e-4 (or
pyhf's is NaN), the point is computed again by pyhf with every fit also started from the
engine's minima (its fits of the data at mu = 1, 0 and free, and of the Asimov data pyhf makes
from the mu = 0 one, at mu = 1 and free), keeping the lowest minimum by pyhf's own likelihood:
pyhf's code, formulas and optimizer throughout. ``multistart`` records that answer and by how
much it lowered pyhf's fits (``twice_nll_lowered``, the largest over the fits).

Run from the repository root (pyhf 0.7.6 in ``.venv``; ~1-5 s a point on one loaded core)::

    .venv/bin/python tests/data/pyhf_cls_sbottom_published.py [--jobs 2] [--reuse FILE]

``--reuse`` keeps the default answers of an earlier output and only redoes the audit. It reads
the workspaces where the tests do (``tests/workspaces.py``: ``tests/data/workspaces`` or
``PYHF_GPU_SHARED_WORKSPACES``). ``tests/test_pyhf_applied_points.py`` compares the server's
answers against the file.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from functools import cache
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests/: workspaces.py

from workspaces import WORKSPACES_DIR, read_json  # noqa: E402

ANALYSES = ("atlas-susy-2018-31-sbottom-A", "atlas-susy-2018-31-sbottom-B")
OUTPUT = HERE / "pyhf_cls_sbottom_published.json"
TEST_POI = 1.0
TEST_STAT = "qtilde"
CALCTYPE = "asymptotics"
MODIFIER_SETTINGS = {"normsys": {"interpcode": "code4"}, "histosys": {"interpcode": "code4p"}}
AUDIT_ABOVE = 1e-4  # engine vs pyhf difference (CLs_obs or a CLs_exp) that starts an audit


@cache
def published(analysis: str) -> tuple[Any, Any]:
    """(``pyhf.Workspace`` of the background, ``pyhf.PatchSet`` of the published points)."""
    import pyhf

    folder = WORKSPACES_DIR / analysis
    workspace = pyhf.Workspace(read_json(folder, "BkgOnly.json"))
    return workspace, pyhf.PatchSet(read_json(folder, "patchset.hepdata.json.gz"))


def applied(analysis: str, name: str) -> dict[str, Any]:
    """The workspace ``pyhf patchset apply ... --name <name> --output-file p.json`` writes,
    as ``pyhf cls p.json`` reads it back."""
    workspace, patchset = published(analysis)
    return json.loads(json.dumps(patchset.apply(workspace, name), indent=4, sort_keys=True))


def _number(value: Any) -> float | None:
    """A float, ``None`` for pyhf's NaN (JSON has none)."""
    value = float(value)
    return value if math.isfinite(value) else None


def pyhf_cls(spec: dict[str, Any], optimizer: Any = "scipy") -> dict[str, Any]:
    """What ``pyhf cls`` prints for ``spec`` with its defaults (``optimizer``: the default
    ``"scipy"``, or the audit's)."""
    import pyhf

    pyhf.set_backend("numpy", optimizer)
    workspace = pyhf.Workspace(spec)
    model = workspace.model(modifier_settings=MODIFIER_SETTINGS)
    result = pyhf.infer.hypotest(
        TEST_POI,
        workspace.data(model),
        model,
        test_stat=TEST_STAT,
        calctype=CALCTYPE,
        return_expected_set=True,
    )
    return {"CLs_obs": _number(result[0]), "CLs_exp": [_number(x) for x in result[-1]]}


def point(job: tuple[str, str]) -> dict[str, Any]:
    """One point's record: its name, the channels pyhf dropped observations of, and pyhf's
    numbers (or its error)."""
    analysis, name = job
    spec = applied(analysis, name)
    channels = {c["name"] for c in spec["channels"]}
    record: dict[str, Any] = {
        "name": name,
        "unmatched_observations": [
            o["name"] for o in spec["observations"] if o["name"] not in channels
        ],
    }
    start = time.perf_counter()
    try:
        record.update(pyhf_cls(spec))
    except Exception as exc:  # pyhf refuses the workspace: recorded, as the CLI would fail
        record["error"] = f"{type(exc).__name__}: {exc}"
    record["seconds"] = round(time.perf_counter() - start, 3)
    return record


# --- the audit ---------------------------------------------------------------------------------
def engine_minima(spec: dict[str, Any]) -> tuple[dict[str, Any], list[list[float]]]:
    """The engine's CLs of ``spec`` and the parameters of its minima (pyhf's par_order)."""
    import pyhf
    import torch

    from pyhf_gpu_server.engine import HistFactoryModel
    from pyhf_gpu_server.inference import mle
    from pyhf_gpu_server.inference.hypotest import hypotest

    model = HistFactoryModel.from_workspace(spec)
    result = hypotest(model, [TEST_POI])
    answer = {"CLs_obs": result.observed().item(), "CLs_exp": result.expected()[0].tolist()}
    starts = [
        mle.fit(model, uncertainties=False).bestfit[0],
        mle.fixed_poi_fit(model, TEST_POI, uncertainties=False).bestfit[0],
    ]
    background = mle.fixed_poi_fit(model, 0.0, uncertainties=False).bestfit[0]
    starts.append(background)
    workspace = pyhf.Workspace(spec)
    pyhf_model = workspace.model(modifier_settings=MODIFIER_SETTINGS)
    asimov = torch.as_tensor(pyhf_model.expected_data(background.numpy()))[None]
    starts.append(mle.fit(model, data=asimov, uncertainties=False).bestfit[0])
    starts.append(mle.fixed_poi_fit(model, TEST_POI, data=asimov, uncertainties=False).bestfit[0])
    return answer, [s.tolist() for s in starts]


def multistart_optimizer(starts: list[list[float]], lowered: list[float]) -> Any:
    """pyhf's scipy optimizer (default options) whose every fit is also started from
    ``starts``, the lowest minimum kept; how much lower than from pyhf's own start goes into
    ``lowered``."""
    import pyhf

    class MultiStart(pyhf.optimize.scipy_optimizer):
        def minimize(self, objective, data, pdf, init_pars, par_bounds, fixed_vals=None, **kw):
            wanted = kw.pop("return_fitted_val", False)
            found = []
            for start in [init_pars, *starts]:
                try:
                    pars, value = super().minimize(
                        objective, data, pdf, list(start), par_bounds, fixed_vals,
                        return_fitted_val=True, **kw,
                    )  # fmt: skip
                except pyhf.exceptions.FailedMinimization:
                    if start is init_pars:
                        raise
                    continue
                found.append((float(value), pars))
            best = min(found, key=lambda f: f[0])
            lowered.append(found[0][0] - best[0])
            return (best[1], best[0]) if wanted else best[1]

    return MultiStart()


def audit(job: tuple[str, str, dict[str, Any]]) -> dict[str, Any] | None:
    """The audit of one point (``None`` where the engine agrees with pyhf's answer)."""
    analysis, name, record = job
    spec = applied(analysis, name)
    engine, starts = engine_minima(spec)
    ours = [engine["CLs_obs"], *engine["CLs_exp"]]
    theirs = [record["CLs_obs"], *record["CLs_exp"]]
    if all(t is not None and abs(o - t) <= AUDIT_ABOVE for o, t in zip(ours, theirs, strict=True)):
        return None
    lowered: list[float] = []
    again = pyhf_cls(spec, multistart_optimizer(starts, lowered))
    return {**again, "twice_nll_lowered": max(lowered), "engine": engine}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=1, help="processes (default 1)")
    parser.add_argument("--output", type=Path, default=OUTPUT)
    parser.add_argument("--reuse", type=Path, help="an earlier output: its default answers")
    args = parser.parse_args()

    import numpy
    import pyhf
    import scipy

    jobs = []
    for analysis in ANALYSES:
        patchset = read_json(WORKSPACES_DIR / analysis, "patchset.hepdata.json.gz")
        jobs += [(analysis, p["metadata"]["name"]) for p in patchset["patches"]]
    start = time.perf_counter()
    with ProcessPoolExecutor(args.jobs) as pool:
        if args.reuse:
            earlier = json.loads(args.reuse.read_text(), parse_constant=lambda _: None)
            kept = {(a, r["name"]): r for a, rs in earlier["results"].items() for r in rs}
            records = [{k: v for k, v in kept[job].items() if k != "multistart"} for job in jobs]
            seconds = earlier["seconds"]
        else:
            records = list(pool.map(point, jobs, chunksize=4))
            seconds = round(time.perf_counter() - start, 1)
        tested = [(*job, r) for job, r in zip(jobs, records, strict=True) if "error" not in r]
        audits = list(pool.map(audit, tested, chunksize=4))
    for (_, _, record), found in zip(tested, audits, strict=True):
        if found is not None:
            record["multistart"] = found
    results: dict[str, list[dict[str, Any]]] = {analysis: [] for analysis in ANALYSES}
    for (analysis, _), record in zip(jobs, records, strict=True):
        results[analysis].append(record)
    document = {
        "made_by": "tests/data/pyhf_cls_sbottom_published.py",
        "pyhf": pyhf.__version__,
        "numpy": numpy.__version__,
        "scipy": scipy.__version__,
        "python": platform.python_version(),
        "backend": "numpy",
        "optimizer": "scipy (SLSQP, pyhf's default options)",
        "workspace": "pyhf patchset apply BkgOnly.json patchset.hepdata.json.gz --name <name>",
        "command": "pyhf cls p.json (defaults: --test-poi 1.0 --test-stat qtilde "
        "--calctype asymptotics; normsys code4, histosys code4p); null: pyhf printed NaN",
        "multistart": "where the engine differs from pyhf's answer by more than 1e-4: pyhf "
        "again, each fit also started from the engine's minima, the lowest kept (see the "
        "script's docstring)",
        "seconds": seconds,
        "results": results,
    }
    args.output.write_text(json.dumps(document, indent=1, allow_nan=False) + "\n")
    failed = sum("error" in r for r in records)
    audited = sum(found is not None for found in audits)
    print(f"{len(records)} points ({failed} refused by pyhf, {audited} audited) -> {args.output}")


if __name__ == "__main__":
    main()
