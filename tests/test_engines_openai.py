"""``OpenAIEngine`` against a stand-in OpenAI server and, where vLLM is installed,
against a real ``vllm serve``.

``StandInServer`` is the application of a tiny OpenAI-compatible server, an
``httpx`` handler that the engine reaches through ``httpx.MockTransport``. It
streams ``/v1/completions`` as vLLM does: one token per SSE event,
``token_ids`` when ``return_token_ids`` is asked, cumulative usage with
``continuous_usage_stats``, a final usage chunk and ``data: [DONE]``. Its
tokens are a function of (prompt, seed), so seeded branches are reproducible.
It is a stand-in for a real server, not a model of vLLM's scheduling; the real
tests below check that.

``SocketServer`` serves the same application on a real socket at 127.0.0.1
(its own thread and event loop), for what only a socket shows: a client's
disconnect seen by the server (abort), and connections refused, dropped
before the answer or reset mid-stream (retries and failures), where the
errors are the ones httpx really raises.

The real server is the session's ``vllm serve`` (``conftest.vllm_server``);
the scenarios every real adapter shares run against it in
``test_engines_scenarios.py``, and the real tests here check what only a
server shows (its prompt ids, aborts on a client's disconnect).
"""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import json
import random
import threading
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")

import sart  # noqa: E402
from adapters import (  # noqa: E402
    PROMPTS,
    VLLM_SERVER_MAX_MODEL_LEN,
    free_port,
    pruning_workload,
    server_metric,
)
from sart.engines.base import BranchSpec  # noqa: E402
from sart.engines.openai import OpenAIEngine  # noqa: E402
from sart.engines.streaming import SyncBridge  # noqa: E402
from sart.testing import check_engine  # noqa: E402
from sart.types import BranchId, FinishReason  # noqa: E402

HAVE_VLLM = importlib.util.find_spec("vllm") is not None


