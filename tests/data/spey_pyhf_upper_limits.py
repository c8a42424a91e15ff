"""Writes ``spey_pyhf_upper_limits.json``: spey-pyhf's ``poi_upper_limit`` of the published
sbottom-B point ``sig_s1_x1`` (ATLAS-SUSY-2018-31 region B, 60 parameters) for each
expectation type, the reference of
``tests/test_spey_backend.py::test_shared_workspace_upper_limits_agree_with_spey_pyhf``.

Each limit is spey's own root search (``rtol=1e-4``) over spey-pyhf's likelihood (pyhf's
numpy backend, spey's SLSQP fits), with its default optimiser options and again with
``tol=1e-10`` (where SLSQP's default stops above the minimum of a flat likelihood): about a
minute of fits on one core, which is why the test reads them from here.

Run from the repository root (``.venv`` with spey and spey-pyhf)::

    .venv/bin/python tests/data/spey_pyhf_upper_limits.py
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    sys.path.insert(0, str(HERE.parent))
    import spey
    import spey_pyhf
    from test_spey_backend import EXPECTATIONS, SHARED, as_list, shared

    logging.getLogger("Spey").setLevel(logging.ERROR)
    background, patch = shared()
    theirs = spey.get_backend("pyhf")(background_only_model=background, signal_patch=patch)
    limits = {}
    for expected in EXPECTATIONS:
        limits[str(expected)] = {
            "default": as_list(theirs.poi_upper_limit(expected=expected)),
            "tol=1e-10": as_list(
                theirs.poi_upper_limit(expected=expected, optimiser_arguments={"tol": 1e-10})
            ),
        }
        print(expected, limits[str(expected)], flush=True)
    out = {
        "what": "spey-pyhf poi_upper_limit per expectation type, with default optimiser "
        "options and with tol=1e-10",
        "workspace": SHARED[0],
        "patch": SHARED[1],
        "spey": spey.__version__,
        "spey_pyhf": spey_pyhf.__version__,
        "limits": limits,
    }
    (HERE / "spey_pyhf_upper_limits.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
