"""numpy's and scipy's OpenBLAS kept to one thread: a process setting.

The engine's CPU fits run on torch's own thread pool, one thread per core. numpy's and
scipy's OpenBLAS threads, after a threaded product, spin-wait on those same cores and slow
the next engine call (BENCHMARKS.md, "Figures behind defaults"); the host-side numpy work
(translating, stacking, plotting) is small enough for one thread.

The server (``pyhf-gpu-server``) and the Dask worker plugin apply it at start-up, with the
allocator's thresholds (:mod:`pyhf_gpu_server.allocator`); a library user may call
:func:`limit_blas_threads`.
"""

from __future__ import annotations

from threadpoolctl import ThreadpoolController

__all__ = ["limit_blas_threads"]


def limit_blas_threads() -> dict[str, int]:
    """Give every BLAS library loaded in the process one thread (torch's own pool is left
    alone): their paths, each with the threads it had. Tested in a fresh process
    (``tests/test_allocator.py``): it changes the whole process."""
    blas = ThreadpoolController().select(user_api="blas")
    before = {library.filepath: library.num_threads for library in blas.lib_controllers}
    blas.limit(limits=1)
    return before
