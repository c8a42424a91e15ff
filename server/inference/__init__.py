"""Statistical inference on batched HistFactory models: pyhf's ``infer``, batched on a device.

Every function works on ``B`` rows at once (a row: one element of the model, one dataset
and, for tests, one POI value), keeps every tensor on the model's device in its dtype, and
runs the fits of one stage as a single batched minimisation.
"""

from .asymptotics import AsymptoticCalculator
from .hypotest import hypotest
from .minimize import MinimizeOptions, minimize
from .mle import FitOptions, fit, fixed_poi_fit
from .results import FitResults, HypotestResults, SignificanceResults, UpperLimitResults
from .significance import significance
from .toys import ToyCalculator
from .upper_limits import upper_limit

__all__ = [
    "AsymptoticCalculator",
    "FitOptions",
    "FitResults",
    "HypotestResults",
    "MinimizeOptions",
    "SignificanceResults",
    "ToyCalculator",
    "UpperLimitResults",
    "fit",
    "fixed_poi_fit",
    "hypotest",
    "minimize",
    "significance",
    "upper_limit",
]
