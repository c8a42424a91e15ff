"""Admission by cost: what a fit of a model holds in memory, and which models are refused.

A batched fit holds, per row, the curvature of ``-2 log L`` over the ``P`` parameters (the
matrix, its factorisation and a secant term: ``3 P^2`` numbers with the dense solver) and the
rate Jacobian over the ``N`` bins plus auxiliary data (``N P``, twice while a trial point is
evaluated). A 129 kB workspace of 6000 bins with a staterror has ``P = 6001``: 2 GB a row.
So before any work a model is refused when it can never fit (``--max-parameters``,
``--max-bins``, or one row above ``--max-fit-memory-mb``), and the rows of an engine call are
split into chunks that fit.

Example:
    >>> limits = FitLimits(max_parameters=5000, max_bins=50_000, max_fit_bytes=4096 * 2**20)
    >>> fit_bytes_per_row(n_pars=60, n_data=63)
    146880
    >>> limits.rows_per_call(n_pars=6001, n_data=12_000)
    2
    >>> limits.refusal(n_pars=6001, n_bins=6000, n_data=12_000)[:44]
    'the model has 6001 parameters, more than the'
"""

from __future__ import annotations

from dataclasses import dataclass

BYTES_PER_NUMBER = 8  # float64; float32 halves it, the bound stays conservative


def fit_bytes_per_row(n_pars: int, n_data: int) -> int:
    """Bytes one row of a batched fit holds: ``3 P^2`` (curvature, factor, secant) plus
    ``2 N P`` (rate Jacobian, and the trial point's) numbers."""
    return BYTES_PER_NUMBER * (3 * n_pars * n_pars + 2 * n_data * n_pars)


@dataclass(frozen=True)
class FitLimits:
    """The service's bounds on what one model may cost (``--max-*`` settings)."""

    max_parameters: int
    max_bins: int
    max_fit_bytes: int

    def refusal(self, n_pars: int, n_bins: int, n_data: int) -> str | None:
        """Why a model of this size is refused before any work, or None."""
        if n_bins > self.max_bins:
            return (
                f"the model has {n_bins} bins, more than the {self.max_bins} this server fits "
                "(--max-bins)"
            )
        if n_pars > self.max_parameters:
            return (
                f"the model has {n_pars} parameters, more than the {self.max_parameters} this "
                "server fits (--max-parameters)"
            )
        need = fit_bytes_per_row(n_pars, n_data)
        if need > self.max_fit_bytes:
            return (
                f"one fit of this model ({n_pars} parameters, {n_data} data) needs "
                f"~{need / 2**20:.0f} MiB, more than the {self.max_fit_bytes / 2**20:.0f} MiB "
                "this server gives a fit (--max-fit-memory-mb)"
            )
        return None

    def rows_per_call(self, n_pars: int, n_data: int) -> int:
        """How many rows one minimiser call may fit at once within ``max_fit_bytes``."""
        return max(1, self.max_fit_bytes // fit_bytes_per_row(n_pars, n_data))
