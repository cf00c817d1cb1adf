"""``PrefixLedger``: the books of held prompts and live branches that every engine adapter keeps.

An engine holds one prefix per request (its prompt) and branches started from
it or forked from a live branch of it (``sart.engines.base`` gives the call
order). Whatever the engine, the same calls must be refused; the ledger makes
each check once, for ``FakeEngine``, ``HFEngine``, ``VLLMEngine`` and
``StreamingEngine`` (and through it vLLM's ``AsyncLLM``, SGLang and OpenAI
servers):

- ``prefill`` of a request whose prefix is already held;
- ``start_branches`` for a request with no prefix, of a branch index started
  before (live or ended) or twice in one call, or forking a parent that is
  not live (a fork's parent must be live before the call);
- ``abort`` (or ``pause``) of a branch that is not live, or of one branch twice in
  one call;
- a ``resume`` start of a branch that is not paused;
- ``release_prefix`` of a request with no prefix (strict mode: or while
  branches of it are live).

Each transition comes in two parts: ``check_*`` raises and changes nothing,
so an adapter can check before it does engine work that may fail, and the
transition itself (``prefill``, ``start``, ``abort``, ``release``) checks
again and records the change, so the ledger never accepts an invalid one,
whoever calls it. A refused call changes nothing. The adapter keeps its
engine state as payloads: a prefix's ``data`` (HF's prompt KV, vLLM's token
ids) and each live branch's payload (the fake's script position, HF's KV
tensors, a stream), which the ledger hands back when the branch leaves.

Two modes, because adapters answer misuse in two ways:

- lenient (default; the real engines): a refused call raises ``EngineError``
  naming its request, so the driver fails that request only and goes on;
  ``release`` ends the branches still live and hands them back to be freed;
- strict (``FakeEngine``): a refused call raises ``EngineMisuse``, an
  ``AssertionError`` (a bug in the caller: the driver lets it through), and
  ``release`` refuses while branches are live.

An engine may end a branch for a reason of its own (vLLM aborting it, a
lost request): ``lose`` takes it out of the live set but keeps it abortable
until the caller aborts it or releases its prefix, since the caller still
believes it live. Pure Python: no torch, no engine.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Generic, TypeVar

import attrs

from sart.engines.base import BranchSpec
from sart.errors import EngineError, EngineMisuse, RequestRefused
from sart.types import BranchId, SamplingSettings

P = TypeVar("P")
"""A prefix's adapter data."""
B = TypeVar("B")
"""A live branch's adapter payload."""


@attrs.frozen
class Prefix(Generic[P]):
    """A held prompt."""

    tokens: int
    """Its length in tokens (its KV, shared by the request's branches)."""
    sampling: SamplingSettings
    data: P
    """The adapter's own (prompt KV, token ids, ...)."""


@attrs.define
class _Books:
    """One request's branch indices; its live payloads are in ``PrefixLedger._branches``."""

    started: set[int] = attrs.Factory(set)
    """Every index ever started (an index is never reused, even after it ended)."""
    live: set[int] = attrs.Factory(set)
    lost: set[int] = attrs.Factory(set)
    """Ended by the engine itself, not yet aborted by the caller."""
    paused: set[int] = attrs.Factory(set)
    """Paused (``pause``): not live, their payloads kept for a ``resume`` start."""


def cap_max_tokens(
    request_id: str, prompt_tokens: int, max_tokens: int, context_len: int | None, context: str
) -> int:
    """``max_tokens`` capped so that prompt + output fit ``context_len`` (``None``: no
    cap). An empty prompt, or one that leaves no room, fails its request
    (``EngineError``); ``context`` names the limit in the message."""
    room = max_tokens if context_len is None else context_len - prompt_tokens
    if prompt_tokens < 1 or room < 1:
        raise RequestRefused(
            f"request {request_id!r}: a prompt of {prompt_tokens} tokens leaves no room in "
            f"{context}",
            [request_id],
            field="prompt",
        )
    return min(max_tokens, room)


