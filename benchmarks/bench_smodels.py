#!/usr/bin/env python3
"""SModelS 3.2.1 end to end, its default pyhf path beside Spey's ("pyhf", "pyhf-gpu").

Runs ``runSModelS`` on one SLHA point against one SModelS database analysis with pyhf
likelihoods, once per mode, each in its own process (``nice -n 10``, bounded by
``--timeout``), and prints a side-by-side table: wall time, time in theory predictions
(SModelS's own log line), the upper limits and r values it reports, and how many fits ran.

Modes (docs/SMODELS.md explains them):

- ``default``: SModelS's own pyhf code (``smodels/statistics/pyhfInterface.py``);
- ``spey``: ``[experimentalFeatures] spey = True``, Spey's ``"pyhf"`` backend (spey-pyhf);
- ``pyhf-gpu``: the same, with Spey's ``"pyhf"`` mapped to ``"pyhf-gpu"``
  (``pyhf_gpu_client.spey``) by a ``[custom-codes]`` file: the pyhf-gpu service fits.

SModelS is not a dependency of this repository: run it with a Python that has
``smodels==3.2.1`` (and ``spey``/``spey-pyhf`` for the spey modes), e.g.::

    python3 -m venv /tmp/smodels-venv
    /tmp/smodels-venv/bin/pip install smodels==3.2.1 spey==0.2.7 spey-pyhf==0.2.2 httpx
    python benchmarks/bench_smodels.py --smodels-python /tmp/smodels-venv/bin/python \\
        --database /tmp/smodels-db/db --slha T6bbHH_pyhf.slha --server http://127.0.0.1:8000

The ``pyhf-gpu`` mode needs ``pyhf_gpu_client`` importable by that Python with its spey entry
point; without an install, ``--client-shim DIR`` builds one (a link to ``client/`` plus an
``entry_points.txt``) and puts it on ``PYTHONPATH``. A mode whose requirements are missing is
skipped with the reason.

The database: SModelS 3.2.1 fetches its database at run time; offline, ``--make-database``
builds a one-analysis database (ATLAS-SUSY-2018-31, three pyhf workspaces, T6bbHH
efficiency maps) from SModelS's former unit-test database (``test/database`` in the
SModelS git history, e.g. commit 34d8a4b59), rewriting its SModelS-2 ``jsonFiles`` into
SModelS 3's ``regionMappings``/``regionSets``/``statModels``. The SLHA point is that
history's ``test/testFiles/slha/T6bbHH_pyhf.slha``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

ANALYSIS = "ATLAS-SUSY-2018-31-eff"
SIGNAL_REGIONS = ["SRA_L", "SRA_M", "SRA_H", "SRB", "SRC_22", "SRC_24", "SRC_26", "SRC_28"]

# SModelS 3 format of the analysis' statistical models (SModelS 2 had
# jsonFiles: {"BkgOnlyA.json": ["SRA_L", "SRA_M", "SRA_H"], "BkgOnlyB.json": ["SRB"], ...})
_REGION_MAPPINGS = {
    "SRA_L": {"pyhf": "SR_meff[0]"},
    "SRA_M": {"pyhf": "SR_meff[1]"},
    "SRA_H": {"pyhf": "SR_meff[2]"},
    "A_VRtt": {"pyhf": "VRtt_meff", "type": "VR"},
    "A_CRtt": {"pyhf": "CRtt_meff", "type": "CR"},
    "SRB": {"pyhf": "SR_cuts"},
    "B_CRtt": {"pyhf": "CRtt_cuts", "type": "CR"},
    "B_VRtt": {"pyhf": "VRtt_cuts", "type": "VR"},
    "SRC_22": {"pyhf": "SR_metsigST[0]"},
    "SRC_24": {"pyhf": "SR_metsigST[1]"},
    "SRC_26": {"pyhf": "SR_metsigST[2]"},
    "SRC_28": {"pyhf": "SR_metsigST[3]"},
    "C_CRtt": {"pyhf": "CRtt_cuts", "type": "CR"},
    "C_VRzAlt": {"pyhf": "VRzAlt_cuts", "type": "VR"},
    "C_CRz": {"pyhf": "CRz_cuts", "type": "CR"},
    "C_VRtt": {"pyhf": "VRtt_cuts", "type": "VR"},
    "C_VRz": {"pyhf": "VRz_cuts", "type": "VR"},
}
_REGION_SETS = {
    "A": ["SRA_L", "SRA_M", "SRA_H", "A_VRtt", "A_CRtt"],
    "B": ["SRB", "B_CRtt", "B_VRtt"],
    "C": ["SRC_22", "SRC_24", "SRC_26", "SRC_28", "C_CRtt", "C_VRzAlt", "C_CRz", "C_VRtt", "C_VRz"],
}
_STAT_MODELS = '{"A": [("pyhf", "BkgOnlyA.json")], "B": [("pyhf", "BkgOnlyB.json")], "C": [("pyhf", "BkgOnlyC.json")]}'


def make_database(source: Path, target: Path) -> Path:
    """A SModelS 3.2.1 database with one analysis, from the SModelS-2 test database's
    ``13TeV/ATLAS/ATLAS-SUSY-2018-31-eff`` (``source``)."""
    ana = target / "13TeV" / "ATLAS" / ANALYSIS
    ana.mkdir(parents=True, exist_ok=True)
    (target / "version").write_text("pyhfgpu-test-321\n")
    for name in ("BkgOnlyA.json", "BkgOnlyB.json", "BkgOnlyC.json"):
        shutil.copy(source / name, ana / name)
    for sr in SIGNAL_REGIONS:
        (ana / sr).mkdir(exist_ok=True)
        shutil.copy(source / sr / "T6bbHH.txt", ana / sr / "T6bbHH.txt")
        lines = (source / sr / "dataInfo.txt").read_text().splitlines()
        (ana / sr / "dataInfo.txt").write_text(
            "\n".join(ln for ln in lines if not ln.startswith("jsonfile")) + "\n"
        )
    keep = ("id", "sqrts", "lumi", "prettyName", "url", "arxiv", "contact", "private", "lastUpdate")
    info = [
        ln
        for ln in (source / "globalInfo.txt").read_text().splitlines()
        if ln.split(":", 1)[0].strip() in keep
    ]
    info += [
        f"regionMappings: {json.dumps(_REGION_MAPPINGS)}",
        f"regionSets: {json.dumps(_REGION_SETS)}",
        f"statModels: {_STAT_MODELS}",
    ]
    (ana / "globalInfo.txt").write_text("\n".join(info) + "\n")
    return target


# -------------------------------------------------------------------- the runs

PARAMETERS = """[options]
checkInput = True
doInvisible = True
doCompress = True
testCoverage = False
computeStatistics = True
combineSRs = True
[particles]
model = share.models.mssm
promptWidth = 1e-11
stableWidth = 1e-25
[parameters]
sigmacut = 0.005
minmassgap = 5
minmassgapISR = 1
maxcond = 0.2
ncpus = 1
[database]
path = {database}
analyses = all
txnames = all
dataselector = all
[printer]
outputType = python
[python-printer]
addElementList = False
addTxWeights = False
addStatModel = False
[custom-codes]
files = {hooks}
"""

SPEY = "[experimentalFeatures]\nspey = True\n"

# exec'd by runSModelS ([custom-codes]): count the fits, dump the counts at exit
COUNTERS = r"""
import atexit as _atexit, collections as _col, json as _json, os as _os, time as _time
_calls, _secs = _col.Counter(), _col.Counter()
def _count(owner, name, key):
    inner = getattr(owner, name)
    def counted(*args, **kwargs):
        t0 = _time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            _calls[key] += 1
            _secs[key] += _time.perf_counter() - t0
    setattr(owner, name, counted)
