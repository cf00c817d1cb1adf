"""A stand-in OpenAI-compatible completions server, for ``OpenAIEngine``'s tests and
the gateway's (``sart serve --engine openai``).

``StandInServer`` is the application of a tiny OpenAI-compatible server, an
``httpx`` handler that an engine reaches through ``httpx.MockTransport``
(``transport``). It streams ``/v1/completions`` as vLLM does: one token per
SSE event, ``token_ids`` when ``return_token_ids`` is asked, cumulative usage
with ``continuous_usage_stats``, ``logprobs`` in vLLM's shape when asked (the
sampled token's entry first in ``top_logprobs``, then the ``k`` most likely;
keys ``"token_id:N"`` with ``return_tokens_as_token_ids``, else the tokens'
texts), a final usage chunk and ``data: [DONE]``; it may serve ``/tokenize``
and vLLM's ``/inference/v1/abort_requests``. Its tokens are a function of
(prompt, seed), so seeded branches are reproducible, and their
log-probabilities a function of the token (``logprobs``).
It is a stand-in for a real server, not a model of vLLM's scheduling; the
real tests (against ``vllm serve``) check that.

``SocketServer`` serves the same application on a real socket at 127.0.0.1
(its own thread and event loop), for what only a socket shows: a client's
disconnect seen by the server (abort), and connections refused, dropped
before the answer or reset mid-stream (retries and failures), where the
errors are the ones httpx really raises.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import threading
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import httpx

from adapters import free_port


class StandInServer:
    """A stand-in OpenAI-compatible completions server (see the module docstring).

    ``token_delay``: seconds between tokens. ``token_ids``: honour
    ``return_token_ids``. ``usage``: honour ``continuous_usage_stats``.
    ``strict``: answer 400 to unknown (vLLM-only) fields. ``tokenize``: serve
    ``/tokenize``. ``fail``: answer every completion request with this HTTP
    status. ``error_after``: send an error object after that many tokens (``error``:
    its message and code; vLLM validates some sampling fields after its 200 and
    says 400 so).
    ``abort_endpoint``: serve vLLM's ``/inference/v1/abort_requests`` (it stops
    the named streams, as vLLM's engine aborts them). ``logprobs``: honour
    ``logprobs`` (else the request's tokens come without them). ``max_logprobs``:
    answer 400 to a larger ``logprobs``, as vLLM does. ``health``: the status of its
    ``GET /health`` (``None``: it has none, 404). ``fail`` and ``health`` may be
    changed while it serves (an upstream that goes bad, and comes back). ``model``: the
    model it serves (``/v1/models``; a completion for another is answered 404) and
    ``api_key``: the key its ``/v1`` routes want (401 without it; ``/health`` and
    ``/tokenize`` stay open), as ``vllm serve``'s ``--served-model-name`` and
    ``--api-key``; both may be changed while it serves (an upstream restarted so).
    """

    _hosts = itertools.count()

    def __init__(
        self,
        *,
        token_delay: float = 0.0,
        token_ids: bool = True,
        usage: bool = True,
        strict: bool = False,
        tokenize: bool = True,
        fail: int | None = None,
        error_after: int | None = None,
        error: tuple[str, int] = ("out of memory", 500),
        abort_endpoint: bool = False,
        logprobs: bool = True,
        max_logprobs: int | None = None,
        health: int | None = 200,
        model: str = "stand-in",
        api_key: str | None = None,
    ) -> None:
        self.model = model
        self.api_key = api_key
        self.token_delay = token_delay
        self.honour_logprobs = logprobs
        self.max_logprobs = max_logprobs
        self.abort_endpoint = abort_endpoint
        self.abort_calls: list[list[str]] = []
        """The ``request_ids`` of every call to the abort endpoint (served or not)."""
        self._aborted: set[str] = set()
        self.token_ids = token_ids
        self.usage = usage
        self.strict = strict
        self.tokenize = tokenize
        self.fail = fail
        self.health = health
        self.error_after = error_after
        self.error_message, self.error_code = error
        self.requests: list[dict[str, Any]] = []
        """Every completion request: its body and ``X-Request-Id``."""
        self.running: set[str] = set()
        self.disconnected: list[str] = []
        """Streams whose client went away before the end."""
        self.url = f"http://stand-in-{next(self._hosts)}"

    def completions(self, rid_prefix: str = "") -> list[dict[str, Any]]:
        return [r for r in self.requests if r["id"].startswith(rid_prefix)]

    async def handle(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content or b"{}")
        path = request.url.path
        if path == "/tokenize" and request.method == "POST" and self.tokenize:
            ids = [1] + [len(w) + 10 for w in body["prompt"].split()]
            return httpx.Response(
                200, json={"count": len(ids), "max_model_len": 4096, "tokens": ids}
            )
        if path == "/health" and request.method == "GET" and self.health is not None:
            return httpx.Response(self.health)
        key = request.headers.get("authorization")
        if path.startswith("/v1") and self.api_key and key != f"Bearer {self.api_key}":
            return httpx.Response(401, json={"error": "Unauthorized"})  # vLLM's words
        if path == "/v1/models" and request.method == "GET":  # vLLM's model card
            card = {"id": self.model, "object": "model", "max_model_len": 4096}
            return httpx.Response(200, json={"object": "list", "data": [card]})
        if path == "/inference/v1/abort_requests":
            self.abort_calls.append(body["request_ids"])
            if not self.abort_endpoint:
                return httpx.Response(404, json={"detail": "Not Found"})
            self._aborted.update(body["request_ids"])
            return httpx.Response(200)
        if path != "/v1/completions":
            return httpx.Response(404, json={"detail": "Not Found"})
        rid = request.headers.get("x-request-id", "")
        self.requests.append({"id": rid, "body": body})
        if self.fail is not None:
            return httpx.Response(self.fail, json={"error": {"message": "unavailable"}})
        if body.get("model") != self.model:
            message = f"The model `{body.get('model')}` does not exist."
            return httpx.Response(404, json={"error": {"message": message, "code": 404}})
        if self.max_logprobs is not None and body.get("logprobs", 0) > self.max_logprobs:
            message = (
                f"Requested sample logprobs of {body['logprobs']}, which is greater "
                f"than max allowed: {self.max_logprobs}"
            )
            return httpx.Response(400, json={"error": {"message": message}})
        if self.strict and ("return_token_ids" in body or "continuous_usage_stats" in str(body)):
            return httpx.Response(400, json={"error": {"message": "unknown field"}})
        events = self._events(rid, body)
        return httpx.Response(
            200, headers={"content-type": "text/event-stream"}, stream=_Body(events)
        )

    async def _events(self, rid: str, body: dict[str, Any]) -> AsyncGenerator[bytes, None]:
        tokens = self.tokens(body["prompt"], body.get("seed"))
        max_tokens = body["max_tokens"]
        with_ids = self.token_ids and body.get("return_token_ids")
        options = body.get("stream_options") or {}
        continuous = self.usage and options.get("continuous_usage_stats")
        self.running.add(rid)
        ended = False
        try:
            for n, token in enumerate([*tokens, None], start=1):
                await asyncio.sleep(self.token_delay)
                if f"cmpl-{rid}-0" in self._aborted:
                    self.disconnected.append(rid)  # vLLM's abort: the stream just ends
                    ended = True
                    return
                if self.error_after is not None and n > self.error_after:
                    ended = True
                    yield _sse(
                        {"object": "error", "message": self.error_message, "code": self.error_code}
                    )
                    return
                finish = None
                if token is None or token == 0:
                    finish = "stop"
                elif n >= max_tokens:
                    finish = "length"
                choice: dict[str, Any] = {
                    "index": 0,
                    "text": "" if token in (None, 0) else f" w{token}",
                    "finish_reason": finish,
                }
                if self.honour_logprobs and body.get("logprobs") is not None:
                    choice["logprobs"] = self._logprobs(token or 0, body)
                if with_ids:
                    choice["token_ids"] = [token or 0]
                    if n == 1:
                        prompt = body["prompt"]
                        choice["prompt_token_ids"] = (
                            prompt if isinstance(prompt, list) else [1, *range(len(prompt))]
                        )
                event: dict[str, Any] = {"id": rid, "object": "text_completion"}
                event["choices"] = [choice]
                if continuous:
                    event["usage"] = {"completion_tokens": n}
                ended = finish is not None
                yield _sse(event)
                if ended:
                    break
            if options.get("include_usage"):
                yield _sse({"id": rid, "choices": [], "usage": {"completion_tokens": n}})
            yield b"data: [DONE]\n\n"
        finally:
            self.running.discard(rid)
            if not ended:
                self.disconnected.append(rid)

    @staticmethod
    def logprobs(token: int, k: int) -> tuple[float, list[tuple[int, float]]]:
        """The stand-in's log-probabilities at ``token``: the sampled token's, and the ``k``
        most likely tokens' (ids 100 and up, never sampled; highest first) as (id, value)."""
        return -0.5 - 0.05 * (token % 9), [(100 + j, -0.1 * (j + 1)) for j in range(k)]

    @staticmethod
    def tokens(prompt: Any, seed: Any) -> list[int]:
        """The continuation of ``prompt`` under ``seed``: ids in 2..99, ending with EOS (0)."""
        rng = random.Random(f"{prompt}|{seed}")
        length = rng.randint(4, 14)
        return [rng.randint(2, 99) for _ in range(length)] + [0]

    def _logprobs(self, token: int, body: dict[str, Any]) -> dict[str, Any]:
        """A choice's ``logprobs`` for one token, as vLLM's completions server sends it."""
        as_ids = self.token_ids and body.get("return_tokens_as_token_ids")

        def key(t: int) -> str:
            return f"token_id:{t}" if as_ids else ("" if t == 0 else f" w{t}")

        k = body["logprobs"]
        sampled, top = self.logprobs(token, k)
        return {
            "text_offset": [0],
            "token_logprobs": [sampled],
            "tokens": [key(token)],
            "top_logprobs": [{key(token): sampled, **{key(t): v for t, v in top}}],
        }


def _sse(event: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(event)}\n\n".encode()


class _Body(httpx.AsyncByteStream):
    """A streamed response body; closing it closes its generator (the server sees the
    client gone)."""

    def __init__(self, pieces: AsyncGenerator[bytes, None]) -> None:
        self._pieces = pieces

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._pieces

    async def aclose(self) -> None:
        await self._pieces.aclose()


def transport(*servers: StandInServer) -> httpx.MockTransport:
    """One ``MockTransport`` for stand-ins, each at its own host."""
    by_host = {httpx.URL(s.url).host: s for s in servers}

    async def handle(request: httpx.Request) -> httpx.Response:
        return await by_host[request.url.host].handle(request)

    return httpx.MockTransport(handle)


class SocketServer(StandInServer):
    """The stand-in on a real socket (see the module docstring), one request per
    connection. ``die_after``: reset the connection after that many tokens of every
    stream. ``drop_first``: reset that many connections at once, before answering.
    """

    def __init__(self, *, die_after: int | None = None, drop_first: int = 0, **kw: Any) -> None:
        super().__init__(**kw)
        self.die_after = die_after
        self.drop_first = drop_first
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.base_events.Server | None = None
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self._thread.start()
        ready.wait(5)

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)

        async def start() -> None:
            self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)

        self._loop.run_until_complete(start())
        ready.set()
        self._loop.run_forever()

    def stop(self) -> None:
        async def close() -> None:
            if self._server is not None:
                self._server.close()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode().split("\r\n")
            method, path, _ = head[0].split(" ", 2)
            fields = [line.split(":", 1) for line in head[1:] if ":" in line]
            headers = httpx.Headers([(k, v.strip()) for k, v in fields])
            content = await reader.readexactly(int(headers.get("content-length", 0)))
            if self.drop_first > 0 and path == "/v1/completions":
                self.drop_first -= 1
                rid = headers.get("x-request-id", "")
                self.requests.append({"id": rid, "body": json.loads(content), "dropped": True})
                writer.transport.abort()  # a crash before any answer
                return
            request = httpx.Request(method, self.url + path, headers=headers, content=content)
            await self._send(reader, writer, await self.handle(request))
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    async def _send(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, response: httpx.Response
    ) -> None:
        """Write ``response``, one chunk per piece of its body, until the client goes away."""
        kind = response.headers.get("content-type", "application/json")
        writer.write(
            f"HTTP/1.1 {response.status_code} X\r\ncontent-type: {kind}\r\n"
            "transfer-encoding: chunked\r\nconnection: close\r\n\r\n".encode()
        )
        gone = asyncio.ensure_future(reader.read(1))  # EOF: the client disconnected
        sent = 0
        try:
            async for piece in response.stream:  # type: ignore[union-attr]
                if not piece:  # a chunk of 0 bytes would end the body
                    continue
                if gone.done():
                    return
                if self.die_after is not None and sent == self.die_after:
                    writer.transport.abort()
                    return
                writer.write(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
                await writer.drain()
                sent += 1
            writer.write(b"0\r\n\r\n")
            await writer.drain()
        finally:
            gone.cancel()
            await response.stream.aclose()  # type: ignore[union-attr]
