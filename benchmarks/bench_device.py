"""The same hypotests eager and compiled, with CUDA graphs and without, in float64 and float32,
on one device (prints a markdown table; ``gpu_check.sh`` runs it on cuda).

Cases: a published patchset (the stau heterogeneous signals, 24 patches, one POI each: the
low-rank solver) and a generated analysis (``generate_large.py``; the block solver). Variants:
eager float64 (the reference), eager float32, ``torch.compile`` (default mode) float64, and
``torch.compile(mode="reduce-overhead")`` float64 (CUDA graphs; cuda only). Each: one call to
warm up (compiles), then the median of ``--repeats`` timed calls (synchronised); the largest
CLs difference from the reference.

    .venv/bin/python benchmarks/bench_device.py --device cuda [--large 40x40x500]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import generate_large
from workspaces import WORKSPACES_DIR as WORKSPACES  # tests/data/workspaces, or the env's
from workspaces import read_json

from pyhf_gpu_server.engine import HistFactoryModel, KernelCache
from pyhf_gpu_server.inference.hypotest import hypotest


def _read(path: Path) -> dict:
    return read_json(path)  # ``x.json`` may be ``x.json.gz`` on disk


def cases(large: tuple[int, int, int]) -> list[tuple[str, dict, dict | None]]:
    found = []
    stau = WORKSPACES / "atlas-susy-2018-04-stau"
    if stau.exists():
        patchset = _read(stau / "patchset.heterogeneous.json")
        found.append(("stau, 24 heterogeneous patches", _read(stau / "BkgOnly.json"), patchset))
    channels, bins, systematics = large
    spec = generate_large.workspace(channels=channels, bins=bins, systematics=systematics)
    found.append((f"generated {channels} x {bins} bins, {systematics} systematics", spec, None))
    return found


def run(model: HistFactoryModel, repeats: int) -> tuple[float, torch.Tensor]:
    def call():
        result = hypotest(model, [1.0])
        values = torch.cat([result.cls_obs.unsqueeze(-1), result.cls_exp], -1)
        if model.device.type == "cuda":
            torch.cuda.synchronize(model.device)
        return values

    call()  # warm-up: compiles, records graphs
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        values = call()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds), values.double().cpu()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--large", default="40x40x500", help="channels x bins x systematics")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-compile", action="store_true", help="eager variants only")
    args = parser.parse_args()
    large = tuple(int(v) for v in args.large.split("x"))
    variants = [("eager", torch.float64, None), ("eager", torch.float32, None)]
    if not args.no_compile:
        variants.append(("compiled", torch.float64, "default"))
        if args.device.startswith("cuda"):
            variants.append(("compiled, CUDA graphs", torch.float64, "reduce-overhead"))
    print(f"torch {torch.__version__} on {args.device}\n")
    print("| case | variant | dtype | seconds | vs eager float64 | max abs CLs difference |")
    print("|---|---|---|---|---|---|")
    for name, spec, patchset in cases(large):
        reference = None
        for label, dtype, mode in variants:
            if patchset is None:
                model = HistFactoryModel.from_workspace(spec, device=args.device, dtype=dtype)
            else:
                model = HistFactoryModel.from_patchset(
                    spec, patchset, device=args.device, dtype=dtype
                )
            if mode is not None:
                model.enable_compile(KernelCache(None if mode == "default" else mode))
            seconds, values = run(model, args.repeats)
            if reference is None:
                reference = (seconds, values)
            ratio = reference[0] / seconds
            diff = (values - reference[1]).abs().max().item()
            print(
                f"| {name} | {label} | {str(dtype).removeprefix('torch.')} | {seconds:.3f} "
                f"| {ratio:.2f}x | {diff:.1e} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
