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


def test_a_pooled_connection_the_server_closed_is_not_a_failed_request() -> None:
    # Before: a POST sent on a kept-alive connection that the server closed meanwhile
    # (uvicorn, under vllm serve, closes one idle for 5 s; aiohttp keeps them 15 s)
    # failed with ConnectError('Server disconnected'): the gateway counted it as the
    # upstream failing, passed a healthy upstream over, and with another upstream
    # down failed requests with a 500 (seen in front of two vllm serve, one killed).
    served: list[int] = []

    async def scenario() -> None:
        async def keep_then_drop(
            reader: asyncio.StreamReader, writer: asyncio.StreamWriter
        ) -> None:
            # Each connection: one answer kept alive, then the next request is read
            # and the connection closed, as an idle timeout that fires as it arrives.
            for answers in (True, False):
                head = await reader.readuntil(b"\r\n\r\n")
                length = [h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")]
                await reader.readexactly(int(length[0].split(b":")[1]) if length else 0)
                if not answers:
                    break
                served.append(1)
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                await writer.drain()
            writer.close()

        server = await asyncio.start_server(keep_then_drop, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/completions"
        try:
            async with httpx.AsyncClient(transport=AiohttpTransport()) as client:
                for _ in range(3):
                    response = await client.post(url, json={"prompt": "p"})
                    assert response.status_code == 200 and response.text == "ok"
        finally:
            server.close()

    asyncio.run(scenario())
    assert len(served) == 3
