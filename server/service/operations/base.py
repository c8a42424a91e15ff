"""The typed seam between the service and the inference layer: one :class:`Operation` per
kind of question (``cls``, ``fit``, ...), each with its options model, its result model and
the one batched inference call that answers its rows.

The service plans a request into rows (an element, and for ``cls`` a tested POI value), the
scheduler batches rows of any requests with equal operation and options, and the device
thread calls :meth:`Operation.run` once per batch with the rows as tensors on the model's
device. Adding an operation is one such object (registered in ``operations/__init__.py``),
one route (generated from the registry) and one client method.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Generic, TypeVar, cast

import pydantic
import torch
from pydantic import BaseModel
from torch import Tensor

from pyhf_gpu_server import inference
from pyhf_gpu_server.engine import HistFactoryModel
from pyhf_gpu_server.engine.layout import ElementLayout
from pyhf_gpu_server.execution import EngineRows
from pyhf_gpu_server.inference.results import HypotestResults
from pyhf_gpu_server.inference.toys import TOY_BLOCK, ToySlice

from ..schemas import CalculatorOptions, ModelSelection, PatchError, ResultFlag, result_flag

OptionsT = TypeVar("OptionsT", bound=BaseModel)

#: parameters above which a toy-based hypothesis is cut finer than a block of toys: a part
#: then holds about ``TOY_BLOCK * TOY_PART_PARAMETERS / parameters`` toys (a toy's fits cost
#: at least in proportion to the parameters), so its progress moves and it gives the device
#: back between parts; at least ``TOY_PART_MIN``, as every part fits the data again (the 4
#: observed fits, against about 3 fits a toy)
TOY_PART_PARAMETERS = 256
TOY_PART_MIN = 10


def toy_part_size(layout: ElementLayout | None) -> int:
    """Toys per part of a toy-based hypothesis on the element ``layout`` (None: not read yet).

    >>> from types import SimpleNamespace as Layout
    >>> [toy_part_size(Layout(n_pars=n)) for n in (119, 256, 1047, 2107, 20000)]
    [50, 50, 12, 10, 10]
    """
    if layout is None or layout.n_pars <= TOY_PART_PARAMETERS:
        return TOY_BLOCK
    return max(TOY_PART_MIN, TOY_BLOCK * TOY_PART_PARAMETERS // layout.n_pars)


@dataclass(frozen=True)
class RowStatus:
    """How a row's fits went, for its ``meta``: all converged, start points per fit, and
    whether the starts agreed (None where the operation runs no such fits); for a toy-based
    test, ``toys``: how many of its toys' fits did not converge, of how many toys (both
    hypotheses'), and whether its fits to the data converged."""

    converged: bool | None = None
    starts: int | None = None
    starts_agreed: bool | None = None
    toys: tuple[int, int, bool] | None = None

    @classmethod
    def of(cls, result: Any, rows: int) -> list[RowStatus]:
        """Per row, the ``converged``/``starts``/``starts_agreed`` tensors of an inference
        result (copied to the host once per result, not once per row)."""
        columns = []
        for name in ("converged", "starts", "starts_agreed"):
            value = getattr(result, name, None)
            columns.append([None] * rows if value is None else value.tolist())
        return [cls(*values) for values in zip(*columns, strict=True)]

    @classmethod
    def of_hypotests(cls, tests: HypotestResults) -> list[RowStatus]:
        """:meth:`of` hypothesis tests, with their toys' fits counted where toy-based."""
        statuses = cls.of(tests, len(tests))
        if tests.toys is None:
            return statuses
        data = [s.converged for name, s in tests.fits.items() if name != "toys"]
        data_converged = torch.stack(data).all(0).tolist()
        toys = zip(tests.toys.signal, tests.toys.background, strict=True)
        totals = [len(signal) + len(background) for signal, background in toys]
        counts = zip(tests.toys.unconverged.tolist(), totals, data_converged, strict=True)
        return [replace(s, toys=c) for s, c in zip(statuses, counts, strict=True)]

    @classmethod
    def joined(cls, parts: list[RowStatus]) -> RowStatus:
        """One hypothesis' status from its parts': all converged, the most start points, all
        agreed (None where a part has no such fits)."""
        converged = [p.converged for p in parts]
        starts = [p.starts for p in parts]
        agreed = [p.starts_agreed for p in parts]
        return cls(
            None if None in converged else all(converged),
            None if None in starts else max(s for s in starts if s is not None),
            None if None in agreed else all(agreed),
        )

    def flags(self) -> list[ResultFlag]:
        """The ``meta.flags`` this status calls for: fits that did not converge, starts that
        disagree."""
        found = []
        failed, toys, data_converged = self.toys or (0, 0, False)
        if self.converged is False and failed and data_converged:
            found.append(
                result_flag(
                    "not_converged",
                    f"the fits of {failed} of its {toys} toys did not converge (meta.converged "
                    "false): their test statistics may not be the minimum's, so each p-value "
                    f"may be off by up to {failed} in {toys // 2}; its fits to the data converged",
                )
            )
        elif self.converged is False:
            among = f" (those of {failed} of its {toys} toys among them)" if failed else ""
            found.append(
                result_flag(
                    "not_converged",
                    f"its fits did not converge{among} (meta.converged false): its numbers may "
                    "not be the minimum's",
                )
            )
        if self.starts_agreed is False:
            found.append(
                result_flag(
                    "starts_disagree",
                    "its fits from extra starts reached different minima (meta.starts_agreed "
                    "false): the answer is the lowest found",
                )
            )
        return found


