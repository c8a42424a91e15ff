"""Running a peer's script (pyhf, NextStat, ...) in the peers' own virtual environment."""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any

THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def run_peer(
    python: str, script: str, payload: Any, threads: int | None = None, **options: Any
) -> subprocess.CompletedProcess[str]:
    """``python -c script`` with ``payload`` as JSON on its stdin, its output captured as text.

    ``threads``: the BLAS/OpenMP threads it may use (``THREAD_VARIABLES``; None: as inherited);
    ``options`` go to ``subprocess.run`` (``timeout``, ``check``).
    """
    env = (
        None if threads is None else {**os.environ, **dict.fromkeys(THREAD_VARIABLES, str(threads))}
    )
    return subprocess.run(
        [python, "-c", script],
        input=json.dumps(payload),
        capture_output=True,
        text=True,
        env=env,
        **options,
    )
