"""Streaming engines: one token stream per branch, presented as the step contract.

vLLM's ``AsyncLLM``, SGLang's ``Engine`` and any OpenAI-compatible server
stream each request's tokens independently; there is no global decode step.
``StreamingEngine`` turns such streams into sart's engine contract, so the
same scheduler and policies run on them:

- a branch is one streamed request (opened by ``_open``, cancelled by
  ``_cancel``: the adapter's only engine-specific parts);
- ``await step(k)`` returns once every live branch has produced ``k`` more
  tokens or ended, so every branch advances exactly ``min(k, remaining)``
  tokens between two checks, as in Algorithm 1. Tokens a fast stream
  produced beyond that are buffered for the next call, never dropped;
- with ``until_first_end`` it returns as soon as some branch ends; the others
  report what they produced so far (at most as many tokens as the call's
  steps);
- with ``per_request_steps`` (what ``sart serve`` sets) the lockstep holds
  within each request only: a request's branches still advance together, so
  its checks compare branches of equal length every ``T`` of its own steps as in
  Algorithm 1, but requests advance independently (``StepOutput.request_steps``)
  and the call returns as soon as one request reaches the chunk's end or a
  branch ends (``sart.engines.lockstep`` has the rules), or when ``interrupt()`` asks. Streams are
  independent on the server, so a new request, still in its prefill, no longer
  holds back every other request's reports and ends, and arrivals start
  without waiting for the batch in flight; a request in ``report_every`` is also
  reported as soon as it has made that many tokens (a server streaming them to
  its client);
- ``abort`` cancels the streams at once (the server frees their KV);
- ``pause`` cancels them too but keeps their reported token ids, and a
  ``BranchSpec(resume=True)`` start opens a new stream for prompt + those ids
  (the way forks are opened; the prefix cache serves the prompt).

A stream that raises fails its request (``EngineError`` naming it); the other
branches carry on. The books of prompts and live streams, and the contract's
checks, are a ``PrefixLedger``'s (``sart.engines.ledger``). ``SyncBridge``
(``sart.engines.sync_bridge``, re-exported here) runs a streaming engine under the
synchronous driver (and under ``check_engine``) on a private event loop.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import TypeVar

import attrs

from sart.engines.base import BranchDelta, BranchSpec, EngineStats, StepOutput, TokenLogprobs
from sart.engines.ledger import PrefixLedger, cap_max_tokens
from sart.engines.lockstep import horizon, request_reach
from sart.errors import EngineError, RequestRefused
from sart.types import BranchId, FinishReason, Prompt, SamplingSettings

_T = TypeVar("_T")


@attrs.frozen
class Chunk:
    """What a stream yields: new tokens, their text, and the finish reason on the last."""

    token_ids: tuple[int, ...] = ()
    text: str = ""
    finish: FinishReason | None = None
    count: int | None = None
    """New tokens when ids are unknown (e.g. a server that streams only text)."""
    texts: tuple[str, ...] | None = None
    """Each token's text, when the engine knows it. Without it the chunk's text
    goes with its first token, so a step that takes part of a chunk reports
    its text early rather than late (engines stream one token per chunk in
    practice, where both are the same)."""
    logprobs: tuple[TokenLogprobs, ...] = ()
    """One per new token when the request asked for log-probabilities (else empty)."""
    stop_reason: str | int | None = None
    """On the last chunk: the stop string or stop token id that ended the branch
    (``BranchDelta.stop_reason``)."""

    @property
    def tokens(self) -> int:
        return self.count if self.count is not None else len(self.token_ids)


@attrs.define
class BranchStream:
    """What ``StreamingEngine`` keeps of one live branch (the ledger's payload); adapters
    that extend ``_take`` or ``_forget`` receive it."""

    task: asyncio.Task[None] | None = None
    # Tokens produced but not yet reported: (token id or None, text piece, logprobs or None).
    pending: list[tuple[int | None, str, TokenLogprobs | None]] = attrs.Factory(list)
    finish: FinishReason | None = None
    stop_reason: str | int | None = None
    error: BaseException | None = None
    generated: list[int] = attrs.Factory(list)
    """Token ids reported so far (for forks and usage)."""
    reported: int = 0


@attrs.frozen
class HeldPrompt:
    """A prefix's data: the prompt, and for adapters that send token ids (``_hold_prompt``)
    its ids and ``max_tokens`` capped by the context length."""

    prompt: Prompt
    ids: tuple[int, ...] = ()
    max_tokens: int = 0


@attrs.frozen
class BranchStart:
    """What ``StreamingEngine._open`` streams: one branch of a request."""

    branch: BranchId
    prompt: Prompt
    """The request's prompt."""
    sampling: SamplingSettings
    """The request's sampling settings (``max_tokens`` counts the inherited tokens)."""
    seed: int
    """The branch's own seed."""
    parent: BranchId | None
    """The branch it forks (Rebase), or ``None``."""
    prefix_tokens: Sequence[int]
    """Tokens it inherits, already generated: a fork's parent's, or a paused branch's
    own (a resume, ``parent`` ``None``). Its prompt is then the request's prompt +
    these tokens, and ``max_tokens`` is reduced by their number."""
    resume: bool = False
    """Whether it resumes a paused branch of its own (a new stream of the same branch)."""


class StreamingEngine(abc.ABC):
    """Base class of streaming adapters (see the module docstring).

    Subclasses implement ``_open`` (start one branch's streamed request and
    yield ``Chunk``s) and ``_cancel`` (abort it on the server), and may
    override ``_prompt_tokens``.
    """

    supports_fork = True
    supports_pause = True

    def __init__(self) -> None:
        self.per_request_steps = False
        """Lockstep within each request only, not across requests (module docstring)."""
        self.report_every: dict[str, int] = {}
        """With ``per_request_steps``: requests whose steps are reported as soon as they
        have made this many (or ended), not only at their chunk's end; a server that
        streams a request's tokens to its client as they come sets it."""
        self._interrupted = False
        self._ledger: PrefixLedger[HeldPrompt, BranchStream] = PrefixLedger()
        # Set by every stream's pump on news (a token, an end, a failure): ``step``
        # waits on this one event, not on one waiter per stream per token. Made
        # afresh by each ``step``, in the loop it runs in.
        self._news: asyncio.Event | None = None

    @property
    def _streams(self) -> Mapping[BranchId, BranchStream]:
        """Live branches' streams."""
        return self._ledger.branches

    # ---------------------------------------------------------- to implement

    @abc.abstractmethod
    def _open(self, start: BranchStart) -> AsyncIterator[Chunk]:
        """Stream one branch (``BranchStart``: which, and from where)."""

    @abc.abstractmethod
    async def _cancel(self, branch: BranchId) -> None:
        """Abort the branch's request on the engine."""

    async def _prompt_tokens(self, prompt: Prompt) -> int:
        return len(prompt) if not isinstance(prompt, str) else max(1, len(prompt.split()))

    # ------------------------------------------------------------- contract

    async def prefill(self, request_id: str, prompt: Prompt, sampling: SamplingSettings) -> int:
        self._ledger.check_prefill(request_id)
        tokens = await self._prompt_tokens(prompt)
        # The engine prefills with the first branch; its prefix cache serves the rest.
        self._ledger.prefill(request_id, tokens, sampling, HeldPrompt(prompt))
        return tokens

    async def start_branches(self, request_id: str, branches: Sequence[BranchSpec]) -> None:
        prefix = self._ledger.check_start(request_id, branches)
        opened: list[tuple[BranchSpec, BranchStream]] = []
        try:
            for spec in branches:
                bid = BranchId(request_id, spec.index)
                parent = None if spec.parent is None else BranchId(request_id, spec.parent)
                if spec.resume:  # a new request for prompt + its own tokens, as a fork's
                    inherited = list(self._ledger.paused[bid].generated)
                else:
                    inherited = [] if parent is None else list(self._streams[parent].generated)
                stream = BranchStream(generated=inherited, reported=len(inherited))
                start = BranchStart(
                    bid,
                    prefix.data.prompt,
                    prefix.sampling,
                    spec.seed,
                    parent,
                    tuple(inherited),
                    resume=spec.resume,
                )
                chunks = self._open(start)
                stream.task = asyncio.ensure_future(self._pump(stream, chunks))
                opened.append((spec, stream))
        except Exception as exc:
            # All or nothing: a start that fails has no effect, so the streams
            # opened before the failing one are stopped (the scheduler never
            # learns of them and would not abort them).
            for spec, stream in opened:
                await self._stop(BranchId(request_id, spec.index), stream)
            if isinstance(exc, EngineError):
                raise
            raise EngineError(
                f"starting branches of {request_id!r} failed: {exc!r}", [request_id]
            ) from exc
        # No await since the check: the ledger records exactly what was opened.
        self._ledger.start(request_id, opened)

    async def step(self, max_steps: int, until_first_end: bool = False) -> StepOutput:
        streams = dict(self._streams)
        if not streams:
            self._interrupted = False
            return StepOutput(steps=0, deltas={})
        if self.per_request_steps:
            return await self._per_request(streams, max_steps, until_first_end)
        streams, steps = await self._wait_for(
            streams, lambda live: horizon(live.values(), max_steps, until_first_end)
        )
        return StepOutput(steps=steps, deltas=self._take(streams, steps))

    async def _wait_for(
        self,
        streams: dict[BranchId, BranchStream],
        ready: Callable[[dict[BranchId, BranchStream]], _T | None],
    ) -> tuple[dict[BranchId, BranchStream], _T]:
        """Wait for news until ``ready(streams)`` is not ``None``; return the streams
        still live then and what ``ready`` said. A stream that failed fails the call."""
        self._news = news = asyncio.Event()
        while True:
            # A branch aborted while this call waits (a task of the same loop may abort)
            # is no longer waited for, nor reported.
            streams = {bid: s for bid, s in streams.items() if bid in self._streams}
            errors = [bid for bid, s in streams.items() if s.error is not None]
            if errors:
                raise self._failure(errors[0], streams[errors[0]])
            got = ready(streams)
            if got is not None:
                return streams, got
            # Single-threaded: no pump runs between the check above and this wait.
            news.clear()
            await news.wait()

    def interrupt(self) -> None:
        """With ``per_request_steps``: make the ``step`` in flight (or, if none is, the
        next one) return now, each request reporting the steps all its branches have
        made (none, if one of them has made none). A server calls it when a request
        arrives for a free slot, so that it starts without waiting for an end."""
        self._interrupted = True
        self._tell()

    async def abort(self, branch_ids: Sequence[BranchId]) -> None:
        streams = self._ledger.abort(branch_ids)
        await asyncio.gather(*(self._stop(bid, stream) for bid, stream in streams.items()))

    async def pause(self, branch_ids: Sequence[BranchId]) -> None:
        """Cancel these branches' streams, keeping the token ids they reported (tokens
        buffered but not reported are dropped: the scheduler never saw them). A branch
        whose ids the engine never gave (a server that streams text only) cannot resume
        exactly: its request fails (``EngineError``) and nothing is paused."""
        for bid in branch_ids:
            stream = self._streams.get(bid)
            if stream is not None and len(stream.generated) != stream.reported:
                raise EngineError(
                    f"pause of branch {bid}: its token ids are unknown, it cannot resume",
                    [bid.request_id],
                )
        streams = self._ledger.pause(
            list(branch_ids), keep=lambda s: BranchStream(generated=list(s.generated))
        )
        await asyncio.gather(*(self._stop(bid, stream) for bid, stream in streams.items()))

    async def release_prefix(self, request_id: str) -> None:
        streams = self._ledger.release(request_id)  # with its branches still live
        await asyncio.gather(*(self._stop(bid, stream) for bid, stream in streams.items()))

    def stats(self) -> EngineStats:
        return EngineStats(
            live_branches=len(self._streams), kv_tokens=self._ledger.kv_tokens(_generated)
        )

    # -------------------------------------------------------------- helpers

    def _branch_input(
        self, branch: BranchId, prefix_tokens: Sequence[int]
    ) -> tuple[list[int], int]:
        """A branch's prompt ids and ``max_tokens`` (held by ``_hold_prompt``); a fork
        sends the prompt + its parent's tokens and has that many tokens fewer."""
        held = self._ledger.prefixes[branch.request_id].data
        return [*held.ids, *prefix_tokens], max(1, held.max_tokens - len(prefix_tokens))

    def _hold_prompt(
        self,
        request_id: str,
        prompt: Prompt,
        sampling: SamplingSettings,
        ids: list[int],
        context_len: int | None,
        context: str,
    ) -> int:
        """``prefill`` for adapters that send the prompt as token ids: keep the ids
        and ``max_tokens`` capped so that prompt + output fit ``context_len``
        (the engine prefills with the first branch; its prefix cache serves the
        others). A prompt that leaves no room fails its request."""
        self._ledger.check_prefill(request_id)
        max_tokens = cap_max_tokens(request_id, len(ids), sampling.max_tokens, context_len, context)
        self._ledger.prefill(
            request_id, len(ids), sampling, HeldPrompt(prompt, tuple(ids), max_tokens)
        )
        return len(ids)

    async def _pump(self, stream: BranchStream, chunks: AsyncIterator[Chunk]) -> None:
        """Move a stream's chunks into its buffer until it ends, fails or is cancelled."""
        try:
            async for chunk in chunks:
                ids: list[int | None] = list(chunk.token_ids) or [None] * chunk.tokens
                if chunk.texts is not None:
                    texts = list(chunk.texts)
                else:
                    texts = [chunk.text] + [""] * (len(ids) - 1) if ids else []
                if chunk.logprobs and len(chunk.logprobs) != len(ids):
                    # Zipped below, a mismatch would drop tokens without a word.
                    raise EngineError(
                        f"a chunk of {len(ids)} tokens came with {len(chunk.logprobs)} logprobs"
                    )
                lps: list[TokenLogprobs | None] = list(chunk.logprobs) or [None] * len(ids)
                stream.pending.extend(zip(ids, texts, lps))
                if chunk.finish is not None:
                    stream.finish = chunk.finish
                    stream.stop_reason = chunk.stop_reason
                self._tell()
                if chunk.finish is not None:
                    return
            if stream.finish is None:  # the stream stopped without saying why
                stream.finish = FinishReason.STOP
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # any stream failure fails its request
            stream.error = exc
        finally:
            self._tell()

    def _tell(self) -> None:
        """Wake the ``step`` waiting for news, if one is."""
        if self._news is not None:
            self._news.set()

    async def _per_request(
        self, streams: dict[BranchId, BranchStream], max_steps: int, until_first_end: bool
    ) -> StepOutput:
        """``step`` with lockstep within each request only (``per_request_steps``)."""

        def plan(live: dict[BranchId, BranchStream]) -> tuple[_Groups, dict[str, int]] | None:
            groups: _Groups = {}
            for bid, stream in live.items():
                groups.setdefault(bid.request_id, {})[bid] = stream
            reach = {
                rid: request_reach(group.values(), max_steps, until_first_end)
                for rid, group in groups.items()
            }
            every = self.report_every
            due = any(
                done or (rid in every and steps >= every[rid])
                for rid, (steps, done) in reach.items()
            )
            if self._interrupted or not reach or due:
                return groups, {rid: steps for rid, (steps, _) in reach.items()}
            return None

        _, (groups, advanced) = await self._wait_for(streams, plan)
        self._interrupted = False
        deltas: dict[BranchId, BranchDelta] = {}
        for rid, group in groups.items():
            taken = self._take(group, advanced[rid])
            deltas.update((b, d) for b, d in taken.items() if d.new_tokens or d.finish)
        return StepOutput(
            steps=max(advanced.values(), default=0), deltas=deltas, request_steps=advanced
        )

    def _take(
        self, streams: dict[BranchId, BranchStream], steps: int
    ) -> dict[BranchId, BranchDelta]:
        deltas = {}
        for bid, stream in streams.items():
            taken, stream.pending = stream.pending[:steps], stream.pending[steps:]
            ends = stream.finish is not None and not stream.pending
            ids = [t for t, _, _ in taken if t is not None]
            stream.generated.extend(ids)
            stream.reported += len(taken)
            deltas[bid] = BranchDelta(
                new_tokens=len(taken),
                text="".join(text for _, text, _ in taken),
                finish=stream.finish if ends else None,
                end_offset=len(taken) if ends else None,
                token_ids=tuple(ids),
                logprobs=tuple(lp for _, _, lp in taken if lp is not None),
                stop_reason=stream.stop_reason if ends else None,
            )
            if ends:
                self._forget(bid)
        return deltas

    async def _stop(self, bid: BranchId, stream: BranchStream | None = None) -> None:
        """Forget a branch and cancel its stream on the engine if it still runs
        (``stream``: one the ledger no longer or not yet holds)."""
        forgotten = self._forget(bid)
        stream = forgotten if forgotten is not None else stream
        if stream is not None and stream.task is not None and not stream.task.done():
            stream.task.cancel()
            await self._cancel(bid)

    def _forget(self, bid: BranchId) -> BranchStream | None:
        """Take a branch out of the books, if it is still there (adapters extend it to
        drop their own state of the branch)."""
        return self._ledger.end(bid) if bid in self._streams else None

    def _failure(self, bid: BranchId, stream: BranchStream) -> EngineError:
        if isinstance(stream.error, RequestRefused):  # the server's no to what it asks
            error = stream.error
            return RequestRefused(f"branch {bid}: {error}", [bid.request_id], field=error.field)
        return EngineError(f"stream of branch {bid} failed: {stream.error!r}", [bid.request_id])


_Groups = dict[str, dict[BranchId, BranchStream]]
"""Live branches' streams by request."""


def _generated(stream: BranchStream) -> int:
    """A branch's own KV tokens: those reported so far (a fork's inherited ones included)."""
    return len(stream.generated)