def hypotests(
    model: HistFactoryModel,
    poi: Tensor | float,
    rows: EngineRows,
    options: CalculatorOptions,
    test_stat: str,
) -> HypotestResults:
    """``inference.hypotest`` of ``rows`` at ``poi``, with the calculator ``options``."""
    calc = options.model_dump(include={"calctype", "ntoys", "seed"})  # pyhf's keywords
    return inference.hypotest(
        model, poi, rows.element, toys=rows.toys, options=rows.fit, test_stat=test_stat, **calc
    )


def qtilde_bound_flags(model: HistFactoryModel, element: Tensor) -> list[tuple[ResultFlag, ...]]:
    """Per row of a ``q~`` test on elements ``element [B]``, ``qtilde_poi_bound`` where its
    POI's lower bound is not 0 (pyhf's ``qmu_tilde`` warns there): below 0 the fits raise it
    to 0 (:attr:`Operation.floors_poi`), above 0 they never reach 0, where q~'s asymptotic
    formulae put the boundary."""
    poi = model.poi_index
    if poi is None:
        return [()] * element.shape[0]
    lows = model.bounds[:, poi, 0].tolist()  # per element, the model's (not floored) bound
    flags: dict[int, tuple[ResultFlag, ...]] = {}
    for e, low in enumerate(lows):
        if low == 0.0:
            flags[e] = ()
            continue
        why = (
            "the fits here raise it to 0 (pyhf warns and fits within it)"
            if low < 0.0
            else "the free fits never reach 0, where q~'s asymptotic formulae put the boundary "
            "(pyhf warns, then raises ValueError: its Asimov fit at POI 0 lies outside the bounds)"
        )
        flags[e] = (
            result_flag(
                "qtilde_poi_bound",
                f"q~ assumes the POI bounded below at 0, and the POI {model.poi_name!r} has the "
                f"lower bound {low:g}: {why}; test_stat 'q' suits such bounds",
            ),
        )
    return [flags[e] for e in element.tolist()]


