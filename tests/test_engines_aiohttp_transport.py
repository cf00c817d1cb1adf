"""``AiohttpTransport``: httpx requests over aiohttp, with httpx's errors."""

from __future__ import annotations

import asyncio

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("aiohttp")

from adapters import free_port  # noqa: E402
from openai_standin import SocketServer  # noqa: E402
from sart.engines.aiohttp_transport import AiohttpTransport  # noqa: E402
from sart.engines.openai import OpenAIEngine  # noqa: E402


def test_the_openai_engine_sends_through_aiohttp_by_default() -> None:
    async def scenario() -> None:
        engine = OpenAIEngine("http://127.0.0.1:1", "m")
        assert isinstance(engine.client._transport, AiohttpTransport)
        await engine.aclose()

    asyncio.run(scenario())


def test_a_streamed_body_and_its_headers_come_through() -> None:
    server = SocketServer()
    try:

        async def scenario() -> None:
            async with httpx.AsyncClient(transport=AiohttpTransport()) as client:
                body = {"model": "stand-in", "prompt": "p", "max_tokens": 5, "stream": True}
                async with client.stream(
                    "POST", f"{server.url}/v1/completions", json=body
                ) as response:
                    assert response.status_code == 200
                    assert response.headers["content-type"].startswith("text/event-stream")
                    data = b"".join([piece async for piece in response.aiter_bytes()])
            assert data.rstrip().endswith(b"data: [DONE]")
            assert data.count(b"data: ") >= 6  # five tokens and [DONE]

        asyncio.run(scenario())
    finally:
        server.stop()


def test_a_refused_connection_is_httpxs_connect_error() -> None:
    async def scenario() -> None:
        async with httpx.AsyncClient(transport=AiohttpTransport()) as client:
            with pytest.raises(httpx.ConnectError):
                await client.get(f"http://127.0.0.1:{free_port()}/v1/models")

    asyncio.run(scenario())


def test_a_server_that_never_answers_is_httpxs_read_timeout() -> None:
    async def scenario() -> None:
        async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await asyncio.sleep(5)
            writer.close()

        server = await asyncio.start_server(hold, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            timeout = httpx.Timeout(0.2, connect=1.0)
            async with httpx.AsyncClient(transport=AiohttpTransport(), timeout=timeout) as client:
                with pytest.raises(httpx.TimeoutException):
                    await client.get(f"http://127.0.0.1:{port}/")
        finally:
            server.close()

    asyncio.run(scenario())
