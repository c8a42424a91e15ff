"""Inference benchmark: this package against pyhf (numpy, JAX) and NextStat, side by side.

Workloads, on the shared workspaces (patch ``sig_s1_x1`` unless said otherwise):

(a) one hypotest (``mu = 1``, qtilde, CLs observed + expected set),
(b) a 64-point ``test_poi`` scan,
(c) all 24 patches of the patchset at ``mu = 1``,
(d) 1000 toys (toy-based CLs at ``mu = 1``),
(e) upper limits by root finding (observed + 5 expected).

Model construction (pyhf's parsing) is never timed. Ours: one warm-up call, then the median
of up to five timed calls within 3 s (a CUDA synchronisation before each clock stops); peers
alike, without the warm-up but JAX's. Peers run in their own virtual environment
(``--peer-python``, default ``/tmp/bench-venv/bin/python``) in a subprocess; slow peer loops
are timed on a few items and extrapolated, and marked so in the table.

Usage::

    python benchmarks/bench_inference.py                      # CPU, all peers
    python benchmarks/bench_inference.py --device cuda --peers none --out -
    PYHF_GPU_TEST_DEVICE=cuda python benchmarks/bench_inference.py --goals
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from peers import run_peer

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
from workspaces import WORKSPACES_DIR as WORKSPACES  # noqa: E402 (tests/data/workspaces)
from workspaces import read_json  # noqa: E402

ALL = sorted(p.parent.name for p in WORKSPACES.glob("*/reference.json"))
PATCH = "sig_s1_x1"
SCAN = [0.05 + i * (5.0 - 0.05) / 63 for i in range(64)]

from pyhf_gpu_server.allocator import tune_cpu_allocator  # noqa: E402
from pyhf_gpu_server.engine import HistFactoryModel  # noqa: E402
from pyhf_gpu_server.inference import hypotest, upper_limit  # noqa: E402


def load(name: str) -> tuple[dict, dict]:
    folder = WORKSPACES / name
    return read_json(folder / "BkgOnly.json"), read_json(folder / "patchset.json")


def timed(
    fn: Callable[[], object], device: torch.device, warm: bool = True, budget: float = 3.0
) -> tuple[float, object]:
    """Seconds of a call of ``fn`` (after a warm-up call), and its result: the median of up
    to five calls while they fit in ``budget`` seconds (single calls vary)."""
    if warm:
        fn()
    seconds = []
    while len(seconds) < 5 and (not seconds or sum(seconds) + seconds[-1] <= budget):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds), out


def ours(names: list[str], tasks: set[str], device: torch.device, ntoys: int) -> dict:
    """Our timings ``{task: {workspace: {"s": seconds, ...}}}`` in float64, and float32 for a, c."""
    results: dict = {}
    for name in names:
        workspace, patchset = load(name)
        patch = next(p for p in patchset["patches"] if p["metadata"]["name"] == PATCH)["patch"]
        one = HistFactoryModel.from_workspace(workspace, patches=[patch], device=device)
        one32 = one.to(dtype=torch.float32)
        if "a" in tasks:
            s, r64 = timed(lambda m=one: hypotest(m, 1.0), device)
            s32, r32 = timed(lambda m=one32: hypotest(m, 1.0), device)
            dev = max(_deviation(r64, r32))
            results.setdefault("a", {})[name] = {
                "s": s,
                "s32": s32,
                "dev32": dev,
                "cls": r64.cls_obs.item(),
            }
        if "b" in tasks:
            scan = torch.tensor(SCAN, dtype=one.dtype, device=device)
            s, _ = timed(lambda m=one, x=scan: hypotest(m, x), device)
            s32, _ = timed(lambda m=one32, x=scan: hypotest(m, x.float()), device)
            results.setdefault("b", {})[name] = {"s": s, "s32": s32}
        if "d" in tasks:
            s, r = timed(
                lambda m=one: hypotest(m, 1.0, calctype="toybased", ntoys=ntoys, seed=1),
                device,
                warm=False,
            )
            results.setdefault("d", {})[name] = {"s": s, "cls": r.cls_obs.item(), "ntoys": ntoys}
        if "e" in tasks:
            s, r = timed(lambda m=one: upper_limit(m), device)
            results.setdefault("e", {})[name] = {
                "s": s,
                "obs": r.obs.item(),
                "hypotests": int(r.hypotests[0]),
            }
        if "c" in tasks:
            every = HistFactoryModel.from_patchset(workspace, patchset, device=device)
            every32 = every.to(dtype=torch.float32)
            s, r64 = timed(lambda m=every: hypotest(m, 1.0), device)
            s32, r32 = timed(lambda m=every32: hypotest(m, 1.0), device)
            results.setdefault("c", {})[name] = {
                "s": s,
                "s32": s32,
                "dev32": max(_deviation(r64, r32)),
                "converged": bool(r64.converged.all()),
            }
        print(
            f"ours {name}: {json.dumps({t: results[t][name] for t in results if name in results[t]})}",
            flush=True,
        )
    return results


def _deviation(a, b) -> list[float]:
    return [
        (a.cls_obs - b.cls_obs.double()).abs().max().item(),
        (a.cls_exp - b.cls_exp.double()).abs().max().item(),
    ]


# --------------------------------------------------------------------------- peers
PEER = r"""
import gzip, json, os, statistics, sys, time
import numpy as np
cfg = json.loads(sys.stdin.read())
peer, names, tasks, budget = cfg["peer"], cfg["names"], set(cfg["tasks"]), cfg["budget"]
def read(path):  # x.json, or x.json.gz where only that is on disk
    if os.path.exists(path):
        return json.load(open(path))
    return json.loads(gzip.decompress(open(path + ".gz", "rb").read()))
