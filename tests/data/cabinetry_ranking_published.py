"""Writes ``cabinetry_ranking_published.json``: cabinetry's ``fit.ranking`` impacts of a few
parameters of three published likelihoods, the reference of
``tests/test_inference_ranking.py::test_ranking_matches_cabinetry``.

cabinetry (``fit.ranking``, MINUIT at ``tolerance=1e-6``, pyhf's numpy backend) is handed this
repository's nominal fit (CPU, float64: best fit and post-fit uncertainties, the
``fit_results`` argument) and ranks only the named parameters (the others' uncertainties set
to 0, which its loop skips): both then fit at the very same fixed values, and the impacts
differ only by the fits. Its MINUIT fits take ~20 s a workspace on one core, which is why the
test reads them from here; where an impact differs from this file by more than the test's
tolerance, the test runs that conditional fit again with cabinetry's fitter, in the test.

Run from the repository root after a change to the nominal fit (``.venv`` with cabinetry)::

    .venv/bin/python tests/data/cabinetry_ranking_published.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    sys.path.insert(0, str(HERE.parent))
    import cabinetry
    import pyhf
    from test_inference_ranking import CASES, MINUIT_TOLERANCE, cabinetry_impacts, published

    from pyhf_gpu_server.inference import ranking

    pyhf.set_backend("numpy")
    cases = []
    for name, patch, labels in CASES:
        ours_model, model, data = published(name, patch)
        ours = ranking(ours_model, parameters=labels)
        impacts = cabinetry_impacts(model, data, ours, labels)
        cases.append({"workspace": name, "patch": patch, "impacts": impacts})
        print(name, impacts, flush=True)
    out = {
        "what": "cabinetry.fit.ranking impacts from this repository's nominal fit, "
        "[prefit_up, prefit_down, postfit_up, postfit_down] per parameter",
        "cabinetry": cabinetry.__version__,
        "pyhf": pyhf.__version__,
        "tolerance": MINUIT_TOLERANCE,
        "cases": cases,
    }
    (HERE / "cabinetry_ranking_published.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
