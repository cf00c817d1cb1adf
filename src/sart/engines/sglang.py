"""``SGLangEngine``: sart's streaming engine over SGLang's in-process ``sglang.Engine``.

One SGLang request per branch, streamed with ``Engine.async_generate(...,
stream=True, rid=...)``; ``StreamingEngine`` turns the streams into the step
contract (``step(k)`` returns once every live branch has produced ``k`` more
tokens or ended; tokens a stream produced beyond are buffered). SGLang keeps
decoding between two ``step`` calls, while sart scores branches.

Requests. ``prefill`` tokenizes the prompt once (token-id prompts are used as
they are; text goes through the engine's tokenizer, special tokens added, or,
with ``chat=True``, the chat template as one user message with a generation
prompt) and every branch is sent as ``input_ids``. Token-id prompts with an id
outside the model's vocabulary fail their request at ``prefill``: SGLang
(0.5.23) does not check ids, and one out of range crashes its scheduler
(``IndexError`` in the embedding) and the engine with every other request.

Prefix sharing. SGLang's radix cache shares the prompt's KV between the
branches of a request: the first branch computes it, the others (and forks)
match it in the tree; nothing in sart copies it. For that the adapter sends a
request's first branch alone and its other branches once SGLang has streamed
the first one's first token (its prompt is in the tree by then); they start
one decode step later. Sent together they would each prefill the whole
prompt: SGLang's default ``schedule_policy="fcfs"`` does no in-batch prefix
matching, and ``"lpm"`` does it only for prefixes of 32 tokens or more. A fork
(``BranchSpec(parent=j)``, for Rebase) is a new request whose ``input_ids``
are the prompt plus the parent's generated token ids, with ``max_new_tokens``
reduced by those tokens; the radix cache serves the shared prefix.

Sampling and log-probabilities: how sart's settings become SGLang's request
fields and what SGLang's log-probabilities measure is ``sart.engines.sglang_wire``.

Request ids. Each branch's ``rid`` is ``f"{rid_prefix}-{len(name)}:{name}"``
with ``name = f"{index}_{request_id}"`` (vLLM's naming of parallel-sampling
children) and a per-adapter random ``rid_prefix``. SGLang aborts every request
whose rid *starts with* the rid it is given (the scheduler matches
``req.rid.startswith(recv_req.rid)``), so plain ``"1_q"`` would also abort
``"1_q1"``; the length field makes the rids of one adapter prefix-free. A
paused branch that resumes gets a new rid (``name = f"{index}_{request_id}~{k}"``
at its ``k``-th resume): SGLang aborts asynchronously, and a resume under the
old rid can reach it before the abort has cleared that rid ("Duplicate request
ID detected").

Streams. SGLang streams cumulative chunks by default (``text`` and
``output_ids`` hold everything so far) and deltas with the server argument
``incremental_streaming_output=True`` (``stream_output`` in older releases);
the adapter reads that setting from ``engine.server_args`` (or
``incremental=``) and turns either into new tokens. ``meta_info["finish_reason"]``
``{"type": "stop", ...}`` ends a branch as ``FINISHED``, ``{"type": "length"}``
as ``TRUNCATED``; any other reason (``"abort"``: SGLang refused or dropped the
request, e.g. out of memory, a prompt too long, a server-side abort) fails the
branch's request with SGLang's message, as does an exception from the stream:
the next ``step`` raises ``EngineError`` naming that request; other requests
carry on.

Abort. Pruning, early stopping and ``release_prefix`` cancel the branch's
stream and call ``engine.tokenizer_manager.abort_request(rid=...)``, the call
behind SGLang's own ``/abort_request`` endpoint (``sglang.Engine`` has no abort
method of its own): the scheduler drops the request from its waiting queue or
running batch and frees its KV (the radix cache keeps the shared prefix).

Event loop. SGLang's ``TokenizerManager`` starts its output loop on the event
loop running at the first ``async_generate``; every later call must run on
that loop. ``sglang.Engine`` keeps one in ``engine.loop`` (its synchronous
``generate`` runs there), so under the synchronous driver (and in
``check_engine``) use ``SGLangEngine.bridge()``, a ``SyncBridge`` on that loop,
rather than ``SyncBridge(...)``, which would start a new loop each time. Under
the ``AsyncDriver``, build the ``sglang.Engine`` inside the coroutine that runs
the driver (``Engine()`` then adopts the running loop).

Concurrency: set SGLang's ``max_running_requests`` to at least sart's
``batch_size`` so that sart's branch budget, not SGLang's queue, decides
admission (``check_batch_size``). Multi-GPU is SGLang's: ``from_args`` passes
``tp_size``, ``dp_size``, ``mem_fraction_static``, ``max_running_requests`` and
every other ``ServerArgs`` field through. Speculative decoding or
``stream_interval`` > 1 make one chunk carry several tokens; the step
contract's token counts still hold, but a chunk boundary may fall inside one
of SGLang's steps.

Needs the ``[sglang]`` extra: importing this module without ``sglang``
raises ``MissingDependencyError``. Wrapping an engine you built does not
import ``sglang`` itself; ``from_args`` does. Tested in CI against SGLang
0.5.23 itself, on its CPU path (``SGLANG_USE_CPU_ENGINE=1``,
``scripts/sglang_cpu_env.sh``; see ``docs/how-to/sglang.md``), and against a
stand-in that follows its signatures. Earlier 0.5.x releases from 0.5.3 on
(``sampling_seed`` and ``incremental_streaming_output`` appeared around then)
use the same calls but are not tested. Written against SGLang's source
(``python/sglang/srt/entrypoints/engine.py``: ``Engine(**server_args)``,
``Engine.async_generate``, ``Engine.loop``, ``Engine.server_args``,
``Engine.shutdown``; ``python/sglang/srt/managers/tokenizer_manager.py``:
``abort_request``, ``tokenizer``, ``context_len``, ``model_config``, the
streamed chunk format; ``python/sglang/srt/sampling/sampling_params.py``:
sampling parameter names).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from sart.errors import (
    ConfigError,
    EngineError,
    MissingDependencyError,
    install_hint,
    needs_extra,
)

_WHAT = "the SGLang engine"

if importlib.util.find_spec("sglang") is None:
    raise MissingDependencyError(
        f"{_WHAT} needs sglang: {install_hint('sglang')} (the module 'sglang' is not installed)"
    )

from sart.engines import sglang_wire as wire  # noqa: E402
from sart.engines.base import TokenLogprobs  # noqa: E402
from sart.engines.prompts import check_vocabulary, prompt_ids  # noqa: E402
from sart.engines.sglang_launch import start_engine  # noqa: E402
from sart.engines.streaming import BranchStart, Chunk, StreamingEngine  # noqa: E402
from sart.engines.sync_bridge import SyncBridge  # noqa: E402
from sart.types import EXTRA_SAMPLING, BranchId, Prompt, SamplingSettings  # noqa: E402


def _import_sglang() -> Any:
    with needs_extra(_WHAT, "sglang"):
        import sglang
    return sglang


def _incremental(server_args: Any) -> bool:
    """Whether SGLang streams deltas (``True``) or cumulative chunks (``False``)."""
    for name in ("incremental_streaming_output", "stream_output"):  # current, older name
        value = getattr(server_args, name, None)
        if isinstance(value, bool):
            return value
    return False


async def _close(stream: Any) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        try:
            await aclose()
        except Exception:  # the request has ended; closing is best effort
            pass


class SGLangEngine(StreamingEngine):
    """A streaming engine over an in-process ``sglang.Engine`` (see the module docstring).

    ``engine``: a built ``sglang.Engine`` (or any object with its
    ``async_generate`` and ``tokenizer_manager.abort_request``). ``tokenizer``:
    for text prompts; default the engine's (``engine.tokenizer_manager.tokenizer``).
    ``chat``: wrap text prompts with the chat template. ``incremental``: how
    SGLang streams (default: read from ``engine.server_args``). ``rid_prefix``:
    start of every rid this adapter sends (default ``"sart-"`` + 8 random hex
    digits; give two adapters on one engine prefixes neither of which starts
    the other).
    """

    supports_fork = True
    sampling_fields = frozenset(EXTRA_SAMPLING)

    def __init__(
        self,
        engine: Any,
        tokenizer: Any = None,
        *,
        chat: bool = False,
        incremental: bool | None = None,
        rid_prefix: str | None = None,
    ) -> None:
        super().__init__()
        self.engine = engine
        manager = getattr(engine, "tokenizer_manager", None)
        self.tokenizer = tokenizer if tokenizer is not None else getattr(manager, "tokenizer", None)
        self.chat = chat
        server_args = getattr(engine, "server_args", None)
        self.incremental = _incremental(server_args) if incremental is None else incremental
        self.rid_prefix = rid_prefix if rid_prefix is not None else f"sart-{uuid.uuid4().hex[:8]}"
        context = getattr(manager, "context_len", None)
        self.context_len: int | None = context if isinstance(context, int) else None
        """The model's context length (prompt + generated tokens), if SGLang says."""
        vocab = getattr(getattr(manager, "model_config", None), "vocab_size", None)
        self.vocab_size: int | None = vocab if isinstance(vocab, int) else None
        """The model's vocabulary size, if SGLang says: prompt ids must lie below it."""
        running = getattr(server_args, "max_running_requests", None)
        self.max_running_requests: int | None = running if isinstance(running, int) else None
        """SGLang's cap on running requests, if set explicitly (else SGLang sizes it)."""
        self._prompt_cached: dict[str, asyncio.Event] = {}
        """Per request: set once its first branch's prompt is in SGLang's radix cache."""
        self._resumes: dict[str, dict[int, int]] = {}
        """Per request, per branch index: how many times the branch resumed (its rid)."""

    @classmethod
    def from_args(
        cls,
        model_path: str,
        *,
        tokenizer: Any = None,
        chat: bool = False,
        rid_prefix: str | None = None,
        **server_args: Any,
    ) -> SGLangEngine:
        """Build ``sglang.Engine(model_path=model_path, **server_args)`` and wrap it.

        Every ``ServerArgs`` field passes through: ``tp_size``, ``dp_size``,
        ``mem_fraction_static``, ``max_running_requests`` (set it to at least
        sart's ``batch_size``), ``enable_deterministic_inference`` (makes seeds
        reproducible), ``incremental_streaming_output``, ``attention_backend``,
        ``context_length``, ``random_seed``... Call it in the coroutine that
        will run the ``AsyncDriver``, or at top level and then use ``bridge()``.
        SGLang starts its scheduler in child processes: scripts need an
        ``if __name__ == "__main__":`` guard.
        """
        sglang = _import_sglang()
        # Keys, choices and a failing child checked; sart's logging kept (sglang_launch).
        engine = start_engine(sglang, model_path, server_args)
        return cls(engine, tokenizer, chat=chat, rid_prefix=rid_prefix)

    def bridge(self) -> SyncBridge:
        """A ``SyncBridge`` for the synchronous driver, on ``engine.loop`` when the
        engine has one (every call to one SGLang engine must use one loop)."""
        loop = getattr(self.engine, "loop", None)
        if not isinstance(loop, asyncio.AbstractEventLoop) or loop.is_closed():
            loop = None
        # On engine.loop the bridge is a guest: close() leaves the loop to sglang.Engine.
        return SyncBridge(self) if loop is None else SyncBridge(self, loop=loop)

    # ------------------------------------------------------------- contract

    async def prefill(self, request_id: str, prompt: Prompt, sampling: SamplingSettings) -> int:
        ids = self._prompt_ids(request_id, prompt)
        # SGLang does not check them itself: its scheduler crashes on one outside.
        check_vocabulary(request_id, ids, self.vocab_size, "the model's vocabulary")
        return self._hold_prompt(
            request_id,
            prompt,
            sampling,
            ids,
            self.context_len,
            f"SGLang's context length {self.context_len}",
        )

    async def _open(self, start: BranchStart) -> AsyncIterator[Chunk]:
        branch, sampling, parent = start.branch, start.sampling, start.parent
        ids, max_tokens = self._branch_input(branch, start.prefix_tokens)
        if start.resume:  # a new rid: see "Request ids" above
            resumes = self._resumes.setdefault(branch.request_id, {})
            resumes[branch.index] = resumes.get(branch.index, 0) + 1
        rid = self.rid(branch)
        params = self.sampling_params(sampling, start.seed, max_tokens)
        cached = self._prompt_cached.get(branch.request_id)
        first = parent is None and cached is None
        if first:  # this branch prefills the prompt; the others wait for it
            cached = self._prompt_cached[branch.request_id] = asyncio.Event()
        elif parent is None and cached is not None:
            await cached.wait()
        try:
            stream = await self.engine.async_generate(
                input_ids=ids,
                sampling_params=params,
                stream=True,
                rid=rid,
                **self.logprob_args(sampling),
            )
            chunks = self._chunks(
                branch,
                rid,
                stream,
                cached if first else None,
                sampling.logprobs,
                sampling.stop_token_ids,
            )
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    yield chunk
        finally:
            if first and cached is not None:
                cached.set()  # also when the first branch ended or failed before a token

    async def _chunks(
        self,
        branch: BranchId,
        rid: str,
        stream: Any,
        cached: asyncio.Event | None,
        top_k: int | None = None,
        stop_token_ids: tuple[int, ...] = (),
    ) -> AsyncGenerator[Chunk, None]:
        """SGLang's chunks of one branch as ``Chunk``s (``cached``: set at the first;
        ``top_k``: the request's ``logprobs``, ``None`` if it asked for none;
        ``stop_token_ids``: the request's, told apart from EOS in ``stop_reason``)."""
        seen_ids = seen_text = 0
        carry = ""  # text that came without a new token, for the next token
        async for out in stream:
            if cached is not None:
                cached.set()  # SGLang streams a token only after the prompt's prefill
            # Read the whole chunk before the next await: in cumulative mode SGLang
            # hands out its live lists (output_ids, the logprobs), which grow.
            token_ids = list(out.get("output_ids") or ())
            text = out.get("text") or ""
            start = 0  # where the new tokens start in the chunk's per-token lists
            if not self.incremental:  # cumulative: everything so far
                start = seen_ids
                token_ids, seen_ids = token_ids[seen_ids:], len(token_ids)
                text, seen_text = text[seen_text:], len(text)
            meta = out.get("meta_info") or {}
            logprobs: tuple[TokenLogprobs, ...] = ()
            if top_k is not None and token_ids:
                try:
                    logprobs = wire.token_logprobs(branch, meta, start, len(token_ids), top_k)
                except wire.SGLangRequestError:
                    await _close(stream)  # SGLang aborts a request whose stream is closed
                    raise
            finish = wire.finish_reason(branch, rid, meta.get("finish_reason"))
            carry += text
            if finish is not None:  # the last chunk: let go of SGLang's generator now
                await _close(stream)
            if token_ids or finish is not None:
                reason = meta.get("finish_reason") if finish is not None else None
                yield Chunk(
                    token_ids=tuple(token_ids),
                    text=carry,
                    finish=finish,
                    logprobs=logprobs,
                    stop_reason=wire.stop_reason(reason, stop_token_ids),
                )
                carry = ""

    async def release_prefix(self, request_id: str) -> None:
        try:
            await super().release_prefix(request_id)
        finally:
            self._prompt_cached.pop(request_id, None)
            self._resumes.pop(request_id, None)

    async def _cancel(self, branch: BranchId) -> None:
        rid = self.rid(branch)
        try:
            self.engine.tokenizer_manager.abort_request(rid=rid)
        except Exception as exc:
            raise EngineError(
                f"SGLang could not abort {rid!r} (branch {branch}): {exc!r}", [branch.request_id]
            ) from exc

    # ---------------------------------------------------------------- extras

    def rid(self, branch: BranchId) -> str:
        """The SGLang request id of ``branch``'s current stream (prefix-free among this
        adapter's; a new one at each resume)."""
        resumes = self._resumes.get(branch.request_id, {}).get(branch.index, 0)
        name = str(branch) if resumes == 0 else f"{branch}~{resumes}"
        return f"{self.rid_prefix}-{len(name)}:{name}"

    sampling_params = staticmethod(wire.sampling_params)
    logprob_args = staticmethod(wire.logprob_args)

    def check_batch_size(self, batch_size: int) -> None:
        """Raise ``ConfigError`` if SGLang's ``max_running_requests`` is set below
        ``batch_size`` (unset: SGLang sizes it from memory, which is not checked)."""
        if self.max_running_requests is not None and batch_size > self.max_running_requests:
            raise ConfigError(
                f"batch_size={batch_size} must be <= SGLang's max_running_requests="
                f"{self.max_running_requests}; build the engine with "
                "max_running_requests >= batch_size"
            )

    def shutdown(self) -> None:
        """Shut SGLang's engine (its scheduler and detokenizer processes) down."""
        self.engine.shutdown()

    # --------------------------------------------------------------- helpers

    def _prompt_ids(self, request_id: str, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str) and self.tokenizer is None:
            raise EngineError(
                f"request {request_id!r}: a text prompt needs a tokenizer, and the SGLang "
                "engine has none (skip_tokenizer_init?); pass tokenizer= or token ids",
                [request_id],
            )
        return prompt_ids(self.tokenizer, prompt, self.chat)
