"""Admission by cost: what a fit of a model holds in memory, which solver it uses, and which
requests are refused.

A batched fit holds, per row, the rate Jacobian over the ``N`` data (``N P`` numbers, twice
while a trial point is evaluated) and the curvature of ``-2 log L`` over the ``P`` parameters.
The dense solver keeps the ``P x P`` matrix, its factor, a secant term and the temporaries of
their assembly, and a fit's exact Hessian is built in column blocks: ``10 P^2`` in all (a
bound on the measured peak resident memory of CPU fits); the low-rank solver
(``inference/curvature.py``: diagonal + rank ``r`` Woodbury, ``r`` = main bins + secant pairs
+ unconstrained parameters) keeps ``2 r P + 2 r^2`` instead, and the block solver (the ``M``
per-bin parameters eliminated, ``K = P - M`` shared ones dense) ``3 N K + 4 K^2`` and its
secant columns' solves. Each adds what assembling the rate Jacobian holds
(:func:`assembly_numbers`). A workspace of 6000 bins with a staterror has ``P = 6001``: 3.8 GiB
a dense row, 4.3 MiB a block one. So before any work:

- the solver of a model is the one the minimiser would pick (``"auto"``,
  ``inference.curvature.choose_solver``), or the low-rank one where the dense one would not
  fit a row in ``--max-fit-memory-mb`` but the low-rank one does;
- a model is refused when it can never fit (``--max-parameters``, ``--max-bins``, or one row
  above ``--max-fit-memory-mb`` with either solver), and a toy-based request when it asks for
  more than ``--max-toys-per-request`` toys in all;
- the rows of an engine call are split into minimiser calls that fit.

Example:
    >>> limits = FitLimits(max_parameters=5000, max_bins=50_000, max_fit_bytes=4096 * 2**20)
    >>> small = ModelShape(n_pars=60, n_main=40, n_aux=23, n_flat=2)
    >>> fit = limits.fit_plan(small)
    >>> fit.solver, fit.bytes_per_row, limits.rows_per_call(fit)
    ('auto', 348480, 8627)
    >>> wide = ModelShape(n_pars=6001, n_main=6000, n_aux=6000, n_flat=1)
    >>> limits.rows_per_call(limits.fit_plan(wide))  # 3.8 GiB a row
    1
    >>> few_bins = ModelShape(n_pars=4000, n_main=10, n_aux=3990, n_flat=1)
    >>> limits.fit_plan(few_bins)  # auto picks low-rank itself: 246 MiB a row, not 610
    FitPlan(solver='auto', bytes_per_row=257739664)
    >>> some_bins = ModelShape(n_pars=600, n_main=400, n_aux=599, n_flat=1)
    >>> FitLimits(5000, 50_000, 20 * 2**20).fit_plan(some_bins).solver  # dense: 36.6 MiB
    'low-rank'
    >>> limits.refusal(wide)[:44]
    'the model has 6001 parameters, more than the'
    >>> analysis = ModelShape(n_pars=2107, n_main=1600, n_aux=2102, n_flat=5, n_per_bin=1600)
    >>> limits.fit_plan(analysis)  # block: 28 MiB a row (dense: 459 MiB)
    FitPlan(solver='auto', bytes_per_row=29212352)
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import numpy as np

from ..engine.layout import ElementLayout
from ..engine.stacking import StackBudget
from ..inference.curvature import choose_solver

BYTES_PER_NUMBER = 8  # float64; float32 halves it, the bound stays conservative
SECANT_PAIRS = 8  # MinimizeOptions.secant_memory: two columns each in the low-rank curvature
DAMPINGS = 2  # steps solved per iteration: pure Newton's and the damped one

Solver = Literal["auto", "low-rank"]


@dataclass(frozen=True)
class ModelShape:
    """The sizes admission looks at: parameters, main bins, auxiliary data, parameters
    without a Normal constraint (their curvature may be zero: a low-rank column each), and
    per-bin parameters (``engine.sparsity``; 0 where unknown: no block solver assumed), and
    the numbers one row's rate Jacobian assembly holds besides the Jacobian
    (:func:`assembly_numbers`; 0 where unknown)."""

    n_pars: int
    n_main: int
    n_aux: int
    n_flat: int
    n_per_bin: int = 0
    n_assembly: int = 0

    @property
    def solver(self) -> str:
        """The solver ``"auto"`` picks for this shape (``inference.curvature.choose_solver``)."""
        return choose_solver(self.n_main, self.n_pars, self.n_per_bin, self.n_flat, SECANT_PAIRS)

    @property
    def n_data(self) -> int:
        return self.n_main + self.n_aux

    @property
    def low_rank(self) -> int:
        """The rank ``r`` of the low-rank solver's correction."""
        return self.n_main + 2 * SECANT_PAIRS + self.n_flat