import pyhf as _pyhf, pyhf.infer.mle as _mle
from pyhf.optimize.mixins import OptimizerMixin as _Opt
_count(_pyhf.infer, "hypotest", "pyhf.infer.hypotest")
_count(_mle, "fit", "pyhf.infer.mle.fit")
_count(_mle, "fixed_poi_fit", "pyhf.infer.mle.fixed_poi_fit")
_count(_Opt, "minimize", "pyhf minimizations")
try:
    import spey.interface.statistical_model as _sm
    _count(_sm, "fit", "spey scipy fits")
    _count(_sm.StatisticalModel, "poi_upper_limit", "spey poi_upper_limit")
except ImportError:
    pass
try:
    from pyhf_gpu_client.spey import PyhfGpuBackend as _GPU
    _count(_GPU, "_ask", "service requests")  # one POST /likelihood each
    _count(_GPU, "_at", "service requests")
except ImportError:
    pass
def _dump():
    with open(_os.environ["BENCH_SMODELS_COUNTS"], "w") as f:
        _json.dump({"calls": dict(_calls), "seconds": dict(_secs)}, f)
_atexit.register(_dump)
"""

# the few lines that make SModelS's Spey path use the pyhf-gpu service
PYHF_GPU = r"""
import spey as _spey
import smodels.statistics.speyTools as _speyTools
_speyTools.get_backend = lambda name: _spey.get_backend("pyhf-gpu" if name == "pyhf" else name)
"""

RUN = "import sys; from smodels.tools.runSModelS import main; sys.exit(main())"


def _has(python: str, module: str, env: dict[str, str]) -> bool:
    return (
        subprocess.run(
            [python, "-c", f"import {module}"], env=env, capture_output=True, timeout=120
        ).returncode
        == 0
    )


def make_shim(directory: Path) -> Path:
    """``pyhf_gpu_client`` (a link to ``client/``) and its spey entry point, importable from
    ``directory`` without installing this repository into SModelS's environment."""
    directory.mkdir(parents=True, exist_ok=True)
    link = directory / "pyhf_gpu_client"
    if not link.exists():
        link.symlink_to(REPO / "client")
    info = directory / "pyhf_gpu_shim-0.0.0.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: pyhf-gpu-shim\nVersion: 0.0.0\n")
    (info / "entry_points.txt").write_text(
        "[spey.backend.plugins]\npyhf-gpu = pyhf_gpu_client.spey:PyhfGpuBackend\n"
    )
    return directory