class PrefixLedger(Generic[P, B]):
    """Prefixes and branches held by one engine adapter (see the module docstring)."""

    def __init__(self, *, strict: bool = False) -> None:
        self.strict = strict
        self._prefixes: dict[str, Prefix[P]] = {}
        self._books: dict[str, _Books] = {}
        self._branches: dict[BranchId, B] = {}
        self._paused: dict[BranchId, B] = {}
        # Read-only views: state changes only through the transitions below.
        self.prefixes: Mapping[str, Prefix[P]] = MappingProxyType(self._prefixes)
        """Held prefixes by request id."""
        self.branches: Mapping[BranchId, B] = MappingProxyType(self._branches)
        """Live branches' payloads (lost ones excluded)."""
        self.paused: Mapping[BranchId, B] = MappingProxyType(self._paused)
        """Paused branches' payloads, kept for their ``resume``."""

    # ------------------------------------------------------------- queries

    def started(self, request_id: str) -> frozenset[int]:
        """Indices ever started for a held request (empty if it holds no prefix)."""
        books = self._books.get(request_id)
        return frozenset(books.started) if books else frozenset()

    def live(self, request_id: str) -> list[BranchId]:
        """A request's live branches, by index."""
        books = self._books.get(request_id)
        return [BranchId(request_id, j) for j in sorted(books.live)] if books else []

    def lost(self, request_id: str) -> list[BranchId]:
        """A request's branches the engine ended itself and the caller has not aborted."""
        books = self._books.get(request_id)
        return [BranchId(request_id, j) for j in sorted(books.lost)] if books else []

    def kv_tokens(self, generated: Callable[[B], int]) -> int:
        """KV tokens held: every prompt once plus ``generated(payload)`` per live branch."""
        prompts = sum(p.tokens for p in self._prefixes.values())
        return prompts + sum(generated(b) for b in self._branches.values())

    def usage(self, request_id: str, generated: Callable[[B], int]) -> tuple[int, int]:
        """``(live branches, KV tokens)`` held by one request (0, 0 if it holds nothing)."""
        prefix = self._prefixes.get(request_id)
        if prefix is None:
            return (0, 0)
        live = [self._branches[bid] for bid in self.live(request_id)]
        return (len(live), prefix.tokens + sum(generated(b) for b in live))

    # --------------------------------------------------------- transitions

    def check_prefill(self, request_id: str) -> None:
        if request_id in self._prefixes:
            raise self._refuse(
                f"prefill of {request_id!r}, whose prefix is already held", request_id
            )

    def prefill(
        self, request_id: str, tokens: int, sampling: SamplingSettings, data: P
    ) -> Prefix[P]:
        """Hold a request's prompt of ``tokens`` tokens."""
        self.check_prefill(request_id)
        prefix = Prefix(tokens, sampling, data)
        self._prefixes[request_id] = prefix
        self._books[request_id] = _Books()
        return prefix

    def check_start(self, request_id: str, branches: Sequence[BranchSpec]) -> Prefix[P]:
        """Refuse the start unless it is valid; return the request's prefix."""
        prefix = self._prefixes.get(request_id)
        if prefix is None:
            raise self._refuse(
                f"start_branches for {request_id!r}, which has no prefix", request_id
            )
        books = self._books[request_id]
        indices = [spec.index for spec in branches]
        # Twice in one call is refused like a restart: the second would orphan the first.
        # A paused branch is started again only as a resume, and must be paused to resume.
        fresh = [spec.index for spec in branches if not spec.resume]
        twice = books.started.intersection(fresh)
        twice.update(j for j, n in Counter(indices).items() if n > 1)
        for spec in branches:
            if spec.resume and spec.index not in books.paused:
                branch = BranchId(request_id, spec.index)
                raise self._refuse(f"resume of branch {branch}, which is not paused", request_id)
        if twice:
            raise self._refuse(
                f"branches {sorted(twice)} of {request_id!r} started twice", request_id
            )
        for spec in branches:
            if spec.parent is not None and spec.parent not in books.live:
                parent = BranchId(request_id, spec.parent)
                raise self._refuse(f"fork from branch {parent}, which is not live", request_id)
        return prefix

    def start(self, request_id: str, branches: Sequence[tuple[BranchSpec, B]]) -> None:
        """Record these branches live (all of them, or none and it raises), each with its
        payload; call it once the engine has started them."""
        self.check_start(request_id, [spec for spec, _ in branches])
        books = self._books[request_id]
        for spec, payload in branches:
            books.started.add(spec.index)
            books.live.add(spec.index)
            if spec.resume:
                books.paused.discard(spec.index)
                del self._paused[BranchId(request_id, spec.index)]
            self._branches[BranchId(request_id, spec.index)] = payload

    def end(self, branch: BranchId) -> B:
        """The branch ended (finished on the engine); return its payload. Only for live
        branches (``KeyError`` otherwise: a bug in the adapter, not in its caller)."""
        payload = self._branches.pop(branch)
        self._books[branch.request_id].live.discard(branch.index)
        return payload

    def lose(self, branch: BranchId) -> B:
        """The engine ended the branch for a reason of its own: it is no longer live,
        but the caller may still abort it (until it releases the prefix)."""
        payload = self.end(branch)
        self._books[branch.request_id].lost.add(branch.index)
        return payload

    def check_abort(self, branches: Iterable[BranchId]) -> list[BranchId]:
        """Refuse the abort unless every branch is live or lost; return the live ones."""
        seen: dict[BranchId, None] = {}  # ordered, for the engine calls that follow
        for bid in branches:
            books = self._books.get(bid.request_id)
            if books is None or not (bid.index in books.live or bid.index in books.lost):
                raise self._refuse(f"abort of branch {bid}, which is not live", bid.request_id)
            if bid in seen:
                raise self._refuse(f"abort of branch {bid} twice in one call", bid.request_id)
            seen[bid] = None
        return [bid for bid in seen if bid in self._branches]

    def abort(self, branches: Sequence[BranchId]) -> dict[BranchId, B]:
        """End these branches now (lost ones are forgotten); return the live ones' payloads."""
        self.check_abort(branches)
        ended = {}
        for bid in branches:
            if bid in self._branches:
                ended[bid] = self.end(bid)
            else:
                self._books[bid.request_id].lost.discard(bid.index)
        return ended

    def pause(self, branches: Sequence[BranchId], keep: Callable[[B], B]) -> dict[BranchId, B]:
        """Pause these live branches: they leave the live set (the adapter frees their KV)
        and ``keep(payload)`` (what a resume needs: their tokens, a script position) is
        held until their ``resume`` start or the prefix's release. Returns the live
        payloads, for the adapter to free."""
        for bid in branches:
            books = self._books.get(bid.request_id)
            if books is None or bid.index not in books.live:
                raise self._refuse(f"pause of branch {bid}, which is not live", bid.request_id)
        if len(set(branches)) != len(branches):
            twice = sorted({b for b in branches if branches.count(b) > 1})
            raise self._refuse(f"pause of branches {twice} twice in one call", twice[0].request_id)
        ended = {}
        for bid in branches:
            ended[bid] = payload = self.end(bid)
            self._books[bid.request_id].paused.add(bid.index)
            self._paused[bid] = keep(payload)
        return ended

    def check_release(self, request_id: str) -> list[BranchId]:
        """Refuse the release unless it is valid; return the request's live branches."""
        if request_id not in self._prefixes:
            raise self._refuse(f"release_prefix of {request_id!r}, which has no prefix", request_id)
        live = self.live(request_id)
        if live and self.strict:
            indices = [bid.index for bid in live]
            raise self._refuse(
                f"release_prefix of {request_id!r} while branches {indices} are live", request_id
            )
        return live

    def release(self, request_id: str) -> dict[BranchId, B]:
        """Drop the request's prefix; return the payloads of its branches still live, which
        end now (lenient mode only) for the adapter to free."""
        live = self.check_release(request_id)
        ended = {bid: self._branches.pop(bid) for bid in live}
        for index in self._books[request_id].paused:  # never resumed: nothing left to free
            del self._paused[BranchId(request_id, index)]
        del self._prefixes[request_id], self._books[request_id]
        return ended

    # -------------------------------------------------------------- helpers

    def _refuse(self, message: str, request_id: str) -> Exception:
        if self.strict:
            return EngineMisuse(message)
        return EngineError(message, [request_id])


__all__ = ["EngineMisuse", "Prefix", "PrefixLedger", "cap_max_tokens"]