class StandInServer:
    """A stand-in OpenAI-compatible completions server (see the module docstring).

    ``token_delay``: seconds between tokens. ``token_ids``: honour
    ``return_token_ids``. ``usage``: honour ``continuous_usage_stats``.
    ``strict``: answer 400 to unknown (vLLM-only) fields. ``tokenize``: serve
    ``/tokenize``. ``fail``: answer every completion request with this HTTP
    status. ``error_after``: send an error object after that many tokens.
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
    ) -> None:
        self.token_delay = token_delay
        self.token_ids = token_ids
        self.usage = usage
        self.strict = strict
        self.tokenize = tokenize
        self.fail = fail
        self.error_after = error_after
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
        if path != "/v1/completions":
            return httpx.Response(404, json={"detail": "Not Found"})
        rid = request.headers.get("x-request-id", "")
        self.requests.append({"id": rid, "body": body})
        if self.fail is not None:
            return httpx.Response(self.fail, json={"error": {"message": "unavailable"}})
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
                if self.error_after is not None and n > self.error_after:
                    ended = True
                    yield _sse({"object": "error", "message": "out of memory", "code": 500})
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
    def tokens(prompt: Any, seed: Any) -> list[int]:
        """The continuation of ``prompt`` under ``seed``: ids in 2..99, ending with EOS (0)."""
        rng = random.Random(f"{prompt}|{seed}")
        length = rng.randint(4, 14)
        return [rng.randint(2, 99) for _ in range(length)] + [0]


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


@pytest.fixture
def server() -> StandInServer:
    return StandInServer()


def engine(*servers: StandInServer | str, **kwargs: Any) -> OpenAIEngine:
    """An engine on stand-ins: through a ``MockTransport``, or over real sockets where
    any of them is a ``SocketServer`` or a URL."""
    if not any(isinstance(s, (str, SocketServer)) for s in servers):
        kwargs["transport"] = transport(*servers)  # type: ignore[arg-type]
    urls = [s if isinstance(s, str) else s.url for s in servers]
    return OpenAIEngine(urls, "stand-in", **kwargs)


def dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens there


async def drain(e: OpenAIEngine, chunk: int = 3) -> dict[BranchId, list[Any]]:
    deltas: dict[BranchId, list[Any]] = {}
    while e.stats().live_branches:
        for bid, d in (await e.step(chunk)).deltas.items():
            deltas.setdefault(bid, []).append(d)
    return deltas


# --------------------------------------------------------------- stand-in tests


def test_the_registry_loads_it() -> None:
    assert sart.load_engine("openai") is OpenAIEngine


@pytest.mark.parametrize("mode", ["ids", "usage", "text", "strict"])
def test_passes_the_conformance_suite(mode: str) -> None:
    s = StandInServer(
        token_ids=mode == "ids",
        usage=mode in ("ids", "usage"),
        strict=mode == "strict",
        tokenize=mode != "text",
    )
    check_engine(lambda: SyncBridge(engine(s)))


def test_streams_tokens_text_and_finish_reasons(server: StandInServer) -> None:
    async def scenario() -> None:
        e = engine(server)
        sampling = sart.SamplingSettings(temperature=1.0, max_tokens=6, stop=("zz",))
        n = await e.prefill("a", "one two three", sampling)
        assert n == 4  # the stand-in's /tokenize: BOS + one id per word
        await e.start_branches("a", [BranchSpec(j, 40 + j) for j in range(4)])
        deltas = await drain(e)
        body = server.completions("0_a-")[0]["body"]
        assert body["prompt"] == "one two three" and body["n"] == 1 and body["stream"]
        assert body["seed"] == 40 and body["stop"] == ["zz"] and body["max_tokens"] == 6
        assert "logprobs" not in body
        for j in range(4):
            want = StandInServer.tokens("one two three", 40 + j)
            got = deltas[BranchId("a", j)]
            ids = [t for d in got for t in d.token_ids]
            assert ids == want[:6]
            assert "".join(d.text for d in got) == "".join(f" w{t}" for t in want[:6] if t)
            expect = FinishReason.STOP if len(want) <= 6 else FinishReason.LENGTH
            assert got[-1].finish is expect
        await e.release_prefix("a")
        await e.aclose()

    asyncio.run(scenario())


def one_branch(*servers: StandInServer, **kwargs: Any) -> list[Any]:
    """The deltas of one branch (seed 5) of the prompt "p q" (max_tokens=40)."""

    async def scenario() -> list[Any]:
        e = engine(*servers, **kwargs)
        await e.prefill("a", "p q", sart.SamplingSettings(temperature=1.0, max_tokens=40))
        await e.start_branches("a", [BranchSpec(0, 5)])
        deltas = (await drain(e))[BranchId("a", 0)]
        await e.release_prefix("a")
        await e.aclose()
        return deltas

    return asyncio.run(scenario())


def test_counts_tokens_from_usage_when_the_server_gives_no_ids() -> None:
    deltas = one_branch(StandInServer(token_ids=False))
    # The EOS token has no text, yet usage counts it.
    assert sum(d.new_tokens for d in deltas) == len(StandInServer.tokens("p q", 5))
    assert all(d.token_ids == () for d in deltas)


def test_a_strict_server_gets_the_request_again_without_the_extensions() -> None:
    server = StandInServer(strict=True)
    deltas = one_branch(server)
    # Counted one per chunk with text, topped up by the final usage chunk.
    assert sum(d.new_tokens for d in deltas) == len(StandInServer.tokens("p q", 5))
    assert [("return_token_ids" in r["body"]) for r in server.requests] == [True, False]


def test_abort_closes_the_stream_and_the_server_sees_it() -> None:
    # A real socket: the server must see the client's disconnect.
    server = SocketServer(token_delay=0.02)
    try:

        async def scenario() -> None:
            e = engine(server)
            await e.prefill("a", "p", sart.SamplingSettings(temperature=1.0, max_tokens=1000))
            # Long branches: a seed whose continuation is long enough.
            await e.start_branches("a", [BranchSpec(0, 1), BranchSpec(1, 2)])
            await e.step(1)
            assert len(server.running) == 2
            await e.abort([BranchId("a", 1)])
            assert e.stats().live_branches == 1
            for _ in range(50):
                if len(server.running) == 1:
                    break
                await asyncio.sleep(0.01)
            assert len(server.running) == 1
            assert [r.split("-")[0] for r in server.disconnected] == ["1_a"]
            await e.release_prefix("a")  # aborts branch 0 too
            for _ in range(50):
                if not server.running:
                    break
                await asyncio.sleep(0.01)
            assert not server.running
            await e.aclose()

        asyncio.run(scenario())
    finally:
        server.stop()


def test_connection_errors_are_retried_on_another_server_without_duplicates() -> None:
    # Real sockets: a refused connection and dropped ones, as httpx reports them.
    flaky = SocketServer(drop_first=2)
    good = SocketServer()
    try:

        async def scenario() -> None:
            e = engine(dead_url(), flaky, good, max_retries=2)
            await e.prefill("a", "p", sart.SamplingSettings(temperature=1.0, max_tokens=30))
            await e.start_branches("a", [BranchSpec(j, j) for j in range(6)])
            deltas = await drain(e)
            assert set(deltas) == {BranchId("a", j) for j in range(6)}
            for j in range(6):
                ids = [t for d in deltas[BranchId("a", j)] for t in d.token_ids]
                assert ids == StandInServer.tokens("p", j)[:30]
                served = [
                    r for s in (flaky, good) for r in s.completions(f"{j}_a-") if "dropped" not in r
                ]
                assert len(served) == 1  # streamed exactly once
            assert len([r for r in flaky.requests if "dropped" in r]) == 2
            await e.release_prefix("a")

        asyncio.run(scenario())
    finally:
        flaky.stop()
        good.stop()


def test_no_server_left_fails_only_that_request() -> None:
    # A real socket: nothing listens at the URL.
    async def scenario() -> None:
        e = engine(dead_url(), max_retries=1, tokenizer=_Words())
        await e.prefill("a", "p", sart.SamplingSettings(max_tokens=5))
        await e.start_branches("a", [BranchSpec(0, 0)])
        with pytest.raises(sart.EngineError) as info:
            await e.step(2)
        assert info.value.request_ids == {"a"}
        assert "2 attempts" in str(info.value)
        await e.abort([BranchId("a", 0)])
        await e.release_prefix("a")

    asyncio.run(scenario())


def test_busy_servers_send_the_branch_on_without_duplicates() -> None:
    busy, down, good = StandInServer(fail=503), StandInServer(fail=502), StandInServer()
    deltas = one_branch(busy, down, good, max_retries=2)
    assert [t for d in deltas for t in d.token_ids] == StandInServer.tokens("p q", 5)
    assert [len(s.requests) for s in (busy, down, good)] == [1, 1, 1]


@pytest.mark.parametrize("status", [400, 500])
def test_an_error_answer_fails_its_request_without_a_retry(status: int) -> None:
    # return_token_ids=False: a 400 is not taken for a rejection of the extensions.
    bad, good = StandInServer(fail=status), StandInServer()

    async def scenario() -> None:
        e = engine(bad, good, return_token_ids=False)
        await e.prefill("a", "p", sart.SamplingSettings(max_tokens=5))
        await e.start_branches("a", [BranchSpec(0, 0)])
        with pytest.raises(sart.EngineError, match=f"answered HTTP {status}") as info:
            await drain(e)
        assert info.value.request_ids == {"a"}
        assert len(bad.requests) == 1 and not good.requests
        await e.release_prefix("a")

    asyncio.run(scenario())


def test_an_error_event_mid_stream_fails_only_its_request() -> None:
    server = StandInServer(error_after=2)

    async def scenario() -> None:
        e = engine(server)
        await e.prefill("a", "p", sart.SamplingSettings(temperature=1.0, max_tokens=30))
        await e.start_branches("a", [BranchSpec(0, 1)])
        with pytest.raises(sart.EngineError, match="reported an error") as info:
            await drain(e, chunk=1)
        assert info.value.request_ids == {"a"}
        assert len(server.requests) == 1  # never retried: it had streamed tokens
        await e.release_prefix("a")

    asyncio.run(scenario())


def test_branches_spread_over_servers_by_load() -> None:
    one, two = StandInServer(token_delay=0.01), StandInServer(token_delay=0.01)

    async def scenario() -> None:
        e = engine(one, two)
        sampling = sart.SamplingSettings(temperature=1.0, max_tokens=8)
        await e.prefill("a", "p", sampling)
        await e.start_branches("a", [BranchSpec(j, j) for j in range(6)])
        await e.step(1)
        assert [s.live for s in e.servers] == [3, 3]
        assert len(one.running) == len(two.running) == 3
        # Abort the three on server one: the next three go there.
        on_one = [b for b in list(e._streams) if e.placement[b] == one.url]
        await e.abort(on_one)
        await e.prefill("b", "q", sampling)
        await e.start_branches("b", [BranchSpec(j, j) for j in range(3)])
        await e.step(1)
        assert all(e.placement[BranchId("b", j)] == one.url for j in range(3))
        await drain(e)
        for rid in ("a", "b"):
            await e.release_prefix(rid)

    asyncio.run(scenario())


def test_a_server_dying_mid_stream_fails_only_its_request() -> None:
    # Real sockets: a connection reset mid-stream, as httpx reports it.
    dying = SocketServer(die_after=3, token_delay=0.005)
    good = SocketServer(token_delay=0.005)
    try:

        async def scenario() -> None:
            e = engine(dying, good)
            sampling = sart.SamplingSettings(temperature=1.0, max_tokens=30)
            await e.prefill("a", "p", sampling)
            await e.start_branches("a", [BranchSpec(0, 1)])  # to the first server
            await e.prefill("b", "p", sampling)
            await e.start_branches("b", [BranchSpec(0, 1)])  # to the other
            assert e.placement[BranchId("a", 0)] == dying.url
            with pytest.raises(sart.EngineError) as info:
                for _ in range(40):
                    await e.step(1)
            assert info.value.request_ids == {"a"}
            assert "after it produced tokens" in str(info.value)
            assert len(dying.requests) == 1  # never retried
            await e.abort([BranchId("a", 0)])
            await e.release_prefix("a")
            deltas = await drain(e)
            assert deltas[BranchId("b", 0)][-1].finish is not None
            await e.release_prefix("b")

        asyncio.run(scenario())
    finally:
        dying.stop()
        good.stop()


def fork_after_three_tokens(server: StandInServer) -> tuple[Any, dict[str, Any]]:
    """Branch 0 of "one two" (max_tokens=30) makes 3 tokens, then branch 1 forks from
    it: the parent's delta and the fork's request body."""

    async def scenario() -> tuple[Any, dict[str, Any]]:
        e = engine(server)
        await e.prefill("a", "one two", sart.SamplingSettings(temperature=1.0, max_tokens=30))
        await e.start_branches("a", [BranchSpec(0, 3)])
        parent = (await e.step(3)).deltas[BranchId("a", 0)]
        await e.start_branches("a", [BranchSpec(1, 9, parent=0)])
        await e.step(1)  # the fork's request goes out once its stream runs
        fork = server.completions("1_a-")[0]["body"]
        await drain(e)
        await e.release_prefix("a")
        return parent, fork

    return asyncio.run(scenario())


def test_a_fork_continues_from_its_parents_ids(server: StandInServer) -> None:
    parent, fork = fork_after_three_tokens(server)
    head = parent.token_ids
    # The server's own prompt ids (from the first chunk), then the parent's tokens.
    assert fork["prompt"] == [1, *range(len("one two")), *head]
    assert fork["max_tokens"] == 30 - 3 and fork["seed"] == 9


def test_a_fork_without_ids_continues_from_its_parents_text() -> None:
    parent, fork = fork_after_three_tokens(StandInServer(token_ids=False))
    text = parent.text
    assert fork["prompt"] == "one two" + text and fork["max_tokens"] == 27


def test_sart_end_to_end_on_the_stand_in(server: StandInServer) -> None:
    requests, prm = pruning_workload([f"p q{i}" for i in range(3)], every=2, max_tokens=12)
    bridge = SyncBridge(engine(server))
    results = sart.run(requests, bridge, prm, batch_size=8)
    assert all(r.ok for r in results), [r.reason for r in results]
    assert all(b.status.is_ended for r in results for b in r.branches)
    assert bridge.stats().live_branches == 0


class _Words:
    def encode(self, text: str) -> list[int]:
        return [len(w) for w in text.split()]


# --------------------------------------------------------------- real vLLM tests


def running(url: str) -> float:
    return server_metric(url, "vllm:num_requests_running")


def finished(url: str, reason: str = "length") -> float:
    """Requests that vLLM finished for ``reason`` (``stop``, ``length``...). Not the sum
    over reasons: vLLM counts a request aborted on a client's disconnect under
    ``abort`` too, depending on when the abort reaches its engine core."""
    return server_metric(url, "vllm:request_success_total", f'finished_reason="{reason}"')


def test_real_streams_ids_and_prompt_lengths(vllm_server: str) -> None:
    async def scenario() -> None:
        e = OpenAIEngine(vllm_server, "demo")
        sampling = sart.SamplingSettings(temperature=1.0, max_tokens=10, seed=1)
        n = await e.prefill("a", PROMPTS[0], sampling)
        ids, max_len = await e._tokenize(PROMPTS[0], "a")
        assert n == len(ids) and max_len == VLLM_SERVER_MAX_MODEL_LEN
        await e.start_branches("a", [BranchSpec(0, 1), BranchSpec(1, 2)])
        deltas = await drain(e)
        for got in deltas.values():
            assert sum(d.new_tokens for d in got) == len([t for d in got for t in d.token_ids])
            assert got[-1].finish in (FinishReason.STOP, FinishReason.LENGTH)
        assert e._requests["a"].ids == ids  # the server's own prompt ids
        await e.release_prefix("a")
        await e.aclose()

    asyncio.run(scenario())


def test_real_abort_makes_the_server_drop_the_request(vllm_server: str) -> None:
    # The tiny model decodes thousands of tokens a second, so the branches must be
    # long (ignore_eos, 4000 tokens) and many for aborts to reach requests still running.
    width, cut, max_tokens = 32, 16, 4000

    async def scenario() -> None:
        e = OpenAIEngine(vllm_server, "demo", extra_body={"ignore_eos": True})
        sampling = sart.SamplingSettings(temperature=1.0, max_tokens=max_tokens, seed=1)
        await e.prefill("a", PROMPTS[1], sampling)
        finished0 = finished(vllm_server)
        tokens0 = server_metric(vllm_server, "vllm:generation_tokens_total")
        await e.start_branches("a", [BranchSpec(j, 10 + j) for j in range(width)])
        await e.step(1)
        # vLLM's engine runs ahead of what its API server has streamed (from 100 to
        # over 13,000 of the 128,000 tokens were made before the client saw a token
        # of every branch, in three quiet runs): what an abort can save depends on
        # what is left when it lands, so measure that.
        made_before = server_metric(vllm_server, "vllm:generation_tokens_total") - tokens0
        done_before = finished(vllm_server) - finished0
        await e.abort([BranchId("a", j) for j in range(cut)])
        assert e.stats().live_branches == width - cut
        while e.stats().live_branches:
            for delta in (await e.step(1000)).deltas.values():
                assert delta.finish in (None, FinishReason.LENGTH)
        await e.release_prefix("a")
        await e.aclose()
        for _ in range(100):
            if running(vllm_server) == 0:
                break
            await asyncio.sleep(0.1)
        assert running(vllm_server) == 0
        # The branches left alone ran to max_tokens on the server; an aborted one
        # ran out only if it had before the abort (one more may end between the
        # metric's read and the abort): vLLM aborts a request whose client
        # disconnects. And after the abort, the aborted branches made at most a
        # few hundred tokens each (those in flight).
        ran_out = finished(vllm_server) - finished0
        assert width - cut <= ran_out <= width - cut + done_before + 1
        made = server_metric(vllm_server, "vllm:generation_tokens_total") - tokens0
        assert (width - cut) * max_tokens <= made
        assert made - made_before <= (width - cut) * max_tokens + cut * 500

    asyncio.run(scenario())


def test_close_closes_the_http_client_from_synchronous_code() -> None:
    engine = OpenAIEngine(["http://127.0.0.1:9", "http://127.0.0.1:10"], "m")
    engine.close()  # nothing open yet: a no-op
    client = engine.client
    engine.close()
    assert client.is_closed and engine._client is None

    async def inside_a_loop() -> None:
        engine.client  # noqa: B018 - opens the client
        with pytest.raises(RuntimeError, match=r"await engine\.aclose"):
            engine.close()
        await engine.aclose()

    asyncio.run(inside_a_loop())
