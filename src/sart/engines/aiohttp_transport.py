"""``AiohttpTransport``: httpx's requests carried by an aiohttp session.

``OpenAIEngine`` speaks httpx (its tests replace the transport with
``httpx.MockTransport``), but httpx's own connection pool (httpcore) is slow
with many concurrent streams (encode/httpx#3215): against ``vllm serve`` on
this project's 2-core machine, 32 streams of 64 tokens in flight, httpx's pool
got 16 requests/s, httpx over this transport 58 and aiohttp alone 88, with
about half the client's CPU time (``benchmarks/gateway_upstream.py``;
``docs/how-to/gateway.md``). ``vllm bench serve`` uses aiohttp. So
when aiohttp is installed (the ``serve`` and ``remote`` extras install it),
the engine's httpx client sends through this transport: httpx keeps the API,
aiohttp holds the connections.

Errors keep httpx's meaning, which the engine's retries read: a refused or
failed connection is ``httpx.ConnectError``, a timeout ``httpx.ConnectTimeout``
or ``httpx.ReadTimeout``, a connection that breaks mid-stream
``httpx.ReadError``.

A request whose connection breaks before any answer (``ServerDisconnectedError``,
or ``ClientOSError`` writing it) is sent once more, on a new connection: the
server most likely closed a kept-alive connection as the request went out
(uvicorn, under ``vllm serve`` and SGLang, closes one idle for 5 s; aiohttp keeps
them 15 s). aiohttp does the same for idempotent methods only; the engine's POSTs
are safe to resend (no answer came, so nothing was streamed; the engine would
resend it to another server). Before, the gateway took the error for its
upstream failing: it passed a healthy upstream over for its cooldown and, with
another upstream down, failed requests with a 500 (seen in front of two ``vllm
serve``, one of them killed). A refused connection (``ClientConnectorError``) is
not resent.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx

try:
    import aiohttp
except ImportError:  # pragma: no cover - exercised where aiohttp is absent
    aiohttp = None  # type: ignore[assignment]


def default_transport() -> httpx.AsyncBaseTransport | None:
    """An ``AiohttpTransport`` if aiohttp is installed, else ``None`` (httpx's pool)."""
    return AiohttpTransport() if aiohttp is not None else None


class _Body(httpx.AsyncByteStream):
    """An aiohttp response's body as httpx reads it; closing it releases the connection."""

    def __init__(self, response: Any, request: httpx.Request) -> None:
        self._response = response
        self._request = request

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for data in self._response.content.iter_any():
                yield data
        except asyncio.TimeoutError as exc:
            raise httpx.ReadTimeout(str(exc) or "read timed out", request=self._request) from exc
        except aiohttp.ClientError as exc:
            raise httpx.ReadError(str(exc) or type(exc).__name__, request=self._request) from exc

    async def aclose(self) -> None:
        self._response.release()


class AiohttpTransport(httpx.AsyncBaseTransport):
    """Sends httpx requests with one aiohttp ``ClientSession`` (made on first use, in
    the loop that uses it), no limit on connections, keep-alive on."""

    def __init__(self) -> None:
        if aiohttp is None:
            raise ImportError("AiohttpTransport needs aiohttp: pip install aiohttp")
        self._session: Any = None

    def _open(self) -> Any:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
            # httpx decodes the body itself: aiohttp must hand it over as sent.
            self._session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        return self._session

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        timeouts = request.extensions.get("timeout", {})
        timeout = aiohttp.ClientTimeout(
            total=None,
            sock_connect=timeouts.get("connect"),
            sock_read=timeouts.get("read"),
        )
        try:
            response = await self._send(request, timeout)
        except asyncio.TimeoutError as exc:
            raise httpx.ConnectTimeout(str(exc) or "timed out", request=request) from exc
        except aiohttp.ClientError as exc:
            raise httpx.ConnectError(str(exc) or type(exc).__name__, request=request) from exc
        return httpx.Response(
            response.status,
            headers=list(response.raw_headers),  # (name, value) bytes pairs, as sent
            stream=_Body(response, request),
            request=request,
        )

    async def _send(self, request: httpx.Request, timeout: Any) -> Any:
        """aiohttp's response to ``request``; sent twice if the first connection broke
        before any answer (module docstring)."""
        body = await request.aread()
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in request.headers.raw]
        for last in (False, True):
            try:
                return await self._open().request(
                    request.method,
                    str(request.url),
                    headers=headers,
                    data=body,
                    allow_redirects=False,
                    timeout=timeout,
                    # The headers above are httpx's own, Host and Content-Length included.
                    skip_auto_headers=("User-Agent", "Accept-Encoding", "Accept", "Content-Type"),
                )
            except aiohttp.ClientConnectorError:
                raise  # refused or unreachable: another try would be refused too
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
                if last:
                    raise
        raise AssertionError("unreachable")

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


__all__ = ["AiohttpTransport", "default_transport"]
