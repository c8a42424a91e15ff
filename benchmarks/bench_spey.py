"""spey on pyhf-gpu against spey-pyhf: 200 signal patches on one background, in one run.

A reinterpretation loop asks spey's ``exclusion_confidence_level`` (observed, asymptotic,
``q~`` at POI 1) of many signal points on one published background. Three ways, side by
side on the published ATLAS-SUSY-2018-31 region B points (``patchset.hepdata.json``, the
first 200 that carry a signal; 60 parameters, 3 bins):

1. ``pyhf_gpu_client.spey.exclusion_confidence_levels``: the 200 patches in ONE request
   (the four fits of each on the server, CLs by spey's own formulae);
2. our backend through spey, per patch: ``spey.get_backend("pyhf-gpu")(...)`` then
   ``exclusion_confidence_level()`` (one request a patch);
3. spey-pyhf's loop: ``spey.get_backend("pyhf")(...)`` then ``exclusion_confidence_level()``
   (pyhf's numpy backend, spey's scipy SLSQP fits; its default when jax is absent).

Patches that differ from spey-pyhf by more than 1e-4 are fitted by spey-pyhf again at
``tol=1e-10``: its SLSQP stops above flat minima at its default ``tol=1e-6``. (One published
point, ``sbottom_400_205_60``, still differs by 7e-4: spey-pyhf's conditional fit at POI 1
lands in a local minimum even then, -log L 50.63392 against ours 50.63012, which pyhf's own
``logpdf`` at our parameters confirms.)

It starts its own server (CPU unless ``--device``; default settings), warms it with one
request on another patchset's background, and prints a markdown table: seconds, per patch,
the speed-up against spey-pyhf and the largest |difference| of ``1 - CLs`` from spey-pyhf's.

    .venv/bin/python benchmarks/bench_spey.py [--patches 200] [--device cpu]

``--parity`` instead compares, on every shared workspace's reference patches
(``reference.json``: three of ``patchset.json`` each), spey's ``exclusion_confidence_level``
(observed, aposteriori, apriori) and, on the first ``--limits`` of them, ``poi_upper_limit``
(the three again) through our backend and through spey-pyhf: a table of both and their
difference (absolute for ``1 - CLs``, relative for limits: spey's root finder stops at
``rtol=1e-4``). Where they differ by more than 1e-4, spey-pyhf fitted at ``tol=1e-10`` too.

    .venv/bin/python benchmarks/bench_spey.py --parity [--limits 1]
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path

import spey

from pyhf_gpu_client import Client
from pyhf_gpu_client.spey import exclusion_confidence_levels

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from service_support import running_server
from workspaces import WORKSPACES_DIR, analysis_names, read_json

ANALYSIS = "atlas-susy-2018-31-sbottom-B"


def alive(patch: list[dict]) -> bool:
    """Whether the patch adds a positive signal somewhere (spey returns no CLs otherwise)."""
    return any(v > 0 for op in patch for v in (op.get("value") or {}).get("data", []))


def parity(server_url: str, limits: int) -> None:
    """Ours against spey-pyhf on every shared workspace's reference patches (a table)."""
    client = Client(server_url, timeout=600)
    expectations = [spey.ExpectationType.observed, "aposteriori", spey.ExpectationType.apriori]
    print("| workspace | patch | quantity | pyhf-gpu | spey-pyhf | diff | spey-pyhf tol=1e-10 |")
    print("|---|---|---|---:|---:|---:|---:|")
    for analysis in analysis_names():
        folder = WORKSPACES_DIR / analysis
        background = read_json(folder / "BkgOnly.json")
        patches = {
            p["metadata"]["name"]: p["patch"]
            for p in read_json(folder / "patchset.json")["patches"]
        }
        reference = read_json(folder / "reference.json")["reference"]["results"]
        for k, name in enumerate(r["patch"] for r in reference):
            ours = spey.get_backend("pyhf-gpu")(
                background_only_model=background, signal_patch=patches[name], client=client
            )
            theirs = spey.get_backend("pyhf")(
                background_only_model=background, signal_patch=patches[name]
            )
            asks = {"CLs": _cls, **({"upper limit": _limit} if k < limits else {})}
            for quantity, ask in asks.items():
                for expected in expectations:
                    a, b = ask(ours, expected), ask(theirs, expected)
                    rel = quantity != "CLs"
                    diff = max(
                        abs(x - y) / (abs(y) if rel else 1.0) for x, y in zip(a, b, strict=True)
                    )
                    tight = ""
                    if diff > 1e-4:
                        tight = " ".join(f"{v:.6g}" for v in ask(theirs, expected, tight=True))
                    label = getattr(expected, "name", expected)
                    print(
                        f"| {analysis} | {name} | {quantity} {label} | "
                        f"{' '.join(f'{v:.6g}' for v in a)} | {' '.join(f'{v:.6g}' for v in b)} | "
                        f"{diff:.1e} | {tight} |",
                        flush=True,
                    )
    client.close()


