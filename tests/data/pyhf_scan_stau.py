"""Writes ``pyhf_scan_stau.json``: pyhf's ``-2 Delta ln L`` of the published stau workspace
(ATLAS-SUSY-2018-04, 119 parameters, first patch of ``patchset.json``) with
``TopSystHardCodeSR1`` fixed at each scanned value, the reference of
``tests/test_inference_scan.py::test_scan_matches_pyhf_on_stau``.

The values are ``pyhf.infer.mle.fit`` (numpy backend, scipy at ``tolerance=1e-12``) with the
parameter fixed at the value (its start value, as cabinetry's ``scan``) less pyhf's free fit:
the same ``pyhf_delta`` the test module uses live on the smaller sbottom-B workspace. Each
pyhf fit of this workspace takes ~6 s on one core, which is why the test reads them from here.

Run from the repository root (``.venv``)::

    .venv/bin/python tests/data/pyhf_scan_stau.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    sys.path.insert(0, str(HERE.parent))
    import pyhf
    from test_inference_scan import STAU, STAU_SCAN, pyhf_delta

    pyhf.set_backend("numpy", pyhf.optimize.scipy_optimizer(tolerance=1e-12))
    ((label, values),) = STAU_SCAN.items()
    deltas = [pyhf_delta(STAU, {label: value}) for value in values]
    out = {
        "what": "pyhf -2 Delta ln L with the parameter fixed at each value, less the free fit "
        "(numpy backend, scipy tolerance 1e-12)",
        "workspace": STAU,
        "patch": 0,
        "pyhf": pyhf.__version__,
        "parameter": label,
        "values": values,
        "delta_nlls": deltas,
    }
    (HERE / "pyhf_scan_stau.json").write_text(json.dumps(out, indent=1) + "\n")
    print(out)


if __name__ == "__main__":
    main()