def background_only_flags(model: HistFactoryModel, element: Tensor) -> list[tuple[ResultFlag, ...]]:
    """Per row of a hypothesis test on elements ``element [B]``, ``background_only_impossible``
    where the element's data have events in bins that only the POI's samples can fill
    (:attr:`~pyhf_gpu_server.engine.layout.ElementLayout.poi_only_bins`), naming the first."""
    flags: dict[int, tuple[ResultFlag, ...]] = {}
    for e in set(element.tolist()):
        layout = model.stack.elements[e]
        bins = layout.poi_only_bins
        if not bins:
            flags[e] = ()
            continue
        more = f" (and {len(bins) - 1} more bins)" if len(bins) > 1 else ""
        detail = (
            f"{layout.bin_name(bins[0])}{more} has {layout.observed[bins[0]]:g} observed events "
            f"where only samples scaled by the POI {model.poi_name!r} predict any: the data "
            "have no probability at POI = 0, so the background-only fits have no minimum "
            "(pyhf's fail); the answer rests on where they stopped"
        )
        flags[e] = (result_flag("background_only_impossible", detail),)
    return [flags[e] for e in element.tolist()]


def uncertainty_flags(
    labels: Sequence[str], uncertainties: Sequence[float | None]
) -> tuple[ResultFlag, ...]:
    """``undetermined_parameters`` where some of the parameters ``labels`` have no
    uncertainty (NaN or None; fixed ones have 0), naming the first few.

    >>> [f.detail[:46] for f in uncertainty_flags(["a", "b[0]"], [0.5, float("nan")])]
    ['1 of 2 parameters have no uncertainty: the lik']
    """
    missing = [label for label, u in zip(labels, uncertainties, strict=True) if u is None or u != u]
    if not missing:
        return ()
    named = ", ".join(missing[:5]) + (", ..." if len(missing) > 5 else "")
    if len(missing) < len(labels):
        why = "the likelihood has no curvature along them at the best fit, alone or with others "
        why += "(a shapefactor of a bin without events on its bound 0; a second normfactor of "
        why += "one sample): the other uncertainties hold them there"
    else:
        why = "the Hessian at the best fit is not positive definite (a direction the data do "
        why += "not constrain)"
    detail = f"{len(missing)} of {len(labels)} parameters have no uncertainty: {why} ({named})"
    return (result_flag("undetermined_parameters", detail),)


@dataclass(frozen=True)
class RowResult:
    """One row's answer: the operation's answer model (its result model without ``meta``)
    and how its fits went; for a slice of a toy row, ``part``: what
    :meth:`Operation.join` joins into the hypothesis' answer (on the host, picklable)."""

    answer: BaseModel
    status: RowStatus
    part: Any = None
    flags: tuple[ResultFlag, ...] = ()  # the operation's own meta.flags


