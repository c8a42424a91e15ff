"""One-time costs paid at start-up, before the server says it is ready.

The first JSON-schema check compiles pyhf's schemas; the first model built and the first fit
on a device initialise torch's kernels and linear algebra. Paid here, on the build and device
threads, a user's first request costs only its own work.
"""

from __future__ import annotations

import torch

from pyhf_gpu_server import inference
from pyhf_gpu_server.engine import HistFactoryModel, schema

SCHEMAS = ("workspace.json", "patchset.json", "jsonpatch.json")

# two bins, every kind of modifier the fit path meets: normfactor, lumi, normsys, histosys,
# staterror and shapesys
WORKSPACE = {
    "channels": [
        {
            "name": "SR",
            "samples": [
                {
                    "name": "signal",
                    "data": [4.0, 6.0],
                    "modifiers": [
                        {"name": "mu", "type": "normfactor", "data": None},
                        {"name": "lumi", "type": "lumi", "data": None},
                    ],
                },
                {
                    "name": "background",
                    "data": [50.0, 40.0],
                    "modifiers": [
                        {"name": "norm", "type": "normsys", "data": {"hi": 1.1, "lo": 0.9}},
                        {
                            "name": "shape",
                            "type": "histosys",
                            "data": {"hi_data": [52.0, 41.0], "lo_data": [48.0, 39.0]},
                        },
                        {"name": "staterror_SR", "type": "staterror", "data": [2.0, 2.0]},
                        {"name": "uncorr", "type": "shapesys", "data": [3.0, 3.0]},
                    ],
                },
            ],
        }
    ],
    "observations": [{"name": "SR", "data": [53.0, 44.0]}],
    "measurements": [
        {
            "name": "m",
            "config": {
                "poi": "mu",
                "parameters": [
                    {
                        "name": "lumi",
                        "auxdata": [1.0],
                        "sigmas": [0.02],
                        "inits": [1.0],
                        "bounds": [[0.5, 1.5]],
                    }
                ],
            },
        }
    ],
    "version": "1.0.0",
}


def build(device: str, dtype: torch.dtype) -> HistFactoryModel:
    """Compile the schema validators and build the small model (on the build thread)."""
    for name in SCHEMAS:
        schema.compiled(name)
    schema.validate(WORKSPACE, "workspace.json")
    return HistFactoryModel.from_workspace(WORKSPACE, device=device, dtype=dtype)


def infer(model: HistFactoryModel) -> None:
    """Fit and test the small model (on the device thread)."""
    poi = torch.ones(2, dtype=model.dtype, device=model.device)
    inference.hypotest(model, poi, element=torch.zeros(2, dtype=torch.long, device=model.device))
