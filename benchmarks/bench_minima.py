"""Several minima of smooth published likelihoods: the conditional fits at ``mu = 1``.

pyhf's default interpolation codes (code4p histosys, code4 normsys) are smooth, and our fits
of such models run one start (:mod:`pyhf_gpu_server.inference.starts`). This measures what one
start misses. Per named patch of a shared workspace's published patchset, the fit of the
observed data with the POI fixed at 1 (the conditional fit of a hypothesis test):

- ours from the model's init (what a hypothesis test runs) and from ``--starts`` seeded
  random start points (every free parameter moved by ``N(0, sigma)``, clipped to its bounds),
  all rows in one batched call;
- the lowest minimum found, how many distinct minima (twice NLL rounded to 1e-3) the starts
  reached (converged, with a gradient below 1e-3 on the parameters off their bounds), the
  smallest eigenvalue of the exact Hessian on those parameters over those minima (positive:
  each is a true local minimum), and how many starts were flagged converged although their
  gradient there is not ~0;
- pyhf's ``fixed_poi_fit`` (numpy, scipy) from its init.

Usage::

    python benchmarks/bench_minima.py atlas-susy-2018-31-sbottom-B sbottom_400_370_240 ...
        [--starts 32] [--sigma 0.5] [--seed 1]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_patchsets import WORKSPACES, patches_of, read

from pyhf_gpu_server.engine import HistFactoryModel
from pyhf_gpu_server.engine.translate import WorkspaceTranslator
from pyhf_gpu_server.inference import mle
from pyhf_gpu_server.inference.objective import TwiceNLL


def pyhf_conditional(background: dict, patch: list) -> float:
    """pyhf's twice NLL of the conditional fit at ``mu = 1`` (numpy, scipy)."""
    import jsonpatch
    import pyhf

    pyhf.set_backend("numpy", "scipy")
    workspace = pyhf.Workspace(jsonpatch.apply_patch(background, patch))
    model = workspace.model()
    fit = pyhf.infer.mle.fixed_poi_fit(1.0, workspace.data(model), model, return_fitted_val=True)
    return float(fit[1])


def minima(model: HistFactoryModel, starts: int, sigma: float, seed: int) -> dict:
    """Our conditional fits at ``mu = 1`` from the init (row 0) and ``starts`` random points."""
    rows = starts + 1
    element = torch.zeros(rows, dtype=torch.long)
    poi = torch.ones(rows, dtype=model.dtype)
    init, bounds = model.init[0], model.bounds[0]
    fixed = model.fixed[0].clone()
    fixed[model.poi_index] = True  # fixed_poi_fit fixes it at 1
    generator = torch.Generator().manual_seed(seed)
    moved = sigma * torch.randn(rows, init.shape[0], generator=generator, dtype=model.dtype)
    moved[0] = 0.0
    lo, hi = bounds.select(-1, 0), bounds.select(-1, 1)
    start = torch.where(fixed, init, torch.minimum(torch.maximum(init + moved, lo), hi))
    with torch.inference_mode():
        fit = mle.fixed_poi_fit(model, poi, element=element, init=start, uncertainties=False)
        objective = TwiceNLL(model, model.observed.expand(rows, -1), element)
        exact = objective.derivatives(fit.bestfit, torch.arange(rows))  # exact g and Hessian
    gradient, hessian = exact.g, exact.H
    values = fit.best_twice_nll
    inside = ~fixed & (fit.bestfit > lo + 1e-8) & (fit.bestfit < hi - 1e-8)
    steep = (gradient.abs() * inside).amax(1) > 1e-3
    claimed = fit.converged & torch.isfinite(values)
    minimum = claimed & ~steep  # a converged fit whose gradient off the bounds is ~0
    smallest = min(
        torch.linalg.eigvalsh(hessian[i][inside[i]][:, inside[i]])[0].item()
        for i in minimum.nonzero().flatten().tolist()
    )
    found = values[minimum]
    return {
        "init": values[0].item(),
        "init_minimum": bool(minimum[0]),
        "lowest": found.min().item(),
        "distinct": len({round(v, 3) for v in found.tolist()}),
        "minima": int(minimum.sum()),
        "steep_claims": int((claimed & steep).sum()),
        "smallest_eigenvalue": smallest,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workspace", help="a folder of the shared workspaces")
    parser.add_argument("patches", nargs="+", help="patch names of its published patchset")
    parser.add_argument("--patchset", default="patchset.hepdata.json.gz")
    parser.add_argument("--starts", type=int, default=32)
    parser.add_argument("--sigma", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    background = read(WORKSPACES / args.workspace / "BkgOnly.json")
    by_name = dict(patches_of(args.workspace, args.patchset))
    translator = WorkspaceTranslator(background)
    print(
        f"{args.workspace}, conditional fits at mu = 1, {args.starts} random starts "
        f"(sigma {args.sigma}, seed {args.seed})\n"
    )
    print(
        "| patch | ours from the init | lowest found | distinct minima (starts at one) "
        "| smallest Hessian eigenvalue there | converged, gradient not ~0 | pyhf |"
    )
    print("|---|---|---|---|---|---|---|")
    for name in args.patches:
        model = HistFactoryModel([translator.element(by_name[name], name)])
        found = minima(model, args.starts, args.sigma, args.seed)
        flag = "" if found["init_minimum"] else " (not a minimum)"
        print(
            f"| {name} | {found['init']:.4f}{flag} | {found['lowest']:.4f} | "
            f"{found['distinct']} ({found['minima']}/{args.starts + 1}) | "
            f"{found['smallest_eigenvalue']:.3f} | {found['steep_claims']} | "
            f"{pyhf_conditional(background, by_name[name]):.4f} |"
        )


if __name__ == "__main__":
    main()