#: The largest observed count admitted: a float64 holds every integer count exactly up to 2^53.
MAX_COUNT = 2.0**53


def likelihood_refusal(layout: ElementLayout) -> str | None:
    """Why an element's likelihood has no meaning, or None: observed counts above
    :data:`MAX_COUNT` (or not finite), or a bin whose samples' nominal rates (multipliers at 1)
    sum below 0, or to 0 where events are observed. pyhf builds such models and its fits fail
    (``FailedMinimization``: the log of a negative rate, or of 0) or, in a bin with no events,
    drive a normfactor of the negative sample to its bound (``-2 log L = 2 lambda`` rewards a
    rate below 0); here they are refused.

    Example:
        >>> import pyhf
        >>> from pyhf_gpu_server.engine.translate import translate
        >>> spec = pyhf.simplemodels.uncorrelated_background([5.0], [10.0], [2.5]).spec
        >>> ws = {**spec, "observations": [{"name": "singlechannel", "data": [1e300]}],
        ...       "measurements": [{"name": "m", "config": {"poi": "mu", "parameters": []}}],
        ...       "version": "1.0.0"}
        >>> likelihood_refusal(translate(ws))[:61]
        "observed count 1e+300 in channel 'singlechannel' bin 0: above"
    """
    n_main = layout.n_main
    observed = layout.observed[:n_main]
    total = np.zeros(n_main)
    for sample in layout.samples:
        total = total + sample.nominal
    checks = (
        (
            ~np.isfinite(observed) | (observed > MAX_COUNT),
            lambda b: (
                f"observed count {observed[b]:g} in {layout.bin_name(b)}: above 2^53, where "
                "float64 no longer counts events exactly"
            ),
        ),
        (
            (total < 0) | ((total == 0) & (observed > 0)),
            lambda b: (
                f"{layout.bin_name(b)}: the samples' nominal rates sum to {total[b]:g} "
                f"against {observed[b]:g} observed, where the likelihood is undefined (no "
                "Poisson probability; pyhf's fits fail, or run a factor to its bound)"
            ),
        ),
    )
    for bad, why in checks:
        where = np.flatnonzero(bad)
        if where.size:
            more = f" (bins {where[:10].tolist()} of the model)" if where.size > 1 else ""
            return why(int(where[0])) + more
    return None


def assembly_numbers(
    n_main: int,
    columns: int,
    histosys_width: int,
    n_histosys: int,
    normsys_entries: int,
    multiplier_depth: int,
    per_column_histosys: bool = False,
) -> int:
    """Numbers one row holds while a modifier block's share of the rate Jacobian is assembled
    (``engine.kernel.expected_main_jacobian``), at the block's largest step: the histosys
    shifts scaled per bin (``[N, K J]`` twice, ``K J`` = ``histosys_width``) or, in a stack's
    own block, per column (``[K J, Q]`` twice), and their ``[N, J]`` sum; or the normsys
    entries' factors, slopes and weighted rates (``5 T``); or the multipliers' values and
    products (``3 D Q``); plus the ``Q`` columns' rate factors (``10 Q``).

    Example (a 300-bin model of 8 samples, 60 histosys parameters in code4's 4 terms, 25200
    normsys entries, 3 multipliers deep: 1.5 MB a row)::

        >>> assembly_numbers(300, 2400, 240, 60, 25200, 3)
        186000
    """
    scaled = columns if per_column_histosys else n_main
    histosys = 2 * histosys_width * scaled + n_main * n_histosys if histosys_width else 0
    return max(histosys, 5 * normsys_entries, 3 * multiplier_depth * columns) + 10 * columns


