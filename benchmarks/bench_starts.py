"""What the extra starts of kinked likelihoods cost, and what they change.

pyhf's default interpolation codes (code4p histosys, code4 normsys) are smooth: those fits run
once, as before. With ``code0`` histosys and ``code1`` normsys (kinked at 0) every fit also
runs extra starts (:mod:`pyhf_gpu_server.inference.starts`). Per shared workspace, with those
codes, all 24 patches of ``patchset.json`` at ``mu = 1`` (qtilde, observed + expected CLs):

- ours with the extra starts (the default) and with one start (``FitOptions(starts=None)``),
  the median of a few timed calls after a warm-up (``bench_inference.timed``), and pyhf (numpy, its own single-start fits) on
  one patch, times 24;
- how many patches' CLs changed by more than 1e-6, and the largest change.

Usage::

    python benchmarks/bench_starts.py [--device cpu] [--out BENCHMARKS-starts.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_inference import ALL, load, timed  # noqa: E402

from pyhf_gpu_server.engine import HistFactoryModel  # noqa: E402
from pyhf_gpu_server.inference import hypotest  # noqa: E402
from pyhf_gpu_server.inference.mle import FitOptions  # noqa: E402

KINKED = {"histosys": {"interpcode": "code0"}, "normsys": {"interpcode": "code1"}}


def pyhf_one_patch(workspace: dict, patchset: dict) -> float:
    import pyhf

    pyhf.set_backend("numpy", "scipy")
    patch = pyhf.PatchSet(patchset).patches[0]
    ws = pyhf.Workspace(patch.apply(workspace))
    model = ws.model(modifier_settings=KINKED)
    data = ws.data(model)
    start = time.perf_counter()
    pyhf.infer.hypotest(1.0, data, model, test_stat="qtilde", return_expected_set=True)
    return time.perf_counter() - start


def run(name: str, device: torch.device, pyhf_too: bool) -> dict:
    workspace, patchset = load(name)
    model = HistFactoryModel.from_patchset(
        workspace, patchset, modifier_settings=KINKED, device=device
    )
    many, res_many = timed(lambda: hypotest(model, 1.0), device, budget=30.0)
    one, res_one = timed(lambda: hypotest(model, 1.0, options=FitOptions(starts=None)), device)
    obs_many = torch.cat([res_many.cls_obs.unsqueeze(1), res_many.cls_exp], 1)
    obs_one = torch.cat([res_one.cls_obs.unsqueeze(1), res_one.cls_exp], 1)
    change = (obs_many - obs_one).abs().amax(1)
    row = {
        "workspace": name,
        "parameters": model.n_pars,
        "kinked_parameters": int(model.kinked_params.numel()),
        "patches": model.n_elements,
        "starts_per_fit": int(res_many.starts.max()),
        "ours_extra_starts_s": round(many, 3),
        "ours_one_start_s": round(one, 3),
        "cost_of_extra_starts": round(many / one, 2),
        "patches_changed": int((change > 1e-6).sum()),
        "largest_cls_change": float(change.max()),
        "converged_extra_starts": int(res_many.converged.sum()),
        "converged_one_start": int(res_one.converged.sum()),
    }
    if pyhf_too:
        row["pyhf_24_patches_s"] = round(24 * pyhf_one_patch(workspace, patchset), 2)
        row["pyhf_over_ours_extra_starts"] = round(row["pyhf_24_patches_s"] / many, 1)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--no-pyhf", action="store_true")
    parser.add_argument("--out", default="-")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(2)
    rows = [run(name, device, not args.no_pyhf) for name in ALL]
    text = json.dumps({"device": str(device), "results": rows}, indent=1)
    if args.out == "-":
        print(text)
    else:
        Path(args.out).write_text(text)
        print(text)


if __name__ == "__main__":
    main()
