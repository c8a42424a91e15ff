"""Worker processes, forked at start-up, that take shares of the server's CPU work.

Two kinds of work are shared with the idle ones, each request or batch using a worker only
while no other does (:meth:`LocalWorkers.idle`):

- **Translation.** Translating a patch is host-side Python, the GIL held, which no device
  shortens. Each worker keeps its own warm translators and, for a request with at least
  ``min_patches`` new patches, translates a share of them while the build thread translates
  its own; a worker's elements come back pickled, in the element's own numbers.
- **Engine calls, on a CPU device** (``fork(..., engine=True)``): a batch's elements are
  shared out, each worker fitting the rows of its share on its own warm model of those
  elements (:mod:`.engine_shares`), one intra-op thread each. A fit iteration on the CPU is
  mostly torch's per-operation dispatch, which one process cannot spread over two cores.

The workers are forked before the server starts any thread (a forked child has only the
forking thread) and before torch has run anything (its thread pools are made in the child).
Whatever goes wrong with a worker (it died, did not answer within its bound, could not
pickle its answer) costs only time: its share is done in the server process, and that worker
is not used again (a fork later, with threads running, would not be safe).

Example:
    >>> import pyhf
    >>> spec = pyhf.simplemodels.uncorrelated_background([5.0], [10.0], [2.5]).spec
    >>> ws = {**spec, "observations": [{"name": "singlechannel", "data": [12.0]}],
    ...       "measurements": [{"name": "m", "config": {"poi": "mu", "parameters": []}}],
    ...       "version": "1.0.0"}
    >>> background = Background(ws, "ws", "m", None)
    >>> double = [{"op": "replace", "path": "/channels/0/samples/0/data", "value": [10.0]}]
    >>> patches = [PatchSpec(f"p{i}", str(i), tuple(double)) for i in range(4)]
    >>> workers = LocalWorkers.fork(1, min_patches=2)
    >>> store = ElementStore(workers=workers)
    >>> [e.layout.samples[0].nominal.tolist() for e in store.elements(background, patches)]
    [[10.0], [10.0], [10.0], [10.0]]
    >>> workers.used, workers.close()
    (1, None)
"""

from __future__ import annotations

import itertools
import logging
import math
import multiprocessing
import pickle
import signal
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from .elements import Background, Element, ElementStore, PatchSpec

log = logging.getLogger("pyhf_gpu_server.service")

#: a request's new patches below this count are all translated in the server process
MIN_PATCHES = 32
#: the bound on a worker's answer: this, plus ``SECONDS_PER_PATCH`` for each patch it has
BASE_TIMEOUT_S = 10.0
SECONDS_PER_PATCH = 0.05
#: the server's own share, relative to a worker's (the worker's trip both ways costs too)
SERVER_SHARE_WEIGHT = 1.25
#: the bound on handing a worker a share (an idle worker reads at once: milliseconds)
SEND_TIMEOUT_S = 1.0
KEPT_BACKGROUND_KEYS = 64  # backgrounds the server remembers having sent a worker
MISSING = b"missing"  # a worker no longer holds the background or model a share names


@dataclass(eq=False)
class _Worker:
    """The server's end of one worker: its process, socket and stop flag (shared memory: set,
    the worker's running fits stop), what it was sent (backgrounds, models), whether it is
    broken (given up on)."""

    process: Any
    channel: socket.socket
    stop_flag: Any  # multiprocessing RawValue("b")
    lock: threading.Lock = field(default_factory=threading.Lock)
    backgrounds: set[tuple] = field(default_factory=set)
    models: set[tuple] = field(default_factory=set)  # engine-share model keys sent
    broken: bool = False

    @property
    def name(self) -> str:
        """How results' meta name it (``worker``)."""
        return f"local-worker-{self.process.pid}"

    def send(self, payload: bytes, deadline: float = math.inf) -> None:
        """One message (``TimeoutError`` at ``deadline``, or after :data:`SEND_TIMEOUT_S`:
        an idle worker reads at once)."""
        _send_message(self.channel, payload, min(deadline, time.monotonic() + SEND_TIMEOUT_S))

    def send_patches(
        self,
        background: Background,
        patches: Sequence[PatchSpec],
        with_spec: bool,
        deadline: float,
    ) -> None:
        """Ask for the layouts of ``patches`` (the operations as JSON, the background's
        workspace only with ``with_spec``); ``TimeoutError`` at ``deadline``."""
        spec = (background.workspace, background.measurement, background.modifier_settings)
        operations = orjson.dumps([p.operations for p in patches])
        names = [p.name for p in patches]
        message = (background.key, background.workspace_digest, spec if with_spec else None)
        self.send(pickle.dumps(("translate", *message, names, operations), protocol=5), deadline)
        if len(self.backgrounds) >= KEPT_BACKGROUND_KEYS:  # sent again when next needed
            self.backgrounds.clear()
        self.backgrounds.add(background.key)

    def receive(self, deadline: float) -> bytearray:
        """The answer, once it came; ``TimeoutError`` at ``deadline`` (monotonic seconds)."""
        return _receive_message(self.channel, deadline)

    def stop(self, kill: bool = False) -> None:
        """Close the socket (the worker exits on it) and end the process: at once with
        ``kill`` (a worker given up on), else after a second at most."""
        self.broken = True
        self.channel.close()
        if not kill:
            self.process.join(timeout=1.0)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=1.0)