def _cls(model, expected, tight: bool = False) -> list[float]:
    """spey's 1 - CLs (observed: one; aposteriori and apriori: the expected five)."""
    options = {"tol": 1e-10} if tight else {}
    if expected == "aposteriori":  # the expected set of the fits to the data ("all")
        return [float(v) for v in model.exclusion_confidence_level(expected="all", **options)[1]]
    return [float(v) for v in model.exclusion_confidence_level(expected=expected, **options)]


def _limit(model, expected, tight: bool = False) -> list[float]:
    if expected == "aposteriori":
        expected = spey.ExpectationType.aposteriori
    options = {"optimiser_arguments": {"tol": 1e-10}} if tight else {}
    return [float(model.poi_upper_limit(expected=expected, **options))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--patches", type=int, default=200)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--parity", action="store_true", help="compare on reference patches")
    parser.add_argument("--limits", type=int, default=1, help="patches with upper limits")
    args = parser.parse_args()
    logging.getLogger("Spey").setLevel(logging.ERROR)
    if args.parity:
        with (
            tempfile.TemporaryDirectory() as tmp,
            running_server(Path(tmp), ["--device", args.device]) as server,
        ):
            parity(server.url, args.limits)
        return
    background = read_json(WORKSPACES_DIR / ANALYSIS / "BkgOnly.json")
    points = read_json(WORKSPACES_DIR / ANALYSIS / "patchset.hepdata.json")["patches"]
    signals = {p["metadata"]["name"]: p["patch"] for p in points if alive(p["patch"])}
    names = list(signals)[: args.patches]
    signals = {name: signals[name] for name in names}
    rows = []
    with (
        tempfile.TemporaryDirectory() as tmp,
        running_server(Path(tmp), ["--device", args.device]) as server,
    ):
        client = Client(server.url, timeout=600)
        warm = read_json(WORKSPACES_DIR / "atlas-susy-2018-31-sbottom-A" / "BkgOnly.json")
        warm_patch = read_json(WORKSPACES_DIR / "atlas-susy-2018-31-sbottom-A" / "patchset.json")
        exclusion_confidence_levels(warm, [warm_patch["patches"][0]["patch"]], client=client)

        start = time.perf_counter()
        batched = exclusion_confidence_levels(background, signals, client=client)
        rows.append(
            ("`exclusion_confidence_levels` (one request)", time.perf_counter() - start, batched)
        )

        start = time.perf_counter()
        ours = {}
        for name in names:
            model = spey.get_backend("pyhf-gpu")(
                background_only_model=background, signal_patch=signals[name], client=client
            )
            ours[name] = model.exclusion_confidence_level()
        rows.append(("spey + `pyhf-gpu` backend, per patch", time.perf_counter() - start, ours))
        client.close()

    start = time.perf_counter()
    reference = {}
    for name in names:
        model = spey.get_backend("pyhf")(
            background_only_model=background, signal_patch=signals[name]
        )
        reference[name] = model.exclusion_confidence_level()
    rows.append(("spey + spey-pyhf (`pyhf`), per patch", time.perf_counter() - start, reference))

    # where spey-pyhf differs by more than 1e-4, is its own fit (SLSQP, tol=1e-6) the cause?
    wide = [n for n in names if abs(batched[n][0] - reference[n][0]) > 1e-4]
    tight = {}
    for name in wide:
        model = spey.get_backend("pyhf")(
            background_only_model=background, signal_patch=signals[name]
        )
        tight[name] = model.exclusion_confidence_level(tol=1e-10)

    peer = rows[-1][1]
    print(
        f"\n{len(names)} signal patches of {ANALYSIS} (observed 1 - CLs, q~, POI 1), "
        f"device {args.device}\n"
    )
    print("| how | seconds | per patch (ms) | vs spey-pyhf | max abs diff of 1 - CLs |")
    print("|---|---:|---:|---:|---:|")
    for label, seconds, values in rows:
        diff = max(abs(values[n][0] - reference[n][0]) for n in names)
        print(
            f"| {label} | {seconds:.1f} | {1000 * seconds / len(names):.0f} | "
            f"{peer / seconds:.1f}x | {diff:.1e} |"
        )
    print(f"\n{len(wide)} patches differ from spey-pyhf by more than 1e-4; against spey-pyhf ")
    print("fitted at tol=1e-10 (1 - CLs: ours, spey-pyhf, spey-pyhf tol=1e-10):\n")
    for name in wide:
        ours_, default, fitted = batched[name][0], reference[name][0], tight[name][0]
        print(f"- {name}: {ours_:.6g}, {default:.6g}, {fitted:.6g} ({abs(ours_ - fitted):.1e})")


if __name__ == "__main__":
    main()
