"""Statistical inference on batched HistFactory models (pyhf's ``infer``, batched on a device)."""

from .mle import FitOptions, fit, fixed_poi_fit
from .minimize import MinimizeOptions, minimize
from .results import FitResults, HypotestResults, SignificanceResults, UpperLimitResults

__all__ = [
    "FitOptions",
    "FitResults",
    "HypotestResults",
    "MinimizeOptions",
    "SignificanceResults",
    "UpperLimitResults",
    "fit",
    "fixed_poi_fit",
    "minimize",
]