class LocalWorkers:
    """Forked workers; :meth:`elements` (translation) and the engine's shares
    (:class:`~.engine_shares.EngineShares`) use the idle ones."""

    def __init__(
        self, workers: Sequence[_Worker], min_patches: int = MIN_PATCHES, engine: bool = False
    ) -> None:
        self._workers = list(workers)
        self.min_patches = min_patches
        self.engine = engine  # whether they take engine-call shares (a CPU device)
        self.used = 0  # requests that had a share translated by a worker
        self.shared_batches = 0  # engine calls that had a share fitted by a worker

    @classmethod
    def fork(
        cls,
        count: int,
        min_patches: int = MIN_PATCHES,
        engine: bool = False,
        max_layout_bytes: int | None = None,
    ) -> LocalWorkers:
        """Start ``count`` workers (none where ``fork`` is not available); with ``engine`` they
        also fit engine-call shares on the CPU (warmed up first, one intra-op thread); they
        translate under ``max_layout_bytes`` as the server does. Call it before the process
        starts threads: a forked child has only the forking thread."""
        if count <= 0 or "fork" not in multiprocessing.get_all_start_methods():
            return cls([], min_patches)
        context = multiprocessing.get_context("fork")
        workers: list[_Worker] = []
        for _ in range(count):
            mine, theirs = socket.socketpair()
            stop_flag = context.RawValue("b", 0)
            servers_ends = [mine, *(w.channel for w in workers)]
            args = (theirs, servers_ends, stop_flag, engine, max_layout_bytes)
            process = context.Process(target=_serve, args=args, name="pyhf-gpu-worker", daemon=True)
            process.start()
            theirs.close()
            workers.append(_Worker(process, mine, stop_flag))
        return cls(workers, min_patches, engine)

    @property
    def count(self) -> int:
        """Workers still in use."""
        return sum(not w.broken for w in self._workers)

    @staticmethod
    def describe(workers: LocalWorkers | None) -> dict[str, int]:
        """For ``GET /info``: the workers in use, the requests whose translation and the engine
        calls whose fits they shared (none: zeros)."""
        if workers is None:
            return {"workers": 0, "shared_requests": 0, "shared_batches": 0}
        return {
            "workers": workers.count,
            "shared_requests": workers.used,
            "shared_batches": workers.shared_batches,
        }

    def idle(self, most: int) -> list[_Worker]:
        """Up to ``most`` idle workers, each held (not waited for) until :meth:`release`."""
        taken: list[_Worker] = []
        for worker in self._workers:
            if len(taken) >= most:
                break
            if not worker.broken and worker.lock.acquire(blocking=False):
                taken.append(worker)
        return taken

    @staticmethod
    def release(workers: Sequence[_Worker]) -> None:
        """Hand back workers taken by :meth:`idle`."""
        for worker in workers:
            worker.lock.release()

    def elements(
        self,
        background: Background,
        patches: Sequence[PatchSpec],
        translate: Callable[[PatchSpec], Element],
    ) -> list[Element]:
        """The element of each of ``patches`` (new ones): the idle workers each translate a
        share, ``translate`` the first share and any share a worker did not answer."""
        workers = self.idle(len(self._workers)) if len(patches) >= self.min_patches else []
        try:
            shares = _split(patches, len(workers) + 1)
            start = time.monotonic()
            asked = [
                (w, share, start + BASE_TIMEOUT_S + SECONDS_PER_PATCH * len(share))
                for w, share in zip(workers, shares[1:], strict=True)
            ]
            for worker, share, deadline in asked:
                with_spec = background.key not in worker.backgrounds
                try:
                    worker.send_patches(background, share, with_spec, deadline)
                except (OSError, TypeError, ValueError, pickle.PicklingError) as exc:  # timeouts
                    self.give_up(worker, f"could not send it work: {type(exc).__name__}: {exc}")
            found = [translate(patch) for patch in shares[0]]
            for worker, share, deadline in asked:
                found += self._receive(worker, background, share, deadline) or [
                    translate(patch) for patch in share
                ]
        finally:
            self.release(workers)
        self.used += bool(workers)
        return found

    def close(self) -> None:
        """Stop every worker."""
        for worker in self._workers:
            if worker.channel.fileno() != -1:
                worker.stop()

    def give_up(self, worker: _Worker, why: str) -> None:
        """Stop using ``worker`` (killed at once: it may be stuck)."""
        log.warning("a local worker is not used any more (%s)", why)
        worker.stop(kill=True)

    def _receive(
        self,
        worker: _Worker,
        background: Background,
        share: Sequence[PatchSpec],
        deadline: float,
    ) -> list[Element] | None:
        """The elements of ``share`` from ``worker`` (None: translate them here)."""
        if worker.broken:
            return None
        try:
            answer = worker.receive(deadline)
            if answer == MISSING:  # it let the background go: once more, with it
                worker.send_patches(background, share, True, deadline)
                answer = worker.receive(deadline)
            outcomes = pickle.loads(answer)
        except (OSError, EOFError, TimeoutError, pickle.UnpicklingError) as exc:
            self.give_up(worker, f"no answer: {type(exc).__name__}: {exc}")
            return None
        if not isinstance(outcomes, list) or len(outcomes) != len(share):
            # the worker could not translate or pickle them (its message says why)
            log.warning("a local worker failed to translate a share: %.200s", outcomes)
            return None
        return [
            Element(patch, layout, error)
            for patch, (layout, error) in zip(share, outcomes, strict=True)
        ]


