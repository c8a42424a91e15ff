"""Statistical inference on batched HistFactory models: pyhf's ``infer``, batched on a device.

Every function works on ``B`` rows at once (a row: one element of the model, one dataset
and, for tests, one POI value), keeps every tensor on the model's device in its dtype, and
runs the fits of one stage as a single batched minimisation.
"""

from .asymptotics import AsymptoticCalculator
from .goodness_of_fit import GoodnessOfFitResults, goodness_of_fit
from .hypotest import hypotest, join_toy_parts
from .minimize import MinimizeOptions, minimize
from .mle import FitOptions, fit, fixed_poi_fit
from .ranking import RankingResults, ranking
from .results import FitResults, HypotestResults, SignificanceResults, UpperLimitResults
from .scan import Scan2DResults, ScanResults, scan, scan2d
from .significance import significance, significance_of
from .toys import ToyCalculator
from .upper_limits import upper_limit
from .yields import YieldSet, YieldsResults, yields

__all__ = [
    "AsymptoticCalculator",
    "FitOptions",
    "FitResults",
    "GoodnessOfFitResults",
    "HypotestResults",
    "MinimizeOptions",
    "RankingResults",
    "Scan2DResults",
    "ScanResults",
    "SignificanceResults",
    "ToyCalculator",
    "UpperLimitResults",
    "YieldSet",
    "YieldsResults",
    "fit",
    "fixed_poi_fit",
    "goodness_of_fit",
    "hypotest",
    "join_toy_parts",
    "minimize",
    "ranking",
    "scan",
    "scan2d",
    "significance",
    "significance_of",
    "upper_limit",
    "yields",
]
