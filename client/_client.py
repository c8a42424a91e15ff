"""``Client`` and ``AsyncClient``: the API of :class:`~pyhf_gpu_client._base.ClientBase`
over httpx, blocking and as coroutines."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any, TypeVar

import httpx

from . import protocol as p
from ._base import ClientBase, _job_id
from .exceptions import TransportError
from .results import Job

__all__ = ["AsyncClient", "Client"]

T = TypeVar("T")


def _httpx_timeout(timeout: p.Timeout | float | None) -> httpx.Timeout:
    """``ClientConfig.timeout`` for httpx (a :class:`~.protocol.Timeout` or None by then:
    ``Timeout.of`` returns those as they are)."""
    limits = p.Timeout.of(timeout)
    return httpx.Timeout(None) if limits is None else httpx.Timeout(**vars(limits))


def _httpx_options(client: ClientBase, transport: Any) -> dict[str, Any]:
    """The arguments of ``httpx.Client`` / ``httpx.AsyncClient`` for ``client``'s settings."""
    return {
        "base_url": client.config.server,
        "headers": client._headers,
        "timeout": _httpx_timeout(client.config.timeout),
        "verify": client.config.tls_verify(),
        "transport": transport,
    }


def _transport_error(exc: httpx.TransportError, request: p.Request) -> TransportError:
    """An httpx transport failure as the client's exception."""
    kind: p.TransportFailure = "failed"
    if isinstance(exc, (httpx.ConnectTimeout, httpx.PoolTimeout)):
        kind = "connect-timeout"
    elif isinstance(exc, httpx.TimeoutException):
        kind = "read-timeout"
    elif isinstance(exc, httpx.ConnectError):
        kind = "connect"
    return p.transport_error(kind, exc, request)


class Client(ClientBase):
    """Blocking client (httpx style). Use as a context manager or call :meth:`close`.

    Example::

        with Client("http://gpu-node:8000") as client:
            result = client.cls("workspace.json", test_poi=1.0)
            print(result.cls_obs, result.to_pyhf_json())
    """

    def __init__(
        self,
        server: str | None = None,
        *,
        transport: httpx.BaseTransport | None = None,
        **kwargs: Any,
    ) -> None:
        """Same arguments as :class:`ClientBase`; ``transport`` replaces httpx's (tests)."""
        super().__init__(server, **kwargs)
        self._http = httpx.Client(**_httpx_options(self, transport))

    def _send(self, request: p.Request) -> httpx.Response:
        try:
            return self._http.request(**self.config.httpx_arguments(request))
        except httpx.TransportError as exc:
            raise _transport_error(exc, request) from exc

    def events(self, job: Job | str) -> Iterator[dict[str, Any]]:
        """Server-sent events of a job (``GET /jobs/{id}/events``), as parsed dicts."""
        parser = p.SSEParser()
        try:
            with self._http.stream("GET", f"/jobs/{_job_id(job)}/events") as response:
                if response.status_code >= 400:
                    response.read()
                    raise p.error_from_response(response)
                for line in response.iter_lines():
                    event = parser.feed(line)
                    if event is not None:
                        yield event
        except httpx.TransportError as exc:
            raise _transport_error(exc, p.Request("GET", "/events")) from exc

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient(ClientBase):
    """Asyncio client with the same methods as :class:`Client`, each awaitable.

    Example::

        async with AsyncClient() as client:
            results = await client.run_patchset("BkgOnly.json", "patchset.json")
    """

    def __init__(
        self,
        server: str | None = None,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        **kwargs: Any,
    ) -> None:
        """Same arguments as :class:`Client`."""
        super().__init__(server, **kwargs)
        self._http = httpx.AsyncClient(**_httpx_options(self, transport))

    async def _run(self, flow: p.Flow[T]) -> T:
        """Drive a flow with ``await``: the async twin of :meth:`ClientBase._run` (I/O only)."""
        outcome: Any = None
        error: TransportError | None = None
        while True:
            command = p.advance(flow, outcome, error)
            if isinstance(command, p.Done):
                return command.value
            outcome, error = None, None
            if isinstance(command, p.Sleep):
                import asyncio  # here: not in every blocking client's start-up

                await asyncio.sleep(command.seconds)
                continue
            try:
                outcome = await self._http.request(**self.config.httpx_arguments(command))
            except httpx.TransportError as exc:
                error = _transport_error(exc, command)

    async def events(self, job: Job | str) -> AsyncIterator[dict[str, Any]]:
        """Server-sent events of a job (``GET /jobs/{id}/events``), as parsed dicts."""
        parser = p.SSEParser()
        try:
            async with self._http.stream("GET", f"/jobs/{_job_id(job)}/events") as response:
                if response.status_code >= 400:
                    await response.aread()
                    raise p.error_from_response(response)
                async for line in response.aiter_lines():
                    event = parser.feed(line)
                    if event is not None:
                        yield event
        except httpx.TransportError as exc:
            raise _transport_error(exc, p.Request("GET", "/events")) from exc

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
