"""The operations the service answers, by name (``POST /<name>``, a job's ``operation``).

Example:
    >>> sorted(OPERATIONS)
    ['cls', 'fit', 'likelihood', 'ranking', 'scan', 'significance', 'upper-limit', 'yields']
    >>> OPERATIONS["cls"].request_model.__name__, OPERATIONS["cls"].pois_field
    ('ClsRequest', 'test_poi')
"""

from __future__ import annotations

import functools
import operator
from typing import Any, Literal

from pydantic import create_model

from ..schemas import JobViewBase, _Declared
from .base import EngineRows, Operation, RowResult, RowStatus
from .cls import Cls
from .fit import Fit
from .likelihood import Likelihood
from .ranking import Ranking
from .scan import Scan
from .significance import Significance
from .upper_limit import UpperLimit
from .yields import Yields

__all__ = [
    "OPERATIONS",
    "EngineRows",
    "JobList",
    "JobView",
    "Operation",
    "RowResult",
    "RowStatus",
    "operation_named",
]

_ALL = (Cls(), Fit(), UpperLimit(), Significance(), Ranking(), Scan(), Yields(), Likelihood())
OPERATIONS: dict[str, Operation] = {op.name: op for op in _ALL}


def operation_named(name: str) -> Operation:
    """The operation called ``name``; ``KeyError`` if there is none."""
    return OPERATIONS[name]


_RESPONSE: Any = functools.reduce(operator.or_, (op.response_model for op in OPERATIONS.values()))
JobView = create_model(
    "JobView",
    __base__=JobViewBase,
    operation=(Literal[tuple(OPERATIONS)], ...),  # type: ignore[arg-type]  # names at run time
    result=(_RESPONSE | None, None),
)
JobView.__doc__ = JobViewBase.__doc__
JobList = create_model("JobList", __base__=_Declared, jobs=(list[JobView], ...))
JobList.__doc__ = "GET /jobs: newest first."