#: The share of ``--max-fit-memory-mb`` left to the allocator: a minimiser call's temporaries,
#: freed, leave holes in the heap (glibc's, on the CPU; CUDA's cache likewise) that the next
#: call's differently sized ones do not all reuse, so resident memory grows past what the
#: fits hold at once. Engine calls fit their rows within the rest.
HEAP_SHARE = 0.3
#: The share of ``--max-fit-memory-mb`` that the toys drawn in one engine call may hold (at
#: least one row's); its fits are admitted within the rest.
TOY_SHARE = 0.25


def toy_bytes(shape: ModelShape) -> int:
    """Bytes one toy holds in an engine call outside the minimiser, from its draw to its test
    statistic: its pseudo-data and the fits' copies of it (``2 (N + A)``), and per fit, free
    and conditional, its start, bounds, best fit and results (``9 P``). A toy-based engine
    call holds them for all its toys at once, besides the ``max_rows`` fit rows its minimiser
    calls hold (checked by ``tests/test_admission_memory.py``).

    Example (the 550-parameter, 300-bin analysis of ``generate_large``: 845 data, 53 kB)::

        >>> toy_bytes(ModelShape(550, 300, 545, 8))
        53120
    """
    return BYTES_PER_NUMBER * (2 * shape.n_data + 9 * shape.n_pars)


def dense_bytes_per_row(shape: ModelShape) -> int:
    """``10 P^2`` (curvature, factor, secant, temporaries) + ``2 N P`` (Jacobian, and the trial
    point's) + the Jacobian's assembly."""
    P = shape.n_pars
    return BYTES_PER_NUMBER * (10 * P * P + 2 * shape.n_data * P + shape.n_assembly)


def low_rank_bytes_per_row(shape: ModelShape) -> int:
    """``2 N P`` (Jacobians) + ``2 r P`` (Woodbury columns) + ``2 r^2`` (capacitance, factor)
    + the Jacobian's assembly."""
    P, r = shape.n_pars, shape.low_rank
    return BYTES_PER_NUMBER * (2 * shape.n_data * P + 2 * r * P + 2 * r * r + shape.n_assembly)


def block_bytes_per_row(shape: ModelShape) -> int:
    """``3 N K`` (the shared parameters' Jacobians, current and trial, and weighted for one
    damping at a time) + ``2 D K^2`` (per damping: the Schur complement and its factor) +
    ``2 D (2 m + 1) P`` (the secant columns and their solves) + ``8 (N + A + P)`` (the per-bin
    blocks and the per-row vectors) + the Jacobian's assembly: nothing grows with ``M P`` or
    ``P^2``."""
    P, N = shape.n_pars, shape.n_main
    K = P - shape.n_per_bin
    m = SECANT_PAIRS
    numbers = 3 * N * K + DAMPINGS * 2 * K * K + 2 * DAMPINGS * (2 * m + 1) * P
    numbers += shape.n_assembly
    return BYTES_PER_NUMBER * (numbers + 8 * (shape.n_data + P))


@dataclass(frozen=True)
class FitPlan:
    """How a model's fits run: the solver and what one row holds with it."""

    solver: Solver
    bytes_per_row: int