import pyhf
from pyhf.tensor.numpy_backend import numpy_backend
numpy_backend.percentile = lambda self, t, q, axis=None, interpolation="linear": np.percentile(t, q, axis=axis, method=interpolation)
if peer == "pyhf-jax":
    pyhf.set_backend("jax")
elif peer == "pyhf-numpy":
    pyhf.set_backend("numpy")
else:
    import nextstat
t_start = time.time()
out = {}
def left():
    return budget - (time.time() - t_start)
def clock(fn):  # median of up to five calls within 3 s, as ours
    seconds = []
    while len(seconds) < 5 and (not seconds or sum(seconds) + seconds[-1] <= 3.0):
        t = time.perf_counter(); r = fn(); seconds.append(time.perf_counter() - t)
    return statistics.median(seconds), r
def guarded(task, name, fn):
    try:
        fn()
    except Exception as exc:  # a peer failing a task is a result too
        emit(task, name, {"error": type(exc).__name__ + ": " + str(exc).splitlines()[0][:120]})
def emit(task, name, rec):
    out.setdefault(task, {})[name] = rec
    print("PEER", json.dumps({"task": task, "name": name, **rec}), file=sys.stderr, flush=True)
def build(ws, ps, patch):
    w = pyhf.PatchSet(ps).apply(pyhf.Workspace(ws), patch)
    if peer == "nextstat":
        return nextstat.from_pyhf(json.dumps(dict(w))), None
    m = w.model()
    return m, w.data(m)
def cls(model, data, mu):
    if peer == "nextstat":
        return nextstat.hypotest(mu, model)
    return pyhf.infer.hypotest(mu, data, model, return_expected_set=True)
def toys(model, data, n):
    if peer == "nextstat":
        return nextstat.hypotest_toys(1.0, model, n_toys=n, seed=1, expected_set=True)
    return pyhf.infer.hypotest(1.0, data, model, calctype="toybased", ntoys=n, return_expected_set=True, track_progress=False)
def limit(model, data):
    if peer == "nextstat":
        return nextstat.upper_limit(model, method="root")
    return pyhf.infer.intervals.upper_limits.upper_limit(data, model, level=0.05)
