"""Which worker a batch goes to, and whether its model's recipe must travel with it.

Workers are ranked per model by rendezvous (highest-random-weight) hashing of the model id:
the same order on every call and every API node, and adding or losing a worker moves only the
models it ranks first. A batch goes to an idle worker that holds its model warm (the
best-ranked such), else to the best-ranked idle worker (its owner when idle), else, all being
busy, to the best-ranked holder or the owner, where Dask queues it (``allow_other_workers``:
Dask may still move it). So one model's batches stay on its owner while it keeps up, and the
chunks of a large patchset or toy job spread over all the workers.

What a worker holds is what this API node has seen it answer (or sent it); a worker that
evicted a model answers ``ModelMissing`` and :meth:`Placement.lost` forgets it.
"""

from __future__ import annotations

import hashlib
import threading
from collections import Counter
from collections.abc import Hashable, Iterable

MAX_REMEMBERED = 1024  # model keys remembered per worker


def rendezvous(model_id: str, workers: Iterable[str]) -> list[str]:
    """``workers`` by decreasing highest-random weight for ``model_id``.

    Example:
        >>> order = rendezvous("m1", ["a", "b", "c"])
        >>> sorted(order) == ["a", "b", "c"] and rendezvous("m1", ["c", "b", "a"]) == order
        True
    """

    def weight(worker: str) -> bytes:
        return hashlib.blake2b(f"{worker}\0{model_id}".encode(), digest_size=8).digest()

    return sorted(workers, key=weight, reverse=True)


class Placement:
    """This API node's view of the workers: models each holds, batches each runs now (one
    lock; called from the scheduler's runner threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.holds: dict[str, dict[Hashable, None]] = {}  # insertion-ordered sets
        self.in_flight: Counter[str] = Counter()
        self.batches: Counter[str] = Counter()  # batches each worker answered

    def choose(
        self, key: Hashable, model_id: str, workers: Iterable[str]
    ) -> tuple[str | None, bool]:
        """(worker, whether the recipe must go) for a batch of model ``key`` among the live
        ``workers``; (None, True) when there is none (Dask waits for one). The worker counts
        one more batch in flight until :meth:`release`."""
        with self._lock:
            live = set(workers)
            for gone in set(self.holds) - live:
                del self.holds[gone]
            if not live:
                return None, True
            ranked = rendezvous(model_id, live)
            idle = [w for w in ranked if self.in_flight[w] == 0]
            holders = [w for w in ranked if key in self.holds.get(w, ())]
            warm_idle = [w for w in idle if w in holders]
            choice = (warm_idle or idle or holders or ranked)[0]
            self.in_flight[choice] += 1
            return choice, key not in self.holds.get(choice, ())

    def release(self, worker: str | None) -> None:
        """A batch sent to ``worker`` is over."""
        if worker is None:
            return
        with self._lock:
            self.in_flight[worker] -= 1
            if self.in_flight[worker] <= 0:
                del self.in_flight[worker]

    def holding(self, worker: str, key: Hashable) -> None:
        """``worker`` answered a batch of ``key``: it holds that model now."""
        with self._lock:
            held = self.holds.setdefault(worker, {})
            held.pop(key, None)
            held[key] = None
            while len(held) > MAX_REMEMBERED:  # beyond any worker cache: forget the oldest
                del held[next(iter(held))]
            self.batches[worker] += 1

    def lost(self, worker: str, key: Hashable) -> None:
        """``worker`` does not hold ``key`` (it said so)."""
        with self._lock:
            self.holds.get(worker, {}).pop(key, None)
