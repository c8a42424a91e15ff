"""``StdlibClient``: the API of :class:`~pyhf_gpu_client._base.ClientBase` over the standard
library's ``http.client``, for the command line.

Importing httpx (and httpcore, h11, ...) is a large part of a command's start-up; a command
sends a few requests to a plain ``http://`` server and exits, which ``http.client`` does as
well: one keep-alive connection, gzip answers decoded, the connect and read timeouts (the read
one also bounds sending) and the same errors as :class:`~pyhf_gpu_client.Client`. The command
line uses it wherever :meth:`~pyhf_gpu_client.protocol.ClientConfig.plain_http` holds (no TLS,
no proxy settings) and httpx's :class:`~pyhf_gpu_client.Client` elsewhere.
"""

from __future__ import annotations

import gzip
import http.client
from typing import Any
from urllib.parse import urlencode, urlsplit

from . import protocol as p
from ._base import ClientBase

__all__ = ["StdlibClient"]

#: failures of a kept-alive connection that the server closed meanwhile (sent again once)
_STALE = (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError)


class StdlibClient(ClientBase):
    """Blocking client over ``http.client`` (a plain ``http://`` server, no proxy). Use as a
    context manager or call :meth:`close`."""

    def __init__(self, server: str | None = None, **kwargs: Any) -> None:
        """Same arguments as :class:`~pyhf_gpu_client._base.ClientBase`."""
        super().__init__(server, **kwargs)
        if not self.config.plain_http():
            raise ValueError("StdlibClient speaks plain http:// without a proxy only")
        url = urlsplit(self.config.server)
        self._host, self._port = url.hostname or "127.0.0.1", url.port or 80
        self._prefix = url.path.rstrip("/")
        self._connection: http.client.HTTPConnection | None = None

    def _send(self, request: p.Request) -> p.Response:
        headers, body = self.config.encode(request)
        headers = {**self._headers, **headers, "Accept-Encoding": "gzip"}
        target = self._prefix + request.path
        params = p.query_params(request)
        if params:
            target += "?" + urlencode(params, doseq=True)
        if self._connection is not None:  # kept alive: the server may have closed it since
            try:
                return self._exchange(request, target, headers, body, fresh=False)
            except _STALE:
                pass  # closed: once more, on a new connection
        return self._exchange(request, target, headers, body, fresh=True)

    def _exchange(
        self,
        request: p.Request,
        target: str,
        headers: dict[str, str],
        body: bytes | None,
        fresh: bool,
    ) -> p.Response:
        """One request and its whole answer, on the kept connection or a new one (``fresh``);
        transport failures become the client's exceptions, but for a kept connection that
        turns out closed (raised as it is)."""
        timeout = p.Timeout.of(self.config.timeout)  # one already (ClientConfig made it one)
        try:
            connection = self._connect(timeout)
        except TimeoutError as exc:
            raise p.transport_error("connect-timeout", exc, request) from exc
        except OSError as exc:
            raise p.transport_error("connect", exc, request) from exc
        try:
            connection.request(request.method, target, body=body, headers=headers)
            answer = connection.getresponse()
            content = answer.read()
        except TimeoutError as exc:
            self.close()
            raise p.transport_error("read-timeout", exc, request) from exc
        except (OSError, http.client.HTTPException) as exc:
            self.close()
            if isinstance(exc, _STALE) and not fresh:
                raise
            raise p.transport_error("failed", exc, request) from exc
        if answer.getheader("Content-Encoding", "").lower() == "gzip":
            content = gzip.decompress(content)
        if answer.will_close:
            self.close()
        return p.Response(answer.status, answer.reason, answer.headers, content, request)

    def _connect(self, timeout: p.Timeout | None) -> http.client.HTTPConnection:
        """The kept-alive connection, opened within the connect timeout if there is none;
        its socket then waits at most the read timeout for each answer."""
        if self._connection is None:
            connection = http.client.HTTPConnection(
                self._host, self._port, timeout=None if timeout is None else timeout.connect
            )
            connection.connect()  # (with TCP_NODELAY)
            connection.sock.settimeout(None if timeout is None else timeout.read)
            self._connection = connection
        return self._connection

    def close(self) -> None:
        """Close the connection."""
        if self._connection is not None:
            self._connection.close()
            self._connection = None

    def __enter__(self) -> StdlibClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