for name in names:
    ws, ps = (read(cfg["dir"] + "/" + name + "/" + file) for file in ("BkgOnly.json", "patchset.json"))
    model, data = build(ws, ps, cfg["patch"])
    first = clock(lambda: cls(model, data, 1.0))[0] if peer == "pyhf-jax" else None
    def task_a():
        s, _ = clock(lambda: cls(model, data, 1.0))
        emit("a", name, {"s": s, "first_call_s": first, "items": 1, "of": 1})
    def task_b():
        k = 64 if peer == "nextstat" else 2
        s, _ = clock(lambda: [cls(model, data, mu) for mu in cfg["scan"][:k]])
        emit("b", name, {"s": s * 64 / k, "items": k, "of": 64})
    def task_c():
        patches = [p["metadata"]["name"] for p in ps["patches"]]
        k = 24 if peer == "nextstat" else 2
        built = [build(ws, ps, p) for p in patches[:k]]
        if peer == "pyhf-jax":
            cls(*built[0], 1.0)  # warm for this structure
        s, _ = clock(lambda: [cls(m, d, 1.0) for m, d in built])
        emit("c", name, {"s": s * 24 / k, "items": k, "of": 24})
    def task_d():
        k = 100 if peer == "nextstat" else 3
        if peer == "pyhf-jax":
            toys(model, data, 1)
        s, _ = clock(lambda: toys(model, data, k))
        emit("d", name, {"s": s * cfg["ntoys"] / k, "items": k, "of": cfg["ntoys"]})
    def task_e():
        s, r = clock(lambda: limit(model, data))
        obs = r[0] if isinstance(r, tuple) else r
        emit("e", name, {"s": s, "obs": float(obs), "items": 1, "of": 1})
    for key, fn in (("a", task_a), ("b", task_b), ("c", task_c), ("d", task_d), ("e", task_e)):
        if key in tasks and left() > 0:
            guarded(key, name, fn)