def smodels_python(args: argparse.Namespace) -> list[str]:
    """The command prefix of a ``python -c`` in SModelS's environment: niced, and killed after
    ``--timeout`` seconds."""
    return ["nice", "-n", "10", "timeout", str(args.timeout), args.smodels_python, "-c"]


def run_mode(mode: str, args: argparse.Namespace, work: Path) -> dict:
    env = dict(os.environ)
    if mode == "pyhf-gpu":
        if args.client_shim:
            env["PYTHONPATH"] = os.pathsep.join(
                [str(make_shim(Path(args.client_shim))), env.get("PYTHONPATH", "")]
            )
        if args.server:
            env["PYHF_GPU_SERVER"] = args.server
        if not env.get("PYHF_GPU_SERVER"):
            return {"skipped": "no --server / $PYHF_GPU_SERVER"}
        if not _has(args.smodels_python, "pyhf_gpu_client.spey", env):
            return {"skipped": "pyhf_gpu_client.spey not importable (try --client-shim)"}
    if mode in ("spey", "pyhf-gpu") and not _has(args.smodels_python, "spey_pyhf", env):
        return {"skipped": "spey / spey-pyhf not installed"}
    d = work / mode
    d.mkdir(parents=True, exist_ok=True)
    hooks = d / "hooks.py"
    hooks.write_text(COUNTERS + (PYHF_GPU if mode == "pyhf-gpu" else ""))
    params = PARAMETERS.format(database=args.database, hooks=hooks)
    if mode != "default":
        params = params.replace("[printer]", SPEY + "[printer]")
    (d / "parameters.ini").write_text(params)
    env["BENCH_SMODELS_COUNTS"] = str(d / "counts.json")
    out = d / "out"
    out.mkdir(exist_ok=True)
    cmd = [
        *smodels_python(args),
        RUN,
        "-p",
        str(d / "parameters.ini"),
        "-f",
        str(args.slha),
        "-o",
        str(out),
    ]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=d)
    wall = time.perf_counter() - t0
    (d / "log.txt").write_text(proc.stdout + proc.stderr)
    if proc.returncode == 124:
        return {"skipped": f"timed out after {args.timeout} s", "wall_s": wall}
    result_file = out / (Path(args.slha).name + ".py")
    if proc.returncode != 0 or not result_file.exists():
        log = (proc.stdout + proc.stderr).strip().splitlines()
        errors = [ln for ln in log if "Error" in ln or "quit unexpectedly" in ln]
        tail = (errors or log)[-3:]
        return {"skipped": f"exit {proc.returncode}: {' | '.join(tail)}", "wall_s": wall}
    ns: dict = {}
    exec(result_file.read_text(), ns)
    res = [r for r in ns["smodelsOutput"].get("ExptRes", []) if r.get("DataSetID") == "(combined)"]
    row = {"wall_s": wall, "result": res[0] if res else None}
    m = re.search(r"Finished theory prediction .* in ([0-9.]+) min", proc.stdout + proc.stderr)
    row["predictions_s"] = float(m.group(1)) * 60 if m else None
    counts = d / "counts.json"
    row["counts"] = json.loads(counts.read_text()) if counts.exists() else {}
    return row