class Operation(ABC, Generic[OptionsT]):
    """One kind of question the service answers.

    Class attributes: ``name`` (route ``POST /<name>``, job ``operation``), ``summary``,
    ``options_model`` (its pydantic options; the request is the model selection plus these),
    ``result_model`` (one row's JSON: the answer :meth:`run` makes, a model of its only
    ``*Answer`` base, plus ``meta``), ``pois_field`` (the option whose values multiply the
    rows, answered as a list when it is one; None: a row per element).
    """

    name: ClassVar[str]
    summary: ClassVar[str]
    options_model: ClassVar[type[BaseModel]]
    result_model: ClassVar[type[BaseModel]]
    pois_field: ClassVar[str | None] = None

    def __init__(self) -> None:
        title = "".join(part.title() for part in self.name.split("-"))
        self.request_model: type[ModelSelection] = pydantic.create_model(
            f"{title}Request",
            # a subclass of both (the stub types __base__ as bases of one type)
            __base__=(ModelSelection, self.options_model),  # type: ignore[arg-type]
            __doc__=f"POST /{self.name} envelope: a model selection and the options.",
        )
        self.response_model: Any = self._response_model()

    def _response_model(self) -> Any:
        """One result (or, with ``pois_field``, a list of them), or ``{patch_name: result |
        error}`` for a patchset."""
        # a union built at run time from the class attribute: no static type
        result: Any = self.result_model
        if self.pois_field is not None:
            result = result | list[result]
        return result | dict[str, result | PatchError]

    def options_of(self, request: BaseModel) -> OptionsT:
        """The options part of a validated request."""
        fields = set(self.options_model.model_fields)
        given = request.model_dump(include=fields, exclude_unset=True)  # defaults stay unset
        # options_model is OptionsT's class (a ClassVar cannot be typed with a type variable)
        return cast(OptionsT, self.options_model.model_validate(given))

    def tested_values(self, options: OptionsT) -> tuple[str, list[float]] | None:
        """The option naming POI values to test and its values, which must lie within the
        POI's bounds (pyhf refuses to start a fit outside them); None when there are none."""
        return None

    def floors_poi(self, options: OptionsT) -> bool:
        """Whether the fits raise the POI's lower bound to 0 (``q~``)."""
        return False

    def toys(self, options: OptionsT) -> int:
        """Toys per hypothesis (0: asymptotic formulae, no toys): the calculator options'."""
        return getattr(options, "toys", 0)

    def row_cost(self, options: OptionsT) -> float:
        """About how many fits a row runs (sizes the chunks of jobs by time): a toy row is
        a slice of at most :data:`~pyhf_gpu_server.inference.toys.TOY_BLOCK` toys."""
        return 4.0 + 3.0 * min(self.toys(options), TOY_BLOCK)

    def parts(
        self, options: OptionsT, layout: ElementLayout | None
    ) -> list[tuple[int, int]] | None:
        """The parts ``(first, stop)`` a hypothesis on the element ``layout`` is cut into, a
        row each, whose results :meth:`join` joins (None: one row, uncut); ``layout`` None:
        as far as known before the patches are read (progress' first total). Here: a
        toy-based test's toys, in slices of :func:`toy_part_size`."""
        ntoys = self.toys(options)
        if not ntoys:
            return None
        return [(s.first, s.stop) for s in ToySlice.cut(0, ntoys, toy_part_size(layout))]

    def long_parts(self, options: OptionsT, layout: ElementLayout) -> bool:
        """Whether the parts (:meth:`parts`) of a hypothesis on ``layout`` are long work:
        they run in the jobs lane even for a synchronous request, a chunk at a time between
        interactive work, rather than all in one interactive engine call. Here: toys cut
        finer than a block (:func:`toy_part_size`: a large model)."""
        return self.toys(options) > 0 and toy_part_size(layout) < TOY_BLOCK

    def join(self, parts: list[RowResult]) -> RowResult:
        """One hypothesis' answer from its parts' results (in the order of :meth:`parts`);
        operations that cut hypotheses say how."""
        if len(parts) == 1 and parts[0].part is None:
            return parts[0]
        raise NotImplementedError(f"{self.name} has no parts to join")

    def element_problem(self, layout: ElementLayout, options: OptionsT) -> str | None:
        """Why ``options`` cannot be answered on the element (patch) ``layout``, or None:
        that patch answers its own 422 entry, the others their results. Here: a tested POI
        value (``test_poi``, an upper-limit ``scan``) outside the POI's bounds (raised to 0
        by ``q~``), where pyhf refuses to start a fit."""
        tested = self.tested_values(options)
        if tested is None or layout.poi_index is None:
            return None
        field, values = tested
        lo, hi = (float(v) for v in layout.bounds[layout.poi_index])
        floored = self.floors_poi(options) and lo < 0.0
        if floored:
            lo = 0.0
        outside = [v for v in values if not lo <= v <= hi]
        if not outside:
            return None
        why = " (q~, test_stat 'qtilde', bounds the POI below at 0)" if floored else ""
        return (
            f"{field} value {outside[0]!r} lies outside the bounds [{lo!r}, {hi!r}] of the POI "
            f"{layout.poi_name!r}{why}; pyhf refuses to start a fit there: test values inside "
            "the bounds, or widen them in the measurement's parameters"
        )

    @abstractmethod
    def run(self, model: HistFactoryModel, rows: EngineRows, options: OptionsT) -> list[RowResult]:
        """ONE batched inference call answering ``rows`` (on the device thread)."""