print(json.dumps(out))
"""


def peers(
    peer_names: list[str],
    names: list[str],
    tasks: set[str],
    python: str,
    ntoys: int,
    budget: float,
    threads: int,
) -> dict:
    """Each peer's timings, from a subprocess in the peers' virtual environment."""
    found = {}
    for peer in peer_names:
        cfg = {
            "peer": peer,
            "names": names,
            "tasks": sorted(tasks),
            "dir": str(WORKSPACES),
            "patch": PATCH,
            "scan": SCAN,
            "ntoys": ntoys,
            "budget": budget,
        }
        print(f"running peer {peer} ...", flush=True)
        proc = run_peer(python, PEER, cfg, threads)
        for line in proc.stderr.splitlines():
            if line.startswith("PEER"):
                print(peer, line[5:], flush=True)
        try:
            found[peer] = json.loads(proc.stdout.strip().splitlines()[-1])
        except (IndexError, json.JSONDecodeError):
            print(f"peer {peer} failed:\n{proc.stderr[-3000:]}", flush=True)
            found[peer] = {}
    return found


TASKS = {
    "a": "one hypotest (mu=1)",
    "b": "64-point scan",
    "c": "24 patches",
    "d": "toys",
    "e": "upper limit (root finding)",
}


def markdown(our: dict, peer: dict, device: torch.device, ntoys: int) -> str:
    """The results table: times and ratios (peer time / our float64 time)."""
    lines = [
        f"Device: {device} ({torch.get_num_threads()} threads), torch {torch.__version__}. "
        "Times in seconds; ratio = peer time / our float64 time. "
        "`~` marks a peer time extrapolated from the items it was timed on (k/n).",
        "",
        "| task | workspace | ours f64 | ours f32 | f32 max abs CLs dev | "
        + " | ".join(peer)
        + " |",
        "|---|---|---|---|---|" + "---|" * len(peer),
    ]
    for task, title in TASKS.items():
        for name, rec in our.get(task, {}).items():
            row = [title if task != "d" else f"{ntoys} toys", name, f"{rec['s']:.3f}"]
            row.append(f"{rec['s32']:.3f}" if "s32" in rec else "")
            row.append(f"{rec['dev32']:.1e}" if "dev32" in rec else "")
            for p in peer:
                theirs = peer[p].get(task, {}).get(name)
                if not theirs:
                    row.append("n/a")
                    continue
                if "error" in theirs:  # details in the run's log
                    row.append(f"fails ({theirs['error'].split(':')[0]})")
                    continue
                mark = "~" if theirs.get("items", 1) < theirs.get("of", 1) else ""
                note = f" ({theirs['items']}/{theirs['of']})" if mark else ""
                row.append(f"{mark}{theirs['s']:.2f}{note} = {theirs['s'] / rec['s']:.1f}x")
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def goals(device: torch.device) -> None:
    """The H200 goals: 480 hypotests (24 patches x 20 test_poi) on the largest workspace, 10^4 toys."""
    largest = max(
        ALL, key=lambda n: json.loads((WORKSPACES / n / "reference.json").read_text())["npars"]
    )
    workspace, patchset = load(largest)
    every = HistFactoryModel.from_patchset(workspace, patchset, device=device)
    pois = torch.linspace(0.1, 4.0, 20, dtype=every.dtype, device=device)
    s, r = timed(lambda: hypotest(every, pois), device)
    print(
        f"GOAL 480 hypotests on {largest}: {s:.3f} s (goal < 1 s), converged {bool(r.converged.all())}"
    )
    one = HistFactoryModel.from_workspace(
        workspace, patches=[patchset["patches"][0]["patch"]], device=device
    )
    s, r = timed(lambda: hypotest(one, 1.0, calctype="toybased", ntoys=10_000, seed=1), device)
    print(
        f"GOAL 10^4 toys on {largest}: {s:.3f} s (goal < 5 s), converged {bool(r.converged.all())}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default=os.environ.get("PYHF_GPU_TEST_DEVICE", "cpu"))
    parser.add_argument("--workspaces", nargs="*", default=ALL)
    parser.add_argument("--tasks", default="abcde")
    parser.add_argument(
        "--detail",
        nargs="*",
        default=["atlas-susy-2018-31-sbottom-B", "atlas-susy-2018-04-stau"],
        help="workspaces for the scan, toys and limits (b, d, e)",
    )
    parser.add_argument("--ntoys", type=int, default=1000)
    parser.add_argument("--peers", nargs="*", default=["pyhf-numpy", "pyhf-jax", "nextstat"])
    parser.add_argument("--peer-python", default="/tmp/bench-venv/bin/python")
    parser.add_argument("--peer-budget", type=float, default=420.0, help="seconds per peer")
    parser.add_argument(
        "--out",
        default="-",
        help="markdown file to write ('-': stdout only; BENCHMARKS.md takes it)",
    )
    parser.add_argument("--goals", action="store_true", help="also time the H200 goals")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="CPU threads for us (torch) and the peers' numpy/BLAS (OMP_NUM_THREADS etc.)",
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    tune_cpu_allocator()  # as pyhf-gpu-server's process: in-process times match it
    tasks = set(args.tasks)
    broad, detail = tasks & {"a", "c"}, tasks - {"a", "c"}
    our = ours(args.workspaces, broad, device, args.ntoys)
    for task, recs in ours(
        [n for n in args.workspaces if n in args.detail], detail, device, args.ntoys
    ).items():
        our[task] = recs
    peer_names = [p for p in args.peers if p != "none"]
    theirs = {}
    if peer_names:
        budget = args.peer_budget / 2
        theirs.update(
            peers(
                peer_names,
                args.workspaces,
                broad,
                args.peer_python,
                args.ntoys,
                budget,
                args.threads,
            )
        )
        detail_names = [n for n in args.workspaces if n in args.detail]
        more = peers(
            peer_names, detail_names, detail, args.peer_python, args.ntoys, budget, args.threads
        )
        for p, recs in more.items():
            theirs.setdefault(p, {}).update(recs)
    table = markdown(our, theirs, device, args.ntoys)
    print(table)
    if args.out != "-":
        Path(args.out).write_text("# Inference benchmark\n\n" + table)
    if args.goals:
        goals(device)


if __name__ == "__main__":
    main()