def table(rows: dict[str, dict]) -> str:
    fields = [
        ("wall time (s)", lambda r: f"{r['wall_s']:.1f}"),
        (
            "theory predictions (s)",
            lambda r: f"{r['predictions_s']:.1f}" if r.get("predictions_s") else "?",
        ),
        ("theory prediction (fb)", lambda r: f"{r['result']['theory prediction (fb)']:.5g}"),
        ("upper limit (fb)", lambda r: f"{r['result']['upper limit (fb)']:.5g}"),
        ("expected upper limit (fb)", lambda r: f"{r['result']['expected upper limit (fb)']:.5g}"),
        ("r", lambda r: f"{r['result']['r']:.5g}"),
        ("r_expected", lambda r: f"{r['result']['r_expected']:.5g}"),
    ]
    keys = sorted({k for r in rows.values() for k in r.get("counts", {}).get("calls", {})})
    for k in keys:
        fields.append(
            (f"# {k}", lambda r, k=k: str(r.get("counts", {}).get("calls", {}).get(k, 0)))
        )
    modes = list(rows)
    lines = ["| | " + " | ".join(modes) + " |", "|---" * (len(modes) + 1) + "|"]
    for label, get in fields:
        cells = []
        for m in modes:
            r = rows[m]
            if "skipped" in r:
                cells.append("skipped")
                continue
            try:
                cells.append(get(r))
            except (KeyError, TypeError):
                cells.append("-")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    for m, r in rows.items():
        if "skipped" in r:
            lines.append(f"\n{m}: skipped ({r['skipped']})")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--smodels-python", default=os.environ.get("SMODELS_PYTHON", "/tmp/smodels-venv/bin/python")
    )
    ap.add_argument(
        "--database",
        default=os.environ.get("SMODELS_DATABASE", "/tmp/smodels-db/db"),
        help="a SModelS 3.2.1 database directory (text format)",
    )
    ap.add_argument(
        "--make-database",
        metavar="SRC",
        help=f"first build --database from SModelS-2's test/database/13TeV/ATLAS/{ANALYSIS}",
    )
    ap.add_argument("--slha", default="/tmp/smodels-run/T6bbHH_pyhf.slha")
    ap.add_argument("--modes", default="default,spey,pyhf-gpu")
    ap.add_argument(
        "--server", default=None, help="the pyhf-gpu service (default $PYHF_GPU_SERVER)"
    )
    ap.add_argument(
        "--client-shim",
        default=None,
        metavar="DIR",
        help="make pyhf_gpu_client (this checkout's client/) importable from DIR",
    )
    ap.add_argument("--timeout", type=int, default=1200, help="seconds per mode")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args()
    if args.make_database:
        make_database(Path(args.make_database), Path(args.database))
    args.slha = str(Path(args.slha).resolve())
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-smodels-"))
    # a first run pickles the text database (db3.pcl): do it outside the timings
    load = "import sys; from smodels.experiment.databaseObj import Database; Database(sys.argv[1])"
    subprocess.run([*smodels_python(args), load, args.database], capture_output=True)
    rows = {}
    for mode in args.modes.split(","):
        print(f"[bench_smodels] {mode} ...", file=sys.stderr, flush=True)
        rows[mode] = run_mode(mode, args, work)
    print(table(rows))
    print(f"\n(work files: {work})")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1, default=str))


if __name__ == "__main__":
    main()
