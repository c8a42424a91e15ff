"""Where the slowest fits of a hypothesis test spend their iterations: curvature on the path.

The engine call of a published patchset lasts as long as its slowest rows: the conditional
fits at mu = 1 of strongly excluded points (BENCHMARKS.md). For each named patch of a shared
workspace's published patchset, the conditional fit at mu = 1 to the observed data, as a
hypothesis test runs it (default options), stopped after every ``--every``-th iteration
(the minimiser is deterministic: the fit stopped after ``k`` iterations is at its ``k``-th
iterate). At each such iterate:

- twice NLL (less its data-only constant) and the gradient's norm on the free parameters;
- the two smallest eigenvalues of the exact Hessian (``torch.func``) on the free parameters:
  negative, the likelihood is not convex there;
- how many iterations plain Newton on the exact Hessian (a Cholesky solve, the step halved
  until it descends) needs from there to the minimiser's criterion (Newton decrement below
  ``tol``), against the iterations the fit itself still runs.

Usage::

    python benchmarks/bench_tail.py atlas-susy-2018-31-sbottom-B sbottom_400_300_60 ...
        [--patchset patchset.hepdata.json.gz] [--every 10]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_patchsets import WORKSPACES, patches_of, read

from pyhf_gpu_server.engine import HistFactoryModel
from pyhf_gpu_server.engine.translate import WorkspaceTranslator
from pyhf_gpu_server.inference import mle
from pyhf_gpu_server.inference.minimize import MinimizeOptions
from pyhf_gpu_server.inference.objective import TwiceNLL

NEWTON_MAX_ITER = 50


def conditional_fit(model: HistFactoryModel, max_iter: int) -> mle.FitResults:
    """The conditional fit at mu = 1 to the observed data, stopped after ``max_iter``."""
    options = mle.FitOptions(minimize=replace(MinimizeOptions(), max_iter=max_iter))
    element = torch.zeros(1, dtype=torch.long)
    return mle.fixed_poi_fit(model, 1.0, element=element, options=options, uncertainties=False)


def exact_newton(objective: TwiceNLL, x: torch.Tensor, free: torch.Tensor, tol: float) -> int | str:
    """Iterations of plain Newton on the exact Hessian from ``x [1, P]`` until the Newton
    decrement is below ``tol``; ``"not PD"`` where the Hessian on the way is not positive
    definite, ``"> NEWTON_MAX_ITER"`` where it takes longer."""
    rows = torch.arange(1)
    for iteration in range(NEWTON_MAX_ITER + 1):
        exact = objective.derivatives(x, rows)
        g, H = exact.g[0][free], exact.H[0][free][:, free]
        factor, info = torch.linalg.cholesky_ex(H)
        if info.item() != 0:
            return "not PD"
        step = -torch.cholesky_solve(g.unsqueeze(-1), factor).squeeze(-1)
        if -(g @ step).item() <= tol:
            return iteration
        length, before = 1.0, exact.f[0].item()
        while True:
            trial = x.clone()
            trial[0, free] = x[0, free] + length * step
            if objective.value(trial, rows)[0].item() < before or length < 1e-6:
                break
            length /= 2
        x = trial
    return f"> {NEWTON_MAX_ITER}"


def path(model: HistFactoryModel, every: int) -> list[dict]:
    """The table's rows for one model (see the module doc)."""
    full = conditional_fit(model, MinimizeOptions().max_iter)
    total = int(full.iterations[0])
    fixed = model.fixed[0].clone()
    fixed[model.poi_index] = True
    free = ~fixed
    objective = TwiceNLL(model, model.observed.reshape(1, -1), torch.zeros(1, dtype=torch.long))
    tol = MinimizeOptions().tol
    out = []
    for k in range(0, total + 1, every):
        x = model.init[:1].clone() if k == 0 else conditional_fit(model, k).bestfit
        x[0, model.poi_index] = 1.0
        exact = objective.derivatives(x, torch.arange(1))
        eigenvalues = torch.linalg.eigvalsh(exact.H[0][free][:, free])
        out.append(
            {
                "iterate": k,
                "twice_nll": exact.f[0].item(),
                "gradient": exact.g[0][free].norm().item(),
                "eigenvalues": eigenvalues[:2].tolist(),
                "newton": exact_newton(objective, x, free, tol),
                "fit_left": total - k,
            }
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workspace")
    parser.add_argument("patches", nargs="+")
    parser.add_argument("--patchset", default="patchset.hepdata.json.gz")
    parser.add_argument("--every", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(2)
    translator = WorkspaceTranslator(read(WORKSPACES / args.workspace / "BkgOnly.json"))
    by_name = dict(patches_of(args.workspace, args.patchset))
    print(
        f"Conditional fits at mu = 1 to the observed data ({args.workspace}, {args.patchset}), "
        "stopped after every "
        f"{args.every}th iteration; exact Newton: iterations to the same criterion from there "
        "(not PD: the exact Hessian on its way is not positive definite).\n"
    )
    print(
        "| patch | iterate | twice NLL (less its constant) | gradient norm | smallest exact "
        "Hessian eigenvalues | exact Newton from here | the fit's iterations left |"
    )
    print("|---|---|---|---|---|---|---|")
    with torch.inference_mode():
        for name in args.patches:
            model = HistFactoryModel([translator.element(by_name[name], name)])
            for row in path(model, args.every):
                low = ", ".join(f"{v:.3f}" for v in row["eigenvalues"])
                print(
                    f"| {name} | {row['iterate']} | {row['twice_nll']:.6f} | "
                    f"{row['gradient']:.2e} | {low} | {row['newton']} | {row['fit_left']} |"
                )


if __name__ == "__main__":
    main()