def _split(patches: Sequence[PatchSpec], parts: int) -> list[list[PatchSpec]]:
    """``patches`` in ``parts`` consecutive shares, the first (the server's own) larger by
    :data:`SERVER_SHARE_WEIGHT`: a worker's share also costs its trip both ways.

    >>> [len(share) for share in _split(list(range(10)), 3)]
    [4, 3, 3]
    """
    weights = [SERVER_SHARE_WEIGHT] + [1.0] * (parts - 1)
    bounds = [round(len(patches) * sum(weights[:i]) / sum(weights)) for i in range(parts + 1)]
    return [list(patches[a:b]) for a, b in itertools.pairwise(bounds)]


def _serve(
    channel: socket.socket,
    servers_ends: Sequence[socket.socket],
    stop_flag: Any,
    engine: bool,
    max_layout_bytes: int | None,
) -> None:
    """A worker: answer the shares it is sent until its socket closes. The server's ends,
    inherited, are closed here: the server's exit ends the worker."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C: the server stops us
    for other in servers_ends:
        other.close()
    store = ElementStore(max_layout_bytes=max_layout_bytes)
    backgrounds: OrderedDict[tuple, Background] = OrderedDict()
    models = None
    if engine:
        from . import engine_shares  # torch's first kernels and fits: paid now, not at a share

        models = engine_shares.worker_models()
    while True:
        try:
            message = pickle.loads(_receive_message(channel, None))
        except (EOFError, OSError):
            return
        if message[0] == "engine" and models is not None:
            answer = engine_shares.answer(models, message[1:], stop_flag)
        else:
            answer = _translation(store, backgrounds, message[1:])
        try:
            _send_message(channel, answer, None)
        except OSError:  # the server stopped waiting for us (and closed its end)
            return


def _translation(
    store: ElementStore, backgrounds: OrderedDict[tuple, Background], message: tuple
) -> bytes:
    """The answer to a translation share: :data:`MISSING`, or the pickled ``(layout,
    error)`` of each patch, or of a message why there are none."""
    key, digest, spec, names, operations = message
    if spec is not None:
        backgrounds[key] = Background(spec[0], digest, spec[1], spec[2])
        while len(backgrounds) > store.max_backgrounds:
            backgrounds.popitem(last=False)
    background = backgrounds.get(key)
    if background is None:
        return MISSING
    backgrounds.move_to_end(key)
    try:
        patches = [
            PatchSpec(name, "", tuple(ops))
            for name, ops in zip(names, orjson.loads(operations), strict=True)
        ]
        elements = [store.translate(background, patch) for patch in patches]
        return pickle.dumps([(e.layout, e.error) for e in elements], protocol=5)
    except Exception as exc:  # reported: the server translates the share itself
        return pickle.dumps(f"{type(exc).__name__}: {exc}")


def _send_message(channel: socket.socket, payload: bytes, deadline: float | None) -> None:
    """``payload`` after its length (8 bytes); ``TimeoutError`` at ``deadline`` (None: none)."""
    _bound(channel, deadline)
    channel.sendall(len(payload).to_bytes(8, "little"))
    _bound(channel, deadline)
    channel.sendall(payload)


def _receive_message(channel: socket.socket, deadline: float | None) -> bytearray:
    """One message of :func:`_send_message`; ``EOFError`` when the other end closed."""
    size = int.from_bytes(_exactly(channel, 8, deadline), "little")
    return _exactly(channel, size, deadline)


def _exactly(channel: socket.socket, size: int, deadline: float | None) -> bytearray:
    buffer = bytearray(size)
    view, got = memoryview(buffer), 0
    while got < size:
        _bound(channel, deadline)
        count = channel.recv_into(view[got:])
        if not count:
            raise EOFError("the other end closed")
        got += count
    return buffer


def _bound(channel: socket.socket, deadline: float | None) -> None:
    """The socket's timeout: what is left until ``deadline`` (None: blocking)."""
    if deadline is None:
        channel.settimeout(None)
        return
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("no answer in time")
    channel.settimeout(left)