@dataclass(frozen=True)
class FitLimits:
    """The service's bounds on what one request may cost (``--max-*`` settings)."""

    max_parameters: int
    max_bins: int
    max_fit_bytes: int
    max_toys: int = 10_000_000
    max_model_bytes: int = 512 * 2**20

    @property
    def stack_budget(self) -> StackBudget:
        """What one stacked model may grow to (``engine.stacking.partition``): the union's
        parameters within ``--max-parameters``, its variants' histosys arrays within
        ``--max-model-memory-mb``."""
        return StackBudget(self.max_parameters, self.max_model_bytes)

    def fit_plan(self, shape: ModelShape) -> FitPlan:
        """The solver a model's fits use, and their bytes per row.

        ``"auto"`` picks as the minimiser does (:attr:`ModelShape.solver`); where it would
        pick dense and a dense row does not fit but a low-rank one does, low-rank is forced."""
        dense, low = dense_bytes_per_row(shape), low_rank_bytes_per_row(shape)
        if shape.solver == "low-rank":
            return FitPlan("auto", low)
        if shape.solver == "block":
            return FitPlan("auto", block_bytes_per_row(shape))
        if dense > self.max_fit_bytes and low <= self.max_fit_bytes:
            return FitPlan("low-rank", low)
        return FitPlan("auto", dense)

    def refusal(self, shape: ModelShape) -> str | None:
        """Why a model of this shape is refused before any work, or None."""
        n_bins = shape.n_main
        if n_bins > self.max_bins:
            return (
                f"the model has {n_bins} bins, more than the {self.max_bins} this server fits "
                "(--max-bins)"
            )
        if shape.n_pars > self.max_parameters:
            return (
                f"the model has {shape.n_pars} parameters, more than the {self.max_parameters} "
                "this server fits (--max-parameters)"
            )
        need = self.fit_plan(shape).bytes_per_row
        if need > self.max_fit_bytes:
            return (
                f"one fit of this model ({shape.n_pars} parameters, {shape.n_data} data) needs "
                f"~{need / 2**20:.0f} MiB, more than the {self.max_fit_bytes / 2**20:.0f} MiB "
                "this server gives a fit (--max-fit-memory-mb)"
            )
        return None

    def toys_refusal(self, ntoys: int, hypotheses: int) -> str | None:
        """Why a toy-based request of ``hypotheses`` rows at ``ntoys`` each is refused, or None."""
        total = ntoys * hypotheses
        if total <= self.max_toys:
            return None
        return (
            f"the request asks for {total} toys ({hypotheses} hypotheses x ntoys {ntoys}), more "
            f"than the {self.max_toys} this server runs per request (--max-toys-per-request): "
            "fewer test_poi values, patches or toys, or several requests"
        )

    @property
    def call_bytes(self) -> int:
        """What one engine call's fits (and drawn toys) are admitted within: ``max_fit_bytes``
        less :data:`HEAP_SHARE` of it, left to the allocator."""
        return int((1.0 - HEAP_SHARE) * self.max_fit_bytes)

    def rows_per_call(self, fit: FitPlan) -> int:
        """How many rows one minimiser call may fit at once within :attr:`call_bytes`."""
        return max(1, self.call_bytes // fit.bytes_per_row)

    def toy_call(self, fit: FitPlan, shape: ModelShape, toys_per_row: int) -> tuple[int, int]:
        """For rows that draw ``toys_per_row`` toys each: how many such rows one engine call
        takes (their toys within :data:`TOY_SHARE` of :attr:`call_bytes`, at least one row),
        and how many fit rows one of its minimiser calls fits within what is left.

        Example (a 1 GiB bound, 717 MiB of it for the call, 100 toys a row of 53 kB each,
        fit rows of 3.2 MB):

            >>> limits = FitLimits(5000, 50000, 2**30)
            >>> limits.toy_call(FitPlan("auto", 3_200_000), ModelShape(550, 300, 545, 8), 100)
            (35, 176)
        """
        per_row = toys_per_row * toy_bytes(shape)
        rows = max(1, int(TOY_SHARE * self.call_bytes) // per_row)
        left = self.call_bytes - rows * per_row
        return rows, max(1, left // fit.bytes_per_row)


class FitMemory:
    """What the fits of the engine call running now hold (estimated: rows in flight times
    bytes per row), and the most any call held; read by the metrics at every scrape.

    After a call that held more than ``release_above`` bytes, ``release()`` hands the freed
    memory back (on the CPU glibc keeps it otherwise), so the process's resident memory
    returns to what the models hold.

    Example:
        >>> memory = FitMemory()
        >>> with memory.holding(rows=8, fit=FitPlan("auto", 1000), max_rows=4):
        ...     memory.current
        4000
        >>> memory.current, memory.peak
        (0, 4000)
    """

    def __init__(
        self, release: Callable[[], None] = lambda: None, release_above: int = 16 * 2**20
    ) -> None:
        self.current = 0
        self.peak = 0
        self.release = release
        self.release_above = release_above
        self._lock = threading.Lock()

    @contextmanager
    def holding(self, rows: float, fit: FitPlan, max_rows: int, besides: int = 0) -> Iterator[None]:
        """Count ``rows`` fit rows (at most ``max_rows`` at once), and ``besides`` bytes held
        outside the minimiser (drawn toys), while the block runs."""
        nbytes = int(min(rows, max_rows) * fit.bytes_per_row) + besides
        with self._lock:
            self.current += nbytes
            self.peak = max(self.peak, self.current)
        try:
            yield
        finally:
            with self._lock:
                self.current -= nbytes
            if nbytes > self.release_above:
                self.release()
